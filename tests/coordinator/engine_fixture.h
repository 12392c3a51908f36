// The fixture of CoordinatorEngine's deterministic tests (engine_test.cc,
// real_model_engine_test.cc): the engine over in-memory workers (fake_workers.h) and a FakeClock,
// without its threads (run_loops false); the test steps each decode loop itself (StepWorker),
// checks the workers itself (RefreshWorkers) and looks for stalled writes itself
// (CheckStalledWrites). The only waits are for a Generate handler thread to reach a state
// (AwaitDecoding, AwaitEvents), never for time.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "coordinator/engine.h"
#include "coordinator/generate.h"
#include "coordinator/metrics.h"
#include "coordinator/service.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "tests/coordinator/fake_workers.h"
#include "tests/coordinator/requests_metric.h"

namespace dsa {
namespace engine_testing {

namespace cv1 = ::dsa::coordinator::v1;
using ::dsa::testing::FakeWorkers;

inline constexpr absl::Duration kSafetyNet = absl::Seconds(20);  // a broken test fails, not hangs
inline constexpr char kA1[] = "10.0.0.1:7000";
inline constexpr char kA2[] = "10.0.0.2:7000";
inline constexpr char kI1[] = "10.0.1.1:7100";
inline constexpr char kI2[] = "10.0.1.2:7100";

// A Generate call's client: records every event (as the gRPC adapter would send it); can hold its
// Writes (a reader that stopped reading, its flow-control window full) until the call is
// cancelled.
class RecordingStream final : public GenerateStream {
 public:
  bool Write(const GenerateEvent& event) override {
    absl::MutexLock lock(&mu_);
    if (hold_writes_) {
      ++writes_held_;
      mu_.Await(absl::Condition(&cancelled_));
    }
    if (cancelled_) return false;
    events_.push_back(ToGenerateEventProto(event));
    return true;
  }
  bool IsCancelled() override {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }
  void TryCancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  void HoldWrites() {
    absl::MutexLock lock(&mu_);
    hold_writes_ = true;
  }
  // Waits until `count` events were written (or a Write is held, with `held`).
  bool AwaitEvents(int count) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, count] { return static_cast<int>(events_.size()) >= count; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), kSafetyNet);
  }
  bool AwaitHeldWrite() {
    absl::MutexLock lock(&mu_);
    auto held = [this] { return writes_held_ > 0; };
    return mu_.AwaitWithTimeout(absl::Condition(&held), kSafetyNet);
  }
  std::vector<cv1::GenerateEvent> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }

 private:
  absl::Mutex mu_;
  bool hold_writes_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  int writes_held_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<cv1::GenerateEvent> events_ ABSL_GUARDED_BY(mu_);
};

// One Generate running on its own thread (the handler thread gRPC would give it).
struct Call {
  RecordingStream stream;
  absl::Status status;
  std::thread thread;
  std::atomic<bool> returned{false};
  void Join() {
    if (thread.joinable()) thread.join();
  }
  const cv1::Admitted& admitted() {
    events_ = stream.events();
    return events_.at(0).admitted();
  }
  // Tokens generated over every Tokens event, and whether their positions are contiguous from
  // `context`.
  int64_t Tokens(int64_t context, bool* contiguous) {
    events_ = stream.events();
    int64_t total = 0;
    *contiguous = true;
    for (const cv1::GenerateEvent& e : events_) {
      if (!e.has_tokens()) continue;
      *contiguous &= e.tokens().first_position() == context + total;
      total += e.tokens().count();
    }
    return total;
  }
  const cv1::Finished* finished() {
    events_ = stream.events();
    for (const cv1::GenerateEvent& e : events_) {
      if (e.has_finished()) return &e.finished();
    }
    return nullptr;
  }

 private:
  std::vector<cv1::GenerateEvent> events_;
};

inline GenerateSpec Request(const std::string& id, int64_t context, int64_t new_tokens) {
  GenerateSpec request;
  request.request_id = id;
  request.context_length = context;
  request.max_new_tokens = new_tokens;
  return request;
}

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    options_.run_loops = false;
    options_.worker_check_interval_ms = 0;
    options_.retain_finished = false;  // every finished sequence is released
    options_.stall_timeout_ms = 0;
  }

  void Start(const std::vector<std::string>& attention, const std::vector<std::string>& indexers) {
    for (const std::string& a : attention) fakes_->AddAttention(a, attention_shape_);
    for (const std::string& i : indexers) fakes_->AddIndexer(i);
    options_.attention_addresses = attention;
    options_.indexer_addresses = indexers;
    auto engine = CoordinatorEngine::Create(options_, &metrics_, fakes_, &clock_);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
  }

  // A failed assertion leaves handlers waiting for steps: cancel them and step every worker
  // until each has returned (bounded), so that the test fails instead of hanging.
  void TearDown() override {
    for (auto& call : calls_) call->stream.TryCancel();
    for (int round = 0; round < 1000; ++round) {
      bool all_returned = true;
      for (auto& call : calls_) all_returned &= call->returned.load();
      if (all_returned) break;
      for (const std::string& address : options_.attention_addresses) {
        (void)engine_->StepWorker(address);
      }
      engine_->RefreshWorkers();
    }
    for (auto& call : calls_) {
      if (call->returned.load()) {
        call->Join();
      } else {
        ADD_FAILURE() << "a Generate handler never returned";
        call->thread.detach();
        (void)call.release();  // leaked on purpose: its thread still runs
      }
    }
  }

  // Starts a Generate on its own thread; the fixture owns the call. With `hold_writes` every
  // Write blocks from the first (Admitted) on: set before the thread starts, so that the
  // handler cannot write Admitted before the hold is in place.
  Call* Generate(const GenerateSpec& request, const std::string& caller = "router",
                 bool hold_writes = false) {
    calls_.push_back(std::make_unique<Call>());
    Call* call = calls_.back().get();
    if (hold_writes) call->stream.HoldWrites();
    call->thread = std::thread([this, request, caller, call] {
      call->status = engine_->Generate(request, caller, "", call->stream);
      call->returned = true;
    });
    return call;
  }

  // Steps the decode loop of `address` until `call` has its Finished event (bounded).
  void StepUntilFinished(const std::string& address, Call& call, int max_steps = 1000) {
    for (int i = 0; i < max_steps && call.finished() == nullptr; ++i) {
      absl::StatusOr<int> stepped = engine_->StepWorker(address);
      ASSERT_TRUE(stepped.ok()) << stepped.status();
      // The handler writes what the step queued: wait for it, so the queue never fills.
      ASSERT_TRUE(call.stream.AwaitEvents(static_cast<int>(call.stream.events().size())));
    }
  }

  // Starts `request`, steps the decode loop of `address` until it has finished, and checks that
  // it completed (wrap in ASSERT_NO_FATAL_FAILURE).
  void RunToCompletion(const GenerateSpec& request, const std::string& address,
                       const std::string& caller = "router") {
    Call* call = Generate(request, caller);
    ASSERT_TRUE(engine_->AwaitDecoding(address, 1, kSafetyNet));
    StepUntilFinished(address, *call);
    call->Join();
    ASSERT_TRUE(call->status.ok()) << call->status;
  }

  // SIGCONT of a stalled worker, then a check: the Releases that waited for it are delivered, and
  // neither it nor the indexer kI1 holds anything.
  void ResumeAndExpectNothingLeft(const std::string& stalled) {
    fakes_->SetStalled(stalled, false);
    engine_->RefreshWorkers();
    EXPECT_EQ(fakes_->Sequences(stalled), 0);
    EXPECT_EQ(fakes_->Sequences(kI1), 0);
  }

  // The engine's GetLoad as the gRPC adapter answers it.
  cv1::GetLoadResponse GetLoad() { return ToGetLoadResponse(engine_->GetLoad()); }

  int64_t Metric(const std::string& line_prefix) {
    const std::string text = prometheus::TextSerializer().Serialize(registry_.Collect());
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (absl::StartsWith(line, line_prefix)) {
        return static_cast<int64_t>(std::stod(std::string(line.substr(line_prefix.size()))));
      }
    }
    return -1;
  }

  // dsa_coordinator_requests_total of `outcome` (and `code`, when given), over its codes.
  int64_t Requests(const std::string& outcome, const std::string& code = "") {
    return testing::RequestsWithOutcome(prometheus::TextSerializer().Serialize(registry_.Collect()),
                                        outcome, code);
  }

  CoordinatorOptions options_;
  FakeWorkers::AttentionShape attention_shape_;  // of every attention worker Start adds
  prometheus::Registry registry_;
  CoordinatorMetrics metrics_{registry_};
  FakeClock clock_;
  std::shared_ptr<FakeWorkers> fakes_ = std::make_shared<FakeWorkers>(&clock_);
  std::unique_ptr<CoordinatorEngine> engine_;
  std::vector<std::unique_ptr<Call>> calls_;
};

}  // namespace engine_testing
}  // namespace dsa
