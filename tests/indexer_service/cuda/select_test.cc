// Tests of the whole select on the GPU (indexer_service/cuda/select.h) against the CPU engine's
// parts step by step: SpinState::Plan (warm-up, budget, forced blocks, exploration, union of
// verifier rows), ScoreBlocks, SelectTopK and SpinState::Update. Keys and queries are small
// integers (device_workload.h), so every score is exact in fp32 whatever the accumulation order:
// the scored blocks, the scores, the selections and V and D must all match bit for bit. Also: a
// CUDA graph of the launch replays to the same results. Skips without a usable GPU.
#include "indexer_service/cuda/select.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/index_key_cache.h"
#include "indexer_service/spin.h"
#include "indexer_service/topk.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"
#include "tests/indexer_service/device_workload.h"

namespace dsa::cuda {
namespace {

using testing::DeviceBuffer;
using testing::NoUsableGpu;
using testing::ToBf16Bits;
using testing_workload::ExactKeys;
using testing_workload::ExactRow;
using testing_workload::MakeExactRow;

constexpr int kHeads = 16;
constexpr int kDim = 64;

// One group of the test batch: a sequence (one layer) with its CPU SPIN state and the GPU's V / D.
struct Group {
  uint64_t id = 0;
  int rows = 1;  // verifier rows of its steps (1 = plain decode)
  SpinState spin;
  DeviceBuffer vertical, diagonal;  // fp32 [capacity], zero at start
  int64_t capacity = 0;
};

class SelectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  }

  // Builds `lengths.size()` groups, prefills each, then runs `steps` selects (a group's first is
  // its warm-up), appending `rows` keys per group before each later step, and compares each
  // step's GPU results with the CPU's. Group g joins the batch at step join_step[g] (all at step 0
  // when empty), so a step can mix groups in their warm-up with groups planned by SPIN.
  void Run(const std::vector<int64_t>& lengths, const std::vector<int>& rows_per_group,
           const SpinConfig& config, int top_k, int steps, bool through_graph,
           const std::vector<int>& join_step = {}) {
    std::mt19937 rng(17);
    int64_t capacity_blocks = 0;
    for (int64_t n : lengths) capacity_blocks += CeilDiv(n + steps * 4 + 64, kBlockSize) + 1;
    auto cache = IndexKeyCache::Create(capacity_blocks, kDim);
    ASSERT_TRUE(cache.ok());
    std::vector<Group> groups;
    auto join = [&](size_t g) {
      SpinConfig c = config;
      c.seed = 1000 + g;  // as if mixed with the sequence id
      Group group{g + 1, rows_per_group[g], SpinState(c, top_k, 3), {}, {}, 0};
      group.capacity = lengths[g] + steps * 4 + 64;
      std::vector<float> zeros(group.capacity, 0.0f);
      group.vertical = DeviceBuffer::From(zeros);
      group.diagonal = DeviceBuffer::From(zeros);
      ASSERT_TRUE(cache->AddSequence(group.id, 1).ok());
      const std::vector<float> keys = ExactKeys(rng, lengths[g], kDim);
      ASSERT_TRUE(cache->Append(group.id, 0, keys, lengths[g]).ok());
      groups.push_back(std::move(group));
    };
    for (int step = 0; step < steps; ++step) {
      if (step > 0) {
        for (Group& group : groups) {
          const std::vector<float> keys = ExactKeys(rng, group.rows, kDim);
          ASSERT_TRUE(cache->Append(group.id, 0, keys, group.rows).ok());
        }
      }
      for (size_t g = 0; g < lengths.size(); ++g) {
        if ((join_step.empty() ? 0 : join_step[g]) == step) join(g);
        if (HasFatalFailure()) return;
      }
      RunStep(*cache, groups, config, top_k, rng, through_graph, step);
      if (HasFatalFailure()) return;
    }
  }

  void RunStep(const IndexKeyCache& cache, std::vector<Group>& groups, const SpinConfig& config,
               int top_k, std::mt19937& rng, bool through_graph, int step) {
    const int num_groups = static_cast<int>(groups.size());
    std::vector<int32_t> group_first_row{0}, block_tables;
    std::vector<int64_t> group_table_offset, group_num_slots, row_position, capacity;
    std::vector<SelectPlan> plan;
    std::vector<float*> vertical, diagonal;
    std::vector<uint64_t> seeds;
    std::vector<uint16_t> query;
    std::vector<float> weights;
    std::vector<ExactRow> rows;
    int64_t max_visible_blocks = 1;
    // CPU: plan, scores, top-K, update.
    std::vector<std::vector<int32_t>> want_blocks, want_selection;
    std::vector<std::vector<float>> want_scores;
    for (int g = 0; g < num_groups; ++g) {
      Group& group = groups[g];
      auto view = cache.View(group.id, 0);
      ASSERT_TRUE(view.ok());
      group_table_offset.push_back(static_cast<int64_t>(block_tables.size()));
      block_tables.insert(block_tables.end(), view->block_table.begin(), view->block_table.end());
      group_num_slots.push_back(view->num_slots);
      plan.push_back(group.spin.warmup_pending() ? SelectPlan::kAllBlocks : SelectPlan::kSpin);
      vertical.push_back(group.vertical.as<float>());
      diagonal.push_back(group.diagonal.as<float>());
      capacity.push_back(group.capacity);
      seeds.push_back(1000 + g);
      std::vector<int64_t> positions;
      std::vector<IndexerRow> cpu_rows;
      const size_t first = rows.size();
      for (int r = 0; r < group.rows; ++r) {
        rows.push_back(MakeExactRow(rng, kHeads, kDim));
        positions.push_back(view->num_slots - group.rows + r);
      }
      for (int r = 0; r < group.rows; ++r) {
        const ExactRow& row = rows[first + r];
        cpu_rows.push_back(row.row(positions[r]));
        row_position.push_back(positions[r]);
        for (float q : row.query) query.push_back(ToBf16Bits(q));
        weights.insert(weights.end(), row.weights.begin(), row.weights.end());
        max_visible_blocks = std::max(max_visible_blocks, CeilDiv(positions[r] + 1, kBlockSize));
      }
      group_first_row.push_back(static_cast<int32_t>(row_position.size()));
      const BlockPlan cpu_plan = group.spin.Plan(positions);
      std::vector<float> scores(group.rows * cpu_plan.blocks.size() * kBlockSize);
      ScoreBlocks(*view, cpu_plan.blocks, cpu_rows, kHeads, scores);
      const size_t stride = cpu_plan.blocks.size() * kBlockSize;
      for (int r = 0; r < group.rows; ++r) {
        std::vector<int32_t> selection(top_k);
        SelectTopK(std::span<const float>(scores).subspan(r * stride, stride), cpu_plan.blocks,
                   positions[r], selection);
        want_selection.push_back(std::move(selection));
        want_scores.emplace_back(scores.begin() + r * stride, scores.begin() + (r + 1) * stride);
      }
      if (group.rows == 1) group.spin.Update(positions[0], cpu_plan.blocks, scores);
      want_blocks.push_back(cpu_plan.blocks);
    }
    // GPU.
    const BlockPool& pool = cache.pool();
    std::vector<uint8_t> pool_bytes(pool.keys(0),
                                    pool.keys(0) + pool.capacity_blocks() * pool.block_bytes());
    DeviceBuffer d_pool = DeviceBuffer::From(pool_bytes);
    DeviceBuffer d_first_row = DeviceBuffer::From(group_first_row);
    DeviceBuffer d_table_offset = DeviceBuffer::From(group_table_offset);
    DeviceBuffer d_tables = DeviceBuffer::From(block_tables);
    DeviceBuffer d_num_slots = DeviceBuffer::From(group_num_slots);
    DeviceBuffer d_query = DeviceBuffer::From(query);
    DeviceBuffer d_weights = DeviceBuffer::From(weights);
    DeviceBuffer d_position = DeviceBuffer::From(row_position);
    DeviceBuffer d_plan = DeviceBuffer::From(plan);
    DeviceBuffer d_vertical = DeviceBuffer::From(vertical);
    DeviceBuffer d_diagonal = DeviceBuffer::From(diagonal);
    DeviceBuffer d_capacity = DeviceBuffer::From(capacity);
    DeviceBuffer d_seeds = DeviceBuffer::From(seeds);
    const int num_rows = static_cast<int>(row_position.size());
    DeviceBuffer d_selection(sizeof(int32_t) * num_rows * top_k);
    DeviceBuffer d_scores(sizeof(float) * num_rows * max_visible_blocks * kBlockSize);
    DeviceBuffer d_score_offset(sizeof(int64_t) * num_rows);
    DeviceBuffer d_blocks(sizeof(int32_t) * num_groups * max_visible_blocks);
    DeviceBuffer d_block_offset(sizeof(int64_t) * (num_groups + 1));
    SelectParams p;
    p.pool = d_pool.as<uint8_t>();
    p.head_dim = kDim;
    p.num_heads = kHeads;
    p.num_groups = num_groups;
    p.num_rows = num_rows;
    p.group_first_row = d_first_row.as<int32_t>();
    p.group_table_offset = d_table_offset.as<int64_t>();
    p.block_tables = d_tables.as<int32_t>();
    p.group_num_slots = d_num_slots.as<int64_t>();
    p.query = d_query.as<void>();
    p.head_weights = d_weights.as<float>();
    p.row_position = d_position.as<int64_t>();
    p.group_plan = d_plan.as<SelectPlan>();
    p.vertical = d_vertical.as<float* const>();
    p.diagonal = d_diagonal.as<float* const>();
    p.spin_capacity = d_capacity.as<int64_t>();
    p.group_seed = d_seeds.as<uint64_t>();
    p.top_k = top_k;
    p.target_block_sparsity = config.target_block_sparsity;
    p.exploration_fraction = config.exploration_fraction;
    p.ema_decay = config.ema_decay;
    p.layer = 3;
    p.max_visible_blocks = max_visible_blocks;
    p.host_all_blocks = std::all_of(plan.begin(), plan.end(),
                                    [](SelectPlan x) { return x == SelectPlan::kAllBlocks; });
    p.host_no_all_blocks = std::none_of(plan.begin(), plan.end(),
                                        [](SelectPlan x) { return x == SelectPlan::kAllBlocks; });
    p.selection = d_selection.as<int32_t>();
    p.scores = d_scores.as<float>();
    p.row_score_offset = d_score_offset.as<int64_t>();
    p.group_blocks = d_blocks.as<int32_t>();
    p.group_block_offset = d_block_offset.as<int64_t>();
    DeviceBuffer workspace(SelectScratchBytes(p));
    p.workspace = workspace.as<void>();
    p.workspace_bytes = workspace.bytes();
    const char* why = "";
    ASSERT_TRUE(CanImplementSelect(p, &why)) << why;
    cudaStream_t stream;
    DSA_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    if (through_graph) {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      DSA_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const cudaError_t launched = LaunchSelect(p, stream);
      DSA_CUDA_OK(cudaStreamEndCapture(stream, &graph));
      DSA_CUDA_OK(launched);
      DSA_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      DSA_CUDA_OK(cudaGraphLaunch(exec, stream));
      DSA_CUDA_OK(cudaStreamSynchronize(stream));
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    } else {
      DSA_CUDA_OK(LaunchSelect(p, stream));
      DSA_CUDA_OK(cudaStreamSynchronize(stream));
    }
    cudaStreamDestroy(stream);
    const std::vector<int32_t> selection = d_selection.ToHost<int32_t>();
    const std::vector<float> scores = d_scores.ToHost<float>();
    const std::vector<int64_t> score_offset = d_score_offset.ToHost<int64_t>();
    const std::vector<int32_t> blocks = d_blocks.ToHost<int32_t>();
    const std::vector<int64_t> block_offset = d_block_offset.ToHost<int64_t>();
    int row = 0;
    for (int g = 0; g < num_groups; ++g) {
      const std::vector<int32_t> got_blocks(blocks.begin() + block_offset[g],
                                            blocks.begin() + block_offset[g + 1]);
      EXPECT_EQ(got_blocks, want_blocks[g]) << "step " << step << " group " << g;
      for (int r = 0; r < groups[g].rows; ++r, ++row) {
        const std::vector<int32_t> got(selection.begin() + row * top_k,
                                       selection.begin() + (row + 1) * top_k);
        EXPECT_EQ(got, want_selection[row]) << "step " << step << " group " << g << " row " << r;
        const std::vector<float> got_scores(
            scores.begin() + score_offset[row],
            scores.begin() + score_offset[row] + want_scores[row].size());
        EXPECT_EQ(got_scores, want_scores[row]) << "step " << step << " group " << g;
      }
      std::vector<float> want_v = groups[g].spin.vertical(), want_d = groups[g].spin.diagonal();
      want_v.resize(groups[g].capacity, 0.0f);
      want_d.resize(groups[g].capacity, 0.0f);
      EXPECT_EQ(groups[g].vertical.ToHost<float>(), want_v) << "V, step " << step << " group " << g;
      EXPECT_EQ(groups[g].diagonal.ToHost<float>(), want_d) << "D, step " << step << " group " << g;
    }
  }
};

SpinConfig Config(double rho, double gamma) {
  SpinConfig config;
  config.target_block_sparsity = rho;
  config.exploration_fraction = gamma;
  return config;
}

TEST_F(SelectTest, MatchesTheCpuOverContextLengthsWithExploration) {
  const std::vector<int64_t> lengths = {1, 63, 64, 65, 2047, 2048, 2049, 16385};
  Run(lengths, std::vector<int>(lengths.size(), 1), Config(0.4, 0.05), 256, 5, false);
}

TEST_F(SelectTest, MatchesTheCpuWithVerifierRowsInTheBatch) {
  // Groups of 1 to 4 verifier rows: the union is scored, only one-row groups update.
  Run({3000, 5000, 700, 9000}, {1, 2, 3, 4}, Config(0.5, 0.05), 512, 4, false);
}

TEST_F(SelectTest, MatchesTheCpuAtEveryTargetSparsityWithKOf2048) {
  for (double rho : {0.0, 0.3, 0.4, 0.5}) {
    SCOPED_TRACE(rho);
    Run({131072, 20000}, {1, 1}, Config(rho, 0.05), 2048, 3, false);
  }
}

TEST_F(SelectTest, MatchesTheCpuPastAMillionSlots) {
  // 16,384 blocks (the plan in shared memory) and 16,386 (the plan's workspace path).
  Run({1048576, 1048576 + 65}, {1, 1}, Config(0.4, 0.05), 2048, 2, false);
}

TEST_F(SelectTest, SixtyFourGroupsThroughACudaGraph) {
  std::vector<int64_t> lengths(64);
  for (int g = 0; g < 64; ++g) lengths[g] = 1500 + 131 * g;
  Run(lengths, std::vector<int>(64, 1), Config(0.4, 0.2), 256, 3, true);
}

TEST_F(SelectTest, LaysOutMoreGroupsThanOneLayoutCtaHolds) {
  // Past kLayoutThreads (1,024) groups the layout and the lists take two launches (LayoutKernel,
  // CompactKernel) instead of one; one- and two-row groups, the warm-up and then SPIN.
  std::vector<int64_t> lengths(1100);
  std::vector<int> rows(1100);
  for (int g = 0; g < 1100; ++g) {
    lengths[g] = 200 + 37 * (g % 40);
    rows[g] = 1 + g % 2;
  }
  Run(lengths, rows, Config(0.4, 0.1), 64, 3, false);
}

TEST_F(SelectTest, MixesGroupsInTheirWarmUpWithSpinGroups) {
  // Groups that join at step 1 or 2 take every block (their warm-up) in the same batch as groups
  // planned by SPIN: the fill beside the plan, then the layout of both. With verifier rows (the
  // union) and with one row a group (the plans are the unions).
  Run({3000, 5000, 7000, 900, 2100}, {1, 2, 1, 3, 1}, Config(0.4, 0.05), 256, 4, false,
      {0, 0, 1, 1, 2});
  Run({3000, 5000, 7000, 900}, {1, 1, 1, 1}, Config(0.4, 0.05), 256, 3, true, {0, 1, 1, 2});
}

TEST(SelectCheckTest, RefusesWhatItCannotRun) {
  SelectParams p;
  p.num_groups = 1;
  p.num_rows = 1;
  p.top_k = 4096;
  const char* why = "";
  EXPECT_FALSE(CanImplementSelect(p, &why));
  EXPECT_NE(std::string(why).find("top_k"), std::string::npos) << why;
  p.top_k = 64;
  p.query_dtype = QueryDtype::kFloat32;
  EXPECT_FALSE(CanImplementSelect(p, &why));
  EXPECT_EQ(LaunchSelect(p, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace dsa::cuda
