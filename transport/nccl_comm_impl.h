// The NCCL and CUDA side of the NCCL data plane's link (nccl_link.h): NcclCommImpl, the NcclComm
// that makes the real calls on libnccl and the CUDA runtime; the links made on it (two ranks, or
// loopback on one GPU); and the staging buffers and error helpers the transport and the server
// share. Built only with DSA_ENABLE_CUDA.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/nccl_link.h"

namespace dsa {

/// A non-blocking communicator (ncclConfig_t.blocking = 0) and a high-priority, non-blocking
/// stream on one GPU. Not thread-safe (NcclLink serializes its calls).
class NcclCommImpl final : public NcclComm {
 public:
  /// The stream on options.cuda_device (made current), no communicator yet. UNAVAILABLE when
  /// CUDA refused.
  static absl::StatusOr<std::unique_ptr<NcclCommImpl>> Create(const NcclLinkOptions& options);
  /// Starts joining the communicator `unique_id` of `num_ranks` as `rank` (ncclCommInitRankConfig,
  /// non-blocking) and returns at once; GetAsyncError says when it joined. UNAVAILABLE when NCCL
  /// refused (what it made aborted).
  absl::Status Join(const ncclUniqueId& unique_id, int num_ranks, int rank);
  ~NcclCommImpl() override;
  NcclCommImpl(const NcclCommImpl&) = delete;
  NcclCommImpl& operator=(const NcclCommImpl&) = delete;

  int GetAsyncError(int* state) override;
  int SendRecv(std::span<const NcclOp* const> ops, int peer) override;
  int Finalize() override;
  int Destroy() override;
  void Abort() override;
  absl::Status Error(const char* what, int result) override;
  absl::Status SetDevice() override;
  absl::Status CopyToDevice(void* device, const void* host, int64_t bytes) override;
  absl::Status CopyToHost(void* host, const void* device, int64_t bytes) override;
  absl::Status RecordEvent(cudaEvent_t event) override;
  absl::StatusOr<bool> QueryEvent(cudaEvent_t event) override;
  cudaStream_t stream() const override { return stream_; }

 private:
  explicit NcclCommImpl(int cuda_device) : cuda_device_(cuda_device) {}
  const int cuda_device_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;  // null once destroyed or aborted
};

/// Starts joining a two-rank link as `rank` (0 attention, 1 indexer) on options.cuda_device and
/// returns at once; NcclLink::WaitReady tells when both ranks joined. INVALID_ARGUMENT (rank),
/// UNAVAILABLE (CUDA or NCCL refused).
absl::StatusOr<std::shared_ptr<NcclLink>> StartTwoRankNcclLink(const ncclUniqueId& unique_id,
                                                               int rank,
                                                               const NcclLinkOptions& options);
/// A one-rank link with both endpoints here, ready when returned. UNAVAILABLE.
absl::StatusOr<std::shared_ptr<NcclLink>> CreateLoopbackNcclLink(const NcclLinkOptions& options);

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
