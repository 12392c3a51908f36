// The coordinator's side of its leases on its workers' sequences (docs/reliability.md, "Ownership
// that survives its owner"): every check renews the lease on every worker, a worker is taken in
// only under a renewed lease, every Prefill carries it, a lease that ran out (the coordinator was
// paused past its ttl) is handled as a restart of the worker, and a newer instance of the same
// coordinator takes the workers over. CoordinatorEngine over in-memory workers whose lease tables
// are the workers' own (server/sequence_leases.h) on the test's FakeClock, without threads: the
// test checks the workers (RefreshWorkers), steps the decode loops and moves the clock itself.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "coordinator/engine.h"
#include "tests/coordinator/engine_fixture.h"

namespace dsa {
namespace {

// The fixture's names: EngineTest, Call, Request, kA1.., cv1, FakeWorkers.
using namespace ::dsa::engine_testing;  // NOLINT(google-build-using-namespace)

class LeaseTest : public EngineTest {
 protected:
  void SetUp() override {
    EngineTest::SetUp();
    options_.name = "coordinator-a:7400";
    options_.instance_id = "first";
    options_.lease_ttl_ms = 3000;
  }

  // Another engine over the same fake workers (another process of the coordinator, or another
  // coordinator), with its own metrics.
  std::unique_ptr<CoordinatorEngine> StartAnother(const std::string& name,
                                                  const std::string& instance_id) {
    CoordinatorOptions options = options_;
    options.name = name;
    options.instance_id = instance_id;
    auto engine = CoordinatorEngine::Create(options, &other_metrics_, fakes_, &clock_);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? *std::move(engine) : nullptr;
  }

  void ExpectLease(const dsa::common::v1::Lease& lease, const std::string& instance_id) {
    EXPECT_EQ(lease.owner(), options_.name);
    EXPECT_EQ(lease.instance_id(), instance_id);
    EXPECT_EQ(lease.ttl_ms(), options_.lease_ttl_ms);
  }

  prometheus::Registry other_registry_;
  CoordinatorMetrics other_metrics_{other_registry_};
};

TEST_F(LeaseTest, EveryCheckRenewsTheLeaseOnEveryWorkerAndTheFirstBeforeItIsTakenIn) {
  Start({kA1, kA2}, {kI1, kI2});  // Create runs the first check
  for (const char* address : {kA1, kA2, kI1, kI2}) {
    const std::vector<dsa::common::v1::Lease> renewals = fakes_->Renewals(address);
    ASSERT_EQ(renewals.size(), 1u) << address;
    ExpectLease(renewals[0], "first");
  }
  cv1::GetLoadResponse load = GetLoad();
  ASSERT_EQ(load.attention_workers_size(), 2);
  ASSERT_EQ(load.indexer_workers_size(), 2);
  for (const auto& worker : load.attention_workers()) EXPECT_TRUE(worker.ready());
  for (const auto& worker : load.indexer_workers()) EXPECT_TRUE(worker.ready());

  engine_->RefreshWorkers();
  engine_->RefreshWorkers();
  for (const char* address : {kA1, kA2, kI1, kI2}) {
    const std::vector<dsa::common::v1::Lease> renewals = fakes_->Renewals(address);
    ASSERT_EQ(renewals.size(), 3u) << address;
    for (const auto& renewal : renewals) ExpectLease(renewal, "first");
  }
  // Renewed within the ttl every time: the workers still count as the same, nothing retired.
  EXPECT_EQ(GetLoad().attention_workers_size(), 2);
}

TEST_F(LeaseTest, EveryPrefillCarriesTheLeaseAndTheWorkersHoldItsSequencesUnderIt) {
  options_.retain_finished = true;
  Start({kA1}, {kI1});
  GenerateSpec turn = Request("r1", 40, 3);
  turn.session_id = "chat";  // kept on both workers after the turn
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn, kA1));
  const std::vector<dsa::attention::v1::PrefillRequest> prefills = fakes_->Prefills(kA1);
  ASSERT_EQ(prefills.size(), 1u);
  ASSERT_TRUE(prefills[0].has_lease());
  ExpectLease(prefills[0].lease(), "first");
  EXPECT_EQ(fakes_->Sequences(kA1), 1);
  EXPECT_EQ(fakes_->Sequences(kI1), 1);

  // Renewed in time, the workers keep what the lease holds however long it is held.
  for (int i = 0; i < 5; ++i) {
    clock_.Advance(absl::Milliseconds(options_.lease_ttl_ms - 1));
    engine_->RefreshWorkers();
  }
  EXPECT_EQ(fakes_->Sequences(kA1), 1);
  EXPECT_EQ(fakes_->Sequences(kI1), 1);
  EXPECT_EQ(GetLoad().retained_sequences(), 1);
}

// The coordinator was paused (or cut off) past its lease's ttl: the workers released everything
// it held, though they did not restart. Its running request finds its sequence gone at its next
// step and moves, as after a restart (ARestartedWorkerIsRetiredAndItsRequestMovesToTheNewInstance),
// onto the same workers taken in afresh under a new lease.
TEST_F(LeaseTest, ALeaseThatRanOutIsARestartOfTheWorkerAndItsRequestMoves) {
  Start({kA1}, {kI1});
  auto call = Generate(Request("r1", 50, 4));
  ASSERT_TRUE(call->stream.AwaitEvents(1));
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);
  clock_.Advance(absl::Milliseconds(options_.lease_ttl_ms));  // no check for a whole ttl
  EXPECT_EQ(fakes_->Sequences(kA1), 0);  // the workers' sweep released the lease's sequences
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);  // NOT_FOUND: it migrates (its check: renewed false)
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));  // the slot taken in afresh
  StepUntilFinished(kA1, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  EXPECT_EQ(call->finished()->migrations(), 1);
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
  cv1::GetLoadResponse load = GetLoad();
  ASSERT_EQ(load.attention_workers_size(), 1);  // the retired slot is not reported
  EXPECT_TRUE(load.attention_workers(0).ready());
  ASSERT_EQ(load.indexer_workers_size(), 1);
  EXPECT_TRUE(load.indexer_workers(0).ready());
}

// The same for a kept session (ARestartedAttentionWorkersKeptSessionIsReleasedOnItsIndexer): the
// coordinator forgets it at the check that sees the lease ran out, so its next turn starts afresh
// instead of continuing a sequence the workers no longer hold.
TEST_F(LeaseTest, ALeaseThatRanOutForgetsTheKeptSessionsOfItsWorkers) {
  Start({kA1}, {kI1});
  GenerateSpec turn = Request("r1", 20, 2);
  turn.session_id = "chat";
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn, kA1));
  EXPECT_EQ(GetLoad().retained_sequences(), 1);
  clock_.Advance(absl::Milliseconds(options_.lease_ttl_ms + 1));
  engine_->RefreshWorkers();
  EXPECT_EQ(GetLoad().retained_sequences(), 0);
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
  EXPECT_TRUE(GetLoad().attention_workers(0).ready());

  // The next turn of the session runs from its whole context on the new lease.
  turn.request_id = "r2";
  turn.context_length = 30;
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn, kA1));
  const std::vector<dsa::attention::v1::PrefillRequest> prefills = fakes_->Prefills(kA1);
  ASSERT_EQ(prefills.size(), 2u);
  EXPECT_FALSE(prefills[1].continue_sequence());
  ExpectLease(prefills[1].lease(), "first");
}

// The coordinator restarted (same name, new instance) while the old process was only paused: the
// new one's first check releases at once what the old one held, and the old one, when it resumes,
// is refused (FAILED_PRECONDITION): its workers are not ready to it, so it places nothing there.
TEST_F(LeaseTest, ANewerInstanceOfTheSameNameTakesTheWorkersOverAndTheOldOneIsNotReady) {
  options_.retain_finished = true;
  Start({kA1}, {kI1});
  GenerateSpec turn = Request("r1", 20, 2);
  turn.session_id = "chat";
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn, kA1));
  EXPECT_EQ(fakes_->Sequences(kA1), 1);
  EXPECT_EQ(fakes_->Sequences(kI1), 1);

  std::unique_ptr<CoordinatorEngine> second = StartAnother(options_.name, "second");
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(fakes_->Sequences(kA1), 0);  // released at once, not after the ttl
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
  EXPECT_TRUE(second->GetLoad().attention_workers.at(0).ready);

  engine_->RefreshWorkers();  // the old instance resumes
  cv1::GetLoadResponse load = GetLoad();
  ASSERT_EQ(load.attention_workers_size(), 1);
  EXPECT_FALSE(load.attention_workers(0).ready());
  ASSERT_EQ(load.indexer_workers_size(), 1);
  EXPECT_FALSE(load.indexer_workers(0).ready());
  GenerateSpec refused = Request("r2", 20, 2);
  Call* call = Generate(refused);
  call->Join();
  EXPECT_EQ(call->status.code(), absl::StatusCode::kUnavailable) << call->status;

  // A superseded instance is not taken in either: no worker is taken in without a renewal.
  std::unique_ptr<CoordinatorEngine> stale = StartAnother(options_.name, "first");
  ASSERT_NE(stale, nullptr);
  EXPECT_TRUE(stale->GetLoad().attention_workers.empty());
  EXPECT_TRUE(stale->GetLoad().indexer_workers.empty());
  // Another coordinator (another name) shares the workers beside the second one.
  std::unique_ptr<CoordinatorEngine> other = StartAnother("coordinator-b:7400", "first");
  ASSERT_NE(other, nullptr);
  EXPECT_TRUE(other->GetLoad().attention_workers.at(0).ready);
  second->RefreshWorkers();
  EXPECT_TRUE(second->GetLoad().attention_workers.at(0).ready);
}

// A renewal that does not reach the worker is a lost check (not ready until one gets through);
// once one does within the ttl, the lease is still live there and nothing was lost.
TEST_F(LeaseTest, ARenewalThatDoesNotReachTheWorkerIsALostCheck) {
  Start({kA1}, {kI1});
  GenerateSpec turn = Request("r1", 20, 2);
  turn.session_id = "chat";
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn, kA1));
  fakes_->FailRenewals(kA1, absl::UnavailableError("connection reset (fake)"));
  engine_->RefreshWorkers();
  EXPECT_FALSE(GetLoad().attention_workers(0).ready());
  fakes_->FailRenewals(kA1, absl::OkStatus());
  clock_.Advance(absl::Milliseconds(options_.lease_ttl_ms - 1));
  engine_->RefreshWorkers();
  cv1::GetLoadResponse load = GetLoad();
  ASSERT_EQ(load.attention_workers_size(), 1);
  EXPECT_TRUE(load.attention_workers(0).ready());
  EXPECT_EQ(load.retained_sequences(), 1);  // the same slot: not retired
  EXPECT_EQ(fakes_->Sequences(kA1), 1);
}

TEST(LeaseOptionsTest, TheNameAndTheTtlAreChecked) {
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  auto create = [&](const std::function<void(CoordinatorOptions&)>& change) {
    CoordinatorOptions options;
    options.attention_addresses = {kA1};
    options.indexer_addresses = {kI1};
    options.run_loops = false;
    change(options);
    FakeClock clock;
    auto fakes = std::make_shared<FakeWorkers>(&clock);
    fakes->AddAttention(kA1);
    fakes->AddIndexer(kI1);
    absl::StatusOr<std::unique_ptr<CoordinatorEngine>> engine =
        CoordinatorEngine::Create(options, &metrics, fakes, &clock);
    return engine.status();
  };
  EXPECT_TRUE(create([](CoordinatorOptions&) {}).ok());
  for (int64_t ttl : {int64_t{0}, int64_t{-1}, int64_t{600001}}) {
    absl::Status status = create([ttl](CoordinatorOptions& o) { o.lease_ttl_ms = ttl; });
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << ttl;
    EXPECT_TRUE(absl::StrContains(status.message(), "lease_ttl_ms")) << status;
  }
  EXPECT_TRUE(create([](CoordinatorOptions& o) { o.lease_ttl_ms = 600000; }).ok());
  // Every check renews: the ttl must cover three of them.
  absl::Status status = create([](CoordinatorOptions& o) {
    o.worker_check_interval_ms = 2000;
    o.lease_ttl_ms = 5999;
  });
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "lease_ttl_ms")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "worker_check_interval_ms")) << status;
  EXPECT_TRUE(create([](CoordinatorOptions& o) {
                o.worker_check_interval_ms = 2000;
                o.lease_ttl_ms = 6000;
              }).ok());
  status = create([](CoordinatorOptions& o) { o.name = ""; });
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "--name")) << status;
  status = create([](CoordinatorOptions& o) { o.name = std::string(257, 'n'); });
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dsa
