// The CUDA backend's capability check (see device_info.h).
#include <cstdio>

#include "indexer_service/cuda/device_info.h"

namespace dsa::cuda {

cudaError_t CountDevices(int* count) {
  *count = 0;
  const cudaError_t error = cudaGetDeviceCount(count);
  if (error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    *count = 0;
    return cudaSuccess;
  }
  return error;
}

cudaError_t GetDeviceInfo(int ordinal, DeviceInfo* info) {
  // Range-check first so a bad ordinal is answered without a failing CUDA call (sanitizer-clean).
  int count = 0;
  if (const cudaError_t error = CountDevices(&count); error != cudaSuccess) return error;
  if (ordinal < 0 || ordinal >= count) return cudaErrorInvalidDevice;
  cudaDeviceProp prop{};
  const cudaError_t error = cudaGetDeviceProperties(&prop, ordinal);
  if (error != cudaSuccess) return error;
  info->ordinal = ordinal;
  info->sm_major = prop.major;
  info->sm_minor = prop.minor;
  info->num_sms = prop.multiProcessorCount;
  info->global_memory_bytes = prop.totalGlobalMem;
  std::snprintf(info->name, sizeof(info->name), "%s", prop.name);
  return cudaSuccess;
}

bool CanRunIndexerKernels(const DeviceInfo& info) {
  return info.sm_major == 9 && info.sm_minor == 0;
}

}  // namespace dsa::cuda
