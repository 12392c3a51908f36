// CoordinatorEngine with a real model behind it: in-memory attention workers that run the tiny
// model of tests/coordinator/tiny_model.h (vocabulary 64, end-of-sequence 63, next token = last +
// 1 mod 64 when greedy), so every token id the coordinator streams, every draft it proposes and
// every Commit it sends can be worked out by hand. Deterministic as engine_test.cc (the fixture:
// engine_fixture.h): the test steps the decode loop itself. Also the pattern model's side of the
// same fields (validated, ignored).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "coordinator/token_blocks.h"
#include "tests/coordinator/engine_fixture.h"
#include "tests/coordinator/tiny_model.h"

namespace dsa {
namespace {

// The fixture's names: EngineTest, Call, Request, kA1.., cv1, FakeWorkers.
using namespace ::dsa::engine_testing;  // NOLINT(google-build-using-namespace)
using ::dsa::testing::kTinyEos;
using ::dsa::testing::TinyModelShape;
using Ids = std::vector<int32_t>;

GenerateSpec TokensRequest(const std::string& id, const Ids& context, int64_t new_tokens,
                           int draft = 0) {
  GenerateSpec request;
  request.request_id = id;
  request.context_tokens = context;
  request.max_new_tokens = new_tokens;
  request.draft_length = draft;
  return request;
}

// The Tokens events of a call.
std::vector<cv1::Tokens> TokensEvents(Call& call) {
  std::vector<cv1::Tokens> out;
  for (const cv1::GenerateEvent& e : call.stream.events()) {
    if (e.has_tokens()) out.push_back(e.tokens());
  }
  return out;
}

// Every token id a call streamed, in order; checks that each event's count is its ids' and that
// positions are contiguous from `context`.
Ids StreamedIds(Call& call, int64_t context) {
  Ids ids;
  for (const cv1::Tokens& t : TokensEvents(call)) {
    EXPECT_EQ(t.first_position(), context + static_cast<int64_t>(ids.size()));
    EXPECT_EQ(t.count(), t.token_ids_size());
    ids.insert(ids.end(), t.token_ids().begin(), t.token_ids().end());
  }
  return ids;
}

// 10, 11, ..., 17, 10, 11: the tiny model continues with 12, 13, ...; prompt lookup finds
// [10, 11, 12] at 0 after the first token and drafts 13, 14, 15, 16, which it confirms.
Ids Ramp() { return {10, 11, 12, 13, 14, 15, 16, 17, 10, 11}; }

class RealModelTest : public EngineTest {
 protected:
  void SetUp() override {
    EngineTest::SetUp();
    attention_shape_ = TinyModelShape(/*max_context=*/4096);
  }
};

TEST_F(RealModelTest, GreedyIdsStreamInOrderFromThePrefillsTokenOn) {
  Start({kA1}, {kI1});
  Call* call = Generate(TokensRequest("r1", {5, 9, 20}, 5));
  // The prefill's token is the first Tokens event, before any decode step (the TTFT).
  ASSERT_TRUE(call->stream.AwaitEvents(2));
  EXPECT_EQ(fakes_->DecodeSteps(kA1), 0);
  const cv1::Tokens first = TokensEvents(*call).at(0);
  EXPECT_EQ(first.first_position(), 3);
  EXPECT_EQ(first.count(), 1);
  EXPECT_EQ(first.drafted(), 0);
  EXPECT_EQ(first.token_ids(0), 21);
  const std::vector<attention::v1::PrefillRequest> prefills = fakes_->Prefills(kA1);
  ASSERT_EQ(prefills.size(), 1u);
  EXPECT_EQ(prefills[0].context_length(), 3);
  EXPECT_EQ(Ids(prefills[0].tokens().begin(), prefills[0].tokens().end()), (Ids{5, 9, 20}));
  EXPECT_EQ(prefills[0].sampling().temperature(), 0.0f);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));

  // Each step's input is the last token; the KV holds everything but it.
  for (int step = 0; step < 2; ++step) {
    ASSERT_EQ(*engine_->StepWorker(kA1), 1);
    ASSERT_TRUE(call->stream.AwaitEvents(3 + step));
  }
  EXPECT_EQ(fakes_->KvTokens(kA1, prefills[0].sequence_id()), (Ids{5, 9, 20, 21, 22}));
  const auto steps = fakes_->Steps(kA1);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].sequences(0).rows(), 1);
  EXPECT_EQ(Ids(steps[0].sequences(0).tokens().begin(), steps[0].sequences(0).tokens().end()),
            (Ids{21}));
  EXPECT_EQ(Ids(steps[1].sequences(0).tokens().begin(), steps[1].sequences(0).tokens().end()),
            (Ids{22}));
  StepUntilFinished(kA1, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  EXPECT_EQ(StreamedIds(*call, 3), (Ids{21, 22, 23, 24, 25}));
  ASSERT_NE(call->finished(), nullptr);
  EXPECT_EQ(call->finished()->generated_tokens(), 5);
  EXPECT_EQ(call->finished()->finish_reason(), cv1::FINISH_REASON_LENGTH);
  EXPECT_FALSE(call->finished()->has_stop_token_id());
  EXPECT_TRUE(fakes_->Commits(kA1).empty());  // one-row steps need none
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(Metric("dsa_coordinator_time_to_first_token_seconds_count "), 1);
  EXPECT_EQ(Metric("dsa_coordinator_inter_token_latency_seconds_count "), 4);
}

TEST_F(RealModelTest, NgramDraftsAreKeptWhileTheModelAgreesAndSpeculationChangesNoToken) {
  Start({kA1}, {kI1});
  Call* call = Generate(TokensRequest("r1", Ramp(), 10, /*draft=*/4));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  const uint64_t sequence_id = fakes_->Prefills(kA1).at(0).sequence_id();
  // Step 1: after 12, [10, 11, 12] occurs at 0; drafts 13..16, all confirmed, then 17.
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);
  ASSERT_TRUE(call->stream.AwaitEvents(3));
  Ids kv = Ramp();
  kv.insert(kv.end(), {12, 13, 14, 15, 16});  // every token but the last (17)
  EXPECT_EQ(fakes_->KvTokens(kA1, sequence_id), kv);
  // Step 2: after 17, [14, 15, 16, 17] occurs at 4; drafts 10, 11, 12 (3: 4 tokens are left), the
  // model says 18: none kept.
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);
  StepUntilFinished(kA1, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  // The model's own greedy continuation, whatever was drafted.
  EXPECT_EQ(StreamedIds(*call, 10), (Ids{12, 13, 14, 15, 16, 17, 18, 19, 20, 21}));
  const std::vector<cv1::Tokens> events = TokensEvents(*call);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ((std::vector<int>{events[1].count(), events[1].drafted(), events[1].accepted()}),
            (std::vector<int>{5, 4, 4}));
  EXPECT_EQ((std::vector<int>{events[2].count(), events[2].drafted(), events[2].accepted()}),
            (std::vector<int>{1, 3, 0}));
  const auto steps = fakes_->Steps(kA1);
  ASSERT_GE(steps.size(), 2u);
  EXPECT_EQ(Ids(steps[0].sequences(0).tokens().begin(), steps[0].sequences(0).tokens().end()),
            (Ids{12, 13, 14, 15, 16}));
  EXPECT_EQ(Ids(steps[1].sequences(0).tokens().begin(), steps[1].sequences(0).tokens().end()),
            (Ids{17, 10, 11, 12}));
  // Commit(count - 1) after each speculative step.
  const auto commits = fakes_->Commits(kA1);
  ASSERT_EQ(commits.size(), 2u);
  EXPECT_EQ(commits[0].accepted(), 4);
  EXPECT_EQ(commits[1].accepted(), 0);
  EXPECT_EQ(Metric("dsa_coordinator_spec_decode_draft_tokens_total "), 7);
  EXPECT_EQ(Metric("dsa_coordinator_spec_decode_accepted_tokens_total "), 4);
}

TEST_F(RealModelTest, EndOfSequenceInsideAStepEndsTheRequestAndCommitsOnlyWhatWasKept) {
  Start({kA1}, {kI1});
  // After 62, [60, 61, 62] occurs at 0: drafts 63, 0, 1, 60; the model confirms 63, 0, 1 (64 mod
  // 64 = 0) and says 2. The end-of-sequence token 63 ends it there.
  const Ids context = {60, 61, 62, kTinyEos, 0, 1, 60, 61};
  Call* call = Generate(TokensRequest("r1", context, 20, /*draft=*/4));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  StepUntilFinished(kA1, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  EXPECT_EQ(StreamedIds(*call, 8), (Ids{62, kTinyEos}));
  const std::vector<cv1::Tokens> events = TokensEvents(*call);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ((std::vector<int>{events[1].count(), events[1].drafted(), events[1].accepted()}),
            (std::vector<int>{1, 4, 3}));
  ASSERT_EQ(fakes_->Commits(kA1).size(), 1u);
  EXPECT_EQ(fakes_->Commits(kA1)[0].accepted(), 0);
  EXPECT_EQ(call->finished()->finish_reason(), cv1::FINISH_REASON_EOS);
  EXPECT_EQ(call->finished()->stop_token_id(), kTinyEos);
  EXPECT_EQ(call->finished()->generated_tokens(), 2);
  EXPECT_EQ(fakes_->Sequences(kA1), 0);

  // ignore_eos: the same step keeps 63, 0, 1 and the model's 2, and goes on to max_new_tokens.
  GenerateSpec ignoring = TokensRequest("r2", context, 5, /*draft=*/4);
  ignoring.ignore_eos = true;
  Call* on = Generate(ignoring);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  StepUntilFinished(kA1, *on);
  on->Join();
  ASSERT_TRUE(on->status.ok()) << on->status;
  EXPECT_EQ(StreamedIds(*on, 8), (Ids{62, kTinyEos, 0, 1, 2}));
  EXPECT_EQ(on->finished()->finish_reason(), cv1::FINISH_REASON_LENGTH);
  EXPECT_EQ(fakes_->Commits(kA1).back().accepted(), 3);
}

TEST_F(RealModelTest, AStopTokenEndsTheRequestWithItsIdAndTheRightCommit) {
  Start({kA1}, {kI1});
  // Drafts 13..16 confirmed (and 17); the stop token 15 ends it: 13, 14, 15 kept, Commit(2).
  GenerateSpec request = TokensRequest("r1", Ramp(), 20, /*draft=*/4);
  request.stop_token_ids.push_back(40);
  request.stop_token_ids.push_back(15);
  Call* call = Generate(request);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  const uint64_t sequence_id = fakes_->Prefills(kA1).at(0).sequence_id();
  StepUntilFinished(kA1, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  EXPECT_EQ(StreamedIds(*call, 10), (Ids{12, 13, 14, 15}));
  EXPECT_EQ(call->finished()->finish_reason(), cv1::FINISH_REASON_STOP_TOKEN);
  EXPECT_EQ(call->finished()->stop_token_id(), 15);
  EXPECT_EQ(call->finished()->generated_tokens(), 4);
  ASSERT_EQ(fakes_->Commits(kA1).size(), 1u);
  EXPECT_EQ(fakes_->Commits(kA1)[0].sequence_id(), sequence_id);
  EXPECT_EQ(fakes_->Commits(kA1)[0].accepted(), 2);
  EXPECT_EQ(TokensEvents(*call).back().accepted(), 4);  // what the model confirmed

  // A stop token as the prefill's token: done without a decode step.
  GenerateSpec at_once = TokensRequest("r2", {5, 9, 20}, 20);
  at_once.stop_token_ids.push_back(21);
  Call* quick = Generate(at_once);
  quick->Join();
  ASSERT_TRUE(quick->status.ok()) << quick->status;
  EXPECT_EQ(StreamedIds(*quick, 3), (Ids{21}));
  EXPECT_EQ(quick->finished()->finish_reason(), cv1::FINISH_REASON_STOP_TOKEN);
  EXPECT_EQ(quick->admitted().attention_worker(), kA1);
  EXPECT_EQ(fakes_->Steps(kA1).size(), 1u);  // r1's only
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
}

TEST_F(RealModelTest, MaxNewTokensBoundsTheDraftSoTheLastStepEndsExactlyThere) {
  Start({kA1}, {kI1});
  // 3 tokens: 12 from the prefill, then 2 left: one draft (13), confirmed, then 14.
  Call* call = Generate(TokensRequest("r1", Ramp(), 3, /*draft=*/4));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  StepUntilFinished(kA1, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  EXPECT_EQ(StreamedIds(*call, 10), (Ids{12, 13, 14}));
  EXPECT_EQ(fakes_->Steps(kA1).at(0).sequences(0).rows(), 2);
  EXPECT_EQ(fakes_->Commits(kA1).at(0).accepted(), 1);
  EXPECT_EQ(call->finished()->finish_reason(), cv1::FINISH_REASON_LENGTH);

  // max_new_tokens 1: the prefill's token is all.
  Call* one = Generate(TokensRequest("r2", Ramp(), 1, /*draft=*/4));
  one->Join();
  ASSERT_TRUE(one->status.ok()) << one->status;
  EXPECT_EQ(StreamedIds(*one, 10), (Ids{12}));
  EXPECT_EQ(one->finished()->finish_reason(), cv1::FINISH_REASON_LENGTH);
  EXPECT_EQ(fakes_->Steps(kA1).size(), 1u);
}

TEST_F(RealModelTest, SequencesWithAndWithoutDraftsShareOneDecodeStep) {
  Start({kA1}, {kI1});
  Call* drafting = Generate(TokensRequest("r1", Ramp(), 6, /*draft=*/2));
  Call* plain = Generate(TokensRequest("r2", {1, 30}, 6, /*draft=*/2));  // nothing to look up
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 2, kSafetyNet));
  ASSERT_EQ(*engine_->StepWorker(kA1), 2);
  const auto steps = fakes_->Steps(kA1);
  ASSERT_EQ(steps.size(), 1u);
  ASSERT_EQ(steps[0].sequences_size(), 2);
  std::vector<std::vector<int32_t>> rows_tokens;
  for (const auto& s : steps[0].sequences()) {
    EXPECT_EQ(s.rows(), s.tokens_size());
    rows_tokens.emplace_back(s.tokens().begin(), s.tokens().end());
  }
  std::sort(rows_tokens.begin(), rows_tokens.end());
  EXPECT_EQ(rows_tokens, (std::vector<std::vector<int32_t>>{{12, 13, 14}, {31}}));
  StepUntilFinished(kA1, *drafting);
  StepUntilFinished(kA1, *plain);
  drafting->Join();
  plain->Join();
  EXPECT_EQ(StreamedIds(*drafting, 10), (Ids{12, 13, 14, 15, 16, 17}));
  EXPECT_EQ(StreamedIds(*plain, 2), (Ids{31, 32, 33, 34, 35, 36}));
}

TEST_F(RealModelTest, SamplingReachesTheWorkerAndASeedRepeats) {
  Start({kA1}, {kI1});
  // The tiny model steps by 1 + seed mod 3 when it samples: 3 for seed 5.
  GenerateSpec request = TokensRequest("r1", {5}, 3);
  request.sampling.temperature = 0.7f;
  request.sampling.top_p = 0.9f;
  request.sampling.seed = 5;
  for (int run = 0; run < 2; ++run) {
    request.request_id = absl::StrCat("r", run);
    Call* call = Generate(request);
    ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
    StepUntilFinished(kA1, *call);
    call->Join();
    ASSERT_TRUE(call->status.ok()) << call->status;
    EXPECT_EQ(StreamedIds(*call, 1), (Ids{8, 11, 14}));
  }
  const auto prefill = fakes_->Prefills(kA1).at(0);
  EXPECT_FLOAT_EQ(prefill.sampling().temperature(), 0.7f);
  EXPECT_FLOAT_EQ(prefill.sampling().top_p(), 0.9f);
  EXPECT_EQ(prefill.sampling().seed(), 5u);
}

// Without a seed, equal sampled requests (even with one request id) must not draw alike: the
// coordinator picks a seed per request, and keeps it when the request moves to another worker.
TEST_F(RealModelTest, AnUnseededSampledRequestGetsASeedOfItsOwnThatAMigrationKeeps) {
  Start({kA1, kA2}, {kI1});
  GenerateSpec request = TokensRequest("same-id", {5}, 4);
  request.sampling.temperature = 0.7f;
  std::vector<uint64_t> seeds;
  for (int run = 0; run < 2; ++run) {
    Call* call = Generate(request);
    ASSERT_TRUE(call->stream.AwaitEvents(2));
    const std::string worker = call->admitted().attention_worker();
    ASSERT_TRUE(engine_->AwaitDecoding(worker, 1, kSafetyNet));
    const auto prefills = fakes_->Prefills(worker);
    ASSERT_FALSE(prefills.empty());
    seeds.push_back(prefills.back().sampling().seed());
    if (run == 1) {
      // Move the second request: its re-prefill carries the seed it started with.
      const std::string other = worker == kA1 ? kA2 : kA1;
      const size_t before = fakes_->Prefills(other).size();
      fakes_->SetDown(worker, true);
      ASSERT_EQ(*engine_->StepWorker(worker), 1);  // fails: the request moves
      ASSERT_TRUE(engine_->AwaitDecoding(other, 1, kSafetyNet));
      const auto moved = fakes_->Prefills(other);
      ASSERT_EQ(moved.size(), before + 1);
      EXPECT_EQ(moved.back().sampling().seed(), seeds[1]);
      StepUntilFinished(other, *call);
    } else {
      StepUntilFinished(worker, *call);
    }
    call->Join();
    ASSERT_TRUE(call->status.ok()) << call->status;
  }
  EXPECT_NE(seeds[0], seeds[1]);
  // A greedy request needs none and gets none.
  Call* greedy = Generate(TokensRequest("greedy", {5}, 1));
  ASSERT_TRUE(greedy->stream.AwaitEvents(2));
  const std::string worker = greedy->admitted().attention_worker();
  greedy->Join();
  ASSERT_TRUE(greedy->status.ok()) << greedy->status;
  EXPECT_EQ(fakes_->Prefills(worker).back().sampling().seed(), 0u);
}

TEST_F(RealModelTest, EachBadFieldIsRefusedWithAPreciseStatus) {
  Start({kA1}, {kI1});
  struct Case {
    GenerateSpec request;
    absl::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  const auto bad = absl::StatusCode::kInvalidArgument;
  cases.push_back({Request("a", 10, 1), bad,
                   "model 'tiny' generates real tokens: the request needs context_tokens "
                   "(context_length alone is for the synthetic pattern model)"});
  cases.push_back({TokensRequest("a", {1, 2, 64}, 1), bad,
                   "context_tokens.tokens[2] = 64 is outside the vocabulary [0, 64) of model "
                   "'tiny'"});
  cases.push_back({TokensRequest("a", {1, -5}, 1), bad,
                   "context_tokens.tokens[1] = -5: token ids must be >= 0"});
  {
    GenerateSpec r = TokensRequest("a", {1}, 1);
    r.stop_token_ids.push_back(3);
    r.stop_token_ids.push_back(100);
    cases.push_back({r, bad,
                     "stop_token_ids[1] = 100 is outside the vocabulary [0, 64) of model "
                     "'tiny'"});
  }
  {
    GenerateSpec r = TokensRequest("a", {1}, 1);
    r.stop_token_ids.push_back(-1);
    cases.push_back({r, bad, "stop_token_ids[0] = -1: token ids must be >= 0"});
  }
  {
    GenerateSpec r = TokensRequest("a", {1}, 1);
    for (int i = 0; i <= kMaxStopTokenIds; ++i) r.stop_token_ids.push_back(1);
    cases.push_back({r, bad, "stop_token_ids holds 257 ids; at most 256"});
  }
  for (float temperature : {-1.0f, 100.5f, std::numeric_limits<float>::quiet_NaN()}) {
    GenerateSpec r = TokensRequest("a", {1}, 1);
    r.sampling.temperature = temperature;
    cases.push_back({r, bad, "sampling.temperature must be 0 (greedy) or in (0, 100], got "});
  }
  for (float top_p : {-0.1f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    GenerateSpec r = TokensRequest("a", {1}, 1);
    r.sampling.top_p = top_p;
    cases.push_back({r, bad, "sampling.top_p must be in (0, 1] (0 means 1), got "});
  }
  {
    GenerateSpec r = TokensRequest("a", {1}, 1);
    r.prefix_block_ids.push_back(7);
    cases.push_back({r, bad,
                     "prefix_block_ids must be empty with context_tokens: the coordinator "
                     "derives the prefix block ids from the tokens"});
  }
  cases.push_back({TokensRequest("a", {1, 2, 3}, 4094), absl::StatusCode::kResourceExhausted,
                   "context (3 tokens) + max_new_tokens (4094) = 4097 tokens exceed the "
                   "max_context of model 'tiny' (4096 tokens)"});
  for (const Case& c : cases) {
    RecordingStream stream;
    const absl::Status status = engine_->Generate(c.request, "router", "", stream);
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), c.message)) << status;
    EXPECT_TRUE(stream.events().empty());
  }
  EXPECT_EQ(Requests("rejected"), static_cast<int64_t>(cases.size()));
  EXPECT_TRUE(fakes_->Prefills(kA1).empty());
  // At the limit: 3 + 4093 = 4096 tokens fit.
  Call* call = Generate(TokensRequest("fits", {1, 2, 3}, 4093));
  ASSERT_TRUE(call->stream.AwaitEvents(2));
  ASSERT_TRUE(engine_->Abort("fits", "router").ok());
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);
  call->Join();
  EXPECT_EQ(call->status.code(), absl::StatusCode::kCancelled);
}

TEST_F(RealModelTest, PrefixBlockIdsComeFromTheTokensSoEqualPrefixesShareAndOthersNever) {
  options_.retain_finished = true;  // finished sequences stay as prefix donors
  Start({kA1}, {kI1});
  Ids prompt(1100);
  for (int i = 0; i < 1100; ++i) prompt[i] = (i * 7) % 61;
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(TokensRequest("donor", prompt, 2), kA1));
  Ids same = prompt;
  same.resize(1050);  // the same two whole blocks, another tail
  same.push_back(3);
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(TokensRequest("same", same, 2), kA1));
  Ids changed = prompt;
  changed[100] = (changed[100] + 1) % 61;  // one token of block 0
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(TokensRequest("changed", changed, 2), kA1));
  const auto prefills = fakes_->Prefills(kA1);
  ASSERT_EQ(prefills.size(), 3u);
  const std::vector<uint64_t> ids = PrefixBlockIdsOfTokens(prompt);
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(std::vector<uint64_t>(prefills[0].prefix_block_ids().begin(),
                                  prefills[0].prefix_block_ids().end()),
            ids);
  EXPECT_EQ(std::vector<uint64_t>(prefills[1].prefix_block_ids().begin(),
                                  prefills[1].prefix_block_ids().end()),
            ids);
  ASSERT_TRUE(prefills[1].has_prefix_source_id());
  EXPECT_EQ(prefills[1].prefix_source_id(), prefills[0].sequence_id());
  EXPECT_EQ(prefills[1].prefix_slots(), 1024);
  EXPECT_EQ(prefills[1].tokens_size(), 1051);  // every token: the worker computes its KV
  ASSERT_EQ(prefills[2].prefix_block_ids_size(), 2);
  EXPECT_NE(prefills[2].prefix_block_ids(0), ids[0]);
  EXPECT_NE(prefills[2].prefix_block_ids(1), ids[1]);
  EXPECT_FALSE(prefills[2].has_prefix_source_id());
}

TEST_F(RealModelTest, AMigratedRequestIsPrefilledWithEveryTokenSoFarAndGoesOnWhereItWas) {
  Start({kA1, kA2}, {kI1});
  Call* call = Generate(TokensRequest("r1", {5, 9, 20}, 6));
  ASSERT_TRUE(call->stream.AwaitEvents(2));  // Admitted, the prefill's 21
  const std::string first = call->admitted().attention_worker();
  const std::string second = first == kA1 ? kA2 : kA1;
  ASSERT_TRUE(engine_->AwaitDecoding(first, 1, kSafetyNet));
  for (int step = 0; step < 2; ++step) {  // 22, 23
    ASSERT_EQ(*engine_->StepWorker(first), 1);
    ASSERT_TRUE(call->stream.AwaitEvents(3 + step));
  }
  fakes_->SetDown(first, true);
  ASSERT_EQ(*engine_->StepWorker(first), 1);  // fails: the request moves
  ASSERT_TRUE(engine_->AwaitDecoding(second, 1, kSafetyNet));
  const auto moved = fakes_->Prefills(second);
  ASSERT_EQ(moved.size(), 1u);
  EXPECT_EQ(moved[0].context_length(), 6);
  EXPECT_EQ(Ids(moved[0].tokens().begin(), moved[0].tokens().end()), (Ids{5, 9, 20, 21, 22, 23}));
  StepUntilFinished(second, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  // The moved prefill's token (24) is the next one; nothing lost, nothing repeated.
  EXPECT_EQ(StreamedIds(*call, 3), (Ids{21, 22, 23, 24, 25, 26}));
  EXPECT_EQ(call->finished()->migrations(), 1);
  EXPECT_EQ(call->finished()->generated_tokens(), 6);
  fakes_->SetDown(first, false);
  engine_->RefreshWorkers();
  EXPECT_EQ(fakes_->Sequences(first), 0);
}

TEST_F(RealModelTest, ASessionTurnMustStartWithTheHistoryAndPrefillsOnlyWhatIsNew) {
  Start({kA1}, {kI1});
  GenerateSpec turn1 = TokensRequest("t1", {5, 9, 20}, 3);
  turn1.session_id = "chat";
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn1, kA1));  // 21, 22, 23
  const uint64_t sequence_id = fakes_->Prefills(kA1).at(0).sequence_id();
  EXPECT_EQ(fakes_->KvTokens(kA1, sequence_id), (Ids{5, 9, 20, 21, 22}));

  // The history is 5, 9, 20, 21, 22, 23: a turn that changes it is refused, naming where.
  GenerateSpec wrong = TokensRequest("t2", {5, 9, 20, 21, 33, 23, 40}, 3);
  wrong.session_id = "chat";
  Call* refused = Generate(wrong);
  refused->Join();
  EXPECT_EQ(refused->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused->status.message(),
            "session 'chat': context_tokens must start with the session's 6 tokens (previous "
            "context + generated tokens); position 4 differs: 33, the session has 22");
  GenerateSpec shorter = TokensRequest("t2", {5, 9, 20, 21}, 3);
  shorter.session_id = "chat";
  Call* too_short = Generate(shorter);
  too_short->Join();
  EXPECT_EQ(too_short->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(too_short->status.message(), "holds 6 slots")) << too_short->status;

  // The next turn: only the tokens from the sequence's length (5 slots) on are prefilled: the last
  // generated token, which the KV does not hold yet, then the new ones.
  GenerateSpec turn2 = TokensRequest("t2", {5, 9, 20, 21, 22, 23, 40, 41}, 2);
  turn2.session_id = "chat";
  Call* call = Generate(turn2);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  const auto prefills = fakes_->Prefills(kA1);
  ASSERT_EQ(prefills.size(), 2u);
  EXPECT_TRUE(prefills[1].continue_sequence());
  EXPECT_EQ(prefills[1].sequence_id(), sequence_id);
  EXPECT_EQ(prefills[1].context_length(), 8);
  EXPECT_EQ(Ids(prefills[1].tokens().begin(), prefills[1].tokens().end()), (Ids{23, 40, 41}));
  StepUntilFinished(kA1, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  EXPECT_EQ(StreamedIds(*call, 8), (Ids{42, 43}));
  EXPECT_EQ(fakes_->KvTokens(kA1, sequence_id), (Ids{5, 9, 20, 21, 22, 23, 40, 41, 42}));
}

TEST_F(RealModelTest, WorkersOfAnotherModelAreNotTakenInTogetherAndGetLoadNamesTheModel) {
  fakes_->AddAttention(kA1, attention_shape_);
  fakes_->AddAttention(kA2, FakeWorkers::AttentionShape{});  // the pattern model
  fakes_->AddIndexer(kI1);
  options_.attention_addresses = {kA1, kA2};
  options_.indexer_addresses = {kI1};
  auto engine = CoordinatorEngine::Create(options_, &metrics_, fakes_, &clock_);
  ASSERT_TRUE(engine.ok()) << engine.status();
  engine_ = *std::move(engine);
  cv1::GetLoadResponse load = GetLoad();
  ASSERT_EQ(load.attention_workers_size(), 1);
  EXPECT_EQ(load.attention_workers(0).address(), kA1);
  EXPECT_EQ(load.model().name(), "tiny");
  EXPECT_EQ(load.model().vocab_size(), 64);
  EXPECT_EQ(load.model().eos_token_id(), kTinyEos);
  EXPECT_EQ(load.model().max_context(), 4096);

  // A1 leaves with nothing held: the pattern worker is taken in, and the coordinator serves its
  // model; A1 back keeps no new sequence (another model).
  fakes_->SetDown(kA1, true);
  engine_->RefreshWorkers();
  engine_->RefreshWorkers();
  load = GetLoad();
  EXPECT_EQ(load.model().name(), "pattern");
  EXPECT_EQ(load.model().vocab_size(), 0);
  EXPECT_EQ(load.model().eos_token_id(), -1);
  fakes_->SetDown(kA1, false);
  engine_->RefreshWorkers();
  load = GetLoad();
  ASSERT_EQ(load.attention_workers_size(), 2);
  for (const auto& w : load.attention_workers()) EXPECT_EQ(w.ready(), w.address() == kA2);
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(Request("r1", 10, 2), kA2));
}

TEST(RealModelEngineCreateTest, NgramLengthsOutOfRangeAreRefused) {
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  CoordinatorOptions options;
  options.attention_addresses = {kA1};
  options.indexer_addresses = {kI1};
  options.run_loops = false;
  options.ngram = {3, 2};
  auto engine = CoordinatorEngine::Create(options, &metrics, std::make_shared<FakeWorkers>());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.status().message(),
            "n-gram lengths must satisfy 1 <= min_ngram (--ngram-min, 3) <= max_ngram "
            "(--ngram-max, 2) <= 64");
}

// The pattern model: context token ids must be >= 0 too; sampling and stop ids are validated and
// ignored; every request ends at max_new_tokens (FINISH_REASON_LENGTH) without token ids.
TEST_F(EngineTest, ThePatternModelRefusesNegativeIdsAndIgnoresTheRealModelsFields) {
  Start({kA1}, {kI1});
  RecordingStream stream;
  const absl::Status refused =
      engine_->Generate(TokensRequest("a", {-5, 1000000000}, 1), "router", "", stream);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.message(), "context_tokens.tokens[0] = -5: token ids must be >= 0");
  GenerateSpec request = TokensRequest("r1", {5, 1000000000}, 3);
  request.stop_token_ids.push_back(6);
  request.sampling.temperature = 1.0f;
  request.ignore_eos = true;
  Call* call = Generate(request);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  StepUntilFinished(kA1, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  bool contiguous = false;
  EXPECT_EQ(call->Tokens(2, &contiguous), 3);
  EXPECT_TRUE(contiguous);
  for (const cv1::Tokens& t : TokensEvents(*call)) EXPECT_EQ(t.token_ids_size(), 0);
  EXPECT_EQ(call->finished()->finish_reason(), cv1::FINISH_REASON_LENGTH);
  const auto prefill = fakes_->Prefills(kA1).at(0);
  EXPECT_EQ(prefill.tokens_size(), 0);
  EXPECT_FALSE(prefill.has_sampling());
  EXPECT_EQ(GetLoad().model().name(), "pattern");
}

}  // namespace
}  // namespace dsa
