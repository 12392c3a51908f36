// Tests of `dsa eval` on a small configuration: the figures it reports must be consistent with the
// definitions (all-keep misses nothing, rho = 0 is all-keep, realized sparsity tracks the budget).
#include "tools/dsa/eval.h"

#include "gtest/gtest.h"

namespace dsa {
namespace {

EvalOptions Small() {
  EvalOptions o;
  o.context_slots = 4096;
  o.decode_steps = 8;
  o.num_layers = 2;
  o.num_heads = 16;
  o.head_dim = 32;
  o.top_k = 256;
  o.target_sparsities = {0.0, 0.5};
  o.exploration_fractions = {0.0};
  o.draft_length = 2;
  o.predictor_study = false;
  o.pattern = SpinFigurePatternConfig();  // SPIN misses a few slots of it at 4K
  return o;
}

const EvalRow* Find(const EvalReport& report, const std::string& kind, double rho) {
  for (const EvalRow& r : report.rows) {
    if (r.kind == kind && r.target_sparsity == rho) return &r;
  }
  return nullptr;
}

TEST(Eval, FiguresFollowTheirDefinitions) {
  auto report = RunEval(Small(), nullptr);
  ASSERT_TRUE(report.ok()) << report.status();
  const EvalRow* all_keep = Find(*report, "all-keep", 0.0);
  ASSERT_NE(all_keep, nullptr);
  EXPECT_EQ(all_keep->mean_miss_rate, 0.0);
  EXPECT_EQ(all_keep->p99_miss_rate, 0.0);
  EXPECT_EQ(all_keep->realized_block_sparsity, 0.0);
  EXPECT_EQ(all_keep->rows, 2 * 8);
  // 8 decode positions from 4096: blocks visible 65 at each step for 2 layers.
  EXPECT_EQ(all_keep->blocks_visible, 2 * 8 * 65);

  const EvalRow* rho0 = Find(*report, "spin", 0.0);
  ASSERT_NE(rho0, nullptr);
  EXPECT_EQ(rho0->mean_miss_rate, 0.0);
  EXPECT_EQ(rho0->blocks_scored, rho0->blocks_visible);

  const EvalRow* rho5 = Find(*report, "spin", 0.5);
  ASSERT_NE(rho5, nullptr);
  // Step 0 is the warm-up (65 blocks); later steps keep ceil(0.5 * 65) = 33 blocks.
  EXPECT_EQ(rho5->blocks_scored, 2 * (65 + 7 * 33));
  EXPECT_GT(rho5->mean_miss_rate, 0.0);
  EXPECT_LE(rho5->p99_miss_rate, 1.0);
  EXPECT_GE(rho5->p99_miss_rate, rho5->mean_miss_rate);

  const EvalRow* spec_all_keep = nullptr;
  for (const EvalRow& r : report->rows) {
    if (r.kind == "spec-all-keep") spec_all_keep = &r;
  }
  ASSERT_NE(spec_all_keep, nullptr);
  EXPECT_EQ(spec_all_keep->mean_miss_rate, 0.0);
  EXPECT_GE(spec_all_keep->mean_accepted, 0.0);
  EXPECT_LE(spec_all_keep->mean_accepted, 2.0);
  ASSERT_NE(Find(*report, "spec-union-prefix-valid", 0.5), nullptr);
  ASSERT_NE(Find(*report, "spec-row0", 0.5), nullptr);

  const nlohmann::json j = EvalReportToJson(*report);
  EXPECT_EQ(j["rows"].size(), report->rows.size());
  EXPECT_EQ(j["options"]["context_slots"], 4096);
  EXPECT_NE(EvalReportToMarkdown(*report).find("| all-keep |"), std::string::npos);
}

TEST(Eval, RejectsBadOptions) {
  EvalOptions o = Small();
  o.context_slots = 1000;
  EXPECT_EQ(RunEval(o, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  o = Small();
  o.target_sparsities = {1.0};
  EXPECT_EQ(RunEval(o, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  o = Small();
  o.draft_length = 5;
  EXPECT_EQ(RunEval(o, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dsa
