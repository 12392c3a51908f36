// The real model's indexer-scores check on the CUDA scoring device (skips without a usable GPU):
// the real SmolLM2-135M indexer inputs scored by the GPU equal the double-precision reference over
// fp8 keys; the CUDA-core scan against fp32 queries, the tensor-core scan (the default, kAuto, for
// H = 16, D = 64) against the queries rounded to bf16 (cuda_scoring_device.h: "scores as
// ScoreBlocks on the bf16 query").
#include <memory>

#include "gtest/gtest.h"
#include "indexer_service/cuda/cuda_scoring_device.h"
#include "indexer_service/cuda/device_info.h"
#include "indexer_service/indexer.h"
#include "tests/attention_worker/llama_indexer_scores_check.h"

namespace dsa {
namespace {

bool NoUsableGpu() {
  int count = 0;
  if (cuda::CountDevices(&count) != cudaSuccess || count == 0) return true;
  cuda::DeviceInfo info;
  return cuda::GetDeviceInfo(0, &info) != cudaSuccess || !cuda::CanRunIndexerKernels(info);
}

void RunOnDevice(cuda::ScanKernel kernel, bool bf16_queries, const std::string& label) {
  if (NoUsableGpu()) GTEST_SKIP() << "no GPU that can run the indexer kernels";
  const auto& inputs = indexer_scores_check::Inputs(/*read_file=*/true);
  ASSERT_FALSE(inputs.layers.empty()) << "the model inputs could not be computed (see above)";
  cuda::CudaScoringOptions options;
  options.scan_kernel = kernel;
  auto device = cuda::CreateCudaScoringDevice(options);
  ASSERT_TRUE(device.ok()) << device.status();
  auto indexer = Indexer::Create({.capacity_blocks = 256, .num_heads = 16, .head_dim = 64},
                                 std::move(*device));
  ASSERT_TRUE(indexer.ok()) << indexer.status();
  indexer_scores_check::CheckIndexer(**indexer, bf16_queries, /*expect_on_device=*/true, label);
  EXPECT_TRUE((*indexer)->DeviceStatus().ok()) << (*indexer)->DeviceStatus();
}

TEST(LlamaIndexerScoresCudaTest, CudaCoreScanEqualsTheReference) {
  RunOnDevice(cuda::ScanKernel::kCudaCores, /*bf16_queries=*/false, "cuda-cores");
}

TEST(LlamaIndexerScoresCudaTest, DefaultTensorCoreScanEqualsTheReferenceOnBf16Queries) {
  RunOnDevice(cuda::ScanKernel::kAuto, /*bf16_queries=*/true, "cuda-auto(tensor-cores)");
}

}  // namespace
}  // namespace dsa
