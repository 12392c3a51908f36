// Tests of NcclLink's logic over a CPU fake of its NCCL and CUDA calls (NcclComm), so that they run
// without a GPU or NCCL: the join and its deadline, posting order and the peer of each operation,
// loopback pairing, Wait's deadline (the operation stays posted), a call in progress past
// call_timeout, a lost peer (the communicator's async error, a CUDA error) aborting the link for
// every later call, Release (finalize and destroy, or abort), Abort's first reason, destruction.
// The fake's communicator changes state at a counted poll, never by time, so every case is
// deterministic.
#include "transport/nccl_link.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dsa {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
constexpr int kNcclRemoteError = 6;  // ncclRemoteError: the peer went away
constexpr int kPollsSpent = 99;      // the fake's own: FakeState::max_polls passed

// What the fake answers and what it was asked, shared with the test (the link owns the fake).
struct FakeState {
  std::mutex mutex;
  // The communicator's state as ncclCommGetAsyncError reports it; from poll `change_at_poll` on
  // (1-based, 0: never), `changed_state`.
  int async_state = kNcclSuccess;
  int change_at_poll = 0;
  int changed_state = kNcclSuccess;
  int polls = 0;
  // Past this many polls the communicator fails (kPollsSpent): a link that polls on where it should
  // have stopped (a deadline passed) ends instead of hanging the test. Working cases poll <= 3.
  int max_polls = 1000;
  int send_recv_result = kNcclSuccess;
  int finalize_result = kNcclSuccess;
  int destroy_result = kNcclSuccess;
  // Events complete at their `complete_at_query`-th QueryEvent (1-based; absent: never).
  std::map<cudaEvent_t, int> complete_at_query;
  std::map<cudaEvent_t, int> queries;
  absl::Status query_error;  // QueryEvent's answer when set
  std::vector<std::string> calls;
};

class FakeNcclComm final : public NcclComm {
 public:
  explicit FakeNcclComm(std::shared_ptr<FakeState> state) : state_(std::move(state)) {}
  ~FakeNcclComm() override { Record("~"); }

  int GetAsyncError(int* state) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    ++state_->polls;
    if (state_->change_at_poll > 0 && state_->polls >= state_->change_at_poll) {
      state_->async_state = state_->changed_state;
    }
    *state = state_->polls > state_->max_polls ? kPollsSpent : state_->async_state;
    return kNcclSuccess;
  }
  int SendRecv(std::span<const NcclOp* const> ops, int peer) override {
    std::string call = "SendRecv";
    for (const NcclOp* op : ops) absl::StrAppend(&call, op->send ? " send " : " recv ", op->bytes);
    absl::StrAppend(&call, " peer ", peer);
    Record(call);
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->send_recv_result;
  }
  int Finalize() override {
    Record("Finalize");
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->finalize_result;
  }
  int Destroy() override {
    Record("Destroy");
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->destroy_result;
  }
  void Abort() override { Record("Abort"); }
  absl::Status Error(const char* what, int result) override {
    return absl::UnavailableError(absl::StrCat(what, ": NCCL error ", result));
  }
  absl::Status SetDevice() override {
    Record("SetDevice");
    return absl::OkStatus();
  }
  absl::Status CopyToDevice(void* device, const void* host, int64_t bytes) override {
    Record(absl::StrCat("CopyToDevice ", bytes));
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* host, const void* device, int64_t bytes) override {
    Record(absl::StrCat("CopyToHost ", bytes));
    return absl::OkStatus();
  }
  absl::Status RecordEvent(cudaEvent_t event) override {
    Record("RecordEvent");
    return absl::OkStatus();
  }
  absl::StatusOr<bool> QueryEvent(cudaEvent_t event) override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->query_error.ok()) return state_->query_error;
    const int queries = ++state_->queries[event];
    auto it = state_->complete_at_query.find(event);
    return it != state_->complete_at_query.end() && queries >= it->second;
  }
  cudaStream_t stream() const override { return nullptr; }

 private:
  void Record(std::string call) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->calls.push_back(std::move(call));
  }
  std::shared_ptr<FakeState> state_;
};

// Two distinct event handles (never dereferenced: the fake only compares them).
int event_storage[2];
const cudaEvent_t kEventA = reinterpret_cast<cudaEvent_t>(&event_storage[0]);
const cudaEvent_t kEventB = reinterpret_cast<cudaEvent_t>(&event_storage[1]);
char device_buffer[256];
char host_buffer[256];

NcclOp Send(int64_t bytes, cudaEvent_t done = nullptr, int64_t copy_bytes = 0) {
  return {.send = true,
          .device = device_buffer,
          .bytes = bytes,
          .host = host_buffer,
          .copy_bytes = copy_bytes,
          .done = done};
}
NcclOp Recv(int64_t bytes, cudaEvent_t done = nullptr, int64_t copy_bytes = 0) {
  NcclOp op = Send(bytes, done, copy_bytes);
  op.send = false;
  return op;
}

// A deadline a broken link would run into instead of hanging the test (the fake's state changes
// at counted polls, so a working link never waits for it).
absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

class NcclLinkTest : public ::testing::Test {
 protected:
  // A link over a fresh fake, joined unless `join` is false: two ranks as `rank`, or loopback.
  std::shared_ptr<NcclLink> MakeLink(bool loopback, int rank = 0, bool join = true) {
    state_ = std::make_shared<FakeState>();
    auto link = NcclLink::Create(std::make_unique<FakeNcclComm>(state_), options_, loopback, rank);
    if (join) {
      EXPECT_TRUE(link->WaitReady(Soon()).ok());
    }
    Calls().clear();
    return link;
  }

  std::vector<std::string>& Calls() { return state_->calls; }
  int Count(const std::string& call) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return static_cast<int>(std::count(state_->calls.begin(), state_->calls.end(), call));
  }

  NcclLinkOptions options_{.spin = absl::ZeroDuration(), .poll_interval = absl::Microseconds(1)};
  std::shared_ptr<FakeState> state_;
};

TEST_F(NcclLinkTest, WaitReadyPollsUntilThePeerJoined) {
  auto link = MakeLink(/*loopback=*/false, 0, /*join=*/false);
  state_->async_state = kNcclInProgress;
  state_->change_at_poll = 3;  // both ranks joined at the third look
  EXPECT_EQ(link->Post(NcclEndpoint::kAttention, Send(64)).status().code(),
            absl::StatusCode::kUnavailable);  // not up yet: nothing issued
  EXPECT_TRUE(link->WaitReady(Soon()).ok());
  EXPECT_EQ(state_->polls, 3);
  EXPECT_TRUE(link->WaitReady(absl::InfinitePast()).ok());  // ready stays ready
  EXPECT_EQ(Count("Abort"), 0);
  EXPECT_THAT(Calls(), ElementsAre());
}

TEST_F(NcclLinkTest, APeerThatNeverJoinsAbortsTheLinkAtTheDeadline) {
  auto link = MakeLink(/*loopback=*/false, 0, /*join=*/false);
  state_->async_state = kNcclInProgress;
  const absl::Status ready = link->WaitReady(absl::InfinitePast());
  EXPECT_EQ(ready.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(ready.message(), HasSubstr("did not come up by the deadline"));
  EXPECT_EQ(link->status(), ready);
  EXPECT_EQ(link->Post(NcclEndpoint::kAttention, Send(64)).status(), ready);
  EXPECT_EQ(link->Release(NcclEndpoint::kAttention, Soon()), ready);
  EXPECT_THAT(Calls(), ElementsAre("Abort"));  // aborted once; never finalized
}

TEST_F(NcclLinkTest, AJoinThatFailsAbortsTheLink) {
  auto link = MakeLink(/*loopback=*/false, 1, /*join=*/false);
  state_->async_state = kNcclRemoteError;
  const absl::Status ready = link->WaitReady(Soon());
  EXPECT_EQ(ready, absl::UnavailableError("joining the NCCL communicator: NCCL error 6"));
  EXPECT_THAT(Calls(), ElementsAre("Abort"));
}

TEST_F(NcclLinkTest, TwoRankOperationsIssueAtOnceInOrderToThePeer) {
  auto link = MakeLink(/*loopback=*/false, /*rank=*/1);  // the indexer
  EXPECT_EQ(link->Post(NcclEndpoint::kAttention, Send(64)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(link->Post(NcclEndpoint::kIndexer, Send(0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto sent = link->Post(NcclEndpoint::kIndexer, Send(64, kEventA, /*copy_bytes=*/80));
  auto received = link->Post(NcclEndpoint::kIndexer, Recv(32, kEventB, /*copy_bytes=*/32));
  ASSERT_TRUE(sent.ok() && received.ok());
  EXPECT_EQ(*sent, 0u);
  EXPECT_EQ(*received, 1u);
  // A send's staging copy goes before it, a receive's after it; each event last; peer rank 0.
  EXPECT_THAT(Calls(),
              ElementsAre("SetDevice", "CopyToDevice 80", "SendRecv send 64 peer 0", "RecordEvent",
                          "SetDevice", "SendRecv recv 32 peer 0", "CopyToHost 32", "RecordEvent"));
  EXPECT_TRUE(link->Wait(NcclEndpoint::kIndexer, 1, nullptr, absl::InfinitePast()).ok());
}

TEST_F(NcclLinkTest, AWaitPastItsDeadlineLeavesTheOperationPosted) {
  auto link = MakeLink(/*loopback=*/false, 0);
  auto seq = link->Post(NcclEndpoint::kAttention, Send(64, kEventA));
  ASSERT_TRUE(seq.ok());
  const absl::Status late =
      link->Wait(NcclEndpoint::kAttention, *seq, kEventA, absl::InfinitePast());
  EXPECT_EQ(late,
            absl::DeadlineExceededError("the NCCL operation did not complete by the deadline"));
  EXPECT_TRUE(link->status().ok());
  EXPECT_EQ(Count("Abort"), 0);
  // The event completes at its third look: waited for again, the operation is done.
  state_->complete_at_query[kEventA] = 3;
  EXPECT_TRUE(link->Wait(NcclEndpoint::kAttention, *seq, kEventA, Soon()).ok());
  EXPECT_EQ(state_->queries[kEventA], 3);
  EXPECT_EQ(Count("Abort"), 0);
}

TEST_F(NcclLinkTest, ACallStillInProgressPastTheCallTimeoutAbortsTheLink) {
  options_.call_timeout = absl::ZeroDuration();
  auto link = MakeLink(/*loopback=*/false, 0);
  state_->send_recv_result = kNcclInProgress;
  state_->async_state = kNcclInProgress;  // the peer never takes part
  const absl::Status posted = link->Post(NcclEndpoint::kAttention, Send(64, kEventA)).status();
  EXPECT_EQ(posted,
            absl::UnavailableError(
                "ncclSend/ncclRecv still in progress after 0 (the peer did not take part)"));
  EXPECT_EQ(Count("Abort"), 1);
  EXPECT_EQ(Count("RecordEvent"), 0);  // never issued
  EXPECT_EQ(link->Wait(NcclEndpoint::kAttention, 0, kEventA, Soon()), posted);
  EXPECT_EQ(link->Post(NcclEndpoint::kAttention, Send(64)).status(), posted);
  EXPECT_EQ(Count("Abort"), 1);
}

TEST_F(NcclLinkTest, ACallInProgressThatFinishesInTimeIsIssued) {
  auto link = MakeLink(/*loopback=*/false, 0);
  state_->send_recv_result = kNcclInProgress;
  state_->async_state = kNcclInProgress;
  state_->polls = 0;
  state_->change_at_poll = 2;  // the enqueue finishes at the second look
  state_->changed_state = kNcclSuccess;
  auto seq = link->Post(NcclEndpoint::kAttention, Send(64, kEventA));
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(state_->polls, 2);
  EXPECT_EQ(Count("RecordEvent"), 1);
}

TEST_F(NcclLinkTest, APeerLostDuringAWaitAbortsTheLinkForEveryLaterCall) {
  auto link = MakeLink(/*loopback=*/false, 0);
  auto seq = link->Post(NcclEndpoint::kAttention, Recv(64, kEventA));
  ASSERT_TRUE(seq.ok());
  // The event never completes; the communicator reports the peer gone at the third poll.
  state_->polls = 0;
  state_->change_at_poll = 3;
  state_->changed_state = kNcclRemoteError;
  const absl::Status lost = link->Wait(NcclEndpoint::kAttention, *seq, kEventA, Soon());
  EXPECT_EQ(lost, absl::UnavailableError("the NCCL communicator failed: NCCL error 6"));
  EXPECT_EQ(state_->polls, 3);
  EXPECT_EQ(link->status(), lost);
  EXPECT_EQ(link->Post(NcclEndpoint::kAttention, Send(64)).status(), lost);
  EXPECT_EQ(link->Wait(NcclEndpoint::kAttention, *seq, kEventA, Soon()), lost);
  EXPECT_EQ(link->Release(NcclEndpoint::kAttention, Soon()), lost);
  EXPECT_EQ(Count("Abort"), 1);
  EXPECT_EQ(Count("Finalize"), 0);
}

TEST_F(NcclLinkTest, ACudaErrorOnTheEventAbortsTheLink) {
  auto link = MakeLink(/*loopback=*/false, 0);
  auto seq = link->Post(NcclEndpoint::kAttention, Send(64, kEventA));
  ASSERT_TRUE(seq.ok());
  state_->query_error = absl::UnavailableError("cudaEventQuery: an illegal memory access");
  EXPECT_EQ(link->Wait(NcclEndpoint::kAttention, *seq, kEventA, Soon()), state_->query_error);
  EXPECT_EQ(link->status(), state_->query_error);
  EXPECT_EQ(Count("Abort"), 1);
}

TEST_F(NcclLinkTest, LoopbackPairsEachOperationWithTheOtherEndpointsMatch) {
  auto link = MakeLink(/*loopback=*/true);
  auto sent = link->Post(NcclEndpoint::kAttention, Send(64, kEventA));
  ASSERT_TRUE(sent.ok());
  EXPECT_THAT(Calls(), ElementsAre());  // waits for the indexer's receive
  EXPECT_EQ(link->Wait(NcclEndpoint::kAttention, *sent, kEventA, absl::InfinitePast()),
            absl::DeadlineExceededError(
                "the peer's matching NCCL operation did not complete by the deadline"));
  auto received = link->Post(NcclEndpoint::kIndexer, Recv(64, kEventB));
  ASSERT_TRUE(received.ok());
  EXPECT_THAT(Calls(), ElementsAre("SetDevice", "SendRecv recv 64 send 64 peer 0", "RecordEvent",
                                   "RecordEvent"));
  state_->complete_at_query[kEventA] = 1;
  state_->complete_at_query[kEventB] = 1;
  EXPECT_TRUE(link->Wait(NcclEndpoint::kAttention, *sent, kEventA, absl::InfinitePast()).ok());
  EXPECT_TRUE(link->Wait(NcclEndpoint::kIndexer, *received, kEventB, absl::InfinitePast()).ok());
}

TEST_F(NcclLinkTest, LoopbackSidesOutOfStepAbortTheLink) {
  auto link = MakeLink(/*loopback=*/true);
  ASSERT_TRUE(link->Post(NcclEndpoint::kAttention, Send(64)).ok());
  const absl::Status out_of_step = link->Post(NcclEndpoint::kIndexer, Send(64)).status();
  EXPECT_EQ(out_of_step, absl::UnavailableError("NCCL data plane aborted: loopback NCCL link out "
                                                "of step: a send of 64 bytes met a send of 64"));
  EXPECT_THAT(Calls(), ElementsAre("Abort"));
}

TEST_F(NcclLinkTest, ReleaseFinalizesAndDestroysTheCommunicator) {
  auto link = MakeLink(/*loopback=*/false, 0);
  state_->polls = 0;
  state_->async_state = kNcclInProgress;  // the finalize flushes for two looks
  state_->change_at_poll = 3;
  state_->changed_state = kNcclSuccess;
  state_->finalize_result = kNcclInProgress;
  EXPECT_TRUE(link->Release(NcclEndpoint::kAttention, Soon()).ok());
  EXPECT_EQ(state_->polls, 3);
  EXPECT_THAT(Calls(), ElementsAre("Finalize", "Destroy"));
  const absl::Status closed = absl::UnavailableError("the NCCL link was closed");
  EXPECT_EQ(link->status(), closed);
  EXPECT_EQ(link->Post(NcclEndpoint::kAttention, Send(64)).status(), closed);
  EXPECT_EQ(link->Release(NcclEndpoint::kAttention, Soon()), closed);
  link.reset();  // closed: nothing left to abort
  EXPECT_THAT(Calls(), ElementsAre("Finalize", "Destroy", "~"));
}

TEST_F(NcclLinkTest, AFinalizePastItsDeadlineAbortsInstead) {
  auto link = MakeLink(/*loopback=*/false, 0);
  state_->async_state = kNcclInProgress;
  state_->finalize_result = kNcclInProgress;
  const absl::Status released = link->Release(NcclEndpoint::kAttention, absl::InfinitePast());
  EXPECT_EQ(released.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(released.message(), HasSubstr("ncclCommFinalize still in progress"));
  EXPECT_EQ(link->status(), released);
  EXPECT_THAT(Calls(), ElementsAre("Finalize", "Abort"));
}

TEST_F(NcclLinkTest, LoopbackReleasesTheCommunicatorWithItsLastEndpoint) {
  auto link = MakeLink(/*loopback=*/true);
  EXPECT_TRUE(link->Release(NcclEndpoint::kAttention, Soon()).ok());
  EXPECT_THAT(Calls(), ElementsAre());
  EXPECT_EQ(link->Post(NcclEndpoint::kAttention, Send(64)).status(),
            absl::UnavailableError("the NCCL link endpoint was released"));
  EXPECT_TRUE(link->Post(NcclEndpoint::kIndexer, Recv(64)).ok());  // the other still posts
  EXPECT_TRUE(link->Release(NcclEndpoint::kIndexer, Soon()).ok());
  EXPECT_THAT(Calls(), ElementsAre("Finalize", "Destroy"));
}

TEST_F(NcclLinkTest, AbortKeepsItsFirstReasonAndAbortsOnce) {
  auto link = MakeLink(/*loopback=*/false, 0);
  link->Abort(absl::CancelledError("the server was stopped"));
  link->Abort(absl::UnavailableError("a later reason"));
  const absl::Status aborted =
      absl::UnavailableError("NCCL data plane aborted: the server was stopped");
  EXPECT_EQ(link->status(), aborted);
  EXPECT_EQ(link->Post(NcclEndpoint::kAttention, Send(64)).status(), aborted);
  EXPECT_EQ(link->WaitReady(Soon()), aborted);
  link.reset();
  EXPECT_THAT(Calls(), ElementsAre("Abort", "~"));
}

TEST_F(NcclLinkTest, DestroyingAnOpenLinkAbortsItsCommunicatorFirst) {
  auto link = MakeLink(/*loopback=*/true);
  ASSERT_TRUE(link->Post(NcclEndpoint::kAttention, Send(64)).ok());  // left unmatched
  link.reset();
  EXPECT_THAT(Calls(), ElementsAre("Abort", "~"));
}

}  // namespace
}  // namespace dsa
