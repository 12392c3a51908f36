// Integration test of the three server binaries as one local cluster (dsa up's LocalCluster):
// ~20 Mooncake requests replayed through the real coordinator, attention worker and indexer, every
// request completed, the figures plausible, /metrics of every server free of request labels, and
// a clean stop. Also the startup errors (a missing binary, a process that exits at once), and the
// `dsa up` command from start to SIGINT, and with --restart after its coordinator was killed.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/server_process.h"
#include "tools/dsa/cluster.h"
#include "tools/dsa/replay.h"
#include "tools/dsa/trace.h"

extern char** environ;

namespace dsa {
namespace {

std::string BinDir() {
  const std::filesystem::path indexer = DSA_INDEXER_BINARY;
  EXPECT_EQ(indexer.parent_path(), std::filesystem::path(DSA_ATTENTION_BINARY).parent_path());
  EXPECT_EQ(indexer.parent_path(), std::filesystem::path(DSA_COORDINATOR_BINARY).parent_path());
  return indexer.parent_path().string();
}

LocalClusterOptions SmallCluster(const std::string& log_name) {
  LocalClusterOptions options;
  options.bin_dir = BinDir();
  options.log_dir = (std::filesystem::path(::testing::TempDir()) / log_name).string();
  options.num_indexers = 1;
  options.num_attention_workers = 1;
  options.capacity_blocks = 4096;
  options.audit_fraction = 0.25;
  options.num_heads = 8;  // a small indexer shape keeps the run short on a CPU
  options.head_dim = 32;
  options.top_k = 256;  // under the 4096-token contexts, so SPIN prunes
  return options;
}

TEST(LocalClusterTest, ReplaysMooncakeRequestsAndStopsCleanly) {
  const std::string path = std::string(DSA_TRACE_DIR) + "/mooncake_conversation_trace.jsonl";
  auto trace = ReadTraceFile(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  const ReplayCaps caps = {20, 4096, 8};
  const std::vector<TraceRequest> requests = ApplyCaps(*std::move(trace), caps);
  ASSERT_EQ(requests.size(), 20u);
  int64_t expected_tokens = 0;
  bool shares_prefix = false;
  std::set<uint64_t> first_ids;
  for (const TraceRequest& request : requests) {
    expected_tokens += request.output_tokens;
    if (!request.prefix_block_ids.empty()) {
      shares_prefix |= !first_ids.insert(request.prefix_block_ids[0]).second;
    }
  }

  auto cluster = LocalCluster::Start(SmallCluster("replay"));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_EQ((*cluster)->processes().size(), 3u);
  for (const ClusterProcess& process : (*cluster)->processes()) {
    EXPECT_EQ(process.address.rfind("127.0.0.1:", 0), 0u) << process.name;
    EXPECT_FALSE(process.metrics_address.empty()) << process.name;
    EXPECT_EQ(CheckHealth(process.address, "readiness", std::chrono::seconds(5)), 1)
        << process.name;
  }
  EXPECT_EQ((*cluster)->coordinator_address(), (*cluster)->processes().back().address);

  ReplayOptions options;
  options.coordinator = (*cluster)->coordinator_address();
  options.caps = caps;
  options.time_scale = 0;
  options.max_in_flight = 4;
  options.draft_length = 2;
  options.sample_ms = 100;
  auto report = RunReplay(requests, options);
  ASSERT_TRUE(report.ok()) << report.status();
  std::printf("%s", ReplayReportToMarkdown(*report).c_str());
  EXPECT_EQ(report->completed, 20) << report->first_error;
  EXPECT_EQ(report->failed, 0) << report->first_error;
  EXPECT_EQ(report->generated_tokens, expected_tokens);
  EXPECT_GT(report->realized_block_sparsity, 0.0);
  EXPECT_LT(report->realized_block_sparsity, 1.0);
  if (shares_prefix) {
    EXPECT_GT(report->prefix_slots_reused, 0);
  }
  EXPECT_GT(report->drafted_tokens, 0);
  EXPECT_LE(report->accepted_tokens, report->drafted_tokens);
  EXPECT_GT(report->audited_rows, 0);
  EXPECT_GE(report->audited_miss_rate, 0.0);
  EXPECT_LE(report->audited_miss_rate, 1.0);
  EXPECT_FALSE(report->selection_wait.empty());
  ASSERT_FALSE(report->cache_samples.empty());
  EXPECT_EQ(report->cache_capacity, 4096);
  EXPECT_GT(report->cache_used_max, 0);
  EXPECT_GT(report->ttft_p50, 0);

  for (const ClusterProcess& process : (*cluster)->processes()) {
    const std::string metrics = dsa::testing::HttpGetMetrics(process.metrics_address);
    const std::string family = process.name.rfind("dsa-indexer", 0) == 0     ? "dsa_indexer_"
                               : process.name.rfind("dsa-attention", 0) == 0 ? "dsa_attention_"
                                                                             : "dsa_coordinator_";
    EXPECT_NE(metrics.find("\n" + family), std::string::npos) << process.name << ":\n" << metrics;
    // The families DESIGN.md section 6 names, each with samples ("# TYPE name" and a sample line).
    const std::map<std::string, std::vector<std::string>> named = {
        {"dsa_indexer_",
         {"dsa_indexer_select_duration_seconds", "dsa_indexer_blocks_scored_total",
          "dsa_indexer_blocks_visible_total", "dsa_indexer_audited_miss_ratio",
          "dsa_indexer_cache_blocks"}},
        {"dsa_attention_",
         {"dsa_attention_selection_wait_seconds", "dsa_attention_full_layer_selects_total"}},
        {"dsa_coordinator_",
         {"dsa_coordinator_time_to_first_token_seconds",
          "dsa_coordinator_inter_token_latency_seconds", "dsa_coordinator_queue_duration_seconds",
          "dsa_coordinator_requests_total", "dsa_coordinator_spec_decode_draft_tokens_total",
          "dsa_coordinator_spec_decode_accepted_tokens_total",
          "dsa_coordinator_generated_tokens_total", "dsa_coordinator_workers",
          "dsa_coordinator_max_queued_requests", "dsa_coordinator_request_duration_seconds",
          "dsa_coordinator_prompt_tokens_total"}}};
    std::vector<std::string> every = named.at(family);
    for (const char* common :
         {"dsa_build_info", "process_cpu_seconds_total", "process_resident_memory_bytes",
          "process_start_time_seconds", "process_open_fds"}) {
      every.emplace_back(common);
    }
    for (const std::string& name : every) {
      EXPECT_NE(metrics.find("# TYPE " + name + " "), std::string::npos)
          << process.name << " lacks " << name;
      EXPECT_NE(metrics.find("\n" + name), std::string::npos) << process.name << " lacks " << name;
    }
    // Every label of every dsa_ sample is one of the bounded, non-request labels ("code": one of
    // gRPC's 17 status codes).
    const std::set<std::string> allowed = {"phase",     "state",     "outcome", "layer",
                                           "scored_on", "form",      "kind",    "le",
                                           "quantile",  "component", "version", "code"};
    std::istringstream lines(metrics);
    std::string line;
    int dsa_samples = 0;
    while (std::getline(lines, line)) {
      if (line.rfind("dsa_", 0) != 0) continue;
      ++dsa_samples;
      const size_t open = line.find('{');
      if (open == std::string::npos) continue;
      const std::string labels = line.substr(open + 1, line.find('}', open) - open - 1);
      size_t at = 0;
      while (at < labels.size()) {
        const size_t eq = labels.find('=', at);
        ASSERT_NE(eq, std::string::npos) << line;
        const std::string name = labels.substr(at, eq - at);
        EXPECT_TRUE(allowed.contains(name)) << process.name << ": label " << name << " in " << line;
        const size_t open_quote = labels.find('"', eq);
        const size_t close_quote = labels.find('"', open_quote + 1);
        if (name == "le") {  // bucket bounds read as written: no float noise
          const std::string bound = labels.substr(open_quote + 1, close_quote - open_quote - 1);
          char shortest[32];
          std::snprintf(shortest, sizeof(shortest), "%.6g", std::strtod(bound.c_str(), nullptr));
          EXPECT_TRUE(bound == "+Inf" || bound == shortest) << process.name << ": " << line;
        }
        at = labels.find_first_not_of(',', close_quote + 1);
        if (at == std::string::npos) break;
      }
    }
    EXPECT_GT(dsa_samples, 0) << process.name;
  }
  const absl::Status stopped = (*cluster)->Stop();
  EXPECT_TRUE(stopped.ok()) << stopped;
  for (const ClusterProcess& process : (*cluster)->processes()) {
    EXPECT_EQ(process.exit_code, 0) << process.name;
    EXPECT_EQ(process.pid, -1) << process.name;
  }
}

// Co-located (--transport inprocess): no dsa-indexer process; each dsa-attention holds its indexer
// and serves it at its own address, the coordinator pairs them. Two attention workers, so the
// pairing matters; every request completes and both indexers' metrics are on their workers.
TEST(LocalClusterTest, ReplaysWithIndexersCoLocatedInTheAttentionWorkers) {
  const std::string path = std::string(DSA_TRACE_DIR) + "/mooncake_conversation_trace.jsonl";
  auto trace = ReadTraceFile(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  const ReplayCaps caps = {12, 4096, 8};
  const std::vector<TraceRequest> requests = ApplyCaps(*std::move(trace), caps);
  int64_t expected_tokens = 0;
  for (const TraceRequest& request : requests) expected_tokens += request.output_tokens;

  LocalClusterOptions cluster_options = SmallCluster("colocated");
  cluster_options.transport = "inprocess";
  cluster_options.num_attention_workers = 2;
  auto cluster = LocalCluster::Start(cluster_options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_EQ((*cluster)->processes().size(), 3u);  // two attention workers and the coordinator
  for (const ClusterProcess& process : (*cluster)->processes()) {
    EXPECT_EQ(process.name.rfind("dsa-indexer", 0), std::string::npos) << process.name;
  }
  ReplayOptions options;
  options.coordinator = (*cluster)->coordinator_address();
  options.caps = caps;
  options.time_scale = 0;
  options.max_in_flight = 4;
  options.draft_length = 2;
  options.sample_ms = 100;
  auto report = RunReplay(requests, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->completed, static_cast<int64_t>(requests.size())) << report->first_error;
  EXPECT_EQ(report->failed, 0) << report->first_error;
  EXPECT_EQ(report->generated_tokens, expected_tokens);
  EXPECT_GT(report->realized_block_sparsity, 0.0);
  EXPECT_EQ(report->cache_capacity, 2 * 4096);  // two co-located indexers
  for (int w = 0; w < 2; ++w) {
    const ClusterProcess& worker = (*cluster)->processes()[w];
    const std::string metrics = dsa::testing::HttpGetMetrics(worker.metrics_address);
    EXPECT_NE(metrics.find("\ndsa_indexer_blocks_scored_total"), std::string::npos) << worker.name;
    EXPECT_NE(metrics.find("\ndsa_attention_selection_wait_seconds"), std::string::npos)
        << worker.name;
  }
  const absl::Status stopped = (*cluster)->Stop();
  EXPECT_TRUE(stopped.ok()) << stopped;
}

TEST(LocalClusterTest, OneRequestsTraceIdRunsThroughEveryServersLog) {
  // The router's traceparent reaches the coordinator, the attention worker's Prefill and the
  // indexer's CreateSequence and AppendIndexKeys; each server logs one line per call with it, and
  // the coordinator one line for the request.
  LocalClusterOptions options = SmallCluster("trace");
  options.indexer_args = {"--log-level=debug"};
  options.attention_args = {"--log-level=debug"};
  options.coordinator_args = {"--log-level=debug"};
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
  {
    auto stub = dsa::coordinator::v1::CoordinatorService::NewStub(
        grpc::CreateChannel((*cluster)->coordinator_address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.AddMetadata("traceparent", "00-" + trace_id + "-00f067aa0ba902b7-01");
    dsa::coordinator::v1::GenerateRequest request;
    request.set_request_id("traced-request");
    request.set_context_length(300);
    request.set_max_new_tokens(4);
    auto reader = stub->Generate(&context, request);
    dsa::coordinator::v1::GenerateEvent event;
    while (reader->Read(&event)) {
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  ASSERT_TRUE((*cluster)->Stop().ok());
  std::map<std::string, std::string> logs;
  for (const ClusterProcess& process : (*cluster)->processes()) {
    std::ifstream in(process.log_path);
    std::stringstream text;
    text << in.rdbuf();
    logs[process.name] = text.str();
  }
  const std::string traced = "\"trace_id\":\"" + trace_id + "\"";
  const auto has_line = [&](const std::string& log, const std::string& what) {
    std::istringstream lines(log);
    for (std::string line; std::getline(lines, line);) {
      if (line.find(traced) != std::string::npos && line.find(what) != std::string::npos) {
        return true;
      }
    }
    return false;
  };
  EXPECT_TRUE(has_line(logs["dsa-coordinator"], "\"msg\":\"request\"")) << logs["dsa-coordinator"];
  EXPECT_TRUE(has_line(logs["dsa-coordinator"], "\"request_id\":\"traced-request\""));
  EXPECT_TRUE(has_line(logs["dsa-attention-0"], "/dsa.attention.v1.AttentionService/Prefill"))
      << logs["dsa-attention-0"];
  EXPECT_TRUE(has_line(logs["dsa-indexer-0"], "/dsa.indexer.v1.IndexerService/CreateSequence"))
      << logs["dsa-indexer-0"];
  EXPECT_TRUE(has_line(logs["dsa-indexer-0"], "/dsa.indexer.v1.IndexerService/AppendIndexKeys"));
}

// The real model's settings are checked before anything starts (its run with the real files is
// tests/integration/served_generation_test.py, label `model`).
TEST(LocalClusterTest, RealModelSettingsAreCheckedBeforeStarting) {
  LocalClusterOptions options = SmallCluster("smollm2_settings");
  options.model = kSmolLM2Model;
  // SmallCluster's H 8, D 32 are not the model's indexer shape.
  auto shape = LocalCluster::Start(options);
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kInvalidArgument) << shape.status();
  EXPECT_NE(shape.status().message().find("H 16, D 64"), std::string::npos) << shape.status();
  options.num_heads.reset();
  options.head_dim.reset();
  options.model_file = "/nonexistent/model.safetensors";
  auto missing = LocalCluster::Start(options);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_NE(missing.status().message().find("scripts/model_setup.sh"), std::string::npos);
  options.model_file.clear();
  // Indexer weights whose header is not a safetensors file's: refused, naming the file.
  const std::string bad_weights =
      (std::filesystem::path(::testing::TempDir()) / "not_weights.safetensors").string();
  std::ofstream(bad_weights) << "not a safetensors file";
  options.indexer_weights = bad_weights;
  auto bad = LocalCluster::Start(options);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(bad_weights), std::string::npos) << bad.status();
  options.indexer_weights.clear();
  // The GPU is no longer refused for the real model: the tool starts the cluster, and on a machine
  // without a GPU (or a build without CUDA) it is dsa-attention that fails to start, naming why.
  if (std::filesystem::exists(FindRepoFile(kDefaultModelFile))) {
    options.attention_device = "cuda";
    auto on_gpu = LocalCluster::Start(options);
    if (!on_gpu.ok()) {
      EXPECT_NE(on_gpu.status().code(), absl::StatusCode::kInvalidArgument) << on_gpu.status();
      EXPECT_NE(on_gpu.status().message().find("dsa-attention-0"), std::string::npos)
          << on_gpu.status();
    }
    options.attention_device.reset();
  }
  // The model's files with the pattern model, or an unknown model.
  LocalClusterOptions pattern = SmallCluster("pattern_with_files");
  pattern.indexer_weights = "weights.safetensors";
  EXPECT_EQ(LocalCluster::Start(pattern).status().code(), absl::StatusCode::kInvalidArgument);
  pattern.indexer_weights.clear();
  pattern.model = "gpt-5";
  EXPECT_EQ(LocalCluster::Start(pattern).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LocalClusterTest, MissingBinaryIsNotFound) {
  LocalClusterOptions options = SmallCluster("missing");
  options.bin_dir = "/nonexistent-dsa-bin";
  auto cluster = LocalCluster::Start(options);
  EXPECT_EQ(cluster.status().code(), absl::StatusCode::kNotFound) << cluster.status();
  EXPECT_NE(cluster.status().message().find("/nonexistent-dsa-bin/dsa-indexer"), std::string::npos);
}

TEST(LocalClusterTest, StartupFailureNamesTheProcessAndItsStderr) {
  LocalClusterOptions options = SmallCluster("bad_flag");
  options.attention_args = {"--no-such-flag"};
  auto cluster = LocalCluster::Start(options);
  ASSERT_FALSE(cluster.ok());
  EXPECT_EQ(cluster.status().code(), absl::StatusCode::kUnavailable) << cluster.status();
  const std::string message(cluster.status().message());
  EXPECT_NE(message.find("dsa-attention-0 exited"), std::string::npos) << message;
  EXPECT_NE(message.find(options.log_dir + "/dsa-attention-0.log"), std::string::npos) << message;
  EXPECT_NE(message.find("no-such-flag"), std::string::npos) << message;  // CLI11's complaint
}

// `dsa up` as a process: prints the coordinator address on stdout, serves, and on SIGINT stops
// the whole cluster and exits 0.
TEST(DsaUpTest, ServesUntilSigintThenStopsTheCluster) {
  const std::string log_dir = (std::filesystem::path(::testing::TempDir()) / "dsa_up").string();
  std::vector<std::string> args = {DSA_BINARY,   "up",    "--bin-dir",   BinDir(),
                                   "--log-dir",  log_dir, "--num-heads", "8",
                                   "--head-dim", "32",    "--top-k",     "256"};
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  std::string line;
  char c = 0;
  while (read(out[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  const std::string marker = "dsa up: coordinator listening on ";
  ASSERT_EQ(line.rfind(marker, 0), 0u) << line;
  const std::string coordinator = line.substr(marker.size());
  EXPECT_EQ(CheckHealth(coordinator, "readiness", std::chrono::seconds(5)), 1);

  ReplayOptions options;
  options.coordinator = coordinator;
  options.time_scale = 0;
  options.max_in_flight = 1;  // the second starts after the first finished (a retained donor)
  const std::vector<TraceRequest> requests = {{0, 1000, 3, {7, 8}}, {0, 700, 2, {7, 9}}};
  auto report = RunReplay(requests, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->completed, 2) << report->first_error;
  EXPECT_EQ(report->prefix_slots_reused, 512);  // the second shares block id 7 with the first

  ASSERT_EQ(kill(pid, SIGINT), 0);
  EXPECT_EQ(dsa::testing::WaitExit(pid, std::chrono::seconds(60)), 0);
  close(out[0]);
  EXPECT_EQ(CheckHealth(coordinator, "liveness", std::chrono::milliseconds(500)), -1);
  for (const char* name : {"dsa-indexer-0", "dsa-attention-0", "dsa-coordinator"}) {
    const std::string log = FileTail(log_dir + "/" + name + ".log", 100000);
    EXPECT_NE(log.find("\"msg\":\"stopped\""), std::string::npos) << name << ":\n" << log;
  }
}

// `dsa up --restart` restarts a coordinator that died like any worker: at its address, under its
// --name, and the cluster goes on serving there.
TEST(DsaUpTest, RestartStartsAKilledCoordinatorAgainAtItsAddress) {
  const std::string log_dir =
      (std::filesystem::path(::testing::TempDir()) / "dsa_up_restart").string();
  const std::string stderr_path = log_dir + ".stderr";
  std::vector<std::string> args = {DSA_BINARY,
                                   "up",
                                   "--bin-dir",
                                   BinDir(),
                                   "--log-dir",
                                   log_dir,
                                   "--num-heads",
                                   "8",
                                   "--head-dim",
                                   "32",
                                   "--top-k",
                                   "256",
                                   "--restart",
                                   "--restart-delay-ms",
                                   "0"};
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, stderr_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  std::string line;
  char c = 0;
  while (read(out[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  const std::string marker = "dsa up: coordinator listening on ";
  ASSERT_EQ(line.rfind(marker, 0), 0u) << line;
  const std::string coordinator = line.substr(marker.size());
  // The cluster listing (stderr): "  dsa-coordinator    pid N  grpc ...".
  const std::string listing = FileTail(stderr_path, 100000);
  const size_t at = listing.find("dsa-coordinator");
  ASSERT_NE(at, std::string::npos) << listing;
  const size_t pid_at = listing.find("pid ", at);
  ASSERT_NE(pid_at, std::string::npos) << listing;
  const pid_t coordinator_pid = std::atoi(listing.c_str() + pid_at + 4);
  ASSERT_GT(coordinator_pid, 0) << listing;

  ASSERT_EQ(kill(coordinator_pid, SIGKILL), 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (FileTail(stderr_path, 100000).find("dsa-coordinator restarted") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_NE(FileTail(stderr_path, 100000).find("dsa-coordinator restarted"), std::string::npos)
      << FileTail(stderr_path, 100000);
  EXPECT_EQ(CheckHealth(coordinator, "readiness", std::chrono::seconds(10)), 1);
  ReplayOptions options;
  options.coordinator = coordinator;
  options.time_scale = 0;
  auto report = RunReplay({{0, 700, 2, {7}}}, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->completed, 1) << report->first_error;

  ASSERT_EQ(kill(pid, SIGINT), 0);
  EXPECT_EQ(dsa::testing::WaitExit(pid, std::chrono::seconds(60)), 0)
      << FileTail(stderr_path, 100000);
  close(out[0]);
  const std::string log = FileTail(log_dir + "/dsa-coordinator.restart1.log", 100000);
  EXPECT_NE(log.find("\"msg\":\"stopped\""), std::string::npos) << log;
}

}  // namespace
}  // namespace dsa
