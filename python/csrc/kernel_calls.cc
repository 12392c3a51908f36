// The torch-free half of the dsa_kernels bindings: kernel_calls.h.
#include "python/csrc/kernel_calls.h"

#include <climits>
#include <cstdint>
#include <functional>
#include <string>

#include "indexer_service/cuda/device_info.h"
#include "indexer_service/cuda/key_append.h"
#include "indexer_service/cuda/scan.h"
#include "indexer_service/cuda/spin_predict.h"
#include "indexer_service/cuda/topk.h"

namespace dsa::python {
namespace {

Result Refused(const char* check, const char* why) {
  return ArgumentError(Cat(check, " refused the launch: ", why != nullptr ? why : "(no reason)"));
}

Result LaunchResult(cudaError_t e, const char* launch) {
  if (e == cudaSuccess) return Ok();
  return {kRuntimeError,
          Cat(launch, " failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e))};
}

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

}  // namespace

Result CallAppend(const AppendArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "append";
  if (a.first_slot < 0) {
    return ArgumentError(Cat(kOp, ": argument 'first_slot' must be >= 0, got ", a.first_slot));
  }
  const int64_t blocks_needed = (a.first_slot + a.num_keys + kBlockSize - 1) / kBlockSize;
  if (a.num_keys > 0 && a.block_table_entries < blocks_needed) {
    return ArgumentError(Cat(kOp,
                             ": argument 'block_table' must have at least ceil((first_slot + "
                             "num_keys) / 64) = ",
                             blocks_needed, " entries, got ", a.block_table_entries));
  }
  cuda::AppendParams p;
  p.keys = a.keys;
  p.keys_dtype = a.keys_bf16 ? cuda::KeyDtype::kBFloat16 : cuda::KeyDtype::kFloat32;
  p.num_keys = a.num_keys;
  p.head_dim = static_cast<int>(a.head_dim);
  p.block_table = a.block_table;
  p.first_slot = a.first_slot;
  p.pool = a.pool;
  const char* why = nullptr;
  if (!cuda::CanImplementAppend(p, &why)) return Refused("CanImplementAppend", why);
  return LaunchResult(cuda::LaunchAppend(p, stream), "LaunchAppend");
}

namespace {

Result ParseKernel(const std::string& kernel, bool* tensor_cores) {
  if (kernel != "tensor_cores" && kernel != "cuda_cores") {
    return ArgumentError(
        Cat("scan: argument 'kernel' must be \"tensor_cores\" or \"cuda_cores\", got \"", kernel,
            "\""));
  }
  *tensor_cores = kernel == "tensor_cores";
  return Ok();
}

}  // namespace

Result CheckScanOptions(const std::string& kernel, const std::string& query_prep) {
  bool tensor_cores = false;
  DSA_RETURN_IF_ERROR(ParseKernel(kernel, &tensor_cores));
  cuda::ScanQueryPrep prep = cuda::ScanQueryPrep::kAuto;
  return ParseQueryPrep(query_prep, &prep);
}

Result CallScan(const ScanArgs& a, const std::function<void*(size_t)>& allocate_workspace,
                cudaStream_t stream) {
  bool tensor_cores = false;
  DSA_RETURN_IF_ERROR(ParseKernel(a.kernel, &tensor_cores));
  cuda::ScanParams p;
  DSA_RETURN_IF_ERROR(ParseQueryPrep(a.query_prep, &p.query_prep));
  if (a.total_blocks < 0) {
    return ArgumentError(Cat("scan: argument 'total_blocks' must be >= 0, got ", a.total_blocks));
  }
  p.pool = a.pool;
  p.head_dim = static_cast<int>(a.head_dim);
  p.num_heads = static_cast<int>(a.num_heads);
  p.num_groups = static_cast<int>(a.num_groups);
  p.num_rows = static_cast<int>(a.num_rows);
  p.group_first_row = a.group_first_row;
  p.group_block_offset = a.group_block_offset;
  p.total_blocks = a.total_blocks;
  p.logical_blocks = a.logical_blocks;
  p.group_table_offset = a.group_table_offset;
  p.block_tables = a.block_tables;
  p.group_num_slots = a.group_num_slots;
  p.query = a.query;
  p.query_dtype = a.query_bf16 ? cuda::QueryDtype::kBFloat16 : cuda::QueryDtype::kFloat32;
  p.head_weights = a.head_weights;
  p.row_position = a.row_position;
  p.row_score_offset = a.row_score_offset;
  p.scores = a.scores;
  const char* why = nullptr;
  if (!tensor_cores) {
    if (!cuda::CanImplementScanCudaCores(p, &why)) return Refused("CanImplementScanCudaCores", why);
    return LaunchResult(cuda::LaunchScanCudaCores(p, stream), "LaunchScanCudaCores");
  }
  const size_t workspace_bytes = cuda::ScanTensorCoresScratchBytes(p);
  if (workspace_bytes > 0 && a.total_blocks > 0) {
    p.workspace = allocate_workspace(workspace_bytes);
    p.workspace_bytes = workspace_bytes;
  }
  if (!cuda::CanImplementScanTensorCores(p, &why)) {
    return Refused("CanImplementScanTensorCores", why);
  }
  return LaunchResult(cuda::LaunchScanTensorCores(p, stream), "LaunchScanTensorCores");
}

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

Result CheckTopKK(int64_t k) {
  if (k < 1 || k > kMaxTopK) {
    return ArgumentError(Cat("topk: argument 'k' must be in [1, ", kMaxTopK, "], got ", k));
  }
  return Ok();
}

Result CallTopK(const TopKArgs& a, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(CheckTopKK(a.k));
  if (a.max_row_entries < 0) {
    return ArgumentError(Cat("topk: argument 'max_row_entries' must be >= 0 (0: no bound), got ",
                             a.max_row_entries));
  }
  if (a.num_rows == 0) return Ok();
  cuda::TopKParams p;
  p.scores = a.scores;
  p.num_rows = static_cast<int>(a.num_rows);
  p.row_score_offset = a.row_score_offset;
  p.row_num_entries = a.row_num_entries;
  p.logical_blocks = a.logical_blocks;
  p.row_block_offset = a.row_block_offset;
  p.row_max_slot = a.row_max_slot;
  p.k = static_cast<int>(a.k);
  p.selection = a.selection;
  p.max_row_entries = a.max_row_entries;
  const char* why = nullptr;
  if (!cuda::CanImplementTopK(p, &why)) return Refused("CanImplementTopK", why);
  return LaunchResult(cuda::LaunchTopK(p, stream), "LaunchTopK");
}

namespace {

cuda::SpinPredictParams SpinParams(const SpinArgs& a) {
  cuda::SpinPredictParams p;
  p.num_rows = static_cast<int>(a.num_rows);
  p.top_k = static_cast<int>(a.top_k);
  p.target_block_sparsity = a.target_block_sparsity;
  p.exploration_fraction = a.exploration_fraction;
  p.positions = a.positions;
  p.row_block_offset = a.row_block_offset;
  p.scores = a.block_scores;
  p.selected = a.selected;
  p.selected_count = a.selected_count;
  p.vertical = a.vertical;
  p.diagonal = a.diagonal;
  p.vertical_len = a.vertical_len;
  p.diagonal_len = a.diagonal_len;
  return p;
}

}  // namespace

Result CheckSpinTopK(int64_t top_k) {
  if (top_k < 0 || top_k > INT32_MAX) {
    return ArgumentError(Cat("spin_plan: argument 'top_k' out of range: ", top_k));
  }
  return Ok();
}

Result CheckSpin(const SpinArgs& a) {
  DSA_RETURN_IF_ERROR(CheckSpinTopK(a.top_k));
  const char* why = nullptr;
  if (!cuda::CanImplementSpinPredict(SpinParams(a), &why)) {
    return Refused("CanImplementSpinPredict", why);
  }
  return Ok();
}

Result CallSpin(const SpinArgs& a, cudaStream_t stream) {
  return LaunchResult(cuda::LaunchSpinPredict(SpinParams(a), stream), "LaunchSpinPredict");
}

DeviceFacts GetDeviceFacts(int ordinal) {
  DeviceFacts facts;
  cuda::DeviceInfo info;
  const cudaError_t e = cuda::GetDeviceInfo(ordinal, &info);
  if (e != cudaSuccess) {
    facts.error = Cat("GetDeviceInfo failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
    return facts;
  }
  facts.ordinal = info.ordinal;
  facts.name = info.name;
  facts.sm_major = info.sm_major;
  facts.sm_minor = info.sm_minor;
  facts.num_sms = info.num_sms;
  facts.global_memory_bytes = static_cast<int64_t>(info.global_memory_bytes);
  facts.can_run_indexer_kernels = cuda::CanRunIndexerKernels(info);
  return facts;
}

}  // namespace dsa::python
