// The percentile of bench_select_stream_rtt, bench_remote_select_rtt and
// bench_engine_decode_step. Not the replay report's: `dsa replay` uses the nearest rank
// (tools/dsa/replay.h, NearestRankPercentile, rank ceil(p * n)), and bench_nccl_transport the
// sample at floor(p * n); each kept as its published figures were computed.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace dsa::bench {

/// The p-th percentile (p in [0, 1]) of `values` (any unit; returned in the same), as the sample
/// at rank round(p * (n - 1)) of the sorted values; 0 for no values.
inline double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto rank = static_cast<size_t>(p * static_cast<double>(values.size() - 1) + 0.5);
  return values[rank];
}

}  // namespace dsa::bench
