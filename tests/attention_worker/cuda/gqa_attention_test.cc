// The real model's GQA attention kernels (attention_worker/cuda/gqa_attention.h) against their
// double-precision CPU reference (gqa_attention_reference.h) on seeded inputs: the sparse decode
// over a grid of K (1, 7, 64, 512, 2048) and contexts that are not multiples of 64, with -1
// padding, verifier rows (several rows of one cache, each with its own selection), dense entries
// and several shapes; the dense causal prefill over tiles of caches that already hold slots. The
// reference itself is checked on a hand-computed case without a GPU. GPU cases skip without one.
#include "attention_worker/cuda/gqa_attention.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention_worker/cuda/gqa_attention_reference.h"
#include "gtest/gtest.h"

namespace dsa::cuda {
namespace {

bool HasGpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

template <typename T>
T* Upload(const std::vector<T>& host) {
  T* device = nullptr;
  EXPECT_EQ(
      cudaMalloc(reinterpret_cast<void**>(&device), std::max<size_t>(1, host.size()) * sizeof(T)),
      cudaSuccess);
  if (!host.empty()) {
    EXPECT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return device;
}

struct Shape {
  int num_heads, num_kv_heads, head_dim;
};

std::string Name(const Shape& s) {
  return absl::StrCat(s.num_heads, "x", s.num_kv_heads, "x", s.head_dim);
}

// One sequence's cache on the host: fp32 [num_layers][2][capacity][kv_dim], random.
struct HostCache {
  int64_t capacity = 0;
  std::vector<float> data;
};

HostCache RandomCache(std::mt19937& rng, int num_layers, int64_t capacity, int kv_dim) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  HostCache cache{capacity, std::vector<float>(2 * num_layers * capacity * kv_dim)};
  for (float& x : cache.data) x = normal(rng);
  return cache;
}

// A decode entry: a row of cache `cache` at `position`, attending `selection` (empty: dense).
struct Entry {
  int cache = 0;
  int64_t position = 0;
  std::vector<int32_t> selection;
};

// K distinct slots in [0, position] (all of them, shuffled, when K > position + 1, then -1 up to
// K), with about a tenth of the entries turned to -1 (at least one slot kept).
std::vector<int32_t> RandomSelection(std::mt19937& rng, int64_t position, int k) {
  std::vector<int32_t> slots(position + 1);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(std::min<int64_t>(k, position + 1));
  while (static_cast<int>(slots.size()) < k) slots.push_back(-1);
  std::uniform_int_distribution<int> tenth(0, 9);
  for (size_t i = 1; i < slots.size(); ++i) {
    if (tenth(rng) == 0) slots[i] = -1;
  }
  std::shuffle(slots.begin(), slots.end(), rng);
  if (std::all_of(slots.begin(), slots.end(), [](int32_t s) { return s < 0; })) {
    slots[0] = static_cast<int32_t>(position);
  }
  return slots;
}

// Runs the decode kernel over `entries` at layer `layer` and compares every output with the
// reference: |gpu - ref| <= 2e-5 + 1e-4 * max |ref| (fp32 accumulation against double).
void CheckDecode(const Shape& shape, const std::vector<HostCache>& caches,
                 const std::vector<Entry>& entries, int num_layers, int layer, uint32_t seed,
                 const std::string& what) {
  SCOPED_TRACE(what);
  std::mt19937 rng(seed);
  const int q_dim = shape.num_heads * shape.head_dim;
  const int kv_dim = shape.num_kv_heads * shape.head_dim;
  const int64_t query_stride = q_dim + 2 * kv_dim;  // the runner's qkv rows
  const int rows = static_cast<int>(entries.size());
  std::normal_distribution<float> normal(0.0f, 2.0f);  // sharper softmax than unit queries
  std::vector<float> queries(rows * query_stride);
  for (float& x : queries) x = normal(rng);
  std::vector<float*> device_caches;
  for (const HostCache& cache : caches) device_caches.push_back(Upload(cache.data));
  std::vector<LlamaRowCache> row_caches(rows);
  std::vector<int32_t> entry_rows(rows), offsets = {0}, flat;
  int max_slots = 1;
  // Entries in reverse row order: the kernel must follow entry_rows, not assume identity.
  for (int e = 0; e < rows; ++e) {
    const int r = rows - 1 - e;
    const Entry& entry = entries[r];
    row_caches[r] =
        LlamaRowCache{device_caches[entry.cache], caches[entry.cache].capacity, entry.position, 0};
    entry_rows[e] = r;
    flat.insert(flat.end(), entry.selection.begin(), entry.selection.end());
    offsets.push_back(static_cast<int32_t>(flat.size()));
    max_slots = std::max<int>(max_slots, entry.selection.empty()
                                             ? static_cast<int>(entry.position + 1)
                                             : static_cast<int>(entry.selection.size()));
  }
  float* d_queries = Upload(queries);
  LlamaRowCache* d_rows = Upload(row_caches);
  int32_t* d_entry_rows = Upload(entry_rows);
  int32_t* d_offsets = Upload(offsets);
  int32_t* d_flat = Upload(flat);
  const int64_t out_stride = q_dim + 8;
  std::vector<float> out(rows * out_stride, NAN);
  float* d_out = Upload(out);
  const size_t scratch_bytes =
      GqaDecodeScratchBytes(rows, max_slots, shape.num_heads, shape.num_kv_heads, shape.head_dim);
  void* scratch = nullptr;
  if (scratch_bytes > 0) {
    ASSERT_EQ(cudaMalloc(&scratch, scratch_bytes), cudaSuccess);
  }
  GqaDecodeParams p;
  p.queries = d_queries;
  p.query_stride = query_stride;
  p.caches = d_rows;
  p.entry_rows = d_entry_rows;
  p.selection_offsets = d_offsets;
  p.selections = d_flat;
  p.num_entries = rows;
  p.max_entry_slots = max_slots;
  p.layer = layer;
  p.num_heads = shape.num_heads;
  p.num_kv_heads = shape.num_kv_heads;
  p.head_dim = shape.head_dim;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(shape.head_dim)));
  p.out = d_out;
  p.out_stride = out_stride;
  p.scratch = scratch;
  ASSERT_EQ(LaunchGqaDecode(p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  std::vector<float> expected(q_dim);
  for (int r = 0; r < rows; ++r) {
    const Entry& entry = entries[r];
    const HostCache& cache = caches[entry.cache];
    const float* keys =
        cache.data.data() + static_cast<int64_t>(2 * layer) * cache.capacity * kv_dim;
    const float* values = keys + cache.capacity * kv_dim;
    GqaAttentionReference(&queries[r * query_stride], keys, values, shape.num_heads,
                          shape.num_kv_heads, shape.head_dim, entry.position, entry.selection,
                          1.0 / std::sqrt(static_cast<double>(shape.head_dim)), expected.data());
    double peak = 0;
    for (float x : expected) peak = std::max(peak, std::abs(static_cast<double>(x)));
    const double tolerance = 2e-5 + 1e-4 * peak;
    int bad = 0;
    for (int i = 0; i < q_dim; ++i) {
      const double diff = std::abs(static_cast<double>(out[r * out_stride + i]) - expected[i]);
      if (!(diff <= tolerance) && bad++ < 3) {
        ADD_FAILURE() << "row " << r << " (position " << entry.position << ", K "
                      << entry.selection.size() << ") value " << i << ": gpu "
                      << out[r * out_stride + i] << ", reference " << expected[i];
      }
    }
    EXPECT_EQ(bad, 0) << "row " << r;
  }
  for (float* c : device_caches) cudaFree(c);
  cudaFree(d_queries);
  cudaFree(d_rows);
  cudaFree(d_entry_rows);
  cudaFree(d_offsets);
  cudaFree(d_flat);
  cudaFree(d_out);
  if (scratch != nullptr) cudaFree(scratch);
}

TEST(GqaAttentionReference, MatchesAHandComputedCase) {
  // Two heads on one KV head, head_dim 2, slots 0..2; the selection {2, -1, 0}.
  const float query[] = {1, 0, 0, 2};
  const float keys[] = {1, 0, /*slot 1*/ 5, 5, /*slot 2*/ 0, 1};
  const float values[] = {1, 2, /*slot 1*/ 100, 100, /*slot 2*/ 3, 4};
  const int32_t selection[] = {2, -1, 0};
  float out[4];
  GqaAttentionReference(query, keys, values, 2, 1, 2, 2, selection, 1.0, out);
  // Head 0: logits slot0 = 1, slot2 = 0 -> weights e/(e+1), 1/(e+1).
  const double e = std::exp(1.0);
  EXPECT_NEAR(out[0], (e * 1 + 3) / (e + 1), 1e-6);
  EXPECT_NEAR(out[1], (e * 2 + 4) / (e + 1), 1e-6);
  // Head 1: logits slot0 = 0, slot2 = 2.
  const double e2 = std::exp(2.0);
  EXPECT_NEAR(out[2], (1 + e2 * 3) / (1 + e2), 1e-6);
  EXPECT_NEAR(out[3], (2 + e2 * 4) / (1 + e2), 1e-6);
  // Dense (an empty selection) attends slot 1 too.
  GqaAttentionReference(query, keys, values, 2, 1, 2, 2, {}, 1.0, out);
  EXPECT_GT(out[0], 50.0f);
}

TEST(GqaAttention, CanImplementSaysWhy) {
  const char* why = nullptr;
  EXPECT_TRUE(CanImplementGqaDecode(9, 3, 64, &why));
  EXPECT_FALSE(CanImplementGqaDecode(10, 2, 64, &why));  // 5 heads a KV head
  EXPECT_NE(why, nullptr);
  EXPECT_FALSE(CanImplementGqaDecode(9, 3, 48, &why));
  EXPECT_FALSE(CanImplementGqaDecode(9, 2, 64, &why));
  EXPECT_TRUE(CanImplementGqaPrefill(9, 3, 64, &why));
  EXPECT_FALSE(CanImplementGqaPrefill(4, 2, 8, &why));
  EXPECT_EQ(GqaDecodeScratchBytes(4, 128, 9, 3, 64), 0u);
  EXPECT_EQ(GqaDecodeScratchBytes(1, 129, 9, 3, 64), sizeof(float) * 3 * 2 * 3 * 66);
}

class GqaDecodeGrid : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(GqaDecodeGrid, MatchesTheReferenceOverKAndContexts) {
  const Shape shape = GetParam();
  const int kv_dim = shape.num_kv_heads * shape.head_dim;
  constexpr int kLayers = 2;
  for (const int64_t context : {77, 1000, 4999}) {
    for (const int k : {1, 7, 64, 512, 2048}) {
      std::mt19937 rng(static_cast<uint32_t>(context * 31 + k));
      std::vector<HostCache> caches;
      caches.push_back(RandomCache(rng, kLayers, context + 5, kv_dim));  // capacity > context
      caches.push_back(RandomCache(rng, kLayers, context, kv_dim));
      caches.push_back(RandomCache(rng, kLayers, context + 64, kv_dim));
      std::vector<Entry> entries;
      // One decode row, four verifier rows of another cache (each its own selection), and a
      // dense row (no selection) of a third.
      entries.push_back({0, context - 1, RandomSelection(rng, context - 1, k)});
      for (int64_t t = std::max<int64_t>(0, context - 4); t < context; ++t) {
        entries.push_back({1, t, RandomSelection(rng, t, k)});
      }
      entries.push_back({2, context - 1, {}});
      CheckDecode(shape, caches, entries, kLayers, /*layer=*/1, static_cast<uint32_t>(k),
                  absl::StrCat(Name(shape), " context ", context, " K ", k));
    }
  }
}

TEST_P(GqaDecodeGrid, EdgeCases) {
  const Shape shape = GetParam();
  const int kv_dim = shape.num_kv_heads * shape.head_dim;
  std::mt19937 rng(5);
  std::vector<HostCache> caches = {RandomCache(rng, 1, 300, kv_dim)};
  std::vector<Entry> entries;
  entries.push_back({0, 0, {}});             // position 0, dense: one slot
  entries.push_back({0, 0, {0}});            // position 0, selected
  entries.push_back({0, 299, {-1, -1, 5}});  // mostly padding
  std::vector<int32_t> late(300, -1);        // the only slots in the last of three blocks
  late[290] = 17;
  late[299] = 299;
  entries.push_back({0, 299, late});
  std::vector<int32_t> all(300);  // every slot selected, in reverse: equals dense
  std::iota(all.rbegin(), all.rend(), 0);
  entries.push_back({0, 299, all});
  entries.push_back({0, 128, {}});  // dense over exactly one block and one slot
  CheckDecode(shape, caches, entries, 1, 0, 9, Name(shape) + " edge cases");
}

INSTANTIATE_TEST_SUITE_P(Shapes, GqaDecodeGrid,
                         ::testing::Values(Shape{9, 3, 64}, Shape{4, 2, 8}, Shape{8, 2, 128},
                                           Shape{4, 4, 32}, Shape{4, 1, 16}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return Name(info.param);
                         });

// The prefill kernel over several caches' tiles; each row attends 0..its position.
TEST(GqaPrefill, MatchesTheReferenceOverTiles) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  const Shape shape{9, 3, 64};
  const int q_dim = shape.num_heads * shape.head_dim;
  const int kv_dim = shape.num_kv_heads * shape.head_dim;
  const int64_t query_stride = q_dim + 2 * kv_dim;
  constexpr int kLayers = 2, kLayer = 1;
  std::mt19937 rng(21);
  // (slots already held, rows of this pass): a fresh prefill, a continuation, one full tile, a
  // short one after a long context.
  const std::vector<std::pair<int64_t, int>> groups = {{0, 100}, {37, 200}, {5, 64}, {1000, 17}};
  std::vector<HostCache> caches;
  std::vector<Entry> rows;  // the reference's rows (dense)
  std::vector<int32_t> tile_rows;
  std::vector<GqaPrefillTile> tiles;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto [held, count] = groups[g];
    caches.push_back(RandomCache(rng, kLayers, held + count + 3, kv_dim));
    const int first_row = static_cast<int>(rows.size());
    for (int i = 0; i < count; ++i) rows.push_back({static_cast<int>(g), held + i, {}});
    // Rows of the pass in a shuffled order; tiles list them in position order.
    for (int begin = 0; begin < count; begin += kGqaPrefillTileRows) {
      const int n = std::min(kGqaPrefillTileRows, count - begin);
      tiles.push_back({static_cast<int32_t>(tile_rows.size()), n});
      for (int i = 0; i < n; ++i) tile_rows.push_back(first_row + begin + i);
    }
  }
  std::reverse(tiles.begin(), tiles.end());
  const int n = static_cast<int>(rows.size());
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> queries(n * query_stride);
  for (float& x : queries) x = normal(rng);
  std::vector<float*> device_caches;
  for (const HostCache& cache : caches) device_caches.push_back(Upload(cache.data));
  std::vector<LlamaRowCache> row_caches(n);
  for (int r = 0; r < n; ++r) {
    row_caches[r] = LlamaRowCache{device_caches[rows[r].cache], caches[rows[r].cache].capacity,
                                  rows[r].position, 0};
  }
  float* d_queries = Upload(queries);
  LlamaRowCache* d_rows = Upload(row_caches);
  int32_t* d_tile_rows = Upload(tile_rows);
  GqaPrefillTile* d_tiles = Upload(tiles);
  std::vector<float> out(n * q_dim, NAN);
  float* d_out = Upload(out);
  GqaPrefillParams p;
  p.queries = d_queries;
  p.query_stride = query_stride;
  p.caches = d_rows;
  p.tile_rows = d_tile_rows;
  p.tiles = d_tiles;
  p.num_tiles = static_cast<int>(tiles.size());
  p.layer = kLayer;
  p.num_heads = shape.num_heads;
  p.num_kv_heads = shape.num_kv_heads;
  p.head_dim = shape.head_dim;
  p.scale = 0.125f;
  p.out = d_out;
  p.out_stride = q_dim;
  ASSERT_EQ(LaunchGqaPrefill(p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  std::vector<float> expected(q_dim);
  int bad_rows = 0;
  for (int r = 0; r < n; ++r) {
    const HostCache& cache = caches[rows[r].cache];
    const float* keys =
        cache.data.data() + static_cast<int64_t>(2 * kLayer) * cache.capacity * kv_dim;
    GqaAttentionReference(&queries[r * query_stride], keys, keys + cache.capacity * kv_dim,
                          shape.num_heads, shape.num_kv_heads, shape.head_dim, rows[r].position, {},
                          0.125, expected.data());
    double peak = 0;
    for (float x : expected) peak = std::max(peak, std::abs(static_cast<double>(x)));
    for (int i = 0; i < q_dim; ++i) {
      const double diff = std::abs(static_cast<double>(out[r * q_dim + i]) - expected[i]);
      if (!(diff <= 2e-5 + 1e-4 * peak)) {
        if (bad_rows++ < 5) {
          ADD_FAILURE() << "row " << r << " (cache " << rows[r].cache << ", position "
                        << rows[r].position << ") value " << i << ": gpu " << out[r * q_dim + i]
                        << ", reference " << expected[i];
        }
        break;
      }
    }
  }
  EXPECT_EQ(bad_rows, 0);
  for (float* c : device_caches) cudaFree(c);
  cudaFree(d_queries);
  cudaFree(d_rows);
  cudaFree(d_tile_rows);
  cudaFree(d_tiles);
  cudaFree(d_out);
}

TEST(GqaAttention, RefusesBadParams) {
  GqaDecodeParams decode;
  EXPECT_EQ(LaunchGqaDecode(decode, nullptr), cudaErrorInvalidValue);
  GqaPrefillParams prefill;
  EXPECT_EQ(LaunchGqaPrefill(prefill, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace dsa::cuda
