// The parts of bench_engine_decode_step other than its main (engine_decode_step_arms.h).
#include "bench/engine_decode_step_arms.h"

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/percentile.h"
#include "nlohmann/json.hpp"

namespace dsa::bench {

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double UnixSeconds() { return static_cast<double>(absl::ToUnixMicros(absl::Now())) / 1e6; }

absl::StatusOr<std::vector<Shape>> ParseShapes(const std::string& text) {
  std::vector<Shape> shapes;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> parts = absl::StrSplit(item, 'x');
    Shape shape;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &shape.batch) ||
        !absl::SimpleAtoi(parts[1], &shape.context) || shape.batch < 1 || shape.context < 64) {
      return absl::InvalidArgumentError(absl::StrCat("bad shape \"", item, "\" (want BxC)"));
    }
    shapes.push_back(shape);
  }
  if (shapes.empty()) return absl::InvalidArgumentError("no shapes");
  return shapes;
}

nlohmann::json CellJson(const Cell& cell, int layers) {
  auto median_of = [&](auto field) {
    std::vector<double> v;
    for (const StepParts& p : cell.parts) v.push_back(field(p));
    return Percentile(v, 0.5);
  };
  const double step_ms = Percentile(cell.step_seconds, 0.5) * 1e3;
  // Per step: what is neither transport, attention nor the drain (plan, queries, keys,
  // bookkeeping).
  std::vector<double> rest;
  for (size_t i = 0; i < cell.parts.size(); ++i) {
    const StepParts& p = cell.parts[i];
    rest.push_back(cell.step_seconds[i] - p.submit - p.await - p.attention - p.drain);
  }
  return {
      {"steps", cell.step_seconds.size()},
      {"step_ms_p50", step_ms},
      {"step_ms_p10", Percentile(cell.step_seconds, 0.1) * 1e3},
      {"step_ms_p90", Percentile(cell.step_seconds, 0.9) * 1e3},
      {"layer_us", step_ms * 1e3 / layers},
      {"submit_us_per_layer",
       median_of([](const StepParts& p) { return p.submit; }) * 1e6 / layers},
      {"await_us_per_layer", median_of([](const StepParts& p) { return p.await; }) * 1e6 / layers},
      {"attention_us_per_layer",
       median_of([](const StepParts& p) { return p.attention; }) * 1e6 / layers},
      {"drain_us_per_layer", median_of([](const StepParts& p) { return p.drain; }) * 1e6 / layers},
      {"rest_us_per_layer", Percentile(rest, 0.5) * 1e6 / layers},
      {"selection_wait_us_per_layer", Percentile(cell.wait_seconds, 0.5) * 1e6 / layers},
      {"realized_block_sparsity", cell.blocks_visible > 0
                                      ? 1.0 - static_cast<double>(cell.blocks_scored) /
                                                  static_cast<double>(cell.blocks_visible)
                                      : 0.0},
  };
}

}  // namespace dsa::bench
