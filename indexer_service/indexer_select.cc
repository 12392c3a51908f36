// The indexer engine's select path (see indexer.h): checking a select, planning the blocks,
// scoring, top-K, audits, the SPIN update, SelectBatch and the device-resident handoff.
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/philox.h"
#include "common/status_macros.h"
#include "indexer_service/indexer.h"
#include "indexer_service/sparsity_controller.h"
#include "indexer_service/topk.h"

namespace dsa {
namespace {

absl::Status CheckFinite(std::span<const float> values, const char* what, size_t row) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " of row ", row, " has a non-finite value at index ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Indexer::CheckSelectLocked(uint64_t sequence_id, int layer,
                                        std::span<const IndexerRow> rows, PreparedSelect* prepared,
                                        bool device_queries) {
  auto found = Find(sequence_id);
  if (!found.ok()) return found.status();
  SequenceState& state = **found;
  auto view = cache_.View(sequence_id, layer);
  if (!view.ok()) return view.status();
  if (rows.empty()) return absl::InvalidArgumentError("select needs at least one row");
  const size_t query_size = static_cast<size_t>(options_.num_heads) * options_.head_dim;
  std::vector<int64_t> positions;
  positions.reserve(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    if (device_queries != (rows[r].device_query != nullptr)) {
      return absl::InvalidArgumentError(
          device_queries
              ? absl::StrCat("row ", r, " of a device-resident select has no device query")
              : absl::StrCat("row ", r,
                             " has a device query but the select has no device "
                             "handoff (SelectBatch with a DeviceHandoff)"));
    }
    if (!device_queries && rows[r].query.size() != query_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("indexer query of row ", r, " has ", rows[r].query.size(),
                       " values, expected H ", options_.num_heads, " x D ", options_.head_dim));
    }
    if (rows[r].head_weights.size() != static_cast<size_t>(options_.num_heads)) {
      return absl::InvalidArgumentError(absl::StrCat("head weights of row ", r, " have ",
                                                     rows[r].head_weights.size(),
                                                     " values, expected ", options_.num_heads));
    }
    if (auto s = CheckFinite(rows[r].query, "indexer query", r); !s.ok()) return s;  // host only
    if (auto s = CheckFinite(rows[r].head_weights, "head weights", r); !s.ok()) return s;
    if (rows[r].position < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", r, " has negative position ", rows[r].position));
    }
    if (r > 0 && rows[r].position <= rows[r - 1].position) {
      return absl::InvalidArgumentError(absl::StrCat("positions must be strictly increasing: row ",
                                                     r, " at ", rows[r].position, " after ",
                                                     rows[r - 1].position));
    }
    if (rows[r].position >= view->num_slots) {
      return absl::OutOfRangeError(absl::StrCat("row ", r, " at position ", rows[r].position,
                                                " but layer ", layer, " holds ", view->num_slots,
                                                " slots; append the row's index key first"));
    }
    positions.push_back(rows[r].position);
  }
  if (positions[0] <= state.last_position[layer]) {
    return absl::InvalidArgumentError(
        absl::StrCat("position ", positions[0], " is not after layer ", layer,
                     "'s last selected position ", state.last_position[layer]));
  }
  if (rows.size() > 1) {
    // Verifier rows are the d + 1 positions t..t+d whose keys were appended last.
    if (positions.back() - positions[0] != static_cast<int64_t>(rows.size()) - 1 ||
        positions.back() != view->num_slots - 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "verifier rows must be consecutive and end at the newest slot ", view->num_slots - 1,
          "; got ", rows.size(), " rows from ", positions[0], " to ", positions.back()));
    }
  }
  if (!state.pending[layer].positions.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("layer ", layer, " of sequence ", sequence_id,
                                                      " has a speculative step awaiting Commit"));
  }
  if (state.pending_rows > 0 && (static_cast<int>(rows.size()) != state.pending_rows ||
                                 positions[0] != state.pending_first_position)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "this speculative step has ", state.pending_rows, " rows from position ",
        state.pending_first_position, "; got ", rows.size(), " rows from ", positions[0]));
  }
  prepared->sequence_id = sequence_id;
  prepared->layer = layer;
  prepared->state = &state;
  prepared->view = *view;
  prepared->rows = rows;
  prepared->positions = std::move(positions);
  return absl::OkStatus();
}

namespace {

using Clock = std::chrono::steady_clock;

// Rows of one device-resident select at most (the CUDA query staging's grid; more are refused).
constexpr size_t kMaxDeviceSelectRows = 65535;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

void Indexer::PlanSelectLocked(PreparedSelect& prepared) {
  SequenceState& state = *prepared.state;
  if (state.spin_on_device && DeviceActiveLocked()) {
    // The device plans (SelectWithSpin); only the turn's warm-up flag is kept here.
    prepared.spin_on_device = true;
    prepared.all_blocks_on_device =
        state.spin[prepared.layer].TakeWarmup() || !state.options.spin.enabled;
    prepared.result.top_k = state.options.top_k;
    prepared.result.blocks_visible = CeilDiv(prepared.positions.back() + 1, kBlockSize);
    return;
  }
  prepared.spin_on_device = false;
  const auto start = Clock::now();
  BlockPlan plan = prepared.state->spin[prepared.layer].Plan(prepared.positions);
  SelectResult& result = prepared.result;
  result.phase_seconds.predict = SecondsSince(start);
  result.top_k = prepared.state->options.top_k;
  result.blocks = std::move(plan.blocks);
  result.blocks_scored = static_cast<int64_t>(result.blocks.size());
  result.blocks_visible = plan.visible_blocks;
  result.all_blocks = plan.all_blocks;
  prepared.scores.resize(prepared.rows.size() * result.blocks.size() * kBlockSize);
}

namespace {

// Each row's top-K over the blocks it scored: scores [rows, blocks * 64] in ScoreBlocks' layout,
// row r masked past rows[r].position; selections [rows, top_k].
void SelectTopKRows(std::span<const float> scores, std::span<const int32_t> blocks,
                    std::span<const IndexerRow> rows, int top_k, std::span<int32_t> selections) {
  const size_t stride = blocks.size() * kBlockSize;
  for (size_t r = 0; r < rows.size(); ++r) {
    SelectTopK(scores.subspan(r * stride, stride), blocks, rows[r].position,
               selections.subspan(r * top_k, top_k));
  }
}

}  // namespace

void Indexer::FinishSelectLocked(PreparedSelect& prepared) {
  SelectResult& result = prepared.result;
  SequenceState& state = *prepared.state;
  const int layer = prepared.layer;
  const std::span<const IndexerRow> rows = prepared.rows;
  const std::vector<int64_t>& positions = prepared.positions;
  std::vector<float>& scores = prepared.scores;
  auto phase_start = Clock::now();
  if (!result.on_device) {
    result.selections.resize(rows.size() * result.top_k);
    SelectTopKRows(scores, result.blocks, rows, result.top_k, result.selections);
    result.phase_seconds.topk = SecondsSince(phase_start);
  }
  if (rows.size() == 1) {
    if (!prepared.spin_on_device) {  // on the device, SelectWithSpin updated the EMAs
      phase_start = Clock::now();
      state.spin[layer].Update(positions[0], result.blocks, scores);
      result.phase_seconds.update = SecondsSince(phase_start);
    }
    state.last_position[layer] = positions[0];
  } else {
    PendingStep& pending = state.pending[layer];
    pending.positions = positions;
    pending.blocks = result.blocks;
    pending.on_device = prepared.spin_on_device;
    if (!prepared.spin_on_device) pending.scores = scores;
    state.pending_rows = static_cast<int>(rows.size());
    state.pending_first_position = positions[0];
  }
  if (!result.all_blocks && options_.audit_fraction > 0 &&
      AuditDraw(prepared.sequence_id, layer, positions[0]) < options_.audit_fraction) {
    // Dense re-score of every visible block for the audit; the EMAs never see these scores.
    std::vector<int32_t> dense(rows.size() * result.top_k);
    SelectDenseLocked(prepared.view, result.blocks_visible, rows, result.top_k, dense);
    for (size_t r = 0; r < rows.size(); ++r) {
      result.audit_miss_rates.push_back(SelectionMissRate(
          std::span<const int32_t>(result.selections.data() + r * result.top_k, result.top_k),
          std::span<const int32_t>(dense.data() + r * result.top_k, result.top_k)));
    }
  }
  result.spin = state.spin_config.enabled;
  result.target_block_sparsity = result.spin ? state.spin_config.target_block_sparsity : 0.0;
  if (state.miss_target > 0) AdaptSparsityLocked(state, result, positions[0]);
  if (prepared.return_scores) result.scores = std::move(scores);
}

void Indexer::AdaptSparsityLocked(SequenceState& state, const SelectResult& result,
                                  int64_t first_position) {
  double observed = 0;
  if (!result.audit_miss_rates.empty()) {
    for (double rate : result.audit_miss_rates) observed += rate;
    observed /= static_cast<double>(result.audit_miss_rates.size());
  } else if (!(result.all_blocks && state.spin_config.target_block_sparsity == 0 &&
               first_position + 1 > result.top_k)) {
    // Nothing observed: an unaudited pruned select, a warm-up, or a row that sees at most K slots.
    // At rho 0 a long row's select pruned nothing, so its miss is 0 without an audit, which lets
    // rho rise again.
    return;
  }
  const double rho =
      NextTargetSparsity(state.spin_config.target_block_sparsity, observed, state.miss_target);
  state.spin_config.target_block_sparsity = rho;
  for (SpinState& layer : state.spin) layer.set_target_block_sparsity(rho);
}

void Indexer::ScoreSelectsLocked(std::span<PreparedSelect> prepared) {
  std::vector<PreparedSelect*> spin_on_device, planned;
  for (PreparedSelect& p : prepared) (p.spin_on_device ? spin_on_device : planned).push_back(&p);
  if (!spin_on_device.empty() && !SelectSpinOnDeviceLocked(spin_on_device)) {
    // The device failed and was dropped: these selects are planned again, on the CPU (a warm-up:
    // their EMAs were on the device).
    for (PreparedSelect* p : spin_on_device) {
      PlanSelectLocked(*p);
      planned.push_back(p);
    }
  }
  if (!planned.empty()) ScorePlannedLocked(planned);
}

namespace {

// A ScoreAndSelect error after which the device is kept and the batch runs on the CPU: a job it
// does not implement, or scratch memory that could not grow (nothing ran on the device).
bool DeviceDeclined(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnimplemented ||
         status.code() == absl::StatusCode::kResourceExhausted;
}

// A shared pass's device or CPU time, charged to each select by its share of the scored blocks:
// phase_seconds.scan and .topk of every select.
template <typename Prepared>
void ChargeShares(std::span<Prepared* const> prepared, double scan_seconds, double topk_seconds) {
  int64_t total_blocks = 0;
  for (const Prepared* q : prepared) total_blocks += q->result.blocks_scored;
  for (Prepared* p : prepared) {
    const double share = total_blocks == 0 ? 0.0
                                           : static_cast<double>(p->result.blocks_scored) /
                                                 static_cast<double>(total_blocks);
    p->result.phase_seconds.scan = scan_seconds * share;
    p->result.phase_seconds.topk = topk_seconds * share;
  }
}

}  // namespace

bool Indexer::SelectSpinOnDeviceLocked(std::span<PreparedSelect* const> prepared,
                                       const DeviceHandoff* handoff,
                                       std::span<int32_t* const> device_selections) {
  std::vector<DeviceSpinJob> jobs(prepared.size());
  for (size_t i = 0; i < prepared.size(); ++i) {
    PreparedSelect& p = *prepared[i];
    p.result.selections.resize(p.rows.size() * p.result.top_k);
    jobs[i].view = &p.view;
    jobs[i].sequence_id = p.sequence_id;
    jobs[i].layer = p.layer;
    jobs[i].rows = p.rows;
    jobs[i].config = &p.state->spin_config;
    jobs[i].top_k = p.result.top_k;
    jobs[i].all_blocks = p.all_blocks_on_device;
    jobs[i].blocks = &p.result.blocks;
    jobs[i].scores = p.return_scores ? &p.scores : nullptr;
    jobs[i].selections = p.result.selections;
    if (handoff != nullptr) {
      jobs[i].handoff = handoff;
      jobs[i].device_selections = device_selections[i];
    }
  }
  DeviceScoreSeconds seconds;
  const absl::Status status = device_->SelectWithSpin(jobs, options_.num_heads, &seconds);
  if (!status.ok()) {
    DropDeviceLocked(status);
    return false;
  }
  for (PreparedSelect* p : prepared) {
    SelectResult& result = p->result;
    result.blocks_scored = static_cast<int64_t>(result.blocks.size());
    result.all_blocks = result.blocks_scored == result.blocks_visible;
    result.on_device = true;
  }
  // The device's whole select: plan, scan, top-K and update in one pass, charged as the scan.
  ChargeShares(prepared, seconds.scan, seconds.topk);
  return true;
}

void Indexer::ScorePlannedLocked(std::span<PreparedSelect* const> prepared) {
  if (DeviceActiveLocked()) {
    std::vector<DeviceScoreJob> jobs(prepared.size());
    for (size_t i = 0; i < prepared.size(); ++i) {
      PreparedSelect& p = *prepared[i];
      p.result.selections.resize(p.rows.size() * p.result.top_k);
      jobs[i] = {&p.view, p.result.blocks, p.rows, p.result.top_k, p.scores, p.result.selections};
    }
    DeviceScoreSeconds seconds;
    const absl::Status status = device_->ScoreAndSelect(jobs, options_.num_heads, &seconds);
    if (status.ok()) {
      for (PreparedSelect* p : prepared) p->result.on_device = true;
      ChargeShares(prepared, seconds.scan, seconds.topk);
      return;
    }
    if (!DeviceDeclined(status)) DropDeviceLocked(status);
  }
  std::vector<ScoreJob> jobs(prepared.size());
  for (size_t i = 0; i < prepared.size(); ++i) {
    jobs[i] = {&prepared[i]->view, prepared[i]->result.blocks, prepared[i]->rows,
               prepared[i]->scores};
  }
  const auto start = Clock::now();
  ScoreBlockBatch(jobs, options_.num_heads);
  const double scan_seconds = SecondsSince(start);
  // The CPU's top-K runs (and is timed) in FinishSelectLocked.
  ChargeShares(prepared, scan_seconds, /*topk_seconds=*/0.0);
}

void Indexer::SelectDenseLocked(const KeyCacheView& view, int64_t num_blocks,
                                std::span<const IndexerRow> rows, int top_k,
                                std::span<int32_t> selections) {
  std::vector<int32_t> all(num_blocks);
  for (size_t j = 0; j < all.size(); ++j) all[j] = static_cast<int32_t>(j);
  if (DeviceActiveLocked()) {
    const DeviceScoreJob job{&view, all, rows, top_k, {}, selections};
    DeviceScoreSeconds seconds;
    const absl::Status status = device_->ScoreAndSelect(std::span<const DeviceScoreJob>(&job, 1),
                                                        options_.num_heads, &seconds);
    if (status.ok()) return;
    if (!DeviceDeclined(status)) DropDeviceLocked(status);
  }
  std::vector<float> scores(rows.size() * all.size() * kBlockSize);
  ScoreBlocks(view, all, rows, options_.num_heads, scores);
  SelectTopKRows(scores, all, rows, top_k, selections);
}

absl::Status Indexer::SelectOneLocked(uint64_t sequence_id, int layer,
                                      std::span<const IndexerRow> rows, bool return_scores,
                                      PreparedSelect& prepared) {
  DSA_RETURN_IF_ERROR(CheckSelectLocked(sequence_id, layer, rows, &prepared));
  prepared.return_scores = return_scores;
  PlanSelectLocked(prepared);
  ScoreSelectsLocked(std::span<PreparedSelect>(&prepared, 1));
  FinishSelectLocked(prepared);
  return absl::OkStatus();
}

absl::StatusOr<SelectResult> Indexer::Select(uint64_t sequence_id, int layer,
                                             std::span<const IndexerRow> rows, bool return_scores) {
  std::lock_guard<std::mutex> lock(mutex_);
  PreparedSelect prepared;
  DSA_RETURN_IF_ERROR(SelectOneLocked(sequence_id, layer, rows, return_scores, prepared));
  return std::move(prepared.result);
}

absl::StatusOr<std::vector<SelectResult>> Indexer::SelectOnDeviceLocked(
    std::span<const SelectGroup> groups, const DeviceHandoff& handoff, size_t* groups_applied) {
  if (!DeviceActiveLocked() || device_->device_ordinal() < 0) {
    return absl::UnimplementedError(absl::StrCat(
        "device-resident selects need an active scoring device that takes device queries; this "
        "indexer scores on ",
        device_ == nullptr ? "the CPU" : device_->Describe(),
        device_status_.ok() ? "" : absl::StrCat(" (dropped: ", device_status_.message(), ")")));
  }
  if (options_.audit_fraction > 0) {
    return absl::UnimplementedError(
        "device-resident selects are not audited (audit_fraction > 0 needs host queries)");
  }
  size_t total_rows = 0;
  for (const SelectGroup& g : groups) total_rows += g.rows.size();
  if (total_rows > kMaxDeviceSelectRows) {
    return absl::UnimplementedError(absl::StrCat("a device-resident select of ", total_rows,
                                                 " rows is above the device's ",
                                                 kMaxDeviceSelectRows));
  }
  std::vector<PreparedSelect> prepared(groups.size());
  std::vector<int32_t*> device_selections(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t h = 0; h < g; ++h) {
      if (groups[g].sequence_id == groups[h].sequence_id) {
        return absl::UnimplementedError(absl::StrCat("groups ", h, " and ", g,
                                                     " of a device-resident "
                                                     "select address the same sequence ",
                                                     groups[g].sequence_id));
      }
    }
    auto found = Find(groups[g].sequence_id);
    if (found.ok() && (*found)->options.top_k != handoff.top_k) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group ", g, ": sequence ", groups[g].sequence_id, " has K = ", (*found)->options.top_k,
          " but the device-resident select's selections hold K = ", handoff.top_k, " a row"));
    }
    if (found.ok() && !(*found)->spin_on_device) {
      return absl::UnimplementedError(absl::StrCat(
          "group ", g, ": sequence ", groups[g].sequence_id,
          "'s SPIN settings do not run on the scoring device, so it needs host queries"));
    }
    if (groups[g].device_selections == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("group ", g, " of a device-resident select has no device_selections"));
    }
    if (auto s = CheckSelectLocked(groups[g].sequence_id, groups[g].layer, groups[g].rows,
                                   &prepared[g], /*device_queries=*/true);
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("group ", g, ": ", s.message()));
    }
    device_selections[g] = groups[g].device_selections;
  }
  std::vector<PreparedSelect*> all(prepared.size());
  for (size_t g = 0; g < prepared.size(); ++g) {
    PlanSelectLocked(prepared[g]);  // spin_on_device: keeps only the warm-up flag
    all[g] = &prepared[g];
  }
  // Whether the device got as far as handing the selections over (then a consumer may have read
  // them: a failure after that is the select's error, not a refusal).
  bool enqueued = false;
  DeviceHandoff watched = handoff;
  watched.on_enqueued = [&enqueued, &handoff] {
    enqueued = true;
    if (handoff.on_enqueued) handoff.on_enqueued();
  };
  if (!SelectSpinOnDeviceLocked(all, &watched, device_selections)) {
    // Dropped (every SPIN-on-device sequence restarts with a warm-up on the CPU); the rows'
    // queries are on the device, so nothing is scored again here. Before the hand-over nothing
    // was applied or read: the caller may send host queries (UNIMPLEMENTED, as a refusal).
    const std::string why =
        absl::StrCat("the scoring device failed and was dropped: ", device_status_.message());
    if (!enqueued) {
      return absl::UnimplementedError(
          absl::StrCat("device-resident select refused (send host queries): ", why));
    }
    return absl::InternalError(absl::StrCat("device-resident select: ", why));
  }
  std::vector<SelectResult> results;
  results.reserve(groups.size());
  for (PreparedSelect& p : prepared) {
    FinishSelectLocked(p);
    results.push_back(std::move(p.result));
  }
  if (groups_applied != nullptr) *groups_applied = groups.size();
  return results;
}

absl::StatusOr<std::vector<SelectResult>> Indexer::SelectBatch(std::span<const SelectGroup> groups,
                                                               size_t* groups_applied,
                                                               const DeviceHandoff* handoff) {
  if (groups_applied != nullptr) *groups_applied = 0;
  if (groups.empty()) return absl::InvalidArgumentError("select needs at least one group");
  const int64_t head_dim = options_.head_dim;
  std::lock_guard<std::mutex> lock(mutex_);
  // Removes the new keys of groups [from, to), newest first.
  auto undo_appends = [&](size_t from, size_t to) {
    for (size_t g = to; g-- > from;) {
      if (!groups[g].new_index_keys.empty()) {
        (void)TruncateIndexKeysLocked(groups[g].sequence_id, groups[g].layer,
                                      groups[g].new_keys_first_slot);
      }
    }
  };
  for (size_t g = 0; g < groups.size(); ++g) {
    const SelectGroup& group = groups[g];
    if (group.new_index_keys.empty()) continue;
    absl::Status appended;
    if (group.new_index_keys.size() % static_cast<size_t>(head_dim) != 0) {
      appended = absl::InvalidArgumentError(
          absl::StrCat(group.new_index_keys.size(), " values, not a multiple of D = ", head_dim));
    } else if (absl::StatusOr<int64_t> slots = cache_.NumSlots(group.sequence_id, group.layer);
               !slots.ok()) {
      appended = slots.status();
    } else if (*slots != group.new_keys_first_slot) {
      appended = absl::FailedPreconditionError(
          absl::StrCat("they go at slot ", group.new_keys_first_slot, " but layer ", group.layer,
                       " holds ", *slots, " slots (another call appended)"));
    } else {
      appended =
          AppendIndexKeysLocked(group.sequence_id, group.layer, group.new_index_keys,
                                static_cast<int64_t>(group.new_index_keys.size()) / head_dim);
    }
    if (!appended.ok()) {
      undo_appends(0, g);  // groups before g appended; g did not
      return absl::Status(appended.code(),
                          absl::StrCat("group ", g, " new_index_keys: ", appended.message()));
    }
  }
  size_t applied = 0;
  absl::StatusOr<std::vector<SelectResult>> results = SelectBatchLocked(groups, &applied, handoff);
  if (groups_applied != nullptr) *groups_applied = applied;
  if (!results.ok()) undo_appends(applied, groups.size());
  return results;
}

absl::StatusOr<std::vector<SelectResult>> Indexer::SelectBatchLocked(
    std::span<const SelectGroup> groups, size_t* groups_applied, const DeviceHandoff* handoff) {
  *groups_applied = 0;
  if (handoff != nullptr) return SelectOnDeviceLocked(groups, *handoff, groups_applied);
  std::vector<PreparedSelect> prepared(groups.size());
  auto group_error = [](size_t g, const absl::Status& status) {
    return absl::Status(status.code(), absl::StrCat("group ", g, ": ", status.message()));
  };
  bool repeated_sequence = false;
  for (size_t g = 0; g < groups.size() && !repeated_sequence; ++g) {
    for (size_t h = 0; h < g; ++h) {
      repeated_sequence = repeated_sequence || groups[g].sequence_id == groups[h].sequence_id;
    }
  }
  std::vector<SelectResult> results;
  results.reserve(groups.size());
  if (repeated_sequence) {
    // A sequence twice in one batch (several layers of one step, or later positions): a group's
    // checks depend on the groups before it, so they run one after another.
    for (size_t g = 0; g < groups.size(); ++g) {
      if (auto s = SelectOneLocked(groups[g].sequence_id, groups[g].layer, groups[g].rows,
                                   /*return_scores=*/false, prepared[g]);
          !s.ok()) {
        return group_error(g, s);
      }
      results.push_back(std::move(prepared[g].result));
      if (groups_applied != nullptr) *groups_applied = g + 1;
    }
    return results;
  }
  // Distinct sequences: every check first (nothing changes on an error), then one scoring pass
  // over all groups' blocks.
  for (size_t g = 0; g < groups.size(); ++g) {
    if (auto s =
            CheckSelectLocked(groups[g].sequence_id, groups[g].layer, groups[g].rows, &prepared[g]);
        !s.ok()) {
      return group_error(g, s);
    }
  }
  for (PreparedSelect& p : prepared) PlanSelectLocked(p);
  ScoreSelectsLocked(prepared);
  for (size_t g = 0; g < groups.size(); ++g) {
    FinishSelectLocked(prepared[g]);
    results.push_back(std::move(prepared[g].result));
  }
  if (groups_applied != nullptr) *groups_applied = groups.size();
  return results;
}

double Indexer::AuditDraw(uint64_t sequence_id, int layer, int64_t position) const {
  const uint64_t key = MixSeed(options_.audit_seed, sequence_id);
  const PhiloxCounter counter{{static_cast<uint32_t>(position),
                               static_cast<uint32_t>(static_cast<uint64_t>(position) >> 32),
                               static_cast<uint32_t>(layer), 0xA0D17u}};
  return UniformFloat(
      Philox4x32(counter, PhiloxKey{{static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)}})
          .c[0]);
}

}  // namespace dsa
