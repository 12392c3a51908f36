// The CUDA scoring device (see cuda_scoring_device.h).
#include "indexer_service/cuda/cuda_scoring_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "indexer_service/cuda/device_info.h"
#include "indexer_service/cuda/query_stage.h"
#include "indexer_service/cuda/scan.h"
#include "indexer_service/cuda/select.h"
#include "indexer_service/cuda/spin_update.h"
#include "indexer_service/cuda/topk.h"

namespace dsa::cuda {
namespace {

absl::Status CudaError(cudaError_t error, const char* what) {
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

#define DSA_CUDA_RETURN(expr, what)             \
  do {                                          \
    const cudaError_t dsa_cuda_error = (expr);  \
    if (dsa_cuda_error != cudaSuccess) {        \
      return CudaError(dsa_cuda_error, (what)); \
    }                                           \
  } while (false)

// A growable allocation (contents not kept on growth), twice as large at each growth: device
// memory (cudaMalloc) or page-locked host memory (cudaMallocHost, so copies run asynchronously at
// full speed).
template <cudaError_t (*Allocate)(void**, size_t), cudaError_t (*Free)(void*)>
class GrowableBuffer {
 public:
  GrowableBuffer() = default;
  GrowableBuffer(const GrowableBuffer&) = delete;
  GrowableBuffer& operator=(const GrowableBuffer&) = delete;
  GrowableBuffer(GrowableBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  GrowableBuffer& operator=(GrowableBuffer&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~GrowableBuffer() {
    if (ptr_ != nullptr) Free(ptr_);
  }
  absl::Status Reserve(size_t bytes, const char* what) {
    if (bytes <= bytes_) return absl::OkStatus();
    const size_t grown = std::max(bytes, bytes_ * 2);
    if (ptr_ != nullptr) Free(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
    DSA_CUDA_RETURN(Allocate(&ptr_, grown), what);
    bytes_ = grown;
    return absl::OkStatus();
  }
  template <typename T>
  T* as(size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<uint8_t*>(ptr_) + byte_offset);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

cudaError_t DeviceAllocate(void** ptr, size_t bytes) { return cudaMalloc(ptr, bytes); }
cudaError_t HostAllocate(void** ptr, size_t bytes) { return cudaMallocHost(ptr, bytes); }
using DeviceBuffer = GrowableBuffer<DeviceAllocate, cudaFree>;
using PinnedBuffer = GrowableBuffer<HostAllocate, cudaFreeHost>;

// Byte offsets of the batch's arrays in one upload, each 16-byte aligned.
struct BatchLayout {
  size_t group_first_row = 0, group_block_offset = 0, logical_blocks = 0, group_table_offset = 0,
         block_tables = 0, group_num_slots = 0, query = 0, head_weights = 0, row_position = 0,
         row_score_offset = 0, row_num_entries = 0, row_block_offset = 0, total = 0;
};

size_t Take(size_t& cursor, size_t bytes) {
  const size_t at = cursor;
  cursor = (cursor + bytes + 15) / 16 * 16;
  return at;
}

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

// Whether every query value rounds to a finite bf16 (|x| below bf16's largest plus half an ulp).
// A larger one would turn infinite in the tensor-core scan while the CPU's fp32 stays finite, so
// such a batch runs the CUDA-core scan.
bool QueriesFitBfloat16(std::span<const IndexerRow> rows) {
  for (const IndexerRow& row : rows) {
    for (float q : row.query) {
      if ((std::bit_cast<uint32_t>(q) & 0x7fffffffu) >= 0x7f7f8000u) return false;
    }
  }
  return true;
}

// fp32 -> bf16 bits, round to nearest even (finite inputs: the Indexer refuses others).
uint16_t ToBfloat16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

class CudaScoringDevice final : public ScoringDevice {
 public:
  CudaScoringDevice(const CudaScoringOptions& options, const DeviceInfo& info)
      : options_(options), info_(info) {}

  ~CudaScoringDevice() override {
    cudaSetDevice(options_.device);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (host_registered_) cudaHostUnregister(const_cast<uint8_t*>(host_pool_));
    if (device_pool_ != nullptr) cudaFree(device_pool_);
    for (cudaEvent_t event : events_) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
    DSA_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    for (cudaEvent_t& event : events_) {
      DSA_CUDA_RETURN(cudaEventCreate(&event), "event");
    }
    return absl::OkStatus();
  }

  int device_ordinal() const override { return options_.device; }

  std::string Describe() const override {
    const char* kernel = options_.scan_kernel == ScanKernel::kTensorCores ? "tensor-core scan"
                         : options_.scan_kernel == ScanKernel::kCudaCores
                             ? "CUDA-core scan"
                             : "tensor-core scan where it applies";
    return absl::StrCat("cuda:", options_.device, " ", info_.name, " (", kernel,
                        options_.spin ? ", SPIN on the GPU)" : ", SPIN on the CPU)");
  }

  absl::Status Attach(const BlockPool& pool, int num_heads) override {
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

  absl::Status MirrorBlocks(std::span<const int32_t> block_ids) override {
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

  absl::Status ScoreAndSelect(std::span<const DeviceScoreJob> jobs, int num_heads,
                              DeviceScoreSeconds* seconds) override {
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
    DSA_RETURN_IF_ERROR(scores_.Reserve(sizeof(float) * std::max<int64_t>(score_entries, 1),
                                        "device score buffer"));
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
      DSA_CUDA_RETURN(
          cudaMemcpyAsync(download_.as<uint8_t>(scores_at), scores_.as<void>(),
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

  // ---- SPIN on the GPU: V and D resident, the whole select of select.h ----

  bool RunsSpin(const SpinConfig& config, int top_k) const override {
    return options_.spin && top_k <= kMaxTopK && config.pooling == BlockPooling::kMax &&
           config.reduction == BlockReduction::kA1 &&
           config.exploration == ExplorationPolicy::kRandom &&
           config.spec_mask == SpecMaskPolicy::kRowLocalUnion;
  }

  absl::Status SelectWithSpin(std::span<const DeviceSpinJob> jobs, int num_heads,
                              DeviceScoreSeconds* seconds) override {
    DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
    // One launch per run of jobs sharing the launch-wide settings (layer, rho, gamma, a, K).
    auto same_launch = [](const DeviceSpinJob& a, const DeviceSpinJob& b) {
      return a.layer == b.layer && a.top_k == b.top_k &&
             a.config->target_block_sparsity == b.config->target_block_sparsity &&
             a.config->exploration_fraction == b.config->exploration_fraction &&
             a.config->ema_decay == b.config->ema_decay;
    };
    std::vector<bool> done(jobs.size(), false);
    std::vector<std::vector<const DeviceSpinJob*>> launches;
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (done[i]) continue;
      std::vector<const DeviceSpinJob*> launch;
      for (size_t j = i; j < jobs.size(); ++j) {
        if (!done[j] && same_launch(jobs[i], jobs[j])) {
          launch.push_back(&jobs[j]);
          done[j] = true;
        }
      }
      launches.push_back(std::move(launch));
    }
    // The device-resident path: the producer's queries must be written before the first launch
    // stages them; the last launch records the handoff's event.
    const DeviceHandoff* handoff = jobs.empty() ? nullptr : jobs[0].handoff;
    if (handoff != nullptr && handoff->inputs_ready != nullptr) {
      DSA_CUDA_RETURN(
          cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(handoff->inputs_ready), 0),
          "waiting for the device queries");
    }
    double total_ms = 0;
    for (size_t i = 0; i < launches.size(); ++i) {
      float ms = 0;
      DSA_RETURN_IF_ERROR(
          SelectLaunch(launches[i], num_heads, &ms, i + 1 == launches.size() ? handoff : nullptr));
      total_ms += ms;
    }
    seconds->scan = total_ms * 1e-3;
    seconds->topk = 0;
    seconds->scan_kernel = last_scan_kernel_;
    return absl::OkStatus();
  }

  absl::Status CommitSpin(uint64_t sequence_id, int layer, int replay_rows) override {
    SpinSlot* found = FindSlot(sequence_id, layer);
    if (found == nullptr || found->pending_positions.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no verifier step of sequence ", sequence_id, " layer ", layer, " on the GPU"));
    }
    SpinSlot& slot = *found;
    DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
    const int rows = std::min<int>(replay_rows, static_cast<int>(slot.pending_positions.size()));
    if (rows > 0) {
      // The replay's small arrays in one upload: first rows, block offsets, positions, score
      // offsets and the V / D pointers.
      size_t cursor = 0;
      const size_t at_first = Take(cursor, 2 * sizeof(int32_t));
      const size_t at_offset = Take(cursor, 2 * sizeof(int64_t));
      const size_t at_position = Take(cursor, rows * sizeof(int64_t));
      const size_t at_score = Take(cursor, rows * sizeof(int64_t));
      const size_t at_vertical = Take(cursor, sizeof(float*));
      const size_t at_diagonal = Take(cursor, sizeof(float*));
      DSA_RETURN_IF_ERROR(upload_.Reserve(cursor, "pinned upload buffer"));
      DSA_RETURN_IF_ERROR(batch_.Reserve(cursor, "device batch buffer"));
      upload_.as<int32_t>(at_first)[0] = 0;
      upload_.as<int32_t>(at_first)[1] = rows;
      upload_.as<int64_t>(at_offset)[0] = 0;
      upload_.as<int64_t>(at_offset)[1] = slot.pending_num_blocks;
      int64_t end_slot = 0;
      for (int r = 0; r < rows; ++r) {
        upload_.as<int64_t>(at_position)[r] = slot.pending_positions[r];
        upload_.as<int64_t>(at_score)[r] = r * slot.pending_num_blocks * kBlockSize;
        end_slot = std::max(end_slot, slot.pending_positions[r] + 1);
      }
      *upload_.as<float*>(at_vertical) = slot.vertical.as<float>();
      *upload_.as<float*>(at_diagonal) = slot.diagonal.as<float>();
      DSA_CUDA_RETURN(cudaMemcpyAsync(batch_.as<void>(), upload_.as<void>(), cursor,
                                      cudaMemcpyHostToDevice, stream_),
                      "uploading the replay");
      SpinUpdateParams update;
      update.num_groups = 1;
      update.num_rows = rows;
      update.group_first_row = batch_.as<int32_t>(at_first);
      update.group_block_offset = batch_.as<int64_t>(at_offset);
      update.logical_blocks = slot.pending_blocks.as<int32_t>();
      update.row_position = batch_.as<int64_t>(at_position);
      update.row_score_offset = batch_.as<int64_t>(at_score);
      update.scores = slot.pending_scores.as<float>();
      update.vertical = batch_.as<float* const>(at_vertical);
      update.diagonal = batch_.as<float* const>(at_diagonal);
      update.ema_decay = slot.ema_decay;
      update.max_visible_slots = end_slot;
      DSA_CUDA_RETURN(LaunchSpinUpdate(update, stream_), "launching the deferred update");
      DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "the deferred update");
      slot.used = std::max(slot.used, end_slot);
    }
    slot.pending_positions.clear();
    return absl::OkStatus();
  }

  absl::Status ResetSpin(uint64_t sequence_id) override {
    DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
    auto layers = spin_.find(sequence_id);
    if (layers == spin_.end()) return absl::OkStatus();
    for (SpinSlot& slot : layers->second) {
      if (slot.capacity == 0) continue;
      DSA_CUDA_RETURN(
          cudaMemsetAsync(slot.vertical.as<void>(), 0, sizeof(float) * slot.capacity, stream_),
          "zeroing V");
      DSA_CUDA_RETURN(
          cudaMemsetAsync(slot.diagonal.as<void>(), 0, sizeof(float) * slot.capacity, stream_),
          "zeroing D");
    }
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "zeroing the EMAs");
    return absl::OkStatus();
  }

  void ReleaseSpin(uint64_t sequence_id) override {
    cudaSetDevice(options_.device);
    spin_.erase(sequence_id);
  }

  absl::Status ReadSpin(uint64_t sequence_id, int layer, std::vector<float>* vertical,
                        std::vector<float>* diagonal) override {
    const SpinSlot* found = FindSlot(sequence_id, layer);
    if (found == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("no SPIN state of sequence ", sequence_id, " layer ", layer, " on the GPU"));
    }
    DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
    const SpinSlot& slot = *found;
    vertical->resize(slot.used);
    diagonal->resize(slot.used);
    if (slot.used > 0) {
      DSA_CUDA_RETURN(cudaMemcpyAsync(vertical->data(), slot.vertical.as<void>(),
                                      sizeof(float) * slot.used, cudaMemcpyDeviceToHost, stream_),
                      "reading V");
      DSA_CUDA_RETURN(cudaMemcpyAsync(diagonal->data(), slot.diagonal.as<void>(),
                                      sizeof(float) * slot.used, cudaMemcpyDeviceToHost, stream_),
                      "reading D");
      DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "reading the EMAs");
    }
    return absl::OkStatus();
  }

 private:
  // The SPIN state of one (sequence, layer) on the GPU.
  struct SpinSlot {
    DeviceBuffer vertical, diagonal;  // fp32 [capacity], zero past what SPIN wrote
    int64_t capacity = 0;
    int64_t used = 0;  // SpinState's vector length: the largest updated position + 1
    double ema_decay = 0.5;
    // The pending verifier step (CommitSpin): its scores [rows, blocks * 64] and blocks.
    std::vector<int64_t> pending_positions;
    int64_t pending_num_blocks = 0;
    DeviceBuffer pending_scores, pending_blocks;
  };

  // Writes row `row`'s query (bf16 for the tensor-core scan, else fp32) and head weights into the
  // upload at the byte offsets of the query and weight arrays.
  void WriteRow(const IndexerRow& r, int64_t row, bool tensor_cores, int num_heads, size_t at_query,
                size_t at_weights) {
    const size_t values = static_cast<size_t>(num_heads) * head_dim_;
    if (tensor_cores) {
      uint16_t* q = upload_.as<uint16_t>(at_query) + row * values;
      for (size_t i = 0; i < values; ++i) q[i] = ToBfloat16(r.query[i]);
    } else {
      std::memcpy(upload_.as<float>(at_query) + row * values, r.query.data(),
                  sizeof(float) * values);
    }
    std::memcpy(upload_.as<float>(at_weights) + row * num_heads, r.head_weights.data(),
                sizeof(float) * num_heads);
  }

  // The SPIN slot of (sequence, layer), or null when it has none.
  SpinSlot* FindSlot(uint64_t sequence_id, int layer) {
    auto it = spin_.find(sequence_id);
    if (it == spin_.end() || layer < 0 || layer >= static_cast<int>(it->second.size())) {
      return nullptr;
    }
    return &it->second[layer];
  }
  // The slot of (sequence, layer), made (empty: zero EMAs) when missing. Invalidates references to
  // the sequence's other slots.
  SpinSlot& SlotFor(uint64_t sequence_id, int layer) {
    std::vector<SpinSlot>& layers = spin_[sequence_id];
    if (static_cast<int>(layers.size()) <= layer) layers.resize(layer + 1);
    return layers[layer];
  }

  // Grows a slot's V and D to hold `slots` entries (new entries zero; old ones kept).
  absl::Status EnsureCapacity(SpinSlot& slot, int64_t slots) {
    if (slots <= slot.capacity) return absl::OkStatus();
    const int64_t capacity = std::max<int64_t>(slots, 2 * slot.capacity) + 1024;
    for (DeviceBuffer* buffer : {&slot.vertical, &slot.diagonal}) {
      DeviceBuffer grown;
      DSA_RETURN_IF_ERROR(grown.Reserve(sizeof(float) * capacity, "SPIN EMAs"));
      DSA_CUDA_RETURN(cudaMemsetAsync(grown.as<void>(), 0, sizeof(float) * capacity, stream_),
                      "zeroing the EMAs");
      if (slot.capacity > 0) {
        DSA_CUDA_RETURN(
            cudaMemcpyAsync(grown.as<void>(), buffer->as<void>(), sizeof(float) * slot.capacity,
                            cudaMemcpyDeviceToDevice, stream_),
            "copying the EMAs");
      }
      DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "growing the EMAs");
      *buffer = std::move(grown);
    }
    slot.capacity = capacity;
    return absl::OkStatus();
  }

  // One LaunchSelect over jobs sharing the launch-wide settings; `ms` gets its device time.
  // One select launch. Jobs with a handoff read IndexerRow::device_query (staged into the batch
  // buffer on the device) and get their selections copied to device_selections; with `notify`,
  // its selections_ready is recorded and on_enqueued called once they are enqueued.
  absl::Status SelectLaunch(const std::vector<const DeviceSpinJob*>& jobs, int num_heads, float* ms,
                            const DeviceHandoff* notify) {
    const bool device_queries = jobs[0]->handoff != nullptr;
    const int num_groups = static_cast<int>(jobs.size());
    int64_t num_rows = 0, table_entries = 0, max_visible_blocks = 1;
    for (const DeviceSpinJob* job : jobs) {
      num_rows += static_cast<int64_t>(job->rows.size());
      table_entries += static_cast<int64_t>(job->view->block_table.size());
      const int64_t newest = job->rows.back().position;
      max_visible_blocks = std::max(max_visible_blocks, CeilDiv(newest + 1, kBlockSize));
      SpinSlot& slot = SlotFor(job->sequence_id, job->layer);
      slot.ema_decay = job->config->ema_decay;
      DSA_RETURN_IF_ERROR(EnsureCapacity(slot, newest + 1));
    }
    const char* why = "";
    bool tensor_cores = tensor_cores_;
    for (const DeviceSpinJob* job : jobs)
      tensor_cores = tensor_cores && QueriesFitBfloat16(job->rows);
    last_scan_kernel_ = tensor_cores ? "tensor-cores" : "cuda-cores";
    const size_t query_bytes = tensor_cores ? 2 : 4;
    const size_t query_values = static_cast<size_t>(num_heads) * head_dim_;
    // The upload.
    size_t cursor = 0;
    const size_t at_first_row = Take(cursor, sizeof(int32_t) * (num_groups + 1));
    const size_t at_table_offset = Take(cursor, sizeof(int64_t) * num_groups);
    const size_t at_tables = Take(cursor, sizeof(int32_t) * table_entries);
    const size_t at_num_slots = Take(cursor, sizeof(int64_t) * num_groups);
    const size_t at_query = Take(cursor, query_bytes * query_values * num_rows);
    const size_t at_weights = Take(cursor, sizeof(float) * num_heads * num_rows);
    const size_t at_position = Take(cursor, sizeof(int64_t) * num_rows);
    const size_t at_plan = Take(cursor, sizeof(SelectPlan) * num_groups);
    const size_t at_vertical = Take(cursor, sizeof(float*) * num_groups);
    const size_t at_diagonal = Take(cursor, sizeof(float*) * num_groups);
    const size_t at_capacity = Take(cursor, sizeof(int64_t) * num_groups);
    const size_t at_seed = Take(cursor, sizeof(uint64_t) * num_groups);
    const size_t at_query_pointers = Take(cursor, device_queries ? sizeof(float*) * num_rows : 0);
    const size_t upload_bytes = cursor;
    // The outputs, on the device after the upload.
    const size_t at_selection = Take(cursor, sizeof(int32_t) * num_rows * jobs[0]->top_k);
    const size_t at_block_offset = Take(cursor, sizeof(int64_t) * (num_groups + 1));
    const size_t at_score_offset = Take(cursor, sizeof(int64_t) * num_rows);
    const size_t at_blocks = Take(cursor, sizeof(int32_t) * num_groups * max_visible_blocks);
    const size_t download_bytes = cursor - at_selection;
    DSA_RETURN_IF_ERROR(upload_.Reserve(upload_bytes, "pinned upload buffer"));
    DSA_RETURN_IF_ERROR(download_.Reserve(download_bytes, "pinned download buffer"));
    DSA_RETURN_IF_ERROR(batch_.Reserve(cursor, "device batch buffer"));
    DSA_RETURN_IF_ERROR(scores_.Reserve(sizeof(float) * num_rows * max_visible_blocks * kBlockSize,
                                        "device score buffer"));
    int64_t row = 0, table = 0;
    for (int g = 0; g < num_groups; ++g) {
      const DeviceSpinJob& job = *jobs[g];
      SpinSlot& slot = *FindSlot(job.sequence_id, job.layer);
      upload_.as<int32_t>(at_first_row)[g] = static_cast<int32_t>(row);
      upload_.as<int64_t>(at_table_offset)[g] = table;
      std::memcpy(upload_.as<int32_t>(at_tables) + table, job.view->block_table.data(),
                  sizeof(int32_t) * job.view->block_table.size());
      table += static_cast<int64_t>(job.view->block_table.size());
      upload_.as<int64_t>(at_num_slots)[g] = job.view->num_slots;
      upload_.as<SelectPlan>(at_plan)[g] =
          job.all_blocks ? SelectPlan::kAllBlocks : SelectPlan::kSpin;
      upload_.as<float*>(at_vertical)[g] = slot.vertical.as<float>();
      upload_.as<float*>(at_diagonal)[g] = slot.diagonal.as<float>();
      upload_.as<int64_t>(at_capacity)[g] = slot.capacity;
      upload_.as<uint64_t>(at_seed)[g] = job.config->seed;
      for (const IndexerRow& r : job.rows) {
        if (device_queries) {
          upload_.as<const float*>(at_query_pointers)[row] = r.device_query;
          std::memcpy(upload_.as<float>(at_weights) + row * num_heads, r.head_weights.data(),
                      sizeof(float) * num_heads);
        } else {
          WriteRow(r, row, tensor_cores, num_heads, at_query, at_weights);
        }
        upload_.as<int64_t>(at_position)[row] = r.position;
        ++row;
      }
    }
    upload_.as<int32_t>(at_first_row)[num_groups] = static_cast<int32_t>(row);

    SelectParams p;
    p.pool = device_pool_;
    p.head_dim = head_dim_;
    p.num_heads = num_heads;
    p.num_groups = num_groups;
    p.num_rows = static_cast<int>(num_rows);
    p.group_first_row = batch_.as<int32_t>(at_first_row);
    p.group_table_offset = batch_.as<int64_t>(at_table_offset);
    p.block_tables = batch_.as<int32_t>(at_tables);
    p.group_num_slots = batch_.as<int64_t>(at_num_slots);
    p.query = batch_.as<void>(at_query);
    p.query_dtype = tensor_cores ? QueryDtype::kBFloat16 : QueryDtype::kFloat32;
    p.head_weights = batch_.as<float>(at_weights);
    p.row_position = batch_.as<int64_t>(at_position);
    p.scan = tensor_cores ? SelectScan::kTensorCores : SelectScan::kCudaCores;
    p.group_plan = batch_.as<SelectPlan>(at_plan);
    p.vertical = batch_.as<float* const>(at_vertical);
    p.diagonal = batch_.as<float* const>(at_diagonal);
    p.spin_capacity = batch_.as<int64_t>(at_capacity);
    p.group_seed = batch_.as<uint64_t>(at_seed);
    const SpinConfig& config = *jobs[0]->config;
    p.top_k = jobs[0]->top_k;
    p.target_block_sparsity = config.target_block_sparsity;
    p.exploration_fraction = config.exploration_fraction;
    p.ema_decay = config.ema_decay;
    p.layer = jobs[0]->layer;
    p.update = true;
    p.max_visible_blocks = max_visible_blocks;
    p.host_all_blocks = std::all_of(jobs.begin(), jobs.end(),
                                    [](const DeviceSpinJob* job) { return job->all_blocks; });
    p.host_no_all_blocks = std::none_of(jobs.begin(), jobs.end(),
                                        [](const DeviceSpinJob* job) { return job->all_blocks; });
    p.selection = batch_.as<int32_t>(at_selection);
    p.scores = scores_.as<float>();
    p.row_score_offset = batch_.as<int64_t>(at_score_offset);
    p.group_blocks = batch_.as<int32_t>(at_blocks);
    p.group_block_offset = batch_.as<int64_t>(at_block_offset);
    p.workspace_bytes = SelectScratchBytes(p);
    DSA_RETURN_IF_ERROR(workspace_.Reserve(p.workspace_bytes, "select workspace"));
    p.workspace = workspace_.as<void>();
    if (!CanImplementSelect(p, &why)) {
      return absl::InternalError(absl::StrCat("the GPU select refused the batch: ", why));
    }
    DSA_CUDA_RETURN(cudaMemcpyAsync(batch_.as<void>(), upload_.as<void>(), upload_bytes,
                                    cudaMemcpyHostToDevice, stream_),
                    "uploading the batch");
    if (device_queries) {
      StageQueriesParams stage;
      stage.row_queries = batch_.as<const float* const>(at_query_pointers);
      stage.num_rows = num_rows;
      stage.values_per_row = static_cast<int64_t>(query_values);
      stage.to_bfloat16 = tensor_cores;
      stage.out = batch_.as<void>(at_query);
      DSA_CUDA_RETURN(LaunchStageQueries(stage, stream_), "staging the device queries");
    }
    DSA_CUDA_RETURN(cudaEventRecord(events_[0], stream_), "event");
    DSA_CUDA_RETURN(LaunchSelect(p, stream_), "launching the select");
    DSA_CUDA_RETURN(cudaEventRecord(events_[1], stream_), "event");
    if (device_queries) {
      // Each job's rows to its device_selections; runs of jobs whose outputs are adjacent (the
      // usual case: one buffer in batch order) in one copy.
      const int32_t* source = batch_.as<int32_t>(at_selection);
      const int64_t top_k = jobs[0]->top_k;
      int64_t first = 0;
      for (int g = 0; g < num_groups;) {
        int h = g;
        int64_t rows = static_cast<int64_t>(jobs[g]->rows.size());
        while (h + 1 < num_groups &&
               jobs[h + 1]->device_selections == jobs[g]->device_selections + rows * top_k) {
          ++h;
          rows += static_cast<int64_t>(jobs[h]->rows.size());
        }
        DSA_CUDA_RETURN(
            cudaMemcpyAsync(jobs[g]->device_selections, source + first * top_k,
                            sizeof(int32_t) * rows * top_k, cudaMemcpyDeviceToDevice, stream_),
            "handing over the selections");
        first += rows;
        g = h + 1;
      }
    }
    if (notify != nullptr) {
      if (notify->selections_ready != nullptr) {
        DSA_CUDA_RETURN(
            cudaEventRecord(static_cast<cudaEvent_t>(notify->selections_ready), stream_),
            "recording the handoff's event");
      }
      if (notify->on_enqueued) notify->on_enqueued();
    }
    DSA_CUDA_RETURN(cudaMemcpyAsync(download_.as<void>(), batch_.as<uint8_t>() + at_selection,
                                    download_bytes, cudaMemcpyDeviceToHost, stream_),
                    "downloading the selections");
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "running the select");
    DSA_CUDA_RETURN(cudaEventElapsedTime(ms, events_[0], events_[1]), "event time");
    const auto* selection = download_.as<int32_t>();
    const auto* block_offset = download_.as<int64_t>(at_block_offset - at_selection);
    const auto* score_offset = download_.as<int64_t>(at_score_offset - at_selection);
    const auto* blocks = download_.as<int32_t>(at_blocks - at_selection);
    row = 0;
    for (int g = 0; g < num_groups; ++g) {
      const DeviceSpinJob& job = *jobs[g];
      SpinSlot& slot = *FindSlot(job.sequence_id, job.layer);
      const auto rows = static_cast<int64_t>(job.rows.size());
      const int64_t count = block_offset[g + 1] - block_offset[g];
      job.blocks->assign(blocks + block_offset[g], blocks + block_offset[g + 1]);
      std::memcpy(job.selections.data(), selection + row * job.top_k,
                  sizeof(int32_t) * rows * job.top_k);
      const int64_t entries = rows * count * kBlockSize;
      const float* job_scores = scores_.as<float>() + score_offset[row];
      if (job.scores != nullptr) {
        job.scores->resize(entries);
        DSA_CUDA_RETURN(cudaMemcpyAsync(job.scores->data(), job_scores, sizeof(float) * entries,
                                        cudaMemcpyDeviceToHost, stream_),
                        "downloading the scores");
      }
      if (rows == 1) {
        slot.used = std::max(slot.used, job.rows[0].position + 1);
      } else {
        // The verifier step's scores and blocks stay on the GPU for CommitSpin.
        DSA_RETURN_IF_ERROR(slot.pending_scores.Reserve(sizeof(float) * entries, "pending scores"));
        DSA_RETURN_IF_ERROR(slot.pending_blocks.Reserve(
            sizeof(int32_t) * std::max<int64_t>(count, 1), "pending blocks"));
        DSA_CUDA_RETURN(cudaMemcpyAsync(slot.pending_scores.as<void>(), job_scores,
                                        sizeof(float) * entries, cudaMemcpyDeviceToDevice, stream_),
                        "keeping the verifier scores");
        DSA_CUDA_RETURN(cudaMemcpyAsync(slot.pending_blocks.as<void>(),
                                        batch_.as<int32_t>(at_blocks) + block_offset[g],
                                        sizeof(int32_t) * count, cudaMemcpyDeviceToDevice, stream_),
                        "keeping the verifier blocks");
        slot.pending_num_blocks = count;
        slot.pending_positions.clear();
        for (const IndexerRow& r : job.rows) slot.pending_positions.push_back(r.position);
      }
      row += rows;
    }
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "keeping the verifier step");
    return absl::OkStatus();
  }

  CudaScoringOptions options_;
  DeviceInfo info_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t events_[3] = {nullptr, nullptr, nullptr};
  int head_dim_ = 0;
  size_t block_bytes_ = 0;
  int64_t capacity_blocks_ = 0;
  const uint8_t* host_pool_ = nullptr;
  bool host_registered_ = false;
  uint8_t* device_pool_ = nullptr;
  PinnedBuffer upload_, download_;
  DeviceBuffer batch_, scores_, selections_, workspace_;
  absl::flat_hash_map<uint64_t, std::vector<SpinSlot>> spin_;  // by sequence, then layer
  const char* last_scan_kernel_ = "";
  bool tensor_cores_ = false;  // the model's shape runs the tensor-core scan (Attach)
};

}  // namespace

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
