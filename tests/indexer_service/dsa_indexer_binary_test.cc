// Tests of the `dsa-indexer` binary as a real process on loopback (port 0): --help, the printed
// bound address, grpc.health.v1 liveness/readiness, server reflection, /metrics, the service,
// readiness NOT_SERVING while draining after SIGTERM, and exit within the grace period with a
// stream still open.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "tests/testing/server_process.h"

namespace {

namespace v1 = ::dsa::indexer::v1;
using Clock = std::chrono::steady_clock;

using dsa::testing::HealthStatus;
using dsa::testing::HttpGetMetrics;
using dsa::testing::Process;
using dsa::testing::ReflectionListServices;
using dsa::testing::WaitExit;
using dsa::testing::WatchHealthUntil;

Process Start(const std::vector<std::string>& flags) {
  return dsa::testing::StartServer(DSA_INDEXER_BINARY, flags);
}

TEST(DsaIndexerBinaryTest, HelpListsTheFlags) {
  FILE* pipe = popen((std::string(DSA_INDEXER_BINARY) + " --help").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string text;
  char buffer[512];
  while (fgets(buffer, sizeof(buffer), pipe) != nullptr) text += buffer;
  EXPECT_EQ(pclose(pipe), 0);
  for (const char* flag : {"--listen", "--capacity-blocks", "--num-heads", "--head-dim",
                           "--shutdown-grace-ms", "--drain-delay-ms", "--metrics-listen"}) {
    EXPECT_NE(text.find(flag), std::string::npos) << flag;
  }
}

// Stderr and exit status of the binary with `args` (a shell word list).
std::pair<std::string, int> RunWith(const std::string& args) {
  FILE* pipe = popen((std::string(DSA_INDEXER_BINARY) + " " + args + " 2>&1").c_str(), "r");
  std::string text;
  char buffer[512];
  while (pipe != nullptr && fgets(buffer, sizeof(buffer), pipe) != nullptr) text += buffer;
  const int status = pipe != nullptr ? pclose(pipe) : -1;
  return {text, WIFEXITED(status) ? WEXITSTATUS(status) : -1};
}

// Start-up refusals say what is wrong and what was meant: an empty cache, a misspelt flag (on the
// command line and in the TOML file), a metrics port in use.
TEST(DsaIndexerBinaryTest, StartupRefusalsNameTheProblem) {
  auto [zero, zero_code] = RunWith("--capacity-blocks 0");
  EXPECT_NE(zero_code, 0);
  EXPECT_NE(zero.find("--capacity-blocks: must be a whole number of blocks, at least 1; got 0"),
            std::string::npos)
      << zero;
  auto [typo, typo_code] = RunWith("--capacity-blok 10");
  EXPECT_NE(typo_code, 0);
  EXPECT_NE(typo.find("--capacity-blok: did you mean --capacity-blocks?"), std::string::npos)
      << typo;
  const std::string file = ::testing::TempDir() + "/indexer_flags.toml";
  std::ofstream(file) << "num_heads = 8\ncapacity_blok = 10\n";
  auto [config, config_code] = RunWith("--config " + file);
  EXPECT_NE(config_code, 0);
  EXPECT_NE(config.find(file + ":2:1: 'capacity_blok' is not a flag of this server; did you mean "
                               "capacity-blocks?"),
            std::string::npos)
      << config;
  // The metrics port of a running indexer, taken again.
  const Process first = Start({"--metrics-listen", "127.0.0.1:0"});
  ASSERT_FALSE(first.metrics_address.empty());
  auto [taken, taken_code] =
      RunWith("--listen 127.0.0.1:0 --metrics-listen " + first.metrics_address);
  EXPECT_EQ(taken_code, 1);
  EXPECT_NE(taken.find(R"("flag":"--metrics-listen","level":"error","msg":"cannot listen")"),
            std::string::npos)
      << taken;
  kill(first.pid, SIGKILL);
  WaitExit(first.pid, std::chrono::seconds(10));
}

TEST(DsaIndexerBinaryTest, ServesHealthAndTheApiThenDrainsOnSigterm) {
  const Process process = Start({"--capacity-blocks", "64", "--num-heads", "4", "--head-dim", "16",
                                 "--drain-delay-ms", "1500", "--shutdown-grace-ms", "1000"});
  ASSERT_FALSE(process.address.empty());
  EXPECT_EQ(process.address.rfind("127.0.0.1:", 0), 0u) << process.address;
  EXPECT_NE(process.address, "127.0.0.1:0");
  auto channel = grpc::CreateChannel(process.address, grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(channel, "liveness"), 1);
  EXPECT_EQ(HealthStatus(channel, "readiness"), 1);
  EXPECT_EQ(HealthStatus(channel, ""), 1);

  const std::string services = ReflectionListServices(channel);
  EXPECT_NE(services.find("dsa.indexer.v1.IndexerService"), std::string::npos) << services;
  EXPECT_NE(services.find("grpc.health.v1.Health"), std::string::npos) << services;

  auto stub = v1::IndexerService::NewStub(channel);
  {
    grpc::ClientContext context;
    v1::GetLoadResponse load;
    ASSERT_TRUE(stub->GetLoad(&context, v1::GetLoadRequest(), &load).ok());
    EXPECT_EQ(load.capacity_blocks(), 64);
    EXPECT_EQ(load.num_heads(), 4);
    EXPECT_EQ(load.head_dim(), 16);
  }
  {
    grpc::ClientContext context;
    v1::ReleaseRequest request;
    request.set_sequence_id(5);
    v1::ReleaseResponse response;
    EXPECT_EQ(stub->Release(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }

  // /metrics: the families of DESIGN.md section 6, labelled by phase or state only.
  ASSERT_FALSE(process.metrics_address.empty());
  const std::string metrics = HttpGetMetrics(process.metrics_address);
  EXPECT_NE(metrics.find("200 OK"), std::string::npos) << metrics;
  for (const char* sample : {"dsa_indexer_select_duration_seconds_count{phase=\"scan\"}",
                             "dsa_indexer_blocks_scored_total", "dsa_indexer_blocks_visible_total",
                             "dsa_indexer_cache_blocks{state=\"exclusive\"} 0",
                             "dsa_indexer_cache_blocks{state=\"free\"} 64"}) {
    EXPECT_NE(metrics.find(sample), std::string::npos) << sample;
  }
  EXPECT_EQ(metrics.find("request_id"), std::string::npos);

  // SIGTERM: readiness turns NOT_SERVING while the server still answers, then it exits cleanly.
  ASSERT_EQ(kill(process.pid, SIGTERM), 0);
  const int readiness = WatchHealthUntil(channel, "readiness", 2, std::chrono::seconds(1));
  EXPECT_EQ(readiness, 2);
  EXPECT_EQ(HealthStatus(channel, ""), 2);  // the unnamed service follows readiness
  EXPECT_EQ(HealthStatus(channel, "liveness"), 1);
  EXPECT_EQ(WaitExit(process.pid, std::chrono::seconds(10)), 0);
}

TEST(DsaIndexerBinaryTest, ShutdownWithAnOpenStreamEndsWithinTheGracePeriod) {
  const Process process = Start({"--capacity-blocks", "16", "--num-heads", "4", "--head-dim", "16",
                                 "--shutdown-grace-ms", "500"});
  ASSERT_FALSE(process.address.empty());
  auto channel = grpc::CreateChannel(process.address, grpc::InsecureChannelCredentials());
  auto stub = v1::IndexerService::NewStub(channel);
  grpc::ClientContext context;
  auto stream = stub->SelectStream(&context);  // open, never half-closed
  ASSERT_EQ(HealthStatus(channel, "readiness"), 1);
  const auto start = Clock::now();
  ASSERT_EQ(kill(process.pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(process.pid, std::chrono::seconds(10)), 0);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));  // grace 0.5 s plus slack
  v1::SelectResponse response;
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_FALSE(stream->Finish().ok());
}

}  // namespace
