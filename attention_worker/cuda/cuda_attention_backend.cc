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
#include "attention_worker/cuda/sparse_mla_decode.h"

namespace dsa::cuda {
namespace {

constexpr int64_t kSlotsPerBlock = kMlaCacheBlockSize;
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
  cudaError_t Reserve(size_t n) {
    if (n <= capacity) return cudaSuccess;
    if (data != nullptr) (void)cudaFree(data);
    data = nullptr;
    capacity = 0;
    const cudaError_t error =
        cudaMalloc(reinterpret_cast<void**>(&data), std::max<size_t>(n, 1) * sizeof(T));
    if (error == cudaSuccess) capacity = n;
    return error;
  }
};

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
      DSA_CUDA_RETURN(table_.Reserve(table.size()), "block table");
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
      if (rows[r].selection.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", rows[r].sequence_id, ": an empty selection"));
      }
      by_k[rows[r].selection.size()].push_back(r);
    }
    for (const auto& [top_k, members] : by_k) {
      absl::Status status =
          AttendGroup(model_layer, rows, members, static_cast<int>(top_k), outputs);
      if (!status.ok()) return status;
    }
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "layer attention");
    if (!outputs.empty()) {
      for (size_t r = 0; r < rows.size(); ++r) {
        for (int64_t i = 0; i < per_row; ++i) {
          outputs[r * per_row + i] = Bf16BitsToFloat(host_out_[r * per_row + i]);
        }
      }
    }
    return absl::OkStatus();
  }

 private:
  struct SequenceKv {
    int64_t num_slots = 0;
    std::vector<int32_t> block_table;  // logical block -> physical block
  };

  __nv_bfloat16* Pool(int layer) const {
    return pools_ + static_cast<size_t>(layer) * static_cast<size_t>(num_blocks_) * kBlockElements;
  }

  // One launch for `members` (indices into rows), all of K = top_k; the outputs land in
  // host_out_ at each row's index (copied only when outputs are wanted).
  absl::Status AttendGroup(int layer, std::span<const AttentionRowRef> rows,
                           const std::vector<size_t>& members, int top_k,
                           std::span<float> outputs) {
    const int n = static_cast<int>(members.size());
    size_t max_blocks = 1;
    for (size_t r : members) {
      max_blocks = std::max(max_blocks, sequences_.at(rows[r].sequence_id).block_table.size());
    }
    std::vector<int32_t> tables(static_cast<size_t>(n) * max_blocks, 0);
    std::vector<int32_t> num_slots(n), positions(n), selections(static_cast<size_t>(n) * top_k);
    std::vector<int64_t> positions64(n);
    for (int i = 0; i < n; ++i) {
      const AttentionRowRef& row = rows[members[i]];
      const SequenceKv& kv = sequences_.at(row.sequence_id);
      std::copy(kv.block_table.begin(), kv.block_table.end(), tables.begin() + i * max_blocks);
      num_slots[i] = static_cast<int32_t>(kv.num_slots);
      positions[i] = static_cast<int32_t>(row.position);
      positions64[i] = row.position;
      std::copy(row.selection.begin(), row.selection.end(), selections.begin() + i * top_k);
    }
    const size_t out_values = static_cast<size_t>(n) * options_.num_heads * kMlaValueDim;
    DSA_CUDA_RETURN(d_tables_.Reserve(tables.size()), "staging");
    DSA_CUDA_RETURN(d_num_slots_.Reserve(n), "staging");
    DSA_CUDA_RETURN(d_positions_.Reserve(n), "staging");
    DSA_CUDA_RETURN(d_positions64_.Reserve(n), "staging");
    DSA_CUDA_RETURN(d_selections_.Reserve(selections.size()), "staging");
    DSA_CUDA_RETURN(d_queries_.Reserve(static_cast<size_t>(n) * options_.num_heads * kMlaKeyDim),
                    "queries");
    DSA_CUDA_RETURN(d_out_.Reserve(out_values), "outputs");
    const auto upload = [&](auto* dst, const auto& src) {
      return cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(src[0]), cudaMemcpyHostToDevice,
                             stream_);
    };
    DSA_CUDA_RETURN(upload(d_tables_.data, tables), "staging upload");
    DSA_CUDA_RETURN(upload(d_num_slots_.data, num_slots), "staging upload");
    DSA_CUDA_RETURN(upload(d_positions_.data, positions), "staging upload");
    DSA_CUDA_RETURN(upload(d_positions64_.data, positions64), "staging upload");
    DSA_CUDA_RETURN(upload(d_selections_.data, selections), "staging upload");

    MlaQueryRowsParams query;
    query.seed = options_.seed;
    query.layer = layer;
    query.num_rows = n;
    query.num_heads = options_.num_heads;
    query.positions = d_positions64_.data;
    query.queries = d_queries_.data;
    DSA_CUDA_RETURN(LaunchMlaQueryRows(query, stream_), "attention queries");

    SparseMlaDecodeParams params;
    params.kv_pool = Pool(layer);
    params.num_physical_blocks = num_blocks_;
    params.num_rows = n;
    params.num_heads = options_.num_heads;
    params.query = d_queries_.data;
    params.block_tables = d_tables_.data;
    params.max_blocks_per_row = static_cast<int>(max_blocks);
    params.num_slots = d_num_slots_.data;
    params.positions = d_positions_.data;
    params.selections = d_selections_.data;
    params.top_k = top_k;
    params.out = d_out_.data;
    // The split workspace is attached before the check: with automatic splits, CanImplement
    // refuses a launch whose partials have nowhere to go.
    DSA_CUDA_RETURN(workspace_.Reserve(SparseMlaDecodeScratchBytes(params)), "attention workspace");
    params.workspace = workspace_.data;
    params.workspace_bytes = workspace_.capacity;
    if (CanImplementSparseMlaDecodeTensorCores(params)) {
      DSA_CUDA_RETURN(LaunchSparseMlaDecodeTensorCores(params, stream_), "sparse MLA decode");
    } else {
      DSA_CUDA_RETURN(LaunchSparseMlaDecodeCudaCores(params, stream_), "sparse MLA decode");
    }
    if (!outputs.empty()) {
      // Rows come back in member order; placed at their own index of the batch.
      std::vector<uint16_t> group_out(out_values);
      DSA_CUDA_RETURN(cudaMemcpyAsync(group_out.data(), d_out_.data, out_values * 2,
                                      cudaMemcpyDeviceToHost, stream_),
                      "outputs download");
      DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "sparse MLA decode");
      const size_t per_row = static_cast<size_t>(options_.num_heads) * kMlaValueDim;
      host_out_.resize(rows.size() * per_row);
      for (int i = 0; i < n; ++i) {
        std::copy(group_out.begin() + i * per_row, group_out.begin() + (i + 1) * per_row,
                  host_out_.begin() + members[i] * per_row);
      }
    } else {
      // The host staging vectors must outlive the uploads.
      DSA_CUDA_RETURN(cudaStreamSynchronize(stream_), "sparse MLA decode");
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
  DeviceArray<int32_t> d_tables_, d_num_slots_, d_positions_, d_selections_;
  DeviceArray<int64_t> d_positions64_;
  DeviceArray<__nv_bfloat16> d_queries_, d_out_;
  DeviceArray<unsigned char> workspace_;
  std::vector<uint16_t> host_out_;
};

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
