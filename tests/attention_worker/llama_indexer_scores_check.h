// The real model's indexer-scores check, shared by the CPU test (llama_indexer_scores_test.cc) and
// its CUDA variant (cuda/llama_indexer_scores_cuda_test.cc): the real SmolLM2-135M backbone with
// the trained lightning indexer runs over held-out tokens; the indexer inputs of a few full layers
// go through an Indexer (append, then RunLayerSelect: the entry point every data plane uses), and
// its selections (and, through Indexer::Select, its scores) must equal a double-precision reference
// of docs/model.md's z_t[i] = s_i * sum_h w_h ReLU(q_h . k^_i) over the fp8-dequantized keys
// (common/fp8.h's QuantizeIndexKey, as the service quantizes). With $DSA_INDEXER_SCORES_INPUTS
// set, the model's indexer inputs are written to that file, or read from it when it exists: the
// GPU host, which cannot receive the backbone with the tests, checks the inputs computed here.
#pragma once

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/llama_model.h"
#include "common/fp8.h"
#include "common/npy.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "indexer_service/indexer.h"
#include "indexer_service/layer_select.h"

namespace dsa::indexer_scores_check {

inline constexpr int kTokens = 512;               // held-out tokens run through the model
inline constexpr int kRows = 4;                   // rows n-4 .. n-1 select
inline constexpr int kTopK = 64;                  // K
inline constexpr int kLayers[] = {0, 2, 14, 28};  // model layers checked (indexer layers 0..3)
inline constexpr int kNumLayers = 4;
// A service slot may replace a reference top-K slot only when both reference scores lie within
// this fraction of the row's largest |z| of the K-th reference score (a near-tie).
inline constexpr double kTieTolerance = 1e-5;
// A service score (fp32) may differ from the double reference by this fraction of the slot's
// term magnitude s_i * sum_h |w_h| * sum_d |q_hd k^_id| (fp32 accumulation of 16 x 64 products).
inline constexpr double kScoreTolerance = 1e-5;

struct LayerInputs {
  int model_layer = 0;
  std::vector<float> queries;       // [n, 16, 64]
  std::vector<float> head_weights;  // [n, 16]
  std::vector<float> keys;          // [n, 64]
};

struct ModelInputs {
  int n = 0;
  int num_heads = 0;
  int head_dim = 0;
  std::vector<LayerInputs> layers;
  double forward_seconds = 0;
};

inline std::string SourceDir() { return DSA_SOURCE_DIR; }

// Runs the real model and collects the indexer inputs of kLayers. Fails (not skips) when the files
// are missing.
inline void ComputeInputs(ModelInputs* out) {
  const char* env_dir = std::getenv("DSA_MODEL_DIR");
  const std::string model_dir = (env_dir != nullptr && *env_dir != '\0')
                                    ? std::string(env_dir)
                                    : SourceDir() + "/build/models/smollm2-135m";
  const std::string model_path = model_dir + "/model.safetensors";
  const std::string tokens_path = model_dir + "/python_docs_heldout.npy";
  const std::string indexer_path = SourceDir() + "/data/models/smollm2_indexer.safetensors";
  for (const std::string& path : {model_path, tokens_path, indexer_path}) {
    ASSERT_TRUE(std::filesystem::exists(path))
        << path << " is missing: run scripts/model_setup.sh (it converts the backbone and writes "
        << "the held-out tokens; $DSA_MODEL_DIR overrides " << SourceDir()
        << "/build/models/smollm2-135m) and keep data/models/smollm2_indexer.safetensors";
  }
  auto model = LlamaModel::Load(model_path, indexer_path);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->has_indexer());
  auto tokens = ReadTokensNpy(tokens_path);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_GE(static_cast<int>(tokens->size()), kTokens) << tokens_path;

  const auto start = std::chrono::steady_clock::now();
  const LightningIndexerConfig& ic = (*model)->indexer_config();
  out->n = kTokens;
  out->num_heads = ic.num_heads;
  out->head_dim = ic.head_dim;
  ASSERT_EQ(ic.num_heads, 16);
  ASSERT_EQ(ic.head_dim, 64);
  LlamaKvCache kv(**model);
  std::vector<LlamaRow> rows(kTokens);
  for (int t = 0; t < kTokens; ++t) rows[t] = {&kv, t, (*tokens)[t]};
  auto pass = LlamaForward::Begin(*model, rows);
  ASSERT_TRUE(pass.ok()) << pass.status();
  for (int layer : kLayers) {
    while ((*pass)->next_layer() < layer) ASSERT_TRUE((*pass)->RunLayer().ok());
    LayerInputs in;
    in.model_layer = layer;
    in.queries.resize(size_t{kTokens} * ic.num_heads * ic.head_dim);
    in.head_weights.resize(size_t{kTokens} * ic.num_heads);
    in.keys.resize(size_t{kTokens} * ic.head_dim);
    ASSERT_TRUE((*pass)->IndexerInputs(in.queries, in.head_weights, in.keys).ok());
    out->layers.push_back(std::move(in));
  }
  out->forward_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline std::string InputsTensorName(int model_layer, const char* what) {
  return absl::StrCat("layer", model_layer, ".", what);
}

// Writes `in` to a safetensors file (fp32 tensors layer<L>.queries [n, H, D], .head_weights
// [n, H], .keys [n, D]; metadata n, num_heads, head_dim), so that a host without the 538 MB
// backbone (the GPU host) can check the same inputs.
inline void WriteInputs(const ModelInputs& in, const std::string& path) {
  std::vector<SafetensorsTensorToWrite> tensors;
  const auto bytes = [](const std::vector<float>& v) { return std::as_bytes(std::span(v)); };
  for (const LayerInputs& layer : in.layers) {
    tensors.push_back({InputsTensorName(layer.model_layer, "queries"),
                       "F32",
                       {in.n, in.num_heads, in.head_dim},
                       bytes(layer.queries)});
    tensors.push_back({InputsTensorName(layer.model_layer, "head_weights"),
                       "F32",
                       {in.n, in.num_heads},
                       bytes(layer.head_weights)});
    tensors.push_back({InputsTensorName(layer.model_layer, "keys"),
                       "F32",
                       {in.n, in.head_dim},
                       bytes(layer.keys)});
  }
  const absl::Status written = WriteSafetensors(path,
                                                {{"n", std::to_string(in.n)},
                                                 {"num_heads", std::to_string(in.num_heads)},
                                                 {"head_dim", std::to_string(in.head_dim)}},
                                                tensors);
  ASSERT_TRUE(written.ok()) << written;
}

// Reads what WriteInputs wrote into `out`; leaves out->layers empty (and fails the test) on any
// mismatch with kLayers, kTokens or the indexer's H = 16, D = 64.
inline void ReadInputs(const std::string& path, ModelInputs* out) {
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const auto& metadata = (*file)->metadata();
  ASSERT_TRUE(metadata.count("n") && metadata.count("num_heads") && metadata.count("head_dim"))
      << path << ": metadata n, num_heads, head_dim expected";
  out->n = std::stoi(metadata.at("n"));
  out->num_heads = std::stoi(metadata.at("num_heads"));
  out->head_dim = std::stoi(metadata.at("head_dim"));
  ASSERT_EQ(out->n, kTokens) << path;
  ASSERT_EQ(out->num_heads, 16) << path;
  ASSERT_EQ(out->head_dim, 64) << path;
  std::vector<LayerInputs> layers;
  for (int layer : kLayers) {
    LayerInputs in;
    in.model_layer = layer;
    const auto read = [&](const char* what, std::vector<float>* v, int64_t count) {
      const SafetensorsTensor* t = (*file)->Find(InputsTensorName(layer, what));
      if (t == nullptr || t->dtype != "F32" || t->num_elements() != count) {
        ADD_FAILURE() << path << ": " << InputsTensorName(layer, what) << " missing or not F32 of "
                      << count << " values";
        return false;
      }
      v->resize(count);
      std::memcpy(v->data(), t->bytes.data(), count * sizeof(float));
      return true;
    };
    const int64_t n = out->n, h = out->num_heads, d = out->head_dim;
    if (!read("queries", &in.queries, n * h * d) ||
        !read("head_weights", &in.head_weights, n * h) || !read("keys", &in.keys, n * d)) {
      return;
    }
    layers.push_back(std::move(in));
  }
  out->layers = std::move(layers);
}

// The model's inputs, once per test binary. With `read_file` and $DSA_INDEXER_SCORES_INPUTS
// naming an existing file, read from it (the GPU host's way: the backbone cannot travel there);
// else computed from the model, and written to $DSA_INDEXER_SCORES_INPUTS when it is set and every
// layer was computed.
inline const ModelInputs& Inputs(bool read_file) {
  static ModelInputs* inputs = [read_file] {
    auto* computed = new ModelInputs;
    const char* path = std::getenv("DSA_INDEXER_SCORES_INPUTS");
    const bool named = path != nullptr && *path != '\0';
    if (named && read_file && std::filesystem::exists(path)) {
      ReadInputs(path, computed);
      return computed;
    }
    ComputeInputs(computed);
    if (named && static_cast<int>(computed->layers.size()) == kNumLayers &&
        !::testing::Test::HasFailure()) {
      WriteInputs(*computed, path);
    }
    return computed;
  }();
  return *inputs;
}

// bf16 round-to-nearest-even (the tensor-core scan's query rounding).
inline float RoundBf16(float x) {
  uint32_t bits = std::bit_cast<uint32_t>(x);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return std::bit_cast<float>(bits & 0xffff0000u);
}

struct RefRow {
  std::vector<double> z;          // [t + 1]
  std::vector<double> magnitude;  // [t + 1]: s_i * sum_h |w_h| sum_d |q_hd k^_id|
  std::vector<int32_t> top;       // the top-K (score desc, slot asc)
  double row_scale = 0;           // max |z|
};

// z over slots 0..t of `keys` (already dequantized, without scale) times `scales`, in double.
inline RefRow Reference(const float* query, const float* w, const std::vector<float>& keys,
                        const std::vector<float>& scales, int64_t t, int num_heads, int head_dim) {
  RefRow row;
  row.z.resize(t + 1);
  row.magnitude.resize(t + 1);
  for (int64_t i = 0; i <= t; ++i) {
    double z = 0, mag = 0;
    for (int h = 0; h < num_heads; ++h) {
      double dot = 0, abs_dot = 0;
      for (int d = 0; d < head_dim; ++d) {
        const double p = double{query[h * head_dim + d]} * keys[i * head_dim + d];
        dot += p;
        abs_dot += std::abs(p);
      }
      z += double{w[h]} * std::max(dot, 0.0);
      mag += std::abs(double{w[h]}) * abs_dot;
    }
    row.z[i] = scales[i] * z;
    row.magnitude[i] = scales[i] * mag;
    row.row_scale = std::max(row.row_scale, std::abs(row.z[i]));
  }
  std::vector<int32_t> order(t + 1);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return row.z[a] > row.z[b]; });
  order.resize(std::min<int64_t>(kTopK, t + 1));
  row.top = order;
  return row;
}

inline double Overlap(const std::vector<int32_t>& a, std::span<const int32_t> b) {
  std::set<int32_t> sa(a.begin(), a.end());
  int common = 0;
  for (int32_t s : b) common += s >= 0 && sa.count(s);
  return static_cast<double>(common) / a.size();
}

// Runs the check on `indexer` (CPU, or with a scoring device). `bf16_queries`: the
// reference rounds the queries to bf16 (the tensor-core scan). `expect_on_device`: every select
// must have run on the device.
inline void CheckIndexer(Indexer& indexer, bool bf16_queries, bool expect_on_device,
                         const std::string& label) {
  const ModelInputs& in = Inputs(/*read_file=*/expect_on_device);
  ASSERT_EQ(static_cast<int>(in.layers.size()), kNumLayers) << "model inputs missing";
  const auto start = std::chrono::steady_clock::now();
  const int n = in.n, H = in.num_heads, D = in.head_dim;
  SequenceOptions so;
  so.num_layers = kNumLayers;
  so.top_k = kTopK;
  so.spin.enabled = false;  // all-keep: every visible block is scored
  constexpr uint64_t kSelectSeq = 1, kScoresSeq = 2;
  ASSERT_TRUE(indexer.CreateSequence(kSelectSeq, so).ok());
  ASSERT_TRUE(indexer.CreateSequence(kScoresSeq, so).ok());

  double max_score_err = 0;      // |svc - ref| / magnitude, worst
  double max_score_err_top = 0;  // |svc - ref| / row's max |z|, worst
  int near_tie_swaps = 0;
  double min_overlap_fp32 = 1, sum_overlap_fp32 = 0;
  int overlap_rows = 0;
  for (int j = 0; j < kNumLayers; ++j) {
    const LayerInputs& layer = in.layers[j];
    SCOPED_TRACE(absl::StrCat(label, " model layer ", layer.model_layer));
    for (uint64_t seq : {kSelectSeq, kScoresSeq}) {
      ASSERT_TRUE(indexer.AppendIndexKeys(seq, j, layer.keys, n).ok());
    }
    // The service's quantization of every key (DESIGN.md 4.1).
    std::vector<float> dequant(static_cast<size_t>(n) * D), scales(n), unit(n, 1.0f);
    std::vector<uint8_t> codes(D);
    for (int i = 0; i < n; ++i) {
      scales[i] =
          QuantizeIndexKey(std::span(layer.keys).subspan(static_cast<size_t>(i) * D, D), codes);
      for (int d = 0; d < D; ++d) dequant[static_cast<size_t>(i) * D + d] = DecodeFp8E4m3(codes[d]);
    }
    const int64_t first = n - kRows;
    // The services' entry point.
    LayerSelectRequest request;
    request.num_heads = H;
    request.head_dim = D;
    SelectRowGroup group;
    group.sequence_id = kSelectSeq;
    group.layer = j;
    group.first_position = first;
    group.num_rows = kRows;
    group.queries.assign(layer.queries.begin() + first * H * D, layer.queries.end());
    group.head_weights.assign(layer.head_weights.begin() + first * H, layer.head_weights.end());
    request.groups.push_back(group);
    auto selection = RunLayerSelect(indexer, request);
    ASSERT_TRUE(selection.ok()) << selection.status();
    ASSERT_EQ(selection->groups.size(), 1u);
    const GroupSelection& got = selection->groups[0];
    ASSERT_EQ(got.top_k, kTopK);
    ASSERT_EQ(got.selections.size(), size_t{kRows} * kTopK);
    EXPECT_TRUE(got.all_blocks);
    EXPECT_EQ(got.blocks_scored, (n + 63) / 64);
    // The scores, through Indexer::Select on a twin sequence (RunLayerSelect does not return them).
    std::vector<IndexerRow> rows(kRows);
    for (int r = 0; r < kRows; ++r) {
      rows[r].query = std::span(layer.queries).subspan(size_t(first + r) * H * D, H * D);
      rows[r].head_weights = std::span(layer.head_weights).subspan(size_t(first + r) * H, H);
      rows[r].position = first + r;
    }
    auto scored = indexer.Select(kScoresSeq, j, rows, /*return_scores=*/true);
    ASSERT_TRUE(scored.ok()) << scored.status();
    EXPECT_EQ(scored->on_device, expect_on_device);
    EXPECT_EQ(scored->selections, got.selections) << "Select and RunLayerSelect disagree";
    const size_t width = scored->blocks.size() * 64;
    ASSERT_EQ(scored->scores.size(), size_t{kRows} * width);
    for (size_t b = 0; b < scored->blocks.size(); ++b) ASSERT_EQ(scored->blocks[b], int32_t(b));

    for (int r = 0; r < kRows; ++r) {
      const int64_t t = first + r;
      std::vector<float> query(layer.queries.begin() + t * H * D,
                               layer.queries.begin() + (t + 1) * H * D);
      if (bf16_queries) {
        for (float& q : query) q = RoundBf16(q);
      }
      const float* w = layer.head_weights.data() + t * H;
      const RefRow ref = Reference(query.data(), w, dequant, scales, t, H, D);
      const RefRow ref32 =
          Reference(layer.queries.data() + t * H * D, w, layer.keys, unit, t, H, D);
      std::span<const int32_t> sel(got.selections.data() + static_cast<size_t>(r) * kTopK, kTopK);
      // Selection: K distinct slots <= t, the reference's top-K up to near-tie swaps.
      const double tie = kTieTolerance * ref.row_scale;
      const double kth = ref.z[ref.top.back()];
      std::set<int32_t> ref_set(ref.top.begin(), ref.top.end());
      std::set<int32_t> got_set;
      for (int k = 0; k < kTopK; ++k) {
        ASSERT_GE(sel[k], 0) << "row " << t << " entry " << k;
        ASSERT_LE(sel[k], t);
        ASSERT_TRUE(got_set.insert(sel[k]).second) << "slot " << sel[k] << " repeated";
        if (k > 0) {
          EXPECT_GE(ref.z[sel[k - 1]], ref.z[sel[k]] - tie)
              << "row " << t << ": not best first at entry " << k;
        }
      }
      for (int32_t s : got_set) {
        if (ref_set.count(s)) continue;
        ++near_tie_swaps;
        EXPECT_GE(ref.z[s], kth - tie) << "row " << t << ": slot " << s << " (ref " << ref.z[s]
                                       << ") selected over the K-th reference score " << kth;
      }
      for (int32_t s : ref_set) {
        if (!got_set.count(s)) {
          EXPECT_LE(ref.z[s], kth + tie) << "row " << t << ": reference slot " << s << " (ref "
                                         << ref.z[s] << ") missing from the selection";
        }
      }
      // Scores.
      const float* svc = scored->scores.data() + static_cast<size_t>(r) * width;
      for (int64_t i = 0; i <= t; ++i) {
        const double err = std::abs(double{svc[i]} - ref.z[i]);
        EXPECT_LE(err, kScoreTolerance * ref.magnitude[i] + 1e-30)
            << "row " << t << " slot " << i << ": service " << svc[i] << " reference " << ref.z[i];
        max_score_err = std::max(max_score_err, ref.magnitude[i] > 0 ? err / ref.magnitude[i] : 0);
        max_score_err_top = std::max(max_score_err_top, err / ref.row_scale);
      }
      for (size_t i = t + 1; i < width; ++i) EXPECT_EQ(svc[i], -INFINITY) << "slot " << i;
      // fp8's effect: the fp32-key top-K against the service's (fp8) selection.
      const double overlap = Overlap(ref32.top, sel);
      min_overlap_fp32 = std::min(min_overlap_fp32, overlap);
      sum_overlap_fp32 += overlap;
      ++overlap_rows;
    }
  }
  const double mean_overlap = sum_overlap_fp32 / overlap_rows;
  // Loose bound only: fp8 e4m3 keys (3 mantissa bits) should keep most of the fp32 top-K.
  EXPECT_GE(mean_overlap, 0.5);
  std::printf(
      "[%s] n=%d rows=%d K=%d layers={0,2,14,28}: max |svc-ref|/magnitude = %.3g (tol %.0e), "
      "max |svc-ref|/row max|z| = %.3g, near-tie swaps vs reference top-K = %d (tol %.0e of row "
      "max|z|); fp32-key top-K vs fp8 selection overlap: mean %.4f min %.4f over %d rows; "
      "model forward %.2f s (cached per binary), indexer check %.3f s\n",
      label.c_str(), n, kRows, kTopK, max_score_err, kScoreTolerance, max_score_err_top,
      near_tie_swaps, kTieTolerance, mean_overlap, min_overlap_fp32, overlap_rows,
      in.forward_seconds,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  std::fflush(stdout);
}

}  // namespace dsa::indexer_scores_check
