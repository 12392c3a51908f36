// A coordinator killed (-9) mid-stream leaves nothing on its workers for long (docs/reliability.md,
// "Ownership that survives its owner"): a LocalCluster of one dsa-indexer, one dsa-attention and
// a coordinator runs requests with long max_new_tokens; the coordinator is killed, and the workers'
// capacity comes back whole (the indexer's free_blocks == capacity_blocks with no sequence, the
// attention worker's KV empty with no sequence):
//  - left dead, within two lease periods (the workers' lease sweep), and a new coordinator of the
//    same --name serves again afterwards;
//  - restarted at once under the same --name, as soon as its first check renews the lease (the
//    dead instance is superseded), well before the ttl.
// Each prints the time it measured.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "dsa/attention/v1/attention.grpc.pb.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tools/dsa/cluster.h"

namespace dsa {
namespace {

namespace cv1 = ::dsa::coordinator::v1;
namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;
using Clock = std::chrono::steady_clock;

constexpr int kStreams = 4;
constexpr int64_t kCheckIntervalMs = 500;

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

// Polls `done` every 10 ms for up to `timeout`; whether it became true.
bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

int64_t MillisecondsSince(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

class CoordinatorLeaseTest : public ::testing::Test {
 protected:
  // Starts the cluster with the coordinator's lease ttl `ttl_ms`.
  void StartCluster(int64_t ttl_ms) {
    ttl_ms_ = ttl_ms;
    const std::filesystem::path bin = std::filesystem::path(DSA_COORDINATOR_BINARY).parent_path();
    LocalClusterOptions options;
    options.bin_dir = bin.string();
    log_dir_ = std::filesystem::path(::testing::TempDir()) / ("lease-" + std::to_string(getpid()));
    options.log_dir = log_dir_.string();
    options.num_indexers = 1;
    options.num_attention_workers = 1;
    options.capacity_blocks = 4096;
    options.num_heads = 8;
    options.head_dim = 32;
    options.top_k = 256;
    options.coordinator_args = {"--worker-check-interval-ms",
                                std::to_string(kCheckIntervalMs),
                                "--lease-ttl-ms",
                                std::to_string(ttl_ms),
                                "--retain-finished",
                                "false",
                                "--name",
                                "lease-test-coordinator"};
    auto cluster = LocalCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    for (size_t i = 0; i < cluster_->processes().size(); ++i) {
      const ClusterProcess& process = cluster_->processes()[i];
      if (process.name == "dsa-coordinator") coordinator_index_ = i;
      if (process.name.rfind("dsa-indexer", 0) == 0) indexer_ = process.address;
      if (process.name.rfind("dsa-attention", 0) == 0) attention_ = process.address;
    }
  }

  void TearDown() override {
    for (std::thread& stream : streams_) stream.join();
    if (cluster_ != nullptr) (void)cluster_->Stop();  // the killed coordinator makes it unclean
    if (!HasFailure()) std::filesystem::remove_all(log_dir_);  // kept for a failure's diagnosis
  }

  // Starts kStreams Generate streams that decode far longer than the test runs; each ends when
  // the coordinator dies.
  void StartLongStreams() {
    for (int i = 0; i < kStreams; ++i) {
      streams_.emplace_back([this, i] {
        auto stub = cv1::CoordinatorService::NewStub(Channel(cluster_->coordinator_address()));
        grpc::ClientContext context;
        cv1::GenerateRequest request;
        request.set_request_id("long-" + std::to_string(i));
        request.set_context_length(1000 + 100 * i);
        request.set_max_new_tokens(12000);  // 4 x 4 layers x 208 blocks fit the indexer
        auto reader = stub->Generate(&context, request);
        cv1::GenerateEvent event;
        while (reader->Read(&event)) {
          if (event.has_tokens()) ++tokens_seen_;
        }
        const grpc::Status status = reader->Finish();
        absl::MutexLock lock(&mu_);
        stream_ends_ += "stream " + std::to_string(i) + ": " + std::to_string(status.error_code()) +
                        " " + status.error_message() + "\n";
      });
    }
  }

  // Whether the workers hold nothing: the indexer's blocks all free and no sequence, the
  // attention worker's KV empty and no sequence. `what` (may be null) gets what they report.
  bool CapacityBack(std::string* what = nullptr) {
    iv1::GetLoadResponse load;
    av1::GetInfoResponse info;
    {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      if (!iv1::IndexerService::NewStub(Channel(indexer_))
               ->GetLoad(&context, iv1::GetLoadRequest(), &load)
               .ok()) {
        return false;
      }
    }
    {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      if (!av1::AttentionService::NewStub(Channel(attention_))
               ->GetInfo(&context, av1::GetInfoRequest(), &info)
               .ok()) {
        return false;
      }
    }
    if (what != nullptr) {
      *what = "indexer free_blocks " + std::to_string(load.free_blocks()) + " of " +
              std::to_string(load.capacity_blocks()) + ", sequences " +
              std::to_string(load.sequences()) + "; attention sequences " +
              std::to_string(info.sequences()) + ", kv_used_slots " +
              std::to_string(info.kv_used_slots());
    }
    return load.free_blocks() == load.capacity_blocks() && load.sequences() == 0 &&
           info.sequences() == 0 && info.kv_used_slots() == 0;
  }

  // Waits until every stream runs on the workers (each has had tokens, the workers hold them).
  void AwaitStreamsRunning() {
    ASSERT_TRUE(WaitFor(
        [&] {
          iv1::GetLoadResponse load;
          grpc::ClientContext context;
          context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
          return tokens_seen_.load() >= 2 * kStreams &&
                 iv1::IndexerService::NewStub(Channel(indexer_))
                     ->GetLoad(&context, iv1::GetLoadRequest(), &load)
                     .ok() &&
                 load.sequences() == kStreams;
        },
        std::chrono::seconds(30)))
        << "the streams never all ran; tokens " << tokens_seen_.load() << "; " << StreamEnds();
    std::string what;
    EXPECT_FALSE(CapacityBack(&what)) << what;
  }

  // kill -9 of the coordinator, reaped; when the signal was sent.
  Clock::time_point KillCoordinator() {
    const pid_t pid = cluster_->processes()[coordinator_index_].pid;
    const Clock::time_point killed = Clock::now();
    EXPECT_EQ(kill(pid, SIGKILL), 0);
    EXPECT_TRUE(WaitFor(
        [&] {
          return cluster_->processes()[coordinator_index_].pid < 0 ||
                 !cluster_->ReapExited().empty();
        },
        std::chrono::seconds(10)));
    return killed;
  }

  // Runs `count` short requests through the coordinator; each must finish OK.
  void ExpectRequestsSucceed(int count) {
    auto stub = cv1::CoordinatorService::NewStub(Channel(cluster_->coordinator_address()));
    for (int i = 0; i < count; ++i) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      cv1::GenerateRequest request;
      request.set_request_id("after-" + std::to_string(i));
      request.set_context_length(700);
      request.set_max_new_tokens(8);
      auto reader = stub->Generate(&context, request);
      cv1::GenerateEvent event;
      bool finished = false;
      while (reader->Read(&event)) finished |= event.has_finished();
      const grpc::Status status = reader->Finish();
      EXPECT_TRUE(status.ok()) << status.error_message();
      EXPECT_TRUE(finished);
    }
  }

  std::string StreamEnds() {
    absl::MutexLock lock(&mu_);
    return stream_ends_;
  }

  absl::Mutex mu_;
  std::string stream_ends_ ABSL_GUARDED_BY(mu_);  // how the streams that ended ended
  int64_t ttl_ms_ = 0;
  std::filesystem::path log_dir_;
  std::unique_ptr<LocalCluster> cluster_;
  size_t coordinator_index_ = 0;
  std::string indexer_;
  std::string attention_;
  std::vector<std::thread> streams_;
  std::atomic<int64_t> tokens_seen_{0};
};

TEST_F(CoordinatorLeaseTest, AKilledCoordinatorsSequencesAreReleasedWithinTwoLeasePeriods) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*ttl_ms=*/2000));
  StartLongStreams();
  ASSERT_NO_FATAL_FAILURE(AwaitStreamsRunning());
  const Clock::time_point killed = KillCoordinator();
  std::string what;
  const bool back =
      WaitFor([&] { return CapacityBack(&what); }, std::chrono::milliseconds(2 * ttl_ms_));
  const int64_t elapsed_ms = MillisecondsSince(killed);
  std::printf(
      "lease: capacity back %lld ms after kill -9 of the coordinator (ttl %lld ms, "
      "checks every %lld ms)\n",
      static_cast<long long>(elapsed_ms), static_cast<long long>(ttl_ms_),
      static_cast<long long>(kCheckIntervalMs));
  ASSERT_TRUE(back) << "not within two lease periods: " << what;
  // Held until the lease ran out, its ttl after the last renewal (a check at most one interval
  // before the kill): it was the lease that let go, nothing sooner.
  EXPECT_GE(elapsed_ms, ttl_ms_ / 2);

  // A new coordinator of the same name serves again.
  const absl::Status restarted = cluster_->Restart(coordinator_index_);
  ASSERT_TRUE(restarted.ok()) << restarted;
  ExpectRequestsSucceed(3);
  EXPECT_TRUE(WaitFor([&] { return CapacityBack(&what); }, std::chrono::seconds(10))) << what;
}

TEST_F(CoordinatorLeaseTest, ACoordinatorRestartedAtOnceFreesItsDeadInstancesSequencesAtOnce) {
  // A ttl far longer than the restart takes: what comes back before it was superseded, not expired.
  ASSERT_NO_FATAL_FAILURE(StartCluster(/*ttl_ms=*/20000));
  StartLongStreams();
  ASSERT_NO_FATAL_FAILURE(AwaitStreamsRunning());
  const Clock::time_point killed = KillCoordinator();
  const absl::Status restarted = cluster_->Restart(coordinator_index_);
  ASSERT_TRUE(restarted.ok()) << restarted;
  const int64_t restart_ms = MillisecondsSince(killed);
  std::string what;
  const bool back = WaitFor([&] { return CapacityBack(&what); }, std::chrono::seconds(5));
  const int64_t elapsed_ms = MillisecondsSince(killed);
  std::printf(
      "lease: capacity back %lld ms after kill -9 of the coordinator and its immediate "
      "restart (ready after %lld ms; ttl %lld ms)\n",
      static_cast<long long>(elapsed_ms), static_cast<long long>(restart_ms),
      static_cast<long long>(ttl_ms_));
  ASSERT_TRUE(back) << what;
  EXPECT_LT(elapsed_ms, ttl_ms_ / 4);
  ExpectRequestsSucceed(3);
}

}  // namespace
}  // namespace dsa
