// The NCCL and CUDA side of the NCCL data plane's link (see nccl_comm_impl.h).
#include "transport/nccl_comm_impl.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace dsa {

static_assert(kNcclSuccess == ncclSuccess && kNcclInProgress == ncclInProgress,
              "nccl_link.h's ncclResult_t values differ from nccl.h's");

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

absl::StatusOr<std::unique_ptr<NcclCommImpl>> NcclCommImpl::Create(const NcclLinkOptions& options) {
  if (cudaError_t e = cudaSetDevice(options.cuda_device); e != cudaSuccess) {
    return CudaError("cudaSetDevice", e);
  }
  std::unique_ptr<NcclCommImpl> comm(new NcclCommImpl(options.cuda_device));
  if (absl::Status s = CreateStream(&comm->stream_); !s.ok()) return s;
  return comm;
}

absl::Status NcclCommImpl::Join(const ncclUniqueId& unique_id, int num_ranks, int rank) {
  ncclConfig_t config = NonBlockingConfig();
  const ncclResult_t result = ncclCommInitRankConfig(&comm_, num_ranks, unique_id, rank, &config);
  if (result != ncclSuccess && result != ncclInProgress) {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    return NcclError("ncclCommInitRankConfig", result);
  }
  return absl::OkStatus();
}

NcclCommImpl::~NcclCommImpl() {
  if (stream_ != nullptr) {
    cudaSetDevice(cuda_device_);
    cudaStreamSynchronize(stream_);  // the aborted kernels have ended; copies and events drain
    cudaStreamDestroy(stream_);
  }
}

int NcclCommImpl::GetAsyncError(int* state) {
  ncclResult_t async = ncclSuccess;
  const ncclResult_t result = ncclCommGetAsyncError(comm_, &async);
  *state = async;
  return result;
}

int NcclCommImpl::SendRecv(std::span<const NcclOp* const> ops, int peer) {
  ncclResult_t result = ncclGroupStart();
  for (const NcclOp* op : ops) {
    if (result != ncclSuccess) continue;
    result = op->send ? ncclSend(op->device, op->bytes, ncclUint8, peer, comm_, stream_)
                      : ncclRecv(op->device, op->bytes, ncclUint8, peer, comm_, stream_);
  }
  const ncclResult_t ended = ncclGroupEnd();
  if (result == ncclSuccess || result == ncclInProgress) result = ended;
  return result;
}

int NcclCommImpl::Finalize() { return ncclCommFinalize(comm_); }

int NcclCommImpl::Destroy() {
  const ncclResult_t result = ncclCommDestroy(comm_);
  comm_ = nullptr;
  return result;
}

void NcclCommImpl::Abort() {
  if (comm_ != nullptr) ncclCommAbort(comm_);
  comm_ = nullptr;
}

absl::Status NcclCommImpl::Error(const char* what, int result) {
  return NcclError(what, static_cast<ncclResult_t>(result), comm_);
}

absl::Status NcclCommImpl::SetDevice() {
  if (cudaError_t e = cudaSetDevice(cuda_device_); e != cudaSuccess) {
    return CudaError("cudaSetDevice", e);
  }
  return absl::OkStatus();
}

absl::Status NcclCommImpl::CopyToDevice(void* device, const void* host, int64_t bytes) {
  if (cudaError_t e = cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_);
      e != cudaSuccess) {
    return CudaError("cudaMemcpyAsync (to the send buffer)", e);
  }
  return absl::OkStatus();
}

absl::Status NcclCommImpl::CopyToHost(void* host, const void* device, int64_t bytes) {
  if (cudaError_t e = cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_);
      e != cudaSuccess) {
    return CudaError("cudaMemcpyAsync (from the receive buffer)", e);
  }
  return absl::OkStatus();
}

absl::Status NcclCommImpl::RecordEvent(cudaEvent_t event) {
  if (cudaError_t e = cudaEventRecord(event, stream_); e != cudaSuccess) {
    return CudaError("cudaEventRecord", e);
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> NcclCommImpl::QueryEvent(cudaEvent_t event) {
  const cudaError_t query = cudaEventQuery(event);
  if (query == cudaSuccess) return true;
  if (query == cudaErrorNotReady) return false;
  return CudaError("cudaEventQuery", query);
}

absl::StatusOr<std::shared_ptr<NcclLink>> StartTwoRankNcclLink(const ncclUniqueId& unique_id,
                                                               int rank,
                                                               const NcclLinkOptions& options) {
  if (rank != 0 && rank != 1) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of a two-rank link"));
  }
  absl::StatusOr<std::unique_ptr<NcclCommImpl>> comm = NcclCommImpl::Create(options);
  if (!comm.ok()) return comm.status();
  if (absl::Status s = (*comm)->Join(unique_id, 2, rank); !s.ok()) return s;
  return NcclLink::Create(*std::move(comm), options, /*loopback=*/false, rank);
}

absl::StatusOr<std::shared_ptr<NcclLink>> CreateLoopbackNcclLink(const NcclLinkOptions& options) {
  absl::StatusOr<std::unique_ptr<NcclCommImpl>> comm = NcclCommImpl::Create(options);
  if (!comm.ok()) return comm.status();
  ncclUniqueId unique_id;
  if (ncclResult_t r = ncclGetUniqueId(&unique_id); r != ncclSuccess) {
    return NcclError("ncclGetUniqueId", r);
  }
  if (absl::Status s = (*comm)->Join(unique_id, 1, 0); !s.ok()) return s;
  std::shared_ptr<NcclLink> link =
      NcclLink::Create(*std::move(comm), options, /*loopback=*/true, /*rank=*/0);
  if (absl::Status s = link->WaitReady(absl::Now() + options.call_timeout); !s.ok()) return s;
  return link;
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
