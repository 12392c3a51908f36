// The real model's GPU runner (attention_worker/cuda/llama_cuda_runner.h) against the CPU runner
// (LlamaForward) on random models: dense prefill, one-row decode, verifier rows, sparse rows over
// selections with -1 padding, batched caches, truncate and copy, the indexer inputs, and the
// refusals. Two models: the tiny one of llama_model_test (head_dim 8: every row through the split
// decode kernel) and a small one of SmolLM2's head shape (head_dim 64, 3 query heads a KV head: the
// prefill kernel for long dense groups). With DSA_SMOLLM2_MODEL and DSA_SMOLLM2_INDEXER set (the
// converted model files), also SmolLM2-135M itself. Skips without a GPU.
//
// Tolerances (fp32 everywhere; the two runners differ only in the order of fp32 sums):
// logits and indexer inputs within 1e-4 x max(1, max |CPU value|) on the random models, and
// 2e-3 x max(1, max |CPU logit|) on SmolLM2 (30 layers), whose greedy tokens must also agree.
#include "attention_worker/cuda/llama_cuda_runner.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/llama_model.h"
#include "attention_worker/llama_runner.h"
#include "gtest/gtest.h"
#include "tests/attention_worker/random_llama.h"

namespace dsa {
namespace {

// llama_model_test's tiny shape.
std::shared_ptr<const LlamaModel> TinyModel() {
  const LlamaConfig c = testing::TinyLlamaConfig(3, 64);
  return testing::RandomLlamaModel(c, testing::TinyIndexerConfig(c), 7);
}

// SmolLM2's attention shape (head_dim 64, 3 query heads a KV head), small elsewhere.
std::shared_ptr<const LlamaModel> SmolShapedModel() {
  LlamaConfig c = testing::TinyLlamaConfig(2, 700);
  c.d_model = 96;
  c.num_heads = 6;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.ffn_dim = 160;
  c.vocab_size = 300;
  c.rope_base = 100000.0;
  LightningIndexerConfig ic = testing::TinyIndexerConfig(c, 4, 32);
  ic.query_rank = 16;
  ic.rope_dims = 16;
  ic.rope_base = 100000.0;
  return testing::RandomLlamaModel(c, ic, 8);
}

double MaxAbs(const std::vector<float>& v) {
  double peak = 0;
  for (float x : v) peak = std::max(peak, std::abs(static_cast<double>(x)));
  return peak;
}

// |gpu - cpu| <= relative * max(1, max |cpu|) everywhere (reports the first few misses).
void ExpectClose(const std::vector<float>& gpu, const std::vector<float>& cpu, double relative,
                 const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  const double tolerance = relative * std::max(1.0, MaxAbs(cpu));
  int bad = 0;
  double worst = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double diff = std::abs(static_cast<double>(gpu[i]) - cpu[i]);
    worst = std::max(worst, std::isnan(diff) ? INFINITY : diff);
    if (!(diff <= tolerance) && bad++ < 3) {
      ADD_FAILURE() << what << ": value " << i << " gpu " << gpu[i] << " cpu " << cpu[i]
                    << " (tolerance " << tolerance << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what << ": worst difference " << worst << " of tolerance " << tolerance;
}

// The same caches on both runners, and passes driven identically on both.
class Twin {
 public:
  explicit Twin(std::shared_ptr<const LlamaModel> model) : model_(model) {
    cpu_ = MakeCpuLlamaRunner(model);
    auto gpu = cuda::CreateCudaLlamaRunner(model);
    EXPECT_TRUE(gpu.ok()) << gpu.status();
    if (gpu.ok()) gpu_ = *gpu;
  }
  bool ok() const { return gpu_ != nullptr; }
  const LlamaConfig& config() const { return model_->config(); }
  LlamaRunner& cpu() { return *cpu_; }
  LlamaRunner& gpu() { return *gpu_; }

  // A new cache on each runner; returns its index.
  int NewCache() {
    cpu_caches_.push_back(*cpu_->NewCache());
    gpu_caches_.push_back(*gpu_->NewCache());
    return static_cast<int>(cpu_caches_.size()) - 1;
  }
  LlamaSequenceCache& cpu_cache(int i) { return *cpu_caches_[i]; }
  LlamaSequenceCache& gpu_cache(int i) { return *gpu_caches_[i]; }

  struct Row {
    int cache = 0;
    int32_t token = 0;
  };
  // selection(layer, row index, position): empty = dense.
  using SelectionFn = std::function<std::vector<int32_t>(int, int, int64_t)>;

  // Runs one pass of `rows` (positions from each cache's length, in row order) on both runners,
  // compares the indexer inputs of every layer and the logits of every row.
  void RunAndCompare(const std::vector<Row>& rows, const SelectionFn& selection,
                     const std::string& what, double relative = 1e-4) {
    SCOPED_TRACE(what);
    std::vector<LlamaRunnerRow> cpu_rows, gpu_rows;
    std::vector<int64_t> next(cpu_caches_.size());
    for (size_t i = 0; i < cpu_caches_.size(); ++i) next[i] = cpu_caches_[i]->num_slots();
    std::vector<int64_t> positions;
    for (const Row& row : rows) {
      const int64_t position = next[row.cache]++;
      positions.push_back(position);
      cpu_rows.push_back({cpu_caches_[row.cache].get(), position, row.token});
      gpu_rows.push_back({gpu_caches_[row.cache].get(), position, row.token});
    }
    auto cpu_pass = cpu_->Begin(cpu_rows);
    auto gpu_pass = gpu_->Begin(gpu_rows);
    ASSERT_TRUE(cpu_pass.ok()) << cpu_pass.status();
    ASSERT_TRUE(gpu_pass.ok()) << gpu_pass.status();
    const int n = static_cast<int>(rows.size());
    const LightningIndexerConfig& ic = model_->indexer_config();
    for (int layer = 0; layer < config().num_layers; ++layer) {
      std::vector<std::vector<float>> inputs[2];
      for (int side = 0; side < 2; ++side) {
        inputs[side] = {std::vector<float>(n * ic.num_heads * ic.head_dim),
                        std::vector<float>(n * ic.num_heads), std::vector<float>(n * ic.head_dim)};
        LlamaPass& pass = side == 0 ? **cpu_pass : **gpu_pass;
        const absl::Status status =
            pass.IndexerInputs(inputs[side][0], inputs[side][1], inputs[side][2]);
        ASSERT_TRUE(status.ok()) << status;
      }
      const char* names[] = {"indexer queries", "head weights", "index keys"};
      for (int i = 0; i < 3; ++i) {
        ExpectClose(inputs[1][i], inputs[0][i], relative,
                    absl::StrCat(names[i], " of layer ", layer));
      }
      std::vector<std::vector<int32_t>> owned;
      std::vector<std::span<const int32_t>> spans;
      if (selection) {
        for (int r = 0; r < n; ++r) owned.push_back(selection(layer, r, positions[r]));
        for (const auto& s : owned) spans.emplace_back(s);
      }
      const absl::Status cpu_status = (*cpu_pass)->RunLayer(spans);
      const absl::Status gpu_status = (*gpu_pass)->RunLayer(spans);
      ASSERT_TRUE(cpu_status.ok()) << cpu_status;
      ASSERT_TRUE(gpu_status.ok()) << gpu_status;
    }
    std::vector<int32_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    std::vector<float> cpu_logits(n * config().vocab_size), gpu_logits(cpu_logits.size());
    ASSERT_TRUE((*cpu_pass)->Logits(all, cpu_logits).ok());
    const absl::Status status = (*gpu_pass)->Logits(all, gpu_logits);
    ASSERT_TRUE(status.ok()) << status;
    ExpectClose(gpu_logits, cpu_logits, relative, "logits");
    // Greedy tokens agree wherever the CPU's top two logits are further apart than the tolerance.
    const int vocab = config().vocab_size;
    const double tolerance = relative * std::max(1.0, MaxAbs(cpu_logits));
    for (int r = 0; r < n; ++r) {
      const float* c = &cpu_logits[static_cast<size_t>(r) * vocab];
      const float* g = &gpu_logits[static_cast<size_t>(r) * vocab];
      const int cpu_top = static_cast<int>(std::max_element(c, c + vocab) - c);
      const int gpu_top = static_cast<int>(std::max_element(g, g + vocab) - g);
      float second = -INFINITY;
      for (int i = 0; i < vocab; ++i) {
        if (i != cpu_top) second = std::max(second, c[i]);
      }
      if (c[cpu_top] - second > 2 * tolerance) {
        EXPECT_EQ(gpu_top, cpu_top) << "row " << r << "'s greedy token";
      }
    }
    for (size_t i = 0; i < cpu_caches_.size(); ++i) {
      EXPECT_EQ(gpu_caches_[i]->num_slots(), cpu_caches_[i]->num_slots()) << "cache " << i;
    }
  }

  std::vector<Row> Tokens(int cache, int n, uint32_t seed) const {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int32_t> token(0, config().vocab_size - 1);
    std::vector<Row> rows(n);
    for (Row& row : rows) row = {cache, token(rng)};
    return rows;
  }

 private:
  std::shared_ptr<const LlamaModel> model_;
  std::shared_ptr<LlamaRunner> cpu_;
  std::shared_ptr<LlamaRunner> gpu_;
  std::vector<std::unique_ptr<LlamaSequenceCache>> cpu_caches_;
  std::vector<std::unique_ptr<LlamaSequenceCache>> gpu_caches_;
};

// A selection of K distinct slots in [0, position] (all when K > position) with -1 padding mixed
// in, seeded by (layer, row, position).
std::vector<int32_t> Selection(int k, int layer, int row, int64_t position) {
  std::mt19937 rng(static_cast<uint32_t>(1000 * layer + 37 * row + position));
  std::vector<int32_t> slots(position + 1);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(std::min<int64_t>(k, position + 1));
  slots.push_back(-1);
  if (k > 3) slots.insert(slots.begin() + 1, -1);
  return slots;
}

enum class Model { kTiny, kSmolShaped };

class LlamaCudaRunnerTest : public ::testing::TestWithParam<Model> {
 protected:
  void SetUp() override {
    if (cuda::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    twin_ = std::make_unique<Twin>(GetParam() == Model::kTiny ? TinyModel() : SmolShapedModel());
    ASSERT_TRUE(twin_->ok());
  }
  bool tiny() const { return GetParam() == Model::kTiny; }
  // A prompt long enough to use the prefill kernel on the SmolLM2-shaped model.
  int prompt() const { return tiny() ? 40 : 300; }
  std::unique_ptr<Twin> twin_;
};

TEST_P(LlamaCudaRunnerTest, DensePrefillAndDecodeEqualTheCpu) {
  const int a = twin_->NewCache();
  twin_->RunAndCompare(twin_->Tokens(a, prompt(), 1), nullptr, "prefill");
  for (int step = 0; step < 3; ++step) {
    twin_->RunAndCompare(twin_->Tokens(a, 1, 10 + step), nullptr,
                         absl::StrCat("one-row decode ", step));
  }
}

TEST_P(LlamaCudaRunnerTest, SparseRowsOverSelectionsEqualTheCpu) {
  const int a = twin_->NewCache();
  twin_->RunAndCompare(twin_->Tokens(a, prompt(), 2), nullptr, "prefill");
  for (const int k : {1, 7, 16, 64, 512}) {
    twin_->RunAndCompare(
        twin_->Tokens(a, 1, 20 + k),
        [k](int layer, int row, int64_t position) { return Selection(k, layer, row, position); },
        absl::StrCat("sparse decode, K ", k));
  }
}

TEST_P(LlamaCudaRunnerTest, VerifierRowsEqualTheCpu) {
  const int a = twin_->NewCache();
  twin_->RunAndCompare(twin_->Tokens(a, prompt() - 10, 3), nullptr, "prefill");
  twin_->RunAndCompare(twin_->Tokens(a, 4, 4), nullptr, "dense verifier rows");
  twin_->RunAndCompare(
      twin_->Tokens(a, 3, 5),
      [](int layer, int row, int64_t position) { return Selection(9, layer, row, position); },
      "sparse verifier rows");
  // Mixed: the first row dense, the others sparse.
  twin_->RunAndCompare(
      twin_->Tokens(a, 3, 6),
      [](int layer, int row, int64_t position) {
        return row == 0 ? std::vector<int32_t>{} : Selection(5, layer, row, position);
      },
      "mixed verifier rows");
}

TEST_P(LlamaCudaRunnerTest, BatchedCachesEqualTheCpu) {
  const int a = twin_->NewCache(), b = twin_->NewCache(), c = twin_->NewCache();
  twin_->RunAndCompare(twin_->Tokens(a, prompt() / 2, 7), nullptr, "prefill a");
  twin_->RunAndCompare(twin_->Tokens(b, 5, 8), nullptr, "prefill b");
  // A batched prefill of two caches, then a step with rows of all three, in mixed order.
  std::vector<Twin::Row> rows = twin_->Tokens(c, prompt() / 3, 9);
  for (const Twin::Row& row : twin_->Tokens(b, 20, 10)) rows.push_back(row);
  twin_->RunAndCompare(rows, nullptr, "batched prefill");
  std::vector<Twin::Row> step = {{b, 3}, {a, 4}, {c, 5}, {b, 6}, {b, 7}};
  twin_->RunAndCompare(
      step,
      [](int layer, int row, int64_t position) {
        return row == 2 ? std::vector<int32_t>{} : Selection(6, layer, row, position);
      },
      "batched step");
}

TEST_P(LlamaCudaRunnerTest, TruncateAndCopyKeepTheCachesEqual) {
  const int a = twin_->NewCache();
  twin_->RunAndCompare(twin_->Tokens(a, 30, 11), nullptr, "prefill");
  ASSERT_TRUE(twin_->cpu_cache(a).Truncate(21).ok());
  ASSERT_TRUE(twin_->gpu_cache(a).Truncate(21).ok());
  twin_->RunAndCompare(twin_->Tokens(a, 4, 12), nullptr, "after truncate");
  EXPECT_EQ(twin_->gpu_cache(a).Truncate(26).code(), absl::StatusCode::kInvalidArgument);
  const int b = twin_->NewCache();
  ASSERT_TRUE(twin_->cpu_cache(b).CopyFrom(twin_->cpu_cache(a)).ok());
  const absl::Status copied = twin_->gpu_cache(b).CopyFrom(twin_->gpu_cache(a));
  ASSERT_TRUE(copied.ok()) << copied;
  EXPECT_EQ(twin_->gpu_cache(b).num_slots(), 25);
  twin_->RunAndCompare({{a, 9}, {b, 9}}, nullptr, "the copy and its source");
  EXPECT_EQ(twin_->gpu_cache(b).CopyFrom(twin_->gpu_cache(b)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(twin_->gpu_cache(b).CopyFrom(twin_->cpu_cache(a)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(LlamaCudaRunnerTest, RefusalsChangeNothing) {
  LlamaRunner& gpu = twin_->gpu();
  const int a = twin_->NewCache();
  twin_->RunAndCompare(twin_->Tokens(a, 10, 13), nullptr, "prefill");
  LlamaSequenceCache& cache = twin_->gpu_cache(a);
  const auto code = [&](std::vector<LlamaRunnerRow> rows) {
    return gpu.Begin(rows).status().code();
  };
  EXPECT_EQ(code({}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{&cache, 11, 1}}), absl::StatusCode::kInvalidArgument);  // a gap
  EXPECT_EQ(code({{&cache, 10, -1}}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{&cache, 10, twin_->config().vocab_size}}), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{&twin_->cpu_cache(a), 10, 1}}), absl::StatusCode::kInvalidArgument);
  std::vector<LlamaRunnerRow> too_long;
  for (int64_t t = 10; t <= twin_->config().context_length; ++t) too_long.push_back({&cache, t, 1});
  EXPECT_EQ(code(too_long), absl::StatusCode::kResourceExhausted);
  {
    auto pass = gpu.Begin({{&cache, 10, 1}});
    ASSERT_TRUE(pass.ok()) << pass.status();
    EXPECT_EQ(cache.Truncate(5).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(code({{&cache, 10, 1}}), absl::StatusCode::kFailedPrecondition);
    std::vector<float> logits(twin_->config().vocab_size);
    const int32_t row = 0;
    EXPECT_EQ((*pass)->Logits(std::span<const int32_t>(&row, 1), logits).code(),
              absl::StatusCode::kFailedPrecondition);
    for (const std::vector<int32_t>& bad :
         {std::vector<int32_t>{11}, std::vector<int32_t>{3, 3}, std::vector<int32_t>{-1, -1},
          std::vector<int32_t>{-2}}) {
      const std::span<const int32_t> span(bad);
      EXPECT_EQ((*pass)->RunLayer(std::span<const std::span<const int32_t>>(&span, 1)).code(),
                absl::StatusCode::kInvalidArgument);
    }
    // Still usable: a layer runs; an unfinished pass commits nothing.
    EXPECT_TRUE((*pass)->RunLayer().ok());
  }
  EXPECT_EQ(cache.num_slots(), 10);
  twin_->RunAndCompare(twin_->Tokens(a, 2, 14), nullptr, "after the refusals");
}

INSTANTIATE_TEST_SUITE_P(Models, LlamaCudaRunnerTest,
                         ::testing::Values(Model::kTiny, Model::kSmolShaped),
                         [](const ::testing::TestParamInfo<Model>& info) {
                           return info.param == Model::kTiny ? std::string("Tiny")
                                                             : std::string("SmolShaped");
                         });

// SmolLM2-135M itself, when its files are named: a 512-token prefill, 8 greedy decode steps and
// 4 sparse steps (K 64) on both runners; the greedy tokens agree and the logits are close.
TEST(LlamaCudaRunnerRealModel, SmolLM2EqualsTheCpu) {
  const char* model_path = std::getenv("DSA_SMOLLM2_MODEL");
  const char* indexer_path = std::getenv("DSA_SMOLLM2_INDEXER");
  if (model_path == nullptr || indexer_path == nullptr) {
    GTEST_SKIP() << "DSA_SMOLLM2_MODEL and DSA_SMOLLM2_INDEXER not set";
  }
  if (cuda::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto model = LlamaModel::Load(model_path, indexer_path);
  ASSERT_TRUE(model.ok()) << model.status();
  Twin twin(*model);
  ASSERT_TRUE(twin.ok());
  const int a = twin.NewCache();
  // Token ids from a fixed seed over the ordinary (non-special) vocabulary.
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> token(17, 20000);
  std::vector<Twin::Row> prompt(512);
  for (Twin::Row& row : prompt) row = {a, token(rng)};
  twin.RunAndCompare(prompt, nullptr, "SmolLM2 prefill of 512", 2e-3);
  for (int step = 0; step < 12; ++step) {
    const bool sparse = step >= 8;
    twin.RunAndCompare({{a, token(rng)}},
                       sparse ? Twin::SelectionFn([](int layer, int row, int64_t position) {
                         return Selection(64, layer, row, position);
                       })
                              : Twin::SelectionFn(),
                       absl::StrCat("SmolLM2 step ", step, sparse ? " (sparse, K 64)" : ""), 2e-3);
  }
}

}  // namespace
}  // namespace dsa
