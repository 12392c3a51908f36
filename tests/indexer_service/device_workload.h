// A scripted indexer workload for checking a scoring device (indexer_service/scoring_device.h)
// against the CPU: the same calls on an Indexer with the device and on one without must give the
// same record. Keys and queries are small integers (with one key element at +-448, so the fp8
// scale is exactly 1) and head weights powers of two: every product and sum is exact in fp32, so
// the scores do not depend on accumulation order or on a device's bf16/f16 query rounding, and the
// record must match bit for bit, SPIN's EMAs included. Covers prefill, decode steps with SPIN,
// prefix sharing with copy on write after a truncate, speculative verifier rows with Commit, a
// batch of groups of distinct sequences, the audit, a K above the GPU's largest, a sequence whose
// rho adaptive sparsity moves, and a new turn.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "indexer_service/indexer.h"

namespace dsa::testing_workload {

/// What the workload saw: one entry per select (or status), in call order.
struct WorkloadRecord {
  std::vector<std::string> labels;
  std::vector<std::vector<int32_t>> selections;
  std::vector<std::vector<float>> scores;
  std::vector<std::vector<double>> miss_rates;
  std::vector<double> target_block_sparsity;      // the rho each select planned with
  std::vector<std::vector<float>> spin_vertical;  // V after the workload, per (sequence, layer)
  std::vector<std::vector<float>> spin_diagonal;  // D, likewise
  int selects_on_device = 0;
};

/// fp32 [n, head_dim]: element 0 is +-448 (so amax / 448 = 1 and every code is exact), the others
/// integers in [-8, 8].
inline std::vector<float> ExactKeys(std::mt19937& rng, int64_t n, int head_dim) {
  std::uniform_int_distribution<int> small(-8, 8);
  std::bernoulli_distribution sign(0.5);
  std::vector<float> keys(static_cast<size_t>(n) * head_dim);
  for (int64_t i = 0; i < n; ++i) {
    keys[i * head_dim] = sign(rng) ? 448.0f : -448.0f;
    for (int d = 1; d < head_dim; ++d) keys[i * head_dim + d] = static_cast<float>(small(rng));
  }
  return keys;
}

/// One row's query (integers in [-3, 3], element 0 of every head 0 so the +-448 element adds
/// nothing) and head weights (powers of two in [1/4, 2]).
struct ExactRow {
  std::vector<float> query;
  std::vector<float> weights;
  IndexerRow row(int64_t position) const { return {query, weights, position}; }
};

inline ExactRow MakeExactRow(std::mt19937& rng, int num_heads, int head_dim) {
  std::uniform_int_distribution<int> small(-3, 3);
  std::uniform_int_distribution<int> exponent(-2, 1);
  ExactRow r{std::vector<float>(static_cast<size_t>(num_heads) * head_dim),
             std::vector<float>(num_heads)};
  for (int h = 0; h < num_heads; ++h) {
    for (int d = 1; d < head_dim; ++d) r.query[h * head_dim + d] = static_cast<float>(small(rng));
    r.weights[h] = std::ldexp(1.0f, exponent(rng));
  }
  return r;
}

/// Runs the script on `indexer` (capacity >= 1024 blocks, audit fraction 1) with K = `top_k` for
/// the SPIN sequences (<= kMaxTopK) and K = `wide_top_k` for the "wide" sequence, which a device
/// whose largest K is below it declines (the fake's FakeControls::max_top_k; the CPU scores it
/// then). `wide_top_k` 0: no wide sequence and no batch mixing it. Fails the current test on an
/// unexpected status.
inline WorkloadRecord RunWorkload(Indexer& indexer, int top_k = 256, int wide_top_k = kMaxTopK) {
  const int num_heads = indexer.options().num_heads;
  const int head_dim = indexer.options().head_dim;
  std::mt19937 rng(20261129);
  WorkloadRecord record;
  auto add = [&](const std::string& label, const SelectResult& result) {
    record.labels.push_back(label);
    record.selections.push_back(result.selections);
    record.scores.push_back(result.scores);
    record.miss_rates.push_back(result.audit_miss_rates);
    record.target_block_sparsity.push_back(result.target_block_sparsity);
    if (result.on_device) ++record.selects_on_device;
  };
  auto append = [&](uint64_t id, int layer, int64_t n) {
    const std::vector<float> keys = ExactKeys(rng, n, head_dim);
    ASSERT_TRUE(indexer.AppendIndexKeys(id, layer, keys, n).ok());
  };
  auto select = [&](uint64_t id, int layer, int64_t position, const std::string& label) {
    const ExactRow row = MakeExactRow(rng, num_heads, head_dim);
    const IndexerRow rows[] = {row.row(position)};
    auto result = indexer.Select(id, layer, rows, /*return_scores=*/true);
    ASSERT_TRUE(result.ok()) << label << ": " << result.status();
    add(label, *result);
  };
  // One SelectBatch of one row each of (id_a, layer_a) at pos_a and (id_b, layer_b) at pos_b;
  // false (the test failed) when it fails.
  auto select_pair = [&](uint64_t id_a, int layer_a, int64_t pos_a, uint64_t id_b, int layer_b,
                         int64_t pos_b, const std::string& label) {
    const ExactRow a = MakeExactRow(rng, num_heads, head_dim);
    const ExactRow b = MakeExactRow(rng, num_heads, head_dim);
    const IndexerRow rows_a[] = {a.row(pos_a)};
    const IndexerRow rows_b[] = {b.row(pos_b)};
    const SelectGroup groups[] = {{id_a, layer_a, rows_a}, {id_b, layer_b, rows_b}};
    auto results = indexer.SelectBatch(groups);
    EXPECT_TRUE(results.ok()) << results.status();
    if (!results.ok()) return false;
    for (const SelectResult& result : *results) add(label, result);
    return true;
  };
  SequenceOptions options;
  options.num_layers = 2;
  options.top_k = top_k;
  options.spin.target_block_sparsity = 0.4;
  options.spin.exploration_fraction = 0.05;
  options.spin.seed = 7;
  // Sequence 1: prefill 3,000 slots per layer, a dense warm-up, then 24 SPIN decode steps.
  EXPECT_TRUE(indexer.CreateSequence(1, options).ok());
  for (int l = 0; l < 2; ++l) append(1, l, 3000);
  for (int l = 0; l < 2; ++l) select(1, l, 2999, absl::StrCat("warm-up layer ", l));
  for (int step = 0; step < 24; ++step) {
    for (int l = 0; l < 2; ++l) {
      append(1, l, 1);
      select(1, l, 3000 + step, absl::StrCat("decode ", step, " layer ", l));
    }
  }
  // Sequence 2 shares 2,944 slots (46 blocks) of sequence 1, truncates into the last shared block
  // and appends: the block is copied on write (the device must see the copy).
  EXPECT_TRUE(indexer.CreateSequenceFromPrefix(2, options, 1, 2944).ok());
  for (int l = 0; l < 2; ++l) {
    EXPECT_TRUE(indexer.TruncateIndexKeys(2, l, 2900).ok());
    append(2, l, 400);
    select(2, l, 3299, absl::StrCat("prefix warm-up layer ", l));
  }
  // A speculative step of sequence 1: three verifier rows per layer; one draft accepted.
  for (int l = 0; l < 2; ++l) {
    append(1, l, 3);
    std::vector<ExactRow> rows;
    std::vector<IndexerRow> views;
    for (int r = 0; r < 3; ++r) rows.push_back(MakeExactRow(rng, num_heads, head_dim));
    for (int r = 0; r < 3; ++r) views.push_back(rows[r].row(3024 + r));
    auto result = indexer.Select(1, l, views, /*return_scores=*/true);
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return record;
    add(absl::StrCat("verifier rows layer ", l), *result);
  }
  EXPECT_TRUE(indexer.Commit(1, 1).ok());
  // One batch of groups of distinct sequences (sequence 2 also decodes SPIN now).
  for (int step = 0; step < 6; ++step) {
    append(1, 0, 1);
    append(2, 0, 1);
    if (!select_pair(1, 0, 3026 + step, 2, 0, 3300 + step, absl::StrCat("batch ", step))) {
      return record;
    }
  }
  // One batch of two sequences at different layers (two launches on a device that runs SPIN).
  {
    append(1, 1, 1);
    append(2, 0, 1);
    if (!select_pair(1, 1, 3026, 2, 0, 3306, "batch of two layers")) return record;
  }
  // K = wide_top_k (above the device's largest): the device declines, the CPU scores it.
  if (wide_top_k > 0) {
    SequenceOptions wide = options;
    wide.num_layers = 1;
    wide.top_k = wide_top_k;
    EXPECT_TRUE(indexer.CreateSequence(3, wide).ok());
    append(3, 0, 9000);
    select(3, 0, 8999, "wide warm-up");
    append(3, 0, 1);
    select(3, 0, 9000, "wide decode");
    // One batch mixing it (planned on the CPU) with a sequence whose SPIN may run on the device.
    append(3, 0, 1);
    append(2, 1, 1);
    if (!select_pair(3, 0, 9001, 2, 1, 3300, "mixed batch")) return record;
  }
  // Sequence 4 holds a miss target (adaptive sparsity): after each audited select its rho moves,
  // so the device must plan every select with the rho the CPU would.
  {
    SequenceOptions adaptive = options;
    adaptive.num_layers = 1;
    adaptive.spin.miss_target = 0.001;
    EXPECT_TRUE(indexer.CreateSequence(4, adaptive).ok());
    append(4, 0, 3000);
    select(4, 0, 2999, "adaptive warm-up");
    const size_t first = record.target_block_sparsity.size();
    for (int step = 0; step < 8; ++step) {
      append(4, 0, 1);
      select(4, 0, 3000 + step, absl::StrCat("adaptive decode ", step));
    }
    const std::vector<double> rhos(record.target_block_sparsity.begin() + first,
                                   record.target_block_sparsity.end());
    EXPECT_NE(*std::min_element(rhos.begin(), rhos.end()),
              *std::max_element(rhos.begin(), rhos.end()))
        << "rho never moved: the workload no longer covers adaptive sparsity";
    EXPECT_TRUE(indexer.Release(4).ok());
  }
  // A new turn: the EMAs reset and the next select is dense again.
  EXPECT_TRUE(indexer.BeginTurn(1).ok());
  append(1, 1, 1);
  select(1, 1, 3027, "new turn");
  for (uint64_t id : {1, 2}) {
    for (int l = 0; l < 2; ++l) {
      auto spin = indexer.GetSpinState(id, l);
      EXPECT_TRUE(spin.ok());
      if (spin.ok()) {
        record.spin_vertical.push_back(spin->vertical());
        record.spin_diagonal.push_back(spin->diagonal());
      }
    }
  }
  EXPECT_TRUE(indexer.Release(2).ok());
  EXPECT_TRUE(indexer.Release(1).ok());
  return record;
}

/// EXPECTs every entry of `device` equal to `cpu`'s (selections, scores bit for bit, audit miss
/// rates, SPIN V and D).
inline void ExpectSameRecord(const WorkloadRecord& cpu, const WorkloadRecord& device) {
  ASSERT_EQ(cpu.labels, device.labels);
  for (size_t i = 0; i < cpu.labels.size(); ++i) {
    EXPECT_EQ(cpu.selections[i], device.selections[i]) << cpu.labels[i];
    ASSERT_EQ(cpu.scores[i].size(), device.scores[i].size()) << cpu.labels[i];
    for (size_t j = 0; j < cpu.scores[i].size(); ++j) {
      if (cpu.scores[i][j] != device.scores[i][j]) {  // -inf == -inf; no NaN reaches here
        ADD_FAILURE() << cpu.labels[i] << ": score " << j << " " << cpu.scores[i][j] << " vs "
                      << device.scores[i][j];
        break;
      }
    }
    EXPECT_EQ(cpu.miss_rates[i], device.miss_rates[i]) << cpu.labels[i];
    EXPECT_EQ(cpu.target_block_sparsity[i], device.target_block_sparsity[i]) << cpu.labels[i];
  }
  EXPECT_EQ(cpu.spin_vertical, device.spin_vertical);
  EXPECT_EQ(cpu.spin_diagonal, device.spin_diagonal);
}

}  // namespace dsa::testing_workload
