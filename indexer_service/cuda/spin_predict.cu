// SPIN block prediction and the plan without exploration on the GPU (see spin_predict.h).
#include <cmath>
#include <cub/block/block_scan.cuh>

#include "indexer_service/cuda/spin_predict.h"

namespace dsa::cuda {
namespace {

constexpr int kBlockSlots = 64;      // kBlockSize of block_pool.h
constexpr int kPredictWarps = 8;     // warps a CTA of the prediction kernel
constexpr int kPredictChunks = 8;    // CTAs a row (grid.y); warps stride over the row's blocks
constexpr int kSelectThreads = 512;  // threads a CTA (one row) of the plan kernel

// std::max(a, b) and std::max_element's step: b only when a < b, so of equal values (+0 and -0)
// the first one wins.
__device__ __forceinline__ float FirstMax(float a, float b) { return a < b ? b : a; }

__device__ __forceinline__ int64_t RowBlocks(int64_t position) {
  return position < 0 ? 0 : position / kBlockSlots + 1;
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
                  const int64_t* __restrict__ diagonal_len,
                  const int64_t* __restrict__ row_block_offset, float* __restrict__ scores) {
  const int row = blockIdx.x;
  const int64_t t = positions[row];
  const int64_t num_blocks = RowBlocks(t);
  if (num_blocks == 0) return;
  const float* v = vertical[row];
  const float* d = diagonal[row];
  const int64_t v_len = vertical_len[row];
  const int64_t d_len = diagonal_len[row];
  float* out = scores + row_block_offset[row];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int64_t j = static_cast<int64_t>(blockIdx.y) * kPredictWarps + warp; j < num_blocks;
       j += static_cast<int64_t>(gridDim.y) * kPredictWarps) {
    // Lane l holds slots 2l and 2l + 1; the butterfly below keeps each lane's range contiguous
    // with the lower range on the lane whose bit is clear, so every combine is (earlier, later)
    // and the result is max_element's: the first of the largest values.
    const int64_t first = j * kBlockSlots + 2 * lane;
    float m = FirstMax(SlotScore(v, v_len, d, d_len, t, first),
                       SlotScore(v, v_len, d, d_len, t, first + 1));
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, m, offset);
      m = (lane & offset) ? FirstMax(other, m) : FirstMax(m, other);
    }
    if (lane == 0) out[j] = m;  // eq. (2), max pooling
  }
}

// SpinState::BlockBudget with the same fp64 operations (no contraction into FMAs).
__device__ int64_t BlockBudget(int64_t visible_blocks, int top_k, double rho) {
  const int64_t floor_blocks = (static_cast<int64_t>(top_k) + kBlockSlots - 1) / kBlockSlots;
  const double x = __dmul_rn(__dsub_rn(1.0, rho), static_cast<double>(visible_blocks));
  const double slack = __dmul_rn(1e-12, fmax(1.0, fabs(x)));
  const int64_t kept = static_cast<int64_t>(ceil(__dsub_rn(x, slack)));
  const int64_t budget = floor_blocks > kept ? floor_blocks : kept;
  return visible_blocks < budget ? visible_blocks : budget;
}

__global__ void __launch_bounds__(kSelectThreads)
    SelectKernel(const int64_t* __restrict__ positions,
                 const int64_t* __restrict__ row_block_offset, const float* __restrict__ scores,
                 int top_k, double rho, int32_t* __restrict__ selected,
                 int32_t* __restrict__ selected_count) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int written;
  const int row = blockIdx.x;
  const int64_t t = positions[row];
  const int64_t num_blocks = RowBlocks(t);
  const int64_t base = num_blocks > 0 ? row_block_offset[row] : 0;
  const float* s = scores + base;
  int32_t* out = selected + base;
  const bool all = t + 1 <= top_k;  // step 1 (the warm-up and SPIN off are the caller's)
  // Step 4: the sink block and the newest block; step 6: `capacity` more by S, ties to the lower
  // block, among blocks 1 .. B - 2.
  const int64_t forced = num_blocks >= 2 ? 2 : num_blocks;
  const int64_t capacity = all ? 0 : BlockBudget(num_blocks, top_k, rho) - forced;
  if (threadIdx.x == 0) written = 0;
  __syncthreads();
  for (int64_t chunk = 0; chunk < num_blocks; chunk += kSelectThreads) {
    const int64_t j = chunk + threadIdx.x;
    int take = 0;
    if (j < num_blocks) {
      if (all || j == 0 || j == num_blocks - 1) {
        take = 1;
      } else if (capacity > 0) {
        const float sj = s[j];
        int64_t rank = 0;  // other candidates that come before j
        for (int64_t k = 1; k < num_blocks - 1 && rank < capacity; ++k) {
          const float sk = s[k];
          rank += (sk > sj || (sk == sj && k < j)) ? 1 : 0;
        }
        take = rank < capacity ? 1 : 0;
      }
    }
    int index = 0;
    int total = 0;
    Scan(scan_storage).ExclusiveSum(take, index, total);
    if (take) out[written + index] = static_cast<int32_t>(j);
    __syncthreads();  // every thread has read `written` and the scan storage is free again
    if (threadIdx.x == 0) written += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) selected_count[row] = written;
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
      p.diagonal == nullptr || p.diagonal_len == nullptr || p.row_block_offset == nullptr ||
      p.scores == nullptr) {
    return fail(
        "positions, vertical, diagonal, their lengths, row_block_offset and scores must "
        "be set");
  }
  if (p.selected != nullptr) {
    if (p.selected_count == nullptr) return fail("selected needs selected_count");
    if (p.top_k < 1) return fail("top_k must be >= 1");
    if (!std::isfinite(p.target_block_sparsity) || p.target_block_sparsity < 0.0 ||
        p.target_block_sparsity >= 1.0) {
      return fail("target_block_sparsity must be in [0, 1)");
    }
    if (p.exploration_fraction != 0.0) {
      return fail("exploration (exploration_fraction > 0) is not implemented on the GPU");
    }
  }
  return true;
}

cudaError_t LaunchSpinPredict(const SpinPredictParams& p, cudaStream_t stream) {
  if (!CanImplementSpinPredict(p)) return cudaErrorInvalidValue;
  if (p.num_rows == 0) return cudaSuccess;
  PredictKernel<<<dim3(p.num_rows, kPredictChunks), kPredictWarps * 32, 0, stream>>>(
      p.positions, p.vertical, p.vertical_len, p.diagonal, p.diagonal_len, p.row_block_offset,
      p.scores);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (p.selected == nullptr) return cudaSuccess;
  SelectKernel<<<p.num_rows, kSelectThreads, 0, stream>>>(p.positions, p.row_block_offset, p.scores,
                                                          p.top_k, p.target_block_sparsity,
                                                          p.selected, p.selected_count);
  return cudaGetLastError();
}

}  // namespace dsa::cuda
