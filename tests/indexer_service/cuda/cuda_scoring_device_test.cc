// Tests of the CUDA scoring device (indexer_service/cuda/cuda_scoring_device.h) behind the
// Indexer: the exact-integer workload of device_workload.h (SPIN decode steps, prefix sharing with
// copy on write, verifier rows with Commit, batches, audit, K above the GPU's, a new turn) must
// give the CPU engine's record bit for bit, with either scan kernel and two model shapes. The
// GPU tests skip without a usable GPU; the creation errors are checked on any machine.
#include "indexer_service/cuda/cuda_scoring_device.h"

#include <memory>
#include <set>
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
  const char* expected_scan;  // the scan kernel that must run
  bool spin;                  // SPIN on the GPU (CudaScoringOptions::spin)
};

// Forwards to the CUDA device and records which scan kernels ran.
class ScanKernelSpy : public ScoringDevice {
 public:
  ScanKernelSpy(std::unique_ptr<ScoringDevice> device, std::set<std::string>* kernels)
      : device_(std::move(device)), kernels_(kernels) {}
  std::string Describe() const override { return device_->Describe(); }
  absl::Status Attach(const BlockPool& pool, int num_heads) override {
    return device_->Attach(pool, num_heads);
  }
  absl::Status MirrorBlocks(std::span<const int32_t> block_ids) override {
    return device_->MirrorBlocks(block_ids);
  }
  absl::Status ScoreAndSelect(std::span<const DeviceScoreJob> jobs, int num_heads,
                              DeviceScoreSeconds* seconds) override {
    absl::Status status = device_->ScoreAndSelect(jobs, num_heads, seconds);
    if (status.ok()) kernels_->insert(seconds->scan_kernel);
    return status;
  }
  bool RunsSpin(const SpinConfig& config, int top_k) const override {
    return device_->RunsSpin(config, top_k);
  }
  absl::Status SelectWithSpin(std::span<const DeviceSpinJob> jobs, int num_heads,
                              DeviceScoreSeconds* seconds) override {
    absl::Status status = device_->SelectWithSpin(jobs, num_heads, seconds);
    if (status.ok()) kernels_->insert(seconds->scan_kernel);
    ++spin_selects;
    return status;
  }
  absl::Status CommitSpin(uint64_t sequence_id, int layer, int replay_rows) override {
    return device_->CommitSpin(sequence_id, layer, replay_rows);
  }
  absl::Status ResetSpin(uint64_t sequence_id) override { return device_->ResetSpin(sequence_id); }
  void ReleaseSpin(uint64_t sequence_id) override { device_->ReleaseSpin(sequence_id); }
  absl::Status ReadSpin(uint64_t sequence_id, int layer, std::vector<float>* vertical,
                        std::vector<float>* diagonal) override {
    return device_->ReadSpin(sequence_id, layer, vertical, diagonal);
  }
  int spin_selects = 0;

 private:
  std::unique_ptr<ScoringDevice> device_;
  std::set<std::string>* kernels_;
};

class CudaScoringDeviceTest : public ::testing::TestWithParam<Shape> {};

TEST_P(CudaScoringDeviceTest, SameRecordAsTheCpuEngine) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  const Shape shape = GetParam();
  auto cpu = Indexer::Create(WorkloadOptions(shape.num_heads, shape.head_dim));
  ASSERT_TRUE(cpu.ok());
  // No wide sequence: the GPU takes every K the engine allows (kMaxTopK), so nothing declines.
  const WorkloadRecord expected = RunWorkload(**cpu, 256, /*wide_top_k=*/0);

  auto device = CreateCudaScoringDevice({0, shape.kernel, shape.spin});
  ASSERT_TRUE(device.ok()) << device.status();
  int failures = 0;
  std::set<std::string> kernels;
  auto spy = std::make_unique<ScanKernelSpy>(std::move(*device), &kernels);
  const ScanKernelSpy* spy_view = spy.get();
  auto indexer = Indexer::Create(WorkloadOptions(shape.num_heads, shape.head_dim), std::move(spy),
                                 [&](const absl::Status& s) {
                                   ++failures;
                                   ADD_FAILURE() << s;
                                 });
  ASSERT_TRUE(indexer.ok()) << indexer.status();
  const WorkloadRecord record = RunWorkload(**indexer, 256, /*wide_top_k=*/0);
  ExpectSameRecord(expected, record);
  EXPECT_EQ(failures, 0) << (*indexer)->DeviceDescription();
  EXPECT_TRUE((*indexer)->DeviceStatus().ok()) << (*indexer)->DeviceStatus();
  // Every select ran on the GPU.
  EXPECT_EQ(record.selects_on_device, static_cast<int>(record.labels.size()));
  EXPECT_EQ(kernels, std::set<std::string>{shape.expected_scan});
  // With SPIN on the GPU every select is a whole select there (the audits' dense selects still go
  // through ScoreAndSelect): one call a select, one a batch (the six of two groups and the one of
  // two layers each answer two labels).
  if (shape.spin) {
    EXPECT_EQ(spy_view->spin_selects, static_cast<int>(record.labels.size()) - 6 - 1);
  } else {
    EXPECT_EQ(spy_view->spin_selects, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    ShapesAndKernels, CudaScoringDeviceTest,
    ::testing::Values(Shape{16, 64, ScanKernel::kAuto, "tensor-cores", true},
                      Shape{16, 64, ScanKernel::kAuto, "tensor-cores", false},
                      Shape{16, 64, ScanKernel::kCudaCores, "cuda-cores", true},
                      Shape{64, 128, ScanKernel::kTensorCores, "tensor-cores", true},
                      Shape{64, 128, ScanKernel::kCudaCores, "cuda-cores", false},
                      Shape{8, 32, ScanKernel::kAuto, "cuda-cores", true}),
    [](const ::testing::TestParamInfo<Shape>& info) {
      const char* kernel = info.param.kernel == ScanKernel::kAuto          ? "Auto"
                           : info.param.kernel == ScanKernel::kTensorCores ? "TensorCores"
                                                                           : "CudaCores";
      return absl::StrCat("H", info.param.num_heads, "D", info.param.head_dim, kernel,
                          info.param.spin ? "SpinOnGpu" : "SpinOnCpu");
    });

TEST(CudaScoringDeviceWideKTest, SameRecordAsTheCpuEngineWithKOf2048) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  auto cpu = Indexer::Create(WorkloadOptions(64, 128));
  ASSERT_TRUE(cpu.ok());
  auto device = CreateCudaScoringDevice({0, ScanKernel::kAuto, true});
  ASSERT_TRUE(device.ok()) << device.status();
  auto indexer = Indexer::Create(WorkloadOptions(64, 128), std::move(*device));
  ASSERT_TRUE(indexer.ok()) << indexer.status();
  ExpectSameRecord(RunWorkload(**cpu, 2048, /*wide_top_k=*/0),
                   RunWorkload(**indexer, 2048, /*wide_top_k=*/0));
  EXPECT_TRUE((*indexer)->DeviceStatus().ok()) << (*indexer)->DeviceStatus();
}

TEST(CudaScoringDeviceCreateTest, RefusesTheTensorCoreScanForAShapeItCannotRun) {
  if (NoUsableGpu()) GTEST_SKIP() << "no usable GPU";
  auto device = CreateCudaScoringDevice({0, ScanKernel::kTensorCores, true});
  ASSERT_TRUE(device.ok()) << device.status();
  auto indexer = Indexer::Create(WorkloadOptions(8, 32), std::move(*device));
  EXPECT_EQ(indexer.status().code(), absl::StatusCode::kFailedPrecondition) << indexer.status();
}

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
