// CoordinatorEngine over in-memory workers (tests/coordinator/fake_workers.h) and a FakeClock,
// without its threads (run_loops false): the test steps each decode loop itself (StepWorker),
// checks the workers itself (RefreshWorkers) and looks for stalled writes itself
// (CheckStalledWrites), so every fault, migration and stall below happens at a chosen step and a
// chosen clock reading (docs/reliability.md, "Engines where the tests need them"). The only waits
// are for the Generate handler thread to reach a state (AwaitDecoding, AwaitEvents), never for
// time. The fixture: tests/coordinator/engine_fixture.h.
#include "coordinator/engine.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/coordinator/engine_fixture.h"

namespace dsa {
namespace {

// The fixture's names: EngineTest, Call, Request, kA1.., cv1, FakeWorkers.
using namespace ::dsa::engine_testing;  // NOLINT(google-build-using-namespace)

TEST_F(EngineTest, AKilledAttentionWorkersRequestMovesAtTheFailedStepAndLosesNoToken) {
  Start({kA1, kA2}, {kI1});
  auto call = Generate(Request("r1", 100, 8));
  ASSERT_TRUE(call->stream.AwaitEvents(1));
  const std::string first = call->admitted().attention_worker();
  const std::string second = first == kA1 ? kA2 : kA1;
  for (int step = 0; step < 3; ++step) {
    ASSERT_EQ(*engine_->StepWorker(first), 1);
    ASSERT_TRUE(call->stream.AwaitEvents(2 + step));
  }
  const uint64_t sequence_id = fakes_->Prefills(first).at(0).sequence_id();

  fakes_->SetDown(first, true);               // kill -9 between steps 3 and 4
  ASSERT_EQ(*engine_->StepWorker(first), 1);  // the step fails: the request migrates
  ASSERT_TRUE(engine_->AwaitDecoding(second, 1, kSafetyNet));
  // Re-prefilled on the survivor with its context plus the 3 tokens generated.
  ASSERT_EQ(fakes_->Prefills(second).size(), 1u);
  EXPECT_EQ(fakes_->Prefills(second)[0].context_length(), 103);
  // The failed step confirmed the loss: the check before the migration did not ask again and
  // wait for a reconnect.
  EXPECT_EQ(fakes_->ChecksWaitingForReady(first), 0);
  StepUntilFinished(second, *call);
  call->Join();

  ASSERT_TRUE(call->status.ok()) << call->status;
  bool contiguous = false;
  EXPECT_EQ(call->Tokens(100, &contiguous), 8);
  EXPECT_TRUE(contiguous);
  ASSERT_NE(call->finished(), nullptr);
  EXPECT_EQ(call->finished()->migrations(), 1);
  EXPECT_EQ(Metric("dsa_coordinator_migrations_total "), 1);
  EXPECT_EQ(fakes_->Sequences(second), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
  // The dead worker's Release waits for it: delivered at the first check that finds it back.
  EXPECT_EQ(fakes_->Sequences(first), 1);
  fakes_->SetDown(first, false);
  engine_->RefreshWorkers();
  EXPECT_EQ(fakes_->Sequences(first), 0);
  EXPECT_EQ(fakes_->Released(first), std::vector<uint64_t>{sequence_id});
}

TEST_F(EngineTest, AKilledIndexersRequestMovesAndItsBatchNeighbourGoesOnUnmoved) {
  Start({kA1}, {kI1, kI2});
  auto on_first = Generate(Request("r1", 200, 6));
  ASSERT_TRUE(on_first->stream.AwaitEvents(1));
  auto on_second = Generate(Request("r2", 200, 6));
  ASSERT_TRUE(on_second->stream.AwaitEvents(1));
  const std::string dying = on_first->admitted().indexer_worker();
  const std::string surviving = on_second->admitted().indexer_worker();
  ASSERT_NE(dying, surviving) << "placement spreads misses over the indexers";
  ASSERT_EQ(*engine_->StepWorker(kA1), 2);  // one batch of both
  ASSERT_TRUE(on_first->stream.AwaitEvents(2));
  ASSERT_TRUE(on_second->stream.AwaitEvents(2));

  fakes_->SetDown(dying, true);
  const int steps_before = fakes_->DecodeSteps(kA1);
  // The batch fails; each alone: r2 steps, r1 fails and migrates to the surviving indexer.
  ASSERT_EQ(*engine_->StepWorker(kA1), 2);
  EXPECT_EQ(fakes_->DecodeSteps(kA1) - steps_before, 3);
  ASSERT_TRUE(on_second->stream.AwaitEvents(3));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 2, kSafetyNet));  // r1 back, on the other indexer
  for (int i = 0; i < 20 && (on_first->finished() == nullptr || on_second->finished() == nullptr);
       ++i) {
    ASSERT_TRUE(engine_->StepWorker(kA1).ok());
    ASSERT_TRUE(on_first->stream.AwaitEvents(static_cast<int>(on_first->stream.events().size())));
  }
  on_first->Join();
  on_second->Join();
  ASSERT_TRUE(on_first->status.ok()) << on_first->status;
  ASSERT_TRUE(on_second->status.ok()) << on_second->status;
  bool contiguous = false;
  EXPECT_EQ(on_first->Tokens(200, &contiguous), 6);
  EXPECT_TRUE(contiguous);
  EXPECT_EQ(on_second->Tokens(200, &contiguous), 6);
  EXPECT_TRUE(contiguous);
  EXPECT_EQ(on_first->finished()->migrations(), 1);
  EXPECT_EQ(on_second->finished()->migrations(), 0);
  EXPECT_EQ(fakes_->Prefills(kA1).back().indexer_worker(), surviving);
  EXPECT_EQ(fakes_->Sequences(surviving), 0);
  // The dead indexer still holds r1's first sequence; released when it answers again.
  EXPECT_EQ(fakes_->Sequences(dying), 1);
  fakes_->SetDown(dying, false);
  engine_->RefreshWorkers();
  EXPECT_EQ(fakes_->Sequences(dying), 0);
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
}

TEST_F(EngineTest, WithoutMigrationsLeftAFailureEndsOnlyTheRequestsOfTheDeadWorker) {
  options_.max_migrations = 0;
  Start({kA1}, {kI1, kI2});
  auto on_first = Generate(Request("r1", 64, 4));
  ASSERT_TRUE(on_first->stream.AwaitEvents(1));
  auto on_second = Generate(Request("r2", 64, 4));
  ASSERT_TRUE(on_second->stream.AwaitEvents(1));
  ASSERT_NE(on_first->admitted().indexer_worker(), on_second->admitted().indexer_worker());
  fakes_->SetDown(on_first->admitted().indexer_worker(), true);
  ASSERT_EQ(*engine_->StepWorker(kA1), 2);
  on_first->Join();
  EXPECT_EQ(on_first->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(on_first->status.message(), "after 0 migrations"))
      << on_first->status;
  StepUntilFinished(kA1, *on_second);
  on_second->Join();
  EXPECT_TRUE(on_second->status.ok()) << on_second->status;
  EXPECT_EQ(Metric("dsa_coordinator_migrations_total "), 0);
}

// Found by fuzz_coordinator_service: a request ends while its indexer is down. The attention
// worker drops its KV and answers its indexer's UNAVAILABLE, so a retry of its Release finds
// nothing; the indexer sequence is released directly, once the indexer answers again.
TEST_F(EngineTest, ARequestEndingWhileItsIndexerIsDownLeavesNoIndexerSequence) {
  Start({kA1}, {kI1});
  auto call = Generate(Request("r1", 30, 50), "router-a");
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  ASSERT_TRUE(engine_->Abort("r1", "router-a").ok());
  fakes_->SetDown(kI1, true);
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);  // ends it: the attention Release fails on I1
  call->Join();
  EXPECT_EQ(call->status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 1);
  fakes_->SetDown(kI1, false);
  engine_->RefreshWorkers();
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
}

TEST_F(EngineTest, AHungWorkersBatchFailsOnceAndMovesWithoutPerSequenceRetries) {
  Start({kA1, kA2}, {kI1});
  fakes_->SetNotReady(kA2, true);  // both requests go to A1
  engine_->RefreshWorkers();
  auto r1 = Generate(Request("r1", 32, 5));
  ASSERT_TRUE(r1->stream.AwaitEvents(1));
  auto r2 = Generate(Request("r2", 32, 5));
  ASSERT_TRUE(r2->stream.AwaitEvents(1));
  ASSERT_EQ(r1->admitted().attention_worker(), kA1);
  ASSERT_EQ(r2->admitted().attention_worker(), kA1);
  fakes_->SetNotReady(kA2, false);
  fakes_->SetHung(kA1, true);  // SIGSTOP: every call runs into its deadline
  const int steps_before = fakes_->DecodeSteps(kA1);
  ASSERT_EQ(*engine_->StepWorker(kA1), 2);
  EXPECT_EQ(fakes_->DecodeSteps(kA1) - steps_before, 1) << "a hung batch is not retried alone";
  ASSERT_TRUE(engine_->AwaitDecoding(kA2, 2, kSafetyNet));
  StepUntilFinished(kA2, *r1);
  StepUntilFinished(kA2, *r2);
  r1->Join();
  r2->Join();
  ASSERT_TRUE(r1->status.ok()) << r1->status;
  ASSERT_TRUE(r2->status.ok()) << r2->status;
  EXPECT_EQ(r1->finished()->migrations(), 1);
  EXPECT_EQ(r2->finished()->migrations(), 1);
  EXPECT_EQ(fakes_->Sequences(kA1), 2);  // unreachable until SIGCONT
  fakes_->SetHung(kA1, false);
  engine_->RefreshWorkers();
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
}

// A SIGSTOPped attention worker holds its DecodeStep open; the step is cancelled once
// hung_worker_checks consecutive checks of the worker could not reach it, not at the step's
// deadline, and its batch moves without one-by-one retries.
TEST_F(EngineTest, AStepHeldOpenByAWorkerItsChecksCannotReachIsCancelledAndItsBatchMoves) {
  options_.hung_worker_checks = 2;
  Start({kA1, kA2}, {kI1});
  fakes_->SetNotReady(kA2, true);  // both requests go to A1
  engine_->RefreshWorkers();
  auto r1 = Generate(Request("r1", 32, 5));
  ASSERT_TRUE(r1->stream.AwaitEvents(1));
  auto r2 = Generate(Request("r2", 32, 5));
  ASSERT_TRUE(r2->stream.AwaitEvents(1));
  ASSERT_EQ(r1->admitted().attention_worker(), kA1);
  ASSERT_EQ(r2->admitted().attention_worker(), kA1);
  fakes_->SetNotReady(kA2, false);
  fakes_->SetStalled(kA1, true);
  const int steps_before = fakes_->DecodeSteps(kA1);
  const int releases_before = fakes_->ReleaseCalls(kA1);
  absl::StatusOr<int> stepped;
  std::thread step([&] { stepped = engine_->StepWorker(kA1); });
  ASSERT_TRUE(fakes_->AwaitStalledCalls(kA1, 1, kSafetyNet));
  engine_->RefreshWorkers();  // one check lost: not yet
  EXPECT_EQ(fakes_->CancelledCalls(kA1), 0);
  engine_->RefreshWorkers();  // two: the step is cut short
  step.join();
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(*stepped, 2);
  EXPECT_EQ(fakes_->CancelledCalls(kA1), 1);
  EXPECT_EQ(fakes_->DecodeSteps(kA1) - steps_before, 1) << "a hung batch is not retried alone";
  ASSERT_TRUE(engine_->AwaitDecoding(kA2, 2, kSafetyNet));
  StepUntilFinished(kA2, *r1);
  StepUntilFinished(kA2, *r2);
  r1->Join();
  r2->Join();
  ASSERT_TRUE(r1->status.ok()) << r1->status;
  ASSERT_TRUE(r2->status.ok()) << r2->status;
  EXPECT_EQ(r1->finished()->migrations(), 1);
  EXPECT_EQ(r2->finished()->migrations(), 1);
  bool contiguous = false;
  EXPECT_EQ(r1->Tokens(32, &contiguous), 5);
  EXPECT_TRUE(contiguous);
  // Their Releases were not sent to the unreachable worker; they reach it when it answers.
  EXPECT_EQ(fakes_->ReleaseCalls(kA1), releases_before);
  EXPECT_EQ(fakes_->Sequences(kA1), 2);
  ResumeAndExpectNothingLeft(kA1);
}

// A worker that hangs between a speculative step and its Commit: the Commit held open is cut at
// the checks too, and the request moves without losing or repeating a token.
TEST_F(EngineTest, ACommitHeldOpenByAWorkerThatHungAfterItsStepIsCancelledAtItsChecks) {
  options_.hung_worker_checks = 2;
  Start({kA1, kA2}, {kI1});
  fakes_->SetNotReady(kA2, true);
  engine_->RefreshWorkers();
  GenerateSpec speculative = Request("r1", 40, 6);
  speculative.draft_length = 2;
  auto r1 = Generate(speculative);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  fakes_->SetNotReady(kA2, false);
  fakes_->StallAfterNextStep(kA1);
  std::thread step([&] { (void)engine_->StepWorker(kA1); });
  ASSERT_TRUE(fakes_->AwaitStalledCalls(kA1, 1, kSafetyNet));  // the Commit waits
  engine_->RefreshWorkers();
  engine_->RefreshWorkers();
  step.join();
  EXPECT_EQ(fakes_->CancelledCalls(kA1), 1);
  ASSERT_TRUE(engine_->AwaitDecoding(kA2, 1, kSafetyNet));
  StepUntilFinished(kA2, *r1);
  r1->Join();
  ASSERT_TRUE(r1->status.ok()) << r1->status;
  EXPECT_EQ(r1->finished()->migrations(), 1);
  bool contiguous = false;
  EXPECT_EQ(r1->Tokens(40, &contiguous), 6);
  EXPECT_TRUE(contiguous);
  ResumeAndExpectNothingLeft(kA1);
}

// A prefill has no deadline of its own (a long context takes long), so a worker that hangs
// during it would hold it open for good: it is cut at the checks, and the request moves.
TEST_F(EngineTest, APrefillHeldOpenByAHungWorkerIsCutAtItsChecksAndMoves) {
  options_.hung_worker_checks = 2;
  Start({kA1, kA2}, {kI1});
  fakes_->SetNotReady(kA2, true);
  engine_->RefreshWorkers();
  fakes_->SetStalled(kA1, true);  // no check has seen it yet: the prefill goes there
  auto r1 = Generate(Request("r1", 64, 3));
  ASSERT_TRUE(fakes_->AwaitStalledCalls(kA1, 1, kSafetyNet));
  fakes_->SetNotReady(kA2, false);
  engine_->RefreshWorkers();
  engine_->RefreshWorkers();
  ASSERT_TRUE(engine_->AwaitDecoding(kA2, 1, kSafetyNet));
  EXPECT_EQ(fakes_->CancelledCalls(kA1), 1);
  StepUntilFinished(kA2, *r1);
  r1->Join();
  ASSERT_TRUE(r1->status.ok()) << r1->status;
  EXPECT_EQ(r1->finished()->migrations(), 1);
  EXPECT_EQ(r1->admitted().attention_worker(), kA2);  // Admitted is written once it decodes
  ResumeAndExpectNothingLeft(kA1);
}

// hung_worker_checks 0: the step waits, however many checks are lost, and goes on when the
// worker does.
TEST_F(EngineTest, WithoutHungWorkerChecksAStepWaitsForTheWorker) {
  options_.hung_worker_checks = 0;
  Start({kA1}, {kI1});
  auto r1 = Generate(Request("r1", 32, 3));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  fakes_->SetStalled(kA1, true);
  absl::StatusOr<int> stepped;
  std::thread step([&] { stepped = engine_->StepWorker(kA1); });
  ASSERT_TRUE(fakes_->AwaitStalledCalls(kA1, 1, kSafetyNet));
  for (int i = 0; i < 3; ++i) engine_->RefreshWorkers();
  EXPECT_EQ(fakes_->CancelledCalls(kA1), 0);
  fakes_->SetStalled(kA1, false);  // SIGCONT
  step.join();
  engine_->RefreshWorkers();
  StepUntilFinished(kA1, *r1);
  r1->Join();
  ASSERT_TRUE(r1->status.ok()) << r1->status;
  EXPECT_EQ(r1->finished()->migrations(), 0);
}

// Abort while the prefill runs cancels the prefill, and the CANCELLED it brings back is not a
// worker's failure: no migration.
TEST_F(EngineTest, AnAbortDuringThePrefillCancelsItAndIsNoMigration) {
  Start({kA1}, {kI1});
  fakes_->SetStalled(kA1, true);  // no check has seen it: the prefill is placed there, held open
  auto r1 = Generate(Request("r1", 32, 4));
  ASSERT_TRUE(fakes_->AwaitStalledCalls(kA1, 1, kSafetyNet));
  EXPECT_TRUE(engine_->Abort("r1", "router").ok());
  r1->Join();
  EXPECT_EQ(r1->status.code(), absl::StatusCode::kCancelled) << r1->status;
  EXPECT_EQ(fakes_->CancelledCalls(kA1), 1);
  EXPECT_EQ(Metric("dsa_coordinator_migrations_total "), 0);
  ResumeAndExpectNothingLeft(kA1);
}

// An indexer without audits (--audit-fraction 0) refuses a sequence with a miss target,
// FAILED_PRECONDITION, and the attention worker's Prefill answers that refusal. It is about the
// request, not a failed worker (every worker of a deployment shares the flag): the request ends at
// once with the indexer's message, naming the workers, without a migration and without a check
// of the workers; the request decoding beside it, and one that comes after it, go on there.
TEST_F(EngineTest, AMissTargetTheIndexerRefusesEndsItsRequestAtOnceWithoutMigrating) {
  Start({kA1}, {kI1});
  fakes_->SetWithoutAudits(kI1, true);
  auto r1 = Generate(Request("r1", 64, 4));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);
  ASSERT_TRUE(r1->stream.AwaitEvents(2));
  const int checks_before = fakes_->GetLoads(kI1);

  GenerateSpec refused = Request("r2", 64, 4);
  refused.overrides.miss_target = 0.05;
  auto r2 = Generate(refused);
  r2->Join();
  EXPECT_EQ(r2->status.code(), absl::StatusCode::kFailedPrecondition) << r2->status;
  EXPECT_TRUE(absl::StrContains(r2->status.message(),
                                "miss target 0.05 needs audits: this indexer runs with "
                                "audit_fraction 0 (dsa-indexer --audit-fraction)"))
      << r2->status;
  EXPECT_TRUE(absl::StrContains(r2->status.message(), kA1)) << r2->status;
  EXPECT_TRUE(absl::StrContains(r2->status.message(), kI1)) << r2->status;
  EXPECT_FALSE(absl::StrContains(r2->status.message(), "migrations")) << r2->status;
  EXPECT_TRUE(r2->stream.events().empty());  // not even Admitted
  EXPECT_EQ(fakes_->PrefillCalls(kA1), 2);   // r1's, and r2's only one
  EXPECT_EQ(Metric("dsa_coordinator_migrations_total "), 0);
  EXPECT_EQ(fakes_->GetLoads(kI1), checks_before);  // no worker was suspected
  EXPECT_EQ(Requests("failed"), 1);

  // The workers stay ready: the next request is placed there and decodes in r1's batch.
  auto r3 = Generate(Request("r3", 64, 4));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 2, kSafetyNet));
  StepUntilFinished(kA1, *r1);
  StepUntilFinished(kA1, *r3);
  r1->Join();
  r3->Join();
  ASSERT_TRUE(r1->status.ok()) << r1->status;
  ASSERT_TRUE(r3->status.ok()) << r3->status;
  bool contiguous = false;
  EXPECT_EQ(r1->Tokens(64, &contiguous), 4);
  EXPECT_TRUE(contiguous);
  EXPECT_EQ(r1->finished()->migrations(), 0);
  EXPECT_EQ(r3->finished()->migrations(), 0);
  EXPECT_EQ(fakes_->Steps(kA1).at(1).sequences_size(), 2);  // r1 and r3 in one batch
  EXPECT_EQ(Metric("dsa_coordinator_migrations_total "), 0);
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
}

// FAILED_PRECONDITION from a DecodeStep is a worker's failure: the attention worker marked a
// sequence it holds broken, and a fresh prefill elsewhere mends it. That sequence's request moves
// (unlike the refusal of a Prefill that creates one, above); its batch neighbour goes on unmoved.
TEST_F(EngineTest, ASequenceTheAttentionWorkerMarkedBrokenMovesAndItsNeighbourGoesOn) {
  Start({kA1, kA2}, {kI1});
  fakes_->SetNotReady(kA2, true);
  engine_->RefreshWorkers();
  auto r1 = Generate(Request("r1", 64, 4));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  auto r2 = Generate(Request("r2", 64, 4));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 2, kSafetyNet));
  fakes_->SetNotReady(kA2, false);
  engine_->RefreshWorkers();
  const uint64_t broken = fakes_->Prefills(kA1).at(0).sequence_id();
  fakes_->SetBroken(kA1, broken);

  // The batch fails; each alone: r2 steps, r1 fails again and migrates.
  ASSERT_EQ(*engine_->StepWorker(kA1), 2);
  ASSERT_TRUE(engine_->AwaitDecoding(kA2, 1, kSafetyNet));
  StepUntilFinished(kA1, *r2);
  StepUntilFinished(kA2, *r1);
  r1->Join();
  r2->Join();
  ASSERT_TRUE(r1->status.ok()) << r1->status;
  ASSERT_TRUE(r2->status.ok()) << r2->status;
  bool contiguous = false;
  EXPECT_EQ(r1->Tokens(64, &contiguous), 4);
  EXPECT_TRUE(contiguous);
  EXPECT_EQ(r1->finished()->migrations(), 1);
  EXPECT_EQ(r2->finished()->migrations(), 0);
  EXPECT_EQ(Metric("dsa_coordinator_migrations_total "), 1);
  EXPECT_EQ(fakes_->Released(kA1).at(0), broken);
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kA2), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
}

TEST_F(EngineTest, ARestartedWorkerIsRetiredAndItsRequestMovesToTheNewInstance) {
  Start({kA1}, {kI1});
  auto call = Generate(Request("r1", 50, 4));
  ASSERT_TRUE(call->stream.AwaitEvents(1));
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);
  fakes_->Restart(kA1);                     // same address, new instance id, nothing held
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);  // NOT_FOUND: the sequence is gone, it migrates
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));  // the new instance's slot
  StepUntilFinished(kA1, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  EXPECT_EQ(call->finished()->migrations(), 1);
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
  cv1::GetLoadResponse load = GetLoad();
  ASSERT_EQ(load.attention_workers_size(), 1);  // the retired slot is not reported
  EXPECT_TRUE(load.attention_workers(0).ready());
}

// Found by fuzz_coordinator_service: a session kept on a worker whose peer restarted was forgotten
// without a release, leaving its KV on the surviving attention worker and, when its turn ran on
// the restarted process before the check saw the restart, its index keys there too.
TEST_F(EngineTest, ARetiredWorkersKeptSessionIsReleasedOnBothSides) {
  Start({kA1}, {kI1});
  GenerateSpec turn = Request("r1", 20, 2);
  turn.session_id = "chat";
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn, kA1));
  EXPECT_EQ(fakes_->Sequences(kA1), 1);  // kept for the next turn
  fakes_->Restart(kI1);                  // the restart is not seen yet
  engine_->RefreshWorkers();             // seen: I1's slot retired, the session forgotten
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(GetLoad().retained_sequences(), 0);

  // I1 restarts again, and a session's turn runs on its new process before a check sees that.
  fakes_->Restart(kI1);
  turn.request_id = "r2";
  turn.session_id = "chat-2";
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn, kA1));
  EXPECT_EQ(fakes_->Sequences(kA1), 1);
  EXPECT_EQ(fakes_->Sequences(kI1), 1);
  engine_->RefreshWorkers();  // the restart seen: released on both sides
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
}

// Sessions belong to the caller that names them (docs/reliability.md, "Security"): another caller
// that sends the same session id neither continues the owner's sequence (its KV and index keys) nor
// is held to its length; it gets a session of its own, and the owner's stays whole.
TEST_F(EngineTest, ASessionIdFromAnotherCallerStartsItsOwnSession) {
  options_.retain_finished = true;
  Start({kA1}, {kI1});
  GenerateSpec turn = Request("r1", 20, 2);
  turn.session_id = "chat";
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn, kA1, "alice"));
  EXPECT_EQ(fakes_->Sequences(kA1), 1);
  // 10 tokens: shorter than alice's 22 slots, which would be INVALID_ARGUMENT for alice.
  GenerateSpec other = Request("r2", 10, 2);
  other.session_id = "chat";
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(other, kA1, "mallory"));
  EXPECT_EQ(fakes_->Sequences(kA1), 2);
  EXPECT_EQ(GetLoad().retained_sequences(), 2);
  // alice's next turn still continues hers: a context shorter than her 22 slots is refused.
  GenerateSpec shorter = Request("r3", 21, 2);
  shorter.session_id = "chat";
  Call* call = Generate(shorter, "alice");
  call->Join();
  EXPECT_EQ(call->status.code(), absl::StatusCode::kInvalidArgument) << call->status;
  EXPECT_TRUE(absl::StrContains(call->status.message(), "holds 22 slots")) << call->status;
}

// The other way round: the attention worker restarted (its new process holds nothing), so the
// session's index keys on the surviving indexer are released there directly.
TEST_F(EngineTest, ARestartedAttentionWorkersKeptSessionIsReleasedOnItsIndexer) {
  Start({kA1}, {kI1});
  GenerateSpec turn = Request("r1", 20, 2);
  turn.session_id = "chat";
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn, kA1));
  EXPECT_EQ(fakes_->Sequences(kI1), 1);
  fakes_->Restart(kA1);
  engine_->RefreshWorkers();
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
}

// Found by fuzz_coordinator_service (crash-0c78..., fuzz/seeds/coordinator_service/): a request
// placed on a worker that had restarted unseen migrated when that worker went down; its Release
// waited for the worker, and was dropped when the check that found it back saw the restart, though
// the new process held the sequence. The Release goes to the new process now.
TEST_F(EngineTest, AReleaseWaitingForARestartedWorkerGoesToItsNewProcess) {
  Start({kA1, kA2}, {kI1});
  fakes_->SetNotReady(kA2, true);
  engine_->RefreshWorkers();  // only A1 takes requests
  fakes_->Restart(kA1);       // not seen yet: the request goes to the new process
  auto call = Generate(Request("r1", 30, 4));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);
  fakes_->SetNotReady(kA2, false);
  fakes_->SetDown(kA1, true);
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);  // fails: migrates to A2; A1's Release waits
  ASSERT_TRUE(engine_->AwaitDecoding(kA2, 1, kSafetyNet));
  StepUntilFinished(kA2, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  EXPECT_EQ(fakes_->Sequences(kA1), 1);
  fakes_->SetDown(kA1, false);
  engine_->RefreshWorkers();  // the restart seen: A1's slot retired, its new process taken in
  engine_->RefreshWorkers();
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kA2), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
}

// Found by fuzz_coordinator_service (crash-844f...): a kept session forgotten when its indexer
// restarted was released on its attention worker once, ignoring that the worker was down at that
// moment; its KV stayed there. An eviction's Release to an unreachable worker is retried now.
TEST_F(EngineTest, AnEvictionsReleaseToAnUnreachableWorkerIsRetriedWhenItAnswers) {
  Start({kA1}, {kI1});
  GenerateSpec turn = Request("r1", 20, 2);
  turn.session_id = "chat";
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn, kA1));
  EXPECT_EQ(fakes_->Sequences(kA1), 1);  // kept for the next turn
  fakes_->Restart(kI1);
  fakes_->SetDown(kA1, true);
  engine_->RefreshWorkers();  // I1 retired: the session forgotten, A1 unreachable
  EXPECT_EQ(fakes_->Sequences(kA1), 1);
  fakes_->SetDown(kA1, false);
  engine_->RefreshWorkers();
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
}

TEST_F(EngineTest, AReaderThatLeavesItsEventsUnreadIsEndedExactlyAtTheStallTimeout) {
  options_.stall_timeout_ms = 1000;
  options_.max_pending_events = 4;  // a step is skipped while 3 events wait
  Start({kA1}, {kI1});
  auto call = Generate(Request("r1", 40, 100), "router", /*hold_writes=*/true);
  // Admitted's Write blocks: nothing more is read
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  ASSERT_TRUE(call->stream.AwaitHeldWrite());
  for (int step = 0; step < 3; ++step) ASSERT_EQ(*engine_->StepWorker(kA1), 1);
  ASSERT_EQ(*engine_->StepWorker(kA1), 0);  // the queue is full: stalled since now
  clock_.Advance(absl::Milliseconds(999));
  ASSERT_EQ(*engine_->StepWorker(kA1), 0);
  EXPECT_FALSE(call->stream.IsCancelled());
  clock_.Advance(absl::Milliseconds(1));
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);  // ended
  call->Join();
  EXPECT_EQ(call->status.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(absl::StrContains(call->status.message(), "left 3 events unread for 1000 ms"))
      << call->status;
  EXPECT_TRUE(call->stream.IsCancelled());
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(fakes_->Sequences(kI1), 0);
}

TEST_F(EngineTest, AWriteBlockedPastTheStallTimeoutIsCancelledByTheClockNotBefore) {
  options_.stall_timeout_ms = 1000;
  Start({kA1}, {kI1});
  auto call = Generate(Request("r1", 40, 100), "router", /*hold_writes=*/true);
  ASSERT_TRUE(call->stream.AwaitHeldWrite());  // Admitted's Write, blocked since now
  clock_.Advance(absl::Milliseconds(999));
  engine_->CheckStalledWrites();
  EXPECT_FALSE(call->stream.IsCancelled());
  clock_.Advance(absl::Milliseconds(1));
  engine_->CheckStalledWrites();
  EXPECT_TRUE(call->stream.IsCancelled());
  ASSERT_EQ(*engine_->StepWorker(kA1), 1);  // the decode loop ends it and releases it
  call->Join();
  EXPECT_EQ(call->status.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(absl::StrContains(call->status.message(), "read nothing for 1000 ms"))
      << call->status;
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
}

TEST_F(EngineTest, ReadinessFollowsTheLastIndexerAndGenerateSaysWhyItIsRefused) {
  Start({kA1}, {kI1});
  std::vector<bool> told;
  engine_->SetReadinessListener([&told](bool ready) { told.push_back(ready); });
  fakes_->SetDown(kI1, true);
  engine_->RefreshWorkers();
  RecordingStream stream;
  const absl::Status refused = engine_->Generate(Request("r1", 10, 2), "router", "", stream);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(refused.message(), "0 of 1 indexer")) << refused;
  cv1::GetLoadResponse load = GetLoad();
  ASSERT_EQ(load.indexer_workers_size(), 1);
  EXPECT_FALSE(load.indexer_workers(0).ready());
  fakes_->SetDown(kI1, false);
  engine_->RefreshWorkers();
  EXPECT_EQ(told, (std::vector<bool>{true, false, true}));
  auto call = Generate(Request("r2", 10, 2));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  StepUntilFinished(kA1, *call);
  call->Join();
  EXPECT_TRUE(call->status.ok()) << call->status;
}

// Request ids are scoped per caller: another caller's Abort of an id in flight answers as for an
// id never seen (no probing), and another caller may run a request of the same id.
TEST_F(EngineTest, OnlyTheCallerThatStartedARequestMayAbortIt) {
  Start({kA1}, {kI1});
  auto call = Generate(Request("r1", 10, 50), "router-a");
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  const absl::Status other = engine_->Abort("r1", "router-b");
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(other.message(), "no request 'r1' of this caller in flight");
  EXPECT_EQ(engine_->Abort("r9", "router-a").code(), absl::StatusCode::kNotFound);
  // The same id from router-b runs beside router-a's; router-a's own second one is refused.
  auto same_id = Generate(Request("r1", 10, 2), "router-b");
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 2, kSafetyNet));
  auto twice = Generate(Request("r1", 10, 2), "router-a");
  twice->Join();
  EXPECT_EQ(twice->status.code(), absl::StatusCode::kAlreadyExists) << twice->status;
  EXPECT_TRUE(engine_->Abort("r1", "router-a").ok());
  ASSERT_EQ(*engine_->StepWorker(kA1), 2);
  call->Join();
  EXPECT_EQ(call->status.code(), absl::StatusCode::kCancelled);
  StepUntilFinished(kA1, *same_id);
  same_id->Join();
  EXPECT_TRUE(same_id->status.ok()) << same_id->status;
  EXPECT_EQ(fakes_->Sequences(kA1), 0);
  EXPECT_EQ(engine_->StepWorker("10.9.9.9:1").status().code(), absl::StatusCode::kNotFound);
}

// GetLoad is not an amplifier: however often clients call it, each indexer is asked at most once
// per load_cache_ms of the clock; a readiness change is reported at once.
TEST_F(EngineTest, GetLoadAsksEachIndexerAtMostOncePerLoadCacheInterval) {
  options_.load_cache_ms = 100;
  Start({kA1}, {kI1, kI2});
  const int asked = fakes_->GetLoads(kI1);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(GetLoad().indexer_workers_size(), 2);
  EXPECT_EQ(fakes_->GetLoads(kI1), asked + 1);
  EXPECT_EQ(fakes_->GetLoads(kI2), asked + 1);
  clock_.Advance(absl::Milliseconds(99));
  (void)GetLoad();
  EXPECT_EQ(fakes_->GetLoads(kI1), asked + 1);
  clock_.Advance(absl::Milliseconds(1));
  (void)GetLoad();
  EXPECT_EQ(fakes_->GetLoads(kI1), asked + 2);
  // I2 goes down: the next GetLoad says so at once (its readiness is not cached).
  fakes_->SetDown(kI2, true);
  engine_->RefreshWorkers();
  const int after_refresh = fakes_->GetLoads(kI1);
  const cv1::GetLoadResponse load = GetLoad();
  ASSERT_EQ(load.indexer_workers_size(), 2);
  EXPECT_FALSE(load.indexer_workers(1).ready());
  EXPECT_EQ(fakes_->GetLoads(kI1), after_refresh + 1);
}

// Every refused request and every refused Abort leaves one log line naming the request, its
// caller, the code and the reason, and a refusal is counted under its code.
TEST_F(EngineTest, RefusalsAreLoggedAndCountedByCode) {
  Start({kA1}, {kI1});
  RecordingStream stream;
  ::testing::internal::CaptureStderr();
  const absl::Status bad = engine_->Generate(Request("", 10, 2), "router-a", "", stream);
  const absl::Status unknown = engine_->Abort("nope", "router-b");
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(log, R"("caller":"router-a","code":"INVALID_ARGUMENT")")) << log;
  EXPECT_TRUE(absl::StrContains(log, R"("msg":"request rejected","reason":"request_id must be)"))
      << log;
  EXPECT_TRUE(absl::StrContains(log, R"("msg":"abort refused","reason":"no request 'nope')"))
      << log;
  EXPECT_EQ(Requests("rejected", "INVALID_ARGUMENT"), 1);
  EXPECT_EQ(Requests("rejected"), 1);
}

// The end-to-end histogram takes every request that was queued, whatever its end; the prompt
// counter takes each admitted request's context once.
TEST_F(EngineTest, RequestDurationsAndPromptTokensAreCounted) {
  Start({kA1}, {kI1});
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(Request("r1", 300, 2), kA1));
  Call* aborted = Generate(Request("r2", 200, 50));
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  clock_.Advance(absl::Seconds(3));
  ASSERT_TRUE(engine_->Abort("r2", "router").ok());
  StepUntilFinished(kA1, *aborted);
  aborted->Join();
  RecordingStream refused;
  ASSERT_FALSE(engine_->Generate(Request("", 10, 2), "router", "", refused).ok());  // not queued
  EXPECT_EQ(Metric("dsa_coordinator_prompt_tokens_total "), 300 + 200);
  EXPECT_EQ(Metric("dsa_coordinator_request_duration_seconds_count "), 2);
  EXPECT_EQ(Metric("dsa_coordinator_request_duration_seconds_sum "), 3);  // r2's 3 s of clock
}

// A worker the checks no longer reach is not reported with its last load: GetLoad says it is
// unreachable and since when, gives it no figures and leaves it out of the totals; once a check
// reaches it again it is reported as before.
TEST_F(EngineTest, GetLoadReportsAnUnreachableWorkerWithoutItsLastLoad) {
  Start({kA1, kA2}, {kI1, kI2});
  GenerateSpec turn = Request("r1", 200, 2);
  turn.session_id = "chat";  // kept: its index-key blocks stay on the indexer
  Call* call = Generate(turn);
  ASSERT_TRUE(call->stream.AwaitEvents(1));  // Admitted
  const std::string indexer = call->admitted().indexer_worker();
  const std::string attention = call->admitted().attention_worker();
  ASSERT_TRUE(engine_->AwaitDecoding(attention, 1, kSafetyNet));
  StepUntilFinished(attention, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  cv1::GetLoadResponse load = GetLoad();
  int64_t held = 0;
  for (const auto& w : load.indexer_workers()) {
    EXPECT_TRUE(w.reachable());
    EXPECT_EQ(w.unreached_for_ms(), 0);
    if (w.address() == indexer) held = w.cache_blocks_used();
  }
  ASSERT_GT(held, 0);
  const int64_t capacity = load.cache_blocks_capacity();

  fakes_->SetDown(indexer, true);
  fakes_->SetDown(attention, true);
  clock_.Advance(absl::Milliseconds(1500));
  engine_->RefreshWorkers();
  clock_.Advance(absl::Milliseconds(500));
  load = GetLoad();
  ASSERT_EQ(load.indexer_workers_size(), 2);
  for (const auto& w : load.indexer_workers()) {
    const bool down = w.address() == indexer;
    EXPECT_EQ(w.reachable(), !down) << w.address();
    EXPECT_EQ(w.ready(), !down) << w.address();
    EXPECT_EQ(w.unreached_for_ms(), down ? 2000 : 0) << w.address();
    if (down) {
      EXPECT_EQ(w.cache_blocks_used(), 0);
      EXPECT_EQ(w.cache_blocks_capacity(), 0);
      EXPECT_EQ(w.sequences(), 0);
    }
  }
  EXPECT_EQ(load.cache_blocks_used(), 0);
  EXPECT_EQ(load.cache_blocks_capacity(), capacity / 2);
  ASSERT_EQ(load.attention_workers_size(), 2);
  for (const auto& w : load.attention_workers()) {
    const bool down = w.address() == attention;
    EXPECT_EQ(w.reachable(), !down) << w.address();
    EXPECT_EQ(w.unreached_for_ms(), down ? 2000 : 0) << w.address();
  }

  fakes_->SetDown(indexer, false);
  fakes_->SetDown(attention, false);
  engine_->RefreshWorkers();
  clock_.Advance(absl::Milliseconds(100));  // past load_cache_ms
  load = GetLoad();
  for (const auto& w : load.indexer_workers()) {
    EXPECT_TRUE(w.reachable());
    EXPECT_EQ(w.unreached_for_ms(), 0);
  }
  for (const auto& w : load.attention_workers()) EXPECT_TRUE(w.reachable());
  EXPECT_EQ(load.cache_blocks_capacity(), capacity);
}

// Every handler of a failed worker's requests refreshes before it migrates: calls that waited
// behind a refresh in progress share the next one, so three calls make two rounds of checks, not
// three (with a hung worker each round costs a check timeout).
TEST_F(EngineTest, RefreshesThatWaitedBehindOneInProgressShareTheNext) {
  Start({kA1}, {kI1});
  const int asked = fakes_->GetLoads(kI1);
  fakes_->HoldGetLoads(kI1, true);
  std::thread first([this] { engine_->RefreshWorkers(); });
  ASSERT_TRUE(fakes_->AwaitHeldGetLoads(kI1, 1, kSafetyNet));  // its check has begun
  std::thread second([this] { engine_->RefreshWorkers(); });
  std::thread third([this] { engine_->RefreshWorkers(); });
  const absl::Time deadline = absl::Now() + kSafetyNet;
  while (engine_->RefreshesWaiting() < 2 && absl::Now() < deadline) std::this_thread::yield();
  EXPECT_EQ(engine_->RefreshesWaiting(), 2);
  fakes_->HoldGetLoads(kI1, false);
  first.join();
  second.join();
  third.join();
  EXPECT_EQ(fakes_->GetLoads(kI1), asked + 2);
  engine_->RefreshWorkers();  // alone: a round of its own
  EXPECT_EQ(fakes_->GetLoads(kI1), asked + 3);
}

// Options of one attention and one indexer worker, without the engine's threads.
CoordinatorOptions OneWorkerOfEach() {
  CoordinatorOptions options;
  options.attention_addresses = {kA1};
  options.indexer_addresses = {kI1};
  options.run_loops = false;
  return options;
}

TEST(EngineCreateTest, NegativeLoadCacheIsRefused) {
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  CoordinatorOptions options = OneWorkerOfEach();
  options.load_cache_ms = -1;
  auto engine = CoordinatorEngine::Create(options, &metrics, std::make_shared<FakeWorkers>());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.status().message(), "load_cache_ms must be >= 0, got -1");
}

TEST(EngineCreateTest, MissingCollaboratorsAreRefused) {
  prometheus::Registry registry;
  CoordinatorMetrics metrics(registry);
  const CoordinatorOptions options = OneWorkerOfEach();
  auto no_workers = CoordinatorEngine::Create(options, &metrics, nullptr);
  EXPECT_EQ(no_workers.status().code(), absl::StatusCode::kInvalidArgument);
  auto no_clock =
      CoordinatorEngine::Create(options, &metrics, std::make_shared<FakeWorkers>(), nullptr);
  EXPECT_EQ(no_clock.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dsa
