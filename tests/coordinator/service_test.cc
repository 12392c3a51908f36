// Tests of the coordinator service (coordinator/service.h) in-process on 127.0.0.1:0, over fake
// attention workers (tests/coordinator/fake_attention.h) and real in-process indexer servers:
// event streams with exact token counts, speculative steps, the queue, refusals with precise
// statuses, Abort and client cancel, a failing worker, a slow reader, prefix sharing, sessions,
// GetLoad, drain, metrics and startup checks; and a fake worker running the tiny real model
// (tiny_model.h): token ids end to end and prefix sharing by token content on a real indexer.
#include "coordinator/service.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/trace_context.h"
#include "coordinator/metrics.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/parse_errors.h"
#include "tests/coordinator/fake_attention.h"
#include "tests/coordinator/tiny_model.h"
#include "tests/testing/loopback_server.h"
#include "tests/testing/raw_call.h"

namespace dsa {
namespace {

namespace av1 = ::dsa::attention::v1;
namespace cv1 = ::dsa::coordinator::v1;
using testing::FakeAttentionService;
using ::testing::HasSubstr;

constexpr int kLayers = 2, kHeads = 4, kDim = 16;

std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* address) {
  return dsa::testing::ServeOnLoopback(service, address);
}

struct ClusterOptions {
  int num_indexers = 1;
  int num_attention = 1;
  int64_t capacity_blocks = 4096;
  int max_queue = 8;
  int max_running = 32;
  bool retain_finished = true;
  double acceptance_rate = 0.7;
  int max_pending_events = 16;
  int64_t stall_timeout_ms = 60000;
  bool tiny_model = false;  // the attention workers run the tiny real model (tiny_model.h)
};

// Real indexers, fake attention workers and the coordinator, each on its own port.
class Cluster {
 public:
  explicit Cluster(const ClusterOptions& o = {}) {
    for (int i = 0; i < o.num_indexers; ++i) {
      IndexerOptions options;
      options.capacity_blocks = o.capacity_blocks;
      options.num_heads = kHeads;
      options.head_dim = kDim;
      engines_.push_back(*Indexer::Create(options));
      indexer_services_.push_back(std::make_unique<IndexerServiceImpl>(engines_.back().get()));
      indexer_addresses_.emplace_back();
      servers_.push_back(Serve(indexer_services_.back().get(), &indexer_addresses_.back()));
    }
    for (int j = 0; j < o.num_attention; ++j) {
      FakeAttentionService::Shape shape{kLayers, kHeads, kDim, 0};
      if (o.tiny_model) {
        shape.model = "tiny";
        shape.vocab_size = dsa::testing::kTinyVocab;
        shape.eos_token_id = dsa::testing::kTinyEos;
        shape.max_context = 4096;
      }
      fakes_.push_back(std::make_unique<FakeAttentionService>(shape));
      attention_addresses_.emplace_back();
      servers_.push_back(Serve(fakes_.back().get(), &attention_addresses_.back()));
    }
    options_.indexer_addresses = indexer_addresses_;
    options_.attention_addresses = attention_addresses_;
    options_.max_queue = o.max_queue;
    options_.max_running_per_attention = o.max_running;
    options_.retain_finished = o.retain_finished;
    options_.acceptance_rate = o.acceptance_rate;
    options_.top_k = 64;
    options_.seed = 7;
    options_.max_pending_events = o.max_pending_events;
    options_.stall_timeout_ms = o.stall_timeout_ms;
    options_.worker_check_interval_ms = 0;  // no watch thread: tests call RefreshWorkers
    metrics_ = std::make_unique<CoordinatorMetrics>(registry_);
    auto service = CoordinatorServiceImpl::Create(options_, metrics_.get());
    EXPECT_TRUE(service.ok()) << service.status();
    coordinator_ = *std::move(service);
    coordinator_server_ = Serve(coordinator_.get(), &coordinator_address_);
    stub_ = cv1::CoordinatorService::NewStub(
        grpc::CreateChannel(coordinator_address_, grpc::InsecureChannelCredentials()));
  }
  ~Cluster() {
    coordinator_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    coordinator_->Stop();
    for (auto& server : servers_) server->Shutdown();
  }

  cv1::CoordinatorService::Stub& stub() { return *stub_; }
  // Stops attention worker j's server (a worker lost); its fake stays for inspection.
  void StopAttention(int j) {
    servers_[indexer_addresses_.size() + j]->Shutdown(std::chrono::system_clock::now());
  }
  FakeAttentionService& fake(int j = 0) { return *fakes_[j]; }
  Indexer& engine(int i = 0) { return *engines_[i]; }
  CoordinatorServiceImpl& coordinator() { return *coordinator_; }
  const std::string& coordinator_address() const { return coordinator_address_; }
  const std::string& indexer_address(int i = 0) const { return indexer_addresses_[i]; }
  const std::string& attention_address(int j = 0) const { return attention_addresses_[j]; }
  std::string Metrics() { return prometheus::TextSerializer().Serialize(registry_.Collect()); }

 private:
  std::vector<std::unique_ptr<Indexer>> engines_;
  std::vector<std::unique_ptr<IndexerServiceImpl>> indexer_services_;
  std::vector<std::unique_ptr<FakeAttentionService>> fakes_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::vector<std::string> indexer_addresses_;
  std::vector<std::string> attention_addresses_;
  CoordinatorOptions options_;
  prometheus::Registry registry_;
  std::unique_ptr<CoordinatorMetrics> metrics_;
  std::unique_ptr<CoordinatorServiceImpl> coordinator_;
  std::unique_ptr<grpc::Server> coordinator_server_;
  std::string coordinator_address_;
  std::unique_ptr<cv1::CoordinatorService::Stub> stub_;
};

cv1::GenerateRequest Request(const std::string& id, int64_t context, int64_t max_new,
                             int draft = 0) {
  cv1::GenerateRequest r;
  r.set_request_id(id);
  r.set_context_length(context);
  r.set_max_new_tokens(max_new);
  r.set_draft_length(draft);
  return r;
}

struct Stream {
  grpc::Status status;
  std::vector<cv1::GenerateEvent> events;
  int64_t TokenCount() const {
    int64_t n = 0;
    for (const auto& e : events) n += e.has_tokens() ? e.tokens().count() : 0;
    return n;
  }
  const cv1::Admitted* admitted() const {
    return !events.empty() && events.front().has_admitted() ? &events.front().admitted() : nullptr;
  }
};

// Runs one Generate call to its end.
Stream Generate(cv1::CoordinatorService::Stub& stub, const cv1::GenerateRequest& request) {
  Stream stream;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = stub.Generate(&context, request);
  cv1::GenerateEvent event;
  while (reader->Read(&event)) stream.events.push_back(event);
  stream.status = reader->Finish();
  return stream;
}

cv1::GetLoadResponse Load(cv1::CoordinatorService::Stub& stub) {
  grpc::ClientContext context;
  cv1::GetLoadResponse load;
  EXPECT_TRUE(stub.GetLoad(&context, cv1::GetLoadRequest(), &load).ok());
  return load;
}

grpc::Status Abort(cv1::CoordinatorService::Stub& stub, const std::string& id) {
  grpc::ClientContext context;
  cv1::AbortRequest request;
  request.set_request_id(id);
  cv1::AbortResponse response;
  return stub.Abort(&context, request, &response);
}

// Polls `done` every 5 ms for up to 5 s. Only for the coordinator's state as its RPCs report it
// (GetLoad, metrics), which no event announces; the fake's state has its Await... methods.
template <typename F>
bool WaitFor(F done) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a poll interval
  }
  return done();
}

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
  EXPECT_THAT(metrics, HasSubstr("dsa_coordinator_requests_total{outcome=\"completed\"} 1"));
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
  EXPECT_THAT(cluster.Metrics(),
              HasSubstr(absl::StrCat("dsa_coordinator_requests_total{outcome=\"rejected\"} ",
                                     cases.size())));
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
  EXPECT_THAT(cluster.Metrics(),
              HasSubstr("dsa_coordinator_requests_total{outcome=\"cancelled\"} 2"));
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
  EXPECT_THAT(cluster.Metrics(), HasSubstr("dsa_coordinator_requests_total{outcome=\"failed\"} 1"));
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
    return cluster.Metrics().find("dsa_coordinator_requests_total{outcome=\"cancelled\"} 1") !=
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
  EXPECT_THAT(cluster.Metrics(), HasSubstr("dsa_coordinator_requests_total{outcome=\"failed\"} 1"));
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
  // Not reading: others are served meanwhile.
  const Stream fast = Generate(cluster.stub(), Request("fast", 100, 50));
  ASSERT_TRUE(fast.status.ok()) << fast.status.error_message();
  EXPECT_EQ(fast.TokenCount(), 50);
  // The slow request stalls well before its end (its sequence stops growing).
  uint64_t slow_id = 0;
  for (const auto& p : cluster.fake().prefills()) {
    if (p.context_length() == 100 && slow_id == 0) slow_id = p.sequence_id();
  }
  // Time for the unread events to fill the window and the pending queue (no event marks that).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::optional<int64_t> stalled = cluster.fake().Length(slow_id);
  ASSERT_TRUE(stalled.has_value());
  // The span of real time over which a stalled sequence must not grow.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(cluster.fake().Length(slow_id), stalled);
  EXPECT_LT(*stalled, 100 + kSlowTokens);
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

TEST(CoordinatorServiceTest, SharesPrefixesOnTheIndexerWorkerHoldingThem) {
  ClusterOptions o;
  o.num_indexers = 2;
  Cluster cluster(o);
  cv1::GenerateRequest donor = Request("donor", 1100, 4);
  for (uint64_t id : {11, 12, 13}) donor.add_prefix_block_ids(id);
  const Stream d = Generate(cluster.stub(), donor);
  ASSERT_TRUE(d.status.ok()) << d.status.error_message();
  // A request with no prefix goes to the less loaded indexer worker.
  const Stream other = Generate(cluster.stub(), Request("other", 100, 2));
  ASSERT_TRUE(other.status.ok());
  EXPECT_NE(other.admitted()->indexer_worker(), d.admitted()->indexer_worker());

  cv1::GenerateRequest user = Request("user", 1500, 4);
  for (uint64_t id : {11, 12, 13}) user.add_prefix_block_ids(id);
  const Stream u = Generate(cluster.stub(), user);
  ASSERT_TRUE(u.status.ok()) << u.status.error_message();
  EXPECT_EQ(u.admitted()->indexer_worker(), d.admitted()->indexer_worker());
  EXPECT_EQ(u.admitted()->prefix_slots_reused(), 1024);
  const auto prefills = cluster.fake().prefills();
  ASSERT_EQ(prefills.size(), 3u);
  ASSERT_TRUE(prefills[2].has_prefix_source_id());
  EXPECT_EQ(prefills[2].prefix_source_id(), prefills[0].sequence_id());
  EXPECT_EQ(prefills[2].prefix_slots(), 1024);
  // The indexer shares the 16 blocks per layer: 18 (donor, 1100 slots) + 8 (1500 - 1024 slots).
  const cv1::GetLoadResponse load = Load(cluster.stub());
  for (const auto& w : load.indexer_workers()) {
    if (w.address() == d.admitted()->indexer_worker()) {
      EXPECT_EQ(w.cache_blocks_used(), (18 + 8) * kLayers);
      EXPECT_EQ(w.sequences(), 2);
    }
  }
}

TEST(CoordinatorServiceTest, EvictsRetainedDonorsAndIdleSessionsOnTheWorkersToMakeRoom) {
  ClusterOptions o;
  o.capacity_blocks = 40;  // 2 layers x 20 blocks; each request below takes 2 x 10
  Cluster cluster(o);
  ASSERT_TRUE(Generate(cluster.stub(), Request("donor", 600, 4)).status.ok());
  cv1::GenerateRequest turn = Request("turn", 600, 4);
  turn.set_session_id("chat");
  ASSERT_TRUE(Generate(cluster.stub(), turn).status.ok());
  EXPECT_EQ(Load(cluster.stub()).retained_sequences(), 2);
  EXPECT_EQ(cluster.engine().Usage().used_blocks, 2 * 2 * 10);
  const auto prefills = cluster.fake().prefills();
  ASSERT_EQ(prefills.size(), 2u);
  const uint64_t donor_id = prefills[0].sequence_id();
  const uint64_t session_id = prefills[1].sequence_id();
  // The next request needs 20 blocks: the least recently used (the donor) goes, through the
  // indexer's Release (its KV is already gone).
  ASSERT_TRUE(Generate(cluster.stub(), Request("third", 600, 4)).status.ok());
  EXPECT_EQ(Load(cluster.stub()).retained_sequences(), 2);
  EXPECT_TRUE(cluster.fake().Length(session_id).has_value());  // the session is still whole
  // And the next one evicts the idle session through the attention worker (KV and index keys).
  ASSERT_TRUE(Generate(cluster.stub(), Request("fourth", 600, 4)).status.ok());
  EXPECT_FALSE(cluster.fake().Length(session_id).has_value());
  bool session_released = false;
  int donor_releases = 0;
  for (const auto& r : cluster.fake().releases()) {
    if (r.sequence_id() == session_id) session_released = !r.keep_indexer_sequence();
    if (r.sequence_id() == donor_id) {
      ++donor_releases;  // only at its finish, keeping the index keys
      EXPECT_TRUE(r.keep_indexer_sequence());
    }
  }
  EXPECT_TRUE(session_released);
  EXPECT_EQ(donor_releases, 1);
  const cv1::GetLoadResponse load = Load(cluster.stub());
  EXPECT_EQ(load.retained_sequences(), 2);
  EXPECT_EQ(load.indexer_workers(0).sequences(), 2);
  EXPECT_EQ(load.cache_blocks_used(), 40);
  // The session's next turn starts afresh.
  cv1::GenerateRequest again = Request("again", 700, 4);
  again.set_session_id("chat");
  const Stream s = Generate(cluster.stub(), again);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_FALSE(cluster.fake().prefills().back().continue_sequence());
}

TEST(CoordinatorServiceTest, SessionsContinueTheirSequenceTurnByTurn) {
  Cluster cluster;
  cv1::GenerateRequest turn1 = Request("t1", 200, 6);
  turn1.set_session_id("chat");
  const Stream s1 = Generate(cluster.stub(), turn1);
  ASSERT_TRUE(s1.status.ok()) << s1.status.error_message();
  EXPECT_TRUE(cluster.fake().releases().empty());  // a session keeps its KV

  cv1::GenerateRequest short_turn = Request("t2", 205, 6);
  short_turn.set_session_id("chat");
  const Stream bad = Generate(cluster.stub(), short_turn);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.status.error_message(), HasSubstr("holds 206 slots"));

  cluster.fake().SetStepDelayMs(2);
  cv1::GenerateRequest turn2 = Request("t2", 300, 50);
  turn2.set_session_id("chat");
  Stream s2;
  std::thread t([&] { s2 = Generate(cluster.stub(), turn2); });
  ASSERT_TRUE(WaitFor([&] { return Load(cluster.stub()).running() == 1; }));
  cv1::GenerateRequest busy = Request("t3", 400, 1);
  busy.set_session_id("chat");
  EXPECT_EQ(Generate(cluster.stub(), busy).status.error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  t.join();
  ASSERT_TRUE(s2.status.ok()) << s2.status.error_message();
  EXPECT_EQ(s2.events[1].tokens().first_position(), 300);
  const auto prefills = cluster.fake().prefills();
  ASSERT_EQ(prefills.size(), 2u);
  EXPECT_TRUE(prefills[1].continue_sequence());
  EXPECT_EQ(prefills[1].sequence_id(), prefills[0].sequence_id());
  EXPECT_EQ(cluster.fake().Length(prefills[0].sequence_id()), 350);
  EXPECT_EQ(Load(cluster.stub()).retained_sequences(), 1);
}

TEST(CoordinatorServiceTest, DrainRefusesNewAndQueuedRequestsAndLetsRunningOnesFinish) {
  ClusterOptions o;
  o.capacity_blocks = 16;
  o.retain_finished = false;
  Cluster cluster(o);
  cluster.fake().SetStepDelayMs(5);
  Stream running, queued;
  std::thread a([&] { running = Generate(cluster.stub(), Request("run", 400, 40)); });
  ASSERT_TRUE(WaitFor([&] { return Load(cluster.stub()).running() == 1; }));
  std::thread b([&] { queued = Generate(cluster.stub(), Request("wait", 400, 10)); });
  ASSERT_TRUE(WaitFor([&] { return Load(cluster.stub()).queued() == 1; }));
  cluster.coordinator().StartDrain();
  b.join();
  EXPECT_EQ(queued.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(queued.status.error_message(), HasSubstr("draining"));
  const Stream late = Generate(cluster.stub(), Request("late", 10, 1));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  a.join();
  ASSERT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_EQ(running.TokenCount(), 40);
}

TEST(CoordinatorServiceTest, BatchesRunningSequencesOfAWorkerIntoOneDecodeStep) {
  ClusterOptions o;
  o.num_attention = 2;
  Cluster cluster(o);
  cluster.fake(0).SetStepDelayMs(3);
  cluster.fake(1).SetStepDelayMs(3);
  std::vector<Stream> streams(6);
  std::vector<std::thread> threads;
  threads.reserve(6);
  for (int i = 0; i < 6; ++i) {
    threads.emplace_back([&, i] {
      streams[i] = Generate(cluster.stub(), Request(absl::StrCat("r", i), 100 + i, 30));
    });
  }
  for (auto& t : threads) t.join();
  for (const Stream& s : streams) {
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_EQ(s.TokenCount(), 30);
  }
  // Both workers were used (fewest running), and each batched several sequences per step.
  EXPECT_GT(cluster.fake(0).prefills().size(), 0u);
  EXPECT_GT(cluster.fake(1).prefills().size(), 0u);
  EXPECT_GT(cluster.fake(0).max_batch_size(), 1);
  EXPECT_GT(cluster.fake(1).max_batch_size(), 1);
}

// Workers that do not answer or do not fit are not taken in, and the coordinator still starts:
// it is not ready (Generate UNAVAILABLE) until a fitting worker of each kind answers.
TEST(CoordinatorServiceTest, StartsNotReadyAndRefusesWorkersThatDoNotFit) {
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  Cluster cluster;
  CoordinatorOptions options;
  options.indexer_addresses = {cluster.indexer_address()};
  options.attention_addresses = {"127.0.0.1:1"};  // nothing listens there
  options.worker_check_interval_ms = 0;
  auto unreachable = CoordinatorServiceImpl::Create(options, &metrics);
  ASSERT_TRUE(unreachable.ok()) << unreachable.status();
  std::vector<bool> told;
  (*unreachable)->SetReadinessListener([&told](bool ready) { told.push_back(ready); });
  EXPECT_EQ(told, std::vector<bool>{false});
  std::string address;
  auto server = Serve(unreachable->get(), &address);
  auto stub = cv1::CoordinatorService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  const Stream refused = Generate(*stub, Request("early", 100, 4));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.status.error_message(),
              HasSubstr("1 of 1 indexer and 0 of 0 attention workers are ready"));
  EXPECT_THAT(prometheus::TextSerializer().Serialize(registry.Collect()),
              HasSubstr("dsa_coordinator_workers{kind=\"indexer\",state=\"ready\"} 1"));
  server->Shutdown();

  FakeAttentionService other({kLayers + 1, kHeads, kDim, 0});
  std::string other_address;
  auto other_server = Serve(&other, &other_address);
  options.attention_addresses = {cluster.attention_address(), other_address};
  auto disagree = CoordinatorServiceImpl::Create(options, &metrics);
  ASSERT_TRUE(disagree.ok()) << disagree.status();
  bool ready = false;
  (*disagree)->SetReadinessListener([&ready](bool r) { ready = r; });
  EXPECT_TRUE(ready);  // the first attention worker fits; the other is refused
  std::string disagree_address;
  auto disagree_server = Serve(disagree->get(), &disagree_address);
  auto disagree_stub = cv1::CoordinatorService::NewStub(
      grpc::CreateChannel(disagree_address, grpc::InsecureChannelCredentials()));
  const cv1::GetLoadResponse load = Load(*disagree_stub);
  ASSERT_EQ(load.attention_workers_size(), 1);
  EXPECT_EQ(load.attention_workers(0).address(), cluster.attention_address());
  disagree_server->Shutdown();

  FakeAttentionService wide({kLayers, kHeads * 2, kDim, 0});
  std::string wide_address;
  auto wide_server = Serve(&wide, &wide_address);
  options.attention_addresses = {wide_address};
  auto shape = CoordinatorServiceImpl::Create(options, &metrics);
  ASSERT_TRUE(shape.ok()) << shape.status();
  (*shape)->SetReadinessListener([&ready](bool r) { ready = r; });
  EXPECT_FALSE(ready);  // H = 8 does not fit the indexer's H = 4
  other_server->Shutdown();
  wide_server->Shutdown();
}

TEST(CoordinatorServiceTest, RefusesOptionsWithoutWorkersOrWithBadAddresses) {
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  CoordinatorOptions options;
  options.attention_addresses = {"127.0.0.1:1"};
  auto none = CoordinatorServiceImpl::Create(options, &metrics);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("--indexer or --indexer-dns"));
  options.indexer_dns = {"indexers.example"};  // no port
  auto bad = CoordinatorServiceImpl::Create(options, &metrics);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("worker address: \"indexers.example\" is not host:port"));
}

TEST(CoordinatorServiceTest, ResolvesNamesToSortedAddressesAndRefusesBadOnes) {
  auto local = ResolveDnsAddresses("localhost:50052");
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_FALSE(local->empty());
  for (const std::string& address : *local) {
    EXPECT_TRUE(address == "127.0.0.1:50052" || address == "[::1]:50052") << address;
  }
  EXPECT_TRUE(std::is_sorted(local->begin(), local->end()));
  EXPECT_EQ(ResolveDnsAddresses("localhost").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveDnsAddresses("localhost:0").status().code(), absl::StatusCode::kInvalidArgument);
  const absl::Status unknown = ResolveDnsAddresses("no-such-host.invalid:1").status();
  EXPECT_TRUE(unknown.code() == absl::StatusCode::kNotFound ||
              unknown.code() == absl::StatusCode::kUnavailable)
      << unknown;
  EXPECT_THAT(unknown.message(), HasSubstr("no-such-host.invalid"));
}

// Workers found by name (a headless Service): taken in as they appear in the answer, placed on
// only while listed and answering, and taken back when they return; a failed resolution keeps the
// last answer. The resolver is a fake, so the answers are the test's.
TEST(CoordinatorServiceTest, FollowsWorkersThatComeAndGoInTheDnsAnswer) {
  Cluster cluster(ClusterOptions{.num_indexers = 2, .num_attention = 2});
  absl::Mutex mu;
  std::vector<std::string> indexer_answer, attention_answer;
  bool resolver_fails = false;
  AddressResolver resolve =
      [&](const std::string& name) -> absl::StatusOr<std::vector<std::string>> {
    absl::MutexLock lock(&mu);
    if (resolver_fails) return absl::UnavailableError("resolver down");
    return name == "indexers:1" ? indexer_answer : attention_answer;
  };
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  CoordinatorOptions options;
  options.indexer_dns = {"indexers:1"};
  options.attention_dns = {"attention:1"};
  options.top_k = 64;
  options.worker_check_interval_ms = 0;
  auto created = CoordinatorServiceImpl::Create(options, &metrics, resolve);
  ASSERT_TRUE(created.ok()) << created.status();
  CoordinatorServiceImpl& coordinator = **created;
  std::vector<bool> told;
  coordinator.SetReadinessListener([&told](bool ready) { told.push_back(ready); });
  std::string address;
  auto server = Serve(&coordinator, &address);
  auto stub = cv1::CoordinatorService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  EXPECT_EQ(told, std::vector<bool>{false});

  {
    absl::MutexLock lock(&mu);
    indexer_answer = {cluster.indexer_address(0)};
    attention_answer = {cluster.attention_address(0)};
  }
  coordinator.RefreshWorkers();
  EXPECT_EQ(told, (std::vector<bool>{false, true}));
  const Stream first = Generate(*stub, Request("first", 100, 3));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.admitted()->indexer_worker(), cluster.indexer_address(0));

  // Indexer 0 leaves the answer, indexer 1 joins: new requests go to indexer 1 only.
  {
    absl::MutexLock lock(&mu);
    indexer_answer = {cluster.indexer_address(1)};
  }
  coordinator.RefreshWorkers();
  EXPECT_EQ(told.back(), true);
  cv1::GetLoadResponse load = Load(*stub);
  ASSERT_EQ(load.indexer_workers_size(), 2);
  EXPECT_FALSE(load.indexer_workers(0).ready());
  EXPECT_TRUE(load.indexer_workers(1).ready());
  for (int i = 0; i < 3; ++i) {
    const Stream s = Generate(*stub, Request(absl::StrCat("moved", i), 100, 2));
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_EQ(s.admitted()->indexer_worker(), cluster.indexer_address(1));
  }
  EXPECT_THAT(prometheus::TextSerializer().Serialize(registry.Collect()),
              HasSubstr("dsa_coordinator_workers{kind=\"indexer\",state=\"not_ready\"} 1"));

  // The resolver fails: the last answer stands, nothing changes.
  {
    absl::MutexLock lock(&mu);
    resolver_fails = true;
  }
  coordinator.RefreshWorkers();
  EXPECT_EQ(told.back(), true);
  EXPECT_TRUE(Load(*stub).indexer_workers(1).ready());

  // Every attention worker leaves: not ready, Generate UNAVAILABLE; back: ready again.
  {
    absl::MutexLock lock(&mu);
    resolver_fails = false;
    attention_answer = {};
  }
  coordinator.RefreshWorkers();
  EXPECT_EQ(told.back(), false);
  EXPECT_EQ(Generate(*stub, Request("none", 100, 2)).status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
  {
    absl::MutexLock lock(&mu);
    attention_answer = {cluster.attention_address(1), cluster.attention_address(0)};
  }
  coordinator.RefreshWorkers();
  EXPECT_EQ(told.back(), true);
  load = Load(*stub);
  ASSERT_EQ(load.attention_workers_size(), 2);
  EXPECT_TRUE(load.attention_workers(0).ready());
  EXPECT_TRUE(load.attention_workers(1).ready());
  EXPECT_TRUE(Generate(*stub, Request("back", 100, 2)).status.ok());
  server->Shutdown();
  coordinator.Stop();
}

// A worker that answers with a new instance id restarted: its slot is retired (a session on it
// starts afresh elsewhere, its retained donors are forgotten) and the new instance is taken in
// as a new worker, its shape checked again.
TEST(CoordinatorServiceTest, AWorkerThatRestartedIsTakenInAfreshAndItsOldStateForgotten) {
  Cluster cluster(ClusterOptions{.num_indexers = 1, .num_attention = 1});
  cluster.fake().SetInstanceId("first");
  cluster.coordinator().RefreshWorkers();  // taken in before it said: "first" is learnt, no restart
  EXPECT_EQ(Load(cluster.stub()).attention_workers_size(), 1);
  cv1::GenerateRequest turn = Request("turn1", 600, 4);
  turn.set_session_id("chat");
  const Stream first = Generate(cluster.stub(), turn);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(Load(cluster.stub()).retained_sequences(), 1);

  cluster.fake().SetInstanceId("second");
  cluster.coordinator().RefreshWorkers();
  EXPECT_THAT(cluster.Metrics(),
              HasSubstr("dsa_coordinator_workers{kind=\"attention\",state=\"ready\"} 1"));
  const cv1::GetLoadResponse load = Load(cluster.stub());
  ASSERT_EQ(load.attention_workers_size(), 1);  // the retired slot is not listed
  EXPECT_TRUE(load.attention_workers(0).ready());
  EXPECT_EQ(load.retained_sequences(), 0);  // the session's sequence died with the old instance

  turn.set_request_id("turn2");
  turn.set_context_length(700);
  const Stream second = Generate(cluster.stub(), turn);
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  const std::vector<av1::PrefillRequest> prefills = cluster.fake().prefills();
  ASSERT_EQ(prefills.size(), 2u);
  EXPECT_FALSE(prefills[1].continue_sequence());  // afresh, not a continuation
  EXPECT_NE(prefills[1].sequence_id(), prefills[0].sequence_id());
}

// Queued requests that only a worker that left could hold fail with UNAVAILABLE at the next
// refresh instead of waiting forever; a worker that never answers counts as not ready.
TEST(CoordinatorServiceTest, QueuedRequestsFailWhenTheirWorkersLeaveAndUnreachableOnesAreCounted) {
  Cluster cluster;
  absl::Mutex mu;
  std::vector<std::string> indexer_answer = {cluster.indexer_address()};
  AddressResolver resolve =
      [&](const std::string& name) -> absl::StatusOr<std::vector<std::string>> {
    absl::MutexLock lock(&mu);
    return indexer_answer;
  };
  prometheus::Registry dns_registry;
  CoordinatorMetrics dns_metrics(dns_registry);
  CoordinatorOptions dns_options;
  dns_options.indexer_dns = {"indexers:1"};
  dns_options.attention_addresses = {cluster.attention_address()};
  dns_options.max_running_per_attention = 1;
  dns_options.top_k = 64;
  dns_options.worker_check_interval_ms = 0;
  auto created = CoordinatorServiceImpl::Create(dns_options, &dns_metrics, resolve);
  ASSERT_TRUE(created.ok()) << created.status();
  std::string address;
  auto server = Serve(created->get(), &address);
  auto stub = cv1::CoordinatorService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  cluster.fake().SetStepDelayMs(2);
  Stream running, queued;
  std::thread a([&] { running = Generate(*stub, Request("running", 100, 100000)); });
  ASSERT_TRUE(cluster.fake().AwaitDecodeStepsOver(0));
  std::thread b([&] { queued = Generate(*stub, Request("queued", 100, 4)); });
  ASSERT_TRUE(WaitFor([&] { return Load(*stub).queued() == 1; }));
  {
    absl::MutexLock lock(&mu);
    indexer_answer.clear();  // the only indexer leaves (it still runs the first request)
  }
  (*created)->RefreshWorkers();
  b.join();
  EXPECT_EQ(queued.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(queued.status.error_message(), HasSubstr("no ready worker can hold the request"));
  EXPECT_EQ(Load(*stub).running(), 1);  // what the worker holds goes on
  EXPECT_TRUE(Abort(*stub, "running").ok());
  a.join();
  EXPECT_EQ(running.status.error_code(), grpc::StatusCode::CANCELLED);
  server->Shutdown();
  (*created)->Stop();

  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  CoordinatorOptions options;
  options.indexer_addresses = {cluster.indexer_address(), "127.0.0.1:1"};
  options.attention_addresses = {"127.0.0.1:1"};
  options.worker_check_interval_ms = 0;
  auto unreachable = CoordinatorServiceImpl::Create(options, &metrics);
  ASSERT_TRUE(unreachable.ok());
  const std::string text = prometheus::TextSerializer().Serialize(registry.Collect());
  EXPECT_THAT(text, HasSubstr("dsa_coordinator_workers{kind=\"indexer\",state=\"not_ready\"} 1"));
  EXPECT_THAT(text, HasSubstr("dsa_coordinator_workers{kind=\"indexer\",state=\"ready\"} 1"));
  EXPECT_THAT(text, HasSubstr("dsa_coordinator_workers{kind=\"attention\",state=\"not_ready\"} 1"));
}

// A listed worker that stops answering is not placed on; the coordinator stays ready while the
// other worker of its kind is.
TEST(CoordinatorServiceTest, AWorkerThatStopsAnsweringIsNotPlacedOn) {
  Cluster cluster(ClusterOptions{.num_indexers = 1, .num_attention = 2});
  cluster.StopAttention(0);
  cluster.coordinator().RefreshWorkers();
  const cv1::GetLoadResponse load = Load(cluster.stub());
  ASSERT_EQ(load.attention_workers_size(), 2);
  EXPECT_FALSE(load.attention_workers(0).ready());
  EXPECT_TRUE(load.attention_workers(1).ready());
  for (int i = 0; i < 3; ++i) {
    const Stream s = Generate(cluster.stub(), Request(absl::StrCat("r", i), 100, 2));
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_EQ(s.admitted()->attention_worker(), cluster.attention_address(1));
  }
}

// A real model behind the coordinator (the fake runs the tiny model: next = last + 1 mod 64):
// token ids through the gRPC API, n-gram drafts verified, prefix sharing on the real indexer by
// token content, GetLoad naming the model, and a context_length request refused.
TEST(CoordinatorServiceTest, ARealModelStreamsTokenIdsAndSharesPrefixesByTokenContent) {
  ClusterOptions o;
  o.tiny_model = true;
  Cluster cluster(o);
  const cv1::GetLoadResponse load = Load(cluster.stub());
  EXPECT_EQ(load.model().name(), "tiny");
  EXPECT_EQ(load.model().vocab_size(), dsa::testing::kTinyVocab);
  EXPECT_EQ(load.model().eos_token_id(), dsa::testing::kTinyEos);
  EXPECT_EQ(load.model().max_context(), 4096);

  const Stream synthetic = Generate(cluster.stub(), Request("synthetic", 100, 2));
  EXPECT_EQ(synthetic.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(synthetic.status.error_message(), HasSubstr("model 'tiny' generates real tokens"));

  auto tokens_request = [](const std::string& id, const std::vector<int32_t>& context,
                           int64_t max_new, int draft) {
    cv1::GenerateRequest r;
    r.set_request_id(id);
    for (int32_t t : context) r.mutable_context_tokens()->add_tokens(t);
    r.set_max_new_tokens(max_new);
    r.set_draft_length(draft);
    return r;
  };
  auto ids_of = [](const Stream& s) {
    std::vector<int32_t> ids;
    for (const auto& e : s.events) {
      if (e.has_tokens())
        ids.insert(ids.end(), e.tokens().token_ids().begin(), e.tokens().token_ids().end());
    }
    return ids;
  };
  // Drafts 13..16 confirmed, then 10, 11, 12 refused: the model's own tokens either way.
  const Stream spec =
      Generate(cluster.stub(), tokens_request("spec", {10, 11, 12, 13, 14, 15, 16, 17, 10, 11}, 10,
                                              /*draft=*/4));
  ASSERT_TRUE(spec.status.ok()) << spec.status.error_message();
  EXPECT_EQ(ids_of(spec), (std::vector<int32_t>{12, 13, 14, 15, 16, 17, 18, 19, 20, 21}));
  EXPECT_EQ(spec.events.back().finished().finish_reason(), cv1::FINISH_REASON_LENGTH);
  const auto commits = cluster.fake().commits();
  ASSERT_EQ(commits.size(), 2u);
  EXPECT_EQ(commits[0].accepted(), 4);
  EXPECT_EQ(commits[1].accepted(), 0);

  std::vector<int32_t> prompt(1100);
  for (int i = 0; i < 1100; ++i) prompt[i] = (i * 7) % 61;
  const Stream donor = Generate(cluster.stub(), tokens_request("donor", prompt, 3, 0));
  ASSERT_TRUE(donor.status.ok()) << donor.status.error_message();
  const int32_t last = prompt.back();
  EXPECT_EQ(ids_of(donor), (std::vector<int32_t>{last + 1, last + 2, last + 3}));
  std::vector<int32_t> same(prompt.begin(), prompt.begin() + 1024);
  same.resize(1500, 7);
  const Stream user = Generate(cluster.stub(), tokens_request("user", same, 2, 0));
  ASSERT_TRUE(user.status.ok()) << user.status.error_message();
  EXPECT_EQ(user.admitted()->prefix_slots_reused(), 1024);
  std::vector<int32_t> changed = same;
  changed[0] = 60;
  const Stream other = Generate(cluster.stub(), tokens_request("other", changed, 2, 0));
  ASSERT_TRUE(other.status.ok()) << other.status.error_message();
  EXPECT_EQ(other.admitted()->prefix_slots_reused(), 0);
}

}  // namespace
}  // namespace dsa
