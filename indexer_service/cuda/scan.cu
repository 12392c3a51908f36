// The GPU scans (see scan.h). Both kernels give one CTA to one (group, block) pair: the CTA stages
// the block's 64 keys in shared memory once and scores them for every row of the group, so
// verifier rows of one sequence share the key read.
#include <cuda_bf16.h>

#include <cstdint>

#include "indexer_service/cuda/fp8_device.cuh"
#include "indexer_service/cuda/scan.h"

namespace dsa::cuda {
namespace {

// Where CTA `block` of the grid works: the group g whose block range holds it (binary search over
// group_block_offset), the entry j of that block in the group's rows, and the pool block address.
struct BlockWork {
  int group;
  int64_t entry_block;  // j: the block's index in the group's block list
  int64_t logical_block;
  const uint8_t* block;  // the pool block
  int64_t num_slots;
};

__device__ inline BlockWork FindBlockWork(const ScanParams& p, int64_t block) {
  int lo = 0, hi = p.num_groups - 1;  // the last g with group_block_offset[g] <= block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.group_block_offset[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  BlockWork w;
  w.group = lo;
  w.entry_block = block - p.group_block_offset[lo];
  w.logical_block = p.logical_blocks[block];
  const int32_t pool_block = p.block_tables[p.group_table_offset[lo] + w.logical_block];
  w.block = p.pool + CacheBlockBytes(p.head_dim) * pool_block;
  w.num_slots = p.group_num_slots[lo];
  return w;
}

template <typename Q>
__device__ inline float QueryValue(const Q* q);
template <>
__device__ inline float QueryValue<float>(const float* q) {
  return *q;
}
template <>
__device__ inline float QueryValue<__nv_bfloat16>(const __nv_bfloat16* q) {
  return __bfloat162float(*q);
}

// Writes the scaled, masked score of slot s of the CTA's block for row r.
__device__ inline void StoreScore(const ScanParams& p, const BlockWork& w, int r, int s,
                                  float scale, float total) {
  const int64_t slot = w.logical_block * kCacheBlockSize + s;
  const bool visible = slot <= p.row_position[r] && slot < w.num_slots;
  p.scores[p.row_score_offset[r] + w.entry_block * kCacheBlockSize + s] =
      visible ? scale * total : -INFINITY;
}

// ---- CUDA-core scan ------------------------------------------------------------------------
constexpr int kCudaCoreThreads = 256;
constexpr int kHeadLanes = kCudaCoreThreads / kCacheBlockSize;  // 4 threads per slot

// Thread (slot s = tid % 64, head lane hl = tid / 64) sums heads hl, hl + 4, ...; the four partial
// sums meet in shared memory. Keys are decoded to fp32 [64][head_dim + 1] (padded: no conflicts).
template <typename Q>
__global__ void __launch_bounds__(kCudaCoreThreads) ScanCudaCoreKernel(ScanParams p) {
  extern __shared__ float smem[];
  const int stride = p.head_dim + 1;
  float* keys = smem;                                // [64][head_dim + 1]
  float* partial = smem + kCacheBlockSize * stride;  // [kHeadLanes][64]
  const BlockWork w = FindBlockWork(p, blockIdx.x);
  const int64_t key_bytes = int64_t{kCacheBlockSize} * p.head_dim;
  for (int i = threadIdx.x; i < key_bytes; i += kCudaCoreThreads) {
    keys[(i / p.head_dim) * stride + i % p.head_dim] = DecodeFp8E4m3Device(w.block[i]);
  }
  __syncthreads();
  const int s = threadIdx.x % kCacheBlockSize;
  const int head_lane = threadIdx.x / kCacheBlockSize;
  const float scale = reinterpret_cast<const float*>(w.block + key_bytes)[s];
  const Q* query = static_cast<const Q*>(p.query);
  for (int r = p.group_first_row[w.group]; r < p.group_first_row[w.group + 1]; ++r) {
    float total = 0.0f;
    for (int h = head_lane; h < p.num_heads; h += kHeadLanes) {
      const Q* q = query + (static_cast<int64_t>(r) * p.num_heads + h) * p.head_dim;
      const float* k = keys + s * stride;
      float dot = 0.0f;
      for (int d = 0; d < p.head_dim; ++d) dot = fmaf(QueryValue(q + d), k[d], dot);
      total = fmaf(p.head_weights[static_cast<int64_t>(r) * p.num_heads + h],
                   dot < 0.0f ? 0.0f : dot, total);
    }
    partial[head_lane * kCacheBlockSize + s] = total;
    __syncthreads();
    if (head_lane == 0) {
      float sum = 0.0f;
      for (int i = 0; i < kHeadLanes; ++i) sum += partial[i * kCacheBlockSize + s];
      StoreScore(p, w, r, s, scale, sum);
    }
    __syncthreads();
  }
}

size_t CudaCoreSmemBytes(int head_dim) {
  return sizeof(float) * (kCacheBlockSize * (head_dim + 1) + kHeadLanes * kCacheBlockSize);
}

// ---- tensor-core scan ----------------------------------------------------------------------
// Warp w owns heads [16 w, 16 w + 16) as the M dimension of mma.m16n8k16 (A = the row's query,
// [16 heads, head_dim] bf16, held in registers), the block's 64 slots as N (B = keys, bf16
// [64][head_dim + 8] in shared memory, widened from fp8 through a 256-entry table: exact), and
// head_dim as K. The epilogue applies ReLU and the head weights to the fp32 accumulators, sums
// the warp's 16 heads by shuffles, and the warps' partial sums meet in shared memory.
constexpr int kKeyPad = 8;  // bf16 elements of padding per smem key row: conflict-free B loads

__device__ inline void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int kHeadDim>
__global__ void ScanTensorCoreKernel(ScanParams p) {
  constexpr int kStride = kHeadDim + kKeyPad;  // bf16 elements per smem key row
  constexpr int kSteps = kHeadDim / 16;
  __shared__ __align__(16) uint16_t keys[kCacheBlockSize * kStride];
  __shared__ uint16_t table[256];
  __shared__ float partial[8][kCacheBlockSize];
  const int num_warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int c = threadIdx.x; c < 256; c += blockDim.x) {
    table[c] = __bfloat16_as_ushort(__float2bfloat16_rn(DecodeFp8E4m3Device(c)));
  }
  const BlockWork w = FindBlockWork(p, blockIdx.x);
  __syncthreads();
  // Stage: 4 codes per word; kHeadDim % 4 == 0 keeps a word inside one slot.
  const uint32_t* words = reinterpret_cast<const uint32_t*>(w.block);
  for (int i = threadIdx.x; i < kCacheBlockSize * kHeadDim / 4; i += blockDim.x) {
    const uint32_t codes = words[i];
    const int s = (4 * i) / kHeadDim, d = (4 * i) % kHeadDim;
    uint2 out;
    out.x = table[codes & 0xff] | static_cast<uint32_t>(table[(codes >> 8) & 0xff]) << 16;
    out.y = table[(codes >> 16) & 0xff] | static_cast<uint32_t>(table[codes >> 24]) << 16;
    *reinterpret_cast<uint2*>(&keys[s * kStride + d]) = out;
  }
  __syncthreads();
  const float* scales =
      reinterpret_cast<const float*>(w.block + int64_t{kCacheBlockSize} * kHeadDim);
  const __nv_bfloat16* query = static_cast<const __nv_bfloat16*>(p.query);
  const int head0 = warp * 16 + lane / 4;
  const int col = 2 * (lane % 4);
  for (int r = p.group_first_row[w.group]; r < p.group_first_row[w.group + 1]; ++r) {
    const __nv_bfloat16* q = query + (static_cast<int64_t>(r) * p.num_heads + head0) * kHeadDim;
    uint32_t a[kSteps][4];
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      a[k][0] = *reinterpret_cast<const uint32_t*>(q + k * 16 + col);
      a[k][1] = *reinterpret_cast<const uint32_t*>(q + 8 * kHeadDim + k * 16 + col);
      a[k][2] = *reinterpret_cast<const uint32_t*>(q + k * 16 + col + 8);
      a[k][3] = *reinterpret_cast<const uint32_t*>(q + 8 * kHeadDim + k * 16 + col + 8);
    }
    const float* weights = p.head_weights + static_cast<int64_t>(r) * p.num_heads;
    const float w_low = weights[head0], w_high = weights[head0 + 8];
#pragma unroll 2
    for (int n = 0; n < kCacheBlockSize / 8; ++n) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const uint16_t* b = &keys[(n * 8 + lane / 4) * kStride + col];
#pragma unroll
      for (int k = 0; k < kSteps; ++k) {
        MmaBf16(c, a[k], *reinterpret_cast<const uint32_t*>(b + k * 16),
                *reinterpret_cast<const uint32_t*>(b + k * 16 + 8));
      }
      // c[0], c[1]: head head0, slots n*8 + col + {0, 1}; c[2], c[3]: head head0 + 8.
      float even = w_low * (c[0] < 0.0f ? 0.0f : c[0]) + w_high * (c[2] < 0.0f ? 0.0f : c[2]);
      float odd = w_low * (c[1] < 0.0f ? 0.0f : c[1]) + w_high * (c[3] < 0.0f ? 0.0f : c[3]);
      for (int offset = 4; offset < 32; offset *= 2) {
        even += __shfl_xor_sync(0xffffffffu, even, offset);
        odd += __shfl_xor_sync(0xffffffffu, odd, offset);
      }
      if (lane < 4) {
        partial[warp][n * 8 + col] = even;
        partial[warp][n * 8 + col + 1] = odd;
      }
    }
    __syncthreads();
    for (int s = threadIdx.x; s < kCacheBlockSize; s += blockDim.x) {
      float sum = 0.0f;
      for (int i = 0; i < num_warps; ++i) sum += partial[i][s];
      StoreScore(p, w, r, s, scales[s], sum);
    }
    __syncthreads();
  }
}

bool CheckCommon(const ScanParams& p, const char** reason) {
  if (p.num_groups < 0 || p.num_rows < 0 || p.total_blocks < 0) {
    *reason = "negative count";
  } else if (p.total_blocks > 0x7fffffff) {
    *reason = "more than 2^31 - 1 blocks in one launch";
  } else if (p.num_heads < 1) {
    *reason = "num_heads < 1";
  } else if (p.total_blocks > 0 &&
             (p.pool == nullptr || p.group_first_row == nullptr ||
              p.group_block_offset == nullptr || p.logical_blocks == nullptr ||
              p.group_table_offset == nullptr || p.block_tables == nullptr ||
              p.group_num_slots == nullptr || p.query == nullptr || p.head_weights == nullptr ||
              p.row_position == nullptr || p.row_score_offset == nullptr || p.scores == nullptr)) {
    *reason = "null pointer";
  } else if (p.total_blocks > 0 && p.num_groups == 0) {
    *reason = "blocks without groups";
  }
  return *reason == nullptr;
}

}  // namespace

bool CanImplementScanCudaCores(const ScanParams& p, const char** why) {
  const char* reason = nullptr;
  if (CheckCommon(p, &reason)) {
    if (p.head_dim < 1 || p.head_dim > 256) {
      reason = "head_dim outside [1, 256]";
    } else if (p.query_dtype != QueryDtype::kFloat32 && p.query_dtype != QueryDtype::kBFloat16) {
      reason = "query_dtype is neither fp32 nor bf16";
    }
  }
  if (why != nullptr) *why = reason;
  return reason == nullptr;
}

bool CanImplementScanTensorCores(const ScanParams& p, const char** why) {
  const char* reason = nullptr;
  if (CheckCommon(p, &reason)) {
    if (p.head_dim != 64 && p.head_dim != 128) {
      reason = "head_dim is neither 64 nor 128";
    } else if (p.num_heads % 16 != 0 || p.num_heads > 128) {
      reason = "num_heads is not a multiple of 16 up to 128";
    } else if (p.query_dtype != QueryDtype::kBFloat16) {
      reason = "query_dtype is not bf16";
    }
  }
  if (why != nullptr) *why = reason;
  return reason == nullptr;
}

cudaError_t LaunchScanCudaCores(const ScanParams& p, cudaStream_t stream) {
  if (!CanImplementScanCudaCores(p)) return cudaErrorInvalidValue;
  if (p.total_blocks == 0) return cudaSuccess;
  const size_t smem = CudaCoreSmemBytes(p.head_dim);
  const unsigned grid = static_cast<unsigned>(p.total_blocks);
  if (p.query_dtype == QueryDtype::kFloat32) {
    auto kernel = ScanCudaCoreKernel<float>;
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
        e != cudaSuccess) {
      return e;
    }
    kernel<<<grid, kCudaCoreThreads, smem, stream>>>(p);
  } else {
    auto kernel = ScanCudaCoreKernel<__nv_bfloat16>;
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
        e != cudaSuccess) {
      return e;
    }
    kernel<<<grid, kCudaCoreThreads, smem, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t LaunchScanTensorCores(const ScanParams& p, cudaStream_t stream) {
  if (!CanImplementScanTensorCores(p)) return cudaErrorInvalidValue;
  if (p.total_blocks == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(p.total_blocks);
  const unsigned threads = static_cast<unsigned>(p.num_heads / 16 * 32);
  if (p.head_dim == 128) {
    ScanTensorCoreKernel<128><<<grid, threads, 0, stream>>>(p);
  } else {
    ScanTensorCoreKernel<64><<<grid, threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace dsa::cuda
