// Limits every part checks before it does any work (docs/reliability.md, "Hostile input"), one
// name each.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsa {

/// Largest K (selections per row) a sequence may have: the GPU top-K's (indexer_service/cuda/
/// topk.cu keeps 2 x 1,024 threads' winners in shared memory). The CPU backend takes no more, so
/// where a sequence may run never depends on its K; DeepSeek-V3.2 uses K = 2,048 (DESIGN.md 1).
inline constexpr int kMaxTopK = 2048;

/// Most draft tokens d of a speculative step (DESIGN.md 4.3: MTP drafts of up to 4 tokens).
inline constexpr int kMaxDraftLength = 4;
/// Rows of one sequence in one decode step at most: 1, or the d + 1 verifier rows.
inline constexpr int kMaxStepRows = kMaxDraftLength + 1;

/// Largest serialized message a dsa gRPC peer receives (grpc::ServerBuilder::
/// SetMaxReceiveMessageSize and the clients' channel argument): 64 MiB. An indexer refuses a select
/// whose answer could pass it (RESOURCE_EXHAUSTED naming this limit) before running it.
inline constexpr int kMaxReceiveMessageBytes = 64 << 20;

/// The most bytes a dsa.indexer.v1 SelectResponse's answer to a group of `rows` rows of a
/// sequence with K = `top_k` can take: the selections (int32 [rows, K]), the audit miss rates (a
/// double a row) and the framing of the group's fields (under 80 bytes). A select whose groups'
/// bounds, plus 16 bytes, pass kMaxReceiveMessageBytes is refused before it runs.
/// Rows and K are clamped to [0, 2^32] first (a request's shape may hold any int64; the decode
/// refuses a negative one), so the bound never overflows.
constexpr int64_t SelectResponseBytesBound(int64_t rows, int top_k) {
  constexpr int64_t kGroupFramingBytes = 80;
  constexpr int64_t kClamp = int64_t{1} << 32;
  const int64_t r = rows < 0 ? 0 : (rows > kClamp ? kClamp : rows);
  const int64_t k = top_k < 0 ? 0 : top_k;
  return kGroupFramingBytes + r * (int64_t{4} * k + static_cast<int64_t>(sizeof(double)));
}

/// The bytes a SelectResponse has besides its groups (the request_id), with room to spare.
inline constexpr int64_t kSelectResponseFramingBytes = 16;

/// Largest AppendIndexKeys chunk (serialized message) an indexer worker takes: gRPC's 4 MiB
/// default. A larger one is refused with RESOURCE_EXHAUSTED by the handler, which undoes the call's
/// earlier chunks before the status is sent.
inline constexpr int kMaxAppendChunkBytes = 4 << 20;

/// Longest worker address (host:port, a DNS name and port, or a unix: socket path) a request may
/// name: DNS names are at most 253 bytes and unix socket paths 107, so this leaves room to spare
/// while keeping every error message that quotes an address far below gRPC's 8 KiB metadata limit.
inline constexpr size_t kMaxAddressBytes = 1024;

/// Longest status message a server sends: a longer one is cut (ToGrpcStatus), since a message
/// over gRPC's 8 KiB metadata limit reaches the client as a metadata-size error in its place.
inline constexpr size_t kMaxStatusMessageBytes = 4096;

/// The longest Generate request id and session id (coordinator.proto: 1..128 bytes).
inline constexpr size_t kMaxRequestIdBytes = 128;

}  // namespace dsa
