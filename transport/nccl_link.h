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
// The link's logic (posting order, loopback pairing, deadlines, abort, release) makes its NCCL and
// CUDA calls through NcclComm, so it builds without CUDA or NCCL; nccl_comm_impl.h has the real
// calls and the links made on them, tests/transport/nccl_link_test.cc a CPU fake.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

// cudaStream_t and cudaEvent_t without the CUDA headers: the typedefs of CUDA's driver_types.h,
// which a translation unit may repeat.
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

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

/// ncclResult_t values the link tells apart (nccl.h's; NcclCommImpl checks they agree). Any other
/// value is an error, kept for its message (NcclComm::Error).
inline constexpr int kNcclSuccess = 0;
inline constexpr int kNcclInProgress = 7;

/// The NCCL and CUDA calls a link makes on its communicator, device and stream, one method per
/// call: the seam that lets the link's logic run over a CPU fake. NcclCommImpl (nccl_comm_impl.h)
/// makes the real calls. NCCL methods return an ncclResult_t (kNcclSuccess, kNcclInProgress while
/// a non-blocking call runs, or an error); CUDA methods an OK status or UNAVAILABLE
/// "<what>: <cudaGetErrorString>". Not thread-safe: the link calls it under its mutex, except
/// QueryEvent.
class NcclComm {
 public:
  /// Frees the stream once its work drained (cudaSetDevice, cudaStreamSynchronize,
  /// cudaStreamDestroy). The communicator is destroyed or aborted before (Destroy, Abort).
  virtual ~NcclComm() = default;

  /// ncclCommGetAsyncError: the call's result, and in `*state` the communicator's (kNcclSuccess
  /// once the join and every call so far finished, kNcclInProgress while one runs, or its error).
  virtual int GetAsyncError(int* state) = 0;
  /// ncclGroupStart, then ncclSend or ncclRecv of each op (op.bytes of ncclUint8 from or into
  /// op.device, with `peer`, on the stream; none after the first that fails), then ncclGroupEnd.
  /// The first failure, else ncclGroupEnd's result.
  virtual int SendRecv(std::span<const NcclOp* const> ops, int peer) = 0;
  virtual int Finalize() = 0;  // ncclCommFinalize
  /// ncclCommDestroy; the communicator is gone after, whatever it returns.
  virtual int Destroy() = 0;
  /// ncclCommAbort; the communicator is gone after.
  virtual void Abort() = 0;
  /// UNAVAILABLE "<what>: <ncclGetErrorString(result)> (<ncclGetLastError>)", the last error
  /// of the communicator while it exists, else the library's.
  virtual absl::Status Error(const char* what, int result) = 0;

  /// cudaSetDevice(the link's device): "cudaSetDevice".
  virtual absl::Status SetDevice() = 0;
  /// cudaMemcpyAsync of `bytes` on the stream, host to device ("cudaMemcpyAsync (to the send
  /// buffer)") or device to host ("cudaMemcpyAsync (from the receive buffer)").
  virtual absl::Status CopyToDevice(void* device, const void* host, int64_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host, const void* device, int64_t bytes) = 0;
  /// cudaEventRecord(event) on the stream: "cudaEventRecord".
  virtual absl::Status RecordEvent(cudaEvent_t event) = 0;
  /// cudaEventQuery: true once the event completed, false while not ready; "cudaEventQuery" on
  /// an error. Thread-safe.
  virtual absl::StatusOr<bool> QueryEvent(cudaEvent_t event) = 0;
  /// The link's stream (high priority, non-blocking).
  virtual cudaStream_t stream() const = 0;
};

/// Thread-safe: every NCCL call is made under one mutex (a communicator is not thread-safe).
class NcclLink {
 public:
  /// A link over `comm`, whose communicator is joining or joined (WaitReady tells): two ranks,
  /// this process being `rank` (0 attention, 1 indexer), or loopback (`rank` 0). The factories of
  /// nccl_comm_impl.h (StartTwoRankNcclLink, CreateLoopbackNcclLink) make links over libnccl.
  static std::shared_ptr<NcclLink> Create(std::unique_ptr<NcclComm> comm,
                                          const NcclLinkOptions& options, bool loopback, int rank);

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
  cudaStream_t stream() const { return comm_->stream(); }

 private:
  struct Pending {
    NcclOp op;
    uint64_t seq = 0;
  };
  NcclLink(std::unique_ptr<NcclComm> comm, const NcclLinkOptions& options, bool loopback, int rank)
      : options_(options), loopback_(loopback), rank_(rank), comm_(std::move(comm)) {}
  // Enqueues the copies, the grouped send/recv and the events of `ops` (one, or a loopback pair);
  // polls ncclInProgress. Marks the ops issued.
  absl::Status IssueLocked(Pending* a, NcclEndpoint endpoint_a, Pending* b);
  // ncclCommGetAsyncError until not in progress, up to `deadline`.
  absl::Status PollInProgressLocked(const char* what, absl::Time deadline);
  void AbortLocked(const absl::Status& reason);
  bool HoldsLocked(NcclEndpoint endpoint) const;

  const NcclLinkOptions options_;
  const bool loopback_;
  const int rank_;
  const std::unique_ptr<NcclComm> comm_;  // its stream lives as long as the link
  mutable std::mutex mutex_;              // guards everything below and every NCCL call
  bool comm_open_ = true;                 // the communicator is neither destroyed nor aborted
  bool ready_ = false;
  absl::Status status_;  // OK, or why the link is unusable
  std::array<uint64_t, 2> posted_{0, 0};
  std::array<uint64_t, 2> issued_{0, 0};
  std::array<bool, 2> released_{false, false};
  std::array<std::deque<Pending>, 2> unmatched_;  // loopback: posted, waiting for the other side
};

}  // namespace dsa
