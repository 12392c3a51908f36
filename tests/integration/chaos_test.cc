// Chaos on loopback (issue 13, "Faults survived"; after Dynamo's fault-tolerance suite and
// Mooncake's chaos tests): a LocalCluster of two dsa-indexer and two dsa-attention processes and a
// coordinator replays the Mooncake trace while, one after another, an indexer is killed (-9) and
// restarted, the other indexer is stopped (SIGSTOP) and resumed, an attention worker is killed and
// restarted, and the other attention worker is stopped and resumed. Every request completes
// (the killed and hung workers' requests migrate), the report counts the migrations, and once the
// replay is over no sequence is left on any worker.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "dsa/attention/v1/attention.grpc.pb.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
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

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

// Polls `done` every 50 ms for up to `timeout`; whether it became true.
bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return done();
}

class ChaosTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::filesystem::path bin = std::filesystem::path(DSA_COORDINATOR_BINARY).parent_path();
    LocalClusterOptions options;
    options.bin_dir = bin.string();
    options.log_dir = (std::filesystem::path(::testing::TempDir()) / "chaos").string();
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
  }

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

  const auto ready = [&] { return AllWorkersReady(); };
  std::this_thread::sleep_for(std::chrono::seconds(2));
  Kill("dsa-indexer-0");
  EXPECT_TRUE(WaitFor(ready, std::chrono::seconds(15))) << "after the indexer restart";
  Stop("dsa-indexer-1");
  EXPECT_TRUE(WaitFor(ready, std::chrono::seconds(15))) << "after the indexer resumed";
  Kill("dsa-attention-0");
  EXPECT_TRUE(WaitFor(ready, std::chrono::seconds(15))) << "after the attention restart";
  Stop("dsa-attention-1");
  EXPECT_TRUE(WaitFor(ready, std::chrono::seconds(15))) << "after the attention worker resumed";
  replay.join();

  ASSERT_TRUE(report.ok()) << report.status();
  std::printf("%s", ReplayReportToMarkdown(*report).c_str());
  EXPECT_EQ(report->failed, 0) << report->first_error;
  EXPECT_EQ(report->completed, static_cast<int64_t>(requests.size()));
  EXPECT_GE(report->migrations, 1);
  // No orphans: what the dead and hung workers held is released (by the coordinator, once they
  // answer again), and nothing else is retained (--retain-finished false).
  EXPECT_TRUE(WaitFor([&] { return SequencesOnWorkers() == 0; }, std::chrono::seconds(15)))
      << SequencesOnWorkers() << " sequences left on the workers";
}

}  // namespace
}  // namespace dsa
