// CPU benchmark of the indexer's two hot paths (DESIGN.md 4.1, 7): the scan (ScoreBlocks over every
// block of a row, H = 64, D = 128, fp8 paged keys) and the top-K (SelectTopK, K = 2048), at 16K,
// 128K and 1M slots, with the floors and peers each figure is compared with in the same run.
// Run it through bench/run_cpu_bench.sh, which writes docs/results/cpu_bench.{json,md}.
//
// Benchmarks (the names bench/run_cpu_bench.sh parses):
//   Scan/<slots>/<threads>           one row, every block
//   ScanVerifier4/<slots>/<threads>  4 verifier rows at t-3..t sharing one key read
//   PeerScanNaive/<slots>            peer: scalar per-slot loop of the same formula, 1 thread
//   FloorReadBandwidth/<threads>     floor: streaming read of 512 MiB (-> slots/s at 132 B)
//   FloorFmaPeak/<threads>           floor: AVX2 FMA peak (-> slots/s at 2 * H * D FLOP)
//   TopK/<dist>/<slots>/<layout>     SelectTopK; dist 0 relu_tail, 1 uniform_distinct; layout
//                                    0 contiguous slots (as SPIN calls it), 1 block list (as
//                                    the indexer calls it after a scan)
//   PeerTopKPartialSort/<dist>/<slots>  peer: gather pairs, std::partial_sort
//   PeerTopKIntroselect/<dist>/<slots>  peer: gather pairs, nth_element, sort the K winners
// Every benchmark reports wall time and the CPU time of the whole process (all threads).
// All inputs come from fixed seeds; key and query norms are checked non-zero; every SelectTopK
// result is checked against the partial-sort peer and a sample of every scan against the naive
// reference before timing (a mismatch fails the benchmark instead of timing a wrong answer).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/fp8.h"
#include "indexer_service/block_pool.h"
#include "indexer_service/index_key_cache.h"
#include "indexer_service/scoring.h"
#include "indexer_service/topk.h"

namespace dsa {
namespace {

constexpr int kNumHeads = 64;
constexpr int kHeadDim = 128;
constexpr int kTopK = 2048;
constexpr int kVerifierRows = 4;                                // draft length 3: rows at t-3..t
constexpr int64_t kKeyBytesPerSlot = kHeadDim + sizeof(float);  // 132: fp8 key + fp32 scale
constexpr int64_t kSlotCounts[] = {16 * 1024, 128 * 1024, 1024 * 1024};
constexpr int64_t kAppendChunkSlots = 16 * 1024;

int AllCores() { return omp_get_num_procs(); }

// ---------------------------------------------------------------------------------------------
// Scan inputs: one sequence of `num_slots` random keys (N(0, 1) per value, quantized on append) and
// kVerifierRows query rows (N(0, 1) / sqrt(D)) with head weights N(0, 1) / sqrt(H), some negative.
struct ScanInput {
  std::unique_ptr<IndexKeyCache> cache;
  KeyCacheView view;
  std::vector<int32_t> logical_blocks;  // [num_blocks], 0..num_blocks-1
  std::vector<float> queries;           // [kVerifierRows, H, D]
  std::vector<float> head_weights;      // [kVerifierRows, H]
  std::vector<IndexerRow> rows;         // [kVerifierRows], positions num_slots-4 .. num_slots-1
  std::vector<float> scores;            // [kVerifierRows, num_blocks * 64]
  int64_t num_slots = 0;
};

const ScanInput& GetScanInput(int64_t num_slots) {
  static std::map<int64_t, std::unique_ptr<ScanInput>> inputs;
  auto& slot = inputs[num_slots];
  if (slot) return *slot;
  auto input = std::make_unique<ScanInput>();
  input->num_slots = num_slots;
  const int64_t num_blocks = (num_slots + kBlockSize - 1) / kBlockSize;
  auto cache = IndexKeyCache::Create(num_blocks, kHeadDim);
  if (!cache.ok()) std::abort();
  input->cache = std::make_unique<IndexKeyCache>(*std::move(cache));
  if (!input->cache->AddSequence(1, 1).ok()) std::abort();
  std::mt19937_64 rng(0x5eed0000u + static_cast<uint64_t>(num_slots));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> keys(static_cast<size_t>(kAppendChunkSlots) * kHeadDim);
  double key_norm = 0.0;
  for (int64_t first = 0; first < num_slots; first += kAppendChunkSlots) {
    const int64_t count = std::min(kAppendChunkSlots, num_slots - first);
    for (int64_t i = 0; i < count * kHeadDim; ++i) {
      keys[i] = normal(rng);
      key_norm += static_cast<double>(keys[i]) * keys[i];
    }
    if (!input->cache->Append(1, 0, std::span<const float>(keys.data(), count * kHeadDim), count)
             .ok()) {
      std::abort();
    }
  }
  auto view = input->cache->View(1, 0);
  if (!view.ok()) std::abort();
  input->view = *view;
  input->logical_blocks.resize(num_blocks);
  std::iota(input->logical_blocks.begin(), input->logical_blocks.end(), 0);
  input->queries.resize(static_cast<size_t>(kVerifierRows) * kNumHeads * kHeadDim);
  input->head_weights.resize(static_cast<size_t>(kVerifierRows) * kNumHeads);
  double query_norm = 0.0;
  for (float& q : input->queries) {
    q = normal(rng) / std::sqrt(static_cast<float>(kHeadDim));
    query_norm += static_cast<double>(q) * q;
  }
  for (float& w : input->head_weights) w = normal(rng) / std::sqrt(static_cast<float>(kNumHeads));
  if (key_norm == 0.0 || query_norm == 0.0) std::abort();  // never benchmark zeros
  for (int r = 0; r < kVerifierRows; ++r) {
    input->rows.push_back(
        IndexerRow{std::span<const float>(
                       input->queries.data() + static_cast<size_t>(r) * kNumHeads * kHeadDim,
                       kNumHeads * kHeadDim),
                   std::span<const float>(
                       input->head_weights.data() + static_cast<size_t>(r) * kNumHeads, kNumHeads),
                   num_slots - kVerifierRows + r});
  }
  input->scores.resize(static_cast<size_t>(kVerifierRows) * num_blocks * kBlockSize);
  slot = std::move(input);
  return *slot;
}

// The peer: a scalar per-slot reference of z = s * sum_h w_h * ReLU(q_h . k), fp32, same order of
// accumulation (d ascending inside a head, h ascending), decoding every key element from the table.
float NaiveScore(const ScanInput& input, const IndexerRow& row, int64_t slot) {
  const float* table = Fp8E4m3DecodeTable();
  const int32_t block = input.view.block_table[slot / kBlockSize];
  const uint8_t* key = input.view.pool->keys(block) + (slot % kBlockSize) * kHeadDim;
  const float scale = input.view.pool->scales(block)[slot % kBlockSize];
  float total = 0.0f;
  for (int h = 0; h < kNumHeads; ++h) {
    const float* q = row.query.data() + h * kHeadDim;
    float dot = 0.0f;
    for (int d = 0; d < kHeadDim; ++d) dot += q[d] * table[key[d]];
    total += row.head_weights[h] * std::max(dot, 0.0f);
  }
  return scale * total;
}

// The largest possible rounding of one score: 1e-5 of s * sum_h |w_h| * sum_d |q_hd k_d|.
float ScoreTolerance(const ScanInput& input, const IndexerRow& row, int64_t slot) {
  const float* table = Fp8E4m3DecodeTable();
  const int32_t block = input.view.block_table[slot / kBlockSize];
  const uint8_t* key = input.view.pool->keys(block) + (slot % kBlockSize) * kHeadDim;
  const float scale = input.view.pool->scales(block)[slot % kBlockSize];
  double magnitude = 0.0;
  for (int h = 0; h < kNumHeads; ++h) {
    double dot = 0.0;
    for (int d = 0; d < kHeadDim; ++d)
      dot += std::fabs(row.query[h * kHeadDim + d] * table[key[d]]);
    magnitude += std::fabs(row.head_weights[h]) * dot;
  }
  return static_cast<float>(1e-5 * scale * magnitude) + 1e-30f;
}

// Checks the first and last two blocks of every row of the last ScoreBlocks call against the
// naive reference; returns false on a mismatch (printed).
bool CheckScanSample(const ScanInput& input, int num_rows) {
  const int64_t num_blocks = static_cast<int64_t>(input.logical_blocks.size());
  const int64_t row_stride = num_blocks * kBlockSize;
  const int64_t sample_blocks[] = {0, 1, num_blocks - 2, num_blocks - 1};
  for (int r = 0; r < num_rows; ++r) {
    const IndexerRow& row = input.rows[kVerifierRows - num_rows + r];
    for (int64_t j : sample_blocks) {
      for (int s = 0; s < kBlockSize; ++s) {
        const int64_t slot = j * kBlockSize + s;
        const float got = input.scores[r * row_stride + slot];
        if (slot > row.position) {
          if (got != -std::numeric_limits<float>::infinity()) return false;
          continue;
        }
        const float want = NaiveScore(input, row, slot);
        if (!(std::fabs(got - want) <= ScoreTolerance(input, row, slot))) {
          std::fprintf(stderr, "scan mismatch: row %d slot %lld got %.9g want %.9g\n", r,
                       static_cast<long long>(slot), got, want);
          return false;
        }
      }
    }
  }
  return true;
}

void SetScanCounters(benchmark::State& state, int64_t num_slots, int num_rows, int threads) {
  const double slots = static_cast<double>(num_slots);
  state.counters["slots_per_s"] =
      benchmark::Counter(slots, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["slots_per_s_per_core"] =
      benchmark::Counter(slots / threads, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["row_slots_per_s"] =
      benchmark::Counter(slots * num_rows, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
  state.SetBytesProcessed(state.iterations() * num_slots * kKeyBytesPerSlot);
}

void RunScan(benchmark::State& state, int num_rows) {
  const int64_t num_slots = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  ScanInput& input = const_cast<ScanInput&>(GetScanInput(num_slots));
  const std::span<const IndexerRow> rows(input.rows.data() + kVerifierRows - num_rows, num_rows);
  const std::span<float> scores(input.scores.data(), static_cast<size_t>(num_rows) *
                                                         input.logical_blocks.size() * kBlockSize);
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(threads);
  ScoreBlocks(input.view, input.logical_blocks, rows, kNumHeads, scores);  // warm-up and check
  if (!CheckScanSample(input, num_rows)) {
    omp_set_num_threads(saved_threads);
    state.SkipWithError("ScoreBlocks disagrees with the naive reference");
    return;
  }
  for (auto _ : state) {
    ScoreBlocks(input.view, input.logical_blocks, rows, kNumHeads, scores);
    benchmark::DoNotOptimize(scores.data());
    benchmark::ClobberMemory();
  }
  omp_set_num_threads(saved_threads);
  SetScanCounters(state, num_slots, num_rows, threads);
}

void BM_Scan(benchmark::State& state) { RunScan(state, 1); }
void BM_ScanVerifier4(benchmark::State& state) { RunScan(state, kVerifierRows); }

void BM_PeerScanNaive(benchmark::State& state) {
  const int64_t num_slots = state.range(0);
  ScanInput& input = const_cast<ScanInput&>(GetScanInput(num_slots));
  const IndexerRow& row = input.rows[kVerifierRows - 1];
  for (auto _ : state) {
    for (int64_t slot = 0; slot < num_slots; ++slot)
      input.scores[slot] = NaiveScore(input, row, slot);
    benchmark::DoNotOptimize(input.scores.data());
    benchmark::ClobberMemory();
  }
  SetScanCounters(state, num_slots, 1, 1);
}

// ---------------------------------------------------------------------------------------------
// Floors: what the memory system and the FMA units allow, measured in the same run.

void BM_FloorReadBandwidth(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  constexpr size_t kBytes = size_t{512} << 20;
  static std::vector<uint64_t> buffer = [] {
    std::vector<uint64_t> b(kBytes / sizeof(uint64_t));
    std::iota(b.begin(), b.end(), uint64_t{1});
    return b;
  }();
  const int64_t n = static_cast<int64_t>(buffer.size());
  const uint64_t* data = buffer.data();
  for (auto _ : state) {
    uint64_t sum = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : sum) schedule(static)
    for (int64_t i = 0; i < n; ++i) sum += data[i];
    benchmark::DoNotOptimize(sum);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(kBytes));
  state.counters["threads"] = threads;
  state.counters["slots_per_s"] = benchmark::Counter(static_cast<double>(kBytes) / kKeyBytesPerSlot,
                                                     benchmark::Counter::kIsIterationInvariantRate);
}

#if defined(__x86_64__) && defined(__GNUC__)
// 10 independent chains of 8-wide FMAs: 160 FLOP an inner iteration, latency hidden.
__attribute__((target("avx2,fma"))) float FmaChains(int64_t iterations) {
  __m256 acc[10];
  for (int i = 0; i < 10; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  const __m256 mul = _mm256_set1_ps(0.999999f);
  const __m256 add = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < 10; ++i) acc[i] = _mm256_fmadd_ps(acc[i], mul, add);
  }
  __m256 sum = acc[0];
  for (int i = 1; i < 10; ++i) sum = _mm256_add_ps(sum, acc[i]);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  return lanes[0];
}
#endif

void BM_FloorFmaPeak(benchmark::State& state) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    state.SkipWithError("no AVX2/FMA");
    return;
  }
  const int threads = static_cast<int>(state.range(0));
  constexpr int64_t kIterations = 20'000'000;
  for (auto _ : state) {
    float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += FmaChains(kIterations);
    benchmark::DoNotOptimize(sink);
  }
  const double flop = 160.0 * kIterations * threads;
  state.counters["threads"] = threads;
  state.counters["flop_per_s"] =
      benchmark::Counter(flop, benchmark::Counter::kIsIterationInvariantRate);
  // The scan's arithmetic: one multiply and one add per (head, dim) of a slot.
  state.counters["slots_per_s"] = benchmark::Counter(flop / (2.0 * kNumHeads * kHeadDim),
                                                     benchmark::Counter::kIsIterationInvariantRate);
#else
  state.SkipWithError("x86-64 only");
#endif
}

// ---------------------------------------------------------------------------------------------
// Top-K inputs.
enum class ScoreDist { kReluTail = 0, kUniformDistinct = 1 };

// relu_tail: 25% exact zeros (every head's dot product negative), 74% a log-normal body
// (mu 0, sigma 0.75), 1% a Pareto tail (x_min 10, alpha 1.5): the shape of index scores.
// uniform_distinct: a random permutation of (1..n) / n, every score distinct.
const std::vector<float>& GetScores(ScoreDist dist, int64_t n) {
  static std::map<std::pair<int, int64_t>, std::vector<float>> cache;
  auto& scores = cache[{static_cast<int>(dist), n}];
  if (!scores.empty()) return scores;
  scores.resize(n);
  std::mt19937_64 rng(0x70b0000u + static_cast<uint64_t>(n) * 2 + static_cast<uint64_t>(dist));
  if (dist == ScoreDist::kReluTail) {
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    std::lognormal_distribution<float> body(0.0f, 0.75f);
    for (float& s : scores) {
      const float u = uniform(rng);
      if (u < 0.25f) {
        s = 0.0f;
      } else if (u < 0.99f) {
        s = body(rng);
      } else {
        s = 10.0f * std::pow(1.0f - uniform(rng), -1.0f / 1.5f);
      }
    }
  } else {
    std::vector<int64_t> perm(n);
    std::iota(perm.begin(), perm.end(), 1);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t i = 0; i < n; ++i)
      scores[i] = static_cast<float>(static_cast<double>(perm[i]) / n);
  }
  if (std::none_of(scores.begin(), scores.end(), [](float s) { return s != 0.0f; })) std::abort();
  return scores;
}

const std::vector<int32_t>& GetBlockList(int64_t n) {
  static std::map<int64_t, std::vector<int32_t>> cache;
  auto& blocks = cache[n];
  if (blocks.empty()) {
    blocks.resize(n / kBlockSize);
    std::iota(blocks.begin(), blocks.end(), 0);
  }
  return blocks;
}

struct Candidate {
  float score;
  int32_t slot;
};
inline bool Better(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.slot < b.slot);
}

// Peers over contiguous slots 0..n-1 with max_slot = n - 1: gather the selectable pairs, then
// either partial_sort (use_introselect false) or nth_element + sort of the winners.
void PeerTopK(std::span<const float> scores, std::span<int32_t> selection, bool use_introselect,
              std::vector<Candidate>& candidates) {
  const size_t k = selection.size();
  candidates.clear();
  for (size_t e = 0; e < scores.size(); ++e) {
    if (std::isnan(scores[e]) || scores[e] == -INFINITY) continue;
    candidates.push_back({scores[e], static_cast<int32_t>(e)});
  }
  const size_t taken = std::min(k, candidates.size());
  if (use_introselect) {
    if (candidates.size() > k)
      std::nth_element(candidates.begin(), candidates.begin() + k, candidates.end(), Better);
    std::sort(candidates.begin(), candidates.begin() + taken, Better);
  } else {
    std::partial_sort(candidates.begin(), candidates.begin() + taken, candidates.end(), Better);
  }
  for (size_t i = 0; i < taken; ++i) selection[i] = candidates[i].slot;
  std::fill(selection.begin() + taken, selection.end(), -1);
}

void SetTopKCounters(benchmark::State& state, int64_t n) {
  state.counters["scores_per_s"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_TopK(benchmark::State& state) {
  const auto dist = static_cast<ScoreDist>(state.range(0));
  const int64_t n = state.range(1);
  const bool blocked = state.range(2) != 0;
  const std::vector<float>& scores = GetScores(dist, n);
  const std::span<const int32_t> blocks =
      blocked ? std::span<const int32_t>(GetBlockList(n)) : std::span<const int32_t>();
  std::vector<int32_t> selection(kTopK), expected(kTopK);
  std::vector<Candidate> scratch;
  PeerTopK(scores, expected, false, scratch);
  SelectTopK(scores, blocks, n - 1, selection);
  if (selection != expected) {
    state.SkipWithError("SelectTopK disagrees with the partial_sort peer");
    return;
  }
  for (auto _ : state) {
    SelectTopK(scores, blocks, n - 1, selection);
    benchmark::DoNotOptimize(selection.data());
    benchmark::ClobberMemory();
  }
  SetTopKCounters(state, n);
}

void RunPeerTopK(benchmark::State& state, bool use_introselect) {
  const auto dist = static_cast<ScoreDist>(state.range(0));
  const int64_t n = state.range(1);
  const std::vector<float>& scores = GetScores(dist, n);
  std::vector<int32_t> selection(kTopK);
  std::vector<Candidate> scratch;
  scratch.reserve(n);
  for (auto _ : state) {
    PeerTopK(scores, selection, use_introselect, scratch);
    benchmark::DoNotOptimize(selection.data());
    benchmark::ClobberMemory();
  }
  SetTopKCounters(state, n);
}
void BM_PeerTopKPartialSort(benchmark::State& state) { RunPeerTopK(state, false); }
void BM_PeerTopKIntroselect(benchmark::State& state) { RunPeerTopK(state, true); }

std::string CpuModel() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

void RegisterAll() {
  const int all_cores = AllCores();
  std::vector<int64_t> thread_counts = {1};
  if (all_cores > 1) thread_counts.push_back(all_cores);
  for (int64_t slots : kSlotCounts) {
    for (int64_t threads : thread_counts) {
      benchmark::RegisterBenchmark("Scan", BM_Scan)
          ->Args({slots, threads})
          ->UseRealTime()
          ->MeasureProcessCPUTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  for (int64_t slots : kSlotCounts) {
    for (int64_t threads : thread_counts) {
      benchmark::RegisterBenchmark("ScanVerifier4", BM_ScanVerifier4)
          ->Args({slots, threads})
          ->UseRealTime()
          ->MeasureProcessCPUTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  // The scalar peer is ~20x slower: 16K and 128K slots are enough to show its rate.
  for (int64_t slots : {kSlotCounts[0], kSlotCounts[1]}) {
    benchmark::RegisterBenchmark("PeerScanNaive", BM_PeerScanNaive)
        ->Arg(slots)
        ->UseRealTime()
        ->MeasureProcessCPUTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (int64_t threads : thread_counts) {
    benchmark::RegisterBenchmark("FloorReadBandwidth", BM_FloorReadBandwidth)
        ->Arg(threads)
        ->UseRealTime()
        ->MeasureProcessCPUTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("FloorFmaPeak", BM_FloorFmaPeak)
        ->Arg(threads)
        ->UseRealTime()
        ->MeasureProcessCPUTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (int64_t dist : {0, 1}) {
    for (int64_t slots : kSlotCounts) {
      for (int64_t layout : {0, 1}) {
        benchmark::RegisterBenchmark("TopK", BM_TopK)
            ->Args({dist, slots, layout})
            ->UseRealTime()
            ->MeasureProcessCPUTime()
            ->Unit(benchmark::kMicrosecond);
      }
      benchmark::RegisterBenchmark("PeerTopKPartialSort", BM_PeerTopKPartialSort)
          ->Args({dist, slots})
          ->UseRealTime()
          ->MeasureProcessCPUTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("PeerTopKIntroselect", BM_PeerTopKIntroselect)
          ->Args({dist, slots})
          ->UseRealTime()
          ->MeasureProcessCPUTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  benchmark::AddCustomContext("cpu_model", CpuModel());
  benchmark::AddCustomContext("omp_num_procs", std::to_string(all_cores));
  benchmark::AddCustomContext("shape", "H=64 D=128 K=2048 fp8 e4m3 keys, 132 B a slot");
}

}  // namespace
}  // namespace dsa

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  dsa::RegisterAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
