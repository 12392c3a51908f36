// Python bindings (a PyTorch extension, pybind11) of the framework-free indexer kernels under
// indexer_service/cuda/: tensors in, tensors out, on the current torch CUDA stream. Bindings only:
// every tensor is checked here (device, dtype, contiguity, shape); the kernels' Params, their
// CanImplement* (whose reason is passed on) and the launches are kernel_calls.h's, which CI
// compiles without torch; the batch bookkeeping (offsets, layouts, output allocation) lives in
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

#include "python/csrc/kernel_calls.h"

namespace dsa::python {
namespace {

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
  if (pool.size(1) != kBlockSize * (head_dim + 4)) {
    return ArgumentError(Cat(op,
                             ": argument 'pool' must be uint8 [num_blocks, 64 * (head_dim + 4)] "
                             "= [*, ",
                             kBlockSize * (head_dim + 4), "] for head_dim ", head_dim,
                             ", got shape ", Dims(pool.sizes())));
  }
  if (reinterpret_cast<uintptr_t>(pool.data_ptr()) % 16 != 0) {
    return ArgumentError(Cat(op, ": argument 'pool' must start at a 16-byte aligned address"));
  }
  return Ok();
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
  if (head_dim < 1 || head_dim > kMaxAppendHeadDim) {
    return ArgumentError(Cat(op, ": argument 'keys' must have head_dim in [1, ", kMaxAppendHeadDim,
                             "], got shape ", Dims(keys.sizes())));
  }
  DSA_RETURN_IF_ERROR(CheckPool(op, pool, device, head_dim));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "block_table", block_table, device, at::kInt, 1));
  AppendArgs a;
  a.keys = keys.data_ptr();
  a.keys_bf16 = keys.scalar_type() == at::kBFloat16;
  a.num_keys = num_keys;
  a.head_dim = head_dim;
  a.block_table = block_table.data_ptr<int32_t>();
  a.block_table_entries = block_table.numel();
  a.first_slot = first_slot;
  a.pool = pool.data_ptr<uint8_t>();
  const c10::cuda::CUDAGuard guard(device);
  return CallAppend(a, CurrentStream(device));
}

// ---- scan -------------------------------------------------------------------------------------

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
  DSA_RETURN_IF_ERROR(CheckScanOptions(kernel, query_prep));
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

  ScanArgs a;
  a.pool = pool.data_ptr<uint8_t>();
  a.head_dim = head_dim;
  a.num_heads = num_heads;
  a.num_groups = num_groups;
  a.num_rows = num_rows;
  a.group_first_row = group_first_row.data_ptr<int32_t>();
  a.group_block_offset = group_block_offset.data_ptr<int64_t>();
  a.total_blocks = total_blocks;
  a.logical_blocks = logical_blocks.data_ptr<int32_t>();
  a.group_table_offset = group_table_offset.data_ptr<int64_t>();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.group_num_slots = group_num_slots.data_ptr<int64_t>();
  a.query = query.data_ptr();
  a.query_bf16 = query.scalar_type() == at::kBFloat16;
  a.head_weights = head_weights.data_ptr<float>();
  a.row_position = row_position.data_ptr<int64_t>();
  a.row_score_offset = row_score_offset.data_ptr<int64_t>();
  a.scores = scores.data_ptr<float>();
  a.kernel = kernel;
  a.query_prep = query_prep;
  // The tensor-core scan's workspace, from torch's caching allocator on the current stream: it may
  // be freed on return, as the allocator reuses it only in stream order.
  at::Tensor workspace;
  const auto allocate = [&](size_t bytes) {
    workspace = at::empty({static_cast<int64_t>(bytes)},
                          at::TensorOptions().dtype(at::kByte).device(device));
    return workspace.data_ptr();
  };
  const c10::cuda::CUDAGuard guard(device);
  return CallScan(a, allocate, CurrentStream(device));
}

// ---- top-K ------------------------------------------------------------------------------------

// Selections into `selection` (int32 [num_rows, k]).
Result TopKInto(const at::Tensor& scores, const at::Tensor& row_score_offset,
                const at::Tensor& row_num_entries, const at::Tensor& row_max_slot, int64_t k,
                const std::optional<at::Tensor>& logical_blocks,
                const std::optional<at::Tensor>& row_block_offset, const at::Tensor& selection,
                int64_t max_row_entries) {
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
  DSA_RETURN_IF_ERROR(CheckTopKK(k));
  DSA_RETURN_IF_ERROR(CheckTensor(op, "selection", selection, device, at::kInt, 2));
  if (selection.size(0) != num_rows || selection.size(1) != k) {
    return ArgumentError(Cat(op, ": argument 'selection' must be int32 [num_rows, k] = [", num_rows,
                             ", ", k, "], got shape ", Dims(selection.sizes())));
  }
  TopKArgs a;
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
    a.logical_blocks = blocks_or_stub.data_ptr<int32_t>();
    a.row_block_offset = row_block_offset->data_ptr<int64_t>();
  }
  a.k = k;
  a.max_row_entries = max_row_entries;
  // No row: CallTopK checks k and the bound and returns before any launch (no stream used).
  if (num_rows == 0) return CallTopK(a, nullptr);
  // Rows of 0 entries read no score, but the kernel wants a pointer: an empty `scores` gets a
  // one-entry stand-in.
  at::Tensor scores_or_stub = scores.numel() > 0 ? scores : at::empty({1}, scores.options());
  a.scores = scores_or_stub.data_ptr<float>();
  a.num_rows = num_rows;
  a.row_score_offset = row_score_offset.data_ptr<int64_t>();
  a.row_num_entries = row_num_entries.data_ptr<int64_t>();
  a.row_max_slot = row_max_slot.data_ptr<int64_t>();
  a.selection = selection.data_ptr<int32_t>();
  const c10::cuda::CUDAGuard guard(device);
  return CallTopK(a, CurrentStream(device));
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
  DSA_RETURN_IF_ERROR(CheckSpinTopK(top_k));
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
  SpinArgs a;
  a.num_rows = num_rows;
  a.top_k = top_k;
  a.target_block_sparsity = target_block_sparsity;
  a.exploration_fraction = exploration_fraction;
  // The device arrays and outputs (stand-ins for empty outputs: no entry is written then).
  a.positions = positions.data_ptr<int64_t>();
  a.row_block_offset = row_block_offset.data_ptr<int64_t>();
  const at::Tensor scores_or_stub =
      block_scores.numel() > 0 ? block_scores : at::empty({1}, block_scores.options());
  a.block_scores = scores_or_stub.data_ptr<float>();
  at::Tensor selected_or_stub;
  if (selected.has_value()) {
    selected_or_stub = selected->numel() > 0 ? *selected : at::empty({1}, selected->options());
    a.selected = selected_or_stub.data_ptr<int32_t>();
    a.selected_count = selected_count->data_ptr<int32_t>();
  }
  // CanImplement only tests the tables for null: check with the host tables, before any copy.
  a.vertical = reinterpret_cast<const float* const*>(ptr);
  a.diagonal = a.vertical + num_rows;
  a.vertical_len = len;
  a.diagonal_len = len + num_rows;
  DSA_RETURN_IF_ERROR(CheckSpin(a));
  const c10::cuda::CUDAGuard guard(device);
  // Blocking copies from pageable memory, allocated on the current stream: the caching allocator
  // reuses their memory only after the kernels below, in stream order.
  const at::Tensor pointers_device = pointers.to(device);
  const at::Tensor lengths_device = lengths.to(device);
  const auto* table = reinterpret_cast<const float* const*>(pointers_device.data_ptr<int64_t>());
  a.vertical = table;
  a.diagonal = table + num_rows;
  a.vertical_len = lengths_device.data_ptr<int64_t>();
  a.diagonal_len = lengths_device.data_ptr<int64_t>() + num_rows;
  return CallSpin(a, CurrentStream(device));
}

// ---- device info ------------------------------------------------------------------------------

// Properties of GPU `ordinal`; a dict with "error" when they cannot be read.
pybind11::dict DeviceInfo(int64_t ordinal) {
  pybind11::dict d;
  const DeviceFacts facts = GetDeviceFacts(static_cast<int>(ordinal));
  if (!facts.error.empty()) {
    d["error"] = facts.error;
    return d;
  }
  d["ordinal"] = facts.ordinal;
  d["name"] = facts.name;
  d["sm_major"] = facts.sm_major;
  d["sm_minor"] = facts.sm_minor;
  d["num_sms"] = facts.num_sms;
  d["global_memory_bytes"] = facts.global_memory_bytes;
  d["can_run_indexer_kernels"] = facts.can_run_indexer_kernels;
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
        py::arg("logical_blocks"), py::arg("row_block_offset"), py::arg("selection"),
        py::arg("max_row_entries") = 0);
  m.def("spin_predict", &SpinPredict, py::arg("positions"), py::arg("vertical"),
        py::arg("diagonal"), py::arg("row_block_offset"), py::arg("block_scores"),
        py::arg("selected"), py::arg("selected_count"), py::arg("top_k"),
        py::arg("target_block_sparsity"), py::arg("exploration_fraction"));
  m.def("device_info", &DeviceInfo, py::arg("ordinal"));
  m.attr("MAX_TOPK") = dsa::kMaxTopK;
  m.attr("BLOCK_SLOTS") = dsa::kBlockSize;
}
