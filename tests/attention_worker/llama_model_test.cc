// Tests of the real model's forward pass on the CPU: a tiny random model written by the test itself
// (llama_model_test_helpers.h) against a double-precision reference, dense against sparse, one
// pass against incremental decode, verifier rows, rollback and bad rows, and the indexer's inputs
// and scores. The safetensors reader and the loader's errors are in llama_model_loader_test.cc.
#include "attention_worker/llama_model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/topk.h"
#include "tests/attention_worker/llama_model_test_helpers.h"

namespace dsa {
namespace {

using namespace ::dsa::llama_model_testing;  // NOLINT(google-build-using-namespace)

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

}  // namespace
}  // namespace dsa
