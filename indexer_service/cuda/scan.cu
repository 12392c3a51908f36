// The GPU scans (see scan.h). Both kernels give one CTA to one (group, block) pair: the CTA stages
// the block's 64 keys in shared memory once and scores them for every row of the group, so
// verifier rows of one sequence share the key read.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "indexer_service/cuda/dependent_launch.cuh"
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

// The group whose block range holds entry `block` of the flattened block list: the last g with
// group_block_offset[g] <= block.
__device__ inline int FindGroup(const ScanParams& p, int64_t block) {
  int lo = 0, hi = p.num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.group_block_offset[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ inline BlockWork FindBlockWork(const ScanParams& p, int64_t block) {
  const int lo = FindGroup(p, block);
  BlockWork w;
  w.group = lo;
  w.entry_block = block - p.group_block_offset[lo];
  w.logical_block = p.logical_blocks[block];
  const int32_t pool_block = p.block_tables[p.group_table_offset[lo] + w.logical_block];
  w.block = p.pool + CacheBlockBytes(p.head_dim) * pool_block;
  w.num_slots = p.group_num_slots[lo];
  return w;
}

// Writes the scaled, masked score of slot s of the CTA's block for row r.
__device__ inline void StoreScore(const ScanParams& p, const BlockWork& w, int r, int s,
                                  float scale, float total) {
  const int64_t slot = w.logical_block * kBlockSize + s;
  const bool visible = slot <= p.row_position[r] && slot < w.num_slots;
  p.scores[p.row_score_offset[r] + w.entry_block * kBlockSize + s] =
      visible ? scale * total : -INFINITY;
}

// ---- CUDA-core scan ------------------------------------------------------------------------
constexpr int kCudaCoreThreads = 256;
constexpr int kHeadLanes = kCudaCoreThreads / kBlockSize;  // 4 threads per slot

// Thread (slot s = tid % 64, head lane hl = tid / 64) sums heads hl, hl + 4, ...; the four partial
// sums meet in shared memory. Keys are decoded to fp32 [64][head_dim + 1] (padded: no conflicts).
template <typename Q>
__global__ void __launch_bounds__(kCudaCoreThreads) ScanCudaCoreKernel(ScanParams p) {
  extern __shared__ float smem[];
  const int stride = p.head_dim + 1;
  float* keys = smem;                           // [64][head_dim + 1]
  float* partial = smem + kBlockSize * stride;  // [kHeadLanes][64]
  BeginDependentKernel();
  if (p.device_total_blocks != nullptr && blockIdx.x >= *p.device_total_blocks) return;
  const BlockWork w = FindBlockWork(p, blockIdx.x);
  const int64_t key_bytes = int64_t{kBlockSize} * p.head_dim;
  for (int i = threadIdx.x; i < key_bytes; i += kCudaCoreThreads) {
    keys[(i / p.head_dim) * stride + i % p.head_dim] = DecodeFp8E4m3Device(w.block[i]);
  }
  __syncthreads();
  const int s = threadIdx.x % kBlockSize;
  const int head_lane = threadIdx.x / kBlockSize;
  const float scale = reinterpret_cast<const float*>(w.block + key_bytes)[s];
  const Q* query = static_cast<const Q*>(p.query);
  for (int r = p.group_first_row[w.group]; r < p.group_first_row[w.group + 1]; ++r) {
    float total = 0.0f;
    for (int h = head_lane; h < p.num_heads; h += kHeadLanes) {
      const Q* q = query + (static_cast<int64_t>(r) * p.num_heads + h) * p.head_dim;
      const float* k = keys + s * stride;
      float dot = 0.0f;
      for (int d = 0; d < p.head_dim; ++d) dot = fmaf(LoadAsFloat(q + d), k[d], dot);
      total = fmaf(p.head_weights[static_cast<int64_t>(r) * p.num_heads + h],
                   dot < 0.0f ? 0.0f : dot, total);
    }
    partial[head_lane * kBlockSize + s] = total;
    __syncthreads();
    if (head_lane == 0) {
      float sum = 0.0f;
      for (int i = 0; i < kHeadLanes; ++i) sum += partial[i * kBlockSize + s];
      StoreScore(p, w, r, s, scale, sum);
    }
    __syncthreads();
  }
}

size_t CudaCoreSmemBytes(int head_dim) {
  return sizeof(float) * (kBlockSize * (head_dim + 1) + kHeadLanes * kBlockSize);
}

// ---- tensor-core scan: shared pieces ------------------------------------------------------
// The stage layout, mbarrier and bulk-copy (TMA) helpers, the fp8 -> f16 widening, the epilogue's
// ReLU and the query conversion (PrepareQueryKernel, ScanQueryPrep) that the wgmma scan (namespace
// wg below) builds on. They first served the f16 mma.sync kernel of steps 2-8 (docs/gpu_kernels.md;
// removed after the wgmma kernel replaced it: see commit 5cc5a70 for it).
//
// K is permuted (the dot product does not care, as long as A and B agree): k-step k, lane quad
// position c, register half j take dim (k / 4) * 64 + 16 c + 4 (k % 4) + {0, 1} (a0/a1, b0) and
// + {2, 3} (a2/a3, b1), so one 16-byte shared-memory load per key row feeds four k-steps and one
// 16-byte global load per head two.
namespace tc {

constexpr int kMaxDevices = 64;  // devices whose launch configuration is cached

// A stage is one whole cache block as the pool holds it (64 x kHeadDim codes, then 64 scales),
// brought in by one bulk asynchronous copy (TMA) that completes on the stage's mbarrier. The
// 16-byte key loads of a quarter-warp (rows g, g + 1, 128 bytes apart) hit the same banks twice:
// a 2-way conflict on 2 x kHeadDim / 64 shared loads a warp a block, cheaper than the ~4 cp.async
// (with their address arithmetic) a thread a block that a padded layout needed.
template <int kHeadDim>
__host__ __device__ constexpr int StageBytes() {
  return kBlockSize * (kHeadDim + 4);
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
  BeginDependentKernel();
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

ScanQueryPrep ResolveQueryPrep(const ScanParams& p) {
  if (p.query_prep != ScanQueryPrep::kAuto) return p.query_prep;
  return p.num_rows <= p.num_groups ? ScanQueryPrep::kInKernel : ScanQueryPrep::kWorkspace;
}

}  // namespace tc

// ---- tensor-core scan on wgmma (sm_90a) ----------------------------------------------------
// The same contract, work split, ring of TMA-loaded whole blocks and epilogue as the mma.sync
// scan of steps 2-8 had (commit 5cc5a70), but the MMA is one warpgroup's asynchronous
// wgmma.m64nNk16 (f16 in, fp32 accumulation): A = the block's 64 keys (M = 64 slots, warp w owns
// slots [16 w, 16 w + 16) as before), widened to f16 in registers exactly as before; B = the row's
// f16 query (K = head_dim, N = num_heads / 2: two halves) in shared memory, read by the
// tensor cores through a matrix descriptor. A block is head_dim / 16 wgmma instructions a warpgroup
// for each half of the heads (2 x 8 at D = 128) instead of 64 mma.sync a warp, and the query no
// longer takes 128 registers a thread, so more CTAs share an SM. docs/gpu_kernels.md steps 11-12
// have the measurements.
//
// A's register fragment (per warp: a0..a7 as four f16x2 words) is the mma.m16n8k16 one, so the
// K permutation above holds: k-step k, lane quad position c, word half h take dims
// (k / 4) * 64 + 16 c + 4 (k % 4) + 2 h + {0, 1}. B is stored in that permuted K order, in the
// canonical no-swizzle K-major layout: 8 x 8 "core matrices" of 8 heads x 8 (permuted) dims,
// 16 bytes a head; a k-step's tile is kHeads / 8 pairs of core matrices (the two K halves 128
// bytes apart: the leading byte offset; pairs 256 bytes apart: the stride byte offset), tiles
// kHeads * 32 bytes apart.
namespace wg {

// The tuning of steps 11-12 (docs/gpu_kernels.md): 4 CTAs a SM with 4 stages each, 2 CTAs a SM
// for short scans, at most 256 blocks a CTA.
constexpr int kThreads = 128;  // one warpgroup
constexpr int kWarps = kThreads / 32;
constexpr int kCtasPerSm = 4;
constexpr int kStages = 4;
constexpr int kShortCtasPerSm = 2;
constexpr int kMaxChunk = 256;  // blocks per CTA
// A warp waiting for a stage may be suspended up to this long (ns) before it asks again.
constexpr int kSuspendHintNs = 10000000;

// Shared memory: the row's f16 query in the wgmma layout (at the base: 16-byte aligned), the
// stages, the head weights, the stages' mbarriers, the chunk's block addresses, the warps' largest
// magnitudes.
template <int kHeads, int kHeadDim>
constexpr size_t SmemBytes() {
  return size_t{2} * kHeads * kHeadDim + size_t{kStages} * tc::StageBytes<kHeadDim>() + 4 * kHeads +
         kStages * 8 + kMaxChunk * (4 * 4) + 4 * kWarps;
}

// Byte offset in the B layout of query word w (dims 2 w, 2 w + 1) of head n: the inverse of the
// K permutation (k-step k = 4 (w / 32) + (w % 8) / 2, half h = w % 2, quad position c =
// (w % 32) / 8).
template <int kHeads>
__device__ inline uint32_t QueryWordOffset(int n, int w) {
  const int step = 4 * (w / 32) + (w % 8) / 2;
  return step * (kHeads * 32) + (n / 8) * 256 + (w % 2) * 128 + (n % 8) * 16 + ((w % 32) / 8) * 4;
}

// The matrix descriptor of B for k-step 0 (no swizzle; leading byte offset 128, stride byte
// offset 256, both in 16-byte units; the start address likewise). K-step k adds k * kHeads * 32
// bytes to the start address.
__device__ inline uint64_t QueryDescriptor(const void* s_query) {
  const uint64_t start = (tc::SmemAddress(s_query) >> 4) & 0x3fff;
  return start | (uint64_t{128 >> 4} << 16) | (uint64_t{256 >> 4} << 32);
}

__device__ inline void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits for the phase of `bar` with the given parity; while it is not complete the warp may be
// suspended (up to the hint, then it asks again) instead of spinning: a warp waiting for its keys
// takes no issue slots from the CTAs that have theirs (with 4 CTAs a SM, and in a short scan
// where every warp waits for its first block at once).
__device__ inline void WaitPhase(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(tc::SmemAddress(bar)),
      "r"(parity), "n"(kSuspendHintNs)
      : "memory");
}

// Waits until at most kPending of this warpgroup's committed groups are still running.
template <int kPending>
__device__ inline void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses of the accumulators across the asynchronous region.
template <int kCount>
__device__ inline void FenceOperands(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// N = 8 heads (4 accumulators a thread); B through its descriptor. The first k-step
// overwrites d (scale-d false; d written, not read, as far as the compiler knows).
template <bool kAccumulate>
__device__ inline void WgmmaF16N8(float (&d)[4], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (kAccumulate) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %9, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %9, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(0));
  }
}
// N = 16 heads (8 accumulators a thread); B through its descriptor. The first k-step
// overwrites d (scale-d false; d written, not read, as far as the compiler knows).
template <bool kAccumulate>
__device__ inline void WgmmaF16N16(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (kAccumulate) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
        "{%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
        "{%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]),
          "=f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(0));
  }
}
// N = 32 heads (16 accumulators a thread); B through its descriptor. The first k-step
// overwrites d (scale-d false; d written, not read, as far as the compiler knows).
template <bool kAccumulate>
__device__ inline void WgmmaF16N32(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (kAccumulate) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "{%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
        "{%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]),
          "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]),
          "=f"(d[14]), "=f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(0));
  }
}
template <int kN, bool kAccumulate>
__device__ inline void Wgmma(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (kN == 32) {
    WgmmaF16N32<kAccumulate>(d, a, desc);
  } else if constexpr (kN == 16) {
    WgmmaF16N16<kAccumulate>(d, a, desc);
  } else {
    WgmmaF16N8<kAccumulate>(d, a, desc);
  }
}

template <int kHeads, int kHeadDim>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    ScanWgmmaKernel(ScanParams p, int chunk, int ctas_wanted, bool convert_query) {
  BeginDependentKernel();
  constexpr int kStageBytes = tc::StageBytes<kHeadDim>();
  constexpr int kGroups64 = kHeadDim / 64;
  constexpr int kSteps = kHeadDim / 16;
  constexpr int kTiles = kHeads / 8;
  constexpr int kVectors = kHeads * kHeadDim / 8 / kThreads;  // 16-byte query vectors a thread
  static_assert(kVectors * 8 * kThreads == kHeads * kHeadDim, "query not a multiple");
  static_assert(kHeads <= kThreads, "one head weight a thread");
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* s_query = smem;
  uint8_t* stages = smem + 2 * kHeads * kHeadDim;
  float* s_weights = reinterpret_cast<float*>(stages + kStages * kStageBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(s_weights + kHeads);
  int32_t* s_pool_block = reinterpret_cast<int32_t*>(full + kStages);
  int32_t* s_group = s_pool_block + kMaxChunk;
  int32_t* s_logical = s_group + kMaxChunk;
  int32_t* s_entry_block = s_logical + kMaxChunk;
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
    for (int s = 0; s < kStages; ++s) tc::MbarrierInit(&full[s]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }

  // The loaded row: its query in flight (v, raw_weight) between FetchQuery and StoreQuery, its
  // position and first score entry after (its weights, scaled by 2^-e, in s_weights: read there
  // by the epilogue, where 16 registers a thread held them at the price of spills at 4 CTAs a SM).
  const tc::QueryWorkspace workspace = tc::SplitWorkspace(p.workspace, p);
  uint4 v[kVectors];
  float raw_weight = 0.0f;
  int64_t row_position = 0, row_score_offset = 0;
  int loaded_row = -1;
  // Starts the loads of row r's query (bf16 from p.query, or f16 from the workspace) and its
  // head weights, position and first score entry.
  auto fetch_query = [&](int r) {
    const uint4* source =
        convert_query ? reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.query) +
                                                       static_cast<int64_t>(r) * kHeads * kHeadDim)
                      : reinterpret_cast<const uint4*>(workspace.query +
                                                       static_cast<int64_t>(r) * kHeads * kHeadDim);
#pragma unroll
    for (int k = 0; k < kVectors; ++k) v[k] = source[threadIdx.x + k * kThreads];
    if (threadIdx.x < kHeads) {
      raw_weight =
          (convert_query ? p.head_weights
                         : workspace.weights)[static_cast<int64_t>(r) * kHeads + threadIdx.x];
    }
    row_position = p.row_position[r];
    row_score_offset = p.row_score_offset[r];
  };
  // Called by every thread of the CTA for the same rows in the same order (the barriers): writes
  // the fetched row's f16 query into the B layout and its weights into s_weights (with kInKernel
  // the same f16 copy and weights as PrepareQueryKernel writes: x 2^e is exact in fp32).
  auto store_query = [&](int r) {
    int e = 0;
    if (convert_query) {
      __nv_bfloat162 amax2 = __floats2bfloat162_rn(0.0f, 0.0f);
#pragma unroll
      for (int k = 0; k < kVectors; ++k) {
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
      __syncthreads();  // every warp is done with the previous row's s_query, s_weights, s_amax
      if (lane == 0) s_amax[warp] = amax;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, s_amax[w]);
      e = tc::QueryExponent(amax);
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
        v[k] = make_uint4(words[0], words[1], words[2], words[3]);
      }
    } else {
      __syncthreads();  // every warp is done with the previous row's s_query and s_weights
    }
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
      const int vector = threadIdx.x + k * kThreads;  // elements [8 vector, 8 vector + 8)
      const int n = vector * 8 / kHeadDim, w = (vector * 8 % kHeadDim) / 2;
      const uint32_t words[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        *reinterpret_cast<uint32_t*>(s_query + QueryWordOffset<kHeads>(n, w + j)) = words[j];
      }
    }
    if (threadIdx.x < kHeads) {
      s_weights[threadIdx.x] = convert_query ? ldexpf(raw_weight, -e) : raw_weight;
    }
    // The tensor cores read s_query through the async proxy: order the generic writes first.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    loaded_row = r;
  };
  // The chunk's first row is fetched before anything waits: its query travels with the block
  // table reads and the first key loads.
  int first_row = -1;
  if (const int g0 = FindGroup(p, first); p.group_first_row[g0] < p.group_first_row[g0 + 1]) {
    first_row = p.group_first_row[g0];
    fetch_query(first_row);
  }
  __syncthreads();  // the barriers are initialized before any thread starts a load on them

  const int64_t block_bytes = CacheBlockBytes(kHeadDim);
  // Thread i resolves block i of the chunk and, for the first kStages, starts its load at once
  // (no barrier between the last dependent read and the copy).
  for (int i = threadIdx.x; i < count; i += kThreads) {
    const BlockWork w = FindBlockWork(p, first + i);
    const int32_t pool_block = p.block_tables[p.group_table_offset[w.group] + w.logical_block];
    if (i < kStages) {
      tc::BulkLoad(stages + i * kStageBytes, p.pool + block_bytes * pool_block, kStageBytes,
                   &full[i]);
    }
    s_pool_block[i] = pool_block;
    s_group[i] = w.group;
    s_logical[i] = static_cast<int32_t>(w.logical_block);
    s_entry_block[i] = static_cast<int32_t>(w.entry_block);
  }
  __syncthreads();
  if (first_row >= 0) store_query(first_row);

  // Thread 0 starts block i into stage i % kStages (whose previous block every thread is done
  // with: the caller has passed a __syncthreads after it).
  auto load_stage = [&](int i) {
    if (threadIdx.x == 0 && i < count) {
      tc::BulkLoad(stages + (i % kStages) * kStageBytes, p.pool + block_bytes * s_pool_block[i],
                   kStageBytes, &full[i % kStages]);
    }
  };
  const uint64_t desc0 = QueryDescriptor(s_query);
  const int slot_low = warp * 16 + lane / 4;      // A rows slot_low and slot_low + 8
  const int my_slot = slot_low + 8 * (quad & 1);  // the slot this thread stores (quad < 2)
  // Block i's keys as A fragments (f16) and this thread's slot's scale, from its stage.
  uint32_t a[kSteps][4];
  auto load_keys = [&](int i, float& scale) {
    const uint8_t* stage = stages + (i % kStages) * kStageBytes;
#pragma unroll
    for (int g64 = 0; g64 < kGroups64; ++g64) {
      const uint4 top =
          *reinterpret_cast<const uint4*>(stage + slot_low * kHeadDim + g64 * 64 + 16 * quad);
      const uint4 bottom =
          *reinterpret_cast<const uint4*>(stage + (slot_low + 8) * kHeadDim + g64 * 64 + 16 * quad);
      const uint32_t top_words[4] = {top.x, top.y, top.z, top.w};
      const uint32_t bottom_words[4] = {bottom.x, bottom.y, bottom.z, bottom.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        tc::Fp8x4ToF16x2x2(top_words[j], a[g64 * 4 + j][0], a[g64 * 4 + j][2]);
        tc::Fp8x4ToF16x2x2(bottom_words[j], a[g64 * 4 + j][1], a[g64 * 4 + j][3]);
      }
    }
    scale = reinterpret_cast<const float*>(stage + kBlockSize * kHeadDim)[my_slot];
  };
  // The heads in kParts parts (N = kHeads / kParts each, one commit group each), so that the
  // epilogue of the first part runs while the tensor cores work on the second.
  constexpr int kParts = 2;
  constexpr int kPartHeads = kHeads / kParts;
  constexpr int kPartTiles = kTiles / kParts;
  // Starts acc = A B for the loaded row (asynchronous until the epilogue's waits).
  auto issue = [&](float(&acc)[kParts][kPartHeads / 2]) {
    WgmmaFence();
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
      const uint64_t desc = desc0 + ((part * kPartHeads * 32) >> 4);
      Wgmma<kPartHeads, false>(acc[part], a[0], desc);
#pragma unroll
      for (int k = 1; k < kSteps; ++k) {
        Wgmma<kPartHeads, true>(acc[part], a[k], desc + ((k * kHeads * 32) >> 4));
      }
      WgmmaCommit();
    }
  };
  // What a block's epilogue needs besides the accumulators and the loaded row.
  struct BlockMeta {
    int64_t logical, entry_block, num_slots;
    float scale;
  };
  // Waits for each part, then ReLU, head weights, the heads summed in the thread and across the
  // quad, scale and mask. acc[part][4 n + 0..1]: slot slot_low, heads (part * kPartTiles + n) * 8
  // + 2 quad + {0, 1}; acc[part][4 n + 2..3]: slot_low + 8.
  auto epilogue = [&](float(&acc)[kParts][kPartHeads / 2], const BlockMeta& m) {
    float low0 = 0.0f, low1 = 0.0f, high0 = 0.0f, high1 = 0.0f;  // four FFMA chains
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
      if (part + 1 < kParts) {
        WgmmaWait<1>();
      } else {
        WgmmaWait<0>();
      }
      FenceOperands(acc[part]);
#pragma unroll
      for (int n = 0; n < kPartTiles; ++n) {
        const float2 w =
            *reinterpret_cast<const float2*>(s_weights + (part * kPartTiles + n) * 8 + 2 * quad);
        low0 = fmaf(w.x, tc::ReluKeepNaN(acc[part][4 * n + 0]), low0);
        low1 = fmaf(w.y, tc::ReluKeepNaN(acc[part][4 * n + 1]), low1);
        high0 = fmaf(w.x, tc::ReluKeepNaN(acc[part][4 * n + 2]), high0);
        high1 = fmaf(w.y, tc::ReluKeepNaN(acc[part][4 * n + 3]), high1);
      }
    }
    float low = low0 + low1, high = high0 + high1;
    low += __shfl_xor_sync(0xffffffffu, low, 1);
    low += __shfl_xor_sync(0xffffffffu, low, 2);
    high += __shfl_xor_sync(0xffffffffu, high, 1);
    high += __shfl_xor_sync(0xffffffffu, high, 2);
    if (quad < 2) {
      const float total_score = quad == 0 ? low : high;
      const int64_t slot = m.logical * kBlockSize + my_slot;
      const bool visible = slot <= row_position && slot < m.num_slots;
      p.scores[row_score_offset + m.entry_block * kBlockSize + my_slot] =
          visible ? m.scale * total_score : -INFINITY;
    }
  };
  // The group of the last block begun: its filled slots and rows, read again only when the group
  // changes (off the path between a block's arrival and its MMA).
  int cached_group = -1, group_row_begin = 0, group_row_end = 0;
  int64_t group_slots = 0;
  // Waits for block i and reads its bookkeeping.
  auto begin_block = [&](int i, BlockMeta& m, int& row_begin, int& row_end) {
    const int g = s_group[i];
    if (g != cached_group) {
      cached_group = g;
      group_slots = p.group_num_slots[g];
      group_row_begin = p.group_first_row[g];
      group_row_end = p.group_first_row[g + 1];
    }
    m.logical = s_logical[i];
    m.entry_block = s_entry_block[i];
    m.num_slots = group_slots;
    row_begin = group_row_begin;
    row_end = group_row_end;
    WaitPhase(&full[i % kStages], (i / kStages) & 1);
  };
  // As soon as every thread has its keys in registers, block i's stage takes block i + kStages:
  // kStages copies stay in flight while the CTA computes.
  auto release_stage = [&](int i) {
    __syncthreads();
    load_stage(i + kStages);
  };
  float acc[kParts][kPartHeads / 2];
  for (int i = 0; i < count; ++i) {
    BlockMeta m;
    int row_begin, row_end;
    begin_block(i, m, row_begin, row_end);
    if (row_end - row_begin == 1 && row_begin == loaded_row) {  // one row, loaded: the common case
      load_keys(i, m.scale);
      release_stage(i);
      issue(acc);
      epilogue(acc, m);
    } else {
      // Every row of the block, one after the other (the keys widened again for each row: cheaper
      // than holding their registers across a query load), then the stage is released.
      for (int r = row_begin; r < row_end; ++r) {
        if (r != loaded_row) {
          fetch_query(r);
          store_query(r);
        }
        load_keys(i, m.scale);
        issue(acc);
        epilogue(acc, m);
      }
      release_stage(i);
    }
  }
}

template <int kHeads, int kHeadDim>
cudaError_t Launch(const ScanParams& p, cudaStream_t stream) {
  auto kernel = ScanWgmmaKernel<kHeads, kHeadDim>;
  constexpr size_t smem = SmemBytes<kHeads, kHeadDim>();
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  static std::atomic<int> configured_sms[tc::kMaxDevices];  // 0 until configured on that device
  int num_sms =
      device < tc::kMaxDevices ? configured_sms[device].load(std::memory_order_acquire) : 0;
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
    if (device < tc::kMaxDevices) configured_sms[device].store(num_sms, std::memory_order_release);
  }
  const bool convert_query = tc::ResolveQueryPrep(p) == ScanQueryPrep::kInKernel;
  if (!convert_query) {
    if (cudaError_t e = LaunchDependent("prepare", tc::PrepareQueryKernel,
                                        dim3(static_cast<unsigned>(p.num_rows)),
                                        dim3(tc::kPrepareThreads), 0, stream, p);
        e != cudaSuccess) {
      return e;
    }
  }
  // kCtasPerSm CTAs per SM, each a contiguous chunk of blocks (up to kMaxChunk).
  // A short scan (under 8 blocks a CTA at kCtasPerSm) takes kShortCtasPerSm CTAs a SM, each with
  // more blocks: fewer query conversions a SM, more of each CTA's copies started at once.
  const int64_t ctas_wanted =
      int64_t{p.total_blocks < 8LL * kCtasPerSm * num_sms ? kShortCtasPerSm : kCtasPerSm} * num_sms;
  int64_t chunk = (p.total_blocks + ctas_wanted - 1) / ctas_wanted;
  chunk = chunk < 1 ? 1 : (chunk > kMaxChunk ? kMaxChunk : chunk);
  int64_t grid = (p.total_blocks + chunk - 1) / chunk;
  if (p.device_total_blocks != nullptr) {
    // Enough CTAs for any total up to the bound: the kernel splits the device total the same way.
    const int64_t saturated = (p.total_blocks + kMaxChunk - 1) / kMaxChunk;
    grid = std::min<int64_t>(p.total_blocks, std::max<int64_t>(ctas_wanted, saturated));
  }
  if (cudaError_t e = LaunchDependent("scan", kernel, dim3(static_cast<unsigned>(grid)),
                                      dim3(kThreads), smem, stream, p, static_cast<int>(chunk),
                                      static_cast<int>(ctas_wanted), convert_query);
      e != cudaSuccess) {
    return e;
  }
  return cudaGetLastError();
}

}  // namespace wg

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
    if (cudaError_t e =
            LaunchDependent("scan", kernel, dim3(grid), dim3(kCudaCoreThreads), smem, stream, p);
        e != cudaSuccess) {
      return e;
    }
  } else {
    auto kernel = ScanCudaCoreKernel<__nv_bfloat16>;
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
        e != cudaSuccess) {
      return e;
    }
    if (cudaError_t e =
            LaunchDependent("scan", kernel, dim3(grid), dim3(kCudaCoreThreads), smem, stream, p);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaGetLastError();
}

cudaError_t LaunchScanTensorCores(const ScanParams& p, cudaStream_t stream) {
  if (!CanImplementScanTensorCores(p)) return cudaErrorInvalidValue;
  if (p.total_blocks == 0) return cudaSuccess;
  switch (p.num_heads * 1000 + p.head_dim) {
    case 64128:
      return wg::Launch<64, 128>(p, stream);
    case 64064:
      return wg::Launch<64, 64>(p, stream);
    case 32128:
      return wg::Launch<32, 128>(p, stream);
    case 32064:
      return wg::Launch<32, 64>(p, stream);
    case 16128:
      return wg::Launch<16, 128>(p, stream);
    default:
      return wg::Launch<16, 64>(p, stream);
  }
}

}  // namespace dsa::cuda
