// Prometheus metrics of the coordinator (DESIGN.md section 6, docs/services.md "Coordinator"). Base
// units; no request-scoped labels.
#pragma once

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace dsa {

/// How a Generate request ended (the `outcome` label of dsa_coordinator_requests_total).
enum class RequestOutcome { kCompleted, kFailed, kRejected, kCancelled };

/// The coordinator's metric families, registered in a caller-owned registry that outlives this
/// object:
/// - dsa_coordinator_time_to_first_token_seconds (histogram): Generate arrival to the first
///   Tokens event
/// - dsa_coordinator_inter_token_latency_seconds (histogram): per decode step after the first,
///   the time since the previous step of the request divided by the step's tokens
/// - dsa_coordinator_queue_duration_seconds (histogram): Generate arrival to admission
/// - dsa_coordinator_requests_total{outcome="completed"|"failed"|"rejected"|"cancelled"}
/// - dsa_coordinator_spec_decode_draft_tokens_total, ..._accepted_tokens_total (counters)
/// - dsa_coordinator_queued_requests, dsa_coordinator_running_requests (gauges)
/// Thread-safe (prometheus-cpp metrics are).
class CoordinatorMetrics {
 public:
  explicit CoordinatorMetrics(prometheus::Registry& registry);

  void ObserveTimeToFirstToken(double seconds) { ttft_->Observe(seconds); }
  void ObserveInterTokenLatency(double seconds) { itl_->Observe(seconds); }
  void ObserveQueueDuration(double seconds) { queue_->Observe(seconds); }
  void CountRequest(RequestOutcome outcome);
  /// One verification step: `drafted` draft tokens verified, `accepted` of them accepted.
  void CountSpeculativeStep(int drafted, int accepted);
  void SetQueued(int queued) { queued_->Set(queued); }
  void SetRunning(int running) { running_->Set(running); }

 private:
  prometheus::Histogram* ttft_;
  prometheus::Histogram* itl_;
  prometheus::Histogram* queue_;
  prometheus::Counter* completed_;
  prometheus::Counter* failed_;
  prometheus::Counter* rejected_;
  prometheus::Counter* cancelled_;
  prometheus::Counter* drafted_;
  prometheus::Counter* accepted_;
  prometheus::Gauge* queued_;
  prometheus::Gauge* running_;
};

}  // namespace dsa
