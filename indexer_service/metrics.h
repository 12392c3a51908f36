// Prometheus metrics of the indexer worker (DESIGN.md section 6): select phase durations, blocks
// scored and visible, cache blocks by state. Base units; no request-scoped labels.
#pragma once

#include "indexer_service/index_key_cache.h"
#include "indexer_service/indexer.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace dsa {

/// The indexer's metric families, registered in a caller-owned registry that outlives this object:
/// - dsa_indexer_select_duration_seconds{phase="predict"|"scan"|"topk"|"update"} (histogram)
/// - dsa_indexer_blocks_scored_total, dsa_indexer_blocks_visible_total (counters, 64-slot blocks)
/// - dsa_indexer_cache_blocks{state="exclusive"|"shared"|"free"} (gauge, 64-slot blocks; a block
///   held by one sequence, by several, or by none: the three add up to the capacity)
/// - dsa_indexer_audited_miss_ratio (histogram of audited rows' miss ratio against the dense
///   top-K, 0..1; only rows of selects the engine audited, IndexerOptions::audit_fraction)
/// - dsa_indexer_target_block_sparsity (histogram of the SPIN rho each select planned with, 0..0.8:
///   the configured rho, or where adaptive sparsity moved it; selects with SPIN off are not
///   observed)
/// - dsa_indexer_selects_total{scored_on="device"|"cpu"} (counter of row groups by where their
///   scan and top-K ran: with --device cuda, "cpu" grows when the GPU declined a batch or was
///   dropped after a failure)
/// - dsa_indexer_miss_target_ratio (gauge, 0..1): the configured --miss-target
///   (IndexerOptions::miss_target), so that an alert can judge the audited miss ratio against what
///   this deployment asked for; no series while none is set (SetMissTarget)
/// Thread-safe (prometheus-cpp metrics are).
class IndexerMetrics {
 public:
  explicit IndexerMetrics(prometheus::Registry& registry);

  /// Records one Select's phase times and block counts (verifier rows, whose update is deferred to
  /// Commit, observe no update phase).
  void RecordSelect(const SelectResult& result);
  /// Sets the cache gauges from the pool's usage.
  void SetCacheUsage(const CacheUsage& usage);
  /// Exports `miss_target` (IndexerOptions::miss_target, in [0, 1)) as
  /// dsa_indexer_miss_target_ratio; called once at start. 0 (rho fixed) exports no series rather
  /// than a 0, which an alert would read as a target that every audited miss exceeds.
  void SetMissTarget(double miss_target);

 private:
  prometheus::Histogram* predict_seconds_;
  prometheus::Histogram* scan_seconds_;
  prometheus::Histogram* topk_seconds_;
  prometheus::Histogram* update_seconds_;
  prometheus::Histogram* miss_rate_;
  prometheus::Histogram* target_sparsity_;
  prometheus::Counter* blocks_scored_;
  prometheus::Counter* blocks_visible_;
  prometheus::Counter* selects_on_device_;
  prometheus::Counter* selects_on_cpu_;
  prometheus::Gauge* exclusive_blocks_;
  prometheus::Gauge* shared_blocks_;
  prometheus::Gauge* free_blocks_;
  prometheus::Family<prometheus::Gauge>* miss_target_family_;
  prometheus::Gauge* miss_target_ = nullptr;  // null while no target is set
};

}  // namespace dsa
