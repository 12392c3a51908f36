// CPU sparse MLA decode over the paged latent cache (see mla_sparse_attention.h).
#include "attention_worker/mla_sparse_attention.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dsa {
namespace {

float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

absl::Status CheckBatch(const MlaSparseDecodeBatch& b) {
  if (b.num_heads < 1 || b.num_rows < 0 || b.top_k < 0 || b.max_blocks_per_row < 0 ||
      b.num_physical_blocks < 0 || !std::isfinite(b.softmax_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mla sparse decode: heads ", b.num_heads, " must be >= 1; rows ", b.num_rows,
                     ", top_k ", b.top_k, ", max_blocks_per_row ", b.max_blocks_per_row,
                     ", physical blocks ", b.num_physical_blocks, " >= 0; softmax scale finite"));
  }
  const int64_t rows = b.num_rows;
  const auto mismatch = [](const char* name, size_t got, int64_t want) {
    return absl::InvalidArgumentError(absl::StrCat("mla sparse decode: ", name, " has ", got,
                                                   " entries, the shape needs ", want));
  };
  const int64_t pool = b.num_physical_blocks * kBlockSize * kMlaQkDim;
  if (static_cast<int64_t>(b.kv_pool.size()) != pool)
    return mismatch("kv_pool", b.kv_pool.size(), pool);
  if (static_cast<int64_t>(b.query.size()) != rows * b.num_heads * kMlaQkDim) {
    return mismatch("query", b.query.size(), rows * b.num_heads * kMlaQkDim);
  }
  if (static_cast<int64_t>(b.block_tables.size()) != rows * b.max_blocks_per_row) {
    return mismatch("block_tables", b.block_tables.size(), rows * b.max_blocks_per_row);
  }
  if (static_cast<int64_t>(b.num_slots.size()) != rows) {
    return mismatch("num_slots", b.num_slots.size(), rows);
  }
  if (static_cast<int64_t>(b.positions.size()) != rows) {
    return mismatch("positions", b.positions.size(), rows);
  }
  if (static_cast<int64_t>(b.selections.size()) != rows * b.top_k) {
    return mismatch("selections", b.selections.size(), rows * b.top_k);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slots = b.num_slots[r];
    if (slots < 1 || slots > int64_t{kBlockSize} * b.max_blocks_per_row) {
      return absl::InvalidArgumentError(
          absl::StrCat("mla sparse decode: row ", r, " has ", slots, " slots, outside [1, ",
                       int64_t{kBlockSize} * b.max_blocks_per_row, "]"));
    }
    if (b.positions[r] < 0 || b.positions[r] >= slots) {
      return absl::InvalidArgumentError(absl::StrCat("mla sparse decode: row ", r, " position ",
                                                     b.positions[r], " outside [0, ", slots, ")"));
    }
    const int64_t used_blocks = (slots + kBlockSize - 1) / kBlockSize;
    for (int64_t j = 0; j < used_blocks; ++j) {
      const int32_t block = b.block_tables[r * b.max_blocks_per_row + j];
      if (block < 0 || block >= b.num_physical_blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("mla sparse decode: row ", r, " logical block ", j, " maps to ", block,
                         ", outside [0, ", b.num_physical_blocks, ")"));
      }
    }
    for (int64_t e = 0; e < b.top_k; ++e) {
      const int32_t slot = b.selections[r * b.top_k + e];
      if (slot < -1 || slot >= slots) {
        return absl::InvalidArgumentError(absl::StrCat("mla sparse decode: row ", r, " entry ", e,
                                                       " selects slot ", slot, ", outside [-1, ",
                                                       slots, ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

float MlaSoftmaxScale(const MlaSparseDecodeBatch& batch) {
  return batch.softmax_scale != 0.0f ? batch.softmax_scale
                                     : 1.0f / std::sqrt(static_cast<float>(kMlaQkDim));
}

absl::Status MlaSparseDecode(const MlaSparseDecodeBatch& batch, std::span<float> out,
                             std::span<float> lse) {
  if (absl::Status status = CheckBatch(batch); !status.ok()) return status;
  const int64_t rows = batch.num_rows, heads = batch.num_heads;
  if (static_cast<int64_t>(out.size()) != rows * heads * kMlaVDim ||
      static_cast<int64_t>(lse.size()) != rows * heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("mla sparse decode: out has ", out.size(), " and lse ", lse.size(),
                     " entries, the shape needs ", rows * heads * kMlaVDim, " and ", rows * heads));
  }
  const float scale = MlaSoftmaxScale(batch);
  std::vector<float> keys;  // the row's visible selected latent rows, fp32 [n, 576]
  for (int64_t r = 0; r < rows; ++r) {
    keys.clear();
    for (int64_t e = 0; e < batch.top_k; ++e) {
      const int32_t slot = batch.selections[r * batch.top_k + e];
      if (slot < 0 || slot > batch.positions[r]) continue;  // unused, or hidden by causality
      const int64_t block = batch.block_tables[r * batch.max_blocks_per_row + slot / kBlockSize];
      const uint16_t* row =
          batch.kv_pool.data() + (block * kBlockSize + slot % kBlockSize) * kMlaQkDim;
      for (int d = 0; d < kMlaQkDim; ++d) keys.push_back(Bf16ToFloat(row[d]));
    }
    const int64_t n = static_cast<int64_t>(keys.size()) / kMlaQkDim;
#pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < heads; ++h) {
      float* o = out.data() + (r * heads + h) * kMlaVDim;
      std::fill(o, o + kMlaVDim, 0.0f);
      if (n == 0) {
        lse[r * heads + h] = -std::numeric_limits<float>::infinity();
        continue;
      }
      float q[kMlaQkDim];
      const uint16_t* q_bits = batch.query.data() + (r * heads + h) * kMlaQkDim;
      for (int d = 0; d < kMlaQkDim; ++d) q[d] = Bf16ToFloat(q_bits[d]);
      std::vector<float> logits(n);
      float max_logit = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        const float* k = keys.data() + j * kMlaQkDim;
        float dot = 0.0f;
        for (int d = 0; d < kMlaQkDim; ++d) dot += q[d] * k[d];
        logits[j] = scale * dot;
        max_logit = std::max(max_logit, logits[j]);
      }
      float denominator = 0.0f;
      for (float& logit : logits) {
        logit = std::exp(logit - max_logit);
        denominator += logit;
      }
      for (int64_t j = 0; j < n; ++j) {
        const float weight = logits[j] / denominator;
        const float* v = keys.data() + j * kMlaQkDim;  // the value is the latent's first 512 dims
        for (int d = 0; d < kMlaVDim; ++d) o[d] += weight * v[d];
      }
      lse[r * heads + h] = max_logit + std::log(denominator);
    }
  }
  return absl::OkStatus();
}

}  // namespace dsa
