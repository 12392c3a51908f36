// The attention worker's engine: its sequences, their KV cache (an AttentionBackend) and their
// place on the indexer workers (IndexerClients made by an injected factory), prefill, and the
// decode step under the MLI schedule (DESIGN.md sections 3 and 4.3). No gRPC: the service
// (service.h) is a thin adapter over it, and tests drive it with fake indexer clients.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention_worker/attention_backend.h"
#include "attention_worker/attention_model.h"
#include "attention_worker/metrics.h"
#include "attention_worker/model_inputs.h"
#include "attention_worker/pattern_model.h"
#include "attention_worker/sampler.h"
#include "common/clock.h"
#include "common/mli_schedule.h"
#include "contracts/lease.h"
#include "contracts/spin_config.h"
#include "transport/indexer_client.h"

namespace dsa {

/// One attended decode row, reported to AttentionEngineOptions::observer (tests, tools).
struct AttendedRow {
  uint64_t sequence_id = 0;
  int model_layer = 0;                 // l
  int attended_full_layer = 0;         // sigma(l), a model layer index (a full layer)
  int64_t position = 0;                // the row's query position
  std::span<const int32_t> selection;  // int32 [K]: the indexer's selection of sigma(l), -1 padding
  std::span<const float> output;       // fp32 [backend output_values_per_row()]
};

/// The engine's capacity, timeouts and observer (shapes live in the model, schedule and backend).
struct AttentionEngineOptions {
  /// KV slots over all sequences (one slot = one position of every model layer), >= 0, each
  /// sequence counted in whole units of the backend's slot_granularity(). Prefill or a decode step
  /// that would pass it is RESOURCE_EXHAUSTED.
  int64_t kv_capacity_slots = int64_t{4} << 20;
  /// How long a decode step awaits one selection before it fails with DEADLINE_EXCEEDED; below the
  /// coordinator's DecodeStep deadline (dsa-coordinator --rpc-timeout-ms, 30 s), so the worker
  /// gives up before its caller does.
  absl::Duration select_timeout = absl::Seconds(20);
  /// How long Prefill's indexer calls (shape, create, begin turn, commit, release) may take.
  absl::Duration indexer_call_timeout = absl::Seconds(30);
  /// Threads that generate index keys during Prefill, and a large decode step's indexer inputs
  /// (>= 1).
  int prefill_threads = 2;
  /// The co-located, device-resident path: where the backend and an indexer
  /// client's transport share a GPU (both device_ordinal() the same, >= 0), that indexer's selects
  /// go in device form: the indexer queries are generated on the backend's stream, the selections
  /// stay on the GPU, and the layer that attends one waits for it on the GPU (an event), not on the
  /// host. An indexer that cannot take the form (UNIMPLEMENTED: its SPIN settings, auditing, a
  /// dropped device) gets the layer again with host queries, and host queries from then on.
  bool device_selects = true;
  /// The engine's time: the deadlines it gives its indexer clients (Now() plus
  /// indexer_call_timeout or select_timeout) and the durations it reports (prefill, decode step,
  /// selection waits). Its time base must be the clients': the system clock's for the gRPC,
  /// in-process and NCCL clients (SystemClock, the default); a FakeClock only with fake clients
  /// that read it too. Not owned; must outlive the engine.
  const Clock* clock = &SystemClock();
  /// Optional: called for every attended row of every model layer during DecodeStep, on the
  /// calling thread, before the step returns (also for steps that fail later). Must be
  /// thread-safe when steps run concurrently. With an observer the backend copies its outputs out.
  /// Rows attended over device-resident selections are reported at the step's end, once their
  /// host selections are read (their attention waited for the selections on the GPU alone).
  std::function<void(const AttendedRow&)> observer;
};

/// A Prefill (dsa.attention.v1.PrefillRequest in plain form).
struct PrefillSpec {
  uint64_t sequence_id = 0;
  int64_t context_length = 0;              // slots, >= 1
  std::vector<uint64_t> prefix_block_ids;  // one per 512 slots; slots beyond them are per-slot
  std::string indexer_worker;              // the sequence's indexer (address for the factory)
  /// The indexer sequence's top-K and SPIN settings (num_layers is the schedule's full layers).
  int top_k = 0;
  SpinConfig spin;
  std::optional<uint64_t> prefix_source_id;  // share the first prefix_slots slots of this one
  int64_t prefix_slots = 0;
  bool continue_sequence = false;  // extend an existing sequence and begin a new turn
  /// A real model's token ids of slots [the sequence's length (0 when new), context_length), each
  /// in [0, vocab); empty for the synthetic model.
  std::vector<int32_t> tokens;
  /// How a real model draws the sequence's tokens (kept for its decode steps).
  SamplingParams sampling;
  /// The coordinator's lease, passed to the indexer with a new sequence (empty: none). The
  /// engine keeps no lease itself: its service does (AttentionServiceImpl).
  SequenceLease lease;
};

struct PrefillResult {
  int64_t slots = 0;           // the sequence's length after prefill
  int64_t slots_appended = 0;  // index keys computed and sent per full layer (not shared)
  /// A real model: the token sampled from the last context position (for position `slots`).
  std::optional<int32_t> next_token;
};

/// One sequence of a decode step.
struct StepMember {
  uint64_t sequence_id = 0;
  int rows = 1;  // 1, or d + 1 verifier rows (d <= 4)
  /// A real model: the rows' input tokens (the last sampled token, then the d draft tokens), each
  /// in [0, vocab); empty for the synthetic model.
  std::vector<int32_t> tokens;
};

/// Per sequence of a decode step, in request order.
struct SequenceStepResult {
  uint64_t sequence_id = 0;
  int64_t first_position = 0;  // t, the position of row 0
  int64_t blocks_scored = 0;   // summed over the full layers
  int64_t blocks_visible = 0;  // summed over the full layers
  int audited_rows = 0;
  double audit_miss_rate_sum = 0;
  /// Each audited row (audited_rows of them, full layers in rank order): its full layer's rank
  /// and its miss rate, the fraction of the dense top-K its selection lost.
  struct AuditedRow {
    int full_rank = 0;
    double miss_rate = 0;
  };
  std::vector<AuditedRow> audited;
  /// A real model: per row r, the token sampled for position first_position + r + 1.
  std::vector<int32_t> sampled_tokens;
};

struct DecodeStepResult {
  std::vector<SequenceStepResult> sequences;
  /// Per model layer: how long the layer waited for its selection, seconds (0 if already there);
  /// for a device-form select, until it was enqueued on the GPU (the GPU's wait is not counted).
  std::vector<double> selection_wait_seconds;
  /// Full-layer selects of the step that went in device form (AttentionEngineOptions::
  /// device_selects), over all indexer workers.
  int device_selects = 0;
};

/// The engine's shape and load (dsa.attention.v1.GetInfoResponse).
struct AttentionEngineInfo {
  int num_model_layers = 0;
  int num_full_layers = 0;
  int lag_depth = 0;
  int num_heads = 0;   // indexer H
  int head_dim = 0;    // indexer D
  std::string model;   // "pattern" or the real model's name
  int vocab_size = 0;  // 0: the synthetic model (no tokens)
  int eos_token_id = -1;
  int64_t max_context = 0;  // 0: no model limit
  int64_t kv_capacity_slots = 0;
  int64_t kv_used_slots = 0;
  int sequences = 0;
};

/// Runs its sequences' model layers through the model seam (attention_model.h: the synthetic
/// pattern model over a KV backend, or a real model), holds their KV cache there, owns their
/// sequences on the indexer workers, and attends at every model layer l the selection of sigma(l)
/// (MLI paper section 3 eq. (2); DESIGN.md 4.3): full layer f's select is submitted as soon as its
/// inputs exist and awaited at the first layer that attends it.
///
/// Thread-safety: every method may run concurrently. Each sequence has its own lock, so a Prefill
/// of one sequence runs beside DecodeSteps of others; a DecodeStep locks its batch's sequences in
/// increasing id order. Indexer clients are made by the factory on first use of an address,
/// shared, and made again after their data plane ended (UNAVAILABLE).
///
/// A failed decode step that the indexer may already have applied for some layers of a sequence
/// (a 1-row select updates the EMAs at once and cannot be undone; verifier rows leave steps
/// awaiting Commit) marks that sequence broken: its KV cache is rolled back, and every later
/// Prefill (continue), DecodeStep or Commit on it is FAILED_PRECONDITION naming the cause; only
/// Release works. Sequences whose requests the indexer never applied are left exactly as before.
class AttentionEngine {
 public:
  /// `model`'s indexer layers must be the schedule's full layers (ModelShape::
  /// indexer_per_model_layer false) or its model layers (true); `metrics` may be null (otherwise
  /// it must have schedule.num_layers() layer labels and outlive the engine). Errors:
  /// INVALID_ARGUMENT (layer counts differ, capacity, threads, no factory, model or clock).
  static absl::StatusOr<std::unique_ptr<AttentionEngine>> Create(
      MliSchedule schedule, std::unique_ptr<AttentionModel> model,
      IndexerClientFactory indexer_clients, AttentionEngineOptions options,
      AttentionMetrics* metrics = nullptr);

  /// The synthetic model: `model.num_layers()` must equal the schedule's full layers; `backend`
  /// holds the KV of schedule.num_layers() model layers (PatternAttentionModel).
  static absl::StatusOr<std::unique_ptr<AttentionEngine>> Create(
      MliSchedule schedule, PatternModel model, std::unique_ptr<AttentionBackend> backend,
      IndexerClientFactory indexer_clients, AttentionEngineOptions options,
      AttentionMetrics* metrics = nullptr);

  ~AttentionEngine();

  const MliSchedule& schedule() const { return schedule_; }
  const AttentionModel& model() const { return *model_; }

  /// Shape and load. Never fails.
  AttentionEngineInfo GetInfo();

  /// Prefills a sequence of context_length slots: checks the indexer's H and D, creates the
  /// indexer sequence (num_layers = full layers; shared prefix with prefix_source_id /
  /// prefix_slots), appends the index keys (SequenceIndexKeys) of slots [prefix_slots, context)
  /// of every full layer in one append call, and fills the KV cache of every model layer. With
  /// continue_sequence: appends [current length, context) after BeginTurn on the indexer (the
  /// request's prefix ids apply to the new slots). On failure nothing is left behind: the indexer
  /// sequence it created is released, the KV freed (a continue keeps the old slots; an indexer
  /// failure after BeginTurn leaves only the EMA reset).
  /// Errors: INVALID_ARGUMENT (context_length < 1, more prefix ids than ceil(context / 512),
  /// prefix_slots negative, not a multiple of 64, above the context or without prefix_source_id,
  /// no indexer_worker, top_k < 1, continue with a prefix source, another indexer or a shorter
  /// context; the factory's refusal of the address); ALREADY_EXISTS; NOT_FOUND (continue of an
  /// unknown sequence, prefix source); FAILED_PRECONDITION (the indexer's H or D differ from the
  /// model's, a step awaits Commit, a broken sequence); RESOURCE_EXHAUSTED (KV capacity, the
  /// backend's memory, index-key cache, a context over 2^31 - 1 slots or the real model's
  /// context); INVALID_ARGUMENT also for tokens: a real model needs exactly the new slots' ids,
  /// each in [0, vocab), and valid sampling; the synthetic model takes none; UNAVAILABLE or
  /// DEADLINE_EXCEEDED (indexer unreachable; the message names the address).
  absl::StatusOr<PrefillResult> Prefill(const PrefillSpec& spec);

  /// One decode step for a batch (DESIGN.md 4.3): for sequence s at position t = its length with r
  /// rows (the model seam's ModelStep over every row of the batch): for each model layer l in
  /// order: if l is full layer f, one LayerSelectRequest per indexer worker with a row group per
  /// sequence (queries and head weights of positions t..t+r-1 and the r new index keys of layer
  /// f, from the model: the synthetic model's pure functions, or the real model's lightning
  /// indexer over the layer's input) is submitted; then l awaits the selection of sigma(l)
  /// (collect) and attends it for every row (attend: the synthetic model's KV rows were written at
  /// the plan, the real model's are written by the layer). Selections submitted but attended by no
  /// layer are collected at the end; a real model then samples each row's next token
  /// (SequenceStepResult::sampled_tokens). r = 1 advances the sequence by one slot; r > 1 leaves a
  /// step awaiting Commit. Errors: INVALID_ARGUMENT (no sequences, rows outside 1..5, a sequence
  /// twice, tokens: a real model needs one id a row in [0, vocab), the synthetic model none);
  /// NOT_FOUND; FAILED_PRECONDITION (a step awaits Commit, broken
  /// sequence); RESOURCE_EXHAUSTED (KV capacity; index-key cache; a real model's context, or the
  /// host or device memory for its rows' KV); INTERNAL (a device error); UNAVAILABLE /
  /// DEADLINE_EXCEEDED (indexer); the indexer's status otherwise. On an error every sequence's KV
  /// is rolled back; a sequence the indexer may have advanced (an earlier full layer's select
  /// applied, or a group the indexer reports as applied) is marked broken (named in the message,
  /// see the class comment); the others are exactly as before the step.
  absl::StatusOr<DecodeStepResult> DecodeStep(std::span<const StepMember> members);

  /// Ends a speculative step of d + 1 rows at t: commits the indexer (accepted draft tokens), then
  /// keeps KV slots up to t + accepted (length t + accepted + 1). NOT_FOUND, FAILED_PRECONDITION
  /// (nothing pending, broken), OUT_OF_RANGE (accepted outside 0..d); the indexer's status (then
  /// nothing changed here).
  absl::Status Commit(uint64_t sequence_id, int accepted);

  /// Drops the sequence's KV cache and, unless keep_indexer_sequence, releases its indexer
  /// sequence; a kept sequence with a speculative step pending is committed with 0 accepted drafts
  /// on the indexer first (a prefix donor must not await Commit). The KV is dropped whatever the
  /// indexer answers; NOT_FOUND from the indexer's Release is ignored, another indexer error is
  /// returned (the indexer sequence may remain). NOT_FOUND.
  absl::Status Release(uint64_t sequence_id, bool keep_indexer_sequence);

  /// Closes every indexer client's data plane (after the server stopped). Idempotent.
  void CloseIndexerClients();

 private:
  struct Sequence;
  struct StepState;

  AttentionEngine(MliSchedule schedule, std::unique_ptr<AttentionModel> model,
                  IndexerClientFactory indexer_clients, AttentionEngineOptions options,
                  AttentionMetrics* metrics);

  absl::StatusOr<PrefillResult> NewPrefill(const PrefillSpec& spec);
  absl::StatusOr<PrefillResult> ContinuePrefill(const PrefillSpec& spec);

  // The decode step's parts (DecodeStep): plan (checks, locks, KV rows, batches by indexer),
  // submit and collect one full layer's selects, attend one model layer, roll back on failure.
  absl::Status PlanStep(std::span<const StepMember> members, StepState& step);
  absl::Status SubmitLayer(int full_rank, StepState& step);
  // Submits full layer f for one batch (host or device form, as the batch says).
  absl::Status SubmitBatchLayer(int full_rank, int batch, StepState& step);
  // The device form's part of collecting full layer f of one batch (before CollectLayer).
  absl::Status CollectDeviceLayer(int full_rank, int batch, StepState& step);
  // Whether the batch's client takes the device-resident path (see AttentionEngineOptions).
  bool UsesDeviceSelects(const std::shared_ptr<IndexerClient>& client,
                         const std::vector<int>& members, const StepState& step);
  // Host answers of full layer f; a device-form answer already enqueued on the GPU only with
  // device_answers (the step's end).
  absl::Status CollectLayer(int full_rank, StepState& step, bool device_answers);
  absl::Status AttendLayer(int model_layer, int attended_rank, StepState& step);
  absl::Status RollbackStep(absl::Status status, StepState& step);

  // NOT_FOUND unless live; FAILED_PRECONDITION if broken or (check_pending) a step awaits Commit.
  static absl::Status CheckUsable(const Sequence& sequence, bool check_pending);
  // The client of the indexer at `address` (made on first use).
  absl::StatusOr<std::shared_ptr<IndexerClient>> GetClient(const std::string& address);
  // Forgets `client` if it is still the one for its address (its data plane ended, or its calls
  // do not reach the indexer): the next GetClient makes a new one.
  void DropClient(const std::shared_ptr<IndexerClient>& client);
  // Fails unless the indexer has the model's H and D.
  absl::Status CheckIndexerShape(IndexerClient& client);
  // Appends the index keys of [first_slot, end_slot) of every full layer in one call.
  absl::Status AppendKeys(IndexerClient& client, uint64_t sequence_id,
                          std::span<const uint64_t> prefix_block_ids, int64_t first_slot,
                          int64_t end_slot);
  absl::Time IndexerDeadline() const { return Now() + options_.indexer_call_timeout; }
  // The engine's clock (AttentionEngineOptions::clock).
  absl::Time Now() const { return options_.clock->Now(); }

  // KV capacity accounting (slots over all sequences, each sequence's rounded up to the backend's
  // slot granularity: Footprint).
  int64_t Footprint(int64_t num_slots) const;
  absl::Status ReserveKv(int64_t num_slots);
  void FreeKv(int64_t num_slots);
  // Shrinks the model's slots of `sequence` (never grows), keeping kv_slots in step.
  absl::Status ResizeKv(Sequence& sequence, int64_t num_slots);
  void UpdateUsageMetrics();

  std::shared_ptr<Sequence> FindSequence(uint64_t sequence_id);
  void EraseSequence(uint64_t sequence_id, const Sequence* sequence);

  const MliSchedule schedule_;
  const std::unique_ptr<AttentionModel> model_;
  const IndexerClientFactory indexer_clients_;
  const AttentionEngineOptions options_;
  AttentionMetrics* const metrics_;  // not owned; may be null
  std::vector<int> full_rank_;       // per model layer: its rank among the full layers, or -1

  std::mutex sequences_mutex_;  // guards sequences_
  absl::flat_hash_map<uint64_t, std::shared_ptr<Sequence>> sequences_;

  std::mutex kv_mutex_;  // guards kv_used_slots_
  int64_t kv_used_slots_ = 0;

  std::mutex clients_mutex_;  // guards clients_ and host_only_clients_
  std::map<std::string, std::shared_ptr<IndexerClient>> clients_;
  // Clients whose indexer refused a device-form select (UNIMPLEMENTED): host queries from then on.
  std::map<const IndexerClient*, bool> host_only_clients_;
  // The device-resident path: whether the backend's EnableDeviceSelects ran (and how it ended).
  std::mutex device_selects_mutex_;
  bool device_selects_tried_ = false;
  absl::Status device_selects_status_;
};

}  // namespace dsa
