#include "server/process_metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace dsa {
namespace {

prometheus::MetricFamily Family(const char* name, const char* help, prometheus::MetricType type,
                                double value) {
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  return {name, help, type, {metric}};
}

// The fields of /proc/self/stat after the command name (which may hold spaces and parentheses):
// field 3 (state) is element 0.
std::optional<std::vector<std::string>> StatFields() {
  std::ifstream in("/proc/self/stat");
  std::string line;
  if (!std::getline(in, line)) return std::nullopt;
  const size_t end_of_name = line.rfind(')');
  if (end_of_name == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(end_of_name + 1));
  std::vector<std::string> fields;
  for (std::string field; rest >> field;) fields.push_back(field);
  return fields;
}

std::optional<double> BootTimeSeconds() {
  std::ifstream in("/proc/stat");
  for (std::string key; in >> key;) {
    if (key == "btime") {
      double seconds = 0;
      if (in >> seconds) return seconds;
      return std::nullopt;
    }
    in.ignore(1 << 20, '\n');
  }
  return std::nullopt;
}

double Number(const std::string& text) { return std::strtod(text.c_str(), nullptr); }

}  // namespace

std::vector<prometheus::MetricFamily> ProcessMetrics::Collect() const {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> families;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page_bytes = static_cast<double>(sysconf(_SC_PAGESIZE));
  // proc(5): utime 14, stime 15, starttime 22, vsize 23, rss 24 (1-based); element = field - 3.
  if (const auto fields = StatFields(); fields.has_value() && fields->size() >= 22 && ticks > 0) {
    const double cpu = (Number((*fields)[11]) + Number((*fields)[12])) / ticks;
    families.push_back(Family("process_cpu_seconds_total", "User and system CPU time, seconds",
                              MetricType::Counter, cpu));
    families.push_back(Family("process_virtual_memory_bytes", "Virtual memory size, bytes",
                              MetricType::Gauge, Number((*fields)[20])));
    families.push_back(Family("process_resident_memory_bytes", "Resident memory size, bytes",
                              MetricType::Gauge, Number((*fields)[21]) * page_bytes));
    if (const auto boot = BootTimeSeconds(); boot.has_value()) {
      families.push_back(Family("process_start_time_seconds",
                                "Start time of the process since the Unix epoch, seconds",
                                MetricType::Gauge, *boot + Number((*fields)[19]) / ticks));
    }
  }
  std::error_code error;
  double open_fds = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", error), end; !error && it != end;
       it.increment(error)) {
    ++open_fds;
  }
  if (!error) {
    families.push_back(
        Family("process_open_fds", "Open file descriptors", MetricType::Gauge, open_fds));
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    families.push_back(Family("process_max_fds", "Maximum number of open file descriptors",
                              MetricType::Gauge, static_cast<double>(limit.rlim_cur)));
  }
  return families;
}

}  // namespace dsa
