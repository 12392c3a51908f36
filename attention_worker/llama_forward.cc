// The real model's CPU forward pass (llama_model.h, docs/model.md): the layer-by-layer pass over
// OpenBLAS GEMMs and OpenMP, its kernels (GEMM, RMSNorm, rotations, softmax) and IndexScores.
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
#include "absl/strings/str_cat.h"
#include "attention_worker/llama_blas.h"
#include "attention_worker/llama_model.h"
#include "common/status_macros.h"

namespace dsa {

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

namespace {

// Rows of a dense-attention tile: the tile's score block is [rows * heads per KV head, slots].
constexpr int kAttentionTileRows = 64;
// Rows of one feed-forward chunk (bounds the [rows, 2 ffn_dim] scratch: 25 MB at SmolLM2's shape).
constexpr int64_t kFfnChunkRows = 2048;
// Below this many rows the light per-row loops (norms, rotations, cache writes) run serially.
constexpr int64_t kParallelMinRows = 256;
// Keys per block of IndexScores (bounds its [keys, heads] scratch).
constexpr int64_t kIndexScoreBlock = 512;

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

}  // namespace

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
