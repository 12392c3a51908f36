// Production traces for `dsa replay`: the Mooncake conversation trace (JSON lines) and the Azure
// LLM inference trace (CSV), read into one request list with arrival times relative to the first.
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "contracts/layout.h"

namespace dsa {

/// One request of a trace.
struct TraceRequest {
  int64_t arrival_ms = 0;      // since the trace's first request, >= 0, non-decreasing
  int64_t context_tokens = 0;  // prompt length, >= 1
  int64_t output_tokens = 0;   // tokens to generate, >= 1
  /// Mooncake only: one id per 512-token prefix block of the prompt (equal ids across requests =
  /// a shared, reusable prefix); empty for Azure.
  std::vector<uint64_t> prefix_block_ids;
};

/// Reads Mooncake JSON lines: {"timestamp": ms, "input_length": n, "output_length": n,
/// "hash_ids": [...]} per line; blank lines are skipped. Arrival times are the timestamps relative
/// to the first request's (ms). Errors (INVALID_ARGUMENT, naming the line): malformed JSON, a
/// missing or mistyped field, a negative timestamp, a length < 1, more hash ids than
/// ceil(input_length / 512), timestamps going backwards.
absl::StatusOr<std::vector<TraceRequest>> ReadMooncakeTrace(std::istream& in);

/// Reads the Azure CSV: header `TIMESTAMP,ContextTokens,GeneratedTokens`, then rows like
/// `2023-11-16 18:15:46.6805900,374,44` (UTC, fractional seconds). Arrival times are relative to
/// the first row, in whole milliseconds (truncated). Errors (INVALID_ARGUMENT, naming the line): a
/// wrong header, a row without three fields, an unparsable time or count, a count < 1, time going
/// backwards.
absl::StatusOr<std::vector<TraceRequest>> ReadAzureTrace(std::istream& in);

/// Reads `path` by its extension: `.jsonl` (Mooncake) or `.csv` (Azure). NOT_FOUND when the file
/// cannot be opened; INVALID_ARGUMENT for another extension or the readers' errors, prefixed with
/// "<path>: ".
absl::StatusOr<std::vector<TraceRequest>> ReadTraceFile(const std::string& path);

}  // namespace dsa
