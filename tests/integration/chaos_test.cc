// Chaos on loopback (docs/reliability.md, "Faults survived"; after Dynamo's fault-tolerance suite
// and Mooncake's chaos tests): a LocalCluster of two dsa-indexer and two dsa-attention processes
// and a coordinator replays the Mooncake trace while, one after another, an indexer is killed (-9)
// and restarted, the other indexer is stopped (SIGSTOP) and resumed, an attention worker is killed
// and restarted, and the other attention worker is stopped and resumed. Each fault moves requests
// off the worker it hit (the coordinator's log, split at the faults, names them) and each of those
// completes in full; no request is lost; the report, the requests' own counts, the log and
// dsa_coordinator_migrations_total agree on the migrations; once the replay is over no sequence
// is left on any worker.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dsa/attention/v1/attention.grpc.pb.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/server_process.h"
#include "tools/dsa/cluster.h"
#include "tools/dsa/replay.h"
#include "tools/dsa/trace.h"

namespace dsa {
namespace {

namespace cv1 = ::dsa::coordinator::v1;
namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;
using Clock = std::chrono::steady_clock;

// How long a stopped worker stays stopped: past the attention worker's select timeout and the
// coordinator's DecodeStep deadline below, so that the requests on it must move.
constexpr auto kStopped = std::chrono::milliseconds(5000);
// The coordinator's log lines of a request leaving a failed worker
// (coordinator/request_lifecycle.cc).
constexpr const char* kMigrationLine = "migrating a request off a failed worker";
constexpr const char* kPlacedAgainLine =
    "placing a request again: its Prefill could not reach its indexer";

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

// Polls `done` every 50 ms for up to `timeout`; whether it became true.
bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  return dsa::testing::WaitFor(done, timeout, std::chrono::milliseconds(50));
}

class ChaosTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::filesystem::path bin = std::filesystem::path(DSA_COORDINATOR_BINARY).parent_path();
    LocalClusterOptions options;
    options.bin_dir = bin.string();
    // Its own folder: the test reads the coordinator's log, which another run must not share.
    log_dir_ = std::filesystem::path(::testing::TempDir()) / ("chaos-" + std::to_string(getpid()));
    options.log_dir = log_dir_.string();
    options.num_indexers = 2;
    options.num_attention_workers = 2;
    options.capacity_blocks = 4096;
    options.num_heads = 8;
    options.head_dim = 32;
    options.top_k = 256;
    // Failures are seen fast: checks every 200 ms bounded by 500 ms, a hung attention worker's
    // DecodeStep given up after 3 s, a hung indexer's select after 2 s.
    options.coordinator_args = {
        "--worker-check-interval-ms", "200",  "--worker-check-timeout-ms", "500",
        "--rpc-timeout-ms",           "3000", "--retain-finished",         "false",
        "--max-migrations",           "8"};
    options.attention_args = {"--select-timeout-ms", "2000", "--indexer-call-timeout-ms", "2000"};
    auto cluster = LocalCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    coordinator_ = cv1::CoordinatorService::NewStub(Channel(cluster_->coordinator_address()));
  }

  // Index into processes() of the process named `name`.
  size_t Find(const std::string& name) const {
    for (size_t i = 0; i < cluster_->processes().size(); ++i) {
      if (cluster_->processes()[i].name == name) return i;
    }
    ADD_FAILURE() << "no " << name;
    return 0;
  }

  // The coordinator's view: every worker of both kinds ready.
  bool AllWorkersReady() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    cv1::GetLoadResponse load;
    if (!coordinator_->GetLoad(&context, cv1::GetLoadRequest(), &load).ok()) return false;
    int ready = 0;
    for (const auto& w : load.indexer_workers()) ready += w.ready() ? 1 : 0;
    for (const auto& w : load.attention_workers()) ready += w.ready() ? 1 : 0;
    return ready == 4;
  }

  // Requests the coordinator runs on worker `name`: the sequences it placed on an indexer, those in
  // an attention worker's decode loop; -1 when it does not answer.
  int RunningOn(const std::string& name) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    cv1::GetLoadResponse load;
    if (!coordinator_->GetLoad(&context, cv1::GetLoadRequest(), &load).ok()) return -1;
    const std::string& address = ProcessNamed(name).address;
    for (const auto& w : load.indexer_workers()) {
      if (w.address() == address) return w.sequences();
    }
    for (const auto& w : load.attention_workers()) {
      if (w.address() == address) return w.decoding();
    }
    return -1;
  }

  // Sequences held by every worker (GetLoad of the indexers, GetInfo of the attention workers);
  // -1 when one does not answer.
  int SequencesOnWorkers() {
    int total = 0;
    for (const ClusterProcess& process : cluster_->processes()) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      if (process.name.rfind("dsa-indexer", 0) == 0) {
        iv1::GetLoadResponse load;
        auto stub = iv1::IndexerService::NewStub(Channel(process.address));
        if (!stub->GetLoad(&context, iv1::GetLoadRequest(), &load).ok()) return -1;
        total += static_cast<int>(load.sequences());
      } else if (process.name.rfind("dsa-attention", 0) == 0) {
        av1::GetInfoResponse info;
        auto stub = av1::AttentionService::NewStub(Channel(process.address));
        if (!stub->GetInfo(&context, av1::GetInfoRequest(), &info).ok()) return -1;
        total += info.sequences();
      }
    }
    return total;
  }

  const ClusterProcess& ProcessNamed(const std::string& name) const {
    return cluster_->processes()[Find(name)];
  }

  // Bytes the coordinator has logged so far: where the log of what follows begins.
  int64_t CoordinatorLogBytes() const {
    std::error_code error;
    const auto bytes = std::filesystem::file_size(ProcessNamed("dsa-coordinator").log_path, error);
    return error ? 0 : static_cast<int64_t>(bytes);
  }

  // The coordinator's JSON log lines with the byte offset each begins at.
  std::vector<std::pair<int64_t, nlohmann::json>> CoordinatorLog() const {
    std::ifstream in(ProcessNamed("dsa-coordinator").log_path);
    std::vector<std::pair<int64_t, nlohmann::json>> lines;
    int64_t offset = 0;
    for (std::string line; std::getline(in, line);
         offset += static_cast<int64_t>(line.size()) + 1) {
      nlohmann::json json = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (json.is_object() && json.contains("msg")) lines.emplace_back(offset, std::move(json));
    }
    return lines;
  }

  // dsa_coordinator_migrations_total from the coordinator's /metrics; -1 when absent.
  double MigrationsTotal() const {
    std::istringstream metrics(
        dsa::testing::HttpGetMetrics(ProcessNamed("dsa-coordinator").metrics_address));
    for (std::string line; std::getline(metrics, line);) {
      const std::string name = "dsa_coordinator_migrations_total ";
      if (line.rfind(name, 0) == 0) return std::stod(line.substr(name.size()));
    }
    return -1;
  }

  void Kill(const std::string& name) {
    const size_t i = Find(name);
    std::printf("chaos: kill -9 %s\n", name.c_str());
    ASSERT_EQ(kill(cluster_->processes()[i].pid, SIGKILL), 0);
    ASSERT_TRUE(
        WaitFor([&] { return cluster_->processes()[i].pid < 0 || !cluster_->ReapExited().empty(); },
                std::chrono::seconds(10)));
    const absl::Status restarted = cluster_->Restart(i);
    ASSERT_TRUE(restarted.ok()) << restarted;
    std::printf("chaos: %s restarted\n", name.c_str());
  }

  void Stop(const std::string& name) {
    const pid_t pid = cluster_->processes()[Find(name)].pid;
    std::printf("chaos: SIGSTOP %s for %lld ms\n", name.c_str(),
                static_cast<long long>(kStopped.count()));
    ASSERT_EQ(kill(pid, SIGSTOP), 0);
    std::this_thread::sleep_for(kStopped);
    ASSERT_EQ(kill(pid, SIGCONT), 0);
  }

  void TearDown() override {
    if (cluster_ != nullptr) {
      const absl::Status stopped = cluster_->Stop();
      EXPECT_TRUE(stopped.ok()) << stopped;
    }
    if (!HasFailure()) std::filesystem::remove_all(log_dir_);  // kept for a failure's diagnosis
  }

  std::filesystem::path log_dir_;
  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<cv1::CoordinatorService::Stub> coordinator_;
};

TEST_F(ChaosTest, KilledAndStoppedWorkersLoseNoRequestAndLeaveNoSequence) {
  auto trace = ReadTraceFile(std::string(DSA_TRACE_DIR) + "/mooncake_conversation_trace.jsonl");
  ASSERT_TRUE(trace.ok()) << trace.status();
  // 60 requests over 15 s of the trace, each decoding long enough that every fault finds
  // requests running on the worker it hits.
  const ReplayCaps caps = {60, 2048, 160};
  const std::vector<TraceRequest> requests = ApplyCaps(*std::move(trace), caps);
  ReplayOptions options;
  options.coordinator = cluster_->coordinator_address();
  options.caps = caps;
  options.time_scale = 2;  // 30 s of arrivals, so that every fault lands mid-replay
  options.max_in_flight = 8;
  options.draft_length = 2;
  options.request_timeout_ms = 120000;
  absl::StatusOr<ReplayReport> report;
  std::thread replay([&] { report = RunReplay(requests, options); });

  // Each fault: the worker it hits, in which role the coordinator's log names that worker, and
  // where the log stood when it began (what the log holds from there to the next fault's start
  // happened during it).
  struct Fault {
    std::string name;
    std::string role;  // "indexer_worker" or "attention_worker"
    int64_t log_offset = 0;
  };
  // Killed (kill -9, restarted at once) and stopped (SIGSTOP) in turn.
  std::vector<Fault> faults = {{"dsa-indexer-0", "indexer_worker"},
                               {"dsa-indexer-1", "indexer_worker"},
                               {"dsa-attention-0", "attention_worker"},
                               {"dsa-attention-1", "attention_worker"}};
  const auto ready = [&] { return AllWorkersReady(); };
  // Each fault waits until the worker it hits runs two requests at least, so that it always hits
  // some (a request cannot end between this look and the fault, a few milliseconds, unless it was
  // at its last step).
  const auto hits_requests = [&](const std::string& name) {
    EXPECT_TRUE(WaitFor([&] { return RunningOn(name) >= 2; }, std::chrono::seconds(30)))
        << name << " never ran two requests";
  };
  // A request leaves a failed worker in one of two ways, each one log line naming the workers it
  // left: a migration (it had started decoding: counted in Finished.migrations), or, when its
  // Prefill could not reach its indexer, a placement again (not counted). Which one a fault finds
  // depends on the machine's speed (under the sanitizers the requests on a killed indexer were all
  // still in Prefill).
  const auto is_move = [](const nlohmann::json& line) {
    return line["msg"] == kMigrationLine || line["msg"] == kPlacedAgainLine;
  };
  // A fault's moves are logged when the coordinator sees the failure, which on a loaded machine
  // can be after the next fault began: the next fault waits for the first move off this one's
  // worker, so that the log splits at the faults.
  const auto first_move_logged = [&](const Fault& fault) {
    EXPECT_TRUE(WaitFor(
        [&] {
          for (const auto& [offset, line] : CoordinatorLog()) {
            if (offset >= fault.log_offset && is_move(line) &&
                line.value(fault.role, "") == ProcessNamed(fault.name).address) {
              return true;
            }
          }
          return false;
        },
        std::chrono::seconds(30)))
        << fault.name << ": no request moved off it within 30 s";
  };
  for (size_t f = 0; f < faults.size(); ++f) {
    hits_requests(faults[f].name);
    faults[f].log_offset = CoordinatorLogBytes();
    if (f % 2 == 0) {
      Kill(faults[f].name);
    } else {
      Stop(faults[f].name);
    }
    first_move_logged(faults[f]);
    EXPECT_TRUE(WaitFor(ready, std::chrono::seconds(15))) << "after " << faults[f].name;
  }
  replay.join();

  ASSERT_TRUE(report.ok()) << report.status();
  std::printf("%s", ReplayReportToMarkdown(*report).c_str());
  EXPECT_EQ(report->failed, 0) << report->first_error;
  EXPECT_EQ(report->completed, static_cast<int64_t>(requests.size()));

  // Every request's one "request" line (written before its stream ends): completed, in full.
  const std::vector<std::pair<int64_t, nlohmann::json>> log = CoordinatorLog();
  std::map<std::string, nlohmann::json> finals;
  for (const auto& [offset, line] : log) {
    if (line["msg"] != "request") continue;
    const std::string id = line.value("request_id", "");
    EXPECT_FALSE(finals.contains(id)) << id << " ended twice";
    finals[id] = line;
  }
  ASSERT_EQ(finals.size(), requests.size());
  int64_t migrations_of_requests = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::string id = "replay-" + std::to_string(i);
    ASSERT_TRUE(finals.contains(id)) << id << " never ended";
    const nlohmann::json& final_line = finals[id];
    EXPECT_EQ(final_line.value("code", ""), "OK") << final_line.dump();
    EXPECT_EQ(final_line.value("generated_tokens", int64_t{-1}), requests[i].output_tokens)
        << final_line.dump();
    migrations_of_requests += final_line.value("migrations", 0);
  }

  // Every move is one line naming the workers it left; the line's offset says during which fault
  // it happened.
  std::map<std::string, int> moves_of;                          // request id -> migration lines
  std::vector<std::set<std::string>> migrated(faults.size());   // migrated off the faulted worker
  std::vector<std::set<std::string>> moved_off(faults.size());  // migrated or placed again
  int64_t migration_lines = 0;
  for (const auto& [offset, line] : log) {
    if (!is_move(line)) continue;
    const bool migration = line["msg"] == kMigrationLine;
    const std::string id = line.value("request_id", "");
    if (migration) {
      ++migration_lines;
      EXPECT_EQ(line.value("migration", 0), ++moves_of[id]) << line.dump();
    }
    for (size_t f = faults.size(); f-- > 0;) {
      if (offset < faults[f].log_offset) continue;
      if (line.value(faults[f].role, "") == ProcessNamed(faults[f].name).address) {
        moved_off[f].insert(id);
        if (migration) migrated[f].insert(id);
      }
      break;
    }
  }
  // Per fault: requests ran on the worker it hit, moved off it, and completed (above) in full.
  for (size_t f = 0; f < faults.size(); ++f) {
    EXPECT_FALSE(moved_off[f].empty()) << faults[f].name << ": no request moved off it";
    for (const std::string& id : migrated[f]) {
      EXPECT_GE(finals[id].value("migrations", 0), 1) << faults[f].name << ": " << id;
    }
    std::printf("chaos: %s moved %zu requests off it (%zu migrated, the rest placed again)\n",
                faults[f].name.c_str(), moved_off[f].size(), migrated[f].size());
  }
  // The counts agree: each request's Finished.migrations is its moves in the log; the report
  // sums them; dsa_coordinator_migrations_total counts them.
  for (const auto& [id, moves] : moves_of) {
    EXPECT_EQ(finals[id].value("migrations", 0), moves) << id;
  }
  EXPECT_EQ(migrations_of_requests, migration_lines);
  EXPECT_EQ(report->migrations, migration_lines);
  EXPECT_EQ(report->migrated_requests, static_cast<int64_t>(moves_of.size()));
  EXPECT_EQ(MigrationsTotal(), static_cast<double>(migration_lines));
  // No orphans: what the dead and hung workers held is released (by the coordinator, once they
  // answer again), and nothing else is retained (--retain-finished false).
  EXPECT_TRUE(WaitFor([&] { return SequencesOnWorkers() == 0; }, std::chrono::seconds(15)))
      << SequencesOnWorkers() << " sequences left on the workers";
}

}  // namespace
}  // namespace dsa
