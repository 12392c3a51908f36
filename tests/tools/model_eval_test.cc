// `dsa eval --model smollm2`'s refusals (tools/dsa/model_eval.h): options out of range name the
// option, and a needles file that is missing or malformed is refused before any model work.
#include "tools/dsa/model_eval.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace dsa {
namespace {

void ExpectRefused(const ModelEvalOptions& options, const std::string& words) {
  const absl::Status status = ValidateModelEvalOptions(options);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << words;
  EXPECT_NE(status.message().find(words), std::string::npos) << status;
}

TEST(ModelEvalTest, OptionsOutOfRangeAreRefusedByName) {
  EXPECT_TRUE(ValidateModelEvalOptions(ModelEvalOptions{}).ok());
  ModelEvalOptions o;
  o.contexts = {};
  ExpectRefused(o, "no context lengths");
  o = ModelEvalOptions{};
  o.contexts = {1024, 63};
  ExpectRefused(o, "context 63");
  o = ModelEvalOptions{};
  o.samples = 0;
  ExpectRefused(o, "samples");
  o = ModelEvalOptions{};
  o.continuation = 1;
  ExpectRefused(o, "continuation");
  o = ModelEvalOptions{};
  o.top_k = 2049;
  ExpectRefused(o, "top_k");
  o = ModelEvalOptions{};
  o.device = "tpu";
  ExpectRefused(o, "device \"tpu\"");
  o = ModelEvalOptions{};
  o.arms = {};
  ExpectRefused(o, "no arms");
  o = ModelEvalOptions{};
  o.arms[1].target_block_sparsity = 1.0;
  ExpectRefused(o, o.arms[1].name);
  o = ModelEvalOptions{};
  o.arms[1].draft_length = 5;
  ExpectRefused(o, "draft length 5");
  o = ModelEvalOptions{};
  o.arms[1].miss_target = 0.05;  // all-keep: no rho to move
  ExpectRefused(o, "needs SPIN");
}

TEST(ModelEvalTest, TheDefaultArmsAreTheDocumentedOnes) {
  const std::vector<ModelEvalArm> arms = DefaultModelEvalArms();
  ASSERT_EQ(arms.size(), 20u);
  EXPECT_TRUE(arms[0].dense);
  EXPECT_EQ(arms[1].name, "all-keep");
  EXPECT_FALSE(arms[1].spin);
  int spin = 0, speculative = 0, adaptive = 0;
  for (const ModelEvalArm& arm : arms) {
    spin += arm.spin && arm.draft_length == 0 && arm.retention_stride == 1 && arm.miss_target == 0
                ? 1
                : 0;
    adaptive += arm.miss_target > 0 ? 1 : 0;
    speculative += arm.draft_length == 3 ? 1 : 0;
  }
  EXPECT_EQ(spin, 8);  // rho 0.2-0.5 x gamma 0, 0.05
  EXPECT_EQ(speculative, 3);
  EXPECT_EQ(adaptive, 2);
  EXPECT_EQ(QuickModelEvalArms().size(), 5u);
}

TEST(ModelEvalTest, AMissingOrMalformedNeedlesFileIsRefusedBeforeTheModelLoads) {
  ModelEvalOptions o;
  // Model files that do not exist: the needles are read first, so their error comes back.
  o.model_file = "/nonexistent/model.safetensors";
  o.indexer_weights = "/nonexistent/indexer.safetensors";
  o.heldout_tokens = "/nonexistent/heldout.npy";
  o.needles_file = "/nonexistent/needles.json";
  auto missing = RunModelEval(o, nullptr);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_NE(missing.status().message().find("/nonexistent/needles.json"), std::string::npos);
  const std::string path =
      (std::filesystem::path(::testing::TempDir()) / "model_eval_bad_needles.json").string();
  std::ofstream(path)
      << R"({"cases": [{"length": 3, "depth": 0.5, "tokens": [1, 2], "answer": [4]}]})";
  ModelEvalOptions with_file;
  with_file.needles_file = path;
  auto short_case = RunModelEval(with_file, nullptr);
  EXPECT_EQ(short_case.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(short_case.status().message().find("has 2 tokens"), std::string::npos)
      << short_case.status();
  std::ofstream(path) << "{\"format\": 1}";
  auto malformed = RunModelEval(with_file, nullptr);
  EXPECT_EQ(malformed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(malformed.status().message().find("not a needles file"), std::string::npos)
      << malformed.status();
}

TEST(ModelEvalTest, APartialReportSaysSoInBothForms) {
  ModelEvalReport report;
  report.device = "cpu";
  PerplexityCell cell;
  cell.arm = "dense";
  cell.context = 1024;
  cell.real_perplexity = 3.5;
  report.perplexity.push_back(cell);
  EXPECT_EQ(ModelEvalReportToJson(report)["complete"], false);
  EXPECT_NE(ModelEvalReportToMarkdown(report).find("Partial report"), std::string::npos);
  report.complete = true;
  EXPECT_EQ(ModelEvalReportToJson(report)["complete"], true);
  const std::string whole = ModelEvalReportToMarkdown(report);
  EXPECT_EQ(whole.find("Partial report"), std::string::npos);
  EXPECT_NE(whole.find("| 1024 | dense | 3.500 |"), std::string::npos) << whole;
}

}  // namespace
}  // namespace dsa
