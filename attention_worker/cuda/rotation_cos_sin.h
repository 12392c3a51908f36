// (float) cos(angle) and (float) sin(angle) of a double angle, as the CPU pattern model computes
// them (static_cast<float>(std::cos(angle))), for the GPU generators: an exact integer reduction of
// the angle by 2 pi (256 bits of 1 / (2 pi)) and double-double polynomials, so the double that is
// rounded to float is the correctly rounded cos / sin (error about 2^-70 before that rounding).
// Host and device (DSA_HOST_DEVICE); plain IEEE operations and explicit fma only: compile the
// device side with -fmad=false (the host with no FMA contraction: x86-64 g++ without -march).
// docs/attention_gpu_inputs.md says why this equals glibc's bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/philox.h"  // DSA_HOST_DEVICE

namespace dsa::rotation {

/// A double-double: the unevaluated sum hi + lo, |lo| <= ulp(hi).
struct DoubleDouble {
  double hi;
  double lo;
};

DSA_HOST_DEVICE inline DoubleDouble TwoSum(double a, double b) {
  const double s = a + b;
  const double bb = s - a;
  const double err = (a - (s - bb)) + (b - bb);
  return {s, err};
}
// |a| >= |b| (or a == 0).
DSA_HOST_DEVICE inline DoubleDouble FastTwoSum(double a, double b) {
  const double s = a + b;
  return {s, b - (s - a)};
}
DSA_HOST_DEVICE inline DoubleDouble TwoProd(double a, double b) {
  const double p = a * b;
  return {p, fma(a, b, -p)};
}
DSA_HOST_DEVICE inline DoubleDouble Add(DoubleDouble a, DoubleDouble b) {
  DoubleDouble s = TwoSum(a.hi, b.hi);
  const DoubleDouble t = TwoSum(a.lo, b.lo);
  s.lo += t.hi;
  s = FastTwoSum(s.hi, s.lo);
  s.lo += t.lo;
  return FastTwoSum(s.hi, s.lo);
}
DSA_HOST_DEVICE inline DoubleDouble Mul(DoubleDouble a, DoubleDouble b) {
  DoubleDouble p = TwoProd(a.hi, b.hi);
  const double cross = a.hi * b.lo;
  p.lo += cross + a.lo * b.hi;
  return FastTwoSum(p.hi, p.lo);
}
// 1 / n as a double-double (the residual 1 - n * hi is exact through fma).
DSA_HOST_DEVICE inline DoubleDouble Reciprocal(double n) {
  const double hi = 1.0 / n;
  return {hi, fma(-hi, n, 1.0) / n};
}

// 64 x 64 -> 128-bit unsigned product.
DSA_HOST_DEVICE inline void MulWide(uint64_t a, uint64_t b, uint64_t* hi, uint64_t* lo) {
#if defined(__CUDA_ARCH__)
  *hi = __umul64hi(a, b);
  *lo = a * b;
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  *hi = static_cast<uint64_t>(p >> 64);
  *lo = static_cast<uint64_t>(p);
#endif
}

DSA_HOST_DEVICE inline uint64_t DoubleBits(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(x));
#else
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

DSA_HOST_DEVICE inline int CountLeadingZeros64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __clzll(static_cast<long long>(x));
#else
  return x == 0 ? 64 : __builtin_clzll(x);
#endif
}

// Bits 64 (j - 1) + 1 .. 64 j of 1 / (2 pi) in word j (j >= 1), word 0 zero: the binary expansion
// 0.28BE60DB 9391054A 7F09D5F4 7D4D3770 ... (from Machin's formula in exact integer arithmetic).
// Word j covers fraction bits [64 (j - 1) + 1, 64 j]; word 0 stands for bits [-63, 0] (zeros).
DSA_HOST_DEVICE inline uint64_t InvTwoPiWord(int j) {
  switch (j) {
    case 1:
      return 0x28be60db9391054aull;
    case 2:
      return 0x7f09d5f47d4d3770ull;
    case 3:
      return 0x36d8a5664f10e410ull;
    case 4:
      return 0x7f9458eaf7aef158ull;
    default:
      return 0;
  }
}
// The 64 bits of 1 / (2 pi) at fraction positions [start, start + 63] (positions < 1 are zero);
// start in [-62, 193].
DSA_HOST_DEVICE inline uint64_t InvTwoPiBits(int start) {
  const int index = start + 63;  // bit index from the start of word 0
  const int word = index / 64, offset = index % 64;
  const uint64_t a = InvTwoPiWord(word);
  if (offset == 0) return a;
  return (a << offset) | (InvTwoPiWord(word + 1) >> (64 - offset));
}

// 2 pi as a double-double.
DSA_HOST_DEVICE inline DoubleDouble TwoPi() { return {6.283185307179586, 2.4492935982947064e-16}; }

// sin r and cos r for |r| <= pi / 4 + a little, to about 2^-70: Taylor series whose first terms
// are double-double and whose tail (relative size < 2^-17) is plain double.
DSA_HOST_DEVICE inline void SinCosReduced(DoubleDouble r, DoubleDouble* sin_out,
                                          DoubleDouble* cos_out) {
  const DoubleDouble u = Mul(r, r);
  const double x = u.hi;
  // Tails: sum_{k >= 4} (-1)^k u^(k-4) / (2k+1)! and / (2k)!, up to u^8.
  double sin_tail = 1.0 / 25852016738884976640000.0;         // 1 / 23!
  sin_tail = 1.0 / 51090942171709440000.0 - x * sin_tail;    // 1 / 21!
  sin_tail = 1.0 / 121645100408832000.0 - x * sin_tail;      // 1 / 19!
  sin_tail = 1.0 / 355687428096000.0 - x * sin_tail;         // 1 / 17!
  sin_tail = 1.0 / 1307674368000.0 - x * sin_tail;           // 1 / 15!
  sin_tail = 1.0 / 6227020800.0 - x * sin_tail;              // 1 / 13!
  sin_tail = 1.0 / 39916800.0 - x * sin_tail;                // 1 / 11!
  sin_tail = 1.0 / 362880.0 - x * sin_tail;                  // 1 / 9!
  double cos_tail = 1.0 / 620448401733239439360000.0;        // 1 / 24!
  cos_tail = 1.0 / 1124000727777607680000.0 - x * cos_tail;  // 1 / 22!
  cos_tail = 1.0 / 2432902008176640000.0 - x * cos_tail;     // 1 / 20!
  cos_tail = 1.0 / 6402373705728000.0 - x * cos_tail;        // 1 / 18!
  cos_tail = 1.0 / 20922789888000.0 - x * cos_tail;          // 1 / 16!
  cos_tail = 1.0 / 87178291200.0 - x * cos_tail;             // 1 / 14!
  cos_tail = 1.0 / 479001600.0 - x * cos_tail;               // 1 / 12!
  cos_tail = 1.0 / 3628800.0 - x * cos_tail;                 // 1 / 10!
  cos_tail = 1.0 / 40320.0 - x * cos_tail;                   // 1 / 8!
  // sin r = r (1 - u/3! + u^2/5! - u^3/7! + u^4 tail), cos r = 1 - u/2 + u^2/4! - u^3/6! + u^4
  // tail.
  auto negate = [](DoubleDouble a) { return DoubleDouble{-a.hi, -a.lo}; };
  DoubleDouble s = Add(negate(Reciprocal(5040.0)), Mul(u, DoubleDouble{sin_tail, 0.0}));
  s = Add(Reciprocal(120.0), Mul(u, s));
  s = Add(negate(Reciprocal(6.0)), Mul(u, s));
  s = Add(DoubleDouble{1.0, 0.0}, Mul(u, s));
  *sin_out = Mul(r, s);
  DoubleDouble c = Add(negate(Reciprocal(720.0)), Mul(u, DoubleDouble{cos_tail, 0.0}));
  c = Add(Reciprocal(24.0), Mul(u, c));
  c = Add(DoubleDouble{-0.5, 0.0}, Mul(u, c));
  *cos_out = Add(DoubleDouble{1.0, 0.0}, Mul(u, c));
}

/// (float) cos(angle) and (float) sin(angle) through the correctly rounded double (double
/// rounding included, as static_cast<float>(std::cos(angle)) does). Any finite |angle| < 2^63.
DSA_HOST_DEVICE inline void RotationCosSin(double angle, float* cos_out, float* sin_out) {
  if (angle == 0.0) {  // cos 1, sin a signed zero (sin(-0) = -0)
    *cos_out = 1.0f;
    *sin_out = static_cast<float>(angle);
    return;
  }
  const bool negative = angle < 0.0;
  const double a = negative ? -angle : angle;
  DoubleDouble r{a, 0.0};
  int quadrant = 0;
  if (a > 0.78) {
    // a = mantissa * 2^exponent exactly; turns = frac(a / (2 pi)) as a 192-bit fraction.
    const uint64_t bits = DoubleBits(a);
    const int exponent = static_cast<int>((bits >> 52) & 0x7ff) - 1075;
    const uint64_t mantissa = (bits & ((uint64_t{1} << 52) - 1)) | (uint64_t{1} << 52);
    // The bits of (1 / (2 pi)) * 2^exponent below the units place (those above it give integers).
    const uint64_t w0 = InvTwoPiBits(exponent + 1);
    const uint64_t w1 = InvTwoPiBits(exponent + 65);
    const uint64_t w2 = InvTwoPiBits(exponent + 129);
    uint64_t p0_hi, p0_lo, p1_hi, p1_lo, p2_hi, p2_lo;
    MulWide(mantissa, w0, &p0_hi, &p0_lo);
    MulWide(mantissa, w1, &p1_hi, &p1_lo);
    MulWide(mantissa, w2, &p2_hi, &p2_lo);
    (void)p0_hi;  // integer turns
    (void)p2_lo;  // below 2^-128 turns
    const uint64_t f1 = p2_hi + p1_lo;
    const uint64_t carry = f1 < p2_hi ? 1 : 0;
    const uint64_t f0 = p1_hi + p0_lo + carry;
    // Nearest quarter turn, and the signed remainder in [-1/8, 1/8] turns (128 bits).
    quadrant = static_cast<int>(((f0 + (uint64_t{1} << 61)) >> 62) & 3);
    uint64_t g0 = f0 - (static_cast<uint64_t>(quadrant) << 62);
    uint64_t g1 = f1;
    const bool remainder_negative = static_cast<int64_t>(g0) < 0;
    if (remainder_negative) {  // two's complement negation of the 128-bit value
      g1 = ~g1 + 1;
      g0 = ~g0 + (g1 == 0 ? 1 : 0);
    }
    double hi = 0.0, lo = 0.0;
    if (g0 != 0 || g1 != 0) {
      // Normalize so bit 127 is set; the top 53 bits and the next 53 bits are exact doubles.
      const int shift = g0 != 0 ? CountLeadingZeros64(g0) : 64 + CountLeadingZeros64(g1);
      uint64_t n0, n1;
      if (shift >= 64) {
        n0 = g1 << (shift - 64);
        n1 = 0;
      } else if (shift > 0) {
        n0 = (g0 << shift) | (g1 >> (64 - shift));
        n1 = g1 << shift;
      } else {
        n0 = g0;
        n1 = g1;
      }
      const uint64_t top = n0 >> 11;                            // 53 bits
      const uint64_t next = ((n0 & 0x7ff) << 42) | (n1 >> 22);  // 53 bits
      hi = ldexp(static_cast<double>(top), 75 - 128 - shift);
      lo = ldexp(static_cast<double>(next), 22 - 128 - shift);
    }
    if (remainder_negative) {
      hi = -hi;
      lo = -lo;
    }
    r = Mul(TwoPi(), FastTwoSum(hi, lo));
  }
  DoubleDouble s, c;
  SinCosReduced(r, &s, &c);
  // angle = quadrant * pi/2 + r.
  double cos_value, sin_value;
  switch (quadrant) {
    case 0:
      cos_value = c.hi;
      sin_value = s.hi;
      break;
    case 1:
      cos_value = -s.hi;
      sin_value = c.hi;
      break;
    case 2:
      cos_value = -c.hi;
      sin_value = -s.hi;
      break;
    default:
      cos_value = s.hi;
      sin_value = -c.hi;
      break;
  }
  if (negative) sin_value = -sin_value;
  *cos_out = static_cast<float>(cos_value);
  *sin_out = static_cast<float>(sin_value);
}

}  // namespace dsa::rotation
