// SPIN block prediction, budget, forced blocks, exploration and EMA update (see spin.h).
#include "indexer_service/spin.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/philox.h"
#include "indexer_service/block_pool.h"
#include "indexer_service/topk.h"

namespace dsa {
namespace {

// ceil and floor of a product of a setting (rho, gamma) and a block count, immune to the product
// landing a few ulps past the integer it equals in decimal arithmetic: (1 - 0.7) * 10 evaluates to
// 3.0000000000000004, whose plain ceil would be 4. The slack (1e-12 relative) is far above fp64
// rounding and far below any real fractional part.
int64_t CeilOfProduct(double x) {
  return static_cast<int64_t>(std::ceil(x - 1e-12 * std::max(1.0, std::fabs(x))));
}
int64_t FloorOfProduct(double x) {
  return static_cast<int64_t>(std::floor(x + 1e-12 * std::max(1.0, std::fabs(x))));
}

absl::Status CheckUnitInterval(const char* name, double value) {
  if (!std::isfinite(value) || value < 0.0 || value >= 1.0) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be in [0, 1), got ", value));
  }
  return absl::OkStatus();
}

// Pools the values of one block (DESIGN.md 4.2 step 2; paper 4.6 for top-4 and mean).
float Pool(BlockPooling pooling, const float* values, int count) {
  if (count <= 0) return 0.0f;
  switch (pooling) {
    case BlockPooling::kMax:
      return *std::max_element(values, values + count);
    case BlockPooling::kMean: {
      float sum = 0.0f;
      for (int i = 0; i < count; ++i) sum += values[i];
      return sum / static_cast<float>(count);
    }
    case BlockPooling::kTop4Mean: {
      float top[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
      for (int i = 0; i < count; ++i) {
        float v = values[i];
        for (int k = 0; k < 4; ++k) {
          if (v > top[k]) std::swap(v, top[k]);
        }
      }
      const int used = std::min(count, 4);
      float sum = 0.0f;
      for (int k = 0; k < used; ++k) sum += top[k];
      return sum / static_cast<float>(used);
    }
  }
  return 0.0f;
}

// Takes the `count` best blocks among those not yet taken by `rank` (higher first, ties to the
// lower block) and marks them taken.
void TakeBest(const std::vector<float>& rank, int64_t count, std::vector<bool>& taken,
              std::vector<int32_t>& chosen) {
  if (count <= 0) return;
  std::vector<int32_t> free;
  free.reserve(rank.size());
  for (int32_t j = 0; j < static_cast<int32_t>(rank.size()); ++j) {
    if (!taken[j]) free.push_back(j);
  }
  count = std::min<int64_t>(count, static_cast<int64_t>(free.size()));
  auto better = [&rank](int32_t a, int32_t b) {
    return rank[a] > rank[b] || (rank[a] == rank[b] && a < b);
  };
  std::nth_element(free.begin(), free.begin() + count, free.end(), better);
  for (int64_t i = 0; i < count; ++i) {
    taken[free[i]] = true;
    chosen.push_back(free[i]);
  }
}

}  // namespace

absl::Status ValidateSpinConfig(const SpinConfig& config) {
  if (auto s = CheckUnitInterval("target block sparsity rho", config.target_block_sparsity);
      !s.ok()) {
    return s;
  }
  if (auto s = CheckUnitInterval("EMA decay a", config.ema_decay); !s.ok()) return s;
  if (config.miss_target.has_value()) {
    if (auto s = CheckUnitInterval("miss target", *config.miss_target); !s.ok()) return s;
  }
  return CheckUnitInterval("exploration fraction gamma", config.exploration_fraction);
}

absl::Status ParseBlockPooling(const std::string& name, BlockPooling* out) {
  if (name == "max")
    *out = BlockPooling::kMax;
  else if (name == "top4")
    *out = BlockPooling::kTop4Mean;
  else if (name == "mean")
    *out = BlockPooling::kMean;
  else
    return absl::InvalidArgumentError(
        absl::StrCat("unknown block pooling '", name, "' (max, top4, mean)"));
  return absl::OkStatus();
}

absl::Status ParseBlockReduction(const std::string& name, BlockReduction* out) {
  if (name == "a1")
    *out = BlockReduction::kA1;
  else if (name == "a0")
    *out = BlockReduction::kA0;
  else if (name == "a2")
    *out = BlockReduction::kA2;
  else
    return absl::InvalidArgumentError(
        absl::StrCat("unknown block reduction '", name, "' (a0, a1, a2)"));
  return absl::OkStatus();
}

absl::Status ParseExplorationPolicy(const std::string& name, ExplorationPolicy* out) {
  if (name == "random")
    *out = ExplorationPolicy::kRandom;
  else if (name == "staleness")
    *out = ExplorationPolicy::kStalenessScore;
  else if (name == "age")
    *out = ExplorationPolicy::kBlockAge;
  else
    return absl::InvalidArgumentError(
        absl::StrCat("unknown exploration policy '", name, "' (random, staleness, age)"));
  return absl::OkStatus();
}

SpinState::SpinState(const SpinConfig& config, int top_k, int layer)
    : config_(config), top_k_(top_k), layer_(layer) {}

int64_t SpinState::BlockBudget(int64_t visible_blocks, int top_k, double target_block_sparsity) {
  const int64_t floor_blocks = CeilDiv(top_k, kBlockSize);
  const int64_t kept =
      CeilOfProduct((1.0 - target_block_sparsity) * static_cast<double>(visible_blocks));
  return std::min(visible_blocks, std::max(floor_blocks, kept));
}

std::vector<float> SpinState::PredictBlockScores(int64_t position) const {
  const int64_t visible_slots = position + 1;
  const int64_t num_blocks = CeilDiv(visible_slots, kBlockSize);
  std::vector<float> predicted(num_blocks, 0.0f);
  if (config_.reduction == BlockReduction::kA2) {
    const int64_t newest = position / kBlockSize;
    for (int64_t j = 0; j < num_blocks; ++j) {
      const float v = j < static_cast<int64_t>(block_vertical_.size()) ? block_vertical_[j] : 0.0f;
      const int64_t o = newest - j;
      const float d = o < static_cast<int64_t>(block_diagonal_.size()) ? block_diagonal_[o] : 0.0f;
      predicted[j] = std::max(v, d);
    }
    return predicted;
  }
  float slot_scores[kBlockSize];
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t first = j * kBlockSize;
    const int count = static_cast<int>(std::min<int64_t>(kBlockSize, visible_slots - first));
    for (int s = 0; s < count; ++s) {
      const int64_t i = first + s;
      slot_scores[s] = std::max(V(i), D(position - i));  // eq. (1)
    }
    predicted[j] = Pool(config_.pooling, slot_scores, count);  // eq. (2)
  }
  return predicted;
}

void SpinState::Explore(int64_t position, int64_t count, const std::vector<float>& predicted,
                        std::vector<bool>& taken, std::vector<int32_t>& chosen) const {
  if (count <= 0) return;
  const int64_t num_blocks = static_cast<int64_t>(taken.size());
  if (config_.exploration == ExplorationPolicy::kRandom) {
    // Partial Fisher-Yates over the untaken blocks in ascending order; draw i uses Philox word 0 of
    // counter (position lo, position hi, i, layer) under key (seed lo, seed hi).
    std::vector<int32_t> free;
    for (int32_t j = 0; j < num_blocks; ++j) {
      if (!taken[j]) free.push_back(j);
    }
    count = std::min<int64_t>(count, static_cast<int64_t>(free.size()));
    const PhiloxKey key{
        {static_cast<uint32_t>(config_.seed), static_cast<uint32_t>(config_.seed >> 32)}};
    for (int64_t i = 0; i < count; ++i) {
      const PhiloxCounter counter{{static_cast<uint32_t>(position),
                                   static_cast<uint32_t>(static_cast<uint64_t>(position) >> 32),
                                   static_cast<uint32_t>(i), static_cast<uint32_t>(layer_)}};
      const uint32_t word = Philox4x32(counter, key).c[0];
      const int64_t pick = i + UniformBelow(word, static_cast<uint32_t>(free.size() - i));
      std::swap(free[i], free[pick]);
      taken[free[i]] = true;
      chosen.push_back(free[i]);
    }
    return;
  }
  // Block age: the least recently scored blocks first. Staleness score: age weighted by predicted
  // importance, (S[j] + mean S) * (age + 1), so stale blocks that used to matter come first.
  std::vector<float> rank(num_blocks);
  double mean = 0.0;
  for (float s : predicted) mean += s;
  mean /= std::max<int64_t>(1, num_blocks);
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t last =
        j < static_cast<int64_t>(block_last_scored_.size()) ? block_last_scored_[j] : -1;
    const float age = static_cast<float>(position - last);
    rank[j] = config_.exploration == ExplorationPolicy::kBlockAge
                  ? age
                  : (predicted[j] + static_cast<float>(mean)) * (age + 1.0f);
  }
  TakeBest(rank, count, taken, chosen);
}

std::vector<int32_t> SpinState::PlanRow(int64_t position) const {
  const int64_t visible_slots = position + 1;
  const int64_t num_blocks = CeilDiv(visible_slots, kBlockSize);
  std::vector<int32_t> chosen;
  if (!config_.enabled || warmup_pending_ || visible_slots <= top_k_) {  // step 1
    chosen.resize(num_blocks);
    std::iota(chosen.begin(), chosen.end(), 0);
    return chosen;
  }
  const std::vector<float> predicted = PredictBlockScores(position);  // step 2
  std::vector<bool> taken(num_blocks, false);
  auto take = [&](int32_t j) {
    if (!taken[j]) {
      taken[j] = true;
      chosen.push_back(j);
    }
  };
  take(0);  // step 4: the sink block and the newest block
  take(static_cast<int32_t>(num_blocks - 1));
  if (config_.reduction == BlockReduction::kA0) {
    // A0 (paper 4.6): top-K predicted slots, expanded to their blocks; exploration on top.
    std::vector<float> slot_scores(visible_slots);
    for (int64_t i = 0; i < visible_slots; ++i) slot_scores[i] = std::max(V(i), D(position - i));
    std::vector<int32_t> slots(top_k_);
    SelectTopK(slot_scores, {}, position, slots);
    for (int32_t slot : slots) {
      if (slot >= 0) take(slot / kBlockSize);
    }
    const int64_t budget = static_cast<int64_t>(chosen.size());
    const int64_t n_explore = std::min<int64_t>(
        FloorOfProduct(config_.exploration_fraction * budget + 0.5), num_blocks - budget);
    Explore(position, n_explore, predicted, taken, chosen);
  } else {
    const int64_t budget =
        BlockBudget(num_blocks, top_k_, config_.target_block_sparsity);  // step 3
    const int64_t capacity = budget - static_cast<int64_t>(chosen.size());
    const int64_t n_explore =
        std::min<int64_t>(FloorOfProduct(config_.exploration_fraction * budget + 0.5), capacity);
    Explore(position, n_explore, predicted, taken, chosen);                            // step 5
    TakeBest(predicted, budget - static_cast<int64_t>(chosen.size()), taken, chosen);  // step 6
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

BlockPlan SpinState::Plan(std::span<const int64_t> positions) {
  DSA_CHECK(!positions.empty(), "a plan needs at least one row");
  BlockPlan plan;
  plan.visible_blocks = CeilDiv(positions.back() + 1, kBlockSize);
  plan.row_blocks.reserve(positions.size());
  for (int64_t position : positions) plan.row_blocks.push_back(PlanRow(position));
  if (config_.spec_mask == SpecMaskPolicy::kRow0Sharing && positions.size() > 1) {
    plan.blocks = plan.row_blocks[0];
    for (int64_t position : positions)
      plan.blocks.push_back(static_cast<int32_t>(position / kBlockSize));
  } else {
    for (const auto& row : plan.row_blocks)
      plan.blocks.insert(plan.blocks.end(), row.begin(), row.end());
  }
  std::sort(plan.blocks.begin(), plan.blocks.end());
  plan.blocks.erase(std::unique(plan.blocks.begin(), plan.blocks.end()), plan.blocks.end());
  plan.all_blocks = static_cast<int64_t>(plan.blocks.size()) == plan.visible_blocks;
  warmup_pending_ = false;
  return plan;
}

void SpinState::Update(int64_t position, std::span<const int32_t> blocks,
                       std::span<const float> scores) {
  const float a = static_cast<float>(config_.ema_decay);
  const float b = 1.0f - a;
  if (static_cast<int64_t>(vertical_.size()) <= position) vertical_.resize(position + 1, 0.0f);
  if (static_cast<int64_t>(diagonal_.size()) <= position) diagonal_.resize(position + 1, 0.0f);
  const int64_t newest_block = position / kBlockSize;
  if (static_cast<int64_t>(block_last_scored_.size()) <= newest_block) {
    block_last_scored_.resize(newest_block + 1, -1);
  }
  const bool block_level = config_.reduction == BlockReduction::kA2;
  if (block_level) {
    if (static_cast<int64_t>(block_vertical_.size()) <= newest_block)
      block_vertical_.resize(newest_block + 1, 0.0f);
    if (static_cast<int64_t>(block_diagonal_.size()) <= newest_block)
      block_diagonal_.resize(newest_block + 1, 0.0f);
  }
  float observed[kBlockSize];
  for (size_t j = 0; j < blocks.size(); ++j) {
    const int64_t first = static_cast<int64_t>(blocks[j]) * kBlockSize;
    if (first > position) continue;
    int count = 0;
    for (int s = 0; s < kBlockSize; ++s) {
      const int64_t i = first + s;
      const float z = scores[j * kBlockSize + s];
      if (i > position || !std::isfinite(z)) continue;
      vertical_[i] = a * vertical_[i] + b * z;  // step 8
      diagonal_[position - i] = a * diagonal_[position - i] + b * z;
      observed[count++] = z;
    }
    if (count == 0) continue;
    block_last_scored_[blocks[j]] = position;
    if (block_level) {  // A2: block EMAs of pooled observed scores
      const float pooled = Pool(config_.pooling, observed, count);
      const int64_t o = newest_block - blocks[j];
      block_vertical_[blocks[j]] = a * block_vertical_[blocks[j]] + b * pooled;
      block_diagonal_[o] = a * block_diagonal_[o] + b * pooled;
    }
  }
}

void SpinState::BeginTurn() {
  std::fill(vertical_.begin(), vertical_.end(), 0.0f);
  std::fill(diagonal_.begin(), diagonal_.end(), 0.0f);
  std::fill(block_vertical_.begin(), block_vertical_.end(), 0.0f);
  std::fill(block_diagonal_.begin(), block_diagonal_.end(), 0.0f);
  std::fill(block_last_scored_.begin(), block_last_scored_.end(), -1);
  warmup_pending_ = true;
}

}  // namespace dsa
