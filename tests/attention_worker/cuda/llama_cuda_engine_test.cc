// The attention engine over the real model's seam on the GPU (LlamaAttentionModel over the CUDA
// runner) against the same engine over the CPU runner, each with its own in-process indexer, on
// llama_engine_test's tiny random LLaMA and on a small model of SmolLM2's head shape: the same
// prefill tokens, greedy decode (K over the context, and sparse K = 8 over the indexer's
// selections), verifier rows with Commit, and seeded sampling give the same tokens. Skips without
// a GPU.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention_worker/cuda/llama_cuda_runner.h"
#include "attention_worker/engine.h"
#include "attention_worker/llama_attention_model.h"
#include "attention_worker/llama_model.h"
#include "gtest/gtest.h"
#include "indexer_service/indexer.h"
#include "tests/attention_worker/random_llama.h"
#include "transport/in_process_indexer_client.h"

namespace dsa {
namespace {

struct Shape {
  const char* name;
  int d_model, num_heads, num_kv_heads, head_dim, ffn_dim, vocab, context;
  int index_heads, index_dim;
};

// llama_engine_test's tiny model (4 layers, vocab 50, context 96), and one with SmolLM2's
// attention heads.
constexpr Shape kTiny{"Tiny", 32, 4, 2, 8, 48, 50, 96, 4, 16};
constexpr Shape kSmolShaped{"SmolShaped", 96, 6, 2, 64, 160, 200, 160, 4, 32};

std::shared_ptr<const LlamaModel> MakeModel(const Shape& shape) {
  LlamaConfig c = testing::TinyLlamaConfig(4, shape.context);
  c.d_model = shape.d_model;
  c.num_heads = shape.num_heads;
  c.num_kv_heads = shape.num_kv_heads;
  c.head_dim = shape.head_dim;
  c.ffn_dim = shape.ffn_dim;
  c.vocab_size = shape.vocab;
  return testing::RandomLlamaModel(
      c, testing::TinyIndexerConfig(c, shape.index_heads, shape.index_dim), 11);
}

// One engine over a runner, with its own in-process indexer.
struct EngineUnderTest {
  std::unique_ptr<Indexer> indexer;
  std::unique_ptr<AttentionEngine> engine;
};

EngineUnderTest MakeEngine(std::shared_ptr<LlamaRunner> runner, const Shape& shape) {
  EngineUnderTest out;
  auto schedule = MliSchedule::FromPattern("FSFS", 1);  // full layers 0 and 2, k = 1
  EXPECT_TRUE(schedule.ok()) << schedule.status();
  auto seam = LlamaAttentionModel::Create(std::move(runner), schedule->full_layers(), "tiny");
  EXPECT_TRUE(seam.ok()) << seam.status();
  auto indexer = Indexer::Create({512, shape.index_heads, shape.index_dim});
  EXPECT_TRUE(indexer.ok()) << indexer.status();
  out.indexer = std::move(*indexer);
  AttentionEngineOptions options;
  options.kv_capacity_slots = 4000;
  auto engine = AttentionEngine::Create(
      *schedule, *std::move(seam), InProcessIndexerClient::Factory(out.indexer.get()), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  out.engine = std::move(*engine);
  return out;
}

class LlamaCudaEngineTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    if (cuda::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    shape_ = GetParam();
    model_ = MakeModel(shape_);
    auto gpu = cuda::CreateCudaLlamaRunner(model_);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    engines_[0] = MakeEngine(MakeCpuLlamaRunner(model_), shape_);
    engines_[1] = MakeEngine(*gpu, shape_);
    ASSERT_NE(engines_[0].engine, nullptr);
    ASSERT_NE(engines_[1].engine, nullptr);
  }

  std::vector<int32_t> Prompt(int n, uint32_t seed) const {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int32_t> token(0, shape_.vocab - 1);
    std::vector<int32_t> out(n);
    for (int32_t& x : out) x = token(rng);
    return out;
  }

  // Prefill then `steps` decode steps feeding each sampled token back, on engine `side`; every
  // sampled token.
  std::vector<int32_t> Generate(int side, uint64_t id, const std::vector<int32_t>& prompt,
                                int top_k, int steps, SamplingParams sampling = {}) {
    AttentionEngine& engine = *engines_[side].engine;
    PrefillSpec spec;
    spec.sequence_id = id;
    spec.context_length = static_cast<int64_t>(prompt.size());
    spec.indexer_worker = kInProcessIndexerAddress;
    spec.top_k = top_k;
    spec.tokens = prompt;
    spec.sampling = sampling;
    auto prefill = engine.Prefill(spec);
    EXPECT_TRUE(prefill.ok()) << prefill.status();
    if (!prefill.ok()) return {};
    std::vector<int32_t> out = {*prefill->next_token};
    for (int step = 0; step < steps; ++step) {
      const StepMember member{id, 1, {out.back()}};
      auto result = engine.DecodeStep(std::span<const StepMember>(&member, 1));
      EXPECT_TRUE(result.ok()) << result.status();
      if (!result.ok()) return out;
      out.push_back(result->sequences[0].sampled_tokens[0]);
    }
    return out;
  }

  Shape shape_;
  std::shared_ptr<const LlamaModel> model_;
  EngineUnderTest engines_[2];  // [0] CPU runner, [1] CUDA runner
};

TEST_P(LlamaCudaEngineTest, DescribesTheGpu) {
  EXPECT_EQ(engines_[1].engine->model().Description().rfind("cuda:", 0), 0u)
      << engines_[1].engine->model().Description();
  EXPECT_EQ(engines_[0].engine->model().Description(), "cpu");
}

TEST_P(LlamaCudaEngineTest, GreedyTokensEqualTheCpuDenseAndSparse) {
  const std::vector<int32_t> prompt = Prompt(shape_.context / 2, 1);
  EXPECT_EQ(Generate(1, 1, prompt, shape_.context, 8), Generate(0, 1, prompt, shape_.context, 8))
      << "K over the context";
  EXPECT_EQ(Generate(1, 2, prompt, 8, 8), Generate(0, 2, prompt, 8, 8)) << "K = 8";
}

TEST_P(LlamaCudaEngineTest, VerifierRowsAndCommitEqualTheCpu) {
  const std::vector<int32_t> prompt = Prompt(16, 3);
  std::vector<int32_t> sampled[2];
  for (int side = 0; side < 2; ++side) {
    AttentionEngine& engine = *engines_[side].engine;
    const std::vector<int32_t> first = Generate(side, 1, prompt, 8, 0);
    ASSERT_EQ(first.size(), 1u);
    const StepMember member{1, 3, {first[0], 5, 9}};  // the last token and two drafts
    auto result = engine.DecodeStep(std::span<const StepMember>(&member, 1));
    ASSERT_TRUE(result.ok()) << result.status();
    sampled[side] = result->sequences[0].sampled_tokens;
    ASSERT_TRUE(engine.Commit(1, 1).ok());
    const StepMember next{1, 1, {7}};
    auto again = engine.DecodeStep(std::span<const StepMember>(&next, 1));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->sequences[0].first_position, 18);
    sampled[side].push_back(again->sequences[0].sampled_tokens[0]);
  }
  EXPECT_EQ(sampled[1], sampled[0]);
}

TEST_P(LlamaCudaEngineTest, SeededSamplingEqualsTheCpu) {
  const std::vector<int32_t> prompt = Prompt(24, 4);
  const SamplingParams sampling{1.5f, 0.95f, 7};
  EXPECT_EQ(Generate(1, 5, prompt, 16, 8, sampling), Generate(0, 5, prompt, 16, 8, sampling));
}

INSTANTIATE_TEST_SUITE_P(Models, LlamaCudaEngineTest, ::testing::Values(kTiny, kSmolShaped),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace dsa
