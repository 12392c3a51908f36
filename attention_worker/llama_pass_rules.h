// What every device's forward pass of the real model shares (LlamaForward on the CPU,
// cuda/llama_cuda_runner.h on the GPU), so that both refuse the same rows and selections with the
// same words and rotate by the same RoPE angles: the grouping of a pass's rows by cache, the
// checks of a layer's selections, and the RoPE tables.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace dsa {

/// The rows of one pass that extend one cache.
template <typename Cache>
struct LlamaCacheRows {
  Cache* cache = nullptr;
  int64_t first_position = 0;             // the cache's committed slots when the pass began
  std::vector<int32_t> rows_by_position;  // indices into the pass's rows, increasing position
};

/// Groups a pass's rows by the cache they extend and checks them (LlamaForward::Begin's rules):
/// at least one row and fewer than 2^30; every token in [0, vocab_size); the rows of a cache
/// holding s slots have positions s, s+1, ... exactly once each, ending before context_length.
/// `Row` has `int64_t position` and `int32_t token`; `cache_of(r)` (r a size_t row index) gives
/// row r's cache, a `Cache*` with `num_slots()`, or the error that refuses it (no cache, a cache
/// of another model or runner). Returns the groups in order of first appearance.
/// INVALID_ARGUMENT (empty, too many rows, a token, positions, or cache_of's error);
/// RESOURCE_EXHAUSTED (a position at or past the context length). Messages start with `who`.
template <typename Cache, typename Row, typename CacheOf>
absl::StatusOr<std::vector<LlamaCacheRows<Cache>>> GroupLlamaRows(absl::string_view who,
                                                                  int32_t vocab_size,
                                                                  int64_t context_length,
                                                                  const std::vector<Row>& rows,
                                                                  CacheOf cache_of) {
  if (rows.empty()) return absl::InvalidArgumentError(absl::StrCat(who, ": no rows"));
  if (rows.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max() / 2)) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": too many rows"));
  }
  std::vector<LlamaCacheRows<Cache>> groups;
  for (size_t r = 0; r < rows.size(); ++r) {
    absl::StatusOr<Cache*> cache = cache_of(r);
    if (!cache.ok()) return cache.status();
    const int32_t token = rows[r].token;
    if (token < 0 || token >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": row ", r, " has token ", token, ", outside [0, ", vocab_size, ")"));
    }
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const LlamaCacheRows<Cache>& g) { return g.cache == *cache; });
    if (group == groups.end()) {
      groups.push_back({*cache, (*cache)->num_slots(), {}});
      group = groups.end() - 1;
    }
    group->rows_by_position.push_back(static_cast<int32_t>(r));
  }
  for (LlamaCacheRows<Cache>& group : groups) {
    std::sort(group.rows_by_position.begin(), group.rows_by_position.end(),
              [&](int32_t a, int32_t b) { return rows[a].position < rows[b].position; });
    const auto count = static_cast<int64_t>(group.rows_by_position.size());
    for (int64_t i = 0; i < count; ++i) {
      const int64_t position = rows[group.rows_by_position[i]].position;
      if (position != group.first_position + i) {
        return absl::InvalidArgumentError(
            absl::StrCat(who, ": the rows of a cache holding ", group.first_position,
                         " slots must have positions ", group.first_position, "..",
                         group.first_position + count - 1, " exactly once each; row ",
                         group.rows_by_position[i], " has position ", position));
      }
    }
    const int64_t end = group.first_position + count;
    if (end > context_length) {
      return absl::ResourceExhaustedError(absl::StrCat(
          who, ": position ", end - 1, " is beyond the context length ", context_length));
    }
  }
  return groups;
}

/// Checks one layer's selections for a pass's rows before anything runs (LlamaPass::RunLayer's
/// rules): `selections` is empty (every row dense) or has one entry per row; a non-empty entry
/// names slots in [0, position] of its row, each at most once, -1 padding anywhere, and at least
/// one slot. `Row` has `int64_t position`. `seen` is scratch that is all zero between calls (grown
/// as needed, left all zero). INVALID_ARGUMENT naming the row and slot; messages start with `who`.
template <typename Row>
absl::Status CheckLlamaSelections(absl::string_view who, const std::vector<Row>& rows,
                                  std::span<const std::span<const int32_t>> selections,
                                  std::vector<uint8_t>& seen) {
  if (selections.empty()) return absl::OkStatus();
  if (selections.size() != rows.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", selections.size(), " selections for ", rows.size(), " rows"));
  }
  int64_t max_position = 0;
  for (const Row& row : rows) max_position = std::max(max_position, row.position);
  if (static_cast<int64_t>(seen.size()) < max_position + 1) seen.assign(max_position + 1, 0);
  for (size_t r = 0; r < selections.size(); ++r) {
    const std::span<const int32_t> selection = selections[r];
    if (selection.empty()) continue;
    const int64_t position = rows[r].position;
    if (selection.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max() / 4)) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": row ", r, "'s selection is too long"));
    }
    int64_t count = 0;
    absl::Status status;
    for (const int32_t slot : selection) {
      if (slot == -1) continue;
      if (slot < -1 || slot > position) {
        status = absl::InvalidArgumentError(absl::StrCat(who, ": row ", r, " (position ", position,
                                                         ") selects slot ", slot, ", outside [-1, ",
                                                         position, "]"));
        break;
      }
      if (seen[slot] != 0) {
        status = absl::InvalidArgumentError(
            absl::StrCat(who, ": row ", r, " selects slot ", slot, " twice"));
        break;
      }
      seen[slot] = 1;
      ++count;
    }
    for (const int32_t slot : selection) {
      if (slot >= 0 && slot <= position) seen[slot] = 0;
    }
    if (!status.ok()) return status;
    if (count == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": row ", r, "'s selection has no slot (only -1 padding)"));
    }
  }
  return absl::OkStatus();
}

/// RoPE's frequencies over `dims` dims rotated in adjacent pairs: theta_j = base^(-2j / dims) for
/// j in [0, dims / 2), in double (RoFormer, Su et al. 2021, eq. 15).
inline std::vector<double> RopeFrequencies(double base, int dims) {
  std::vector<double> theta(dims / 2);
  for (int j = 0; j < dims / 2; ++j) theta[j] = std::pow(base, -2.0 * j / dims);
  return theta;
}

/// cos and sin fp32 [theta.size()] of position * theta_j, computed in double and rounded once, so
/// that every device rotates by the same angles.
inline void RopeAngles(int64_t position, const std::vector<double>& theta, float* cos, float* sin) {
  for (size_t j = 0; j < theta.size(); ++j) {
    const double angle = static_cast<double>(position) * theta[j];
    cos[j] = static_cast<float>(std::cos(angle));
    sin[j] = static_cast<float>(std::sin(angle));
  }
}

}  // namespace dsa
