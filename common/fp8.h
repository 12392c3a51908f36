// FP8 E4M3 (OCP "e4m3fn": no infinities, 0x7f/0xff are NaN, max 448) encoding and decoding on the
// host, plus the per-slot index-key quantizer of DESIGN.md section 4.1.
#pragma once

#include <cstdint>
#include <span>

namespace dsa {

/// Largest finite E4M3 magnitude.
inline constexpr float kFp8E4m3Max = 448.0f;

/// Encodes one fp32 value as E4M3 with round-to-nearest-even. Finite values whose magnitude rounds
/// above 448 saturate to +/-448; NaN maps to 0x7f (sign kept), +/-inf saturates to +/-448.
/// Subnormals (|x| < 2^-6) round to multiples of 2^-9. Matches PyTorch's float8_e4m3fn cast: a
/// golden table made with PyTorch 2.15 is embedded in tests/common/fp8_test.cc. Out of range we
/// saturate; PyTorch releases before 2.15 gave NaN from 464 up (the quantizer never gets there).
uint8_t EncodeFp8E4m3(float value);

/// Decodes one E4M3 byte exactly (every E4M3 value is representable in fp32). 0x7f/0xff -> NaN.
float DecodeFp8E4m3(uint8_t code);

/// The 256-entry decode table (index = code), for hot loops.
const float* Fp8E4m3DecodeTable();

/// Quantizes one index key (DESIGN.md 4.1): scale = amax / 448 where amax = max |key[d]|, codes[d]
/// = E4M3(key[d] / scale) with IEEE fp32 division. An all-zero key gets scale 0 and zero codes.
/// `key` and `codes` have the same length D (the head dimension). Requires finite input (callers
/// validate; non-finite input gives NaN codes). Returns the scale (fp32, >= 0).
float QuantizeIndexKey(std::span<const float> key, std::span<uint8_t> codes);

}  // namespace dsa
