// Tests of the CUDA scoring device (indexer_service/cuda/cuda_scoring_device.h) behind the
// Indexer: the exact-integer workload of device_workload.h (SPIN decode steps, prefix sharing with
// copy on write, verifier rows with Commit, batches, audit, K above the GPU's, a new turn) must
// give the CPU engine's record bit for bit, with either scan kernel and two model shapes. The
// GPU tests skip without a usable GPU; the creation errors are checked on any machine.
#include "indexer_service/cuda/cuda_scoring_device.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "indexer_service/indexer.h"
#include "tests/indexer_service/cuda/cuda_test_util.h"
#include "tests/indexer_service/device_workload.h"

namespace dsa::cuda {
namespace {

using testing::NoUsableGpu;
using testing_workload::ExpectSameRecord;
using testing_workload::RunWorkload;
using testing_workload::WorkloadRecord;

IndexerOptions WorkloadOptions(int num_heads, int head_dim) {
  IndexerOptions options;
  options.capacity_blocks = 1024;
  options.num_heads = num_heads;
  options.head_dim = head_dim;
  options.audit_fraction = 1.0;
  return options;
}

struct Shape {
  int num_heads;
  int head_dim;
  ScanKernel kernel;
};

class CudaScoringDeviceTest : public ::testing::TestWithParam<Shape> {};

TEST_P(CudaScoringDeviceTest, SameRecordAsTheCpuEngine) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  const Shape shape = GetParam();
  auto cpu = Indexer::Create(WorkloadOptions(shape.num_heads, shape.head_dim));
  ASSERT_TRUE(cpu.ok());
  const WorkloadRecord expected = RunWorkload(**cpu);

  auto device = CreateCudaScoringDevice({0, shape.kernel});
  ASSERT_TRUE(device.ok()) << device.status();
  int failures = 0;
  auto indexer = Indexer::Create(WorkloadOptions(shape.num_heads, shape.head_dim),
                                 std::move(*device), [&](const absl::Status&) { ++failures; });
  ASSERT_TRUE(indexer.ok()) << indexer.status();
  const WorkloadRecord record = RunWorkload(**indexer);
  ExpectSameRecord(expected, record);
  EXPECT_EQ(failures, 0) << (*indexer)->DeviceDescription();
  EXPECT_TRUE((*indexer)->DeviceStatus().ok()) << (*indexer)->DeviceStatus();
  // Every select but the two with K = 4,096 ran on the GPU.
  EXPECT_EQ(record.selects_on_device, static_cast<int>(record.labels.size()) - 2);
}

INSTANTIATE_TEST_SUITE_P(
    ShapesAndKernels, CudaScoringDeviceTest,
    ::testing::Values(Shape{16, 64, ScanKernel::kAuto}, Shape{16, 64, ScanKernel::kCudaCores},
                      Shape{64, 128, ScanKernel::kTensorCores},
                      Shape{64, 128, ScanKernel::kCudaCores}, Shape{8, 32, ScanKernel::kAuto}),
    [](const ::testing::TestParamInfo<Shape>& info) {
      const char* kernel = info.param.kernel == ScanKernel::kAuto          ? "Auto"
                           : info.param.kernel == ScanKernel::kTensorCores ? "TensorCores"
                                                                           : "CudaCores";
      return absl::StrCat("H", info.param.num_heads, "D", info.param.head_dim, kernel);
    });

TEST(CudaScoringDeviceCreateTest, RefusesAnOrdinalOutOfRange) {
  auto device = CreateCudaScoringDevice({1 << 20, ScanKernel::kAuto});
  EXPECT_EQ(device.status().code(), absl::StatusCode::kFailedPrecondition) << device.status();
}

TEST(CudaScoringDeviceCreateTest, ParsesTheScanKernel) {
  ScanKernel kernel = ScanKernel::kAuto;
  EXPECT_TRUE(ParseScanKernel("cuda-cores", &kernel).ok());
  EXPECT_EQ(kernel, ScanKernel::kCudaCores);
  EXPECT_TRUE(ParseScanKernel("tensor-cores", &kernel).ok());
  EXPECT_EQ(kernel, ScanKernel::kTensorCores);
  const absl::Status bad = ParseScanKernel("tensor", &kernel);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("cuda-cores"), std::string::npos);
}

}  // namespace
}  // namespace dsa::cuda
