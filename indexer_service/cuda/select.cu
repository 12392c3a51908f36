// The whole select of a batch on the GPU (see select.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "indexer_service/cuda/dependent_launch.cuh"
#include "indexer_service/cuda/fp8_device.cuh"
#include "indexer_service/cuda/select.h"
#include "indexer_service/cuda/spin_predict.h"
#include "indexer_service/cuda/spin_update.h"
#include "indexer_service/cuda/topk.h"

namespace dsa::cuda {
namespace {

constexpr int kThreads = 256;

// Where the pipeline's own arrays live in the workspace (byte offsets, 16-byte aligned).
struct Workspace {
  size_t row_group = 0;            // int32 [rows]
  size_t plan_position = 0;        // int64 [rows]: t, or -1 for rows of kAllBlocks groups
  size_t row_vertical = 0;         // const float* [rows]
  size_t row_diagonal = 0;         // const float* [rows]
  size_t row_capacity = 0;         // int64 [rows]
  size_t row_seed = 0;             // uint64 [rows]
  size_t row_plan_offset = 0;      // int64 [rows]: r x max_visible_blocks
  size_t predicted = 0;            // fp32 [rows x max_visible_blocks]
  size_t selected = 0;             // int32 [rows x max_visible_blocks]
  size_t selected_count = 0;       // int32 [rows]
  size_t union_offset = 0;         // int64 [groups]: g x max_visible_blocks
  size_t union_blocks = 0;         // int32 [groups x max_visible_blocks]
  size_t union_count = 0;          // int32 [groups]
  size_t device_total = 0;         // int64 [1]
  size_t row_num_entries = 0;      // int64 [rows]
  size_t row_block_offset = 0;     // int64 [rows]
  size_t update_first_row = 0;     // int32 [groups + 1]
  size_t update_position = 0;      // int64 [rows]
  size_t update_score_offset = 0;  // int64 [rows]
  size_t predict_workspace = 0;
  size_t predict_workspace_bytes = 0;
  size_t scan_workspace = 0;
  size_t scan_workspace_bytes = 0;
  size_t total = 0;
};

size_t Take(size_t& cursor, size_t bytes) {
  const size_t at = cursor;
  cursor = (cursor + bytes + 15) / 16 * 16;
  return at;
}

// The predict and scan launches of `p` with their workspace pointers unset (for sizes and checks).
SpinPredictParams PredictShape(const SelectParams& p) {
  SpinPredictParams q;
  q.num_rows = p.num_rows;
  q.top_k = p.top_k;
  q.target_block_sparsity = p.target_block_sparsity;
  q.exploration_fraction = p.exploration_fraction;
  q.layer = p.layer;
  q.max_visible_blocks = p.max_visible_blocks;
  q.total_blocks = static_cast<int64_t>(p.num_rows) * p.max_visible_blocks;
  // The plan is always made: a stand-in `selected` (replaced before any launch) makes the size
  // query count the plan's workspace (rows past kSpinSharedPlanBlocks blocks with exploration).
  static int32_t stand_in[4];
  q.selected = stand_in;
  q.selected_count = stand_in;
  return q;
}

ScanParams ScanShape(const SelectParams& p) {
  ScanParams s;
  s.pool = p.pool;
  s.head_dim = p.head_dim;
  s.num_heads = p.num_heads;
  s.num_groups = p.num_groups;
  s.num_rows = p.num_rows;
  s.total_blocks = static_cast<int64_t>(p.num_groups) * p.max_visible_blocks;
  s.group_first_row = p.group_first_row;
  s.group_table_offset = p.group_table_offset;
  s.block_tables = p.block_tables;
  s.group_num_slots = p.group_num_slots;
  s.query = p.query;
  s.query_dtype = p.query_dtype;
  s.head_weights = p.head_weights;
  s.row_position = p.row_position;
  s.scores = p.scores;
  s.logical_blocks = p.group_blocks;
  s.group_block_offset = p.group_block_offset;
  s.row_score_offset = p.row_score_offset;
  return s;
}

Workspace Layout(const SelectParams& p) {
  const size_t rows = static_cast<size_t>(p.num_rows);
  const size_t groups = static_cast<size_t>(p.num_groups);
  const size_t row_blocks = rows * static_cast<size_t>(p.max_visible_blocks);
  const size_t group_blocks = groups * static_cast<size_t>(p.max_visible_blocks);
  Workspace w;
  size_t c = 0;
  w.row_group = Take(c, 4 * rows);
  w.plan_position = Take(c, 8 * rows);
  w.row_vertical = Take(c, sizeof(void*) * rows);
  w.row_diagonal = Take(c, sizeof(void*) * rows);
  w.row_capacity = Take(c, 8 * rows);
  w.row_seed = Take(c, 8 * rows);
  w.row_plan_offset = Take(c, 8 * rows);
  w.predicted = Take(c, 4 * row_blocks);
  w.selected = Take(c, 4 * row_blocks);
  w.selected_count = Take(c, 4 * rows);
  w.union_offset = Take(c, 8 * groups);
  if (p.num_rows == p.num_groups) {
    // Every group has one row (each has at least one): its union is its row's plan, read in place.
    w.union_blocks = w.selected;
    w.union_count = w.selected_count;
  } else {
    w.union_blocks = Take(c, 4 * group_blocks);
    w.union_count = Take(c, 4 * groups);
  }
  w.device_total = Take(c, 8);
  w.row_num_entries = Take(c, 8 * rows);
  w.row_block_offset = Take(c, 8 * rows);
  w.update_first_row = Take(c, 4 * (groups + 1));
  w.update_position = Take(c, 8 * rows);
  w.update_score_offset = Take(c, 8 * rows);
  w.predict_workspace_bytes = SpinPredictScratchBytes(PredictShape(p));
  w.predict_workspace = Take(c, w.predict_workspace_bytes);
  ScanParams scan = ScanShape(p);
  w.scan_workspace_bytes =
      p.scan == SelectScan::kTensorCores ? ScanTensorCoresScratchBytes(scan) : 0;
  w.scan_workspace = Take(c, w.scan_workspace_bytes);
  w.total = c;
  return w;
}

template <typename T>
__host__ __device__ T* At(void* base, size_t offset) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(base) + offset);
}

// The plan and scan launches of `p` with their pointers into the workspace laid out as `w`.
SpinPredictParams PredictLaunch(const SelectParams& p, const Workspace& w) {
  SpinPredictParams q = PredictShape(p);
  q.positions = At<int64_t>(p.workspace, w.plan_position);
  q.vertical = At<const float*>(p.workspace, w.row_vertical);
  q.vertical_len = At<int64_t>(p.workspace, w.row_capacity);
  q.diagonal = At<const float*>(p.workspace, w.row_diagonal);
  q.diagonal_len = At<int64_t>(p.workspace, w.row_capacity);
  q.row_block_offset = At<int64_t>(p.workspace, w.row_plan_offset);
  q.scores = At<float>(p.workspace, w.predicted);
  q.selected = At<int32_t>(p.workspace, w.selected);
  q.selected_count = At<int32_t>(p.workspace, w.selected_count);
  q.row_seed = At<uint64_t>(p.workspace, w.row_seed);
  q.workspace = At<void>(p.workspace, w.predict_workspace);
  q.workspace_bytes = w.predict_workspace_bytes;
  return q;
}

ScanParams ScanLaunch(const SelectParams& p, const Workspace& w) {
  ScanParams s = ScanShape(p);
  s.device_total_blocks = At<int64_t>(p.workspace, w.device_total);
  s.workspace = At<void>(p.workspace, w.scan_workspace);
  s.workspace_bytes = w.scan_workspace_bytes;
  return s;
}

// Per group (a thread each): its rows' SPIN inputs for the plan kernels.
__global__ void SetupKernel(SelectParams p, Workspace w) {
  BeginDependentKernel();
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= p.num_groups) return;
  void* base = p.workspace;
  const bool spin = p.group_plan[g] == SelectPlan::kSpin;
  for (int r = p.group_first_row[g]; r < p.group_first_row[g + 1]; ++r) {
    At<int32_t>(base, w.row_group)[r] = g;
    At<int64_t>(base, w.plan_position)[r] = spin ? p.row_position[r] : -1;
    At<const float*>(base, w.row_vertical)[r] = p.vertical[g];
    At<const float*>(base, w.row_diagonal)[r] = p.diagonal[g];
    At<int64_t>(base, w.row_capacity)[r] = p.spin_capacity[g];
    At<uint64_t>(base, w.row_seed)[r] = p.group_seed[g];
    At<int64_t>(base, w.row_plan_offset)[r] = static_cast<int64_t>(r) * p.max_visible_blocks;
  }
  At<int64_t>(base, w.union_offset)[g] = static_cast<int64_t>(g) * p.max_visible_blocks;
}

// Rows of kAllBlocks groups take every visible block (grid: block chunks x rows).
__global__ void AllBlocksKernel(SelectParams p, Workspace w) {
  BeginDependentKernel();
  const int r = blockIdx.y;
  void* base = p.workspace;
  const int g = At<int32_t>(base, w.row_group)[r];
  if (p.group_plan[g] == SelectPlan::kSpin) return;
  const int64_t visible = (p.row_position[r] + kBlockSize) / kBlockSize;  // ceil((t + 1) / 64)
  int32_t* selected =
      At<int32_t>(base, w.selected) + static_cast<int64_t>(r) * p.max_visible_blocks;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < visible;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    selected[j] = static_cast<int32_t>(j);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    At<int32_t>(base, w.selected_count)[r] = static_cast<int32_t>(visible);
  }
}

constexpr int kLayoutThreads = 1024;
using LayoutScan = cub::BlockScan<int64_t, kLayoutThreads>;

// Where a thread's groups start in the flat layout, and the totals: three block prefix sums of
// each thread's blocks, score entries and update rows (exclusive).
struct LayoutStarts {
  int64_t blocks, scores, updates;
  int64_t total_blocks, total_updates;
};
__device__ LayoutStarts ScanLayout(int64_t blocks, int64_t scores, int64_t updates,
                                   LayoutScan::TempStorage& storage) {
  LayoutStarts s{};
  int64_t unused = 0;
  LayoutScan(storage).ExclusiveSum(blocks, s.blocks, s.total_blocks);
  __syncthreads();
  LayoutScan(storage).ExclusiveSum(scores, s.scores, unused);
  __syncthreads();
  LayoutScan(storage).ExclusiveSum(updates, s.updates, s.total_updates);
  return s;
}

// Group g's layout, its list of `count` blocks starting at start.blocks: its block offset and
// first update row, and each row's score offset, entry count and block offset (a one-row group's
// row also its update row). start.scores and start.updates move past the group.
__device__ void WriteGroupLayout(const SelectParams& p, const Workspace& w, int g, int64_t count,
                                 LayoutStarts& start) {
  void* base = p.workspace;
  const int first = p.group_first_row[g], end = p.group_first_row[g + 1];
  p.group_block_offset[g] = start.blocks;
  At<int32_t>(base, w.update_first_row)[g] = static_cast<int32_t>(start.updates);
  for (int r = first; r < end; ++r) {
    p.row_score_offset[r] = start.scores;
    At<int64_t>(base, w.row_num_entries)[r] = count * kBlockSize;
    At<int64_t>(base, w.row_block_offset)[r] = start.blocks;
    if (p.update && end - first == 1) {
      At<int64_t>(base, w.update_position)[start.updates] = p.row_position[r];
      At<int64_t>(base, w.update_score_offset)[start.updates] = start.scores;
      ++start.updates;
    }
    start.scores += count * kBlockSize;
  }
}

// The totals, once (one thread): the offsets' end, the update rows' end, the device total.
__device__ void WriteLayoutTotals(const SelectParams& p, const Workspace& w,
                                  const LayoutStarts& start) {
  p.group_block_offset[p.num_groups] = start.total_blocks;
  At<int32_t>(p.workspace, w.update_first_row)[p.num_groups] =
      static_cast<int32_t>(start.total_updates);
  *At<int64_t>(p.workspace, w.device_total) = start.total_blocks;
}

// One CTA: the compacted block lists' offsets, the device total, every row's score offset and
// entry count, and the one-row groups' update rows. Each thread takes a run of groups; three block
// prefix sums (cub) give each run its starting block, score entry and update row.
__global__ void __launch_bounds__(kLayoutThreads) LayoutKernel(SelectParams p, Workspace w) {
  BeginDependentKernel();
  __shared__ LayoutScan::TempStorage scan_storage;
  void* base = p.workspace;
  const int32_t* union_count = At<int32_t>(base, w.union_count);
  const int per_thread = (p.num_groups + kLayoutThreads - 1) / kLayoutThreads;
  const int first_group = min(p.num_groups, static_cast<int>(threadIdx.x) * per_thread);
  const int end_group = min(p.num_groups, first_group + per_thread);
  int64_t blocks = 0, scores = 0, updates = 0;
  for (int g = first_group; g < end_group; ++g) {
    const int64_t rows = p.group_first_row[g + 1] - p.group_first_row[g];
    blocks += union_count[g];
    scores += rows * union_count[g] * kBlockSize;
    updates += p.update && rows == 1 ? 1 : 0;
  }
  LayoutStarts start = ScanLayout(blocks, scores, updates, scan_storage);
  for (int g = first_group; g < end_group; ++g) {
    WriteGroupLayout(p, w, g, union_count[g], start);
    start.blocks += union_count[g];
  }
  if (threadIdx.x == 0) WriteLayoutTotals(p, w, start);
}

// LayoutKernel and CompactKernel in one launch, for at most kLayoutThreads groups. kKeepAll: every
// group keeps all its visible blocks (host_all_blocks), which also stands for setup, fill and
// union: a group's union of its rows' prefixes 0 .. ceil((t + 1) / 64) - 1 is the longest, so its
// list is 0 .. count - 1 with count its rows' most visible blocks. Else a group's list is its
// union (or its one row's plan), union_count[g] blocks at g x max_visible_blocks. Every CTA sums
// the counts itself (a thread a group, one block scan); CTA 0 writes the offsets, score offsets,
// entry counts and update rows as LayoutKernel does, and all CTAs write the lists, one
// grid-stride pass over the flat entries.
template <bool kKeepAll>
__global__ void __launch_bounds__(kLayoutThreads) LayoutListsKernel(SelectParams p, Workspace w) {
  BeginDependentKernel();
  __shared__ LayoutScan::TempStorage scan_storage;
  __shared__ int64_t group_start[kLayoutThreads + 1];  // block offsets; [num_groups] the total
  void* base = p.workspace;
  const int g = static_cast<int>(threadIdx.x);
  const bool has_group = g < p.num_groups;
  const int first = has_group ? p.group_first_row[g] : 0;
  const int end = has_group ? p.group_first_row[g + 1] : 0;
  int64_t count = 0;
  if constexpr (kKeepAll) {
    for (int r = first; r < end; ++r) {
      count = max(count, (p.row_position[r] + kBlockSize) / kBlockSize);  // ceil((t + 1) / 64)
    }
  } else {
    if (has_group) count = At<int32_t>(base, w.union_count)[g];
  }
  const int64_t rows = end - first;
  LayoutStarts start =
      ScanLayout(count, rows * count * kBlockSize, p.update && rows == 1 ? 1 : 0, scan_storage);
  const int64_t total_blocks = start.total_blocks;
  if (has_group) group_start[g] = start.blocks;
  if (threadIdx.x == 0) group_start[p.num_groups] = total_blocks;
  __syncthreads();
  if (blockIdx.x == 0 && has_group) WriteGroupLayout(p, w, g, count, start);
  if (blockIdx.x == 0 && threadIdx.x == 0) WriteLayoutTotals(p, w, start);
  const int32_t* unions = At<int32_t>(base, w.union_blocks);
  // Entry e of the flat lists belongs to the last group that starts at or before it.
  int group = 0;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total_blocks;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    while (group_start[group + 1] <= e) ++group;  // e only grows: a forward walk
    const int64_t i = e - group_start[group];
    p.group_blocks[e] = kKeepAll ? static_cast<int32_t>(i)
                                 : unions[static_cast<int64_t>(group) * p.max_visible_blocks + i];
  }
}

// CTAs of LayoutListsKernel: one a kLayoutThreads entries of the largest total, at most 64.
unsigned LayoutListsCtas(const SelectParams& p) {
  const int64_t most = static_cast<int64_t>(p.num_groups) * p.max_visible_blocks;
  return static_cast<unsigned>(
      std::min<int64_t>(64, std::max<int64_t>(1, (most + kLayoutThreads - 1) / kLayoutThreads)));
}

// Copies each group's union into the compacted list (grid: block chunks x groups).
__global__ void CompactKernel(SelectParams p, Workspace w) {
  BeginDependentKernel();
  const int g = blockIdx.y;
  void* base = p.workspace;
  const int64_t count = At<int32_t>(base, w.union_count)[g];
  const int32_t* from =
      At<int32_t>(base, w.union_blocks) + static_cast<int64_t>(g) * p.max_visible_blocks;
  int32_t* to = p.group_blocks + p.group_block_offset[g];
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    to[i] = from[i];
  }
}

unsigned ChunksOf(int64_t items) {
  const int64_t chunks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(chunks < 1 ? 1 : (chunks > 1024 ? 1024 : chunks));
}

// The chain's last kernels once the block lists and offsets are on the device: the scan, top-K and,
// with `update`, the EMA update of the one-row groups.
cudaError_t LaunchScanTopKAndUpdate(const SelectParams& p, const Workspace& w,
                                    cudaStream_t stream) {
  void* base = p.workspace;
  const ScanParams scan = ScanLaunch(p, w);
  if (cudaError_t e = p.scan == SelectScan::kTensorCores ? LaunchScanTensorCores(scan, stream)
                                                         : LaunchScanCudaCores(scan, stream);
      e != cudaSuccess) {
    return e;
  }
  TopKParams topk;
  topk.scores = p.scores;
  topk.num_rows = p.num_rows;
  topk.row_score_offset = p.row_score_offset;
  topk.row_num_entries = At<int64_t>(base, w.row_num_entries);
  topk.logical_blocks = p.group_blocks;
  topk.row_block_offset = At<int64_t>(base, w.row_block_offset);
  topk.row_max_slot = p.row_position;
  topk.max_row_entries = p.max_visible_blocks * kBlockSize;  // a group scores at most those
  topk.k = p.top_k;
  topk.selection = p.selection;
  if (cudaError_t e = LaunchTopK(topk, stream); e != cudaSuccess) return e;
  if (p.update) {
    SpinUpdateParams update;
    update.num_groups = p.num_groups;
    update.num_rows = p.num_rows;
    update.group_first_row = At<int32_t>(base, w.update_first_row);
    update.group_block_offset = p.group_block_offset;
    update.logical_blocks = p.group_blocks;
    update.row_position = At<int64_t>(base, w.update_position);
    update.row_score_offset = At<int64_t>(base, w.update_score_offset);
    update.scores = p.scores;
    update.vertical = p.vertical;
    update.diagonal = p.diagonal;
    update.ema_decay = p.ema_decay;
    update.max_visible_slots = p.max_visible_blocks * kBlockSize;
    update.max_group_rows = 1;  // only one-row groups update here
    if (cudaError_t e = LaunchSpinUpdate(update, stream); e != cudaSuccess) return e;
  }
  return cudaGetLastError();
}

// LayoutListsKernel<kKeepAll> (at most kLayoutThreads groups), then the scan, top-K and update.
template <bool kKeepAll>
cudaError_t LaunchLayoutListsAndTheRest(const SelectParams& p, const Workspace& w,
                                        cudaStream_t stream) {
  if (cudaError_t e = LaunchDependent(kKeepAll ? "keep_all_layout" : "layout_lists",
                                      LayoutListsKernel<kKeepAll>, dim3(LayoutListsCtas(p)),
                                      dim3(kLayoutThreads), 0, stream, p, w);
      e != cudaSuccess) {
    return e;
  }
  return LaunchScanTopKAndUpdate(p, w, stream);
}

}  // namespace

bool CanImplementSelect(const SelectParams& p, const char** why) {
  auto fail = [why](const char* reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
  if (p.num_groups < 0 || p.num_rows < 0) return fail("num_groups and num_rows must be >= 0");
  if (p.num_groups > 65535 || p.num_rows > 65535) {
    return fail("at most 65,535 groups and 65,535 rows a launch (grid.y)");
  }
  if (p.top_k < 1 || p.top_k > kMaxTopK) return fail("top_k must be in [1, kMaxTopK]");
  if (!std::isfinite(p.ema_decay) || p.ema_decay < 0.0 || p.ema_decay >= 1.0) {
    return fail("ema_decay must be in [0, 1)");
  }
  if (p.scan == SelectScan::kTensorCores && p.query_dtype != QueryDtype::kBFloat16) {
    return fail("the tensor-core scan takes bf16 queries");
  }
  if (p.num_rows == 0) return p.num_groups == 0 || fail("every group needs a row");
  if (p.num_groups == 0) return fail("rows need a group");
  if (p.max_visible_blocks < 1 || p.max_visible_blocks > (int64_t{1} << 25)) {
    return fail("max_visible_blocks must be in [1, 2^25]");
  }
  if (p.group_plan == nullptr || p.vertical == nullptr || p.diagonal == nullptr ||
      p.spin_capacity == nullptr || p.group_seed == nullptr || p.selection == nullptr ||
      p.scores == nullptr || p.row_score_offset == nullptr || p.group_blocks == nullptr ||
      p.group_block_offset == nullptr || p.row_position == nullptr ||
      p.group_first_row == nullptr) {
    return fail("the SPIN arrays, the outputs and the rows' positions must be set");
  }
  if (p.workspace == nullptr || p.workspace_bytes < SelectScratchBytes(p) ||
      reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) {
    return fail("the workspace must be 16-byte aligned and SelectScratchBytes long");
  }
  const Workspace w = Layout(p);
  if (!CanImplementSpinPredict(PredictLaunch(p, w), why)) return false;
  const ScanParams scan = ScanLaunch(p, w);
  return p.scan == SelectScan::kTensorCores ? CanImplementScanTensorCores(scan, why)
                                            : CanImplementScanCudaCores(scan, why);
}

size_t SelectScratchBytes(const SelectParams& p) {
  if (p.num_rows <= 0 || p.max_visible_blocks <= 0) return 0;
  return Layout(p).total;
}

cudaError_t LaunchSelect(const SelectParams& p, cudaStream_t stream) {
  if (!CanImplementSelect(p)) return cudaErrorInvalidValue;
  if (p.num_rows == 0) return cudaSuccess;
  const Workspace w = Layout(p);
  void* base = p.workspace;
  if (p.host_all_blocks && p.num_groups <= kLayoutThreads) {
    return LaunchLayoutListsAndTheRest<true>(p, w, stream);
  }
  // Every group one row, every one planned by SPIN: the plan reads the groups' arrays as the rows'
  // (a row's plan at row x max_visible_blocks), and nothing needs the setup's per-row arrays.
  const bool rows_are_groups = p.num_rows == p.num_groups && p.host_no_all_blocks;
  if (!rows_are_groups) {
    if (cudaError_t e = LaunchDependent("setup", SetupKernel, dim3(ChunksOf(p.num_groups)),
                                        dim3(kThreads), 0, stream, p, w);
        e != cudaSuccess) {
      return e;
    }
  }
  // The plan of every SPIN row (rows of kAllBlocks groups have position -1: nothing done).
  SpinPredictParams predict = PredictLaunch(p, w);
  if (rows_are_groups) {
    predict.positions = p.row_position;
    predict.vertical = p.vertical;
    predict.vertical_len = p.spin_capacity;
    predict.diagonal = p.diagonal;
    predict.diagonal_len = p.spin_capacity;
    predict.row_seed = p.group_seed;
    predict.row_block_offset = nullptr;
    predict.row_block_stride = p.max_visible_blocks;
  }
  if (!p.host_all_blocks) {
    if (cudaError_t e = LaunchSpinPredict(predict, stream); e != cudaSuccess) return e;
  }
  if (!p.host_no_all_blocks) {  // else every group plans with SPIN: nothing to fill
    const dim3 grid(ChunksOf(p.max_visible_blocks), p.num_rows);
    if (cudaError_t e =
            LaunchDependent("fill", AllBlocksKernel, grid, dim3(kThreads), 0, stream, p, w);
        e != cudaSuccess) {
      return e;
    }
  }
  SpinUnionParams unite;
  unite.num_groups = p.num_groups;
  unite.group_first_row = p.group_first_row;
  unite.row_block_offset = At<int64_t>(base, w.row_plan_offset);
  unite.selected = At<int32_t>(base, w.selected);
  unite.selected_count = At<int32_t>(base, w.selected_count);
  unite.group_block_offset = At<int64_t>(base, w.union_offset);
  unite.union_blocks = At<int32_t>(base, w.union_blocks);
  unite.union_count = At<int32_t>(base, w.union_count);
  if (p.num_rows != p.num_groups) {  // else the plans are the unions (Layout)
    if (cudaError_t e = LaunchSpinUnion(unite, stream); e != cudaSuccess) return e;
  }
  if (p.num_groups <= kLayoutThreads) return LaunchLayoutListsAndTheRest<false>(p, w, stream);
  if (cudaError_t e =
          LaunchDependent("layout", LayoutKernel, dim3(1), dim3(kLayoutThreads), 0, stream, p, w);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = LaunchDependent("compact", CompactKernel,
                                      dim3(ChunksOf(p.max_visible_blocks), p.num_groups),
                                      dim3(kThreads), 0, stream, p, w);
      e != cudaSuccess) {
    return e;
  }
  return LaunchScanTopKAndUpdate(p, w, stream);
}

}  // namespace dsa::cuda
