// The real model's weights on the CPU (llama_model.h, docs/model.md): the configs, loading and
// checking the safetensors weights, and the KV cache; the forward pass is in llama_forward.cc.
#include "attention_worker/llama_model.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "attention_worker/llama_blas.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace dsa {
namespace {

float HalfToFloat(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  uint32_t mantissa = half & 0x3ffu;
  uint32_t bits = 0;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa != 0) {  // subnormal: normalize
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | ((113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
  } else {
    bits = sign;
  }
  return std::bit_cast<float>(bits);
}

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status ParseIntField(const std::map<std::string, std::string>& metadata,
                           absl::string_view path, const char* name, int* out) {
  const auto it = metadata.find(name);
  if (it == metadata.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": metadata has no '", name, "' (expected a decimal integer string)"));
  }
  if (!absl::SimpleAtoi(it->second, out)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": metadata '", name, "' = '", it->second,
                                                   "' is not a decimal integer"));
  }
  return absl::OkStatus();
}

absl::Status ParseRealField(const std::map<std::string, std::string>& metadata,
                            absl::string_view path, const char* name, double* out) {
  const auto it = metadata.find(name);
  if (it == metadata.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": metadata has no '", name, "' (expected a decimal number string)"));
  }
  if (!absl::SimpleAtod(it->second, out) || !std::isfinite(*out)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": metadata '", name, "' = '", it->second,
                                                   "' is not a finite decimal number"));
  }
  return absl::OkStatus();
}

absl::Status CheckFormat(const SafetensorsFile& file, absl::string_view expected) {
  const auto it = file.metadata().find("dsa.format");
  if (it == file.metadata().end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": metadata has no 'dsa.format' (expected '", expected, "')"));
  }
  if (it->second != expected) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": metadata 'dsa.format' is '",
                                                   it->second, "', expected '", expected, "'"));
  }
  return absl::OkStatus();
}

// Copies the tensor `name` into fp32 after checking its dtype (one of `dtypes`: F32, F16) and
// shape.
absl::Status ReadTensor(const SafetensorsFile& file, const std::string& name,
                        std::vector<std::string> dtypes, std::vector<int64_t> shape,
                        std::vector<float>* out) {
  const std::string expected = absl::StrCat(absl::StrJoin(dtypes, " or "), " ", ShapeString(shape));
  const SafetensorsTensor* tensor = file.Find(name);
  if (tensor == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": missing tensor '", name, "' (expected ", expected, ")"));
  }
  if (std::find(dtypes.begin(), dtypes.end(), tensor->dtype) == dtypes.end()) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", name, "' has dtype ",
                                                   tensor->dtype, ", expected ", expected));
  }
  if (tensor->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", name, "' has shape ",
                                                   ShapeString(tensor->shape), ", expected ",
                                                   expected));
  }
  const int64_t count = tensor->num_elements();
  out->resize(count);
  if (tensor->dtype == "F32") {
    std::memcpy(out->data(), tensor->bytes.data(), count * sizeof(float));
  } else {  // F16, little-endian
    const std::byte* bytes = tensor->bytes.data();
    for (int64_t i = 0; i < count; ++i) {
      const auto half = static_cast<uint16_t>(static_cast<uint16_t>(bytes[2 * i]) |
                                              static_cast<uint16_t>(bytes[2 * i + 1]) << 8);
      (*out)[i] = HalfToFloat(half);
    }
  }
  return absl::OkStatus();
}

// Fails with INVALID_ARGUMENT naming the file if it holds a tensor outside `expected`.
absl::Status CheckNoExtraTensors(const SafetensorsFile& file,
                                 const std::vector<std::string>& expected) {
  for (const auto& [name, tensor] : file.tensors()) {
    if (std::find(expected.begin(), expected.end(), name) == expected.end()) {
      return absl::InvalidArgumentError(absl::StrCat(file.path(), ": unexpected tensor '", name,
                                                     "' (not part of docs/model.md's format)"));
    }
  }
  return absl::OkStatus();
}

// Appends `part` to `out` (stacking weight matrices along their output dimension).
void Append(std::vector<float>* out, const std::vector<float>& part) {
  out->insert(out->end(), part.begin(), part.end());
}

std::string LayerName(int layer, absl::string_view suffix) {
  return absl::StrCat("blk.", layer, ".", suffix);
}

}  // namespace

// ---- configs ----

absl::StatusOr<LlamaConfig> LlamaConfig::FromMetadata(
    const std::map<std::string, std::string>& metadata, const std::string& path) {
  LlamaConfig config;
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "num_layers", &config.num_layers));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "d_model", &config.d_model));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "num_heads", &config.num_heads));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "num_kv_heads", &config.num_kv_heads));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "head_dim", &config.head_dim));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "ffn_dim", &config.ffn_dim));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "vocab_size", &config.vocab_size));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "context_length", &config.context_length));
  DSA_RETURN_IF_ERROR(ParseRealField(metadata, path, "rope_base", &config.rope_base));
  double rms_eps = 0;
  DSA_RETURN_IF_ERROR(ParseRealField(metadata, path, "rms_eps", &rms_eps));
  config.rms_eps = static_cast<float>(rms_eps);
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "bos_token_id", &config.bos_token_id));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "eos_token_id", &config.eos_token_id));
  DSA_RETURN_IF_ERROR(config.Validate(path));
  return config;
}

absl::Status LlamaConfig::Validate(const std::string& path) const {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": model config: ", why));
  };
  // Upper bounds keep every size product inside int64 and every GEMM dimension inside int.
  constexpr int kMaxWidth = 1 << 16;
  if (num_layers < 1 || num_layers > 1024) return bad("num_layers must be in [1, 1024]");
  if (d_model < 1 || d_model > kMaxWidth) return bad("d_model must be in [1, 65536]");
  if (num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0) {
    return bad(absl::StrCat("num_heads (", num_heads,
                            ") must be a positive multiple of "
                            "num_kv_heads (",
                            num_kv_heads, ")"));
  }
  if (head_dim < 2 || head_dim % 2 != 0 || q_dim() > kMaxWidth) {
    return bad("head_dim must be even, >= 2, and num_heads * head_dim <= 65536");
  }
  if (ffn_dim < 1 || ffn_dim > kMaxWidth) return bad("ffn_dim must be in [1, 65536]");
  if (vocab_size < 1 || vocab_size > (1 << 24)) return bad("vocab_size must be in [1, 2^24]");
  if (context_length < 1 || context_length > (1 << 20)) {
    return bad("context_length must be in [1, 2^20]");
  }
  if (!(rope_base > 1)) return bad("rope_base must be > 1");
  if (!(rms_eps > 0)) return bad("rms_eps must be > 0");
  if (bos_token_id < 0 || bos_token_id >= vocab_size || eos_token_id < 0 ||
      eos_token_id >= vocab_size) {
    return bad("bos_token_id and eos_token_id must be in [0, vocab_size)");
  }
  return absl::OkStatus();
}

LlamaConfig SmolLM2Config() {
  LlamaConfig config;
  config.num_layers = 30;
  config.d_model = 576;
  config.num_heads = 9;
  config.num_kv_heads = 3;
  config.head_dim = 64;
  config.ffn_dim = 1536;
  config.vocab_size = 49152;
  config.context_length = 8192;
  config.rope_base = 100000.0;
  config.rms_eps = 1e-5f;
  config.bos_token_id = 1;
  config.eos_token_id = 2;
  return config;
}

absl::StatusOr<LightningIndexerConfig> LightningIndexerConfig::FromMetadata(
    const std::map<std::string, std::string>& metadata, const std::string& path) {
  LightningIndexerConfig config;
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "num_layers", &config.num_layers));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "num_heads", &config.num_heads));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "head_dim", &config.head_dim));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "query_rank", &config.query_rank));
  DSA_RETURN_IF_ERROR(ParseIntField(metadata, path, "rope_dims", &config.rope_dims));
  DSA_RETURN_IF_ERROR(ParseRealField(metadata, path, "rope_base", &config.rope_base));
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": indexer config: ", why));
  };
  constexpr int kMaxWidth = 1 << 12;
  if (config.num_layers < 1 || config.num_layers > 1024) return bad("num_layers not in [1, 1024]");
  if (config.num_heads < 1 || config.num_heads > kMaxWidth || config.head_dim < 1 ||
      config.head_dim > kMaxWidth || config.query_rank < 1 || config.query_rank > kMaxWidth) {
    return bad("num_heads, head_dim and query_rank must be in [1, 4096]");
  }
  if (config.rope_dims < 0 || config.rope_dims % 2 != 0 || config.rope_dims > config.head_dim) {
    return bad(
        absl::StrCat("rope_dims (", config.rope_dims, ") must be even and in [0, head_dim]"));
  }
  if (!(config.rope_base > 1)) return bad("rope_base must be > 1");
  return config;
}

float LightningIndexerConfig::head_weight_scale() const {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(num_heads) * head_dim));
}

// ---- LlamaModel ----

absl::StatusOr<std::shared_ptr<const LlamaModel>> LlamaModel::Load(
    const std::string& model_path, const std::string& indexer_path) {
  DSA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(model_path));
  DSA_RETURN_IF_ERROR(CheckFormat(*file, kLlamaModelFormat));
  DSA_ASSIGN_OR_RETURN(LlamaConfig config, LlamaConfig::FromMetadata(file->metadata(), model_path));
  const auto model_name = file->metadata().find("dsa.model");
  if (model_name != file->metadata().end() && model_name->second == kSmolLM2ModelName) {
    const LlamaConfig expected = SmolLM2Config();
    const auto check = [&](const char* name, double actual, double wanted) {
      return actual == wanted ? absl::OkStatus()
                              : absl::InvalidArgumentError(absl::StrCat(
                                    model_path, ": metadata '", name, "' is ", actual,
                                    ", expected ", wanted, " for ", kSmolLM2ModelName));
    };
    DSA_RETURN_IF_ERROR(check("num_layers", config.num_layers, expected.num_layers));
    DSA_RETURN_IF_ERROR(check("d_model", config.d_model, expected.d_model));
    DSA_RETURN_IF_ERROR(check("num_heads", config.num_heads, expected.num_heads));
    DSA_RETURN_IF_ERROR(check("num_kv_heads", config.num_kv_heads, expected.num_kv_heads));
    DSA_RETURN_IF_ERROR(check("head_dim", config.head_dim, expected.head_dim));
    DSA_RETURN_IF_ERROR(check("ffn_dim", config.ffn_dim, expected.ffn_dim));
    DSA_RETURN_IF_ERROR(check("vocab_size", config.vocab_size, expected.vocab_size));
    DSA_RETURN_IF_ERROR(check("context_length", config.context_length, expected.context_length));
    DSA_RETURN_IF_ERROR(check("rope_base", config.rope_base, expected.rope_base));
    DSA_RETURN_IF_ERROR(check("rms_eps", config.rms_eps, expected.rms_eps));
    DSA_RETURN_IF_ERROR(check("bos_token_id", config.bos_token_id, expected.bos_token_id));
    DSA_RETURN_IF_ERROR(check("eos_token_id", config.eos_token_id, expected.eos_token_id));
  }

  const int64_t d = config.d_model, q = config.q_dim(), kv = config.kv_dim(), f = config.ffn_dim;
  std::vector<std::string> names = {"token_embd.weight", "output_norm.weight"};
  std::vector<float> token_embd, output_norm;
  DSA_RETURN_IF_ERROR(
      ReadTensor(*file, "token_embd.weight", {"F32"}, {config.vocab_size, d}, &token_embd));
  DSA_RETURN_IF_ERROR(ReadTensor(*file, "output_norm.weight", {"F32"}, {d}, &output_norm));
  std::vector<Layer> layers(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) {
    Layer& layer = layers[l];
    std::vector<float> part;
    const auto read = [&](absl::string_view suffix, std::vector<int64_t> shape,
                          std::vector<float>* out) {
      names.push_back(LayerName(l, suffix));
      return ReadTensor(*file, names.back(), {"F32"}, std::move(shape), out);
    };
    DSA_RETURN_IF_ERROR(read("attn_norm.weight", {d}, &layer.attn_norm));
    DSA_RETURN_IF_ERROR(read("attn_q.weight", {q, d}, &layer.wqkv));
    DSA_RETURN_IF_ERROR(read("attn_k.weight", {kv, d}, &part));
    Append(&layer.wqkv, part);
    DSA_RETURN_IF_ERROR(read("attn_v.weight", {kv, d}, &part));
    Append(&layer.wqkv, part);
    DSA_RETURN_IF_ERROR(read("attn_output.weight", {d, q}, &layer.wo));
    DSA_RETURN_IF_ERROR(read("ffn_norm.weight", {d}, &layer.ffn_norm));
    DSA_RETURN_IF_ERROR(read("ffn_gate.weight", {f, d}, &layer.wgate_up));
    DSA_RETURN_IF_ERROR(read("ffn_up.weight", {f, d}, &part));
    Append(&layer.wgate_up, part);
    DSA_RETURN_IF_ERROR(read("ffn_down.weight", {d, f}, &layer.wdown));
  }
  DSA_RETURN_IF_ERROR(CheckNoExtraTensors(*file, names));

  LightningIndexerConfig indexer_config;
  std::vector<IndexerLayer> indexer_layers;
  if (!indexer_path.empty()) {
    DSA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> indexer_file,
                         SafetensorsFile::Open(indexer_path));
    DSA_RETURN_IF_ERROR(CheckFormat(*indexer_file, kLightningIndexerFormat));
    DSA_ASSIGN_OR_RETURN(indexer_config, LightningIndexerConfig::FromMetadata(
                                             indexer_file->metadata(), indexer_path));
    if (indexer_config.num_layers != config.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          indexer_path, ": the indexer has ", indexer_config.num_layers, " layers, expected ",
          config.num_layers, " (the layers of ", model_path, "): an indexer for another model"));
    }
    const auto base_digest = indexer_file->metadata().find("base_model_sha256");
    const auto model_digest = file->metadata().find("source_sha256");
    if (base_digest != indexer_file->metadata().end() && !base_digest->second.empty() &&
        model_digest != file->metadata().end() && base_digest->second != model_digest->second) {
      return absl::InvalidArgumentError(
          absl::StrCat(indexer_path, ": base_model_sha256 is ", base_digest->second, ", expected ",
                       model_digest->second, " (the source_sha256 of ", model_path,
                       "): an indexer for another model"));
    }
    const int64_t h = indexer_config.num_heads, dk = indexer_config.head_dim,
                  r = indexer_config.query_rank;
    std::vector<std::string> indexer_names;
    indexer_layers.resize(config.num_layers);
    for (int l = 0; l < config.num_layers; ++l) {
      IndexerLayer& layer = indexer_layers[l];
      std::vector<float> part;
      const auto read = [&](absl::string_view suffix, std::vector<int64_t> shape,
                            std::vector<float>* out) {
        indexer_names.push_back(LayerName(l, suffix));
        return ReadTensor(*indexer_file, indexer_names.back(), {"F16", "F32"}, std::move(shape),
                          out);
      };
      DSA_RETURN_IF_ERROR(read("indexer.q_a.weight", {r, d}, &layer.wproj));
      DSA_RETURN_IF_ERROR(read("indexer.k.weight", {dk, d}, &part));
      Append(&layer.wproj, part);
      DSA_RETURN_IF_ERROR(read("indexer.weights_proj.weight", {h, d}, &part));
      Append(&layer.wproj, part);
      DSA_RETURN_IF_ERROR(read("indexer.q_b.weight", {h * dk, r}, &layer.wqb));
      DSA_RETURN_IF_ERROR(read("indexer.k_norm.weight", {dk}, &layer.k_norm_weight));
      DSA_RETURN_IF_ERROR(read("indexer.k_norm.bias", {dk}, &layer.k_norm_bias));
    }
    DSA_RETURN_IF_ERROR(CheckNoExtraTensors(*indexer_file, indexer_names));
  }
  return FromWeights(config, std::move(token_embd), std::move(output_norm), std::move(layers),
                     indexer_config, std::move(indexer_layers));
}

absl::StatusOr<std::shared_ptr<const LlamaModel>> LlamaModel::FromWeights(
    const LlamaConfig& config, std::vector<float> token_embd, std::vector<float> output_norm,
    std::vector<Layer> layers, const LightningIndexerConfig& indexer_config,
    std::vector<IndexerLayer> indexer_layers) {
  DSA_RETURN_IF_ERROR(config.Validate("LlamaModel::FromWeights"));
  const auto bad = [](absl::string_view what, size_t size, int64_t expected) {
    return absl::InvalidArgumentError(absl::StrCat("LlamaModel::FromWeights: ", what, " has ", size,
                                                   " values, expected ", expected));
  };
  const int64_t d = config.d_model, q = config.q_dim(), kv = config.kv_dim(), f = config.ffn_dim;
  if (static_cast<int64_t>(token_embd.size()) != config.vocab_size * d) {
    return bad("token_embd", token_embd.size(), config.vocab_size * d);
  }
  if (static_cast<int64_t>(output_norm.size()) != d)
    return bad("output_norm", output_norm.size(), d);
  if (static_cast<int>(layers.size()) != config.num_layers) {
    return bad("layers", layers.size(), config.num_layers);
  }
  for (const Layer& layer : layers) {
    if (static_cast<int64_t>(layer.attn_norm.size()) != d)
      return bad("attn_norm", layer.attn_norm.size(), d);
    if (static_cast<int64_t>(layer.wqkv.size()) != (q + 2 * kv) * d) {
      return bad("wqkv", layer.wqkv.size(), (q + 2 * kv) * d);
    }
    if (static_cast<int64_t>(layer.wo.size()) != d * q) return bad("wo", layer.wo.size(), d * q);
    if (static_cast<int64_t>(layer.ffn_norm.size()) != d)
      return bad("ffn_norm", layer.ffn_norm.size(), d);
    if (static_cast<int64_t>(layer.wgate_up.size()) != 2 * f * d) {
      return bad("wgate_up", layer.wgate_up.size(), 2 * f * d);
    }
    if (static_cast<int64_t>(layer.wdown.size()) != d * f)
      return bad("wdown", layer.wdown.size(), d * f);
  }
  if (!indexer_layers.empty()) {
    if (static_cast<int>(indexer_layers.size()) != config.num_layers ||
        indexer_config.num_layers != config.num_layers) {
      return bad("indexer_layers", indexer_layers.size(), config.num_layers);
    }
    const int64_t h = indexer_config.num_heads, dk = indexer_config.head_dim,
                  r = indexer_config.query_rank;
    if (h < 1 || dk < 1 || r < 1 || indexer_config.rope_dims % 2 != 0 ||
        indexer_config.rope_dims < 0 || indexer_config.rope_dims > dk) {
      return absl::InvalidArgumentError("LlamaModel::FromWeights: bad indexer config");
    }
    for (const IndexerLayer& layer : indexer_layers) {
      if (static_cast<int64_t>(layer.wproj.size()) != (r + dk + h) * d) {
        return bad("indexer wproj", layer.wproj.size(), (r + dk + h) * d);
      }
      if (static_cast<int64_t>(layer.wqb.size()) != h * dk * r)
        return bad("indexer wqb", layer.wqb.size(), h * dk * r);
      if (static_cast<int64_t>(layer.k_norm_weight.size()) != dk ||
          static_cast<int64_t>(layer.k_norm_bias.size()) != dk) {
        return bad("indexer k_norm", layer.k_norm_weight.size(), dk);
      }
    }
  }
  DSA_RETURN_IF_ERROR(Blas().status());
  std::shared_ptr<LlamaModel> model(new LlamaModel());
  model->config_ = config;
  model->indexer_config_ = indexer_config;
  model->token_embd_ = std::move(token_embd);
  model->output_norm_ = std::move(output_norm);
  model->layers_ = std::move(layers);
  model->indexer_layers_ = std::move(indexer_layers);
  return std::shared_ptr<const LlamaModel>(std::move(model));
}

int64_t LlamaModel::weight_bytes() const {
  int64_t values = static_cast<int64_t>(token_embd_.size() + output_norm_.size());
  for (const Layer& layer : layers_) {
    values +=
        static_cast<int64_t>(layer.attn_norm.size() + layer.wqkv.size() + layer.wo.size() +
                             layer.ffn_norm.size() + layer.wgate_up.size() + layer.wdown.size());
  }
  for (const IndexerLayer& layer : indexer_layers_) {
    values += static_cast<int64_t>(layer.wproj.size() + layer.wqb.size() +
                                   layer.k_norm_weight.size() + layer.k_norm_bias.size());
  }
  return values * static_cast<int64_t>(sizeof(float));
}

// ---- LlamaKvCache ----

LlamaKvCache::LlamaKvCache(const LlamaModel& model)
    : num_layers_(model.config().num_layers),
      kv_dim_(model.config().kv_dim()),
      context_length_(model.config().context_length),
      keys_(num_layers_),
      values_(num_layers_) {}

absl::Status LlamaKvCache::Truncate(int64_t num_slots) {
  if (in_pass()) {
    return absl::FailedPreconditionError("LlamaKvCache::Truncate: the cache is in a pass");
  }
  if (num_slots < 0 || num_slots > num_slots_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LlamaKvCache::Truncate: ", num_slots, " slots requested, the cache holds ", num_slots_));
  }
  num_slots_ = num_slots;
  return absl::OkStatus();
}

absl::Status LlamaKvCache::CopyFrom(const LlamaKvCache& source) {
  if (&source == this || source.num_layers_ != num_layers_ || source.kv_dim_ != kv_dim_ ||
      source.context_length_ != context_length_) {
    return absl::InvalidArgumentError(
        "LlamaKvCache::CopyFrom: the source is this cache or was made for another model shape");
  }
  // The source's fields are read only after its mark reads clear (in_pass()'s acquire).
  if (in_pass() || source.in_pass()) {
    return absl::FailedPreconditionError("LlamaKvCache::CopyFrom: a cache is in a pass");
  }
  const int64_t n = source.num_slots_;
  DSA_RETURN_IF_ERROR(Reserve(n));
  for (int l = 0; l < num_layers_; ++l) {
    std::copy_n(source.keys_[l].data(), n * kv_dim_, keys_[l].data());
    std::copy_n(source.values_[l].data(), n * kv_dim_, values_[l].data());
  }
  num_slots_ = n;
  return absl::OkStatus();
}

int64_t LlamaKvCache::bytes() const {
  return 2 * static_cast<int64_t>(num_layers_) * capacity_ * kv_dim_ *
         static_cast<int64_t>(sizeof(float));
}

std::span<const float> LlamaKvCache::keys(int layer) const {
  return std::span<const float>(keys_[layer].data(), num_slots_ * kv_dim_);
}

std::span<const float> LlamaKvCache::values(int layer) const {
  return std::span<const float>(values_[layer].data(), num_slots_ * kv_dim_);
}

absl::Status LlamaKvCache::Reserve(int64_t slots) {
  if (slots <= capacity_) return absl::OkStatus();
  const int64_t capacity =
      std::min(context_length_, std::max({slots, 2 * capacity_, static_cast<int64_t>(64)}));
  try {
    for (int l = 0; l < num_layers_; ++l) {
      keys_[l].resize(capacity * kv_dim_);
      values_[l].resize(capacity * kv_dim_);
    }
  } catch (const std::bad_alloc&) {
    // Layers already grown keep their memory; capacity_ stays what every layer holds.
    return absl::ResourceExhaustedError(absl::StrCat(
        "LlamaKvCache: cannot allocate ", capacity, " slots (",
        2 * capacity * kv_dim_ * num_layers_ * static_cast<int64_t>(sizeof(float)), " bytes)"));
  }
  capacity_ = capacity;
  return absl::OkStatus();
}

}  // namespace dsa
