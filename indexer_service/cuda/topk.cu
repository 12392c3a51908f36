// The GPU top-K (see topk.h). One CTA per row. Each selectable entry is one 64-bit rank, (order-
// preserving bits of its score) << 32 | ~slot, so the order of DESIGN.md 4.1 (score descending,
// then slot ascending) is the descending order of distinct integers and 0 marks "not selectable".
// Fast path: a strided sample of 4096 ranks, sorted, gives a threshold that at least K ranks
// reach with near certainty; one pass gathers the ranks at or above it into a shared-memory
// candidate buffer (a few K), and the exact radix select runs over that buffer. When the sample
// cannot help, fewer than K ranks pass, or the candidates overflow the buffer (many equal scores),
// the radix select runs over the whole row instead: the result never depends on the sample and no
// candidate is ever dropped.
#include <cub/block/block_scan.cuh>

#include "indexer_service/cuda/topk.h"

namespace dsa::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kRadixBits = 11;
constexpr int kBins = 1 << kRadixBits;  // 2048 = 2 bins a thread in the suffix scan
constexpr int kSampleSize = 4096;
constexpr int kMaxCandidates = 8192;
static_assert(kBins == 2 * kThreads, "the bin scan gives each thread two bins");
static_assert(kMaxTopK == 2 * kThreads, "the winners' sort gives each thread one pair");
static_assert(kSampleSize <= kMaxCandidates, "the sample lives in the candidate buffer");

constexpr size_t kSmemBytes =
    sizeof(uint64_t) * (kMaxCandidates + kMaxTopK) + sizeof(uint32_t) * kBins;

// Ranks come in tiles of kUnroll entries a thread, all loads of a tile issued before any is used,
// so that one CTA keeps enough bytes in flight to stream a row (one load at a time per thread
// would leave a 1,024-thread CTA at a few GB/s).
constexpr int kUnroll = 16;
constexpr int64_t kTile = int64_t{kThreads} * kUnroll;

__device__ inline uint64_t RankOf(float score, int64_t slot, int64_t max_slot) {
  if (!(score > -INFINITY) || slot > max_slot) return 0;
  const uint32_t bits = __float_as_uint(score + 0.0f);  // -0 becomes +0
  const uint32_t key =
      bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
  return static_cast<uint64_t>(key) << 32 | static_cast<uint32_t>(~static_cast<uint32_t>(slot));
}

// The ranks of one row in global memory: entry e's rank, or 0 when it is not selectable (NaN,
// -inf, or a slot past the row's position).
struct RowSource {
  const float* scores;
  const int32_t* blocks;  // null: entry e is slot e
  int64_t max_slot;
  int64_t size;
  __device__ int64_t SlotOf(int64_t e, int32_t block) const {
    return blocks == nullptr ? e : int64_t{block} * 64 + (e & 63);
  }
  __device__ uint64_t Rank(int64_t e) const {
    return RankOf(scores[e], SlotOf(e, blocks == nullptr ? 0 : blocks[e >> 6]), max_slot);
  }
  // ranks[j] = rank of entry base + j * kThreads + threadIdx.x (0 past the end).
  __device__ void LoadTile(int64_t base, uint64_t (&ranks)[kUnroll]) const {
    float score[kUnroll];
    int32_t block[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t e = base + j * kThreads + threadIdx.x;
      score[j] = e < size ? scores[e] : -INFINITY;
      block[j] = (blocks != nullptr && e < size) ? blocks[e >> 6] : 0;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t e = base + j * kThreads + threadIdx.x;
      ranks[j] = RankOf(score[j], SlotOf(e, block[j]), max_slot);
    }
  }
};

// Ranks already gathered into shared memory (all selectable).
struct BufferSource {
  const uint64_t* ranks;
  int64_t size;
  __device__ void LoadTile(int64_t base, uint64_t (&out)[kUnroll]) const {
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t e = base + j * kThreads + threadIdx.x;
      out[j] = e < size ? ranks[e] : 0;
    }
  }
};

struct Shared {
  cub::BlockScan<uint32_t, kThreads>::TempStorage scan;
  uint32_t digit, above, total, count;
};

// Calls visit(rank) for every entry of `source` (0 past the end), with all 32 lanes of each warp
// in step, so visit may use warp collectives.
template <typename Source, typename Visit>
__device__ inline void ForEachRank(const Source& source, Visit visit) {
  for (int64_t base = 0; base < source.size; base += kTile) {
    uint64_t ranks[kUnroll];
    source.LoadTile(base, ranks);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (base + j * kThreads >= source.size) break;  // uniform across the CTA
      visit(ranks[j]);
    }
  }
}

// Appends every rank >= threshold (threshold > 0) of `source` to out[] (warp-aggregated: one
// shared atomic per warp and step); *count receives the number of such ranks even past
// `capacity`, which is never written beyond. *count must be 0 on entry (set before a barrier).
template <typename Source>
__device__ inline void GatherAtLeast(const Source& source, uint64_t threshold, uint64_t* out,
                                     uint32_t capacity, uint32_t* count) {
  const int lane = threadIdx.x % 32;
  ForEachRank(source, [&](uint64_t rank) {
    const bool take = rank >= threshold;
    const uint32_t mask = __ballot_sync(0xffffffffu, take);
    if (mask == 0) return;
    uint32_t base = 0;
    if (lane == 0) base = atomicAdd(count, static_cast<uint32_t>(__popc(mask)));
    base = __shfl_sync(0xffffffffu, base, 0);
    const uint32_t position = base + __popc(mask & ((1u << lane) - 1));
    if (take && position < capacity) out[position] = rank;
  });
}

// The exact radix select: the smallest threshold such that the ranks of `source` at or above it
// are its min(k, selectable) largest. 11 bits a pass from the top, over the ranks that share the
// prefix fixed so far, stopping once the k-th rank's bin is taken whole. Histogram increments are
// aggregated over the lanes of a warp that hit the same bin (__match_any_sync), so many equal
// scores cost no more than distinct ones.
template <typename Source>
__device__ uint64_t RadixThreshold(const Source& source, uint32_t k, uint32_t* hist,
                                   Shared& shared) {
  const int lane = threadIdx.x % 32;
  uint64_t prefix = 0;  // the fixed bits above `high`
  uint32_t need = k;    // ranks still to take among those that share the prefix
  for (int pass = 0, shift = 64; shift > 0; ++pass) {
    const int high = shift;
    const int width = shift >= kRadixBits ? kRadixBits : shift;
    shift -= width;
    for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
    __syncthreads();
    ForEachRank(source, [&](uint64_t rank) {
      const bool counted = rank != 0 && (high == 64 || (rank >> high) == prefix);
      const uint32_t digit =
          counted ? static_cast<uint32_t>(rank >> shift) & ((1u << width) - 1) : 0xffffffffu;
      const uint32_t peers = __match_any_sync(0xffffffffu, digit);
      if (counted && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
    });
    __syncthreads();
    // Suffix sums: thread t holds bins 2047 - 2t and 2046 - 2t (descending digits).
    const int bin_high = kBins - 1 - 2 * threadIdx.x, bin_low = bin_high - 1;
    const uint32_t count_high = hist[bin_high], count_low = hist[bin_low];
    uint32_t above, total;
    cub::BlockScan<uint32_t, kThreads>(shared.scan)
        .ExclusiveSum(count_high + count_low, above, total);
    if (above < need && need <= above + count_high) {
      shared.digit = bin_high;
      shared.above = above;
    } else if (above + count_high < need && need <= above + count_high + count_low) {
      shared.digit = bin_low;
      shared.above = above + count_high;
    }
    if (threadIdx.x == 0) shared.total = total;
    __syncthreads();
    if (pass == 0 && shared.total <= k) {
      __syncthreads();
      return 1;  // every selectable rank
    }
    const uint32_t digit = shared.digit;
    need -= shared.above;
    prefix = (prefix << width) | digit;
    const uint32_t in_bin = hist[digit];
    __syncthreads();  // hist and the shared values are read before the next pass writes them
    if (in_bin == need) return prefix << shift;  // the whole bin is taken
  }
  return 1;  // unreachable: at shift 0 the bin holds one rank (ranks are distinct)
}

// One compare-exchange step of the bitonic sort on the pair of elements a thread holds in
// registers (elements 2t and 2t + 1): partner element e ^ stride lives in thread t ^ (stride / 2)
// (a shuffle within the warp: 2 <= stride <= 32).
__device__ inline uint64_t ExchangeInRegisters(uint64_t x, int element, int stride, int size) {
  const uint64_t other = __shfl_xor_sync(0xffffffffu, x, stride / 2);
  const bool lower = (element & stride) == 0;
  const bool descending = (element & size) == 0;
  return (lower == descending) ? max(x, other) : min(x, other);
}

// Sorts a[0, kMaxTopK) descending in shared memory. All threads must call it. Steps whose stride
// is at least 64 elements go through shared memory (one barrier each); the rest of each merge
// runs on the two elements a thread holds, with warp shuffles and no barrier.
__device__ void SortWinnersDescending(uint64_t* a) {
  const int t = threadIdx.x;
  const int e0 = 2 * t, e1 = 2 * t + 1;
  for (int size = 2; size <= kMaxTopK; size <<= 1) {
    int stride = size / 2;
    for (; stride >= 64; stride >>= 1) {
      const int i = 2 * t - (t & (stride - 1));
      const int j = i + stride;
      const bool descending = (i & size) == 0;
      const uint64_t x = a[i], y = a[j];
      if ((x < y) == descending) {
        a[i] = y;
        a[j] = x;
      }
      __syncthreads();
    }
    uint64_t x0 = a[e0], x1 = a[e1];
    for (; stride >= 2; stride >>= 1) {
      x0 = ExchangeInRegisters(x0, e0, stride, size);
      x1 = ExchangeInRegisters(x1, e1, stride, size);
    }
    // stride 1: the pair inside the thread
    const bool descending = (e0 & size) == 0;
    if ((x0 < x1) == descending) {
      const uint64_t tmp = x0;
      x0 = x1;
      x1 = tmp;
    }
    a[e0] = x0;
    a[e1] = x1;
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads) TopKKernel(TopKParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint64_t* candidates = reinterpret_cast<uint64_t*>(smem);
  uint64_t* winners = candidates + kMaxCandidates;
  uint32_t* hist = reinterpret_cast<uint32_t*>(winners + kMaxTopK);
  __shared__ Shared shared;

  const int row = blockIdx.x;
  RowSource source;
  source.size = p.row_num_entries[row];
  source.scores = p.scores + p.row_score_offset[row];
  source.blocks =
      p.logical_blocks == nullptr ? nullptr : p.logical_blocks + p.row_block_offset[row];
  source.max_slot = p.row_max_slot[row];
  const uint32_t k = static_cast<uint32_t>(p.k);
  const int64_t n = source.size;

  // Fast path: sample, threshold, gather candidates, select among them.
  bool selected = false;
  uint64_t threshold = 0;
  if (n >= 4 * kSampleSize && 4 * int64_t{k} <= n) {
    for (int i = threadIdx.x; i < kSampleSize; i += kThreads) {
      candidates[i] = source.Rank(i * n / kSampleSize + (n / kSampleSize) / 2);
    }
    __syncthreads();
    // The sample holds each of the k best with probability k / n: ask for 4 standard deviations
    // (and 2) more than the expected count, so fewer than k reach the threshold only rarely.
    const double expected = static_cast<double>(kSampleSize) * k / static_cast<double>(n);
    const int position = static_cast<int>(ceil(expected + 4.0 * sqrt(expected) + 2.0));
    uint64_t sample_threshold = 0;
    if (position <= kSampleSize) {
      // The ranks at or above it are the `position` best of the sample (1: fewer are selectable).
      sample_threshold = RadixThreshold(BufferSource{candidates, kSampleSize},
                                        static_cast<uint32_t>(position), hist, shared);
      if (sample_threshold == 1) sample_threshold = 0;
    }
    if (threadIdx.x == 0) shared.count = 0;
    __syncthreads();
    if (sample_threshold != 0) {
      GatherAtLeast(source, sample_threshold, candidates, kMaxCandidates, &shared.count);
      __syncthreads();
      const uint32_t gathered = shared.count;
      if (gathered >= k && gathered <= kMaxCandidates) {
        const BufferSource buffer{candidates, gathered};
        threshold = RadixThreshold(buffer, k, hist, shared);
        if (threadIdx.x == 0) shared.count = 0;
        __syncthreads();
        GatherAtLeast(buffer, threshold, winners, kMaxTopK, &shared.count);
        selected = true;
      }
      __syncthreads();
    }
  }
  if (!selected) {  // exact over the whole row
    threshold = RadixThreshold(source, k, hist, shared);
    if (threadIdx.x == 0) shared.count = 0;
    __syncthreads();
    GatherAtLeast(source, threshold, winners, kMaxTopK, &shared.count);
  }
  __syncthreads();
  const uint32_t taken = min(shared.count, static_cast<uint32_t>(kMaxTopK));
  for (uint32_t i = taken + threadIdx.x; i < kMaxTopK; i += kThreads) winners[i] = 0;
  __syncthreads();
  SortWinnersDescending(winners);
  int32_t* out = p.selection + static_cast<int64_t>(row) * p.k;
  for (int i = threadIdx.x; i < p.k; i += kThreads) {
    out[i] = static_cast<uint32_t>(i) < taken
                 ? static_cast<int32_t>(~static_cast<uint32_t>(winners[i]))
                 : -1;
  }
}

}  // namespace

bool CanImplementTopK(const TopKParams& p, const char** why) {
  const char* reason = nullptr;
  if (p.k < 1 || p.k > kMaxTopK) {
    reason = "k outside [1, 2048]";
  } else if (p.num_rows < 0) {
    reason = "num_rows < 0";
  } else if (p.num_rows > 0 &&
             (p.scores == nullptr || p.row_score_offset == nullptr ||
              p.row_num_entries == nullptr || p.row_max_slot == nullptr || p.selection == nullptr ||
              (p.logical_blocks != nullptr && p.row_block_offset == nullptr))) {
    reason = "null pointer";
  }
  if (why != nullptr) *why = reason;
  return reason == nullptr;
}

cudaError_t LaunchTopK(const TopKParams& p, cudaStream_t stream) {
  if (!CanImplementTopK(p)) return cudaErrorInvalidValue;
  if (p.num_rows == 0) return cudaSuccess;
  if (cudaError_t e = cudaFuncSetAttribute(TopKKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kSmemBytes));
      e != cudaSuccess) {
    return e;
  }
  TopKKernel<<<static_cast<unsigned>(p.num_rows), kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsa::cuda
