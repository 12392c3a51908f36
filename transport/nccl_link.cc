// The NCCL communicator of one attention-indexer pair (see nccl_link.h).
#include "transport/nccl_link.h"

#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dsa {

absl::Status NcclError(const char* what, ncclResult_t result, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return absl::UnavailableError(absl::StrCat(
      what, ": ", ncclGetErrorString(result), (last != nullptr && last[0] != '\0') ? " (" : "",
      last != nullptr ? last : "", (last != nullptr && last[0] != '\0') ? ")" : ""));
}

absl::Status CudaError(const char* what, cudaError_t error) {
  return absl::UnavailableError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

namespace {

// Creates the high-priority, non-blocking stream of a link on the current device.
absl::Status CreateStream(cudaStream_t* stream) {
  int least = 0, greatest = 0;
  if (cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest); e != cudaSuccess) {
    return CudaError("cudaDeviceGetStreamPriorityRange", e);
  }
  if (cudaError_t e = cudaStreamCreateWithPriority(stream, cudaStreamNonBlocking, greatest);
      e != cudaSuccess) {
    return CudaError("cudaStreamCreateWithPriority", e);
  }
  return absl::OkStatus();
}

ncclConfig_t NonBlockingConfig() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

}  // namespace

absl::StatusOr<std::shared_ptr<NcclLink>> NcclLink::StartTwoRank(const ncclUniqueId& unique_id,
                                                                 int rank,
                                                                 const NcclLinkOptions& options) {
  if (rank != 0 && rank != 1) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of a two-rank link"));
  }
  if (cudaError_t e = cudaSetDevice(options.cuda_device); e != cudaSuccess) {
    return CudaError("cudaSetDevice", e);
  }
  std::shared_ptr<NcclLink> link(new NcclLink(options, /*loopback=*/false));
  link->rank_ = rank;
  if (absl::Status s = CreateStream(&link->stream_); !s.ok()) return s;
  ncclConfig_t config = NonBlockingConfig();
  const ncclResult_t result = ncclCommInitRankConfig(&link->comm_, 2, unique_id, rank, &config);
  if (result != ncclSuccess && result != ncclInProgress) {
    if (link->comm_ != nullptr) ncclCommAbort(link->comm_);
    link->comm_ = nullptr;
    return NcclError("ncclCommInitRankConfig", result);
  }
  return link;
}

absl::StatusOr<std::shared_ptr<NcclLink>> NcclLink::CreateLoopback(const NcclLinkOptions& options) {
  if (cudaError_t e = cudaSetDevice(options.cuda_device); e != cudaSuccess) {
    return CudaError("cudaSetDevice", e);
  }
  std::shared_ptr<NcclLink> link(new NcclLink(options, /*loopback=*/true));
  if (absl::Status s = CreateStream(&link->stream_); !s.ok()) return s;
  ncclUniqueId unique_id;
  if (ncclResult_t r = ncclGetUniqueId(&unique_id); r != ncclSuccess) {
    return NcclError("ncclGetUniqueId", r);
  }
  ncclConfig_t config = NonBlockingConfig();
  const ncclResult_t result = ncclCommInitRankConfig(&link->comm_, 1, unique_id, 0, &config);
  if (result != ncclSuccess && result != ncclInProgress) {
    if (link->comm_ != nullptr) ncclCommAbort(link->comm_);
    link->comm_ = nullptr;
    return NcclError("ncclCommInitRankConfig", result);
  }
  if (absl::Status s = link->WaitReady(absl::Now() + options.call_timeout); !s.ok()) return s;
  return link;
}

NcclLink::~NcclLink() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    AbortLocked(absl::UnavailableError("the NCCL link was destroyed"));
  }
  if (stream_ != nullptr) {
    cudaSetDevice(options_.cuda_device);
    cudaStreamSynchronize(stream_);  // the aborted kernels have ended; copies and events drain
    cudaStreamDestroy(stream_);
  }
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
    ncclResult_t state = ncclSuccess;
    if (ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
      return NcclError("ncclCommGetAsyncError", r, comm_);
    }
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclError(what, state, comm_);
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
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) state = r;
      if (state == ncclSuccess) {
        ready_ = true;
        return absl::OkStatus();
      }
      if (state != ncclInProgress) {
        AbortLocked(NcclError("joining the NCCL communicator", state, comm_));
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
  if (cudaError_t e = cudaSetDevice(options_.cuda_device); e != cudaSuccess) {
    return CudaError("cudaSetDevice", e);
  }
  Pending* ops[2] = {a, b};
  for (Pending* p : ops) {
    if (p != nullptr && p->op.send && p->op.copy_bytes > 0) {
      if (cudaError_t e = cudaMemcpyAsync(p->op.device, p->op.host, p->op.copy_bytes,
                                          cudaMemcpyHostToDevice, stream_);
          e != cudaSuccess) {
        return CudaError("cudaMemcpyAsync (to the send buffer)", e);
      }
    }
  }
  const int peer = loopback_ ? 0 : 1 - rank_;
  ncclResult_t result = ncclGroupStart();
  for (Pending* p : ops) {
    if (p == nullptr || result != ncclSuccess) continue;
    result = p->op.send ? ncclSend(p->op.device, p->op.bytes, ncclUint8, peer, comm_, stream_)
                        : ncclRecv(p->op.device, p->op.bytes, ncclUint8, peer, comm_, stream_);
  }
  const ncclResult_t ended = ncclGroupEnd();
  if (result == ncclSuccess || result == ncclInProgress) result = ended;
  if (result == ncclInProgress) {
    if (absl::Status s =
            PollInProgressLocked("ncclSend/ncclRecv", absl::Now() + options_.call_timeout);
        !s.ok()) {
      return s;
    }
  } else if (result != ncclSuccess) {
    return NcclError("ncclSend/ncclRecv", result, comm_);
  }
  for (Pending* p : ops) {
    if (p == nullptr) continue;
    if (!p->op.send && p->op.copy_bytes > 0) {
      if (cudaError_t e = cudaMemcpyAsync(p->op.host, p->op.device, p->op.copy_bytes,
                                          cudaMemcpyDeviceToHost, stream_);
          e != cudaSuccess) {
        return CudaError("cudaMemcpyAsync (from the receive buffer)", e);
      }
    }
    if (p->op.done != nullptr) {
      if (cudaError_t e = cudaEventRecord(p->op.done, stream_); e != cudaSuccess) {
        return CudaError("cudaEventRecord", e);
      }
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
      const cudaError_t query = cudaEventQuery(done);
      if (query == cudaSuccess) return absl::OkStatus();
      if (query != cudaErrorNotReady) {
        Abort(CudaError("cudaEventQuery", query));
        return status();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!status_.ok()) return status_;
      if (comm_ != nullptr) {
        ncclResult_t state = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
        if (r != ncclSuccess) state = r;
        if (state != ncclSuccess && state != ncclInProgress) {
          AbortLocked(NcclError("the NCCL communicator failed", state, comm_));
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
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
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
  if (!all_released || comm_ == nullptr) return status_;
  // Finalize flushes what was issued; then destroy. A finalize that does not finish aborts.
  ncclResult_t result = ncclCommFinalize(comm_);
  absl::Status finalized;
  if (result == ncclInProgress) {
    finalized = PollInProgressLocked("ncclCommFinalize", deadline);
  } else if (result != ncclSuccess) {
    finalized = NcclError("ncclCommFinalize", result, comm_);
  }
  if (!finalized.ok()) {
    AbortLocked(finalized);
    return status_;
  }
  result = ncclCommDestroy(comm_);
  comm_ = nullptr;
  if (result != ncclSuccess && result != ncclInProgress) {
    status_ = NcclError("ncclCommDestroy", result);
  }
  if (status_.ok()) status_ = absl::UnavailableError("the NCCL link was closed");
  return absl::OkStatus();
}

NcclStagingBuffer::~NcclStagingBuffer() {
  Free(data_);
  for (uint8_t* block : retired_) Free(block);
}

void NcclStagingBuffer::Free(uint8_t* block) const {
  if (block == nullptr) return;
  if (kind_ == Kind::kHost) {
    cudaFreeHost(block);
  } else {
    cudaFree(block);
  }
}

absl::Status NcclStagingBuffer::Reserve(int64_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  int64_t capacity = 4096;
  while (capacity < bytes) capacity *= 2;
  void* block = nullptr;
  const cudaError_t e =
      kind_ == Kind::kHost ? cudaMallocHost(&block, capacity) : cudaMalloc(&block, capacity);
  if (e != cudaSuccess) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate ", capacity, " bytes of ", kind_ == Kind::kHost ? "pinned host" : "device",
        " staging memory: ", cudaGetErrorString(e)));
  }
  if (data_ != nullptr) retired_.push_back(data_);
  data_ = static_cast<uint8_t*>(block);
  capacity_ = capacity;
  return absl::OkStatus();
}

}  // namespace dsa
