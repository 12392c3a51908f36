#include "server/log.h"

#include <atomic>
#include <cstdio>

#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace dsa {

namespace {

std::atomic<int> min_log_level{static_cast<int>(LogLevel::kInfo)};

int LevelOf(absl::string_view name) {
  if (name == "debug") return static_cast<int>(LogLevel::kDebug);
  if (name == "info") return static_cast<int>(LogLevel::kInfo);
  if (name == "warn") return static_cast<int>(LogLevel::kWarn);
  if (name == "error") return static_cast<int>(LogLevel::kError);
  return -1;
}

}  // namespace

bool SetLogLevel(const std::string& level) {
  const int value = LevelOf(level);
  if (value < 0) return false;
  min_log_level.store(value, std::memory_order_relaxed);
  return true;
}

bool LogLevelEnabled(const char* level) {
  const int value = LevelOf(level);
  return (value < 0 ? static_cast<int>(LogLevel::kError) : value) >=
         min_log_level.load(std::memory_order_relaxed);
}

void LogJson(const char* level, const char* msg, nlohmann::json fields) {
  if (!LogLevelEnabled(level)) return;
  fields["ts"] = absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone());
  fields["level"] = level;
  fields["msg"] = msg;
  const std::string line = fields.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

}  // namespace dsa
