// The real model's forward pass on a GPU (see llama_cuda_runner.h).
#include "attention_worker/cuda/llama_cuda_runner.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/cuda/cublas_library.h"
#include "attention_worker/cuda/gqa_attention.h"
#include "attention_worker/cuda/llama_kernels.h"
#include "attention_worker/cuda/llama_kv_layout.h"
#include "attention_worker/llama_pass_rules.h"
#include "common/status_macros.h"

namespace dsa::cuda {
namespace {

// A cache's rows of one pass at or above this many dense rows run the tiled prefill kernel (when
// it is built for the shape); fewer (decode, verifier rows) run the split decode kernel.
constexpr int kPrefillMinRows = 16;
// Rows of one feed-forward chunk (bounds the [rows, 2 ffn_dim] scratch: 50 MB at SmolLM2's shape).
constexpr int64_t kFfnChunkRows = 4096;
// Device buffers are carved at this alignment (floats: 256 bytes).
constexpr int64_t kAlignFloats = 64;

int64_t AlignUp(int64_t n) { return (n + kAlignFloats - 1) / kAlignFloats * kAlignFloats; }

absl::Status CudaStatus(cudaError_t error, const std::string& what) {
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

// ---- CudaLlamaCache ----

CudaLlamaCache::~CudaLlamaCache() {
  if (base_ != nullptr) {
    auto held = runner_->lock();
    runner_->Free(base_);
  }
}

const LlamaRunner* CudaLlamaCache::runner() const { return runner_; }

absl::Status CudaLlamaCache::Truncate(int64_t num_slots) {
  // Under the lock: a CopyFrom on another thread reads num_slots_ (and Begin sets in_pass_) there.
  auto held = runner_->lock();
  if (in_pass_) {
    return absl::FailedPreconditionError("LlamaSequenceCache::Truncate: the cache is in a pass");
  }
  if (num_slots < 0 || num_slots > num_slots_) {
    return absl::InvalidArgumentError(absl::StrCat("LlamaSequenceCache::Truncate: ", num_slots,
                                                   " slots requested, the cache holds ",
                                                   num_slots_));
  }
  num_slots_ = num_slots;
  return absl::OkStatus();
}

absl::Status CudaLlamaCache::CopyFrom(const LlamaSequenceCache& source) {
  if (source.runner() != runner_ || &source == this) {
    return absl::InvalidArgumentError(
        "LlamaSequenceCache::CopyFrom: the source is this cache or another runner's");
  }
  const auto& from = static_cast<const CudaLlamaCache&>(source);
  // Under the lock: Begin, on another thread, marks the source in a pass under it.
  auto held = runner_->lock();
  if (in_pass_ || from.in_pass_) {
    return absl::FailedPreconditionError("LlamaSequenceCache::CopyFrom: a cache is in a pass");
  }
  const int64_t kept = num_slots_;
  num_slots_ = 0;  // Reserve need not copy this cache's own slots
  absl::Status status = runner_->Reserve(this, from.num_slots_);
  if (status.ok()) status = runner_->CopySlots(from, this, from.num_slots_);
  num_slots_ = status.ok() ? from.num_slots_ : kept;
  return status;
}

int64_t CudaLlamaCache::bytes() const {
  return 2 * static_cast<int64_t>(runner_->config().num_layers) * capacity_ *
         runner_->config().kv_dim() * static_cast<int64_t>(sizeof(float));
}

// ---- CudaLlamaRunner ----

absl::Status CudaLlamaRunner::Init() {
  const LlamaConfig& config = model_->config();
  const char* why = nullptr;
  if (!CanImplementGqaDecode(config.num_heads, config.num_kv_heads, config.head_dim, &why)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the GPU runner is not built for this model's attention: ", why));
  }
  use_prefill_kernel_ =
      CanImplementGqaPrefill(config.num_heads, config.num_kv_heads, config.head_dim, nullptr);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device_ < 0 || device_ >= count) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device ", device_, " (", count, " visible)"));
  }
  DSA_CUDA_OK(cudaSetDevice(device_), "cudaSetDevice");
  cudaDeviceProp properties{};
  DSA_CUDA_OK(cudaGetDeviceProperties(&properties, device_), "cudaGetDeviceProperties");
  if (properties.major != 9) {
    return absl::FailedPreconditionError(
        absl::StrCat("GPU ", device_, " (", properties.name, ", sm_", properties.major,
                     properties.minor, ") cannot run the sm_90a kernels of the model"));
  }
  description_ = absl::StrCat("cuda:", device_, " (", properties.name, ")");
  std::string error;
  cublas_api_ = LoadCublas(&error);
  if (cublas_api_ == nullptr) return absl::FailedPreconditionError(error);
  DSA_CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device_;
  DSA_CUDA_OK(cudaMemPoolCreate(&pool_, &props), "cudaMemPoolCreate");
  uint64_t keep = std::numeric_limits<uint64_t>::max();
  DSA_CUDA_OK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep),
              "cudaMemPoolSetAttribute");
  if (const cublasStatus_t status = cublas_api_->create(&cublas_);
      status != CUBLAS_STATUS_SUCCESS) {
    cublas_ = nullptr;
    return absl::InternalError(absl::StrCat("cublasCreate: ", cublas_api_->status_string(status)));
  }
  if (cublas_api_->set_stream(cublas_, stream_) != CUBLAS_STATUS_SUCCESS ||
      cublas_api_->set_math_mode(cublas_, CUBLAS_DEFAULT_MATH) != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError("cublasSetStream / cublasSetMathMode failed");
  }

  // The weights: one allocation, every tensor 256-byte aligned.
  struct Piece {
    std::span<const float> host;
    const float** device;
  };
  std::vector<Piece> pieces;
  pieces.push_back({model_->token_embd(), &token_embd_});
  pieces.push_back({model_->output_norm(), &output_norm_});
  layers_.resize(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) {
    const LlamaModel::Layer& w = model_->layer(l);
    DeviceLayer& d = layers_[l];
    pieces.push_back({w.attn_norm, &d.attn_norm});
    pieces.push_back({w.wqkv, &d.wqkv});
    pieces.push_back({w.wo, &d.wo});
    pieces.push_back({w.ffn_norm, &d.ffn_norm});
    pieces.push_back({w.wgate_up, &d.wgate_up});
    pieces.push_back({w.wdown, &d.wdown});
    if (model_->has_indexer()) {
      const LlamaModel::IndexerLayer& iw = model_->indexer_layer(l);
      pieces.push_back({iw.wproj, &d.wproj});
      pieces.push_back({iw.wqb, &d.wqb});
      pieces.push_back({iw.k_norm_weight, &d.k_norm_weight});
      pieces.push_back({iw.k_norm_bias, &d.k_norm_bias});
    }
  }
  int64_t total = 0;
  for (const Piece& piece : pieces) total += AlignUp(static_cast<int64_t>(piece.host.size()));
  DSA_CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&weights_), total * sizeof(float)),
              absl::StrCat("the model's weights (", total * sizeof(float), " bytes)"));
  int64_t offset = 0;
  for (const Piece& piece : pieces) {
    DSA_CUDA_OK(cudaMemcpy(weights_ + offset, piece.host.data(), piece.host.size_bytes(),
                           cudaMemcpyHostToDevice),
                "uploading the weights");
    *piece.device = weights_ + offset;
    offset += AlignUp(static_cast<int64_t>(piece.host.size()));
  }
  theta_ = RopeFrequencies(config.rope_base, config.head_dim);
  if (model_->has_indexer()) {
    const LightningIndexerConfig& ic = model_->indexer_config();
    index_theta_ = RopeFrequencies(ic.rope_base, ic.rope_dims);
  }
  return absl::OkStatus();
}

CudaLlamaRunner::~CudaLlamaRunner() {
  (void)cudaSetDevice(device_);
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  if (cublas_ != nullptr) (void)cublas_api_->destroy(cublas_);
  for (const PinnedBuffer& buffer : pinned_) {
    (void)cudaFreeHost(buffer.data);
    (void)cudaEventDestroy(buffer.copied);
  }
  if (weights_ != nullptr) (void)cudaFree(weights_);
  if (pool_ != nullptr) (void)cudaMemPoolDestroy(pool_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

absl::Status CudaLlamaRunner::AcquirePinned(size_t bytes, PinnedBuffer* out) {
  // The smallest free buffer that fits, else the largest grown to fit.
  auto best = pinned_.end();
  for (auto it = pinned_.begin(); it != pinned_.end(); ++it) {
    if (it->bytes >= bytes && (best == pinned_.end() || it->bytes < best->bytes)) best = it;
  }
  if (best != pinned_.end()) {
    *out = *best;
    pinned_.erase(best);
    return absl::OkStatus();
  }
  PinnedBuffer buffer;
  if (!pinned_.empty()) {  // grow the largest free one
    auto largest = std::max_element(
        pinned_.begin(), pinned_.end(),
        [](const PinnedBuffer& a, const PinnedBuffer& b) { return a.bytes < b.bytes; });
    buffer = *largest;
    pinned_.erase(largest);
    DSA_CUDA_OK(cudaEventSynchronize(buffer.copied), "waiting for a staging buffer");
    (void)cudaFreeHost(buffer.data);
    buffer.data = nullptr;
    buffer.bytes = 0;
  } else {
    DSA_CUDA_OK(cudaEventCreateWithFlags(&buffer.copied, cudaEventDisableTiming),
                "cudaEventCreate");
  }
  const size_t size = std::max<size_t>(size_t{64} << 10, std::bit_ceil(bytes));
  const cudaError_t error = cudaHostAlloc(&buffer.data, size, cudaHostAllocDefault);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaEventDestroy(buffer.copied);
    return CudaStatus(error, "a pinned staging buffer");
  }
  buffer.bytes = size;
  *out = buffer;
  return absl::OkStatus();
}

absl::Status CudaLlamaRunner::Reserve(CudaLlamaCache* cache, int64_t slots) {
  if (slots <= cache->capacity_) return absl::OkStatus();
  const LlamaConfig& c = config();
  const int64_t capacity = std::min<int64_t>(
      c.context_length, std::max({slots, 2 * cache->capacity_, static_cast<int64_t>(64)}));
  void* base = nullptr;
  DSA_RETURN_IF_ERROR(
      Allocate(sizeof(float) * 2 * static_cast<size_t>(c.num_layers) * capacity * c.kv_dim(), &base,
               "a sequence's KV cache"));
  CudaLlamaCache grown(this);
  grown.base_ = static_cast<float*>(base);
  grown.capacity_ = capacity;
  absl::Status copied = CopySlots(*cache, &grown, cache->num_slots_);
  if (!copied.ok()) {
    Free(grown.base_);
    grown.base_ = nullptr;
    return copied;
  }
  Free(cache->base_);
  cache->base_ = grown.base_;
  cache->capacity_ = capacity;
  grown.base_ = nullptr;  // owned by `cache` now
  return absl::OkStatus();
}

absl::Status CudaLlamaRunner::CopySlots(const CudaLlamaCache& source, CudaLlamaCache* target,
                                        int64_t slots) {
  if (slots == 0 || source.base_ == nullptr) return absl::OkStatus();
  const int64_t row_bytes = static_cast<int64_t>(config().kv_dim()) * sizeof(float);
  DSA_CUDA_OK(cudaMemcpy2DAsync(target->base_, target->capacity_ * row_bytes, source.base_,
                                source.capacity_ * row_bytes, slots * row_bytes,
                                2 * static_cast<size_t>(config().num_layers),
                                cudaMemcpyDeviceToDevice, stream_),
              "copying a KV cache");
  return absl::OkStatus();
}

absl::Status CudaLlamaRunner::Gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                                   int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                                   int64_t ldc) {
  if (m == 0 || n == 0) return absl::OkStatus();
  // Column-major: c^T [n, m] = b^T^T [n, k] a^T [k, m].
  const cublasStatus_t status =
      cublas_api_->sgemm(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                         static_cast<int>(m), static_cast<int>(k), &alpha, b, static_cast<int>(ldb),
                         a, static_cast<int>(lda), &beta, c, static_cast<int>(ldc));
  if (status != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasSgemm [", m, ", ", n, ", ", k,
                                            "]: ", cublas_api_->status_string(status)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LlamaPass>> CudaLlamaRunner::Begin(
    std::vector<LlamaRunnerRow> rows) {
  const LlamaConfig& c = config();
  auto grouped = GroupLlamaRows<CudaLlamaCache>(
      "LlamaRunner::Begin", c.vocab_size, c.context_length, rows,
      [&](size_t r) -> absl::StatusOr<CudaLlamaCache*> {
        if (rows[r].cache == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("LlamaRunner::Begin: row ", r, " has no cache"));
        }
        if (rows[r].cache->runner() != this) {
          return absl::InvalidArgumentError(
              absl::StrCat("LlamaRunner::Begin: row ", r, "'s cache belongs to another runner"));
        }
        return static_cast<CudaLlamaCache*>(rows[r].cache);
      });
  if (!grouped.ok()) return grouped.status();
  std::vector<CudaLlamaPass::CacheGroup> groups = *std::move(grouped);
  auto held = lock();
  for (const CudaLlamaPass::CacheGroup& group : groups) {
    if (group.cache->in_pass_) {
      return absl::FailedPreconditionError("LlamaRunner::Begin: a cache is in another pass");
    }
  }
  for (const CudaLlamaPass::CacheGroup& group : groups) {
    DSA_RETURN_IF_ERROR(Reserve(
        group.cache, group.first_position + static_cast<int64_t>(group.rows_by_position.size())));
  }
  auto pass = std::make_unique<CudaLlamaPass>(this, std::move(rows), std::move(groups));
  if (absl::Status started = pass->Start(); !started.ok()) {
    pass->Release();
    held.unlock();  // the pass's destructor takes the lock
    return started;
  }
  return std::unique_ptr<LlamaPass>(std::move(pass));
}

// ---- CudaLlamaPass ----

CudaLlamaPass::~CudaLlamaPass() {
  auto held = runner_->lock();
  Release();
}

void CudaLlamaPass::Release() {
  runner_->Free(workspace_);
  runner_->Free(plan_);
  runner_->Free(scratch_);
  workspace_ = nullptr;
  plan_ = nullptr;
  scratch_ = nullptr;
  for (PinnedBuffer& buffer : staging_) {
    runner_->ReleasePinned(buffer);
    buffer = PinnedBuffer{};
  }
  for (const CacheGroup& group : groups_) group.cache->in_pass_ = false;
  groups_.clear();
}

absl::Status CudaLlamaPass::Start() {
  const LlamaModel& model = runner_->model();
  const LlamaConfig& c = model.config();
  const int64_t n = num_rows(), d = c.d_model, pairs = c.head_dim / 2;
  const bool indexer = model.has_indexer();
  const LightningIndexerConfig& ic = model.indexer_config();
  const int64_t ih = indexer ? ic.num_heads : 0, idk = indexer ? ic.head_dim : 0;
  const int64_t index_width = indexer ? ic.query_rank + idk + ih : 0;
  const int64_t index_pairs = indexer ? ic.rope_dims / 2 : 0;
  const int64_t chunk = std::min(n, kFfnChunkRows);
  // The workspace's parts, in floats (int32 and LlamaRowCache rounded up).
  std::vector<std::pair<float**, int64_t>> parts = {
      {&h_, n * d},
      {&x_, n * d},
      {&qkv_, n * (c.q_dim() + 2 * c.kv_dim())},
      {&attn_, n * c.q_dim()},
      {&gate_up_, chunk * 2 * c.ffn_dim},
      {&index_proj_, n * index_width},
      {&index_queries_, n * ih * idk},
      {&head_weights_, n * ih},
      {&index_keys_, n * idk},
      {&rope_cos_, n * pairs},
      {&rope_sin_, n * pairs},
      {&index_cos_, n * index_pairs},
      {&index_sin_, n * index_pairs},
  };
  float* tokens_part = nullptr;
  float* caches_part = nullptr;
  parts.push_back({&tokens_part, n});
  parts.push_back({&caches_part, n * static_cast<int64_t>(sizeof(LlamaRowCache) / sizeof(float))});
  int64_t total = 0;
  for (const auto& part : parts) total += AlignUp(part.second);
  for (const CacheGroup& group : groups_) group.cache->in_pass_ = true;
  DSA_RETURN_IF_ERROR(runner_->Allocate(total * sizeof(float), &workspace_, "a pass's workspace"));
  int64_t offset = 0;
  for (const auto& part : parts) {
    *part.first = static_cast<float*>(workspace_) + offset;
    offset += AlignUp(part.second);
  }
  tokens_ = reinterpret_cast<int32_t*>(tokens_part);
  caches_ = reinterpret_cast<LlamaRowCache*>(caches_part);

  // The rows: tokens, caches, RoPE tables (as the CPU computes them).
  std::vector<int32_t> tokens(n);
  std::vector<LlamaRowCache> caches(n);
  std::vector<float> cos(n * pairs), sin(n * pairs);
  std::vector<float> index_cos(n * index_pairs), index_sin(n * index_pairs);
  for (int64_t r = 0; r < n; ++r) {
    const LlamaRunnerRow& row = rows_[r];
    const auto* cache = static_cast<const CudaLlamaCache*>(row.cache);
    tokens[r] = row.token;
    caches[r] = LlamaRowCache{cache->base_, cache->capacity_, row.position, 0};
    RopeAngles(row.position, runner_->theta(), &cos[r * pairs], &sin[r * pairs]);
    if (index_pairs > 0) {
      RopeAngles(row.position, runner_->index_theta(), &index_cos[r * index_pairs],
                 &index_sin[r * index_pairs]);
    }
  }
  const cudaStream_t stream = runner_->stream();
  const auto upload = [&](void* device, const void* host, size_t bytes) {
    return bytes == 0 ? cudaSuccess
                      : cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream);
  };
  DSA_CUDA_OK(upload(tokens_, tokens.data(), n * sizeof(int32_t)), "uploading a pass's rows");
  DSA_CUDA_OK(upload(caches_, caches.data(), n * sizeof(LlamaRowCache)), "uploading a pass's rows");
  DSA_CUDA_OK(upload(rope_cos_, cos.data(), cos.size() * sizeof(float)), "uploading RoPE");
  DSA_CUDA_OK(upload(rope_sin_, sin.data(), sin.size() * sizeof(float)), "uploading RoPE");
  DSA_CUDA_OK(upload(index_cos_, index_cos.data(), index_cos.size() * sizeof(float)),
              "uploading RoPE");
  DSA_CUDA_OK(upload(index_sin_, index_sin.data(), index_sin.size() * sizeof(float)),
              "uploading RoPE");
  EmbeddingGatherParams gather;
  gather.table = runner_->token_embd();
  gather.tokens = tokens_;
  gather.out = h_;
  gather.rows = static_cast<int>(n);
  gather.width = static_cast<int>(d);
  DSA_CUDA_OK(LaunchEmbeddingGather(gather, stream), "the embedding gather");
  return absl::OkStatus();
}

absl::Status CudaLlamaPass::ComputeLayerInput() {
  if (x_layer_ == layer_) return absl::OkStatus();
  const LlamaConfig& c = runner_->config();
  RmsNormParams norm;
  norm.x = h_;
  norm.x_stride = c.d_model;
  norm.weight = runner_->layer(layer_).attn_norm;
  norm.out = x_;
  norm.out_stride = c.d_model;
  norm.rows = num_rows();
  norm.width = c.d_model;
  norm.eps = c.rms_eps;
  DSA_CUDA_OK(LaunchRmsNorm(norm, runner_->stream()), "the attention's RMSNorm");
  x_layer_ = layer_;
  return absl::OkStatus();
}

absl::Status CudaLlamaPass::IndexerInputs(std::span<float> queries, std::span<float> head_weights,
                                          std::span<float> index_keys) {
  const LlamaModel& model = runner_->model();
  if (!model.has_indexer()) {
    return absl::FailedPreconditionError("LlamaPass::IndexerInputs: the model has no indexer");
  }
  if (done()) return absl::FailedPreconditionError("LlamaPass::IndexerInputs: the pass is done");
  DSA_RETURN_IF_ERROR(failed_);
  const LightningIndexerConfig& ic = model.indexer_config();
  const int64_t n = num_rows(), h = ic.num_heads, dk = ic.head_dim, rank = ic.query_rank;
  if (static_cast<int64_t>(queries.size()) != n * h * dk ||
      static_cast<int64_t>(head_weights.size()) != n * h ||
      static_cast<int64_t>(index_keys.size()) != n * dk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LlamaPass::IndexerInputs: expected queries [", n, ", ", h, ", ", dk, "], head_weights [",
        n, ", ", h, "], index_keys [", n, ", ", dk, "] values; got ", queries.size(), ", ",
        head_weights.size(), ", ", index_keys.size()));
  }
  auto held = runner_->lock();
  const absl::Status status = [&]() -> absl::Status {
    DSA_RETURN_IF_ERROR(ComputeLayerInput());
    const DeviceLayer& layer = runner_->layer(layer_);
    const int64_t d = runner_->config().d_model, width = rank + dk + h;
    DSA_RETURN_IF_ERROR(
        runner_->Gemm(n, width, d, 1.0f, x_, d, layer.wproj, d, 0.0f, index_proj_, width));
    DSA_RETURN_IF_ERROR(runner_->Gemm(n, h * dk, rank, 1.0f, index_proj_, width, layer.wqb, rank,
                                      0.0f, index_queries_, h * dk));
    IndexerHeadsParams heads;
    heads.proj = index_proj_;
    heads.queries = index_queries_;
    heads.head_weights = head_weights_;
    heads.index_keys = index_keys_;
    heads.k_norm_weight = layer.k_norm_weight;
    heads.k_norm_bias = layer.k_norm_bias;
    heads.cos = index_cos_;
    heads.sin = index_sin_;
    heads.rows = static_cast<int>(n);
    heads.num_heads = static_cast<int>(h);
    heads.head_dim = static_cast<int>(dk);
    heads.query_rank = static_cast<int>(rank);
    heads.rope_dims = ic.rope_dims;
    heads.k_norm_eps = ic.k_norm_eps;
    heads.head_weight_scale = ic.head_weight_scale();
    const cudaStream_t stream = runner_->stream();
    DSA_CUDA_OK(LaunchIndexerHeads(heads, stream), "the indexer's heads");
    DSA_CUDA_OK(cudaMemcpyAsync(queries.data(), index_queries_, queries.size_bytes(),
                                cudaMemcpyDeviceToHost, stream),
                "copying the indexer queries");
    DSA_CUDA_OK(cudaMemcpyAsync(head_weights.data(), head_weights_, head_weights.size_bytes(),
                                cudaMemcpyDeviceToHost, stream),
                "copying the head weights");
    DSA_CUDA_OK(cudaMemcpyAsync(index_keys.data(), index_keys_, index_keys.size_bytes(),
                                cudaMemcpyDeviceToHost, stream),
                "copying the index keys");
    DSA_CUDA_OK(cudaStreamSynchronize(stream), "the indexer inputs");
    return absl::OkStatus();
  }();
  return status.ok() ? status : Fail(status);
}

template <typename Params>
Params CudaLlamaPass::GqaParams() const {
  const LlamaConfig& c = runner_->config();
  Params p;
  p.queries = qkv_;
  p.query_stride = c.q_dim() + 2 * c.kv_dim();
  p.caches = caches_;
  p.layer = layer_;
  p.num_heads = c.num_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  p.out = attn_;
  p.out_stride = c.q_dim();
  return p;
}

absl::Status CudaLlamaPass::Attention(std::span<const std::span<const int32_t>> selections) {
  const LlamaConfig& c = runner_->config();
  // The plan: decode entries (selected rows; dense rows of small groups) and prefill tiles (the
  // dense rows of large groups, 64 at a time in increasing position).
  std::vector<int32_t> entry_rows, offsets = {0}, flat, tile_rows;
  std::vector<GqaPrefillTile> tiles;
  std::vector<int64_t> tile_last_position;
  int64_t max_entry_slots = 0;
  for (const CacheGroup& group : groups_) {
    std::vector<int32_t> dense;
    for (const int32_t r : group.rows_by_position) {
      if (selections.empty() || selections[r].empty()) {
        dense.push_back(r);
        continue;
      }
      entry_rows.push_back(r);
      flat.insert(flat.end(), selections[r].begin(), selections[r].end());
      offsets.push_back(static_cast<int32_t>(flat.size()));
      max_entry_slots = std::max<int64_t>(max_entry_slots, selections[r].size());
    }
    if (runner_->use_prefill_kernel() && static_cast<int>(dense.size()) >= kPrefillMinRows) {
      for (size_t begin = 0; begin < dense.size(); begin += kGqaPrefillTileRows) {
        const size_t end = std::min(dense.size(), begin + kGqaPrefillTileRows);
        tiles.push_back(
            {static_cast<int32_t>(tile_rows.size()), static_cast<int32_t>(end - begin)});
        tile_last_position.push_back(rows_[dense[end - 1]].position);
        tile_rows.insert(tile_rows.end(), dense.begin() + begin, dense.begin() + end);
      }
    } else {
      for (const int32_t r : dense) {
        entry_rows.push_back(r);
        offsets.push_back(static_cast<int32_t>(flat.size()));
        max_entry_slots = std::max<int64_t>(max_entry_slots, rows_[r].position + 1);
      }
    }
  }
  // The longest tiles first (the causal triangle's work is uneven).
  std::vector<size_t> order(tiles.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tile_last_position[a] > tile_last_position[b];
  });
  const size_t num_entries = entry_rows.size(), num_tiles = tiles.size();
  plan_host_.clear();
  plan_host_.insert(plan_host_.end(), entry_rows.begin(), entry_rows.end());
  plan_host_.insert(plan_host_.end(), offsets.begin(), offsets.end());
  plan_host_.insert(plan_host_.end(), flat.begin(), flat.end());
  plan_host_.insert(plan_host_.end(), tile_rows.begin(), tile_rows.end());
  for (const size_t i : order) {
    plan_host_.push_back(tiles[i].first);
    plan_host_.push_back(tiles[i].count);
  }
  const cudaStream_t stream = runner_->stream();
  if (plan_host_.size() > plan_capacity_) {
    runner_->Free(plan_);
    plan_ = nullptr;
    plan_capacity_ = 0;
    const size_t capacity = std::max<size_t>(plan_host_.size() * 2, 1024);
    void* plan = nullptr;
    DSA_RETURN_IF_ERROR(
        runner_->Allocate(capacity * sizeof(int32_t), &plan, "a layer's attention plan"));
    plan_ = static_cast<int32_t*>(plan);
    plan_capacity_ = capacity;
  }
  const size_t plan_bytes = plan_host_.size() * sizeof(int32_t);
  PinnedBuffer& staging = staging_[next_staging_];
  next_staging_ ^= 1;
  if (staging.bytes < plan_bytes) {
    runner_->ReleasePinned(staging);
    staging = PinnedBuffer{};
    DSA_RETURN_IF_ERROR(runner_->AcquirePinned(plan_bytes, &staging));
  }
  DSA_CUDA_OK(cudaEventSynchronize(staging.copied), "waiting for a staging buffer");
  std::memcpy(staging.data, plan_host_.data(), plan_bytes);
  DSA_CUDA_OK(cudaMemcpyAsync(plan_, staging.data, plan_bytes, cudaMemcpyHostToDevice, stream),
              "uploading the selections");
  DSA_CUDA_OK(cudaEventRecord(staging.copied, stream), "recording a staging buffer's copy");
  const int32_t* plan = plan_;
  if (num_entries > 0) {
    const size_t scratch =
        GqaDecodeScratchBytes(static_cast<int>(num_entries), static_cast<int>(max_entry_slots),
                              c.num_heads, c.num_kv_heads, c.head_dim);
    if (scratch > scratch_capacity_) {
      runner_->Free(scratch_);
      scratch_ = nullptr;
      scratch_capacity_ = 0;
      DSA_RETURN_IF_ERROR(runner_->Allocate(scratch * 2, &scratch_, "the attention's scratch"));
      scratch_capacity_ = scratch * 2;
    }
    auto decode = GqaParams<GqaDecodeParams>();
    decode.entry_rows = plan;
    decode.selection_offsets = plan + num_entries;
    decode.selections = plan + 2 * num_entries + 1;
    decode.num_entries = static_cast<int>(num_entries);
    decode.max_entry_slots = static_cast<int>(max_entry_slots);
    decode.scratch = scratch_;
    DSA_CUDA_OK(LaunchGqaDecode(decode, stream), "the sparse GQA decode");
  }
  if (num_tiles > 0) {
    const int32_t* tile_rows_device = plan + 2 * num_entries + 1 + flat.size();
    auto prefill = GqaParams<GqaPrefillParams>();
    prefill.tile_rows = tile_rows_device;
    prefill.tiles = reinterpret_cast<const GqaPrefillTile*>(tile_rows_device + tile_rows.size());
    prefill.num_tiles = static_cast<int>(num_tiles);
    DSA_CUDA_OK(LaunchGqaPrefill(prefill, stream), "the dense causal prefill attention");
  }
  return absl::OkStatus();
}

absl::Status CudaLlamaPass::RunLayer(std::span<const std::span<const int32_t>> selections) {
  if (done()) return absl::FailedPreconditionError("LlamaPass::RunLayer: the pass is done");
  DSA_RETURN_IF_ERROR(failed_);
  DSA_RETURN_IF_ERROR(CheckLlamaSelections("LlamaPass::RunLayer", rows_, selections, seen_));
  auto held = runner_->lock();
  const absl::Status status = [&]() -> absl::Status {
    const LlamaConfig& c = runner_->config();
    const DeviceLayer& layer = runner_->layer(layer_);
    const int64_t n = num_rows(), d = c.d_model, q = c.q_dim(), f = c.ffn_dim;
    const int64_t width = q + 2 * c.kv_dim();
    const cudaStream_t stream = runner_->stream();
    DSA_RETURN_IF_ERROR(ComputeLayerInput());
    DSA_RETURN_IF_ERROR(runner_->Gemm(n, width, d, 1.0f, x_, d, layer.wqkv, d, 0.0f, qkv_, width));
    RopeKvWriteParams rope;
    rope.qkv = qkv_;
    rope.cos = rope_cos_;
    rope.sin = rope_sin_;
    rope.caches = caches_;
    rope.rows = static_cast<int>(n);
    rope.num_heads = c.num_heads;
    rope.num_kv_heads = c.num_kv_heads;
    rope.head_dim = c.head_dim;
    rope.layer = layer_;
    DSA_CUDA_OK(LaunchRopeKvWrite(rope, stream), "RoPE and the KV write");
    DSA_RETURN_IF_ERROR(Attention(selections));
    // h += Wo o (the residual add is the GEMM's beta = 1).
    DSA_RETURN_IF_ERROR(runner_->Gemm(n, d, q, 1.0f, attn_, q, layer.wo, q, 1.0f, h_, d));
    // h += Wdown (silu(Wgate y) * (Wup y)), y = RMSNorm(h) * ffn_norm, in chunks of rows.
    RmsNormParams norm;
    norm.x = h_;
    norm.x_stride = d;
    norm.weight = layer.ffn_norm;
    norm.out = x_;
    norm.out_stride = d;
    norm.rows = static_cast<int>(n);
    norm.width = static_cast<int>(d);
    norm.eps = c.rms_eps;
    DSA_CUDA_OK(LaunchRmsNorm(norm, stream), "the feed-forward's RMSNorm");
    x_layer_ = -1;  // x_ holds y now
    const int64_t chunk = std::min(n, kFfnChunkRows);
    for (int64_t r0 = 0; r0 < n; r0 += chunk) {
      const int64_t rows = std::min(chunk, n - r0);
      DSA_RETURN_IF_ERROR(runner_->Gemm(rows, 2 * f, d, 1.0f, x_ + r0 * d, d, layer.wgate_up, d,
                                        0.0f, gate_up_, 2 * f));
      SwiGluParams swiglu;
      swiglu.gate_up = gate_up_;
      swiglu.rows = static_cast<int>(rows);
      swiglu.ffn_dim = static_cast<int>(f);
      DSA_CUDA_OK(LaunchSwiGlu(swiglu, stream), "SwiGLU");
      DSA_RETURN_IF_ERROR(
          runner_->Gemm(rows, d, f, 1.0f, gate_up_, 2 * f, layer.wdown, f, 1.0f, h_ + r0 * d, d));
    }
    return absl::OkStatus();
  }();
  if (!status.ok()) return Fail(status);
  ++layer_;
  if (done()) {
    for (const CacheGroup& group : groups_) {
      group.cache->num_slots_ =
          group.first_position + static_cast<int64_t>(group.rows_by_position.size());
      group.cache->in_pass_ = false;
    }
    groups_.clear();
  }
  return absl::OkStatus();
}

absl::Status CudaLlamaPass::Logits(std::span<const int32_t> row_indices, std::span<float> out) {
  const LlamaConfig& c = runner_->config();
  if (!done()) {
    return absl::FailedPreconditionError(
        absl::StrCat("LlamaPass: the pass is at layer ", layer_, " of ", c.num_layers));
  }
  DSA_RETURN_IF_ERROR(failed_);
  const int64_t d = c.d_model, vocab = c.vocab_size;
  const auto m = static_cast<int64_t>(row_indices.size());
  if (static_cast<int64_t>(out.size()) != m * vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("LlamaPass::Logits: out has ", out.size(), " values, expected ", m * vocab));
  }
  for (const int32_t r : row_indices) {
    if (r < 0 || r >= num_rows()) {
      return absl::InvalidArgumentError(
          absl::StrCat("LlamaPass: row index ", r, " outside [0, ", num_rows(), ")"));
    }
  }
  if (m == 0) return absl::OkStatus();
  auto held = runner_->lock();
  void* buffer = nullptr;
  const int64_t hidden_floats = AlignUp(m * d), logits_floats = AlignUp(m * vocab);
  DSA_RETURN_IF_ERROR(
      runner_->Allocate(sizeof(float) * (hidden_floats + logits_floats) + sizeof(int32_t) * m,
                        &buffer, "the logits"));
  float* hidden = static_cast<float*>(buffer);
  float* logits = hidden + hidden_floats;
  auto* indices = reinterpret_cast<int32_t*>(logits + logits_floats);
  const cudaStream_t stream = runner_->stream();
  const absl::Status status = [&]() -> absl::Status {
    DSA_CUDA_OK(cudaMemcpyAsync(indices, row_indices.data(), m * sizeof(int32_t),
                                cudaMemcpyHostToDevice, stream),
                "uploading the logits' rows");
    RmsNormParams norm;
    norm.x = h_;
    norm.x_stride = d;
    norm.row_indices = indices;
    norm.weight = runner_->output_norm();
    norm.out = hidden;
    norm.out_stride = d;
    norm.rows = static_cast<int>(m);
    norm.width = static_cast<int>(d);
    norm.eps = c.rms_eps;
    DSA_CUDA_OK(LaunchRmsNorm(norm, stream), "the output RMSNorm");
    DSA_RETURN_IF_ERROR(
        runner_->Gemm(m, vocab, d, 1.0f, hidden, d, runner_->token_embd(), d, 0.0f, logits, vocab));
    DSA_CUDA_OK(
        cudaMemcpyAsync(out.data(), logits, out.size_bytes(), cudaMemcpyDeviceToHost, stream),
        "copying the logits");
    DSA_CUDA_OK(cudaStreamSynchronize(stream), "the logits");
    return absl::OkStatus();
  }();
  runner_->Free(buffer);
  return status.ok() ? status : Fail(status);
}

}  // namespace

absl::StatusOr<std::shared_ptr<LlamaRunner>> CreateCudaLlamaRunner(
    std::shared_ptr<const LlamaModel> model, const CudaLlamaRunnerOptions& options) {
  if (model == nullptr) return absl::InvalidArgumentError("CreateCudaLlamaRunner: no model");
  auto runner = std::make_shared<CudaLlamaRunner>(std::move(model), options.device);
  DSA_RETURN_IF_ERROR(runner->Init());
  return std::shared_ptr<LlamaRunner>(std::move(runner));
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace dsa::cuda
