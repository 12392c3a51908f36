// The GPU scans (see scan.h). Both kernels give one CTA to one (group, block) pair: the CTA stages
// the block's 64 keys in shared memory once and scores them for every row of the group, so
// verifier rows of one sequence share the key read.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

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
  if (p.device_total_blocks != nullptr && blockIdx.x >= *p.device_total_blocks) return;
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
// Query-stationary f16 mma.sync m16n8k16 (fp32 accumulation). A CTA of 4 warps takes a chunk of
// consecutive entries of the flattened block list (possibly spanning groups) and streams the
// blocks through a ring of kStages shared-memory stages, one bulk asynchronous copy (TMA) a block
// completing on the stage's mbarrier, so the next blocks' loads overlap the current block's math.
// Warp w owns slots [16 w, 16 w + 16) of each block: A = keys (16 slots x head_dim, fp8 read
// straight from shared memory and widened to f16 exactly in registers, each key byte once), B =
// the row's query (head_dim x num_heads f16, held in registers with the row's head weights while
// consecutive blocks belong to the same row), N = heads. The epilogue applies ReLU and the head
// weights to the accumulators, sums the heads inside the thread and across the 4 lanes of a quad,
// scales by s_i and masks.
//
// K is permuted (the dot product does not care, as long as A and B agree): k-step k, lane quad
// position c, register half j take dim (k / 4) * 64 + 16 c + 4 (k % 4) + {0, 1} (a0/a1, b0) and
// + {2, 3} (a2/a3, b1), so one 16-byte shared-memory load per key row feeds four k-steps and one
// 16-byte global load per head two.
namespace tc {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kStages = 8;       // 8 x 8.25 KiB at D = 128: 7 blocks in flight per CTA
constexpr int kMaxChunk = 256;   // blocks per CTA
constexpr int kMaxDevices = 64;  // devices whose launch configuration is cached

// A stage is one whole cache block as the pool holds it (64 x kHeadDim codes, then 64 scales),
// brought in by one bulk asynchronous copy (TMA) that completes on the stage's mbarrier. The
// 16-byte key loads of a quarter-warp (rows g, g + 1, 128 bytes apart) hit the same banks twice:
// a 2-way conflict on 2 x kHeadDim / 64 shared loads a warp a block, cheaper than the ~4 cp.async
// (with their address arithmetic) a thread a block that a padded layout needed.
template <int kHeadDim>
__host__ __device__ constexpr int StageBytes() {
  return kCacheBlockSize * (kHeadDim + 4);
}
// Shared memory: the stages, the row's converted query (f16) and head weights (kInKernel), the
// stages' mbarriers, the chunk's block addresses, and the warps' largest magnitudes.
template <int kHeads, int kHeadDim>
constexpr size_t SmemBytes() {
  return size_t{kStages} * StageBytes<kHeadDim>() + size_t{2} * kHeads * kHeadDim + 4 * kHeads +
         kStages * 8 + kMaxChunk * (4 + 4 + 4 + 8) + 4 * kWarps;
}

__device__ inline uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ inline void MbarrierInit(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(SmemAddress(bar)));
}
// One thread: expects `bytes` on `bar` and starts the bulk copy that delivers them.
__device__ inline void BulkLoad(void* smem, const void* global, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddress(bar)),
               "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(SmemAddress(smem)),
      "l"(global), "r"(bytes), "r"(SmemAddress(bar))
      : "memory");
}
__device__ inline void MbarrierWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(SmemAddress(bar)),
      "r"(parity)
      : "memory");
}

__device__ inline void MmaF16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four E4M3 codes (low byte first) -> two pairs of f16 (low half first): codes 0, 1 in *low,
// 2, 3 in *high; one instruction a pair, exact (every E4M3 value is a normal f16 or zero; NaN
// codes, only in unfilled and masked slots, stay NaN). The pairs are the halves of the word, so
// nothing masks or shifts them out.
__device__ inline void Fp8x4ToF16x2x2(uint32_t codes, uint32_t& low, uint32_t& high) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(low), "=r"(high)
      : "r"(codes));
}

// ReLU that lets NaN through (as `x < 0 ? 0 : x` and the CPU's std::max(dot, 0) do): one
// instruction.
__device__ inline float ReluKeepNaN(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;\n" : "=f"(y) : "f"(x));
  return y;
}

// The query workspace: each row's query in f16, scaled by a power of two 2^e_r chosen so that its
// largest magnitude lands in [2^14, 2^15), and its head weights scaled by 2^-e_r. ReLU commutes
// with a positive scale and power-of-two scaling is exact in fp32, so the scores are those of the
// bf16 query; the f16 copy is exact for every element within 2^28 of the row's largest (smaller
// ones are rounded to 2^-39 of the largest).
struct QueryWorkspace {
  __half* query;   // [num_rows, num_heads, head_dim]
  float* weights;  // [num_rows, num_heads]
};

__host__ __device__ inline QueryWorkspace SplitWorkspace(void* workspace, const ScanParams& p) {
  QueryWorkspace w;
  w.query = static_cast<__half*>(workspace);
  w.weights = reinterpret_cast<float*>(static_cast<uint8_t*>(workspace) +
                                       size_t{2} * p.num_rows * p.num_heads * p.head_dim);
  return w;
}

// The row's scale exponent e: 2^e amax lies in [2^14, 2^15) (e clamped to [-100, 100]; 0 for an
// all-zero row).
__device__ inline int QueryExponent(float amax) {
  int exponent = 0;  // amax = m 2^exponent, m in [0.5, 1)
  frexpf(amax, &exponent);
  return amax > 0.0f ? max(-100, min(100, 15 - exponent)) : 0;
}

constexpr int kPrepareThreads = 256;

__global__ void __launch_bounds__(kPrepareThreads) PrepareQueryKernel(ScanParams p) {
  const int r = blockIdx.x;
  const int64_t size = static_cast<int64_t>(p.num_heads) * p.head_dim;
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p.query) + r * size;
  __shared__ float warp_max[kPrepareThreads / 32];
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < size; i += kPrepareThreads) {
    amax = fmaxf(amax, fabsf(__bfloat162float(q[i])));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int i = 0; i < kPrepareThreads / 32; ++i) amax = fmaxf(amax, warp_max[i]);
  const int e = QueryExponent(amax);
  const QueryWorkspace w = SplitWorkspace(p.workspace, p);
  for (int64_t i = threadIdx.x; i < size; i += kPrepareThreads) {
    w.query[r * size + i] = __float2half_rn(ldexpf(__bfloat162float(q[i]), e));
  }
  for (int h = threadIdx.x; h < p.num_heads; h += kPrepareThreads) {
    w.weights[static_cast<int64_t>(r) * p.num_heads + h] =
        ldexpf(p.head_weights[static_cast<int64_t>(r) * p.num_heads + h], -e);
  }
}

template <int kHeads, int kHeadDim>
__global__ void __launch_bounds__(kThreads, 2)
    ScanTensorCoreKernel(ScanParams p, int chunk, int ctas_wanted, bool convert_query) {
  constexpr int kStageBytes = StageBytes<kHeadDim>();
  constexpr int kGroups64 = kHeadDim / 64;  // 64-dim groups: one 16-byte load per key row each
  constexpr int kSteps = kHeadDim / 16;
  constexpr int kTiles = kHeads / 8;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* stages = smem;
  __half* s_query = reinterpret_cast<__half*>(smem + kStages * kStageBytes);
  float* s_weights = reinterpret_cast<float*>(s_query + kHeads * kHeadDim);
  uint64_t* full = reinterpret_cast<uint64_t*>(s_weights + kHeads);
  int32_t* s_pool_block = reinterpret_cast<int32_t*>(full + kStages);
  int32_t* s_group = s_pool_block + kMaxChunk;
  int32_t* s_logical = s_group + kMaxChunk;
  int64_t* s_entry_block = reinterpret_cast<int64_t*>(s_logical + kMaxChunk);
  float* s_amax = reinterpret_cast<float*>(s_entry_block + kMaxChunk);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane % 4;
  int64_t total = p.total_blocks;
  if (p.device_total_blocks != nullptr) {  // the same split as the host's, of the device total
    total = *p.device_total_blocks;
    chunk = static_cast<int>(
        min(int64_t{kMaxChunk}, max(int64_t{1}, (total + ctas_wanted - 1) / ctas_wanted)));
  }
  const int64_t first = static_cast<int64_t>(blockIdx.x) * chunk;
  if (first >= total) return;  // the whole CTA: no barrier is set up yet
  const int count = static_cast<int>(min(int64_t{chunk}, total - first));
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) MbarrierInit(&full[s]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  for (int i = threadIdx.x; i < count; i += kThreads) {
    const BlockWork w = FindBlockWork(p, first + i);
    s_pool_block[i] = p.block_tables[p.group_table_offset[w.group] + w.logical_block];
    s_group[i] = w.group;
    s_logical[i] = static_cast<int32_t>(w.logical_block);
    s_entry_block[i] = w.entry_block;
  }
  __syncthreads();

  const int64_t block_bytes = CacheBlockBytes(kHeadDim);
  // Thread 0 starts block i into stage i % kStages (whose previous block every thread is done
  // with: the caller has passed a __syncthreads after it).
  auto load_stage = [&](int i) {
    if (threadIdx.x == 0 && i < count) {
      BulkLoad(stages + (i % kStages) * kStageBytes, p.pool + block_bytes * s_pool_block[i],
               kStageBytes, &full[i % kStages]);
    }
  };
  for (int i = 0; i < kStages - 1; ++i) load_stage(i);

  const QueryWorkspace workspace = SplitWorkspace(p.workspace, p);
  uint32_t b[kTiles][kSteps][2];  // the row's query as B fragments (f16, scaled by 2^e)
  float2 wt[kTiles];              // its head weights n * 8 + 2 quad + {0, 1}, scaled by 2^-e
  int loaded_row = -1;
  // The loaded row's position and first score entry, read with its query (off the path between
  // the last key and the first store of a short chunk).
  int64_t row_position = 0, row_score_offset = 0;
  // The B fragments (and weights) of a row from its f16 copy: the workspace's or the CTA's.
  auto load_fragments = [&](const __half* row_query, const float* row_weights) {
#pragma unroll
    for (int n = 0; n < kTiles; ++n) {
      const __half* q = row_query + (n * 8 + lane / 4) * kHeadDim + 16 * quad;
#pragma unroll
      for (int g64 = 0; g64 < kGroups64; ++g64) {
        const uint4 low = *reinterpret_cast<const uint4*>(q + g64 * 64);
        const uint4 high = *reinterpret_cast<const uint4*>(q + g64 * 64 + 8);
        b[n][g64 * 4 + 0][0] = low.x;
        b[n][g64 * 4 + 0][1] = low.y;
        b[n][g64 * 4 + 1][0] = low.z;
        b[n][g64 * 4 + 1][1] = low.w;
        b[n][g64 * 4 + 2][0] = high.x;
        b[n][g64 * 4 + 2][1] = high.y;
        b[n][g64 * 4 + 3][0] = high.z;
        b[n][g64 * 4 + 3][1] = high.w;
      }
      wt[n] = *reinterpret_cast<const float2*>(row_weights + n * 8 + 2 * quad);
    }
  };
  // Called by every thread of the CTA for the same rows in the same order (the barriers below).
  auto load_query = [&](int r) {
    if (convert_query) {
      // The CTA converts the bf16 row from p.query into s_query together (kPerThread elements a
      // thread), the same f16 copy and weights as PrepareQueryKernel writes (x 2^e is exact in
      // fp32, as ldexpf is).
      constexpr int kVectors = kHeads * kHeadDim / 8 / kThreads;  // 16-byte vectors a thread
      static_assert(kVectors * 8 * kThreads == kHeads * kHeadDim, "query not a multiple");
      const uint4* source = reinterpret_cast<const uint4*>(
          static_cast<const __nv_bfloat16*>(p.query) + static_cast<int64_t>(r) * kHeads * kHeadDim);
      uint4 v[kVectors];
      __nv_bfloat162 amax2 = __floats2bfloat162_rn(0.0f, 0.0f);
#pragma unroll
      for (int k = 0; k < kVectors; ++k) {
        v[k] = source[threadIdx.x + k * kThreads];
        const uint32_t words[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          __nv_bfloat162 pair;
          memcpy(&pair, &words[j], 4);
          amax2 = __hmax2(amax2, __habs2(pair));  // NaN ignored, as fmaxf does
        }
      }
      float amax = fmaxf(__low2float(amax2), __high2float(amax2));
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      }
      __syncthreads();  // every warp is done with the previous row's s_query and s_amax
      if (lane == 0) s_amax[warp] = amax;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, s_amax[w]);
      const int e = QueryExponent(amax);
      const float scale = ldexpf(1.0f, e);  // 2^e, e in [-100, 100]: a normal float
#pragma unroll
      for (int k = 0; k < kVectors; ++k) {
        uint32_t words[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const __half2 f16 = __floats2half2_rn(__uint_as_float(words[j] << 16) * scale,
                                                __uint_as_float(words[j] & 0xffff0000u) * scale);
          memcpy(&words[j], &f16, 4);
        }
        reinterpret_cast<uint4*>(s_query)[threadIdx.x + k * kThreads] =
            make_uint4(words[0], words[1], words[2], words[3]);
      }
      for (int h = threadIdx.x; h < kHeads; h += kThreads) {
        s_weights[h] = ldexpf(p.head_weights[static_cast<int64_t>(r) * kHeads + h], -e);
      }
      __syncthreads();
      load_fragments(s_query, s_weights);
    } else {
      load_fragments(workspace.query + static_cast<int64_t>(r) * kHeads * kHeadDim,
                     workspace.weights + static_cast<int64_t>(r) * kHeads);
    }
    row_position = p.row_position[r];
    row_score_offset = p.row_score_offset[r];
    loaded_row = r;
  };
  // The first row's query travels while the first stages load.
  if (const int g0 = s_group[0]; p.group_first_row[g0] < p.group_first_row[g0 + 1]) {
    load_query(p.group_first_row[g0]);
  }
  const int slot_low = warp * 16 + lane / 4;  // A rows slot_low and slot_low + 8
  for (int i = 0; i < count; ++i) {
    MbarrierWait(&full[i % kStages], (i / kStages) & 1);
    __syncthreads();  // every thread is done with block i - 1: its stage may be refilled
    load_stage(i + kStages - 1);
    const uint8_t* stage = stages + (i % kStages) * kStageBytes;
    const float* scales = reinterpret_cast<const float*>(stage + kCacheBlockSize * kHeadDim);
    const int g = s_group[i];
    const int64_t logical = s_logical[i], entry_block = s_entry_block[i];
    const int64_t num_slots = p.group_num_slots[g];
    const int row_end = p.group_first_row[g + 1];
    for (int r = p.group_first_row[g]; r < row_end; ++r) {
      if (r != loaded_row) load_query(r);
      float acc[kTiles][4];
#pragma unroll
      for (int n = 0; n < kTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
      for (int g64 = 0; g64 < kGroups64; ++g64) {
        const uint4 top =
            *reinterpret_cast<const uint4*>(stage + slot_low * kHeadDim + g64 * 64 + 16 * quad);
        const uint4 bottom = *reinterpret_cast<const uint4*>(stage + (slot_low + 8) * kHeadDim +
                                                             g64 * 64 + 16 * quad);
        const uint32_t top_words[4] = {top.x, top.y, top.z, top.w};
        const uint32_t bottom_words[4] = {bottom.x, bottom.y, bottom.z, bottom.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t a[4];
          Fp8x4ToF16x2x2(top_words[j], a[0], a[2]);
          Fp8x4ToF16x2x2(bottom_words[j], a[1], a[3]);
#pragma unroll
          for (int n = 0; n < kTiles; ++n) {
            MmaF16(acc[n], a, b[n][g64 * 4 + j][0], b[n][g64 * 4 + j][1]);
          }
        }
      }
      // acc[n][0..1]: slot slot_low, heads n * 8 + 2 quad + {0, 1}; acc[n][2..3]: slot_low + 8.
      float low0 = 0.0f, low1 = 0.0f, high0 = 0.0f, high1 = 0.0f;  // four FFMA chains
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {
        low0 = fmaf(wt[n].x, ReluKeepNaN(acc[n][0]), low0);
        low1 = fmaf(wt[n].y, ReluKeepNaN(acc[n][1]), low1);
        high0 = fmaf(wt[n].x, ReluKeepNaN(acc[n][2]), high0);
        high1 = fmaf(wt[n].y, ReluKeepNaN(acc[n][3]), high1);
      }
      float low = low0 + low1, high = high0 + high1;
      low += __shfl_xor_sync(0xffffffffu, low, 1);
      low += __shfl_xor_sync(0xffffffffu, low, 2);
      high += __shfl_xor_sync(0xffffffffu, high, 1);
      high += __shfl_xor_sync(0xffffffffu, high, 2);
      if (quad < 2) {
        const int s = slot_low + 8 * quad;
        const float total = quad == 0 ? low : high;
        const int64_t slot = logical * kCacheBlockSize + s;
        const bool visible = slot <= row_position && slot < num_slots;
        p.scores[row_score_offset + entry_block * kCacheBlockSize + s] =
            visible ? scales[s] * total : -INFINITY;
      }
    }
  }
}

ScanQueryPrep ResolveQueryPrep(const ScanParams& p) {
  if (p.query_prep != ScanQueryPrep::kAuto) return p.query_prep;
  return p.num_rows <= p.num_groups ? ScanQueryPrep::kInKernel : ScanQueryPrep::kWorkspace;
}

template <int kHeads, int kHeadDim>
cudaError_t Launch(const ScanParams& p, cudaStream_t stream) {
  auto kernel = ScanTensorCoreKernel<kHeads, kHeadDim>;
  constexpr size_t smem = SmemBytes<kHeads, kHeadDim>();
  // The host work between launches lands on the GPU's timeline of a short scan, so the kernel's
  // shared-memory attribute is set, and the SM count read, once a device (then cached).
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  static std::atomic<int> configured_sms[kMaxDevices];  // 0 until configured on that device
  int num_sms = device < kMaxDevices ? configured_sms[device].load(std::memory_order_acquire) : 0;
  if (num_sms == 0) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
        e != cudaSuccess) {
      return e;
    }
    if (cudaError_t e = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
        e != cudaSuccess) {
      return e;
    }
    if (device < kMaxDevices) configured_sms[device].store(num_sms, std::memory_order_release);
  }
  const bool convert_query = ResolveQueryPrep(p) == ScanQueryPrep::kInKernel;
  if (!convert_query) {
    PrepareQueryKernel<<<static_cast<unsigned>(p.num_rows), kPrepareThreads, 0, stream>>>(p);
  }
  // Two CTAs per SM, each a contiguous chunk of blocks (up to kMaxChunk).
  const int64_t ctas_wanted = 2LL * num_sms;
  int64_t chunk = (p.total_blocks + ctas_wanted - 1) / ctas_wanted;
  chunk = chunk < 1 ? 1 : (chunk > kMaxChunk ? kMaxChunk : chunk);
  int64_t grid = (p.total_blocks + chunk - 1) / chunk;
  if (p.device_total_blocks != nullptr) {
    // Enough CTAs for any total up to the bound: the kernel splits the device total the same way.
    const int64_t saturated = (p.total_blocks + kMaxChunk - 1) / kMaxChunk;
    grid = std::min<int64_t>(p.total_blocks, std::max<int64_t>(ctas_wanted, saturated));
  }
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(
      p, static_cast<int>(chunk), static_cast<int>(ctas_wanted), convert_query);
  return cudaGetLastError();
}
}  // namespace tc

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

size_t ScanTensorCoresScratchBytes(const ScanParams& p) {
  if (p.query_prep == ScanQueryPrep::kInKernel) return 0;
  if (p.num_rows <= 0 || p.num_heads <= 0 || p.head_dim <= 0) return 0;
  return size_t{1} * p.num_rows * p.num_heads * (size_t{2} * p.head_dim + 4);
}

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
    } else if (p.num_heads != 16 && p.num_heads != 32 && p.num_heads != 64) {
      reason = "num_heads is not 16, 32 or 64";
    } else if (p.query_dtype != QueryDtype::kBFloat16) {
      reason = "query_dtype is not bf16";
    } else if (p.query_prep != ScanQueryPrep::kAuto && p.query_prep != ScanQueryPrep::kWorkspace &&
               p.query_prep != ScanQueryPrep::kInKernel) {
      reason = "query_prep is not a ScanQueryPrep";
    } else if (p.total_blocks > 0 && ScanTensorCoresScratchBytes(p) > 0 &&
               (p.workspace == nullptr || p.workspace_bytes < ScanTensorCoresScratchBytes(p))) {
      reason = "workspace missing or smaller than ScanTensorCoresScratchBytes";
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
  switch (p.num_heads * 1000 + p.head_dim) {
    case 64128:
      return tc::Launch<64, 128>(p, stream);
    case 64064:
      return tc::Launch<64, 64>(p, stream);
    case 32128:
      return tc::Launch<32, 128>(p, stream);
    case 32064:
      return tc::Launch<32, 64>(p, stream);
    case 16128:
      return tc::Launch<16, 128>(p, stream);
    default:
      return tc::Launch<16, 64>(p, stream);
  }
}

}  // namespace dsa::cuda
