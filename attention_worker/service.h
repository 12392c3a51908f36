// The attention worker service: dsa.attention.v1.AttentionService over the synthetic pattern model,
// the MLI layer schedule, a per-sequence KV cache and one selection stream per indexer worker
// (DESIGN.md sections 3, 4.3 and 5; docs/services.md "Attention worker model").
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention_worker/metrics.h"
#include "attention_worker/pattern_model.h"
#include "common/mli_schedule.h"
#include "dsa/attention/v1/attention.grpc.pb.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "transport/selection_transport.h"

namespace dsa {

/// One attended decode row, reported to AttentionWorkerOptions::observer (tests, tools).
struct AttendedRow {
  uint64_t sequence_id = 0;
  int model_layer = 0;                 // l
  int attended_full_layer = 0;         // sigma(l), a model layer index (a full layer)
  int64_t position = 0;                // the row's query position
  std::span<const int32_t> selection;  // int32 [K]: the indexer's selection of sigma(l), -1 padding
  std::span<const float> output;       // fp32 [attention_heads, kv_dim]: SparseAttention's output
};

/// The attention worker's shapes, capacity and seed (the pattern model and the MLI schedule are
/// passed separately).
struct AttentionWorkerOptions {
  /// Dk = Dv of the KV cache and of the attention queries, >= 1.
  int kv_dim = 32;
  /// Attention query heads (MQA: all share a slot's key and value), >= 1.
  int attention_heads = 8;
  /// KV slots over all sequences (one slot = one position of every model layer), >= 0. Prefill or
  /// a decode step that would pass it is RESOURCE_EXHAUSTED.
  int64_t kv_capacity_slots = int64_t{4} << 20;
  /// Seed of the KV cache and the attention queries (Philox4x32 key), see KvCacheRow.
  uint64_t seed = 0;
  /// How long a decode step awaits one selection before it fails with DEADLINE_EXCEEDED; below the
  /// coordinator's DecodeStep deadline (dsa-coordinator --rpc-timeout-ms, 30 s), so the worker
  /// gives up before its caller does.
  absl::Duration select_timeout = absl::Seconds(20);
  /// How long Prefill's unary indexer calls (GetLoad, CreateSequence, BeginTurn) may take.
  absl::Duration indexer_call_timeout = absl::Seconds(30);
  /// Threads that generate index keys and KV rows during Prefill (>= 1).
  int prefill_threads = 2;
  /// Optional: called for every attended row of every model layer during DecodeStep, on the
  /// calling thread, before the step returns (also for steps that fail later). Must be
  /// thread-safe when steps run concurrently.
  std::function<void(const AttendedRow&)> observer;
};

/// Key and value of KV slot `slot` at model layer `layer`: fp32 [kv_dim] each, uniform in [-1, 1),
/// a pure function of (seed, layer, slot) through Philox4x32-10 (common/philox.h). Sizes must
/// match (checked by the caller).
void KvCacheRow(uint64_t seed, int layer, int64_t slot, std::span<float> key_out,
                std::span<float> value_out);

/// Attention query of the decode row at `position` of model layer `layer`: fp32
/// [attention_heads, kv_dim] (out.size()), uniform in [-1, 1), a pure function of
/// (seed, layer, position) through Philox4x32-10.
void AttentionQuery(uint64_t seed, int layer, int64_t position, std::span<float> out);

/// Index keys of slots [first_slot, first_slot + num_slots) of full layer `full_layer` of a
/// sequence whose prompt has `prefix_block_ids` (one per kPrefixBlockSlots slots): slot i below
/// kPrefixBlockSlots * prefix_block_ids.size() takes offset i % 512 of block id[i / 512]
/// (PatternModel::PrefixBlockIndexKeys), other slots PatternModel::IndexKeys. Requests with equal
/// leading prefix ids thus get bit-identical keys there. out: fp32 [num_slots, head_dim].
/// Errors: the pattern model's INVALID_ARGUMENT.
absl::Status SequenceIndexKeys(const PatternModel& model,
                               std::span<const uint64_t> prefix_block_ids, int full_layer,
                               int64_t first_slot, int64_t num_slots, std::span<float> out);

/// dsa.attention.v1.AttentionService: runs its sequences' model layers (the pattern model with
/// num_layers = the schedule's full layers), holds their KV cache, owns their sequences on the
/// indexer workers, and attends at every model layer l the selection of sigma(l) (MLI paper
/// section 3 eq. (2); DESIGN.md 4.3) with the CPU SparseAttention reference.
///
/// Thread-safety: every RPC may run concurrently. Each sequence has its own lock, so a Prefill of
/// one sequence runs beside DecodeSteps of others; a DecodeStep locks its batch's sequences in
/// increasing id order. Indexer clients (stub + GrpcStreamTransport per address) are created
/// lazily, shared, and replaced when their stream has ended.
///
/// A failed decode step that the indexer may already have applied for some layers of a sequence
/// (a 1-row select updates the EMAs at once and cannot be undone; verifier rows leave steps
/// awaiting Commit) marks that sequence broken: its KV cache is rolled back, and every later
/// Prefill (continue), DecodeStep or Commit on it is FAILED_PRECONDITION naming the cause; only
/// Release works. Sequences whose requests the indexer never applied are left exactly as before.
class AttentionServiceImpl final : public dsa::attention::v1::AttentionService::Service {
 public:
  /// `model.num_layers()` must equal the number of full layers of `schedule`; `metrics` may be
  /// null (otherwise it must have schedule.num_layers() layer labels and outlive the service).
  /// Errors: INVALID_ARGUMENT (layer counts differ, kv_dim, attention_heads, capacity, threads).
  static absl::StatusOr<std::unique_ptr<AttentionServiceImpl>> Create(
      MliSchedule schedule, PatternModel model, AttentionWorkerOptions options,
      AttentionMetrics* metrics = nullptr);

  ~AttentionServiceImpl() override;

  /// Model shape and capacity. Always OK.
  grpc::Status GetInfo(grpc::ServerContext* context,
                       const dsa::attention::v1::GetInfoRequest* request,
                       dsa::attention::v1::GetInfoResponse* response) override;

  /// Prefills a sequence of context_length slots: checks the indexer's H and D (GetLoad), creates
  /// the indexer sequence (num_layers = full layers; shared prefix with prefix_source_id /
  /// prefix_slots), appends the index keys (SequenceIndexKeys) of slots [prefix_slots, context) of
  /// every full layer in one AppendIndexKeys call of fp32 chunks under kMaxAppendChunkBytes, and
  /// fills the KV cache of every model layer. With continue_sequence: appends
  /// [current length, context) after BeginTurn on the indexer (the request's prefix ids apply to
  /// the new slots). On failure nothing is left behind: the indexer sequence it created is
  /// released, the KV freed (a continue keeps the old slots; an indexer failure after BeginTurn
  /// leaves only the EMA reset). Response: slots, slots_appended per full layer, seconds.
  /// Errors: INVALID_ARGUMENT (context_length < 1, more prefix ids than ceil(context / 512),
  /// prefix_slots negative, not a multiple of 64, above the context or without prefix_source_id,
  /// no indexer_worker, top_k < 1, continue with a prefix source, another indexer or a shorter
  /// context); ALREADY_EXISTS; NOT_FOUND (continue of an unknown sequence, prefix source);
  /// FAILED_PRECONDITION (the indexer's H or D differ from the model's, a step awaits Commit, a
  /// broken sequence); RESOURCE_EXHAUSTED (KV capacity, index-key cache); UNAVAILABLE or
  /// DEADLINE_EXCEEDED (indexer unreachable; the message names the address).
  grpc::Status Prefill(grpc::ServerContext* context,
                       const dsa::attention::v1::PrefillRequest* request,
                       dsa::attention::v1::PrefillResponse* response) override;

  /// One decode step for a batch: for sequence s at position t = its length with r rows, KV rows
  /// t..t+r-1 of every model layer are written first; then for each model layer l in order: if l
  /// is full layer f, one SelectRequest per indexer worker with a RowGroup per sequence (queries
  /// and head weights of positions t..t+r-1 from PatternModel::IndexerQuery, new_index_keys =
  /// the r new keys of layer f) is submitted; then l awaits the selection of sigma(l) and runs
  /// SparseAttention for every row over the KV cache. Selections submitted but attended by no
  /// layer are collected at the end. r = 1 advances the sequence by one slot; r > 1 leaves a step
  /// awaiting Commit. Response: per sequence (request order) t, blocks scored/visible summed over
  /// the full layers, audited rows and miss-rate sum; selection_wait_seconds [num_model_layers];
  /// seconds. Errors: INVALID_ARGUMENT (no sequences, rows outside 1..5, a sequence twice);
  /// NOT_FOUND; FAILED_PRECONDITION (a step awaits Commit, broken sequence); RESOURCE_EXHAUSTED
  /// (KV capacity; index-key cache); UNAVAILABLE / DEADLINE_EXCEEDED (indexer); the indexer's
  /// status otherwise. On an error every sequence's KV is rolled back; a sequence the indexer may
  /// have advanced (an earlier full layer's select applied, or a group the indexer reports as
  /// applied) is marked broken (named in the message, see the class comment); the others are
  /// exactly as before the step.
  grpc::Status DecodeStep(grpc::ServerContext* context,
                          const dsa::attention::v1::DecodeStepRequest* request,
                          dsa::attention::v1::DecodeStepResponse* response) override;

  /// Ends a speculative step of d + 1 rows at t: commits the indexer (accepted draft tokens), then
  /// keeps KV slots up to t + accepted (length t + accepted + 1). NOT_FOUND, FAILED_PRECONDITION
  /// (nothing pending, broken), OUT_OF_RANGE (accepted outside 0..d); the indexer's status (then
  /// nothing changed here).
  grpc::Status Commit(grpc::ServerContext* context,
                      const dsa::attention::v1::CommitRequest* request,
                      dsa::attention::v1::CommitResponse* response) override;

  /// Drops the sequence's KV cache and, unless keep_indexer_sequence, releases its indexer
  /// sequence; a kept sequence with a speculative step pending is committed with 0 accepted drafts
  /// on the indexer first (a prefix donor must not await Commit). The KV is dropped whatever the
  /// indexer answers; NOT_FOUND from the indexer's Release is ignored, another indexer error is
  /// returned (the indexer sequence may remain). NOT_FOUND.
  grpc::Status Release(grpc::ServerContext* context,
                       const dsa::attention::v1::ReleaseRequest* request,
                       dsa::attention::v1::ReleaseResponse* response) override;

  /// Closes every selection stream (after the server stopped). Idempotent.
  void CloseTransports();

 private:
  struct Sequence;
  struct Peer;
  struct StepState;

  AttentionServiceImpl(MliSchedule schedule, PatternModel model, AttentionWorkerOptions options,
                       AttentionMetrics* metrics);

  absl::Status DoPrefill(const dsa::attention::v1::PrefillRequest& request,
                         dsa::attention::v1::PrefillResponse* response);
  absl::Status ContinuePrefill(const dsa::attention::v1::PrefillRequest& request,
                               dsa::attention::v1::PrefillResponse* response);
  absl::Status DoDecodeStep(const dsa::attention::v1::DecodeStepRequest& request,
                            dsa::attention::v1::DecodeStepResponse* response);
  absl::Status DoCommit(const dsa::attention::v1::CommitRequest& request);
  absl::Status DoRelease(const dsa::attention::v1::ReleaseRequest& request);

  // The indexer clients of `address` (created on first use).
  absl::StatusOr<std::shared_ptr<Peer>> GetPeer(const std::string& address);
  // Forgets `peer` if it is still the cached one for its address (its stream ended).
  void DropPeer(const std::shared_ptr<Peer>& peer);
  // Fails unless the indexer at `address` has the model's H and D.
  absl::Status CheckIndexerShape(const Peer& peer);
  // Appends the index keys of [first_slot, end_slot) of every full layer in one call.
  absl::Status AppendKeys(const Peer& peer, uint64_t sequence_id,
                          std::span<const uint64_t> prefix_block_ids, int64_t first_slot,
                          int64_t end_slot);
  // Fills the KV rows [first_slot, end_slot) of every model layer (the vectors already sized).
  void FillKv(Sequence& sequence, int64_t first_slot, int64_t end_slot) const;
  // Resizes the sequence's KV arrays to `num_slots`.
  void ResizeKv(Sequence& sequence, int64_t num_slots) const;

  // KV capacity accounting (slots over all sequences).
  absl::Status ReserveKv(int64_t num_slots);
  void FreeKv(int64_t num_slots);
  void UpdateUsageMetrics();

  std::shared_ptr<Sequence> FindSequence(uint64_t sequence_id);
  void EraseSequence(uint64_t sequence_id, const Sequence* sequence);

  const MliSchedule schedule_;
  const PatternModel model_;
  const AttentionWorkerOptions options_;
  AttentionMetrics* const metrics_;  // not owned; may be null

  std::mutex sequences_mutex_;  // guards sequences_
  absl::flat_hash_map<uint64_t, std::shared_ptr<Sequence>> sequences_;

  std::mutex kv_mutex_;  // guards kv_used_slots_
  int64_t kv_used_slots_ = 0;

  std::mutex peers_mutex_;  // guards peers_
  std::map<std::string, std::shared_ptr<Peer>> peers_;
};

}  // namespace dsa
