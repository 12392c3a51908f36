// The attention engine's decode step (see AttentionEngine::DecodeStep in engine.h): plan, submit
// each full layer's selects, collect them where a layer first attends them, attend, roll back.
#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attention_worker/engine.h"
#include "attention_worker/engine_internal.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "contracts/limits.h"

namespace dsa {

namespace {

using engine_internal::CheckModelContext;
using engine_internal::IsTransportFailure;
using engine_internal::ValidateTokens;

// A decode step generates its groups' indexer inputs on several threads only with at least this
// many groups a thread (a group of one row is about 0.1-0.2 ms of the pattern model at H = 64).
constexpr int kMinGroupsPerGenerationThread = 4;

// For a select the indexer refused: the number of leading groups it applied, from the status
// payload the transport attaches (kGroupsAppliedPayload); without it, every group counts as
// applied (the safe assumption).
int AppliedGroups(const absl::Status& status, int num_groups) {
  const auto payload = status.GetPayload(kGroupsAppliedPayload);  // absl::optional<absl::Cord>
  int applied = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &applied)) {
    return num_groups;
  }
  return std::clamp(applied, 0, num_groups);
}

}  // namespace

// The state of one decode step: the batch, its indexer requests and their selections.
struct AttentionEngine::StepState {
  struct Member {
    std::shared_ptr<Sequence> sequence;
    int rows = 0;
    int64_t first_position = 0;  // t
    int batch = 0;               // index into batches
    // Per full layer (rank): the selections int32 [rows, top_k] (host), or with the device form
    // their place on the GPU (null until enqueued).
    std::vector<std::vector<int32_t>> selections;
    std::vector<const int32_t*> device_selections;
    std::vector<int> top_k;
    int64_t batch_row = 0;  // the member's first row in its batch's requests
    int step_row = 0;       // the member's first row in the step's ModelStep
    int64_t blocks_scored = 0;
    int64_t blocks_visible = 0;
    int audited_rows = 0;
    double audit_miss_rate_sum = 0;
    std::vector<SequenceStepResult::AuditedRow> audited;
    bool touched = false;  // the indexer may have applied part of this step
  };
  struct Batch {  // the members on one indexer worker
    std::shared_ptr<IndexerClient> client;
    std::vector<int> members;
    // Per full layer (rank): request id once submitted (0 = not submitted), and whether its
    // answer was collected.
    std::vector<uint64_t> request_ids;
    std::vector<bool> collected;
    // The device-resident path (AttentionEngineOptions::device_selects): the requests' form, and
    // per full layer whether its selections are enqueued on the GPU and waited for.
    bool device_form = false;
    int device_top_k = 0;
    int64_t rows = 0;
    std::vector<DeviceSelectSlot> device_slots;
    std::vector<bool> submitted_on_device;
    std::vector<bool> enqueued;
    std::vector<bool> awaited_on_device;
  };
  std::vector<Member> members;  // request order
  std::vector<Batch> batches;
  std::vector<std::unique_lock<std::mutex>> locks;  // the members' locks, increasing id order
  int64_t total_rows = 0;                           // KV slots reserved for the step
  std::vector<double> selection_wait_seconds;       // per model layer
  std::unique_ptr<DeviceStep> device_step;          // when a batch has the device form
  std::unique_ptr<ModelStep> model_step;            // the model's pass over the step's rows
  // Rows attended over device selections, reported to the observer once their host selections
  // are read (the step's end).
  struct Observation {
    size_t member = 0;
    int row = 0;
    int model_layer = 0;
    int attended_layer = 0;
    int full_rank = 0;
    std::vector<float> output;
  };
  std::vector<Observation> observations;
};

bool AttentionEngine::UsesDeviceSelects(const std::shared_ptr<IndexerClient>& client,
                                        const std::vector<int>& members, const StepState& step) {
  const int ordinal = model_->device_ordinal();
  if (!options_.device_selects || ordinal < 0 || step.device_step != nullptr) return false;
  if (client->Selections().device_ordinal() != ordinal) return false;
  {
    std::lock_guard<std::mutex> lock(clients_mutex_);
    if (host_only_clients_.contains(client.get())) return false;
  }
  for (int i : members) {  // one K a request: the row stride of its device selections
    if (step.members[i].sequence->top_k != step.members[members[0]].sequence->top_k) return false;
  }
  std::lock_guard<std::mutex> lock(device_selects_mutex_);
  if (!device_selects_tried_) {
    device_selects_tried_ = true;
    device_selects_status_ = model_->EnableDeviceSelects();
  }
  return device_selects_status_.ok();
}

absl::Status AttentionEngine::PlanStep(std::span<const StepMember> members, StepState& step) {
  if (members.empty()) {
    return absl::InvalidArgumentError("a decode step needs at least one sequence");
  }
  const int num_full = static_cast<int>(schedule_.full_layers().size());
  step.members.resize(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    const StepMember& s = members[i];
    if (s.rows < 1 || s.rows > kMaxStepRows) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s.sequence_id, " asks for ",
                                                     s.rows, " rows; rows must be in 1..",
                                                     kMaxStepRows));
    }
    for (size_t j = 0; j < i; ++j) {
      if (members[j].sequence_id == s.sequence_id) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", s.sequence_id, " appears twice in the step"));
      }
    }
    step.members[i].sequence = FindSequence(s.sequence_id);
    if (step.members[i].sequence == nullptr) {
      return absl::NotFoundError(absl::StrCat("sequence ", s.sequence_id, " not found"));
    }
    step.members[i].rows = s.rows;
    DSA_RETURN_IF_ERROR(ValidateTokens(model_->shape(), s.tokens, s.rows,
                                       absl::StrCat("sequence ", s.sequence_id, "'s step")));
  }
  // Lock the batch in increasing id order (no deadlock with concurrent steps).
  std::vector<int> order(step.members.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return step.members[a].sequence->id < step.members[b].sequence->id;
  });
  step.locks.reserve(order.size());
  for (int i : order) step.locks.emplace_back(step.members[i].sequence->mutex);
  int64_t total_rows = 0;
  for (StepState::Member& m : step.members) {
    const Sequence& s = *m.sequence;
    DSA_RETURN_IF_ERROR(CheckUsable(s, /*check_pending=*/true));
    DSA_RETURN_IF_ERROR(CheckModelContext(model_->shape(), s.length + m.rows));
    m.first_position = s.length;
    m.selections.resize(num_full);
    m.top_k.resize(num_full);
    total_rows += Footprint(m.first_position + m.rows) - Footprint(m.first_position);
  }
  DSA_RETURN_IF_ERROR(ReserveKv(total_rows));
  step.total_rows = total_rows;
  // The model's pass over every row (the synthetic model writes the rows' KV here).
  std::vector<ModelRow> model_rows;
  for (size_t i = 0; i < step.members.size(); ++i) {
    StepState::Member& m = step.members[i];
    m.step_row = static_cast<int>(model_rows.size());
    for (int r = 0; r < m.rows; ++r) {
      model_rows.push_back(ModelRow{m.sequence->id, m.first_position + r,
                                    members[i].tokens.empty() ? -1 : members[i].tokens[r],
                                    m.sequence->sampling});
    }
    m.sequence->kv_slots = m.first_position + m.rows;  // rolled back from here on a failure
  }
  auto model_step = model_->BeginStep(model_rows);
  if (!model_step.ok()) return RollbackStep(model_step.status(), step);
  step.model_step = *std::move(model_step);
  // Batches by indexer worker, in order of first appearance.
  std::map<std::string, int> batch_of;
  for (size_t i = 0; i < step.members.size(); ++i) {
    StepState::Member& m = step.members[i];
    const std::string& address = m.sequence->indexer_worker;
    auto [it, inserted] = batch_of.emplace(address, static_cast<int>(step.batches.size()));
    if (inserted) {
      auto client = GetClient(address);
      if (!client.ok()) return RollbackStep(client.status(), step);
      StepState::Batch batch;
      batch.client = *client;
      batch.request_ids.assign(num_full, 0);
      batch.collected.assign(num_full, false);
      step.batches.push_back(std::move(batch));
    }
    m.batch = it->second;
    StepState::Batch& batch = step.batches[m.batch];
    batch.members.push_back(static_cast<int>(i));
    m.batch_row = batch.rows;
    batch.rows += m.rows;
    m.device_selections.assign(num_full, nullptr);
  }
  // Each layer's select to an indexer worker carries its batch's rows: its answer must fit a
  // message (contracts/limits.h), or every sequence of the batch would fail at the first layer.
  for (const StepState::Batch& batch : step.batches) {
    int64_t bound = kSelectResponseFramingBytes;
    for (int i : batch.members) {
      bound += SelectResponseBytesBound(step.members[i].rows, step.members[i].sequence->top_k);
    }
    if (bound > kMaxReceiveMessageBytes) {
      return RollbackStep(
          absl::ResourceExhaustedError(absl::StrCat(
              "the step's selections from indexer worker ", batch.client->address(), " could take ",
              bound, " bytes a layer, over the message limit of ", kMaxReceiveMessageBytes,
              " bytes (kMaxReceiveMessageBytes): step fewer sequences")),
          step);
    }
  }
  for (StepState::Batch& batch : step.batches) {
    if (!UsesDeviceSelects(batch.client, batch.members, step)) continue;
    auto device_step = model_->BeginDeviceStep();
    if (!device_step.ok()) break;  // host queries for this step
    step.device_step = *std::move(device_step);
    batch.device_form = true;
    batch.device_top_k = step.members[batch.members[0]].sequence->top_k;
    batch.device_slots.assign(num_full, DeviceSelectSlot{});
    batch.submitted_on_device.assign(num_full, false);
    batch.enqueued.assign(num_full, false);
    batch.awaited_on_device.assign(num_full, false);
  }
  step.selection_wait_seconds.assign(schedule_.num_layers(), 0.0);
  return absl::OkStatus();
}

absl::Status AttentionEngine::RollbackStep(absl::Status status, StepState& step) {
  std::vector<uint64_t> broken;
  for (StepState::Member& m : step.members) {
    if (m.sequence->kv_slots != m.first_position) (void)ResizeKv(*m.sequence, m.first_position);
    if (m.touched) {
      m.sequence->broken =
          absl::StrCat("a decode step at position ", m.first_position,
                       " failed after the indexer applied part of it: ", status.message());
      broken.push_back(m.sequence->id);
    }
  }
  FreeKv(step.total_rows);
  step.total_rows = 0;
  if (broken.empty()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(status.message(), "; sequences ", absl::StrJoin(broken, ", "),
                                   " may have advanced on the indexer and are now broken "
                                   "(release them)"));
}

absl::Status AttentionEngine::SubmitLayer(int f, StepState& step) {
  if (absl::Status s = step.model_step->PrepareIndexerInputs(schedule_.full_layers()[f], f);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("full layer ", f, " indexer inputs: ", s.message()));
  }
  for (size_t b = 0; b < step.batches.size(); ++b) {
    DSA_RETURN_IF_ERROR(SubmitBatchLayer(f, static_cast<int>(b), step));
  }
  return absl::OkStatus();
}

absl::Status AttentionEngine::SubmitBatchLayer(int f, int b, StepState& step) {
  StepState::Batch& batch = step.batches[b];
  const int num_heads = model_->shape().num_heads;
  const int head_dim = model_->shape().head_dim;
  const bool on_device = batch.device_form;
  LayerSelectRequest select;
  select.num_heads = num_heads;
  select.head_dim = head_dim;
  const int num_groups = static_cast<int>(batch.members.size());
  select.groups.resize(num_groups);
  if (on_device) {
    // The queries on the backend's stream; the head weights and new keys (H and D a row) below.
    std::vector<int64_t> positions;
    positions.reserve(batch.rows);
    for (int i : batch.members) {
      const StepState::Member& m = step.members[i];
      for (int r = 0; r < m.rows; ++r) positions.push_back(m.first_position + r);
    }
    auto slot = step.device_step->PrepareSelect(f, positions, batch.device_top_k);
    if (!slot.ok()) {
      return absl::Status(slot.status().code(),
                          absl::StrCat("full layer ", f, " indexer queries on the device: ",
                                       slot.status().message()));
    }
    batch.device_slots[f] = *slot;
    select.device = DeviceSelectBuffers{slot->queries, slot->queries_ready, slot->selections,
                                        batch.device_top_k, slot->selections_ready};
  }
  // The groups' indexer inputs (the synthetic model's pure functions of (layer, positions), or the
  // real model's, computed for every row at PrepareIndexerInputs): on up to prefill_threads
  // threads when the batch is large enough to pay for them.
  std::vector<absl::Status> generated(num_groups);
  const int threads =
      num_groups >= kMinGroupsPerGenerationThread * 2
          ? std::min(options_.prefill_threads, num_groups / kMinGroupsPerGenerationThread)
          : 1;
  ParallelFor(num_groups, threads, [&](int64_t g) {
    const StepState::Member& m = step.members[batch.members[g]];
    SelectRowGroup& group = select.groups[g];
    group.sequence_id = m.sequence->id;
    group.layer = f;
    group.first_position = m.first_position;
    group.num_rows = m.rows;
    if (!on_device) group.queries.resize(static_cast<size_t>(m.rows) * num_heads * head_dim);
    group.head_weights.resize(static_cast<size_t>(m.rows) * num_heads);
    group.new_index_keys.resize(static_cast<size_t>(m.rows) * head_dim);
    generated[g] =
        step.model_step->IndexerInputs(f, m.step_row, m.rows, m.sequence->prefix_block_ids,
                                       group.queries, group.head_weights, group.new_index_keys);
  });
  for (const absl::Status& status : generated) DSA_RETURN_IF_ERROR(status);
  auto id = batch.client->Selections().Submit(std::move(select));
  if (!id.ok()) {
    DropClient(batch.client);
    return absl::Status(id.status().code(),
                        absl::StrCat("indexer worker ", batch.client->address(), ", full layer ", f,
                                     ": ", id.status().message()));
  }
  batch.request_ids[f] = *id;
  if (on_device) batch.submitted_on_device[f] = true;
  return absl::OkStatus();
}

// The device form's half of collecting full layer f: waits (host) until the batch's selections
// are enqueued on the GPU and points its members at them. An indexer that cannot take the form
// gets the layer again with host queries (then collected as any host request). Other errors are
// left to the host answer (Await), which reports them.
absl::Status AttentionEngine::CollectDeviceLayer(int f, int b, StepState& step) {
  StepState::Batch& batch = step.batches[b];
  if (batch.submitted_on_device.empty() || !batch.submitted_on_device[f] || batch.enqueued[f] ||
      batch.collected[f] || batch.request_ids[f] == 0) {
    return absl::OkStatus();
  }
  SelectionTransport& transport = batch.client->Selections();
  const absl::Status enqueued =
      transport.AwaitEnqueued(batch.request_ids[f], Now() + options_.select_timeout);
  if (enqueued.ok()) {
    batch.enqueued[f] = true;
    for (int i : batch.members) {
      StepState::Member& m = step.members[i];
      m.device_selections[f] =
          batch.device_slots[f].selections + static_cast<size_t>(m.batch_row) * batch.device_top_k;
      m.top_k[f] = batch.device_top_k;
    }
    return absl::OkStatus();
  }
  if (enqueued.code() != absl::StatusCode::kUnimplemented) return absl::OkStatus();
  // Refused before anything changed: the answer is that refusal; host queries from now on. Any
  // other answer (a transport that has no AwaitEnqueued, a late success) is not resent.
  auto refused = transport.Await(batch.request_ids[f], Now() + options_.select_timeout);
  if (refused.status().code() != absl::StatusCode::kUnimplemented) {
    batch.collected[f] = true;
    for (int i : batch.members) step.members[i].touched = true;
    return absl::InternalError(
        absl::StrCat("indexer worker ", batch.client->address(),
                     "'s transport said it takes device forms, but could not say when full layer ",
                     f, "'s selections were enqueued: ", enqueued.message()));
  }
  batch.request_ids[f] = 0;
  {
    std::lock_guard<std::mutex> lock(clients_mutex_);
    host_only_clients_[batch.client.get()] = true;
  }
  // Later layers go with host queries too (earlier ones, already enqueued, stay on the device).
  batch.device_form = false;
  batch.submitted_on_device[f] = false;
  return SubmitBatchLayer(f, b, step);
}

absl::Status AttentionEngine::CollectLayer(int f, StepState& step, bool device_answers) {
  absl::Status first_error;
  for (StepState::Batch& batch : step.batches) {
    if (batch.request_ids[f] == 0 || batch.collected[f]) continue;
    // A device-form answer enqueued on the GPU is read by the host at the step's end (its blocks
    // and audit figures), or at once for the observer (its host selections).
    const bool enqueued = !batch.enqueued.empty() && batch.enqueued[f];
    if (enqueued && !device_answers) continue;
    batch.collected[f] = true;
    SelectionTransport& transport = batch.client->Selections();
    auto answer = transport.Await(batch.request_ids[f], Now() + options_.select_timeout);
    const int num_groups = static_cast<int>(batch.members.size());
    if (!answer.ok()) {
      if (answer.status().code() == absl::StatusCode::kDeadlineExceeded) {
        transport.Forget(batch.request_ids[f]);  // a late answer is dropped
        // A device-form select may still run later and write the step's buffers.
        if (!batch.submitted_on_device.empty() && batch.submitted_on_device[f]) {
          step.device_step->Abandon();
        }
      }
      const int applied = IsTransportFailure(answer.status().code())
                              ? num_groups
                              : AppliedGroups(answer.status(), num_groups);
      for (int g = 0; g < applied; ++g) step.members[batch.members[g]].touched = true;
      if (answer.status().code() == absl::StatusCode::kUnavailable) DropClient(batch.client);
      if (first_error.ok()) {
        first_error =
            absl::Status(answer.status().code(),
                         absl::StrCat("indexer worker ", batch.client->address(), ", full layer ",
                                      f, " select: ", answer.status().message()));
      }
      continue;
    }
    for (int i : batch.members) step.members[i].touched = true;
    if (static_cast<int>(answer->groups.size()) != num_groups) {
      if (first_error.ok()) {
        first_error = absl::InternalError(absl::StrCat("indexer worker ", batch.client->address(),
                                                       " answered ", answer->groups.size(),
                                                       " selections for ", num_groups, " groups"));
      }
      continue;
    }
    for (int g = 0; g < num_groups; ++g) {
      StepState::Member& m = step.members[batch.members[g]];
      GroupSelection& selection = answer->groups[g];
      if (selection.num_rows != m.rows || selection.top_k < 1 ||
          selection.selections.size() != static_cast<size_t>(m.rows) * selection.top_k) {
        if (first_error.ok()) {
          first_error = absl::InternalError(
              absl::StrCat("indexer worker ", batch.client->address(), " answered group ", g,
                           " with ", selection.selections.size(), " selection entries for ", m.rows,
                           " rows of K = ", selection.top_k));
        }
        continue;
      }
      if (m.device_selections[f] != nullptr && selection.top_k != m.top_k[f]) {
        if (first_error.ok()) {
          first_error = absl::InternalError(absl::StrCat(
              "indexer worker ", batch.client->address(), " answered group ", g,
              " with K = ", selection.top_k, " but its device selections hold K = ", m.top_k[f]));
        }
        continue;
      }
      m.top_k[f] = selection.top_k;
      m.selections[f] = std::move(selection.selections);
      m.blocks_scored += selection.blocks_scored;
      m.blocks_visible += selection.blocks_visible;
      m.audited_rows += static_cast<int>(selection.audit_miss_rates.size());
      for (double rate : selection.audit_miss_rates) m.audit_miss_rate_sum += rate;
      for (double rate : selection.audit_miss_rates) m.audited.push_back({f, rate});
    }
  }
  return first_error;
}

absl::Status AttentionEngine::AttendLayer(int l, int fs, StepState& step) {
  const int attended = schedule_.AttendedLayer(l);
  // Device selections: the attention stream waits for them on the GPU (once a step and layer).
  for (StepState::Batch& batch : step.batches) {
    if (batch.enqueued.empty() || !batch.enqueued[fs] || batch.awaited_on_device[fs]) continue;
    if (absl::Status s = step.device_step->WaitForSelections(fs); !s.ok()) {
      return absl::InternalError(absl::StrCat("layer ", l, " waiting for the selection of layer ",
                                              attended, " on the GPU: ", s.message()));
    }
    batch.awaited_on_device[fs] = true;
  }
  std::vector<AttentionRowRef> rows;
  std::vector<std::span<const int32_t>> host_selections;  // for the observer
  for (StepState::Member& m : step.members) {
    const int top_k = m.top_k[fs];
    for (int r = 0; r < m.rows; ++r) {
      const std::span<const int32_t> host =
          m.selections[fs].empty()
              ? std::span<const int32_t>()
              : std::span<const int32_t>(m.selections[fs].data() + static_cast<size_t>(r) * top_k,
                                         static_cast<size_t>(top_k));
      if (m.device_selections[fs] != nullptr) {
        rows.push_back(AttentionRowRef{m.sequence->id,
                                       m.first_position + r,
                                       {},
                                       m.device_selections[fs] + static_cast<size_t>(r) * top_k,
                                       top_k});
      } else {
        rows.push_back(AttentionRowRef{m.sequence->id, m.first_position + r, host});
      }
      host_selections.push_back(host);
    }
  }
  std::vector<float> outputs;
  if (options_.observer) outputs.resize(rows.size() * model_->output_values_per_row());
  if (absl::Status s = step.model_step->AttendLayer(l, rows, outputs); !s.ok()) {
    return absl::InternalError(absl::StrCat("layer ", l, " attention over the selection of layer ",
                                            attended, ": ", s.message()));
  }
  if (options_.observer) {
    const auto per_row = static_cast<size_t>(model_->output_values_per_row());
    size_t r = 0;
    for (size_t i = 0; i < step.members.size(); ++i) {
      const StepState::Member& m = step.members[i];
      for (int row = 0; row < m.rows; ++row, ++r) {
        const std::span<const float> output(outputs.data() + r * per_row, per_row);
        if (m.device_selections[fs] == nullptr) {
          options_.observer(AttendedRow{rows[r].sequence_id, l, attended, rows[r].position,
                                        host_selections[r], output});
        } else {
          // Its host selection is read at the step's end (the attention read the device's,
          // ordered by the event alone): reported then.
          step.observations.push_back(StepState::Observation{
              i, row, l, attended, fs, std::vector<float>(output.begin(), output.end())});
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DecodeStepResult> AttentionEngine::DecodeStep(std::span<const StepMember> members) {
  const absl::Time start = Now();
  StepState step;
  DSA_RETURN_IF_ERROR(PlanStep(members, step));
  const int num_full = static_cast<int>(schedule_.full_layers().size());
  // On a failure: collect every answer still outstanding (so we know what was applied).
  // The observer's rows that waited for their host selections (an empty one if it never came).
  auto report_observations = [&] {
    for (const StepState::Observation& o : step.observations) {
      const StepState::Member& m = step.members[o.member];
      const int top_k = m.top_k[o.full_rank];
      const std::vector<int32_t>& selection = m.selections[o.full_rank];
      const std::span<const int32_t> row =
          selection.size() >= static_cast<size_t>(o.row + 1) * top_k
              ? std::span<const int32_t>(selection.data() + static_cast<size_t>(o.row) * top_k,
                                         static_cast<size_t>(top_k))
              : std::span<const int32_t>();
      options_.observer(AttendedRow{m.sequence->id, o.model_layer, o.attended_layer,
                                    m.first_position + o.row, row, o.output});
    }
    step.observations.clear();
  };
  auto fail = [&](absl::Status status) -> absl::Status {
    for (int f = 0; f < num_full; ++f) (void)CollectLayer(f, step, /*device_answers=*/true);
    (void)model_->Synchronize();
    report_observations();
    step.device_step.reset();  // its buffers back to the backend (or abandoned)
    return RollbackStep(std::move(status), step);
  };
  for (int l = 0; l < schedule_.num_layers(); ++l) {
    if (full_rank_[l] >= 0) {
      if (absl::Status s = SubmitLayer(full_rank_[l], step); !s.ok()) return fail(s);
    }
    const int fs = full_rank_[schedule_.AttendedLayer(l)];
    const absl::Time wait_start = Now();
    for (size_t b = 0; b < step.batches.size(); ++b) {
      if (absl::Status s = CollectDeviceLayer(fs, static_cast<int>(b), step); !s.ok()) {
        return fail(s);
      }
    }
    if (absl::Status s = CollectLayer(fs, step, /*device_answers=*/false); !s.ok()) return fail(s);
    step.selection_wait_seconds[l] = absl::ToDoubleSeconds(Now() - wait_start);
    if (absl::Status s = AttendLayer(l, fs, step); !s.ok()) return fail(s);
  }
  // Selections no layer attends (the last k full layers') still have to be collected, and the
  // host answers of those that went to the GPU read.
  for (int f = 0; f < num_full; ++f) {
    for (size_t b = 0; b < step.batches.size(); ++b) {
      if (absl::Status s = CollectDeviceLayer(f, static_cast<int>(b), step); !s.ok()) {
        return fail(s);
      }
    }
    if (absl::Status s = CollectLayer(f, step, /*device_answers=*/true); !s.ok()) return fail(s);
    for (StepState::Batch& batch : step.batches) {
      // Waited for on the GPU too, so that the step's buffers are free once the stream is.
      if (!batch.enqueued.empty() && batch.enqueued[f] && !batch.awaited_on_device[f]) {
        if (absl::Status s = step.device_step->WaitForSelections(f); !s.ok()) return fail(s);
        batch.awaited_on_device[f] = true;
      }
    }
  }
  if (absl::Status s = model_->Synchronize(); !s.ok()) {
    return fail(absl::InternalError(absl::StrCat("the decode step's attention: ", s.message())));
  }
  step.device_step.reset();
  report_observations();
  auto sampled = step.model_step->Finish();
  if (!sampled.ok()) {
    return fail(absl::Status(sampled.status().code(), absl::StrCat("sampling the step's tokens: ",
                                                                   sampled.status().message())));
  }

  DecodeStepResult result;
  result.sequences.reserve(step.members.size());
  for (StepState::Member& m : step.members) {
    Sequence& s = *m.sequence;
    if (m.rows == 1) {
      s.length = m.first_position + 1;
    } else {
      s.pending_rows = m.rows;
    }
    SequenceStepResult& out =
        result.sequences.emplace_back(SequenceStepResult{s.id,
                                                         m.first_position,
                                                         m.blocks_scored,
                                                         m.blocks_visible,
                                                         m.audited_rows,
                                                         m.audit_miss_rate_sum,
                                                         std::move(m.audited),
                                                         {}});
    if (!sampled->empty()) {
      out.sampled_tokens.assign(sampled->begin() + m.step_row,
                                sampled->begin() + m.step_row + m.rows);
    }
  }
  result.selection_wait_seconds = std::move(step.selection_wait_seconds);
  int host_selects = 0;
  for (const StepState::Batch& batch : step.batches) {
    for (bool on_device : batch.submitted_on_device) result.device_selects += on_device;
    for (uint64_t id : batch.request_ids) host_selects += id != 0;
  }
  host_selects -= result.device_selects;
  if (metrics_ != nullptr) metrics_->RecordSelects(host_selects, result.device_selects);
  if (metrics_ != nullptr) {
    metrics_->RecordDecodeStep(absl::ToDoubleSeconds(Now() - start));
    metrics_->RecordSelectionWaits(result.selection_wait_seconds);
  }
  return result;
}

}  // namespace dsa
