// Prometheus metrics of the coordinator (see metrics.h).
#include "coordinator/metrics.h"

namespace dsa {
namespace {

// 1 ms to 60 s: a decode step on the CPU backend takes milliseconds, a queued long prefill minutes.
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0};
}

}  // namespace

CoordinatorMetrics::CoordinatorMetrics(prometheus::Registry& registry) {
  ttft_ = &prometheus::BuildHistogram()
               .Name("dsa_coordinator_time_to_first_token_seconds")
               .Help("Generate arrival to the request's first Tokens event")
               .Register(registry)
               .Add({}, LatencyBuckets());
  itl_ = &prometheus::BuildHistogram()
              .Name("dsa_coordinator_inter_token_latency_seconds")
              .Help("Per decode step after the first: time since the previous step / its tokens")
              .Register(registry)
              .Add({}, LatencyBuckets());
  queue_ = &prometheus::BuildHistogram()
                .Name("dsa_coordinator_queue_duration_seconds")
                .Help("Generate arrival to admission (placement on the workers)")
                .Register(registry)
                .Add({}, LatencyBuckets());
  auto& requests = prometheus::BuildCounter()
                       .Name("dsa_coordinator_requests_total")
                       .Help("Generate requests by how they ended")
                       .Register(registry);
  completed_ = &requests.Add({{"outcome", "completed"}});
  failed_ = &requests.Add({{"outcome", "failed"}});
  rejected_ = &requests.Add({{"outcome", "rejected"}});
  cancelled_ = &requests.Add({{"outcome", "cancelled"}});
  drafted_ = &prometheus::BuildCounter()
                  .Name("dsa_coordinator_spec_decode_draft_tokens_total")
                  .Help("Draft tokens verified by speculative decode steps")
                  .Register(registry)
                  .Add({});
  accepted_ = &prometheus::BuildCounter()
                   .Name("dsa_coordinator_spec_decode_accepted_tokens_total")
                   .Help("Draft tokens accepted by speculative decode steps")
                   .Register(registry)
                   .Add({});
  queued_ = &prometheus::BuildGauge()
                 .Name("dsa_coordinator_queued_requests")
                 .Help("Requests waiting for admission")
                 .Register(registry)
                 .Add({});
  running_ = &prometheus::BuildGauge()
                  .Name("dsa_coordinator_running_requests")
                  .Help("Requests admitted and not yet ended (prefilling or decoding)")
                  .Register(registry)
                  .Add({});
}

void CoordinatorMetrics::CountRequest(RequestOutcome outcome) {
  switch (outcome) {
    case RequestOutcome::kCompleted:
      completed_->Increment();
      break;
    case RequestOutcome::kFailed:
      failed_->Increment();
      break;
    case RequestOutcome::kRejected:
      rejected_->Increment();
      break;
    case RequestOutcome::kCancelled:
      cancelled_->Increment();
      break;
  }
}

void CoordinatorMetrics::CountSpeculativeStep(int drafted, int accepted) {
  drafted_->Increment(drafted);
  accepted_->Increment(accepted);
}

}  // namespace dsa
