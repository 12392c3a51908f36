// Prometheus metrics of the coordinator (DESIGN.md section 6, docs/services.md "Coordinator"). Base
// units; no request-scoped labels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace dsa {

/// How a Generate request ended (the `outcome` label of dsa_coordinator_requests_total).
enum class RequestOutcome { kCompleted, kFailed, kRejected, kCancelled };

/// Bucket upper bounds (seconds, increasing, > 0) of the coordinator's latency histograms.
struct CoordinatorBuckets {
  /// TTFT: a queued long prefill on the CPU takes minutes (Dynamo's range reaches 480 s).
  std::vector<double> time_to_first_token = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                             0.25,  0.5,    1,     2.5,  5,     10,   30,
                                             60,    120,    240,   480,  960};
  /// ITL: from 1 ms (a GPU decode step) to 10 s (a CPU step of a large batch).
  std::vector<double> inter_token_latency = {0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015,
                                             0.02,  0.03,   0.05,  0.075,  0.1,  0.15,
                                             0.25,  0.5,    1,     2.5,    5,    10};
  /// Queue: admission waits, like TTFT.
  std::vector<double> queue = time_to_first_token;
};

/// INVALID_ARGUMENT unless `bounds` is non-empty, finite, > 0 and strictly increasing; `what`
/// names the flag in the message.
absl::Status ValidateBuckets(const std::vector<double>& bounds, const std::string& what);

/// The coordinator's metric families, registered in a caller-owned registry that outlives this
/// object:
/// - dsa_coordinator_time_to_first_token_seconds (histogram): Generate arrival to the first
///   Tokens event
/// - dsa_coordinator_inter_token_latency_seconds (histogram): per decode step after the first,
///   the time since the previous step of the request divided by the step's tokens
/// - dsa_coordinator_queue_duration_seconds (histogram): Generate arrival to admission
/// - dsa_coordinator_request_duration_seconds (histogram): Generate arrival to the request's end,
///   every outcome of a request that was queued (the end-to-end latency a client sees)
/// - dsa_coordinator_prompt_tokens_total (counter): context tokens of the requests admitted
///   (once a request; a migration's re-prefill is not counted again)
/// - dsa_coordinator_requests_total{outcome="completed"|"failed"|"rejected"|"cancelled",code}:
///   code is the request's final status code's name ("OK", "RESOURCE_EXHAUSTED", ...), so that
///   refusals and failures are told apart by why
/// - dsa_coordinator_spec_decode_draft_tokens_total, ..._accepted_tokens_total (counters)
/// - dsa_coordinator_generated_tokens_total (counter): tokens sent to clients in Tokens events
/// - dsa_coordinator_migrations_total (counter): running requests moved off a failed worker
/// - dsa_coordinator_queued_requests, dsa_coordinator_running_requests (gauges)
/// - dsa_coordinator_max_queued_requests (gauge): the queue's bound (--max-queue)
/// - dsa_coordinator_workers{kind="indexer"|"attention",state="ready"|"not_ready"} (gauge): the
///   workers taken in, by readiness (the two states add up to those known)
/// Thread-safe (prometheus-cpp metrics are).
class CoordinatorMetrics {
 public:
  /// `buckets` must pass ValidateBuckets (the caller checks flags first).
  explicit CoordinatorMetrics(prometheus::Registry& registry,
                              const CoordinatorBuckets& buckets = {});

  void ObserveTimeToFirstToken(double seconds) { ttft_->Observe(seconds); }
  void ObserveInterTokenLatency(double seconds) { itl_->Observe(seconds); }
  void ObserveQueueDuration(double seconds) { queue_->Observe(seconds); }
  void ObserveRequestDuration(double seconds) { duration_->Observe(seconds); }
  void CountPromptTokens(int64_t tokens) { prompt_tokens_->Increment(static_cast<double>(tokens)); }
  /// One request ended with `outcome` and the status `code` its Generate returned.
  void CountRequest(RequestOutcome outcome, absl::StatusCode code);
  /// One verification step: `drafted` draft tokens verified, `accepted` of them accepted.
  void CountSpeculativeStep(int drafted, int accepted);
  void SetQueued(int queued) { queued_->Set(queued); }
  void SetRunning(int running) { running_->Set(running); }
  void SetMaxQueued(int max_queue) { max_queued_->Set(max_queue); }
  void CountGeneratedTokens(int tokens) { generated_->Increment(tokens); }
  void CountMigration() { migrations_->Increment(); }
  /// Workers of a kind (`attention` true: attention workers; false: indexer workers) by state.
  void SetWorkers(bool attention, int ready, int not_ready);

 private:
  prometheus::Histogram* ttft_;
  prometheus::Histogram* itl_;
  prometheus::Histogram* queue_;
  prometheus::Histogram* duration_;
  prometheus::Counter* prompt_tokens_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Counter* drafted_;
  prometheus::Counter* accepted_;
  prometheus::Counter* generated_;
  prometheus::Counter* migrations_;
  prometheus::Gauge* queued_;
  prometheus::Gauge* running_;
  prometheus::Gauge* max_queued_;
  prometheus::Gauge* ready_indexers_;
  prometheus::Gauge* not_ready_indexers_;
  prometheus::Gauge* ready_attention_;
  prometheus::Gauge* not_ready_attention_;
};

}  // namespace dsa
