// The CUDA scoring device (see cuda_scoring_device.h): setup, the pool mirror, and one upload /
// scan / top-K / download pass per batch of selects; SPIN on the GPU is in
// cuda_scoring_device_spin.cc.
#include "indexer_service/cuda/cuda_scoring_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "indexer_service/cuda/cuda_scoring_device_internal.h"
#include "indexer_service/cuda/device_info.h"
#include "indexer_service/cuda/scan.h"
#include "indexer_service/cuda/topk.h"

namespace dsa::cuda {
namespace scoring_internal {
namespace {

// Whether the tensor-core scan takes a batch of this shape (head_dim, num_heads, the bf16 query):
// the real pointers are set after the layout, so stand-ins take their place for the check.
bool TensorCoresTakeShape(ScanParams shape, const char** why) {
  alignas(16) static uint8_t stand_in[16] = {};
  shape.pool = stand_in;
  shape.group_first_row = reinterpret_cast<const int32_t*>(stand_in);
  shape.group_block_offset = reinterpret_cast<const int64_t*>(stand_in);
  shape.logical_blocks = reinterpret_cast<const int32_t*>(stand_in);
  shape.group_table_offset = reinterpret_cast<const int64_t*>(stand_in);
  shape.block_tables = reinterpret_cast<const int32_t*>(stand_in);
  shape.group_num_slots = reinterpret_cast<const int64_t*>(stand_in);
  shape.query = stand_in;
  shape.head_weights = reinterpret_cast<const float*>(stand_in);
  shape.row_position = reinterpret_cast<const int64_t*>(stand_in);
  shape.row_score_offset = reinterpret_cast<const int64_t*>(stand_in);
  shape.scores = reinterpret_cast<float*>(stand_in);
  shape.workspace = stand_in;
  shape.workspace_bytes = ScanTensorCoresScratchBytes(shape);
  return CanImplementScanTensorCores(shape, why);
}

}  // namespace

CudaScoringDevice::~CudaScoringDevice() {
  cudaSetDevice(options_.device);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (host_registered_) cudaHostUnregister(const_cast<uint8_t*>(host_pool_));
  if (device_pool_ != nullptr) cudaFree(device_pool_);
  for (cudaEvent_t event : events_) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaScoringDevice::Init() {
  DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
  DSA_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
  for (cudaEvent_t& event : events_) {
    DSA_CUDA_RETURN(cudaEventCreate(&event), "event");
  }
  return absl::OkStatus();
}

std::string CudaScoringDevice::Describe() const {
  const char* kernel = options_.scan_kernel == ScanKernel::kTensorCores ? "tensor-core scan"
                       : options_.scan_kernel == ScanKernel::kCudaCores
                           ? "CUDA-core scan"
                           : "tensor-core scan where it applies";
  return absl::StrCat("cuda:", options_.device, " ", info_.name, " (", kernel,
                      options_.spin ? ", SPIN on the GPU)" : ", SPIN on the CPU)");
}

absl::Status CudaScoringDevice::Attach(const BlockPool& pool, int num_heads) {
  DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
  head_dim_ = pool.head_dim();
  // The scan kernel, decided once for the model's shape.
  ScanParams shape;
  shape.head_dim = head_dim_;
  shape.num_heads = num_heads;
  shape.num_groups = 1;
  shape.num_rows = 1;
  shape.total_blocks = 1;
  shape.query_dtype = QueryDtype::kBFloat16;
  const char* why = "";
  tensor_cores_ =
      options_.scan_kernel != ScanKernel::kCudaCores && TensorCoresTakeShape(shape, &why);
  if (options_.scan_kernel == ScanKernel::kTensorCores && !tensor_cores_) {
    return absl::FailedPreconditionError(absl::StrCat("the tensor-core scan cannot run H ",
                                                      num_heads, " x D ", head_dim_, ": ", why,
                                                      " (--scan-kernel auto or cuda-cores can)"));
  }
  block_bytes_ = pool.block_bytes();
  capacity_blocks_ = pool.capacity_blocks();
  if (capacity_blocks_ == 0) return absl::OkStatus();
  host_pool_ = pool.keys(0);
  const size_t bytes = block_bytes_ * static_cast<size_t>(capacity_blocks_);
  if (const cudaError_t error = cudaMalloc(reinterpret_cast<void**>(&device_pool_), bytes);
      error != cudaSuccess) {
    device_pool_ = nullptr;
    return CudaError(
        error, absl::StrCat("allocating the ", bytes, "-byte index-key pool on the GPU").c_str());
  }
  // Page-locking the host pool makes the mirror copies direct; without it they are staged.
  host_registered_ = cudaHostRegister(const_cast<uint8_t*>(host_pool_), bytes,
                                      cudaHostRegisterDefault) == cudaSuccess;
  if (!host_registered_) cudaGetLastError();  // clear the error: pageable copies still work
  return absl::OkStatus();
}

absl::Status CudaScoringDevice::MirrorBlocks(std::span<const int32_t> block_ids) {
  if (block_ids.empty()) return absl::OkStatus();
  DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
  std::vector<int32_t> ids(block_ids.begin(), block_ids.end());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  for (size_t i = 0; i < ids.size();) {
    size_t j = i + 1;
    while (j < ids.size() && ids[j] == ids[j - 1] + 1) ++j;  // one copy per run of blocks
    const size_t offset = block_bytes_ * static_cast<size_t>(ids[i]);
    DSA_CUDA_RETURN(cudaMemcpyAsync(device_pool_ + offset, host_pool_ + offset,
                                    block_bytes_ * (j - i), cudaMemcpyHostToDevice, stream_),
                    "mirroring pool blocks");
    i = j;
  }
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "mirroring pool blocks");
  return absl::OkStatus();
}

absl::Status CudaScoringDevice::ScoreAndSelect(std::span<const DeviceScoreJob> jobs, int num_heads,
                                               DeviceScoreSeconds* seconds) {
  if (jobs.empty()) return absl::OkStatus();
  for (const DeviceScoreJob& job : jobs) {
    if (job.top_k > kMaxTopK) {
      return absl::UnimplementedError(
          absl::StrCat("K ", job.top_k, " is above the GPU top-K's largest, ", kMaxTopK));
    }
  }
  DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
  // Sizes of the batch.
  const int num_groups = static_cast<int>(jobs.size());
  int64_t num_rows = 0, total_blocks = 0, table_entries = 0, score_entries = 0,
          selection_entries = 0;
  bool want_scores = false;
  for (const DeviceScoreJob& job : jobs) {
    const auto rows = static_cast<int64_t>(job.rows.size());
    const auto blocks = static_cast<int64_t>(job.logical_blocks.size());
    num_rows += rows;
    total_blocks += blocks;
    table_entries += static_cast<int64_t>(job.view->block_table.size());
    score_entries += rows * blocks * kBlockSize;
    selection_entries += rows * job.top_k;
    want_scores = want_scores || !job.scores.empty();
  }
  if (num_rows == 0) return absl::OkStatus();
  // The scan kernel: the tensor-core one where asked and possible.
  ScanParams scan;
  scan.head_dim = head_dim_;
  scan.num_heads = num_heads;
  scan.num_groups = num_groups;
  scan.num_rows = static_cast<int>(num_rows);
  scan.total_blocks = total_blocks;
  scan.query_dtype = QueryDtype::kBFloat16;
  const char* why = "";
  bool tensor_cores = tensor_cores_;
  for (const DeviceScoreJob& job : jobs)
    tensor_cores = tensor_cores && QueriesFitBfloat16(job.rows);
  if (!tensor_cores) scan.query_dtype = QueryDtype::kFloat32;
  const size_t query_bytes = tensor_cores ? 2 : 4;
  const size_t query_values = static_cast<size_t>(num_heads) * head_dim_;

  // Layout and fill of the one upload.
  BatchLayout at;
  size_t cursor = 0;
  at.group_first_row = Take(cursor, sizeof(int32_t) * (num_groups + 1));
  at.group_block_offset = Take(cursor, sizeof(int64_t) * (num_groups + 1));
  at.logical_blocks = Take(cursor, sizeof(int32_t) * total_blocks);
  at.group_table_offset = Take(cursor, sizeof(int64_t) * num_groups);
  at.block_tables = Take(cursor, sizeof(int32_t) * table_entries);
  at.group_num_slots = Take(cursor, sizeof(int64_t) * num_groups);
  at.query = Take(cursor, query_bytes * query_values * num_rows);
  at.head_weights = Take(cursor, sizeof(float) * num_heads * num_rows);
  at.row_position = Take(cursor, sizeof(int64_t) * num_rows);
  at.row_score_offset = Take(cursor, sizeof(int64_t) * num_rows);
  at.row_num_entries = Take(cursor, sizeof(int64_t) * num_rows);
  at.row_block_offset = Take(cursor, sizeof(int64_t) * num_rows);
  at.total = cursor;
  DSA_RETURN_IF_ERROR(upload_.Reserve(at.total, "pinned upload buffer"));
  DSA_RETURN_IF_ERROR(batch_.Reserve(at.total, "device batch buffer"));
  {
    auto* group_first_row = upload_.as<int32_t>(at.group_first_row);
    auto* group_block_offset = upload_.as<int64_t>(at.group_block_offset);
    auto* logical_blocks = upload_.as<int32_t>(at.logical_blocks);
    auto* group_table_offset = upload_.as<int64_t>(at.group_table_offset);
    auto* block_tables = upload_.as<int32_t>(at.block_tables);
    auto* group_num_slots = upload_.as<int64_t>(at.group_num_slots);
    auto* row_position = upload_.as<int64_t>(at.row_position);
    auto* row_score_offset = upload_.as<int64_t>(at.row_score_offset);
    auto* row_num_entries = upload_.as<int64_t>(at.row_num_entries);
    auto* row_block_offset = upload_.as<int64_t>(at.row_block_offset);
    int64_t row = 0, block = 0, table = 0, score = 0;
    for (int g = 0; g < num_groups; ++g) {
      const DeviceScoreJob& job = jobs[g];
      const auto blocks = static_cast<int64_t>(job.logical_blocks.size());
      group_first_row[g] = static_cast<int32_t>(row);
      group_block_offset[g] = block;
      group_table_offset[g] = table;
      group_num_slots[g] = job.view->num_slots;
      std::memcpy(logical_blocks + block, job.logical_blocks.data(), sizeof(int32_t) * blocks);
      std::memcpy(block_tables + table, job.view->block_table.data(),
                  sizeof(int32_t) * job.view->block_table.size());
      for (const IndexerRow& r : job.rows) {
        WriteRow(r, row, tensor_cores, num_heads, at.query, at.head_weights);
        row_position[row] = r.position;
        row_score_offset[row] = score;
        row_num_entries[row] = blocks * kBlockSize;
        row_block_offset[row] = block;
        score += blocks * kBlockSize;
        ++row;
      }
      block += blocks;
      table += static_cast<int64_t>(job.view->block_table.size());
    }
    group_first_row[num_groups] = static_cast<int32_t>(row);
    group_block_offset[num_groups] = block;
  }
  DSA_RETURN_IF_ERROR(
      scores_.Reserve(sizeof(float) * std::max<int64_t>(score_entries, 1), "device score buffer"));
  DSA_RETURN_IF_ERROR(
      selections_.Reserve(sizeof(int32_t) * selection_entries, "device selection buffer"));
  const size_t download_bytes =
      sizeof(int32_t) * selection_entries + (want_scores ? sizeof(float) * score_entries : 0);
  DSA_RETURN_IF_ERROR(download_.Reserve(download_bytes, "pinned download buffer"));

  scan.pool = device_pool_;
  scan.group_first_row = batch_.as<int32_t>(at.group_first_row);
  scan.group_block_offset = batch_.as<int64_t>(at.group_block_offset);
  scan.logical_blocks = batch_.as<int32_t>(at.logical_blocks);
  scan.group_table_offset = batch_.as<int64_t>(at.group_table_offset);
  scan.block_tables = batch_.as<int32_t>(at.block_tables);
  scan.group_num_slots = batch_.as<int64_t>(at.group_num_slots);
  scan.query = batch_.as<void>(at.query);
  scan.head_weights = batch_.as<float>(at.head_weights);
  scan.row_position = batch_.as<int64_t>(at.row_position);
  scan.row_score_offset = batch_.as<int64_t>(at.row_score_offset);
  scan.scores = scores_.as<float>();
  if (tensor_cores) {
    scan.workspace_bytes = ScanTensorCoresScratchBytes(scan);
    DSA_RETURN_IF_ERROR(workspace_.Reserve(scan.workspace_bytes, "scan workspace"));
    scan.workspace = workspace_.as<void>();
  }
  if (!(tensor_cores ? CanImplementScanTensorCores(scan, &why)
                     : CanImplementScanCudaCores(scan, &why))) {
    return absl::InternalError(absl::StrCat("the scan refused the batch: ", why));
  }

  // One top-K launch per run of consecutive jobs with the same K, all checked before anything
  // is launched (a refusal then leaves the device idle).
  std::vector<TopKParams> topks;
  int64_t first_row = 0, selection_offset = 0;
  for (int g = 0; g < num_groups;) {
    int h = g;
    int64_t rows = 0;
    while (h < num_groups && jobs[h].top_k == jobs[g].top_k) {
      rows += static_cast<int64_t>(jobs[h].rows.size());
      ++h;
    }
    TopKParams topk;
    topk.scores = scores_.as<float>();
    topk.num_rows = static_cast<int>(rows);
    topk.row_score_offset = batch_.as<int64_t>(at.row_score_offset) + first_row;
    topk.row_num_entries = batch_.as<int64_t>(at.row_num_entries) + first_row;
    topk.logical_blocks = batch_.as<int32_t>(at.logical_blocks);
    topk.row_block_offset = batch_.as<int64_t>(at.row_block_offset) + first_row;
    topk.row_max_slot = batch_.as<int64_t>(at.row_position) + first_row;
    const int64_t* entries = upload_.as<int64_t>(at.row_num_entries) + first_row;
    topk.max_row_entries = rows == 0 ? 0 : *std::max_element(entries, entries + rows);
    topk.k = jobs[g].top_k;
    topk.selection = selections_.as<int32_t>() + selection_offset;
    if (!CanImplementTopK(topk, &why)) {
      return absl::UnimplementedError(absl::StrCat("the GPU top-K cannot take it: ", why));
    }
    topks.push_back(topk);
    first_row += rows;
    selection_offset += rows * jobs[g].top_k;
    g = h;
  }

  DSA_CUDA_RETURN(cudaMemcpyAsync(batch_.as<void>(), upload_.as<void>(), at.total,
                                  cudaMemcpyHostToDevice, stream_),
                  "uploading the batch");
  DSA_CUDA_RETURN(cudaEventRecord(events_[0], stream_), "event");
  DSA_CUDA_RETURN(
      tensor_cores ? LaunchScanTensorCores(scan, stream_) : LaunchScanCudaCores(scan, stream_),
      "launching the scan");
  DSA_CUDA_RETURN(cudaEventRecord(events_[1], stream_), "event");
  for (const TopKParams& topk : topks) {
    DSA_CUDA_RETURN(LaunchTopK(topk, stream_), "launching the top-K");
  }
  DSA_CUDA_RETURN(cudaEventRecord(events_[2], stream_), "event");
  DSA_CUDA_RETURN(
      cudaMemcpyAsync(download_.as<void>(), selections_.as<void>(),
                      sizeof(int32_t) * selection_entries, cudaMemcpyDeviceToHost, stream_),
      "downloading the selections");
  const size_t scores_at = sizeof(int32_t) * selection_entries;
  if (want_scores) {
    DSA_CUDA_RETURN(cudaMemcpyAsync(download_.as<uint8_t>(scores_at), scores_.as<void>(),
                                    sizeof(float) * score_entries, cudaMemcpyDeviceToHost, stream_),
                    "downloading the scores");
  }
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "running the select batch");
  float scan_ms = 0, topk_ms = 0;
  DSA_CUDA_RETURN(cudaEventElapsedTime(&scan_ms, events_[0], events_[1]), "event time");
  DSA_CUDA_RETURN(cudaEventElapsedTime(&topk_ms, events_[1], events_[2]), "event time");
  seconds->scan = scan_ms * 1e-3;
  seconds->topk = topk_ms * 1e-3;
  seconds->scan_kernel = tensor_cores ? "tensor-cores" : "cuda-cores";
  int64_t selection = 0, score = 0;
  for (const DeviceScoreJob& job : jobs) {
    const auto entries = static_cast<int64_t>(job.rows.size()) * job.top_k;
    std::memcpy(job.selections.data(), download_.as<int32_t>() + selection,
                sizeof(int32_t) * entries);
    selection += entries;
    const auto job_scores = static_cast<int64_t>(job.rows.size()) *
                            static_cast<int64_t>(job.logical_blocks.size()) * kBlockSize;
    if (!job.scores.empty()) {
      std::memcpy(job.scores.data(), download_.as<float>(scores_at) + score,
                  sizeof(float) * job_scores);
    }
    score += job_scores;
  }
  return absl::OkStatus();
}

}  // namespace scoring_internal

using scoring_internal::CudaError;
using scoring_internal::CudaScoringDevice;

absl::Status ParseScanKernel(const std::string& name, ScanKernel* out) {
  if (name == "auto") {
    *out = ScanKernel::kAuto;
  } else if (name == "tensor-cores") {
    *out = ScanKernel::kTensorCores;
  } else if (name == "cuda-cores") {
    *out = ScanKernel::kCudaCores;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("scan kernel must be auto, tensor-cores or cuda-cores, got \"", name, "\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ScoringDevice>> CreateCudaScoringDevice(
    const CudaScoringOptions& options) {
  int count = 0;
  DSA_CUDA_RETURN(CountDevices(&count), "counting GPUs");
  if (count == 0) return absl::FailedPreconditionError("no CUDA GPU is visible");
  if (options.device < 0 || options.device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", options.device, " out of range: ", count, " visible"));
  }
  DeviceInfo info;
  DSA_CUDA_RETURN(GetDeviceInfo(options.device, &info), "reading the GPU's properties");
  if (!CanRunIndexerKernels(info)) {
    return absl::FailedPreconditionError(
        absl::StrCat("GPU ", options.device, " (", info.name, ", sm_", info.sm_major, info.sm_minor,
                     ") cannot run the indexer kernels, built for sm_90a"));
  }
  auto device = std::make_unique<CudaScoringDevice>(options, info);
  if (auto s = device->Init(); !s.ok()) return s;
  return std::unique_ptr<ScoringDevice>(std::move(device));
}

}  // namespace dsa::cuda
