// Device-side FP8 E4M3 encoding, input loads and the paged-cache address arithmetic shared by the
// indexer kernels. The encoder is a line-by-line port of common/fp8.cc (EncodeFp8E4m3), so the GPU
// append is bit-identical to the CPU quantizer (DESIGN.md 4.1).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "contracts/layout.h"

namespace dsa::cuda {

/// An fp32 or bf16 input value (keys, queries) as fp32: exact either way.
__device__ inline float LoadAsFloat(const float* p) { return *p; }
__device__ inline float LoadAsFloat(const __nv_bfloat16* p) { return __bfloat162float(*p); }

/// Bytes of one cache block: 64 x head_dim fp8 codes, then 64 fp32 scales.
__host__ __device__ inline int64_t CacheBlockBytes(int head_dim) {
  return int64_t{kBlockSize} * (head_dim + 4);
}

/// fp32 -> E4M3 with round-to-nearest-even and saturation to +/-448; NaN -> 0x7f (sign kept).
/// Same integer steps as dsa::EncodeFp8E4m3 (common/fp8.cc).
__device__ inline uint8_t EncodeFp8E4m3Device(float value) {
  uint32_t bits = __float_as_uint(value);
  const uint32_t sign = (bits >> 24) & 0x80u;
  bits &= 0x7fffffffu;
  if (bits > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);   // NaN
  if (bits >= 0x43e80000u) return static_cast<uint8_t>(sign | 0x7eu);  // >= 464 and inf: 448
  if (bits < 0x3c800000u) {
    // Subnormal result: x * 2^9 (exact) rounded to the nearest-even integer.
    const float rounded = rintf(__fmul_rn(__uint_as_float(bits), 512.0f));
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(rounded));
  }
  const uint32_t mantissa_odd = (bits >> 20) & 1u;
  bits += 0x7ffffu + mantissa_odd;
  bits -= (127u - 7u) << 23;
  return static_cast<uint8_t>(sign | (bits >> 20));
}

/// E4M3 -> fp32, exact (0x7f/0xff -> NaN).
__device__ inline float DecodeFp8E4m3Device(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t magnitude_code = code & 0x7fu;
  float magnitude;
  if (magnitude_code == 0x7fu) {
    magnitude = __uint_as_float(0x7fc00000u);
  } else if (magnitude_code < 8u) {
    magnitude = static_cast<float>(magnitude_code) * 0x1p-9f;  // subnormal: m * 2^-9
  } else {
    magnitude = __uint_as_float((magnitude_code << 20) + (120u << 23));
  }
  return __uint_as_float(__float_as_uint(magnitude) | sign);
}

}  // namespace dsa::cuda
