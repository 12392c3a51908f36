// Prometheus metrics of the attention worker (DESIGN.md section 6): how long each model layer
// waited for its lagged selection (MLI, DESIGN.md 4.3), decode-step and prefill durations, KV-cache
// slots and sequences. Base units; no request- or sequence-scoped labels.
#pragma once

#include <cstdint>
#include <vector>

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace dsa {

/// The attention worker's metric families, registered in a caller-owned registry that outlives
/// this object:
/// - dsa_attention_selection_wait_seconds{layer="0".."L-1"} (histogram, seconds): per decode step
///   and model layer, the time the layer spent awaiting the selection of sigma(l); 0 when it had
///   already arrived.
/// - dsa_attention_decode_step_duration_seconds (histogram, seconds): one DecodeStep, all layers.
/// - dsa_attention_prefill_duration_seconds (histogram, seconds): one successful Prefill.
/// - dsa_attention_kv_slots{state="used"|"free"} (gauge, slots; one slot holds every model
///   layer's key and value of one position; the two add up to the capacity).
/// - dsa_attention_sequences (gauge): sequences held.
/// - dsa_attention_full_layer_selects_total{form="host"|"device"} (counter): full-layer selects
///   sent, by form (device: the co-located device-resident path, AttentionEngineOptions::
///   device_selects).
/// Thread-safe (prometheus-cpp metrics are).
class AttentionMetrics {
 public:
  /// `num_model_layers` >= 1: one `layer` label value per model layer.
  AttentionMetrics(prometheus::Registry& registry, int num_model_layers);

  /// Records one decode step's wait per model layer (seconds, [num_model_layers]; extra entries
  /// are ignored).
  void RecordSelectionWaits(const std::vector<double>& wait_seconds);
  void RecordDecodeStep(double seconds);
  /// Counts one decode step's full-layer selects by form.
  void RecordSelects(int64_t host_selects, int64_t device_selects);
  void RecordPrefill(double seconds);
  /// Sets the KV-slot and sequence gauges.
  void SetUsage(int64_t kv_used_slots, int64_t kv_capacity_slots, int64_t sequences);

 private:
  std::vector<prometheus::Histogram*> selection_wait_seconds_;  // per model layer
  prometheus::Histogram* decode_step_seconds_;
  prometheus::Histogram* prefill_seconds_;
  prometheus::Gauge* kv_used_slots_;
  prometheus::Gauge* kv_free_slots_;
  prometheus::Gauge* sequences_;
  prometheus::Counter* host_selects_;
  prometheus::Counter* device_selects_;
};

}  // namespace dsa
