// The CUDA backend's capability check: which GPUs this process sees and whether the indexer
// kernels (built for sm_90a) can run on them. Framework-free: no Abseil, gRPC or protobuf here.
#pragma once

#include <cuda_runtime_api.h>

namespace dsa::cuda {

/// One visible GPU.
struct DeviceInfo {
  int ordinal = -1;
  int sm_major = 0;
  int sm_minor = 0;
  int num_sms = 0;
  size_t global_memory_bytes = 0;
  char name[256] = {};
};

/// Number of visible GPUs into `count` (0 when there is no GPU or no driver; the CUDA error of that
/// case is swallowed and cudaSuccess returned, so CPU machines see 0). Other errors are returned.
cudaError_t CountDevices(int* count);

/// Properties of GPU `ordinal` (0-based, < CountDevices). Returns cudaErrorInvalidDevice otherwise.
cudaError_t GetDeviceInfo(int ordinal, DeviceInfo* info);

/// Whether the indexer kernels can run on a GPU: compute capability 9.0 (Hopper; the kernels are
/// built for sm_90a and use its wgmma/TMA features).
bool CanRunIndexerKernels(const DeviceInfo& info);

}  // namespace dsa::cuda
