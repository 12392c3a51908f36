// The NCCL communicator of one attention-indexer pair and the CUDA stream its point-to-point
// operations run on, shared by NcclSelectionTransport (attention side) and NcclSelectionServer
// (indexer side). Two modes with one interface:
// - two ranks (the deployment): attention is rank 0, indexer rank 1, one process each; every
//   posted operation is issued at once as its own ncclSend or ncclRecv;
// - loopback (one GPU, one process): a one-rank communicator with both endpoints in this process;
//   an operation waits until the other endpoint posts its match, then the pair is issued as one
//   self send/recv group. The transport and the server run the same code in both modes.
// The communicator is non-blocking (ncclConfig_t.blocking = 0): no call can hang on a lost peer;
// waits poll CUDA events and ncclCommGetAsyncError, and ncclCommAbort ends everything.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace dsa {

/// How a link is created and how it polls.
struct NcclLinkOptions {
  int cuda_device = 0;  // this side's GPU (CUDA ordinal)
  /// A wait polls its event without sleeping (yielding the core) for this long, then sleeps
  /// poll_interval between polls: a layer's answer is usually back within the spin.
  absl::Duration spin = absl::Milliseconds(2);
  absl::Duration poll_interval = absl::Microseconds(20);
  /// Bound on one NCCL call that returned ncclInProgress (the first operation to the peer connects
  /// to it); past it the link is aborted (UNAVAILABLE).
  absl::Duration call_timeout = absl::Seconds(30);
};

/// The two ends of a link. Two ranks: rank 0 is kAttention, rank 1 kIndexer (each process uses
/// its own); loopback: both in one process.
enum class NcclEndpoint { kAttention = 0, kIndexer = 1 };

/// One point-to-point operation, with its staging copy. Buffers stay valid and untouched until
/// the operation completed (Wait OK) or the link was released or aborted.
struct NcclOp {
  bool send = true;
  void* device = nullptr;  // device memory, `bytes` bytes: sent from, or received into
  int64_t bytes = 0;       // > 0; a send and its receive have the same size
  /// Pinned host memory (cudaMallocHost): copy_bytes are copied to `device` before a send, or from
  /// it after a receive, on the link's stream. copy_bytes 0: no copy. copy_bytes may pass `bytes`
  /// when the device region also holds later operations' buffers (one copy stages a message's
  /// header and payload).
  void* host = nullptr;
  int64_t copy_bytes = 0;
  /// Recorded on the link's stream after the operation and its copy (may be null).
  cudaEvent_t done = nullptr;
};

/// Thread-safe: every NCCL call is made under one mutex (a communicator is not thread-safe).
class NcclLink {
 public:
  /// Starts joining a two-rank communicator as `rank` (0 attention, 1 indexer) on
  /// options.cuda_device and returns at once; WaitReady tells when both ranks joined.
  /// INVALID_ARGUMENT (rank), UNAVAILABLE (CUDA or NCCL refused).
  static absl::StatusOr<std::shared_ptr<NcclLink>> StartTwoRank(const ncclUniqueId& unique_id,
                                                                int rank,
                                                                const NcclLinkOptions& options);
  /// A one-rank communicator with both endpoints here, ready when returned. UNAVAILABLE.
  static absl::StatusOr<std::shared_ptr<NcclLink>> CreateLoopback(const NcclLinkOptions& options);

  /// Aborts the communicator if it is still open (bounded), then frees the stream.
  ~NcclLink();
  NcclLink(const NcclLink&) = delete;
  NcclLink& operator=(const NcclLink&) = delete;

  /// Waits until the communicator is initialized. UNAVAILABLE (and the link aborted) on an NCCL
  /// error or when `deadline` passes first (the peer never joined).
  absl::Status WaitReady(absl::Time deadline);

  /// Posts `op` on `endpoint`; operations of one endpoint are issued in posting order. Returns its
  /// sequence number on that endpoint (for Wait). UNAVAILABLE once aborted or released (the
  /// message says why); FAILED_PRECONDITION for an endpoint this process does not hold;
  /// INVALID_ARGUMENT for an empty op. Loopback: INTERNAL (and the link aborted) when the matched
  /// pair is not a send and a receive of one size (the two sides are out of step).
  absl::StatusOr<uint64_t> Post(NcclEndpoint endpoint, const NcclOp& op);

  /// Waits until operation `seq` of `endpoint` (posted with event `done`) completed: polls the
  /// event and ncclCommGetAsyncError. DEADLINE_EXCEEDED at `deadline` (the operation stays
  /// posted: wait again, or abort); UNAVAILABLE when the link is or gets aborted (an NCCL or CUDA
  /// error aborts it here).
  absl::Status Wait(NcclEndpoint endpoint, uint64_t seq, cudaEvent_t done, absl::Time deadline);

  /// Aborts the communicator (ncclCommAbort): operations in flight end, every later Post and Wait
  /// answers UNAVAILABLE with `reason`. Idempotent (the first reason stays).
  void Abort(const absl::Status& reason);

  /// `endpoint` is done with the link. When every endpoint of this process is released, the
  /// communicator is finalized and destroyed (ncclCommFinalize, polled until `deadline`, else
  /// aborted). Returns the link's status: OK, or why it was aborted.
  absl::Status Release(NcclEndpoint endpoint, absl::Time deadline);

  /// OK, or UNAVAILABLE with why the link was aborted.
  absl::Status status() const;
  bool loopback() const { return loopback_; }
  int cuda_device() const { return options_.cuda_device; }
  /// The link's stream (high priority, non-blocking). Work the caller enqueues on it runs in
  /// order with the operations issued so far.
  cudaStream_t stream() const { return stream_; }

 private:
  struct Pending {
    NcclOp op;
    uint64_t seq = 0;
  };
  NcclLink(const NcclLinkOptions& options, bool loopback)
      : options_(options), loopback_(loopback) {}
  // Enqueues the copies, the grouped send/recv and the events of `ops` (one, or a loopback pair);
  // polls ncclInProgress. Marks the ops issued.
  absl::Status IssueLocked(Pending* a, NcclEndpoint endpoint_a, Pending* b);
  // ncclCommGetAsyncError until not in progress, up to `deadline`.
  absl::Status PollInProgressLocked(const char* what, absl::Time deadline);
  void AbortLocked(const absl::Status& reason);
  bool HoldsLocked(NcclEndpoint endpoint) const;

  const NcclLinkOptions options_;
  const bool loopback_;
  int rank_ = 0;
  cudaStream_t stream_ = nullptr;
  mutable std::mutex mutex_;  // guards everything below and every NCCL call
  ncclComm_t comm_ = nullptr;
  bool ready_ = false;
  absl::Status status_;  // OK, or why the link is unusable
  std::array<uint64_t, 2> posted_{0, 0};
  std::array<uint64_t, 2> issued_{0, 0};
  std::array<bool, 2> released_{false, false};
  std::array<std::deque<Pending>, 2> unmatched_;  // loopback: posted, waiting for the other side
};

/// Pinned host or device memory that grows (never shrinks). The old block of a grown buffer is
/// kept until destruction, so a copy still in flight from it stays valid.
class NcclStagingBuffer {
 public:
  enum class Kind { kHost, kDevice };
  explicit NcclStagingBuffer(Kind kind) : kind_(kind) {}
  ~NcclStagingBuffer();
  NcclStagingBuffer(const NcclStagingBuffer&) = delete;
  NcclStagingBuffer& operator=(const NcclStagingBuffer&) = delete;

  /// Ensures at least `bytes` bytes (rounded up to a power of two). RESOURCE_EXHAUSTED when CUDA
  /// cannot allocate.
  absl::Status Reserve(int64_t bytes);
  uint8_t* data() const { return data_; }
  int64_t capacity() const { return capacity_; }

 private:
  void Free(uint8_t* block) const;
  Kind kind_;
  uint8_t* data_ = nullptr;
  int64_t capacity_ = 0;
  std::deque<uint8_t*> retired_;
};

/// "<what>: <NCCL error> (<ncclGetLastError>)" as UNAVAILABLE.
absl::Status NcclError(const char* what, ncclResult_t result, ncclComm_t comm = nullptr);
/// "<what>: <CUDA error>" as UNAVAILABLE.
absl::Status CudaError(const char* what, cudaError_t error);

}  // namespace dsa
