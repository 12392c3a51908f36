// Output helpers the `dsa` subcommands share: progress lines on stderr, report files opened before
// the work so a bad path fails first, and whole-file replacement for checkpointed reports.
#pragma once

#include <fstream>
#include <string>

namespace dsa::commands {

/// Prints `line` indented on stderr and flushes it (a long run's progress).
void PrintProgress(const std::string& line);

/// Opens `path` for writing now, so a bad path fails before minutes of work; empty path = none.
/// Returns false after printing why it could not.
bool OpenOutput(const std::string& path, std::ofstream& out);

/// Writes `text` to `out` (opened by OpenOutput for `path`) and closes it; empty path = none.
/// Returns false after printing why the write failed.
bool WriteOutput(const std::string& path, std::ofstream& out, const std::string& text);

/// Whether ReplaceOutput can write beside `path` (its temporary is created and removed), so a bad
/// path fails before minutes of work without truncating what `path` holds; empty path = none.
bool CanReplaceOutput(const std::string& path);

/// Replaces `path` with `text` through a temporary beside it, so that a reader never sees half a
/// file and a run killed mid-write leaves the previous whole one; empty path = none. On failure
/// the temporary is removed and `path` kept.
bool ReplaceOutput(const std::string& path, const std::string& text);

/// A file named by a flag, or the repository's default (FindRepoFile) when the flag is empty.
std::string RepoFileOr(const std::string& given, const char* fallback);

}  // namespace dsa::commands
