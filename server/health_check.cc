#include "server/health_check.h"

#include <vector>

#include "grpcpp/impl/client_unary_call.h"

namespace dsa {

int CheckHealthStatus(grpc::Channel& channel, const std::string& service,
                      std::chrono::milliseconds timeout, bool wait_for_ready) {
  return CheckHealth(channel, service, timeout, wait_for_ready).serving;
}

HealthCheckResult CheckHealth(grpc::Channel& channel, const std::string& service,
                              std::chrono::milliseconds timeout, bool wait_for_ready) {
  HealthCheckResult result;
  std::string request = {'\x0a', static_cast<char>(service.size())};
  request += service;
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  context.set_wait_for_ready(wait_for_ready);
  const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check",
                                         grpc::internal::RpcMethod::NORMAL_RPC);
  result.call = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      &channel, method, &context, request_buffer, &response_buffer);
  if (!result.call.ok()) return result;
  std::vector<grpc::Slice> slices;
  if (!response_buffer.Dump(&slices).ok()) return result;
  std::string response;
  for (const grpc::Slice& s : slices) {
    response.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  if (response.empty()) {
    result.serving = 0;  // UNKNOWN, the default value
  } else if (response.size() == 2 && response[0] == '\x08') {
    result.serving = static_cast<unsigned char>(response[1]);
  }
  return result;
}

}  // namespace dsa
