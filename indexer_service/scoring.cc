// CPU index scoring (see scoring.h): per block, decode the fp8 keys once into a transposed fp32
// tile, then for every row and head accumulate q_h . k over the tile with the slot as the SIMD
// lane.
#include "indexer_service/scoring.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DSA_SCORING_X86 1
#endif

#include "absl/base/config.h"
#include "common/fp8.h"

namespace dsa {
namespace {

// Eight fp32 lanes; the x86-64-v3 clone of ScoreTile keeps them in ymm registers, the default
// clone in pairs of xmm registers. Only referenced through pointers and references, so no 32-byte
// vector crosses a call (whose ABI would differ between the clones).
typedef float Lanes8 __attribute__((vector_size(32)));
typedef float Lanes8Unaligned __attribute__((vector_size(32), aligned(4)));

// The decoded tile of one block is fp32 [kBlockSize / kSlotsPerPass, head_dim, kSlotsPerPass]:
// per pass of 16 slots, a contiguous [head_dim, 16] panel (8 KiB at D = 128) that stays in L1
// while every head is scored against it.
constexpr int kSlotsPerPass = 16;
constexpr int kVectorsPerPass = kSlotsPerPass / 8;

inline size_t TileIndex(int d, int s, int head_dim) {
  return (static_cast<size_t>(s / kSlotsPerPass) * head_dim + d) * kSlotsPerPass +
         s % kSlotsPerPass;
}

// Adds w_i * ReLU(q_i . k) to total for kHeads heads i, in order, over one panel: the panel rows
// are loaded once for kHeads heads (register tiling: 2 * kHeads accumulators), and every lane
// accumulates d ascending inside a head.
template <int kHeads>
inline void AccumulateHeads(const float* __restrict panel, const float* __restrict query,
                            const float* __restrict head_weights, int head_dim,
                            Lanes8 (&total)[kVectorsPerPass]) {
  Lanes8 dot[kHeads][kVectorsPerPass] = {};
  for (int d = 0; d < head_dim; ++d) {
    Lanes8 key[kVectorsPerPass];
    for (int v = 0; v < kVectorsPerPass; ++v) {
      key[v] = *reinterpret_cast<const Lanes8Unaligned*>(panel + d * kSlotsPerPass + 8 * v);
    }
    for (int i = 0; i < kHeads; ++i) {
      const float qd = query[static_cast<size_t>(i) * head_dim + d];
      for (int v = 0; v < kVectorsPerPass; ++v) dot[i][v] += qd * key[v];
    }
  }
  for (int i = 0; i < kHeads; ++i) {
    for (int v = 0; v < kVectorsPerPass; ++v) {
      // std::max(dot, 0.0f) lane by lane: NaN and -0 pass through unchanged, as there.
      const Lanes8 relu = dot[i][v] < 0.0f ? Lanes8{} : dot[i][v];
      total[v] += head_weights[i] * relu;
    }
  }
}

// Scores one decoded block for one row:
//   out[s] = scale[s] * sum_h w[h] * ReLU(sum_d q[h][d] k[d][s]),
// `tile` being the block decoded as TileIndex lays it out. Every lane accumulates in the order of
// the plain loops (d ascending inside a head, h ascending), so the scores do not depend on the
// tiling (6 heads a step, then 4, 2, 1 for the rest).
// Not under ThreadSanitizer: the clones' ifunc resolver, instrumented, runs at load before TSan's
// runtime is up and crashes the process (scripts/tsan.sh).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(ABSL_HAVE_THREAD_SANITIZER)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void ScoreTile(const float* __restrict tile, const float* __restrict scales,
               const float* __restrict query, const float* __restrict head_weights, int num_heads,
               int head_dim, float* __restrict out) {
  for (int s0 = 0; s0 < kBlockSize; s0 += kSlotsPerPass) {
    const float* panel = tile + TileIndex(0, s0, head_dim);
    Lanes8 total[kVectorsPerPass] = {};
    int h = 0;
    for (; h + 6 <= num_heads; h += 6) {
      AccumulateHeads<6>(panel, query + static_cast<size_t>(h) * head_dim, head_weights + h,
                         head_dim, total);
    }
    for (; h + 4 <= num_heads; h += 4) {
      AccumulateHeads<4>(panel, query + static_cast<size_t>(h) * head_dim, head_weights + h,
                         head_dim, total);
    }
    for (; h + 2 <= num_heads; h += 2) {
      AccumulateHeads<2>(panel, query + static_cast<size_t>(h) * head_dim, head_weights + h,
                         head_dim, total);
    }
    for (; h < num_heads; ++h) {
      AccumulateHeads<1>(panel, query + static_cast<size_t>(h) * head_dim, head_weights + h,
                         head_dim, total);
    }
    for (int v = 0; v < kVectorsPerPass; ++v) {
      *reinterpret_cast<Lanes8Unaligned*>(out + s0 + 8 * v) =
          *reinterpret_cast<const Lanes8Unaligned*>(scales + s0 + 8 * v) * total[v];
    }
  }
}

// Decodes the fp8 codes of one block (slot-major [kBlockSize, head_dim]) into `tile` (fp32, laid
// out by TileIndex); slots >= `filled` decode as 0. Exact: the decode table.
void DecodeBlockScalar(const uint8_t* codes, int head_dim, int64_t filled, float* tile) {
  const float* table = Fp8E4m3DecodeTable();
  for (int s = 0; s < kBlockSize; ++s) {
    const uint8_t* key = codes + static_cast<size_t>(s) * head_dim;
    for (int d = 0; d < head_dim; ++d) {
      tile[TileIndex(d, s, head_dim)] = s < filled ? table[key[d]] : 0.0f;
    }
  }
}

#if DSA_SCORING_X86
// Eight E4M3 codes (the low 8 bytes) to fp32 with integer arithmetic: normal codes (exponent field
// e >= 1) map to fp32 bits sign | (code & 0x7f) << 20 plus a rebias of 120 << 23; subnormals
// (e == 0, mantissa m) are m * 2^-9 (exact, and a normal fp32, so FTZ/DAZ cannot touch them);
// 0x7f/0xff take `nan_bits` with the code's sign. Checked against the table once at start-up.
__attribute__((target("avx2"))) inline __m256 DecodeFp8x8(__m128i codes, __m256i nan_bits) {
  const __m256i code = _mm256_cvtepu8_epi32(codes);
  const __m256i magnitude_code = _mm256_and_si256(code, _mm256_set1_epi32(0x7f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
  const __m256i normal =
      _mm256_add_epi32(_mm256_slli_epi32(magnitude_code, 20), _mm256_set1_epi32(120 << 23));
  const __m256 subnormal =
      _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude_code), _mm256_set1_ps(0x1p-9f));
  __m256i magnitude = _mm256_blendv_epi8(normal, _mm256_castps_si256(subnormal),
                                         _mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude_code));
  magnitude = _mm256_blendv_epi8(magnitude, nan_bits,
                                 _mm256_cmpeq_epi32(magnitude_code, _mm256_set1_epi32(0x7f)));
  return _mm256_castsi256_ps(_mm256_or_si256(magnitude, sign));
}

// DecodeBlockScalar with AVX2: 8 slots x 8 dims at a time, decoded by rows then transposed 8 x 8 in
// registers. Dims beyond the last multiple of 8 go through the table.
__attribute__((target("avx2"))) void DecodeBlockAvx2(const uint8_t* codes, int head_dim,
                                                     int64_t filled, float* tile,
                                                     uint32_t nan_bits) {
  static constexpr uint8_t kZeroCodes[8] = {};
  const __m256i nan_vector = _mm256_set1_epi32(static_cast<int>(nan_bits));
  const int vector_dims = head_dim & ~7;
  for (int s0 = 0; s0 < kBlockSize; s0 += 8) {
    const uint8_t* slot_codes[8];
    for (int i = 0; i < 8; ++i) {
      slot_codes[i] = s0 + i < filled ? codes + static_cast<size_t>(s0 + i) * head_dim : nullptr;
    }
    for (int d0 = 0; d0 < vector_dims; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        const uint8_t* src = slot_codes[i] ? slot_codes[i] + d0 : kZeroCodes;
        r[i] = DecodeFp8x8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)), nan_vector);
      }
      // 8 x 8 transpose: r[i] holds dims d0..d0+7 of slot s0+i; afterwards r[j] holds slots
      // s0..s0+7 of dim d0+j.
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
      float* dst = tile + TileIndex(d0, s0, head_dim);  // dim d0 + j at dst + j * kSlotsPerPass
      _mm256_storeu_ps(dst + 0 * kSlotsPerPass, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(dst + 1 * kSlotsPerPass, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(dst + 2 * kSlotsPerPass, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(dst + 3 * kSlotsPerPass, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(dst + 4 * kSlotsPerPass, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(dst + 5 * kSlotsPerPass, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(dst + 6 * kSlotsPerPass, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(dst + 7 * kSlotsPerPass, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
  if (vector_dims < head_dim) {
    const float* table = Fp8E4m3DecodeTable();
    for (int s = 0; s < kBlockSize; ++s) {
      const uint8_t* key = codes + static_cast<size_t>(s) * head_dim;
      for (int d = vector_dims; d < head_dim; ++d) {
        tile[TileIndex(d, s, head_dim)] = s < filled ? table[key[d]] : 0.0f;
      }
    }
  }
}

// The NaN bits DecodeFp8x8 gives 0x7f, or 0 when the AVX2 decode must not be used: no AVX2, or
// any of the 256 codes decodes differently from the table (bit for bit).
uint32_t Avx2DecodeNanBits() {
  if (!__builtin_cpu_supports("avx2")) return 0;
  const float* table = Fp8E4m3DecodeTable();
  const uint32_t nan_bits = std::bit_cast<uint32_t>(table[0x7f]) & 0x7fffffffu;
  if (nan_bits == 0) return 0;
  // One block whose slot s holds codes s * 4 .. s * 4 + 3 in dims 0..3 (and 0 elsewhere): all 256.
  std::vector<uint8_t> codes(static_cast<size_t>(kBlockSize) * 8, 0);
  for (int c = 0; c < 256; ++c)
    codes[static_cast<size_t>(c / 4) * 8 + c % 4] = static_cast<uint8_t>(c);
  std::vector<float> decoded(static_cast<size_t>(8) * kBlockSize), expected(decoded.size());
  DecodeBlockAvx2(codes.data(), 8, kBlockSize, decoded.data(), nan_bits);
  DecodeBlockScalar(codes.data(), 8, kBlockSize, expected.data());
  if (std::memcmp(decoded.data(), expected.data(), decoded.size() * sizeof(float)) != 0) return 0;
  return nan_bits;
}
#endif

// DecodeBlockScalar's result, with AVX2 where the CPU has it and the start-up check passed.
void DecodeBlock(const uint8_t* codes, int head_dim, int64_t filled, float* tile) {
#if DSA_SCORING_X86
  static const uint32_t nan_bits = Avx2DecodeNanBits();
  if (nan_bits != 0) {
    DecodeBlockAvx2(codes, head_dim, filled, tile, nan_bits);
    return;
  }
#endif
  DecodeBlockScalar(codes, head_dim, filled, tile);
}

}  // namespace

void ScoreBlockBatch(std::span<const ScoreJob> jobs, int num_heads) {
  // Work item w is block w - first_block[job] of the job whose range holds it.
  std::vector<int64_t> first_block(jobs.size() + 1, 0);
  for (size_t i = 0; i < jobs.size(); ++i) {
    first_block[i + 1] = first_block[i] + static_cast<int64_t>(jobs[i].logical_blocks.size());
  }
  const int64_t total_blocks = first_block.back();
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  // A block is ~0.5M multiply-adds at H = 64, D = 128 (tens of microseconds on a core); starting a
  // team of every core costs about as much, so small selects use at most one thread per two
  // blocks.
  const int threads = static_cast<int>(
      std::clamp<int64_t>(total_blocks / 2, 1, std::max(1, omp_get_max_threads())));

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> tile;
#pragma omp for schedule(dynamic, 4)
    for (int64_t w = 0; w < total_blocks; ++w) {
      const size_t i = static_cast<size_t>(
          std::upper_bound(first_block.begin(), first_block.end(), w) - first_block.begin() - 1);
      const ScoreJob& job = jobs[i];
      const KeyCacheView& cache = *job.cache;
      const int head_dim = cache.pool->head_dim();
      tile.resize(static_cast<size_t>(head_dim) * kBlockSize);
      const int64_t j = w - first_block[i];
      const int64_t row_stride = static_cast<int64_t>(job.logical_blocks.size()) * kBlockSize;
      const int64_t logical = job.logical_blocks[j];
      const int32_t block = cache.block_table[logical];
      const uint8_t* codes = cache.pool->keys(block);
      const float* block_scales = cache.pool->scales(block);
      const int64_t first_slot = logical * kBlockSize;
      const int64_t filled = std::min<int64_t>(kBlockSize, cache.num_slots - first_slot);
      DecodeBlock(codes, head_dim, filled, tile.data());
      float scales[kBlockSize];
      for (int s = 0; s < kBlockSize; ++s) scales[s] = s < filled ? block_scales[s] : 0.0f;
      for (size_t r = 0; r < job.rows.size(); ++r) {
        float* out = job.scores.data() + r * row_stride + j * kBlockSize;
        const int64_t visible = std::min<int64_t>(filled, job.rows[r].position + 1 - first_slot);
        if (visible <= 0) {
          std::fill(out, out + kBlockSize, kMinusInf);
          continue;
        }
        ScoreTile(tile.data(), scales, job.rows[r].query.data(), job.rows[r].head_weights.data(),
                  num_heads, head_dim, out);
        for (int64_t s = visible; s < kBlockSize; ++s) out[s] = kMinusInf;
      }
    }
  }
}

void ScoreBlocks(const KeyCacheView& cache, std::span<const int32_t> logical_blocks,
                 std::span<const IndexerRow> rows, int num_heads, std::span<float> scores) {
  const ScoreJob job{&cache, logical_blocks, rows, scores};
  ScoreBlockBatch(std::span<const ScoreJob>(&job, 1), num_heads);
}

}  // namespace dsa
