// Prometheus metrics of the indexer worker (see metrics.h).
#include "indexer_service/metrics.h"

#include <string>

namespace dsa {
namespace {

// 10 us to 2.5 s: a top-K of one row is ~10 us, a dense scan of a long batch is ~1 s on the CPU.
prometheus::Histogram::BucketBoundaries DurationBuckets() {
  return {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
          1e-2, 2.5e-2, 5e-2, 0.1,  0.25,   0.5,  1.0,  2.5};
}

}  // namespace

IndexerMetrics::IndexerMetrics(prometheus::Registry& registry) {
  auto& duration = prometheus::BuildHistogram()
                       .Name("dsa_indexer_select_duration_seconds")
                       .Help("Wall time of each phase of a select, per row group")
                       .Register(registry);
  predict_seconds_ = &duration.Add({{"phase", "predict"}}, DurationBuckets());
  scan_seconds_ = &duration.Add({{"phase", "scan"}}, DurationBuckets());
  topk_seconds_ = &duration.Add({{"phase", "topk"}}, DurationBuckets());
  update_seconds_ = &duration.Add({{"phase", "update"}}, DurationBuckets());
  blocks_scored_ = &prometheus::BuildCounter()
                        .Name("dsa_indexer_blocks_scored_total")
                        .Help("64-slot blocks scored by selects (after SPIN pruning)")
                        .Register(registry)
                        .Add({});
  blocks_visible_ = &prometheus::BuildCounter()
                         .Name("dsa_indexer_blocks_visible_total")
                         .Help("64-slot blocks visible to selects (what all-keep would score)")
                         .Register(registry)
                         .Add({});
  auto& selects = prometheus::BuildCounter()
                      .Name("dsa_indexer_selects_total")
                      .Help("Row groups selected, by where their scan and top-K ran")
                      .Register(registry);
  selects_on_device_ = &selects.Add({{"scored_on", "device"}});
  selects_on_cpu_ = &selects.Add({{"scored_on", "cpu"}});
  miss_rate_ = &prometheus::BuildHistogram()
                    .Name("dsa_indexer_audited_miss_ratio")
                    .Help("Audited rows: fraction of the dense top-K the pruned selection lost")
                    .Register(registry)
                    .Add({}, prometheus::Histogram::BucketBoundaries{0.0, 0.01, 0.02, 0.05, 0.1,
                                                                     0.2, 0.3, 0.5, 0.75, 1.0});
  target_sparsity_ =
      &prometheus::BuildHistogram()
           .Name("dsa_indexer_target_block_sparsity")
           .Help(
               "SPIN's target block sparsity rho of each select (SPIN on): the configured rho, "
               "or where adaptive sparsity (--miss-target) moved it")
           .Register(registry)
           .Add({}, prometheus::Histogram::BucketBoundaries{0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7,
                                                            0.8});
  auto& cache = prometheus::BuildGauge()
                    .Name("dsa_indexer_cache_blocks")
                    .Help(
                        "64-slot blocks of the index-key cache by state (exclusive: held by one "
                        "sequence; shared: by several; the states add up to the capacity)")
                    .Register(registry);
  exclusive_blocks_ = &cache.Add({{"state", "exclusive"}});
  shared_blocks_ = &cache.Add({{"state", "shared"}});
  free_blocks_ = &cache.Add({{"state", "free"}});
  // Registered now so the family exists, but with no series until SetMissTarget gives one.
  miss_target_family_ = &prometheus::BuildGauge()
                             .Name("dsa_indexer_miss_target_ratio")
                             .Help(
                                 "Adaptive sparsity's audited miss target (--miss-target, 0..1) "
                                 "of sequences that name none; absent when none is set")
                             .Register(registry);
}

void IndexerMetrics::RecordSelect(const SelectResult& result) {
  predict_seconds_->Observe(result.phase_seconds.predict);
  scan_seconds_->Observe(result.phase_seconds.scan);
  topk_seconds_->Observe(result.phase_seconds.topk);
  const bool single_row = result.selections.size() == static_cast<size_t>(result.top_k);
  if (single_row) update_seconds_->Observe(result.phase_seconds.update);
  blocks_scored_->Increment(static_cast<double>(result.blocks_scored));
  blocks_visible_->Increment(static_cast<double>(result.blocks_visible));
  for (double miss : result.audit_miss_rates) miss_rate_->Observe(miss);
  if (result.spin) target_sparsity_->Observe(result.target_block_sparsity);
  (result.on_device ? selects_on_device_ : selects_on_cpu_)->Increment();
}

void IndexerMetrics::SetCacheUsage(const CacheUsage& usage) {
  exclusive_blocks_->Set(static_cast<double>(usage.used_blocks - usage.shared_blocks));
  shared_blocks_->Set(static_cast<double>(usage.shared_blocks));
  free_blocks_->Set(static_cast<double>(usage.free_blocks));
}

void IndexerMetrics::SetMissTarget(double miss_target) {
  if (miss_target > 0) {
    if (miss_target_ == nullptr) miss_target_ = &miss_target_family_->Add({});
    miss_target_->Set(miss_target);
  } else if (miss_target_ != nullptr) {
    miss_target_family_->Remove(miss_target_);
    miss_target_ = nullptr;
  }
}

}  // namespace dsa
