// The layer stand-in (layer_standin.h): its GEMM against a CPU GEMM on a small shape (bf16 inputs,
// fp32 accumulation, bf16 output), the weight bytes it reads, the rotation over buffers that
// exceed the L2, and the busy spin's length.
#include "attention_worker/cuda/layer_standin.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"

namespace dsa::cuda {
namespace {

using ::dsa::cuda::testing::DeviceBuffer;
using ::dsa::cuda::testing::FromBf16Bits;
using ::dsa::cuda::testing::NoUsableGpu;
using ::dsa::cuda::testing::ToBf16Bits;

class LayerStandinLayoutTest : public ::testing::TestWithParam<StandinWeightLayout> {};

TEST_P(LayerStandinLayoutTest, GemmMatchesTheCpuAndReadsTheAskedBytes) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  const bool by_hidden = GetParam() == StandinWeightLayout::kRowMajorOutputByHidden;
  LayerStandinParams params;
  params.layout = GetParam();
  params.hidden_dim = 64;
  params.weight_bytes_per_layer = 2 * 64 * 96;  // N = 96
  params.busy_micros = 0.0;
  params.max_rows = 8;
  LayerStandin standin;
  DSA_CUDA_OK(CreateLayerStandin(params, &standin));
  EXPECT_EQ(standin.weight_rows, 96);
  EXPECT_GE(static_cast<int64_t>(standin.weights.size()) * params.weight_bytes_per_layer,
            kStandinMinRotationBytes);
  const int rows = 3, m = 64, n = 96;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(rows) * m);
  for (uint16_t& v : x) v = ToBf16Bits(uniform(rng));
  DeviceBuffer d_x = DeviceBuffer::From(x);
  DeviceBuffer d_out(static_cast<size_t>(rows) * n * 2);
  for (int layer = 0; layer < 3; ++layer) {
    int buffer = -1;
    DSA_CUDA_OK(RunLayerStandin(&standin, d_x.as<__nv_bfloat16>(), rows, d_out.as<__nv_bfloat16>(),
                                nullptr, &buffer));
    EXPECT_EQ(buffer, layer);  // each layer reads the next buffer
    DSA_CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> w(static_cast<size_t>(n) * m);
    DSA_CUDA_OK(
        cudaMemcpy(w.data(), standin.weights[buffer], w.size() * 2, cudaMemcpyDeviceToHost));
    double w_norm = 0.0;
    for (uint16_t v : w) w_norm += std::abs(FromBf16Bits(v));
    ASSERT_GT(w_norm, 0.0);  // never a GEMM of zeros
    const std::vector<uint16_t> out = d_out.ToHost<uint16_t>();
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < n; ++j) {
        double ref = 0.0, scale = 0.0;
        for (int k = 0; k < m; ++k) {
          const uint16_t weight = by_hidden ? w[j * m + k] : w[k * n + j];
          const double p = static_cast<double>(FromBf16Bits(x[r * m + k])) * FromBf16Bits(weight);
          ref += p;
          scale += std::abs(p);
        }
        EXPECT_NEAR(FromBf16Bits(out[r * n + j]), ref, 1e-2 * scale + 1e-6) << r << " " << j;
      }
    }
  }
  LayerStandinTiming timing;
  DSA_CUDA_OK(MeasureLayerStandin(&standin, d_x.as<__nv_bfloat16>(), rows,
                                  d_out.as<__nv_bfloat16>(), 5, nullptr, &timing));
  EXPECT_EQ(timing.weight_bytes_per_layer, 2 * 64 * 96);
  EXPECT_GT(timing.gemm_micros, 0.0);
  DSA_CUDA_OK(DestroyLayerStandin(&standin));
}

INSTANTIATE_TEST_SUITE_P(Layouts, LayerStandinLayoutTest,
                         ::testing::Values(StandinWeightLayout::kRowMajorOutputByHidden,
                                           StandinWeightLayout::kRowMajorHiddenByOutput));

TEST(LayerStandinTest, BusySpinLastsAtLeastItsTime) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  LayerStandinParams params;
  params.hidden_dim = 64;
  params.weight_bytes_per_layer = 2 * 64 * 64;
  params.busy_micros = 50.0;
  LayerStandin standin;
  DSA_CUDA_OK(CreateLayerStandin(params, &standin));
  DeviceBuffer d_x(2 * 64 * 2), d_out(2 * 64 * 2);
  DSA_CUDA_OK(cudaMemset(d_x.as<void>(), 0, d_x.bytes()));
  LayerStandinTiming timing;
  DSA_CUDA_OK(MeasureLayerStandin(&standin, d_x.as<__nv_bfloat16>(), 2, d_out.as<__nv_bfloat16>(),
                                  10, nullptr, &timing));
  EXPECT_GE(timing.layer_micros, 50.0);
  // An upper bound only outside compute-sanitizer, which slows every launch.
  if (std::getenv("DSA_UNDER_SANITIZER") == nullptr) {
    EXPECT_LT(timing.layer_micros, 50.0 + timing.gemm_micros + 30.0);
  }
  EXPECT_DOUBLE_EQ(standin.params.busy_micros, 50.0);  // restored after the GEMM-only pass
  DSA_CUDA_OK(DestroyLayerStandin(&standin));
}

TEST(LayerStandinTest, RefusesBadParams) {
  LayerStandin standin;
  LayerStandinParams params;
  params.weight_bytes_per_layer = 2 * kStandinHiddenDim + 2;  // not whole rows
  EXPECT_EQ(CreateLayerStandin(params, &standin), cudaErrorInvalidValue);
  params.weight_bytes_per_layer = 0;
  EXPECT_EQ(CreateLayerStandin(params, &standin), cudaErrorInvalidValue);
  params = LayerStandinParams{};
  params.busy_micros = -1.0;
  EXPECT_EQ(CreateLayerStandin(params, &standin), cudaErrorInvalidValue);
  EXPECT_EQ(RunLayerStandin(&standin, nullptr, 1, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchBusySpin(-1.0, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(kStandinDefaultWeightBytes, 76'009'472);
}

}  // namespace
}  // namespace dsa::cuda
