// The MLI layer schedule with IndexCache retention (MLI paper section 3, eq. (2); DESIGN.md 4.3):
// which full layer's selection each layer attends, at lag depth k.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace dsa {

/// Immutable schedule over `num_layers` layers (0-based). Thread-safe (const after creation).
///
/// F is the set of full layers (they run an indexer); p(l) is the nearest full layer at or before
/// l; pi_k(f) steps back k positions along F; layer l attends the selection of sigma(l) =
/// pi_k(p(l)), except that the first k full layers, which have no such predecessor, attend their
/// own (so no layer ever attends an uninitialized selection).
class MliSchedule {
 public:
  /// Every r-th layer, starting at 0, is full (retention 1/r). Errors: INVALID_ARGUMENT when
  /// num_layers < 1, retention_stride < 1 or lag_depth < 0.
  static absl::StatusOr<MliSchedule> FromRetention(int num_layers, int retention_stride,
                                                   int lag_depth);

  /// `pattern` has one character per layer, 'F' (full) or 'S' (shared), e.g. "FSSSFSSS".
  /// Errors: INVALID_ARGUMENT when the pattern is empty, has another character, starts with 'S',
  /// or does not have `expected_num_layers` characters (pass -1 to skip that check), or when
  /// lag_depth < 0.
  static absl::StatusOr<MliSchedule> FromPattern(std::string_view pattern, int lag_depth,
                                                 int expected_num_layers = -1);

  /// Layers in the schedule (>= 1).
  int num_layers() const { return static_cast<int>(is_full_.size()); }
  /// k (>= 0): a full layer attends the selection made k full layers earlier.
  int lag_depth() const { return lag_depth_; }
  /// The full layers F in increasing order.
  const std::vector<int>& full_layers() const { return full_layers_; }
  /// Whether `layer` runs its own indexer. Requires 0 <= layer < num_layers().
  bool is_full(int layer) const { return is_full_[layer]; }
  /// p(l): the nearest full layer at or before `layer`. Requires 0 <= layer < num_layers().
  int NearestFullLayer(int layer) const;
  /// sigma(l) = pi_k(p(l)) (the layer whose selection `layer` attends). Requires a valid layer.
  int AttendedLayer(int layer) const;
  /// The layers that attend full layer f's selection, in increasing order (empty for a shared
  /// layer).
  std::vector<int> Consumers(int full_layer) const;
  /// The first layer that needs full layer f's selection (pi_k^{-1}(f) in the paper; the earliest
  /// of Consumers(f)); -1 when no layer attends it (the last k full layers' selections are unused).
  int DeadlineLayer(int full_layer) const;
  /// The schedule as a pattern string, e.g. "FSSSFSSS".
  std::string Pattern() const;

 private:
  MliSchedule(std::vector<bool> is_full, int lag_depth);
  std::vector<bool> is_full_;
  std::vector<int> full_layers_;
  std::vector<int> full_rank_;  // position of p(l) in full_layers_, per layer
  int lag_depth_ = 0;
};

}  // namespace dsa
