// Fair admission and tenant scoping in CoordinatorEngine over in-memory workers and a FakeClock
// (engine_fixture.h): a flooding caller is held to its queued and running shares and does not
// delay another caller's request behind its own, weights shape the order of admissions, and a
// caller neither continues another's session nor shares another's prefix (docs/reliability.md,
// "Fair admission"). Callers are TenantIdentity strings, as the gRPC adapter passes them.
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "coordinator/engine.h"
#include "tests/coordinator/engine_fixture.h"

namespace dsa {
namespace {

// The fixture's names: EngineTest, Call, Request, kA1.., cv1, FakeWorkers.
using namespace ::dsa::engine_testing;  // NOLINT(google-build-using-namespace)

constexpr char kAlice[] = "peer:10.1.0.1";
constexpr char kBob[] = "peer:10.1.0.2";

class FairnessTest : public EngineTest {
 protected:
  // Waits until `count` requests are queued (a handler thread reached Submit), bounded.
  bool AwaitQueued(int count) {
    const absl::Time until = absl::Now() + kSafetyNet;
    while (absl::Now() < until) {
      if (GetLoad().queued() >= count) return true;
      std::this_thread::yield();
    }
    return false;
  }
  // Whether `call` has been admitted (its Admitted event written), waiting for its handler.
  static bool Admitted(Call& call) { return !call.stream.events().empty(); }
};

// A flood from alice (both running slots and her whole queued share) does not hold bob's request
// behind hers: her further request is refused, naming her own limit and nothing of bob's, bob's is
// queued, and when a slot frees bob's is admitted before alice's earlier-queued ones.
TEST_F(FairnessTest, AnotherCallersRequestIsAdmittedBeforeAFloodsQueuedOnes) {
  options_.max_running_per_attention = 2;
  options_.max_running_per_caller = 0;  // the order of the queue alone
  options_.max_queued_per_caller = 4;
  Start({kA1}, {kI1});
  Call* first = Generate(Request("a0", 10, 1), kAlice);  // ends at the first step
  Generate(Request("a1", 10, 100), kAlice);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 2, kSafetyNet));
  std::vector<Call*> queued;
  for (int i = 0; i < 4; ++i) {
    queued.push_back(Generate(Request("a" + std::to_string(i + 2), 10, 1), kAlice));
    ASSERT_TRUE(AwaitQueued(i + 1));
  }
  Call* refused = Generate(Request("a6", 10, 1), kAlice);
  refused->Join();
  EXPECT_EQ(refused->status.code(), absl::StatusCode::kResourceExhausted) << refused->status;
  EXPECT_EQ(refused->status.message(),
            "caller 'peer:10.1.0.1' has 4 requests queued, its limit (--max-queued-per-caller 4); "
            "retry when one of them is admitted");
  Call* bob = Generate(Request("b0", 10, 1), kBob);
  ASSERT_TRUE(AwaitQueued(5));  // queued, not refused: alice's share is hers alone
  EXPECT_FALSE(bob->returned.load());

  ASSERT_EQ(*engine_->StepWorker(kA1), 2);  // a0 finishes: one slot frees
  first->Join();
  ASSERT_TRUE(first->status.ok()) << first->status;
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 2, kSafetyNet));
  ASSERT_TRUE(bob->stream.AwaitEvents(1));
  EXPECT_EQ(GetLoad().queued(), 4);
  for (Call* call : queued) EXPECT_FALSE(Admitted(*call));
}

// Weights 2:1: while both wait, alice (weight 2) is admitted twice for each of bob's (weight 1).
TEST_F(FairnessTest, WeightsShareAdmissionsInTheirRatio) {
  options_.max_running_per_attention = 1;
  options_.max_running_per_caller = 0;
  options_.caller_weights = {{kAlice, 2}};
  Start({kA1}, {kI1});
  Call* holder = Generate(Request("hold", 10, 1), "peer:10.1.0.9");
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  std::vector<std::pair<char, Call*>> waiting;
  for (int i = 0; i < 4; ++i) {
    waiting.emplace_back('a', Generate(Request("a" + std::to_string(i), 10, 1), kAlice));
    ASSERT_TRUE(AwaitQueued(static_cast<int>(waiting.size())));
  }
  for (int i = 0; i < 4; ++i) {
    waiting.emplace_back('b', Generate(Request("b" + std::to_string(i), 10, 1), kBob));
    ASSERT_TRUE(AwaitQueued(static_cast<int>(waiting.size())));
  }
  // Each step ends the running request (one token), which admits the next.
  std::string order;
  Call* running = holder;
  for (size_t n = 0; n < waiting.size(); ++n) {
    ASSERT_EQ(*engine_->StepWorker(kA1), 1);
    running->Join();
    ASSERT_TRUE(running->status.ok()) << running->status;
    ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
    // Decoding before its handler has written Admitted: wait for that write.
    running = nullptr;
    for (const absl::Time until = absl::Now() + kSafetyNet;
         running == nullptr && absl::Now() < until;) {
      for (auto& [who, call] : waiting) {
        if (call != nullptr && Admitted(*call)) {
          order.push_back(who);
          running = call;
          call = nullptr;
        }
      }
      std::this_thread::yield();
    }
    ASSERT_NE(running, nullptr) << order;
  }
  StepUntilFinished(kA1, *running);
  // Start tags: alice 0, 0.5, 1, 1.5; bob 0, 1, 2, 3 (ties to the earlier arrival).
  EXPECT_EQ(order, "abaababb");
}

// With the default running share (-1: the slots less a quarter), a caller cannot take every
// running slot: alice's fourth of 4 slots waits, and bob's request runs at once beside hers.
TEST_F(FairnessTest, TheDefaultRunningShareLeavesASlotToOthers) {
  options_.max_running_per_attention = 4;
  Start({kA1}, {kI1});
  for (int i = 0; i < 4; ++i) Generate(Request("a" + std::to_string(i), 10, 50), kAlice);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 3, kSafetyNet));
  ASSERT_TRUE(AwaitQueued(1));
  Call* bob = Generate(Request("b0", 10, 50), kBob);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 4, kSafetyNet));
  ASSERT_TRUE(bob->stream.AwaitEvents(1));
  EXPECT_EQ(GetLoad().queued(), 1);  // alice's fourth, at her share of 3
  EXPECT_EQ(GetLoad().running(), 4);
}

// Another peer that names alice's session neither continues it nor learns its length: it gets a
// session of its own (no "holds N slots"), and alice's stays whole.
TEST_F(FairnessTest, APeerCannotContinueOrMeasureAnotherPeersSession) {
  options_.retain_finished = true;
  Start({kA1}, {kI1});
  GenerateSpec turn = Request("r1", 20, 2);
  turn.session_id = "chat";
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(turn, kA1, kAlice));
  GenerateSpec probe = Request("r2", 5, 2);  // shorter than alice's 22 slots
  probe.session_id = "chat";
  Call* call = Generate(probe, kBob);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  StepUntilFinished(kA1, *call);
  call->Join();
  ASSERT_TRUE(call->status.ok()) << call->status;
  EXPECT_FALSE(absl::StrContains(call->status.message(), "slots"));
  EXPECT_EQ(GetLoad().retained_sequences(), 2);
  GenerateSpec next = Request("r3", 21, 2);
  next.session_id = "chat";
  Call* mine = Generate(next, kAlice);
  mine->Join();
  EXPECT_EQ(mine->status.code(), absl::StatusCode::kInvalidArgument) << mine->status;
  EXPECT_TRUE(absl::StrContains(mine->status.message(), "holds 22 slots")) << mine->status;
}

// A prefix is shared only with a donor of the same caller: bob, sending alice's prefix id, is told
// prefix_slots_reused 0 (nothing of what alice sent); alice's own next request reuses it.
TEST_F(FairnessTest, APrefixIsSharedOnlyWithTheSameCallersDonor) {
  options_.retain_finished = true;
  Start({kA1}, {kI1});
  GenerateSpec request = Request("r1", 600, 2);
  request.prefix_block_ids = {42, 43};
  ASSERT_NO_FATAL_FAILURE(RunToCompletion(request, kA1, kAlice));
  request.request_id = "r2";
  Call* bob = Generate(request, kBob);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  StepUntilFinished(kA1, *bob);
  bob->Join();
  ASSERT_TRUE(bob->status.ok()) << bob->status;
  EXPECT_EQ(bob->admitted().prefix_slots_reused(), 0);
  request.request_id = "r3";
  Call* alice = Generate(request, kAlice);
  ASSERT_TRUE(engine_->AwaitDecoding(kA1, 1, kSafetyNet));
  StepUntilFinished(kA1, *alice);
  alice->Join();
  ASSERT_TRUE(alice->status.ok()) << alice->status;
  EXPECT_EQ(alice->admitted().prefix_slots_reused(), 512);
}

}  // namespace
}  // namespace dsa
