// Trace readers (see trace.h).
#include "tools/dsa/trace.h"

#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace dsa {
namespace {

absl::Status LineError(int64_t line, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("trace line ", line, ": ", what));
}

// Reads an integer field of a JSON object; false when missing or not an integer.
bool IntField(const nlohmann::json& object, const char* name, int64_t* out) {
  auto it = object.find(name);
  if (it == object.end() || !it->is_number_integer()) return false;
  *out = it->get<int64_t>();
  return true;
}

}  // namespace

absl::StatusOr<std::vector<TraceRequest>> ReadMooncakeTrace(std::istream& in) {
  std::vector<TraceRequest> requests;
  std::string text;
  int64_t line = 0;
  int64_t first_timestamp = 0, last_timestamp = 0;
  while (std::getline(in, text)) {
    ++line;
    if (absl::StripAsciiWhitespace(text).empty()) continue;
    const nlohmann::json object = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (object.is_discarded() || !object.is_object()) return LineError(line, "not a JSON object");
    TraceRequest request;
    if (!IntField(object, "timestamp", &request.arrival_ms) || request.arrival_ms < 0) {
      return LineError(line, "\"timestamp\" must be an integer >= 0 (ms)");
    }
    if (!IntField(object, "input_length", &request.context_tokens) || request.context_tokens < 1) {
      return LineError(line, "\"input_length\" must be an integer >= 1");
    }
    if (!IntField(object, "output_length", &request.output_tokens) || request.output_tokens < 1) {
      return LineError(line, "\"output_length\" must be an integer >= 1");
    }
    auto ids = object.find("hash_ids");
    if (ids != object.end()) {
      if (!ids->is_array()) return LineError(line, "\"hash_ids\" must be an array");
      for (const auto& id : *ids) {
        if (!id.is_number_unsigned()) {
          return LineError(line, "\"hash_ids\" must hold integers >= 0");
        }
        request.prefix_block_ids.push_back(id.get<uint64_t>());
      }
      const int64_t blocks = (request.context_tokens + kPrefixBlockTokens - 1) / kPrefixBlockTokens;
      if (static_cast<int64_t>(request.prefix_block_ids.size()) > blocks) {
        return LineError(line,
                         absl::StrCat(request.prefix_block_ids.size(), " hash ids for ",
                                      request.context_tokens, " tokens (at most ", blocks, ")"));
      }
    }
    if (!requests.empty() && request.arrival_ms < last_timestamp) {
      return LineError(line, "timestamps go backwards");
    }
    // Arrivals relative to the first request (as the Azure reader's), so that a trace whose first
    // timestamp is late does not idle before it.
    if (requests.empty()) first_timestamp = request.arrival_ms;
    last_timestamp = request.arrival_ms;
    request.arrival_ms -= first_timestamp;
    requests.push_back(std::move(request));
  }
  if (requests.empty()) return absl::InvalidArgumentError("trace has no requests");
  return requests;
}

absl::StatusOr<std::vector<TraceRequest>> ReadAzureTrace(std::istream& in) {
  std::string text;
  if (!std::getline(in, text) ||
      absl::StripAsciiWhitespace(text) != "TIMESTAMP,ContextTokens,GeneratedTokens") {
    return LineError(1, "expected the header TIMESTAMP,ContextTokens,GeneratedTokens");
  }
  std::vector<TraceRequest> requests;
  absl::Time first;
  int64_t line = 1;
  while (std::getline(in, text)) {
    ++line;
    const absl::string_view row = absl::StripAsciiWhitespace(text);
    if (row.empty()) continue;
    const std::vector<absl::string_view> fields = absl::StrSplit(row, ',');
    if (fields.size() != 3) return LineError(line, "expected 3 comma-separated fields");
    absl::Time time;
    std::string error;
    if (!absl::ParseTime("%Y-%m-%d %H:%M:%E*S", std::string(fields[0]), absl::UTCTimeZone(), &time,
                         &error)) {
      return LineError(line, absl::StrCat("bad TIMESTAMP: ", error));
    }
    if (time == absl::InfiniteFuture() || time == absl::InfinitePast()) {
      // absl::ParseTime also reads "infinite-future" and "infinite-past".
      return LineError(line, "TIMESTAMP must be a date and time, not an infinity");
    }
    TraceRequest request;
    if (!absl::SimpleAtoi(fields[1], &request.context_tokens) || request.context_tokens < 1) {
      return LineError(line, "ContextTokens must be an integer >= 1");
    }
    if (!absl::SimpleAtoi(fields[2], &request.output_tokens) || request.output_tokens < 1) {
      return LineError(line, "GeneratedTokens must be an integer >= 1");
    }
    if (requests.empty()) first = time;
    request.arrival_ms = absl::ToInt64Milliseconds(time - first);
    if (request.arrival_ms < 0 ||
        (!requests.empty() && request.arrival_ms < requests.back().arrival_ms)) {
      return LineError(line, "TIMESTAMP goes backwards");
    }
    requests.push_back(std::move(request));
  }
  if (requests.empty()) return absl::InvalidArgumentError("trace has no requests");
  return requests;
}

absl::StatusOr<std::vector<TraceRequest>> ReadTraceFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot open trace ", path, ": ", std::strerror(errno)));
  }
  absl::StatusOr<std::vector<TraceRequest>> read;
  if (absl::EndsWith(path, ".jsonl")) {
    read = ReadMooncakeTrace(in);
  } else if (absl::EndsWith(path, ".csv")) {
    read = ReadAzureTrace(in);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("trace ", path, ": unknown format (expected .jsonl Mooncake or .csv Azure)"));
  }
  if (read.ok()) return read;
  return absl::Status(read.status().code(), absl::StrCat(path, ": ", read.status().message()));
}

}  // namespace dsa
