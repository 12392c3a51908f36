// Tests of the `dsa-coordinator` binary as a real process on loopback (port 0) beside real
// dsa-indexer and dsa-attention processes: --help, readiness that follows the workers (not ready
// until they listen, whatever the start order),
// grpc.health.v1, reflection, a Generate stream end to end, GetLoad, /metrics, and the SIGTERM
// drain (readiness NOT_SERVING, new requests UNAVAILABLE, a running request finishes, exit 0).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/coordinator/generate_client.h"
#include "tests/testing/server_process.h"

namespace {

namespace cv1 = ::dsa::coordinator::v1;
using Clock = std::chrono::steady_clock;
using dsa::coordinator_testing::Request;
using dsa::coordinator_testing::Stream;
using dsa::testing::HealthStatus;
using dsa::testing::HttpGetMetrics;
using dsa::testing::Process;
using dsa::testing::ReflectionListServices;
using dsa::testing::StartServer;
using dsa::testing::WaitExit;

std::string RunForOutput(const std::string& command, int* exit_code) {
  FILE* pipe = popen(command.c_str(), "r");
  std::string text;
  if (pipe == nullptr) return text;
  char buffer[512];
  while (fgets(buffer, sizeof(buffer), pipe) != nullptr) text += buffer;
  *exit_code = pclose(pipe);
  return text;
}

TEST(DsaCoordinatorBinaryTest, HelpListsTheFlags) {
  int exit_code = -1;
  const std::string text =
      RunForOutput(std::string(DSA_COORDINATOR_BINARY) + " --help", &exit_code);
  EXPECT_EQ(exit_code, 0);
  for (const char* flag : {"--listen",
                           "--metrics-listen",
                           "--shutdown-grace-ms",
                           "--drain-delay-ms",
                           "--indexer",
                           "--attention",
                           "--max-queue",
                           "--max-running",
                           "--top-k",
                           "--target-block-sparsity",
                           "--exploration-fraction",
                           "--all-keep",
                           "--acceptance-rate",
                           "--seed",
                           "--retain-finished",
                           "--worker-check-timeout-ms",
                           "--indexer-dns",
                           "--attention-dns",
                           "--worker-check-interval-ms",
                           "--name",
                           "--lease-ttl-ms",
                           "--ttft-buckets",
                           "--itl-buckets",
                           "--log-level",
                           "--config",
                           "--version"}) {
    EXPECT_NE(text.find(flag), std::string::npos) << flag;
  }
}

// A lease ttl that the checks could not keep up is refused at start, naming both flags.
TEST(DsaCoordinatorBinaryTest, ALeaseTtlShorterThanThreeChecksIsRefused) {
  int exit_code = -1;
  const std::string text = RunForOutput(
      std::string(DSA_COORDINATOR_BINARY) +
          " --listen 127.0.0.1:0 --metrics-listen none --indexer 127.0.0.1:1 --attention "
          "127.0.0.1:2 --worker-check-interval-ms 2000 --lease-ttl-ms 5000 2>&1",
      &exit_code);
  EXPECT_NE(exit_code, 0) << text;
  EXPECT_NE(text.find("--lease-ttl-ms"), std::string::npos) << text;
  EXPECT_NE(text.find("--worker-check-interval-ms"), std::string::npos) << text;
}

// A Generate call to a real process, run to its end (60 s: the workers are real processes too).
Stream Generate(cv1::CoordinatorService::Stub& stub, const cv1::GenerateRequest& request,
                absl::Notification* admitted = nullptr) {
  return dsa::coordinator_testing::Generate(stub, request, std::chrono::seconds(60), admitted);
}

// One dsa-indexer and one dsa-attention (a small model: H = 4, D = 16, pattern FSFS), both ready.
void StartWorkers(Process* indexer, Process* attention) {
  *indexer = StartServer(DSA_INDEXER_BINARY,
                         {"--capacity-blocks", "1024", "--num-heads", "4", "--head-dim", "16"});
  ASSERT_FALSE(indexer->address.empty());
  *attention = StartServer(DSA_ATTENTION_BINARY,
                           {"--layer-pattern", "FSFS", "--num-heads", "4", "--head-dim", "16",
                            "--kv-dim", "8", "--attention-heads", "2"});
  ASSERT_FALSE(attention->address.empty());
}

// A loopback port that was free a moment ago (for a worker that starts after the coordinator).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  close(fd);
  return ntohs(address.sin_port);
}

// Waits up to 20 s for `service`'s health to become `status` (a health Watch, not a poll); returns
// the last status seen.
int AwaitHealth(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                int status) {
  return dsa::testing::WatchHealthUntil(channel, service, status, std::chrono::seconds(20));
}

// Pods start in any order: a coordinator whose workers are not up yet serves, not ready (and
// refuses Generate with UNAVAILABLE), turns ready once both listen, and not ready again when its
// only indexer is gone.
TEST(DsaCoordinatorBinaryTest, StartsNotReadyAndFollowsItsWorkers) {
  const std::string indexer_address = "127.0.0.1:" + std::to_string(FreePort());
  const std::string attention_address = "127.0.0.1:" + std::to_string(FreePort());
  const Process coordinator =
      StartServer(DSA_COORDINATOR_BINARY,
                  {"--indexer", indexer_address, "--attention", attention_address, "--top-k", "64",
                   "--worker-check-interval-ms", "100", "--shutdown-grace-ms", "500"});
  ASSERT_FALSE(coordinator.address.empty());
  auto channel = grpc::CreateChannel(coordinator.address, grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(channel, "liveness"), 1);
  EXPECT_EQ(HealthStatus(channel, "readiness"), 2);
  EXPECT_EQ(HealthStatus(channel, ""), 2);
  auto stub = cv1::CoordinatorService::NewStub(channel);
  const Stream refused = Generate(*stub, Request("early", 300, 4, 0));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(refused.status.error_message().find("not ready"), std::string::npos)
      << refused.status.error_message();

  const Process indexer = StartServer(
      DSA_INDEXER_BINARY, {"--listen", indexer_address, "--capacity-blocks", "1024", "--num-heads",
                           "4", "--head-dim", "16", "--shutdown-grace-ms", "500"});
  ASSERT_EQ(indexer.address, indexer_address);
  EXPECT_EQ(AwaitHealth(channel, "readiness", 2), 2);  // an indexer alone is not enough
  const Process attention =
      StartServer(DSA_ATTENTION_BINARY, {"--listen", attention_address, "--layer-pattern", "FSFS",
                                         "--num-heads", "4", "--head-dim", "16", "--kv-dim", "8",
                                         "--attention-heads", "2", "--shutdown-grace-ms", "500"});
  ASSERT_EQ(attention.address, attention_address);
  EXPECT_EQ(AwaitHealth(channel, "readiness", 1), 1);
  EXPECT_EQ(AwaitHealth(channel, "", 1), 1);  // set just after "readiness"
  // A request whose prefix stays on the indexer as a donor (retained).
  cv1::GenerateRequest with_prefix = Request("late", 1100, 4, 0);
  with_prefix.add_prefix_block_ids(7);
  with_prefix.add_prefix_block_ids(8);
  const Stream served = Generate(*stub, with_prefix);
  EXPECT_TRUE(served.status.ok()) << served.status.error_message();
  EXPECT_EQ(served.TokenCount(), 4);

  kill(indexer.pid, SIGTERM);  // its drain turns its readiness NOT_SERVING at once
  EXPECT_EQ(WaitExit(indexer.pid, std::chrono::seconds(10)), 0);
  EXPECT_EQ(AwaitHealth(channel, "readiness", 2), 2);
  EXPECT_EQ(AwaitHealth(channel, "", 2), 2);
  {
    grpc::ClientContext context;
    cv1::GetLoadResponse load;
    ASSERT_TRUE(stub->GetLoad(&context, cv1::GetLoadRequest(), &load).ok());
    ASSERT_EQ(load.indexer_workers_size(), 1);
    EXPECT_FALSE(load.indexer_workers(0).ready());
    ASSERT_EQ(load.attention_workers_size(), 1);
    EXPECT_TRUE(load.attention_workers(0).ready());
  }
  const std::string metrics = HttpGetMetrics(coordinator.metrics_address);
  for (const char* sample : {"dsa_coordinator_workers{kind=\"indexer\",state=\"not_ready\"} 1",
                             "dsa_coordinator_workers{kind=\"indexer\",state=\"ready\"} 0",
                             "dsa_coordinator_workers{kind=\"attention\",state=\"ready\"} 1",
                             "dsa_build_info{component=\"coordinator\""}) {
    EXPECT_NE(metrics.find(sample), std::string::npos) << sample << "\n" << metrics;
  }

  // The indexer comes back at the same address, a new process: the coordinator sees the new
  // instance, forgets the donor the old one held, and a request with the same prefix is served
  // (from a fresh prefill, not from the lost donor).
  const Process restarted = StartServer(
      DSA_INDEXER_BINARY, {"--listen", indexer_address, "--capacity-blocks", "1024", "--num-heads",
                           "4", "--head-dim", "16", "--shutdown-grace-ms", "500"});
  ASSERT_EQ(restarted.address, indexer_address);
  EXPECT_EQ(AwaitHealth(channel, "readiness", 1), 1);
  with_prefix.set_request_id("after-restart");
  const Stream again = Generate(*stub, with_prefix);
  EXPECT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.TokenCount(), 4);
  kill(restarted.pid, SIGTERM);
  EXPECT_EQ(WaitExit(restarted.pid, std::chrono::seconds(10)), 0);
  kill(attention.pid, SIGTERM);
  kill(coordinator.pid, SIGTERM);
  EXPECT_EQ(WaitExit(attention.pid, std::chrono::seconds(10)), 0);
  EXPECT_EQ(WaitExit(coordinator.pid, std::chrono::seconds(10)), 0);
}

TEST(DsaCoordinatorBinaryTest, ServesGenerateOverRealWorkersThenDrainsOnSigterm) {
  Process indexer, attention;
  ASSERT_NO_FATAL_FAILURE(StartWorkers(&indexer, &attention));
  const Process coordinator =
      StartServer(DSA_COORDINATOR_BINARY,
                  {"--indexer", indexer.address, "--attention", attention.address, "--top-k", "64",
                   "--drain-delay-ms", "1000", "--shutdown-grace-ms", "20000"});
  ASSERT_FALSE(coordinator.address.empty());
  auto channel = grpc::CreateChannel(coordinator.address, grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(channel, "liveness"), 1);
  EXPECT_EQ(HealthStatus(channel, "readiness"), 1);
  const std::string services = ReflectionListServices(channel);
  EXPECT_NE(services.find("dsa.coordinator.v1.CoordinatorService"), std::string::npos);
  auto stub = cv1::CoordinatorService::NewStub(channel);

  const Stream first = Generate(*stub, Request("first", 300, 9, 2));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_TRUE(first.Any(&cv1::GenerateEvent::has_admitted));
  EXPECT_TRUE(first.Any(&cv1::GenerateEvent::has_finished));
  EXPECT_EQ(first.TokenCount(), 9);
  {
    grpc::ClientContext context;
    cv1::GetLoadResponse load;
    ASSERT_TRUE(stub->GetLoad(&context, cv1::GetLoadRequest(), &load).ok());
    EXPECT_EQ(load.retained_sequences(), 1);
    EXPECT_EQ(load.cache_blocks_capacity(), 1024);
    EXPECT_GT(load.cache_blocks_used(), 0);
  }
  const std::string metrics = HttpGetMetrics(coordinator.metrics_address);
  EXPECT_NE(metrics.find("dsa_coordinator_requests_total{code=\"OK\",outcome=\"completed\"} 1"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("dsa_coordinator_time_to_first_token_seconds_count 1"), std::string::npos);
  EXPECT_EQ(metrics.find("request_id"), std::string::npos);

  // A long request runs while the coordinator drains.
  Stream running;
  absl::Notification long_admitted;
  std::thread long_request(
      [&] { running = Generate(*stub, Request("long", 200, 200, 0), &long_admitted); });
  (void)long_admitted.WaitForNotificationWithTimeout(absl::Seconds(10));  // running
  ASSERT_EQ(kill(coordinator.pid, SIGTERM), 0);
  const int readiness =
      dsa::testing::WatchHealthUntil(channel, "readiness", 2, std::chrono::seconds(1));
  EXPECT_EQ(readiness, 2);
  const Stream late = Generate(*stub, Request("late", 100, 1, 0));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(late.status.error_message().find("draining"), std::string::npos);
  long_request.join();
  EXPECT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_EQ(running.TokenCount(), 200);
  EXPECT_EQ(WaitExit(coordinator.pid, std::chrono::seconds(20)), 0);

  kill(attention.pid, SIGTERM);
  kill(indexer.pid, SIGTERM);
  EXPECT_EQ(WaitExit(attention.pid, std::chrono::seconds(10)), 0);
  EXPECT_EQ(WaitExit(indexer.pid, std::chrono::seconds(10)), 0);
}

TEST(DsaCoordinatorBinaryTest, ARequestLongerThanTheGraceIsCutAndTheProcessExitsInTime) {
  Process indexer, attention;
  ASSERT_NO_FATAL_FAILURE(StartWorkers(&indexer, &attention));
  const Process coordinator =
      StartServer(DSA_COORDINATOR_BINARY,
                  {"--indexer", indexer.address, "--attention", attention.address, "--top-k", "64",
                   "--drain-delay-ms", "300", "--shutdown-grace-ms", "500"});
  ASSERT_FALSE(coordinator.address.empty());
  auto stub = cv1::CoordinatorService::NewStub(
      grpc::CreateChannel(coordinator.address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  // 2 x ceil(20100 / 64) = 630 blocks: fits, and takes far longer than the grace to decode.
  auto open = stub->Generate(&context, Request("long", 100, 20000, 0));
  cv1::GenerateEvent event;
  ASSERT_TRUE(open->Read(&event));
  ASSERT_TRUE(event.has_admitted());
  ASSERT_TRUE(open->Read(&event));
  ASSERT_TRUE(event.has_tokens());
  const auto signalled = Clock::now();
  ASSERT_EQ(kill(coordinator.pid, SIGTERM), 0);
  int64_t tokens = 0;
  while (open->Read(&event)) tokens += event.has_tokens() ? event.tokens().count() : 0;
  const grpc::Status status = open->Finish();
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_LT(tokens, 20000);
  EXPECT_EQ(WaitExit(coordinator.pid, std::chrono::seconds(10)), 0);
  EXPECT_LT(Clock::now() - signalled, std::chrono::milliseconds(300 + 500 + 1500));

  kill(attention.pid, SIGTERM);
  kill(indexer.pid, SIGTERM);
  EXPECT_EQ(WaitExit(attention.pid, std::chrono::seconds(10)), 0);
  EXPECT_EQ(WaitExit(indexer.pid, std::chrono::seconds(10)), 0);
}

}  // namespace
