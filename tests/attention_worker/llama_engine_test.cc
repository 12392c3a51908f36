// Tests of the attention engine over the real model's seam (llama_attention_model.h) with a tiny
// random LLaMA model and a real in-process indexer: tokens in, sampled tokens out; a prefill's
// next token and greedy decode steps equal a direct dense pass when K covers the context; a sparse
// step attends exactly the selections the indexer made (checked against a pass over them);
// verifier rows and Commit; and bad tokens, sampling and contexts refused with nothing changed.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "attention_worker/engine.h"
#include "attention_worker/llama_attention_model.h"
#include "attention_worker/llama_model.h"
#include "gtest/gtest.h"
#include "indexer_service/indexer.h"
#include "tests/attention_worker/random_llama.h"
#include "transport/in_process_indexer_client.h"

namespace dsa {
namespace {

constexpr int kVocab = testing::kTinyLlamaVocab;
constexpr int kContext = 96;

std::shared_ptr<const LlamaModel> MakeTinyModel() {
  const LlamaConfig c = testing::TinyLlamaConfig(4, kContext);
  return testing::RandomLlamaModel(c, testing::TinyIndexerConfig(c), 11);
}

int32_t Argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

class LlamaEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = MakeTinyModel();
    auto schedule = MliSchedule::FromPattern("FSFS", 1);  // full layers 0 and 2, k = 1
    ASSERT_TRUE(schedule.ok()) << schedule.status();
    auto seam = LlamaAttentionModel::Create(model_, schedule->full_layers(), "tiny");
    ASSERT_TRUE(seam.ok()) << seam.status();
    // A position seen again (a rejected draft's slot decoded anew) keeps its latest logits.
    (*seam)->set_logits_observer(
        [this](uint64_t id, int64_t position, std::span<const float> logits) {
          std::lock_guard<std::mutex> lock(mutex_);
          logits_seen_[{id, position}].assign(logits.begin(), logits.end());
        });
    auto indexer = Indexer::Create({512, 4, 16});
    ASSERT_TRUE(indexer.ok()) << indexer.status();
    indexer_ = std::move(*indexer);
    AttentionEngineOptions options;
    options.kv_capacity_slots = 1000;
    options.observer = [this](const AttendedRow& row) {
      std::lock_guard<std::mutex> lock(mutex_);
      observed_[{row.model_layer, row.position}] =
          std::vector<int32_t>(row.selection.begin(), row.selection.end());
    };
    auto engine = AttentionEngine::Create(*schedule, *std::move(seam),
                                          InProcessIndexerClient::Factory(indexer_.get()), options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }

  absl::StatusOr<PrefillResult> Prefill(uint64_t id, const std::vector<int32_t>& tokens,
                                        int top_k) {
    PrefillSpec spec;
    spec.sequence_id = id;
    spec.context_length = static_cast<int64_t>(tokens.size());
    spec.indexer_worker = kInProcessIndexerAddress;
    spec.top_k = top_k;
    spec.tokens = tokens;
    return engine_->Prefill(spec);
  }

  // The logits of every row of a dense pass over `tokens` from position 0.
  std::vector<float> DenseLogits(const std::vector<int32_t>& tokens) {
    LlamaKvCache cache(*model_);
    std::vector<LlamaRow> rows;
    for (size_t i = 0; i < tokens.size(); ++i) {
      rows.push_back({&cache, static_cast<int64_t>(i), tokens[i]});
    }
    auto pass = LlamaForward::Begin(model_, rows);
    EXPECT_TRUE(pass.ok()) << pass.status();
    for (int l = 0; l < model_->config().num_layers; ++l) EXPECT_TRUE((*pass)->RunLayer().ok());
    std::vector<int32_t> all(rows.size());
    std::iota(all.begin(), all.end(), 0);
    std::vector<float> logits(rows.size() * kVocab);
    EXPECT_TRUE((*pass)->Logits(all, logits).ok());
    return logits;
  }

  std::vector<int32_t> Prompt(int n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int32_t> token(0, kVocab - 1);
    std::vector<int32_t> out(n);
    for (int32_t& x : out) x = token(rng);
    return out;
  }

  std::shared_ptr<const LlamaModel> model_;
  std::unique_ptr<Indexer> indexer_;
  std::unique_ptr<AttentionEngine> engine_;
  std::mutex mutex_;
  std::map<std::pair<int, int64_t>, std::vector<int32_t>> observed_;  // (layer, position)
  // The logits observer's: (sequence, position) -> logits [vocab].
  std::map<std::pair<uint64_t, int64_t>, std::vector<float>> logits_seen_;
};

TEST_F(LlamaEngineTest, GetInfoNamesTheModelAndItsVocabulary) {
  const AttentionEngineInfo info = engine_->GetInfo();
  EXPECT_EQ(info.model, "tiny");
  EXPECT_EQ(info.vocab_size, kVocab);
  EXPECT_EQ(info.eos_token_id, 2);
  EXPECT_EQ(info.max_context, kContext);
  EXPECT_EQ(info.num_model_layers, 4);
  EXPECT_EQ(info.num_full_layers, 2);
  EXPECT_EQ(info.num_heads, 4);
  EXPECT_EQ(info.head_dim, 16);
}

// The logits observer sees the prefill's last position and every row of a step, verifier rows
// included, each with the logits a dense pass gives there (K covers the context).
TEST_F(LlamaEngineTest, TheLogitsObserverSeesEachRowsLogitsAtItsPosition) {
  std::vector<int32_t> tokens = Prompt(20, 7);
  auto prefill = Prefill(1, tokens, /*top_k=*/kContext);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  const auto close_to = [](const std::vector<float>& seen, std::span<const float> dense) {
    float worst = 0;
    for (size_t i = 0; i < dense.size(); ++i) worst = std::max(worst, std::abs(seen[i] - dense[i]));
    return worst;
  };
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ASSERT_EQ(logits_seen_.size(), 1u);
    ASSERT_TRUE(logits_seen_.contains({1, 19}));
    EXPECT_LT(close_to(logits_seen_[{1, 19}],
                       std::span<const float>(DenseLogits(tokens)).subspan(19 * kVocab, kVocab)),
              1e-4);
  }
  const StepMember member{1, 3, {*prefill->next_token, 4, 9}};  // row 0 and two drafts
  auto step = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
  ASSERT_TRUE(step.ok()) << step.status();
  tokens.insert(tokens.end(), member.tokens.begin(), member.tokens.end());
  const std::vector<float> dense = DenseLogits(tokens);
  std::lock_guard<std::mutex> lock(mutex_);
  EXPECT_EQ(logits_seen_.size(), 4u);
  for (int64_t position = 20; position <= 22; ++position) {
    ASSERT_TRUE(logits_seen_.contains({1, position})) << position;
    EXPECT_LT(close_to(logits_seen_[{1, position}],
                       std::span<const float>(dense).subspan(position * kVocab, kVocab)),
              1e-4)
        << position;
  }
}

TEST_F(LlamaEngineTest, GreedyDecodingWithKOverTheContextEqualsADensePass) {
  std::vector<int32_t> tokens = Prompt(20, 1);
  auto prefill = Prefill(1, tokens, /*top_k=*/kContext);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  ASSERT_TRUE(prefill->next_token.has_value());
  std::vector<float> dense = DenseLogits(tokens);
  EXPECT_EQ(*prefill->next_token,
            Argmax(std::span<const float>(dense).subspan((tokens.size() - 1) * kVocab, kVocab)));
  tokens.push_back(*prefill->next_token);
  for (int step = 0; step < 6; ++step) {
    const StepMember member{1, 1, {tokens.back()}};
    auto result = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->sequences[0].sampled_tokens.size(), 1u);
    EXPECT_EQ(result->sequences[0].first_position, static_cast<int64_t>(tokens.size()) - 1);
    dense = DenseLogits(tokens);
    EXPECT_EQ(result->sequences[0].sampled_tokens[0],
              Argmax(std::span<const float>(dense).subspan((tokens.size() - 1) * kVocab, kVocab)))
        << "step " << step;
    tokens.push_back(result->sequences[0].sampled_tokens[0]);
  }
}

TEST_F(LlamaEngineTest, ASparseStepAttendsTheIndexersSelectionsAtEveryLayer) {
  const std::vector<int32_t> tokens = Prompt(60, 2);
  auto prefill = Prefill(1, tokens, /*top_k=*/8);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  const StepMember member{1, 1, {*prefill->next_token}};
  auto result = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
  ASSERT_TRUE(result.ok()) << result.status();
  // Each model layer attended a selection of 8 slots made for position 60.
  for (int l = 0; l < 4; ++l) {
    const auto key = std::make_pair(l, int64_t{60});
    ASSERT_TRUE(observed_.contains(key)) << l;
    const std::vector<int32_t>& selection = observed_[key];
    EXPECT_EQ(selection.size(), 8u);
    for (int32_t slot : selection) EXPECT_TRUE(slot >= 0 && slot <= 60) << slot;
  }
  // FSFS with k = 1: every layer attends full layer 0's selection (layer 2 attends the full layer
  // one before it; its own selection is made and attended by none).
  for (int l = 1; l < 4; ++l)
    EXPECT_EQ(observed_[std::make_pair(l, int64_t{60})], observed_[std::make_pair(0, int64_t{60})])
        << l;
  // A pass over the prompt densely, then the step's row over the observed selections, samples the
  // same token.
  LlamaKvCache cache(*model_);
  std::vector<LlamaRow> rows;
  for (size_t i = 0; i < tokens.size(); ++i) {
    rows.push_back({&cache, static_cast<int64_t>(i), tokens[i]});
  }
  auto prompt = LlamaForward::Begin(model_, rows);
  ASSERT_TRUE(prompt.ok());
  for (int l = 0; l < 4; ++l) ASSERT_TRUE((*prompt)->RunLayer().ok());
  prompt->reset();
  auto pass = LlamaForward::Begin(model_, {{&cache, 60, *prefill->next_token}});
  ASSERT_TRUE(pass.ok());
  for (int l = 0; l < 4; ++l) {
    const std::span<const int32_t> selection(observed_[std::make_pair(l, int64_t{60})]);
    ASSERT_TRUE((*pass)->RunLayer(std::span<const std::span<const int32_t>>(&selection, 1)).ok());
  }
  std::vector<float> logits(kVocab);
  const int32_t row = 0;
  ASSERT_TRUE((*pass)->Logits(std::span<const int32_t>(&row, 1), logits).ok());
  EXPECT_EQ(result->sequences[0].sampled_tokens[0], Argmax(logits));
}

TEST_F(LlamaEngineTest, VerifierRowsSampleEveryRowAndCommitKeepsTheAccepted) {
  std::vector<int32_t> tokens = Prompt(16, 3);
  auto prefill = Prefill(1, tokens, /*top_k=*/kContext);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  const std::vector<int32_t> rows = {*prefill->next_token, 5, 9};  // the last token, 2 drafts
  const StepMember member{1, 3, rows};
  auto result = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->sequences[0].sampled_tokens.size(), 3u);
  std::vector<int32_t> all = tokens;
  all.insert(all.end(), rows.begin(), rows.end());
  const std::vector<float> dense = DenseLogits(all);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(result->sequences[0].sampled_tokens[r],
              Argmax(std::span<const float>(dense).subspan((16 + r) * kVocab, kVocab)))
        << r;
  }
  ASSERT_TRUE(engine_->Commit(1, 1).ok());  // keeps positions 16, 17
  const StepMember next{1, 1, {7}};
  auto again = engine_->DecodeStep(std::span<const StepMember>(&next, 1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->sequences[0].first_position, 18);
  std::vector<int32_t> kept = tokens;
  kept.insert(kept.end(), {rows[0], rows[1], 7});
  const std::vector<float> dense_kept = DenseLogits(kept);
  EXPECT_EQ(again->sequences[0].sampled_tokens[0],
            Argmax(std::span<const float>(dense_kept).subspan(18 * kVocab, kVocab)));
}

TEST_F(LlamaEngineTest, SeededSamplingRepeatsAndDependsOnTheSeed) {
  const std::vector<int32_t> tokens = Prompt(24, 4);
  std::vector<std::vector<int32_t>> runs;
  for (uint64_t seed : {7u, 7u, 8u}) {
    PrefillSpec spec;
    spec.sequence_id = 100 + runs.size();
    spec.context_length = 24;
    spec.indexer_worker = kInProcessIndexerAddress;
    spec.top_k = kContext;
    spec.tokens = tokens;
    spec.sampling = {1.5f, 0.95f, seed};
    auto prefill = engine_->Prefill(spec);
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    std::vector<int32_t> out = {*prefill->next_token};
    for (int step = 0; step < 8; ++step) {
      const StepMember member{spec.sequence_id, 1, {out.back()}};
      auto result = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
      ASSERT_TRUE(result.ok()) << result.status();
      out.push_back(result->sequences[0].sampled_tokens[0]);
    }
    runs.push_back(out);
  }
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_NE(runs[0], runs[2]);
}

TEST_F(LlamaEngineTest, BadTokensSamplingAndContextsAreRefusedAndChangeNothing) {
  std::vector<int32_t> tokens = Prompt(10, 5);
  tokens[3] = kVocab;
  auto out_of_vocab = Prefill(1, tokens, 16);
  EXPECT_EQ(out_of_vocab.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out_of_vocab.status().message().find("token 3 is 50, outside the vocabulary [0, 50)"),
            std::string::npos)
      << out_of_vocab.status();
  tokens[3] = -1;
  EXPECT_EQ(Prefill(1, tokens, 16).status().code(), absl::StatusCode::kInvalidArgument);
  PrefillSpec no_tokens;
  no_tokens.sequence_id = 1;
  no_tokens.context_length = 10;
  no_tokens.indexer_worker = kInProcessIndexerAddress;
  no_tokens.top_k = 16;
  EXPECT_EQ(engine_->Prefill(no_tokens).status().code(), absl::StatusCode::kInvalidArgument);
  PrefillSpec bad_sampling = no_tokens;
  bad_sampling.tokens = Prompt(10, 5);
  bad_sampling.sampling.top_p = 1.5f;
  EXPECT_EQ(engine_->Prefill(bad_sampling).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Prefill(1, Prompt(kContext + 1, 6), 16).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(engine_->GetInfo().sequences, 0);
  EXPECT_EQ(engine_->GetInfo().kv_used_slots, 0);

  auto prefill = Prefill(1, Prompt(kContext - 1, 7), 16);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  const StepMember missing{1, 1, {}};
  EXPECT_EQ(engine_->DecodeStep(std::span<const StepMember>(&missing, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  const StepMember bad{1, 1, {kVocab + 3}};
  EXPECT_EQ(engine_->DecodeStep(std::span<const StepMember>(&bad, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  const StepMember past_context{1, 2, {4, 4}};
  EXPECT_EQ(engine_->DecodeStep(std::span<const StepMember>(&past_context, 1)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(engine_->GetInfo().kv_used_slots, kContext - 1);
  // The sequence goes on as if nothing had been asked.
  const StepMember good{1, 1, {*prefill->next_token}};
  auto step = engine_->DecodeStep(std::span<const StepMember>(&good, 1));
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->sequences[0].first_position, kContext - 1);
}

}  // namespace
}  // namespace dsa

namespace dsa {
namespace {

TEST_F(LlamaEngineTest, AContinuationRunsItsNewTokensAndNeedsAtLeastOne) {
  std::vector<int32_t> tokens = Prompt(12, 8);
  auto prefill = Prefill(1, tokens, /*top_k=*/kContext);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  PrefillSpec empty;
  empty.sequence_id = 1;
  empty.context_length = 12;
  empty.continue_sequence = true;
  const auto refused = engine_->Prefill(empty);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("needs at least one new token"), std::string::npos)
      << refused.status();
  // The next turn: the generated token, then more text; its next token is the dense pass's.
  const std::vector<int32_t> more = {*prefill->next_token, 3, 4, 5};
  PrefillSpec next = empty;
  next.context_length = 16;
  next.tokens = more;
  auto continued = engine_->Prefill(next);
  ASSERT_TRUE(continued.ok()) << continued.status();
  tokens.insert(tokens.end(), more.begin(), more.end());
  const std::vector<float> dense = DenseLogits(tokens);
  EXPECT_EQ(*continued->next_token,
            Argmax(std::span<const float>(dense).subspan(15 * kVocab, kVocab)));
}

TEST(LlamaEngineCreateTest, AModelWhoseFullLayersDifferFromTheSchedulesIsRefused) {
  auto schedule = MliSchedule::FromPattern("FSFS", 1);
  ASSERT_TRUE(schedule.ok());
  auto seam = LlamaAttentionModel::Create(MakeTinyModel(), {0, 1}, "tiny");
  ASSERT_TRUE(seam.ok()) << seam.status();
  auto engine = AttentionEngine::Create(
      *schedule, *std::move(seam),
      [](const std::string&) -> absl::StatusOr<std::shared_ptr<IndexerClient>> {
        return absl::UnavailableError("unused");
      },
      AttentionEngineOptions{});
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("full layers 0,1"), std::string::npos)
      << engine.status();
}

}  // namespace
}  // namespace dsa
