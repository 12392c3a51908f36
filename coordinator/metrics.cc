// Prometheus metrics of the coordinator (see metrics.h).
#include "coordinator/metrics.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace dsa {

absl::Status ValidateBuckets(const std::vector<double>& bounds, const std::string& what) {
  if (bounds.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": no bucket bound"));
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || bounds[i] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": bound ", bounds[i], " is not a finite number > 0"));
    }
    if (i > 0 && bounds[i] <= bounds[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": bounds must increase, but ",
                                                     bounds[i], " follows ", bounds[i - 1]));
    }
  }
  return absl::OkStatus();
}

CoordinatorMetrics::CoordinatorMetrics(prometheus::Registry& registry,
                                       const CoordinatorBuckets& buckets) {
  ttft_ = &prometheus::BuildHistogram()
               .Name("dsa_coordinator_time_to_first_token_seconds")
               .Help("Generate arrival to the request's first Tokens event")
               .Register(registry)
               .Add({}, buckets.time_to_first_token);
  itl_ = &prometheus::BuildHistogram()
              .Name("dsa_coordinator_inter_token_latency_seconds")
              .Help("Per decode step after the first: time since the previous step / its tokens")
              .Register(registry)
              .Add({}, buckets.inter_token_latency);
  queue_ = &prometheus::BuildHistogram()
                .Name("dsa_coordinator_queue_duration_seconds")
                .Help("Generate arrival to admission (placement on the workers)")
                .Register(registry)
                .Add({}, buckets.queue);
  duration_ = &prometheus::BuildHistogram()
                   .Name("dsa_coordinator_request_duration_seconds")
                   .Help("Generate arrival to the request's end, every outcome (end to end)")
                   .Register(registry)
                   .Add({}, buckets.time_to_first_token);
  prompt_tokens_ = &prometheus::BuildCounter()
                        .Name("dsa_coordinator_prompt_tokens_total")
                        .Help("Context tokens of the requests admitted (once a request)")
                        .Register(registry)
                        .Add({});
  auto& requests = prometheus::BuildCounter()
                       .Name("dsa_coordinator_requests_total")
                       .Help("Generate requests by how they ended")
                       .Register(registry);
  requests_ = &requests;
  // The usual ends exist from the start, so that a rate over them is 0 rather than absent.
  requests.Add({{"outcome", "completed"}, {"code", "OK"}});
  requests.Add({{"outcome", "cancelled"}, {"code", "CANCELLED"}});
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
  generated_ = &prometheus::BuildCounter()
                    .Name("dsa_coordinator_generated_tokens_total")
                    .Help("Tokens sent to clients in Tokens events")
                    .Register(registry)
                    .Add({});
  migrations_ = &prometheus::BuildCounter()
                     .Name("dsa_coordinator_migrations_total")
                     .Help(
                         "Running requests moved off a failed worker to a surviving one "
                         "(re-prefill of the context and the tokens generated)")
                     .Register(registry)
                     .Add({});
  max_queued_ = &prometheus::BuildGauge()
                     .Name("dsa_coordinator_max_queued_requests")
                     .Help("The queue's bound (--max-queue): a full queue refuses requests")
                     .Register(registry)
                     .Add({});
  auto& workers = prometheus::BuildGauge()
                      .Name("dsa_coordinator_workers")
                      .Help("Workers taken in, by kind and readiness (placed on only when ready)")
                      .Register(registry);
  ready_indexers_ = &workers.Add({{"kind", "indexer"}, {"state", "ready"}});
  not_ready_indexers_ = &workers.Add({{"kind", "indexer"}, {"state", "not_ready"}});
  ready_attention_ = &workers.Add({{"kind", "attention"}, {"state", "ready"}});
  not_ready_attention_ = &workers.Add({{"kind", "attention"}, {"state", "not_ready"}});
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

void CoordinatorMetrics::CountRequest(RequestOutcome outcome, absl::StatusCode code) {
  const char* name = "completed";
  switch (outcome) {
    case RequestOutcome::kCompleted:
      break;
    case RequestOutcome::kFailed:
      name = "failed";
      break;
    case RequestOutcome::kRejected:
      name = "rejected";
      break;
    case RequestOutcome::kCancelled:
      name = "cancelled";
      break;
  }
  requests_->Add({{"outcome", name}, {"code", absl::StatusCodeToString(code)}}).Increment();
}

void CoordinatorMetrics::SetWorkers(bool attention, int ready, int not_ready) {
  (attention ? ready_attention_ : ready_indexers_)->Set(ready);
  (attention ? not_ready_attention_ : not_ready_indexers_)->Set(not_ready);
}

void CoordinatorMetrics::CountSpeculativeStep(int drafted, int accepted) {
  drafted_->Increment(drafted);
  accepted_->Increment(accepted);
}

}  // namespace dsa
