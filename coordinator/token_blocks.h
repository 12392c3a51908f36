// Prefix block ids derived from a prompt's token ids, so that requests share index keys exactly
// when their token prefixes are equal (prefix-aware placement, coordinator/scheduler.h).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace dsa {

/// One id per whole 512-token block of `tokens` (kPrefixBlockTokens; a partial last block gets
/// none), chained as vLLM's prefix caching keys its blocks: id_j = H(id_{j-1}, tokens of block
/// j), id_{-1} = 0, where H is the first 8 bytes (little-endian) of SHA-256 over the 8-byte
/// little-endian parent id followed by the block's 512 token ids as 4-byte little-endian
/// integers. Equal token prefixes give equal ids; a one-token change in block j changes the ids of
/// block j and every later block. A fixed, collision-resistant algorithm (vLLM moved its block
/// hash to SHA-256 after CVE-2025-25183: a caller who can craft a colliding prompt could read
/// another's cached prefix), stable across processes and runs, unlike absl::Hash or
/// absl::HashOf, which are seeded per process. Thread-safe (pure); a few microseconds a block.
std::vector<uint64_t> PrefixBlockIdsOfTokens(absl::Span<const int32_t> tokens);

}  // namespace dsa
