// The GPU LLaMA runner's pass (see llama_cuda_runner.h): the workspace and the row uploads, then
// per layer the indexer's inputs, the attention (prefill or decode kernel) and the feed-forward,
// then the logits. Its runner, caches and weights are in llama_cuda_runner.cc.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/cuda/gqa_attention.h"
#include "attention_worker/cuda/llama_cuda_runner_internal.h"
#include "attention_worker/cuda/llama_kernels.h"
#include "attention_worker/cuda/llama_kv_layout.h"
#include "attention_worker/llama_pass_rules.h"
#include "common/status_macros.h"

namespace dsa::cuda::llama_internal {
namespace {

// A cache's rows of one pass at or above this many dense rows run the tiled prefill kernel (when
// it is built for the shape); fewer (decode, verifier rows) run the split decode kernel.
constexpr int kPrefillMinRows = 16;
// Rows of one feed-forward chunk (bounds the [rows, 2 ffn_dim] scratch: 50 MB at SmolLM2's shape).
constexpr int64_t kFfnChunkRows = 4096;

}  // namespace

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

}  // namespace dsa::cuda::llama_internal
