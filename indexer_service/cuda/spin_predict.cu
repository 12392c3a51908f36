// SPIN block prediction, the plan with seeded exploration and the speculative union on the GPU
// (see spin_predict.h).
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "common/philox.h"
#include "indexer_service/cuda/dependent_launch.cuh"
#include "indexer_service/cuda/fp8_device.cuh"
#include "indexer_service/cuda/spin_predict.h"

namespace dsa::cuda {
namespace {

// Where each row's entries start in `scores` and `selected`: the caller's array, or, without one,
// row x stride (SpinPredictParams::row_block_stride).
struct RowOffsets {
  const int64_t* offset;
  int64_t stride;
  __device__ __forceinline__ int64_t operator[](int row) const {
    return offset != nullptr ? offset[row] : static_cast<int64_t>(row) * stride;
  }
};

constexpr int kPredictWarps = 8;       // warps a CTA of the prediction kernel
constexpr int kPredictUnroll = 1;      // consecutive blocks a warp an iteration (1 measured best)
constexpr int kPredictChunks = 64;     // CTAs a row (grid.y) without max_visible_blocks
constexpr int kSelectThreads = 512;    // threads a CTA (one row) of the plan kernel
constexpr int kUnionThreads = 512;     // threads a CTA (one group) of the union kernel
constexpr int kUnionWords = 1024;      // bitmap words a union chunk: 32,768 blocks
constexpr int kPlanBytesPerBlock = 5;  // exploration: int32 free-list entry + byte flag a block

// std::max(a, b) and std::max_element's step: b only when a < b, so of equal values (+0 and -0)
// the first one wins.
__device__ __forceinline__ float FirstMax(float a, float b) { return a < b ? b : a; }

__device__ __forceinline__ int64_t RowBlocks(int64_t position) {
  return position < 0 ? 0 : position / kBlockSize + 1;
}

// Predicted slot score max(V[i], D[t - i]) (eq. (1)), unseen entries 0; -inf for a slot past t
// (only in the last block, after every visible slot, so it never wins against a visible one).
__device__ __forceinline__ float SlotScore(const float* v, int64_t v_len, const float* d,
                                           int64_t d_len, int64_t t, int64_t i) {
  if (i > t) return -INFINITY;
  const float vi = i < v_len ? v[i] : 0.0f;
  const int64_t o = t - i;
  const float di = o < d_len ? d[o] : 0.0f;
  return FirstMax(vi, di);
}

__global__ void __launch_bounds__(kPredictWarps * 32)
    PredictKernel(const int64_t* __restrict__ positions, const float* const* __restrict__ vertical,
                  const int64_t* __restrict__ vertical_len,
                  const float* const* __restrict__ diagonal,
                  const int64_t* __restrict__ diagonal_len, RowOffsets row_block_offset,
                  float* __restrict__ scores) {
  BeginDependentKernel();
  const int row = blockIdx.x;
  // The row's arguments all at once (valid entries for every row), then the early exit: one
  // round trip before the V and D loads instead of two.
  const int64_t t = positions[row];
  const float* v = vertical[row];
  const float* d = diagonal[row];
  const int64_t v_len = vertical_len[row];
  const int64_t d_len = diagonal_len[row];
  float* out = scores + row_block_offset[row];
  const int64_t num_blocks = RowBlocks(t);
  if (num_blocks == 0) return;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // Each warp takes kPredictUnroll consecutive blocks at a time, their loads all in flight.
  for (int64_t j0 = (static_cast<int64_t>(blockIdx.y) * kPredictWarps + warp) * kPredictUnroll;
       j0 < num_blocks; j0 += static_cast<int64_t>(gridDim.y) * kPredictWarps * kPredictUnroll) {
    // Lane l holds slots 2l and 2l + 1; the butterfly below keeps each lane's range contiguous
    // with the lower range on the lane whose bit is clear, so every combine is (earlier, later)
    // and the result is max_element's: the first of the largest values.
    float m[kPredictUnroll];
#pragma unroll
    for (int u = 0; u < kPredictUnroll; ++u) {
      const int64_t first = (j0 + u) * kBlockSize + 2 * lane;
      m[u] = FirstMax(SlotScore(v, v_len, d, d_len, t, first),
                      SlotScore(v, v_len, d, d_len, t, first + 1));
    }
#pragma unroll
    for (int u = 0; u < kPredictUnroll; ++u) {
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, m[u], offset);
        m[u] = (lane & offset) ? FirstMax(other, m[u]) : FirstMax(m[u], other);
      }
    }
    // eq. (2), max pooling; lane u writes block j0 + u.
#pragma unroll
    for (int u = 0; u < kPredictUnroll; ++u) {
      if (lane == u && j0 + u < num_blocks) out[j0 + u] = m[u];
    }
  }
}

// SpinState::BlockBudget with the same fp64 operations (no contraction into FMAs).
__device__ int64_t BlockBudget(int64_t visible_blocks, int top_k, double rho) {
  const int64_t floor_blocks = (static_cast<int64_t>(top_k) + kBlockSize - 1) / kBlockSize;
  const double x = __dmul_rn(__dsub_rn(1.0, rho), static_cast<double>(visible_blocks));
  const double slack = __dmul_rn(1e-12, fmax(1.0, fabs(x)));
  const int64_t kept = static_cast<int64_t>(ceil(__dsub_rn(x, slack)));
  const int64_t budget = floor_blocks > kept ? floor_blocks : kept;
  return visible_blocks < budget ? visible_blocks : budget;
}

// A uint32 ordered as the float: larger S, larger key; -0 maps as +0, so equal values (the CPU's
// == on floats) get equal keys. S is finite (finite V and D).
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  const uint32_t bits = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
}

// SpinState::PlanRow's n_explore = min(FloorOfProduct(gamma m_t + 0.5), capacity) with the same
// fp64 operations (no FMA contraction).
__device__ int64_t ExploreCount(int64_t budget, int64_t capacity, double gamma) {
  const double x = __dadd_rn(__dmul_rn(gamma, static_cast<double>(budget)), 0.5);
  const double slack = __dmul_rn(1e-12, fmax(1.0, fabs(x)));
  const int64_t n = static_cast<int64_t>(floor(__dadd_rn(x, slack)));
  return n < capacity ? n : capacity;
}

// The plan of one row with S read from global memory (one CTA): the path of rows past 2^20 slots
// (the free list in the workspace) and of launches without max_visible_blocks.
__device__ __forceinline__ void PlanRowGlobal(
    int row, const int64_t* __restrict__ positions, RowOffsets row_block_offset,
    const float* __restrict__ scores, int top_k, double rho, double gamma, uint64_t seed,
    const uint64_t* __restrict__ row_seed, int layer, int64_t max_blocks,
    unsigned char* __restrict__ workspace, int64_t workspace_blocks, int32_t* __restrict__ selected,
    int32_t* __restrict__ selected_count) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int written;
  extern __shared__ __align__(16) unsigned char plan_shared[];
  const int64_t t = positions[row];
  const int64_t num_blocks = RowBlocks(t);
  const int64_t base = num_blocks > 0 ? row_block_offset[row] : 0;
  const float* s = scores + base;
  int32_t* out = selected + base;
  const bool all = t + 1 <= top_k;  // step 1 (the warm-up and SPIN off are the caller's)
  // Step 3 and 4: the budget, the sink block and the newest block.
  const int64_t forced = num_blocks >= 2 ? 2 : num_blocks;
  const int64_t budget = all ? num_blocks : BlockBudget(num_blocks, top_k, rho);
  const int64_t capacity = all ? 0 : budget - forced;
  // Step 5: n_explore (> 0 only when B >= 3: capacity > 0 needs m_t > 2).
  const int64_t n_explore = gamma > 0.0 && capacity > 0 ? ExploreCount(budget, capacity, gamma) : 0;
  if (n_explore > 0 && num_blocks > max_blocks) {  // the caller's bound is wrong: refuse the row
    if (threadIdx.x == 0) selected_count[row] = -1;
    return;
  }
  // Step 6: `best` more by S among the blocks still free.
  const int64_t best = capacity - (n_explore > 0 ? n_explore : 0);
  const unsigned char* explored = nullptr;
  if (n_explore > 0) {
    // Partial Fisher-Yates over the untaken blocks in ascending order (1 .. B - 2, so free[k] =
    // k + 1): draw i swaps free[i] with free[i + UniformBelow(word_i, F - i)], F = B - 2. The
    // draws are independent of the shuffle, so warp 0 makes 32 at a time and lane 0 applies the
    // swaps in order; afterwards free[0 .. n) are the explored blocks (later swaps never touch a
    // position below their own index).
    unsigned char* storage = workspace != nullptr ? workspace + 4 * base : plan_shared;
    int32_t* free_list = reinterpret_cast<int32_t*>(storage);
    unsigned char* flags = workspace != nullptr ? workspace + 4 * workspace_blocks + base
                                                : plan_shared + 4 * max_blocks;
    const int64_t free_count = num_blocks - 2;
    for (int64_t k = threadIdx.x; k < free_count; k += kSelectThreads) {
      free_list[k] = static_cast<int32_t>(k + 1);
    }
    for (int64_t j = threadIdx.x; j < num_blocks; j += kSelectThreads) flags[j] = 0;
    __syncthreads();
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const uint64_t row_key = row_seed != nullptr ? row_seed[row] : seed;
      const PhiloxKey key{{static_cast<uint32_t>(row_key), static_cast<uint32_t>(row_key >> 32)}};
      for (int64_t first = 0; first < n_explore; first += 32) {
        const int64_t i = first + lane;
        int64_t pick = 0;
        if (i < n_explore) {
          const PhiloxCounter counter{{static_cast<uint32_t>(t),
                                       static_cast<uint32_t>(static_cast<uint64_t>(t) >> 32),
                                       static_cast<uint32_t>(i), static_cast<uint32_t>(layer)}};
          const uint32_t word = Philox4x32(counter, key).c[0];
          pick = i + UniformBelow(word, static_cast<uint32_t>(free_count - i));
        }
        const int steps = n_explore - first < 32 ? static_cast<int>(n_explore - first) : 32;
        for (int k = 0; k < steps; ++k) {
          const int64_t q = __shfl_sync(0xffffffffu, pick, k);
          if (lane == 0) {
            const int64_t at = first + k;
            const int32_t held = free_list[at];
            free_list[at] = free_list[q];
            free_list[q] = held;
          }
        }
      }
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n_explore; i += kSelectThreads) flags[free_list[i]] = 1;
    __syncthreads();
    explored = flags;
  }
  // Step 6 by an exact radix select over the free candidates (blocks 1 .. B - 2 not explored):
  // four 8-bit passes, most significant first, find the best-th largest key T (OrderedKey of S)
  // and how many candidates of key T to take (`need`); then every candidate above T and the
  // `need` lowest-numbered of key T are taken: the CPU's order (higher S first, ties to the lower
  // block) makes the chosen set exactly this.
  __shared__ int histogram[256];
  __shared__ uint32_t select_prefix;
  __shared__ int64_t select_need;
  __shared__ int64_t equal_taken;
  const int64_t candidates = num_blocks > 2 ? num_blocks - 2 - (n_explore > 0 ? n_explore : 0) : 0;
  const bool take_all_free = best >= candidates;  // TakeBest's min(count, free.size())
  uint32_t threshold = 0;
  int64_t need = 0;
  if (best > 0 && !take_all_free) {
    uint32_t prefix = 0;
    uint32_t mask = 0;
    need = best;
    for (int shift = 24; shift >= 0; shift -= 8) {
      if (threadIdx.x < 256) histogram[threadIdx.x] = 0;
      __syncthreads();
      for (int64_t j = 1 + threadIdx.x; j < num_blocks - 1; j += kSelectThreads) {
        if (explored != nullptr && explored[j]) continue;
        const uint32_t key = OrderedKey(s[j]);
        if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 255], 1);
      }
      __syncthreads();
      if (threadIdx.x < 32) {
        // Lane l holds digits 255 - 8 l .. 248 - 8 l (highest first); an inclusive scan over
        // lanes finds the lane, then the digit, where the running count reaches `need`.
        const int lane = threadIdx.x;
        int counts[8];
        int lane_sum = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          counts[k] = histogram[255 - 8 * lane - k];
          lane_sum += counts[k];
        }
        int inclusive = lane_sum;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
          const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
          if (lane >= offset) inclusive += other;
        }
        int64_t before = inclusive - lane_sum;
        if (before < need && need <= inclusive) {
          for (int k = 0; k < 8; ++k) {
            if (before + counts[k] >= need) {
              select_prefix = prefix | (static_cast<uint32_t>(255 - 8 * lane - k) << shift);
              select_need = need - before;
              break;
            }
            before += counts[k];
          }
        }
      }
      __syncthreads();
      prefix = select_prefix;
      need = select_need;
      mask |= 255u << shift;
    }
    threshold = prefix;
  }
  if (threadIdx.x == 0) {
    written = 0;
    equal_taken = 0;
  }
  __syncthreads();
  for (int64_t chunk = 0; chunk < num_blocks; chunk += kSelectThreads) {
    const int64_t j = chunk + threadIdx.x;
    int take = 0;
    int equal = 0;
    if (j < num_blocks) {
      if (all || j == 0 || j == num_blocks - 1) {
        take = 1;
      } else if (explored != nullptr && explored[j]) {
        take = 1;
      } else if (best > 0) {
        if (take_all_free) {
          take = 1;
        } else {
          const uint32_t key = OrderedKey(s[j]);
          take = key > threshold ? 1 : 0;
          equal = key == threshold ? 1 : 0;
        }
      }
    }
    int equal_index = 0;
    int equal_total = 0;
    Scan(scan_storage).ExclusiveSum(equal, equal_index, equal_total);
    __syncthreads();  // the scan storage is free again
    if (equal && equal_taken + equal_index < need) take = 1;
    int index = 0;
    int total = 0;
    Scan(scan_storage).ExclusiveSum(take, index, total);
    if (take) out[written + index] = static_cast<int32_t>(j);
    __syncthreads();  // every thread has read `written` and `equal_taken`; the storage is free
    if (threadIdx.x == 0) {
      written += total;
      equal_taken += equal_total;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) selected_count[row] = written;
}

__global__ void __launch_bounds__(kSelectThreads)
    SelectKernel(const int64_t* __restrict__ positions, RowOffsets row_block_offset,
                 const float* __restrict__ scores, int top_k, double rho, double gamma,
                 uint64_t seed, const uint64_t* __restrict__ row_seed, int layer,
                 int64_t max_blocks, unsigned char* __restrict__ workspace,
                 int64_t workspace_blocks, int32_t* __restrict__ selected,
                 int32_t* __restrict__ selected_count) {
  BeginDependentKernel();
  PlanRowGlobal(blockIdx.x, positions, row_block_offset, scores, top_k, rho, gamma, seed, row_seed,
                layer, max_blocks, workspace, workspace_blocks, selected, selected_count);
}

// Kernel 2 with S in shared memory (rows of at most max_visible_blocks <= kSpinSharedPlanBlocks
// blocks): S is staged once as order-preserving keys, the forced and explored blocks get
// kAlwaysKey (above every finite S), and the plan is the first (forced + explored + best) blocks
// by key, ties to the lower block: one radix select over the staged keys and one scan a
// 2,048-block tile for the ascending write-out.
constexpr uint32_t kAlwaysKey = 0xFFFFFFFFu;  // OrderedKey of a finite or infinite float is less
constexpr int kParallelExplore = 1024;        // draws resolved in parallel (more: the swap chain)
constexpr int kPlanItems = 4;                 // consecutive blocks a thread in the write-out

__host__ __device__ __forceinline__ int64_t RoundUp4(int64_t x) { return (x + 3) / 4 * 4; }

__global__ void __launch_bounds__(kSelectThreads)
    PlanSharedKernel(const int64_t* __restrict__ positions, RowOffsets row_block_offset,
                     const float* __restrict__ scores, int top_k, double rho, double gamma,
                     uint64_t seed, const uint64_t* __restrict__ row_seed, int layer,
                     int64_t max_blocks, int32_t* __restrict__ selected,
                     int32_t* __restrict__ selected_count) {
  BeginDependentKernel();
  using Scan = cub::BlockScan<uint32_t, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int32_t picks[kParallelExplore];
  __shared__ int32_t before[kParallelExplore];
  __shared__ int32_t latest[kParallelExplore];
  __shared__ int histogram[256];
  __shared__ uint32_t select_prefix;
  __shared__ int select_need;
  __shared__ int select_bin;
  // RoundUp4(max_blocks) keys, then (exploration) the free list past kParallelExplore draws, or
  // each position's latest draw up to it.
  extern __shared__ __align__(16) uint32_t plan_keys[];
  const int row = blockIdx.x;
  const int64_t t = positions[row];
  const int64_t num_blocks = RowBlocks(t);
  const bool all = t + 1 <= top_k;  // step 1 (the warm-up and SPIN off are the caller's)
  const int64_t forced = num_blocks >= 2 ? 2 : num_blocks;
  const int64_t budget = all ? num_blocks : BlockBudget(num_blocks, top_k, rho);
  const int64_t capacity = all ? 0 : budget - forced;
  const int64_t n_explore = gamma > 0.0 && capacity > 0 ? ExploreCount(budget, capacity, gamma) : 0;
  if (all) {
    if (num_blocks > 0) {
      int32_t* out = selected + row_block_offset[row];
      for (int64_t j = threadIdx.x; j < num_blocks; j += kSelectThreads) {
        out[j] = static_cast<int32_t>(j);
      }
    }
    if (threadIdx.x == 0) selected_count[row] = static_cast<int32_t>(num_blocks);
    return;
  }
  if (num_blocks > max_blocks) {
    if (n_explore > 0) {  // the caller's bound is wrong: refuse the row
      if (threadIdx.x == 0) selected_count[row] = -1;
    } else {  // no shared memory needed: plan from global memory
      PlanRowGlobal(row, positions, row_block_offset, scores, top_k, rho, gamma, seed, row_seed,
                    layer, 0, nullptr, 0, selected, selected_count);
    }
    return;
  }
  const int b = static_cast<int>(num_blocks);  // <= kSpinSharedPlanBlocks, >= 1
  const int64_t base = row_block_offset[row];
  const float* s = scores + base;
  int32_t* out = selected + base;
  uint32_t* keys = plan_keys;
#pragma unroll 4
  for (int j = threadIdx.x; j < b; j += kSelectThreads) {
    keys[j] = j == 0 || j == b - 1 ? kAlwaysKey : OrderedKey(s[j]);
  }
  const int n = static_cast<int>(n_explore);
  if (n > 0) {
    // Step 5, SpinState::Explore's partial Fisher-Yates over free[k] = k + 1 (blocks 1 .. B - 2,
    // F = B - 2): draw i swaps free[i] and free[q_i], q_i = i + UniformBelow(word_i, F - i) >= i.
    // Position k is final after draw k and holds what position q_k held before it: the value
    // that the latest earlier draw m with q_m = q_k moved there (what position m held before
    // draw m), or q_k + 1 if none. What position m held before draw m is likewise the latest
    // earlier draw with q = m, recursively, or m + 1. So n <= kParallelExplore draws resolve from
    // the draws alone; more take the swap chain in order.
    const uint64_t row_key = row_seed != nullptr ? row_seed[row] : seed;
    const PhiloxKey key{{static_cast<uint32_t>(row_key), static_cast<uint32_t>(row_key >> 32)}};
    const int free_count = b - 2;
    auto pick = [&](int i) {
      const PhiloxCounter counter{{static_cast<uint32_t>(t),
                                   static_cast<uint32_t>(static_cast<uint64_t>(t) >> 32),
                                   static_cast<uint32_t>(i), static_cast<uint32_t>(layer)}};
      const uint32_t word = Philox4x32(counter, key).c[0];
      return i + static_cast<int32_t>(UniformBelow(word, static_cast<uint32_t>(free_count - i)));
    };
    if (n <= kParallelExplore) {
      // last_draw[q]: the latest draw so far that picked position q. One warp walks the draws 32
      // at a time: a draw's latest earlier draw of the same q is the next lower lane of its
      // __match_any_sync group, or, for the group's lowest lane, last_draw[q] of the chunks
      // before; the group's highest lane then records itself. That is O(n / 32) steps where a
      // scan of the earlier draws a thread was O(n) (~4 us at 61 draws, 1 x 128K).
      int32_t* last_draw = reinterpret_cast<int32_t*>(plan_keys + RoundUp4(max_blocks));
      for (int i = threadIdx.x; i < n; i += kSelectThreads) picks[i] = pick(i);
      for (int q = threadIdx.x; q < free_count; q += kSelectThreads) last_draw[q] = -1;
      __syncthreads();  // also orders the staged keys before the marks below
      if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        for (int first = 0; first < n; first += 32) {
          const int k = first + lane;
          const int32_t q = k < n ? picks[k] : -1 - lane;  // past n: a group of its own
          const uint32_t same = __match_any_sync(0xffffffffu, q);
          const uint32_t lower = same & ((1u << lane) - 1u);
          if (k < n) before[k] = lower != 0 ? first + 31 - __clz(lower) : last_draw[q];
          __syncwarp();  // every lane has read last_draw before the chunk's writes
          if (k < n && (same >> lane) == 1u) last_draw[q] = k;
          __syncwarp();
        }
      }
      __syncthreads();
      // The latest draw m < p that picked p: every draw that picks p is <= p (q_m >= m), so it is
      // last_draw[p] unless that is draw p itself, whose own predecessor is then the one.
      for (int p = threadIdx.x; p < n; p += kSelectThreads) {
        const int32_t m = last_draw[p];
        latest[p] = m == p ? before[p] : m;
      }
      __syncthreads();
      for (int k = threadIdx.x; k < n; k += kSelectThreads) {
        int m = before[k];
        int block = picks[k] + 1;
        if (m >= 0) {
          while (latest[m] >= 0) m = latest[m];
          block = m + 1;
        }
        keys[block] = kAlwaysKey;
      }
    } else {
      int32_t* free_list = reinterpret_cast<int32_t*>(plan_keys + RoundUp4(max_blocks));
      for (int k = threadIdx.x; k < free_count; k += kSelectThreads) free_list[k] = k + 1;
      for (int first = 0; first < n; first += kParallelExplore) {
        const int chunk = n - first < kParallelExplore ? n - first : kParallelExplore;
        __syncthreads();  // the free list is set up and the previous chunk's picks are used
        for (int i = threadIdx.x; i < chunk; i += kSelectThreads) picks[i] = pick(first + i);
        __syncthreads();
        if (threadIdx.x == 0) {
          for (int k = 0; k < chunk; ++k) {
            const int at = first + k;
            const int q = picks[k];
            const int32_t held = free_list[at];
            free_list[at] = free_list[q];
            free_list[q] = held;
          }
        }
      }
      __syncthreads();
      for (int i = threadIdx.x; i < n; i += kSelectThreads) keys[free_list[i]] = kAlwaysKey;
    }
  }
  __syncthreads();
  // Step 6: `best` more by S among the candidates (keys below kAlwaysKey). The plan is every
  // block with (key & mask) > threshold and the `need` lowest-numbered with (key & mask) ==
  // threshold.
  const int always = static_cast<int>(forced) + n;
  const int64_t best = capacity - n;
  const int candidates = b - always;
  uint32_t mask = 0xFFFFFFFFu;
  uint32_t threshold = 0;  // best >= candidates: every block (all keys are above 0)
  int need = 0;
  if (best <= 0) {
    threshold = kAlwaysKey - 1;  // the forced and explored blocks only
  } else if (best < candidates) {
    // The (always + best)-th largest key by four 8-bit histogram passes, most significant first;
    // stops early once the threshold's bin is taken whole.
    uint32_t prefix = 0;
    mask = 0;
    need = always + static_cast<int>(best);
    for (int shift = 24; shift >= 0; shift -= 8) {
      if (threadIdx.x < 256) histogram[threadIdx.x] = 0;
      __syncthreads();
      for (int j = threadIdx.x; j < b; j += kSelectThreads) {
        const uint32_t k = keys[j];
        if ((k & mask) == prefix) atomicAdd(&histogram[(k >> shift) & 255], 1);
      }
      __syncthreads();
      if (threadIdx.x < 32) {
        // Lane l holds digits 255 - 8 l .. 248 - 8 l (highest first); an inclusive scan over
        // lanes finds the lane, then the digit, where the running count reaches `need`.
        const int lane = threadIdx.x;
        int counts[8];
        int lane_sum = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          counts[k] = histogram[255 - 8 * lane - k];
          lane_sum += counts[k];
        }
        int inclusive = lane_sum;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
          const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
          if (lane >= offset) inclusive += other;
        }
        int taken_before = inclusive - lane_sum;
        if (taken_before < need && need <= inclusive) {
          for (int k = 0; k < 8; ++k) {
            if (taken_before + counts[k] >= need) {
              select_prefix = prefix | (static_cast<uint32_t>(255 - 8 * lane - k) << shift);
              select_need = need - taken_before;
              select_bin = counts[k];
              break;
            }
            taken_before += counts[k];
          }
        }
      }
      __syncthreads();
      prefix = select_prefix;
      need = select_need;
      mask |= 255u << shift;
      if (select_bin == need) break;  // uniform: every key of the bin is taken
    }
    threshold = prefix;
  }
  // Write-out in ascending order: a taken block j goes to (taken above before j) +
  // min(equal before j, need). One scan a tile of kSelectThreads x kPlanItems blocks over the
  // packed counts (above in the low 16 bits, equal in the high 16).
  uint32_t run_above = 0;
  uint32_t run_equal = 0;
  const uint32_t need_u = static_cast<uint32_t>(need);
  for (int tile = 0; tile < b; tile += kSelectThreads * kPlanItems) {
    const int j0 = tile + kPlanItems * threadIdx.x;
    uint32_t k4[kPlanItems] = {0, 0, 0, 0};
    if (j0 < b) {
      const uint4 v = *reinterpret_cast<const uint4*>(keys + j0);
      k4[0] = v.x;
      k4[1] = v.y;
      k4[2] = v.z;
      k4[3] = v.w;
    }
    uint32_t above_bits = 0;
    uint32_t equal_bits = 0;
#pragma unroll
    for (int u = 0; u < kPlanItems; ++u) {
      if (j0 + u < b) {
        const uint32_t masked = k4[u] & mask;
        if (masked > threshold) {
          above_bits |= 1u << u;
        } else if (masked == threshold) {
          equal_bits |= 1u << u;
        }
      }
    }
    uint32_t prefix = 0;
    uint32_t total = 0;
    Scan(scan_storage)
        .ExclusiveSum(static_cast<uint32_t>(__popc(above_bits)) |
                          (static_cast<uint32_t>(__popc(equal_bits)) << 16),
                      prefix, total);
    uint32_t above = run_above + (prefix & 0xFFFFu);
    uint32_t equal = run_equal + (prefix >> 16);
#pragma unroll
    for (int u = 0; u < kPlanItems; ++u) {
      if (above_bits & (1u << u)) {
        out[above + (equal < need_u ? equal : need_u)] = j0 + u;
        ++above;
      } else if (equal_bits & (1u << u)) {
        if (equal < need_u) out[above + equal] = j0 + u;
        ++equal;
      }
    }
    run_above += total & 0xFFFFu;
    run_equal += total >> 16;
    __syncthreads();  // the scan storage is free again
  }
  if (threadIdx.x == 0) {
    selected_count[row] =
        static_cast<int32_t>(run_above + (run_equal < need_u ? run_equal : need_u));
  }
}

// One CTA per group: the distinct union of its rows' ascending lists, in chunks of
// 32 x kUnionWords blocks; thread k owns bitmap words 2k and 2k + 1, so the exclusive prefix of the
// per-thread population counts places every block in ascending order.
__global__ void __launch_bounds__(kUnionThreads)
    UnionKernel(const int32_t* __restrict__ group_first_row,
                const int64_t* __restrict__ row_block_offset, const int32_t* __restrict__ selected,
                const int32_t* __restrict__ selected_count,
                const int64_t* __restrict__ group_block_offset, int32_t* __restrict__ union_blocks,
                int32_t* __restrict__ union_count) {
  BeginDependentKernel();
  static_assert(kUnionWords == 2 * kUnionThreads, "two bitmap words a thread");
  using Scan = cub::BlockScan<int, kUnionThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ uint32_t bitmap[kUnionWords];
  __shared__ int64_t written;
  const int group = blockIdx.x;
  const int first_row = group_first_row[group];
  const int end_row = group_first_row[group + 1];
  if (end_row - first_row == 1) {
    // One row: its list is already strictly increasing, so the union is a copy.
    const int32_t count = selected_count[first_row];
    if (count > 0) {
      const int32_t* list = selected + row_block_offset[first_row];
      int32_t* out = union_blocks + group_block_offset[group];
      for (int32_t i = threadIdx.x; i < count; i += kUnionThreads) out[i] = list[i];
    }
    if (threadIdx.x == 0) union_count[group] = count > 0 ? count : 0;
    return;
  }
  int64_t end_block = 0;  // the largest block of any row + 1 (rows are ascending)
  for (int r = first_row; r < end_row; ++r) {
    const int32_t count = selected_count[r];
    if (count <= 0) continue;
    const int64_t last = selected[row_block_offset[r] + count - 1];
    end_block = last + 1 > end_block ? last + 1 : end_block;
  }
  int32_t* out = union_blocks + (end_block > 0 ? group_block_offset[group] : 0);
  if (threadIdx.x == 0) written = 0;
  constexpr int64_t kChunkBlocks = 32 * static_cast<int64_t>(kUnionWords);
  for (int64_t chunk = 0; chunk < end_block; chunk += kChunkBlocks) {
    for (int w = threadIdx.x; w < kUnionWords; w += kUnionThreads) bitmap[w] = 0;
    __syncthreads();
    for (int r = first_row; r < end_row; ++r) {
      const int32_t count = selected_count[r];
      const int32_t* list = selected + (count > 0 ? row_block_offset[r] : 0);
      for (int32_t i = threadIdx.x; i < count; i += kUnionThreads) {
        const int64_t b = static_cast<int64_t>(list[i]) - chunk;
        if (b >= 0 && b < kChunkBlocks) atomicOr(&bitmap[b >> 5], 1u << (b & 31));
      }
    }
    __syncthreads();
    const uint32_t w0 = bitmap[2 * threadIdx.x];
    const uint32_t w1 = bitmap[2 * threadIdx.x + 1];
    int index = 0;
    int total = 0;
    Scan(scan_storage).ExclusiveSum(__popc(w0) + __popc(w1), index, total);
    int32_t* at = out + written + index;
    const int64_t word_block = chunk + 64 * static_cast<int64_t>(threadIdx.x);
    for (uint32_t m = w0; m != 0; m &= m - 1)
      *at++ = static_cast<int32_t>(word_block + __ffs(m) - 1);
    for (uint32_t m = w1; m != 0; m &= m - 1) {
      *at++ = static_cast<int32_t>(word_block + 32 + __ffs(m) - 1);
    }
    __syncthreads();  // every thread has read `written` and the bitmap
    if (threadIdx.x == 0) written += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) union_count[group] = static_cast<int32_t>(written);
}

}  // namespace

namespace {

// Whether the launch explores (gamma > 0 with a plan) and keeps its plan in the workspace.
bool Explores(const SpinPredictParams& p) {
  return p.selected != nullptr && p.exploration_fraction > 0.0;
}
bool PlanInWorkspace(const SpinPredictParams& p) {
  return Explores(p) && p.max_visible_blocks > kSpinSharedPlanBlocks;
}
RowOffsets RowOffsetsOf(const SpinPredictParams& p) {
  return RowOffsets{p.row_block_offset, p.row_block_stride};
}

}  // namespace

bool CanImplementSpinPredict(const SpinPredictParams& p, const char** why) {
  auto fail = [why](const char* reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
  if (p.num_rows < 0) return fail("num_rows must be >= 0");
  if (p.pooling != SpinPooling::kMax) {
    return fail("only max block pooling (the default) is implemented on the GPU");
  }
  if (p.reduction != SpinReduction::kA1) {
    return fail("only the A1 reduction (pooled slot predictions, the default) is on the GPU");
  }
  if (p.num_rows == 0) return true;
  if (p.positions == nullptr || p.vertical == nullptr || p.vertical_len == nullptr ||
      p.diagonal == nullptr || p.diagonal_len == nullptr || p.scores == nullptr) {
    return fail("positions, vertical, diagonal, their lengths and scores must be set");
  }
  if (p.row_block_offset == nullptr && p.row_block_stride < 1) {
    return fail("row_block_offset must be set, or row_block_stride >= 1 without it");
  }
  if (p.selected != nullptr) {
    if (p.selected_count == nullptr) return fail("selected needs selected_count");
    if (p.top_k < 1) return fail("top_k must be >= 1");
    if (!std::isfinite(p.target_block_sparsity) || p.target_block_sparsity < 0.0 ||
        p.target_block_sparsity >= 1.0) {
      return fail("target_block_sparsity must be in [0, 1)");
    }
    if (!std::isfinite(p.exploration_fraction) || p.exploration_fraction < 0.0 ||
        p.exploration_fraction >= 1.0) {
      return fail("exploration_fraction must be in [0, 1)");
    }
  }
  if (Explores(p)) {
    if (p.exploration != SpinExploration::kRandom) {
      return fail(
          "only random exploration is on the GPU (staleness and block age need the blocks' "
          "last-scored positions)");
    }
    if (p.max_visible_blocks < 1) return fail("exploration needs max_visible_blocks >= 1");
    if (PlanInWorkspace(p)) {
      if (p.total_blocks < 1) return fail("total_blocks must be set for rows past 2^20 slots");
      if (p.workspace == nullptr || p.workspace_bytes < SpinPredictScratchBytes(p)) {
        return fail("the workspace is smaller than SpinPredictScratchBytes");
      }
      if (reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) {
        return fail("the workspace must be 16-byte aligned");
      }
    }
  }
  return true;
}

size_t SpinPredictScratchBytes(const SpinPredictParams& p) {
  if (!PlanInWorkspace(p) || p.total_blocks <= 0) return 0;
  const size_t bytes = static_cast<size_t>(p.total_blocks) * kPlanBytesPerBlock;
  return (bytes + 15) / 16 * 16;
}

cudaError_t LaunchSpinPredict(const SpinPredictParams& p, cudaStream_t stream) {
  if (!CanImplementSpinPredict(p)) return cudaErrorInvalidValue;
  if (p.num_rows == 0) return cudaSuccess;
  // Kernel 1's CTAs a row: kPredictChunks, or with the max_visible_blocks hint one iteration of
  // kPredictUnroll blocks a warp.
  int64_t chunks = kPredictChunks;
  if (p.max_visible_blocks > 0) {
    const int64_t per_cta = int64_t{kPredictWarps} * kPredictUnroll;
    const int64_t wanted = (p.max_visible_blocks + per_cta - 1) / per_cta;
    chunks = wanted > 65535 ? 65535 : wanted;
  }
  if (cudaError_t e =
          LaunchDependent("predict", PredictKernel, dim3(p.num_rows, static_cast<unsigned>(chunks)),
                          dim3(kPredictWarps * 32), 0, stream, p.positions, p.vertical,
                          p.vertical_len, p.diagonal, p.diagonal_len, RowOffsetsOf(p), p.scores);
      e != cudaSuccess) {
    return e;
  }
  if (p.selected == nullptr) return cudaSuccess;
  const bool explores = Explores(p);
  if (p.max_visible_blocks >= 1 && p.max_visible_blocks <= kSpinSharedPlanBlocks) {
    // S staged in shared memory: 4 bytes a block, and with exploration 4 more (the free list or
    // each position's latest draw).
    size_t shared_bytes = 4 * static_cast<size_t>(RoundUp4(p.max_visible_blocks));
    if (explores) shared_bytes += 4 * static_cast<size_t>(p.max_visible_blocks);
    if (shared_bytes > 24 * 1024) {  // past 48 KiB with the ~19 KiB of static shared memory
      if (cudaError_t e =
              cudaFuncSetAttribute(PlanSharedKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(shared_bytes));
          e != cudaSuccess) {
        return e;
      }
    }
    return LaunchDependent("plan", PlanSharedKernel, dim3(p.num_rows), dim3(kSelectThreads),
                           shared_bytes, stream, p.positions, RowOffsetsOf(p), p.scores, p.top_k,
                           p.target_block_sparsity, explores ? p.exploration_fraction : 0.0, p.seed,
                           p.row_seed, p.layer, p.max_visible_blocks, p.selected, p.selected_count);
  }
  const bool in_workspace = PlanInWorkspace(p);
  const size_t shared_bytes = explores && !in_workspace
                                  ? static_cast<size_t>(p.max_visible_blocks) * kPlanBytesPerBlock
                                  : 0;
  if (shared_bytes > 48 * 1024) {
    if (cudaError_t e =
            cudaFuncSetAttribute(SelectKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(shared_bytes));
        e != cudaSuccess) {
      return e;
    }
  }
  return LaunchDependent("plan", SelectKernel, dim3(p.num_rows), dim3(kSelectThreads), shared_bytes,
                         stream, p.positions, RowOffsetsOf(p), p.scores, p.top_k,
                         p.target_block_sparsity, explores ? p.exploration_fraction : 0.0, p.seed,
                         p.row_seed, p.layer, explores ? p.max_visible_blocks : 0,
                         in_workspace ? static_cast<unsigned char*>(p.workspace) : nullptr,
                         in_workspace ? p.total_blocks : 0, p.selected, p.selected_count);
}

bool CanImplementSpinUnion(const SpinUnionParams& p, const char** why) {
  auto fail = [why](const char* reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
  if (p.num_groups < 0) return fail("num_groups must be >= 0");
  if (p.num_groups == 0) return true;
  if (p.group_first_row == nullptr || p.row_block_offset == nullptr || p.selected == nullptr ||
      p.selected_count == nullptr || p.group_block_offset == nullptr || p.union_blocks == nullptr ||
      p.union_count == nullptr) {
    return fail(
        "group_first_row, row_block_offset, selected, selected_count, group_block_offset, "
        "union_blocks and union_count must be set");
  }
  return true;
}

cudaError_t LaunchSpinUnion(const SpinUnionParams& p, cudaStream_t stream) {
  if (!CanImplementSpinUnion(p)) return cudaErrorInvalidValue;
  if (p.num_groups == 0) return cudaSuccess;
  return LaunchDependent("union", UnionKernel, dim3(p.num_groups), dim3(kUnionThreads), 0, stream,
                         p.group_first_row, p.row_block_offset, p.selected, p.selected_count,
                         p.group_block_offset, p.union_blocks, p.union_count);
}

}  // namespace dsa::cuda
