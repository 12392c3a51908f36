// The real model's CPU forward pass (llama_model.h, docs/model.md): loading and checking the
// safetensors weights, the KV cache, and the layer-by-layer pass over OpenBLAS GEMMs and OpenMP.
#include "attention_worker/llama_model.h"

#include <cblas.h>  // declarations only: OpenBLAS is loaded with dlopen (Blas() below)
#include <dlfcn.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "absl/base/config.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace dsa {
namespace {

// Rows of a dense-attention tile: the tile's score block is [rows * heads per KV head, slots].
constexpr int kAttentionTileRows = 64;
// Rows of one feed-forward chunk (bounds the [rows, 2 ffn_dim] scratch: 25 MB at SmolLM2's shape).
constexpr int64_t kFfnChunkRows = 2048;
// Below this many rows the light per-row loops (norms, rotations, cache writes) run serially.
constexpr int64_t kParallelMinRows = 256;
// Keys per block of IndexScores (bounds its [keys, heads] scratch).
constexpr int64_t kIndexScoreBlock = 512;

// The OpenBLAS functions the model calls.
struct BlasFunctions {
  decltype(&cblas_sgemm) sgemm = nullptr;
  decltype(&cblas_sgemv) sgemv = nullptr;
};

// OpenBLAS, loaded once (thread-safe) by the first model built or IndexScores call, and never
// unloaded. It is dlopened, not linked: a linked libopenblas.so.0 is in every startup link map, and
// its 60 KB of TLS then lands in every thread's static TLS block, which glibc takes out of each
// thread's stack. Debian civetweb's /metrics threads ask for 100 KB and kept 12 KB (with CUDA's
// libraries); serving a scrape overflowed that, jumping the guard page into the civetweb master
// thread's descriptor, and dsa-attention died with SIGSEGV (cuda/standin_module.h: the same with
// cuBLAS). Loaded later, the library's TLS (the general-dynamic model) is allocated on first use,
// by the threads that call it. With OpenBLAS's pthread build, its own threads would compete with
// the model's OpenMP threads: it is set to one thread. (The OpenMP build runs single-threaded
// inside a parallel region by itself, and its openblas_set_num_threads would change OpenMP's
// thread count: left alone.)
const absl::StatusOr<BlasFunctions>& Blas() {
  static const absl::StatusOr<BlasFunctions> blas = []() -> absl::StatusOr<BlasFunctions> {
    void* library = dlopen(DSA_OPENBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot load OpenBLAS (" DSA_OPENBLAS_SONAME "): ", dlerror()));
    }
    const auto bind = [library](auto& function, const char* name) {
      function =
          reinterpret_cast<std::remove_reference_t<decltype(function)>>(dlsym(library, name));
      return function != nullptr;
    };
    BlasFunctions blas;
    decltype(&openblas_get_parallel) get_parallel = nullptr;
    decltype(&openblas_set_num_threads) set_num_threads = nullptr;
    if (!bind(blas.sgemm, "cblas_sgemm") || !bind(blas.sgemv, "cblas_sgemv") ||
        !bind(get_parallel, "openblas_get_parallel") ||
        !bind(set_num_threads, "openblas_set_num_threads")) {
      return absl::FailedPreconditionError(
          absl::StrCat("OpenBLAS (" DSA_OPENBLAS_SONAME ") lacks a function: ", dlerror()));
    }
    if (get_parallel() == 1) set_num_threads(1);
    return blas;
  }();
  return blas;
}

// c[m, n] = alpha * a[m, k] b[n, k]^T + beta * c (row-major; b is a weight [out, in]). Outside a
// parallel region, splits the columns over the OpenMP threads.
void GemmNT(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
            const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
            int64_t parallel_min_work) {
  if (m == 0 || n == 0) return;
  const BlasFunctions& blas = *Blas();  // loaded: a model exists
  const auto run = [&](int64_t n0, int64_t n1) {
    if (m == 1) {
      blas.sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(n1 - n0), static_cast<int>(k), alpha,
                 b + n0 * ldb, static_cast<int>(ldb), a, 1, beta, c + n0, 1);
    } else {
      blas.sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m),
                 static_cast<int>(n1 - n0), static_cast<int>(k), alpha, a, static_cast<int>(lda),
                 b + n0 * ldb, static_cast<int>(ldb), beta, c + n0, static_cast<int>(ldc));
    }
  };
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (threads <= 1 || m * n * k < parallel_min_work || n < 32) {
    run(0, n);
    return;
  }
  // Column blocks, multiples of 16, about two per thread for balance.
  const int64_t parts = std::min<int64_t>(2 * threads, n / 16);
  const int64_t width = (n / parts + 15) / 16 * 16;
  const int64_t num_blocks = (n + width - 1) / width;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t block = 0; block < num_blocks; ++block) {
    run(block * width, std::min(n, (block + 1) * width));
  }
}

// c[m, n] = a[m, k] b[k, n] (row-major), on the calling thread.
void GemmNN(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
            int64_t ldb, float* c, int64_t ldc) {
  Blas()->sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b, static_cast<int>(ldb), 0.0f,
                c, static_cast<int>(ldc));
}

// out[i] = x[i] / sqrt(mean(x^2) + eps) * weight[i] over one row of width n.
void RmsNormRow(const float* x, const float* weight, int64_t n, float eps, float* out) {
  double sum_squares = 0;
  for (int64_t i = 0; i < n; ++i) sum_squares += static_cast<double>(x[i]) * x[i];
  const auto inv = static_cast<float>(1.0 / std::sqrt(sum_squares / n + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

// Rotates adjacent pairs (2j, 2j+1) of `x`'s first 2 * pairs values by the angles whose cos / sin
// are given (one per pair).
void RotatePairs(float* x, const float* cos, const float* sin, int pairs) {
  for (int j = 0; j < pairs; ++j) {
    const float a = x[2 * j], b = x[2 * j + 1];
    x[2 * j] = a * cos[j] - b * sin[j];
    x[2 * j + 1] = a * sin[j] + b * cos[j];
  }
}

// exp(x) for the softmax's shifted logits (x <= 0; NaN-free): Cephes' expf polynomial on
// x = n ln 2 + r, |r| <= ln(2) / 2, then 2^n from the exponent bits; within 2 ulp of expf. Inputs
// below -87.3 give about 1e-38 instead of a denormal or 0 (negligible beside the row's max term,
// which is 1). Plain arithmetic, so the loops calling it vectorize.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.3f);
  constexpr float kLog2e = 1.44269504088896341f, kRound = 12582912.0f;  // 1.5 * 2^23
  const float n = (x * kLog2e + kRound) - kRound;                       // round to nearest
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;          // x - n ln 2, two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const auto bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

// In-place softmax over row[0, n), n >= 1 (the attention's hot loop: one clone per x86 level).
// Not under ThreadSanitizer: the clones' ifunc resolver, instrumented, runs at load before TSan's
// runtime is up and crashes the process (as indexer_service/scoring.cc's ScoreTile).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(ABSL_HAVE_THREAD_SANITIZER)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void SoftmaxRow(float* row, int64_t n) {
  float max_value = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max_value)
  for (int64_t j = 0; j < n; ++j) max_value = row[j] > max_value ? row[j] : max_value;
  float total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < n; ++j) {
    row[j] = ExpNonPositive(row[j] - max_value);
    total += row[j];
  }
  const float inv = 1.0f / total;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
}

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

// ---- LlamaForward ----

LlamaForward::LlamaForward(std::shared_ptr<const LlamaModel> model, std::vector<LlamaRow> rows,
                           const LlamaForwardOptions& options)
    : model_(std::move(model)), options_(options), rows_(std::move(rows)) {}

LlamaForward::~LlamaForward() {
  for (const auto& group : groups_) group.cache->in_pass_ = false;
}

absl::StatusOr<std::unique_ptr<LlamaForward>> LlamaForward::Begin(
    std::shared_ptr<const LlamaModel> model, std::vector<LlamaRow> rows,
    const LlamaForwardOptions& options) {
  if (model == nullptr) return absl::InvalidArgumentError("LlamaForward::Begin: no model");
  if (options.parallel_min_work < 1) {
    return absl::InvalidArgumentError("LlamaForward::Begin: parallel_min_work must be >= 1");
  }
  const LlamaConfig& config = model->config();
  auto grouped = GroupLlamaRows<LlamaKvCache>(
      "LlamaForward::Begin", config.vocab_size, config.context_length, rows,
      [&](size_t r) -> absl::StatusOr<LlamaKvCache*> {
        LlamaKvCache* kv = rows[r].kv;
        if (kv == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("LlamaForward::Begin: row ", r, " has no cache"));
        }
        if (kv->num_layers_ != config.num_layers || kv->kv_dim_ != config.kv_dim()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "LlamaForward::Begin: row ", r, "'s cache was made for another model shape"));
        }
        return kv;
      });
  if (!grouped.ok()) return grouped.status();
  std::vector<LlamaCacheRows<LlamaKvCache>> groups = *std::move(grouped);
  for (const auto& group : groups) {
    if (group.cache->in_pass()) {
      return absl::FailedPreconditionError("LlamaForward::Begin: a cache is in another pass");
    }
  }
  for (const auto& group : groups) {
    DSA_RETURN_IF_ERROR(group.cache->Reserve(group.first_position +
                                             static_cast<int64_t>(group.rows_by_position.size())));
  }

  std::unique_ptr<LlamaForward> pass(new LlamaForward(std::move(model), std::move(rows), options));
  const LlamaModel& m = *pass->model_;
  for (const auto& group : groups) group.cache->in_pass_ = true;
  pass->groups_ = std::move(groups);
  const int64_t n = pass->num_rows(), d = config.d_model;
  pass->h_.resize(n * d);
  pass->x_.resize(n * d);
  pass->qkv_.resize(n * (config.q_dim() + 2 * config.kv_dim()));
  pass->attn_.resize(n * config.q_dim());
  const int pairs = config.head_dim / 2;
  pass->rope_cos_.resize(n * pairs);
  pass->rope_sin_.resize(n * pairs);
  const int index_pairs = m.has_indexer() ? m.indexer_config_.rope_dims / 2 : 0;
  pass->index_rope_cos_.resize(n * index_pairs);
  pass->index_rope_sin_.resize(n * index_pairs);
  const std::vector<double> theta = RopeFrequencies(config.rope_base, config.head_dim);
  const std::vector<double> index_theta =
      RopeFrequencies(m.indexer_config_.rope_base, 2 * index_pairs);
  for (int64_t r = 0; r < n; ++r) {
    const LlamaRow& row = pass->rows_[r];
    std::memcpy(&pass->h_[r * d], &m.token_embd_[static_cast<int64_t>(row.token) * d],
                d * sizeof(float));
    RopeAngles(row.position, theta, &pass->rope_cos_[r * pairs], &pass->rope_sin_[r * pairs]);
    if (index_pairs > 0) {
      RopeAngles(row.position, index_theta, &pass->index_rope_cos_[r * index_pairs],
                 &pass->index_rope_sin_[r * index_pairs]);
    }
  }
  return pass;
}

void LlamaForward::ComputeLayerInput() {
  if (x_layer_ == layer_) return;
  const LlamaConfig& config = model_->config();
  const int64_t n = num_rows(), d = config.d_model;
  const float* weight = model_->layers_[layer_].attn_norm.data();
#pragma omp parallel for schedule(static) if (n >= kParallelMinRows)
  for (int64_t r = 0; r < n; ++r) RmsNormRow(&h_[r * d], weight, d, config.rms_eps, &x_[r * d]);
  x_layer_ = layer_;
}

absl::Status LlamaForward::IndexerInputs(std::span<float> queries, std::span<float> head_weights,
                                         std::span<float> index_keys) {
  if (!model_->has_indexer()) {
    return absl::FailedPreconditionError("LlamaForward::IndexerInputs: the model has no indexer");
  }
  if (done()) return absl::FailedPreconditionError("LlamaForward::IndexerInputs: the pass is done");
  const LightningIndexerConfig& ic = model_->indexer_config_;
  const int64_t n = num_rows(), h = ic.num_heads, dk = ic.head_dim, rank = ic.query_rank;
  if (static_cast<int64_t>(queries.size()) != n * h * dk ||
      static_cast<int64_t>(head_weights.size()) != n * h ||
      static_cast<int64_t>(index_keys.size()) != n * dk) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LlamaForward::IndexerInputs: expected queries [", n, ", ", h, ", ", dk,
        "], head_weights [", n, ", ", h, "], index_keys [", n, ", ", dk, "] values; got ",
        queries.size(), ", ", head_weights.size(), ", ", index_keys.size()));
  }
  ComputeLayerInput();
  const LlamaModel::IndexerLayer& layer = model_->indexer_layers_[layer_];
  const int64_t d = model_->config().d_model, width = rank + dk + h;
  std::vector<float>& proj = index_proj_;
  proj.resize(n * width);
  GemmNT(n, width, d, 1.0f, x_.data(), d, layer.wproj.data(), d, 0.0f, proj.data(), width,
         options_.parallel_min_work);
  GemmNT(n, h * dk, rank, 1.0f, proj.data(), width, layer.wqb.data(), rank, 0.0f, queries.data(),
         h * dk, options_.parallel_min_work);
  const int pairs = ic.rope_dims / 2;
  const float scale = ic.head_weight_scale();
#pragma omp parallel for schedule(static) if (n >= kParallelMinRows)
  for (int64_t r = 0; r < n; ++r) {
    const float* cos = index_rope_cos_.data() + r * pairs;
    const float* sin = index_rope_sin_.data() + r * pairs;
    for (int64_t head = 0; head < h; ++head) {
      RotatePairs(&queries[(r * h + head) * dk], cos, sin, pairs);
    }
    // k = RoPE(LayerNorm(Wk x)).
    const float* k_raw = &proj[r * width + rank];
    double mean = 0, variance = 0;
    for (int64_t i = 0; i < dk; ++i) mean += k_raw[i];
    mean /= static_cast<double>(dk);
    for (int64_t i = 0; i < dk; ++i) variance += (k_raw[i] - mean) * (k_raw[i] - mean);
    variance /= static_cast<double>(dk);
    const auto inv = static_cast<float>(1.0 / std::sqrt(variance + ic.k_norm_eps));
    float* key = &index_keys[r * dk];
    for (int64_t i = 0; i < dk; ++i) {
      key[i] = (k_raw[i] - static_cast<float>(mean)) * inv * layer.k_norm_weight[i] +
               layer.k_norm_bias[i];
    }
    RotatePairs(key, cos, sin, pairs);
    for (int64_t head = 0; head < h; ++head) {
      head_weights[r * h + head] = proj[r * width + rank + dk + head] * scale;
    }
  }
  return absl::OkStatus();
}

absl::Status LlamaForward::RunLayer(std::span<const std::span<const int32_t>> selections) {
  if (done()) return absl::FailedPreconditionError("LlamaForward::RunLayer: the pass is done");
  const int64_t n = num_rows();
  DSA_RETURN_IF_ERROR(
      CheckLlamaSelections("LlamaForward::RunLayer", rows_, selections, selection_seen_));

  const LlamaConfig& config = model_->config();
  const LlamaModel::Layer& layer = model_->layers_[layer_];
  const int64_t d = config.d_model, q = config.q_dim(), kv = config.kv_dim(), f = config.ffn_dim;
  const int64_t hd = config.head_dim, width = q + 2 * kv;
  ComputeLayerInput();
  GemmNT(n, width, d, 1.0f, x_.data(), d, layer.wqkv.data(), d, 0.0f, qkv_.data(), width,
         options_.parallel_min_work);
  const int pairs = config.head_dim / 2;
#pragma omp parallel for schedule(static) if (n >= kParallelMinRows)
  for (int64_t r = 0; r < n; ++r) {
    float* row = &qkv_[r * width];
    const float* cos = &rope_cos_[r * pairs];
    const float* sin = &rope_sin_[r * pairs];
    for (int64_t head = 0; head < config.num_heads + config.num_kv_heads; ++head) {
      RotatePairs(row + head * hd, cos, sin, pairs);
    }
    LlamaKvCache& cache = *rows_[r].kv;
    const int64_t slot = rows_[r].position;
    std::memcpy(&cache.keys_[layer_][slot * kv], row + q, kv * sizeof(float));
    std::memcpy(&cache.values_[layer_][slot * kv], row + q + kv, kv * sizeof(float));
  }
  Attention(selections);
  // h += Wo o.
  GemmNT(n, d, q, 1.0f, attn_.data(), q, layer.wo.data(), q, 1.0f, h_.data(), d,
         options_.parallel_min_work);
  // h += Wdown (silu(Wgate y) * (Wup y)), y = RMSNorm(h) * ffn_norm, in chunks of rows.
  const int64_t chunk = std::min(n, kFfnChunkRows);
  std::vector<float>& y = ffn_input_;
  std::vector<float>& gate_up = ffn_gate_up_;
  y.resize(chunk * d);
  gate_up.resize(chunk * 2 * f);
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rows = std::min(chunk, n - r0);
#pragma omp parallel for schedule(static) if (rows >= kParallelMinRows)
    for (int64_t r = 0; r < rows; ++r) {
      RmsNormRow(&h_[(r0 + r) * d], layer.ffn_norm.data(), d, config.rms_eps, &y[r * d]);
    }
    GemmNT(rows, 2 * f, d, 1.0f, y.data(), d, layer.wgate_up.data(), d, 0.0f, gate_up.data(), 2 * f,
           options_.parallel_min_work);
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; ++r) {
      float* g = &gate_up[r * 2 * f];
      const float* u = g + f;
      for (int64_t i = 0; i < f; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
    GemmNT(rows, d, f, 1.0f, gate_up.data(), 2 * f, layer.wdown.data(), f, 1.0f, &h_[r0 * d], d,
           options_.parallel_min_work);
  }
  ++layer_;
  if (done()) {
    for (const auto& group : groups_) {
      group.cache->num_slots_ =
          group.first_position + static_cast<int64_t>(group.rows_by_position.size());
      group.cache->in_pass_ = false;
    }
    groups_.clear();
  }
  return absl::OkStatus();
}

void LlamaForward::Attention(std::span<const std::span<const int32_t>> selections) {
  const LlamaConfig& config = model_->config();
  const int64_t q = config.q_dim(), kv = config.kv_dim(), hd = config.head_dim;
  const int64_t width = q + 2 * kv;
  const int64_t group_heads = config.num_heads / config.num_kv_heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  // Tasks: a tile of dense rows of one cache (rows_by_position[begin, end)) x one KV head, or one
  // sparse row x one KV head.
  struct Task {
    int32_t group = 0;
    int32_t begin = 0, end = 0;  // dense tile (indices into dense_rows[group])
    int32_t sparse_row = -1;     // or a sparse row
  };
  std::vector<std::vector<int32_t>> dense_rows(groups_.size());
  std::vector<Task> tiles;
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (const int32_t r : groups_[g].rows_by_position) {
      if (selections.empty() || selections[r].empty()) {
        dense_rows[g].push_back(r);
      } else {
        tiles.push_back({static_cast<int32_t>(g), 0, 0, r});
      }
    }
    const auto count = static_cast<int32_t>(dense_rows[g].size());
    for (int32_t begin = 0; begin < count; begin += kAttentionTileRows) {
      tiles.push_back(
          {static_cast<int32_t>(g), begin, std::min(count, begin + kAttentionTileRows), -1});
    }
  }
  const auto num_tasks = static_cast<int64_t>(tiles.size()) * config.num_kv_heads;
  int64_t work = 0;  // multiply-adds of Q K^T and P V, all tasks
  for (const Task& tile : tiles) {
    if (tile.sparse_row >= 0) {
      work += static_cast<int64_t>(selections[tile.sparse_row].size()) * 2 * q;
    } else {
      const auto& tile_rows = dense_rows[tile.group];
      work += static_cast<int64_t>(tile.end - tile.begin) *
              (rows_[tile_rows[tile.end - 1]].position + 1) * 2 * q;
    }
  }
  const int layer = layer_;

  const bool parallel = num_tasks > 1 && work >= options_.parallel_min_work;
  scratch_.resize(parallel ? omp_get_max_threads() : 1);
#pragma omp parallel if (parallel)
  {
    AttentionScratch& scratch = scratch_[omp_get_thread_num()];
    std::vector<float>& query = scratch.query;
    std::vector<float>& scores = scratch.scores;
    std::vector<float>& out = scratch.out;
    std::vector<float>& gathered_keys = scratch.gathered_keys;
    std::vector<float>& gathered_values = scratch.gathered_values;
    std::vector<int32_t>& slots = scratch.slots;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const Task& tile = tiles[task / config.num_kv_heads];
      const int64_t kv_head = task % config.num_kv_heads;
      const LlamaKvCache& cache = *groups_[tile.group].cache;
      const float* keys = cache.keys_[layer].data() + kv_head * hd;
      const float* values = cache.values_[layer].data() + kv_head * hd;
      const int64_t q_offset = kv_head * group_heads * hd;  // this KV head's query heads
      if (tile.sparse_row >= 0) {
        // One row over its selected slots, in increasing slot order (so that the result does
        // not depend on the selection's order): gather, S = q K^T, softmax, O = S V.
        const int32_t r = tile.sparse_row;
        slots.clear();
        for (const int32_t slot : selections[r]) {
          if (slot >= 0) slots.push_back(slot);
        }
        std::sort(slots.begin(), slots.end());
        gathered_keys.clear();
        gathered_values.clear();
        for (const int32_t slot : slots) {
          gathered_keys.insert(gathered_keys.end(), keys + slot * kv, keys + slot * kv + hd);
          gathered_values.insert(gathered_values.end(), values + slot * kv,
                                 values + slot * kv + hd);
        }
        const auto count = static_cast<int64_t>(gathered_keys.size()) / hd;
        scores.resize(group_heads * count);
        GemmNT(group_heads, count, hd, scale, &qkv_[r * width + q_offset], hd, gathered_keys.data(),
               hd, 0.0f, scores.data(), count, options_.parallel_min_work);
        for (int64_t i = 0; i < group_heads; ++i) SoftmaxRow(&scores[i * count], count);
        GemmNN(group_heads, hd, count, scores.data(), count, gathered_values.data(), hd,
               &attn_[r * q + q_offset], hd);
        if (options_.selection_mass_probe) {
          // The dense softmax over slots 0..position, and its mass on the selected slots.
          const int64_t visible = rows_[r].position + 1;
          query.resize(group_heads * visible);
          GemmNT(group_heads, visible, hd, scale, &qkv_[r * width + q_offset], hd, keys, kv, 0.0f,
                 query.data(), visible, options_.parallel_min_work);
          double mass = 0;
          for (int64_t i = 0; i < group_heads; ++i) {
            float* row = &query[i * visible];
            SoftmaxRow(row, visible);
            for (const int32_t slot : slots) mass += row[slot];
          }
          options_.selection_mass_probe(groups_[tile.group].cache, layer, rows_[r].position,
                                        static_cast<int>(kv_head),
                                        mass / static_cast<double>(group_heads));
        }
        continue;
      }
      // A tile of dense rows (increasing positions): S = Q K^T over slots 0..last position,
      // the causal mask, softmax, O = S V; query row i * group_heads + j is row i's head j.
      const std::vector<int32_t>& tile_rows = dense_rows[tile.group];
      const int64_t m = static_cast<int64_t>(tile.end - tile.begin) * group_heads;
      const int64_t num_keys = rows_[tile_rows[tile.end - 1]].position + 1;
      query.resize(m * hd);
      for (int32_t i = tile.begin; i < tile.end; ++i) {
        std::memcpy(&query[(i - tile.begin) * group_heads * hd],
                    &qkv_[tile_rows[i] * width + q_offset], group_heads * hd * sizeof(float));
      }
      scores.resize(m * num_keys);
      GemmNT(m, num_keys, hd, scale, query.data(), hd, keys, kv, 0.0f, scores.data(), num_keys,
             options_.parallel_min_work);
      for (int64_t i = 0; i < m; ++i) {
        const int64_t visible = rows_[tile_rows[tile.begin + i / group_heads]].position + 1;
        float* row = &scores[i * num_keys];
        SoftmaxRow(row, visible);
        std::fill(row + visible, row + num_keys, 0.0f);
      }
      out.resize(m * hd);
      GemmNN(m, hd, num_keys, scores.data(), num_keys, values, kv, out.data(), hd);
      for (int32_t i = tile.begin; i < tile.end; ++i) {
        std::memcpy(&attn_[tile_rows[i] * q + q_offset], &out[(i - tile.begin) * group_heads * hd],
                    group_heads * hd * sizeof(float));
      }
    }
  }
}

absl::Status LlamaForward::FinalHidden(std::span<const int32_t> row_indices,
                                       std::span<float> out) const {
  if (!done()) {
    return absl::FailedPreconditionError(absl::StrCat("LlamaForward: the pass is at layer ", layer_,
                                                      " of ", model_->config().num_layers));
  }
  const int64_t d = model_->config().d_model;
  if (static_cast<int64_t>(out.size()) != static_cast<int64_t>(row_indices.size()) * d) {
    return absl::InvalidArgumentError(absl::StrCat("LlamaForward::FinalHidden: out has ",
                                                   out.size(), " values, expected ",
                                                   row_indices.size() * d));
  }
  for (const int32_t r : row_indices) {
    if (r < 0 || r >= num_rows()) {
      return absl::InvalidArgumentError(
          absl::StrCat("LlamaForward: row index ", r, " outside [0, ", num_rows(), ")"));
    }
  }
  for (size_t i = 0; i < row_indices.size(); ++i) {
    RmsNormRow(&h_[row_indices[i] * d], model_->output_norm_.data(), d, model_->config().rms_eps,
               &out[i * d]);
  }
  return absl::OkStatus();
}

absl::Status LlamaForward::Logits(std::span<const int32_t> row_indices,
                                  std::span<float> out) const {
  const int64_t d = model_->config().d_model, vocab = model_->config().vocab_size;
  const auto n = static_cast<int64_t>(row_indices.size());
  if (static_cast<int64_t>(out.size()) != n * vocab) {
    return absl::InvalidArgumentError(absl::StrCat("LlamaForward::Logits: out has ", out.size(),
                                                   " values, expected ", n * vocab));
  }
  std::vector<float> hidden(n * d);
  DSA_RETURN_IF_ERROR(FinalHidden(row_indices, std::span<float>(hidden)));
  GemmNT(n, vocab, d, 1.0f, hidden.data(), d, model_->token_embd_.data(), d, 0.0f, out.data(),
         vocab, options_.parallel_min_work);
  return absl::OkStatus();
}

absl::Status IndexScores(int num_heads, int head_dim, std::span<const float> query,
                         std::span<const float> head_weights, std::span<const float> keys,
                         std::span<float> out) {
  const int64_t h = num_heads, dk = head_dim;
  if (h < 1 || dk < 1 || static_cast<int64_t>(query.size()) != h * dk ||
      static_cast<int64_t>(head_weights.size()) != h ||
      static_cast<int64_t>(keys.size()) != static_cast<int64_t>(out.size()) * dk) {
    return absl::InvalidArgumentError(
        absl::StrCat("IndexScores: expected query [", h, ", ", dk, "], head_weights [", h,
                     "], keys [n, ", dk, "] and out [n]; got ", query.size(), ", ",
                     head_weights.size(), ", ", keys.size(), ", ", out.size()));
  }
  const absl::StatusOr<BlasFunctions>& blas = Blas();
  DSA_RETURN_IF_ERROR(blas.status());
  const auto n = static_cast<int64_t>(out.size());
  std::vector<float> dots(std::min(n, kIndexScoreBlock) * h);
  for (int64_t i0 = 0; i0 < n; i0 += kIndexScoreBlock) {
    const int64_t count = std::min(kIndexScoreBlock, n - i0);
    blas->sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(count),
                static_cast<int>(h), static_cast<int>(dk), 1.0f, keys.data() + i0 * dk,
                static_cast<int>(dk), query.data(), static_cast<int>(dk), 0.0f, dots.data(),
                static_cast<int>(h));
    for (int64_t i = 0; i < count; ++i) {
      float z = 0;
      for (int64_t head = 0; head < h; ++head) {
        z += head_weights[head] * std::max(0.0f, dots[i * h + head]);
      }
      out[i0 + i] = z;
    }
  }
  return absl::OkStatus();
}

}  // namespace dsa
