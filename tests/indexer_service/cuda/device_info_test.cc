// GPU test of the CUDA capability check; skips cleanly where no GPU is present.
#include "indexer_service/cuda/device_info.h"

#include "gtest/gtest.h"

namespace dsa::cuda {
namespace {

TEST(DeviceInfo, CountsDevicesWithoutFailingOnCpuMachines) {
  int count = -1;
  ASSERT_EQ(CountDevices(&count), cudaSuccess);
  EXPECT_GE(count, 0);
}

TEST(DeviceInfo, ReportsTheLentHopperGpu) {
  int count = 0;
  ASSERT_EQ(CountDevices(&count), cudaSuccess);
  if (count == 0) GTEST_SKIP() << "no GPU";
  DeviceInfo info;
  ASSERT_EQ(GetDeviceInfo(0, &info), cudaSuccess);
  EXPECT_GT(info.num_sms, 0);
  EXPECT_GT(info.global_memory_bytes, 0u);
  EXPECT_EQ(GetDeviceInfo(count, &info), cudaErrorInvalidDevice);
  // The capability check agrees with the compute capability the driver reports.
  EXPECT_EQ(CanRunIndexerKernels(info), info.sm_major == 9 && info.sm_minor == 0) << info.name;
}

}  // namespace
}  // namespace dsa::cuda
