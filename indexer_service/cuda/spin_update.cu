// SPIN's EMA update on the GPU (see spin_update.h).
#include <cmath>

#include "indexer_service/cuda/dependent_launch.cuh"
#include "indexer_service/cuda/fp8_device.cuh"
#include "indexer_service/cuda/spin_update.h"

namespace dsa::cuda {
namespace {

constexpr int kUpdateThreads = 256;       // threads a CTA
constexpr int kDefaultUpdateChunks = 64;  // CTAs a group when no max_visible_slots hint is given
constexpr int kMaxUpdateChunks = 8192;    // cap of grid.x (the threads stride past it)
constexpr int kUpdateItems = 4;           // one-row groups: entries a thread an iteration

// Index of `block` in the strictly increasing list[0 .. count), or -1.
__device__ __forceinline__ int64_t FindBlock(const int32_t* __restrict__ list, int64_t count,
                                             int64_t block) {
  int64_t lo = 0;
  int64_t hi = count;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (list[mid] < block) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < count && list[lo] == block ? lo : -1;
}

// SpinState::Update's a * old + b * z: two fp32 products and an add, no contraction.
__device__ __forceinline__ float Ema(float a, float b, float old, float z) {
  return __fadd_rn(__fmul_rn(a, old), __fmul_rn(b, z));
}

__global__ void __launch_bounds__(kUpdateThreads) UpdateKernel(
    const int32_t* __restrict__ group_first_row, const int64_t* __restrict__ group_block_offset,
    const int32_t* __restrict__ logical_blocks, const int64_t* __restrict__ row_position,
    const int64_t* __restrict__ row_score_offset, const float* __restrict__ scores,
    float* const* __restrict__ vertical, float* const* __restrict__ diagonal, float a, float b) {
  BeginDependentKernel();
  const int group = blockIdx.y;
  const int first_row = group_first_row[group];
  const int end_row = group_first_row[group + 1];
  if (first_row >= end_row) return;
  const int64_t list_begin = group_block_offset[group];
  const int64_t list_count = group_block_offset[group + 1] - list_begin;
  const int32_t* list = logical_blocks + list_begin;
  float* v = vertical[group];
  float* d = diagonal[group];
  if (end_row - first_row == 1) {
    // One row: a warp per tile of kUpdateItems x 32 consecutive entries, lane l taking entries
    // l, l + 32, ... (coalesced, kUpdateItems loads in flight), no search. The list is strictly
    // increasing, so the entries' slots, and their offsets t - slot, are distinct.
    const int64_t t = row_position[first_row];
    const float* z = scores + row_score_offset[first_row];
    const int lane = threadIdx.x & 31;
    const int64_t entries = list_count * kBlockSize;
    const int64_t tile_stride = static_cast<int64_t>(gridDim.x) * (kUpdateThreads / 32);
    for (int64_t tile =
             static_cast<int64_t>(blockIdx.x) * (kUpdateThreads / 32) + (threadIdx.x >> 5);
         tile * kUpdateItems * 32 < entries; tile += tile_stride) {
      int64_t slot[kUpdateItems];
      float value[kUpdateItems];
#pragma unroll
      for (int u = 0; u < kUpdateItems; ++u) {
        const int64_t e = (tile * kUpdateItems + u) * 32 + lane;
        slot[u] = e < entries
                      ? static_cast<int64_t>(list[e / kBlockSize]) * kBlockSize + e % kBlockSize
                      : t + 1;
        value[u] = slot[u] <= t ? z[e] : -INFINITY;
      }
      float old_v[kUpdateItems];
      float old_d[kUpdateItems];
#pragma unroll
      for (int u = 0; u < kUpdateItems; ++u) {
        if (isfinite(value[u])) {
          old_v[u] = v[slot[u]];
          old_d[u] = d[t - slot[u]];
        }
      }
#pragma unroll
      for (int u = 0; u < kUpdateItems; ++u) {
        if (isfinite(value[u])) {
          v[slot[u]] = Ema(a, b, old_v[u], value[u]);
          d[t - slot[u]] = Ema(a, b, old_d[u], value[u]);
        }
      }
    }
    return;
  }
  int64_t end_slot = 0;  // the largest position + 1
  for (int r = first_row; r < end_row; ++r) {
    const int64_t t = row_position[r];
    end_slot = t + 1 > end_slot ? t + 1 : end_slot;
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kUpdateThreads;
  for (int64_t x = static_cast<int64_t>(blockIdx.x) * kUpdateThreads + threadIdx.x; x < end_slot;
       x += stride) {
    // V[x]: slot x, the same block entry for every row.
    const int64_t entry = FindBlock(list, list_count, x / kBlockSize);
    if (entry >= 0) {
      const int64_t at = entry * kBlockSize + x % kBlockSize;
      float value = 0.0f;
      bool loaded = false;
      for (int r = first_row; r < end_row; ++r) {
        if (x > row_position[r]) continue;
        const float z = scores[row_score_offset[r] + at];
        if (!isfinite(z)) continue;
        if (!loaded) {
          value = v[x];
          loaded = true;
        }
        value = Ema(a, b, value, z);
      }
      if (loaded) v[x] = value;
    }
    // D[x]: offset x, slot t - x of row t.
    float value = 0.0f;
    bool loaded = false;
    for (int r = first_row; r < end_row; ++r) {
      const int64_t t = row_position[r];
      if (x > t) continue;
      const int64_t slot = t - x;
      const int64_t slot_entry = FindBlock(list, list_count, slot / kBlockSize);
      if (slot_entry < 0) continue;
      const float z = scores[row_score_offset[r] + slot_entry * kBlockSize + slot % kBlockSize];
      if (!isfinite(z)) continue;
      if (!loaded) {
        value = d[x];
        loaded = true;
      }
      value = Ema(a, b, value, z);
    }
    if (loaded) d[x] = value;
  }
}

}  // namespace

bool CanImplementSpinUpdate(const SpinUpdateParams& p, const char** why) {
  auto fail = [why](const char* reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
  if (p.num_groups < 0 || p.num_rows < 0) return fail("num_groups and num_rows must be >= 0");
  if (p.num_groups > 65535) return fail("at most 65,535 groups a launch (grid.y)");
  if (p.reduction != SpinReduction::kA1) {
    return fail("only the A1 reduction is on the GPU (A2 keeps block-level EMAs)");
  }
  if (p.exploration != SpinExploration::kRandom) {
    return fail(
        "only random exploration is on the GPU (staleness and block age need the blocks' "
        "last-scored positions)");
  }
  if (!std::isfinite(p.ema_decay) || p.ema_decay < 0.0 || p.ema_decay >= 1.0) {
    return fail("ema_decay must be in [0, 1)");
  }
  if (p.num_groups == 0) return true;
  if (p.group_first_row == nullptr || p.group_block_offset == nullptr || p.vertical == nullptr ||
      p.diagonal == nullptr) {
    return fail("group_first_row, group_block_offset, vertical and diagonal must be set");
  }
  if (p.num_rows > 0 && (p.logical_blocks == nullptr || p.row_position == nullptr ||
                         p.row_score_offset == nullptr || p.scores == nullptr)) {
    return fail("logical_blocks, row_position, row_score_offset and scores must be set");
  }
  return true;
}

cudaError_t LaunchSpinUpdate(const SpinUpdateParams& p, cudaStream_t stream) {
  if (!CanImplementSpinUpdate(p)) return cudaErrorInvalidValue;
  if (p.num_groups == 0 || p.num_rows == 0) return cudaSuccess;
  const float a = static_cast<float>(p.ema_decay);  // as SpinState::Update
  const float b = 1.0f - a;
  int64_t chunks = kDefaultUpdateChunks;
  if (p.max_visible_slots > 0) {
    // One thread a slot index, or with only one-row groups one warp a tile of kUpdateItems x 32.
    const int64_t per_cta =
        p.max_group_rows == 1 ? int64_t{kUpdateThreads} * kUpdateItems : int64_t{kUpdateThreads};
    chunks = (p.max_visible_slots + per_cta - 1) / per_cta;
    chunks = chunks < kMaxUpdateChunks ? chunks : kMaxUpdateChunks;
  }
  return LaunchDependent("update", UpdateKernel, dim3(static_cast<unsigned>(chunks), p.num_groups),
                         dim3(kUpdateThreads), 0, stream, p.group_first_row, p.group_block_offset,
                         p.logical_blocks, p.row_position, p.row_score_offset, p.scores, p.vertical,
                         p.diagonal, a, b);
}

}  // namespace dsa::cuda
