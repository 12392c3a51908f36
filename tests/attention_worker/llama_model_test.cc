// Tests of the real model's CPU side: the safetensors reader (crafted good and broken files), the
// loader's checks (each error names the file and what was expected), and the forward pass of a
// tiny random model written by the test itself, against a double-precision reference, dense
// against sparse, one pass against incremental decode, verifier rows, rollback and bad rows.
#include "attention_worker/llama_model.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "indexer_service/topk.h"

namespace dsa {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/llama_model_test_", getpid(), "_", name);
}

std::vector<std::byte> FloatBytes(const std::vector<float>& values) {
  std::vector<std::byte> bytes(values.size() * sizeof(float));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// fp16 bits of a value k / 1024 with |k| < 2048 (exact in fp16; the test's indexer weights).
uint16_t ExactHalf(float value) {
  if (value == 0) return 0;
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int exponent = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
  const uint32_t mantissa = (bits & 0x7fffffu) >> 13;
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exponent) << 10) | mantissa);
}

std::vector<std::byte> HalfBytes(const std::vector<float>& values) {
  std::vector<std::byte> bytes(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t half = ExactHalf(values[i]);
    bytes[2 * i] = static_cast<std::byte>(half & 0xff);
    bytes[2 * i + 1] = static_cast<std::byte>(half >> 8);
  }
  return bytes;
}

void WriteRaw(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t length = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(length >> (8 * i)));
  out << header << data;
}

void Truncate(const std::string& path, uint64_t bytes) {
  std::filesystem::resize_file(path, bytes);
}

// ---- safetensors ----

TEST(Safetensors, RoundTrip) {
  const std::string path = TempPath("round_trip.safetensors");
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<std::byte> a_bytes = FloatBytes(a);
  const std::vector<std::byte> b_bytes = {std::byte{7}, std::byte{8}};
  const SafetensorsTensorToWrite tensors[] = {{"a", "F32", {2, 3}, a_bytes},
                                              {"b", "U8", {2}, b_bytes}};
  ASSERT_TRUE(WriteSafetensors(path, {{"key", "value"}}, tensors).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("key"), "value");
  ASSERT_EQ((*file)->tensors().size(), 2u);
  const SafetensorsTensor* tensor = (*file)->Find("a");
  ASSERT_NE(tensor, nullptr);
  EXPECT_EQ(tensor->dtype, "F32");
  EXPECT_EQ(tensor->shape, (std::vector<int64_t>{2, 3}));
  ASSERT_EQ(tensor->bytes.size(), 24u);
  EXPECT_EQ(std::memcmp(tensor->bytes.data(), a.data(), 24), 0);
  EXPECT_EQ((*file)->Find("b")->bytes[1], std::byte{8});
  EXPECT_EQ((*file)->Find("c"), nullptr);
  file->reset();
  std::filesystem::remove(path);
}

TEST(Safetensors, MissingFileIsNotFound) {
  const std::string path = TempPath("does_not_exist.safetensors");
  const auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr(path));
}

TEST(Safetensors, TruncatedFileIsDataLossWithBothSizes) {
  const std::string path = TempPath("truncated.safetensors");
  const std::vector<std::byte> bytes = FloatBytes(std::vector<float>(100, 1.0f));
  const SafetensorsTensorToWrite tensors[] = {{"x", "F32", {100}, bytes}};
  ASSERT_TRUE(WriteSafetensors(path, {}, tensors).ok());
  const uint64_t full = std::filesystem::file_size(path);
  Truncate(path, full - 10);
  auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().message(),
              AllOf(HasSubstr(path), HasSubstr("truncated"), HasSubstr(absl::StrCat(full - 10)),
                    HasSubstr(absl::StrCat("expected ", full))));
  // Inside the header, and shorter than the length field.
  Truncate(path, 20);
  EXPECT_EQ(SafetensorsFile::Open(path).status().code(), absl::StatusCode::kDataLoss);
  Truncate(path, 5);
  file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().message(), AllOf(HasSubstr(path), HasSubstr("at least 8")));
  std::filesystem::remove(path);
}

TEST(Safetensors, MalformedHeadersAreInvalidArgument) {
  const std::string path = TempPath("malformed.safetensors");
  const std::string eight(8, 'x');
  struct Case {
    std::string header, data, expected;
  };
  const Case cases[] = {
      {"not json", "", "not a JSON object"},
      {"[1, 2]", "", "not a JSON object"},
      {R"({"x": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}})", eight,
       "unknown dtype \"F33\""},
      {R"({"x": {"shape": [2], "data_offsets": [0, 8]}})", eight, "no string \"dtype\""},
      {R"({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", eight,
       "not an integer >= 0"},
      {R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", eight, "end < begin"},
      {R"({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", eight,
       "spans 8 bytes but F32 [3] needs 12"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
           "y": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}})",
       eight, "overlap"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", eight, "hole"},
      {R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", eight,
       "4 bytes after its data section"},
      {R"({"__metadata__": {"a": 1}})", "", "metadata 'a' is not a string"},
  };
  for (const Case& c : cases) {
    WriteRaw(path, c.header, c.data);
    const auto file = SafetensorsFile::Open(path);
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << c.header;
    EXPECT_THAT(file.status().message(), AllOf(HasSubstr(path), HasSubstr(c.expected))) << c.header;
  }
  // Offsets beyond the data section: the file is shorter than the header needs.
  WriteRaw(path, R"({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", eight);
  const auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().message(), AllOf(HasSubstr(path), HasSubstr("truncated")));
  // A header length beyond the file.
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const uint64_t length = 1000;
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(length >> (8 * i)));
    out << "{}";
  }
  EXPECT_EQ(SafetensorsFile::Open(path).status().code(), absl::StatusCode::kDataLoss);
  std::filesystem::remove(path);
}

// Options whose GEMMs and attention fork threads from `work` multiply-adds on.
LlamaForwardOptions ParallelFrom(int64_t work) {
  LlamaForwardOptions options;
  options.parallel_min_work = work;
  return options;
}

// ---- a tiny model ----

LlamaConfig TinyConfig() {
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

LightningIndexerConfig TinyIndexerConfig() {
  LightningIndexerConfig config;
  config.num_layers = 3;
  config.num_heads = 4;
  config.head_dim = 16;
  config.query_rank = 8;
  config.rope_dims = 8;
  config.rope_base = 10000.0;
  return config;
}

std::map<std::string, std::string> ConfigMetadata(const LlamaConfig& c) {
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

std::vector<float> Normal(std::mt19937& rng, int64_t n, float stddev, float mean = 0) {
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<float> out(n);
  for (float& x : out) x = normal(rng);
  return out;
}

Tensors TinyModelTensors(const LlamaConfig& c, uint32_t seed) {
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
Tensors TinyIndexerTensors(const LlamaConfig& c, const LightningIndexerConfig& ic, uint32_t seed) {
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
absl::Status WriteTensors(const std::string& path, const std::map<std::string, std::string>& meta,
                          const Tensors& t, const std::string& dtype, const std::string& skip = "",
                          const std::map<std::string, std::vector<int64_t>>& shape_override = {},
                          const std::map<std::string, std::string>& dtype_override = {},
                          bool extra = false) {
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

std::map<std::string, std::string> IndexerMetadata(const LightningIndexerConfig& ic) {
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

  static LlamaConfig* config_;
  static LightningIndexerConfig* indexer_config_;
  static Tensors* model_tensors_;
  static Tensors* indexer_tensors_;
  static std::string* model_path_;
  static std::string* indexer_path_;
  static std::shared_ptr<const LlamaModel>* model_;
};

LlamaConfig* TinyModel::config_ = nullptr;
LightningIndexerConfig* TinyModel::indexer_config_ = nullptr;
Tensors* TinyModel::model_tensors_ = nullptr;
Tensors* TinyModel::indexer_tensors_ = nullptr;
std::string* TinyModel::model_path_ = nullptr;
std::string* TinyModel::indexer_path_ = nullptr;
std::shared_ptr<const LlamaModel>* TinyModel::model_ = nullptr;

// ---- an independent double-precision reference of docs/model.md ----

using Matrix = std::vector<std::vector<double>>;  // [rows][cols]

std::vector<double> MatVec(const std::vector<float>& w, int64_t out, int64_t in,
                           const std::vector<double>& x) {
  std::vector<double> y(out, 0.0);
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) y[o] += static_cast<double>(w[o * in + i]) * x[i];
  }
  return y;
}

std::vector<double> RmsNorm(const std::vector<double>& x, const std::vector<float>& weight,
                            double eps) {
  double ms = 0;
  for (double v : x) ms += v * v;
  ms /= static_cast<double>(x.size());
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] / std::sqrt(ms + eps) * weight[i];
  return out;
}

void Rope(double* x, int64_t position, double base, int dims) {
  for (int j = 0; j < dims / 2; ++j) {
    const double angle = static_cast<double>(position) * std::pow(base, -2.0 * j / dims);
    const double a = x[2 * j], b = x[2 * j + 1];
    x[2 * j] = a * std::cos(angle) - b * std::sin(angle);
    x[2 * j + 1] = a * std::sin(angle) + b * std::cos(angle);
  }
}

struct ReferenceOutput {
  Matrix logits;                    // [n][vocab]
  std::vector<Matrix> layer_input;  // [layer][n][d_model]
};

// The forward of a single sequence from position 0; `selected(layer, t)` lists the attended
// slots of row t (all of 0..t when empty).
ReferenceOutput ReferenceForward(
    const LlamaConfig& c, const Tensors& w, const std::vector<int32_t>& tokens,
    const std::function<std::vector<int32_t>(int, int64_t)>& selected = nullptr) {
  const int64_t n = static_cast<int64_t>(tokens.size()), d = c.d_model, hd = c.head_dim;
  Matrix h(n, std::vector<double>(d));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < d; ++i) h[t][i] = w["token_embd.weight"][tokens[t] * d + i];
  }
  ReferenceOutput out;
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    Matrix x(n), q(n), k(n), v(n);
    for (int64_t t = 0; t < n; ++t) {
      x[t] = RmsNorm(h[t], w[p + "attn_norm.weight"], c.rms_eps);
      q[t] = MatVec(w[p + "attn_q.weight"], c.q_dim(), d, x[t]);
      k[t] = MatVec(w[p + "attn_k.weight"], c.kv_dim(), d, x[t]);
      v[t] = MatVec(w[p + "attn_v.weight"], c.kv_dim(), d, x[t]);
      for (int head = 0; head < c.num_heads; ++head) Rope(&q[t][head * hd], t, c.rope_base, hd);
      for (int head = 0; head < c.num_kv_heads; ++head) Rope(&k[t][head * hd], t, c.rope_base, hd);
    }
    out.layer_input.push_back(x);
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int32_t> slots = selected ? selected(l, t) : std::vector<int32_t>{};
      slots.erase(std::remove(slots.begin(), slots.end(), -1), slots.end());
      if (slots.empty()) {
        slots.resize(t + 1);
        std::iota(slots.begin(), slots.end(), 0);
      }
      std::vector<double> o(c.q_dim(), 0.0);
      for (int head = 0; head < c.num_heads; ++head) {
        const int kv_head = head / (c.num_heads / c.num_kv_heads);
        std::vector<double> logits;
        double peak = -1e300;
        for (const int32_t s : slots) {
          double dot = 0;
          for (int64_t i = 0; i < hd; ++i) dot += q[t][head * hd + i] * k[s][kv_head * hd + i];
          logits.push_back(dot / std::sqrt(static_cast<double>(hd)));
          peak = std::max(peak, logits.back());
        }
        double total = 0;
        for (double& z : logits) total += (z = std::exp(z - peak));
        for (size_t j = 0; j < slots.size(); ++j) {
          for (int64_t i = 0; i < hd; ++i) {
            o[head * hd + i] += logits[j] / total * v[slots[j]][kv_head * hd + i];
          }
        }
      }
      const std::vector<double> attn = MatVec(w[p + "attn_output.weight"], d, c.q_dim(), o);
      for (int64_t i = 0; i < d; ++i) h[t][i] += attn[i];
      const std::vector<double> y = RmsNorm(h[t], w[p + "ffn_norm.weight"], c.rms_eps);
      std::vector<double> gate = MatVec(w[p + "ffn_gate.weight"], c.ffn_dim, d, y);
      const std::vector<double> up = MatVec(w[p + "ffn_up.weight"], c.ffn_dim, d, y);
      for (int64_t i = 0; i < c.ffn_dim; ++i) gate[i] = gate[i] / (1 + std::exp(-gate[i])) * up[i];
      const std::vector<double> down = MatVec(w[p + "ffn_down.weight"], d, c.ffn_dim, gate);
      for (int64_t i = 0; i < d; ++i) h[t][i] += down[i];
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    out.logits.push_back(MatVec(w["token_embd.weight"], c.vocab_size, d,
                                RmsNorm(h[t], w["output_norm.weight"], c.rms_eps)));
  }
  return out;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
  }
  return worst;
}

TEST_F(TinyModel, ConfigAndSizes) {
  const LlamaModel& model = **model_;
  EXPECT_EQ(model.config().num_layers, 3);
  EXPECT_EQ(model.config().kv_dim(), 16);
  EXPECT_FLOAT_EQ(model.config().rms_eps, 1e-5f);
  ASSERT_TRUE(model.has_indexer());
  EXPECT_EQ(model.indexer_config().query_rank, 8);
  EXPECT_GT(model.weight_bytes(), 0);
}

TEST_F(TinyModel, DenseMatchesADoublePrecisionReference) {
  const std::vector<int32_t> tokens = Tokens(40, 1);
  LlamaKvCache cache(**model_);
  const std::vector<float> logits = RunPass(cache, tokens);
  EXPECT_EQ(cache.num_slots(), 40);
  const ReferenceOutput reference = ReferenceForward(*config_, *model_tensors_, tokens);
  double worst = 0, scale = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    for (int i = 0; i < config_->vocab_size; ++i) {
      const double expected = reference.logits[t][i];
      worst = std::max(worst, std::abs(logits[t * config_->vocab_size + i] - expected));
      scale = std::max(scale, std::abs(expected));
    }
  }
  EXPECT_GT(scale, 1.0);  // non-trivial logits
  EXPECT_LT(worst, 1e-4 * scale) << "scale " << scale;
}

TEST_F(TinyModel, SparseMatchesTheReferenceOverItsSelections) {
  const std::vector<int32_t> tokens = Tokens(30, 2);
  // Row t attends every other slot down from t, plus slot 0, in a scrambled order, -1 padded.
  const auto selection_of = [](int layer, int64_t t) {
    std::vector<int32_t> out = {-1};
    for (int64_t s = t; s >= 0; s -= 2 + layer % 2) out.push_back(static_cast<int32_t>(s));
    if (std::find(out.begin(), out.end(), 0) == out.end()) out.push_back(0);
    std::reverse(out.begin(), out.end());
    out.push_back(-1);
    return out;
  };
  LlamaKvCache cache(**model_);
  const std::vector<float> logits = RunPass(cache, tokens, selection_of);
  const ReferenceOutput reference =
      ReferenceForward(*config_, *model_tensors_, tokens, selection_of);
  double worst = 0, scale = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    for (int i = 0; i < config_->vocab_size; ++i) {
      worst =
          std::max(worst, std::abs(logits[t * config_->vocab_size + i] - reference.logits[t][i]));
      scale = std::max(scale, std::abs(reference.logits[t][i]));
    }
  }
  EXPECT_LT(worst, 1e-4 * scale);
}

TEST_F(TinyModel, SparseOverEverySlotEqualsDense) {
  const std::vector<int32_t> tokens = Tokens(50, 3);
  LlamaKvCache dense_cache(**model_), sparse_cache(**model_);
  const std::vector<float> dense = RunPass(dense_cache, tokens);
  std::mt19937 rng(4);
  const auto all_slots = [&rng](int, int64_t t) {
    std::vector<int32_t> out(t + 1);
    std::iota(out.begin(), out.end(), 0);
    std::shuffle(out.begin(), out.end(), rng);
    out.insert(out.begin() + out.size() / 2, -1);
    out.push_back(-1);
    return out;
  };
  const std::vector<float> sparse = RunPass(sparse_cache, tokens, all_slots);
  // fp32 sums in another order (a gathered GEMM against the dense tile's): within 1e-5 of the
  // logits' scale (a few ulps).
  double scale = 0;
  for (const float x : dense) scale = std::max(scale, std::abs(static_cast<double>(x)));
  EXPECT_GT(scale, 1.0);
  EXPECT_LT(MaxAbsDiff(dense, sparse), 1e-5 * scale);
  for (int l = 0; l < config_->num_layers; ++l) {
    EXPECT_LT(
        MaxAbsDiff(std::vector<float>(dense_cache.keys(l).begin(), dense_cache.keys(l).end()),
                   std::vector<float>(sparse_cache.keys(l).begin(), sparse_cache.keys(l).end())),
        1e-5);
  }
}

TEST_F(TinyModel, ParallelAndSerialPassesAgree) {
  // parallel_min_work = 1 forks every GEMM and every layer's attention (the tiny model's work is
  // below the default threshold): the same logits, dense and sparse, as the serial pass.
  const std::vector<int32_t> tokens = Tokens(60, 11);
  const auto every_third = [](int, int64_t t) {
    std::vector<int32_t> out;
    for (int64_t s = t; s >= 0; s -= 3) out.push_back(static_cast<int32_t>(s));
    return out;
  };
  for (const bool sparse : {false, true}) {
    LlamaKvCache serial_cache(**model_), parallel_cache(**model_);
    const std::function<std::vector<int32_t>(int, int64_t)> selection =
        sparse ? every_third : std::function<std::vector<int32_t>(int, int64_t)>();
    const std::vector<float> serial = RunPass(serial_cache, tokens, selection);
    const std::vector<float> parallel = RunPass(parallel_cache, tokens, selection, ParallelFrom(1));
    EXPECT_LT(MaxAbsDiff(serial, parallel), 1e-4) << (sparse ? "sparse" : "dense");
    // A one-row step on top.
    EXPECT_LT(MaxAbsDiff(RunPass(serial_cache, {5}),
                         RunPass(parallel_cache, {5}, nullptr, ParallelFrom(1))),
              1e-4);
  }
  LlamaKvCache cache(**model_);
  EXPECT_EQ(LlamaForward::Begin(*model_, {{&cache, 0, 1}}, ParallelFrom(0)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The selection-mass probe: at layer 0 (the same inputs whatever the selections), the masses of
// two selections that split a row's visible slots add up to 1 for every row and KV head, and a
// selection of every visible slot holds all of it.
TEST_F(TinyModel, SelectionMassProbeMeasuresTheDenseMassOnTheSelection) {
  const std::vector<int32_t> tokens = {3, 17, 5, 9, 22, 8, 1, 40, 13, 2, 7, 30};
  using Key = std::tuple<int, int64_t, int>;  // layer, position, KV head
  const auto run = [&](const std::function<bool(int32_t)>& keep) {
    std::map<Key, double> masses;
    std::mutex mutex;
    LlamaForwardOptions options;
    options.selection_mass_probe = [&](const LlamaKvCache*, int layer, int64_t position,
                                       int kv_head, double mass) {
      std::lock_guard<std::mutex> lock(mutex);
      EXPECT_TRUE(masses.emplace(Key{layer, position, kv_head}, mass).second);
    };
    LlamaKvCache cache(**model_);
    RunPass(
        cache, tokens,
        [&](int, int64_t position) {
          std::vector<int32_t> selection;
          for (int32_t slot = 0; slot <= position; ++slot) {
            if (keep(slot)) selection.push_back(slot);
          }
          if (selection.empty()) selection.push_back(static_cast<int32_t>(position));
          return selection;
        },
        options);
    return masses;
  };
  const auto even = run([](int32_t slot) { return slot % 2 == 0; });
  const auto odd = run([](int32_t slot) { return slot % 2 == 1; });
  const auto all = run([](int32_t) { return true; });
  const int64_t rows = static_cast<int64_t>(tokens.size());
  EXPECT_EQ(all.size(), static_cast<size_t>(rows * config_->num_layers * config_->num_kv_heads));
  for (const auto& [key, mass] : all) EXPECT_NEAR(mass, 1.0, 1e-5);
  // Position 0 has one visible slot (0, even): the odd selection falls back to it.
  for (int64_t position = 1; position < rows; ++position) {
    for (int h = 0; h < config_->num_kv_heads; ++h) {
      const Key key{0, position, h};
      ASSERT_TRUE(even.count(key) && odd.count(key));
      EXPECT_GT(even.at(key), 0.0);
      EXPECT_GT(odd.at(key), 0.0);
      EXPECT_NEAR(even.at(key) + odd.at(key), 1.0, 1e-5) << position << " " << h;
    }
  }
}

TEST_F(TinyModel, OnePassEqualsIncrementalDecode) {
  const std::vector<int32_t> tokens = Tokens(45, 5);
  LlamaKvCache prefill_cache(**model_), decode_cache(**model_);
  const std::vector<float> prefill = RunPass(prefill_cache, tokens);
  std::vector<float> decode;
  // A prefill of 10, then one row per pass.
  const std::vector<float> first =
      RunPass(decode_cache, std::vector<int32_t>(tokens.begin(), tokens.begin() + 10));
  decode.insert(decode.end(), first.begin(), first.end());
  for (size_t t = 10; t < tokens.size(); ++t) {
    const std::vector<float> step = RunPass(decode_cache, {tokens[t]});
    decode.insert(decode.end(), step.begin(), step.end());
  }
  EXPECT_EQ(decode_cache.num_slots(), 45);
  EXPECT_LT(MaxAbsDiff(prefill, decode), 1e-4);
  EXPECT_LT(
      MaxAbsDiff(std::vector<float>(prefill_cache.values(2).begin(), prefill_cache.values(2).end()),
                 std::vector<float>(decode_cache.values(2).begin(), decode_cache.values(2).end())),
      1e-5);
}

TEST_F(TinyModel, VerifierRowsAndTruncate) {
  const std::vector<int32_t> tokens = Tokens(36, 6);
  LlamaKvCache full_cache(**model_);
  const std::vector<float> full = RunPass(full_cache, tokens);
  const int vocab = config_->vocab_size;
  // Prefill 30, then verifier rows 30..35 in one pass (given in reverse order).
  LlamaKvCache cache(**model_);
  RunPass(cache, std::vector<int32_t>(tokens.begin(), tokens.begin() + 30));
  std::vector<LlamaRow> rows;
  for (int64_t t = 35; t >= 30; --t) rows.push_back({&cache, t, tokens[t]});
  auto pass = LlamaForward::Begin(*model_, rows);
  ASSERT_TRUE(pass.ok()) << pass.status();
  for (int l = 0; l < config_->num_layers; ++l) ASSERT_TRUE((*pass)->RunLayer().ok());
  std::vector<float> verifier(6 * vocab);
  const std::vector<int32_t> all_rows = {0, 1, 2, 3, 4, 5};
  ASSERT_TRUE((*pass)->Logits(all_rows, verifier).ok());
  for (int r = 0; r < 6; ++r) {
    const int64_t t = 35 - r;
    EXPECT_LT(
        MaxAbsDiff(
            std::vector<float>(verifier.begin() + r * vocab, verifier.begin() + (r + 1) * vocab),
            std::vector<float>(full.begin() + t * vocab, full.begin() + (t + 1) * vocab)),
        1e-4)
        << "row at position " << t;
  }
  pass->reset();
  EXPECT_EQ(cache.num_slots(), 36);
  // Two of the draft accepted: keep slots 0..32, then a different token at 33 and a re-run.
  ASSERT_TRUE(cache.Truncate(33).ok());
  const std::vector<float> other = RunPass(cache, {7, 8});
  LlamaKvCache fresh(**model_);
  std::vector<int32_t> fresh_tokens(tokens.begin(), tokens.begin() + 33);
  fresh_tokens.push_back(7);
  fresh_tokens.push_back(8);
  const std::vector<float> expected = RunPass(fresh, fresh_tokens);
  EXPECT_LT(MaxAbsDiff(other, std::vector<float>(expected.end() - 2 * vocab, expected.end())),
            1e-4);
  // Truncate, then the very same rows again: the same logits bit for bit.
  ASSERT_TRUE(cache.Truncate(33).ok());
  EXPECT_EQ(RunPass(cache, {7, 8}), other);
  EXPECT_EQ(cache.Truncate(36).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Truncate(-1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_GE(cache.bytes(), 2 * 3 * 35 * 16 * 4);
}

TEST_F(TinyModel, CopyFromCopiesTheSlotsAndRefusesCachesInAPass) {
  const std::vector<int32_t> tokens = Tokens(20, 10);
  LlamaKvCache source(**model_), copy(**model_), control(**model_);
  RunPass(source, tokens);
  RunPass(copy, Tokens(30, 11));  // more slots than the source: the copy drops them
  RunPass(control, Tokens(30, 11));
  // In a pass (begun, one layer run): refused both ways, nothing changed.
  auto pass = LlamaForward::Begin(*model_, {{&source, 20, 4}});
  ASSERT_TRUE(pass.ok()) << pass.status();
  ASSERT_TRUE((*pass)->RunLayer().ok());
  EXPECT_TRUE(source.in_pass());
  EXPECT_EQ(copy.CopyFrom(source).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(source.CopyFrom(copy).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(copy.CopyFrom(copy).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(copy.num_slots(), 30);
  EXPECT_EQ(source.num_slots(), 20);
  for (int l = 1; l < config_->num_layers; ++l) ASSERT_TRUE((*pass)->RunLayer().ok());
  EXPECT_FALSE(source.in_pass());  // the last layer ends the pass
  EXPECT_EQ(source.num_slots(), 21);
  pass->reset();
  EXPECT_EQ(RunPass(copy, {5}), RunPass(control, {5}));
  // After the pass: a copy of the slots, bit for bit, that the source's later passes leave alone.
  ASSERT_TRUE(copy.CopyFrom(source).ok());
  EXPECT_FALSE(copy.in_pass());
  EXPECT_EQ(copy.num_slots(), 21);
  const std::vector<float> next = RunPass(source, {6});
  EXPECT_EQ(RunPass(copy, {6}), next);
  EXPECT_EQ(copy.Truncate(21).code(), absl::StatusCode::kOk);
  EXPECT_EQ(RunPass(copy, {6}), next);
  // Into an empty cache (its memory grows as a pass's would).
  LlamaKvCache empty(**model_);
  ASSERT_TRUE(empty.CopyFrom(source).ok());
  EXPECT_EQ(empty.num_slots(), 22);
  EXPECT_EQ(RunPass(empty, {7}), RunPass(source, {7}));
}

TEST_F(TinyModel, BatchedDecodeOverSeveralCaches) {
  const std::vector<int32_t> a = Tokens(20, 7), b = Tokens(12, 8);
  LlamaKvCache alone_a(**model_), alone_b(**model_), batch_a(**model_), batch_b(**model_);
  const std::vector<float> expected_a = RunPass(alone_a, a);
  const std::vector<float> expected_b = RunPass(alone_b, b);
  const int vocab = config_->vocab_size;
  RunPass(batch_a, std::vector<int32_t>(a.begin(), a.end() - 1));
  RunPass(batch_b, std::vector<int32_t>(b.begin(), b.end() - 3));
  // One pass: a's last row (dense), b's last 3 rows (sparse over all their slots), interleaved.
  const std::vector<LlamaRow> rows = {
      {&batch_b, 10, b[10]}, {&batch_a, 19, a[19]}, {&batch_b, 9, b[9]}, {&batch_b, 11, b[11]}};
  auto pass = LlamaForward::Begin(*model_, rows);
  ASSERT_TRUE(pass.ok()) << pass.status();
  std::vector<std::vector<int32_t>> owned;
  for (const LlamaRow& row : rows) {
    std::vector<int32_t> all(row.position + 1);
    std::iota(all.rbegin(), all.rend(), 0);
    owned.push_back(row.kv == &batch_a ? std::vector<int32_t>{} : all);
  }
  const std::vector<std::span<const int32_t>> spans(owned.begin(), owned.end());
  for (int l = 0; l < config_->num_layers; ++l) ASSERT_TRUE((*pass)->RunLayer(spans).ok());
  std::vector<float> out(2 * vocab);
  const std::vector<int32_t> last_rows = {1, 3};
  ASSERT_TRUE((*pass)->Logits(last_rows, out).ok());
  EXPECT_LT(MaxAbsDiff(std::vector<float>(out.begin(), out.begin() + vocab),
                       std::vector<float>(expected_a.end() - vocab, expected_a.end())),
            1e-4);
  EXPECT_LT(MaxAbsDiff(std::vector<float>(out.begin() + vocab, out.end()),
                       std::vector<float>(expected_b.end() - vocab, expected_b.end())),
            1e-4);
}

TEST_F(TinyModel, BadRowsAreRefusedAndChangeNothing) {
  LlamaKvCache cache(**model_), other(**model_);
  const std::vector<int32_t> tokens = Tokens(8, 9);
  const std::vector<float> before = RunPass(cache, tokens);
  const auto begin_code = [&](std::vector<LlamaRow> rows) {
    return LlamaForward::Begin(*model_, std::move(rows)).status().code();
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(begin_code({}), kInvalid);
  EXPECT_EQ(begin_code({{nullptr, 0, 1}}), kInvalid);
  EXPECT_EQ(begin_code({{&cache, 9, 1}}), kInvalid);                   // a gap
  EXPECT_EQ(begin_code({{&cache, 7, 1}}), kInvalid);                   // an existing slot
  EXPECT_EQ(begin_code({{&cache, 8, 1}, {&cache, 10, 1}}), kInvalid);  // not contiguous
  EXPECT_EQ(begin_code({{&cache, 8, 1}, {&cache, 8, 1}}), kInvalid);   // twice
  EXPECT_EQ(begin_code({{&cache, 8, 50}}), kInvalid);                  // token == vocab
  EXPECT_EQ(begin_code({{&cache, 8, -1}}), kInvalid);
  EXPECT_EQ(begin_code({{&other, 0, 1}, {&cache, 8, 70}}), kInvalid);
  std::vector<LlamaRow> long_rows;
  for (int64_t t = 0; t < 65; ++t) long_rows.push_back({&other, t, 1});
  EXPECT_EQ(begin_code(long_rows), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.num_slots(), 8);
  EXPECT_EQ(other.num_slots(), 0);

  // Bad selections: refused before anything changes, and the pass goes on.
  auto pass = LlamaForward::Begin(*model_, {{&cache, 8, 3}, {&cache, 9, 4}});
  ASSERT_TRUE(pass.ok());
  EXPECT_EQ(LlamaForward::Begin(*model_, {{&cache, 8, 3}}).status().code(),
            absl::StatusCode::kFailedPrecondition);  // the cache is in a pass
  EXPECT_EQ(cache.Truncate(2).code(), absl::StatusCode::kFailedPrecondition);
  const std::vector<int32_t> ok = {0, 8}, beyond = {0, 9}, below = {-2, 1}, twice = {3, 3},
                             none = {-1, -1};
  const auto run = [&](const std::vector<int32_t>& first) {
    const std::vector<std::span<const int32_t>> spans = {first, {}};
    return (*pass)->RunLayer(spans);
  };
  for (const auto* bad : {&beyond, &below, &twice, &none}) {
    const absl::Status status = run(*bad);
    EXPECT_EQ(status.code(), kInvalid) << status;
    EXPECT_EQ((*pass)->next_layer(), 0);
  }
  const std::vector<std::span<const int32_t>> one = {ok};
  EXPECT_EQ((*pass)->RunLayer(one).code(), kInvalid);  // 1 selection for 2 rows
  std::vector<float> logits(config_->vocab_size);
  const std::vector<int32_t> first_row = {0};
  EXPECT_EQ((*pass)->Logits(first_row, logits).code(), absl::StatusCode::kFailedPrecondition);
  std::vector<float> q(2 * 4 * 16), w(2 * 4), k(2 * 16);
  EXPECT_EQ((*pass)->IndexerInputs(q, w, std::span<float>(k).first(5)).code(), kInvalid);
  // Abandoned after one layer: nothing committed.
  ASSERT_TRUE(run(ok).ok());
  pass->reset();
  EXPECT_EQ(cache.num_slots(), 8);
  // The cache gives bit for bit what a cache that saw none of the refused calls gives.
  LlamaKvCache control(**model_);
  EXPECT_EQ(RunPass(control, tokens), before);
  EXPECT_EQ(RunPass(cache, {3}), RunPass(control, {3}));
}

TEST_F(TinyModel, IndexerInputsAndScoresMatchTheReference) {
  const std::vector<int32_t> tokens = Tokens(24, 10);
  const ReferenceOutput reference = ReferenceForward(*config_, *model_tensors_, tokens);
  LlamaKvCache cache(**model_);
  std::vector<LlamaRow> rows;
  for (int64_t t = 0; t < 24; ++t) rows.push_back({&cache, t, tokens[t]});
  auto pass = LlamaForward::Begin(*model_, rows);
  ASSERT_TRUE(pass.ok());
  const LightningIndexerConfig& ic = *indexer_config_;
  const int64_t h = ic.num_heads, dk = ic.head_dim, r = ic.query_rank, d = config_->d_model;
  const Tensors& wi = *indexer_tensors_;
  for (int layer = 0; layer < config_->num_layers; ++layer) {
    std::vector<float> q(24 * h * dk), w(24 * h), k(24 * dk);
    ASSERT_TRUE((*pass)->IndexerInputs(q, w, k).ok());
    const std::string p = absl::StrCat("blk.", layer, ".indexer.");
    double worst = 0;
    for (int64_t t = 0; t < 24; ++t) {
      const std::vector<double>& x = reference.layer_input[layer][t];
      std::vector<double> eq =
          MatVec(wi[p + "q_b.weight"], h * dk, r, MatVec(wi[p + "q_a.weight"], r, d, x));
      for (int64_t head = 0; head < h; ++head) Rope(&eq[head * dk], t, ic.rope_base, ic.rope_dims);
      std::vector<double> ek = MatVec(wi[p + "k.weight"], dk, d, x);
      double mean = 0, var = 0;
      for (double v : ek) mean += v / dk;
      for (double v : ek) var += (v - mean) * (v - mean) / dk;
      for (int64_t i = 0; i < dk; ++i) {
        ek[i] = (ek[i] - mean) / std::sqrt(var + 1e-6) * wi[p + "k_norm.weight"][i] +
                wi[p + "k_norm.bias"][i];
      }
      Rope(ek.data(), t, ic.rope_base, ic.rope_dims);
      const std::vector<double> ew = MatVec(wi[p + "weights_proj.weight"], h, d, x);
      for (int64_t i = 0; i < h * dk; ++i)
        worst = std::max(worst, std::abs(q[t * h * dk + i] - eq[i]));
      for (int64_t i = 0; i < dk; ++i) worst = std::max(worst, std::abs(k[t * dk + i] - ek[i]));
      for (int64_t i = 0; i < h; ++i) {
        worst = std::max(worst, std::abs(w[t * h + i] - ew[i] / std::sqrt(double(h * dk))));
      }
    }
    EXPECT_LT(worst, 1e-4) << "layer " << layer;
    // Index scores of the last row over every slot, and the top-K.
    const int64_t t = 23;
    std::vector<float> scores(24);
    ASSERT_TRUE(IndexScores(h, dk, std::span<const float>(&q[t * h * dk], h * dk),
                            std::span<const float>(&w[t * h], h), k, scores)
                    .ok());
    for (int64_t i = 0; i < 24; ++i) {
      double z = 0;
      for (int64_t head = 0; head < h; ++head) {
        double dot = 0;
        for (int64_t j = 0; j < dk; ++j) dot += double(q[(t * h + head) * dk + j]) * k[i * dk + j];
        z += w[t * h + head] * std::max(0.0, dot);
      }
      EXPECT_NEAR(scores[i], z, 1e-5 * (1 + std::abs(z)));
    }
    std::vector<int32_t> top(30);
    SelectTopK(scores, {}, t, top);
    EXPECT_EQ(std::count(top.begin(), top.end(), -1), 6);
    ASSERT_TRUE((*pass)->RunLayer().ok());
  }
  std::vector<float> q(24 * h * dk), w(24 * h), k(24 * dk);
  EXPECT_EQ((*pass)->IndexerInputs(q, w, k).code(), absl::StatusCode::kFailedPrecondition);
  std::vector<float> out(3);
  EXPECT_EQ(
      IndexScores(h, dk, std::span<const float>(q).first(h * dk),
                  std::span<const float>(w).first(h), std::span<const float>(k).first(2 * dk), out)
          .code(),
      absl::StatusCode::kInvalidArgument);
}

// ---- the loader's errors: each names the file and what was expected ----

class LoaderErrors : public TinyModel {
 protected:
  absl::Status LoadWith(const std::string& model_path, const std::string& indexer_path) {
    return LlamaModel::Load(model_path, indexer_path).status();
  }
};

TEST_F(LoaderErrors, MissingAndTruncatedFiles) {
  const std::string missing = TempPath("missing.safetensors");
  absl::Status status = LoadWith(missing, *indexer_path_);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(missing));
  status = LoadWith(*model_path_, missing);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(missing));
  const std::string truncated = TempPath("truncated_model.safetensors");
  std::filesystem::copy_file(*model_path_, truncated,
                             std::filesystem::copy_options::overwrite_existing);
  const uint64_t size = std::filesystem::file_size(truncated);
  Truncate(truncated, size - 1000);
  status = LoadWith(truncated, "");
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(status.message(),
              AllOf(HasSubstr(truncated), HasSubstr(absl::StrCat("expected ", size)),
                    HasSubstr(absl::StrCat(size - 1000))));
  std::filesystem::remove(truncated);
}

TEST_F(LoaderErrors, WrongTensorsAndMetadata) {
  const std::string path = TempPath("broken_model.safetensors");
  const auto expect = [&](const absl::Status& written, const std::string& expected) {
    ASSERT_TRUE(written.ok()) << written;
    const absl::Status status = LoadWith(path, "");
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr(path), HasSubstr(expected)));
  };
  const std::map<std::string, std::string> meta = ConfigMetadata(*config_);
  expect(WriteTensors(path, meta, *model_tensors_, "F32", "blk.1.ffn_up.weight"),
         "missing tensor 'blk.1.ffn_up.weight' (expected F32 [48, 32])");
  expect(WriteTensors(path, meta, *model_tensors_, "F32", "", {{"blk.2.attn_k.weight", {16, 31}}}),
         "tensor 'blk.2.attn_k.weight' has shape [16, 31], expected F32 [16, 32]");
  expect(WriteTensors(path, meta, *model_tensors_, "F32", "", {}, {{"output_norm.weight", "F16"}}),
         "tensor 'output_norm.weight' has dtype F16, expected F32 [32]");
  expect(WriteTensors(path, meta, *model_tensors_, "F32", "", {}, {}, /*extra=*/true),
         "unexpected tensor 'rope_freqs.weight'");
  auto other = meta;
  other["dsa.format"] = "dsa-llama/2";
  expect(WriteTensors(path, other, *model_tensors_, "F32"),
         "'dsa.format' is 'dsa-llama/2', expected 'dsa-llama/1'");
  other = meta;
  other.erase("dsa.format");
  expect(WriteTensors(path, other, *model_tensors_, "F32"), "no 'dsa.format'");
  other = meta;
  other.erase("ffn_dim");
  expect(WriteTensors(path, other, *model_tensors_, "F32"), "metadata has no 'ffn_dim'");
  other = meta;
  other["num_heads"] = "four";
  expect(WriteTensors(path, other, *model_tensors_, "F32"), "'num_heads' = 'four'");
  other = meta;
  other["num_kv_heads"] = "3";
  expect(WriteTensors(path, other, *model_tensors_, "F32"), "multiple of num_kv_heads");
  // Called SmolLM2-135M, but with the tiny shapes.
  other = meta;
  other["dsa.model"] = kSmolLM2ModelName;
  expect(WriteTensors(path, other, *model_tensors_, "F32"),
         "'num_layers' is 3, expected 30 for smollm2-135m");
  std::filesystem::remove(path);
}

TEST_F(LoaderErrors, IndexerForAnotherModel) {
  const std::string path = TempPath("broken_indexer.safetensors");
  const auto expect = [&](const absl::Status& written, const std::string& expected) {
    ASSERT_TRUE(written.ok()) << written;
    const absl::Status status = LoadWith(*model_path_, path);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr(path), HasSubstr(expected)));
  };
  auto meta = IndexerMetadata(*indexer_config_);
  // Two layers for a three-layer model.
  LightningIndexerConfig two = *indexer_config_;
  two.num_layers = 2;
  LlamaConfig two_layer_model = *config_;
  two_layer_model.num_layers = 2;
  expect(
      WriteTensors(path, IndexerMetadata(two), TinyIndexerTensors(two_layer_model, two, 1), "F16"),
      "the indexer has 2 layers, expected 3");
  // Made for a backbone of width 64.
  LlamaConfig wide = *config_;
  wide.d_model = 64;
  expect(WriteTensors(path, meta, TinyIndexerTensors(wide, *indexer_config_, 1), "F16"),
         "tensor 'blk.0.indexer.q_a.weight' has shape [8, 64], expected F16 or F32 [8, 32]");
  auto other = meta;
  other["base_model_sha256"] = "def";
  expect(WriteTensors(path, other, *indexer_tensors_, "F16"),
         "base_model_sha256 is def, expected abc");
  other = meta;
  other["dsa.format"] = kLlamaModelFormat;
  expect(WriteTensors(path, other, *indexer_tensors_, "F16"),
         "'dsa.format' is 'dsa-llama/1', expected 'dsa-indexer/1'");
  other = meta;
  other["rope_dims"] = "7";
  expect(WriteTensors(path, other, *indexer_tensors_, "F16"), "rope_dims (7)");
  expect(WriteTensors(path, meta, *indexer_tensors_, "F16", "blk.2.indexer.k_norm.bias"),
         "missing tensor 'blk.2.indexer.k_norm.bias'");
  std::filesystem::remove(path);
  // No indexer: loads; IndexerInputs is refused.
  auto model = LlamaModel::Load(*model_path_, "");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_FALSE((*model)->has_indexer());
  LlamaKvCache cache(**model);
  auto pass = LlamaForward::Begin(*model, {{&cache, 0, 1}});
  ASSERT_TRUE(pass.ok());
  std::vector<float> q(64), w(4), k(16);
  EXPECT_EQ((*pass)->IndexerInputs(q, w, k).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace dsa
