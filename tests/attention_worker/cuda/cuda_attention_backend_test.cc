// GPU tests of the CUDA attention backend (attention_worker/cuda/cuda_attention_backend.h): its
// outputs against the CPU sparse MLA decode (MlaSparseDecode) over the rows the CPU generators
// give (MlaKvRow, MlaAttentionQuery) for sequences of several lengths, selections with -1 and
// causally hidden entries; a full pool refused with nothing changed; and the attention engine on
// it over a co-located CPU indexer. Skipped without a GPU that runs the kernels.
#include "attention_worker/cuda/cuda_attention_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <vector>

#include "attention_worker/engine.h"
#include "attention_worker/mla_kv.h"
#include "attention_worker/mla_sparse_attention.h"
#include "gtest/gtest.h"
#include "indexer_service/cuda/cuda_scoring_device.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"
#include "transport/in_process_indexer_client.h"

namespace dsa::cuda {
namespace {

constexpr uint64_t kSeed = 21;
constexpr int kHeads = 128;
// Max |gpu - cpu| over a row set, relative to max |cpu| (bf16 inputs and output, fp32
// accumulation; the kernel's own test uses the same bound).
constexpr float kOutTolerance = 1e-2f;

// The CPU reference of one layer for rows (sequence length, position, selection).
struct RefRow {
  int64_t num_slots;
  int64_t position;
  std::vector<int32_t> selection;
};

std::vector<float> CpuLayer(int layer, const std::vector<RefRow>& rows, int top_k) {
  // A host pool with one contiguous block run per row's sequence.
  int64_t blocks = 0;
  std::vector<int64_t> first_block;
  int max_blocks = 0;
  for (const RefRow& row : rows) {
    first_block.push_back(blocks);
    const int64_t n = (row.num_slots + 63) / 64;
    blocks += n;
    max_blocks = std::max<int>(max_blocks, static_cast<int>(n));
  }
  std::vector<uint16_t> pool(static_cast<size_t>(blocks) * 64 * kMlaQkDim, 0);
  std::vector<int32_t> tables(rows.size() * max_blocks, 0), num_slots, positions, selections;
  std::vector<uint16_t> queries(rows.size() * kHeads * kMlaQkDim);
  for (size_t r = 0; r < rows.size(); ++r) {
    for (int64_t slot = 0; slot < rows[r].num_slots; ++slot) {
      const size_t at = static_cast<size_t>(first_block[r] * 64 + slot) * kMlaQkDim;
      EXPECT_TRUE(
          MlaKvRow(kSeed, layer, slot, std::span<uint16_t>(pool.data() + at, kMlaQkDim)).ok());
    }
    for (int j = 0; j < max_blocks; ++j) {
      tables[r * max_blocks + j] = static_cast<int32_t>(first_block[r] + j);
    }
    num_slots.push_back(static_cast<int32_t>(rows[r].num_slots));
    positions.push_back(static_cast<int32_t>(rows[r].position));
    selections.insert(selections.end(), rows[r].selection.begin(), rows[r].selection.end());
    EXPECT_TRUE(MlaAttentionQuery(kSeed, layer, rows[r].position,
                                  std::span<uint16_t>(queries.data() + r * kHeads * kMlaQkDim,
                                                      kHeads * kMlaQkDim))
                    .ok());
  }
  MlaSparseDecodeBatch batch;
  batch.num_heads = kHeads;
  batch.num_rows = static_cast<int>(rows.size());
  batch.top_k = top_k;
  batch.max_blocks_per_row = max_blocks;
  batch.num_physical_blocks = blocks;
  batch.kv_pool = pool;
  batch.query = queries;
  batch.block_tables = tables;
  batch.num_slots = num_slots;
  batch.positions = positions;
  batch.selections = selections;
  std::vector<float> out(rows.size() * kHeads * kMlaVDim), lse(rows.size() * kHeads);
  const absl::Status status = MlaSparseDecode(batch, out, lse);
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

void ExpectClose(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  ASSERT_EQ(gpu.size(), cpu.size());
  float max_ref = 0, max_err = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    max_ref = std::max(max_ref, std::abs(cpu[i]));
    const float err = std::abs(gpu[i] - cpu[i]);
    max_err = std::isnan(err) ? INFINITY : std::max(max_err, err);
  }
  EXPECT_GT(max_ref, 0.0f);
  EXPECT_LE(max_err, kOutTolerance * max_ref) << "max |cpu| " << max_ref;
}

class CudaAttentionBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::NoUsableGpu()) GTEST_SKIP() << "no GPU that runs the kernels";
  }
};

TEST_F(CudaAttentionBackendTest, LayerOutputsMatchTheCpuReference) {
  CudaAttentionBackendOptions options;
  options.num_model_layers = 3;
  options.seed = kSeed;
  options.capacity_slots = 1 << 14;
  auto backend = CreateCudaAttentionBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->output_values_per_row(), kHeads * kMlaVDim);
  // Two sequences grown in steps (so their blocks interleave in the pool), then a shrink.
  ASSERT_TRUE((*backend)->ResizeSequence(1, 100).ok());
  ASSERT_TRUE((*backend)->ResizeSequence(2, 3000).ok());
  ASSERT_TRUE((*backend)->ResizeSequence(1, 1500).ok());
  ASSERT_TRUE((*backend)->ResizeSequence(2, 2100).ok());
  constexpr int kTopK = 256;
  std::mt19937 rng(4);
  std::vector<RefRow> rows;
  for (auto [length, position] :
       {std::pair<int64_t, int64_t>{1500, 1499}, {2100, 2099}, {2100, 700}}) {
    RefRow row{length, position, std::vector<int32_t>(kTopK, -1)};
    std::uniform_int_distribution<int32_t> slot(0, static_cast<int32_t>(length - 1));
    for (int i = 0; i < kTopK - 20; ++i) row.selection[i] = slot(rng);  // some beyond position
    std::sort(row.selection.begin(), row.selection.end() - 20);
    row.selection.erase(std::unique(row.selection.begin(), row.selection.end() - 20),
                        row.selection.end() - 20);
    row.selection.resize(kTopK, -1);
    rows.push_back(row);
  }
  const uint64_t ids[] = {1, 2, 2};
  for (int layer = 0; layer < 3; ++layer) {
    std::vector<AttentionRowRef> refs;
    for (size_t r = 0; r < rows.size(); ++r) {
      refs.push_back({ids[r], rows[r].position, rows[r].selection});
    }
    std::vector<float> gpu(rows.size() * kHeads * kMlaVDim);
    const absl::Status status = (*backend)->AttendLayer(layer, refs, gpu);
    ASSERT_TRUE(status.ok()) << status;
    SCOPED_TRACE("layer " + std::to_string(layer));
    ExpectClose(gpu, CpuLayer(layer, rows, kTopK));
  }
  // A row past its sequence's slots is refused.
  const AttentionRowRef beyond{1, 1500, rows[0].selection};
  EXPECT_EQ((*backend)->AttendLayer(0, std::span<const AttentionRowRef>(&beyond, 1), {}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaAttentionBackendTest, AFullPoolIsRefusedAndChangesNothing) {
  CudaAttentionBackendOptions options;
  options.num_model_layers = 1;
  options.seed = kSeed;
  options.capacity_slots = 640;  // 10 blocks
  auto backend = CreateCudaAttentionBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  ASSERT_TRUE((*backend)->ResizeSequence(1, 600).ok());  // 10 blocks
  EXPECT_EQ((*backend)->ResizeSequence(2, 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*backend)->ResizeSequence(1, 641).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE((*backend)->ResizeSequence(1, 64).ok());   // frees 9 blocks
  ASSERT_TRUE((*backend)->ResizeSequence(2, 576).ok());  // takes them
  std::vector<int32_t> selection = {0, 5, 63};
  const AttentionRowRef row{1, 63, selection};
  std::vector<float> gpu(kHeads * kMlaVDim);
  ASSERT_TRUE((*backend)->AttendLayer(0, std::span<const AttentionRowRef>(&row, 1), gpu).ok());
  ExpectClose(gpu, CpuLayer(0, {{64, 63, selection}}, 3));
}

TEST_F(CudaAttentionBackendTest, TheEngineDecodesOnItOverACoLocatedIndexer) {
  auto schedule = MliSchedule::FromPattern("FSFS", 1);
  ASSERT_TRUE(schedule.ok());
  PatternModelConfig config;
  config.num_layers = 2;
  config.num_heads = 8;
  config.head_dim = 32;
  config.seed = 3;
  config.num_diagonals = 2;
  auto model = PatternModel::Create(config);
  ASSERT_TRUE(model.ok());
  CudaAttentionBackendOptions options;
  options.num_model_layers = 4;
  options.seed = kSeed;
  options.capacity_slots = 1 << 14;
  auto backend = CreateCudaAttentionBackend(options);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto indexer = Indexer::Create({1024, 8, 32});
  ASSERT_TRUE(indexer.ok());
  std::vector<std::vector<float>> outputs;
  std::vector<std::vector<int32_t>> selections;
  std::vector<int64_t> positions;
  AttentionEngineOptions engine_options;
  engine_options.observer = [&](const AttendedRow& row) {
    outputs.emplace_back(row.output.begin(), row.output.end());
    selections.emplace_back(row.selection.begin(), row.selection.end());
    positions.push_back(row.position);
  };
  auto engine =
      AttentionEngine::Create(*schedule, *model, std::move(*backend),
                              InProcessIndexerClient::Factory(indexer->get()), engine_options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  PrefillSpec spec;
  spec.sequence_id = 5;
  spec.context_length = 3000;
  spec.indexer_worker = kInProcessIndexerAddress;
  spec.top_k = 256;
  ASSERT_TRUE((*engine)->Prefill(spec).ok());
  const StepMember member{5, 1};
  for (int step = 0; step < 3; ++step) {
    auto result = (*engine)->DecodeStep(std::span<const StepMember>(&member, 1));
    ASSERT_TRUE(result.ok()) << result.status();
  }
  ASSERT_EQ(outputs.size(), 12u);  // 3 steps x 4 layers
  // Row 0 (layer 0, step 0) against the CPU reference over its own selection.
  ExpectClose(outputs[0], CpuLayer(0, {{3001, positions[0], selections[0]}}, 256));
  EXPECT_TRUE((*engine)->Release(5, false).ok());
}

// The co-located device-resident path on the GPU: the engine over a CUDA
// indexer on the same GPU, with the indexer queries generated on the GPU and the selections left
// there, gives the selections and outputs of the host path (device_selects off) for plain,
// speculative and committed steps of three sequences, at a tensor-core and a CUDA-core scan shape.
struct GpuObservation {
  uint64_t sequence_id;
  int layer;
  int64_t position;
  std::vector<int32_t> selection;
  std::vector<float> output;
};

std::vector<GpuObservation> RunOnGpu(int num_heads, int head_dim, bool device_selects,
                                     int* device_selects_seen) {
  auto schedule = MliSchedule::FromPattern("FSFSFS", 1);
  EXPECT_TRUE(schedule.ok());
  PatternModelConfig config;
  config.num_layers = 3;
  config.num_heads = num_heads;
  config.head_dim = head_dim;
  config.seed = 3;
  config.num_diagonals = 2;
  auto model = PatternModel::Create(config);
  EXPECT_TRUE(model.ok()) << model.status();
  CudaAttentionBackendOptions options;
  options.num_model_layers = 6;
  options.seed = kSeed;
  options.capacity_slots = 1 << 15;
  auto backend = CreateCudaAttentionBackend(options);
  EXPECT_TRUE(backend.ok()) << backend.status();
  auto device = CreateCudaScoringDevice(CudaScoringOptions{});
  EXPECT_TRUE(device.ok()) << device.status();
  IndexerOptions indexer_options;
  indexer_options.capacity_blocks = 4096;
  indexer_options.num_heads = num_heads;
  indexer_options.head_dim = head_dim;
  auto indexer = Indexer::Create(indexer_options, std::move(*device));
  EXPECT_TRUE(indexer.ok()) << indexer.status();
  std::vector<GpuObservation> observed;
  std::mutex mutex;
  AttentionEngineOptions engine_options;
  engine_options.device_selects = device_selects;
  engine_options.observer = [&](const AttendedRow& row) {
    std::lock_guard<std::mutex> lock(mutex);
    observed.push_back({row.sequence_id, row.model_layer, row.position,
                        std::vector<int32_t>(row.selection.begin(), row.selection.end()),
                        std::vector<float>(row.output.begin(), row.output.end())});
  };
  auto engine =
      AttentionEngine::Create(*schedule, *model, std::move(*backend),
                              InProcessIndexerClient::Factory(indexer->get()), engine_options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  std::vector<StepMember> plain, speculative;
  for (uint64_t id = 1; id <= 3; ++id) {
    PrefillSpec spec;
    spec.sequence_id = id;
    spec.context_length = 2500 + 1700 * static_cast<int64_t>(id);
    spec.indexer_worker = kInProcessIndexerAddress;
    spec.top_k = 512;
    spec.spin.target_block_sparsity = 0.4;
    EXPECT_TRUE((*engine)->Prefill(spec).ok());
    plain.push_back({id, 1});
    speculative.push_back({id, id == 2 ? 3 : 1});
  }
  *device_selects_seen = 0;
  auto step = [&](const std::vector<StepMember>& members) {
    auto result = (*engine)->DecodeStep(members);
    EXPECT_TRUE(result.ok()) << result.status();
    if (result.ok()) *device_selects_seen += result->device_selects;
  };
  for (int i = 0; i < 4; ++i) step(plain);
  step(speculative);
  EXPECT_TRUE((*engine)->Commit(2, 1).ok());
  for (int i = 0; i < 2; ++i) step(plain);
  return observed;
}

TEST_F(CudaAttentionBackendTest, DeviceResidentSelectsGiveTheHostPathsSelectionsAndOutputs) {
  for (auto [heads, dim] : {std::pair<int, int>{64, 128}, {8, 32}}) {
    SCOPED_TRACE(::testing::Message() << "H " << heads << " D " << dim);
    int host_device_selects = 0, device_device_selects = 0;
    const std::vector<GpuObservation> host = RunOnGpu(heads, dim, false, &host_device_selects);
    const std::vector<GpuObservation> device = RunOnGpu(heads, dim, true, &device_device_selects);
    EXPECT_EQ(host_device_selects, 0);
    EXPECT_EQ(device_device_selects, 7 * 3);  // every step's three full layers
    ASSERT_EQ(host.size(), 3u * 6 * 7 + 6 * 2);
    ASSERT_EQ(device.size(), host.size());
    int pruned_rows = 0;
    for (size_t i = 0; i < host.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "observation " << i);
      EXPECT_EQ(device[i].sequence_id, host[i].sequence_id);
      EXPECT_EQ(device[i].position, host[i].position);
      EXPECT_EQ(device[i].selection, host[i].selection);
      EXPECT_EQ(device[i].output, host[i].output);  // same kernels over the same selection
      pruned_rows += host[i].selection.back() == -1;
    }
    EXPECT_LT(pruned_rows, static_cast<int>(host.size()));
  }
}

}  // namespace
}  // namespace dsa::cuda
