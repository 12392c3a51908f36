// `dsa generate`'s Python side: spawns dsa_client.generate (SpawnChild: no shell) and waits.
#include "tools/dsa/generate.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tools/dsa/cluster.h"
#include "tools/dsa/spawn.h"

extern char** environ;

namespace dsa {

absl::StatusOr<int> RunPythonGenerate(const std::string& coordinator,
                                      const PythonGenerateOptions& options) {
  std::string python = options.python;
  if (python.empty()) {
    const char* from_env = std::getenv("DSA_PYTHON");
    python = from_env != nullptr && *from_env != '\0' ? std::string(from_env)
                                                      : FindRepoFile(".venv-model/bin/python");
  }
  if (access(python.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat(
        "no Python interpreter at ", python,
        ": bash scripts/model_setup.sh makes .venv-model/ (grpcio, protobuf, tokenizers); or give "
        "--python or $DSA_PYTHON"));
  }
  const std::string client_dir =
      options.client_dir.empty() ? FindRepoFile("clients/python") : options.client_dir;
  if (access((client_dir + "/dsa_client/generate.py").c_str(), R_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("no dsa_client package in ", client_dir,
                                            " (give --client-dir: the repository's "
                                            "clients/python)"));
  }

  // The environment with the client first on PYTHONPATH.
  std::vector<std::string> environment;
  std::string python_path = "PYTHONPATH=" + client_dir;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    if (std::strncmp(*entry, "PYTHONPATH=", 11) == 0) {
      if ((*entry)[11] != '\0') python_path += std::string(":") + (*entry + 11);
    } else {
      environment.emplace_back(*entry);
    }
  }
  environment.push_back(python_path);
  std::vector<std::string> args = {"-m", "dsa_client.generate", "--target", coordinator};
  args.insert(args.end(), options.args.begin(), options.args.end());
  SpawnOptions spawn;
  spawn.environment = std::move(environment);
  absl::StatusOr<pid_t> spawned = SpawnChild(python, args, spawn);
  if (!spawned.ok()) return spawned.status();
  const pid_t pid = *spawned;
  int wait_status = 0;
  while (waitpid(pid, &wait_status, 0) < 0) {
    if (errno != EINTR) {
      return absl::InternalError(absl::StrCat("waiting for ", python, ": ", std::strerror(errno)));
    }
  }
  return WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : 128 + WTERMSIG(wait_status);
}

}  // namespace dsa
