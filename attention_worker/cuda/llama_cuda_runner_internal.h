// The GPU LLaMA runner's private parts shared by its two source files: llama_cuda_runner.cc (the
// weights upload, the KV caches, Begin) and llama_cuda_pass.cc (the prefill / decode pass). Not the
// runner's API (llama_cuda_runner.h is): include it from those two files only.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "attention_worker/cuda/cublas_library.h"
#include "attention_worker/cuda/llama_cuda_runner.h"
#include "attention_worker/cuda/llama_kv_layout.h"
#include "attention_worker/llama_pass_rules.h"

namespace dsa::cuda::llama_internal {

// Device buffers are carved at this alignment (floats: 256 bytes).
constexpr int64_t kAlignFloats = 64;

inline int64_t AlignUp(int64_t n) { return (n + kAlignFloats - 1) / kAlignFloats * kAlignFloats; }

inline absl::Status CudaStatus(cudaError_t error, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorString(error));
  return error == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(message)
                                            : absl::InternalError(message);
}

#define DSA_CUDA_OK(expr, what)                   \
  do {                                            \
    const cudaError_t dsa_cuda_error_ = (expr);   \
    if (dsa_cuda_error_ != cudaSuccess) {         \
      (void)cudaGetLastError();                   \
      return CudaStatus(dsa_cuda_error_, (what)); \
    }                                             \
  } while (false)

// One layer's weights on the device (fp32, row-major [out, in] as LlamaModel's).
struct DeviceLayer {
  const float* attn_norm = nullptr;      // [d_model]
  const float* wqkv = nullptr;           // [q_dim + 2 kv_dim, d_model]
  const float* wo = nullptr;             // [d_model, q_dim]
  const float* ffn_norm = nullptr;       // [d_model]
  const float* wgate_up = nullptr;       // [2 ffn_dim, d_model]
  const float* wdown = nullptr;          // [d_model, ffn_dim]
  const float* wproj = nullptr;          // indexer [query_rank + head_dim + num_heads, d_model]
  const float* wqb = nullptr;            // indexer [num_heads * head_dim, query_rank]
  const float* k_norm_weight = nullptr;  // indexer [head_dim]
  const float* k_norm_bias = nullptr;    // indexer [head_dim]
};

// A pinned host buffer a pass stages its per-layer uploads in, so that cudaMemcpyAsync returns
// without waiting for the stream (from pageable memory it may wait); `copied` is recorded after
// the copy that read it, and waited for before the buffer is written again.
struct PinnedBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  cudaEvent_t copied = nullptr;
};

class CudaLlamaRunner;

class CudaLlamaCache final : public LlamaSequenceCache {
 public:
  explicit CudaLlamaCache(CudaLlamaRunner* runner) : runner_(runner) {}
  ~CudaLlamaCache() override;
  const LlamaRunner* runner() const override;
  int64_t num_slots() const override { return num_slots_; }
  absl::Status Truncate(int64_t num_slots) override;
  absl::Status CopyFrom(const LlamaSequenceCache& source) override;
  int64_t bytes() const override;

 private:
  friend class CudaLlamaRunner;
  friend class CudaLlamaPass;
  CudaLlamaRunner* const runner_;
  float* base_ = nullptr;  // device fp32 [num_layers][2][capacity_][kv_dim] (pool memory)
  int64_t capacity_ = 0;
  int64_t num_slots_ = 0;
  bool in_pass_ = false;
};

class CudaLlamaRunner final : public LlamaRunner {
 public:
  CudaLlamaRunner(std::shared_ptr<const LlamaModel> model, int device)
      : model_(std::move(model)), device_(device) {}
  ~CudaLlamaRunner() override;

  absl::Status Init();

  const LlamaModel& model() const override { return *model_; }
  std::string Description() const override { return description_; }
  absl::StatusOr<std::unique_ptr<LlamaSequenceCache>> NewCache() override {
    return std::unique_ptr<LlamaSequenceCache>(new CudaLlamaCache(this));
  }
  absl::StatusOr<std::unique_ptr<LlamaPass>> Begin(std::vector<LlamaRunnerRow> rows) override;

  // ---- for the caches and passes; each needs lock() held ----

  std::unique_lock<std::mutex> lock() {
    std::unique_lock<std::mutex> held(mutex_);
    (void)cudaSetDevice(device_);
    return held;
  }
  cudaStream_t stream() const { return stream_; }
  const LlamaConfig& config() const { return model_->config(); }
  const DeviceLayer& layer(int l) const { return layers_[l]; }
  const float* token_embd() const { return token_embd_; }
  const float* output_norm() const { return output_norm_; }
  bool use_prefill_kernel() const { return use_prefill_kernel_; }

  // Stream-ordered allocation from the runner's pool (RESOURCE_EXHAUSTED when it cannot grow).
  absl::Status Allocate(size_t bytes, void** out, const char* what) {
    DSA_CUDA_OK(cudaMallocFromPoolAsync(out, std::max<size_t>(bytes, 1), pool_, stream_), what);
    return absl::OkStatus();
  }
  void Free(void* pointer) {
    if (pointer != nullptr) (void)cudaFreeAsync(pointer, stream_);
  }
  // A staging buffer of at least `bytes` (from the pool, or grown); back with ReleasePinned.
  absl::Status AcquirePinned(size_t bytes, PinnedBuffer* out);
  void ReleasePinned(PinnedBuffer buffer) {
    if (buffer.data != nullptr) pinned_.push_back(buffer);
  }
  // Grows `cache` to hold `slots` (capacity doubles up to the context), keeping its slots.
  absl::Status Reserve(CudaLlamaCache* cache, int64_t slots);
  // Copies slots [0, source.num_slots_) of every layer of `source` into `target` (reserved).
  absl::Status CopySlots(const CudaLlamaCache& source, CudaLlamaCache* target, int64_t slots);
  // Row-major c[m, n] = alpha a[m, k] b[n, k]^T + beta c (b a weight [out, in]).
  absl::Status Gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                    const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

  const std::vector<double>& theta() const { return theta_; }
  const std::vector<double>& index_theta() const { return index_theta_; }

 private:
  const std::shared_ptr<const LlamaModel> model_;
  const int device_;
  std::string description_;
  std::mutex mutex_;  // serializes the device work of every cache and pass
  cudaStream_t stream_ = nullptr;
  cudaMemPool_t pool_ = nullptr;
  const CublasApi* cublas_api_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  float* weights_ = nullptr;  // one allocation (cudaMalloc) for every weight
  const float* token_embd_ = nullptr;
  const float* output_norm_ = nullptr;
  std::vector<DeviceLayer> layers_;
  bool use_prefill_kernel_ = false;
  std::vector<double> theta_, index_theta_;
  std::vector<PinnedBuffer> pinned_;  // free staging buffers (passes hold the others)
};

// ---- the pass ----

class CudaLlamaPass final : public LlamaPass {
 public:
  using CacheGroup = LlamaCacheRows<CudaLlamaCache>;

  CudaLlamaPass(CudaLlamaRunner* runner, std::vector<LlamaRunnerRow> rows,
                std::vector<CacheGroup> groups)
      : runner_(runner), rows_(std::move(rows)), groups_(std::move(groups)) {}
  ~CudaLlamaPass() override;

  // Allocates the workspace, uploads the rows and gathers their embeddings (lock held).
  absl::Status Start();
  // Frees the device memory and releases the caches (lock held); the destructor calls it.
  void Release();

  int num_rows() const override { return static_cast<int>(rows_.size()); }
  int next_layer() const override { return layer_; }
  bool done() const override { return layer_ == runner_->config().num_layers; }
  absl::Status IndexerInputs(std::span<float> queries, std::span<float> head_weights,
                             std::span<float> index_keys) override;
  absl::Status RunLayer(std::span<const std::span<const int32_t>> selections) override;
  absl::Status Logits(std::span<const int32_t> row_indices, std::span<float> out) override;

 private:
  absl::Status ComputeLayerInput();  // x_ = RMSNorm(h_) * attn_norm of layer_, once a layer
  absl::Status Attention(std::span<const std::span<const int32_t>> selections);
  // GqaDecodeParams or GqaPrefillParams with the fields they share set for layer_: the queries
  // (the first q_dim columns of qkv_), the rows' caches, the heads, the logit scale and attn_.
  template <typename Params>
  Params GqaParams() const;
  absl::Status Fail(absl::Status status) {
    if (failed_.ok()) failed_ = status;
    return status;
  }
  CudaLlamaRunner* const runner_;
  const std::vector<LlamaRunnerRow> rows_;
  std::vector<CacheGroup> groups_;
  int layer_ = 0;
  int x_layer_ = -1;
  absl::Status failed_;        // a device error: the pass is unusable
  std::vector<uint8_t> seen_;  // CheckLlamaSelections' scratch

  // The workspace (one pool allocation), device fp32 unless said.
  void* workspace_ = nullptr;
  float* h_ = nullptr;              // [rows, d_model] the residual stream
  float* x_ = nullptr;              // [rows, d_model] the layer's (or the FFN's) normed input
  float* qkv_ = nullptr;            // [rows, q_dim + 2 kv_dim]
  float* attn_ = nullptr;           // [rows, q_dim]
  float* gate_up_ = nullptr;        // [chunk rows, 2 ffn_dim]
  float* index_proj_ = nullptr;     // [rows, query_rank + D + H]
  float* index_queries_ = nullptr;  // [rows, H * D]
  float* head_weights_ = nullptr;   // [rows, H]
  float* index_keys_ = nullptr;     // [rows, D]
  float* rope_cos_ = nullptr;       // [rows, head_dim / 2]
  float* rope_sin_ = nullptr;
  float* index_cos_ = nullptr;  // [rows, rope_dims / 2]
  float* index_sin_ = nullptr;
  int32_t* tokens_ = nullptr;        // int32 [rows]
  LlamaRowCache* caches_ = nullptr;  // [rows]
  // A layer's attention plan (int32): entry rows, selection offsets, selections, tile rows,
  // tiles; grown as needed.
  int32_t* plan_ = nullptr;
  size_t plan_capacity_ = 0;  // int32 values
  std::vector<int32_t> plan_host_;
  PinnedBuffer staging_[2];  // the plan's uploads, alternating between layers
  int next_staging_ = 0;
  void* scratch_ = nullptr;  // the decode kernel's partials
  size_t scratch_capacity_ = 0;
};

}  // namespace dsa::cuda::llama_internal
