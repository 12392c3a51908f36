// Tests of the synthetic pattern model: determinism, prefix-block keys, pure queries, config
// validation and the ground-truth statistics (salience, topic switches, layer correlation).
#include "attention_worker/pattern_model.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dsa {
namespace {

using ::testing::HasSubstr;

PatternModel MakeModel(const PatternModelConfig& config = {}) {
  absl::StatusOr<PatternModel> model = PatternModel::Create(config);
  EXPECT_TRUE(model.ok()) << model.status();
  return *std::move(model);
}

std::vector<float> Keys(const PatternModel& model, int layer, int64_t first, int64_t count) {
  std::vector<float> keys(count * model.head_dim());
  EXPECT_TRUE(model.IndexKeys(layer, first, count, keys).ok());
  return keys;
}

bool BitIdentical(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

TEST(PatternModelTest, SameSeedGivesBitIdenticalKeysAndQueries) {
  PatternModelConfig config;
  config.seed = 42;
  const PatternModel a = MakeModel(config), b = MakeModel(config);
  const std::vector<float> keys_a = Keys(a, 2, 1000, 100), keys_b = Keys(b, 2, 1000, 100);
  EXPECT_TRUE(BitIdentical(keys_a.data(), keys_b.data(), keys_a.size()));

  std::vector<float> qa(64 * 128), qb(64 * 128), wa(64), wb(64);
  ASSERT_TRUE(a.IndexerQuery(3, 5000, qa, wa).ok());
  ASSERT_TRUE(b.IndexerQuery(3, 5000, qb, wb).ok());
  EXPECT_TRUE(BitIdentical(qa.data(), qb.data(), qa.size()));
  EXPECT_TRUE(BitIdentical(wa.data(), wb.data(), wa.size()));

  config.seed = 43;
  const std::vector<float> keys_c = Keys(MakeModel(config), 2, 1000, 100);
  EXPECT_FALSE(BitIdentical(keys_a.data(), keys_c.data(), keys_a.size()));
}

TEST(PatternModelTest, KeyOfASlotDoesNotDependOnTheRange) {
  const PatternModel model = MakeModel();
  const int d = model.head_dim();
  const std::vector<float> wide = Keys(model, 1, 1000, 100);
  const std::vector<float> narrow = Keys(model, 1, 1050, 10);
  EXPECT_TRUE(BitIdentical(wide.data() + 50 * d, narrow.data(), narrow.size()));
  // Layers differ.
  const std::vector<float> other_layer = Keys(model, 2, 1050, 10);
  EXPECT_FALSE(BitIdentical(narrow.data(), other_layer.data(), narrow.size()));
}

TEST(PatternModelTest, PrefixBlockKeysShareContentAcrossPositions) {
  const PatternModel model = MakeModel();
  const int d = model.head_dim(), half = d / 2;
  constexpr uint64_t kBlockId = 0x1234'5678'9abcULL;
  std::vector<float> at_a(32 * d), at_b(32 * d), again(32 * d), other_block(32 * d);
  // Offsets 100..131 of the block, placed at slot 5 * 512 + 100 in one request and at slot
  // 9 * 512 + 100 in another.
  ASSERT_TRUE(model.PrefixBlockIndexKeys(1, kBlockId, 100, 5 * 512 + 100, 32, at_a).ok());
  ASSERT_TRUE(model.PrefixBlockIndexKeys(1, kBlockId, 100, 9 * 512 + 100, 32, at_b).ok());
  ASSERT_TRUE(model.PrefixBlockIndexKeys(1, kBlockId, 100, 5 * 512 + 100, 32, again).ok());
  ASSERT_TRUE(
      model.PrefixBlockIndexKeys(1, kBlockId + 1, 100, 5 * 512 + 100, 32, other_block).ok());

  // Same block id, offset and position: the whole key is bit-identical.
  EXPECT_TRUE(BitIdentical(at_a.data(), again.data(), at_a.size()));
  for (int j = 0; j < 32; ++j) {
    const float* a = at_a.data() + j * d;
    const float* b = at_b.data() + j * d;
    // The content half is bit-identical at any position; the RoPE half is the same vector rotated
    // (equal norm per rotation pair) by a different angle.
    EXPECT_TRUE(BitIdentical(a, b, half)) << "offset " << 100 + j;
    EXPECT_FALSE(BitIdentical(a + half, b + half, half));
    for (int f = 0; f < half / 2; ++f) {
      const float norm_a = std::hypot(a[half + 2 * f], a[half + 2 * f + 1]);
      const float norm_b = std::hypot(b[half + 2 * f], b[half + 2 * f + 1]);
      EXPECT_NEAR(norm_a, norm_b, 1e-5f * (1.0f + norm_a));
    }
  }
  EXPECT_FALSE(BitIdentical(at_a.data(), other_block.data(), half));

  // A sub-range of the block gives the same rows.
  std::vector<float> sub(4 * d);
  ASSERT_TRUE(model.PrefixBlockIndexKeys(1, kBlockId, 110, 5 * 512 + 110, 4, sub).ok());
  EXPECT_TRUE(BitIdentical(sub.data(), at_a.data() + 10 * d, sub.size()));
  EXPECT_EQ(model.PrefixBlockTopic(kBlockId), model.PrefixBlockTopic(kBlockId));
}

TEST(PatternModelTest, QueriesArePureFunctionsOfThePosition) {
  const PatternModel model = MakeModel();
  const size_t q_size = static_cast<size_t>(model.num_heads()) * model.head_dim();
  constexpr int kRows = 5;
  std::vector<std::vector<float>> forward(kRows, std::vector<float>(q_size)),
      backward(kRows, std::vector<float>(q_size)),
      forward_w(kRows, std::vector<float>(model.num_heads())),
      backward_w(kRows, std::vector<float>(model.num_heads()));
  for (int r = 0; r < kRows; ++r) {
    ASSERT_TRUE(model.IndexerQuery(2, 9000 + r, forward[r], forward_w[r]).ok());
  }
  for (int r = kRows - 1; r >= 0; --r) {
    ASSERT_TRUE(model.IndexerQuery(2, 9000 + r, backward[r], backward_w[r]).ok());
  }
  for (int r = 0; r < kRows; ++r) {
    EXPECT_TRUE(BitIdentical(forward[r].data(), backward[r].data(), q_size));
    EXPECT_TRUE(BitIdentical(forward_w[r].data(), backward_w[r].data(), forward_w[r].size()));
    for (float w : forward_w[r]) {
      EXPECT_TRUE(std::isfinite(w));
      EXPECT_GT(w, 0.0f);
    }
    for (float v : forward[r]) EXPECT_TRUE(std::isfinite(v));
  }
  // Consecutive rows differ (the query moves with t).
  EXPECT_FALSE(BitIdentical(forward[0].data(), forward[1].data(), q_size));
}

struct BadField {
  std::string field;
  std::function<void(PatternModelConfig&)> corrupt;
};

TEST(PatternModelTest, RejectsInvalidConfigNamingTheField) {
  const std::vector<BadField> cases = {
      {"num_layers", [](PatternModelConfig& c) { c.num_layers = 0; }},
      {"num_heads", [](PatternModelConfig& c) { c.num_heads = 0; }},
      {"head_dim", [](PatternModelConfig& c) { c.head_dim = 100; }},
      {"head_dim", [](PatternModelConfig& c) { c.head_dim = 2048; }},
      {"num_sink_slots", [](PatternModelConfig& c) { c.num_sink_slots = -1; }},
      {"sink_strength", [](PatternModelConfig& c) { c.sink_strength = -1.0f; }},
      {"salient_fraction", [](PatternModelConfig& c) { c.salient_fraction = 1.0f; }},
      {"salient_strength", [](PatternModelConfig& c) { c.salient_strength = NAN; }},
      {"num_topics", [](PatternModelConfig& c) { c.num_topics = 0; }},
      {"topic_strength", [](PatternModelConfig& c) { c.topic_strength = INFINITY; }},
      {"topic_switch_rate", [](PatternModelConfig& c) { c.topic_switch_rate = 1e-6f; }},
      {"topic_switch_rate", [](PatternModelConfig& c) { c.topic_switch_rate = 1.5f; }},
      {"positional_head_fraction", [](PatternModelConfig& c) { c.positional_head_fraction = 2; }},
      {"num_diagonals", [](PatternModelConfig& c) { c.num_diagonals = 0; }},
      {"num_diagonals", [](PatternModelConfig& c) { c.num_diagonals = 17; }},  // 16 positional
      {"diagonal_strength", [](PatternModelConfig& c) { c.diagonal_strength = -0.5f; }},
      {"recency_strength", [](PatternModelConfig& c) { c.recency_strength = -0.5f; }},
      {"recency_window_slots", [](PatternModelConfig& c) { c.recency_window_slots = 0; }},
      {"diagonal_band_slots", [](PatternModelConfig& c) { c.diagonal_band_slots = 0; }},
      {"min_diagonal_offset", [](PatternModelConfig& c) { c.min_diagonal_offset = 0; }},
      {"max_diagonal_offset", [](PatternModelConfig& c) { c.max_diagonal_offset = 16; }},
      {"rope_base", [](PatternModelConfig& c) { c.rope_base = 1.0f; }},
      {"positional_threshold", [](PatternModelConfig& c) { c.positional_threshold = 1.0f; }},
      {"key_noise", [](PatternModelConfig& c) { c.key_noise = -1.0f; }},
      {"rope_key_noise", [](PatternModelConfig& c) { c.rope_key_noise = -1.0f; }},
      {"query_noise", [](PatternModelConfig& c) { c.query_noise = -1.0f; }},
      {"query_noise_steps", [](PatternModelConfig& c) { c.query_noise_steps = 0; }},
      {"shared_query_noise_fraction",
       [](PatternModelConfig& c) { c.shared_query_noise_fraction = 1.5f; }},
      {"head_weight_noise", [](PatternModelConfig& c) { c.head_weight_noise = -0.1f; }},
      {"layer_correlation", [](PatternModelConfig& c) { c.layer_correlation = 1.1f; }},
      {"layer_correlation_length", [](PatternModelConfig& c) { c.layer_correlation_length = 0; }},
  };
  for (const BadField& bad : cases) {
    PatternModelConfig config;
    bad.corrupt(config);
    const absl::StatusOr<PatternModel> model = PatternModel::Create(config);
    ASSERT_FALSE(model.ok()) << bad.field;
    EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument) << bad.field;
    EXPECT_THAT(std::string(model.status().message()), HasSubstr(bad.field));
  }
  EXPECT_TRUE(ValidatePatternModelConfig(PatternModelConfig{}).ok());
}

TEST(PatternModelTest, OtherShapesWork) {
  PatternModelConfig config;
  config.num_heads = 4;
  config.head_dim = 8;
  config.num_diagonals = 1;
  config.topic_switch_rate = 0.0f;
  const PatternModel model = MakeModel(config);
  std::vector<float> keys(3 * 8), query(4 * 8), weights(4);
  EXPECT_TRUE(model.IndexKeys(0, 0, 3, keys).ok());
  EXPECT_TRUE(model.IndexerQuery(0, 2, query, weights).ok());
  EXPECT_EQ(model.TopicEpochStart(123456), 0);
}

TEST(PatternModelTest, RejectsBadArguments) {
  const PatternModel model = MakeModel();
  std::vector<float> keys(2 * 128), query(64 * 128), weights(64);
  EXPECT_EQ(model.IndexKeys(4, 0, 2, keys).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model.IndexKeys(-1, 0, 2, keys).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model.IndexKeys(0, -1, 2, keys).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model.IndexKeys(0, 0, 3, keys).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model.PrefixBlockIndexKeys(0, 7, 511, 0, 2, keys).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model.PrefixBlockIndexKeys(0, 7, -1, 0, 2, keys).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model.IndexerQuery(0, -1, query, weights).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model.IndexerQuery(9, 0, query, weights).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model.IndexerQuery(0, 0, std::span<float>(query).first(10), weights).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model.IndexerQuery(0, 0, query, std::span<float>(weights).first(3)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PatternModelTest, SalientFractionAndTopicSwitchRateMatchTheConfig) {
  PatternModelConfig config;
  config.salient_fraction = 0.02f;
  config.topic_switch_rate = 0.05f;
  const PatternModel model = MakeModel(config);
  constexpr int64_t kSlots = 200000;
  int64_t salient = 0;
  for (int64_t i = 0; i < kSlots; ++i) salient += model.IsSalientSlot(1, i);
  EXPECT_NEAR(static_cast<double>(salient) / kSlots, 0.02, 0.002);

  constexpr int64_t kSteps = 20000;
  int64_t switches = 0;
  for (int64_t t = 1; t < kSteps; ++t) {
    const int64_t epoch = model.TopicEpochStart(t);
    ASSERT_LE(epoch, t);
    if (epoch == t) {
      ++switches;
    } else {
      EXPECT_EQ(epoch, model.TopicEpochStart(t - 1));
      EXPECT_EQ(model.QueryTopic(t), model.QueryTopic(t - 1));
    }
  }
  EXPECT_NEAR(static_cast<double>(switches) / kSteps, 0.05, 0.006);
}

// Cosine similarity of two layers' keys over many slots (content half, mean removed per dim).
double KeyCorrelation(const PatternModel& model, int layer_a, int layer_b) {
  constexpr int64_t kSlots = 2000;
  const int d = model.head_dim(), half = d / 2;
  const std::vector<float> a = Keys(model, layer_a, 10000, kSlots);
  const std::vector<float> b = Keys(model, layer_b, 10000, kSlots);
  double dot = 0.0, na = 0.0, nb = 0.0;
  for (int dim = 0; dim < half; ++dim) {
    double mean_a = 0.0, mean_b = 0.0;
    for (int64_t i = 0; i < kSlots; ++i) {
      mean_a += a[i * d + dim];
      mean_b += b[i * d + dim];
    }
    mean_a /= kSlots;
    mean_b /= kSlots;
    for (int64_t i = 0; i < kSlots; ++i) {
      const double x = a[i * d + dim] - mean_a, y = b[i * d + dim] - mean_b;
      dot += x * y;
      na += x * x;
      nb += y * y;
    }
  }
  return dot / std::sqrt(na * nb);
}

TEST(PatternModelTest, AdjacentLayersAreCorrelated) {
  PatternModelConfig config;
  config.num_layers = 12;
  const PatternModel model = MakeModel(config);
  const double adjacent = KeyCorrelation(model, 4, 5);
  const double far = KeyCorrelation(model, 0, 11);
  EXPECT_GT(adjacent, 0.3);
  EXPECT_LT(far, 0.2);
  EXPECT_GT(adjacent, far + 0.2);

  config.layer_correlation = 0.0f;
  const PatternModel independent = MakeModel(config);
  EXPECT_LT(std::abs(KeyCorrelation(independent, 4, 5)), 0.1);
}

}  // namespace
}  // namespace dsa
