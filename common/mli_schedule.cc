// The MLI schedule (see mli_schedule.h).
#include "common/mli_schedule.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dsa {

MliSchedule::MliSchedule(std::vector<bool> is_full, int lag_depth)
    : is_full_(std::move(is_full)), lag_depth_(lag_depth) {
  full_rank_.resize(is_full_.size());
  for (int l = 0; l < static_cast<int>(is_full_.size()); ++l) {
    if (is_full_[l]) full_layers_.push_back(l);
    full_rank_[l] = static_cast<int>(full_layers_.size()) - 1;
  }
}

absl::StatusOr<MliSchedule> MliSchedule::FromRetention(int num_layers, int retention_stride,
                                                       int lag_depth) {
  if (num_layers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_layers must be >= 1, got ", num_layers));
  }
  if (retention_stride < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("retention stride r must be >= 1, got ", retention_stride));
  }
  if (lag_depth < 0) {
    return absl::InvalidArgumentError(absl::StrCat("lag depth k must be >= 0, got ", lag_depth));
  }
  std::vector<bool> is_full(num_layers);
  for (int l = 0; l < num_layers; ++l) is_full[l] = (l % retention_stride) == 0;
  return MliSchedule(std::move(is_full), lag_depth);
}

absl::StatusOr<MliSchedule> MliSchedule::FromPattern(std::string_view pattern, int lag_depth,
                                                     int expected_num_layers) {
  if (pattern.empty()) return absl::InvalidArgumentError("layer pattern is empty");
  if (expected_num_layers >= 0 && static_cast<int>(pattern.size()) != expected_num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer pattern has ", pattern.size(),
                                                   " layers, the model has ", expected_num_layers));
  }
  if (lag_depth < 0) {
    return absl::InvalidArgumentError(absl::StrCat("lag depth k must be >= 0, got ", lag_depth));
  }
  std::vector<bool> is_full(pattern.size());
  for (size_t l = 0; l < pattern.size(); ++l) {
    const char c = pattern[l];
    if (c != 'F' && c != 'S') {
      return absl::InvalidArgumentError(absl::StrCat("layer pattern character ", l, " is '",
                                                     std::string(1, c), "'; expected 'F' or 'S'"));
    }
    is_full[l] = c == 'F';
  }
  if (!is_full[0]) {
    return absl::InvalidArgumentError(
        "layer pattern starts with a shared layer ('S'); layer 0 must be full");
  }
  return MliSchedule(std::move(is_full), lag_depth);
}

int MliSchedule::NearestFullLayer(int layer) const { return full_layers_[full_rank_[layer]]; }

int MliSchedule::AttendedLayer(int layer) const {
  const int rank = full_rank_[layer];
  // The first k full layers have no full layer k positions before them: they attend their own.
  const int source_rank = rank >= lag_depth_ ? rank - lag_depth_ : rank;
  return full_layers_[source_rank];
}

std::vector<int> MliSchedule::Consumers(int full_layer) const {
  std::vector<int> consumers;
  if (full_layer < 0 || full_layer >= num_layers() || !is_full_[full_layer]) return consumers;
  for (int l = 0; l < num_layers(); ++l) {
    if (AttendedLayer(l) == full_layer) consumers.push_back(l);
  }
  return consumers;
}

int MliSchedule::DeadlineLayer(int full_layer) const {
  const std::vector<int> consumers = Consumers(full_layer);
  return consumers.empty() ? -1 : consumers.front();
}

std::string MliSchedule::Pattern() const {
  std::string pattern;
  pattern.reserve(is_full_.size());
  for (bool full : is_full_) pattern.push_back(full ? 'F' : 'S');
  return pattern;
}

}  // namespace dsa
