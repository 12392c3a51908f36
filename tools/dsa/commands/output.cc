// Output helpers the `dsa` subcommands share (output.h).
#include "tools/dsa/commands/output.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "tools/dsa/cluster.h"

namespace dsa::commands {
namespace {

// The temporary ReplaceOutput writes beside `path`.
std::string PartialPath(const std::string& path) { return path + ".partial"; }

}  // namespace

void PrintProgress(const std::string& line) {
  std::fprintf(stderr, "  %s\n", line.c_str());
  std::fflush(stderr);
}

bool OpenOutput(const std::string& path, std::ofstream& out) {
  if (path.empty()) return true;
  out.open(path);
  if (!out) {
    std::fprintf(stderr, "dsa: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    return false;
  }
  return true;
}

bool WriteOutput(const std::string& path, std::ofstream& out, const std::string& text) {
  if (path.empty()) return true;
  out << text;
  out.close();
  if (!out) {
    std::fprintf(stderr, "dsa: writing %s failed: %s\n", path.c_str(), std::strerror(errno));
    return false;
  }
  return true;
}

bool CanReplaceOutput(const std::string& path) {
  if (path.empty()) return true;
  std::ofstream probe(PartialPath(path), std::ios::trunc);
  const int error = errno;
  if (!probe) {
    std::fprintf(stderr, "dsa: cannot write %s: %s\n", PartialPath(path).c_str(),
                 std::strerror(error));
    return false;
  }
  probe.close();
  std::remove(PartialPath(path).c_str());
  return true;
}

bool ReplaceOutput(const std::string& path, const std::string& text) {
  if (path.empty()) return true;
  const std::string temporary = PartialPath(path);
  std::ofstream out(temporary, std::ios::trunc);
  out << text;
  out.close();
  const bool written = static_cast<bool>(out);
  if (!written || std::rename(temporary.c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "dsa: writing %s failed%s%s\n", path.c_str(), written ? ": " : "",
                 written ? std::strerror(errno) : "");
    std::remove(temporary.c_str());
    return false;
  }
  return true;
}

std::string RepoFileOr(const std::string& given, const char* fallback) {
  return dsa::FindRepoFile(given.empty() ? fallback : given);
}

}  // namespace dsa::commands
