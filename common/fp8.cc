// FP8 E4M3 conversion, bit-exact with round-to-nearest-even (see fp8.h).
#include "common/fp8.h"

#include <array>
#include <bit>
#include <cmath>

namespace dsa {
namespace {

float DecodeBits(uint8_t code) {
  const uint32_t sign = (code >> 7) & 1u;
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  float magnitude;
  if (exponent == 0xf && mantissa == 0x7) {
    magnitude = std::nanf("");
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m * 2^-6 / 8
  } else {
    magnitude =
        std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, static_cast<int>(exponent) - 7);
  }
  return sign ? -magnitude : magnitude;
}

const std::array<float, 256>& DecodeTable() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = DecodeBits(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

}  // namespace

uint8_t EncodeFp8E4m3(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7fffffffu;
  if (bits > 0x7f800000u) return sign | 0x7f;  // NaN
  // Saturation: 464 = 0x43e80000 is the midpoint between 448 and the (non-existent) 480; values at
  // or above it would round past the largest finite code. Infinity saturates too.
  if (bits >= 0x43e80000u) return sign | 0x7e;
  if (bits < 0x3c800000u) {
    // Below 2^-6 the result is subnormal: x * 2^9 (exact) rounded to the nearest-even integer is
    // the subnormal mantissa; a result of 8 is the smallest normal code, 2^-6.
    const float scaled = std::bit_cast<float>(bits) * 512.0f;  // exact (power of two)
    const float rounded = std::nearbyint(scaled);              // default mode: nearest-even
    return sign | static_cast<uint8_t>(rounded);  // 8 (=2^-6) becomes the smallest normal
  }
  // Normal range: keep 3 mantissa bits, round to nearest even on the 20 dropped bits.
  const uint32_t mantissa_odd = (bits >> 20) & 1u;
  bits += 0x7ffffu + mantissa_odd;
  // Rebias the exponent from 127 to 7.
  bits -= (127u - 7u) << 23;
  return sign | static_cast<uint8_t>(bits >> 20);
}

float DecodeFp8E4m3(uint8_t code) { return DecodeTable()[code]; }

const float* Fp8E4m3DecodeTable() { return DecodeTable().data(); }

float QuantizeIndexKey(std::span<const float> key, std::span<uint8_t> codes) {
  float amax = 0.0f;
  for (float v : key) amax = std::fmax(amax, std::fabs(v));
  const float scale = amax / kFp8E4m3Max;
  if (!(scale > 0.0f)) {
    // An all-zero key, or one so small (amax < 448 x the least subnormal) that its scale
    // underflows to 0: store it as zero rather than dividing by zero (NaN codes).
    for (auto& c : codes) c = 0;
    return 0.0f;
  }
  for (size_t d = 0; d < key.size(); ++d) codes[d] = EncodeFp8E4m3(key[d] / scale);
  return scale;
}

}  // namespace dsa
