// Prometheus metrics of the attention worker (see metrics.h).
#include "attention_worker/metrics.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace dsa {
namespace {

// Bucket bounds 1, 2.5 and 5 x 10^e seconds for e from `lowest` to `highest` (decades), then 10^
// (highest + 1). Each is parsed from its decimal text, so that the `le` labels prometheus-cpp
// writes (16 significant digits) read as written: 0.25, not 0.2500000000000001.
prometheus::Histogram::BucketBoundaries DecadeBuckets(int lowest, int highest) {
  prometheus::Histogram::BucketBoundaries bounds;
  char text[32];
  for (int e = lowest; e <= highest; ++e) {
    for (const char* mantissa : {"1", "2.5", "5"}) {
      std::snprintf(text, sizeof(text), "%se%d", mantissa, e);
      bounds.push_back(std::strtod(text, nullptr));
    }
  }
  std::snprintf(text, sizeof(text), "1e%d", highest + 1);
  bounds.push_back(std::strtod(text, nullptr));
  return bounds;
}

}  // namespace

AttentionMetrics::AttentionMetrics(prometheus::Registry& registry, int num_model_layers) {
  auto& wait = prometheus::BuildHistogram()
                   .Name("dsa_attention_selection_wait_seconds")
                   .Help(
                       "Time a model layer waited for the selection it attends (MLI lag), per "
                       "decode step")
                   .Register(registry);
  const auto wait_buckets = DecadeBuckets(-5, 0);  // 10 us .. 10 s
  for (int layer = 0; layer < num_model_layers; ++layer) {
    selection_wait_seconds_.push_back(&wait.Add({{"layer", std::to_string(layer)}}, wait_buckets));
  }
  const auto duration_buckets = DecadeBuckets(-4, 1);  // 100 us .. 100 s
  decode_step_seconds_ = &prometheus::BuildHistogram()
                              .Name("dsa_attention_decode_step_duration_seconds")
                              .Help("Duration of one DecodeStep over all model layers")
                              .Register(registry)
                              .Add({}, duration_buckets);
  prefill_seconds_ = &prometheus::BuildHistogram()
                          .Name("dsa_attention_prefill_duration_seconds")
                          .Help("Duration of one successful Prefill (index keys and KV cache)")
                          .Register(registry)
                          .Add({}, duration_buckets);
  auto& kv = prometheus::BuildGauge()
                 .Name("dsa_attention_kv_slots")
                 .Help(
                     "KV-cache slots (one position of every model layer) by state; used and free "
                     "add up to the capacity")
                 .Register(registry);
  kv_used_slots_ = &kv.Add({{"state", "used"}});
  kv_free_slots_ = &kv.Add({{"state", "free"}});
  sequences_ = &prometheus::BuildGauge()
                    .Name("dsa_attention_sequences")
                    .Help("Sequences held by this attention worker")
                    .Register(registry)
                    .Add({});
  auto& selects = prometheus::BuildCounter()
                      .Name("dsa_attention_full_layer_selects_total")
                      .Help(
                          "Full-layer selects sent to indexer workers, by form (host buffers, or "
                          "device-resident on the co-located GPU)")
                      .Register(registry);
  host_selects_ = &selects.Add({{"form", "host"}});
  device_selects_ = &selects.Add({{"form", "device"}});
}

void AttentionMetrics::RecordSelects(int64_t host_selects, int64_t device_selects) {
  host_selects_->Increment(static_cast<double>(host_selects));
  device_selects_->Increment(static_cast<double>(device_selects));
}

void AttentionMetrics::RecordSelectionWaits(const std::vector<double>& wait_seconds) {
  const size_t n = std::min(wait_seconds.size(), selection_wait_seconds_.size());
  for (size_t l = 0; l < n; ++l) selection_wait_seconds_[l]->Observe(wait_seconds[l]);
}

void AttentionMetrics::RecordDecodeStep(double seconds) { decode_step_seconds_->Observe(seconds); }

void AttentionMetrics::RecordPrefill(double seconds) { prefill_seconds_->Observe(seconds); }

void AttentionMetrics::SetUsage(int64_t kv_used_slots, int64_t kv_capacity_slots,
                                int64_t sequences) {
  kv_used_slots_->Set(static_cast<double>(kv_used_slots));
  kv_free_slots_->Set(static_cast<double>(std::max<int64_t>(0, kv_capacity_slots - kv_used_slots)));
  sequences_->Set(static_cast<double>(sequences));
}

}  // namespace dsa
