// The GPU append (see key_append.h): one warp quantizes one key into its slot of the paged cache.
#include <cuda_bf16.h>

#include "indexer_service/cuda/fp8_device.cuh"
#include "indexer_service/cuda/key_append.h"

namespace dsa::cuda {
namespace {

constexpr int kWarpsPerCta = 8;

template <typename T>
__global__ void AppendKernel(const T* __restrict__ keys, int64_t num_keys, int head_dim,
                             const int32_t* __restrict__ block_table, int64_t first_slot,
                             uint8_t* __restrict__ pool) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerCta;
  for (int64_t key = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
       key < num_keys; key += warps) {
    const T* src = keys + key * head_dim;
    float amax = 0.0f;
    for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(LoadAsFloat(src + d)));
    for (int offset = 16; offset > 0; offset /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    const float scale = __fdiv_rn(amax, 448.0f);
    const int64_t slot = first_slot + key;
    uint8_t* block = pool + CacheBlockBytes(head_dim) * block_table[slot / kBlockSize];
    const int slot_in_block = static_cast<int>(slot % kBlockSize);
    uint8_t* codes = block + static_cast<int64_t>(slot_in_block) * head_dim;
    const bool zero = !(scale > 0.0f);
    for (int d = lane; d < head_dim; d += 32) {
      codes[d] = zero ? uint8_t{0} : EncodeFp8E4m3Device(__fdiv_rn(LoadAsFloat(src + d), scale));
    }
    if (lane == 0) {
      reinterpret_cast<float*>(block + int64_t{kBlockSize} * head_dim)[slot_in_block] =
          zero ? 0.0f : scale;
    }
  }
}

}  // namespace

bool CanImplementAppend(const AppendParams& p, const char** why) {
  const char* reason = nullptr;
  if (p.num_keys < 0) {
    reason = "num_keys < 0";
  } else if (p.head_dim < 1 || p.head_dim > 1024) {
    reason = "head_dim outside [1, 1024]";
  } else if (p.first_slot < 0) {
    reason = "first_slot < 0";
  } else if (p.num_keys > 0 &&
             (p.keys == nullptr || p.block_table == nullptr || p.pool == nullptr)) {
    reason = "null pointer";
  } else if (p.keys_dtype != KeyDtype::kFloat32 && p.keys_dtype != KeyDtype::kBFloat16) {
    reason = "keys_dtype is neither fp32 nor bf16";
  }
  if (why != nullptr) *why = reason;
  return reason == nullptr;
}

cudaError_t LaunchAppend(const AppendParams& p, cudaStream_t stream) {
  if (!CanImplementAppend(p)) return cudaErrorInvalidValue;
  if (p.num_keys == 0) return cudaSuccess;
  const int64_t ctas = (p.num_keys + kWarpsPerCta - 1) / kWarpsPerCta;
  const unsigned grid = static_cast<unsigned>(ctas < 65535 ? ctas : 65535);
  if (p.keys_dtype == KeyDtype::kFloat32) {
    AppendKernel<float>
        <<<grid, kWarpsPerCta * 32, 0, stream>>>(static_cast<const float*>(p.keys), p.num_keys,
                                                 p.head_dim, p.block_table, p.first_slot, p.pool);
  } else {
    AppendKernel<__nv_bfloat16><<<grid, kWarpsPerCta * 32, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(p.keys), p.num_keys, p.head_dim, p.block_table,
        p.first_slot, p.pool);
  }
  return cudaGetLastError();
}

}  // namespace dsa::cuda
