// Tests of the `dsa-coordinator` binary as a real process on loopback (port 0) beside real
// dsa-indexer and dsa-attention processes: --help, failing startup when workers are unreachable,
// grpc.health.v1, reflection, a Generate stream end to end, GetLoad, /metrics, and the SIGTERM
// drain (readiness NOT_SERVING, new requests UNAVAILABLE, a running request finishes, exit 0).
#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testing/server_process.h"

namespace {

namespace cv1 = ::dsa::coordinator::v1;
using Clock = std::chrono::steady_clock;
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
  for (const char* flag :
       {"--listen", "--metrics-listen", "--shutdown-grace-ms", "--drain-delay-ms", "--indexer",
        "--attention", "--max-queue", "--max-running", "--top-k", "--target-block-sparsity",
        "--exploration-fraction", "--all-keep", "--acceptance-rate", "--seed", "--retain-finished",
        "--startup-timeout-ms"}) {
    EXPECT_NE(text.find(flag), std::string::npos) << flag;
  }
}

TEST(DsaCoordinatorBinaryTest, FailsToStartWhenAWorkerIsUnreachable) {
  int exit_code = -1;
  const auto start = Clock::now();
  const std::string text = RunForOutput(
      std::string(DSA_COORDINATOR_BINARY) +
          " --indexer 127.0.0.1:1 --attention 127.0.0.1:1 --startup-timeout-ms 300 2>&1",
      &exit_code);
  EXPECT_NE(exit_code, 0);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_NE(text.find("attention worker 127.0.0.1:1"), std::string::npos) << text;
}

cv1::GenerateRequest Request(const std::string& id, int64_t context, int64_t max_new, int draft) {
  cv1::GenerateRequest r;
  r.set_request_id(id);
  r.set_context_length(context);
  r.set_max_new_tokens(max_new);
  r.set_draft_length(draft);
  return r;
}

struct Stream {
  grpc::Status status;
  int64_t tokens = 0;
  bool admitted = false;
  bool finished = false;
};

Stream Generate(cv1::CoordinatorService::Stub& stub, const cv1::GenerateRequest& request) {
  Stream s;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub.Generate(&context, request);
  cv1::GenerateEvent event;
  while (reader->Read(&event)) {
    s.admitted = s.admitted || event.has_admitted();
    s.finished = s.finished || event.has_finished();
    if (event.has_tokens()) s.tokens += event.tokens().count();
  }
  s.status = reader->Finish();
  return s;
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
  EXPECT_TRUE(first.admitted);
  EXPECT_TRUE(first.finished);
  EXPECT_EQ(first.tokens, 9);
  {
    grpc::ClientContext context;
    cv1::GetLoadResponse load;
    ASSERT_TRUE(stub->GetLoad(&context, cv1::GetLoadRequest(), &load).ok());
    EXPECT_EQ(load.retained_sequences(), 1);
    EXPECT_EQ(load.cache_blocks_capacity(), 1024);
    EXPECT_GT(load.cache_blocks_used(), 0);
  }
  const std::string metrics = HttpGetMetrics(coordinator.metrics_address);
  EXPECT_NE(metrics.find("dsa_coordinator_requests_total{outcome=\"completed\"} 1"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("dsa_coordinator_time_to_first_token_seconds_count 1"), std::string::npos);
  EXPECT_EQ(metrics.find("request_id"), std::string::npos);

  // A long request runs while the coordinator drains.
  Stream running;
  std::thread long_request([&] { running = Generate(*stub, Request("long", 200, 200, 0)); });
  for (int i = 0; i < 500; ++i) {
    grpc::ClientContext context;
    cv1::GetLoadResponse load;
    if (stub->GetLoad(&context, cv1::GetLoadRequest(), &load).ok() && load.running() == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(kill(coordinator.pid, SIGTERM), 0);
  int readiness = 1;
  for (int i = 0; i < 100 && readiness == 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    readiness = HealthStatus(channel, "readiness");
  }
  EXPECT_EQ(readiness, 2);
  const Stream late = Generate(*stub, Request("late", 100, 1, 0));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(late.status.error_message().find("draining"), std::string::npos);
  long_request.join();
  EXPECT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_EQ(running.tokens, 200);
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
