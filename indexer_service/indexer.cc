// The indexer engine (see indexer.h): sequences, index-key appends, Commit, Release and the
// accessors; the select path is in indexer_select.cc.
#include "indexer_service/indexer.h"

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/philox.h"
#include "common/status_macros.h"

namespace dsa {

absl::StatusOr<std::unique_ptr<Indexer>> Indexer::Create(const IndexerOptions& options,
                                                         std::unique_ptr<ScoringDevice> device,
                                                         DeviceFailureCallback on_device_failure) {
  if (options.num_heads < 1 || options.num_heads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_heads must be in [1, 1024], got ", options.num_heads));
  }
  if (!(options.audit_fraction >= 0.0 && options.audit_fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("audit_fraction must be in [0, 1], got ", options.audit_fraction));
  }
  if (!(options.miss_target >= 0.0 && options.miss_target < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("miss_target must be in [0, 1), got ", options.miss_target));
  }
  if (options.miss_target > 0 && options.audit_fraction == 0) {
    return absl::InvalidArgumentError(
        "a miss target needs audit_fraction > 0 (the audits are the controller's feedback)");
  }
  auto cache = IndexKeyCache::Create(options.capacity_blocks, options.head_dim);
  if (!cache.ok()) return cache.status();
  std::unique_ptr<Indexer> indexer(new Indexer(options, std::move(*cache)));
  if (device != nullptr) {
    DSA_RETURN_IF_ERROR(device->Attach(indexer->cache_.pool(), options.num_heads));
    indexer->device_ordinal_.store(device->device_ordinal(), std::memory_order_release);
    indexer->device_ = std::move(device);
    indexer->on_device_failure_ = std::move(on_device_failure);
  }
  return indexer;
}

std::string Indexer::DeviceDescription() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (device_ == nullptr) return "cpu";
  if (device_status_.ok()) return device_->Describe();
  return absl::StrCat(device_->Describe(), " (dropped: ", device_status_.ToString(), ")");
}

absl::Status Indexer::DeviceStatus() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (device_ == nullptr) return absl::FailedPreconditionError("no scoring device: CPU scoring");
  return device_status_;
}

int Indexer::DeviceOrdinal() const { return device_ordinal_.load(std::memory_order_acquire); }

void Indexer::DropDeviceLocked(const absl::Status& status) {
  device_status_ = status.ok() ? absl::InternalError("scoring device failed") : status;
  device_ordinal_.store(-1, std::memory_order_release);
  for (auto& [id, state] : sequences_) {
    if (!state.spin_on_device) continue;
    state.spin_on_device = false;
    for (SpinState& spin : state.spin) spin.BeginTurn();  // the EMAs were on the device
  }
  if (on_device_failure_) on_device_failure_(device_status_);
}

absl::Status Indexer::ValidateSequenceOptions(const SequenceOptions& options) const {
  if (options.num_layers < 1 || options.num_layers > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers must be in [1, 4096], got ", options.num_layers));
  }
  if (options.top_k < 1 || options.top_k > kMaxTopK) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k must be in [1, ", kMaxTopK, "] (kMaxTopK), got ", options.top_k));
  }
  DSA_RETURN_IF_ERROR(ValidateSpinConfig(options.spin));
  if (options.spin.enabled && options.spin.miss_target.value_or(0) > 0 &&
      options_.audit_fraction == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "miss target ", *options.spin.miss_target,
        " needs audits: this indexer runs with audit_fraction 0 (dsa-indexer --audit-fraction)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Indexer::SequenceState*> Indexer::Find(uint64_t sequence_id) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end())
    return absl::NotFoundError(absl::StrCat("unknown sequence ", sequence_id));
  return &it->second;
}

absl::StatusOr<const Indexer::SequenceState*> Indexer::Find(uint64_t sequence_id) const {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end())
    return absl::NotFoundError(absl::StrCat("unknown sequence ", sequence_id));
  return &it->second;
}

void Indexer::AddSequenceState(uint64_t sequence_id, const SequenceOptions& options) {
  SequenceState state;
  state.options = options;
  // Exploration is seeded per sequence (DESIGN.md 4.2 step 5): the configured seed mixed with the
  // id.
  SpinConfig spin = options.spin;
  spin.seed = MixSeed(options.spin.seed, sequence_id);
  for (int l = 0; l < options.num_layers; ++l) state.spin.emplace_back(spin, options.top_k, l);
  state.spin_config = spin;
  state.miss_target = spin.enabled ? spin.miss_target.value_or(options_.miss_target) : 0.0;
  state.spin_on_device = DeviceActiveLocked() && device_->RunsSpin(spin, options.top_k);
  state.pending.resize(options.num_layers);
  state.last_position.assign(options.num_layers, -1);
  sequences_.emplace(sequence_id, std::move(state));
}

absl::Status Indexer::CreateSequence(uint64_t sequence_id, const SequenceOptions& options) {
  if (auto s = ValidateSequenceOptions(options); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto s = cache_.AddSequence(sequence_id, options.num_layers); !s.ok()) return s;
  AddSequenceState(sequence_id, options);
  return absl::OkStatus();
}

absl::Status Indexer::CreateSequenceFromPrefix(uint64_t sequence_id, const SequenceOptions& options,
                                               uint64_t source_id, int64_t num_prefix_slots) {
  if (auto s = ValidateSequenceOptions(options); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto source = sequences_.find(source_id);
      source != sequences_.end() && source->second.pending_rows > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prefix source ", source_id, " has a speculative step awaiting Commit; share after it"));
  }
  if (auto s = cache_.AddSequenceWithPrefix(sequence_id, options.num_layers, source_id,
                                            num_prefix_slots);
      !s.ok()) {
    return s;
  }
  AddSequenceState(sequence_id, options);
  return absl::OkStatus();
}

absl::Status Indexer::AppendIndexKeys(uint64_t sequence_id, int layer, std::span<const float> keys,
                                      int64_t num_keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  return AppendIndexKeysLocked(sequence_id, layer, keys, num_keys);
}

absl::Status Indexer::AppendIndexKeysAt(uint64_t sequence_id, int layer, int64_t first_slot,
                                        std::span<const float> keys, int64_t num_keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  DSA_ASSIGN_OR_RETURN(const int64_t slots, cache_.NumSlots(sequence_id, layer));
  if (first_slot != slots) {
    return absl::FailedPreconditionError(absl::StrCat("first_slot ", first_slot, " but layer ",
                                                      layer, " of sequence ", sequence_id,
                                                      " holds ", slots, " slots"));
  }
  return AppendIndexKeysLocked(sequence_id, layer, keys, num_keys);
}

absl::Status Indexer::AppendIndexKeysLocked(uint64_t sequence_id, int layer,
                                            std::span<const float> keys, int64_t num_keys) {
  auto state = Find(sequence_id);
  if (!state.ok()) return state.status();
  // A layer whose own verifier rows await Commit takes no keys (Commit truncates it); the other
  // layers may, since a layer's index keys depend on the layers before it in the same step.
  if (layer >= 0 && layer < (*state)->options.num_layers &&
      !(*state)->pending[layer].positions.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " of sequence ", sequence_id,
                     " has a speculative step awaiting Commit; append after it"));
  }
  // The device mirrors the blocks written (and a copy-on-write block, which takes the old last
  // block's place); without one, nothing more is looked up.
  const bool mirror = DeviceActiveLocked() && num_keys > 0;
  absl::StatusOr<int64_t> first_slot = 0;
  if (mirror) first_slot = cache_.NumSlots(sequence_id, layer);
  DSA_RETURN_IF_ERROR(cache_.Append(sequence_id, layer, keys, num_keys));
  if (mirror) {
    auto view = cache_.View(sequence_id, layer);
    DSA_CHECK(view.ok() && first_slot.ok(), "an appended layer has a view");
    if (auto s = device_->MirrorBlocks(view->block_table.subspan(*first_slot / kBlockSize));
        !s.ok()) {
      DropDeviceLocked(s);  // the host copy holds the keys: nothing is lost
    }
  }
  return absl::OkStatus();
}

absl::Status Indexer::TruncateIndexKeys(uint64_t sequence_id, int layer, int64_t num_slots) {
  std::lock_guard<std::mutex> lock(mutex_);
  return TruncateIndexKeysLocked(sequence_id, layer, num_slots);
}

absl::Status Indexer::TruncateIndexKeysLocked(uint64_t sequence_id, int layer, int64_t num_slots) {
  auto found = Find(sequence_id);
  if (!found.ok()) return found.status();
  const SequenceState& state = **found;
  if (layer < 0 || layer >= state.options.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range [0, ", state.options.num_layers, ")"));
  }
  if (!state.pending[layer].positions.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " of sequence ", sequence_id,
                     " has a speculative step awaiting Commit; truncate after it"));
  }
  if (num_slots >= 0 && num_slots <= state.last_position[layer]) {
    return absl::FailedPreconditionError(absl::StrCat("truncating layer ", layer, " to ", num_slots,
                                                      " slots would drop selected position ",
                                                      state.last_position[layer]));
  }
  return cache_.Truncate(sequence_id, layer, num_slots);
}

absl::Status Indexer::Commit(uint64_t sequence_id, int accepted) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = Find(sequence_id);
  if (!found.ok()) return found.status();
  SequenceState& state = **found;
  if (state.pending_rows == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", sequence_id, " has no speculative step to commit"));
  }
  if (accepted < 0 || accepted >= state.pending_rows) {
    return absl::OutOfRangeError(absl::StrCat("accepted ", accepted, " outside [0, ",
                                              state.pending_rows - 1, "] draft tokens"));
  }
  const size_t replay_rows = state.options.spin.spec_update == SpecUpdatePolicy::kRow0
                                 ? 1
                                 : static_cast<size_t>(accepted) + 1;
  const int64_t keep_slots = state.pending_first_position + accepted + 1;
  for (int l = 0; l < state.options.num_layers; ++l) {
    PendingStep& pending = state.pending[l];
    if (!pending.positions.empty()) {
      if (pending.on_device) {
        // The scores are on the device; after a device failure the EMAs restart (warm-up) and
        // there is nothing to replay.
        if (state.spin_on_device && DeviceActiveLocked()) {
          if (auto st = device_->CommitSpin(sequence_id, l, static_cast<int>(replay_rows));
              !st.ok()) {
            DropDeviceLocked(st);
          }
        }
      } else {
        const size_t row_stride = pending.blocks.size() * kBlockSize;
        for (size_t r = 0; r < replay_rows; ++r) {
          state.spin[l].Update(
              pending.positions[r], pending.blocks,
              std::span<const float>(pending.scores.data() + r * row_stride, row_stride));
        }
      }
      pending = PendingStep{};
      state.last_position[l] = keep_slots - 1;
    }
    auto slots = cache_.NumSlots(sequence_id, l);
    DSA_CHECK(slots.ok(), "a sequence's layer vanished during Commit");
    if (*slots > keep_slots) {
      DSA_CHECK(cache_.Truncate(sequence_id, l, keep_slots).ok(), "truncate within the length");
    }
  }
  state.pending_rows = 0;
  state.pending_first_position = -1;
  return absl::OkStatus();
}

absl::Status Indexer::BeginTurn(uint64_t sequence_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = Find(sequence_id);
  if (!found.ok()) return found.status();
  if ((*found)->pending_rows > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", sequence_id, " has a speculative step awaiting Commit"));
  }
  for (SpinState& spin : (*found)->spin) spin.BeginTurn();
  if ((*found)->spin_on_device && DeviceActiveLocked()) {
    if (auto st = device_->ResetSpin(sequence_id); !st.ok()) DropDeviceLocked(st);
  }
  return absl::OkStatus();
}

absl::Status Indexer::Release(uint64_t sequence_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sequences_.contains(sequence_id)) {
    return absl::NotFoundError(absl::StrCat("unknown sequence ", sequence_id));
  }
  if (auto s = cache_.RemoveSequence(sequence_id); !s.ok()) return s;
  if (device_ != nullptr) device_->ReleaseSpin(sequence_id);
  sequences_.erase(sequence_id);
  return absl::OkStatus();
}

absl::StatusOr<int> Indexer::TopK(uint64_t sequence_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  DSA_ASSIGN_OR_RETURN(const SequenceState* state, Find(sequence_id));
  return state->options.top_k;
}

absl::StatusOr<int64_t> Indexer::NumSlots(uint64_t sequence_id, int layer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cache_.NumSlots(sequence_id, layer);
}

absl::StatusOr<SpinState> Indexer::GetSpinState(uint64_t sequence_id, int layer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = Find(sequence_id);
  if (!found.ok()) return found.status();
  if (layer < 0 || layer >= (*found)->options.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  SpinState spin = (*found)->spin[layer];
  if ((*found)->spin_on_device && DeviceActiveLocked()) {
    std::vector<float> vertical, diagonal;
    const absl::Status read = device_->ReadSpin(sequence_id, layer, &vertical, &diagonal);
    if (read.ok()) {
      spin.SetEmas(std::move(vertical), std::move(diagonal));
    } else if (read.code() != absl::StatusCode::kNotFound) {  // NOT_FOUND: never selected
      return read;
    }
  }
  return spin;
}

CacheUsage Indexer::Usage() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cache_.Usage();
}

int64_t Indexer::num_sequences() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(sequences_.size());
}

}  // namespace dsa
