// The rotation of the GPU generators (attention_worker/cuda/rotation_cos_sin.h), run on the host
// with the same IEEE operations, against the CPU pattern model's static_cast<float>(std::cos(a))
// and std::sin over the angles the model forms (theta_f * slot and theta_f * (t - offset)), with
// slots and positions past 2^20, 2^32 and 2^40, negative angles and angles near multiples of pi/2.
#include "attention_worker/cuda/rotation_cos_sin.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>

#include "gtest/gtest.h"

namespace dsa::rotation {
namespace {

void ExpectSameAsLibm(double angle) {
  float cs = 0.0f, sn = 0.0f;
  RotationCosSin(angle, &cs, &sn);
  ASSERT_EQ(std::bit_cast<uint32_t>(cs),
            std::bit_cast<uint32_t>(static_cast<float>(std::cos(angle))))
      << std::hexfloat << angle;
  ASSERT_EQ(std::bit_cast<uint32_t>(sn),
            std::bit_cast<uint32_t>(static_cast<float>(std::sin(angle))))
      << std::hexfloat << angle;
}

TEST(RotationCosSinTest, MatchesLibmOnTheModelsAngles) {
  std::mt19937_64 rng(12345);
  const int kPairs = 32;
  for (int f = 0; f < kPairs; ++f) {
    const double theta = std::pow(10000.0, -static_cast<double>(f) / kPairs);
    for (int64_t slot = 0; slot < 4096; ++slot) ExpectSameAsLibm(theta * static_cast<double>(slot));
    for (int64_t start : {int64_t{1} << 20, int64_t{1} << 32, int64_t{1} << 40, int64_t{1} << 52}) {
      for (int64_t k = -64; k < 64; ++k) ExpectSameAsLibm(theta * static_cast<double>(start + k));
    }
    for (int i = 0; i < 20000; ++i) {
      const int64_t slot = static_cast<int64_t>(rng() >> (20 + i % 40));
      ExpectSameAsLibm(theta * static_cast<double>(slot));
      ExpectSameAsLibm(-theta * static_cast<double>(slot % 3000));
    }
  }
}

TEST(RotationCosSinTest, MatchesLibmNearQuarterTurnsAndEdges) {
  for (int64_t k = 1; k < 2000000; k += 7) {
    const double quarter = static_cast<double>(k) * (std::numbers::pi / 2);
    ExpectSameAsLibm(quarter);
    ExpectSameAsLibm(std::nextafter(quarter, 0.0));
    ExpectSameAsLibm(std::nextafter(quarter, 1e300));
  }
  for (double a : {0.0, 1e-300, 1e-20, 1e-8, 0.5, 0.78, 0.7853981633974483, 0.79, 1.0, 3.0, 1e6,
                   1e15, 9.2e18}) {
    ExpectSameAsLibm(a);
    ExpectSameAsLibm(-a);
  }
}

}  // namespace
}  // namespace dsa::rotation
