// The attention side's MLA rows on the GPU (see mla_inputs.h).
#include "attention_worker/cuda/mla_inputs.h"
#include "attention_worker/cuda/uniform_row.h"
#include "contracts/layout.h"

namespace dsa::cuda {
namespace {

constexpr int kGroupsPerRow = kMlaKeyDim / 4;  // 144 Philox blocks a row
constexpr int kThreads = 256;
constexpr int64_t kMaxRowValues = int64_t{1} << 26;
constexpr int64_t kMaxGridItems = int64_t{1} << 38;  // 2^30 blocks of 256 threads

__device__ uint2 PackBf16x4(const PhiloxCounter& words) {
  const uint32_t b0 = Bf16BitsNearestEven(UniformRowValue(words.c[0]));
  const uint32_t b1 = Bf16BitsNearestEven(UniformRowValue(words.c[1]));
  const uint32_t b2 = Bf16BitsNearestEven(UniformRowValue(words.c[2]));
  const uint32_t b3 = Bf16BitsNearestEven(UniformRowValue(words.c[3]));
  return make_uint2(b0 | (b1 << 16), b2 | (b3 << 16));
}

// One thread per (slot, group of 4 dims).
__global__ void MlaKvRowsKernel(MlaKvRowsParams p) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= p.num_slots * kGroupsPerRow) return;
  const int64_t slot = p.first_slot + item / kGroupsPerRow;
  const auto group = static_cast<uint32_t>(item % kGroupsPerRow);
  const PhiloxCounter words = UniformRowBlock(p.seed, kMlaKeyStream, p.layer, slot, group);
  const int64_t physical = p.block_table[slot / kBlockSize];
  const int64_t element = (physical * kBlockSize + slot % kBlockSize) * kMlaKeyDim + 4 * group;
  *reinterpret_cast<uint2*>(p.kv_pool + element) = PackBf16x4(words);
}

// One thread per (row, group of 4 values of the row's num_heads * 576).
__global__ void MlaQueryRowsKernel(MlaQueryRowsParams p) {
  const int64_t groups_per_row = static_cast<int64_t>(p.num_heads) * kGroupsPerRow;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= p.num_rows * groups_per_row) return;
  const int64_t row = item / groups_per_row;
  const auto group = static_cast<uint32_t>(item % groups_per_row);
  const PhiloxCounter words =
      UniformRowBlock(p.seed, kMlaQueryStream, p.layer, p.positions[row], group);
  *reinterpret_cast<uint2*>(p.queries + row * groups_per_row * 4 + 4 * int64_t{group}) =
      PackBf16x4(words);
}

bool Fail(const char** why, const char* reason) {
  if (why != nullptr) *why = reason;
  return false;
}

}  // namespace

bool CanImplementMlaKvRows(const MlaKvRowsParams& params, const char** why) {
  if (params.layer < 0) return Fail(why, "layer must be >= 0");
  if (params.first_slot < 0 || params.num_slots < 0) {
    return Fail(why, "first_slot and num_slots must be >= 0");
  }
  if (params.num_slots > (int64_t{1} << 30)) return Fail(why, "num_slots above 2^30");
  if (params.num_slots > 0 && (params.block_table == nullptr || params.kv_pool == nullptr)) {
    return Fail(why, "block_table and kv_pool are required");
  }
  if ((reinterpret_cast<uintptr_t>(params.kv_pool) & 7) != 0) {
    return Fail(why, "kv_pool must be 8-byte aligned");
  }
  return true;
}

bool CanImplementMlaQueryRows(const MlaQueryRowsParams& params, const char** why) {
  if (params.layer < 0) return Fail(why, "layer must be >= 0");
  if (params.num_rows < 0) return Fail(why, "num_rows must be >= 0");
  if (params.num_heads < 1 || int64_t{params.num_heads} * kMlaKeyDim > kMaxRowValues) {
    return Fail(why, "num_heads * 576 must be in [576, 2^26]");
  }
  if (int64_t{params.num_rows} * params.num_heads * kGroupsPerRow > kMaxGridItems) {
    return Fail(why, "num_rows * num_heads * 144 above 2^38");
  }
  if (params.num_rows > 0 && (params.positions == nullptr || params.queries == nullptr)) {
    return Fail(why, "positions and queries are required");
  }
  if ((reinterpret_cast<uintptr_t>(params.queries) & 7) != 0) {
    return Fail(why, "queries must be 8-byte aligned");
  }
  return true;
}

cudaError_t LaunchMlaKvRows(const MlaKvRowsParams& params, cudaStream_t stream) {
  if (!CanImplementMlaKvRows(params)) return cudaErrorInvalidValue;
  const int64_t items = params.num_slots * kGroupsPerRow;
  if (items == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((items + kThreads - 1) / kThreads);
  MlaKvRowsKernel<<<blocks, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t LaunchMlaQueryRows(const MlaQueryRowsParams& params, cudaStream_t stream) {
  if (!CanImplementMlaQueryRows(params)) return cudaErrorInvalidValue;
  const int64_t items = int64_t{params.num_rows} * params.num_heads * kGroupsPerRow;
  if (items == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((items + kThreads - 1) / kThreads);
  MlaQueryRowsKernel<<<blocks, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace dsa::cuda
