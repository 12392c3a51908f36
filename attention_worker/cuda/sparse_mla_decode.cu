// The GPU sparse MLA decode (see sparse_mla_decode.h): a CUDA-core kernel (one CTA per (row,
// head), the simple version the tensor-core one was first checked beside) and the tensor-core
// kernel (mma.sync bf16, split-KV, a log-sum-exp combine). docs/attention_gpu.md records how each
// step of the tensor-core kernel was predicted and measured.
#include <cuda_bf16.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "attention_worker/cuda/sparse_mla_decode.h"

namespace dsa::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ inline float Log2Scale(float softmax_scale) {
  return (softmax_scale != 0.0f ? softmax_scale : 0.041666666666666664f /* 1/sqrt(576) */) * kLog2e;
}

// Whether entry `slot` of a row's selection is attended: selected, causal, filled.
__device__ inline bool Attended(int32_t slot, int32_t position, int32_t num_slots) {
  return slot >= 0 && slot <= position && slot < num_slots;
}

// The latent row of `slot` in the row's sequence.
__device__ inline const __nv_bfloat16* LatentRow(const SparseMlaDecodeParams& p, int row,
                                                 int32_t slot) {
  const int32_t block =
      p.block_tables[static_cast<int64_t>(row) * p.max_blocks_per_row + slot / kBlockSize];
  return p.kv_pool + (static_cast<int64_t>(block) * kBlockSize + slot % kBlockSize) * kMlaKeyDim;
}

// ---- CUDA-core kernel ------------------------------------------------------------------------
constexpr int kCudaCoreThreads = 128;
constexpr int kCudaCoreWarps = kCudaCoreThreads / 32;
constexpr int kCudaCoreMaxTopK = 8192;  // logits in 32 KB of shared memory

__device__ inline float BlockReduce(float value, float* scratch, bool take_max) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = take_max ? fmaxf(value, other) : value + other;
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  value = scratch[0];
  for (int w = 1; w < kCudaCoreWarps; ++w) {
    value = take_max ? fmaxf(value, scratch[w]) : value + scratch[w];
  }
  __syncthreads();
  return value;
}

// CTA (head h, row r): a warp per selection entry computes its log2-scaled logit into shared
// memory; then the max and the sum of exp2; then each thread accumulates 4 value dims.
__global__ void __launch_bounds__(kCudaCoreThreads)
    SparseMlaDecodeCudaCoreKernel(SparseMlaDecodeParams p) {
  extern __shared__ float logits[];  // [top_k]
  __shared__ float scratch[kCudaCoreWarps];
  const int head = blockIdx.x, row = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int32_t position = p.positions[row], num_slots = p.num_slots[row];
  const int32_t* selection = p.selections + static_cast<int64_t>(row) * p.top_k;
  const __nv_bfloat16* q = p.query + (static_cast<int64_t>(row) * p.num_heads + head) * kMlaKeyDim;
  const float scale_log2 = Log2Scale(p.softmax_scale);
  for (int e = warp; e < p.top_k; e += kCudaCoreWarps) {
    const int32_t slot = selection[e];
    float logit = -INFINITY;
    if (Attended(slot, position, num_slots)) {
      const __nv_bfloat16* k = LatentRow(p, row, slot);
      float dot = 0.0f;
      for (int d = 2 * lane; d < kMlaKeyDim; d += 64) {
        const float2 qf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(q + d));
        const float2 kf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(k + d));
        dot = fmaf(qf.x, kf.x, fmaf(qf.y, kf.y, dot));
      }
      for (int offset = 16; offset > 0; offset /= 2) {
        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      }
      logit = dot * scale_log2;
    }
    if (lane == 0) logits[e] = logit;
  }
  __syncthreads();
  float local_max = -INFINITY;
  for (int e = threadIdx.x; e < p.top_k; e += kCudaCoreThreads)
    local_max = fmaxf(local_max, logits[e]);
  const float max_logit = BlockReduce(local_max, scratch, true);
  const float base = max_logit == -INFINITY ? 0.0f : max_logit;
  float local_sum = 0.0f;
  for (int e = threadIdx.x; e < p.top_k; e += kCudaCoreThreads) {
    const float weight = exp2f(logits[e] - base);
    logits[e] = weight;
    local_sum += weight;
  }
  const float sum = BlockReduce(local_sum, scratch, false);  // its barrier publishes the weights
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const int d = 4 * threadIdx.x;  // 128 threads x 4 = 512 value dims
  for (int e = 0; e < p.top_k; ++e) {
    const float weight = logits[e];
    if (weight == 0.0f) continue;  // unattended (or underflowed) entries read nothing
    const __nv_bfloat16* v = LatentRow(p, row, selection[e]) + d;
    const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(v));
    const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(v + 2));
    acc[0] = fmaf(weight, v01.x, acc[0]);
    acc[1] = fmaf(weight, v01.y, acc[1]);
    acc[2] = fmaf(weight, v23.x, acc[2]);
    acc[3] = fmaf(weight, v23.y, acc[3]);
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  __nv_bfloat16* o = p.out + (static_cast<int64_t>(row) * p.num_heads + head) * kMlaValueDim + d;
  *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(acc[0] * inv, acc[1] * inv);
  *reinterpret_cast<__nv_bfloat162*>(o + 2) = __floats2bfloat162_rn(acc[2] * inv, acc[3] * inv);
  if (p.lse != nullptr && threadIdx.x == 0) {
    p.lse[static_cast<int64_t>(row) * p.num_heads + head] =
        sum > 0.0f ? (max_logit + log2f(sum)) * kLn2 : -INFINITY;
  }
}

// ---- tensor-core kernel ----------------------------------------------------------------------
// CTA (64-head group, split, row), 8 warps. Shared memory holds the group's query (64 x 576 bf16)
// and two stages of 64 gathered latent rows (64 x 576 bf16 each), every 1152-byte row stored with
// its 16-byte chunks XOR-swizzled by (row & 7) so that ldmatrix's eight rows hit eight distinct
// bank groups; then P (64 heads x 64 slots bf16, swizzled alike), the two halves' row maxima and
// the rescale factors.
//   S = Q K^T: warp w computes heads [16 (w % 4), +16) x slots [32 (w / 4), +32) (k = 576).
//   Online softmax (log2 domain): the row max over both slot halves through shared memory.
//   O += P V: warp w owns heads [32 (w % 2), +32) x value dims [128 (w / 2), +128) (128 fp32
//   accumulators a thread), reading P and V (the tile's first 512 dims) through ldmatrix.
constexpr int kThreads = 256;
constexpr int kTileSlots = 64;
constexpr int kGroupHeads = 64;
constexpr int kRowChunks = kMlaKeyDim / 8;  // 72 chunks of 16 bytes
constexpr int kRowBytes = kMlaKeyDim * 2;   // 1152
constexpr int kTileBytes = kTileSlots * kRowBytes;
constexpr int kQueryBytes = kGroupHeads * kRowBytes;
constexpr int kPBytes = kGroupHeads * kTileSlots * 2;
constexpr int kSmemQuery = 0;
constexpr int kSmemKv = kSmemQuery + kQueryBytes;
constexpr int kSmemP = kSmemKv + 2 * kTileBytes;
constexpr int kSmemMax = kSmemP + kPBytes;         // float [2][64]
constexpr int kSmemAlpha = kSmemMax + 2 * 64 * 4;  // float [64]
constexpr int kSmemBias = kSmemAlpha + 64 * 4;     // float [2][64]: 0 or -inf per slot
constexpr int kSmemBytes = kSmemBias + 2 * kTileSlots * 4;
static_assert(kSmemBytes <= 227 * 1024, "fits one SM's shared memory");

__device__ inline uint32_t SmemAddress(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
// Byte offset of chunk `chunk` of row `row` in a swizzled tile of 1152-byte rows.
__device__ inline uint32_t SwizzledRow(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}
// Byte offset of chunk `chunk` (0..7) of row `row` of P (128-byte rows).
__device__ inline uint32_t SwizzledP(int row, int chunk) {
  return row * (kTileSlots * 2) + ((chunk ^ (row & 7)) << 4);
}

__device__ inline void CpAsync16(uint32_t smem, const void* global, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(global),
               "r"(fill ? 16 : 0)
               : "memory");
}
__device__ inline void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ inline void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ inline void Ldmatrix4(uint32_t address, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ inline void Ldmatrix4Trans(uint32_t address, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
// c += a b for one m16n8k16 tile (bf16 in, fp32 accumulators).
__device__ inline void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ inline uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Which tiles of a row's selection a split covers: [first, last) of ceil(top_k / 64).
struct SplitRange {
  int first, last;
};
__host__ __device__ inline int NumTiles(int top_k) { return (top_k + kTileSlots - 1) / kTileSlots; }
__host__ __device__ inline int TilesPerSplit(int top_k, int num_splits) {
  return (NumTiles(top_k) + num_splits - 1) / num_splits;
}

// Issues the gather of tile `tile` of the row's selection into stage `stage`: thread t copies 18
// chunks of slot entry t / 4; unattended entries are zero-filled and biased to -inf.
__device__ inline void LoadTile(const SparseMlaDecodeParams& p, int row, int tile, uint8_t* smem,
                                int stage, int32_t position, int32_t num_slots) {
  const int entry_in_tile = threadIdx.x / 4;
  const int entry = tile * kTileSlots + entry_in_tile;
  const int32_t slot =
      entry < p.top_k ? p.selections[static_cast<int64_t>(row) * p.top_k + entry] : -1;
  const bool attended = Attended(slot, position, num_slots);
  const uint8_t* src = attended ? reinterpret_cast<const uint8_t*>(LatentRow(p, row, slot))
                                : reinterpret_cast<const uint8_t*>(p.kv_pool);
  const uint32_t base = SmemAddress(smem + kSmemKv + stage * kTileBytes);
  for (int c = threadIdx.x % 4; c < kRowChunks; c += 4) {
    CpAsync16(base + SwizzledRow(entry_in_tile, c), src + 16 * c, attended);
  }
  if (threadIdx.x % 4 == 0) {
    reinterpret_cast<float*>(smem + kSmemBias)[stage * kTileSlots + entry_in_tile] =
        attended ? 0.0f : -INFINITY;
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    SparseMlaDecodeTensorCoreKernel(SparseMlaDecodeParams p, int num_splits, float* partial_out,
                                    float* partial_lse) {
  extern __shared__ __align__(128) uint8_t smem[];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the combine may start
#endif
  const int group = blockIdx.x, split = blockIdx.y, row = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int32_t position = p.positions[row], num_slots = p.num_slots[row];
  const int tiles_per_split = TilesPerSplit(p.top_k, num_splits);
  const int first_tile = split * tiles_per_split;
  const int last_tile = min(first_tile + tiles_per_split, NumTiles(p.top_k));

  // The group's query: 64 heads x 72 chunks, 18 a thread; with the first tile in group 0.
  {
    const uint8_t* q = reinterpret_cast<const uint8_t*>(
        p.query + (static_cast<int64_t>(row) * p.num_heads + group * kGroupHeads) * kMlaKeyDim);
    const uint32_t base = SmemAddress(smem + kSmemQuery);
    for (int i = threadIdx.x; i < kGroupHeads * kRowChunks; i += kThreads) {
      const int head = i / kRowChunks, c = i % kRowChunks;
      CpAsync16(base + SwizzledRow(head, c), q + head * kRowBytes + 16 * c, true);
    }
  }
  if (first_tile < last_tile) LoadTile(p, row, first_tile, smem, 0, position, num_slots);
  CpAsyncCommit();
  if (first_tile + 1 < last_tile) LoadTile(p, row, first_tile + 1, smem, 1, position, num_slots);
  CpAsyncCommit();

  const float scale_log2 = Log2Scale(p.softmax_scale);
  const int g = lane / 4, quad = lane % 4;
  // S layout: heads 16 qk_m + {g, g + 8}, slots 32 qk_n + 8 j + 2 quad + {0, 1}.
  const int qk_m = warp % 4, qk_n = warp / 4;
  // O layout: heads 32 pv_m + 16 mt + {g, g + 8}, dims 128 pv_n + 8 nt + 2 quad + {0, 1}.
  const int pv_m = warp % 2, pv_n = warp / 2;
  float m_run[2] = {-INFINITY, -INFINITY};  // running max (log2 domain) of S rows g, g + 8
  float l_run[2] = {0.0f, 0.0f};            // this thread's part of the running sums
  float o[2][16][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][nt][i] = 0.0f;
    }
  }
  float* row_max = reinterpret_cast<float*>(smem + kSmemMax);
  float* alpha_of_head = reinterpret_cast<float*>(smem + kSmemAlpha);
  const float* bias = reinterpret_cast<const float*>(smem + kSmemBias);
  const uint32_t q_base = SmemAddress(smem + kSmemQuery);
  const uint32_t p_base = SmemAddress(smem + kSmemP);

  for (int tile = first_tile; tile < last_tile; ++tile) {
    const int stage = (tile - first_tile) & 1;
    CpAsyncWait<1>();
    __syncthreads();
    const uint32_t kv_base = SmemAddress(smem + kSmemKv + stage * kTileBytes);

    // S = Q K^T for this warp's 16 heads x 32 slots.
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = 0.0f;
    }
    {
      const int a_row = 16 * qk_m + (lane & 15);
      const int matrix = lane >> 3;
      const int b_slot0 = 32 * qk_n + (matrix >> 1) * 8 + (lane & 7);
#pragma unroll 4
      for (int ks = 0; ks < kMlaKeyDim / 16; ++ks) {
        uint32_t a[4], b01[4], b23[4];
        Ldmatrix4(q_base + SwizzledRow(a_row, 2 * ks + (lane >> 4)), a);
        Ldmatrix4(kv_base + SwizzledRow(b_slot0, 2 * ks + (matrix & 1)), b01);
        Ldmatrix4(kv_base + SwizzledRow(b_slot0 + 16, 2 * ks + (matrix & 1)), b23);
        Mma(s[0], a, b01[0], b01[1]);
        Mma(s[1], a, b01[2], b01[3]);
        Mma(s[2], a, b23[0], b23[1]);
        Mma(s[3], a, b23[2], b23[3]);
      }
    }
    // Online softmax: logits in the log2 domain, masked by the stage's bias.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int slot = 32 * qk_n + 8 * j + 2 * quad;
      const float b0 = bias[stage * kTileSlots + slot], b1 = bias[stage * kTileSlots + slot + 1];
      s[j][0] = s[j][0] * scale_log2 + b0;
      s[j][1] = s[j][1] * scale_log2 + b1;
      s[j][2] = s[j][2] * scale_log2 + b0;
      s[j][3] = s[j][3] * scale_log2 + b1;
      tile_max[0] = fmaxf(tile_max[0], fmaxf(s[j][0], s[j][1]));
      tile_max[1] = fmaxf(tile_max[1], fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
    }
    const int head0 = 16 * qk_m + g;
    if (quad == 0) {
      row_max[qk_n * 64 + head0] = tile_max[0];
      row_max[qk_n * 64 + head0 + 8] = tile_max[1];
    }
    __syncthreads();
    float base[2], alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float both = fmaxf(row_max[head0 + 8 * h], row_max[64 + head0 + 8 * h]);
      const float m_new = fmaxf(m_run[h], both);
      base[h] = m_new == -INFINITY ? 0.0f : m_new;
      alpha[h] = exp2f(m_run[h] - base[h]);
      m_run[h] = m_new;
    }
    uint8_t* p_tile = smem + kSmemP;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p0 = exp2f(s[j][0] - base[0]), p1 = exp2f(s[j][1] - base[0]);
      const float p2 = exp2f(s[j][2] - base[1]), p3 = exp2f(s[j][3] - base[1]);
      l_run[0] = (j == 0 ? l_run[0] * alpha[0] : l_run[0]) + p0 + p1;
      l_run[1] = (j == 0 ? l_run[1] * alpha[1] : l_run[1]) + p2 + p3;
      const int chunk = 4 * qk_n + j;
      *reinterpret_cast<uint32_t*>(p_tile + SwizzledP(head0, chunk) + 4 * quad) = PackBf16(p0, p1);
      *reinterpret_cast<uint32_t*>(p_tile + SwizzledP(head0 + 8, chunk) + 4 * quad) =
          PackBf16(p2, p3);
    }
    if (qk_n == 0 && quad == 0) {
      alpha_of_head[head0] = alpha[0];
      alpha_of_head[head0 + 8] = alpha[1];
    }
    __syncthreads();

    // O = alpha O + P V for this warp's 32 heads x 128 value dims.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const float a_lo = alpha_of_head[32 * pv_m + 16 * mt + g];
      const float a_hi = alpha_of_head[32 * pv_m + 16 * mt + g + 8];
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        o[mt][nt][0] *= a_lo;
        o[mt][nt][1] *= a_lo;
        o[mt][nt][2] *= a_hi;
        o[mt][nt][3] *= a_hi;
      }
    }
#pragma unroll
    for (int ks = 0; ks < kTileSlots / 16; ++ks) {
      uint32_t a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int p_row = 32 * pv_m + 16 * mt + (lane & 15);
        Ldmatrix4(p_base + SwizzledP(p_row, 2 * ks + (lane >> 4)), a[mt]);
      }
      const int matrix = lane >> 3;
      const int v_slot = 16 * ks + (matrix & 1) * 8 + (lane & 7);
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t b[4];
        Ldmatrix4Trans(kv_base + SwizzledRow(v_slot, 16 * pv_n + 2 * np + (matrix >> 1)), b);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          Mma(o[mt][2 * np], a[mt], b[0], b[1]);
          Mma(o[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage
    if (tile + 2 < last_tile) LoadTile(p, row, tile + 2, smem, stage, position, num_slots);
    CpAsyncCommit();
  }
  CpAsyncWait<0>();

  // The row sums: a quad's parts, then both slot halves through shared memory (row_max reused).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  __syncthreads();
  const int head0 = 16 * qk_m + g;
  if (quad == 0) {
    row_max[qk_n * 64 + head0] = l_run[0];
    row_max[qk_n * 64 + head0 + 8] = l_run[1];
  }
  __syncthreads();
  const int64_t row_head0 = static_cast<int64_t>(row) * p.num_heads + group * kGroupHeads;
  if (qk_n == 0 && quad == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = row_max[head0 + 8 * h] + row_max[64 + head0 + 8 * h];
      const float lse = l > 0.0f ? (m_run[h] + log2f(l)) * kLn2 : -INFINITY;
      if (num_splits == 1) {
        if (p.lse != nullptr) p.lse[row_head0 + head0 + 8 * h] = lse;
      } else {
        partial_lse[(static_cast<int64_t>(row) * num_splits + split) * p.num_heads +
                    group * kGroupHeads + head0 + 8 * h] = lse;
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int head = 32 * pv_m + 16 * mt + g + 8 * h;
      const float l = row_max[head] + row_max[64 + head];
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      if (num_splits == 1) {
        __nv_bfloat16* out = p.out + (row_head0 + head) * kMlaValueDim + 128 * pv_n + 2 * quad;
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
          *reinterpret_cast<uint32_t*>(out + 8 * nt) =
              PackBf16(o[mt][nt][2 * h] * inv, o[mt][nt][2 * h + 1] * inv);
        }
      } else {
        float* out = partial_out +
                     ((static_cast<int64_t>(row) * num_splits + split) * p.num_heads +
                      group * kGroupHeads + head) *
                         kMlaValueDim +
                     128 * pv_n + 2 * quad;
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
          *reinterpret_cast<float2*>(out + 8 * nt) =
              make_float2(o[mt][nt][2 * h] * inv, o[mt][nt][2 * h + 1] * inv);
        }
      }
    }
  }
}

// ---- tensor-core kernel on wgmma (sm_90a) ----------------------------------------------------
// CTA (64-head group, split, row), two warpgroups. Shared memory holds the query and two stages
// of 64 gathered latent rows in the canonical 128-byte-swizzled layout of wgmma: each tile of 64
// rows x 576 dims is 9 panels of 64 dims; a panel is 64 rows x 128 bytes, row r's 16-byte chunk c
// at chunk c ^ (r & 7), so 8-row groups are 1024 bytes apart. The same panels are the keys
// (K-major B of S = Q K^T) and the values (N-major B of O = P V: a panel's rows are 8 slots x 64
// value dims apart by 1024 and 8192 bytes). P (64 heads x 64 slots bf16) is one such panel.
//   S: warpgroup w computes all 64 heads x slots [32 w, +32) (36 wgmma m64n32k16).
//   Online softmax (log2 domain): the row max over both halves through shared memory; a
//   thread's S rows are its O rows, so the rescale stays in registers.
//   O: warpgroup w owns all 64 heads x value dims [256 w, +256) (4 wgmma m64n256k16 a tile,
//   128 fp32 accumulators a thread).
constexpr int kPanelBytes = 64 * 128;     // 64 rows x 64 dims bf16
constexpr int kPanels = kMlaKeyDim / 64;  // 9
constexpr int kWgSmemQuery = 0;
constexpr int kWgSmemKv = kWgSmemQuery + kPanels * kPanelBytes;
constexpr int kWgSmemP = kWgSmemKv + 2 * kPanels * kPanelBytes;
constexpr int kWgSmemMax = kWgSmemP + kPanelBytes;                     // float [2][64]
constexpr int kWgSmemBias = kWgSmemMax + 2 * 64 * 4;                   // float [2][64]
constexpr int kWgSmemBytes = kWgSmemBias + 2 * kTileSlots * 4 + 1024;  // + alignment slack
static_assert(kWgSmemBytes <= 227 * 1024, "fits one SM's shared memory");

// Byte offset of 16-byte chunk `chunk` (0..71) of row `row` (0..63) in a swizzled tile.
__device__ inline uint32_t PanelOffset(int row, int chunk) {
  return (chunk >> 3) * kPanelBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// A wgmma shared-memory matrix descriptor with 128-byte swizzling; byte offsets as the PTX ISA
// defines them (K-major: stride = between 8-row groups, leading unused; N-major: leading =
// between 64-element panels along N, stride = between 8-row groups along K).
__device__ inline uint64_t SwizzledDescriptor(uint32_t address, uint32_t leading_bytes,
                                              uint32_t stride_bytes) {
  return uint64_t{(address & 0x3ffffu) >> 4} | (uint64_t{leading_bytes >> 4} << 16) |
         (uint64_t{stride_bytes >> 4} << 32) | (uint64_t{1} << 62);
}

__device__ inline void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending of this warpgroup's committed wgmma groups are still running.
template <int kPending>
__device__ inline void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Makes this thread's generic-proxy writes to shared memory (cp.async, st.shared) visible to
// the tensor cores' (async proxy) reads after the next barrier.
__device__ inline void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
template <int kCount>
__device__ inline void FenceOperands(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// S (+)= A B for m64n32k16: A = 64 query heads (K-major), B = 32 latent rows (K-major); d is
// overwritten when accumulate is 0.
__device__ inline void WgmmaQk(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// O += P V for m64n256k16: A = P (64 heads x 16 slots, K-major), B = V (16 slots x 256 value
// dims, N-major: the latent rows as they lie in shared memory, transposed by the instruction).
__device__ inline void WgmmaPv(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
      "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// Accumulator chains of S = Q K^T: k-step ks accumulates into chain ks % kQkChains, their sum is
// S. Four chains (so that consecutive wgmma do not wait on each other's accumulators) measured no
// faster than one on the H200 (docs/history/attention_gpu_steps.md, step 5): one, for the
// registers.
constexpr int kQkChains = 1;

// Issues S = Q K^T for this warpgroup's 32 slots of a stage (36 wgmma, one commit group; k-step
// ks reads dims [16 ks, +16): panel ks / 4, 32 (ks % 4) bytes into its 128-byte rows). The chains'
// sum is S.
__device__ inline void IssueQk(float (&qk)[kQkChains][16], uint64_t q_desc, uint64_t k_desc) {
  WgmmaFence();
#pragma unroll
  for (int ks = 0; ks < kMlaKeyDim / 16; ++ks) {
    const uint64_t offset = ((ks / 4) * kPanelBytes + (ks % 4) * 32) >> 4;
    WgmmaQk(qk[ks % kQkChains], q_desc + offset, k_desc + offset, ks >= kQkChains);
  }
  WgmmaCommit();
}

// The gather of a tile into a stage of the swizzled layout, in two halves that the loop issues
// apart (the block table read needs the selection entry, the cp.async the block): thread t
// gathers the 18 chunks (t % 4 + 4 j) of the tile's entry t / 4.
// The selection entry this thread gathers for `tile` (-1 past the selection or the split).
__device__ inline int32_t TileEntry(const SparseMlaDecodeParams& p, int row, int tile,
                                    int last_tile) {
  const int entry = tile * kTileSlots + static_cast<int>(threadIdx.x) / 4;
  return tile < last_tile && entry < p.top_k
             ? p.selections[static_cast<int64_t>(row) * p.top_k + entry]
             : -1;
}
// The latent row of an entry (reads the block table), or null when it is not attended.
__device__ inline const uint8_t* TileSource(const SparseMlaDecodeParams& p, int row, int32_t slot,
                                            int32_t position, int32_t num_slots) {
  return Attended(slot, position, num_slots)
             ? reinterpret_cast<const uint8_t*>(LatentRow(p, row, slot))
             : nullptr;
}
// A tile's gather is committed as kGatherParts cp.async groups of 3 panels each (dims
// [192 part, +192)), so S can start on the first panels while the last still arrive.
constexpr int kGatherParts = 3;
constexpr int kStepsPerPart = kMlaKeyDim / 16 / kGatherParts;  // 12 k-steps of S a part

// Issues this thread's cp.async of `src` into `stage` (zero-filled and biased -inf when null), or
// nothing when `issue` is false; commits kGatherParts groups either way.
__device__ inline void GatherRow(const SparseMlaDecodeParams& p, bool issue, const uint8_t* src,
                                 uint8_t* smem, int stage) {
  const int entry_in_tile = threadIdx.x / 4;
  const bool attended = src != nullptr;
  const uint8_t* from = attended ? src : reinterpret_cast<const uint8_t*>(p.kv_pool);
  const uint32_t base = SmemAddress(smem + kWgSmemKv + stage * kPanels * kPanelBytes);
  constexpr int kChunksPerThread = kRowChunks / 4;  // 18: chunk threadIdx % 4 + 4 j
#pragma unroll
  for (int part = 0; part < kGatherParts; ++part) {
    if (issue) {
#pragma unroll
      for (int j = part * kChunksPerThread / kGatherParts;
           j < (part + 1) * kChunksPerThread / kGatherParts; ++j) {
        const int c = threadIdx.x % 4 + 4 * j;
        CpAsync16(base + PanelOffset(entry_in_tile, c), from + 16 * c, attended);
      }
    }
    CpAsyncCommit();
  }
  if (issue && threadIdx.x % 4 == 0) {
    reinterpret_cast<float*>(smem + kWgSmemBias)[stage * kTileSlots + entry_in_tile] =
        attended ? 0.0f : -INFINITY;
  }
}

// Issues k-steps [kFirst, kFirst + kCount) of S (no fence, no commit).
template <int kFirst, int kCount>
__device__ inline void IssueQkSteps(float (&qk)[kQkChains][16], uint64_t q_desc, uint64_t k_desc) {
#pragma unroll
  for (int ks = kFirst; ks < kFirst + kCount; ++ks) {
    const uint64_t offset = ((ks / 4) * kPanelBytes + (ks % 4) * 32) >> 4;
    WgmmaQk(qk[ks % kQkChains], q_desc + offset, k_desc + offset, ks >= kQkChains);
  }
}

// Waits for a tile's gather (kLater groups were committed after its last part) and issues S for
// it as one commit group. kPanelWait: part by part (wait for a part, barrier, its 12 k-steps);
// otherwise the whole tile first. kIssue false waits only (an experiment switch).
template <bool kPanelWait, int kLater, bool kIssue>
__device__ inline void WaitAndIssueQk(float (&qk)[kQkChains][16], uint64_t q_desc,
                                      uint64_t k_desc) {
  static_assert(kGatherParts == 3, "three parts below");
  if constexpr (kPanelWait) {
    WgmmaFence();
    CpAsyncWait<kLater + 2>();
    FenceProxyAsync();
    __syncthreads();
    if constexpr (kIssue) IssueQkSteps<0, kStepsPerPart>(qk, q_desc, k_desc);
    CpAsyncWait<kLater + 1>();
    FenceProxyAsync();
    __syncthreads();
    if constexpr (kIssue) IssueQkSteps<kStepsPerPart, kStepsPerPart>(qk, q_desc, k_desc);
    CpAsyncWait<kLater>();
    FenceProxyAsync();
    __syncthreads();
    if constexpr (kIssue) IssueQkSteps<2 * kStepsPerPart, kStepsPerPart>(qk, q_desc, k_desc);
    WgmmaCommit();
  } else {
    CpAsyncWait<kLater>();
    FenceProxyAsync();
    __syncthreads();
    if constexpr (kIssue) IssueQk(qk, q_desc, k_desc);
  }
}

// Experiment switches (docs/attention_gpu.md, steps 5 and 7): leave out S's wgmma, P V's wgmma, or
// the gathers past a split's first two tiles. Wrong results; for timing differences only. The
// library runs kSkip 0 without kPanelWait; only bench_gpu_attention's own build of this file
// (DSA_SPARSE_MLA_DECODE_EXPERIMENTS, bench/CMakeLists.txt) picks another variant (WgmmaKernel).
constexpr int kSkipQk = 1, kSkipPv = 2, kSkipGather = 4;

template <int kSkip, bool kPanelWait>
__global__ void __launch_bounds__(kThreads, 1)
    SparseMlaDecodeWgmmaKernel(SparseMlaDecodeParams p, int num_splits, float* partial_out,
                               float* partial_lse) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // The swizzle pattern repeats every 1024 bytes of shared address: align the base to it.
  uint8_t* smem = smem_raw + ((1024 - (SmemAddress(smem_raw) & 1023)) & 1023);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the combine may start
#endif
  const int group = blockIdx.x, split = blockIdx.y, row = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int wg = warp / 4, warp_in_wg = warp % 4;
  const int32_t position = p.positions[row], num_slots = p.num_slots[row];
  const int tiles_per_split = TilesPerSplit(p.top_k, num_splits);
  const int first_tile = split * tiles_per_split;
  const int last_tile = min(first_tile + tiles_per_split, NumTiles(p.top_k));
  {
    const uint8_t* q = reinterpret_cast<const uint8_t*>(
        p.query + (static_cast<int64_t>(row) * p.num_heads + group * kGroupHeads) * kMlaKeyDim);
    const uint32_t base = SmemAddress(smem + kWgSmemQuery);
    for (int i = threadIdx.x; i < kGroupHeads * kRowChunks; i += kThreads) {
      const int head = i / kRowChunks, c = i % kRowChunks;
      CpAsync16(base + PanelOffset(head, c), q + head * kRowBytes + 16 * c, true);
    }
  }
  const int32_t entry0 = TileEntry(p, row, first_tile, last_tile);
  const int32_t entry1 = TileEntry(p, row, first_tile + 1, last_tile);
  int32_t pending_entry = TileEntry(p, row, first_tile + 2, last_tile);  // read one tile ahead
  // Groups: the query with tile 0's first part, tile 0's other parts, tile 1's three parts.
  GatherRow(p, first_tile < last_tile, TileSource(p, row, entry0, position, num_slots), smem, 0);
  GatherRow(p, first_tile + 1 < last_tile, TileSource(p, row, entry1, position, num_slots), smem,
            1);

  const float scale_log2 = Log2Scale(p.softmax_scale);
  const int g = lane / 4, quad = lane % 4;
  // Accumulator rows of this thread (S and O alike): heads 16 warp_in_wg + g + 8 i.
  const int head0 = 16 * warp_in_wg + g;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.0f, 0.0f};
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float* row_max = reinterpret_cast<float*>(smem + kWgSmemMax);
  const float* bias = reinterpret_cast<const float*>(smem + kWgSmemBias);
  const uint32_t q_base = SmemAddress(smem + kWgSmemQuery);
  const uint32_t p_base = SmemAddress(smem + kWgSmemP);
  uint8_t* p_tile = smem + kWgSmemP;

  // Descriptors of stage 0 (a stage adds kStageDescriptor; a k-step its byte offset / 16).
  const uint64_t q_desc = SwizzledDescriptor(q_base, 16, 1024);
  const uint32_t kv0 = SmemAddress(smem + kWgSmemKv);
  const uint64_t k_desc0 = SwizzledDescriptor(kv0 + wg * 32 * 128, 16, 1024);
  const uint64_t v_desc0 = SwizzledDescriptor(kv0 + 4 * wg * kPanelBytes, kPanelBytes, 1024);
  const uint64_t p_desc = SwizzledDescriptor(p_base, 16, 1024);
  constexpr uint64_t kStageDescriptor = (kPanels * kPanelBytes) >> 4;

  // The loop keeps the tensor cores fed across phases: S of tile t + 1 is issued right behind
  // P V of tile t (both asynchronous), and the gather of tile t + 2 is issued while S of t + 1
  // runs. S of the split's first tile comes first.
  float qk[kQkChains][16];
#pragma unroll
  for (int c = 0; c < kQkChains; ++c) {
#pragma unroll
    for (int i = 0; i < 16; ++i) qk[c][i] = 0.0f;
  }
  if (first_tile < last_tile) {
    WaitAndIssueQk<kPanelWait, kGatherParts, (kSkip & kSkipQk) == 0>(qk, q_desc, k_desc0);
    WgmmaWait<0>();
#pragma unroll
    for (int c = 0; c < kQkChains; ++c) FenceOperands(qk[c]);
  }
  for (int tile = first_tile; tile < last_tile; ++tile) {
    const int stage = (tile - first_tile) & 1;
    // The gather of tile + 2 starts here in two reads a tile apart: its block-table entry now
    // (its selection entry was read an iteration ago), the selection entry of tile + 3 for the
    // next; the cp.async at the end of the iteration finds both loads done.
    const uint8_t* next_src = TileSource(p, row, pending_entry, position, num_slots);
    pending_entry = TileEntry(p, row, tile + 3, last_tile);
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      s[i] = qk[0][i];
#pragma unroll
      for (int c = 1; c < kQkChains; ++c) s[i] += qk[c][i];
    }
    // Online softmax. s[4 j + 2 i + c]: head head0 + 8 i, slot 32 wg + 8 j + 2 quad + c.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int slot = 32 * wg + 8 * j + 2 * quad;
      const float b0 = bias[stage * kTileSlots + slot], b1 = bias[stage * kTileSlots + slot + 1];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        s[4 * j + 2 * i] = s[4 * j + 2 * i] * scale_log2 + b0;
        s[4 * j + 2 * i + 1] = s[4 * j + 2 * i + 1] * scale_log2 + b1;
        tile_max[i] = fmaxf(tile_max[i], fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
    }
    if (quad == 0) {
      row_max[wg * 64 + head0] = tile_max[0];
      row_max[wg * 64 + head0 + 8] = tile_max[1];
    }
    __syncthreads();
    float base[2], alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float both = fmaxf(row_max[head0 + 8 * i], row_max[64 + head0 + 8 * i]);
      const float m_new = fmaxf(m_run[i], both);
      base[i] = m_new == -INFINITY ? 0.0f : m_new;
      alpha[i] = exp2f(m_run[i] - base[i]);
      m_run[i] = m_new;
      l_run[i] *= alpha[i];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int chunk = 4 * wg + j;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float p0 = exp2f(s[4 * j + 2 * i] - base[i]);
        const float p1 = exp2f(s[4 * j + 2 * i + 1] - base[i]);
        l_run[i] += p0 + p1;
        const int head = head0 + 8 * i;
        *reinterpret_cast<uint32_t*>(p_tile + head * 128 + ((chunk ^ (head & 7)) << 4) + 4 * quad) =
            PackBf16(p0, p1);
      }
    }
    // Once the row maxima settle, most tiles rescale nothing: skip it when no row of the warp
    // moved.
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j + 0] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
      }
    }
    FenceProxyAsync();
    __syncthreads();

    // O += P V: 64 heads x this warpgroup's 256 value dims (panels 4 wg .. 4 wg + 3).
    WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < ((kSkip & kSkipPv) ? 0 : kTileSlots / 16); ++ks) {
      WgmmaPv(o, p_desc + ((ks * 32) >> 4),
              v_desc0 + stage * kStageDescriptor + ((ks * 16 * 128) >> 4), 1);
    }
    WgmmaCommit();
    const bool has_next = tile + 1 < last_tile;
    if (has_next) {
      // tile + 1's parts are the latest groups
      WaitAndIssueQk<kPanelWait, 0, (kSkip & kSkipQk) == 0>(
          qk, q_desc, k_desc0 + (stage ^ 1) * kStageDescriptor);
      WgmmaWait<1>();  // P V of this tile done; S of the next may still run
    } else {
      WgmmaWait<0>();
    }
    // No accumulator is touched until the next wait<0>: ptxas serializes every wgmma of a kernel
    // that reads one while a group may still run (C7514).
    __syncthreads();  // both warpgroups are done with this stage's values and with P
    GatherRow(p, (kSkip & kSkipGather) == 0 && tile + 2 < last_tile, next_src, smem, stage);
    WgmmaWait<0>();
    FenceOperands(o);
#pragma unroll
    for (int c = 0; c < kQkChains; ++c) FenceOperands(qk[c]);
  }
  CpAsyncWait<0>();

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
  }
  __syncthreads();
  if (quad == 0) {
    row_max[wg * 64 + head0] = l_run[0];
    row_max[wg * 64 + head0 + 8] = l_run[1];
  }
  __syncthreads();
  const int64_t row_head0 = static_cast<int64_t>(row) * p.num_heads + group * kGroupHeads;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int head = head0 + 8 * i;
    const float l = row_max[head] + row_max[64 + head];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    if (wg == 0 && quad == 0) {
      const float lse = l > 0.0f ? (m_run[i] + log2f(l)) * kLn2 : -INFINITY;
      if (num_splits == 1) {
        if (p.lse != nullptr) p.lse[row_head0 + head] = lse;
      } else {
        partial_lse[(static_cast<int64_t>(row) * num_splits + split) * p.num_heads +
                    group * kGroupHeads + head] = lse;
      }
    }
    if (num_splits == 1) {
      __nv_bfloat16* out = p.out + (row_head0 + head) * kMlaValueDim + 256 * wg + 2 * quad;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<uint32_t*>(out + 8 * j) =
            PackBf16(o[4 * j + 2 * i] * inv, o[4 * j + 2 * i + 1] * inv);
      }
    } else {
      float* out = partial_out +
                   ((static_cast<int64_t>(row) * num_splits + split) * p.num_heads +
                    group * kGroupHeads + head) *
                       kMlaValueDim +
                   256 * wg + 2 * quad;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<float2*>(out + 8 * j) =
            make_float2(o[4 * j + 2 * i] * inv, o[4 * j + 2 * i + 1] * inv);
      }
    }
  }
}

// CTA (head, row), 128 threads x 4 dims: merges the splits' normalized partials by their LSEs.
// The splits' LSEs are read at once into shared memory, then every thread's partial loads are
// independent (unrolled), so a row of 32 splits costs a few load latencies, not 32. Launched with
// programmatic dependent launch: it waits (griddepcontrol.wait) for the split kernel's writes.
constexpr int kCombineThreads = 128;
constexpr int kMaxSplits = kCombineThreads;
__global__ void __launch_bounds__(kCombineThreads)
    SparseMlaDecodeCombineKernel(SparseMlaDecodeParams p, int num_splits, const float* partial_out,
                                 const float* partial_lse) {
  __shared__ float split_lse[kMaxSplits];
  __shared__ float split_weight[kMaxSplits];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  const int head = blockIdx.x, row = blockIdx.y;
  const int64_t first = static_cast<int64_t>(row) * num_splits * p.num_heads + head;
  if (threadIdx.x < num_splits) {
    split_lse[threadIdx.x] = partial_lse[first + threadIdx.x * p.num_heads];
  }
  __syncthreads();
  float max_lse = -INFINITY;
  for (int s = 0; s < num_splits; ++s) max_lse = fmaxf(max_lse, split_lse[s]);
  if (threadIdx.x < num_splits) {
    split_weight[threadIdx.x] =
        max_lse == -INFINITY ? 0.0f : __expf(split_lse[threadIdx.x] - max_lse);
  }
  __syncthreads();
  float sum = 0.0f;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float4* part =
      reinterpret_cast<const float4*>(partial_out + first * kMlaValueDim) + threadIdx.x;
  const int64_t split_stride = int64_t{p.num_heads} * kMlaValueDim / 4;  // in float4
#pragma unroll 8
  for (int s = 0; s < num_splits; ++s) {
    const float weight = split_weight[s];
    const float4 v = part[s * split_stride];
    sum += weight;
    acc.x = fmaf(weight, v.x, acc.x);
    acc.y = fmaf(weight, v.y, acc.y);
    acc.z = fmaf(weight, v.z, acc.z);
    acc.w = fmaf(weight, v.w, acc.w);
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  __nv_bfloat16* out =
      p.out + (static_cast<int64_t>(row) * p.num_heads + head) * kMlaValueDim + 4 * threadIdx.x;
  reinterpret_cast<__nv_bfloat162*>(out)[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  reinterpret_cast<__nv_bfloat162*>(out)[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  if (p.lse != nullptr && threadIdx.x == 0) {
    p.lse[static_cast<int64_t>(row) * p.num_heads + head] =
        sum > 0.0f ? max_lse + logf(sum) : -INFINITY;
  }
}

bool Refuse(const char** why, const char* reason) {
  if (why != nullptr) *why = reason;
  return false;
}

bool CheckCommon(const SparseMlaDecodeParams& p, const char** why) {
  if (p.num_rows < 0) return Refuse(why, "num_rows must be >= 0");
  if (p.num_heads < 1) return Refuse(why, "num_heads must be >= 1");
  if (p.top_k < 1) return Refuse(why, "top_k must be >= 1");
  if (p.max_blocks_per_row < 0) return Refuse(why, "max_blocks_per_row must be >= 0");
  if (!std::isfinite(p.softmax_scale)) return Refuse(why, "softmax_scale must be finite");
  if (p.num_rows > 0 && (p.kv_pool == nullptr || p.query == nullptr || p.block_tables == nullptr ||
                         p.num_slots == nullptr || p.positions == nullptr ||
                         p.selections == nullptr || p.out == nullptr)) {
    return Refuse(why, "a required pointer is null");
  }
  if (p.num_rows > 65535) return Refuse(why, "num_rows must be <= 65535 (the grid's y/z limit)");
  return true;
}

int DeviceSmCount() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 132;
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 132;
  }
  return sms;
}

}  // namespace

bool CanImplementSparseMlaDecodeCudaCores(const SparseMlaDecodeParams& params, const char** why) {
  if (!CheckCommon(params, why)) return false;
  if (params.top_k > kCudaCoreMaxTopK) return Refuse(why, "top_k must be <= 8192");
  if (params.num_heads > 65535) return Refuse(why, "num_heads must be <= 65535");
  return true;
}

cudaError_t LaunchSparseMlaDecodeCudaCores(const SparseMlaDecodeParams& params,
                                           cudaStream_t stream) {
  if (!CanImplementSparseMlaDecodeCudaCores(params)) return cudaErrorInvalidValue;
  if (params.num_rows == 0) return cudaSuccess;
  const size_t smem = sizeof(float) * params.top_k;
  SparseMlaDecodeCudaCoreKernel<<<dim3(params.num_heads, params.num_rows), kCudaCoreThreads, smem,
                                  stream>>>(params);
  return cudaGetLastError();
}

int SparseMlaDecodeNumSplits(const SparseMlaDecodeParams& params) {
  const int tiles = NumTiles(params.top_k > 0 ? params.top_k : 1);
  int splits = params.num_splits;
  if (splits <= 0) {
    const int64_t ctas_per_split = std::max<int64_t>(
        1, int64_t{params.num_rows} * std::max(1, params.num_heads / kGroupHeads));
    splits = static_cast<int>(std::max<int64_t>(1, DeviceSmCount() / ctas_per_split));
  }
  splits = std::min(std::max(splits, 1), tiles);
  // No empty split: as many as the tiles per split need.
  const int per_split = (tiles + splits - 1) / splits;
  return (tiles + per_split - 1) / per_split;
}

size_t SparseMlaDecodeScratchBytes(const SparseMlaDecodeParams& params) {
  const int splits = SparseMlaDecodeNumSplits(params);
  if (splits <= 1 || params.num_rows <= 0 || params.num_heads <= 0) return 0;
  return size_t{4} * params.num_rows * params.num_heads * splits * (kMlaValueDim + 1);
}

bool CanImplementSparseMlaDecodeTensorCores(const SparseMlaDecodeParams& params, const char** why) {
  if (!CheckCommon(params, why)) return false;
  if (params.num_heads % kGroupHeads != 0) {
    return Refuse(why, "num_heads must be a multiple of 64 (one CTA a 64-head group)");
  }
  if (params.num_heads / kGroupHeads > 65535) return Refuse(why, "num_heads too large");
  if (params.num_splits > NumTiles(params.top_k)) {
    return Refuse(why, "num_splits must be <= ceil(top_k / 64)");
  }
  if (params.num_splits < 0) return Refuse(why, "num_splits must be >= 0");
  if (SparseMlaDecodeNumSplits(params) > kMaxSplits) {
    return Refuse(why, "num_splits must be <= 128 (the combine's threads)");
  }
  if (params.mma != SparseMlaMma::kAuto && params.mma != SparseMlaMma::kMmaSync &&
      params.mma != SparseMlaMma::kWgmma) {
    return Refuse(why, "unknown mma");
  }
  const size_t need = SparseMlaDecodeScratchBytes(params);
  if (need > 0 && (params.workspace == nullptr || params.workspace_bytes < need)) {
    return Refuse(why, "workspace smaller than SparseMlaDecodeScratchBytes");
  }
  if (need > 0 && reinterpret_cast<uintptr_t>(params.workspace) % 16 != 0) {
    return Refuse(why, "workspace must be 16-byte aligned");
  }
  return true;
}

namespace {

using WgmmaKernelFn = void (*)(SparseMlaDecodeParams, int, float*, float*);

// The wgmma kernel the launcher runs. *experiment: whether it is an experiment switch's variant.
WgmmaKernelFn WgmmaKernel(bool* experiment) {
#ifdef DSA_SPARSE_MLA_DECODE_EXPERIMENTS
  // bench_gpu_attention's build only (read once): DSA_ATTENTION_PANEL_WAIT=1, S waits for the
  // gather panel by panel; else DSA_ATTENTION_SKIP=1|2|4 leaves a part out (kSkipQk ...).
  static const int skip = [] {
    const char* value = std::getenv("DSA_ATTENTION_SKIP");
    return value == nullptr ? 0 : std::atoi(value);
  }();
  static const bool panel_wait = [] {
    const char* value = std::getenv("DSA_ATTENTION_PANEL_WAIT");
    return value != nullptr && std::atoi(value) != 0;
  }();
  *experiment = panel_wait || skip == kSkipQk || skip == kSkipPv || skip == kSkipGather;
  return panel_wait            ? SparseMlaDecodeWgmmaKernel<0, true>
         : skip == kSkipQk     ? SparseMlaDecodeWgmmaKernel<kSkipQk, false>
         : skip == kSkipPv     ? SparseMlaDecodeWgmmaKernel<kSkipPv, false>
         : skip == kSkipGather ? SparseMlaDecodeWgmmaKernel<kSkipGather, false>
                               : SparseMlaDecodeWgmmaKernel<0, false>;
#else
  *experiment = false;
  return SparseMlaDecodeWgmmaKernel<0, false>;
#endif
}

}  // namespace

cudaError_t LaunchSparseMlaDecodeTensorCores(const SparseMlaDecodeParams& params,
                                             cudaStream_t stream) {
  if (!CanImplementSparseMlaDecodeTensorCores(params)) return cudaErrorInvalidValue;
  if (params.num_rows == 0) return cudaSuccess;
  const bool wgmma = params.mma != SparseMlaMma::kMmaSync;
  bool experiment = false;
  auto* kernel = wgmma ? WgmmaKernel(&experiment) : SparseMlaDecodeTensorCoreKernel;
  const int smem_bytes = wgmma ? kWgSmemBytes : kSmemBytes;
  // The shared-memory opt-in, once a device and kernel.
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> configured[kMaxDevices][2];  // [device][wgmma]: not for experiments
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (experiment || device >= kMaxDevices ||
      !configured[device][wgmma].load(std::memory_order_acquire)) {
    if (cudaError_t e =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
        e != cudaSuccess) {
      return e;
    }
    if (device < kMaxDevices) configured[device][wgmma].store(true, std::memory_order_release);
  }
  const int splits = SparseMlaDecodeNumSplits(params);
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  if (splits > 1) {
    partial_out = static_cast<float*>(params.workspace);
    partial_lse = partial_out +
                  static_cast<int64_t>(params.num_rows) * splits * params.num_heads * kMlaValueDim;
  }
  const dim3 grid(params.num_heads / kGroupHeads, splits, params.num_rows);
  kernel<<<grid, kThreads, smem_bytes, stream>>>(params, splits, partial_out, partial_lse);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (splits == 1) return cudaSuccess;
  // The combine, launched early (programmatic dependent launch) to wait on the split kernel.
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(params.num_heads, params.num_rows);
  config.blockDim = dim3(kCombineThreads);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  const float* combine_out = partial_out;
  const float* combine_lse = partial_lse;
  const cudaError_t e = cudaLaunchKernelEx(&config, SparseMlaDecodeCombineKernel, params, splits,
                                           combine_out, combine_lse);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e;
}

}  // namespace dsa::cuda
