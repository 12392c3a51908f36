// Prometheus metrics of the attention worker (see metrics.h).
#include "attention_worker/metrics.h"

#include <algorithm>
#include <string>

namespace dsa {
namespace {

// Exponential bucket bounds from `start` seconds, `factor` apart, `count` of them.
prometheus::Histogram::BucketBoundaries ExponentialBuckets(double start, double factor, int count) {
  prometheus::Histogram::BucketBoundaries bounds;
  double bound = start;
  for (int i = 0; i < count; ++i, bound *= factor) bounds.push_back(bound);
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
  // 10 us .. about 10 s.
  const auto wait_buckets = ExponentialBuckets(1e-5, 2.0, 21);
  for (int layer = 0; layer < num_model_layers; ++layer) {
    selection_wait_seconds_.push_back(&wait.Add({{"layer", std::to_string(layer)}}, wait_buckets));
  }
  const auto duration_buckets = ExponentialBuckets(1e-4, 2.0, 20);  // 100 us .. about 50 s
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
                 .Help("KV-cache slots (one position of every model layer) by state")
                 .Register(registry);
  kv_used_slots_ = &kv.Add({{"state", "used"}});
  kv_capacity_slots_ = &kv.Add({{"state", "capacity"}});
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
  kv_capacity_slots_->Set(static_cast<double>(kv_capacity_slots));
  sequences_->Set(static_cast<double>(sequences));
}

}  // namespace dsa
