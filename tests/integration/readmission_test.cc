// An indexer that restarts under load costs no request (docs/reliability.md, "An indexer that
// restarts"): a LocalCluster of two dsa-indexer, two dsa-attention and a coordinator with
// --max-migrations 1 runs a steady stream of requests; dsa-indexer-0 is killed (-9), left dead
// long enough for the attention workers' connections to it to back off, and restarted at its
// address. The coordinator's checks reach the new process before the attention workers' data
// plane does: placements there must not spend the requests' one migration. Every request
// completes; the test prints how many there were, how many moved, and how many the coordinator
// placed again for free. DSA_BIN_DIR (optional) runs other builds' binaries, e.g. to see the fault
// without the fix.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/server_process.h"
#include "tools/dsa/cluster.h"

namespace dsa {
namespace {

namespace cv1 = ::dsa::coordinator::v1;
using Clock = std::chrono::steady_clock;

constexpr int kStreams = 6;
// Dead for this long: past gRPC's default reconnection backoffs of 1 s and 1.6 s, so that an
// attention worker's channel with the default settings is still waiting when the indexer is back.
constexpr auto kDead = std::chrono::milliseconds(3000);
constexpr auto kLoadAfterRestart = std::chrono::milliseconds(6000);

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

// Lines of `path` that contain `text`.
int CountLines(const std::string& path, const std::string& text) {
  std::ifstream in(path);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) n += line.find(text) != std::string::npos ? 1 : 0;
  return n;
}

TEST(IndexerRestartTest, AnIndexerRestartedUnderLoadLosesNoRequest) {
  const char* bin_override = std::getenv("DSA_BIN_DIR");
  LocalClusterOptions options;
  options.bin_dir = bin_override != nullptr
                        ? std::string(bin_override)
                        : std::filesystem::path(DSA_COORDINATOR_BINARY).parent_path().string();
  const std::filesystem::path log_dir =
      std::filesystem::path(::testing::TempDir()) / ("readmission-" + std::to_string(getpid()));
  options.log_dir = log_dir.string();
  options.num_indexers = 2;
  options.num_attention_workers = 2;
  options.capacity_blocks = 4096;
  options.num_heads = 8;
  options.head_dim = 32;
  options.top_k = 256;
  options.coordinator_args = {
      "--worker-check-interval-ms", "200", "--worker-check-timeout-ms", "500",
      "--max-migrations",           "1",   "--retain-finished",         "false"};
  options.attention_args = {"--select-timeout-ms", "2000", "--indexer-call-timeout-ms", "2000"};
  auto started = LocalCluster::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<LocalCluster> cluster = std::move(*started);
  size_t indexer0 = 0;
  size_t coordinator = 0;
  for (size_t i = 0; i < cluster->processes().size(); ++i) {
    if (cluster->processes()[i].name == "dsa-indexer-0") indexer0 = i;
    if (cluster->processes()[i].name == "dsa-coordinator") coordinator = i;
  }

  // kStreams clients, each sending one request after another until told to stop.
  const std::string indexer0_address = cluster->processes()[indexer0].address;
  std::atomic<bool> stop{false};
  std::atomic<bool> back{false};     // dsa-indexer-0 restarted
  std::atomic<int> on_restarted{0};  // completed there, sent after its restart
  std::atomic<int> completed{0};
  std::atomic<int> migrated{0};
  absl::Mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> clients;
  clients.reserve(kStreams);
  for (int c = 0; c < kStreams; ++c) {
    clients.emplace_back([&, c] {
      auto stub = cv1::CoordinatorService::NewStub(Channel(cluster->coordinator_address()));
      for (int n = 0; !stop.load(); ++n) {
        const bool sent_after_restart = back.load();
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        cv1::GenerateRequest request;
        request.set_request_id(absl::StrCat("c", c, "-", n));
        request.set_context_length(600 + 64 * c);
        request.set_max_new_tokens(60);
        auto reader = stub->Generate(&context, request);
        cv1::GenerateEvent event;
        int64_t tokens = 0;
        int migrations = -1;
        std::string indexer;
        while (reader->Read(&event)) {
          if (event.has_admitted()) indexer = event.admitted().indexer_worker();
          if (event.has_tokens()) tokens += event.tokens().count();
          if (event.has_finished()) migrations = event.finished().migrations();
        }
        const grpc::Status status = reader->Finish();
        if (status.ok() && tokens == 60 && migrations >= 0) {
          ++completed;
          migrated += migrations > 0 ? 1 : 0;
          on_restarted += sent_after_restart && indexer == indexer0_address ? 1 : 0;
        } else {
          absl::MutexLock lock(&mu);
          failures.push_back(absl::StrCat(request.request_id(), ": ",
                                          static_cast<int>(status.error_code()), " ",
                                          status.error_message()));
        }
      }
    });
  }

  ASSERT_TRUE(testing::WaitFor([&] { return completed.load() >= 2 * kStreams; },
                               std::chrono::seconds(60), std::chrono::milliseconds(20)));
  const pid_t pid = cluster->processes()[indexer0].pid;
  std::printf("readmission: kill -9 dsa-indexer-0 after %d requests\n", completed.load());
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  ASSERT_TRUE(testing::WaitFor(
      [&] { return cluster->processes()[indexer0].pid < 0 || !cluster->ReapExited().empty(); },
      std::chrono::seconds(10), std::chrono::milliseconds(20)));
  std::this_thread::sleep_for(kDead);
  const absl::Status restarted = cluster->Restart(indexer0);
  ASSERT_TRUE(restarted.ok()) << restarted;
  back = true;
  const int before_restart = completed.load();
  std::this_thread::sleep_for(kLoadAfterRestart);
  stop = true;
  for (std::thread& client : clients) client.join();

  const std::string& log = cluster->processes()[coordinator].log_path;
  const int again = CountLines(log, "its Prefill could not reach its indexer");
  const int holds = CountLines(log, "indexer held back from placements");
  std::printf(
      "readmission: %d requests completed (%d after the restart, %d of them admitted on the "
      "restarted indexer), %d failed; %d moved; %d placements again for free, %d indexer "
      "holds\n",
      completed.load(), completed.load() - before_restart, on_restarted.load(),
      static_cast<int>(failures.size()), migrated.load(), again, holds);
  for (const std::string& failure : failures) std::printf("  failed %s\n", failure.c_str());
  EXPECT_TRUE(failures.empty());
  // The restarted indexer takes requests again.
  EXPECT_GT(on_restarted.load(), 0);
  (void)cluster->Stop();
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(log_dir);
}

}  // namespace
}  // namespace dsa
