// Helpers for the GPU tests: a device buffer that frees itself, a CUDA status check, the skip when
// no usable GPU is present, and bf16 rounding on the host.
#pragma once

#include <cuda_runtime_api.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/cuda/device_info.h"

namespace dsa::cuda::testing {

#define DSA_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(expr)

/// True (and the test should GTEST_SKIP) when no GPU that can run the kernels is visible.
inline bool NoUsableGpu() {
  int count = 0;
  if (CountDevices(&count) != cudaSuccess || count == 0) return true;
  DeviceInfo info;
  return GetDeviceInfo(0, &info) != cudaSuccess || !CanRunIndexerKernels(info);
}

/// Device memory of `bytes` bytes, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0 && cudaMalloc(&ptr_, bytes) != cudaSuccess) ptr_ = nullptr;
  }
  template <typename T>
  static DeviceBuffer From(const std::vector<T>& host) {
    DeviceBuffer buffer(host.size() * sizeof(T));
    if (!host.empty() && buffer.ptr_ != nullptr) {
      cudaMemcpy(buffer.ptr_, host.data(), buffer.bytes_, cudaMemcpyHostToDevice);
    }
    return buffer;
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) {
    other.ptr_ = nullptr;
  }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  bool ok() const { return ptr_ != nullptr || bytes_ == 0; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  std::vector<T> ToHost() const {
    std::vector<T> host(bytes_ / sizeof(T));
    if (!host.empty()) cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// fp32 -> bf16 bits, round-to-nearest-even (finite inputs).
inline uint16_t ToBf16Bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
/// bf16 bits -> fp32 (exact).
inline float FromBf16Bits(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

}  // namespace dsa::cuda::testing
