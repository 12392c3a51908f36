// LocalCluster: the three server binaries as child processes on loopback (SpawnChild: no shell).
#include "tools/dsa/cluster.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attention_worker/llama_model.h"
#include "common/safetensors.h"
#include "grpcpp/grpcpp.h"
#include "server/health_check.h"
#include "tools/dsa/spawn.h"

namespace dsa {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kStderrTailBytes = 4000;
constexpr std::chrono::milliseconds kPollInterval{20};

// A process's exit code from a wait status: the code, or 128 + the signal.
int ExitCode(int wait_status) {
  return WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : 128 + WTERMSIG(wait_status);
}

// Reaps `process` if it has exited; true when it has (exit_code set, pid -1).
bool Reaped(ClusterProcess& process) {
  if (process.pid < 0) return true;
  int wait_status = 0;
  const pid_t done = waitpid(process.pid, &wait_status, WNOHANG);
  if (done == process.pid) {
    process.exit_code = ExitCode(wait_status);
    process.pid = -1;
    return true;
  }
  return false;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The value after `marker` on its line in `text`, up to a space, a '/' (when `stop_at_slash`) or
// the end of the line; "" when the marker or the end of its line is not there yet.
std::string ValueAfter(const std::string& text, const std::string& marker, bool stop_at_slash) {
  const size_t at = text.find(marker);
  if (at == std::string::npos) return "";
  const size_t begin = at + marker.size();
  const size_t end_of_line = text.find('\n', begin);
  if (end_of_line == std::string::npos) return "";  // the line is not complete yet
  size_t end = text.find_first_of(stop_at_slash ? " /\n" : " \n", begin);
  return text.substr(begin, end - begin);
}

// A description of `process` for error messages: name, pid, log file and the tail of its stderr.
std::string Describe(const ClusterProcess& process) {
  std::string tail = FileTail(process.log_path, kStderrTailBytes);
  if (tail.empty()) tail = "(empty)\n";
  return absl::StrCat(process.name, " (", process.binary, "); its stderr is in ", process.log_path,
                      " and ends with:\n", tail);
}

}  // namespace

std::string ExecutableDir() {
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? "" : exe.parent_path().string();
}

std::string FindRepoFile(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path given(path);
  if (path.empty()) return path;
  if (fs::exists(given, error)) return fs::absolute(given, error).lexically_normal().string();
  if (given.is_absolute()) return path;
  const std::string exe_dir = ExecutableDir();
  if (exe_dir.empty()) return path;
  const fs::path in_repo = fs::path(exe_dir).parent_path().parent_path() / given;
  if (fs::exists(in_repo, error)) return in_repo.lexically_normal().string();
  return path;
}

std::string FileTail(const std::string& path, size_t max_bytes) {
  std::string text = ReadFile(path);
  if (text.size() <= max_bytes) return text;
  text = text.substr(text.size() - max_bytes);
  const size_t newline = text.find('\n');
  return newline == std::string::npos ? text : text.substr(newline + 1);
}

// grpc.health.v1.Health/Check by hand (grpc's generated health stubs are not installed): request
// field 1 (service name), response field 1 (status enum).
int CheckHealth(const std::string& address, const std::string& service,
                std::chrono::milliseconds timeout) {
  const auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  // A server still binding is not a failure yet.
  return CheckHealthStatus(*channel, service, timeout, /*wait_for_ready=*/true);
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(
    const LocalClusterOptions& options) {
  const bool colocated = options.transport == "inprocess";
  if (!colocated && options.transport != "grpc" && options.transport != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown transport \"", options.transport, "\": grpc, inprocess or nccl"));
  }
  if (options.transport == "nccl" && options.indexer_device != "cuda") {
    return absl::InvalidArgumentError(
        "--transport nccl needs the indexers on GPUs (--indexer-device cuda): NCCL data planes "
        "run between an attention GPU and an indexer GPU");
  }
  if (options.num_indexers < 1 || options.num_attention_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a cluster needs at least one indexer and one attention worker (asked for ",
                     options.num_indexers, " and ", options.num_attention_workers, ")"));
  }
  const bool real_model = options.model == kSmolLM2Model;
  if (!real_model && options.model != kPatternModel) {
    return absl::InvalidArgumentError(absl::StrCat("unknown model \"", options.model,
                                                   "\": ", kPatternModel, " or ", kSmolLM2Model));
  }
  std::string model_file, indexer_weights;
  LightningIndexerConfig indexer_shape;
  if (real_model) {
    model_file = FindRepoFile(options.model_file.empty() ? kDefaultModelFile : options.model_file);
    indexer_weights = FindRepoFile(options.indexer_weights.empty() ? kDefaultIndexerWeights
                                                                   : options.indexer_weights);
    if (access(indexer_weights.c_str(), R_OK) != 0) {
      return absl::NotFoundError(
          absl::StrCat("--model smollm2: no indexer weights ", indexer_weights,
                       " (the repository carries data/models/smollm2_indexer.safetensors; or "
                       "give --indexer-weights)"));
    }
    // The indexer's H and D, which every dsa-indexer must serve, are the weights' own.
    auto weights = SafetensorsFile::Open(indexer_weights);
    if (!weights.ok()) return weights.status();
    auto shape = LightningIndexerConfig::FromMetadata((*weights)->metadata(), indexer_weights);
    if (!shape.ok()) return shape.status();
    indexer_shape = *shape;
    if (options.num_heads.value_or(shape->num_heads) != shape->num_heads ||
        options.head_dim.value_or(shape->head_dim) != shape->head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--model smollm2's indexer is H ", shape->num_heads, ", D ", shape->head_dim, " (",
          indexer_weights, "): leave --num-heads and --head-dim unset or give those"));
    }
    if (access(model_file.c_str(), R_OK) != 0) {
      return absl::NotFoundError(
          absl::StrCat("--model smollm2: no model file ", model_file,
                       " (bash scripts/model_setup.sh writes it; or give --model-file)"));
    }
  } else if (!options.model_file.empty() || !options.indexer_weights.empty()) {
    return absl::InvalidArgumentError("--model-file and --indexer-weights need --model smollm2");
  }
  // The indexer shape every dsa-indexer (and a pattern dsa-attention) is given.
  const std::optional<int> num_heads =
      real_model ? std::optional<int>(indexer_shape.num_heads) : options.num_heads;
  const std::optional<int> head_dim =
      real_model ? std::optional<int>(indexer_shape.head_dim) : options.head_dim;
  const std::optional<int> top_k =
      real_model && !options.top_k.has_value() ? std::optional<int>(kSmolLM2TopK) : options.top_k;
  const std::string bin_dir = options.bin_dir.empty() ? ExecutableDir() : options.bin_dir;
  const std::string indexer_binary = bin_dir + "/dsa-indexer";
  const std::string attention_binary = bin_dir + "/dsa-attention";
  const std::string coordinator_binary = bin_dir + "/dsa-coordinator";
  for (const std::string& binary : {indexer_binary, attention_binary, coordinator_binary}) {
    if (access(binary.c_str(), X_OK) != 0) {
      return absl::NotFoundError(absl::StrCat(
          binary, " is not an executable file (build it, or point --bin-dir at the folder)"));
    }
  }

  std::unique_ptr<LocalCluster> cluster(new LocalCluster());
  cluster->stop_timeout_ = options.stop_timeout;
  cluster->startup_timeout_ = options.startup_timeout;
  if (options.log_dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/dsa-cluster-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) {
      return absl::InternalError(
          absl::StrCat("cannot create a log folder ", pattern, ": ", std::strerror(errno)));
    }
    cluster->log_dir_ = pattern;
  } else {
    std::error_code error;
    std::filesystem::create_directories(options.log_dir, error);
    if (error) {
      return absl::InternalError(
          absl::StrCat("cannot create the log folder ", options.log_dir, ": ", error.message()));
    }
    cluster->log_dir_ = options.log_dir;
  }

  const auto add = [](std::vector<std::string>& args, const char* flag, const auto& value) {
    if (value.has_value()) {
      args.emplace_back(flag);
      std::ostringstream text;
      text << *value;
      args.push_back(text.str());
    }
  };
  const auto make = [&](const std::string& name, const std::string& binary,
                        std::vector<std::string> args) {
    ClusterProcess process;
    process.name = name;
    process.binary = binary;
    process.args = std::move(args);
    process.stdout_path = absl::StrCat(cluster->log_dir_, "/", name, ".stdout");
    process.log_path = absl::StrCat(cluster->log_dir_, "/", name, ".log");
    return process;
  };
  const std::vector<std::string> loopback = {"--listen", "127.0.0.1:0", "--metrics-listen",
                                             "127.0.0.1:0"};

  // The flags of indexer i: for a dsa-indexer ("--"), or for the co-located indexer of
  // dsa-attention i ("--indexer-").
  const auto indexer_flags = [&](int i, const std::string& prefix) {
    std::vector<std::string> args;
    const auto flag = [&](const char* name) { return prefix + name; };
    add(args, flag("capacity-blocks").c_str(), options.capacity_blocks);
    add(args, flag("audit-fraction").c_str(), options.audit_fraction);
    add(args, flag("device").c_str(), options.indexer_device);
    if (options.indexer_device == "cuda" && !options.indexer_cuda_devices.empty()) {
      add(args, flag("cuda-device").c_str(),
          std::optional<int>(
              options.indexer_cuda_devices[i % options.indexer_cuda_devices.size()]));
    }
    for (const std::string& extra : options.indexer_args) {
      // "--audit-seed=3" -> "--indexer-audit-seed=3" for a co-located indexer.
      args.push_back(extra.rfind("--", 0) == 0 ? prefix + extra.substr(2) : extra);
    }
    return args;
  };

  std::vector<std::string> indexer_addresses;
  for (int i = 0; i < (colocated ? 0 : options.num_indexers); ++i) {
    std::vector<std::string> args = loopback;
    add(args, "--num-heads", num_heads);
    add(args, "--head-dim", head_dim);
    const std::vector<std::string> flags = indexer_flags(i, "--");
    args.insert(args.end(), flags.begin(), flags.end());
    if (absl::Status started = cluster->StartProcess(
            make(absl::StrCat("dsa-indexer-", i), indexer_binary, std::move(args)),
            options.startup_timeout);
        !started.ok()) {
      return started;
    }
    indexer_addresses.push_back(cluster->processes_.back().address);
  }
  std::vector<std::string> attention_addresses;
  for (int i = 0; i < options.num_attention_workers; ++i) {
    std::vector<std::string> args = loopback;
    if (real_model) {
      // Its shapes come from its files; the pattern model's --num-heads, --head-dim and --seed
      // are refused.
      args.insert(args.end(), {"--model", kSmolLM2Model, "--model-file", model_file,
                               "--indexer-weights", indexer_weights});
    } else {
      add(args, "--num-heads", options.num_heads);
      add(args, "--head-dim", options.head_dim);
      add(args, "--seed", options.seed);
    }
    add(args, "--layer-pattern", options.layer_pattern);
    add(args, "--kv-capacity-slots", options.kv_capacity_slots);
    add(args, "--attention-device", options.attention_device);
    if (options.attention_device == "cuda" && !options.attention_cuda_devices.empty()) {
      add(args, "--attention-cuda-device",
          std::optional<int>(
              options.attention_cuda_devices[i % options.attention_cuda_devices.size()]));
    }
    if (options.transport == "nccl") args.insert(args.end(), {"--transport", "nccl"});
    if (colocated) {
      args.insert(args.end(), {"--transport", "inprocess"});
      const std::vector<std::string> flags = indexer_flags(i, "--indexer-");
      args.insert(args.end(), flags.begin(), flags.end());
    }
    args.insert(args.end(), options.attention_args.begin(), options.attention_args.end());
    if (absl::Status started = cluster->StartProcess(
            make(absl::StrCat("dsa-attention-", i), attention_binary, std::move(args)),
            options.startup_timeout);
        !started.ok()) {
      return started;
    }
    attention_addresses.push_back(cluster->processes_.back().address);
    // A co-located indexer is served at its attention worker's address.
    if (colocated) indexer_addresses.push_back(attention_addresses.back());
  }
  std::vector<std::string> args = loopback;
  if (colocated) args.push_back("--colocated");
  for (const std::string& address : indexer_addresses) {
    args.insert(args.end(), {"--indexer", address});
  }
  for (const std::string& address : attention_addresses) {
    args.insert(args.end(), {"--attention", address});
  }
  add(args, "--top-k", top_k);
  add(args, "--target-block-sparsity", options.target_block_sparsity);
  add(args, "--acceptance-rate", options.acceptance_rate);
  add(args, "--seed", options.seed);
  // One lease owner across the coordinator's restarts (Restart keeps its flags), and distinct
  // from every other cluster's: a restarted coordinator's first check frees at once what the dead
  // one held on the workers. A --name among coordinator_args wins.
  const bool named = std::any_of(
      options.coordinator_args.begin(), options.coordinator_args.end(),
      [](const std::string& arg) { return arg == "--name" || arg.rfind("--name=", 0) == 0; });
  if (!named) {
    static std::atomic<int> clusters{0};
    args.insert(args.end(),
                {"--name", absl::StrCat("dsa-local-", getpid(), "-", clusters.fetch_add(1))});
  }
  args.insert(args.end(), options.coordinator_args.begin(), options.coordinator_args.end());
  if (absl::Status started = cluster->StartProcess(
          make("dsa-coordinator", coordinator_binary, std::move(args)), options.startup_timeout);
      !started.ok()) {
    return started;
  }
  return cluster;
}

absl::Status LocalCluster::StartProcess(ClusterProcess process, std::chrono::milliseconds timeout,
                                        std::optional<size_t> replace) {
  SpawnOptions spawn;
  spawn.stdin_from_dev_null = true;
  spawn.stdout_path = process.stdout_path;
  spawn.stderr_path = process.log_path;
  spawn.own_process_group = true;
  absl::StatusOr<pid_t> pid = SpawnChild(process.binary, process.args, spawn);
  if (!pid.ok()) return pid.status();
  process.pid = *pid;
  if (replace.has_value()) {
    processes_[*replace] = std::move(process);
  } else {
    processes_.push_back(std::move(process));
  }
  ClusterProcess& started = replace.has_value() ? processes_[*replace] : processes_.back();
  const auto deadline = Clock::now() + timeout;
  const auto exited = [&started]() {
    return absl::UnavailableError(absl::StrCat(started.name, " exited with code ",
                                               started.exit_code,
                                               " during startup: ", Describe(started)));
  };

  // 1. The printed addresses (both lines come in one flush).
  while (started.address.empty()) {
    if (Reaped(started)) return exited();
    const std::string out = ReadFile(started.stdout_path);
    started.address = ValueAfter(out, "listening on ", /*stop_at_slash=*/false);
    started.metrics_address = ValueAfter(out, "metrics on http://", /*stop_at_slash=*/true);
    if (!started.address.empty()) break;
    if (Clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(started.name, " printed no 'listening on' line within ", timeout.count(),
                       " ms (stdout in ", started.stdout_path, "): ", Describe(started)));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  // 2. Readiness SERVING.
  int health = -1;
  while (true) {
    if (Reaped(started)) return exited();
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    health =
        CheckHealth(started.address, "readiness", std::min(left, std::chrono::milliseconds(1000)));
    if (health == 1) return absl::OkStatus();
    std::this_thread::sleep_for(kPollInterval);
  }
  return absl::DeadlineExceededError(
      absl::StrCat(started.name, " at ", started.address, " was not ready within ", timeout.count(),
                   " ms (last grpc.health.v1 readiness answer: ",
                   health == -1 ? "call failed" : absl::StrCat(health), "): ", Describe(started)));
}

void LocalCluster::StopGroup(const std::vector<size_t>& indices,
                             std::chrono::milliseconds timeout) {
  for (size_t i : indices) {
    if (!Reaped(processes_[i])) kill(processes_[i].pid, SIGTERM);
  }
  const auto deadline = Clock::now() + timeout;
  while (true) {
    bool all_done = true;
    for (size_t i : indices) all_done = Reaped(processes_[i]) && all_done;
    if (all_done) return;
    if (Clock::now() > deadline) break;
    std::this_thread::sleep_for(kPollInterval);
  }
  for (size_t i : indices) {
    ClusterProcess& process = processes_[i];
    if (process.pid < 0) continue;
    kill(process.pid, SIGKILL);
    int wait_status = 0;
    waitpid(process.pid, &wait_status, 0);
    process.exit_code = ExitCode(wait_status);
    process.pid = -1;
  }
}

absl::Status LocalCluster::Stop() {
  if (!stopped_) {
    stopped_ = true;
    std::vector<size_t> coordinator, attention, indexers;
    for (size_t i = 0; i < processes_.size(); ++i) {
      const std::string& name = processes_[i].name;
      if (name.rfind("dsa-coordinator", 0) == 0) {
        coordinator.push_back(i);
      } else if (name.rfind("dsa-attention", 0) == 0) {
        attention.push_back(i);
      } else {
        indexers.push_back(i);
      }
    }
    StopGroup(coordinator, stop_timeout_);
    StopGroup(attention, stop_timeout_);
    StopGroup(indexers, stop_timeout_);
  }
  std::vector<std::string> bad;
  for (const ClusterProcess& process : processes_) {
    if (process.exit_code != 0) {
      bad.push_back(absl::StrCat(process.name, " exited with ", process.exit_code,
                                 process.exit_code == 128 + SIGKILL ? " (killed)" : "", "; log ",
                                 process.log_path));
    }
  }
  if (bad.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("unclean stop: ", absl::StrJoin(bad, "; ")));
}

absl::Status LocalCluster::CheckRunning() {
  for (ClusterProcess& process : processes_) {
    if (Reaped(process)) {
      return absl::UnavailableError(absl::StrCat(process.name, " exited with code ",
                                                 process.exit_code, ": ", Describe(process)));
    }
  }
  return absl::OkStatus();
}

std::vector<size_t> LocalCluster::ReapExited() {
  std::vector<size_t> exited;
  for (size_t i = 0; i < processes_.size(); ++i) {
    if (processes_[i].pid >= 0 && Reaped(processes_[i])) exited.push_back(i);
  }
  return exited;
}

absl::Status LocalCluster::Restart(size_t index) {
  if (index >= processes_.size()) {
    return absl::OutOfRangeError(absl::StrCat("no process ", index));
  }
  ClusterProcess process = processes_[index];
  if (process.pid >= 0 && !Reaped(processes_[index])) {
    return absl::FailedPreconditionError(absl::StrCat(process.name, " still runs"));
  }
  // The same flags, at the addresses it had (the coordinator's clients find it where it was, and
  // under the same --name it takes its workers over from its dead instance at once).
  // (After a failed restart the flags already hold them and the addresses are empty.)
  for (size_t a = 0; a + 1 < process.args.size(); ++a) {
    if (process.args[a] == "--listen" && !process.address.empty()) {
      process.args[a + 1] = process.address;
    }
    if (process.args[a] == "--metrics-listen" && !process.metrics_address.empty()) {
      process.args[a + 1] = process.metrics_address;
    }
  }
  ++process.restarts;
  const std::string stem = absl::StrCat(log_dir_, "/", process.name, ".restart", process.restarts);
  process.stdout_path = stem + ".stdout";
  process.log_path = stem + ".log";
  process.address.clear();
  process.metrics_address.clear();
  process.exit_code = -1;
  absl::Status started = StartProcess(std::move(process), startup_timeout_, index);
  ClusterProcess& restarted = processes_[index];
  if (!started.ok() && restarted.pid >= 0) {
    // Alive but not ready in time: killed, so that a later Restart starts afresh.
    kill(restarted.pid, SIGKILL);
    int wait_status = 0;
    waitpid(restarted.pid, &wait_status, 0);
    restarted.exit_code = ExitCode(wait_status);
    restarted.pid = -1;
  }
  return started;
}

const std::string& LocalCluster::coordinator_address() const {
  static const std::string kNone;
  return processes_.empty() || processes_.back().name != "dsa-coordinator"
             ? kNone
             : processes_.back().address;
}

LocalCluster::~LocalCluster() { (void)Stop(); }

}  // namespace dsa
