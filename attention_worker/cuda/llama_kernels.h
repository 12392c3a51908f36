// The real model's per-row GPU kernels (docs/model.md, "The forward pass"): the embedding gather,
// RMSNorm, RoPE with the KV-cache write, SwiGLU, and the lightning indexer's key LayerNorm, RoPE
// and head weights. The matrices are cuBLAS GEMMs (llama_cuda_runner.cc); attention is in
// gqa_attention.h. Framework-free: device pointers, sizes, a stream, a cudaError_t back
// (cudaErrorInvalidValue for bad params, else the launch's error). Their CPU reference is
// LlamaForward (attention_worker/llama_model.h), which the runner's tests compare with.
// Every kernel runs asynchronously on `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "attention_worker/cuda/llama_kv_layout.h"

namespace dsa::cuda {

/// out[r, :] = table[tokens[r], :] (the token embedding).
struct EmbeddingGatherParams {
  const float* table = nullptr;     // device fp32 [vocab, width]
  const int32_t* tokens = nullptr;  // device int32 [rows], each in [0, vocab) (checked on the host)
  float* out = nullptr;             // device fp32 [rows, width]
  int rows = 0;                     // >= 1
  int width = 0;                    // >= 1
};
cudaError_t LaunchEmbeddingGather(const EmbeddingGatherParams& params, cudaStream_t stream);

/// out[i, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight, r = row_indices[i] (or i when
/// row_indices is null); the sum of squares in double, as the CPU.
struct RmsNormParams {
  const float* x = nullptr;              // device fp32 [*, x_stride]
  int64_t x_stride = 0;                  // values between rows of x, >= width
  const int32_t* row_indices = nullptr;  // device int32 [rows] or null (identity)
  const float* weight = nullptr;         // device fp32 [width]
  float* out = nullptr;                  // device fp32 [rows, out_stride]
  int64_t out_stride = 0;                // >= width
  int rows = 0;                          // >= 1
  int width = 0;                         // >= 1
  float eps = 0;                         // > 0
};
cudaError_t LaunchRmsNorm(const RmsNormParams& params, cudaStream_t stream);

/// RoPE over adjacent pairs (2j, 2j+1) of every query and key head of each qkv row (in place), then
/// the row's key and value written to slot `position` of its cache's layer `layer`.
struct RopeKvWriteParams {
  float* qkv = nullptr;                   // device fp32 [rows, q_dim + 2 kv_dim]: q | k | v
  const float* cos = nullptr;             // device fp32 [rows, head_dim / 2]
  const float* sin = nullptr;             // device fp32 [rows, head_dim / 2]
  const LlamaRowCache* caches = nullptr;  // device [rows]
  int rows = 0;                           // >= 1
  int num_heads = 0;                      // query heads, >= 1
  int num_kv_heads = 0;                   // >= 1
  int head_dim = 0;                       // even, >= 2
  int layer = 0;                          // the cache layer written, >= 0
};
cudaError_t LaunchRopeKvWrite(const RopeKvWriteParams& params, cudaStream_t stream);

/// gate_up[r, i] = silu(gate_up[r, i]) * gate_up[r, ffn_dim + i] for i < ffn_dim (in place: the
/// first half of each row becomes the down projection's input).
struct SwiGluParams {
  float* gate_up = nullptr;  // device fp32 [rows, 2 ffn_dim]: gate | up
  int rows = 0;              // >= 1
  int ffn_dim = 0;           // >= 1
};
cudaError_t LaunchSwiGlu(const SwiGluParams& params, cudaStream_t stream);

/// The lightning indexer's row-wise part (docs/model.md, "The lightning indexer"), after the two
/// GEMMs: queries get RoPE on dims [0, rope_dims) of each head (in place); the key is
/// RoPE(LayerNorm(k_raw)) (mean and variance in double); the head weights are w_raw * scale.
struct IndexerHeadsParams {
  const float* proj = nullptr;           // device fp32 [rows, query_rank + head_dim + num_heads]:
                                         // Wqa x | Wk x | Ww x
  float* queries = nullptr;              // device fp32 [rows, num_heads * head_dim], in place
  float* head_weights = nullptr;         // device fp32 [rows, num_heads] (out)
  float* index_keys = nullptr;           // device fp32 [rows, head_dim] (out)
  const float* k_norm_weight = nullptr;  // device fp32 [head_dim]
  const float* k_norm_bias = nullptr;    // device fp32 [head_dim]
  const float* cos = nullptr;            // device fp32 [rows, rope_dims / 2]
  const float* sin = nullptr;            // device fp32 [rows, rope_dims / 2]
  int rows = 0;                          // >= 1
  int num_heads = 0;                     // >= 1
  int head_dim = 0;                      // >= 1
  int query_rank = 0;                    // >= 1
  int rope_dims = 0;                     // even, in [0, head_dim]
  float k_norm_eps = 0;                  // > 0
  float head_weight_scale = 0;           // num_heads^-1/2 * head_dim^-1/2
};
cudaError_t LaunchIndexerHeads(const IndexerHeadsParams& params, cudaStream_t stream);

}  // namespace dsa::cuda
