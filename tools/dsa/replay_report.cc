// `dsa replay`'s report as JSON and as markdown tables (replay.h), apart from the trace client
// that fills it.
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "tools/dsa/replay.h"

namespace dsa {

nlohmann::json ReplayReportToJson(const ReplayReport& report) {
  nlohmann::json json;
  json["settings"] = {{"limit", report.caps.limit},
                      {"max_context", report.caps.max_context},
                      {"max_output", report.caps.max_output},
                      {"time_scale", report.time_scale},
                      {"max_in_flight", report.max_in_flight},
                      {"draft_length", report.draft_length}};
  json["requests"] = {
      {"total", report.requests},          {"completed", report.completed},
      {"failed", report.failed},           {"failures_by_code", report.failures_by_code},
      {"first_error", report.first_error}, {"stopped", report.stopped},
      {"migrations", report.migrations},   {"migrated_requests", report.migrated_requests}};
  json["wall_seconds"] = report.wall_seconds;
  json["latency_seconds"] = {{"ttft_p50", report.ttft_p50},
                             {"ttft_p99", report.ttft_p99},
                             {"inter_token_p50", report.itl_p50},
                             {"inter_token_p99", report.itl_p99},
                             {"inter_token_max", report.itl_max},
                             {"client_wait_mean", report.client_wait_mean},
                             {"client_wait_max", report.client_wait_max}};
  json["throughput"] = {{"generated_tokens", report.generated_tokens},
                        {"decode_tokens_per_second", report.decode_tokens_per_second}};
  json["indexer"] = {
      {"blocks_scored", report.blocks_scored},
      {"blocks_visible", report.blocks_visible},
      {"realized_block_sparsity", report.realized_block_sparsity},
      {"audited_rows", report.audited_rows},
      {"audited_miss_rate",
       report.audited_rows > 0 ? nlohmann::json(report.audited_miss_rate) : nlohmann::json()},
      {"prefix_slots_reused", report.prefix_slots_reused},
      {"context_slots", report.context_slots},
      {"prefix_reuse_fraction", report.prefix_reuse_fraction},
      {"prefix_slots_reusable", report.prefix_slots_reusable}};
  json["speculative_decoding"] = {{"drafted_tokens", report.drafted_tokens},
                                  {"accepted_tokens", report.accepted_tokens},
                                  {"acceptance", report.spec_acceptance}};
  nlohmann::json samples = nlohmann::json::array();
  for (const CacheSample& sample : report.cache_samples) {
    samples.push_back({{"seconds", sample.seconds},
                       {"cache_blocks_used", sample.cache_blocks_used},
                       {"cache_blocks_capacity", sample.cache_blocks_capacity},
                       {"queued", sample.queued},
                       {"running", sample.running}});
  }
  json["cache_use"] = {{"used_blocks_min", report.cache_used_min},
                       {"used_blocks_mean", report.cache_used_mean},
                       {"used_blocks_max", report.cache_used_max},
                       {"capacity_blocks", report.cache_capacity},
                       {"samples", samples}};
  nlohmann::json waits = nlohmann::json::array();
  for (const LayerWait& wait : report.selection_wait) {
    waits.push_back({{"layer", wait.layer},
                     {"steps", wait.steps},
                     {"mean_seconds", wait.mean_seconds},
                     {"p99_seconds", wait.p99_seconds}});
  }
  json["selection_wait_per_layer"] = waits;
  json["model"] = {{"name", report.model_name},
                   {"vocab_size", report.vocab_size},
                   {"max_context", report.model_max_context}};
  if (report.real_tokens) {
    json["real_tokens"] = {{"token_file", report.token_file},
                           {"block_tokens", kPrefixBlockTokens},
                           {"contexts_cut_to_model", report.contexts_cut_to_model},
                           {"temperature", report.sampling.temperature},
                           {"top_p", report.sampling.top_p},
                           {"seed", report.sampling.seed},
                           {"ignore_eos", report.sampling.ignore_eos}};
    json["finish_reasons"] = report.finish_reasons;
    nlohmann::json samples_json = nlohmann::json::array();
    for (const OutputSample& sample : report.samples) {
      samples_json.push_back({{"index", sample.index},
                              {"status", sample.status},
                              {"context_tokens", sample.context_tokens},
                              {"context_tail_ids", sample.context_tail_ids},
                              {"token_ids", sample.token_ids},
                              {"finish_reason", sample.finish_reason}});
    }
    json["samples"] = samples_json;
  }
  return json;
}

std::string ReplayReportToMarkdown(const ReplayReport& report) {
  const auto ms = [](double seconds) { return absl::StrFormat("%.2f ms", seconds * 1e3); };
  const auto cap = [](int64_t value) {
    return value > 0 ? absl::StrCat(value) : std::string("none");
  };
  std::string failures;
  for (const auto& [code, count] : report.failures_by_code) {
    absl::StrAppend(&failures, failures.empty() ? " (" : ", ", code, ": ", count);
  }
  if (!failures.empty()) failures += ")";
  std::string out = "| figure | value |\n|---|---|\n";
  const auto row = [&out](const std::string& name, const std::string& value) {
    absl::StrAppend(&out, "| ", name, " | ", value, " |\n");
  };
  row("caps: limit / max context / max output",
      absl::StrCat(cap(report.caps.limit), " / ", cap(report.caps.max_context), " / ",
                   cap(report.caps.max_output)));
  if (report.real_tokens) {
    row("model", absl::StrFormat("%s (vocabulary %d, max context %d)",
                                 report.model_name.empty() ? std::string("?") : report.model_name,
                                 report.vocab_size, report.model_max_context));
    row("contexts",
        absl::StrCat("real text from ", report.token_file, ", one ", kPrefixBlockTokens,
                     "-token slice per trace hash id (context_tokens); ",
                     report.contexts_cut_to_model, " cut to fit the model's max context"));
    const ReplaySampling& sampling = report.sampling;
    row("sampling",
        absl::StrCat(
            sampling.temperature > 0
                ? absl::StrFormat("temperature %g, top-p %g, seed %d + request index",
                                  sampling.temperature, sampling.top_p > 0 ? sampling.top_p : 1.0F,
                                  sampling.seed)
                : std::string("greedy"),
            sampling.ignore_eos ? "; ignore_eos" : "; ends at EOS"));
  }
  row("time scale / max in flight / draft length",
      absl::StrCat(report.time_scale == 0 ? "0 (as fast as possible)"
                                          : absl::StrFormat("%g", report.time_scale),
                   " / ", report.max_in_flight, " / ", report.draft_length));
  row("requests completed / failed",
      absl::StrCat(report.completed, " / ", report.failed, failures, " of ", report.requests,
                   report.stopped ? " (stopped by a signal before the end)" : ""));
  row("migrations (requests moved off a failed worker)",
      absl::StrCat(report.migrations, " (", report.migrated_requests, " requests)"));
  row("wall time", absl::StrFormat("%.2f s", report.wall_seconds));
  row("TTFT p50 / p99", absl::StrCat(ms(report.ttft_p50), " / ", ms(report.ttft_p99)));
  row("inter-token latency p50 / p99 / max",
      absl::StrCat(ms(report.itl_p50), " / ", ms(report.itl_p99), " / ", ms(report.itl_max)));
  row("client-side wait (max in flight) mean / max",
      absl::StrCat(ms(report.client_wait_mean), " / ", ms(report.client_wait_max)));
  row("generated tokens", absl::StrCat(report.generated_tokens));
  row("decode tokens/s (generated / wall)",
      absl::StrFormat("%.1f", report.decode_tokens_per_second));
  row("realized block sparsity",
      absl::StrFormat("%.4f (%d of %d blocks scored)", report.realized_block_sparsity,
                      report.blocks_scored, report.blocks_visible));
  row("audited miss rate",
      report.audited_rows > 0
          ? absl::StrFormat("%.4f over %d rows", report.audited_miss_rate, report.audited_rows)
          : std::string("not audited"));
  row("prefix slots reused",
      absl::StrFormat("%d (%.4f of %d context slots; the trace allows at most %d)",
                      report.prefix_slots_reused, report.prefix_reuse_fraction,
                      report.context_slots, report.prefix_slots_reusable));
  row("cache blocks used min / mean / max (capacity)",
      absl::StrFormat("%.0f / %.1f / %.0f (%d), %d samples", report.cache_used_min,
                      report.cache_used_mean, report.cache_used_max, report.cache_capacity,
                      report.cache_samples.size()));
  row("spec acceptance (accepted / drafted)",
      absl::StrFormat("%.4f (%d / %d)", report.spec_acceptance, report.accepted_tokens,
                      report.drafted_tokens));
  if (report.real_tokens) {
    std::string reasons;
    for (const auto& [reason, count] : report.finish_reasons) {
      absl::StrAppend(&reasons, reasons.empty() ? "" : ", ", reason, ": ", count);
    }
    row("finish reasons (completed requests)", reasons.empty() ? std::string("none") : reasons);
  }
  for (const LayerWait& wait : report.selection_wait) {
    row(absl::StrCat("selection wait, layer ", wait.layer, " mean / p99"),
        absl::StrCat(ms(wait.mean_seconds), " / ", ms(wait.p99_seconds), " over ", wait.steps,
                     " steps"));
  }
  if (!report.samples.empty()) {
    absl::StrAppend(&out,
                    "\n### Sample outputs (generated token ids; the JSON report has them and "
                    "each context's last ",
                    kSampleContextTailTokens,
                    " ids: `python -m dsa_model.replay_samples REPORT.json` decodes them)\n\n"
                    "| request | context tokens | status | finish | generated token ids |\n"
                    "|---|---|---|---|---|\n");
    for (const OutputSample& sample : report.samples) {
      absl::StrAppend(&out, "| ", sample.index, " | ", sample.context_tokens, " | ", sample.status,
                      " | ", sample.finish_reason.empty() ? std::string("-") : sample.finish_reason,
                      " | ", absl::StrJoin(sample.token_ids, " "), " |\n");
    }
  }
  return out;
}

}  // namespace dsa
