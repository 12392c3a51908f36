// Readmission that waits for the data plane (docs/reliability.md, "An indexer that restarts"):
// the coordinator's checks reach a restarted indexer before the attention workers' connections to
// it work again. A Prefill that could not reach its indexer lost nothing, so placing its request
// again is no migration; the indexer is held back from placements for a backoff (on the engine's
// clock), or, when it is the only one, its requests wait the backoff out; its first placement
// after a restart is a probe. The engine over in-memory workers and a FakeClock
// (engine_fixture.h); the only waits are for handler threads to reach a state.
#include <memory>
#include <string>
#include <vector>

#include "coordinator/engine.h"
#include "coordinator/request_lifecycle.h"
#include "coordinator/worker_pool.h"
#include "tests/coordinator/engine_fixture.h"

namespace dsa {
namespace {

// The fixture's names: EngineTest, Call, Request, kA1.., cv1, FakeWorkers.
using namespace ::dsa::engine_testing;  // NOLINT(google-build-using-namespace)

// The ready workers of each kind, as the coordinator's metrics line starts.
constexpr char kReadyIndexers[] = "dsa_coordinator_workers{kind=\"indexer\",state=\"ready\"} ";
constexpr char kReadyAttention[] = "dsa_coordinator_workers{kind=\"attention\",state=\"ready\"} ";

// The indexers named by the Prefills the attention worker at `address` answered OK, in order.
std::vector<std::string> PrefilledIndexers(FakeWorkers& fakes, const std::string& address) {
  std::vector<std::string> indexers;
  for (const auto& prefill : fakes.Prefills(address)) indexers.push_back(prefill.indexer_worker());
  return indexers;
}

class ReadmissionTest : public EngineTest {
 protected:
  // Starts one attention worker and two indexers, and a long request that holds one of them
  // (`kept_`), so that new requests go to the other, least loaded one (`restarted_`), which then
  // restarts and is seen to.
  void StartWithARestartedIndexer(bool attention_can_reach) {
    Start({kA1}, {kI1, kI2});
    busy_ = Generate(Request("busy", 4000, 1000));
    ASSERT_TRUE(busy_->stream.AwaitEvents(1));
    kept_ = busy_->admitted().indexer_worker();
    restarted_ = kept_ == kI1 ? kI2 : kI1;
    fakes_->Restart(restarted_);
    fakes_->SetUnreachableFromAttention(restarted_, !attention_can_reach);
    engine_->RefreshWorkers();  // retired, and its new instance taken in on probation
  }

  Call* busy_ = nullptr;
  std::string kept_;
  std::string restarted_;
};

TEST_F(ReadmissionTest, RequestsWhosePrefillCannotReachARestartedIndexerMoveForFree) {
  options_.max_migrations = 1;
  ASSERT_NO_FATAL_FAILURE(StartWithARestartedIndexer(/*attention_can_reach=*/false));
  const std::vector<Call*> calls = {Generate(Request("r0", 100, 4)),
                                    Generate(Request("r1", 100, 4)),
                                    Generate(Request("r2", 100, 4))};
  // Each is placed on the restarted indexer at most once or twice before its hold, then on the
  // kept one; none spends its one migration.
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 4, kSafetyNet));
  for (Call* call : calls) {
    StepUntilFinished(kA1, *call);
    call->Join();
    ASSERT_TRUE(call->status.ok()) << call->status;
    EXPECT_EQ(call->admitted().indexer_worker(), kept_);
    EXPECT_EQ(call->finished()->migrations(), 0);
  }
  EXPECT_GE(fakes_->PrefillCalls(kA1), 1 + 3 + 1);  // busy, the three, and the first failure
  for (const std::string& indexer : PrefilledIndexers(*fakes_, kA1)) {
    EXPECT_EQ(indexer, kept_);
  }

  // The attention side reaches it again; once its hold is over it takes placements again.
  fakes_->SetUnreachableFromAttention(restarted_, false);
  clock_.Advance(WorkerPool::kMaxIndexerHold);
  Call* after = Generate(Request("after", 100, 4));
  ASSERT_TRUE(after->stream.AwaitEvents(1));
  EXPECT_EQ(after->admitted().indexer_worker(), restarted_);
  StepUntilFinished(kA1, *after);
  after->Join();
  EXPECT_TRUE(after->status.ok()) << after->status;
  EXPECT_EQ(after->finished()->migrations(), 0);
}

TEST_F(EngineTest, WithNoOtherIndexerARequestWaitsOutTheHoldsBackoffAndSpendsNoMigration) {
  options_.max_migrations = 1;
  Start({kA1}, {kI1});
  fakes_->Restart(kI1);
  fakes_->SetUnreachableFromAttention(kI1, true);
  engine_->RefreshWorkers();
  Call* call = Generate(Request("r1", 100, 4));
  // The first Prefill fails: the request waits the first hold (100 ms of the engine's clock).
  ASSERT_TRUE(engine_->AwaitPlacementWaits(1, kSafetyNet));
  EXPECT_EQ(fakes_->PrefillCalls(kA1), 1);
  clock_.Advance(WorkerPool::kMinIndexerHold);
  // Placed again, it fails again: the next hold is twice as long.
  ASSERT_TRUE(engine_->AwaitPlacementWaits(2, kSafetyNet));
  EXPECT_EQ(fakes_->PrefillCalls(kA1), 2);
  fakes_->SetUnreachableFromAttention(kI1, false);
  clock_.Advance(WorkerPool::kMinIndexerHold);  // half of it: the request still waits
  EXPECT_EQ(fakes_->PrefillCalls(kA1), 2);
  clock_.Advance(WorkerPool::kMinIndexerHold);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  EXPECT_EQ(fakes_->PrefillCalls(kA1), 3);
  StepUntilFinished(kA1, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  EXPECT_EQ(call->finished()->migrations(), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
}

TEST_F(EngineTest, PlacementsThatNeverReachTheIndexerEndInTheMigrationLimitAtLast) {
  options_.max_migrations = 1;
  Start({kA1}, {kI1});
  fakes_->Restart(kI1);
  fakes_->SetUnreachableFromAttention(kI1, true);
  engine_->RefreshWorkers();
  Call* call = Generate(Request("r1", 100, 4));
  // kMaxUnreachedPlacements placements again for free, then one migration, then the end.
  for (int wait = 1; wait <= RequestLifecycle::kMaxUnreachedPlacements; ++wait) {
    ASSERT_TRUE(engine_->AwaitPlacementWaits(wait, kSafetyNet));
    clock_.Advance(WorkerPool::kMaxIndexerHold);
  }
  call->Join();
  EXPECT_EQ(call->status.code(), absl::StatusCode::kUnavailable) << call->status;
  EXPECT_TRUE(absl::StrContains(call->status.message(), "after 1 migrations")) << call->status;
  EXPECT_EQ(fakes_->PrefillCalls(kA1), RequestLifecycle::kMaxUnreachedPlacements + 2);
}

TEST_F(ReadmissionTest, ARestartedIndexersFirstPlacementIsAProbeThatOthersDoNotJoin) {
  ASSERT_NO_FATAL_FAILURE(StartWithARestartedIndexer(/*attention_can_reach=*/true));
  fakes_->SetStalled(kA1, true);
  Call* probe = Generate(Request("probe", 100, 4));
  ASSERT_TRUE(fakes_->AwaitStalledCalls(kA1, 1, kSafetyNet));
  // While the probe's Prefill runs, the next request goes to the kept indexer, though the
  // restarted one is the least loaded.
  Call* second = Generate(Request("second", 100, 4));
  ASSERT_TRUE(fakes_->AwaitStalledCalls(kA1, 2, kSafetyNet));
  fakes_->SetStalled(kA1, false);
  ASSERT_TRUE(probe->stream.AwaitEvents(1));
  ASSERT_TRUE(second->stream.AwaitEvents(1));
  EXPECT_EQ(probe->admitted().indexer_worker(), restarted_);
  EXPECT_EQ(second->admitted().indexer_worker(), kept_);
  // The probe succeeded: placements there go on as usual.
  Call* third = Generate(Request("third", 100, 4));
  ASSERT_TRUE(third->stream.AwaitEvents(1));
  EXPECT_EQ(third->admitted().indexer_worker(), restarted_);
  for (Call* call : {probe, second, third}) {
    StepUntilFinished(kA1, *call);
    call->Join();
    EXPECT_TRUE(call->status.ok()) << call->status;
    EXPECT_EQ(call->finished()->migrations(), 0);
  }
}

// A check that gets no answer in time (the coordinator's host loaded, the worker busy) is not
// the worker's loss: a ready worker stays in placements until unready_after_timed_out_checks of
// them in a row; one answer in between starts the count again.
TEST_F(EngineTest, AReadyWorkerLeavesPlacementsOnlyAfterConsecutiveTimedOutChecks) {
  options_.unready_after_timed_out_checks = 2;
  Start({kA1}, {kI1, kI2});
  ASSERT_EQ(Metric(kReadyIndexers), 2);
  fakes_->SetHung(kI1, true);
  engine_->RefreshWorkers();  // one timed out: still placed on
  EXPECT_EQ(Metric(kReadyIndexers), 2);
  fakes_->SetHung(kI1, false);
  engine_->RefreshWorkers();  // answered: the count starts again
  fakes_->SetHung(kI1, true);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyIndexers), 2);
  engine_->RefreshWorkers();  // two in a row: out of placements
  EXPECT_EQ(Metric(kReadyIndexers), 1);
  auto call = Generate(Request("r1", 64, 2));
  ASSERT_TRUE(call->stream.AwaitEvents(1));
  EXPECT_EQ(call->admitted().indexer_worker(), kI2);
  StepUntilFinished(kA1, *call);
  call->Join();
  EXPECT_TRUE(call->status.ok()) << call->status;
  fakes_->SetHung(kI1, false);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyIndexers), 2);
}

// What is not a slow answer takes a worker out at the first check: nothing listening
// (UNAVAILABLE), or a worker that says it is not ready; and with the threshold at 1, a timeout.
TEST_F(EngineTest, AWorkerThatIsDownOrNotReadyLeavesPlacementsAtTheFirstCheck) {
  options_.unready_after_timed_out_checks = 2;
  Start({kA1}, {kI1, kI2});
  fakes_->SetDown(kI1, true);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyIndexers), 1);
  fakes_->SetDown(kI1, false);
  engine_->RefreshWorkers();
  ASSERT_EQ(Metric(kReadyIndexers), 2);
  fakes_->SetNotReady(kI2, true);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyIndexers), 1);
}

// A check that finds nothing listening asks once more, waiting for the channel to reconnect,
// before it counts (gRPC 1.51 can report a connect still in progress as failed): one failed
// connect neither keeps a new worker out nor takes a ready one out of placements; two do.
TEST_F(EngineTest, AFailedConnectCountsOnlyWhenTheSecondTryThatWaitsForReadyFailsToo) {
  fakes_->FailConnects(kI2, 1);  // its first check at Create
  Start({kA1}, {kI1, kI2});
  EXPECT_EQ(Metric(kReadyIndexers), 2);
  EXPECT_EQ(fakes_->GetLoads(kI2), 2);
  EXPECT_EQ(fakes_->ChecksWaitingForReady(kI2), 1);
  EXPECT_EQ(fakes_->ChecksWaitingForReady(kI1), 0);  // answered at once: asked once

  fakes_->FailConnects(kA1, 1);
  fakes_->FailConnects(kI1, 1);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyIndexers), 2);
  EXPECT_EQ(Metric(kReadyAttention), 1);
  EXPECT_EQ(fakes_->ChecksWaitingForReady(kA1), 1);

  fakes_->FailConnects(kI1, 2);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyIndexers), 1);
  EXPECT_EQ(fakes_->ChecksWaitingForReady(kI1), 2);
  engine_->RefreshWorkers();  // connects again
  EXPECT_EQ(Metric(kReadyIndexers), 2);
}

TEST_F(EngineTest, WithTheThresholdAtOneTheFirstTimedOutCheckTakesAWorkerOut) {
  options_.unready_after_timed_out_checks = 1;
  Start({kA1}, {kI1, kI2});
  fakes_->SetHung(kI1, true);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyIndexers), 1);
  fakes_->SetHung(kI1, false);
}

// A health check that times out after the worker's GetLoad answered is a lost check like any
// other, not an answer of not ready.
TEST_F(EngineTest, AHealthCheckThatTimesOutIsALostCheckNotANotReadyAnswer) {
  options_.unready_after_timed_out_checks = 2;
  Start({kA1}, {kI1, kI2});
  fakes_->SetHealthHung(kI1, true);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyIndexers), 2);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyIndexers), 1);
  fakes_->SetHealthHung(kI1, false);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyIndexers), 2);
}

// A worker whose calls are cut (hung_worker_checks below the threshold) leaves placements with
// them: a migration off it does not check it again, so it must not still be placed on.
TEST_F(EngineTest, AWorkerWhoseCallsAreCutLeavesPlacementsWithThem) {
  options_.unready_after_timed_out_checks = 3;
  options_.hung_worker_checks = 1;
  Start({kA1}, {kI1, kI2});
  fakes_->SetHung(kI1, true);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyIndexers), 1);
  fakes_->SetHung(kI1, false);
}

// Co-located, a pair is one worker: a half whose check timed out keeps its state, and the other
// half follows it, so the pair never splits (one half ready, the other not).
TEST_F(EngineTest, ACoLocatedPairStaysOneWhenOneHalfsCheckTimesOut) {
  options_.colocated = true;
  options_.unready_after_timed_out_checks = 2;
  Start({kA1, kA2}, {kA1, kA2});
  ASSERT_EQ(Metric(kReadyAttention), 2);
  ASSERT_EQ(Metric(kReadyIndexers), 2);
  fakes_->SetNotReady(kA1, true);
  engine_->RefreshWorkers();
  ASSERT_EQ(Metric(kReadyAttention), 1);
  ASSERT_EQ(Metric(kReadyIndexers), 1);
  // Not ready; its attention half answers ready again while its indexer half's check times out:
  // the pair stays not ready.
  fakes_->SetNotReady(kA1, false);
  fakes_->SetHealthHung(kA1, true, /*indexer_only=*/true);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyAttention), 1);
  EXPECT_EQ(Metric(kReadyIndexers), 1);
  fakes_->SetHealthHung(kA1, false, /*indexer_only=*/true);
  engine_->RefreshWorkers();
  ASSERT_EQ(Metric(kReadyAttention), 2);
  ASSERT_EQ(Metric(kReadyIndexers), 2);
  // Ready; one timed-out check of its indexer half keeps the pair ready, two take it out whole.
  fakes_->SetHealthHung(kA1, true, /*indexer_only=*/true);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyAttention), 2);
  EXPECT_EQ(Metric(kReadyIndexers), 2);
  engine_->RefreshWorkers();
  EXPECT_EQ(Metric(kReadyAttention), 1);
  EXPECT_EQ(Metric(kReadyIndexers), 1);
  fakes_->SetHealthHung(kA1, false, /*indexer_only=*/true);
}

TEST(EngineCreateTest, UnreadyAfterTimedOutChecksBelowOneIsRefused) {
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  CoordinatorOptions options;
  options.attention_addresses = {kA1};
  options.indexer_addresses = {kI1};
  options.run_loops = false;
  options.unready_after_timed_out_checks = 0;
  auto engine = CoordinatorEngine::Create(options, &metrics, std::make_shared<FakeWorkers>());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.status().message(), "unready_after_timed_out_checks must be >= 1, got 0");
}

}  // namespace
}  // namespace dsa
