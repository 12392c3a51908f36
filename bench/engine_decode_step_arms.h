// The parts of bench_engine_decode_step (engine_decode_step_bench.cc) other than its main: the
// timed attention backend, the transports of the arms (serial, ceiling, and the one the engine
// holds, switched between steps), the engine's indexer client, the shapes, and the figures of one
// cell of timed steps.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention_worker/attention_backend.h"
#include "attention_worker/pattern_model.h"
#include "nlohmann/json.hpp"
#include "transport/indexer_client.h"
#include "transport/selection_transport.h"

namespace dsa::bench {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start);

// Wall-clock time, Unix seconds (to line the decode windows up with a GPU-busy sampler's log).
double UnixSeconds();

// Wall time of the parts of one decode step, seconds (reset before each step).
struct StepParts {
  double submit = 0;     // SelectionTransport::Submit calls (serial: the whole select)
  double await = 0;      // SelectionTransport::Await calls (the engine's selection waits)
  double attention = 0;  // the backend's AttendLayer calls (staging and enqueueing on the GPU)
  double drain = 0;      // the step's end: Synchronize, the GPU finishing what the host enqueued
};

// The CUDA (or CPU) backend, timing the engine's calls. The layer stand-in runs inside the CUDA
// backend, on its stream after each layer's attention (CudaAttentionBackendOptions::rest_of_layer:
// cuBLAS cannot be loaded by dsa-attention, attention_worker/cuda/CMakeLists.txt says why).
class TimedBackend final : public dsa::AttentionBackend {
 public:
  TimedBackend(std::unique_ptr<dsa::AttentionBackend> inner, StepParts* parts)
      : inner_(std::move(inner)), parts_(parts) {}

  std::string Description() const override { return inner_->Description(); }
  int64_t output_values_per_row() const override { return inner_->output_values_per_row(); }
  int64_t slot_granularity() const override { return inner_->slot_granularity(); }
  absl::Status ResizeSequence(uint64_t sequence_id, int64_t num_slots) override {
    return inner_->ResizeSequence(sequence_id, num_slots);
  }
  absl::Status AttendLayer(int model_layer, std::span<const dsa::AttentionRowRef> rows,
                           std::span<float> outputs) override {
    const Clock::time_point start = Clock::now();
    absl::Status status = inner_->AttendLayer(model_layer, rows, outputs);
    parts_->attention += SecondsSince(start);
    return status;
  }
  absl::Status Synchronize() override {
    const Clock::time_point start = Clock::now();
    absl::Status status = inner_->Synchronize();
    parts_->drain += SecondsSince(start);
    return status;
  }
  int device_ordinal() const override { return inner_->device_ordinal(); }
  absl::Status EnableDeviceSelects(const dsa::PatternModel& model) override {
    return inner_->EnableDeviceSelects(model);
  }
  absl::StatusOr<std::unique_ptr<dsa::DeviceStep>> BeginDeviceStep() override {
    return inner_->BeginDeviceStep();
  }

 private:
  const std::unique_ptr<dsa::AttentionBackend> inner_;
  StepParts* const parts_;
};

// Arm "serial": Submit runs the select to its end (Await on the inner transport) before returning.
class SerialTransport final : public dsa::SelectionTransport {
 public:
  explicit SerialTransport(dsa::SelectionTransport* inner) : inner_(inner) {}
  absl::StatusOr<uint64_t> Submit(dsa::LayerSelectRequest request) override {
    absl::StatusOr<uint64_t> id = inner_->Submit(std::move(request));
    if (!id.ok()) return id;
    absl::StatusOr<dsa::LayerSelection> answer =
        inner_->Await(*id, absl::Now() + absl::Seconds(60));
    std::lock_guard<std::mutex> lock(mutex_);
    answers_.emplace(*id, std::move(answer));
    return id;
  }
  absl::StatusOr<dsa::LayerSelection> Await(uint64_t request_id, absl::Time /*deadline*/) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = answers_.find(request_id);
    if (it == answers_.end()) return absl::NotFoundError(absl::StrCat("request ", request_id));
    return std::move(answers_.extract(it).mapped());
  }
  void Forget(uint64_t request_id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    answers_.erase(request_id);
  }
  absl::Status Close() override { return absl::OkStatus(); }

 private:
  dsa::SelectionTransport* const inner_;
  std::mutex mutex_;
  std::map<uint64_t, absl::StatusOr<dsa::LayerSelection>> answers_;
};

// Arm "ceiling": answers every row at once with a fixed valid selection of its sequence (K slots
// spread evenly over the slots the sequence had when first seen, best first = ascending), with no
// indexer work. The indexer's sequences do not advance, so this arm runs last on a sequence set.
class CeilingTransport final : public dsa::SelectionTransport {
 public:
  explicit CeilingTransport(int top_k) : top_k_(top_k) {}
  absl::StatusOr<uint64_t> Submit(dsa::LayerSelectRequest request) override {
    std::lock_guard<std::mutex> lock(mutex_);
    dsa::LayerSelection answer;
    answer.groups.reserve(request.groups.size());
    for (const dsa::SelectRowGroup& group : request.groups) {
      std::vector<int32_t>& fixed = fixed_[group.sequence_id];
      if (fixed.empty()) {
        const int64_t slots = group.first_position + 1;  // row 0 sees 0..t
        fixed.assign(static_cast<size_t>(top_k_), -1);
        const int64_t n = std::min<int64_t>(top_k_, slots);
        for (int64_t j = 0; j < n; ++j) fixed[j] = static_cast<int32_t>(j * slots / n);
      }
      dsa::GroupSelection& selection = answer.groups.emplace_back();
      selection.num_rows = group.num_rows;
      selection.top_k = top_k_;
      selection.selections.reserve(static_cast<size_t>(group.num_rows) * top_k_);
      for (int r = 0; r < group.num_rows; ++r) {
        selection.selections.insert(selection.selections.end(), fixed.begin(), fixed.end());
      }
    }
    const uint64_t id = next_id_++;
    answers_.emplace(id, std::move(answer));
    return id;
  }
  absl::StatusOr<dsa::LayerSelection> Await(uint64_t request_id, absl::Time /*deadline*/) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = answers_.find(request_id);
    if (it == answers_.end()) return absl::NotFoundError(absl::StrCat("request ", request_id));
    return std::move(answers_.extract(it).mapped());
  }
  void Forget(uint64_t request_id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    answers_.erase(request_id);
  }
  absl::Status Close() override { return absl::OkStatus(); }

 private:
  const int top_k_;
  std::mutex mutex_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, dsa::LayerSelection> answers_;
  std::map<uint64_t, std::vector<int32_t>> fixed_;  // per sequence
};

// The transport of the current arm (switched between steps only), timing Submit and Await (and
// AwaitEnqueued). Only the device arm shows the in-process transport's GPU (device_ordinal), so
// only it gets device-form requests from the engine.
class ArmTransport final : public dsa::SelectionTransport {
 public:
  explicit ArmTransport(StepParts* parts) : parts_(parts) {}
  void set_arm(dsa::SelectionTransport* arm, bool device_form) {
    arm_ = arm;
    device_form_ = device_form;
  }
  int device_ordinal() const override { return device_form_ ? arm_->device_ordinal() : -1; }
  absl::Status AwaitEnqueued(uint64_t request_id, absl::Time deadline) override {
    const Clock::time_point start = Clock::now();
    absl::Status status = arm_->AwaitEnqueued(request_id, deadline);
    parts_->await += SecondsSince(start);
    return status;
  }
  absl::StatusOr<uint64_t> Submit(dsa::LayerSelectRequest request) override {
    const Clock::time_point start = Clock::now();
    absl::StatusOr<uint64_t> id = arm_->Submit(std::move(request));
    parts_->submit += SecondsSince(start);
    return id;
  }
  absl::StatusOr<dsa::LayerSelection> Await(uint64_t request_id, absl::Time deadline) override {
    const Clock::time_point start = Clock::now();
    absl::StatusOr<dsa::LayerSelection> answer = arm_->Await(request_id, deadline);
    parts_->await += SecondsSince(start);
    return answer;
  }
  void Forget(uint64_t request_id) override { arm_->Forget(request_id); }
  absl::Status Close() override { return absl::OkStatus(); }

 private:
  StepParts* const parts_;
  dsa::SelectionTransport* arm_ = nullptr;
  bool device_form_ = false;
};

// The engine's one indexer client: the control plane (prefill's shape check, create, appends,
// release) goes to the co-located Indexer through InProcessIndexerClient, so that no prefill pays
// for gRPC (with --remote-indexer: to the remote indexer's client); the data plane is the current
// arm's transport (for arm grpc, GrpcIndexerClient's SelectStream). A decode step uses the data
// plane only.
class ArmClient final : public dsa::IndexerClient {
 public:
  ArmClient(std::shared_ptr<dsa::IndexerClient> control, ArmTransport* transport)
      : control_(std::move(control)), transport_(transport) {}
  const std::string& address() const override { return address_; }
  absl::StatusOr<dsa::IndexerShape> GetShape(absl::Time deadline) override {
    return control_->GetShape(deadline);
  }
  absl::Status CreateSequence(const dsa::IndexerSequenceSpec& spec, absl::Time deadline) override {
    return control_->CreateSequence(spec, deadline);
  }
  std::unique_ptr<dsa::IndexKeyAppend> BeginAppend(uint64_t sequence_id,
                                                   absl::Time deadline) override {
    return control_->BeginAppend(sequence_id, deadline);
  }
  absl::Status BeginTurn(uint64_t sequence_id, absl::Time deadline) override {
    return control_->BeginTurn(sequence_id, deadline);
  }
  absl::Status Commit(uint64_t sequence_id, int accepted, absl::Time deadline) override {
    return control_->Commit(sequence_id, accepted, deadline);
  }
  absl::Status Release(uint64_t sequence_id, absl::Time deadline) override {
    return control_->Release(sequence_id, deadline);
  }
  dsa::SelectionTransport& Selections() override { return *transport_; }
  absl::Status Close() override { return absl::OkStatus(); }

 private:
  const std::string address_ = "bench-arms";
  const std::shared_ptr<dsa::IndexerClient> control_;
  ArmTransport* const transport_;
};

struct Shape {
  int batch = 1;
  int64_t context = 0;
};

absl::StatusOr<std::vector<Shape>> ParseShapes(const std::string& text);

// inprocess: host-form requests to the co-located Indexer; device: the same transport with the
// device-resident form (queries generated on the GPU, selections left there, event waits). The
// last two are the arms of --remote-indexer (which runs them and the ceiling only).
inline constexpr const char* kArms[] = {"inprocess", "grpc",   "serial",       "device",
                                        "ceiling",   "remote", "remote_serial"};
inline constexpr int kNumArms = 7;
inline constexpr int kInProcess = 0;
inline constexpr int kSerial = 2;
inline constexpr int kDevice = 3;
inline constexpr int kCeiling = 4;
inline constexpr int kRemote = 5;
inline constexpr int kRemoteSerial = 6;

// Timed steps of one (arm, stand-in) cell of a sequence set.
struct Cell {
  std::vector<double> step_seconds;
  std::vector<StepParts> parts;
  std::vector<double> wait_seconds;  // sum of selection_wait_seconds over the layers
  int64_t blocks_scored = 0;
  int64_t blocks_visible = 0;
};

nlohmann::json CellJson(const Cell& cell, int layers);

}  // namespace dsa::bench
