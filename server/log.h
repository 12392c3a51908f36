// Structured logging: one JSON line on stderr per event, filtered by a process-wide level. Its own
// small library (dsa_log) so that the security code below the servers can log too.
#pragma once

#include <string>

#include "nlohmann/json.hpp"

namespace dsa {

/// The log levels of LogJson, lowest first.
enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

/// Lines below `level` are dropped from then on (thread-safe). Returns false, changing nothing,
/// for a name other than "debug", "info", "warn" or "error".
bool SetLogLevel(const std::string& level);

/// Whether LogJson would write a line at `level` now (to skip building its fields when not).
bool LogLevelEnabled(const char* level);

/// One structured log line on stderr: {"ts": RFC 3339 UTC time with microseconds, "level", "msg",
/// fields...}, unless `level` ("debug", "info", "warn" or "error"; anything else counts as
/// "error") is below SetLogLevel's. Invalid UTF-8 in a field is replaced, never thrown on.
/// Thread-safe (one fprintf per line).
void LogJson(const char* level, const char* msg, nlohmann::json fields = nlohmann::json::object());

}  // namespace dsa
