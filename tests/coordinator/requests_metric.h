// dsa_coordinator_requests_total read from /metrics text: the requests that ended with an outcome,
// summed over their status codes, for tests of the coordinator.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace dsa::testing {

/// The sum of the dsa_coordinator_requests_total series whose `outcome` label is `outcome`
/// ("completed", "failed", "rejected", "cancelled") in Prometheus text `metrics`; with `code`
/// (a status code's name, "OK", "INVALID_ARGUMENT", ...) only that code's series.
inline int64_t RequestsWithOutcome(absl::string_view metrics, absl::string_view outcome,
                                   absl::string_view code = "") {
  int64_t total = 0;
  const std::string label = absl::StrCat("outcome=\"", outcome, "\"");
  const std::string code_label = absl::StrCat("code=\"", code, "\"");
  for (absl::string_view line : absl::StrSplit(metrics, '\n')) {
    if (!absl::StartsWith(line, "dsa_coordinator_requests_total{")) continue;
    const size_t close = line.find('}');
    if (close == absl::string_view::npos) continue;
    const absl::string_view labels = line.substr(0, close);
    if (!absl::StrContains(labels, label)) continue;
    if (!code.empty() && !absl::StrContains(labels, code_label)) continue;
    total += static_cast<int64_t>(std::stod(std::string(line.substr(close + 2))));
  }
  return total;
}

}  // namespace dsa::testing
