// The real model's GPU runner (see llama_cuda_runner.h): the weights upload, the KV caches and the
// start of a pass; the pass itself is in llama_cuda_pass.cc.
#include "attention_worker/cuda/llama_cuda_runner.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/cuda/cublas_library.h"
#include "attention_worker/cuda/gqa_attention.h"
#include "attention_worker/cuda/llama_cuda_runner_internal.h"
#include "attention_worker/llama_pass_rules.h"
#include "common/status_macros.h"

namespace dsa::cuda {
namespace llama_internal {

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

}  // namespace llama_internal

using llama_internal::CudaLlamaRunner;

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
