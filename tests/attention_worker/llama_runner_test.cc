// Tests of the CPU LlamaRunner (llama_runner.h, llama_attention_model.cc) over a tiny random LLaMA:
// LlamaSequenceCache::CopyFrom refuses a cache in a pass (the source's or its own) and changes
// nothing, copies bit for bit once the pass has ended, and stays consistent while another thread
// drives the source's passes (the check and the copy are atomic with respect to Begin; run under
// ThreadSanitizer to see no race with the pass that ends on the other thread).
#include "attention_worker/llama_runner.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "attention_worker/llama_attention_model.h"
#include "attention_worker/llama_model.h"
#include "gtest/gtest.h"
#include "tests/attention_worker/random_llama.h"

namespace dsa {
namespace {

constexpr int kVocab = testing::kTinyLlamaVocab;
constexpr int kLayers = 3;
constexpr int kContext = 64;

class CpuLlamaRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const LlamaConfig c = testing::TinyLlamaConfig(kLayers, kContext);
    model_ = testing::RandomLlamaModel(c, testing::TinyIndexerConfig(c), 13);
    ASSERT_NE(model_, nullptr);
    runner_ = MakeCpuLlamaRunner(model_);
  }

  std::unique_ptr<LlamaSequenceCache> NewCache() {
    auto cache = runner_->NewCache();
    EXPECT_TRUE(cache.ok()) << cache.status();
    return cache.ok() ? *std::move(cache) : nullptr;
  }

  // Begins a pass of `tokens` at positions cache.num_slots()...
  absl::StatusOr<std::unique_ptr<LlamaPass>> Begin(LlamaSequenceCache& cache,
                                                   const std::vector<int32_t>& tokens) {
    std::vector<LlamaRunnerRow> rows;
    for (size_t i = 0; i < tokens.size(); ++i) {
      rows.push_back({&cache, cache.num_slots() + static_cast<int64_t>(i), tokens[i]});
    }
    return runner_->Begin(std::move(rows));
  }

  // Runs a whole pass of `tokens` at positions cache.num_slots()... and returns the last row's
  // logits [vocab] (empty, with a test failure, on an error).
  std::vector<float> Step(LlamaSequenceCache& cache, const std::vector<int32_t>& tokens) {
    auto pass = Begin(cache, tokens);
    EXPECT_TRUE(pass.ok()) << pass.status();
    if (!pass.ok()) return {};
    for (int l = 0; l < kLayers; ++l) {
      const absl::Status status = (*pass)->RunLayer();
      EXPECT_TRUE(status.ok()) << status;
      if (!status.ok()) return {};
    }
    std::vector<float> logits(kVocab);
    const std::vector<int32_t> last = {static_cast<int32_t>(tokens.size()) - 1};
    EXPECT_TRUE((*pass)->Logits(last, logits).ok());
    return logits;
  }

  static std::vector<int32_t> Tokens(int n, int32_t first) {
    std::vector<int32_t> out(n);
    for (int i = 0; i < n; ++i) out[i] = (first + 7 * i) % kVocab;
    return out;
  }

  std::shared_ptr<const LlamaModel> model_;
  std::shared_ptr<LlamaRunner> runner_;
};

TEST_F(CpuLlamaRunnerTest, CopyFromACacheInAPassIsRefusedAndChangesNothing) {
  std::unique_ptr<LlamaSequenceCache> a = NewCache(), b = NewCache(), control = NewCache();
  ASSERT_TRUE(a && b && control);
  Step(*a, Tokens(12, 3));
  Step(*b, Tokens(5, 4));
  Step(*control, Tokens(5, 4));

  // A pass open on a (begun, one layer of three run): refused from it and into it.
  auto pass = Begin(*a, {9});
  ASSERT_TRUE(pass.ok()) << pass.status();
  ASSERT_TRUE((*pass)->RunLayer().ok());
  const absl::Status from_open = b->CopyFrom(*a);
  EXPECT_EQ(from_open.code(), absl::StatusCode::kFailedPrecondition) << from_open;
  EXPECT_EQ(from_open.message(), "LlamaSequenceCache::CopyFrom: a cache is in a pass");
  EXPECT_EQ(a->CopyFrom(*b).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a->Truncate(3).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b->CopyFrom(*b).code(), absl::StatusCode::kInvalidArgument);
  auto other_runner = MakeCpuLlamaRunner(model_);
  auto other = other_runner->NewCache();
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(b->CopyFrom(**other).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->num_slots(), 12);
  EXPECT_EQ(b->num_slots(), 5);

  // b holds what it held: its next step equals the control's, bit for bit.
  EXPECT_EQ(Step(*b, {6}), Step(*control, {6}));

  // The pass ends: the copy succeeds and equals the source.
  for (int l = 1; l < kLayers; ++l) ASSERT_TRUE((*pass)->RunLayer().ok());
  EXPECT_EQ(a->num_slots(), 13);
  const absl::Status copied = b->CopyFrom(*a);
  ASSERT_TRUE(copied.ok()) << copied;
  EXPECT_EQ(b->num_slots(), 13);
  pass->reset();
  const std::vector<float> next = Step(*a, {8});
  EXPECT_EQ(Step(*b, {8}), next);

  // A pass destroyed before its last layer releases the cache, committing nothing.
  auto abandoned = Begin(*a, {2});
  ASSERT_TRUE(abandoned.ok()) << abandoned.status();
  ASSERT_TRUE((*abandoned)->RunLayer().ok());
  EXPECT_EQ(b->CopyFrom(*a).code(), absl::StatusCode::kFailedPrecondition);
  abandoned->reset();
  ASSERT_TRUE(b->CopyFrom(*a).ok());
  EXPECT_EQ(b->num_slots(), 14);
  EXPECT_EQ(Step(*b, {1}), Step(*a, {1}));
}

// One thread decodes on a (one token a pass, some passes abandoned after a layer, a rollback near
// the context's end) while another copies a into b over and over: every copy succeeds or is
// refused as in a pass, and every successful copy holds a consistent prefix of a's sequence (its
// next step equals that of a reference cache holding the same prefix, bit for bit). The copier
// goes on until the decoder is done, so that the two overlap whatever the scheduling.
TEST_F(CpuLlamaRunnerTest, CopyFromWhileAnotherThreadRunsPassesOnTheSource) {
  constexpr int kPrefill = 8, kPasses = 300, kCopies = 300;
  constexpr int32_t kProbe = 3;
  const std::vector<int32_t> tokens = Tokens(kContext - 1, 5);
  std::unique_ptr<LlamaSequenceCache> a = NewCache(), b = NewCache();
  ASSERT_TRUE(a && b);
  Step(*a, std::vector<int32_t>(tokens.begin(), tokens.begin() + kPrefill));

  std::atomic<int> ready = 0;
  std::atomic<bool> decoded = false;  // the decoder's passes are over
  const auto start_together = [&ready] {
    ready.fetch_add(1);
    while (ready.load() < 2) {
    }
  };
  std::thread decoder([&] {
    start_together();
    for (int i = 0; i < kPasses; ++i) {
      if (a->num_slots() == kContext - 1) {
        const absl::Status status = a->Truncate(kPrefill);
        EXPECT_TRUE(status.ok()) << status;
      }
      auto pass = Begin(*a, {tokens[a->num_slots()]});
      EXPECT_TRUE(pass.ok()) << pass.status();
      if (!pass.ok()) return;
      const int layers = i % 5 == 4 ? 1 : kLayers;  // every fifth pass abandoned
      for (int l = 0; l < layers; ++l) {
        const absl::Status status = (*pass)->RunLayer();
        EXPECT_TRUE(status.ok()) << status;
      }
      pass->reset();
      std::this_thread::yield();  // a chance for the copier between passes
    }
    decoded.store(true);
  });
  // The copier's next step after each successful copy, by the copy's slots.
  std::map<int64_t, std::vector<float>> probed;
  int copies = 0, refusals = 0;
  std::thread copier([&] {
    start_together();
    for (int i = 0; i < kCopies || !decoded.load(); ++i) {
      const absl::Status status = b->CopyFrom(*a);
      std::this_thread::yield();  // a chance for the decoder between copies
      if (status.code() == absl::StatusCode::kFailedPrecondition) {
        ++refusals;
        continue;
      }
      EXPECT_TRUE(status.ok()) << status;
      if (!status.ok()) return;
      ++copies;
      const int64_t n = b->num_slots();
      EXPECT_GE(n, kPrefill);
      EXPECT_LT(n, kContext);
      // Probed on its first copy of n slots and then on every eighth (a pass is as long as a copy).
      if (probed.count(n) == 0 || copies % 8 == 0) {
        const std::vector<float> next = Step(*b, {kProbe});
        const auto [it, first] = probed.emplace(n, next);
        if (!first) {
          EXPECT_EQ(next, it->second) << "copies of " << n << " slots differ";
        }
      }
    }
  });
  decoder.join();
  copier.join();
  EXPECT_GE(copies + refusals, kCopies);
  // Both outcomes usually occur, but which one a copy meets depends on the scheduling.
  ::testing::Test::RecordProperty("copies", copies);
  ::testing::Test::RecordProperty("refusals", refusals);

  // Each copied prefix against a reference decoded the same way (a prefill, then one token a pass).
  std::unique_ptr<LlamaSequenceCache> reference = NewCache(), prefix = NewCache();
  ASSERT_TRUE(reference && prefix);
  Step(*reference, std::vector<int32_t>(tokens.begin(), tokens.begin() + kPrefill));
  for (int t = kPrefill; t < kContext - 1; ++t) Step(*reference, {tokens[t]});
  for (const auto& [n, next] : probed) {
    ASSERT_TRUE(prefix->CopyFrom(*reference).ok());
    ASSERT_TRUE(prefix->Truncate(n).ok());
    EXPECT_EQ(Step(*prefix, {kProbe}), next) << "a copy of " << n << " slots";
  }
  ASSERT_TRUE(b->CopyFrom(*a).ok());
  EXPECT_EQ(b->num_slots(), a->num_slots());
}

}  // namespace
}  // namespace dsa
