// The standard process metrics of the Prometheus client libraries (process_cpu_seconds_total and
// friends), read from /proc at each scrape: prometheus-cpp has no process collector.
#pragma once

#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace dsa {

/// At each Collect, from /proc/self/stat, /proc/stat, /proc/self/fd and getrlimit:
/// process_cpu_seconds_total (counter, user + system seconds), process_resident_memory_bytes,
/// process_virtual_memory_bytes, process_start_time_seconds (Unix seconds), process_open_fds,
/// process_max_fds (gauges). A value that cannot be read is left out of that scrape. Linux only;
/// thread-safe (no state).
class ProcessMetrics final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override;
};

}  // namespace dsa
