// The CUDA attention backend (see cuda_attention_backend.h).
#include "attention_worker/cuda/cuda_attention_backend.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "attention_worker/cuda/mla_inputs.h"
#include "attention_worker/cuda/pattern_inputs.h"
#include "attention_worker/cuda/sparse_mla_decode.h"

namespace dsa::cuda {
namespace {

constexpr int64_t kSlotsPerBlock = kBlockSize;
constexpr int64_t kBlockElements = kSlotsPerBlock * kMlaKeyDim;  // bf16 values a block

absl::Status CudaError(cudaError_t error, const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

#define DSA_CUDA_RETURN(expr, what)              \
  do {                                           \
    const cudaError_t dsa_cuda_error_ = (expr);  \
    if (dsa_cuda_error_ != cudaSuccess) {        \
      (void)cudaGetLastError();                  \
      return CudaError(dsa_cuda_error_, (what)); \
    }                                            \
  } while (false)

// A device buffer that grows (contents not kept).
template <typename T>
struct DeviceArray {
  T* data = nullptr;
  size_t capacity = 0;  // elements
  ~DeviceArray() {
    if (data != nullptr) (void)cudaFree(data);
  }
  // Grows to n elements. Work queued on `stream` may still read the old buffer: it runs first.
  cudaError_t Reserve(size_t n, cudaStream_t stream) {
    if (n <= capacity) return cudaSuccess;
    if (data != nullptr && stream != nullptr) {
      const cudaError_t drained = cudaStreamSynchronize(stream);
      if (drained != cudaSuccess) return drained;
    }
    if (data != nullptr) (void)cudaFree(data);
    data = nullptr;
    capacity = 0;
    const cudaError_t error =
        cudaMalloc(reinterpret_cast<void**>(&data), std::max<size_t>(n, 1) * sizeof(T));
    if (error == cudaSuccess) capacity = n;
    return error;
  }
};

// Pinned host buffers for a stream's uploads, used round robin: a buffer is written again only
// after the copy that read it ran (its event), so the host never waits for the stream (pageable
// memory could make cudaMemcpyAsync wait for it).
class PinnedRing {
 public:
  static constexpr int kBuffers = 8;
  ~PinnedRing() {
    for (Entry& e : entries_) {
      if (e.data != nullptr) (void)cudaFreeHost(e.data);
      if (e.copied != nullptr) (void)cudaEventDestroy(e.copied);
    }
  }
  // The next buffer with room for `bytes`; its previous copy has completed.
  cudaError_t Next(size_t bytes, void** out) {
    Entry& e = entries_[next_];
    if (e.copied == nullptr) {
      const cudaError_t created = cudaEventCreateWithFlags(&e.copied, cudaEventDisableTiming);
      if (created != cudaSuccess) return created;
    } else {
      const cudaError_t waited = cudaEventSynchronize(e.copied);
      if (waited != cudaSuccess) return waited;
    }
    if (bytes > e.capacity) {
      if (e.data != nullptr) (void)cudaFreeHost(e.data);
      e.data = nullptr;
      e.capacity = 0;
      const cudaError_t error = cudaMallocHost(&e.data, std::max<size_t>(bytes, 4096));
      if (error != cudaSuccess) return error;
      e.capacity = std::max<size_t>(bytes, 4096);
    }
    *out = e.data;
    return cudaSuccess;
  }
  // Copies `bytes` of the buffer Next returned to `device` on `stream` and moves on.
  cudaError_t Upload(void* device, size_t bytes, cudaStream_t stream) {
    Entry& e = entries_[next_];
    next_ = (next_ + 1) % kBuffers;
    const cudaError_t copied =
        cudaMemcpyAsync(device, e.data, bytes, cudaMemcpyHostToDevice, stream);
    if (copied != cudaSuccess) return copied;
    return cudaEventRecord(e.copied, stream);
  }

 private:
  struct Entry {
    void* data = nullptr;
    size_t capacity = 0;
    cudaEvent_t copied = nullptr;
  };
  Entry entries_[kBuffers];
  int next_ = 0;
};

// A 16-byte aligned piece of a packed upload.
size_t Take(size_t& cursor, size_t bytes) {
  const size_t at = cursor;
  cursor = (cursor + bytes + 15) / 16 * 16;
  return at;
}

float Bf16BitsToFloat(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

class CudaAttentionBackend final : public AttentionBackend {
 public:
  explicit CudaAttentionBackend(const CudaAttentionBackendOptions& options) : options_(options) {}

  ~CudaAttentionBackend() override {
    (void)cudaSetDevice(options_.device);
    if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
    free_steps_.clear();
    (void)FreePatternTables(&tables_);
    if (pools_ != nullptr) (void)cudaFree(pools_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      return absl::FailedPreconditionError("no CUDA device is present");
    }
    if (options_.device < 0 || options_.device >= count) {
      return absl::FailedPreconditionError(
          absl::StrCat("CUDA device ", options_.device, " does not exist (", count, " present)"));
    }
    DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
    cudaDeviceProp properties{};
    DSA_CUDA_RETURN(cudaGetDeviceProperties(&properties, options_.device),
                    "cudaGetDeviceProperties");
    if (properties.major != 9) {
      return absl::FailedPreconditionError(
          absl::StrCat("GPU ", options_.device, " (", properties.name, ", sm_", properties.major,
                       properties.minor, ") cannot run the sm_90a attention kernels"));
    }
    description_ = absl::StrCat("cuda:", options_.device, " (", properties.name, ")");
    num_blocks_ = (options_.capacity_slots + kSlotsPerBlock - 1) / kSlotsPerBlock;
    const size_t pool_bytes = static_cast<size_t>(num_blocks_) * kBlockElements * 2;
    const size_t total = pool_bytes * static_cast<size_t>(options_.num_model_layers);
    if (cudaMalloc(reinterpret_cast<void**>(&pools_), std::max<size_t>(total, 1)) != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat(
          "the KV pools (", options_.num_model_layers, " layers x ", num_blocks_,
          " blocks x 73,728 bytes = ", total, " bytes) do not fit on GPU ", options_.device));
    }
    DSA_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    free_blocks_.reserve(static_cast<size_t>(num_blocks_));
    for (int64_t b = num_blocks_ - 1; b >= 0; --b) free_blocks_.push_back(static_cast<int32_t>(b));
    return absl::OkStatus();
  }

  std::string Description() const override { return description_; }
  int64_t slot_granularity() const override { return kSlotsPerBlock; }
  int64_t output_values_per_row() const override {
    return int64_t{options_.num_heads} * kMlaValueDim;
  }

  // All or nothing: on any error the sequence keeps its slots and blocks. A shrink touches no
  // device state, so it cannot fail.
  absl::Status ResizeSequence(uint64_t sequence_id, int64_t num_slots) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sequences_.find(sequence_id);
    const int64_t old_slots = it == sequences_.end() ? 0 : it->second.num_slots;
    const auto need = static_cast<size_t>((num_slots + kSlotsPerBlock - 1) / kSlotsPerBlock);
    if (num_slots <= old_slots) {  // host bookkeeping only
      if (it == sequences_.end()) return absl::OkStatus();
      SequenceKv& kv = it->second;
      while (kv.block_table.size() > need) {
        free_blocks_.push_back(kv.block_table.back());
        kv.block_table.pop_back();
      }
      kv.num_slots = num_slots;
      if (num_slots == 0) sequences_.erase(it);
      return absl::OkStatus();
    }
    std::vector<int32_t> table =
        it == sequences_.end() ? std::vector<int32_t>() : it->second.block_table;
    const size_t more = need > table.size() ? need - table.size() : 0;
    if (more > free_blocks_.size()) {
      return absl::ResourceExhaustedError(absl::StrCat("GPU KV pool full: ", more,
                                                       " blocks needed, ", free_blocks_.size(),
                                                       " free of ", num_blocks_));
    }
    for (size_t i = 0; i < more; ++i) table.push_back(free_blocks_[free_blocks_.size() - 1 - i]);
    // Rows of the new slots, every layer, from the seed (MlaKvRow on the device).
    absl::Status written = [&]() -> absl::Status {
      DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
      DSA_CUDA_RETURN(table_.Reserve(table.size(), stream_), "block table");
      DSA_CUDA_RETURN(cudaMemcpyAsync(table_.data, table.data(), table.size() * sizeof(int32_t),
                                      cudaMemcpyHostToDevice, stream_),
                      "block table upload");
      for (int layer = 0; layer < options_.num_model_layers; ++layer) {
        MlaKvRowsParams params;
        params.seed = options_.seed;
        params.layer = layer;
        params.first_slot = old_slots;
        params.num_slots = num_slots - old_slots;
        params.block_table = table_.data;
        params.num_physical_blocks = num_blocks_;
        params.kv_pool = Pool(layer);
        DSA_CUDA_RETURN(LaunchMlaKvRows(params, stream_), "KV rows");
      }
      DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "KV rows");  // `table` stays valid
      return absl::OkStatus();
    }();
    if (!written.ok()) return written;  // the free list and the sequence untouched
    free_blocks_.resize(free_blocks_.size() - more);
    SequenceKv& kv = sequences_[sequence_id];
    kv.block_table = std::move(table);
    kv.num_slots = num_slots;
    return absl::OkStatus();
  }

  absl::Status AttendLayer(int model_layer, std::span<const AttentionRowRef> rows,
                           std::span<float> outputs) override {
    const int64_t per_row = output_values_per_row();
    if (!outputs.empty() &&
        static_cast<int64_t>(outputs.size()) != per_row * static_cast<int64_t>(rows.size())) {
      return absl::InvalidArgumentError(absl::StrCat("outputs hold ", outputs.size(),
                                                     " values, expected ", per_row * rows.size()));
    }
    if (model_layer < 0 || model_layer >= options_.num_model_layers) {
      return absl::InvalidArgumentError(absl::StrCat("model layer ", model_layer, " outside [0, ",
                                                     options_.num_model_layers, ")"));
    }
    if (rows.empty()) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mutex_);
    DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
    // Rows of equal K go in one launch (a batch's sequences share K in practice).
    std::map<size_t, std::vector<size_t>> by_k;
    for (size_t r = 0; r < rows.size(); ++r) {
      auto it = sequences_.find(rows[r].sequence_id);
      if (it == sequences_.end() || rows[r].position < 0 ||
          rows[r].position >= it->second.num_slots) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", rows[r].sequence_id, " holds no KV slot ", rows[r].position));
      }
      const size_t top_k = rows[r].device_selection != nullptr
                               ? static_cast<size_t>(std::max(rows[r].top_k, 0))
                               : rows[r].selection.size();
      if (top_k == 0 || (rows[r].device_selection != nullptr && !rows[r].selection.empty())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence ", rows[r].sequence_id,
            top_k == 0 ? ": an empty selection" : ": both a host and a device selection"));
      }
      by_k[top_k].push_back(r);
    }
    if (!outputs.empty()) host_out_.resize(rows.size() * static_cast<size_t>(per_row));
    for (const auto& [top_k, members] : by_k) {
      absl::Status status =
          AttendGroup(model_layer, rows, members, static_cast<int>(top_k), !outputs.empty());
      if (!status.ok()) return status;
    }
    if (options_.rest_of_layer) {
      DSA_CUDA_RETURN(options_.rest_of_layer(stream_, static_cast<int>(rows.size())),
                      "the rest of the layer");
    }
    // Without outputs the work stays queued on the stream: the caller synchronizes at the step's
    // end (Synchronize, DeviceStep::Finish), so the host runs ahead of the GPU.
    if (!outputs.empty()) {
      DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "layer attention");
      for (size_t r = 0; r < rows.size(); ++r) {
        for (int64_t i = 0; i < per_row; ++i) {
          outputs[r * per_row + i] = Bf16BitsToFloat(host_out_[r * per_row + i]);
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Synchronize() override {
    std::lock_guard<std::mutex> lock(mutex_);
    DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "the attention stream");
    return absl::OkStatus();
  }

  int device_ordinal() const override { return options_.device; }

  absl::Status EnableDeviceSelects(const PatternModel& model) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (tables_.allocation != nullptr) return absl::OkStatus();
    DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
    std::vector<float> radius, cosine;
    BoxMullerFirstNormalTables(&radius, &cosine);
    const cudaError_t uploaded =
        UploadPatternTables(model.Tables(), radius.data(), cosine.data(), &tables_);
    if (uploaded == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat(
          "the pattern model's tables (about 128 MiB) do not fit on GPU ", options_.device));
    }
    DSA_CUDA_RETURN(uploaded, "uploading the pattern model's tables");
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<DeviceStep>> BeginDeviceStep() override;

  // ---- for CudaDeviceStep ----
  struct SelectSlotBuffers {
    DeviceArray<float> queries;
    DeviceArray<int32_t> selections;
    DeviceArray<unsigned char> rows;  // int32 layers [n], then int64 positions [n] (16-aligned)
    cudaEvent_t queries_ready = nullptr;
    cudaEvent_t selections_ready = nullptr;
    bool prepared = false;
    ~SelectSlotBuffers() {
      if (queries_ready != nullptr) (void)cudaEventDestroy(queries_ready);
      if (selections_ready != nullptr) (void)cudaEventDestroy(selections_ready);
    }
  };
  struct StepBuffers {
    std::vector<std::unique_ptr<SelectSlotBuffers>> slots;  // per full layer
  };

  absl::StatusOr<DeviceSelectSlot> PrepareSelect(StepBuffers& step, int full_layer,
                                                 std::span<const int64_t> positions, int top_k) {
    if (full_layer < 0 || full_layer >= tables_.scalars.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("full layer ", full_layer, " outside [0, ",
                                                     tables_.scalars.num_layers, ")"));
    }
    if (positions.empty() || top_k < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("a device-resident select needs rows and K >= 1 (", positions.size(),
                       " rows, K ", top_k, ")"));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
    if (step.slots.size() <= static_cast<size_t>(full_layer)) step.slots.resize(full_layer + 1);
    if (step.slots[full_layer] == nullptr) {
      step.slots[full_layer] = std::make_unique<SelectSlotBuffers>();
    }
    SelectSlotBuffers& slot = *step.slots[full_layer];
    if (slot.queries_ready == nullptr) {
      DSA_CUDA_RETURN(cudaEventCreateWithFlags(&slot.queries_ready, cudaEventDisableTiming),
                      "event");
      DSA_CUDA_RETURN(cudaEventCreateWithFlags(&slot.selections_ready, cudaEventDisableTiming),
                      "event");
    }
    const size_t n = positions.size();
    const size_t values = n * tables_.scalars.num_heads * tables_.scalars.head_dim;
    size_t cursor = 0;
    const size_t at_layers = Take(cursor, sizeof(int32_t) * n);
    const size_t at_positions = Take(cursor, sizeof(int64_t) * n);
    if (slot.queries.Reserve(values, stream_) != cudaSuccess ||
        slot.selections.Reserve(n * static_cast<size_t>(top_k), stream_) != cudaSuccess ||
        slot.rows.Reserve(cursor, stream_) != cudaSuccess) {
      (void)cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat(
          "GPU ", options_.device, " has no room for a device-resident select of ", n, " rows"));
    }
    void* staged = nullptr;
    DSA_CUDA_RETURN(ring_.Next(cursor, &staged), "pinned staging");
    auto* bytes = static_cast<unsigned char*>(staged);
    for (size_t i = 0; i < n; ++i) {
      reinterpret_cast<int32_t*>(bytes + at_layers)[i] = full_layer;
      reinterpret_cast<int64_t*>(bytes + at_positions)[i] = positions[i];
    }
    DSA_CUDA_RETURN(ring_.Upload(slot.rows.data, cursor, stream_), "select rows upload");
    PatternIndexerQueriesParams params;
    params.tables = tables_;
    params.num_rows = static_cast<int>(n);
    params.layers = reinterpret_cast<const int32_t*>(slot.rows.data + at_layers);
    params.positions = reinterpret_cast<const int64_t*>(slot.rows.data + at_positions);
    params.queries = slot.queries.data;
    DSA_CUDA_RETURN(LaunchPatternIndexerQueries(params, stream_), "indexer queries");
    DSA_CUDA_RETURN(cudaEventRecord(slot.queries_ready, stream_), "event");
    slot.prepared = true;
    return DeviceSelectSlot{slot.queries.data, slot.queries_ready, slot.selections.data,
                            slot.selections_ready};
  }

  absl::Status WaitForSelections(StepBuffers& step, int full_layer) {
    if (full_layer < 0 || static_cast<size_t>(full_layer) >= step.slots.size() ||
        step.slots[full_layer] == nullptr || !step.slots[full_layer]->prepared) {
      return absl::InvalidArgumentError(
          absl::StrCat("full layer ", full_layer, " has no device-resident select in this step"));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    DSA_CUDA_RETURN(cudaSetDevice(options_.device), "cudaSetDevice");
    DSA_CUDA_RETURN(cudaStreamWaitEvent(stream_, step.slots[full_layer]->selections_ready, 0),
                    "waiting for the selections");
    return absl::OkStatus();
  }

  void ReturnStep(std::unique_ptr<StepBuffers> step) {
    for (auto& slot : step->slots) {
      if (slot != nullptr) slot->prepared = false;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    free_steps_.push_back(std::move(step));
  }

 private:
  struct SequenceKv {
    int64_t num_slots = 0;
    std::vector<int32_t> block_table;  // logical block -> physical block
  };

  __nv_bfloat16* Pool(int layer) const {
    return pools_ + static_cast<size_t>(layer) * static_cast<size_t>(num_blocks_) * kBlockElements;
  }

  // One launch for `members` (indices into rows), all of K = top_k, enqueued on the stream. The
  // small arrays go up in one packed copy from a pinned buffer; device selections are read in
  // place when the members' are adjacent (one indexer answer in row order), else gathered on the
  // device. With want_outputs, the outputs land in host_out_ at each row's index after the
  // caller's synchronize.
  absl::Status AttendGroup(int layer, std::span<const AttentionRowRef> rows,
                           const std::vector<size_t>& members, int top_k, bool want_outputs) {
    const int n = static_cast<int>(members.size());
    size_t max_blocks = 1;
    int device_rows = 0;
    for (size_t r : members) {
      max_blocks = std::max(max_blocks, sequences_.at(rows[r].sequence_id).block_table.size());
      if (rows[r].device_selection != nullptr) ++device_rows;
    }
    bool adjacent = device_rows == n;
    for (int i = 1; i < n && adjacent; ++i) {
      adjacent = rows[members[i]].device_selection ==
                 rows[members[0]].device_selection + static_cast<size_t>(i) * top_k;
    }
    size_t cursor = 0;
    const size_t at_tables = Take(cursor, sizeof(int32_t) * n * max_blocks);
    const size_t at_num_slots = Take(cursor, sizeof(int32_t) * n);
    const size_t at_positions = Take(cursor, sizeof(int32_t) * n);
    const size_t at_positions64 = Take(cursor, sizeof(int64_t) * n);
    const size_t at_selections = Take(cursor, adjacent ? 0 : sizeof(int32_t) * n * top_k);
    const size_t out_values = static_cast<size_t>(n) * options_.num_heads * kMlaValueDim;
    DSA_CUDA_RETURN(staging_.Reserve(cursor, stream_), "staging");
    DSA_CUDA_RETURN(
        d_queries_.Reserve(static_cast<size_t>(n) * options_.num_heads * kMlaKeyDim, stream_),
        "queries");
    DSA_CUDA_RETURN(d_out_.Reserve(out_values, stream_), "outputs");
    void* staged = nullptr;
    DSA_CUDA_RETURN(ring_.Next(cursor, &staged), "pinned staging");
    auto* bytes = static_cast<unsigned char*>(staged);
    auto* tables = reinterpret_cast<int32_t*>(bytes + at_tables);
    auto* selections = reinterpret_cast<int32_t*>(bytes + at_selections);
    std::fill(tables, tables + n * max_blocks, 0);
    for (int i = 0; i < n; ++i) {
      const AttentionRowRef& row = rows[members[i]];
      const SequenceKv& kv = sequences_.at(row.sequence_id);
      std::copy(kv.block_table.begin(), kv.block_table.end(), tables + i * max_blocks);
      reinterpret_cast<int32_t*>(bytes + at_num_slots)[i] = static_cast<int32_t>(kv.num_slots);
      reinterpret_cast<int32_t*>(bytes + at_positions)[i] = static_cast<int32_t>(row.position);
      reinterpret_cast<int64_t*>(bytes + at_positions64)[i] = row.position;
      if (!adjacent && row.device_selection == nullptr) {
        std::copy(row.selection.begin(), row.selection.end(), selections + i * top_k);
      }
    }
    DSA_CUDA_RETURN(ring_.Upload(staging_.data, cursor, stream_), "staging upload");
    int32_t* d_selections = reinterpret_cast<int32_t*>(staging_.data + at_selections);
    if (adjacent) {
      d_selections = const_cast<int32_t*>(rows[members[0]].device_selection);
    } else {
      for (int i = 0; i < n; ++i) {  // device rows gathered after the host rows' upload
        const AttentionRowRef& row = rows[members[i]];
        if (row.device_selection == nullptr) continue;
        DSA_CUDA_RETURN(
            cudaMemcpyAsync(d_selections + static_cast<size_t>(i) * top_k, row.device_selection,
                            sizeof(int32_t) * top_k, cudaMemcpyDeviceToDevice, stream_),
            "gathering the device selections");
      }
    }

    MlaQueryRowsParams query;
    query.seed = options_.seed;
    query.layer = layer;
    query.num_rows = n;
    query.num_heads = options_.num_heads;
    query.positions = reinterpret_cast<const int64_t*>(staging_.data + at_positions64);
    query.queries = d_queries_.data;
    DSA_CUDA_RETURN(LaunchMlaQueryRows(query, stream_), "attention queries");

    SparseMlaDecodeParams params;
    params.kv_pool = Pool(layer);
    params.num_physical_blocks = num_blocks_;
    params.num_rows = n;
    params.num_heads = options_.num_heads;
    params.query = d_queries_.data;
    params.block_tables = reinterpret_cast<const int32_t*>(staging_.data + at_tables);
    params.max_blocks_per_row = static_cast<int>(max_blocks);
    params.num_slots = reinterpret_cast<const int32_t*>(staging_.data + at_num_slots);
    params.positions = reinterpret_cast<const int32_t*>(staging_.data + at_positions);
    params.selections = d_selections;
    params.top_k = top_k;
    params.out = d_out_.data;
    // The split workspace is attached before the check: with automatic splits, CanImplement
    // refuses a launch whose partials have nowhere to go.
    DSA_CUDA_RETURN(workspace_.Reserve(SparseMlaDecodeScratchBytes(params), stream_),
                    "attention workspace");
    params.workspace = workspace_.data;
    params.workspace_bytes = workspace_.capacity;
    if (CanImplementSparseMlaDecodeTensorCores(params)) {
      DSA_CUDA_RETURN(LaunchSparseMlaDecodeTensorCores(params, stream_), "sparse MLA decode");
    } else {
      DSA_CUDA_RETURN(LaunchSparseMlaDecodeCudaCores(params, stream_), "sparse MLA decode");
    }
    if (want_outputs) {
      // Rows come back in member order; placed at their own index of the batch. (A group's
      // outputs are read before the next group's launch reuses d_out_.)
      std::vector<uint16_t> group_out(out_values);
      DSA_CUDA_RETURN(cudaMemcpyAsync(group_out.data(), d_out_.data, out_values * 2,
                                      cudaMemcpyDeviceToHost, stream_),
                      "outputs download");
      DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "sparse MLA decode");
      const size_t per_row = static_cast<size_t>(options_.num_heads) * kMlaValueDim;
      for (int i = 0; i < n; ++i) {
        std::copy(group_out.begin() + i * per_row, group_out.begin() + (i + 1) * per_row,
                  host_out_.begin() + members[i] * per_row);
      }
    }
    return absl::OkStatus();
  }

  const CudaAttentionBackendOptions options_;
  std::string description_;
  std::mutex mutex_;  // one caller at a time on the stream and the staging buffers
  cudaStream_t stream_ = nullptr;
  __nv_bfloat16* pools_ = nullptr;  // [num_model_layers][num_blocks_, 64, 576]
  int64_t num_blocks_ = 0;
  std::vector<int32_t> free_blocks_;
  absl::flat_hash_map<uint64_t, SequenceKv> sequences_;
  DeviceArray<int32_t> table_;
  DeviceArray<unsigned char> staging_;  // AttendGroup's packed arrays
  PinnedRing ring_;
  DeviceArray<__nv_bfloat16> d_queries_, d_out_;
  DeviceArray<unsigned char> workspace_;
  std::vector<uint16_t> host_out_;
  PatternDeviceTables tables_;  // EnableDeviceSelects
  std::vector<std::unique_ptr<StepBuffers>> free_steps_;
};

class CudaDeviceStep final : public DeviceStep {
 public:
  CudaDeviceStep(CudaAttentionBackend* backend,
                 std::unique_ptr<CudaAttentionBackend::StepBuffers> buffers)
      : backend_(backend), buffers_(std::move(buffers)) {}
  ~CudaDeviceStep() override {
    if (abandoned_) {
      (void)buffers_.release();  // a late select may still write them: never reused or freed
      return;
    }
    // A step that ends without Finish (an error path) still must not hand its buffers on while
    // the stream uses them.
    (void)backend_->Synchronize();
    backend_->ReturnStep(std::move(buffers_));
  }
  absl::StatusOr<DeviceSelectSlot> PrepareSelect(int full_layer, std::span<const int64_t> positions,
                                                 int top_k) override {
    return backend_->PrepareSelect(*buffers_, full_layer, positions, top_k);
  }
  absl::Status WaitForSelections(int full_layer) override {
    return backend_->WaitForSelections(*buffers_, full_layer);
  }
  void Abandon() override { abandoned_ = true; }

 private:
  CudaAttentionBackend* const backend_;
  std::unique_ptr<CudaAttentionBackend::StepBuffers> buffers_;
  bool abandoned_ = false;
};

absl::StatusOr<std::unique_ptr<DeviceStep>> CudaAttentionBackend::BeginDeviceStep() {
  std::unique_ptr<StepBuffers> buffers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (tables_.allocation == nullptr) {
      return absl::FailedPreconditionError(
          "device-resident selects are not enabled (EnableDeviceSelects)");
    }
    if (!free_steps_.empty()) {
      buffers = std::move(free_steps_.back());
      free_steps_.pop_back();
    }
  }
  if (buffers == nullptr) buffers = std::make_unique<StepBuffers>();
  return std::unique_ptr<DeviceStep>(std::make_unique<CudaDeviceStep>(this, std::move(buffers)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionBackend>> CreateCudaAttentionBackend(
    const CudaAttentionBackendOptions& options) {
  if (options.num_model_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_model_layers must be >= 1, got ", options.num_model_layers));
  }
  if (options.num_heads < 64 || options.num_heads % 64 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA attention backend needs a multiple of 64 attention heads, got ",
                     options.num_heads));
  }
  if (options.capacity_slots < 1 || options.capacity_slots > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity_slots must be in [1, 2^31], got ", options.capacity_slots));
  }
  auto backend = std::make_unique<CudaAttentionBackend>(options);
  if (absl::Status status = backend->Init(); !status.ok()) return status;
  return std::unique_ptr<AttentionBackend>(std::move(backend));
}

}  // namespace dsa::cuda
