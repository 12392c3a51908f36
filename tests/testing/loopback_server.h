// A gRPC server on 127.0.0.1:0 for tests that stand up services in-process: the dsa servers'
// receive limit and interceptors (server/parse_errors.h), as RunServer sets them.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "contracts/limits.h"
#include "grpcpp/grpcpp.h"
#include "server/parse_errors.h"

namespace dsa::testing {

/// Starts `service` (not owned; outlives the server) on a free loopback port; `*address` gets
/// "127.0.0.1:PORT". `credentials` (TLS, tokens: server/security.h) default to plaintext. Null
/// when the server cannot start.
inline std::unique_ptr<grpc::Server> ServeOnLoopback(
    grpc::Service* service, std::string* address,
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials()) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", credentials, &port);
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
  AddServerInterceptors(builder);
  auto server = builder.BuildAndStart();
  *address = absl::StrCat("127.0.0.1:", port);
  return server;
}

/// A plaintext channel to `address` (a server of this test), connected before it is returned, so
/// that the first connect happens here: gRPC 1.51 can report a connect still in progress as failed
/// with another call's errno ("UNKNOWN: ipv4:...: No such file or directory", gRPC pull request
/// 35064), and the channel's reconnect then retries it instead of the test's first call failing
/// UNAVAILABLE. Waits at most 30 s; a channel that never connects comes back unconnected (its
/// first call then fails, saying why), at once for port 0 (a server that failed to start).
inline std::shared_ptr<grpc::Channel> ConnectedLoopbackChannel(const std::string& address) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  if (!absl::EndsWith(address, ":0")) {
    (void)channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30));
  }
  return channel;
}

}  // namespace dsa::testing
