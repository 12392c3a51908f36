// `dsa up` and `dsa replay --local`: a local cluster of the three server binaries (dsa-indexer,
// dsa-attention, dsa-coordinator) on loopback, started, probed for readiness and stopped in order.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dsa {

/// `--model` of dsa-attention, `dsa up`, `dsa replay` and `dsa generate`: the synthetic pattern
/// model, or SmolLM2-135M with its trained lightning indexers (docs/model.md).
inline constexpr char kPatternModel[] = "pattern";
inline constexpr char kSmolLM2Model[] = "smollm2";
/// The real model's files, relative to the repository (dsa-attention's defaults):
/// scripts/model_setup.sh writes the backbone, tokenizer and token splits; the repository carries
/// the indexer weights.
inline constexpr char kDefaultModelFile[] = "build/models/smollm2-135m/model.safetensors";
inline constexpr char kDefaultIndexerWeights[] = "data/models/smollm2_indexer.safetensors";
inline constexpr char kDefaultTokenizerFile[] = "build/models/smollm2-135m/tokenizer.json";
inline constexpr char kDefaultHeldoutTokens[] = "build/models/smollm2-135m/python_docs_heldout.npy";
/// Passkey cases in the essay haystack (python/dsa_model/needles.py, written by model_setup.sh).
inline constexpr char kDefaultNeedles[] = "build/models/smollm2-135m/needles.json";
/// The selection size a cluster for the real model defaults to (the coordinator's --top-k; its
/// own default, 2048, is the production shape's). The indexer shape every dsa-indexer is given
/// comes from the indexer weights' metadata.
inline constexpr int kSmolLM2TopK = 512;

/// What to start. Unset optionals leave the binaries' own defaults.
struct LocalClusterOptions {
  int num_indexers = 1;  // dsa-indexer processes, >= 1 (ignored with transport inprocess)
  /// "grpc": separate dsa-indexer processes, reached over a SelectStream; "inprocess": every
  /// dsa-attention holds its own indexer (--transport inprocess, the indexer flags below passed
  /// under their --indexer- names), the coordinator pairs them (--colocated); "nccl": separate
  /// dsa-indexer processes on GPUs (indexer_device must be cuda), selections over NCCL.
  std::string transport = "grpc";
  int num_attention_workers = 1;  // dsa-attention processes, >= 1
  /// Folder holding the three binaries; empty = the folder of the running executable
  /// (/proc/self/exe), where the build puts them side by side.
  std::string bin_dir;
  /// Folder for each process's stdout and stderr (`<name>.stdout`, `<name>.log`); empty = a new
  /// temporary folder (kept after the run, so the logs can be read).
  std::string log_dir;
  std::chrono::milliseconds startup_timeout{60000};  // per process: address printed + readiness
  std::chrono::milliseconds stop_timeout{15000};     // per group (coordinator, attention, indexers)

  /// The model the attention workers run: kPatternModel, or kSmolLM2Model, which starts
  /// dsa-attention with --model smollm2 --model-file --indexer-weights (not the pattern model's
  /// --num-heads, --head-dim, --seed), every dsa-indexer with the --num-heads and --head-dim of
  /// the indexer weights' metadata (num_heads and head_dim must be unset or equal to them), the
  /// coordinator with --top-k kSmolLM2TopK unless top_k is set. With attention_device cuda the
  /// real model's forward pass runs on the GPU (cuda/llama_cuda_runner.h).
  std::string model = kPatternModel;
  /// kSmolLM2Model: the backbone and the indexer weights; empty = kDefaultModelFile and
  /// kDefaultIndexerWeights, found by FindRepoFile. Start checks that both files exist and reads
  /// the indexer's shape from the weights' header.
  std::string model_file;
  std::string indexer_weights;

  // Pass-through settings (DESIGN.md / docs/services.md flag names).
  std::optional<int64_t> capacity_blocks;     // dsa-indexer --capacity-blocks, per indexer
  std::optional<double> audit_fraction;       // dsa-indexer --audit-fraction
  std::optional<std::string> indexer_device;  // dsa-indexer --device (cpu | cuda)
  /// With indexer_device cuda: indexer i gets --cuda-device indexer_cuda_devices[i % size]
  /// (empty: every indexer on the GPU's default, 0).
  std::vector<int> indexer_cuda_devices;
  std::optional<std::string> attention_device;  // dsa-attention --attention-device (cpu | cuda)
  /// With attention_device cuda: attention worker i gets --attention-cuda-device
  /// attention_cuda_devices[i % size] (empty: the GPU's default, 0).
  std::vector<int> attention_cuda_devices;
  std::optional<int> num_heads;                 // indexer H: dsa-indexer and dsa-attention
  std::optional<int> head_dim;                  // indexer D: dsa-indexer and dsa-attention
  std::optional<std::string> layer_pattern;     // dsa-attention --layer-pattern
  std::optional<int64_t> kv_capacity_slots;     // dsa-attention --kv-capacity-slots
  std::optional<int> top_k;                     // dsa-coordinator --top-k
  std::optional<double> target_block_sparsity;  // dsa-coordinator --target-block-sparsity
  std::optional<double> acceptance_rate;        // dsa-coordinator --acceptance-rate
  std::optional<uint64_t> seed;                 // dsa-attention and dsa-coordinator --seed
  std::vector<std::string> indexer_args;        // extra flags for every dsa-indexer
  std::vector<std::string> attention_args;      // extra flags for every dsa-attention
  std::vector<std::string> coordinator_args;    // extra flags for dsa-coordinator
};

/// One started server process.
struct ClusterProcess {
  std::string name;               // "dsa-indexer-0", "dsa-attention-0", "dsa-coordinator"
  std::string binary;             // path of the executable
  std::vector<std::string> args;  // flags it was started with
  pid_t pid = -1;                 // -1 once reaped
  std::string address;            // gRPC host:port it printed
  std::string metrics_address;    // /metrics host:port it printed ("" if none)
  std::string stdout_path;        // its stdout (the printed addresses)
  std::string log_path;           // its stderr (JSON log lines)
  int exit_code = -1;             // after Stop: exit code, 128 + signal if killed; -1 = running
  int restarts = 0;               // times Restart started it again
};

/// A running local cluster. Start brings every process up (indexers, then attention workers, then
/// the coordinator with their addresses) or stops what it started and says which one failed.
/// Destruction stops the cluster (Stop). Not thread-safe: one owner.
class LocalCluster {
 public:
  /// Starts the cluster and waits for every process's readiness (grpc.health.v1 "readiness"
  /// SERVING). Errors: INVALID_ARGUMENT (bad counts), NOT_FOUND (a binary missing),
  /// DEADLINE_EXCEEDED (a process printed no address or was not ready within startup_timeout),
  /// UNAVAILABLE (a process exited during startup); the message names the process, its log file
  /// and the tail of its stderr.
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const LocalClusterOptions& options);

  ~LocalCluster();
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  /// SIGTERM to the coordinator, then the attention workers, then the indexers, each group waited
  /// for up to stop_timeout (SIGKILL after that). Idempotent. OK when every process exited with
  /// 0; otherwise INTERNAL naming the processes that did not (killed, non-zero exit).
  absl::Status Stop();

  /// OK while every process runs; UNAVAILABLE naming the first one that exited (with its exit
  /// code, log file and stderr tail).
  absl::Status CheckRunning();

  /// Reaps every process that has exited since the last call and returns their indices into
  /// processes() (exit_code set, pid -1).
  std::vector<size_t> ReapExited();

  /// Starts processes()[index], which must have exited, again with its flags and at the addresses
  /// it had (so the coordinator finds a worker where it was, and sees the restart by its new
  /// instance id; a restarted coordinator is where its clients knew it, under the same --name, so
  /// its first check frees what its dead instance held on the workers), its output in
  /// `<name>.restart<N>.stdout` / `.log`; waits for its readiness as Start does. Errors:
  /// FAILED_PRECONDITION (it still runs), OUT_OF_RANGE (index), and Start's for the process (a
  /// process that is not ready in time is killed; Restart may be called again).
  absl::Status Restart(size_t index);

  /// The coordinator's gRPC address (host:port).
  const std::string& coordinator_address() const;
  /// Every process: indexers, attention workers, then the coordinator.
  const std::vector<ClusterProcess>& processes() const { return processes_; }
  /// Where the logs are.
  const std::string& log_dir() const { return log_dir_; }

 private:
  LocalCluster() = default;
  /// Spawns one process and waits for its printed address and readiness; appended to processes_,
  /// or put at processes_[*replace].
  absl::Status StartProcess(ClusterProcess process, std::chrono::milliseconds timeout,
                            std::optional<size_t> replace = std::nullopt);
  /// SIGTERM to processes_[i] for i in `indices`, then waits (SIGKILL past the timeout).
  void StopGroup(const std::vector<size_t>& indices, std::chrono::milliseconds timeout);

  std::vector<ClusterProcess> processes_;
  std::string log_dir_;
  std::chrono::milliseconds stop_timeout_{15000};
  std::chrono::milliseconds startup_timeout_{60000};
  bool stopped_ = false;
};

/// The folder of the running executable (/proc/self/exe), or "" when it cannot be read.
std::string ExecutableDir();

/// Where a repository-relative file is: `path` itself when it is absolute or exists from the
/// working directory; else the same relative path under the repository this executable was built
/// in (two folders above ExecutableDir(), as for build/bin/dsa) when it exists there; else `path`
/// unchanged (the caller's open then fails naming it). Existing files come back absolute.
std::string FindRepoFile(const std::string& path);

/// The last `max_bytes` of a file (whole lines where possible); "" when unreadable.
std::string FileTail(const std::string& path, size_t max_bytes);

/// grpc.health.v1.Health/Check of `service` at `address` within `timeout`: 1 SERVING,
/// 2 NOT_SERVING, 0 UNKNOWN, -1 when the call failed.
int CheckHealth(const std::string& address, const std::string& service,
                std::chrono::milliseconds timeout);

}  // namespace dsa
