#include "tests/testing/server_process.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <future>
#include <thread>

#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "server/health_check.h"

extern char** environ;

namespace dsa::testing {

Process StartServer(const std::string& binary_path, const std::vector<std::string>& flags) {
  int out[2];
  EXPECT_EQ(pipe(out), 0);
  std::string binary = binary_path;
  // Loopback and free ports unless the test says otherwise (the binaries' defaults are fixed
  // ports on every interface, for pods).
  std::vector<std::string> args;
  for (const char* flag : {"--listen", "--metrics-listen"}) {
    if (std::find(flags.begin(), flags.end(), flag) == flags.end()) {
      args.insert(args.end(), {flag, "127.0.0.1:0"});
    }
  }
  args.insert(args.end(), flags.begin(), flags.end());
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
  Process process{pid, "", "", ""};
  // Read the first two lines: "NAME: listening on HOST:PORT (...)" and
  // "NAME: metrics on http://HOST:PORT/metrics".
  std::string line, metrics_line;
  char c;
  while (read(out[0], &c, 1) == 1 && c != '\n') line.push_back(c);
  while (read(out[0], &c, 1) == 1 && c != '\n') metrics_line.push_back(c);
  if (std::find(flags.begin(), flags.end(), "--health-listen") != flags.end()) {
    std::string health_line;  // "NAME: health on HOST:PORT"
    while (read(out[0], &c, 1) == 1 && c != '\n') health_line.push_back(c);
    const std::string health_marker = "health on ";
    if (const size_t at = health_line.find(health_marker); at != std::string::npos) {
      process.health_address = health_line.substr(at + health_marker.size());
    }
  }
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
  // The exit itself is the event: waitpid blocks on a thread of its own, and a timeout kills the
  // process, which ends that wait.
  std::future<int> exited = std::async(std::launch::async, [pid] {
    int status = 0;
    pid_t waited = -1;
    do {
      waited = waitpid(pid, &status, 0);
    } while (waited < 0 && errno == EINTR);
    if (waited != pid) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  });
  if (exited.wait_for(timeout) == std::future_status::ready) return exited.get();
  kill(pid, SIGKILL);
  exited.get();  // reaped
  return -1;
}

// grpc.health.v1.Health/Check by hand (no generated health stubs are installed): request field 1
// (service name), response field 1 (status: 1 SERVING, 2 NOT_SERVING). -1 when the call fails.
bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout,
             std::chrono::milliseconds poll) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(poll);
  }
  return done();
}

int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service) {
  return CheckHealthStatus(*channel, service, std::chrono::seconds(5), /*wait_for_ready=*/false);
}

// grpc.health.v1.Health/Watch by hand, as HealthStatus: each answer's field 1 is a status.
int WatchHealthUntil(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                     int until, std::chrono::milliseconds timeout) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Watch",
                                         grpc::internal::RpcMethod::SERVER_STREAMING);
  std::string request = {'\x0a', static_cast<char>(service.size())};
  request += service;
  grpc::Slice slice(request);
  const grpc::ByteBuffer request_buffer(&slice, 1);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel.get(), method, &context,
                                                                    request_buffer));
  int last = -1;
  grpc::ByteBuffer response_buffer;
  while (last != until && stream->Read(&response_buffer)) {
    std::vector<grpc::Slice> slices;
    if (!response_buffer.Dump(&slices).ok()) break;
    std::string response;
    for (const grpc::Slice& s : slices) {
      response.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    if (response.empty()) {
      last = 0;  // UNKNOWN, the default value
    } else if (response.size() == 2 && response[0] == '\x08') {
      last = static_cast<unsigned char>(response[1]);
    }
  }
  context.TryCancel();
  (void)stream->Finish();
  return last;
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

}  // namespace dsa::testing
