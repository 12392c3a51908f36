// Starting a child process without a shell (posix_spawn), for `dsa up`'s servers and
// `dsa generate`'s Python client.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dsa {

/// How SpawnChild sets up the child. SIGINT, SIGTERM and SIGPIPE are at their defaults and no
/// signal is blocked in the child, whatever the parent blocks or ignores.
struct SpawnOptions {
  /// stdin from /dev/null (else the parent's).
  bool stdin_from_dev_null = false;
  /// stdout and stderr to these files, created or truncated, mode 0644 (empty: the parent's).
  std::string stdout_path;
  std::string stderr_path;
  /// The child leads a process group of its own, so that a Ctrl-C at the terminal reaches only
  /// the parent, which stops its children in order.
  bool own_process_group = false;
  /// The child's environment, "NAME=value" entries (unset: the parent's).
  std::optional<std::vector<std::string>> environment;
};

/// Starts `binary args...` (argv[0] is `binary`; no PATH search). Returns the child's pid; the
/// caller waits for it. Errors: INTERNAL naming the binary and the reason when posix_spawn fails
/// (a missing binary, a file that cannot be opened, no memory).
absl::StatusOr<pid_t> SpawnChild(const std::string& binary, const std::vector<std::string>& args,
                                 const SpawnOptions& options = {});

}  // namespace dsa
