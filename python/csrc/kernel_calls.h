// The torch-free half of the dsa_kernels bindings: each op's arguments as plain pointers and
// counts, their range checks, the kernel's Params, CanImplement* and the launch. Only the CUDA
// runtime API and indexer_service/cuda's headers: CI compiles this file without torch or a GPU
// (scripts/check_python_kernels.sh), so a change to the kernels' interfaces breaks CI here rather
// than the extension's build on the GPU host. bindings.cpp checks the tensors (device, dtype,
// contiguity, shape) and passes their pointers and sizes on.
//
// Every call returns a Result, (kind, message): kind 0 and "" when it launched, 1 for an argument
// or a refused shape (dsa_kernels raises ValueError), 2 for a failed launch (RuntimeError).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "contracts/layout.h"  // kBlockSize: slots a block
#include "contracts/limits.h"  // kMaxTopK

namespace dsa::python {

enum ResultKind : int { kOk = 0, kValueError = 1, kRuntimeError = 2 };
/// (kind, message): see the file comment.
using Result = std::pair<int, std::string>;

inline Result Ok() { return {kOk, std::string()}; }
inline Result ArgumentError(std::string message) { return {kValueError, std::move(message)}; }

inline void AppendPiece(std::string& out, const char* s) { out += s; }
inline void AppendPiece(std::string& out, const std::string& s) { out += s; }
inline void AppendPiece(std::string& out, int v) { out += std::to_string(v); }
inline void AppendPiece(std::string& out, long v) { out += std::to_string(v); }
inline void AppendPiece(std::string& out, long long v) { out += std::to_string(v); }
inline void AppendPiece(std::string& out, unsigned long v) { out += std::to_string(v); }
inline void AppendPiece(std::string& out, unsigned long long v) { out += std::to_string(v); }

/// The concatenation of strings and integers (no streams: see bindings.cpp's file comment).
template <typename... Args>
std::string Cat(const Args&... args) {
  std::string out;
  (AppendPiece(out, args), ...);
  return out;
}

/// Returns the Result of `expr` when it is an error.
#define DSA_RETURN_IF_ERROR(expr)                  \
  do {                                             \
    ::dsa::python::Result dsa_result_ = (expr);    \
    if (dsa_result_.first != ::dsa::python::kOk) { \
      return dsa_result_;                          \
    }                                              \
  } while (false)

/// append: keys [num_keys, head_dim] (fp32, or bf16 when keys_bf16) -> the pool's fp8 codes and
/// scales at (block_table, first_slot). All pointers are device pointers.
struct AppendArgs {
  const void* keys = nullptr;
  bool keys_bf16 = false;
  int64_t num_keys = 0;
  int64_t head_dim = 0;
  const int32_t* block_table = nullptr;
  int64_t block_table_entries = 0;
  int64_t first_slot = 0;
  uint8_t* pool = nullptr;
};
/// ValueError for head_dim outside [1, 1024], a negative first_slot, a block table shorter than
/// ceil((first_slot + num_keys) / 64), or CanImplementAppend's refusal.
Result CallAppend(const AppendArgs& a, cudaStream_t stream);

/// head_dim bounds of append's keys.
inline constexpr int64_t kMaxAppendHeadDim = 1024;

/// kernel: "tensor_cores" or "cuda_cores"; query_prep: "auto", "workspace" or "in_kernel".
/// ValueError naming the bad one.
Result CheckScanOptions(const std::string& kernel, const std::string& query_prep);

/// scan (scan.h ScanParams' layout; all pointers device pointers). kernel and query_prep as
/// ParseKernel / "auto", "workspace", "in_kernel". total_blocks: the host copy of
/// group_block_offset[num_groups].
struct ScanArgs {
  const uint8_t* pool = nullptr;
  int64_t head_dim = 0;
  int64_t num_heads = 0;
  int64_t num_groups = 0;
  int64_t num_rows = 0;
  const int32_t* group_first_row = nullptr;
  const int64_t* group_block_offset = nullptr;
  int64_t total_blocks = 0;
  const int32_t* logical_blocks = nullptr;
  const int64_t* group_table_offset = nullptr;
  const int32_t* block_tables = nullptr;
  const int64_t* group_num_slots = nullptr;
  const void* query = nullptr;
  bool query_bf16 = false;
  const float* head_weights = nullptr;
  const int64_t* row_position = nullptr;
  const int64_t* row_score_offset = nullptr;
  float* scores = nullptr;
  std::string kernel = "tensor_cores";
  std::string query_prep = "auto";
};
/// Runs the scan. The tensor-core scan's workspace (when it needs one and there are blocks) comes
/// from allocate_workspace(bytes), which must return device memory usable in `stream`'s order.
/// ValueError for an unknown kernel or query_prep, or a CanImplementScan* refusal.
Result CallScan(const ScanArgs& a, const std::function<void*(size_t)>& allocate_workspace,
                cudaStream_t stream);
/// Bytes of the tensor-core scan's workspace for such a launch (what CallScan allocates), the
/// CUDA-core scan's scratch for "cuda_cores"; -1 for an unknown kernel or query_prep.
int64_t ScanWorkspaceBytes(int64_t num_rows, int64_t num_heads, int64_t head_dim,
                           const std::string& kernel, const std::string& query_prep);

/// ValueError unless k is in [1, kMaxTopK].
Result CheckTopKK(int64_t k);

/// top-K (topk.h TopKParams; device pointers). logical_blocks / row_block_offset: both or neither.
struct TopKArgs {
  const float* scores = nullptr;
  int64_t num_rows = 0;
  const int64_t* row_score_offset = nullptr;
  const int64_t* row_num_entries = nullptr;
  const int64_t* row_max_slot = nullptr;
  int64_t k = 0;
  const int32_t* logical_blocks = nullptr;
  const int64_t* row_block_offset = nullptr;
  int32_t* selection = nullptr;
  /// A host bound on every row's entries (TopKParams::max_row_entries), 0 for none: where it says
  /// every chunk is held in shared memory, the kernel without the sampled gather runs (~55 KB less
  /// code to fetch after a cold L2). A row past it is still selected exactly, more slowly.
  int64_t max_row_entries = 0;
};
/// ValueError for a bad k, a negative max_row_entries or a CanImplementTopK refusal. Nothing runs
/// for 0 rows.
Result CallTopK(const TopKArgs& a, cudaStream_t stream);

/// SPIN's prediction and plan (spin_predict.h SpinPredictParams). The per-row tables (V and D
/// pointers and lengths) are given twice: on the host for the check, on the device for the launch.
struct SpinArgs {
  int64_t num_rows = 0;
  int64_t top_k = 0;
  double target_block_sparsity = 0;
  double exploration_fraction = 0;
  const int64_t* positions = nullptr;
  const int64_t* row_block_offset = nullptr;
  float* block_scores = nullptr;
  int32_t* selected = nullptr;  // null: S only
  int32_t* selected_count = nullptr;
  const float* const* vertical = nullptr;  // [num_rows], then diagonal the same
  const float* const* diagonal = nullptr;
  const int64_t* vertical_len = nullptr;
  const int64_t* diagonal_len = nullptr;
};
/// ValueError unless top_k is in [0, 2^31).
Result CheckSpinTopK(int64_t top_k);
/// CheckSpinTopK, and CanImplementSpinPredict's refusal, checked with the host tables in `a`.
Result CheckSpin(const SpinArgs& a);
/// Launches with `a`'s tables (device copies by now).
Result CallSpin(const SpinArgs& a, cudaStream_t stream);

/// A GPU's properties (device_info.h), or `error` when they cannot be read.
struct DeviceFacts {
  std::string error;
  int ordinal = 0;
  std::string name;
  int sm_major = 0;
  int sm_minor = 0;
  int num_sms = 0;
  int64_t global_memory_bytes = 0;
  bool can_run_indexer_kernels = false;
};
DeviceFacts GetDeviceFacts(int ordinal);

}  // namespace dsa::python
