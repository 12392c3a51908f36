// The GPU top-K (see topk.h): per row, a radix select over 64-bit ranks, then a sort of the
// winners in shared memory.
#include <cub/block/block_scan.cuh>

#include "indexer_service/cuda/topk.h"

namespace dsa::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kRadixBits = 11;
constexpr int kBins = 1 << kRadixBits;  // 2048 = 2 bins a thread in the suffix scan
static_assert(kBins == 2 * kThreads, "the bin scan gives each thread two bins");
static_assert(kMaxTopK == 2 * kThreads, "the sort gives each thread one pair");

// The rank of one entry: (order-preserving bits of score + 0) << 32 | ~slot; 0 when the entry is
// not selectable (NaN, -inf, or past the row's position). Selectable ranks are distinct and > 0.
struct RowView {
  const float* scores;
  const int32_t* blocks;  // null: entry e is slot e
  int64_t max_slot;
  __device__ uint64_t Rank(int64_t e) const {
    const float score = scores[e];
    const int64_t slot = blocks == nullptr ? e : int64_t{blocks[e >> 6]} * 64 + (e & 63);
    if (!(score > -INFINITY) || slot > max_slot) return 0;
    const uint32_t bits = __float_as_uint(score + 0.0f);  // -0 becomes +0
    const uint32_t key =
        bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
    return static_cast<uint64_t>(key) << 32 | static_cast<uint32_t>(~static_cast<uint32_t>(slot));
  }
};

__global__ void __launch_bounds__(kThreads) TopKKernel(TopKParams p) {
  using BlockScan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ uint32_t hist[kBins];
  __shared__ uint64_t winners[kMaxTopK];
  __shared__ uint32_t digit_found, above_found, total_found;
  __shared__ uint32_t num_winners;

  const int row = blockIdx.x;
  const int64_t n = p.row_num_entries[row];
  RowView view;
  view.scores = p.scores + p.row_score_offset[row];
  view.blocks = p.logical_blocks == nullptr ? nullptr : p.logical_blocks + p.row_block_offset[row];
  view.max_slot = p.row_max_slot[row];
  const uint32_t k = static_cast<uint32_t>(p.k);

  // Radix select: fix the top bits of the K-th largest rank, kRadixBits at a time.
  uint64_t threshold = 1;  // every selectable rank when fewer than k are selectable
  uint64_t prefix = 0;     // the fixed bits above `shift + width`
  uint32_t need = k;       // ranks still to take among those that share the prefix
  for (int pass = 0, shift = 64; shift > 0; ++pass) {
    const int high = shift;
    const int width = shift >= kRadixBits ? kRadixBits : shift;
    shift -= width;
    for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
    __syncthreads();
    for (int64_t e = threadIdx.x; e < n; e += kThreads) {
      const uint64_t rank = view.Rank(e);
      if (rank != 0 && (high == 64 || (rank >> high) == prefix)) {
        atomicAdd(&hist[(rank >> shift) & ((1u << width) - 1)], 1u);
      }
    }
    __syncthreads();
    // Suffix sums: thread t holds bins 2047 - 2t and 2046 - 2t (descending digits).
    const int bin_high = kBins - 1 - 2 * threadIdx.x, bin_low = bin_high - 1;
    const uint32_t count_high = hist[bin_high], count_low = hist[bin_low];
    uint32_t above, total;
    BlockScan(scan_storage).ExclusiveSum(count_high + count_low, above, total);
    if (above < need && need <= above + count_high) {
      digit_found = bin_high;
      above_found = above;
    } else if (above + count_high < need && need <= above + count_high + count_low) {
      digit_found = bin_low;
      above_found = above + count_high;
    }
    if (threadIdx.x == 0) total_found = total;
    __syncthreads();
    if (pass == 0 && total_found <= k) break;  // threshold 1: take every selectable rank
    const uint32_t digit = digit_found;
    need -= above_found;
    prefix = (prefix << width) | digit;
    const uint32_t in_bin = hist[digit];
    __syncthreads();       // everyone has read hist and the found values before the next pass
    if (in_bin == need) {  // the whole bin is taken: the K-th rank is its lowest member or above
      threshold = prefix << shift;
      break;
    }
  }

  // Gather the winners (at most k of them) and sort them best first.
  if (threadIdx.x == 0) num_winners = 0;
  __syncthreads();
  for (int64_t e = threadIdx.x; e < n; e += kThreads) {
    const uint64_t rank = view.Rank(e);
    if (rank >= threshold) winners[atomicAdd(&num_winners, 1u)] = rank;
  }
  __syncthreads();
  const uint32_t taken = num_winners;
  for (uint32_t i = taken + threadIdx.x; i < kMaxTopK; i += kThreads) winners[i] = 0;
  __syncthreads();
  for (int size = 2; size <= kMaxTopK; size <<= 1) {
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      const int t = threadIdx.x;
      const int i = 2 * t - (t & (stride - 1));
      const int j = i + stride;
      const bool descending = (i & size) == 0;
      const uint64_t a = winners[i], b = winners[j];
      if ((a < b) == descending) {
        winners[i] = b;
        winners[j] = a;
      }
      __syncthreads();
    }
  }
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
  TopKKernel<<<static_cast<unsigned>(p.num_rows), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsa::cuda
