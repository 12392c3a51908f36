// Seeded random LLaMA models with a lightning indexer, for the tests of the real model's CPU and
// GPU paths (the engine over the seam, the CUDA runner against the CPU one). The weights are
// scaled so that activations stay O(1) through a few layers: projections ~ N(0, 1/d_in), norms
// ~ N(1, 0.1), the QKV projection twice that so that attention is not uniform.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "attention_worker/llama_model.h"
#include "gtest/gtest.h"

namespace dsa::testing {

/// n draws of N(mean, stddev^2) from `rng`, in order.
inline std::vector<float> NormalVector(std::mt19937& rng, int64_t n, float stddev, float mean = 0) {
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

/// The vocabulary of TinyLlamaConfig's models.
inline constexpr int kTinyLlamaVocab = 50;

/// A small LLaMA config: `num_layers` layers, d_model 32, 4 query heads and 2 KV heads of 8 dims,
/// FFN 48, vocabulary 50 (BOS 1, EOS 2), RoPE base 10^4.
inline LlamaConfig TinyLlamaConfig(int num_layers, int context_length) {
  LlamaConfig c;
  c.num_layers = num_layers;
  c.d_model = 32;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.ffn_dim = 48;
  c.vocab_size = kTinyLlamaVocab;
  c.context_length = context_length;
  c.rope_base = 10000.0;
  c.rms_eps = 1e-5f;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  return c;
}

/// An indexer on every layer of `c`: `num_heads` x `head_dim`, query rank 8, RoPE on 8 dims.
inline LightningIndexerConfig TinyIndexerConfig(const LlamaConfig& c, int num_heads = 4,
                                                int head_dim = 16) {
  LightningIndexerConfig ic;
  ic.num_layers = c.num_layers;
  ic.num_heads = num_heads;
  ic.head_dim = head_dim;
  ic.query_rank = 8;
  ic.rope_dims = 8;
  ic.rope_base = 10000.0;
  return ic;
}

/// The model of `c` and `ic` with weights drawn from mt19937(seed): each layer's backbone then
/// indexer weights, then the final norm and the embedding. Null (and a test failure) when
/// LlamaModel::FromWeights refuses the configs.
inline std::shared_ptr<const LlamaModel> RandomLlamaModel(const LlamaConfig& c,
                                                          const LightningIndexerConfig& ic,
                                                          uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t d = c.d_model;
  const float s = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<LlamaModel::Layer> layers(c.num_layers);
  std::vector<LlamaModel::IndexerLayer> indexers(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    LlamaModel::Layer& layer = layers[l];
    layer.attn_norm = NormalVector(rng, d, 0.1f, 1.0f);
    layer.wqkv = NormalVector(rng, (c.q_dim() + 2 * c.kv_dim()) * d, 2 * s);
    layer.wo = NormalVector(rng, d * c.q_dim(), s);
    layer.ffn_norm = NormalVector(rng, d, 0.1f, 1.0f);
    layer.wgate_up = NormalVector(rng, 2 * c.ffn_dim * d, s);
    layer.wdown = NormalVector(rng, d * c.ffn_dim, 1.0f / std::sqrt(static_cast<float>(c.ffn_dim)));
    LlamaModel::IndexerLayer& indexer = indexers[l];
    indexer.wproj = NormalVector(rng, (ic.query_rank + ic.head_dim + ic.num_heads) * d, s);
    indexer.wqb = NormalVector(rng, ic.num_heads * ic.head_dim * ic.query_rank,
                               1.0f / std::sqrt(static_cast<float>(ic.query_rank)));
    indexer.k_norm_weight = NormalVector(rng, ic.head_dim, 0.1f, 1.0f);
    indexer.k_norm_bias = NormalVector(rng, ic.head_dim, 0.1f);
  }
  std::vector<float> final_norm = NormalVector(rng, d, 0.1f, 1.0f);
  std::vector<float> embedding = NormalVector(rng, c.vocab_size * d, 1.0f);
  auto model = LlamaModel::FromWeights(c, std::move(embedding), std::move(final_norm),
                                       std::move(layers), ic, std::move(indexers));
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

}  // namespace dsa::testing
