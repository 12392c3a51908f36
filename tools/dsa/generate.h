// `dsa generate`: one prompt through a coordinator that serves a real model, its text streamed.
// Routers tokenize, so the tokenization and the stream stay in Python: this runs the Python
// client's `python -m dsa_client.generate` (clients/python; the `tokenizers` package with the
// model's tokenizer.json) against the coordinator, which `dsa generate` starts as a local cluster
// when none is given.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dsa {

/// How to run the Python side.
struct PythonGenerateOptions {
  /// The interpreter: one with grpcio, protobuf and tokenizers (scripts/model_setup.sh's
  /// .venv-model). Empty = $DSA_PYTHON, else .venv-model/bin/python found by FindRepoFile.
  std::string python;
  /// The folder holding the dsa_client package, put first on PYTHONPATH. Empty = clients/python
  /// found by FindRepoFile.
  std::string client_dir;
  /// Arguments after `--target ADDRESS` (dsa_client.generate's flags, then the prompt).
  std::vector<std::string> args;
};

/// Runs `python -m dsa_client.generate --target coordinator args...` with this process's stdin,
/// stdout and stderr, SIGINT and SIGTERM at their defaults in the child (Ctrl-C stops it; the
/// caller keeps them blocked for its own cleanup), and waits for it. Returns its exit code (128 +
/// the signal that killed it). Errors: NOT_FOUND (no interpreter or client folder, naming what to
/// run or give), INTERNAL (it could not be started).
absl::StatusOr<int> RunPythonGenerate(const std::string& coordinator,
                                      const PythonGenerateOptions& options);

}  // namespace dsa
