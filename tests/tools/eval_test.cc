// Tests of `dsa eval` on a small configuration: the figures it reports must be consistent with the
// definitions (all-keep misses nothing, rho = 0 is all-keep, realized sparsity tracks the budget;
// the speculative arms' steps, rows and accepted drafts are the seeded acceptance model's).
#include "tools/dsa/eval.h"

#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/acceptance_model.h"
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

  // The speculative arms replay one seeded acceptance model: the same steps, rows and accepted
  // drafts in every arm, so every spec row's counts follow from the model alone. Each step verifies
  // d + 1 rows at t .. t + d (all in block 64: 65 blocks visible), then moves t by accepted + 1.
  const EvalOptions options = Small();
  auto acceptance =
      AcceptanceModel::Create(options.acceptance_rate, options.draft_length, options.seed);
  ASSERT_TRUE(acceptance.ok()) << acceptance.status();
  int64_t steps = 0, accepted = 0;
  for (int64_t t = options.context_slots; t < options.context_slots + options.decode_steps;) {
    const int a = acceptance->Accepted(static_cast<uint64_t>(steps));
    ++steps;
    accepted += a;
    t += a + 1;
  }
  ASSERT_GT(steps, 1);
  ASSERT_LT(steps, options.decode_steps);  // some drafts were accepted: the arms are speculative
  const int64_t spec_rows = int64_t{2} * (options.draft_length + 1) * steps;
  const int64_t spec_visible = 2 * steps * 65;
  // Row 0 shares its mask (33 blocks after the warm-up's 65) with every row; the union of the
  // rows' masks holds at least that many, short of every block.
  const int64_t row0_scored = 2 * (65 + (steps - 1) * 33);
  std::vector<const EvalRow*> spec;
  for (const EvalRow& r : report->rows) {
    if (r.kind.rfind("spec", 0) == 0) spec.push_back(&r);
  }
  ASSERT_EQ(spec.size(), 5u);  // all-keep, then two policies at rho 0 and 0.5
  for (const EvalRow* r : spec) {
    SCOPED_TRACE(r->name);
    EXPECT_EQ(r->rows, spec_rows);
    EXPECT_EQ(r->blocks_visible, spec_visible);
    EXPECT_DOUBLE_EQ(r->mean_accepted, static_cast<double>(accepted) / steps);
    EXPECT_GE(r->mean_miss_rate, 0.0);
    EXPECT_GE(r->p99_miss_rate, r->mean_miss_rate);
    EXPECT_LE(r->p99_miss_rate, 1.0);
    EXPECT_DOUBLE_EQ(r->realized_block_sparsity,
                     1.0 - static_cast<double>(r->blocks_scored) / r->blocks_visible);
    if (r->kind == "spec-all-keep" || r->target_sparsity == 0.0) {
      // All-keep, and rho = 0, which is all-keep: every block scored, nothing missed.
      EXPECT_EQ(r->blocks_scored, spec_visible);
      EXPECT_EQ(r->mean_miss_rate, 0.0);
      EXPECT_EQ(r->p99_miss_rate, 0.0);
    } else {
      EXPECT_EQ(r->target_sparsity, 0.5);
      EXPECT_GE(r->blocks_scored, row0_scored);
      EXPECT_LT(r->blocks_scored, spec_visible);
      EXPECT_GT(r->mean_miss_rate, 0.0);  // SPIN misses a few slots of this pattern at 4K
    }
  }
  EXPECT_EQ(spec[0]->kind, "spec-all-keep");
  const EvalRow* row0 = Find(*report, "spec-row0", 0.5);
  ASSERT_NE(row0, nullptr);
  EXPECT_EQ(row0->blocks_scored, row0_scored);
  ASSERT_NE(Find(*report, "spec-row0", 0.0), nullptr);
  ASSERT_NE(Find(*report, "spec-union-prefix-valid", 0.0), nullptr);

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
