// The GPU top-K (see topk.h). Each selectable entry is one 64-bit rank, (order-preserving bits
// of its score) << 32 | ~slot, so the order of DESIGN.md 4.1 (score descending, then slot
// ascending) is the descending order of distinct integers and 0 marks "not selectable".
// One thread-block cluster of C CTAs per row (C in 1..16, chosen per launch so that the rows'
// clusters fill the GPU in one wave): CTA c owns a contiguous chunk of the row. A chunk of at
// most 32K entries is copied once into the CTA's shared memory (cp.async, the whole chunk in
// flight) and held there as 32-bit keys. A longer one is streamed from global memory: a strided
// sample of it picks a threshold, one read gathers the ranks above it into the CTA's shared
// memory, and the select below runs over those (SampledGather); a sample that misjudges the row
// sends it to the same select streamed from global memory each pass.
// An exact radix select runs over the whole row, 11 bits a pass from the top: each CTA
// histograms its chunk into its own shared memory, each CTA sums one slice of the bins over the
// cluster through distributed shared memory, and every thread reads its bins' sums from their
// slice's owner (all CTAs reach the same decisions, so no broadcast is needed). Bits that every
// selectable rank shares (found in the first pass) are skipped. The passes stop
// once the ranks at or above the chosen bin are exactly the K best (the bin is taken whole) or
// few enough to hold in CTA 0's candidate buffer: every CTA then gathers them there, and CTA 0
// orders them by one counting pass (a histogram of 2,048 bins over the candidates' range, a
// scatter into the bins, then each candidate's place is its bin's start plus the number of larger
// ranks in its bin) and writes the K best. Candidates so crowded that the in-bin counting would
// cost more than a sort fall back to an exact radix select among them and a bitonic sort of the
// winners. The counts are exact, so no buffer can overflow and nothing is ever dropped, whatever
// the number of equal scores.
#include <cooperative_groups.h>

#include <cub/block/block_scan.cuh>
#include <mutex>

#include "indexer_service/cuda/dependent_launch.cuh"
#include "indexer_service/cuda/topk.h"

namespace dsa::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 1024;
constexpr int kRadixBits = 11;
constexpr int kBins = 1 << kRadixBits;  // 2048 = 2 bins a thread in the suffix scan
constexpr int kLogMaxCluster = 4;       // clusters of up to 16 CTAs (past the portable 8)
static_assert(kBins == 2 * kThreads, "the bin scan gives each thread two bins");
static_assert(kMaxTopK == 2 * kThreads, "the winners' sort gives each thread one pair");

// A chunk of at most kCacheEntries entries is held in shared memory as 32-bit keys (0: not
// selectable), its block ids beside it. Longer chunks are streamed from global memory: the cache
// then holds the chunk's sample and the ranks it gathers (SampledGather), or, when the sample
// misjudged the row and the select streams each pass, CTA 0's candidates (up to
// kStreamCandidates).
constexpr int kCacheEntries = 32768;
constexpr int kCacheBlocks = kCacheEntries / 64;
constexpr int kCachedCandidates = 4096;  // CTA 0's buffer when the chunks are cached
constexpr int kStreamCandidates = 8192;  // in CTA 0's cache when they are streamed
constexpr size_t kCacheBytes = sizeof(uint32_t) * kCacheEntries;
constexpr size_t kBlockCacheBytes = sizeof(int32_t) * kCacheBlocks;
constexpr size_t kHistBytes = sizeof(uint32_t) * 4 * kBins;
// The second half of the cache: CTA 0's scratch once the gather is over (the finish's scatter,
// or the fallback's winners); the streamed select's candidates take the first half.
constexpr size_t kScratchOffset = kCacheBytes / 2;
static_assert(sizeof(uint64_t) * kStreamCandidates <= kScratchOffset, "candidates fit the cache");
static_assert(sizeof(uint64_t) * kStreamCandidates <= kCacheBytes - kScratchOffset,
              "the scratch holds every candidate");

// Cache, block ids, two histograms and two cluster sums (the passes alternate between them, so a
// CTA may fill the next pass's while the cluster still reads the last's), cached candidates.
constexpr size_t kSmemBytes =
    kCacheBytes + kBlockCacheBytes + kHistBytes + sizeof(uint64_t) * kCachedCandidates;

// Ranks come in tiles of kUnroll entries a thread, all loads of a tile issued before any is used,
// so that a CTA keeps bytes in flight while it streams its chunk.
constexpr int kUnroll = 4;  // measured on the H200: 4 beat 8 and 16 at every shape (fewer stalls)
constexpr int64_t kTile = int64_t{kThreads} * kUnroll;

// The order-preserving 32-bit key of a score (never 0), or 0 for NaN and -inf; before the
// position's mask, so at least the key of the entry's rank.
__device__ inline uint32_t UnmaskedKeyOf(float score) {
  if (!(score > -INFINITY)) return 0;
  const uint32_t bits = __float_as_uint(score + 0.0f);  // -0 becomes +0
  return bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
}

// The key of a selectable score, or 0 when it is not selectable (NaN, -inf, or a slot past the
// row's position).
__device__ inline uint32_t KeyOf(float score, int64_t slot, int64_t max_slot) {
  return slot > max_slot ? 0 : UnmaskedKeyOf(score);
}

__device__ inline uint64_t RankOfKey(uint32_t key, int64_t slot) {
  return key == 0 ? 0
                  : static_cast<uint64_t>(key) << 32 |
                        static_cast<uint32_t>(~static_cast<uint32_t>(slot));
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
  // The rank of entry begin + i (i < size), whose score is `score`.
  __device__ uint64_t RankOf(int64_t i, float score) const {
    const int64_t e = begin + i;
    const int64_t slot = SlotOf(e, blocks != nullptr ? blocks[e >> 6] : 0);
    return RankOfKey(KeyOf(score, slot, max_slot), slot);
  }
  __device__ uint64_t RankAt(int64_t i) const { return RankOf(i, scores[begin + i]); }
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
      const int64_t slot = SlotOf(e, block[j]);
      ranks[j] = RankOfKey(KeyOf(score[j], slot, max_slot), slot);
    }
  }
};

// The same chunk held in shared memory: keys[i] is entry begin + i's key (0: not selectable),
// block_ids[i / 64] its block (begin is a multiple of 64).
struct CacheSource {
  const uint32_t* keys;
  const int32_t* block_ids;
  bool blocked;  // false: entry e is slot e
  int64_t begin;
  int64_t size;
  __device__ int64_t SlotOf(int64_t i) const {
    return blocked ? int64_t{block_ids[i >> 6]} * 64 + (i & 63) : begin + i;
  }
  __device__ void LoadTile(int64_t base, uint64_t (&ranks)[kUnroll]) const {
    uint32_t key[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = base + j * kThreads + threadIdx.x;
      key[j] = i < size ? keys[i] : 0;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      ranks[j] = key[j] == 0 ? 0 : RankOfKey(key[j], SlotOf(base + j * kThreads + threadIdx.x));
    }
  }
};

// cp.async of one 4-byte word (the chunk needs no alignment beyond its elements').
__device__ inline void CopyAsync4(void* shared, const void* global) {
  const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(to), "l"(global) : "memory");
}
__device__ inline void CommitCopies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ inline void WaitCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// The chunk's copy into the cache goes out in kCopyGroups groups (each thread's part of a group
// is 8 entries), all issued at once, so that the whole chunk is in flight; the first pass
// converts group g while the later ones still arrive.
constexpr int kCopyGroups = 4;
constexpr int kGroupEntries = kCacheEntries / kCopyGroups;

__device__ void IssueChunkCopy(const RowSource& row, uint32_t* keys, int32_t* block_ids) {
#pragma unroll
  for (int g = 0; g < kCopyGroups; ++g) {
    if (g == 0 && row.blocks != nullptr) {
      const int64_t num_blocks = (row.size + 63) / 64;
      for (int64_t b = threadIdx.x; b < num_blocks; b += kThreads) {
        CopyAsync4(block_ids + b, row.blocks + (row.begin >> 6) + b);
      }
    }
#pragma unroll
    for (int j = 0; j < kGroupEntries / kThreads; ++j) {
      const int64_t i = int64_t{g} * kGroupEntries + j * kThreads + threadIdx.x;
      if (i < row.size) CopyAsync4(keys + i, row.scores + row.begin + i);
    }
    CommitCopies();  // every thread commits every group (some empty): uniform counts
  }
}

// The AND and the OR of the selectable ranks a thread has seen: the bits where they agree are
// common to all of them.
struct BitsSeen {
  uint64_t all = ~uint64_t{0}, any = 0;
  __device__ void Add(uint64_t rank) {
    all &= rank;
    any |= rank;
  }
};

// The first pass over a cached chunk: as each group lands, its scores become keys in place and
// their top 11 bits (the rank's bits 63..53) are counted. Each thread converts the entries it
// copied itself, so only the block ids (copied by others) need a barrier.
__device__ void ConvertChunk(const RowSource& row, uint32_t* keys, const int32_t* block_ids,
                             uint32_t* hist) {
#pragma unroll
  for (int g = 0; g < kCopyGroups; ++g) {
    if (g == 0) WaitCopies<kCopyGroups - 1>();
    if (g == 1) WaitCopies<kCopyGroups - 2>();
    if (g == 2) WaitCopies<kCopyGroups - 3>();
    if (g == 3) WaitCopies<0>();
    static_assert(kCopyGroups == 4, "one wait a group");
    if (g == 0) __syncthreads();  // the block ids
#pragma unroll
    for (int j = 0; j < kGroupEntries / kThreads; ++j) {
      const int64_t i = int64_t{g} * kGroupEntries + j * kThreads + threadIdx.x;
      if (i < row.size) {
        const int64_t slot =
            row.blocks == nullptr ? row.begin + i : int64_t{block_ids[i >> 6]} * 64 + (i & 63);
        const uint32_t key = KeyOf(__uint_as_float(keys[i]), slot, row.max_slot);
        keys[i] = key;
        if (key != 0) atomicAdd(&hist[key >> (32 - kRadixBits)], 1u);
      }
    }
  }
}

// Ranks in shared memory (0: not selectable, skipped by every pass).
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
  uint32_t digit, above, in_bin, total, count, work;
  uint64_t all, any;          // RadixSelect, a pass after a one-bin pass: this CTA's BitsSeen
  uint64_t row_all, row_any;  // and the cluster's
  uint32_t gathered;  // the sampled select: this CTA's ranks at or above the sample's threshold
  bool sampled_ok;    // the sampled select holds the row's K best
  uint64_t low[kThreads / 32], high[kThreads / 32];
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

// Appends `rank` to out[] when it is >= threshold, for the 32 lanes of a warp at once (all must
// call it together): one atomic on *count a warp, which counts every taken rank even past
// `capacity`; out[] is never written at or beyond `capacity`.
__device__ inline void AppendIfAtLeast(uint64_t rank, uint64_t threshold, uint64_t* out,
                                       uint32_t capacity, uint32_t* count) {
  const int lane = threadIdx.x % 32;
  const bool take = rank >= threshold;
  const uint32_t mask = __ballot_sync(0xffffffffu, take);
  if (mask == 0) return;
  uint32_t base = 0;
  if (lane == 0) base = atomicAdd(count, static_cast<uint32_t>(__popc(mask)));
  base = __shfl_sync(0xffffffffu, base, 0);
  const uint32_t position = base + __popc(mask & ((1u << lane) - 1));
  if (take && position < capacity) out[position] = rank;
}

// Appends every rank >= threshold (threshold > 0) of `source` to out[] (AppendIfAtLeast);
// *count receives the number of such ranks even past `capacity`, which is never written beyond.
// *count must be 0 on entry (set before a barrier).
template <typename Source>
__device__ inline void GatherAtLeast(const Source& source, uint64_t threshold, uint64_t* out,
                                     uint32_t capacity, uint32_t* count) {
  ForEachRank(source,
              [&](uint64_t rank) { AppendIfAtLeast(rank, threshold, out, capacity, count); });
}

// GatherAtLeast over a row in global memory, where nearly every entry falls below the threshold:
// a rank >= threshold needs a score key >= threshold >> 32, so an entry is first tested on its
// score alone (a conversion and a compare), and only a warp with a lane past that test reads
// block ids and builds ranks. Scores aligned to 16 bytes are read 4 at a time (kUnroll float4 a
// thread in flight), the rest one at a time.
constexpr int kVectorUnroll = 4;  // float4 loads a thread in flight (4 spilled registers)
__device__ void GatherRowAtLeast(const RowSource& row, uint64_t threshold, uint64_t* out,
                                 uint32_t capacity, uint32_t* count) {
  const uint32_t key_floor = static_cast<uint32_t>(threshold >> 32);
  // Entry i (score `score`, `valid` false past the end): all 32 lanes of the warp call it together.
  const auto consider = [&](int64_t i, float score, bool valid) {
    const bool maybe = valid && UnmaskedKeyOf(score) >= key_floor;
    if (!__any_sync(0xffffffffu, maybe)) return;
    AppendIfAtLeast(maybe ? row.RankOf(i, score) : 0, threshold, out, capacity, count);
  };
  const float* scores = row.scores + row.begin;
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(scores) & 15) == 0) {  // the same in every thread
    constexpr int64_t kVectorTile = int64_t{kThreads} * 4 * kVectorUnroll;
    const int64_t whole = row.size / kVectorTile * kVectorTile;
    for (int64_t base = 0; base < whole; base += kVectorTile) {
      float4 v[kVectorUnroll];
#pragma unroll
      for (int j = 0; j < kVectorUnroll; ++j) {
        v[j] = reinterpret_cast<const float4*>(scores + base)[j * kThreads + threadIdx.x];
      }
#pragma unroll
      for (int j = 0; j < kVectorUnroll; ++j) {
        const int64_t i = base + 4 * (j * kThreads + threadIdx.x);
        consider(i, v[j].x, true);
        consider(i + 1, v[j].y, true);
        consider(i + 2, v[j].z, true);
        consider(i + 3, v[j].w, true);
      }
    }
    done = whole;
  }
  for (int64_t base = done; base < row.size; base += kTile) {
    float score[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = base + j * kThreads + threadIdx.x;
      score[j] = i < row.size ? scores[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (base + j * kThreads >= row.size) break;  // uniform across the CTA
      const int64_t i = base + j * kThreads + threadIdx.x;
      consider(i, score[j], i < row.size);
    }
  }
}

struct Selection {
  uint64_t threshold;  // the ranks at or above it are kept
  bool exact;          // they are exactly the min(k, selectable) best (else: candidates)
};

// The first pass of a select over `source`: the top 11 bits of each selectable rank counted.
template <typename Source>
struct CountTopDigits {
  const Source& source;
  __device__ void operator()(uint32_t* hist) const {
    ForEachRank(source, [&](uint64_t rank) {
      if (rank != 0) atomicAdd(&hist[static_cast<uint32_t>(rank >> (64 - kRadixBits))], 1u);
    });
  }
};

// The radix select: the smallest threshold such that the ranks of `source` at or above it are its
// min(k, selectable) largest (exact), or, when `capacity` > 0, a threshold that at least those and
// at most `capacity` ranks reach, whichever a pass finds first. 11 bits a pass from the top, over
// the ranks that share the prefix fixed so far, stopping once the k-th rank's bin is taken whole
// (or the ranks at or above it fit in `capacity`). The first pass's counts come from
// first_pass(hist) (the top 11 bits of every selectable rank: CountTopDigits, or the conversion
// of a cached chunk). Histogram increments are plain shared-memory
// atomics, one a counted rank: measured faster than aggregating a warp's equal digits with
// __match_any_sync at every shape, rows of all-equal scores included (docs/gpu_kernels.md step
// 10). kCluster: `source` is this CTA's chunk of the row and the counts are the sums of
// the histograms of every CTA of the cluster (read through distributed shared memory); all CTAs
// of the cluster must call it and get the same answer. hists: 4 * kBins counters (two histograms
// and two slices of sums; the passes alternate between them).
template <bool kCluster, typename Source, typename FirstPass>
__device__ Selection RadixSelect(const Source& source, uint32_t k, uint32_t capacity,
                                 uint32_t* hists, Shared& shared, FirstPass first_pass) {
  uint64_t prefix = 0;  // the fixed bits above `high`
  uint32_t need = k;    // ranks still to take among those that share the prefix
  // Set after a pass that found every rank under the prefix in one bin (all-equal scores): the
  // next pass also takes their AND and OR, and the bits they share are then skipped. A pass that
  // splits the ranks, as the first does on distinct scores, costs nothing more.
  bool track_bits = false;
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
    if (track_bits && threadIdx.x == 0) {
      shared.all = ~uint64_t{0};
      shared.any = 0;
    }
    __syncthreads();
    if (pass == 0) {
      first_pass(hist);
    } else {
      BitsSeen seen;
      ForEachRank(source, [&](uint64_t rank) {
        if (rank != 0 && (rank >> high) == prefix) {
          atomicAdd(&hist[static_cast<uint32_t>(rank >> shift) & ((1u << width) - 1)], 1u);
          if (track_bits) seen.Add(rank);
        }
      });
      if (track_bits) {
        // The warp's bits (32-bit reductions: no 64-bit one exists), then the CTA's.
        const auto lo = [](uint64_t x) { return static_cast<uint32_t>(x); };
        const auto hi = [](uint64_t x) { return static_cast<uint32_t>(x >> 32); };
        const uint64_t warp_all = uint64_t{__reduce_and_sync(0xffffffffu, hi(seen.all))} << 32 |
                                  __reduce_and_sync(0xffffffffu, lo(seen.all));
        const uint64_t warp_any = uint64_t{__reduce_or_sync(0xffffffffu, hi(seen.any))} << 32 |
                                  __reduce_or_sync(0xffffffffu, lo(seen.any));
        if (threadIdx.x % 32 == 0) {
          atomicAnd(reinterpret_cast<unsigned long long*>(&shared.all), warp_all);
          atomicOr(reinterpret_cast<unsigned long long*>(&shared.any), warp_any);
        }
      }
    }
    // Suffix sums: thread t holds bins 2047 - 2t and 2046 - 2t (descending digits).
    const int bin_high = kBins - 1 - 2 * threadIdx.x, bin_low = bin_high - 1;
    uint32_t count_high = 0, count_low = 0;
    uint64_t all = 0, any = 0;  // track_bits: the BitsSeen of the ranks under the prefix
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
      } else if (track_bits && threadIdx.x < kBins / 4 + 32) {  // one warp: the cluster's bits
        const unsigned from = threadIdx.x % 32;
        uint64_t row_all = ~uint64_t{0}, row_any = 0;
        if (from < num_ctas) {
          row_all = *cluster.map_shared_rank(&shared.all, from);
          row_any = *cluster.map_shared_rank(&shared.any, from);
        }
        for (int o = 16; o > 0; o >>= 1) {
          row_all &= __shfl_xor_sync(0xffffffffu, row_all, o);
          row_any |= __shfl_xor_sync(0xffffffffu, row_any, o);
        }
        if (from == 0) {
          shared.row_all = row_all;
          shared.row_any = row_any;
        }
      }
      cluster.sync();  // every slice is summed
      const uint2 pair = *reinterpret_cast<const uint2*>(
          cluster.map_shared_rank(sum, static_cast<unsigned>(bin_low) / slice) + bin_low);
      count_low = pair.x;
      count_high = pair.y;
      all = shared.row_all;
      any = shared.row_any;
    } else {
      __syncthreads();
      count_high = hist[bin_high];
      count_low = hist[bin_low];
      all = shared.all;
      any = shared.any;
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
    if (track_bits) {
      // Bits [common, 64) are the same in every rank under the prefix (more than `need` >= 1 of
      // them, so some bit differs): the passes over them would find one bin each time (all-equal
      // scores: the score's 32 bits and the slots' high bits). They are taken as fixed.
      const int common = 64 - __clzll(static_cast<long long>(all ^ any));
      if (common < shift) {
        prefix = all >> common;
        shift = common;
      }
    }
    track_bits = !track_bits && in_bin == shared.total;  // this pass found one bin
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

__device__ inline int32_t SlotOfRank(uint64_t rank) {
  return static_cast<int32_t>(~static_cast<uint32_t>(rank));
}

// The fallback of FinishRow: an exact radix select among the candidates, the winners gathered
// into scratch and bitonic-sorted (docs/history/gpu_kernels_steps.md, step 9).
__device__ void SelectAndSortWinners(const uint64_t* candidates, uint32_t m, uint32_t k,
                                     uint64_t* winners, uint32_t* hists, Shared& shared,
                                     int32_t* out) {
  const BufferSource buffer{candidates, m};
  const uint64_t threshold =
      RadixSelect<false>(buffer, k, 0, hists, shared, CountTopDigits<BufferSource>{buffer})
          .threshold;
  if (threadIdx.x == 0) shared.count = 0;
  __syncthreads();
  GatherAtLeast(buffer, threshold, winners, kMaxTopK, &shared.count);
  __syncthreads();
  const uint32_t taken = min(shared.count, static_cast<uint32_t>(kMaxTopK));
  for (uint32_t i = taken + threadIdx.x; i < kMaxTopK; i += kThreads) winners[i] = 0;
  __syncthreads();
  SortWinnersDescending(winners);
  for (uint32_t i = threadIdx.x; i < k; i += kThreads) {
    out[i] = i < taken ? SlotOfRank(winners[i]) : -1;
  }
}

// In-bin counting costs about one shared load a pair of candidates in one bin; past this many
// pairs (among the bins that reach the first k places), the radix select and bitonic sort
// (~13 us) are cheaper. -DDSA_TOPK_FORCE_FALLBACK takes the fallback always (for its tests).
#ifdef DSA_TOPK_FORCE_FALLBACK
constexpr uint32_t kRankWorkBudget = 0;
#else
constexpr uint32_t kRankWorkBudget = 1u << 17;
#endif

// CTA 0's finish: writes the min(k, m) largest of the m distinct ranks candidates[0, m) to
// out[0, min(k, m)), largest first, and -1 to out[min(k, m), k). One counting pass: bin
// (high - rank) >> shift (2,048 bins over [low, high], the candidates' range; bin 0 holds the
// largest), a scan of the bins' counts gives each bin's first place, a scatter puts each bin's
// ranks together in scratch, and a rank's place is its bin's first place plus the number of
// larger ranks in its bin. Only bins that start before place k are counted. All threads call it.
__device__ void FinishRow(const uint64_t* candidates, uint32_t m, uint32_t k, uint64_t* scratch,
                          uint32_t* hists, Shared& shared, int32_t* out) {
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  uint32_t* first = hists;         // per bin: its count, then its first place
  uint32_t* next = hists + kBins;  // per bin: the next free place while scattering, then its end
  uint64_t low = ~uint64_t{0}, high = 0;
  for (uint32_t i = t; i < m; i += kThreads) {
    const uint64_t x = candidates[i];
    low = min(low, x);
    high = max(high, x);
  }
  for (int o = 16; o > 0; o >>= 1) {
    low = min(low, __shfl_xor_sync(0xffffffffu, low, o));
    high = max(high, __shfl_xor_sync(0xffffffffu, high, o));
  }
  if (lane == 0) {
    shared.low[warp] = low;
    shared.high[warp] = high;
  }
  first[2 * t] = 0;
  first[2 * t + 1] = 0;
  if (t == 0) shared.work = 0;
  __syncthreads();
  low = shared.low[lane];
  high = shared.high[lane];
  for (int o = 16; o > 0; o >>= 1) {
    low = min(low, __shfl_xor_sync(0xffffffffu, low, o));
    high = max(high, __shfl_xor_sync(0xffffffffu, high, o));
  }
  const uint64_t span = high - low;  // meaningful only when m > 0
  const int shift = span < kBins ? 0 : 64 - __clzll(static_cast<long long>(span)) - kRadixBits;
  for (uint32_t i = t; i < m; i += kThreads) {
    atomicAdd(&first[static_cast<uint32_t>((high - candidates[i]) >> shift)], 1u);
  }
  __syncthreads();
  const uint32_t count0 = first[2 * t], count1 = first[2 * t + 1];
  uint32_t first0;
  cub::BlockScan<uint32_t, kThreads>(shared.scan).ExclusiveSum(count0 + count1, first0);
  const uint32_t first1 = first0 + count0;
  uint32_t work = (first0 < k ? min(count0 * count0, 1u << 20) : 0) +
                  (first1 < k ? min(count1 * count1, 1u << 20) : 0);
  for (int o = 16; o > 0; o >>= 1) work += __shfl_xor_sync(0xffffffffu, work, o);
  if (lane == 0 && work != 0) atomicAdd(&shared.work, work);
  first[2 * t] = first0;
  first[2 * t + 1] = first1;
  next[2 * t] = first0;
  next[2 * t + 1] = first1;
  __syncthreads();
  if (shared.work > kRankWorkBudget) {  // uniform: too crowded for in-bin counting
    __syncthreads();                    // every thread has read shared.work
    SelectAndSortWinners(candidates, m, k, scratch, hists, shared, out);
    return;
  }
  for (uint32_t i = t; i < m; i += kThreads) {
    const uint64_t x = candidates[i];
    const uint32_t bin = static_cast<uint32_t>((high - x) >> shift);
    scratch[atomicAdd(&next[bin], 1u)] = x;
  }
  __syncthreads();
  for (uint32_t i = t; i < m; i += kThreads) {
    const uint64_t x = scratch[i];
    const uint32_t bin = static_cast<uint32_t>((high - x) >> shift);
    const uint32_t begin = first[bin];
    if (begin >= k) continue;
    const uint32_t end = next[bin];
    uint32_t place = begin;
    for (uint32_t j = begin; j < end; ++j) place += scratch[j] > x ? 1 : 0;
    if (place < k) out[place] = SlotOfRank(x);
  }
  for (uint32_t i = min(m, k) + t; i < k; i += kThreads) out[i] = -1;
}

// The sampled select of a streamed row. A chunk's sample: runs of kSampleRun consecutive entries
// every `stride` entries, at most kSampleRuns runs a CTA, the same stride in every CTA of the
// cluster so that the row is sampled evenly.
constexpr int kSampleRun = 8;
constexpr int kSampleRuns = 512;
constexpr int kSampleEntries = kSampleRun * kSampleRuns;
constexpr int kMinSampleStride = 16 * kSampleRun;  // at most 1 entry in 16 sampled
// A CTA's gathered ranks live in its cache, which a streamed chunk does not otherwise use.
constexpr uint32_t kGatherCapacity = kCacheBytes / sizeof(uint64_t);  // 16,384
static_assert(kSampleEntries <= kGatherCapacity, "the sample fits the gather buffer");
static_assert(kSampleEntries % kThreads == 0, "each thread takes the same number of samples");

// One read of a streamed row where the exact select reads it once a radix pass, then once more
// to gather. Every CTA of the cluster calls it; all get the same answer.
//  1. Each CTA samples its chunk (above; stride = chunk / min(512, chunk / 128) entries, so a
//     sampling rate r = 8 / stride: 1/16 up to 2^16 entries a chunk, 4096 / chunk past it).
//  2. The threshold T is the cluster's exact s-th largest sample rank, s = K r + 6 sqrt(K r) + 16,
//     found by RadixSelect over the samples in shared memory. About s / r ranks of the row reach
//     it: 6 standard deviations above K if the samples were independent; runs of 8 neighbours
//     at a stride that may be a multiple of 64 (the same offsets in every block) are not, so the
//     margin is smaller on smooth scores. A miss costs a fallback, never a wrong result. Since
//     s / r >= 2 stride = chunk / 256, a chunk of 2^21 entries (C = 1, rows of 2M) would fill the
//     buffer about half the time, and longer ones always: where the expected count passes 3/4
//     of the buffers, the sample is skipped.
//  3. One pass over the chunk appends its ranks >= T to `buffer` (this CTA's cache, up to
//     kGatherCapacity ranks), counting them exactly (GatherAtLeast).
// It succeeds, and the K best of the row are all in the CTAs' buffers, when no CTA's count passed
// its buffer and the row's count reaches K (or T took every selectable rank: the sample held at
// most s). A sample that misjudges the row (scores periodic in the stride, or too many masked)
// costs one read: the caller then runs the exact streamed select, so nothing is ever lost.
// shared.gathered must be 0 on entry (set before a barrier); it receives this CTA's count.
__device__ bool SampledGather(const RowSource& source, int64_t chunk, uint32_t k, uint64_t* buffer,
                              uint32_t* hists, Shared& shared, cg::cluster_group& cluster) {
  const int64_t runs = min(int64_t{kSampleRuns}, chunk / kMinSampleStride);
  const int64_t stride = chunk / runs;
  const float expected = static_cast<float>(k) * kSampleRun / static_cast<float>(stride);
  const uint32_t s = static_cast<uint32_t>(expected + 6.0f * sqrtf(expected)) + 16;
  // About s * stride / 8 ranks reach the threshold, chunk / 256 at least: past 3/4 of what the
  // CTAs can hold, the sample would overflow too often (chunks of 2^21 entries and more at
  // K 2048), and the read it costs would be lost. The same decision in every CTA, before any
  // barrier.
  if (static_cast<float>(s) * static_cast<float>(stride) / kSampleRun >
      0.75f * kGatherCapacity * cluster.num_blocks()) {
    return false;
  }
  uint64_t sample[kSampleEntries / kThreads];
#pragma unroll
  for (int j = 0; j < kSampleEntries / kThreads; ++j) {  // all loads in flight at once
    const int64_t i = j * kThreads + threadIdx.x;
    const int64_t e = i / kSampleRun * stride + i % kSampleRun;
    sample[j] = (i < runs * kSampleRun && e < source.size) ? source.RankAt(e) : 0;
  }
#pragma unroll
  for (int j = 0; j < kSampleEntries / kThreads; ++j)
    buffer[j * kThreads + threadIdx.x] = sample[j];
  const BufferSource samples{buffer, kSampleEntries};  // RadixSelect's first barrier orders these
  const uint64_t threshold =
      RadixSelect<true>(samples, s, 0, hists, shared, CountTopDigits<BufferSource>{samples})
          .threshold;
  // RadixSelect's last barrier follows its last read of the samples: the buffer is free.
  GatherRowAtLeast(source, threshold, buffer, kGatherCapacity, &shared.gathered);
  cluster.sync();  // every CTA's count is final
  if (threadIdx.x < 32) {
    const unsigned from = threadIdx.x;
    uint64_t count =
        from < cluster.num_blocks() ? *cluster.map_shared_rank(&shared.gathered, from) : 0;
    uint64_t most = count;
    for (int o = 16; o > 0; o >>= 1) {
      count += __shfl_xor_sync(0xffffffffu, count, o);
      most = max(most, __shfl_xor_sync(0xffffffffu, most, o));
    }
    if (threadIdx.x == 0) {
      shared.sampled_ok = most <= kGatherCapacity && (threshold == 1 || count >= k);
    }
  }
  __syncthreads();
  return shared.sampled_ok;
}

// -DDSA_TOPK_TRACE: CTA 0 of row 0 prints the time of each phase (globaltimer, us) at every
// launch: how docs/gpu_kernels.md steps 9-11 split the time. Off in every normal build.
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

// kSampled: a streamed chunk first tries SampledGather. The kernel without it, launched only where
// a host bound on the rows' entries says every chunk is held in shared memory, is ~55 KB of code
// smaller, and a one-row select, which fetches its kernels' code after a cold L2, was ~9 us faster
// with it on an H100 (docs/history/gpu_kernels_steps.md, steps 18 and 19). A streamed chunk
// there (a bound below a row's entries) takes the streamed select: slower, still exact.
template <bool kSampled>
__global__ void __launch_bounds__(kThreads) TopKKernel(TopKParams p) {
#ifdef DSA_TOPK_TRACE
  uint64_t trace[4] = {};
#endif
  BeginDependentKernel();
  TRACE(0);
  extern __shared__ __align__(16) uint8_t smem[];
  uint32_t* cache = reinterpret_cast<uint32_t*>(smem);
  int32_t* block_ids = reinterpret_cast<int32_t*>(smem + kCacheBytes);
  uint32_t* hists = reinterpret_cast<uint32_t*>(smem + kCacheBytes + kBlockCacheBytes);
  uint64_t* cached_candidates = reinterpret_cast<uint64_t*>(hists + 4 * kBins);
  uint64_t* scratch = reinterpret_cast<uint64_t*>(smem + kScratchOffset);
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
  if (threadIdx.x == 0) {
    shared.count = 0;  // CTA 0's is the cluster's gather counter
    shared.gathered = 0;
  }
  const bool cached = chunk <= kCacheEntries;  // the same in every CTA of the cluster

  // Over the whole row (the cluster's chunks): the exact threshold or one that a few K reach;
  // every CTA appends its ranks at or above it to CTA 0's buffer (exact counts: no overflow).
  uint64_t* candidates;
  uint32_t capacity;
  if (cached) {
    IssueChunkCopy(source, cache, block_ids);
    const CacheSource chunk_keys{cache, block_ids, source.blocks != nullptr, source.begin,
                                 source.size};
    candidates = cached_candidates;
    capacity = kCachedCandidates;
    const Selection selection =
        RadixSelect<true>(chunk_keys, k, capacity, hists, shared,
                          [&](uint32_t* hist) { ConvertChunk(source, cache, block_ids, hist); });
    TRACE(1);
    GatherAtLeast(chunk_keys, selection.threshold, cluster.map_shared_rank(candidates, 0), capacity,
                  cluster.map_shared_rank(&shared.count, 0));
  } else if (uint64_t* buffer = reinterpret_cast<uint64_t*>(cache);
             kSampled && SampledGather(source, chunk, k, buffer, hists, shared, cluster)) {
    // The row's K best are among the gathered ranks: the exact select runs over them.
    const BufferSource gathered{buffer, shared.gathered};
    candidates = cached_candidates;
    capacity = kCachedCandidates;
    const Selection selection = RadixSelect<true>(gathered, k, capacity, hists, shared,
                                                  CountTopDigits<BufferSource>{gathered});
    TRACE(1);
    GatherAtLeast(gathered, selection.threshold, cluster.map_shared_rank(candidates, 0), capacity,
                  cluster.map_shared_rank(&shared.count, 0));
  } else {
    if (p.sampled_fallbacks != nullptr && cta == 0 && threadIdx.x == 0) {
      atomicAdd(p.sampled_fallbacks, 1);
    }
    candidates = reinterpret_cast<uint64_t*>(cache);
    capacity = kStreamCandidates;
    const Selection selection =
        RadixSelect<true>(source, k, capacity, hists, shared, CountTopDigits<RowSource>{source});
    TRACE(1);
    GatherAtLeast(source, selection.threshold, cluster.map_shared_rank(candidates, 0), capacity,
                  cluster.map_shared_rank(&shared.count, 0));
  }
  cluster.sync();  // the gather is complete and visible in CTA 0
  TRACE(2);
  if (cta != 0) return;
  FinishRow(candidates, min(shared.count, capacity), k, scratch, hists, shared,
            p.selection + static_cast<int64_t>(row) * p.k);
#ifdef DSA_TOPK_TRACE
  __syncthreads();
  TRACE(3);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    printf("trace C=%u cached=%d candidates=%u select %.2f gather %.2f finish %.2f\n", num_ctas,
           cached ? 1 : 0, shared.count, (trace[1] - trace[0]) * 1e-3, (trace[2] - trace[1]) * 1e-3,
           (trace[3] - trace[2]) * 1e-3);
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
  } else if (p.max_row_entries < 0) {
    reason = "max_row_entries < 0";
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

template <bool kSampled>
ClusterLimits QueryClusterLimits() {
  const auto kernel = TopKKernel<kSampled>;
  ClusterLimits limits;
  cudaError_t& e = limits.error;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kSmemBytes));
  if (e != cudaSuccess) return limits;
  // 16 is past the portable cluster size (8); where the device cannot hold it, it is not used.
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
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
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
      (void)cudaGetLastError();
      clusters = 0;
    }
    limits.max_active[i] = clusters;
  }
  if (limits.max_active[0] == 0) e = cudaErrorInvalidConfiguration;
  return limits;
}

constexpr int kMaxDevices = 64;

// The kernel's cluster limits on `device` (in [0, kMaxDevices)), queried once.
template <bool kSampled>
const ClusterLimits& LimitsOn(int device) {
  static std::once_flag once[kMaxDevices];
  static ClusterLimits limits[kMaxDevices];
  std::call_once(once[device], [&] { limits[device] = QueryClusterLimits<kSampled>(); });
  return limits[device];
}

// The largest cluster (log2) with which every row's cluster is resident at once (one wave).
int LogCluster(const ClusterLimits& limits, int num_rows) {
  for (int i = kLogMaxCluster; i > 0; --i) {
    if (num_rows <= limits.max_active[i]) return i;
  }
  return 0;
}

}  // namespace

cudaError_t LaunchTopK(const TopKParams& p, cudaStream_t stream) {
  if (!CanImplementTopK(p)) return cudaErrorInvalidValue;
  if (p.num_rows == 0) return cudaSuccess;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  // The kernel without the sampled gather where the host's bound says every chunk is cached (the
  // kernel's own chunk rule: ceil(n / C) rounded up to 64 entries).
  const ClusterLimits& lean = LimitsOn<false>(device);
  if (lean.error != cudaSuccess) return lean.error;
  int log_cluster = LogCluster(lean, p.num_rows);
  const int64_t ctas = int64_t{1} << log_cluster;
  const bool every_chunk_cached =
      p.max_row_entries > 0 && p.max_row_entries <= ctas * kCacheEntries &&
      ((p.max_row_entries + ctas - 1) / ctas + 63) / 64 * 64 <= kCacheEntries;
  auto kernel = TopKKernel<false>;
  if (!every_chunk_cached) {
    const ClusterLimits& sampled = LimitsOn<true>(device);
    if (sampled.error != cudaSuccess) return sampled.error;
    log_cluster = LogCluster(sampled, p.num_rows);
    kernel = TopKKernel<true>;
  }
  const unsigned cluster = 1u << log_cluster;
  // Launched without the PDL attribute (dependent_launch.cuh): launched early, while the scan
  // runs, the select got slower (8 x 64K all-keep 69.2 -> 77.0 us, docs/gpu_kernels.md "Step 15");
  // its BeginDependentKernel still lets the update after it launch early.
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
  if (cudaError_t e = cudaLaunchKernelEx(&config, kernel, p); e != cudaSuccess) {
    (void)cudaGetLastError();  // returned here: not reported again by a later launch
    return e;
  }
  return cudaGetLastError();
}

}  // namespace dsa::cuda
