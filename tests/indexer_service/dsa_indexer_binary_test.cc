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
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"

namespace {

namespace v1 = ::dsa::indexer::v1;
using Clock = std::chrono::steady_clock;

// A started dsa-indexer process and the address it printed.
struct Process {
  pid_t pid = -1;
  std::string address;          // gRPC, host:port
  std::string metrics_address;  // /metrics, host:port
};

Process Start(const std::vector<std::string>& flags) {
  int out[2];
  EXPECT_EQ(pipe(out), 0);
  std::string binary = DSA_INDEXER_BINARY;
  std::vector<std::string> args = flags;
  std::vector<char*> argv;
  argv.push_back(binary.data());
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  pid_t pid = -1;
  EXPECT_EQ(posix_spawn(&pid, binary.c_str(), &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  Process process{pid, "", ""};
  // Read the first two lines: "dsa-indexer: listening on HOST:PORT (...)" and
  // "dsa-indexer: metrics on http://HOST:PORT/metrics".
  std::string line, metrics_line;
  char c;
  while (read(out[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  while (read(out[0], &c, 1) == 1 && c != '\n') metrics_line.push_back(c);
  close(out[0]);
  const std::string http = "http://";
  if (const size_t at = metrics_line.find(http); at != std::string::npos) {
    const size_t begin = at + http.size();
    process.metrics_address = metrics_line.substr(begin, metrics_line.find('/', begin) - begin);
  }
  const std::string marker = "listening on ";
  const size_t at = line.find(marker);
  EXPECT_NE(at, std::string::npos) << "first line: " << line;
  if (at != std::string::npos) {
    const size_t begin = at + marker.size();
    process.address = line.substr(begin, line.find(' ', begin) - begin);
  }
  return process;
}

// Waits up to `timeout` for the process to exit; its exit code, or -1 on timeout (then killed).
int WaitExit(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

// grpc.health.v1.Health/Check by hand (no generated health stubs are installed): request field 1
// (service name), response field 1 (status: 1 SERVING, 2 NOT_SERVING). -1 when the call fails.
int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service) {
  std::string request = {'\x0a', static_cast<char>(service.size())};
  request += service;
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check",
                                         grpc::internal::RpcMethod::NORMAL_RPC);
  const grpc::Status status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel.get(), method, &context, request_buffer, &response_buffer);
  if (!status.ok()) return -1;
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(response_buffer.Dump(&slices).ok());
  std::string response;
  for (const grpc::Slice& s : slices)
    response.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (response.empty()) return 0;  // UNKNOWN, the default value
  return response.size() == 2 && response[0] == '\x08' ? response[1] : -1;
}

// The raw bytes of a grpc.reflection.v1alpha list_services answer (no generated reflection stubs
// are installed): request field 7 (list_services), the response holds the service names.
std::string ReflectionListServices(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const grpc::internal::RpcMethod method(
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel.get(), method, &context));
  const std::string request = {'\x3a', '\x01', '*'};
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;
  std::string response;
  if (stream->Write(request_buffer) && stream->Read(&response_buffer)) {
    std::vector<grpc::Slice> slices;
    EXPECT_TRUE(response_buffer.Dump(&slices).ok());
    for (const grpc::Slice& s : slices) {
      response.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  stream->WritesDone();
  (void)stream->Finish();
  return response;
}

// GET http://address/metrics over a plain socket; the whole response, headers included.
std::string HttpGetMetrics(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in server{};
  server.sin_family = AF_INET;
  server.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &server.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  std::string response;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&server), sizeof(server)) == 0) {
    const std::string request =
        "GET /metrics HTTP/1.0\r\nHost: " + address + "\r\nConnection: close\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      ssize_t n;
      while ((n = read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
    }
  }
  close(fd);
  return response;
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

TEST(DsaIndexerBinaryTest, ServesHealthAndTheApiThenDrainsOnSigterm) {
  const Process process = Start({"--capacity-blocks", "64", "--num-heads", "4", "--head-dim", "16",
                                 "--drain-delay-ms", "1500", "--shutdown-grace-ms", "1000"});
  ASSERT_FALSE(process.address.empty());
  EXPECT_EQ(process.address.rfind("127.0.0.1:", 0), 0u) << process.address;
  EXPECT_NE(process.address, "127.0.0.1:0");
  auto channel = grpc::CreateChannel(process.address, grpc::InsecureChannelCredentials());
  EXPECT_EQ(HealthStatus(channel, "liveness"), 1);
  EXPECT_EQ(HealthStatus(channel, "readiness"), 1);

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
                             "dsa_indexer_cache_blocks{state=\"used\"} 0",
                             "dsa_indexer_cache_blocks{state=\"free\"} 64"}) {
    EXPECT_NE(metrics.find(sample), std::string::npos) << sample;
  }
  EXPECT_EQ(metrics.find("request_id"), std::string::npos);

  // SIGTERM: readiness turns NOT_SERVING while the server still answers, then it exits cleanly.
  ASSERT_EQ(kill(process.pid, SIGTERM), 0);
  int readiness = 1;
  for (int i = 0; i < 100 && readiness == 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    readiness = HealthStatus(channel, "readiness");
  }
  EXPECT_EQ(readiness, 2);
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
