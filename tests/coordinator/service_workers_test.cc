// Tests of the coordinator service (coordinator/service.h) in-process on 127.0.0.1:0, over fake
// attention workers and real in-process indexer servers (service_fixture.h), across requests and
// workers: prefix sharing, eviction, sessions, drain, batching, startup checks, workers found by
// name that come, go and restart, unreachable workers; and a fake worker running the tiny real
// model (tiny_model.h): token ids end to end and prefix sharing by token content.
#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/metrics.h"
#include "coordinator/service.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "tests/coordinator/service_fixture.h"
#include "tests/coordinator/tiny_model.h"

namespace dsa {
namespace {

using namespace ::dsa::service_testing;  // NOLINT(google-build-using-namespace)

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
  auto stub = cv1::CoordinatorService::NewStub(::dsa::testing::ConnectedLoopbackChannel(address));
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
  auto disagree_stub =
      cv1::CoordinatorService::NewStub(::dsa::testing::ConnectedLoopbackChannel(disagree_address));
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
  auto stub = cv1::CoordinatorService::NewStub(::dsa::testing::ConnectedLoopbackChannel(address));
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
  auto stub = cv1::CoordinatorService::NewStub(::dsa::testing::ConnectedLoopbackChannel(address));
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
