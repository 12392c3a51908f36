// `dsa fit-pattern` (tools/dsa/pattern_fit.h): the index-score statistics on a source whose top-K
// is known by construction, the refusals, and the fit recovering a pattern model's own statistics
// from another start.
#include "tools/dsa/pattern_fit.h"

#include <cmath>
#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace dsa {
namespace {

// One head, D = 8: slot i's key is (score_i, 0, ...) and every query is (1, 0, ...), so z_t[i] =
// score_i. score(layer, i) is the newest-first ramp i + 1, except that the slots of `lifted`
// score highest at layer 1.
class RampSource final : public IndexScoreSource {
 public:
  explicit RampSource(std::vector<int64_t> lifted) : lifted_(std::move(lifted)) {}
  int num_layers() const override { return 2; }
  int num_heads() const override { return 1; }
  int head_dim() const override { return 8; }
  absl::Status Keys(int layer, int64_t n, std::span<float> out) const override {
    std::fill(out.begin(), out.end(), 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      out[i * 8] = static_cast<float>(i + 1);
      if (layer == 1 && std::find(lifted_.begin(), lifted_.end(), i) != lifted_.end()) {
        out[i * 8] = 1e6f;
      }
    }
    return absl::OkStatus();
  }
  absl::Status Query(int, int64_t, std::span<float> query,
                     std::span<float> head_weights) const override {
    std::fill(query.begin(), query.end(), 0.0f);
    query[0] = 1.0f;
    head_weights[0] = 1.0f;
    return absl::OkStatus();
  }

 private:
  std::vector<int64_t> lifted_;
};

TEST(PatternFitTest, StatisticsOfAKnownTopK) {
  // n = 1024, rows 1020..1023, K = 128. Layer 0: the newest 128 slots [t - 127, t]. Layer 1: the
  // sink slots 0..3 and the older slots 100..103, then the newest 120.
  const RampSource source({0, 1, 2, 3, 100, 101, 102, 103});
  const IndexScoreWindow window{.n = 1024, .rows = 4, .top_k = 128};
  auto s = MeasureIndexScores(source, window);
  ASSERT_TRUE(s.ok()) << s.status();
  // Layer 0: 128 newest slots cross 3 blocks at t = 1020..1022 ([893..1020] .. [895..1022]) and
  // 2 at t = 1023 ([896..1023]); visible blocks: 16 each. Layer 1: blocks 0 and 1 plus the newest
  // 120's two ([901..1020] .. [904..1023] all lie in blocks 14 and 15).
  const double layer0 = (3 + 3 + 3 + 2) / 16.0 / 4;
  const double layer1 = 4 / 16.0;
  EXPECT_NEAR(s->block_coverage, (layer0 + layer1) / 2, 1e-12);
  EXPECT_NEAR(s->recency_share, (1.0 + 120.0 / 128) / 2, 1e-12);
  EXPECT_NEAR(s->sink_share, (0.0 + 4.0 / 128) / 2, 1e-12);  // slots 0..3 (100..103: block 1)
  // Layer 1's older slots 0..3 and 100..103 lie in segment 0.
  EXPECT_NEAR(s->segment_share, (0.0 + 8.0 / 128) / 2, 1e-12);
  // Consecutive rows share all but one slot of the newest run.
  EXPECT_NEAR(s->step_overlap, (127.0 / 128 + 127.0 / 128) / 2, 1e-12);
  // The layers share the newest 120.
  EXPECT_NEAR(s->layer_overlap, 120.0 / 128, 1e-12);
}

TEST(PatternFitTest, RefusalsNameTheProblem) {
  const RampSource source({});
  auto too_few_rows = MeasureIndexScores(source, {.n = 1024, .rows = 1, .top_k = 128});
  EXPECT_EQ(too_few_rows.status().code(), absl::StatusCode::kInvalidArgument);
  auto k_too_large = MeasureIndexScores(source, {.n = 200, .rows = 100, .top_k = 128});
  EXPECT_EQ(k_too_large.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(k_too_large.status().message().find("n - rows >= top_k"), std::string::npos);

  PatternModelConfig config;
  EXPECT_EQ(SetPatternParameter(config, "no_such_field", 1).code(),
            absl::StatusCode::kInvalidArgument);
  PatternFitOptions options;
  options.start.topic_strength = 1.0f;
  options.parameters = {{"topic_strength", 2.0, 4.0, false}};  // 1 lies outside
  auto outside = FitPatternModel(IndexScoreStatistics{}, options, nullptr);
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(outside.status().message().find("topic_strength starts at 1"), std::string::npos)
      << outside.status();
}

TEST(PatternFitTest, TheFitRecoversAPatternModelsOwnStatistics) {
  // The target: a pattern model with other strengths; the fit starts from SPIN Figure 1's. The
  // statistics, not the parameters, are what the fit recovers: at this size several parameter
  // sets give the same statistics. Coordinate descent is local, so the targets are seeds whose
  // minimum that start reaches (seed 5's, for one, it does not).
  for (const uint64_t seed : {1, 2, 3, 4}) {
    SCOPED_TRACE(seed);
    PatternModelConfig shape = SpinFigurePatternConfig();
    shape.num_layers = 2;
    shape.num_heads = 16;  // 4 positional heads, one per diagonal
    shape.head_dim = 16;
    shape.seed = seed;
    PatternModelConfig target = shape;
    target.topic_strength = 3.0f;
    target.recency_strength = 0.5f;
    target.salient_fraction = 0.05f;
    const IndexScoreWindow window{.n = 640, .rows = 8, .top_k = 64};
    auto target_model = PatternModel::Create(target);
    ASSERT_TRUE(target_model.ok()) << target_model.status();
    auto target_source =
        PatternScoreSource(std::make_shared<const PatternModel>(*std::move(target_model)));
    auto real = MeasureIndexScores(*target_source, window);
    ASSERT_TRUE(real.ok()) << real.status();

    PatternFitOptions options;
    options.window = window;
    options.start = shape;
    options.parameters = {{"topic_strength", 0.0, 32.0, false},
                          {"recency_strength", 0.0, 32.0, false},
                          {"salient_fraction", 0.0, 0.2, false}};
    options.max_rounds = 20;
    auto fit = FitPatternModel(*real, options, nullptr);
    ASSERT_TRUE(fit.ok()) << fit.status();
    EXPECT_GT(fit->start_distance, 0.04);
    EXPECT_LT(fit->fitted_distance, 0.05 * fit->start_distance)
        << fit->start_distance << " -> " << fit->fitted_distance;
    // The report's statistics are the fitted config's.
    auto fitted_model = PatternModel::Create(fit->config);
    ASSERT_TRUE(fitted_model.ok());
    auto again = MeasureIndexScores(
        *PatternScoreSource(std::make_shared<const PatternModel>(*std::move(fitted_model))),
        window);
    ASSERT_TRUE(again.ok());
    EXPECT_NEAR(StatisticsDistance(*again, *real), fit->fitted_distance, 1e-12);
  }
}

}  // namespace
}  // namespace dsa
