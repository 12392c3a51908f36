// The CUDA scoring device's private parts shared by its two source files: cuda_scoring_device.cc
// (setup, the pool mirror, the batched scan and top-K of ScoreAndSelect, the factory) and
// cuda_scoring_device_spin.cc (SPIN on the GPU: the whole select of select.h, V and D resident).
// Not the device's API (cuda_scoring_device.h is): include it from those two files only.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "contracts/limits.h"
#include "indexer_service/cuda/cuda_scoring_device.h"
#include "indexer_service/cuda/device_info.h"
#include "indexer_service/scoring_device.h"

namespace dsa::cuda::scoring_internal {

inline absl::Status CudaError(cudaError_t error, const char* what) {
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

inline cudaError_t DeviceAllocate(void** ptr, size_t bytes) { return cudaMalloc(ptr, bytes); }
inline cudaError_t HostAllocate(void** ptr, size_t bytes) { return cudaMallocHost(ptr, bytes); }
using DeviceBuffer = GrowableBuffer<DeviceAllocate, cudaFree>;
using PinnedBuffer = GrowableBuffer<HostAllocate, cudaFreeHost>;

// Byte offsets of the batch's arrays in one upload, each 16-byte aligned.
struct BatchLayout {
  size_t group_first_row = 0, group_block_offset = 0, logical_blocks = 0, group_table_offset = 0,
         block_tables = 0, group_num_slots = 0, query = 0, head_weights = 0, row_position = 0,
         row_score_offset = 0, row_num_entries = 0, row_block_offset = 0, total = 0;
};

inline size_t Take(size_t& cursor, size_t bytes) {
  const size_t at = cursor;
  cursor = (cursor + bytes + 15) / 16 * 16;
  return at;
}

// Whether every query value rounds to a finite bf16 (|x| below bf16's largest plus half an ulp).
// A larger one would turn infinite in the tensor-core scan while the CPU's fp32 stays finite, so
// such a batch runs the CUDA-core scan.
inline bool QueriesFitBfloat16(std::span<const IndexerRow> rows) {
  for (const IndexerRow& row : rows) {
    for (float q : row.query) {
      if ((std::bit_cast<uint32_t>(q) & 0x7fffffffu) >= 0x7f7f8000u) return false;
    }
  }
  return true;
}

// fp32 -> bf16 bits, round to nearest even (finite inputs: the Indexer refuses others).
inline uint16_t ToBfloat16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

class CudaScoringDevice final : public ScoringDevice {
 public:
  CudaScoringDevice(const CudaScoringOptions& options, const DeviceInfo& info)
      : options_(options), info_(info) {}

  ~CudaScoringDevice() override;

  absl::Status Init();

  int device_ordinal() const override { return options_.device; }

  std::string Describe() const override;

  absl::Status Attach(const BlockPool& pool, int num_heads) override;

  absl::Status MirrorBlocks(std::span<const int32_t> block_ids) override;

  absl::Status ScoreAndSelect(std::span<const DeviceScoreJob> jobs, int num_heads,
                              DeviceScoreSeconds* seconds) override;

  // ---- SPIN on the GPU: V and D resident, the whole select of select.h ----

  bool RunsSpin(const SpinConfig& config, int top_k) const override {
    return options_.spin && top_k <= kMaxTopK && config.pooling == BlockPooling::kMax &&
           config.reduction == BlockReduction::kA1 &&
           config.exploration == ExplorationPolicy::kRandom &&
           config.spec_mask == SpecMaskPolicy::kRowLocalUnion;
  }

  absl::Status SelectWithSpin(std::span<const DeviceSpinJob> jobs, int num_heads,
                              DeviceScoreSeconds* seconds) override;

  absl::Status CommitSpin(uint64_t sequence_id, int layer, int replay_rows) override;

  absl::Status ResetSpin(uint64_t sequence_id) override;

  void ReleaseSpin(uint64_t sequence_id) override;

  absl::Status ReadSpin(uint64_t sequence_id, int layer, std::vector<float>* vertical,
                        std::vector<float>* diagonal) override;

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
  absl::Status EnsureCapacity(SpinSlot& slot, int64_t slots);

  // One LaunchSelect over jobs sharing the launch-wide settings; `ms` gets its device time.
  // One select launch. Jobs with a handoff read IndexerRow::device_query (staged into the batch
  // buffer on the device) and get their selections copied to device_selections; with `notify`,
  // its selections_ready is recorded and on_enqueued called once they are enqueued.
  absl::Status SelectLaunch(const std::vector<const DeviceSpinJob*>& jobs, int num_heads, float* ms,
                            const DeviceHandoff* notify);

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

}  // namespace dsa::cuda::scoring_internal
