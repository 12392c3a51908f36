// `dsa replay`: sends a production trace (trace.h) to a coordinator's Generate at the trace's
// arrival times, with caps and a client-side concurrency limit, and reports latency, throughput,
// realized block sparsity, audited miss rate, prefix reuse, cache use, selection wait and
// speculative acceptance (docs/services.md). Against a real model the contexts are real text
// (ContextTokenSource) and the report adds finish reasons and sample outputs' token ids.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "server/security.h"
#include "tools/dsa/trace.h"

namespace dsa {

/// Caps on the trace's requests; 0 = no cap.
struct ReplayCaps {
  int64_t limit = 0;        // only the first `limit` requests
  int64_t max_context = 0;  // context = min(input, max_context); prefix ids cut to ceil(ctx/512)
  int64_t max_output = 0;   // max_new_tokens = min(output, max_output)
};

/// The first `caps.limit` requests of `requests`, each with its context, prefix block ids and
/// output length capped.
std::vector<TraceRequest> ApplyCaps(std::vector<TraceRequest> requests, const ReplayCaps& caps);

/// The trace's own bound on prefix reuse, by the coordinator's sharing rule: for each request, the
/// leading run of its prefix block ids that earlier requests of `requests` had as whole blocks of
/// their prompts (ids are chained hashes, so an equal id means an equal prefix up to that block),
/// times 512 slots, capped at its context rounded down to 64. What a cluster that kept every
/// earlier prompt forever, with no concurrency, could share.
int64_t ReusablePrefixSlots(const std::vector<TraceRequest>& requests);

/// Real text for a real model's replay (docs/services.md, "Real tokens"): a corpus of token ids
/// (the held-out split, python_docs_heldout.npy) cut into 512-token slices, one per trace prefix
/// block, so that requests whose trace hash ids are equal get identical tokens in those blocks and
/// the coordinator's content hashing of context_tokens shares exactly what the trace shares.
/// Immutable after Create; thread-safe.
class ContextTokenSource {
 public:
  /// Multiplier of BlockOffset: a prime, so id -> offset is one to one for ids below the number of
  /// slice offsets (corpora under 10^9 tokens).
  static constexpr uint64_t kOffsetMultiplier = 1000000007;

  /// `tokens`: the corpus, at least kPrefixBlockTokens ids, each >= 0.
  /// INVALID_ARGUMENT when shorter or an id is negative.
  static absl::StatusOr<ContextTokenSource> Create(std::vector<int32_t> tokens);

  /// The context_tokens of request `index` of a (capped) trace: request.context_tokens ids; block
  /// j (slots [512 j, 512 (j + 1)), cut at the context's end) is the corpus slice at
  /// BlockOffset(prefix_block_ids[j]) when the trace has an id for it, else at
  /// UnsharedBlockOffset(index, j).
  std::vector<int32_t> Context(const TraceRequest& request, int64_t index) const;

  /// The first slot of trace prefix block id `id`'s slice: (id * kOffsetMultiplier) mod
  /// num_offsets(), num_offsets() = corpus size - 511 (every slice is whole).
  int64_t BlockOffset(uint64_t id) const;
  /// The slice of a block without a trace id: a SplitMix64 hash of (index, block) mod
  /// num_offsets(); deterministic, and another request's only by chance.
  int64_t UnsharedBlockOffset(int64_t index, int64_t block) const;

  int64_t num_offsets() const {
    return static_cast<int64_t>(tokens_.size()) - kPrefixBlockTokens + 1;
  }
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  int32_t max_token() const { return max_token_; }

 private:
  explicit ContextTokenSource(std::vector<int32_t> tokens);

  std::vector<int32_t> tokens_;
  int32_t max_token_ = 0;
};

/// A real model's sampling for every request of a replay (GenerateRequest.sampling): greedy when
/// temperature is 0; else temperature and top-p, request i drawing with seed `seed` + i.
struct ReplaySampling {
  float temperature = 0;
  float top_p = 0;  // 0 = 1 (no cut)
  uint64_t seed = 0;
  bool ignore_eos = false;  // GenerateRequest.ignore_eos
};

/// How to replay.
struct ReplayOptions {
  std::string coordinator;  // host:port of dsa.coordinator.v1.CoordinatorService
  ClientSecurity security;  // how it is dialed (TLS, client certificate, bearer token)
  ReplayCaps caps;          // recorded in the report (the requests given are already capped)
  double time_scale = 1.0;  // arrival time x scale; 0 = send as fast as max_in_flight allows
  int max_in_flight = 16;   // concurrent Generate streams; later requests wait client-side
  int draft_length = 2;     // speculative draft length d (GenerateRequest.draft_length, 0..4)
  int sample_ms = 500;      // GetLoad sampling period for cache use over time
  int64_t request_timeout_ms = 600000;  // deadline of each Generate stream
  /// Progress on this stream (a redrawn bar on a TTY, else a line every progress_period_ms);
  /// nullptr = none.
  FILE* progress = nullptr;
  int progress_period_ms = 5000;
  /// Set from another thread (a signal) to stop: nothing more is sent and streams in flight are
  /// cancelled (they count as failed, CANCELLED). May be null.
  const std::atomic<bool>* stop = nullptr;
  /// A real model: each context is real text from this source, sent as context_tokens (never
  /// prefix_block_ids: the coordinator derives them from the tokens), with `sampling`; the
  /// coordinator must serve a real model (its GetLoad model has a vocabulary) whose vocabulary
  /// holds every corpus id. Null: the pattern model's context_length with the trace's prefix ids
  /// (and a coordinator serving a real model is refused: FAILED_PRECONDITION). Not owned.
  const ContextTokenSource* tokens = nullptr;
  std::string token_file;  // where `tokens` came from (for the report)
  ReplaySampling sampling;
  /// A real model: the report keeps the generated token ids of the first `sample_outputs`
  /// requests of the trace (and the last kSampleContextTailTokens ids of their contexts).
  int sample_outputs = 3;
};

/// Context ids kept before each sample output (ReplayOptions::sample_outputs).
inline constexpr int kSampleContextTailTokens = 48;

/// What one request did, from its Generate stream.
struct RequestRecord {
  int64_t index = 0;           // position in the (capped) trace
  int64_t context_tokens = 0;  // as sent
  int64_t max_new_tokens = 0;  // as sent
  bool sent = false;           // its Generate call was made
  int status_code = 0;         // grpc::StatusCode of the stream (0 = OK)
  std::string error;           // the status message when it failed
  bool admitted = false;
  int64_t prefix_slots_reused = 0;  // Admitted.prefix_slots_reused
  double client_wait_seconds = 0;   // arrival -> sent (waiting for a max_in_flight slot)
  double ttft_seconds = -1;         // sent -> first Tokens event; -1 = none came
  /// Per Tokens event after the first: (gap since the previous event) / event's count, i.e. the
  /// per-token inter-token latency of that step.
  std::vector<double> inter_token_seconds;
  int64_t generated_tokens = 0;    // sum of Tokens.count
  int migrations = 0;              // Finished.migrations: moves off a failed worker
  int64_t drafted_tokens = 0;      // sum of Tokens.drafted
  int64_t accepted_tokens = 0;     // sum of Tokens.accepted
  int64_t blocks_scored = 0;       // sum of Tokens.blocks_scored
  int64_t blocks_visible = 0;      // sum of Tokens.blocks_visible
  int64_t audited_rows = 0;        // sum of Tokens.audited_rows
  double audit_miss_rate_sum = 0;  // sum of Tokens.audit_miss_rate_sum
  /// Tokens.selection_wait_seconds of every step: [steps][model layers].
  std::vector<std::vector<double>> selection_wait_seconds;
  /// A real model: every generated token id (Tokens.token_ids, in order), Finished's reason
  /// without its prefix ("LENGTH", "EOS", "STOP_TOKEN"; "" before Finished) and stop token; the
  /// context's last ids for a sample output (empty unless it is one).
  std::vector<int32_t> token_ids;
  std::string finish_reason;
  std::optional<int32_t> stop_token_id;
  std::vector<int32_t> context_tail_ids;
};

/// One request's output in the report (a real model; ReplayOptions::sample_outputs).
struct OutputSample {
  int64_t index = 0;
  int64_t context_tokens = 0;
  std::vector<int32_t> context_tail_ids;  // the context's last ids
  std::vector<int32_t> token_ids;         // generated
  std::string finish_reason;              // "" when it did not finish
  std::string status;                     // "OK", or the failure's code name
};

/// One GetLoad sample.
struct CacheSample {
  double seconds = 0;  // since the replay started
  int64_t cache_blocks_used = 0;
  int64_t cache_blocks_capacity = 0;
  int queued = 0;
  int running = 0;
};

/// Mean and p99 (nearest rank) of one model layer's selection wait over all decode steps.
struct LayerWait {
  int layer = 0;
  int64_t steps = 0;
  double mean_seconds = 0;
  double p99_seconds = 0;
};

/// The aggregated report.
struct ReplayReport {
  // Settings.
  ReplayCaps caps;
  double time_scale = 0;
  int max_in_flight = 0;
  int draft_length = 0;
  // The model (the coordinator's GetLoad; set by RunReplay) and, for a real model, its tokens.
  std::string model_name;             // "" when the coordinator named none
  int32_t vocab_size = 0;             // 0: the pattern model
  int64_t model_max_context = 0;      // context + output tokens a sequence may hold; 0 = no limit
  int64_t contexts_cut_to_model = 0;  // requests whose context was cut to fit model_max_context
  bool real_tokens = false;           // contexts were real text (ReplayOptions::tokens)
  std::string token_file;
  ReplaySampling sampling;
  // Outcomes.
  int64_t requests = 0;
  int64_t completed = 0;
  int64_t failed = 0;  // includes requests never sent because the replay was stopped
  /// The replay was stopped (ReplayOptions::stop) before every request was sent and answered.
  bool stopped = false;
  std::map<std::string, int64_t> failures_by_code;  // e.g. "RESOURCE_EXHAUSTED" -> 3
  std::string first_error;                          // one failure's message, for the log
  int64_t migrations = 0;         // sum of Finished.migrations (moves off a failed worker)
  int64_t migrated_requests = 0;  // requests that moved at least once
  double wall_seconds = 0;
  // Latency (seconds; nearest-rank percentiles over completed requests / their steps).
  double ttft_p50 = 0, ttft_p99 = 0;
  double itl_p50 = 0, itl_p99 = 0;
  // The largest inter-token latency of a completed request's step (its gap / its tokens: the
  // longest gap itself without drafts; a migration's cost).
  double itl_max = 0;
  double client_wait_mean = 0, client_wait_max = 0;
  // Throughput.
  int64_t generated_tokens = 0;
  double decode_tokens_per_second = 0;  // generated tokens / wall time
  // Indexer.
  int64_t blocks_scored = 0, blocks_visible = 0;
  double realized_block_sparsity = 0;  // 1 - scored / visible (0 when nothing visible)
  int64_t audited_rows = 0;
  double audit_miss_rate_sum = 0;  // sum of the audited rows' miss rates
  double audited_miss_rate = -1;   // audit_miss_rate_sum / audited_rows; -1 = not audited
  int64_t prefix_slots_reused = 0;
  int64_t context_slots = 0;          // sum of context over admitted requests
  double prefix_reuse_fraction = 0;   // prefix_slots_reused / context_slots
  int64_t prefix_slots_reusable = 0;  // the trace's bound, ReusablePrefixSlots (set by RunReplay)
  // Speculative decoding.
  int64_t drafted_tokens = 0, accepted_tokens = 0;
  double spec_acceptance = 0;  // accepted / drafted (0 when none drafted)
  // Cache use.
  std::vector<CacheSample> cache_samples;
  double cache_used_min = 0, cache_used_mean = 0, cache_used_max = 0;  // blocks
  int64_t cache_capacity = 0;                                          // blocks (last sample)
  std::vector<LayerWait> selection_wait;                               // per model layer
  // A real model: Finished reasons over completed requests ("LENGTH" -> n) and sample outputs.
  std::map<std::string, int64_t> finish_reasons;
  std::vector<OutputSample> samples;
};

/// Cuts contexts (and their prefix ids) so that context + output tokens <= max_context (a real
/// model's limit; 0 = none), outputs to max_context - 1 at most; returns how many requests were
/// cut.
int64_t FitToModelContext(std::vector<TraceRequest>& requests, int64_t max_context);

/// Nearest-rank percentile (p in (0, 100]) of `values`: the ceil(p/100 * n)-th smallest; 0 when
/// empty.
double NearestRankPercentile(std::vector<double> values, double p);

/// Aggregates per-request records and cache samples into the report (pure).
ReplayReport AggregateReplay(const std::vector<RequestRecord>& records,
                             const std::vector<CacheSample>& samples, double wall_seconds,
                             const ReplayOptions& options);

/// Replays `requests` (already capped) against options.coordinator; returns the report, or an
/// error when the coordinator cannot be reached at all (UNAVAILABLE), the options are bad
/// (INVALID_ARGUMENT), or they do not fit the model it serves (FAILED_PRECONDITION: real tokens
/// for the pattern model or the reverse, corpus ids beyond its vocabulary). A real model's
/// contexts are cut to fit its max context first (FitToModelContext). Failed requests are in the
/// report, not an error.
absl::StatusOr<ReplayReport> RunReplay(const std::vector<TraceRequest>& requests,
                                       const ReplayOptions& options);

/// The report as JSON (every figure, the samples and per-layer waits).
nlohmann::json ReplayReportToJson(const ReplayReport& report);

/// The report as a markdown table.
std::string ReplayReportToMarkdown(const ReplayReport& report);

}  // namespace dsa
