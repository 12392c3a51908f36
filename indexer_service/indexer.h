// The indexer engine of one indexer worker: the paged index-key cache of its sequences, SPIN per
// full layer, scoring, top-K and deferred speculative updates (DESIGN.md 4). Scoring and top-K run
// on the CPU, or on a ScoringDevice (the CUDA backend) that mirrors the cache.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "contracts/limits.h"
#include "contracts/sequence.h"
#include "indexer_service/index_key_cache.h"
#include "indexer_service/scoring.h"
#include "indexer_service/scoring_device.h"
#include "indexer_service/spin.h"

namespace dsa {

/// Shapes and capacity of one indexer worker.
struct IndexerOptions {
  int64_t capacity_blocks = 0;  // pool size in 64-slot blocks, shared by all sequences and layers
  int num_heads = 64;           // H of the indexer query
  int head_dim = 128;           // D of index keys and queries
  /// Fraction of pruned selects (SPIN skipped blocks) that are audited, in [0, 1]: every row is
  /// also scored densely and its miss rate against the dense top-K reported. The draw is a pure
  /// function of (audit_seed, sequence, layer, first position). 0 = no audit.
  double audit_fraction = 0;
  uint64_t audit_seed = 0;
  /// The adaptive-sparsity miss target of sequences whose SPIN settings name none, in [0, 1); 0 =
  /// rho fixed (sparsity_controller.h). A target needs audit_fraction > 0: the audits are its
  /// feedback.
  double miss_target = 0;
};

/// Called once, under the engine's lock (do not call back into the Indexer), with the error of a
/// scoring device that failed and was dropped; the CPU serves on from then.
using DeviceFailureCallback = std::function<void(const absl::Status&)>;

/// Time of the phases of one Select (DESIGN.md 4.2 steps 2-8), seconds: wall time on the steady
/// clock on the CPU. A pass shared by a batch (the CPU's scan, or the device's) is charged to each
/// select by its share of the scored blocks; on a device, scan and topk are its event times, and
/// with SPIN on the device the whole select (plan, scan, top-K, update) is charged as scan and
/// topk, predict and update staying 0.
struct SelectPhaseSeconds {
  double predict = 0;  // SPIN plan: block scores, budget, exploration
  double scan = 0;     // scoring the chosen blocks
  double topk = 0;     // top-K of every row
  double update = 0;   // EMA update; 0 for verifier rows (deferred to Commit)
};

/// The outcome of one Select.
struct SelectResult {
  int top_k = 0;
  /// int32 [num_rows, top_k], row-major; best first, -1 padding.
  std::vector<int32_t> selections;
  /// fp32 [num_rows, blocks.size() * 64]: the scores of the scored blocks, as ScoreBlocks lays them
  /// out (-inf beyond a row's position). Filled only when requested.
  std::vector<float> scores;
  /// The scored logical blocks (sorted).
  std::vector<int32_t> blocks;
  int64_t blocks_scored = 0;   // blocks.size()
  int64_t blocks_visible = 0;  // ceil(N_t / 64) for the last row
  bool all_blocks = false;     // every visible block was scored (SPIN off, warm-up, N_t <= K)
  bool on_device = false;      // scan and top-K ran on the scoring device (not the CPU)
  SelectPhaseSeconds phase_seconds;
  /// When this select was audited (IndexerOptions::audit_fraction): per row, the miss rate of its
  /// selection against the dense top-K of the same row; empty otherwise. Auditing costs a dense
  /// scan and changes nothing else (the EMAs see only the pruned scores).
  std::vector<double> audit_miss_rates;
  /// The SPIN target block sparsity rho this select planned with (0 with SPIN off); with a miss
  /// target the controller may move the sequence's rho after it.
  double target_block_sparsity = 0;
  bool spin = false;  // SPIN planned this select (false: all-keep)
};

/// One group of a batched select: rows of one sequence at one layer (see Indexer::Select).
struct SelectGroup {
  uint64_t sequence_id = 0;
  int layer = 0;
  std::span<const IndexerRow> rows;
  /// With a DeviceHandoff (SelectBatch): device int32 [rows, K] that receives the selections.
  int32_t* device_selections = nullptr;
  /// Optional: the step's new index keys of this layer, fp32 [n, D] (finite; the caller checks),
  /// appended before the rows select at slot `new_keys_first_slot`, which must then be the layer's
  /// slot count. The appends, the selects and the undo of the appends of every group not applied
  /// run under one lock (SelectBatch), so no other call can append between them.
  std::span<const float> new_index_keys;
  int64_t new_keys_first_slot = 0;
};

/// Thread-safe (one mutex; a Select scores with all cores, or on the scoring device).
class Indexer {
 public:
  /// With `device` (optional), scan and top-K run on it and every append is mirrored to it; the
  /// host cache stays authoritative, so a device error drops the device (DeviceStatus,
  /// `on_device_failure` when given) and the CPU serves the same call and every later one. A batch
  /// the device does not implement (UNIMPLEMENTED, e.g. K above its largest) runs on the CPU.
  /// Errors: INVALID_ARGUMENT for a negative capacity, num_heads / head_dim outside [1, 1024], or
  /// audit_fraction outside [0, 1]; the device's Attach errors.
  static absl::StatusOr<std::unique_ptr<Indexer>> Create(
      const IndexerOptions& options, std::unique_ptr<ScoringDevice> device = nullptr,
      DeviceFailureCallback on_device_failure = nullptr);

  const IndexerOptions& options() const { return options_; }

  /// "cpu", or the scoring device's description (with "(dropped: ...)" after a failure).
  std::string DeviceDescription() const;
  /// OK while scoring runs on the device; the error that dropped it after a failure;
  /// FAILED_PRECONDITION when there is no device.
  absl::Status DeviceStatus() const;

  /// Creates an empty sequence. ALREADY_EXISTS; INVALID_ARGUMENT (num_layers < 1, top_k < 1, SPIN
  /// settings out of range).
  absl::Status CreateSequence(uint64_t sequence_id, const SequenceOptions& options);
  /// Creates a sequence whose layers start with `source_id`'s first num_prefix_slots slots, sharing
  /// their blocks (num_prefix_slots a multiple of 64). Errors as CreateSequence plus NOT_FOUND
  /// (source), INVALID_ARGUMENT (prefix length, layer count mismatch) and FAILED_PRECONDITION (the
  /// source has a speculative step awaiting Commit: its newest keys may still be rejected).
  absl::Status CreateSequenceFromPrefix(uint64_t sequence_id, const SequenceOptions& options,
                                        uint64_t source_id, int64_t num_prefix_slots);

  /// Appends index keys fp32 [num_keys, head_dim] to one layer (prefill, restore, or a decode
  /// step's new keys). During a speculative step a layer takes its d + 1 draft keys before its own
  /// Select (layer by layer, as a model computes them). Errors: NOT_FOUND, INVALID_ARGUMENT (layer,
  /// shape, non-finite), RESOURCE_EXHAUSTED (pool full, or the layer would pass 2^31 slots; nothing
  /// written), FAILED_PRECONDITION (this layer's verifier rows await Commit).
  absl::Status AppendIndexKeys(uint64_t sequence_id, int layer, std::span<const float> keys,
                               int64_t num_keys);

  /// Shortens one layer to `num_slots` slots, undoing appends that no Select has used yet (the
  /// service rolls back a failed multi-chunk append with it). Only slots after the layer's last
  /// selected position can be removed. Errors: NOT_FOUND; INVALID_ARGUMENT (layer); OUT_OF_RANGE
  /// (num_slots < 0 or above the layer's length); FAILED_PRECONDITION (the layer has verifier
  /// rows awaiting Commit, or num_slots would drop a selected slot).
  absl::Status TruncateIndexKeys(uint64_t sequence_id, int layer, int64_t num_slots);

  /// Selects the top-K slots for one row (a decode step) or d+1 verifier rows (positions t..t+d,
  /// consecutive, t+d the layer's newest slot) of one sequence at one layer: SPIN plan, scoring of
  /// the chosen blocks, top-K per row. One row updates the EMAs at once; several rows defer the
  /// update to Commit(). Each row's key must already be appended (position < the layer's slots),
  /// and positions only move forward: t must be after the layer's last selected position.
  /// Errors: NOT_FOUND; INVALID_ARGUMENT (layer, no rows, query or weight shape, non-finite query
  /// or weight, negative position, positions not strictly increasing within the call or not after
  /// the last selected one, verifier rows not consecutive or not ending at the newest slot, a
  /// different row set than this step's other layers); OUT_OF_RANGE (position >= slots);
  /// FAILED_PRECONDITION (this layer already has a step awaiting Commit).
  absl::StatusOr<SelectResult> Select(uint64_t sequence_id, int layer,
                                      std::span<const IndexerRow> rows, bool return_scores = false);

  /// Select for a batch of groups of many sequences in one call (DESIGN.md 3: the indexer batches
  /// rows of many sequences into one pass): each group as Select would run it, in order, with
  /// every group's chosen blocks scored in one parallel pass. When every group has its own
  /// sequence, all groups are checked before anything runs, so an error changes nothing. When a
  /// sequence appears in several groups (its layers of one step), the groups run one after
  /// another and an error in group g leaves groups 0..g-1 applied. `groups_applied` (optional)
  /// gets the number of groups applied. Errors: Select's, with the message prefixed "group g: ";
  /// INVALID_ARGUMENT for an empty batch. Results in group order; phase_seconds.scan of a shared
  /// pass is split over the groups by their scored blocks.
  ///
  /// With `handoff` (the co-located, device-resident path; scoring_device.h DeviceHandoff): every
  /// row's query is IndexerRow::device_query (in the scoring device's memory: the Indexer checks
  /// its shape nowhere and its values are not checked for finiteness; the producer is the
  /// attention worker of this process), every group names its device_selections, and the device
  /// writes the selections there as well as into the results. Refused with UNIMPLEMENTED before
  /// anything changes (the caller then sends host queries) when no active scoring device has a
  /// device_ordinal() >= 0, auditing is on (audit_fraction > 0: the audit reads host queries), a
  /// sequence appears twice, a group's SPIN does not run on the device (RunsSpin), the batch has
  /// more than 65,535 rows, or the device fails before it handed the selections over (it is then
  /// dropped, as below);
  /// INVALID_ARGUMENT when a row has no device query or a group no device_selections. A device
  /// failure after the hand-over drops the device and fails the batch with INTERNAL, nothing
  /// applied (these rows cannot be scored on the CPU: their queries are on the device). Without
  /// `handoff`, a row with a device_query is INVALID_ARGUMENT.
  ///
  /// New index keys (SelectGroup::new_index_keys): every group's are appended first, all or none,
  /// each at its new_keys_first_slot (FAILED_PRECONDITION "group g new_index_keys: ..." when the
  /// layer's slot count differs: another caller appended; the pool's RESOURCE_EXHAUSTED); when the
  /// batch then fails, the new keys of the groups it did not apply are removed again. All of it
  /// under the Indexer's one lock.
  absl::StatusOr<std::vector<SelectResult>> SelectBatch(std::span<const SelectGroup> groups,
                                                        size_t* groups_applied = nullptr,
                                                        const DeviceHandoff* handoff = nullptr);

  /// The CUDA ordinal of an active scoring device that takes device-resident selects (SelectBatch
  /// with a DeviceHandoff), or -1 (no device, a dropped one, or one that takes host queries only).
  int DeviceOrdinal() const;

  /// Ends a speculative step: `accepted` draft tokens were accepted (0..d). For every layer with a
  /// pending step, replays rows 0..accepted in order into the EMAs (or row 0 only under
  /// kRow0 update) and drops the others; truncates every layer's cache to t + accepted + 1 slots.
  /// Errors: NOT_FOUND; FAILED_PRECONDITION (nothing pending); OUT_OF_RANGE (accepted < 0 or > d).
  absl::Status Commit(uint64_t sequence_id, int accepted);

  /// Starts a new turn: every layer's EMAs reset and the next Select is a warm-up (paper 3.2).
  /// Errors: NOT_FOUND; FAILED_PRECONDITION (a speculative step is pending).
  absl::Status BeginTurn(uint64_t sequence_id);

  /// Drops the sequence and its blocks. NOT_FOUND if unknown.
  absl::Status Release(uint64_t sequence_id);

  /// AppendIndexKeys when the layer holds exactly `first_slot` slots, checked under the same lock
  /// as the append (so two callers cannot both pass the check); FAILED_PRECONDITION "first_slot
  /// ... but layer ... holds ..." otherwise, nothing appended.
  absl::Status AppendIndexKeysAt(uint64_t sequence_id, int layer, int64_t first_slot,
                                 std::span<const float> keys, int64_t num_keys);

  /// The sequence's K (SequenceOptions::top_k). NOT_FOUND.
  absl::StatusOr<int> TopK(uint64_t sequence_id) const;
  /// Slots filled at (sequence, layer). NOT_FOUND, INVALID_ARGUMENT.
  absl::StatusOr<int64_t> NumSlots(uint64_t sequence_id, int layer) const;
  /// A copy of the SPIN state of (sequence, layer), for tests and tools. With SPIN on the device,
  /// V and D are the device's (read back); the rest is the host's bookkeeping (no block ages).
  /// NOT_FOUND, INVALID_ARGUMENT; INTERNAL when the device's copy cannot be read.
  absl::StatusOr<SpinState> GetSpinState(uint64_t sequence_id, int layer) const;
  CacheUsage Usage() const;
  int64_t num_sequences() const;

 private:
  struct PendingStep {
    std::vector<int64_t> positions;
    std::vector<int32_t> blocks;
    std::vector<float> scores;  // [rows, blocks * 64]; empty when they stay on the device
    bool on_device = false;     // the device keeps the scores (ScoringDevice::CommitSpin)
  };
  struct SequenceState {
    SequenceOptions options;
    std::vector<SpinState> spin;          // per layer
    std::vector<PendingStep> pending;     // per layer; empty positions = none
    std::vector<int64_t> last_position;   // per layer: last selected (committed) position, -1 none
    int64_t pending_first_position = -1;  // t of the pending speculative step, -1 = none
    int pending_rows = 0;
    SpinConfig spin_config;       // options.spin with the seed mixed with the sequence id
    double miss_target = 0;       // adaptive sparsity's target (0 = rho fixed)
    bool spin_on_device = false;  // V and D live on the scoring device (RunsSpin)
  };
  // One select between its checks and its finish (all under mutex_).
  struct PreparedSelect {
    uint64_t sequence_id = 0;
    int layer = 0;
    SequenceState* state = nullptr;
    KeyCacheView view;
    std::span<const IndexerRow> rows;
    std::vector<int64_t> positions;
    SelectResult result;
    std::vector<float> scores;  // [rows, blocks * 64]
    bool return_scores = false;
    // SPIN runs on the device for this select (planned there; PlanSelectLocked kept only the
    // warm-up flag): all_blocks_on_device says whether it scores every visible block.
    bool spin_on_device = false;
    bool all_blocks_on_device = false;
  };
  // Scores every prepared select's blocks (PlanSelectLocked done) on the device, or the CPU when
  // there is none, it does not implement the batch or it fails (then it is dropped). On the
  // device, top-K runs there too (result.on_device; FinishSelectLocked skips its own).
  void ScoreSelectsLocked(std::span<PreparedSelect> prepared);
  // Scan and top-K for selects planned on the CPU (device ScoreAndSelect, or the CPU).
  void ScorePlannedLocked(std::span<PreparedSelect* const> prepared);
  // The whole select on the device for selects whose SPIN runs there; false when the device
  // failed (it is dropped, and these selects are planned again on the CPU).
  // With `handoff` (every select's SPIN on the device), the device-resident select of SelectBatch;
  // on failure the device is dropped as well but nothing is planned again.
  bool SelectSpinOnDeviceLocked(std::span<PreparedSelect* const> prepared,
                                const DeviceHandoff* handoff = nullptr,
                                std::span<int32_t* const> device_selections = {});
  // The dense top-K of `rows` over blocks [0, num_blocks) of `view` (the audit), on the device
  // when there is one. selections: [rows, top_k].
  void SelectDenseLocked(const KeyCacheView& view, int64_t num_blocks,
                         std::span<const IndexerRow> rows, int top_k,
                         std::span<int32_t> selections);
  bool DeviceActiveLocked() const { return device_ != nullptr && device_status_.ok(); }
  // Drops the device after `status`: every sequence whose SPIN ran there restarts with a warm-up
  // select on the CPU (its EMAs were on the device), and pending device steps replay nothing.
  void DropDeviceLocked(const absl::Status& status);
  // Every check of Select; fills prepared's sequence, view, rows and positions. Changes nothing.
  // With device_queries, every row's query is its device_query (not checked); without, a row
  // with a device_query is refused.
  absl::Status CheckSelectLocked(uint64_t sequence_id, int layer, std::span<const IndexerRow> rows,
                                 PreparedSelect* prepared, bool device_queries = false);
  // The device-resident SelectBatch (SelectBatch's `handoff`), under mutex_.
  absl::StatusOr<std::vector<SelectResult>> SelectOnDeviceLocked(
      std::span<const SelectGroup> groups, const DeviceHandoff& handoff, size_t* groups_applied);
  // SPIN's plan (clears the warm-up flag) and the score buffer.
  void PlanSelectLocked(PreparedSelect& prepared);
  // Top-K, EMA update or pending step, audit; the scores into the result with return_scores.
  void FinishSelectLocked(PreparedSelect& prepared);
  // Moves the sequence's rho after a select (sparsity_controller.h) when it has a miss target.
  void AdaptSparsityLocked(SequenceState& state, const SelectResult& result,
                           int64_t first_position);
  // One select, start to finish (check, plan, score, finish) into `prepared`; Select's errors.
  absl::Status SelectOneLocked(uint64_t sequence_id, int layer, std::span<const IndexerRow> rows,
                               bool return_scores, PreparedSelect& prepared);

  explicit Indexer(const IndexerOptions& options, IndexKeyCache cache)
      : options_(options), cache_(std::move(cache)) {}
  absl::Status ValidateSequenceOptions(const SequenceOptions& options) const;
  // Uniform [0, 1) draw deciding whether a select is audited.
  double AuditDraw(uint64_t sequence_id, int layer, int64_t position) const;
  void AddSequenceState(uint64_t sequence_id, const SequenceOptions& options);
  absl::StatusOr<SequenceState*> Find(uint64_t sequence_id);
  absl::StatusOr<const SequenceState*> Find(uint64_t sequence_id) const;
  // AppendIndexKeys and TruncateIndexKeys with mutex_ held.
  absl::Status AppendIndexKeysLocked(uint64_t sequence_id, int layer, std::span<const float> keys,
                                     int64_t num_keys);
  absl::Status TruncateIndexKeysLocked(uint64_t sequence_id, int layer, int64_t num_slots);
  // SelectBatch's selects (without the new keys), mutex_ held.
  absl::StatusOr<std::vector<SelectResult>> SelectBatchLocked(std::span<const SelectGroup> groups,
                                                              size_t* groups_applied,
                                                              const DeviceHandoff* handoff);

  IndexerOptions options_;
  mutable std::mutex mutex_;
  IndexKeyCache cache_;
  std::unique_ptr<ScoringDevice> device_;
  DeviceFailureCallback on_device_failure_;
  absl::Status device_status_;  // OK while the device serves; why it was dropped otherwise
  // device_->device_ordinal() while the device serves, -1 otherwise (read without mutex_: the
  // transport asks it while a select holds the lock).
  std::atomic<int> device_ordinal_{-1};
  absl::flat_hash_map<uint64_t, SequenceState> sequences_;
};

}  // namespace dsa
