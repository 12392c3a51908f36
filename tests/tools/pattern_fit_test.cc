// `dsa fit-pattern` (tools/dsa/pattern_fit.h): the index-score statistics on a source whose top-K
// is known by construction, the refusals, and the fit recovering a pattern model's own statistics
// from another start.
#include "tools/dsa/pattern_fit.h"

#include <cmath>
#include <filesystem>
#include <fstream>
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
  // Every slot of a newest run lies in a block the previous row's run touched.
  EXPECT_NEAR(s->block_step_overlap, 1.0, 1e-12);
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

// Every refusal of RunPatternFitStudy comes before the model loads: the model files here do not
// exist, so a refusal that came later would be NOT_FOUND.
TEST(PatternFitTest, AStudyRefusesBadOptionsBeforeLoadingTheModel) {
  PatternFitStudyOptions base;
  base.model_file = "/nonexistent/model.safetensors";
  base.indexer_weights = "/nonexistent/indexer.safetensors";
  base.heldout_tokens = "/nonexistent/heldout.npy";
  const auto refused = [](const PatternFitStudyOptions& o, const std::string& words) {
    auto study = RunPatternFitStudy(o, nullptr);
    EXPECT_EQ(study.status().code(), absl::StatusCode::kInvalidArgument) << words;
    EXPECT_NE(study.status().message().find(words), std::string::npos) << study.status();
  };
  PatternFitStudyOptions o = base;
  o.samples = 0;
  refused(o, "samples must be >= 1");
  o = base;
  o.fit.window.rows = 1;
  refused(o, "rows >= 2");
  o = base;
  o.fit.window = {.n = 600, .rows = 100, .top_k = 512};
  refused(o, "n - rows >= top_k");
  o = base;
  o.spin_decode_steps = -5;
  refused(o, "SPIN check steps");
  o = base;
  o.pattern_heads = 5;  // one positional head for four diagonals
  refused(o, "H = 5");

  const std::string path =
      (std::filesystem::path(::testing::TempDir()) / "pattern_fit_real_eval.json").string();
  o = base;
  o.real_eval_report = path;
  o.fit.window = {.n = 4096, .rows = 32, .top_k = 512};
  const std::string arms =
      R"("arms": [{"name": "spin", "spin": true, "exploration_fraction": 0.0, "lag_depth": 0,
                   "retention_stride": 1, "draft_length": 0, "miss_target": 0.0,
                   "target_block_sparsity": 0.4}])";
  for (const std::string& text :
       {std::string(R"({"options": 1, "perplexity": []})"), std::string(R"([1, 2])"),
        std::string("not json"),
        std::string(R"({"options": {"top_k": 512, "arms": [{"spin": "yes"}]}, "perplexity": []})"),
        R"({"options": {"top_k": 512, )" + arms +
            R"(}, "perplexity": [{"arm": "spin", "context": "4096"}]})"}) {
    std::ofstream(path) << text;
    refused(o, "is not a dsa eval --model smollm2 JSON report");
  }
  std::ofstream(path) << R"({"options": {"top_k": 256, )" << arms
                      << R"(}, "perplexity": [{"arm": "spin", "context": 4096}]})";
  refused(o, "was run with K = 256");
  std::ofstream(path) << R"({"options": {"top_k": 512, )" << arms
                      << R"(}, "perplexity": [{"arm": "spin", "context": 2048}]})";
  refused(o, "no fixed-rho SPIN cell (gamma 0) at context 4096; its cells' contexts: 2048");
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
