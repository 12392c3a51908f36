// Tests of the attention engine (attention_worker/engine.h) against fakes: a scripted indexer
// client that logs every submit and await, and answers (or fails) as told, and a fake backend that
// logs every attend. They pin the MLI schedule (submit when the inputs exist, await at the first
// layer that attends, DESIGN.md 4.3), the failure rules (rollback, broken sequences, dropped
// clients) and the cleanup of a failed prefill. Then the same decode steps through the real
// engine over the in-process indexer client and over the gRPC one give bit-identical selections
// and outputs.
#include "attention_worker/engine.h"

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "attention_worker/cpu_attention_backend.h"
#include "common/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "indexer_service/grpc_service.h"
#include "indexer_service/indexer.h"
#include "tests/indexer_service/fake_scoring_device.h"
#include "transport/grpc_indexer_client.h"
#include "transport/in_process_indexer_client.h"

namespace dsa {
namespace {

constexpr int kH = 8, kD = 32, kK = 64;

// What happened, in order, across the fake client and backend.
struct Log {
  std::mutex mutex;
  std::vector<std::string> events;
  void Add(std::string event) {
    std::lock_guard<std::mutex> lock(mutex);
    events.push_back(std::move(event));
  }
};

// A scripted data plane: answers layer f's request with selection entries = slot (f * 7 + r)
// % (position + 1) for row r, or with the status scripted for that full layer.
class FakeTransport final : public SelectionTransport {
 public:
  explicit FakeTransport(Log* log) : log_(log) {}
  absl::StatusOr<uint64_t> Submit(LayerSelectRequest request) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const int layer = request.groups.at(0).layer;
    if (submit_failure.ok() == false) return submit_failure;
    log_->Add(absl::StrCat("submit ", layer));
    const uint64_t id = next_id_++;
    requests_[id] = std::move(request);
    return id;
  }
  absl::StatusOr<LayerSelection> Await(uint64_t id, absl::Time deadline) override {
    std::lock_guard<std::mutex> lock(mutex_);
    deadlines.push_back(deadline);
    if (clock != nullptr) clock->Advance(await_takes);
    auto it = requests_.find(id);
    if (it == requests_.end()) return absl::NotFoundError("unknown id");
    const LayerSelectRequest request = std::move(it->second);
    requests_.erase(it);
    const int layer = request.groups.at(0).layer;
    log_->Add(absl::StrCat("await ", layer));
    auto failure = answer_failures.find(layer);
    if (failure != answer_failures.end()) return failure->second;
    LayerSelection answer;
    for (const SelectRowGroup& group : request.groups) {
      GroupSelection& out = answer.groups.emplace_back();
      out.num_rows = group.num_rows;
      out.top_k = kK;
      out.selections.assign(static_cast<size_t>(group.num_rows) * kK, -1);
      for (int r = 0; r < group.num_rows; ++r) {
        const int64_t position = group.first_position + r;
        out.selections[static_cast<size_t>(r) * kK] =
            static_cast<int32_t>((layer * 7 + r) % (position + 1));
      }
      out.blocks_scored = 1 + layer;
      out.blocks_visible = 10;
    }
    return answer;
  }
  void Forget(uint64_t id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    log_->Add(absl::StrCat("forget ", id));
    requests_.erase(id);
  }
  absl::Status Close() override { return absl::OkStatus(); }

  absl::Status submit_failure;                  // non-OK: every Submit fails with it
  std::map<int, absl::Status> answer_failures;  // full layer -> its Await's status
  FakeClock* clock = nullptr;                   // when set, each Await advances it by await_takes
  absl::Duration await_takes;
  std::vector<absl::Time> deadlines;  // each Await's, in order

 private:
  Log* log_;
  std::mutex mutex_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, LayerSelectRequest> requests_;
};

// Counts what the engine does on the control plane; index keys go nowhere.
class FakeIndexKeyAppend final : public IndexKeyAppend {
 public:
  explicit FakeIndexKeyAppend(absl::Status finish) : finish_(std::move(finish)) {}
  bool Write(int, int64_t, std::span<const float>, int64_t num_keys) override {
    keys_ += num_keys;
    return true;
  }
  absl::StatusOr<int64_t> Finish() override {
    if (!finish_.ok()) return finish_;
    return keys_;
  }
  void Cancel() override {}

 private:
  absl::Status finish_;
  int64_t keys_ = 0;
};

class FakeIndexerClient final : public IndexerClient {
 public:
  FakeIndexerClient(std::string address, Log* log) : address_(std::move(address)), transport(log) {}
  const std::string& address() const override { return address_; }
  absl::StatusOr<IndexerShape> GetShape(absl::Time) override {
    if (!shape_failure.ok()) return shape_failure;
    return shape;
  }
  absl::Status CreateSequence(const IndexerSequenceSpec& spec, absl::Time) override {
    std::lock_guard<std::mutex> lock(mutex);
    created.push_back(spec.sequence_id);
    return absl::OkStatus();
  }
  std::unique_ptr<IndexKeyAppend> BeginAppend(uint64_t, absl::Time) override {
    return std::make_unique<FakeIndexKeyAppend>(append_status);
  }
  absl::Status BeginTurn(uint64_t, absl::Time) override {
    ++begin_turns;
    return absl::OkStatus();
  }
  absl::Status Commit(uint64_t, int, absl::Time) override { return absl::OkStatus(); }
  absl::Status Release(uint64_t id, absl::Time) override {
    std::lock_guard<std::mutex> lock(mutex);
    released.push_back(id);
    return absl::OkStatus();
  }
  SelectionTransport& Selections() override { return transport; }
  absl::Status Close() override { return absl::OkStatus(); }

  std::string address_;
  FakeTransport transport;
  IndexerShape shape{kH, kD};
  absl::Status shape_failure;  // not OK: GetShape answers it (a connection that cannot be made)
  absl::Status append_status;
  std::mutex mutex;
  std::vector<uint64_t> created, released;
  int begin_turns = 0;
};

// Logs every attend and keeps slot counts; outputs one value per row: its first selected slot.
class FakeBackend final : public AttentionBackend {
 public:
  explicit FakeBackend(Log* log, std::map<uint64_t, int64_t>* slots) : log_(log), slots_(slots) {}
  std::string Description() const override { return "fake"; }
  int64_t output_values_per_row() const override { return 1; }
  absl::Status ResizeSequence(uint64_t id, int64_t num_slots) override {
    if (!resize_failure.ok() && num_slots > (*slots_)[id] &&
        (fail_ids.empty() || fail_ids.contains(id))) {
      return resize_failure;
    }
    if (num_slots == 0) {
      slots_->erase(id);
    } else {
      (*slots_)[id] = num_slots;
    }
    return absl::OkStatus();
  }
  absl::Status AttendLayer(int layer, std::span<const AttentionRowRef> rows,
                           std::span<float> outputs) override {
    log_->Add(absl::StrCat("attend ", layer));
    for (size_t r = 0; r < rows.size(); ++r) {
      if (!outputs.empty()) outputs[r] = static_cast<float>(rows[r].selection[0]);
    }
    return absl::OkStatus();
  }
  absl::Status resize_failure;  // non-OK: a grow fails with it (of fail_ids only, when not empty)
  std::set<uint64_t> fail_ids;

 private:
  Log* log_;
  std::map<uint64_t, int64_t>* slots_;
};

PatternModel MakeModel(int num_full_layers) {
  PatternModelConfig config;
  config.num_layers = num_full_layers;
  config.num_heads = kH;
  config.head_dim = kD;
  config.seed = 3;
  config.num_diagonals = 2;
  auto model = PatternModel::Create(config);
  EXPECT_TRUE(model.ok()) << model.status();
  return *model;
}

class EngineTest : public ::testing::Test {
 protected:
  void Start(const std::string& pattern, int lag) {
    auto schedule = MliSchedule::FromPattern(pattern, lag);
    ASSERT_TRUE(schedule.ok()) << schedule.status();
    auto backend = std::make_unique<FakeBackend>(&log_, &backend_slots_);
    backend_ = backend.get();
    AttentionEngineOptions options;
    options.kv_capacity_slots = 10000;
    options.clock = &clock_;
    options.observer = [this](const AttendedRow& row) {
      std::lock_guard<std::mutex> lock(observed_mutex_);
      observed_.push_back(row.model_layer * 1000 + row.attended_full_layer * 10 +
                          static_cast<int>(row.output[0]));
    };
    auto engine = AttentionEngine::Create(
        *schedule, MakeModel(static_cast<int>(schedule->full_layers().size())), std::move(backend),
        [this](const std::string& address) -> absl::StatusOr<std::shared_ptr<IndexerClient>> {
          ++factory_calls_;
          auto client = std::make_shared<FakeIndexerClient>(address, &log_);
          clients_.push_back(client);
          return std::shared_ptr<IndexerClient>(client);
        },
        options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }

  void MustPrefill(uint64_t id, int64_t context, const std::string& address = "indexer-a") {
    PrefillSpec spec;
    spec.sequence_id = id;
    spec.context_length = context;
    spec.indexer_worker = address;
    spec.top_k = kK;
    auto result = engine_->Prefill(spec);
    ASSERT_TRUE(result.ok()) << result.status();
  }

  std::vector<std::string> TakeLog() {
    std::lock_guard<std::mutex> lock(log_.mutex);
    std::vector<std::string> events;
    events.swap(log_.events);
    return events;
  }

  FakeClock clock_;  // the engine's; moves only when a test or a fake moves it
  Log log_;
  std::map<uint64_t, int64_t> backend_slots_;
  FakeBackend* backend_ = nullptr;
  std::vector<std::shared_ptr<FakeIndexerClient>> clients_;
  int factory_calls_ = 0;
  std::mutex observed_mutex_;
  std::vector<int> observed_;
  std::unique_ptr<AttentionEngine> engine_;
};

TEST_F(EngineTest, EachFullLayerIsSubmittedWhenItRunsAndAwaitedAtTheFirstLayerThatAttendsIt) {
  // FSFSFS, k = 1: full layers 0, 2, 4 (ranks 0, 1, 2); sigma = 0 0 0 0 2 2; rank 2 is attended by
  // no layer and collected at the end.
  Start("FSFSFS", 1);
  MustPrefill(1, 100);
  TakeLog();
  const StepMember member{1, 1};
  auto step = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(TakeLog(), (std::vector<std::string>{"submit 0", "await 0", "attend 0", "attend 1",
                                                 "submit 1", "attend 2", "attend 3", "submit 2",
                                                 "await 1", "attend 4", "attend 5", "await 2"}));
  // Each layer attended sigma(l)'s selection: the fake puts slot (rank * 7) % 101 first.
  EXPECT_EQ(observed_,
            (std::vector<int>{0 + 0, 1000 + 0, 2000 + 0, 3000 + 0, 4000 + 20 + 7, 5000 + 20 + 7}));
  ASSERT_EQ(step->sequences.size(), 1u);
  EXPECT_EQ(step->sequences[0].first_position, 100);
  EXPECT_EQ(step->sequences[0].blocks_scored, 1 + 2 + 3);
  EXPECT_EQ(step->sequences[0].blocks_visible, 30);
  EXPECT_EQ(step->selection_wait_seconds.size(), 6u);
  EXPECT_EQ(backend_slots_[1], 101);
}

TEST_F(EngineTest, LagDepthTwoDefersTheWaitByTwoFullLayers) {
  // FFFF, k = 2: sigma = 0 1 0 1: layer 2 attends rank 0, layer 3 rank 1.
  Start("FFFF", 2);
  MustPrefill(1, 50);
  TakeLog();
  const StepMember member{1, 1};
  ASSERT_TRUE(engine_->DecodeStep(std::span<const StepMember>(&member, 1)).ok());
  EXPECT_EQ(TakeLog(), (std::vector<std::string>{"submit 0", "await 0", "attend 0", "submit 1",
                                                 "await 1", "attend 1", "submit 2", "attend 2",
                                                 "submit 3", "attend 3", "await 2", "await 3"}));
}

TEST_F(EngineTest, ARefusalAfterAnAppliedLayerBreaksOnlyTheSequencesTheIndexerAdvanced) {
  Start("FSFS", 1);
  MustPrefill(1, 100, "indexer-a");
  MustPrefill(2, 100, "indexer-b");
  // indexer-b refuses full layer 1 having applied nothing of it; its layer 0 had been applied.
  ASSERT_EQ(clients_.size(), 2u);
  absl::Status refused = absl::InvalidArgumentError("no");
  refused.SetPayload(kGroupsAppliedPayload, absl::Cord("0"));
  clients_[1]->transport.answer_failures[1] = refused;
  const StepMember members[] = {{1, 1}, {2, 1}};
  auto step = engine_->DecodeStep(members);
  ASSERT_FALSE(step.ok());
  EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(step.status().message().find("indexer worker indexer-b, full layer 1"),
            std::string::npos)
      << step.status();
  EXPECT_NE(step.status().message().find("sequences 1, 2 may have advanced"), std::string::npos)
      << step.status();
  // KV rolled back for both; both are broken (layer 0 applied on each indexer).
  EXPECT_EQ(backend_slots_[1], 100);
  EXPECT_EQ(backend_slots_[2], 100);
  EXPECT_EQ(engine_->GetInfo().kv_used_slots, 200);
  const StepMember one{1, 1};
  EXPECT_EQ(engine_->DecodeStep(std::span<const StepMember>(&one, 1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(engine_->Release(1, false).ok());
  EXPECT_TRUE(engine_->Release(2, false).ok());
  EXPECT_EQ(engine_->GetInfo().kv_used_slots, 0);
}

TEST_F(EngineTest, ARefusalOfTheFirstLayerLeavesTheSequenceExactlyAsBefore) {
  Start("FSFS", 1);
  MustPrefill(1, 100);
  absl::Status refused = absl::NotFoundError("gone");
  refused.SetPayload(kGroupsAppliedPayload, absl::Cord("0"));
  clients_[0]->transport.answer_failures[0] = refused;
  const StepMember member{1, 1};
  auto step = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
  EXPECT_EQ(step.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(step.status().message().find("broken"), std::string::npos) << step.status();
  clients_[0]->transport.answer_failures.clear();
  auto again = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->sequences[0].first_position, 100);
}

TEST_F(EngineTest, AnUnavailableIndexerIsDroppedAndMadeAgainOnTheNextCall) {
  Start("FS", 1);
  MustPrefill(1, 10);
  EXPECT_EQ(factory_calls_, 1);
  clients_[0]->transport.submit_failure = absl::UnavailableError("peer gone");
  const StepMember member{1, 1};
  auto step = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
  EXPECT_EQ(step.status().code(), absl::StatusCode::kUnavailable);
  // Nothing reached the indexer: the sequence is intact, and the next step dials again.
  auto again = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(factory_calls_, 2);
}

TEST_F(EngineTest, APrefillWhoseIndexerClientCannotConnectRemakesItOnceAndSucceeds) {
  Start("FS", 1);
  MustPrefill(9, 10);
  // The indexer restarted: the old client's connection still fails while a new one would dial.
  clients_[0]->shape_failure = absl::UnavailableError("failed to connect to all addresses");
  MustPrefill(1, 10);
  EXPECT_EQ(factory_calls_, 2);
  ASSERT_EQ(clients_.size(), 2u);
  EXPECT_TRUE(clients_[0]->created == std::vector<uint64_t>{9});
  EXPECT_TRUE(clients_[1]->created == std::vector<uint64_t>{1});
  // A refusal is no connection failure: the client is kept.
  clients_[1]->shape = IndexerShape{kH, kD * 2};
  PrefillSpec spec;
  spec.sequence_id = 2;
  spec.context_length = 10;
  spec.indexer_worker = "indexer-a";
  spec.top_k = kK;
  EXPECT_EQ(engine_->Prefill(spec).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(factory_calls_, 2);
}

TEST_F(EngineTest, ADeadlineForgetsTheRequestAndBreaksTheSequence) {
  Start("FS", 1);
  MustPrefill(1, 10);
  clients_[0]->transport.answer_failures[0] = absl::DeadlineExceededError("slow");
  const StepMember member{1, 1};
  auto step = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
  EXPECT_EQ(step.status().code(), absl::StatusCode::kDeadlineExceeded);
  const std::vector<std::string> log = TakeLog();
  EXPECT_NE(std::find(log.begin(), log.end(), "forget 1"), log.end());
  // The outcome on the indexer is unknown: the sequence is broken.
  EXPECT_NE(step.status().message().find("sequences 1 may have advanced"), std::string::npos);
}

// The engine's time is its clock's: a select's deadline is the clock's reading plus
// select_timeout, and a layer's selection wait is what the clock moved while it waited (here only
// the fake's awaits move it, 7 ms each).
TEST_F(EngineTest, DeadlinesAndSelectionWaitsAreReadOnTheEnginesClock) {
  // FSFS, k = 1: every layer attends rank 0 (awaited at layer 0); rank 1 is collected at the end.
  Start("FSFS", 1);
  MustPrefill(1, 100);
  FakeTransport& transport = clients_[0]->transport;
  transport.clock = &clock_;
  transport.await_takes = absl::Milliseconds(7);
  const absl::Time start = clock_.Now();
  const StepMember member{1, 1};
  auto step = engine_->DecodeStep(std::span<const StepMember>(&member, 1));
  ASSERT_TRUE(step.ok()) << step.status();
  const absl::Duration timeout = AttentionEngineOptions().select_timeout;
  EXPECT_EQ(transport.deadlines,
            (std::vector<absl::Time>{start + timeout, start + absl::Milliseconds(7) + timeout}));
  ASSERT_EQ(step->selection_wait_seconds.size(), 4u);
  EXPECT_DOUBLE_EQ(step->selection_wait_seconds[0], 0.007);
  for (int l = 1; l < 4; ++l) EXPECT_EQ(step->selection_wait_seconds[l], 0) << l;
  EXPECT_EQ(clock_.Now(), start + absl::Milliseconds(14));
}

TEST_F(EngineTest, ABackendOutOfMemoryFailsTheStepWithNothingChanged) {
  Start("FS", 1);
  MustPrefill(1, 10);
  MustPrefill(2, 10);
  // Sequence 1 grows first; sequence 2's grow fails: 1 must be shrunk back.
  backend_->resize_failure = absl::ResourceExhaustedError("device memory");
  backend_->fail_ids = {2};
  const StepMember members[] = {{1, 1}, {2, 2}};
  auto step = engine_->DecodeStep(members);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kResourceExhausted);
  for (const std::string& event : TakeLog()) {
    EXPECT_EQ(event.find("submit"), std::string::npos) << "nothing may reach the indexer";
  }
  EXPECT_EQ(backend_slots_[1], 10);
  EXPECT_EQ(backend_slots_[2], 10);
  EXPECT_EQ(engine_->GetInfo().kv_used_slots, 20);
  backend_->resize_failure = absl::OkStatus();
  ASSERT_TRUE(engine_->DecodeStep(members).ok());
}

TEST_F(EngineTest, ABackendOutOfMemoryAtAContinueLeavesTheIndexerUntouched) {
  Start("FS", 1);
  MustPrefill(1, 100);
  backend_->resize_failure = absl::ResourceExhaustedError("device memory");
  PrefillSpec spec;
  spec.sequence_id = 1;
  spec.context_length = 500;
  spec.continue_sequence = true;
  EXPECT_EQ(engine_->Prefill(spec).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(clients_[0]->begin_turns, 0);  // the indexer never heard of the continue
  EXPECT_EQ(backend_slots_[1], 100);
  EXPECT_EQ(engine_->GetInfo().kv_used_slots, 100);
  backend_->resize_failure = absl::OkStatus();
  ASSERT_TRUE(engine_->Prefill(spec).ok());
  EXPECT_EQ(clients_[0]->begin_turns, 1);
  EXPECT_EQ(backend_slots_[1], 500);
}

// A backend that holds slots in blocks of 64: the engine counts whole blocks, so the capacity is
// never passed by rounding.
class BlockBackend final : public AttentionBackend {
 public:
  std::string Description() const override { return "blocks"; }
  int64_t output_values_per_row() const override { return 1; }
  int64_t slot_granularity() const override { return 64; }
  absl::Status ResizeSequence(uint64_t, int64_t) override { return absl::OkStatus(); }
  absl::Status AttendLayer(int, std::span<const AttentionRowRef>, std::span<float>) override {
    return absl::OkStatus();
  }
};

TEST(EngineAccountingTest, KvIsCountedInTheBackendsSlotGranularity) {
  auto schedule = MliSchedule::FromPattern("F", 1);
  ASSERT_TRUE(schedule.ok());
  Log log;
  AttentionEngineOptions options;
  options.kv_capacity_slots = 256;  // 4 blocks
  auto engine = AttentionEngine::Create(
      *schedule, MakeModel(1), std::make_unique<BlockBackend>(),
      [&log](const std::string& address) -> absl::StatusOr<std::shared_ptr<IndexerClient>> {
        return std::shared_ptr<IndexerClient>(std::make_shared<FakeIndexerClient>(address, &log));
      },
      options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  PrefillSpec spec;
  spec.context_length = 65;  // 2 blocks
  spec.indexer_worker = "indexer-a";
  spec.top_k = kK;
  for (uint64_t id : {1, 2}) {
    spec.sequence_id = id;
    ASSERT_TRUE((*engine)->Prefill(spec).ok()) << id;
  }
  EXPECT_EQ((*engine)->GetInfo().kv_used_slots, 256);
  spec.sequence_id = 3;
  spec.context_length = 1;  // one more block: over the 4
  EXPECT_EQ((*engine)->Prefill(spec).status().code(), absl::StatusCode::kResourceExhausted);
  // A step within the blocks held costs nothing more; one that crosses a block is refused.
  const StepMember member{1, 1};
  EXPECT_EQ((*engine)->DecodeStep(std::span<const StepMember>(&member, 1)).status().code(),
            absl::StatusCode::kOk);  // 65 -> 66 slots, still 2 blocks
  EXPECT_TRUE((*engine)->Release(2, false).ok());
  EXPECT_EQ((*engine)->GetInfo().kv_used_slots, 128);
}

TEST_F(EngineTest, AFailedAppendReleasesTheIndexerSequenceAndLeavesNothing) {
  Start("FS", 1);
  MustPrefill(9, 10);  // makes the client
  clients_[0]->append_status = absl::ResourceExhaustedError("index-key cache full");
  PrefillSpec spec;
  spec.sequence_id = 1;
  spec.context_length = 5000;
  spec.indexer_worker = "indexer-a";
  spec.top_k = kK;
  EXPECT_EQ(engine_->Prefill(spec).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(clients_[0]->released, (std::vector<uint64_t>{1}));
  EXPECT_EQ(engine_->GetInfo().sequences, 1);
  EXPECT_EQ(engine_->GetInfo().kv_used_slots, 10);
  EXPECT_FALSE(backend_slots_.contains(1));
}

TEST_F(EngineTest, AnIndexerOfAnotherShapeIsRefusedAtPrefill) {
  Start("FS", 1);
  MustPrefill(9, 10);
  clients_[0]->shape = IndexerShape{kH, kD * 2};
  PrefillSpec spec;
  spec.sequence_id = 1;
  spec.context_length = 10;
  spec.indexer_worker = "indexer-a";
  spec.top_k = kK;
  const absl::Status status = engine_->Prefill(spec).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("D = 64"), std::string::npos) << status;
}

// The real engine and CPU backend over the in-process indexer client and over the gRPC one:
// the same prefill and steps (plain, speculative, committed) give bit-identical observations.
struct Observation {
  uint64_t sequence_id;
  int layer;
  int64_t position;
  std::vector<int32_t> selection;
  std::vector<float> output;
  bool operator==(const Observation&) const = default;
};

// The CPU backend with the device-resident path, its "device memory" host memory: a DeviceStep
// generates the indexer queries with PatternModel::IndexerQuery, and device selections are read
// in place. Counts what the engine asks of the path.
class DeviceFakeBackend final : public AttentionBackend {
 public:
  struct Counts {
    int steps = 0;
    int prepared = 0;     // PrepareSelect calls
    int waits = 0;        // WaitForSelections calls
    int device_rows = 0;  // rows attended over a device selection
  };
  DeviceFakeBackend(std::unique_ptr<AttentionBackend> inner, Counts* counts)
      : inner_(std::move(inner)), counts_(counts) {}
  std::string Description() const override { return "fake device"; }
  int64_t output_values_per_row() const override { return inner_->output_values_per_row(); }
  absl::Status ResizeSequence(uint64_t id, int64_t slots) override {
    return inner_->ResizeSequence(id, slots);
  }
  absl::Status AttendLayer(int layer, std::span<const AttentionRowRef> rows,
                           std::span<float> outputs) override {
    std::vector<AttentionRowRef> host(rows.begin(), rows.end());
    for (AttentionRowRef& row : host) {
      if (row.device_selection == nullptr) continue;
      row.selection = std::span<const int32_t>(row.device_selection, row.top_k);
      row.device_selection = nullptr;
      ++counts_->device_rows;
    }
    return inner_->AttendLayer(layer, host, outputs);
  }
  int device_ordinal() const override { return 0; }
  absl::Status EnableDeviceSelects(const PatternModel& model) override {
    model_.emplace(model);
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<DeviceStep>> BeginDeviceStep() override {
    if (!model_.has_value()) return absl::FailedPreconditionError("not enabled");
    ++counts_->steps;
    return std::unique_ptr<DeviceStep>(std::make_unique<Step>(&*model_, counts_));
  }

 private:
  class Step final : public DeviceStep {
   public:
    Step(const PatternModel* model, Counts* counts) : model_(model), counts_(counts) {}
    absl::StatusOr<DeviceSelectSlot> PrepareSelect(int f, std::span<const int64_t> positions,
                                                   int top_k) override {
      ++counts_->prepared;
      Slot& slot = slots_[f];
      const size_t per_row = static_cast<size_t>(model_->num_heads()) * model_->head_dim();
      slot.queries.assign(positions.size() * per_row, 0);
      std::vector<float> weights(model_->num_heads());
      for (size_t r = 0; r < positions.size(); ++r) {
        const absl::Status status = model_->IndexerQuery(
            f, positions[r], std::span<float>(slot.queries.data() + r * per_row, per_row), weights);
        if (!status.ok()) return status;
      }
      slot.selections.assign(positions.size() * top_k, -9);
      return DeviceSelectSlot{slot.queries.data(), nullptr, slot.selections.data(), nullptr};
    }
    absl::Status WaitForSelections(int f) override {
      ++counts_->waits;
      return slots_.contains(f) ? absl::OkStatus() : absl::InvalidArgumentError("no slot");
    }
    void Abandon() override {}

   private:
    struct Slot {
      std::vector<float> queries;
      std::vector<int32_t> selections;
    };
    const PatternModel* model_;
    Counts* counts_;
    std::map<int, Slot> slots_;
  };
  std::unique_ptr<AttentionBackend> inner_;
  Counts* counts_;
  std::optional<PatternModel> model_;
};

std::vector<Observation> RunWorkload(IndexerClientFactory factory, const std::string& address,
                                     int num_sequences = 2, int threads = 2,
                                     DeviceFakeBackend::Counts* device_counts = nullptr) {
  std::vector<Observation> observed;
  std::mutex mutex;
  auto schedule = MliSchedule::FromPattern("FSFSFS", 1);
  CpuAttentionBackendOptions backend_options;
  backend_options.num_model_layers = schedule->num_layers();
  backend_options.kv_dim = 16;
  backend_options.attention_heads = 4;
  backend_options.seed = 5;
  auto backend = CpuAttentionBackend::Create(backend_options);
  AttentionEngineOptions options;
  options.prefill_threads = threads;
  options.observer = [&](const AttendedRow& row) {
    std::lock_guard<std::mutex> lock(mutex);
    observed.push_back({row.sequence_id, row.model_layer, row.position,
                        std::vector<int32_t>(row.selection.begin(), row.selection.end()),
                        std::vector<float>(row.output.begin(), row.output.end())});
  };
  std::unique_ptr<AttentionBackend> chosen = std::move(*backend);
  if (device_counts != nullptr) {
    chosen = std::make_unique<DeviceFakeBackend>(std::move(chosen), device_counts);
  }
  auto engine = AttentionEngine::Create(*schedule, MakeModel(3), std::move(chosen),
                                        std::move(factory), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  std::vector<StepMember> plain, speculative;
  for (uint64_t id = 11; id < 11 + static_cast<uint64_t>(num_sequences); ++id) {
    plain.push_back({id, 1});
    speculative.push_back({id, id == 11 ? 3 : 1});
    PrefillSpec spec;
    spec.sequence_id = id;
    spec.context_length = 700 + 100 * static_cast<int64_t>(id % 16);
    spec.prefix_block_ids = {42};
    spec.indexer_worker = address;
    spec.top_k = kK;
    spec.spin.target_block_sparsity = 0.4;
    spec.spin.seed = 9;
    auto prefilled = (*engine)->Prefill(spec);
    EXPECT_TRUE(prefilled.ok()) << prefilled.status();
  }
  for (int step = 0; step < 3; ++step) EXPECT_TRUE((*engine)->DecodeStep(plain).ok());
  EXPECT_TRUE((*engine)->DecodeStep(speculative).ok());
  EXPECT_TRUE((*engine)->Commit(11, 1).ok());
  for (int step = 0; step < 2; ++step) EXPECT_TRUE((*engine)->DecodeStep(plain).ok());
  return observed;
}

TEST(EngineTransportsTest, InProcessAndGrpcIndexerClientsGiveIdenticalSelectionsAndOutputs) {
  auto local = Indexer::Create({4096, kH, kD});
  ASSERT_TRUE(local.ok());
  const std::vector<Observation> in_process =
      RunWorkload(InProcessIndexerClient::Factory(local->get()), kInProcessIndexerAddress);

  auto remote = Indexer::Create({4096, kH, kD});
  ASSERT_TRUE(remote.ok());
  IndexerServiceImpl service(remote->get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_GT(port, 0);
  const std::vector<Observation> over_grpc =
      RunWorkload(GrpcIndexerClient::Factory(), absl::StrCat("127.0.0.1:", port));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));

  // 2 sequences x 6 layers x (3 + 2 + 2 plain steps) + 6 layers x (3 + 1 rows) of the speculative.
  ASSERT_EQ(in_process.size(), 2u * 6 * 5 + 6 * 4);
  ASSERT_EQ(over_grpc.size(), in_process.size());
  int with_selection = 0;
  for (size_t i = 0; i < in_process.size(); ++i) {
    EXPECT_EQ(in_process[i], over_grpc[i]) << "observation " << i;
    with_selection += in_process[i].selection[0] >= 0;
  }
  EXPECT_EQ(with_selection, static_cast<int>(in_process.size()));
}

// A batch large enough that its indexer inputs are generated on several threads gives exactly the
// observations one thread gives.
TEST(EngineTransportsTest, ThreadedInputGenerationChangesNothing) {
  std::vector<std::vector<Observation>> runs;
  for (int threads : {1, 3}) {
    auto local = Indexer::Create({8192, kH, kD});
    ASSERT_TRUE(local.ok());
    runs.push_back(RunWorkload(InProcessIndexerClient::Factory(local->get()),
                               kInProcessIndexerAddress, /*num_sequences=*/13, threads));
  }
  ASSERT_EQ(runs[0].size(), 13u * 6 * 5 + 6 * (3 + 12));
  EXPECT_TRUE(runs[0] == runs[1]);
}

// The workload's observations over a co-located CPU indexer (the host path).
std::vector<Observation> HostPathObservations() {
  auto host = Indexer::Create({4096, kH, kD});
  EXPECT_TRUE(host.ok());
  return RunWorkload(InProcessIndexerClient::Factory(host->get()), kInProcessIndexerAddress);
}

// The workload's observations with the fake device backend over an indexer on the fake scoring
// device that `controls` steer.
std::vector<Observation> FakeDeviceObservations(testing_fakes::FakeControls& controls,
                                                DeviceFakeBackend::Counts* counts) {
  auto device =
      Indexer::Create({4096, kH, kD}, std::make_unique<testing_fakes::FakeDevice>(&controls));
  EXPECT_TRUE(device.ok());
  return RunWorkload(InProcessIndexerClient::Factory(device->get()), kInProcessIndexerAddress,
                     /*num_sequences=*/2, /*threads=*/2, counts);
}

// The device-resident path (a backend and a co-located indexer on one "GPU", the fakes' host
// memory): the same observations as host queries, every full layer's select in device form and
// waited for on the device by the layer that attends it.
TEST(EngineTransportsTest, DeviceResidentSelectsGiveTheHostPathsObservations) {
  const std::vector<Observation> expected = HostPathObservations();
  testing_fakes::FakeControls controls;
  controls.runs_spin = true;
  controls.ordinal = 0;
  DeviceFakeBackend::Counts counts;
  const std::vector<Observation> observed = FakeDeviceObservations(controls, &counts);
  ASSERT_EQ(observed.size(), expected.size());
  for (size_t i = 0; i < observed.size(); ++i) {
    EXPECT_EQ(observed[i], expected[i]) << "observation " << i;
  }
  // 6 decode steps x 3 full layers, all in device form; each awaited once on the device.
  EXPECT_EQ(counts.steps, 6);
  EXPECT_EQ(counts.prepared, 6 * 3);
  EXPECT_EQ(counts.waits, 6 * 3);
  EXPECT_EQ(controls.enqueued_calls, 6 * 3);
  EXPECT_EQ(counts.device_rows, static_cast<int>(observed.size()));
}

// An indexer whose device takes host queries only: no device form is sent (the transport says
// device ordinal -1); one whose sequences' SPIN runs on the CPU refuses the first, and the engine
// sends that layer and all later ones with host queries.
TEST(EngineTransportsTest, AnIndexerThatRefusesTheDeviceFormGetsHostQueries) {
  const std::vector<Observation> expected = HostPathObservations();
  for (const bool device_ordinal : {false, true}) {
    testing_fakes::FakeControls controls;
    controls.runs_spin = false;  // SPIN planned on the CPU: a device-form select is refused
    controls.ordinal = device_ordinal ? 0 : -1;
    DeviceFakeBackend::Counts counts;
    const std::vector<Observation> observed = FakeDeviceObservations(controls, &counts);
    EXPECT_TRUE(observed == expected) << "device ordinal " << controls.ordinal;
    EXPECT_EQ(counts.steps, device_ordinal ? 1 : 0);     // the refused step only
    EXPECT_EQ(counts.prepared, device_ordinal ? 1 : 0);  // its first full layer
    EXPECT_EQ(counts.waits, 0);
    EXPECT_EQ(controls.enqueued_calls, 0);
  }
}

TEST(EngineTransportsTest, TheInProcessFactoryRefusesARemoteAddress) {
  auto local = Indexer::Create({64, kH, kD});
  ASSERT_TRUE(local.ok());
  IndexerClientFactory factory = InProcessIndexerClient::Factory(local->get());
  EXPECT_TRUE(factory(kInProcessIndexerAddress).ok());
  const absl::Status refused = factory("10.0.0.1:50051").status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("10.0.0.1:50051"), std::string::npos) << refused;
}

}  // namespace
}  // namespace dsa
