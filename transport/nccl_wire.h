// The NCCL data plane's wire format (no CUDA, no NCCL here, so it is tested on any machine): how a
// LayerSelectRequest, its LayerSelection and a refusal are laid out in the byte buffers that
// NcclSelectionTransport and NcclSelectionServer stage through device memory for ncclSend/ncclRecv.
//
// Every exchange is a fixed-size header (kWireHeaderBytes, so the receiver can post its ncclRecv
// without knowing anything else), then the payload whose size the header gives:
//   attention -> indexer: request header, request payload (groups, then their tensors);
//   indexer -> attention: one answer message of exactly the request header's response_bytes
//     (a selection or an error header, its payload, zero padding), so the attention side posts
//     its receive at Submit, before the indexer has run anything;
//   attention -> indexer: a close header (no payload) ends the session.
// Multi-byte fields are little-endian; tensors start on 16-byte offsets. Every field is checked on
// decode against WireLimits: a corrupt or truncated message is refused with a status (INTERNAL for
// a broken header, INVALID_ARGUMENT for a bad field or layout, RESOURCE_EXHAUSTED naming the limit
// for an oversized one), never read out of bounds.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/selection_transport.h"

namespace dsa {

/// Bytes of every message header.
inline constexpr int64_t kWireHeaderBytes = 64;
/// "DSAN", little-endian: the first four bytes of every header.
inline constexpr uint32_t kWireMagic = 0x4E415344;
/// Wire format version; a header of another version is refused.
inline constexpr uint16_t kWireVersion = 1;
/// Bytes of an error message carried in an error answer (longer ones are cut).
inline constexpr int64_t kMaxWireErrorMessageBytes = 4096;
/// Each tensor of a payload starts at a multiple of this many bytes.
inline constexpr int64_t kWireAlignment = 16;

/// Sizes both sides check every message against. Both ends of a data plane use the same values
/// (the handshake, OpenDataPlane, settles max_message_bytes and max_top_k).
struct WireLimits {
  /// Largest message, header included, in either direction (bytes, >= 8 KiB).
  int64_t max_message_bytes = int64_t{64} << 20;
  /// Row groups in one request, [1, max_groups].
  int max_groups = 4096;
  /// Rows in one group, [1, max_rows_per_group] (a decode row, or d + 1 verifier rows).
  int max_rows_per_group = 4096;
  /// New index keys in one group, [0, max_new_keys_per_group].
  int64_t max_new_keys_per_group = int64_t{1} << 20;
  /// Largest K of any sequence served: the answer message is sized for it (selections int32
  /// [rows, max_top_k] per group), since the attention side posts its receive before the answer
  /// exists. An answer with a larger K is refused by the indexer with RESOURCE_EXHAUSTED.
  int max_top_k = 2048;
};

/// What a message is.
enum class WireKind : uint16_t {
  kRequest = 1,    // attention -> indexer: a LayerSelectRequest
  kSelection = 2,  // indexer -> attention: the LayerSelection of the request with the same id
  kError = 3,      // indexer -> attention: the request was refused (status, groups applied)
  kClose = 4,      // attention -> indexer: no more requests; the indexer side ends its session
};

/// A decoded header. Fields not used by a kind are 0.
struct WireHeader {
  WireKind kind = WireKind::kRequest;
  uint64_t request_id = 0;
  /// Bytes of the payload that follows (padding of an answer not counted).
  int64_t payload_bytes = 0;
  /// kRequest: bytes of the answer message the sender has posted a receive for (header, payload
  /// and padding): the indexer sends exactly this many.
  int64_t response_bytes = 0;
  int32_t num_groups = 0;      // kRequest, kSelection
  int32_t num_heads = 0;       // kRequest: H
  int32_t head_dim = 0;        // kRequest: D
  int32_t status_code = 0;     // kError: an absl::StatusCode, never OK
  int32_t groups_applied = 0;  // kError: leading groups applied before the refusal
};

/// Writes `header` into out[0, kWireHeaderBytes) with its checksum. `out` must hold that many.
void EncodeWireHeader(const WireHeader& header, std::span<uint8_t> out);

/// Reads and checks a header: INTERNAL when `bytes` is shorter than a header, or for a wrong
/// magic, version or checksum (corruption, or a peer out of step); INVALID_ARGUMENT for an unknown
/// kind or a field out of range for its kind (groups, H, D in [1, 1024], status code, sizes);
/// RESOURCE_EXHAUSTED when the payload or the answer would pass limits.max_message_bytes or
/// limits.max_groups (the message names the limit).
absl::StatusOr<WireHeader> DecodeWireHeader(std::span<const uint8_t> bytes,
                                            const WireLimits& limits);

/// The sizes of one request's two messages.
struct WireRequestSizes {
  int64_t payload_bytes = 0;   // the request payload (after its header)
  int64_t response_bytes = 0;  // the answer message (header + largest selection or error)
};

/// Checks `request` against `limits` and sizes its messages. INVALID_ARGUMENT for a shape the wire
/// cannot carry (no groups, H or D outside [1, 1024], num_rows < 1, a negative position or layer,
/// tensors whose sizes do not match num_rows, H and D); RESOURCE_EXHAUSTED (naming the limit) for
/// too many groups, rows or new keys, or a message over max_message_bytes. Finite values and
/// positions against the cache are the indexer's to check (RunLayerSelect).
absl::StatusOr<WireRequestSizes> SizeWireRequest(const LayerSelectRequest& request,
                                                 const WireLimits& limits);

/// Writes the request message (header, then payload) into out[0, kWireHeaderBytes +
/// sizes.payload_bytes). `sizes` must be SizeWireRequest's for `request`.
void PackWireRequest(const LayerSelectRequest& request, uint64_t request_id,
                     const WireRequestSizes& sizes, std::span<uint8_t> out);

/// Decodes a request payload (the bytes after a kRequest header) into the plain structs.
/// INVALID_ARGUMENT when `payload` is shorter than header.payload_bytes, a group field is out of
/// range (num_rows, first_position in [0, 2^31), layer, new keys) or the groups' tensors do not
/// fill the payload exactly; RESOURCE_EXHAUSTED for rows or new keys over `limits`.
absl::StatusOr<LayerSelectRequest> UnpackWireRequest(const WireHeader& header,
                                                     std::span<const uint8_t> payload,
                                                     const WireLimits& limits);

/// Bytes of the selection payload of `selection`. INVALID_ARGUMENT for a group whose selections
/// are not num_rows * top_k or whose audit miss rates are neither empty nor num_rows long;
/// RESOURCE_EXHAUSTED when a group's top_k exceeds limits.max_top_k.
absl::StatusOr<int64_t> SizeWireSelection(const LayerSelection& selection,
                                          const WireLimits& limits);

/// Writes a selection answer into `out`: header, payload (SizeWireSelection's bytes), zero padding
/// to out.size(). `out` must hold kWireHeaderBytes + payload_bytes.
void PackWireSelection(const LayerSelection& selection, uint64_t request_id, int64_t payload_bytes,
                       std::span<uint8_t> out);

/// Decodes a selection payload. INVALID_ARGUMENT for a short payload, num_rows or top_k out of
/// range, blocks_scored outside [0, blocks_visible], a slot below -1, an audit miss rate outside
/// [0, 1] or a layout that does not fill the payload exactly; RESOURCE_EXHAUSTED for top_k over
/// limits.max_top_k.
absl::StatusOr<LayerSelection> UnpackWireSelection(const WireHeader& header,
                                                   std::span<const uint8_t> payload,
                                                   const WireLimits& limits);

/// Writes an error answer for `status` (not OK) into `out` (its message cut to fit out.size() and
/// kMaxWireErrorMessageBytes), zero padding to out.size(). `out` must hold kWireHeaderBytes.
void PackWireError(const absl::Status& status, int groups_applied, uint64_t request_id,
                   std::span<uint8_t> out);

/// The refusal an error answer carries: its code and message, with kGroupsAppliedPayload set to
/// the decimal groups_applied (DecodeWireHeader has checked both). INTERNAL instead when `payload`
/// is shorter than header.payload_bytes.
absl::Status UnpackWireError(const WireHeader& header, std::span<const uint8_t> payload);

/// Writes a close header into out[0, kWireHeaderBytes).
void PackWireClose(std::span<uint8_t> out);

/// Bytes of the answer message for a request of `rows_per_group` rows per group under `limits`
/// (what SizeWireRequest puts in response_bytes): the larger of an error answer and a selection of
/// max_top_k slots and audit miss rates for every row.
int64_t WireResponseBytes(std::span<const int> rows_per_group, const WireLimits& limits);

/// What the indexer side runs for a decoded request (RunLayerSelect over an Indexer, or a test's
/// stand-in): the selection, or the refusal with the leading groups applied before it.
using WireSelectHandler =
    std::function<absl::StatusOr<LayerSelection>(const LayerSelectRequest&, int* groups_applied)>;

/// Whether a caller may select for `sequence_id`: OK, or the refusal (PERMISSION_DENIED from the
/// indexer's owner table: DataPlaneCaller::check_owned in indexer_service/data_plane.h).
using SequenceOwnerCheck = std::function<absl::Status(uint64_t sequence_id)>;

/// `handler` behind `check_owned`: a request any of whose groups' sequences the check refuses is
/// answered with that refusal and groups_applied 0, before `handler` runs (so nothing of it is
/// applied); the others go to `handler` unchanged. The same rule SelectStream applies to each
/// request (a caller selects only for its own sequences: docs/reliability.md, "Security").
/// `check_owned` null: `handler` itself.
WireSelectHandler WithOwnerCheck(WireSelectHandler handler, SequenceOwnerCheck check_owned);

/// The indexer side of one exchange: decodes the request (`header` and its payload), runs
/// `handler` and writes the answer message into `out` (header.response_bytes bytes: the size the
/// attention side receives). A request that does not decode is answered with its
/// INVALID_ARGUMENT / RESOURCE_EXHAUSTED and groups_applied 0; the handler's refusal with its
/// status and groups_applied; a selection that does not fit the answer (a K above max_top_k)
/// with RESOURCE_EXHAUSTED naming the limit and every group counted as applied (they ran).
void AnswerWireRequest(const WireSelectHandler& handler, const WireHeader& header,
                       std::span<const uint8_t> payload, const WireLimits& limits,
                       std::span<uint8_t> out);

}  // namespace dsa
