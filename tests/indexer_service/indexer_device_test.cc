// Tests of the Indexer with a scoring device (indexer_service/scoring_device.h), without a GPU: a
// fake device scores from its own mirror of the pool (so a block the Indexer forgets to mirror
// shows up as wrong scores) with the CPU reference, and can be told to fail or decline. The same
// workload must give the same record as the CPU alone; a failing device is dropped (once, with the
// callback) and the CPU serves the same call and the rest, losing nothing.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "indexer_service/indexer.h"
#include "indexer_service/layer_select.h"
#include "indexer_service/scoring_device.h"
#include "indexer_service/topk.h"
#include "tests/indexer_service/device_workload.h"
#include "tests/indexer_service/fake_scoring_device.h"
#include "transport/in_process_transport.h"

namespace dsa {
namespace {

using testing_fakes::FakeControls;
using testing_fakes::FakeDevice;
using testing_workload::ExpectSameRecord;
using testing_workload::RunWorkload;
using testing_workload::WorkloadRecord;

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
  // Every select but the three with K = kMaxTopK (above the fake's largest) and the mixed batch's
  // other group (the device declines a batch with any K above its largest) ran on the device.
  EXPECT_EQ(record.selects_on_device, static_cast<int>(record.labels.size()) - 4);
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

TEST(IndexerDeviceTest, SpinOnTheDeviceGivesTheCpuRecordBitForBit) {
  // The Indexer hands SPIN over (warm-up flags, verifier steps and their Commit, new turns,
  // release, GetSpinState) and the fake runs it with its own SpinStates: any state the Indexer
  // forgot to hand over would change the record.
  FakeControls controls;
  controls.runs_spin = true;
  auto indexer = Indexer::Create(WorkloadOptions(), std::make_unique<FakeDevice>(&controls));
  ASSERT_TRUE(indexer.ok());
  const WorkloadRecord record = RunWorkload(**indexer);
  ExpectSameRecord(CpuRecord(), record);
  // All but the three with K = 4,096 (the mixed batch's SPIN group ran on the device).
  EXPECT_EQ(record.selects_on_device, static_cast<int>(record.labels.size()) - 3);
  EXPECT_GT(controls.spin_calls, 40);
}

TEST(IndexerDeviceTest, SpinOnTheDeviceWithKOf2048) {
  FakeControls controls;
  controls.runs_spin = true;
  controls.max_top_k = kMaxTopK;
  auto indexer = Indexer::Create(WorkloadOptions(), std::make_unique<FakeDevice>(&controls));
  ASSERT_TRUE(indexer.ok());
  auto cpu = Indexer::Create(WorkloadOptions());
  ASSERT_TRUE(cpu.ok());
  ExpectSameRecord(RunWorkload(**cpu, 2048), RunWorkload(**indexer, 2048));
}

TEST(IndexerDeviceTest, AFailedSpinSelectRestartsTheEmasOnTheCpu) {
  FakeControls controls;
  controls.runs_spin = true;
  controls.fail_spin_at = 6;
  std::vector<absl::Status> failures;
  auto indexer = Indexer::Create(WorkloadOptions(), std::make_unique<FakeDevice>(&controls),
                                 [&](const absl::Status& s) { failures.push_back(s); });
  ASSERT_TRUE(indexer.ok());
  const WorkloadRecord record = RunWorkload(**indexer);  // every call still succeeds
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_EQ(controls.spin_calls, 7);
  // Calls 0-1 were the warm-ups, 2-5 two decode steps; call 6 failed and its select (decode step
  // 2, layer 0) was served on the CPU as a new warm-up: every visible block, so no audit. Layer 1
  // restarted too (its EMAs were on the device); from decode step 3 SPIN prunes again, on the CPU.
  ASSERT_GT(record.labels.size(), 9u);
  EXPECT_EQ(record.labels[6], "decode 2 layer 0");
  EXPECT_TRUE(record.miss_rates[6].empty());
  EXPECT_TRUE(record.miss_rates[7].empty());
  EXPECT_FALSE(record.miss_rates[8].empty());
  EXPECT_FALSE(record.miss_rates[9].empty());
  EXPECT_EQ(record.selects_on_device, 6);
}

TEST(IndexerDeviceTest, AnAttachErrorFailsCreate) {
  class NoMemoryDevice : public FakeDevice {
   public:
    using FakeDevice::FakeDevice;
    absl::Status Attach(const BlockPool&, int) override {
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

// ---- The device-resident path (the co-located attention worker's; scoring_device.h
// DeviceHandoff): the fake's "device memory" is host memory. ----

constexpr int kHeads = 16;
constexpr int kDim = 64;
constexpr int kTopK = 64;
constexpr int kLayers = 2;
constexpr int64_t kPrefill = 1000;

std::vector<float> RandomValues(uint64_t seed, size_t n) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

IndexerOptions DeviceResidentOptions() {
  IndexerOptions options;
  options.capacity_blocks = 256;
  options.num_heads = kHeads;
  options.head_dim = kDim;
  return options;
}

// An indexer on the fake device with sequence 7 (2 layers, K 64, SPIN rho 0.5) prefilled.
std::unique_ptr<Indexer> DeviceResidentIndexer(FakeControls* controls,
                                               IndexerOptions options = DeviceResidentOptions()) {
  auto indexer = Indexer::Create(options, std::make_unique<FakeDevice>(controls));
  EXPECT_TRUE(indexer.ok()) << indexer.status();
  SequenceOptions sequence;
  sequence.num_layers = kLayers;
  sequence.top_k = kTopK;
  sequence.spin.target_block_sparsity = 0.5;
  EXPECT_TRUE((*indexer)->CreateSequence(7, sequence).ok());
  for (int layer = 0; layer < kLayers; ++layer) {
    EXPECT_TRUE(
        (*indexer)->AppendIndexKeys(7, layer, RandomValues(layer, kPrefill * kDim), kPrefill).ok());
  }
  return *std::move(indexer);
}

// Decode step `step`'s request for `layer` (position kPrefill + step, one new key), host form.
LayerSelectRequest DecodeRequest(int step, int layer) {
  LayerSelectRequest request;
  request.num_heads = kHeads;
  request.head_dim = kDim;
  SelectRowGroup group;
  group.sequence_id = 7;
  group.layer = layer;
  group.first_position = kPrefill + step;
  group.num_rows = 1;
  group.queries = RandomValues(1000 + 10 * step + layer, kHeads * kDim);
  group.head_weights = RandomValues(2000 + 10 * step + layer, kHeads);
  group.new_index_keys = RandomValues(3000 + 10 * step + layer, kDim);
  request.groups.push_back(std::move(group));
  return request;
}

// The same request in device form: its queries moved to `device_queries`, selections to
// `device_selections` (sized here).
LayerSelectRequest DeviceForm(LayerSelectRequest request, std::vector<float>* device_queries,
                              std::vector<int32_t>* device_selections) {
  *device_queries = std::move(request.groups[0].queries);
  request.groups[0].queries.clear();
  device_selections->assign(kTopK, -7);
  request.device.queries = device_queries->data();
  request.device.selections = device_selections->data();
  request.device.top_k = kTopK;
  return request;
}

TEST(DeviceResidentSelectTest, TheDeviceFormGivesTheHostFormsSelectionsOnTheDeviceAndTheHost) {
  FakeControls host_controls, device_controls;
  host_controls.runs_spin = device_controls.runs_spin = true;
  device_controls.ordinal = 0;
  std::unique_ptr<Indexer> host = DeviceResidentIndexer(&host_controls);
  std::unique_ptr<Indexer> device = DeviceResidentIndexer(&device_controls);
  InProcessSelectionTransport transport(device.get());
  EXPECT_EQ(transport.device_ordinal(), 0);
  int pruned = 0;
  for (int step = 0; step < 6; ++step) {
    for (int layer = 0; layer < kLayers; ++layer) {
      auto expected = RunLayerSelect(*host, DecodeRequest(step, layer));
      ASSERT_TRUE(expected.ok()) << expected.status();
      std::vector<float> queries;
      std::vector<int32_t> selections;
      auto id = transport.Submit(DeviceForm(DecodeRequest(step, layer), &queries, &selections));
      ASSERT_TRUE(id.ok());
      ASSERT_TRUE(transport.AwaitEnqueued(*id, absl::InfiniteFuture()).ok());
      EXPECT_EQ(selections, expected->groups[0].selections) << "step " << step << " " << layer;
      auto answer = transport.Await(*id, absl::InfiniteFuture());
      ASSERT_TRUE(answer.ok()) << answer.status();
      EXPECT_EQ(answer->groups[0].selections, expected->groups[0].selections);
      EXPECT_EQ(answer->groups[0].blocks_scored, expected->groups[0].blocks_scored);
      if (!answer->groups[0].all_blocks) ++pruned;
    }
  }
  EXPECT_GT(pruned, 0);  // SPIN pruned: the EMAs the device kept match the host's
  EXPECT_EQ(device_controls.enqueued_calls, 6 * kLayers);
  for (int layer = 0; layer < kLayers; ++layer) {
    EXPECT_EQ(*device->NumSlots(7, layer), kPrefill + 6);
    EXPECT_EQ(device->GetSpinState(7, layer)->vertical(), host->GetSpinState(7, layer)->vertical());
  }
}

// The refusal of a device-form request: UNIMPLEMENTED from AwaitEnqueued and Await, with the
// request's new key removed again (the caller sends the layer again with host queries).
void ExpectRefusedAndNothingChanged(Indexer& indexer, const std::string& why) {
  InProcessSelectionTransport transport(&indexer);
  std::vector<float> queries;
  std::vector<int32_t> selections;
  auto id = transport.Submit(DeviceForm(DecodeRequest(0, 0), &queries, &selections));
  ASSERT_TRUE(id.ok());
  const absl::Status enqueued = transport.AwaitEnqueued(*id, absl::InfiniteFuture());
  EXPECT_EQ(enqueued.code(), absl::StatusCode::kUnimplemented) << enqueued;
  EXPECT_NE(enqueued.message().find(why), std::string::npos) << enqueued;
  EXPECT_EQ(transport.Await(*id, absl::InfiniteFuture()).status().code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(*indexer.NumSlots(7, 0), kPrefill);
  // The same layer with host queries then runs.
  EXPECT_TRUE(RunLayerSelect(indexer, DecodeRequest(0, 0)).ok());
}

TEST(DeviceResidentSelectTest, AnIndexerThatCannotTakeTheDeviceFormRefusesItChangingNothing) {
  {
    FakeControls controls;  // host queries only (device_ordinal -1)
    controls.runs_spin = true;
    std::unique_ptr<Indexer> indexer = DeviceResidentIndexer(&controls);
    EXPECT_EQ(InProcessSelectionTransport(indexer.get()).device_ordinal(), -1);
    ExpectRefusedAndNothingChanged(*indexer, "takes device queries");
  }
  {
    FakeControls controls;  // SPIN planned on the CPU
    controls.ordinal = 0;
    std::unique_ptr<Indexer> indexer = DeviceResidentIndexer(&controls);
    ExpectRefusedAndNothingChanged(*indexer, "SPIN settings do not run on the scoring device");
  }
  {
    FakeControls controls;  // auditing reads host queries
    controls.runs_spin = true;
    controls.ordinal = 0;
    IndexerOptions options = DeviceResidentOptions();
    options.audit_fraction = 0.5;
    std::unique_ptr<Indexer> indexer = DeviceResidentIndexer(&controls, options);
    ExpectRefusedAndNothingChanged(*indexer, "not audited");
  }
}

TEST(DeviceResidentSelectTest, MalformedDeviceFormsAreInvalidArguments) {
  FakeControls controls;
  controls.runs_spin = true;
  controls.ordinal = 0;
  std::unique_ptr<Indexer> indexer = DeviceResidentIndexer(&controls);
  std::vector<float> queries;
  std::vector<int32_t> selections;
  LayerSelectRequest wrong_k = DeviceForm(DecodeRequest(0, 0), &queries, &selections);
  wrong_k.device.top_k = kTopK / 2;
  auto refused = RunLayerSelect(*indexer, wrong_k);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("K = 64"), std::string::npos) << refused.status();
  LayerSelectRequest host_queries_too = DeviceForm(DecodeRequest(0, 0), &queries, &selections);
  host_queries_too.groups[0].queries = queries;
  EXPECT_EQ(RunLayerSelect(*indexer, host_queries_too).status().code(),
            absl::StatusCode::kInvalidArgument);
  LayerSelectRequest no_selections = DeviceForm(DecodeRequest(0, 0), &queries, &selections);
  no_selections.device.selections = nullptr;
  EXPECT_EQ(RunLayerSelect(*indexer, no_selections).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A device row without a handoff.
  IndexerRow row;
  row.device_query = queries.data();
  const std::vector<float> weights(kHeads, 1.0f);
  row.head_weights = weights;
  row.position = kPrefill - 1;
  const SelectGroup group{7, 0, std::span<const IndexerRow>(&row, 1)};
  EXPECT_EQ(indexer->SelectBatch(std::span<const SelectGroup>(&group, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (int layer = 0; layer < kLayers; ++layer) EXPECT_EQ(*indexer->NumSlots(7, layer), kPrefill);
}

// A device failure before the selections were handed over is a refusal (UNIMPLEMENTED: send
// host queries), after it the select's INTERNAL error; either way nothing is applied, the device
// is dropped, and host queries then run on the CPU.
TEST(DeviceResidentSelectTest, ADeviceFailureDropsTheDevicePathAndAppliesNothing) {
  for (const bool after_hand_over : {false, true}) {
    SCOPED_TRACE(after_hand_over ? "after the hand-over" : "before the hand-over");
    FakeControls controls;
    controls.runs_spin = true;
    controls.ordinal = 0;
    controls.fail_spin_at = 0;
    controls.fail_after_enqueue = after_hand_over;
    std::unique_ptr<Indexer> indexer = DeviceResidentIndexer(&controls);
    InProcessSelectionTransport transport(indexer.get());
    std::vector<float> queries;
    std::vector<int32_t> selections;
    auto id = transport.Submit(DeviceForm(DecodeRequest(0, 0), &queries, &selections));
    ASSERT_TRUE(id.ok());
    const absl::Status enqueued = transport.AwaitEnqueued(*id, absl::InfiniteFuture());
    EXPECT_EQ(enqueued.ok(), after_hand_over) << enqueued;  // after: the event was recorded
    const auto answer = transport.Await(*id, absl::InfiniteFuture());
    EXPECT_EQ(answer.status().code(),
              after_hand_over ? absl::StatusCode::kInternal : absl::StatusCode::kUnimplemented)
        << answer.status();
    EXPECT_EQ(*indexer->NumSlots(7, 0), kPrefill);  // the new key removed again
    EXPECT_EQ(transport.device_ordinal(), -1);      // dropped: host queries from now on
    EXPECT_TRUE(RunLayerSelect(*indexer, DecodeRequest(0, 0)).ok());
  }
}

}  // namespace
}  // namespace dsa
