// Helpers of the real model's CPU tests (llama_model_test.cc, llama_model_loader_test.cc): crafted
// safetensors files, and a tiny random model (config, tensors, files written once per suite by the
// TinyModel fixture) whose forward passes the tests check.
#pragma once

#include <unistd.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/llama_model.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"

namespace dsa::llama_model_testing {

inline std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/llama_model_test_", getpid(), "_", name);
}

inline std::vector<std::byte> FloatBytes(const std::vector<float>& values) {
  std::vector<std::byte> bytes(values.size() * sizeof(float));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// fp16 bits of a value k / 1024 with |k| < 2048 (exact in fp16; the test's indexer weights).
inline uint16_t ExactHalf(float value) {
  if (value == 0) return 0;
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int exponent = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
  const uint32_t mantissa = (bits & 0x7fffffu) >> 13;
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exponent) << 10) | mantissa);
}

inline std::vector<std::byte> HalfBytes(const std::vector<float>& values) {
  std::vector<std::byte> bytes(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t half = ExactHalf(values[i]);
    bytes[2 * i] = static_cast<std::byte>(half & 0xff);
    bytes[2 * i + 1] = static_cast<std::byte>(half >> 8);
  }
  return bytes;
}

inline void WriteRaw(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(length >> (8 * i)));
  out << header << data;
}

inline void Truncate(const std::string& path, uint64_t bytes) {
  std::filesystem::resize_file(path, bytes);
}

// Options whose GEMMs and attention fork threads from `work` multiply-adds on.
inline LlamaForwardOptions ParallelFrom(int64_t work) {
  LlamaForwardOptions options;
  options.parallel_min_work = work;
  return options;
}

// ---- a tiny model ----

inline LlamaConfig TinyConfig() {
  LlamaConfig config;
  config.num_layers = 3;
  config.d_model = 32;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.head_dim = 8;
  config.ffn_dim = 48;
  config.vocab_size = 50;
  config.context_length = 64;
  config.rope_base = 10000.0;
  config.rms_eps = 1e-5f;
  config.bos_token_id = 1;
  config.eos_token_id = 2;
  return config;
}

inline LightningIndexerConfig TinyIndexerConfig() {
  LightningIndexerConfig config;
  config.num_layers = 3;
  config.num_heads = 4;
  config.head_dim = 16;
  config.query_rank = 8;
  config.rope_dims = 8;
  config.rope_base = 10000.0;
  return config;
}

inline std::map<std::string, std::string> ConfigMetadata(const LlamaConfig& c) {
  return {{"dsa.format", kLlamaModelFormat},
          {"dsa.model", "tiny-test"},
          {"source_sha256", "abc"},
          {"num_layers", absl::StrCat(c.num_layers)},
          {"d_model", absl::StrCat(c.d_model)},
          {"num_heads", absl::StrCat(c.num_heads)},
          {"num_kv_heads", absl::StrCat(c.num_kv_heads)},
          {"head_dim", absl::StrCat(c.head_dim)},
          {"ffn_dim", absl::StrCat(c.ffn_dim)},
          {"vocab_size", absl::StrCat(c.vocab_size)},
          {"context_length", absl::StrCat(c.context_length)},
          {"rope_base", "10000.0"},
          {"rms_eps", "9.999999747378752e-06"},
          {"bos_token_id", absl::StrCat(c.bos_token_id)},
          {"eos_token_id", absl::StrCat(c.eos_token_id)}};
}

// Named tensors with shapes and fp32 values (the test's ground truth).
struct Tensors {
  std::vector<std::string> names;  // file order
  std::map<std::string, std::vector<int64_t>> shapes;
  std::map<std::string, std::vector<float>> values;
  void Add(const std::string& name, std::vector<int64_t> shape, std::vector<float> data) {
    names.push_back(name);
    shapes[name] = std::move(shape);
    values[name] = std::move(data);
  }
  const std::vector<float>& operator[](const std::string& name) const { return values.at(name); }
};

inline std::vector<float> Normal(std::mt19937& rng, int64_t n, float stddev, float mean = 0) {
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

inline Tensors TinyModelTensors(const LlamaConfig& c, uint32_t seed) {
  std::mt19937 rng(seed);
  Tensors t;
  const int64_t d = c.d_model, q = c.q_dim(), kv = c.kv_dim(), f = c.ffn_dim;
  const float s = 1.0f / std::sqrt(static_cast<float>(d));
  t.Add("token_embd.weight", {c.vocab_size, d}, Normal(rng, c.vocab_size * d, 1.0f));
  t.Add("output_norm.weight", {d}, Normal(rng, d, 0.1f, 1.0f));
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    t.Add(p + "attn_norm.weight", {d}, Normal(rng, d, 0.1f, 1.0f));
    t.Add(p + "attn_q.weight", {q, d}, Normal(rng, q * d, 2 * s));
    t.Add(p + "attn_k.weight", {kv, d}, Normal(rng, kv * d, 2 * s));
    t.Add(p + "attn_v.weight", {kv, d}, Normal(rng, kv * d, s));
    t.Add(p + "attn_output.weight", {d, q}, Normal(rng, d * q, s));
    t.Add(p + "ffn_norm.weight", {d}, Normal(rng, d, 0.1f, 1.0f));
    t.Add(p + "ffn_gate.weight", {f, d}, Normal(rng, f * d, s));
    t.Add(p + "ffn_up.weight", {f, d}, Normal(rng, f * d, s));
    t.Add(p + "ffn_down.weight", {d, f}, Normal(rng, d * f, 1.0f / std::sqrt(float(f))));
  }
  return t;
}

// Indexer weights rounded to multiples of 1/1024 (exact in fp16).
inline Tensors TinyIndexerTensors(const LlamaConfig& c, const LightningIndexerConfig& ic,
                                  uint32_t seed) {
  std::mt19937 rng(seed);
  const auto exact = [](std::vector<float> v) {
    for (float& x : v) x = std::clamp(std::round(x * 1024.0f), -2047.0f, 2047.0f) / 1024.0f;
    return v;
  };
  Tensors t;
  const int64_t d = c.d_model, h = ic.num_heads, dk = ic.head_dim, r = ic.query_rank;
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".indexer.");
    t.Add(p + "q_a.weight", {r, d}, exact(Normal(rng, r * d, 1.0f / std::sqrt(float(d)))));
    t.Add(p + "q_b.weight", {h * dk, r},
          exact(Normal(rng, h * dk * r, 1.0f / std::sqrt(float(r)))));
    t.Add(p + "k.weight", {dk, d}, exact(Normal(rng, dk * d, 1.0f / std::sqrt(float(d)))));
    t.Add(p + "k_norm.weight", {dk}, exact(Normal(rng, dk, 0.1f, 1.0f)));
    t.Add(p + "k_norm.bias", {dk}, exact(Normal(rng, dk, 0.1f)));
    t.Add(p + "weights_proj.weight", {h, d}, exact(Normal(rng, h * d, 1.0f / std::sqrt(float(d)))));
  }
  return t;
}

// Writes `t` with dtype `dtype` ("F32" or "F16"), skipping `skip`, overriding shapes / dtypes.
inline absl::Status WriteTensors(
    const std::string& path, const std::map<std::string, std::string>& meta, const Tensors& t,
    const std::string& dtype, const std::string& skip = "",
    const std::map<std::string, std::vector<int64_t>>& shape_override = {},
    const std::map<std::string, std::string>& dtype_override = {}, bool extra = false) {
  std::vector<std::vector<std::byte>> storage;
  std::vector<SafetensorsTensorToWrite> tensors;
  for (const std::string& name : t.names) {
    if (name == skip) continue;
    std::vector<int64_t> shape = t.shapes.at(name);
    std::vector<float> values = t[name];
    if (shape_override.count(name) != 0) {
      shape = shape_override.at(name);
      int64_t count = 1;
      for (int64_t dim : shape) count *= dim;
      values.resize(count, 0.5f);
    }
    const std::string type = dtype_override.count(name) != 0 ? dtype_override.at(name) : dtype;
    storage.push_back(type == "F16" ? HalfBytes(values) : FloatBytes(values));
    tensors.push_back({name, type, shape, storage.back()});
  }
  if (extra) {
    storage.push_back(FloatBytes({1.0f}));
    tensors.push_back({"rope_freqs.weight", "F32", {1}, storage.back()});
  }
  return WriteSafetensors(path, meta, tensors);
}

inline std::map<std::string, std::string> IndexerMetadata(const LightningIndexerConfig& ic) {
  return {{"dsa.format", kLightningIndexerFormat},     {"base_model_sha256", "abc"},
          {"num_layers", absl::StrCat(ic.num_layers)}, {"num_heads", absl::StrCat(ic.num_heads)},
          {"head_dim", absl::StrCat(ic.head_dim)},     {"query_rank", absl::StrCat(ic.query_rank)},
          {"rope_dims", absl::StrCat(ic.rope_dims)},   {"rope_base", "10000.0"}};
}

// The files of one tiny model, written once per suite.
class TinyModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    config_ = new LlamaConfig(TinyConfig());
    indexer_config_ = new LightningIndexerConfig(TinyIndexerConfig());
    model_tensors_ = new Tensors(TinyModelTensors(*config_, 7));
    indexer_tensors_ = new Tensors(TinyIndexerTensors(*config_, *indexer_config_, 8));
    model_path_ = new std::string(TempPath("tiny_model.safetensors"));
    indexer_path_ = new std::string(TempPath("tiny_indexer.safetensors"));
    ASSERT_TRUE(WriteTensors(*model_path_, ConfigMetadata(*config_), *model_tensors_, "F32").ok());
    ASSERT_TRUE(
        WriteTensors(*indexer_path_, IndexerMetadata(*indexer_config_), *indexer_tensors_, "F16")
            .ok());
    auto model = LlamaModel::Load(*model_path_, *indexer_path_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = new std::shared_ptr<const LlamaModel>(*model);
  }
  static void TearDownTestSuite() {
    std::filesystem::remove(*model_path_);
    std::filesystem::remove(*indexer_path_);
    delete model_;
    delete config_;
    delete indexer_config_;
    delete model_tensors_;
    delete indexer_tensors_;
    delete model_path_;
    delete indexer_path_;
  }

  static std::vector<int32_t> Tokens(int n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int32_t> token(0, config_->vocab_size - 1);
    std::vector<int32_t> out(n);
    for (int32_t& x : out) x = token(rng);
    return out;
  }

  // Runs one pass of `tokens` at positions cache.num_slots().. with `selection_of(layer, row)`
  // (empty = dense) and returns every row's logits [n, vocab].
  static std::vector<float> RunPass(
      LlamaKvCache& cache, const std::vector<int32_t>& tokens,
      const std::function<std::vector<int32_t>(int, int64_t)>& selection_of = nullptr,
      const LlamaForwardOptions& options = {}) {
    std::vector<LlamaRow> rows;
    for (size_t i = 0; i < tokens.size(); ++i) {
      rows.push_back({&cache, cache.num_slots() + static_cast<int64_t>(i), tokens[i]});
    }
    auto pass = LlamaForward::Begin(*model_, rows, options);
    EXPECT_TRUE(pass.ok()) << pass.status();
    if (!pass.ok()) return {};
    for (int layer = 0; layer < config_->num_layers; ++layer) {
      std::vector<std::vector<int32_t>> owned;
      std::vector<std::span<const int32_t>> spans;
      if (selection_of) {
        for (const LlamaRow& row : rows) owned.push_back(selection_of(layer, row.position));
        for (const auto& s : owned) spans.emplace_back(s);
      }
      const absl::Status status = (*pass)->RunLayer(spans);
      EXPECT_TRUE(status.ok()) << status;
    }
    std::vector<int32_t> all(rows.size());
    std::iota(all.begin(), all.end(), 0);
    std::vector<float> logits(rows.size() * config_->vocab_size);
    EXPECT_TRUE((*pass)->Logits(all, logits).ok());
    return logits;
  }

  static inline LlamaConfig* config_ = nullptr;
  static inline LightningIndexerConfig* indexer_config_ = nullptr;
  static inline Tensors* model_tensors_ = nullptr;
  static inline Tensors* indexer_tensors_ = nullptr;
  static inline std::string* model_path_ = nullptr;
  static inline std::string* indexer_path_ = nullptr;
  static inline std::shared_ptr<const LlamaModel>* model_ = nullptr;
};

}  // namespace dsa::llama_model_testing
