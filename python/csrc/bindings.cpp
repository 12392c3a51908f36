// Python bindings (a PyTorch extension, pybind11) of the framework-free indexer kernels under
// indexer_service/cuda/: tensors in, tensors out, on the current torch CUDA stream. Bindings only:
// every tensor is checked here (device, dtype, contiguity, shape) and CanImplement*'s reason is
// raised as a ValueError; the batch bookkeeping (offsets, layouts) lives in
// dsa_kernels/__init__.py.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "indexer_service/cuda/device_info.h"
#include "indexer_service/cuda/key_append.h"
#include "indexer_service/cuda/scan.h"
#include "indexer_service/cuda/spin_predict.h"
#include "indexer_service/cuda/topk.h"

namespace dsa::python {
namespace {

constexpr int64_t kBlockSlots = 64;  // kBlockSize of indexer_service/block_pool.h

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
      return c10::toString(t);
  }
}

// Checks one tensor argument of `op`: defined, on `device` (a CUDA device), of `dtype`, with `dim`
// dimensions (-1: any), contiguous. Raises ValueError naming the argument otherwise.
void CheckTensor(const char* op, const char* name, const at::Tensor& t, const at::Device& device,
                 at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK_VALUE(t.defined(), op, ": argument '", name, "' is undefined");
  TORCH_CHECK_VALUE(t.is_cuda(), op, ": argument '", name, "' must be a CUDA tensor on ", device,
                    ", got a tensor on ", t.device());
  TORCH_CHECK_VALUE(t.device() == device, op, ": argument '", name, "' must be on ", device,
                    " (the device of the other arguments), got ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": argument '", name, "' must be ",
                    DtypeName(dtype), ", got ", DtypeName(t.scalar_type()));
  TORCH_CHECK_VALUE(dim < 0 || t.dim() == dim, op, ": argument '", name, "' must have ", dim,
                    " dimension(s), got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": argument '", name,
                    "' must be contiguous (call .contiguous()), got strides ", t.strides());
}

// Same, for a tensor whose dtype may be fp32 or bf16.
void CheckFloatTensor(const char* op, const char* name, const at::Tensor& t,
                      const at::Device& device, int64_t dim) {
  TORCH_CHECK_VALUE(t.defined(), op, ": argument '", name, "' is undefined");
  const at::ScalarType dtype = t.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16, op, ": argument '", name,
                    "' must be float32 or bfloat16, got ", DtypeName(dtype));
  CheckTensor(op, name, t, device, dtype, dim);
}

void CheckLength(const char* op, const char* name, const at::Tensor& t, int64_t expected,
                 const char* what) {
  TORCH_CHECK_VALUE(t.numel() == expected, op, ": argument '", name, "' must have ", expected,
                    " entries (", what, "), got shape ", t.sizes());
}

// The pool: uint8 [num_blocks, 64 * (head_dim + 4)], 16-byte aligned (the scan's bulk copies).
void CheckPool(const char* op, const at::Tensor& pool, const at::Device& device, int64_t head_dim) {
  CheckTensor(op, "pool", pool, device, at::kByte, 2);
  TORCH_CHECK_VALUE(pool.size(1) == kBlockSlots * (head_dim + 4), op,
                    ": argument 'pool' must be uint8 [num_blocks, 64 * (head_dim + 4)] = [*, ",
                    kBlockSlots * (head_dim + 4), "] for head_dim ", head_dim, ", got shape ",
                    pool.sizes());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(pool.data_ptr()) % 16 == 0, op,
                    ": argument 'pool' must start at a 16-byte aligned address");
}

void ThrowIfRefused(bool ok, const char* check, const char* why) {
  TORCH_CHECK_VALUE(ok, check, " refused the launch: ", why != nullptr ? why : "(no reason)");
}

void ThrowIfFailed(cudaError_t e, const char* launch) {
  TORCH_CHECK(e == cudaSuccess, launch, " failed: ", cudaGetErrorName(e), ": ",
              cudaGetErrorString(e));
}

// ---- append ---------------------------------------------------------------------------------

void Append(const at::Tensor& pool, const at::Tensor& block_table, const at::Tensor& keys,
            int64_t first_slot) {
  constexpr const char* op = "append";
  TORCH_CHECK_VALUE(keys.defined() && keys.is_cuda(), op,
                    ": argument 'keys' must be a CUDA tensor [num_keys, head_dim]");
  const at::Device device = keys.device();
  CheckFloatTensor(op, "keys", keys, device, 2);
  const int64_t num_keys = keys.size(0);
  const int64_t head_dim = keys.size(1);
  TORCH_CHECK_VALUE(head_dim >= 1 && head_dim <= 1024, op,
                    ": argument 'keys' must have head_dim in [1, 1024], got shape ", keys.sizes());
  CheckPool(op, pool, device, head_dim);
  CheckTensor(op, "block_table", block_table, device, at::kInt, 1);
  TORCH_CHECK_VALUE(first_slot >= 0, op, ": argument 'first_slot' must be >= 0, got ", first_slot);
  const int64_t blocks_needed = (first_slot + num_keys + kBlockSlots - 1) / kBlockSlots;
  TORCH_CHECK_VALUE(num_keys == 0 || block_table.numel() >= blocks_needed, op,
                    ": argument 'block_table' must have at least ceil((first_slot + num_keys) / "
                    "64) = ",
                    blocks_needed, " entries, got ", block_table.numel());

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
  ThrowIfRefused(cuda::CanImplementAppend(p, &why), "CanImplementAppend", why);
  const c10::cuda::CUDAGuard guard(device);
  ThrowIfFailed(cuda::LaunchAppend(p, at::cuda::getCurrentCUDAStream(device.index()).stream()),
                "LaunchAppend");
}

// ---- scan -----------------------------------------------------------------------------------

cuda::ScanQueryPrep ParseQueryPrep(const std::string& s) {
  if (s == "auto") return cuda::ScanQueryPrep::kAuto;
  if (s == "workspace") return cuda::ScanQueryPrep::kWorkspace;
  if (s == "in_kernel") return cuda::ScanQueryPrep::kInKernel;
  TORCH_CHECK_VALUE(false, "scan: argument 'query_prep' must be \"auto\", \"workspace\" or ",
                    "\"in_kernel\", got \"", s, "\"");
  return cuda::ScanQueryPrep::kAuto;
}

bool ParseTensorCores(const std::string& kernel) {
  TORCH_CHECK_VALUE(kernel == "tensor_cores" || kernel == "cuda_cores",
                    "scan: argument 'kernel' must be \"tensor_cores\" or \"cuda_cores\", got \"",
                    kernel, "\"");
  return kernel == "tensor_cores";
}

// Scores into `scores` (fp32, the scan layout; see scan.h ScanParams). total_blocks is the host
// copy of group_block_offset[num_groups].
void ScanInto(const at::Tensor& pool, const at::Tensor& group_first_row,
              const at::Tensor& group_block_offset, int64_t total_blocks,
              const at::Tensor& logical_blocks, const at::Tensor& group_table_offset,
              const at::Tensor& block_tables, const at::Tensor& group_num_slots,
              const at::Tensor& query, const at::Tensor& head_weights,
              const at::Tensor& row_position, const at::Tensor& row_score_offset,
              const at::Tensor& scores, const std::string& kernel, const std::string& query_prep) {
  constexpr const char* op = "scan";
  const bool tensor_cores = ParseTensorCores(kernel);
  const cuda::ScanQueryPrep prep = ParseQueryPrep(query_prep);
  TORCH_CHECK_VALUE(query.defined() && query.is_cuda(), op,
                    ": argument 'query' must be a CUDA tensor [num_rows, num_heads, head_dim]");
  const at::Device device = query.device();
  CheckFloatTensor(op, "query", query, device, 3);
  const int64_t num_rows = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  TORCH_CHECK_VALUE(num_rows <= INT32_MAX && num_heads >= 1 && head_dim >= 1, op,
                    ": argument 'query' must be [num_rows, num_heads >= 1, head_dim >= 1], got "
                    "shape ",
                    query.sizes());
  CheckPool(op, pool, device, head_dim);
  CheckTensor(op, "group_first_row", group_first_row, device, at::kInt, 1);
  TORCH_CHECK_VALUE(group_first_row.numel() >= 1, op,
                    ": argument 'group_first_row' must have num_groups + 1 >= 1 entries");
  const int64_t num_groups = group_first_row.numel() - 1;
  CheckTensor(op, "group_block_offset", group_block_offset, device, at::kLong, 1);
  CheckLength(op, "group_block_offset", group_block_offset, num_groups + 1, "num_groups + 1");
  TORCH_CHECK_VALUE(total_blocks >= 0, op, ": argument 'total_blocks' must be >= 0, got ",
                    total_blocks);
  CheckTensor(op, "logical_blocks", logical_blocks, device, at::kInt, 1);
  TORCH_CHECK_VALUE(logical_blocks.numel() >= total_blocks, op,
                    ": argument 'logical_blocks' must have at least total_blocks = ", total_blocks,
                    " entries, got ", logical_blocks.numel());
  CheckTensor(op, "group_table_offset", group_table_offset, device, at::kLong, 1);
  CheckLength(op, "group_table_offset", group_table_offset, num_groups, "num_groups");
  CheckTensor(op, "block_tables", block_tables, device, at::kInt, 1);
  CheckTensor(op, "group_num_slots", group_num_slots, device, at::kLong, 1);
  CheckLength(op, "group_num_slots", group_num_slots, num_groups, "num_groups");
  CheckTensor(op, "head_weights", head_weights, device, at::kFloat, 2);
  TORCH_CHECK_VALUE(head_weights.size(0) == num_rows && head_weights.size(1) == num_heads, op,
                    ": argument 'head_weights' must be float32 [num_rows, num_heads] = [", num_rows,
                    ", ", num_heads, "], got shape ", head_weights.sizes());
  CheckTensor(op, "row_position", row_position, device, at::kLong, 1);
  CheckLength(op, "row_position", row_position, num_rows, "num_rows");
  CheckTensor(op, "row_score_offset", row_score_offset, device, at::kLong, 1);
  CheckLength(op, "row_score_offset", row_score_offset, num_rows, "num_rows");
  CheckTensor(op, "scores", scores, device, at::kFloat, -1);

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

  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  const char* why = nullptr;
  if (!tensor_cores) {
    ThrowIfRefused(cuda::CanImplementScanCudaCores(p, &why), "CanImplementScanCudaCores", why);
    ThrowIfFailed(cuda::LaunchScanCudaCores(p, stream), "LaunchScanCudaCores");
    return;
  }
  // The workspace the scratch query asks for, from torch's caching allocator on this stream (it
  // may be freed when this function returns: the allocator reuses it only in stream order).
  const size_t workspace_bytes = cuda::ScanTensorCoresScratchBytes(p);
  at::Tensor workspace;
  if (workspace_bytes > 0 && total_blocks > 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)},
                          at::TensorOptions().dtype(at::kByte).device(device));
    p.workspace = workspace.data_ptr();
    p.workspace_bytes = workspace_bytes;
  }
  ThrowIfRefused(cuda::CanImplementScanTensorCores(p, &why), "CanImplementScanTensorCores", why);
  ThrowIfFailed(cuda::LaunchScanTensorCores(p, stream), "LaunchScanTensorCores");
}

// Bytes of the tensor-core scan's workspace for this launch (what ScanInto allocates).
int64_t ScanWorkspaceBytes(int64_t num_rows, int64_t num_heads, int64_t head_dim,
                           const std::string& kernel, const std::string& query_prep) {
  cuda::ScanParams p;
  p.num_rows = static_cast<int>(num_rows);
  p.num_heads = static_cast<int>(num_heads);
  p.head_dim = static_cast<int>(head_dim);
  p.query_prep = ParseQueryPrep(query_prep);
  return ParseTensorCores(kernel) ? static_cast<int64_t>(cuda::ScanTensorCoresScratchBytes(p))
                                  : static_cast<int64_t>(cuda::ScanCudaCoresScratchBytes(p));
}

// ---- top-K ----------------------------------------------------------------------------------

at::Tensor TopK(const at::Tensor& scores, const at::Tensor& row_score_offset,
                const at::Tensor& row_num_entries, const at::Tensor& row_max_slot, int64_t k,
                const std::optional<at::Tensor>& logical_blocks,
                const std::optional<at::Tensor>& row_block_offset) {
  constexpr const char* op = "topk";
  TORCH_CHECK_VALUE(scores.defined() && scores.is_cuda(), op,
                    ": argument 'scores' must be a CUDA float32 tensor");
  const at::Device device = scores.device();
  CheckTensor(op, "scores", scores, device, at::kFloat, -1);
  CheckTensor(op, "row_offsets", row_score_offset, device, at::kLong, 1);
  const int64_t num_rows = row_score_offset.numel();
  TORCH_CHECK_VALUE(num_rows <= INT32_MAX, op, ": too many rows: ", num_rows);
  CheckTensor(op, "row_num_entries", row_num_entries, device, at::kLong, 1);
  CheckLength(op, "row_num_entries", row_num_entries, num_rows, "num_rows");
  CheckTensor(op, "row_max_slot", row_max_slot, device, at::kLong, 1);
  CheckLength(op, "row_max_slot", row_max_slot, num_rows, "num_rows");
  TORCH_CHECK_VALUE(logical_blocks.has_value() == row_block_offset.has_value(), op,
                    ": arguments 'logical_blocks' and 'row_block_offset' go together: give both "
                    "or neither");
  TORCH_CHECK_VALUE(k >= 1 && k <= cuda::kMaxTopK, op, ": argument 'k' must be in [1, ",
                    cuda::kMaxTopK, "], got ", k);
  cuda::TopKParams p;
  at::Tensor blocks_or_stub;
  if (logical_blocks.has_value()) {
    CheckTensor(op, "logical_blocks", *logical_blocks, device, at::kInt, 1);
    CheckTensor(op, "row_block_offset", *row_block_offset, device, at::kLong, 1);
    CheckLength(op, "row_block_offset", *row_block_offset, num_rows, "num_rows");
    // An empty tensor may have a null data pointer (no row has entries then): a stand-in.
    blocks_or_stub =
        logical_blocks->numel() > 0 ? *logical_blocks : at::empty({1}, logical_blocks->options());
    p.logical_blocks = blocks_or_stub.data_ptr<int32_t>();
    p.row_block_offset = row_block_offset->data_ptr<int64_t>();
  }
  at::Tensor selection =
      at::empty({num_rows, k}, at::TensorOptions().dtype(at::kInt).device(device));
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
  if (num_rows == 0) return selection;
  const char* why = nullptr;
  ThrowIfRefused(cuda::CanImplementTopK(p, &why), "CanImplementTopK", why);
  const c10::cuda::CUDAGuard guard(device);
  ThrowIfFailed(cuda::LaunchTopK(p, at::cuda::getCurrentCUDAStream(device.index()).stream()),
                "LaunchTopK");
  return selection;
}

// ---- SPIN block prediction ------------------------------------------------------------------

// Writes S[j] into `block_scores` and, when `selected` is given, the plan into `selected` and
// `selected_count`. vertical[r] / diagonal[r]: fp32 1-D CUDA tensors (V and D of row r's
// sequence; may be empty).
void SpinPredict(const at::Tensor& positions, const std::vector<at::Tensor>& vertical,
                 const std::vector<at::Tensor>& diagonal, const at::Tensor& row_block_offset,
                 const at::Tensor& block_scores, const std::optional<at::Tensor>& selected,
                 const std::optional<at::Tensor>& selected_count, int64_t top_k,
                 double target_block_sparsity, double exploration_fraction) {
  constexpr const char* op = "spin_plan";
  TORCH_CHECK_VALUE(positions.defined() && positions.is_cuda(), op,
                    ": argument 'positions' must be a CUDA int64 tensor [num_rows]");
  const at::Device device = positions.device();
  CheckTensor(op, "positions", positions, device, at::kLong, 1);
  const int64_t num_rows = positions.numel();
  TORCH_CHECK_VALUE(num_rows <= INT32_MAX, op, ": too many rows: ", num_rows);
  TORCH_CHECK_VALUE(static_cast<int64_t>(vertical.size()) == num_rows &&
                        static_cast<int64_t>(diagonal.size()) == num_rows,
                    op, ": arguments 'vertical' and 'diagonal' must hold one tensor a row (",
                    num_rows, "), got ", vertical.size(), " and ", diagonal.size());
  CheckTensor(op, "row_block_offset", row_block_offset, device, at::kLong, 1);
  CheckLength(op, "row_block_offset", row_block_offset, num_rows, "num_rows");
  CheckTensor(op, "block_scores", block_scores, device, at::kFloat, 1);
  TORCH_CHECK_VALUE(selected.has_value() == selected_count.has_value(), op,
                    ": 'selected' and 'selected_count' go together");
  if (selected.has_value()) {
    CheckTensor(op, "selected", *selected, device, at::kInt, 1);
    TORCH_CHECK_VALUE(selected->numel() >= block_scores.numel(), op,
                      ": argument 'selected' must have as many entries as 'block_scores'");
    CheckTensor(op, "selected_count", *selected_count, device, at::kInt, 1);
    CheckLength(op, "selected_count", *selected_count, num_rows, "num_rows");
  }
  // The per-row pointer and length tables, built on the host and copied to the device.
  at::Tensor pointers = at::empty({2, num_rows}, at::TensorOptions().dtype(at::kLong));
  at::Tensor lengths = at::empty({2, num_rows}, at::TensorOptions().dtype(at::kLong));
  int64_t* ptr = pointers.data_ptr<int64_t>();
  int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r) {
    CheckTensor(op, "vertical[r]", vertical[r], device, at::kFloat, 1);
    CheckTensor(op, "diagonal[r]", diagonal[r], device, at::kFloat, 1);
    ptr[r] = reinterpret_cast<int64_t>(vertical[r].numel() > 0 ? vertical[r].data_ptr() : nullptr);
    ptr[num_rows + r] =
        reinterpret_cast<int64_t>(diagonal[r].numel() > 0 ? diagonal[r].data_ptr() : nullptr);
    len[r] = vertical[r].numel();
    len[num_rows + r] = diagonal[r].numel();
  }
  const c10::cuda::CUDAGuard guard(device);
  // Blocking copies from pageable memory: the tables are on the device before this returns.
  const at::Tensor pointers_device = pointers.to(device);
  const at::Tensor lengths_device = lengths.to(device);

  cuda::SpinPredictParams p;
  p.num_rows = static_cast<int>(num_rows);
  p.positions = positions.data_ptr<int64_t>();
  const auto* table = reinterpret_cast<const float* const*>(pointers_device.data_ptr<int64_t>());
  p.vertical = table;
  p.diagonal = table + num_rows;
  p.vertical_len = lengths_device.data_ptr<int64_t>();
  p.diagonal_len = lengths_device.data_ptr<int64_t>() + num_rows;
  p.row_block_offset = row_block_offset.data_ptr<int64_t>();
  // An empty output (every row with position < 0) may have a null pointer; no entry is written.
  at::Tensor scores_or_stub =
      block_scores.numel() > 0 ? block_scores : at::empty({1}, block_scores.options());
  p.scores = scores_or_stub.data_ptr<float>();
  at::Tensor selected_or_stub;
  if (selected.has_value()) {
    selected_or_stub = selected->numel() > 0 ? *selected : at::empty({1}, selected->options());
    p.selected = selected_or_stub.data_ptr<int32_t>();
    p.selected_count = selected_count->data_ptr<int32_t>();
  }
  TORCH_CHECK_VALUE(top_k >= 0 && top_k <= INT32_MAX, op,
                    ": argument 'top_k' out of range: ", top_k);
  p.top_k = static_cast<int>(top_k);
  p.target_block_sparsity = target_block_sparsity;
  p.exploration_fraction = exploration_fraction;
  const char* why = nullptr;
  ThrowIfRefused(cuda::CanImplementSpinPredict(p, &why), "CanImplementSpinPredict", why);
  ThrowIfFailed(cuda::LaunchSpinPredict(p, at::cuda::getCurrentCUDAStream(device.index()).stream()),
                "LaunchSpinPredict");
  // The tables were allocated on this stream, so the caching allocator reuses their memory only
  // after these kernels, in stream order: nothing more to keep alive.
}

// ---- device info ----------------------------------------------------------------------------

pybind11::dict DeviceInfo(int64_t ordinal) {
  cuda::DeviceInfo info;
  ThrowIfFailed(cuda::GetDeviceInfo(static_cast<int>(ordinal), &info), "GetDeviceInfo");
  pybind11::dict d;
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
  m.doc() = "Bindings of the DSA indexer CUDA kernels (indexer_service/cuda). Use dsa_kernels.";
  m.def("append", &Append, py::arg("pool"), py::arg("block_table"), py::arg("keys"),
        py::arg("first_slot"));
  m.def("scan_into", &ScanInto, py::arg("pool"), py::arg("group_first_row"),
        py::arg("group_block_offset"), py::arg("total_blocks"), py::arg("logical_blocks"),
        py::arg("group_table_offset"), py::arg("block_tables"), py::arg("group_num_slots"),
        py::arg("query"), py::arg("head_weights"), py::arg("row_position"),
        py::arg("row_score_offset"), py::arg("scores"), py::arg("kernel"), py::arg("query_prep"));
  m.def("scan_workspace_bytes", &ScanWorkspaceBytes, py::arg("num_rows"), py::arg("num_heads"),
        py::arg("head_dim"), py::arg("kernel"), py::arg("query_prep"));
  m.def("topk", &TopK, py::arg("scores"), py::arg("row_offsets"), py::arg("row_num_entries"),
        py::arg("row_max_slot"), py::arg("k"), py::arg("logical_blocks") = py::none(),
        py::arg("row_block_offset") = py::none());
  m.def("spin_predict", &SpinPredict, py::arg("positions"), py::arg("vertical"),
        py::arg("diagonal"), py::arg("row_block_offset"), py::arg("block_scores"),
        py::arg("selected"), py::arg("selected_count"), py::arg("top_k"),
        py::arg("target_block_sparsity"), py::arg("exploration_fraction"));
  m.def("device_info", &DeviceInfo, py::arg("ordinal"));
  m.attr("MAX_TOPK") = dsa::cuda::kMaxTopK;
  m.attr("BLOCK_SLOTS") = 64;
}
