// The pattern model's indexer inputs on the GPU (pattern_inputs.h) against the CPU generator
// (PatternModel::IndexKeys / PrefixBlockIndexKeys / IndexerQuery, SequenceIndexKeys), bit for bit
// (memcmp), over several seeds and configurations, every layer, slots and positions past 2^20 and
// 2^32 (and 2^40), prefix-block ids, both key modes. Outputs are poisoned (NaN) before each
// launch, so an unwritten element fails too.
#include "attention_worker/cuda/pattern_inputs.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "attention_worker/model_inputs.h"
#include "attention_worker/pattern_model.h"
#include "gtest/gtest.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"

namespace dsa::cuda {
namespace {

using ::dsa::cuda::testing::DeviceBuffer;
using ::dsa::cuda::testing::NoUsableGpu;

// The Box-Muller tables are seed-independent: built once for the whole binary.
struct BoxMuller {
  std::vector<float> radius, cosine;
  BoxMuller() { BoxMullerFirstNormalTables(&radius, &cosine); }
};
const BoxMuller& Tables() {
  static const BoxMuller* tables = new BoxMuller();
  return *tables;
}
const std::vector<float>& Radius() { return Tables().radius; }
const std::vector<float>& Cosine() { return Tables().cosine; }

// The first differing float of two arrays, for the failure message.
std::string FirstDifference(const std::vector<float>& gpu, const std::vector<float>& cpu, int dim) {
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (std::memcmp(&gpu[i], &cpu[i], sizeof(float)) != 0) {
      char text[160];
      std::snprintf(text, sizeof(text), "row %zu dim %zu: gpu %a cpu %a", i / dim, i % dim, gpu[i],
                    cpu[i]);
      return text;
    }
  }
  return "";
}

class Uploaded {
 public:
  explicit Uploaded(const PatternModel& model) {
    ok_ = UploadPatternTables(model.Tables(), Radius().data(), Cosine().data(), &tables_) ==
          cudaSuccess;
  }
  ~Uploaded() { FreePatternTables(&tables_); }
  bool ok() const { return ok_; }
  const PatternDeviceTables& tables() const { return tables_; }

 private:
  PatternDeviceTables tables_;
  bool ok_ = false;
};

std::vector<PatternModelConfig> Configs() {
  std::vector<PatternModelConfig> configs;
  PatternModelConfig base;
  base.seed = 1;
  configs.push_back(base);
  PatternModelConfig c = base;
  c.seed = 0xDEAD'BEEF'0000'0007ull;
  c.num_layers = 5;
  c.layer_correlation = 1.0f;  // no per-layer part
  c.shared_query_noise_fraction = 0.0f;
  c.topic_switch_rate = 1e-4f;
  configs.push_back(c);
  c = base;
  c.seed = 42;
  c.num_layers = 3;
  c.num_heads = 16;
  c.head_dim = 64;
  c.layer_correlation = 0.0f;  // no smooth part
  c.shared_query_noise_fraction = 1.0f;
  c.salient_fraction = 0.0f;
  c.topic_switch_rate = 0.0f;
  c.query_noise_steps = 1;
  c.num_diagonals = 2;
  configs.push_back(c);
  c = base;
  c.seed = 9;
  c.num_heads = 40;
  c.head_dim = 256;  // more than 32 pairs a lane
  c.num_sink_slots = 600;
  c.salient_fraction = 0.2f;
  c.layer_correlation_length = 3;
  configs.push_back(c);
  return configs;
}

TEST(PatternInputsTest, RangeKeysMatchSequenceIndexKeys) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  for (const PatternModelConfig& config : Configs()) {
    auto model = PatternModel::Create(config);
    ASSERT_TRUE(model.ok()) << model.status();
    Uploaded up(*model);
    ASSERT_TRUE(up.ok());
    const int dim = model->head_dim();
    const std::vector<uint64_t> ids = {5, 0x1234'5678'9abcull, 5, (uint64_t{1} << 63) + 3};
    DeviceBuffer d_ids = DeviceBuffer::From(ids);
    struct Range {
      int64_t first, count;
      bool with_prefix;
    };
    const std::vector<Range> ranges = {{0, 2600, true},
                                       {37, 700, true},
                                       {0, 3, false},
                                       {(1 << 20) - 100, 300, false},
                                       {(int64_t{1} << 32) - 50, 200, true},
                                       {(int64_t{1} << 40) + 7, 129, false}};
    for (int layer = 0; layer < model->num_layers(); ++layer) {
      for (const Range& r : ranges) {
        const size_t n = static_cast<size_t>(r.count) * dim;
        std::vector<float> cpu(n);
        const std::span<const uint64_t> prefix =
            r.with_prefix ? std::span<const uint64_t>(ids) : std::span<const uint64_t>();
        ASSERT_TRUE(SequenceIndexKeys(*model, prefix, layer, r.first, r.count, cpu).ok());
        DeviceBuffer d_keys(n * sizeof(float));
        DSA_CUDA_OK(cudaMemset(d_keys.as<void>(), 0xFF, n * sizeof(float)));
        PatternIndexKeysParams p;
        p.tables = up.tables();
        p.layer = layer;
        p.num_keys = r.count;
        p.first_slot = r.first;
        p.prefix_block_ids = r.with_prefix ? d_ids.as<uint64_t>() : nullptr;
        p.num_prefix_ids = r.with_prefix ? static_cast<int64_t>(ids.size()) : 0;
        p.keys = d_keys.as<float>();
        const char* why = nullptr;
        ASSERT_TRUE(CanImplementPatternIndexKeys(p, &why)) << why;
        DSA_CUDA_OK(LaunchPatternIndexKeys(p, nullptr));
        DSA_CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> gpu = d_keys.ToHost<float>();
        ASSERT_EQ(std::memcmp(gpu.data(), cpu.data(), n * sizeof(float)), 0)
            << "seed " << config.seed << " layer " << layer << " first " << r.first << ": "
            << FirstDifference(gpu, cpu, dim);
      }
    }
  }
}

TEST(PatternInputsTest, GatheredKeysMatchTheCpuPerKey) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  std::mt19937_64 rng(7);
  for (const PatternModelConfig& config : Configs()) {
    auto model = PatternModel::Create(config);
    ASSERT_TRUE(model.ok());
    Uploaded up(*model);
    ASSERT_TRUE(up.ok());
    const int dim = model->head_dim();
    const int kKeys = 3000;
    std::vector<int64_t> slots(kKeys);
    std::vector<uint64_t> block_ids(kKeys);
    std::vector<int32_t> offsets(kKeys);
    for (int j = 0; j < kKeys; ++j) {
      const int kind = j % 4;
      slots[j] = kind == 0   ? static_cast<int64_t>(rng() % 5000)
                 : kind == 1 ? static_cast<int64_t>(rng() >> 20)  // up to 2^44
                             : static_cast<int64_t>(rng() % (int64_t{1} << 34));
      offsets[j] = (j % 3 == 0) ? -1 : static_cast<int32_t>(rng() % 512);
      block_ids[j] = rng();
    }
    DeviceBuffer d_slots = DeviceBuffer::From(slots), d_ids = DeviceBuffer::From(block_ids),
                 d_offsets = DeviceBuffer::From(offsets);
    for (int layer = 0; layer < model->num_layers(); ++layer) {
      std::vector<float> cpu(static_cast<size_t>(kKeys) * dim);
      for (int j = 0; j < kKeys; ++j) {
        std::span<float> out(cpu.data() + static_cast<size_t>(j) * dim, dim);
        if (offsets[j] < 0) {
          ASSERT_TRUE(model->IndexKeys(layer, slots[j], 1, out).ok());
        } else {
          ASSERT_TRUE(
              model->PrefixBlockIndexKeys(layer, block_ids[j], offsets[j], slots[j], 1, out).ok());
        }
      }
      DeviceBuffer d_keys(cpu.size() * sizeof(float));
      DSA_CUDA_OK(cudaMemset(d_keys.as<void>(), 0xFF, d_keys.bytes()));
      PatternIndexKeysParams p;
      p.tables = up.tables();
      p.layer = layer;
      p.num_keys = kKeys;
      p.slots = d_slots.as<int64_t>();
      p.key_prefix_block_ids = d_ids.as<uint64_t>();
      p.key_prefix_offsets = d_offsets.as<int32_t>();
      p.keys = d_keys.as<float>();
      DSA_CUDA_OK(LaunchPatternIndexKeys(p, nullptr));
      DSA_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> gpu = d_keys.ToHost<float>();
      ASSERT_EQ(std::memcmp(gpu.data(), cpu.data(), cpu.size() * sizeof(float)), 0)
          << "seed " << config.seed << " layer " << layer << ": " << FirstDifference(gpu, cpu, dim);
    }
  }
}

TEST(PatternInputsTest, QueriesMatchIndexerQueryAndHeadWeightsMatch) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  std::mt19937_64 rng(11);
  for (const PatternModelConfig& config : Configs()) {
    auto model = PatternModel::Create(config);
    ASSERT_TRUE(model.ok());
    Uploaded up(*model);
    ASSERT_TRUE(up.ok());
    const int heads = model->num_heads(), dim = model->head_dim();
    std::vector<int64_t> positions = {0,
                                      1,
                                      7,
                                      8,
                                      9,
                                      31,
                                      32,
                                      100,
                                      2047,
                                      2048,
                                      2049,
                                      5000,
                                      65535,
                                      131072,
                                      1 << 20,
                                      (1 << 20) + 5,
                                      (int64_t{1} << 32) + 11,
                                      (int64_t{1} << 33) + 3,
                                      (int64_t{1} << 40) + 1};
    for (int i = 0; i < 40; ++i) positions.push_back(static_cast<int64_t>(rng() % 200000));
    std::vector<int32_t> layers;
    std::vector<int64_t> row_positions;
    for (int layer = 0; layer < model->num_layers(); ++layer) {
      for (int64_t t : positions) {
        layers.push_back(layer);
        row_positions.push_back(t);
      }
    }
    const int rows = static_cast<int>(layers.size());
    std::vector<float> cpu(static_cast<size_t>(rows) * heads * dim), weights(heads),
        weights_alone(heads);
    for (int r = 0; r < rows; ++r) {
      ASSERT_TRUE(
          model
              ->IndexerQuery(layers[r], row_positions[r],
                             std::span<float>(cpu.data() + static_cast<size_t>(r) * heads * dim,
                                              static_cast<size_t>(heads) * dim),
                             weights)
              .ok());
      ASSERT_TRUE(model->HeadWeights(layers[r], row_positions[r], weights_alone).ok());
      ASSERT_EQ(std::memcmp(weights.data(), weights_alone.data(), heads * sizeof(float)), 0);
    }
    DeviceBuffer d_layers = DeviceBuffer::From(layers),
                 d_positions = DeviceBuffer::From(row_positions);
    DeviceBuffer d_queries(cpu.size() * sizeof(float));
    DSA_CUDA_OK(cudaMemset(d_queries.as<void>(), 0xFF, d_queries.bytes()));
    PatternIndexerQueriesParams p;
    p.tables = up.tables();
    p.num_rows = rows;
    p.layers = d_layers.as<int32_t>();
    p.positions = d_positions.as<int64_t>();
    p.queries = d_queries.as<float>();
    const char* why = nullptr;
    ASSERT_TRUE(CanImplementPatternIndexerQueries(p, &why)) << why;
    DSA_CUDA_OK(LaunchPatternIndexerQueries(p, nullptr));
    DSA_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> gpu = d_queries.ToHost<float>();
    ASSERT_EQ(std::memcmp(gpu.data(), cpu.data(), cpu.size() * sizeof(float)), 0)
        << "seed " << config.seed << ": " << FirstDifference(gpu, cpu, heads * dim)
        << " (row = layer * " << positions.size() << " + position index)";
  }
}

TEST(PatternInputsTest, RefusesBadLaunches) {
  PatternIndexKeysParams keys;
  const char* why = nullptr;
  EXPECT_FALSE(CanImplementPatternIndexKeys(keys, &why));
  EXPECT_NE(why, nullptr);
  EXPECT_EQ(LaunchPatternIndexKeys(keys, nullptr), cudaErrorInvalidValue);
  PatternIndexerQueriesParams queries;
  EXPECT_FALSE(CanImplementPatternIndexerQueries(queries));
  if (NoUsableGpu()) return;
  auto model = PatternModel::Create(PatternModelConfig{});
  ASSERT_TRUE(model.ok());
  Uploaded up(*model);
  ASSERT_TRUE(up.ok());
  keys.tables = up.tables();
  keys.layer = model->num_layers();
  EXPECT_FALSE(CanImplementPatternIndexKeys(keys));
  keys.layer = 0;
  keys.num_keys = 4;
  EXPECT_FALSE(CanImplementPatternIndexKeys(keys));  // no output
  PatternTables bad = model->Tables();
  bad.rope_theta.pop_back();
  PatternDeviceTables t;
  EXPECT_EQ(UploadPatternTables(bad, Radius().data(), Cosine().data(), &t), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace dsa::cuda
