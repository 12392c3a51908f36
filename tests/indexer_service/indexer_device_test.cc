// Tests of the Indexer with a scoring device (indexer_service/scoring_device.h), without a GPU: a
// fake device scores from its own mirror of the pool (so a block the Indexer forgets to mirror
// shows up as wrong scores) with the CPU reference, and can be told to fail or decline. The same
// workload must give the same record as the CPU alone; a failing device is dropped (once, with the
// callback) and the CPU serves the same call and the rest, losing nothing.
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/indexer.h"
#include "indexer_service/scoring_device.h"
#include "indexer_service/topk.h"
#include "tests/indexer_service/device_workload.h"

namespace dsa {
namespace {

using testing_workload::ExpectSameRecord;
using testing_workload::RunWorkload;
using testing_workload::WorkloadRecord;

// Knobs a test turns to make the fake misbehave; owned by the test (the Indexer owns the fake).
struct FakeControls {
  int mirror_calls = 0;
  int score_calls = 0;
  std::optional<int> fail_mirror_at;  // the n-th MirrorBlocks call (0-based) returns INTERNAL
  std::optional<int> fail_score_at;   // the n-th ScoreAndSelect call returns INTERNAL
  int max_top_k = 2048;               // larger K: UNIMPLEMENTED, as the CUDA backend
};

class FakeDevice : public ScoringDevice {
 public:
  explicit FakeDevice(FakeControls* controls) : controls_(controls) {}

  std::string Describe() const override { return "fake"; }

  absl::Status Attach(const BlockPool& pool) override {
    host_ = &pool;
    mirror_.emplace(pool.capacity_blocks(), pool.head_dim());
    return absl::OkStatus();
  }

  absl::Status MirrorBlocks(std::span<const int32_t> block_ids) override {
    if (controls_->fail_mirror_at == controls_->mirror_calls++) {
      return absl::InternalError("fake mirror failure");
    }
    for (int32_t id : block_ids) {
      std::memcpy(mirror_->keys(id), host_->keys(id), host_->block_bytes());
    }
    return absl::OkStatus();
  }

  absl::Status ScoreAndSelect(std::span<const DeviceScoreJob> jobs, int num_heads,
                              DeviceScoreSeconds* seconds) override {
    if (controls_->fail_score_at == controls_->score_calls++) {
      return absl::InternalError("fake scoring failure");
    }
    for (const DeviceScoreJob& job : jobs) {
      if (job.top_k > controls_->max_top_k) return absl::UnimplementedError("K too large");
    }
    for (const DeviceScoreJob& job : jobs) {
      KeyCacheView view = *job.view;
      view.pool = &*mirror_;  // score what was mirrored, not the host pool
      std::vector<float> scores(job.rows.size() * job.logical_blocks.size() * kBlockSize);
      ScoreBlocks(view, job.logical_blocks, job.rows, num_heads, scores);
      const size_t stride = job.logical_blocks.size() * kBlockSize;
      for (size_t r = 0; r < job.rows.size(); ++r) {
        SelectTopK(std::span<const float>(scores.data() + r * stride, stride), job.logical_blocks,
                   job.rows[r].position, job.selections.subspan(r * job.top_k, job.top_k));
      }
      if (!job.scores.empty()) std::copy(scores.begin(), scores.end(), job.scores.begin());
    }
    seconds->scan = 1e-6;
    seconds->topk = 1e-6;
    return absl::OkStatus();
  }

 private:
  FakeControls* controls_;
  const BlockPool* host_ = nullptr;
  std::optional<BlockPool> mirror_;
};

IndexerOptions WorkloadOptions() {
  IndexerOptions options;
  options.capacity_blocks = 1024;
  options.num_heads = 16;
  options.head_dim = 64;
  options.audit_fraction = 1.0;
  return options;
}

WorkloadRecord CpuRecord() {
  auto indexer = Indexer::Create(WorkloadOptions());
  EXPECT_TRUE(indexer.ok());
  return RunWorkload(**indexer);
}

TEST(IndexerDeviceTest, SameRecordAsTheCpuAndEverySelectOnTheDeviceButTheWideOnes) {
  FakeControls controls;
  auto indexer = Indexer::Create(WorkloadOptions(), std::make_unique<FakeDevice>(&controls));
  ASSERT_TRUE(indexer.ok()) << indexer.status();
  EXPECT_EQ((*indexer)->DeviceDescription(), "fake");
  const WorkloadRecord record = RunWorkload(**indexer);
  ExpectSameRecord(CpuRecord(), record);
  // Every select but the two with K = 4,096 ran on the device.
  EXPECT_EQ(record.selects_on_device, static_cast<int>(record.labels.size()) - 2);
  EXPECT_TRUE((*indexer)->DeviceStatus().ok());
  EXPECT_GT(controls.mirror_calls, 0);
}

TEST(IndexerDeviceTest, WithoutAMirroredAppendTheScoresWouldDiffer) {
  // The check the first test relies on: skipping one mirror (here: the fake drops every copy after
  // the prefill) makes the device's record differ from the CPU's.
  class ForgetfulDevice : public FakeDevice {
   public:
    using FakeDevice::FakeDevice;
    absl::Status MirrorBlocks(std::span<const int32_t> block_ids) override {
      if (++calls_ > 2) return absl::OkStatus();  // claims success, copies nothing
      return FakeDevice::MirrorBlocks(block_ids);
    }

   private:
    int calls_ = 0;
  };
  FakeControls controls;
  auto indexer = Indexer::Create(WorkloadOptions(), std::make_unique<ForgetfulDevice>(&controls));
  ASSERT_TRUE(indexer.ok());
  const WorkloadRecord cpu = CpuRecord();
  const WorkloadRecord record = RunWorkload(**indexer);
  ASSERT_EQ(cpu.labels, record.labels);
  EXPECT_NE(cpu.scores, record.scores);
}

TEST(IndexerDeviceTest, AFailedMirrorDropsTheDeviceOnceAndLosesNothing) {
  FakeControls controls;
  controls.fail_mirror_at = 5;
  std::vector<absl::Status> failures;
  auto indexer = Indexer::Create(WorkloadOptions(), std::make_unique<FakeDevice>(&controls),
                                 [&](const absl::Status& s) { failures.push_back(s); });
  ASSERT_TRUE(indexer.ok());
  const WorkloadRecord record = RunWorkload(**indexer);
  ExpectSameRecord(CpuRecord(), record);
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(failures[0].code(), absl::StatusCode::kInternal);
  EXPECT_EQ((*indexer)->DeviceStatus().code(), absl::StatusCode::kInternal);
  EXPECT_NE((*indexer)->DeviceDescription().find("dropped"), std::string::npos);
  EXPECT_EQ(controls.mirror_calls, 6);  // never called again after the failure
  // Calls 0-1 mirror the prefill, 2-4 the first decode keys; call 5 fails. The two warm-up
  // selects and the three decode selects after mirrored appends ran on the device, the rest on
  // the CPU.
  EXPECT_EQ(record.selects_on_device, 5);
}

TEST(IndexerDeviceTest, AFailedScoreIsServedByTheCpuInTheSameCall) {
  FakeControls controls;
  controls.fail_score_at = 3;
  auto indexer = Indexer::Create(WorkloadOptions(), std::make_unique<FakeDevice>(&controls));
  ASSERT_TRUE(indexer.ok());
  const WorkloadRecord record = RunWorkload(**indexer);
  ExpectSameRecord(CpuRecord(), record);
  EXPECT_EQ(controls.score_calls, 4);
  EXPECT_FALSE((*indexer)->DeviceStatus().ok());
}

TEST(IndexerDeviceTest, AnAttachErrorFailsCreate) {
  class NoMemoryDevice : public FakeDevice {
   public:
    using FakeDevice::FakeDevice;
    absl::Status Attach(const BlockPool&) override {
      return absl::ResourceExhaustedError("no device memory");
    }
  };
  FakeControls controls;
  auto indexer = Indexer::Create(WorkloadOptions(), std::make_unique<NoMemoryDevice>(&controls));
  EXPECT_EQ(indexer.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(IndexerDeviceTest, WithoutADeviceTheStatusSaysCpu) {
  auto indexer = Indexer::Create(WorkloadOptions());
  ASSERT_TRUE(indexer.ok());
  EXPECT_EQ((*indexer)->DeviceDescription(), "cpu");
  EXPECT_EQ((*indexer)->DeviceStatus().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace dsa
