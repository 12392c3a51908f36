// The NCCL communicator of one attention-indexer pair (see nccl_link.h): the link's logic, over
// NcclComm.
#include "transport/nccl_link.h"

#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dsa {

std::shared_ptr<NcclLink> NcclLink::Create(std::unique_ptr<NcclComm> comm,
                                           const NcclLinkOptions& options, bool loopback,
                                           int rank) {
  return std::shared_ptr<NcclLink>(new NcclLink(std::move(comm), options, loopback, rank));
}

NcclLink::~NcclLink() {
  std::lock_guard<std::mutex> lock(mutex_);
  AbortLocked(absl::UnavailableError("the NCCL link was destroyed"));
  // Then comm_ goes: the aborted kernels have ended, its stream drains and is freed.
}

bool NcclLink::HoldsLocked(NcclEndpoint endpoint) const {
  return loopback_ || static_cast<int>(endpoint) == rank_;
}

absl::Status NcclLink::status() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return status_;
}

absl::Status NcclLink::PollInProgressLocked(const char* what, absl::Time deadline) {
  // An enqueue in progress usually finishes within microseconds: spin first (a sleep here would
  // cost every operation its length), then back off.
  const absl::Time spin_until = absl::Now() + options_.spin;
  while (true) {
    int state = kNcclSuccess;
    if (int r = comm_->GetAsyncError(&state); r != kNcclSuccess) {
      return comm_->Error("ncclCommGetAsyncError", r);
    }
    if (state == kNcclSuccess) return absl::OkStatus();
    if (state != kNcclInProgress) return comm_->Error(what, state);
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(absl::StrCat(what, " still in progress after ",
                                                 absl::FormatDuration(options_.call_timeout),
                                                 " (the peer did not take part)"));
    }
    if (absl::Now() < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

absl::Status NcclLink::WaitReady(absl::Time deadline) {
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!status_.ok()) return status_;
      if (ready_) return absl::OkStatus();
      int state = kNcclSuccess;
      int r = comm_->GetAsyncError(&state);
      if (r != kNcclSuccess) state = r;
      if (state == kNcclSuccess) {
        ready_ = true;
        return absl::OkStatus();
      }
      if (state != kNcclInProgress) {
        AbortLocked(comm_->Error("joining the NCCL communicator", state));
        return status_;
      }
      if (absl::Now() >= deadline) {
        AbortLocked(absl::UnavailableError(
            "the NCCL communicator did not come up by the deadline (the peer never joined)"));
        return status_;
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

absl::Status NcclLink::IssueLocked(Pending* a, NcclEndpoint endpoint_a, Pending* b) {
  if (absl::Status s = comm_->SetDevice(); !s.ok()) return s;
  Pending* ops[2] = {a, b};
  for (Pending* p : ops) {
    if (p != nullptr && p->op.send && p->op.copy_bytes > 0) {
      if (absl::Status s = comm_->CopyToDevice(p->op.device, p->op.host, p->op.copy_bytes);
          !s.ok()) {
        return s;
      }
    }
  }
  const int peer = loopback_ ? 0 : 1 - rank_;
  const NcclOp* group[2] = {&a->op, b != nullptr ? &b->op : nullptr};
  const int result =
      comm_->SendRecv(std::span<const NcclOp* const>(group, b != nullptr ? 2 : 1), peer);
  if (result == kNcclInProgress) {
    if (absl::Status s =
            PollInProgressLocked("ncclSend/ncclRecv", absl::Now() + options_.call_timeout);
        !s.ok()) {
      return s;
    }
  } else if (result != kNcclSuccess) {
    return comm_->Error("ncclSend/ncclRecv", result);
  }
  for (Pending* p : ops) {
    if (p == nullptr) continue;
    if (!p->op.send && p->op.copy_bytes > 0) {
      if (absl::Status s = comm_->CopyToHost(p->op.host, p->op.device, p->op.copy_bytes); !s.ok()) {
        return s;
      }
    }
    if (p->op.done != nullptr) {
      if (absl::Status s = comm_->RecordEvent(p->op.done); !s.ok()) return s;
    }
  }
  // Ops of one endpoint issue in posting order, so the count is the next sequence number.
  const int ea = static_cast<int>(endpoint_a);
  issued_[ea] = a->seq + 1;
  if (b != nullptr) issued_[1 - ea] = b->seq + 1;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> NcclLink::Post(NcclEndpoint endpoint, const NcclOp& op) {
  if (op.bytes <= 0 || op.device == nullptr || (op.copy_bytes > 0 && op.host == nullptr)) {
    return absl::InvalidArgumentError("an NCCL operation needs a device buffer of > 0 bytes");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!HoldsLocked(endpoint)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this process is rank ", rank_, " of the link, not endpoint ", static_cast<int>(endpoint)));
  }
  if (!status_.ok()) return status_;
  const int e = static_cast<int>(endpoint);
  if (released_[e]) return absl::UnavailableError("the NCCL link endpoint was released");
  if (!ready_) return absl::UnavailableError("the NCCL communicator is not up yet (WaitReady)");
  Pending pending{op, posted_[e]++};
  if (!loopback_) {
    if (absl::Status s = IssueLocked(&pending, endpoint, nullptr); !s.ok()) {
      AbortLocked(s);
      return status_;
    }
    return pending.seq;
  }
  // Loopback: pair with the other endpoint's oldest unmatched op, or wait for it.
  std::deque<Pending>& other = unmatched_[1 - e];
  if (other.empty()) {
    unmatched_[e].push_back(pending);
    return pending.seq;
  }
  Pending match = other.front();
  other.pop_front();
  if (match.op.send == pending.op.send || match.op.bytes != pending.op.bytes) {
    AbortLocked(absl::InternalError(
        absl::StrCat("loopback NCCL link out of step: a ", pending.op.send ? "send" : "receive",
                     " of ", pending.op.bytes, " bytes met a ", match.op.send ? "send" : "receive",
                     " of ", match.op.bytes)));
    return status_;
  }
  if (absl::Status s = IssueLocked(&pending, endpoint, &match); !s.ok()) {
    AbortLocked(s);
    return status_;
  }
  return pending.seq;
}

absl::Status NcclLink::Wait(NcclEndpoint endpoint, uint64_t seq, cudaEvent_t done,
                            absl::Time deadline) {
  const int e = static_cast<int>(endpoint);
  const absl::Time spin_until = absl::Now() + options_.spin;
  while (true) {
    bool issued = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!status_.ok()) return status_;
      issued = issued_[e] > seq;
    }
    if (issued) {
      if (done == nullptr) return absl::OkStatus();
      const absl::StatusOr<bool> completed = comm_->QueryEvent(done);
      if (completed.ok() && *completed) return absl::OkStatus();
      if (!completed.ok()) {
        Abort(completed.status());
        return status();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!status_.ok()) return status_;
      if (comm_open_) {
        int state = kNcclSuccess;
        int r = comm_->GetAsyncError(&state);
        if (r != kNcclSuccess) state = r;
        if (state != kNcclSuccess && state != kNcclInProgress) {
          AbortLocked(comm_->Error("the NCCL communicator failed", state));
          return status_;
        }
      }
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(issued ? "the NCCL operation" : "the peer's matching NCCL operation",
                       " did not complete by the deadline"));
    }
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(options_.poll_interval);
    }
  }
}

void NcclLink::AbortLocked(const absl::Status& reason) {
  if (status_.ok()) {
    status_ =
        reason.code() == absl::StatusCode::kUnavailable
            ? reason
            : absl::UnavailableError(absl::StrCat("NCCL data plane aborted: ", reason.message()));
  }
  if (comm_open_) {
    comm_->Abort();
    comm_open_ = false;
  }
  unmatched_[0].clear();
  unmatched_[1].clear();
}

void NcclLink::Abort(const absl::Status& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  AbortLocked(reason);
}

absl::Status NcclLink::Release(NcclEndpoint endpoint, absl::Time deadline) {
  std::lock_guard<std::mutex> lock(mutex_);
  released_[static_cast<int>(endpoint)] = true;
  const bool all_released = loopback_ ? (released_[0] && released_[1]) : true;
  if (!all_released || !comm_open_) return status_;
  // Finalize flushes what was issued; then destroy. A finalize that does not finish aborts.
  int result = comm_->Finalize();
  absl::Status finalized;
  if (result == kNcclInProgress) {
    finalized = PollInProgressLocked("ncclCommFinalize", deadline);
  } else if (result != kNcclSuccess) {
    finalized = comm_->Error("ncclCommFinalize", result);
  }
  if (!finalized.ok()) {
    AbortLocked(finalized);
    return status_;
  }
  result = comm_->Destroy();
  comm_open_ = false;
  if (result != kNcclSuccess && result != kNcclInProgress) {
    status_ = comm_->Error("ncclCommDestroy", result);
  }
  if (status_.ok()) status_ = absl::UnavailableError("the NCCL link was closed");
  return absl::OkStatus();
}

}  // namespace dsa
