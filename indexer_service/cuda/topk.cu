// The GPU top-K (see topk.h). Each selectable entry is one 64-bit rank, (order-preserving bits
// of its score) << 32 | ~slot, so the order of DESIGN.md 4.1 (score descending, then slot
// ascending) is the descending order of distinct integers and 0 marks "not selectable".
// One thread-block cluster of C CTAs per row (C in 1..16, chosen per launch so that the rows'
// clusters fill the GPU in one wave): CTA c owns a contiguous chunk of the row. An exact radix
// select runs over the whole row, 11 bits a pass from the top: each CTA histograms its chunk
// into its own shared memory, each CTA sums one slice of the bins over the cluster through
// distributed shared memory, and every thread reads its bins' sums from their slice's owner
// (all CTAs reach the same decisions, so no broadcast is needed). The passes stop once the
// ranks at or above the chosen bin are exactly the K best (the bin is taken whole) or few enough
// (<= 8,192) to hold: every CTA then gathers them into CTA 0's shared memory, where an exact radix
// select over the candidates (when needed) and a bitonic sort of the winners finish the row. The
// counts are exact, so no candidate buffer can overflow and nothing is ever dropped, whatever the
// number of equal scores.
#include <cooperative_groups.h>

#include <cub/block/block_scan.cuh>
#include <mutex>

#include "indexer_service/cuda/topk.h"

namespace dsa::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 1024;
constexpr int kRadixBits = 11;
constexpr int kBins = 1 << kRadixBits;  // 2048 = 2 bins a thread in the suffix scan
constexpr int kMaxCandidates = 8192;
constexpr int kLogMaxCluster = 4;  // clusters of up to 16 CTAs (past the portable 8)
static_assert(kBins == 2 * kThreads, "the bin scan gives each thread two bins");
static_assert(kMaxTopK == 2 * kThreads, "the winners' sort gives each thread one pair");

// Candidates, winners, two histograms and two cluster sums (the passes alternate between them, so
// a CTA may fill the next pass's while the cluster still reads the last's).
constexpr size_t kSmemBytes =
    sizeof(uint64_t) * (kMaxCandidates + kMaxTopK) + sizeof(uint32_t) * 4 * kBins;

// Ranks come in tiles of kUnroll entries a thread, all loads of a tile issued before any is used,
// so that a CTA keeps bytes in flight while it streams its chunk.
constexpr int kUnroll = 4;  // measured on the H200: 4 beat 8 and 16 at every shape (fewer stalls)
constexpr int64_t kTile = int64_t{kThreads} * kUnroll;

__device__ inline uint64_t RankOf(float score, int64_t slot, int64_t max_slot) {
  if (!(score > -INFINITY) || slot > max_slot) return 0;
  const uint32_t bits = __float_as_uint(score + 0.0f);  // -0 becomes +0
  const uint32_t key =
      bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
  return static_cast<uint64_t>(key) << 32 | static_cast<uint32_t>(~static_cast<uint32_t>(slot));
}

// The ranks of entries [begin, begin + size) of one row in global memory: entry e's rank, or 0
// when it is not selectable (NaN, -inf, or a slot past the row's position).
struct RowSource {
  const float* scores;
  const int32_t* blocks;  // null: entry e is slot e
  int64_t max_slot;
  int64_t begin;
  int64_t size;
  __device__ int64_t SlotOf(int64_t e, int32_t block) const {
    return blocks == nullptr ? e : int64_t{block} * 64 + (e & 63);
  }
  // ranks[j] = rank of entry begin + base + j * kThreads + threadIdx.x (0 past the end).
  __device__ void LoadTile(int64_t base, uint64_t (&ranks)[kUnroll]) const {
    float score[kUnroll];
    int32_t block[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = base + j * kThreads + threadIdx.x;
      score[j] = i < size ? scores[begin + i] : -INFINITY;
      block[j] = (blocks != nullptr && i < size) ? blocks[(begin + i) >> 6] : 0;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t e = begin + base + j * kThreads + threadIdx.x;
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
  uint32_t digit, above, in_bin, total, count;
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

struct Selection {
  uint64_t threshold;  // the ranks at or above it are kept
  bool exact;          // they are exactly the min(k, selectable) best (else: candidates)
};

// The radix select: the smallest threshold such that the ranks of `source` at or above it are its
// min(k, selectable) largest (exact), or, when `capacity` > 0, a threshold that at least those and
// at most `capacity` ranks reach, whichever a pass finds first. 11 bits a pass from the top, over
// the ranks that share the prefix fixed so far, stopping once the k-th rank's bin is taken whole
// (or the ranks at or above it fit in `capacity`). Histogram increments are plain shared-memory
// atomics, one a counted rank: measured faster than aggregating a warp's equal digits with
// __match_any_sync at every shape, rows of all-equal scores included (docs/gpu_kernels.md step
// 10). kCluster: `source` is this CTA's chunk of the row and the counts are the sums of
// the histograms of every CTA of the cluster (read through distributed shared memory); all CTAs
// of the cluster must call it and get the same answer. hists: 4 * kBins counters (two histograms
// and two slices of sums; the passes alternate between them).
template <bool kCluster, typename Source>
__device__ Selection RadixSelect(const Source& source, uint32_t k, uint32_t capacity,
                                 uint32_t* hists, Shared& shared) {
  uint64_t prefix = 0;  // the fixed bits above `high`
  uint32_t need = k;    // ranks still to take among those that share the prefix
  for (int pass = 0, shift = 64; shift > 0; ++pass) {
    const int high = shift;
    const int width = shift >= kRadixBits ? kRadixBits : shift;
    shift -= width;
    uint32_t* hist = hists + (pass & 1) * kBins;
    uint32_t* sum = hists + (2 + (pass & 1)) * kBins;  // the cluster's sums of this CTA's slice
    for (int i = threadIdx.x; i < kBins; i += kThreads) {
      hist[i] = 0;
      if constexpr (kCluster) sum[i] = 0;
    }
    __syncthreads();
    ForEachRank(source, [&](uint64_t rank) {
      if (rank != 0 && (high == 64 || (rank >> high) == prefix)) {
        atomicAdd(&hist[static_cast<uint32_t>(rank >> shift) & ((1u << width) - 1)], 1u);
      }
    });
    // Suffix sums: thread t holds bins 2047 - 2t and 2046 - 2t (descending digits).
    const int bin_high = kBins - 1 - 2 * threadIdx.x, bin_low = bin_high - 1;
    uint32_t count_high = 0, count_low = 0;
    if constexpr (kCluster) {
      // Each CTA sums a slice of the bins over the cluster (one 16-byte remote load a thread),
      // then each thread reads its two bins' sums from their slice's owner: ~1.5K remote
      // requests a CTA a pass, where reading every CTA's whole histogram took C x 2K.
      cg::cluster_group cluster = cg::this_cluster();
      cluster.sync();  // every CTA's histogram is complete (and visible cluster-wide)
      const unsigned num_ctas = cluster.num_blocks();
      const unsigned slice = kBins / num_ctas;  // bins a CTA sums (>= 128)
      if (threadIdx.x < kBins / 4) {
        const unsigned from = threadIdx.x / (slice / 4);
        const unsigned bin = cluster.block_rank() * slice + 4 * (threadIdx.x % (slice / 4));
        const uint4 v = *reinterpret_cast<const uint4*>(cluster.map_shared_rank(hist, from) + bin);
        if (v.x != 0) atomicAdd(&sum[bin], v.x);
        if (v.y != 0) atomicAdd(&sum[bin + 1], v.y);
        if (v.z != 0) atomicAdd(&sum[bin + 2], v.z);
        if (v.w != 0) atomicAdd(&sum[bin + 3], v.w);
      }
      cluster.sync();  // every slice is summed
      const uint2 pair = *reinterpret_cast<const uint2*>(
          cluster.map_shared_rank(sum, static_cast<unsigned>(bin_low) / slice) + bin_low);
      count_low = pair.x;
      count_high = pair.y;
    } else {
      __syncthreads();
      count_high = hist[bin_high];
      count_low = hist[bin_low];
    }
    uint32_t above, total;
    cub::BlockScan<uint32_t, kThreads>(shared.scan)
        .ExclusiveSum(count_high + count_low, above, total);
    if (above < need && need <= above + count_high) {
      shared.digit = bin_high;
      shared.above = above;
      shared.in_bin = count_high;
    } else if (above + count_high < need && need <= above + count_high + count_low) {
      shared.digit = bin_low;
      shared.above = above + count_high;
      shared.in_bin = count_low;
    }
    if (threadIdx.x == 0) shared.total = total;
    __syncthreads();
    if (pass == 0 && shared.total <= k) return {1, true};  // every selectable rank
    need -= shared.above;
    prefix = (prefix << width) | shared.digit;
    const uint32_t in_bin = shared.in_bin;
    // The shared values are rewritten in the next pass only after its first barrier.
    if (in_bin == need) return {prefix << shift, true};  // the whole bin is taken
    if (k - need + in_bin <= capacity) return {prefix << shift, false};
  }
  return {1, true};  // unreachable: at shift 0 the bin holds one rank (ranks are distinct)
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

// -DDSA_TOPK_TRACE: CTA 0 of row 0 prints the time of each phase (globaltimer, us) at every
// launch: how docs/gpu_kernels.md step 6 split the time. Off in every normal build.
#ifdef DSA_TOPK_TRACE
__device__ inline uint64_t Now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define TRACE(i) \
  if (blockIdx.x == 0 && threadIdx.x == 0) trace[i] = Now();
#else
#define TRACE(i)
#endif

__global__ void __launch_bounds__(kThreads) TopKKernel(TopKParams p) {
#ifdef DSA_TOPK_TRACE
  uint64_t trace[8] = {};
#endif
  TRACE(0);
  extern __shared__ __align__(16) uint8_t smem[];
  uint64_t* candidates = reinterpret_cast<uint64_t*>(smem);
  uint64_t* winners = candidates + kMaxCandidates;
  uint32_t* hists = reinterpret_cast<uint32_t*>(winners + kMaxTopK);
  __shared__ Shared shared;

  cg::cluster_group cluster = cg::this_cluster();
  const unsigned num_ctas = cluster.num_blocks();
  const unsigned cta = cluster.block_rank();
  const int row = static_cast<int>(blockIdx.x / num_ctas);
  const int64_t n = p.row_num_entries[row];
  // This CTA's chunk: entries [begin, begin + size), chunks a multiple of 64 entries.
  const int64_t chunk = ((n + num_ctas - 1) / num_ctas + 63) / 64 * 64;
  RowSource source;
  source.scores = p.scores + p.row_score_offset[row];
  source.blocks =
      p.logical_blocks == nullptr ? nullptr : p.logical_blocks + p.row_block_offset[row];
  source.max_slot = p.row_max_slot[row];
  source.begin = min(n, chunk * cta);
  source.size = min(n, source.begin + chunk) - source.begin;
  const uint32_t k = static_cast<uint32_t>(p.k);
  if (threadIdx.x == 0) shared.count = 0;  // CTA 0's is the cluster's gather counter

  // Over the whole row (the cluster's chunks): the exact threshold or one that a few K reach.
  const Selection row_selection = RadixSelect<true>(source, k, kMaxCandidates, hists, shared);
  TRACE(1);
  // Every CTA appends its ranks at or above it to CTA 0's buffer (exact counts: no overflow).
  uint64_t* target = row_selection.exact ? winners : candidates;
  GatherAtLeast(source, row_selection.threshold, cluster.map_shared_rank(target, 0),
                row_selection.exact ? kMaxTopK : kMaxCandidates,
                cluster.map_shared_rank(&shared.count, 0));
  cluster.sync();  // the gather is complete and visible in CTA 0
  TRACE(2);
  if (cta != 0) return;

  if (!row_selection.exact) {  // exact select among the candidates
    const BufferSource buffer{candidates, shared.count};
    const uint64_t threshold = RadixSelect<false>(buffer, k, 0, hists, shared).threshold;
    TRACE(3);
    if (threadIdx.x == 0) shared.count = 0;
    __syncthreads();
    GatherAtLeast(buffer, threshold, winners, kMaxTopK, &shared.count);
  }
  __syncthreads();
  const uint32_t taken = min(shared.count, static_cast<uint32_t>(kMaxTopK));
  for (uint32_t i = taken + threadIdx.x; i < kMaxTopK; i += kThreads) winners[i] = 0;
  __syncthreads();
  TRACE(4);
  SortWinnersDescending(winners);
  TRACE(5);
  int32_t* out = p.selection + static_cast<int64_t>(row) * p.k;
  for (int i = threadIdx.x; i < p.k; i += kThreads) {
    out[i] = static_cast<uint32_t>(i) < taken
                 ? static_cast<int32_t>(~static_cast<uint32_t>(winners[i]))
                 : -1;
  }
#ifdef DSA_TOPK_TRACE
  __syncthreads();
  TRACE(6);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    printf(
        "trace C=%u cand=%d select %.2f gather %.2f local %.2f gather2 %.2f sort %.2f out %.2f\n",
        num_ctas, row_selection.exact ? -1 : 0, (trace[1] - trace[0]) * 1e-3,
        (trace[2] - trace[1]) * 1e-3, trace[3] ? (trace[3] - trace[2]) * 1e-3 : 0.0,
        (trace[4] - (trace[3] ? trace[3] : trace[2])) * 1e-3, (trace[5] - trace[4]) * 1e-3,
        (trace[6] - trace[5]) * 1e-3);
  }
#endif
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

namespace {

// Per device: how many clusters of 1, 2, 4, 8 and 16 CTAs can be resident at once (0: none).
struct ClusterLimits {
  cudaError_t error = cudaSuccess;
  int max_active[kLogMaxCluster + 1] = {};
};

ClusterLimits QueryClusterLimits() {
  ClusterLimits limits;
  cudaError_t& e = limits.error;
  e = cudaFuncSetAttribute(TopKKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kSmemBytes));
  if (e != cudaSuccess) return limits;
  // 16 is past the portable cluster size (8); where the device cannot hold it, it is not used.
  if (cudaFuncSetAttribute(TopKKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
      cudaSuccess) {
    (void)cudaGetLastError();
  }
  for (int i = 0; i <= kLogMaxCluster; ++i) {
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = 1u << i;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.gridDim = dim3(1u << i);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmemBytes;
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, TopKKernel, &config) != cudaSuccess) {
      (void)cudaGetLastError();
      clusters = 0;
    }
    limits.max_active[i] = clusters;
  }
  if (limits.max_active[0] == 0) e = cudaErrorInvalidConfiguration;
  return limits;
}

constexpr int kMaxDevices = 64;

}  // namespace

cudaError_t LaunchTopK(const TopKParams& p, cudaStream_t stream) {
  if (!CanImplementTopK(p)) return cudaErrorInvalidValue;
  if (p.num_rows == 0) return cudaSuccess;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  static std::once_flag once[kMaxDevices];
  static ClusterLimits limits[kMaxDevices];
  std::call_once(once[device], [&] { limits[device] = QueryClusterLimits(); });
  if (limits[device].error != cudaSuccess) return limits[device].error;
  // The largest cluster with which every row's cluster is resident at once (one wave).
  int log_cluster = 0;
  for (int i = kLogMaxCluster; i > 0; --i) {
    if (p.num_rows <= limits[device].max_active[i]) {
      log_cluster = i;
      break;
    }
  }
  const unsigned cluster = 1u << log_cluster;
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.gridDim = dim3(static_cast<unsigned>(p.num_rows) * cluster);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  if (cudaError_t e = cudaLaunchKernelEx(&config, TopKKernel, p); e != cudaSuccess) return e;
  return cudaGetLastError();
}

}  // namespace dsa::cuda
