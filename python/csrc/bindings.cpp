// Python bindings (a PyTorch extension, pybind11) of the framework-free indexer kernels under
// indexer_service/cuda/: tensors in, tensors out, on the current torch CUDA stream. Bindings only:
// every tensor is checked here (device, dtype, contiguity, shape) and CanImplement*'s reason is
// passed on; the batch bookkeeping (offsets, layouts, output allocation) lives in
// dsa_kernels/__init__.py.
//
// Every entry point returns a Result, (kind, message): kind 0 and "" when it launched, else the
// error that dsa_kernels raises (kind 1: ValueError for an argument or a refused shape, kind 2:
// RuntimeError for a failed launch). No C++ exception crosses into Python on these paths, and the
// messages are built with std::string alone: on the H200 host (PyTorch 2.11 and its g++), an
// earlier version that threw c10::ValueError (TORCH_CHECK_VALUE) with messages streaming integers
// or an IntArrayRef segfaulted the process at its second to fourth throw; the cause was not found
// (docs/gpu_kernels.md, "Python module").
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "indexer_service/cuda/device_info.h"
#include "indexer_service/cuda/key_append.h"
#include "indexer_service/cuda/scan.h"
#include "indexer_service/cuda/spin_predict.h"
#include "indexer_service/cuda/topk.h"

namespace dsa::python {
namespace {

constexpr int64_t kBlockSlots = 64;  // kBlockSize of indexer_service/block_pool.h

enum ResultKind : int { kOk = 0, kValueError = 1, kRuntimeError = 2 };
/// (kind, message): see the file comment.
using Result = std::pair<int, std::string>;

Result Ok() { return {kOk, std::string()}; }

// ---- messages, without streams ----------------------------------------------------------------

void AppendPiece(std::string& out, const char* s) { out += s; }
void AppendPiece(std::string& out, const std::string& s) { out += s; }
void AppendPiece(std::string& out, int v) { out += std::to_string(v); }
void AppendPiece(std::string& out, long v) { out += std::to_string(v); }
void AppendPiece(std::string& out, long long v) { out += std::to_string(v); }
void AppendPiece(std::string& out, unsigned long v) { out += std::to_string(v); }
void AppendPiece(std::string& out, unsigned long long v) { out += std::to_string(v); }

// The concatenation of strings and integers.
template <typename... Args>
std::string Cat(const Args&... args) {
  std::string out;
  (AppendPiece(out, args), ...);
  return out;
}

// "[2, 3]": a shape or strides.
std::string Dims(c10::IntArrayRef dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(dims[i]);
  }
  return out + "]";
}

std::string DeviceName(const at::Device& d) {
  return d.is_cuda() ? Cat("cuda:", static_cast<int>(d.index()))
                     : std::string(d.is_cpu() ? "cpu" : "a non-CUDA device");
}

// torch's Python name of a dtype ("uint8", "int32", "float32", ...).
std::string DtypeName(at::ScalarType t) {
  switch (t) {
    case at::kByte:
      return "uint8";
    case at::kChar:
      return "int8";
    case at::kShort:
      return "int16";
    case at::kInt:
      return "int32";
    case at::kLong:
      return "int64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kBool:
      return "bool";
    default:
      return "another dtype";
  }
}

// Returns the Result of `expr` when it is an error.
#define DSA_RETURN_IF_ERROR(expr)                     \
  do {                                                \
    Result dsa_result_ = (expr);                      \
    if (dsa_result_.first != kOk) return dsa_result_; \
  } while (false)

Result ArgumentError(std::string message) { return {kValueError, std::move(message)}; }

// ---- argument checks --------------------------------------------------------------------------

// One tensor argument of `op`: defined, on `device` (a CUDA device), of `dtype`, with `dim`
// dimensions (-1: any), contiguous.
Result CheckTensor(const char* op, const char* name, const at::Tensor& t, const at::Device& device,
                   at::ScalarType dtype, int64_t dim) {
  if (!t.defined()) return ArgumentError(Cat(op, ": argument '", name, "' is undefined"));
  if (!t.is_cuda()) {
    return ArgumentError(Cat(op, ": argument '", name, "' must be a CUDA tensor on ",
                             DeviceName(device), ", got a tensor on ", DeviceName(t.device())));
  }
  if (t.device() != device) {
    return ArgumentError(Cat(op, ": argument '", name, "' must be on ", DeviceName(device),
                             " (the device of the other arguments), got ", DeviceName(t.device())));
  }
  if (t.scalar_type() != dtype) {
    return ArgumentError(Cat(op, ": argument '", name, "' must be ", DtypeName(dtype), ", got ",
                             DtypeName(t.scalar_type())));
  }
  if (dim >= 0 && t.dim() != dim) {
    return ArgumentError(Cat(op, ": argument '", name, "' must have ", dim,
                             " dimension(s), got shape ", Dims(t.sizes())));
  }
  if (!t.is_contiguous()) {
    return ArgumentError(Cat(op, ": argument '", name,
                             "' must be contiguous (call .contiguous()), got strides ",
                             Dims(t.strides())));
  }
  return Ok();
}

// Same, for a tensor whose dtype may be fp32 or bf16.
Result CheckFloatTensor(const char* op, const char* name, const at::Tensor& t,
                        const at::Device& device, int64_t dim) {
  if (!t.defined()) return ArgumentError(Cat(op, ": argument '", name, "' is undefined"));
  const at::ScalarType dtype = t.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16) {
    return ArgumentError(
        Cat(op, ": argument '", name, "' must be float32 or bfloat16, got ", DtypeName(dtype)));
  }
  return CheckTensor(op, name, t, device, dtype, dim);
}

Result CheckLength(const char* op, const char* name, const at::Tensor& t, int64_t expected,
                   const char* what) {
  if (t.numel() == expected) return Ok();
  return ArgumentError(Cat(op, ": argument '", name, "' must have ", expected, " entries (", what,
                           "), got shape ", Dims(t.sizes())));
}

// The device a call runs on: that of its main tensor, which must be a CUDA tensor.
Result MainDevice(const char* op, const char* name, const at::Tensor& t, const char* shape,
                  at::Device* device) {
  if (!t.defined() || !t.is_cuda()) {
    return ArgumentError(Cat(op, ": argument '", name, "' must be a CUDA tensor ", shape));
  }
  *device = t.device();
  return Ok();
}

// The pool: uint8 [num_blocks, 64 * (head_dim + 4)], 16-byte aligned (the scan's bulk copies).
Result CheckPool(const char* op, const at::Tensor& pool, const at::Device& device,
                 int64_t head_dim) {
  DSA_RETURN_IF_ERROR(CheckTensor(op, "pool", pool, device, at::kByte, 2));
  if (pool.size(1) != kBlockSlots * (head_dim + 4)) {
    return ArgumentError(Cat(op,
                             ": argument 'pool' must be uint8 [num_blocks, 64 * (head_dim + 4)] "
                             "= [*, ",
                             kBlockSlots * (head_dim + 4), "] for head_dim ", head_dim,
                             ", got shape ", Dims(pool.sizes())));
  }
  if (reinterpret_cast<uintptr_t>(pool.data_ptr()) % 16 != 0) {
    return ArgumentError(Cat(op, ": argument 'pool' must start at a 16-byte aligned address"));
  }
  return Ok();
}

Result Refused(const char* check, const char* why) {
  return ArgumentError(Cat(check, " refused the launch: ", why != nullptr ? why : "(no reason)"));
}

Result LaunchResult(cudaError_t e, const char* launch) {
  if (e == cudaSuccess) return Ok();
  return {kRuntimeError,
          Cat(launch, " failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e))};
}

cudaStream_t CurrentStream(const at::Device& device) {
  return at::cuda::getCurrentCUDAStream(device.index()).stream();
}

// ---- append -----------------------------------------------------------------------------------

Result Append(const at::Tensor& pool, const at::Tensor& block_table, const at::Tensor& keys,
              int64_t first_slot) {
  constexpr const char* op = "append";
  at::Device device(at::kCUDA);
  DSA_RETURN_IF_ERROR(MainDevice(op, "keys", keys, "[num_keys, head_dim]", &device));
  DSA_RETURN_IF_ERROR(CheckFloatTensor(op, "keys", keys, device, 2));
  const int64_t num_keys = keys.size(0);
  const int64_t head_dim = keys.size(1);
  if (head_dim < 1 || head_dim > 1024) {
    return ArgumentError(Cat(op, ": argument 'keys' must have head_dim in [1, 1024], got shape ",
                             Dims(keys.sizes())));
  }
  DSA_RETURN_IF_ERROR(CheckPool(op, pool, device, head_dim));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "block_table", block_table, device, at::kInt, 1));
  if (first_slot < 0) {
    return ArgumentError(Cat(op, ": argument 'first_slot' must be >= 0, got ", first_slot));
  }
  const int64_t blocks_needed = (first_slot + num_keys + kBlockSlots - 1) / kBlockSlots;
  if (num_keys > 0 && block_table.numel() < blocks_needed) {
    return ArgumentError(Cat(op,
                             ": argument 'block_table' must have at least ceil((first_slot + "
                             "num_keys) / 64) = ",
                             blocks_needed, " entries, got ", block_table.numel()));
  }
  cuda::AppendParams p;
  p.keys = keys.data_ptr();
  p.keys_dtype =
      keys.scalar_type() == at::kFloat ? cuda::KeyDtype::kFloat32 : cuda::KeyDtype::kBFloat16;
  p.num_keys = num_keys;
  p.head_dim = static_cast<int>(head_dim);
  p.block_table = block_table.data_ptr<int32_t>();
  p.first_slot = first_slot;
  p.pool = pool.data_ptr<uint8_t>();
  const char* why = nullptr;
  if (!cuda::CanImplementAppend(p, &why)) return Refused("CanImplementAppend", why);
  const c10::cuda::CUDAGuard guard(device);
  return LaunchResult(cuda::LaunchAppend(p, CurrentStream(device)), "LaunchAppend");
}

// ---- scan -------------------------------------------------------------------------------------

Result ParseQueryPrep(const std::string& s, cuda::ScanQueryPrep* prep) {
  if (s == "auto") {
    *prep = cuda::ScanQueryPrep::kAuto;
  } else if (s == "workspace") {
    *prep = cuda::ScanQueryPrep::kWorkspace;
  } else if (s == "in_kernel") {
    *prep = cuda::ScanQueryPrep::kInKernel;
  } else {
    return ArgumentError(
        Cat("scan: argument 'query_prep' must be \"auto\", \"workspace\" or \"in_kernel\", got \"",
            s, "\""));
  }
  return Ok();
}

Result ParseKernel(const std::string& kernel, bool* tensor_cores) {
  if (kernel != "tensor_cores" && kernel != "cuda_cores") {
    return ArgumentError(
        Cat("scan: argument 'kernel' must be \"tensor_cores\" or \"cuda_cores\", got \"", kernel,
            "\""));
  }
  *tensor_cores = kernel == "tensor_cores";
  return Ok();
}

// Scores into `scores` (fp32, the scan layout; see scan.h ScanParams). total_blocks is the host
// copy of group_block_offset[num_groups]. The tensor-core scan's workspace is allocated here with
// torch's caching allocator on the current stream (so it may be freed on return: the allocator
// reuses it only in stream order).
Result ScanInto(const at::Tensor& pool, const at::Tensor& group_first_row,
                const at::Tensor& group_block_offset, int64_t total_blocks,
                const at::Tensor& logical_blocks, const at::Tensor& group_table_offset,
                const at::Tensor& block_tables, const at::Tensor& group_num_slots,
                const at::Tensor& query, const at::Tensor& head_weights,
                const at::Tensor& row_position, const at::Tensor& row_score_offset,
                const at::Tensor& scores, const std::string& kernel,
                const std::string& query_prep) {
  constexpr const char* op = "scan";
  bool tensor_cores = false;
  DSA_RETURN_IF_ERROR(ParseKernel(kernel, &tensor_cores));
  cuda::ScanQueryPrep prep = cuda::ScanQueryPrep::kAuto;
  DSA_RETURN_IF_ERROR(ParseQueryPrep(query_prep, &prep));
  at::Device device(at::kCUDA);
  DSA_RETURN_IF_ERROR(MainDevice(op, "query", query, "[num_rows, num_heads, head_dim]", &device));
  DSA_RETURN_IF_ERROR(CheckFloatTensor(op, "query", query, device, 3));
  const int64_t num_rows = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  if (num_rows > INT32_MAX || num_heads < 1 || head_dim < 1) {
    return ArgumentError(Cat(op,
                             ": argument 'query' must be [num_rows, num_heads >= 1, head_dim >= "
                             "1], got shape ",
                             Dims(query.sizes())));
  }
  DSA_RETURN_IF_ERROR(CheckPool(op, pool, device, head_dim));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "group_first_row", group_first_row, device, at::kInt, 1));
  if (group_first_row.numel() < 1) {
    return ArgumentError(
        Cat(op, ": argument 'group_first_row' must have num_groups + 1 >= 1 entries"));
  }
  const int64_t num_groups = group_first_row.numel() - 1;
  DSA_RETURN_IF_ERROR(
      CheckTensor(op, "group_block_offset", group_block_offset, device, at::kLong, 1));
  DSA_RETURN_IF_ERROR(
      CheckLength(op, "group_block_offset", group_block_offset, num_groups + 1, "num_groups + 1"));
  if (total_blocks < 0) {
    return ArgumentError(Cat(op, ": argument 'total_blocks' must be >= 0, got ", total_blocks));
  }
  DSA_RETURN_IF_ERROR(CheckTensor(op, "logical_blocks", logical_blocks, device, at::kInt, 1));
  if (logical_blocks.numel() < total_blocks) {
    return ArgumentError(Cat(op, ": argument 'logical_blocks' must have at least total_blocks = ",
                             total_blocks, " entries, got ", logical_blocks.numel()));
  }
  DSA_RETURN_IF_ERROR(
      CheckTensor(op, "group_table_offset", group_table_offset, device, at::kLong, 1));
  DSA_RETURN_IF_ERROR(
      CheckLength(op, "group_table_offset", group_table_offset, num_groups, "num_groups"));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "block_tables", block_tables, device, at::kInt, 1));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "group_num_slots", group_num_slots, device, at::kLong, 1));
  DSA_RETURN_IF_ERROR(
      CheckLength(op, "group_num_slots", group_num_slots, num_groups, "num_groups"));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "head_weights", head_weights, device, at::kFloat, 2));
  if (head_weights.size(0) != num_rows || head_weights.size(1) != num_heads) {
    return ArgumentError(
        Cat(op, ": argument 'head_weights' must be float32 [num_rows, num_heads] = [", num_rows,
            ", ", num_heads, "], got shape ", Dims(head_weights.sizes())));
  }
  DSA_RETURN_IF_ERROR(CheckTensor(op, "row_position", row_position, device, at::kLong, 1));
  DSA_RETURN_IF_ERROR(CheckLength(op, "row_position", row_position, num_rows, "num_rows"));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "row_score_offset", row_score_offset, device, at::kLong, 1));
  DSA_RETURN_IF_ERROR(CheckLength(op, "row_score_offset", row_score_offset, num_rows, "num_rows"));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "scores", scores, device, at::kFloat, -1));

  cuda::ScanParams p;
  p.pool = pool.data_ptr<uint8_t>();
  p.head_dim = static_cast<int>(head_dim);
  p.num_heads = static_cast<int>(num_heads);
  p.num_groups = static_cast<int>(num_groups);
  p.num_rows = static_cast<int>(num_rows);
  p.group_first_row = group_first_row.data_ptr<int32_t>();
  p.group_block_offset = group_block_offset.data_ptr<int64_t>();
  p.total_blocks = total_blocks;
  p.logical_blocks = logical_blocks.data_ptr<int32_t>();
  p.group_table_offset = group_table_offset.data_ptr<int64_t>();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.group_num_slots = group_num_slots.data_ptr<int64_t>();
  p.query = query.data_ptr();
  p.query_dtype =
      query.scalar_type() == at::kFloat ? cuda::QueryDtype::kFloat32 : cuda::QueryDtype::kBFloat16;
  p.head_weights = head_weights.data_ptr<float>();
  p.row_position = row_position.data_ptr<int64_t>();
  p.row_score_offset = row_score_offset.data_ptr<int64_t>();
  p.scores = scores.data_ptr<float>();
  p.query_prep = prep;

  const char* why = nullptr;
  if (!tensor_cores) {
    if (!cuda::CanImplementScanCudaCores(p, &why)) return Refused("CanImplementScanCudaCores", why);
    const c10::cuda::CUDAGuard guard(device);
    return LaunchResult(cuda::LaunchScanCudaCores(p, CurrentStream(device)), "LaunchScanCudaCores");
  }
  const size_t workspace_bytes = cuda::ScanTensorCoresScratchBytes(p);
  at::Tensor workspace;
  if (workspace_bytes > 0 && total_blocks > 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)},
                          at::TensorOptions().dtype(at::kByte).device(device));
    p.workspace = workspace.data_ptr();
    p.workspace_bytes = workspace_bytes;
  }
  if (!cuda::CanImplementScanTensorCores(p, &why)) {
    return Refused("CanImplementScanTensorCores", why);
  }
  const c10::cuda::CUDAGuard guard(device);
  return LaunchResult(cuda::LaunchScanTensorCores(p, CurrentStream(device)),
                      "LaunchScanTensorCores");
}

// Bytes of the tensor-core scan's workspace for such a launch (what ScanInto allocates); -1 for
// an unknown kernel or query_prep.
int64_t ScanWorkspaceBytes(int64_t num_rows, int64_t num_heads, int64_t head_dim,
                           const std::string& kernel, const std::string& query_prep) {
  cuda::ScanParams p;
  bool tensor_cores = false;
  if (ParseKernel(kernel, &tensor_cores).first != kOk ||
      ParseQueryPrep(query_prep, &p.query_prep).first != kOk) {
    return -1;
  }
  p.num_rows = static_cast<int>(num_rows);
  p.num_heads = static_cast<int>(num_heads);
  p.head_dim = static_cast<int>(head_dim);
  return tensor_cores ? static_cast<int64_t>(cuda::ScanTensorCoresScratchBytes(p))
                      : static_cast<int64_t>(cuda::ScanCudaCoresScratchBytes(p));
}

// ---- top-K ------------------------------------------------------------------------------------

// Selections into `selection` (int32 [num_rows, k]).
Result TopKInto(const at::Tensor& scores, const at::Tensor& row_score_offset,
                const at::Tensor& row_num_entries, const at::Tensor& row_max_slot, int64_t k,
                const std::optional<at::Tensor>& logical_blocks,
                const std::optional<at::Tensor>& row_block_offset, const at::Tensor& selection) {
  constexpr const char* op = "topk";
  at::Device device(at::kCUDA);
  DSA_RETURN_IF_ERROR(MainDevice(op, "scores", scores, "(float32)", &device));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "scores", scores, device, at::kFloat, -1));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "row_offsets", row_score_offset, device, at::kLong, 1));
  const int64_t num_rows = row_score_offset.numel();
  if (num_rows > INT32_MAX) return ArgumentError(Cat(op, ": too many rows: ", num_rows));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "row_num_entries", row_num_entries, device, at::kLong, 1));
  DSA_RETURN_IF_ERROR(CheckLength(op, "row_num_entries", row_num_entries, num_rows, "num_rows"));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "row_max_slot", row_max_slot, device, at::kLong, 1));
  DSA_RETURN_IF_ERROR(CheckLength(op, "row_max_slot", row_max_slot, num_rows, "num_rows"));
  if (logical_blocks.has_value() != row_block_offset.has_value()) {
    return ArgumentError(Cat(op,
                             ": arguments 'logical_blocks' and 'row_block_offset' go together: "
                             "give both or neither"));
  }
  if (k < 1 || k > kMaxTopK) {
    return ArgumentError(Cat(op, ": argument 'k' must be in [1, ", kMaxTopK, "], got ", k));
  }
  DSA_RETURN_IF_ERROR(CheckTensor(op, "selection", selection, device, at::kInt, 2));
  if (selection.size(0) != num_rows || selection.size(1) != k) {
    return ArgumentError(Cat(op, ": argument 'selection' must be int32 [num_rows, k] = [", num_rows,
                             ", ", k, "], got shape ", Dims(selection.sizes())));
  }
  cuda::TopKParams p;
  at::Tensor blocks_or_stub;
  if (logical_blocks.has_value()) {
    DSA_RETURN_IF_ERROR(CheckTensor(op, "logical_blocks", *logical_blocks, device, at::kInt, 1));
    DSA_RETURN_IF_ERROR(
        CheckTensor(op, "row_block_offset", *row_block_offset, device, at::kLong, 1));
    DSA_RETURN_IF_ERROR(
        CheckLength(op, "row_block_offset", *row_block_offset, num_rows, "num_rows"));
    // An empty tensor may have a null data pointer (no row has entries then): a stand-in.
    blocks_or_stub =
        logical_blocks->numel() > 0 ? *logical_blocks : at::empty({1}, logical_blocks->options());
    p.logical_blocks = blocks_or_stub.data_ptr<int32_t>();
    p.row_block_offset = row_block_offset->data_ptr<int64_t>();
  }
  if (num_rows == 0) return Ok();
  // Rows of 0 entries read no score, but the kernel wants a pointer: an empty `scores` gets a
  // one-entry stand-in.
  at::Tensor scores_or_stub = scores.numel() > 0 ? scores : at::empty({1}, scores.options());
  p.scores = scores_or_stub.data_ptr<float>();
  p.num_rows = static_cast<int>(num_rows);
  p.row_score_offset = row_score_offset.data_ptr<int64_t>();
  p.row_num_entries = row_num_entries.data_ptr<int64_t>();
  p.row_max_slot = row_max_slot.data_ptr<int64_t>();
  p.k = static_cast<int>(k);
  p.selection = selection.data_ptr<int32_t>();
  const char* why = nullptr;
  if (!cuda::CanImplementTopK(p, &why)) return Refused("CanImplementTopK", why);
  const c10::cuda::CUDAGuard guard(device);
  return LaunchResult(cuda::LaunchTopK(p, CurrentStream(device)), "LaunchTopK");
}

// ---- SPIN block prediction --------------------------------------------------------------------

// Writes S[j] into `block_scores` and, when `selected` is given, the plan into `selected` and
// `selected_count`. vertical[r] / diagonal[r]: fp32 1-D CUDA tensors (V and D of row r's
// sequence; may be empty).
Result SpinPredict(const at::Tensor& positions, const std::vector<at::Tensor>& vertical,
                   const std::vector<at::Tensor>& diagonal, const at::Tensor& row_block_offset,
                   const at::Tensor& block_scores, const std::optional<at::Tensor>& selected,
                   const std::optional<at::Tensor>& selected_count, int64_t top_k,
                   double target_block_sparsity, double exploration_fraction) {
  constexpr const char* op = "spin_plan";
  at::Device device(at::kCUDA);
  DSA_RETURN_IF_ERROR(MainDevice(op, "positions", positions, "(int64 [num_rows])", &device));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "positions", positions, device, at::kLong, 1));
  const int64_t num_rows = positions.numel();
  if (num_rows > INT32_MAX) return ArgumentError(Cat(op, ": too many rows: ", num_rows));
  if (static_cast<int64_t>(vertical.size()) != num_rows ||
      static_cast<int64_t>(diagonal.size()) != num_rows) {
    return ArgumentError(Cat(op,
                             ": arguments 'vertical' and 'diagonal' must hold one tensor a row (",
                             num_rows, "), got ", vertical.size(), " and ", diagonal.size()));
  }
  DSA_RETURN_IF_ERROR(CheckTensor(op, "row_block_offset", row_block_offset, device, at::kLong, 1));
  DSA_RETURN_IF_ERROR(CheckLength(op, "row_block_offset", row_block_offset, num_rows, "num_rows"));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "block_scores", block_scores, device, at::kFloat, 1));
  if (selected.has_value() != selected_count.has_value()) {
    return ArgumentError(Cat(op, ": 'selected' and 'selected_count' go together"));
  }
  if (selected.has_value()) {
    DSA_RETURN_IF_ERROR(CheckTensor(op, "selected", *selected, device, at::kInt, 1));
    if (selected->numel() < block_scores.numel()) {
      return ArgumentError(
          Cat(op, ": argument 'selected' must have as many entries as 'block_scores'"));
    }
    DSA_RETURN_IF_ERROR(CheckTensor(op, "selected_count", *selected_count, device, at::kInt, 1));
    DSA_RETURN_IF_ERROR(CheckLength(op, "selected_count", *selected_count, num_rows, "num_rows"));
  }
  if (top_k < 0 || top_k > INT32_MAX) {
    return ArgumentError(Cat(op, ": argument 'top_k' out of range: ", top_k));
  }
  // The per-row pointer and length tables, built on the host and copied to the device.
  at::Tensor pointers = at::empty({2, num_rows}, at::TensorOptions().dtype(at::kLong));
  at::Tensor lengths = at::empty({2, num_rows}, at::TensorOptions().dtype(at::kLong));
  int64_t* ptr = pointers.data_ptr<int64_t>();
  int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r) {
    DSA_RETURN_IF_ERROR(CheckTensor(op, "vertical[r]", vertical[r], device, at::kFloat, 1));
    DSA_RETURN_IF_ERROR(CheckTensor(op, "diagonal[r]", diagonal[r], device, at::kFloat, 1));
    ptr[r] = reinterpret_cast<int64_t>(vertical[r].numel() > 0 ? vertical[r].data_ptr() : nullptr);
    ptr[num_rows + r] =
        reinterpret_cast<int64_t>(diagonal[r].numel() > 0 ? diagonal[r].data_ptr() : nullptr);
    len[r] = vertical[r].numel();
    len[num_rows + r] = diagonal[r].numel();
  }
  cuda::SpinPredictParams p;
  p.num_rows = static_cast<int>(num_rows);
  p.top_k = static_cast<int>(top_k);
  p.target_block_sparsity = target_block_sparsity;
  p.exploration_fraction = exploration_fraction;
  // The device arrays and outputs (stand-ins for empty outputs: no entry is written then).
  p.positions = positions.data_ptr<int64_t>();
  p.row_block_offset = row_block_offset.data_ptr<int64_t>();
  const at::Tensor scores_or_stub =
      block_scores.numel() > 0 ? block_scores : at::empty({1}, block_scores.options());
  p.scores = scores_or_stub.data_ptr<float>();
  at::Tensor selected_or_stub;
  if (selected.has_value()) {
    selected_or_stub = selected->numel() > 0 ? *selected : at::empty({1}, selected->options());
    p.selected = selected_or_stub.data_ptr<int32_t>();
    p.selected_count = selected_count->data_ptr<int32_t>();
  }
  // CanImplement only tests the tables for null: check with the host tables, before any copy.
  p.vertical = reinterpret_cast<const float* const*>(ptr);
  p.diagonal = p.vertical + num_rows;
  p.vertical_len = len;
  p.diagonal_len = len + num_rows;
  const char* why = nullptr;
  if (!cuda::CanImplementSpinPredict(p, &why)) return Refused("CanImplementSpinPredict", why);
  const c10::cuda::CUDAGuard guard(device);
  // Blocking copies from pageable memory, allocated on the current stream: the caching allocator
  // reuses their memory only after the kernels below, in stream order.
  const at::Tensor pointers_device = pointers.to(device);
  const at::Tensor lengths_device = lengths.to(device);
  const auto* table = reinterpret_cast<const float* const*>(pointers_device.data_ptr<int64_t>());
  p.vertical = table;
  p.diagonal = table + num_rows;
  p.vertical_len = lengths_device.data_ptr<int64_t>();
  p.diagonal_len = lengths_device.data_ptr<int64_t>() + num_rows;
  return LaunchResult(cuda::LaunchSpinPredict(p, CurrentStream(device)), "LaunchSpinPredict");
}

// ---- device info ------------------------------------------------------------------------------

// Properties of GPU `ordinal`; a dict with "error" when they cannot be read.
pybind11::dict DeviceInfo(int64_t ordinal) {
  pybind11::dict d;
  cuda::DeviceInfo info;
  const cudaError_t e = cuda::GetDeviceInfo(static_cast<int>(ordinal), &info);
  if (e != cudaSuccess) {
    d["error"] = Cat("GetDeviceInfo failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
    return d;
  }
  d["ordinal"] = info.ordinal;
  d["name"] = std::string(info.name);
  d["sm_major"] = info.sm_major;
  d["sm_minor"] = info.sm_minor;
  d["num_sms"] = info.num_sms;
  d["global_memory_bytes"] = info.global_memory_bytes;
  d["can_run_indexer_kernels"] = cuda::CanRunIndexerKernels(info);
  return d;
}

}  // namespace
}  // namespace dsa::python

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace dsa::python;
  m.doc() =
      "Bindings of the DSA indexer CUDA kernels (indexer_service/cuda). Each returns (kind, "
      "message): 0 = launched, 1 = bad argument, 2 = launch failed. Use dsa_kernels.";
  m.def("append", &Append, py::arg("pool"), py::arg("block_table"), py::arg("keys"),
        py::arg("first_slot"));
  m.def("scan_into", &ScanInto, py::arg("pool"), py::arg("group_first_row"),
        py::arg("group_block_offset"), py::arg("total_blocks"), py::arg("logical_blocks"),
        py::arg("group_table_offset"), py::arg("block_tables"), py::arg("group_num_slots"),
        py::arg("query"), py::arg("head_weights"), py::arg("row_position"),
        py::arg("row_score_offset"), py::arg("scores"), py::arg("kernel"), py::arg("query_prep"));
  m.def("scan_workspace_bytes", &ScanWorkspaceBytes, py::arg("num_rows"), py::arg("num_heads"),
        py::arg("head_dim"), py::arg("kernel"), py::arg("query_prep"));
  m.def("topk_into", &TopKInto, py::arg("scores"), py::arg("row_offsets"),
        py::arg("row_num_entries"), py::arg("row_max_slot"), py::arg("k"),
        py::arg("logical_blocks"), py::arg("row_block_offset"), py::arg("selection"));
  m.def("spin_predict", &SpinPredict, py::arg("positions"), py::arg("vertical"),
        py::arg("diagonal"), py::arg("row_block_offset"), py::arg("block_scores"),
        py::arg("selected"), py::arg("selected_count"), py::arg("top_k"),
        py::arg("target_block_sparsity"), py::arg("exploration_fraction"));
  m.def("device_info", &DeviceInfo, py::arg("ordinal"));
  m.attr("MAX_TOPK") = dsa::kMaxTopK;
  m.attr("BLOCK_SLOTS") = 64;
}
