// What the coordinator's engine (engine.h) takes and gives, in plain form: a Generate request, the
// events of its stream and the client's side of the call (GenerateStream), and GetLoad's answer.
// Each struct is its dsa.coordinator.v1 message (proto/dsa/coordinator/v1/coordinator.proto) field
// for field, presence kept; the gRPC adapter (service.h) is the only place they meet the protos.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "coordinator/served_model.h"

namespace dsa {

/// A request's settings over the coordinator's flags (Overrides): unset takes the flag.
struct GenerateOverrides {
  std::optional<double> target_block_sparsity;  // SPIN rho in [0, 1)
  std::optional<double> exploration_fraction;   // SPIN gamma in [0, 1)
  std::optional<int32_t> top_k;                 // K, in [1, kMaxTopK]
  std::optional<bool> all_keep;                 // SPIN off
  std::optional<double> acceptance_rate;        // the pattern model's acceptance, [0, 1]
  std::optional<double> miss_target;            // adaptive sparsity's target miss rate, [0, 1)
};

/// How a real model samples the request's tokens (SamplingParams).
struct GenerateSampling {
  float temperature = 0;  // 0: greedy; else in (0, 100]
  float top_p = 0;        // in [0, 1]; 0 means 1
  /// The sampler's seed; unset on a sampled request: the coordinator picks one at admission.
  std::optional<uint64_t> seed;
};

/// A Generate request (GenerateRequest in plain form). The context is `context_tokens` when set,
/// else `context_length` (the proto's oneof: the adapter sets at most one; neither is refused).
struct GenerateSpec {
  std::string request_id;                              // 1..128 bytes, unique per caller in flight
  std::optional<int64_t> context_length;               // tokens (slots), >= 1 (the pattern model)
  std::optional<std::vector<int32_t>> context_tokens;  // token ids, >= 1 of them, each >= 0
  /// One id per 512 context slots at most, only with context_length (with context_tokens the
  /// coordinator derives them from the tokens).
  std::vector<uint64_t> prefix_block_ids;
  int64_t max_new_tokens = 0;  // >= 1
  int32_t draft_length = 0;    // speculative draft d, in [0, kMaxDraftLength]
  GenerateOverrides overrides;
  std::string session_id;  // "" or at most 128 bytes: requests of one id continue one sequence
  GenerateSampling sampling;
  std::vector<int32_t> stop_token_ids;  // at most kMaxStopTokenIds, each >= 0
  bool ignore_eos = false;              // a real model goes on past its end-of-sequence token
};

/// Why a request finished (FinishReason; the same values).
enum class FinishReason {
  kUnspecified = 0,
  kLength = 1,     // max_new_tokens generated (always, for the pattern model)
  kEos = 2,        // the model's end-of-sequence token (unless ignore_eos)
  kStopToken = 3,  // one of the request's stop_token_ids
};

/// The first event of a stream: the request was placed and prefilled (Admitted).
struct AdmittedEvent {
  double queue_seconds = 0;  // arrival to admission
  std::string indexer_worker;
  std::string attention_worker;
  int64_t prefix_slots_reused = 0;  // slots shared from a sequence already on the indexer worker
  double prefill_seconds = 0;
};

/// The tokens of one decode step (or, for a real model's first token, of the prefill) (Tokens).
struct TokensEvent {
  int64_t first_position = 0;  // of the first token
  int32_t count = 0;           // tokens
  int32_t drafted = 0;         // draft tokens verified in this step (rows - 1)
  int32_t accepted = 0;
  double step_seconds = 0;                     // the decode step (or the prefill)
  int64_t blocks_scored = 0;                   // over the step's full layers
  int64_t blocks_visible = 0;                  // over the step's full layers
  int32_t audited_rows = 0;                    // rows the indexer audited
  double audit_miss_rate_sum = 0;              // over the audited rows
  std::vector<double> selection_wait_seconds;  // per model layer
  std::vector<int32_t> token_ids;              // a real model's `count` ids
};

/// The last event of a stream that completed (Finished).
struct FinishedEvent {
  int64_t generated_tokens = 0;
  double time_to_first_token_seconds = 0;       // from the Generate call's arrival
  double mean_inter_token_latency_seconds = 0;  // over the tokens after the first step's
  int32_t migrations = 0;                       // moves off a failed worker
  FinishReason finish_reason = FinishReason::kUnspecified;
  std::optional<int32_t> stop_token_id;  // the end-of-sequence or stop token that ended it
};

/// One event of a Generate stream (GenerateEvent's oneof).
using GenerateEvent = std::variant<AdmittedEvent, TokensEvent, FinishedEvent>;

/// The client's side of one Generate call, as its transport gives it to the engine (the gRPC
/// adapter wraps the ServerWriter and ServerContext; the tests give a recorder).
class GenerateStream {
 public:
  virtual ~GenerateStream() = default;
  /// Sends one event, blocking while the client's flow control is full; false when the call is
  /// gone (the client left, or the call was cancelled).
  virtual bool Write(const GenerateEvent& event) = 0;
  /// Whether the call was cancelled (the client cancelled, its deadline passed, the server is
  /// shutting down, or TryCancel).
  virtual bool IsCancelled() = 0;
  /// Cancels the call from another thread: a Write in progress returns false.
  virtual void TryCancel() = 0;
};

/// One indexer worker in GetLoad's answer (WorkerLoad).
struct IndexerWorkerLoad {
  std::string address;
  int64_t cache_blocks_used = 0;      // 64-slot blocks over all layers
  int64_t cache_blocks_capacity = 0;  // 64-slot blocks over all layers
  int32_t sequences = 0;
  bool ready = false;  // new sequences are placed here
  // The coordinator's last check reached it. When not, the figures above are 0 (what it held is
  // unknown) and `unreached_for_ms` says since when no check has reached it.
  bool reachable = true;
  int64_t unreached_for_ms = 0;
};

/// One attention worker in GetLoad's answer (AttentionWorkerLoad).
struct AttentionWorkerLoad {
  std::string address;
  bool ready = false;     // new sequences are placed here
  int32_t decoding = 0;   // sequences in its decode loop
  bool reachable = true;  // as IndexerWorkerLoad's
  int64_t unreached_for_ms = 0;
};

/// GetLoad's answer (GetLoadResponse).
struct CoordinatorLoad {
  int32_t queued = 0;
  int32_t running = 0;                // prefilling or decoding
  int64_t cache_blocks_used = 0;      // over the reachable indexer workers
  int64_t cache_blocks_capacity = 0;  // over the reachable indexer workers
  int64_t retained_sequences = 0;     // finished sequences kept as prefix donors or sessions
  std::vector<IndexerWorkerLoad> indexer_workers;
  std::vector<AttentionWorkerLoad> attention_workers;  // not retired
  std::optional<ServedModel> model;  // unset before the first attention worker was taken in
};

}  // namespace dsa
