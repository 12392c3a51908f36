// See request_log.h.
#include "server/request_log.h"

#include <chrono>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "common/trace_context.h"
#include "server/server.h"

namespace dsa {
namespace {

using grpc::experimental::InterceptionHookPoints;
using grpc::experimental::ServerRpcInfo;

// Statuses a client's request causes (logged at debug like OK); the rest are the server's.
bool ClientCaused(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
      return true;
    default:
      return false;
  }
}

class RequestLogInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit RequestLogInterceptor(ServerRpcInfo* info)
      : info_(info), start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      const auto* metadata = methods->GetRecvInitialMetadata();
      if (metadata != nullptr) {
        auto it = metadata->find(kTraceparentKey);
        if (it != metadata->end()) {
          const auto parsed =
              ParseTraceparent(absl::string_view(it->second.data(), it->second.size()));
          if (parsed.has_value()) trace_id_ = parsed->trace_id;
        }
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      const char* level = ClientCaused(status.error_code()) ? "debug" : "warn";
      if (!LogLevelEnabled(level)) {
        methods->Proceed();
        return;
      }
      nlohmann::json fields = {
          {"method", info_->method()},
          {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()))},
          {"duration_ms",
           std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
               .count()},
          {"peer", info_->server_context()->peer()}};
      if (!trace_id_.empty()) fields["trace_id"] = trace_id_;
      if (!status.ok()) fields["message"] = status.error_message();
      LogJson(level, "rpc", std::move(fields));
    }
    methods->Proceed();
  }

 private:
  ServerRpcInfo* const info_;
  const std::chrono::steady_clock::time_point start_;
  std::string trace_id_;
};

class RequestLogInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(ServerRpcInfo* info) override {
    if (absl::StartsWith(info->method(), "/grpc.health.v1.") ||
        absl::StartsWith(info->method(), "/grpc.reflection.")) {
      return nullptr;  // probes every few seconds: no line each
    }
    return new RequestLogInterceptor(info);
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewRequestLogInterceptorFactory() {
  return std::make_unique<RequestLogInterceptorFactory>();
}

}  // namespace dsa
