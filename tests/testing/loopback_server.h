// A gRPC server on 127.0.0.1:0 for tests that stand up services in-process: the dsa servers'
// receive limit and interceptors (server/parse_errors.h), as RunServer sets them.
#pragma once

#include <memory>
#include <string>

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

}  // namespace dsa::testing
