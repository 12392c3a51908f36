// Philox4x32-10, the counter-based generator of Salmon et al. (SC'11, "Random123"), used for SPIN's
// seeded exploration (DESIGN.md 4.2 step 5) so the CPU and the GPU draw the same numbers from the
// same (key, counter). Header-only and usable from host and device code (no dependencies).
#pragma once

#include <array>
#include <cstdint>

#if defined(__CUDACC__)
#define DSA_HOST_DEVICE __host__ __device__
#else
#define DSA_HOST_DEVICE
#endif

namespace dsa {

struct PhiloxCounter {
  uint32_t c[4];
};
struct PhiloxKey {
  uint32_t k[2];
};

/// Ten rounds of Philox4x32 on `counter` under `key`; returns four independent uniform uint32
/// words.
DSA_HOST_DEVICE inline PhiloxCounter Philox4x32(PhiloxCounter counter, PhiloxKey key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * counter.c[0];
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * counter.c[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    counter =
        PhiloxCounter{{hi1 ^ counter.c[1] ^ key.k[0], lo1, hi0 ^ counter.c[3] ^ key.k[1], lo0}};
    key.k[0] += kWeyl0;
    key.k[1] += kWeyl1;
  }
  return counter;
}

/// Mixes two 64-bit values into one seed (SplitMix64's finalizer over a ^ mix(b)): the exploration
/// key of a sequence is MixSeed(configured seed, sequence id), so sequences draw independently and
/// a run repeats for the same seed and ids.
DSA_HOST_DEVICE inline uint64_t MixSeed(uint64_t a, uint64_t b) {
  auto finalize = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  return finalize(a ^ finalize(b + 0x9E3779B97F4A7C15ull));
}

/// Maps a uniform uint32 to [0, range) by the multiply-shift method (bias below range / 2^32).
DSA_HOST_DEVICE inline uint32_t UniformBelow(uint32_t random_word, uint32_t range) {
  return static_cast<uint32_t>((static_cast<uint64_t>(random_word) * range) >> 32);
}

/// Maps a uniform uint32 to a float in [0, 1) with 24 random bits.
DSA_HOST_DEVICE inline float UniformFloat(uint32_t random_word) {
  return static_cast<float>(random_word >> 8) * (1.0f / 16777216.0f);
}

}  // namespace dsa
