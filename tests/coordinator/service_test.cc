// Tests of the coordinator service (coordinator/service.h) in-process on 127.0.0.1:0, over fake
// attention workers and real in-process indexer servers (service_fixture.h), one request's life:
// event streams with exact token counts, speculative steps, trace context, refusals with precise
// statuses, the queue, Abort and client cancel, a failing or lost worker and a slow reader.
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/trace_context.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/parse_errors.h"
#include "tests/coordinator/requests_metric.h"
#include "tests/coordinator/service_fixture.h"
#include "tests/testing/raw_call.h"

namespace dsa {
namespace {

using namespace ::dsa::service_testing;  // NOLINT(google-build-using-namespace)

TEST(CoordinatorServiceTest, StreamsAdmittedTokensAndFinishedWithExactlyMaxNewTokens) {
  Cluster cluster;
  const Stream s = Generate(cluster.stub(), Request("r1", 300, 7));
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  ASSERT_EQ(s.events.size(), 9u);  // Admitted, 7 x Tokens, Finished
  ASSERT_NE(s.admitted(), nullptr);
  EXPECT_EQ(s.admitted()->indexer_worker(), cluster.indexer_address());
  EXPECT_EQ(s.admitted()->attention_worker(), cluster.attention_address());
  EXPECT_EQ(s.admitted()->prefix_slots_reused(), 0);
  for (int i = 0; i < 7; ++i) {
    const cv1::GenerateEvent& e = s.events[1 + i];
    ASSERT_TRUE(e.has_tokens());
    EXPECT_EQ(e.tokens().first_position(), 300 + i);
    EXPECT_EQ(e.tokens().count(), 1);
    EXPECT_EQ(e.tokens().drafted(), 0);
    EXPECT_EQ(e.tokens().selection_wait_seconds_size(), 2 * kLayers);
  }
  ASSERT_TRUE(s.events.back().has_finished());
  EXPECT_EQ(s.events.back().finished().generated_tokens(), 7);
  EXPECT_GT(s.events.back().finished().time_to_first_token_seconds(), 0.0);
  // The prefill carried the deployment's settings and the indexer address.
  const auto prefills = cluster.fake().prefills();
  ASSERT_EQ(prefills.size(), 1u);
  EXPECT_EQ(prefills[0].context_length(), 300);
  EXPECT_EQ(prefills[0].indexer_worker(), cluster.indexer_address());
  EXPECT_EQ(prefills[0].settings().top_k(), 64);
  EXPECT_DOUBLE_EQ(prefills[0].settings().spin().target_block_sparsity(), 0.4);
  EXPECT_FALSE(prefills[0].settings().spin().has_miss_target());  // the indexer's default
  EXPECT_FALSE(prefills[0].continue_sequence());
  // Finished and retained as a donor: KV released, index keys kept.
  ASSERT_TRUE(cluster.fake().AwaitReleases(1));
  EXPECT_TRUE(cluster.fake().releases()[0].keep_indexer_sequence());
  const cv1::GetLoadResponse load = Load(cluster.stub());
  EXPECT_EQ(load.running(), 0);
  EXPECT_EQ(load.queued(), 0);
  EXPECT_EQ(load.retained_sequences(), 1);
  // The indexer holds the prefill's 300 slots: 5 blocks per layer.
  EXPECT_EQ(load.cache_blocks_used(), 5 * kLayers);
  EXPECT_EQ(load.cache_blocks_capacity(), 4096);
  ASSERT_EQ(load.indexer_workers_size(), 1);
  EXPECT_EQ(load.indexer_workers(0).sequences(), 1);
  const std::string metrics = cluster.Metrics();
  EXPECT_THAT(metrics,
              HasSubstr("dsa_coordinator_requests_total{code=\"OK\",outcome=\"completed\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("dsa_coordinator_time_to_first_token_seconds_count 1"));
  EXPECT_THAT(metrics, HasSubstr("dsa_coordinator_inter_token_latency_seconds_count 6"));
  EXPECT_THAT(metrics, HasSubstr("dsa_coordinator_queue_duration_seconds_count 1"));
}

// A request's miss target goes to its indexer sequence; this cluster's indexer does not audit, so
// the request fails with the indexer's precise reason.
TEST(CoordinatorServiceTest, ARequestsMissTargetReachesItsIndexerSequence) {
  Cluster cluster;
  cv1::GenerateRequest request = Request("r1", 300, 2);
  request.mutable_overrides()->set_miss_target(0.05);
  const Stream s = Generate(cluster.stub(), request);
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.status.error_message().find("needs audits"), std::string::npos)
      << s.status.error_message();
  const auto prefills = cluster.fake().prefills();
  ASSERT_FALSE(prefills.empty());
  ASSERT_TRUE(prefills[0].settings().spin().has_miss_target());
  EXPECT_DOUBLE_EQ(prefills[0].settings().spin().miss_target(), 0.05);
}

TEST(CoordinatorServiceTest, SpeculativeStepsNeverExceedMaxNewTokens) {
  Cluster cluster;
  // Acceptance 1: every draft accepted. d = 3, 10 tokens: rows 4, 4, 2 -> counts 4, 4, 2.
  cv1::GenerateRequest all = Request("all", 100, 10, 3);
  all.mutable_overrides()->set_acceptance_rate(1.0);
  const Stream a = Generate(cluster.stub(), all);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  std::vector<std::vector<int>> steps;
  for (const auto& e : a.events) {
    if (e.has_tokens()) {
      steps.push_back({e.tokens().count(), e.tokens().drafted(), e.tokens().accepted()});
    }
  }
  EXPECT_EQ(steps, (std::vector<std::vector<int>>{{4, 3, 3}, {4, 3, 3}, {2, 1, 1}}));
  // Acceptance 0: one token a step; drafts shrink as the end nears: rows 4, 4, 3, 2, 1.
  cv1::GenerateRequest none = Request("none", 100, 5, 3);
  none.mutable_overrides()->set_acceptance_rate(0.0);
  const Stream n = Generate(cluster.stub(), none);
  ASSERT_TRUE(n.status.ok()) << n.status.error_message();
  std::vector<int> drafted;
  for (const auto& e : n.events) {
    if (e.has_tokens()) {
      EXPECT_EQ(e.tokens().count(), 1);
      drafted.push_back(e.tokens().drafted());
    }
  }
  EXPECT_EQ(drafted, (std::vector<int>{3, 3, 2, 1, 0}));
  // Commits: one per speculative step (3 + 4), none for the 1-row step.
  EXPECT_EQ(cluster.fake().commits().size(), 7u);
  const std::string metrics = cluster.Metrics();
  EXPECT_THAT(metrics, HasSubstr("dsa_coordinator_spec_decode_draft_tokens_total 16"));
  EXPECT_THAT(metrics, HasSubstr("dsa_coordinator_spec_decode_accepted_tokens_total 7"));

  // The default rate (0.7), seeded: the same request id draws the same accepted counts, and the
  // counts always sum to max_new_tokens.
  std::vector<int> first_run;
  for (int run = 0; run < 2; ++run) {
    const Stream s = Generate(cluster.stub(), Request("seeded", 200, 23, 4));
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_EQ(s.TokenCount(), 23);
    EXPECT_EQ(s.events.back().finished().generated_tokens(), 23);
    std::vector<int> accepted;
    int64_t position = 200;
    for (const auto& e : s.events) {
      if (!e.has_tokens()) continue;
      EXPECT_EQ(e.tokens().first_position(), position);
      EXPECT_EQ(e.tokens().count(), e.tokens().accepted() + 1);
      position += e.tokens().count();
      accepted.push_back(e.tokens().accepted());
    }
    if (run == 0) {
      first_run = accepted;
    } else {
      EXPECT_EQ(accepted, first_run);
    }
  }
}

TEST(CoordinatorServiceTest, TheRoutersTraceparentIsCarriedToTheWorkersAsAChildSpan) {
  Cluster cluster;
  const std::string traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  {
    grpc::ClientContext context;
    context.AddMetadata("traceparent", traceparent);
    auto reader = cluster.stub().Generate(&context, Request("traced", 100, 3));
    cv1::GenerateEvent event;
    while (reader->Read(&event)) {
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  // Without one (or with a malformed one) the coordinator starts a trace of its own.
  {
    grpc::ClientContext context;
    context.AddMetadata("traceparent", "00-00000000000000000000000000000000-00f067aa0ba902b7-01");
    auto reader = cluster.stub().Generate(&context, Request("untraced", 100, 3));
    cv1::GenerateEvent event;
    while (reader->Read(&event)) {
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  const std::vector<std::string> sent = cluster.fake().prefill_traceparents();
  ASSERT_EQ(sent.size(), 2u);
  const std::optional<TraceContext> first = ParseTraceparent(sent[0]);
  ASSERT_TRUE(first.has_value()) << sent[0];
  EXPECT_EQ(first->trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");  // the router's trace
  EXPECT_NE(first->parent_id, "00f067aa0ba902b7");                 // the coordinator's own span
  const std::optional<TraceContext> second = ParseTraceparent(sent[1]);
  ASSERT_TRUE(second.has_value()) << sent[1];
  EXPECT_NE(second->trace_id, "00000000000000000000000000000000");
  EXPECT_NE(second->trace_id, first->trace_id);
}

TEST(CoordinatorServiceTest, AReleaseAWorkerDidNotTakeIsRetriedWithItsFlagsAndHoldsItsSpace) {
  // The retained donor's Release (keep_indexer_sequence) fails UNAVAILABLE: the scheduler keeps
  // its space reserved until the retry delivers it, and the retry keeps the index keys.
  Cluster cluster;  // retain_finished: a finished request stays as a prefix donor
  cluster.fake().FailReleases(1);
  cv1::GenerateRequest donor = Request("donor", 1100, 2);
  for (uint64_t id : {21, 22}) donor.add_prefix_block_ids(id);
  const Stream d = Generate(cluster.stub(), donor);
  ASSERT_TRUE(d.status.ok()) << d.status.error_message();
  EXPECT_EQ(Load(cluster.stub()).retained_sequences(), 0);  // still releasing
  ASSERT_EQ(cluster.fake().releases().size(), 1u);
  cluster.coordinator().RefreshWorkers();  // the worker answers its check: the retry
  const std::vector<av1::ReleaseRequest> releases = cluster.fake().releases();
  ASSERT_EQ(releases.size(), 2u);
  EXPECT_EQ(releases[1].sequence_id(), releases[0].sequence_id());
  EXPECT_TRUE(releases[1].keep_indexer_sequence());  // the donor's index keys stay
  EXPECT_EQ(Load(cluster.stub()).retained_sequences(), 1);
  // And the donor serves a request with the same prefix.
  cv1::GenerateRequest user = Request("user", 1200, 2);
  for (uint64_t id : {21, 22}) user.add_prefix_block_ids(id);
  const Stream u = Generate(cluster.stub(), user);
  ASSERT_TRUE(u.status.ok()) << u.status.error_message();
  EXPECT_GT(u.admitted()->prefix_slots_reused(), 0);
}

TEST(CoordinatorServiceTest, UnparseableRequestsGetInvalidArgument) {
  Cluster cluster;
  const auto channel =
      grpc::CreateChannel(cluster.coordinator_address(), grpc::InsecureChannelCredentials());
  // A request id that is not UTF-8 (proto3 strings must be): field 1, length 2, bytes ff fe.
  const std::string bad_id = std::string("\x0a\x02\xff\xfe", 4);
  for (const auto& [method, message] : std::vector<std::pair<std::string, std::string>>{
           {"Generate", bad_id},
           {"Generate", dsa::testing::UnparseableMessage()},
           {"Abort", bad_id},
           {"GetLoad", dsa::testing::UnparseableMessage()}}) {
    const std::string name = "/dsa.coordinator.v1.CoordinatorService/" + method;
    const dsa::testing::RawCallResult result = dsa::testing::RawCall(channel, name, {message});
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_THAT(result.status.error_message(),
                HasSubstr(name + ": the request is not a valid message"));
    EXPECT_TRUE(result.responses.empty());
  }
  EXPECT_EQ(Load(cluster.stub()).running(), 0);
  EXPECT_TRUE(Generate(cluster.stub(), Request("after", 10, 1)).status.ok());
}

TEST(CoordinatorServiceTest, RefusesBadInputWithPreciseStatuses) {
  Cluster cluster;
  struct Case {
    cv1::GenerateRequest request;
    const char* message;
  };
  std::vector<Case> cases;
  cases.push_back({Request("", 10, 1), "request_id must be 1..128 bytes, got 0"});
  cases.push_back({Request(std::string(129, 'x'), 10, 1), "got 129"});
  cases.push_back({Request("a", 0, 1), "context_length must be >= 1, got 0"});
  cases.push_back({Request("a", 10, 0), "max_new_tokens must be >= 1, got 0"});
  cases.push_back({Request("a", 10, 1, 5), "draft_length must be in 0..4, got 5"});
  cases.push_back({Request("a", 10, 1, -1), "draft_length must be in 0..4, got -1"});
  {
    cv1::GenerateRequest r = Request("a", 513, 1);
    for (uint64_t id : {1, 2, 3}) r.add_prefix_block_ids(id);
    cases.push_back({r, "at most ceil(513 / 512) = 2"});
  }
  {
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.mutable_context_tokens();  // empty token list
    cases.push_back({r, "context_tokens must hold at least one token"});
  }
  {
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.clear_context_length();
    cases.push_back({r, "a context is required"});
  }
  {
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.mutable_overrides()->set_target_block_sparsity(1.0);
    cases.push_back({r, "overrides.target_block_sparsity must be in [0, 1), got 1"});
  }
  {
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.mutable_overrides()->set_top_k(0);
    cases.push_back({r, "overrides.top_k must be in [1, 2048] (kMaxTopK), got 0"});
  }
  {
    // A K the backends cannot run (the GPU top-K's largest is 2,048) is refused at admission, so
    // it can never fail a decode batch it would share with others.
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.mutable_overrides()->set_top_k(1 << 20);
    cases.push_back({r, "overrides.top_k must be in [1, 2048] (kMaxTopK), got 1048576"});
  }
  {
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.mutable_overrides()->set_acceptance_rate(1.5);
    cases.push_back({r, "overrides.acceptance_rate must be in [0, 1], got 1.5"});
  }
  {
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.mutable_overrides()->set_exploration_fraction(-0.1);
    cases.push_back({r, "overrides.exploration_fraction must be in [0, 1)"});
  }
  {
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.mutable_overrides()->set_miss_target(1.0);
    cases.push_back({r, "overrides.miss_target must be in [0, 1), got 1"});
  }
  {
    // Token ids are >= 0 whatever the model (the pattern model took [-5, 1000000000] before).
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.mutable_context_tokens()->add_tokens(-5);
    r.mutable_context_tokens()->add_tokens(1000000000);
    cases.push_back({r, "context_tokens.tokens[0] = -5: token ids must be >= 0"});
  }
  {
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.mutable_context_tokens()->add_tokens(5);
    r.add_prefix_block_ids(11);
    cases.push_back({r, "prefix_block_ids must be empty with context_tokens"});
  }
  {
    // The real model's fields are validated for the pattern model too (and otherwise ignored).
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.mutable_sampling()->set_temperature(200);
    cases.push_back({r, "sampling.temperature must be 0 (greedy) or in (0, 100], got 200"});
  }
  {
    cv1::GenerateRequest r = Request("a", 10, 1);
    r.add_stop_token_ids(-2);
    cases.push_back({r, "stop_token_ids[0] = -2: token ids must be >= 0"});
  }
  for (const Case& c : cases) {
    const Stream s = Generate(cluster.stub(), c.request);
    EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.message;
    EXPECT_THAT(s.status.error_message(), HasSubstr(c.message));
    EXPECT_TRUE(s.events.empty());
  }
  // Tokens given explicitly count as the context.
  cv1::GenerateRequest tokens = Request("tokens", 1, 2);
  for (int t = 0; t < 70; ++t) tokens.mutable_context_tokens()->add_tokens(t);
  const Stream ok = Generate(cluster.stub(), tokens);
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.events[1].tokens().first_position(), 70);
  EXPECT_EQ(cluster.fake().prefills().size(), 1u);  // only the good one reached a worker
  EXPECT_EQ(testing::RequestsWithOutcome(cluster.Metrics(), "rejected"),
            static_cast<int64_t>(cases.size()));
  // Each refusal is counted under its own code.
  EXPECT_GT(testing::RequestsWithOutcome(cluster.Metrics(), "rejected", "INVALID_ARGUMENT"), 0);
}

TEST(CoordinatorServiceTest, TooLargeIsRefusedAtOnceWithTheNumbers) {
  ClusterOptions o;
  o.capacity_blocks = 64;
  Cluster cluster(o);
  // ceil((2000 + 100) / 64) = 33 blocks per layer x 2 layers = 66 > 64.
  const Stream s = Generate(cluster.stub(), Request("big", 2000, 100));
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.status.error_message(), HasSubstr("needs 66 index-key-cache blocks"));
  EXPECT_THAT(s.status.error_message(), HasSubstr("largest: 64 blocks"));
  EXPECT_EQ(Load(cluster.stub()).queued(), 0);
}

TEST(CoordinatorServiceTest, FullQueueIsRefusedWhileOthersAreServed) {
  ClusterOptions o;
  o.capacity_blocks = 16;  // one request of ~8 blocks per layer at a time
  o.max_queue = 1;
  o.retain_finished = false;
  Cluster cluster(o);
  cluster.fake().SetStepDelayMs(5);
  Stream first, second;
  std::thread a([&] { first = Generate(cluster.stub(), Request("a", 400, 60)); });
  ASSERT_TRUE(WaitFor([&] { return Load(cluster.stub()).running() == 1; }));
  std::thread b([&] { second = Generate(cluster.stub(), Request("b", 400, 10)); });
  ASSERT_TRUE(WaitFor([&] { return Load(cluster.stub()).queued() == 1; }));
  const auto start = std::chrono::steady_clock::now();
  const Stream third = Generate(cluster.stub(), Request("c", 400, 10));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  EXPECT_EQ(third.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(third.status.error_message(), HasSubstr("queue full"));
  a.join();
  b.join();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(first.TokenCount(), 60);
  EXPECT_EQ(second.TokenCount(), 10);
  EXPECT_GT(second.admitted()->queue_seconds(), 0.0);
}

// On plaintext the caller is its peer's host (TenantIdentity): a client's requests share one
// queued share (8 / 4 = 2 by default), and the refusal names that caller and its limit.
TEST(CoordinatorServiceTest, APlaintextPeersQueuedShareIsRefusedNamingItsHost) {
  ClusterOptions o;
  o.capacity_blocks = 16;  // one request of ~8 blocks per layer at a time
  o.retain_finished = false;
  Cluster cluster(o);
  cluster.fake().SetStepDelayMs(5);
  Stream first, second, third;
  std::thread a([&] { first = Generate(cluster.stub(), Request("a", 400, 60)); });
  ASSERT_TRUE(WaitFor([&] { return Load(cluster.stub()).running() == 1; }));
  std::thread b([&] { second = Generate(cluster.stub(), Request("b", 400, 10)); });
  std::thread c([&] { third = Generate(cluster.stub(), Request("c", 400, 10)); });
  ASSERT_TRUE(WaitFor([&] { return Load(cluster.stub()).queued() == 2; }));
  const Stream refused = Generate(cluster.stub(), Request("d", 400, 10));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(refused.status.error_message(),
            "caller 'peer:127.0.0.1' has 2 requests queued, its limit (--max-queued-per-caller 2); "
            "retry when one of them is admitted");
  a.join();
  b.join();
  c.join();
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_TRUE(third.status.ok()) << third.status.error_message();
}

TEST(CoordinatorServiceTest, DuplicateInFlightIdIsAlreadyExistsAndAbortEndsRequests) {
  ClusterOptions o;
  o.capacity_blocks = 3200;  // "run" takes 2 x ceil(100400 / 64) = 3138 blocks
  o.retain_finished = false;
  Cluster cluster(o);
  cluster.fake().SetStepDelayMs(2);
  Stream running, queued;
  std::thread a([&] { running = Generate(cluster.stub(), Request("run", 400, 100000)); });
  ASSERT_TRUE(WaitFor([&] { return Load(cluster.stub()).running() == 1; }));
  std::thread b([&] { queued = Generate(cluster.stub(), Request("wait", 2000, 10)); });
  ASSERT_TRUE(WaitFor([&] { return Load(cluster.stub()).queued() == 1; }));

  const Stream duplicate = Generate(cluster.stub(), Request("run", 10, 1));
  EXPECT_EQ(duplicate.status.error_code(), grpc::StatusCode::ALREADY_EXISTS);

  EXPECT_EQ(Abort(cluster.stub(), "nobody").error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(Abort(cluster.stub(), "wait").ok());
  b.join();
  EXPECT_EQ(queued.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(queued.events.empty());
  ASSERT_TRUE(Abort(cluster.stub(), "run").ok());
  a.join();
  EXPECT_EQ(running.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(running.TokenCount(), 100000);
  // Resources released: the attention worker and the indexer hold nothing.
  ASSERT_TRUE(cluster.fake().AwaitNumSequences(0));
  ASSERT_TRUE(WaitFor([&] { return Load(cluster.stub()).cache_blocks_used() == 0; }));
  EXPECT_EQ(Load(cluster.stub()).running(), 0);
  EXPECT_THAT(
      cluster.Metrics(),
      HasSubstr("dsa_coordinator_requests_total{code=\"CANCELLED\",outcome=\"cancelled\"} 2"));
  // The id is free again.
  EXPECT_TRUE(Generate(cluster.stub(), Request("run", 10, 1)).status.ok());
}

TEST(CoordinatorServiceTest, AbortDuringPrefillReleasesTheNewSequence) {
  Cluster cluster;
  cluster.fake().HoldPrefills();
  Stream s;
  std::thread t([&] { s = Generate(cluster.stub(), Request("slow-prefill", 500, 10)); });
  ASSERT_TRUE(cluster.fake().AwaitPrefills(1));
  const grpc::Status aborted = Abort(cluster.stub(), "slow-prefill");
  cluster.fake().ReleasePrefills();  // the Prefill held until the Abort is in
  t.join();
  ASSERT_TRUE(aborted.ok());
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(s.TokenCount(), 0);
  EXPECT_EQ(cluster.fake().decode_steps(), 0);
  // Aborted, not retained: nothing left on either worker.
  EXPECT_EQ(cluster.fake().NumSequences(), 0);
  EXPECT_EQ(cluster.engine().Usage().used_blocks, 0);
  EXPECT_EQ(Load(cluster.stub()).retained_sequences(), 0);
}

TEST(CoordinatorServiceTest, ALostAttentionWorkerFailsItsRequestsUnavailable) {
  Cluster cluster;
  cluster.fake().SetStepDelayMs(2);
  Stream s;
  std::thread t([&] { s = Generate(cluster.stub(), Request("lost", 100, 100000)); });
  ASSERT_TRUE(cluster.fake().AwaitDecodeStepsOver(3));
  cluster.StopAttention(0);
  t.join();
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::UNAVAILABLE) << s.status.error_message();
  EXPECT_GT(s.TokenCount(), 0);
  EXPECT_EQ(Load(cluster.stub()).running(), 0);
  // The failure is counted; the coordinator itself goes on answering.
  EXPECT_THAT(
      cluster.Metrics(),
      HasSubstr("dsa_coordinator_requests_total{code=\"UNAVAILABLE\",outcome=\"failed\"} 1"));
}

TEST(CoordinatorServiceTest, ClientCancellingItsStreamAbortsTheRequest) {
  Cluster cluster;
  cluster.fake().SetStepDelayMs(2);
  grpc::ClientContext context;
  auto reader = cluster.stub().Generate(&context, Request("gone", 100, 100000));
  cv1::GenerateEvent event;
  ASSERT_TRUE(reader->Read(&event));
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_TRUE(event.has_tokens());
  context.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(cluster.fake().AwaitNumSequences(0));
  ASSERT_TRUE(WaitFor([&] { return Load(cluster.stub()).running() == 0; }));
  EXPECT_TRUE(WaitFor([&] {
    return cluster.Metrics().find(
               "dsa_coordinator_requests_total{code=\"CANCELLED\",outcome=\"cancelled\"} 1") !=
           std::string::npos;
  }));
}

TEST(CoordinatorServiceTest, AFailingSequenceEndsWithTheWorkersStatusWhileOthersGoOn) {
  Cluster cluster;
  cluster.fake().FailDecodeOfContext(777);
  cluster.fake().SetStepDelayMs(1);
  Stream good, bad;
  std::thread a([&] { good = Generate(cluster.stub(), Request("good", 100, 40)); });
  std::thread b([&] { bad = Generate(cluster.stub(), Request("bad", 777, 40)); });
  a.join();
  b.join();
  ASSERT_TRUE(good.status.ok()) << good.status.error_message();
  EXPECT_EQ(good.TokenCount(), 40);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(bad.status.error_message(), HasSubstr("injected failure"));
  EXPECT_EQ(bad.TokenCount(), 0);
  // The failed sequence was released entirely (not kept as a donor).
  ASSERT_TRUE(cluster.fake().AwaitNumSequences(0));
  bool released_bad = false;
  for (const auto& r : cluster.fake().releases()) {
    released_bad = released_bad || !r.keep_indexer_sequence();
  }
  EXPECT_TRUE(released_bad);
  EXPECT_EQ(Load(cluster.stub()).retained_sequences(), 1);
  EXPECT_THAT(
      cluster.Metrics(),
      HasSubstr("dsa_coordinator_requests_total{code=\"UNAVAILABLE\",outcome=\"failed\"} 1"));
}

TEST(CoordinatorServiceTest, ASlowReaderSlowsOnlyItselfAndIsBounded) {
  ClusterOptions o;
  o.max_pending_events = 4;
  Cluster cluster(o);
  // A client with small HTTP/2 windows, so that unread events back up into the coordinator.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto slow_stub = cv1::CoordinatorService::NewStub(grpc::CreateCustomChannel(
      cluster.coordinator_address(), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext context;
  constexpr int64_t kSlowTokens = 3000;
  auto reader = slow_stub->Generate(&context, Request("slow", 100, kSlowTokens));
  cv1::GenerateEvent event;
  ASSERT_TRUE(reader->Read(&event));
  ASSERT_TRUE(event.has_admitted());
  // Not reading: others are served meanwhile. Their run is also what lets the unread events fill
  // the window and the pending queue: the slow sequence steps with them until it stalls.
  const Stream fast = Generate(cluster.stub(), Request("fast", 100, 200));
  ASSERT_TRUE(fast.status.ok()) << fast.status.error_message();
  EXPECT_EQ(fast.TokenCount(), 200);
  // The slow request stalls well before its end (its sequence stops growing).
  uint64_t slow_id = 0;
  for (const auto& p : cluster.fake().prefills()) {
    if (p.context_length() == 100 && slow_id == 0) slow_id = p.sequence_id();
  }
  const std::optional<int64_t> stalled = cluster.fake().Length(slow_id);
  ASSERT_TRUE(stalled.has_value());
  EXPECT_LT(*stalled, 100 + kSlowTokens);
  // Over a whole later request, one token a step on the same worker, each step was a chance for
  // the slow sequence to advance: it is left out of every one, and does not grow.
  const size_t steps_before = cluster.fake().steps().size();
  constexpr int64_t kWitnessTokens = 100;
  const Stream witness = Generate(cluster.stub(), Request("witness", 100, kWitnessTokens));
  ASSERT_TRUE(witness.status.ok()) << witness.status.error_message();
  EXPECT_EQ(witness.TokenCount(), kWitnessTokens);
  const std::vector<av1::DecodeStepRequest> steps = cluster.fake().steps();
  ASSERT_GE(steps.size(), steps_before + kWitnessTokens);
  int slow_steps = 0;
  for (size_t i = steps_before; i < steps.size(); ++i) {
    for (const av1::SequenceStep& step : steps[i].sequences()) {
      slow_steps += step.sequence_id() == slow_id ? 1 : 0;
    }
  }
  EXPECT_EQ(slow_steps, 0) << "of " << steps.size() - steps_before << " steps";
  EXPECT_EQ(cluster.fake().Length(slow_id), stalled);
  // Reading again, it completes with every token.
  int64_t tokens = 0;
  while (reader->Read(&event)) tokens += event.has_tokens() ? event.tokens().count() : 0;
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(tokens, kSlowTokens);
}

TEST(CoordinatorServiceTest,
     AStreamBlockedOnAClientThatStoppedReadingIsCancelledAtTheStallTimeout) {
  // The request finishes generating (its 64-event queue never fills), but the client's 1 KiB
  // window holds only part of its events: the handler's Write blocks. Before, nothing watched a
  // finished request, and the handler thread waited on the client for good.
  ClusterOptions o;
  o.max_pending_events = 64;
  o.stall_timeout_ms = 300;
  Cluster cluster(o);
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto stub = cv1::CoordinatorService::NewStub(grpc::CreateCustomChannel(
      cluster.coordinator_address(), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext context;
  constexpr int64_t kTokens = 60;
  auto reader = stub->Generate(&context, Request("stops-reading", 100, kTokens));
  // Not reading for 4 stall timeouts (the watch looks every quarter of one): the client's idleness
  // under test, on the service's real clock (engine_test covers the same on a FakeClock).
  std::this_thread::sleep_for(std::chrono::milliseconds(4 * o.stall_timeout_ms));
  cv1::GenerateEvent event;
  int64_t tokens = 0;
  bool finished = false;
  while (reader->Read(&event)) {
    tokens += event.has_tokens() ? event.tokens().count() : 0;
    finished = finished || event.has_finished();
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(tokens, kTokens);  // what the window held
  EXPECT_FALSE(finished);
  // The request itself had completed; its sequence is released or retained, nothing runs.
  EXPECT_EQ(Load(cluster.stub()).running(), 0);
  // A reader that keeps up is not cut, however long its request takes.
  const Stream fast = Generate(cluster.stub(), Request("reads", 100, 200));
  ASSERT_TRUE(fast.status.ok()) << fast.status.error_message();
  EXPECT_EQ(fast.TokenCount(), 200);
}

}  // namespace
}  // namespace dsa
