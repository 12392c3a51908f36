// The coordinator service: the gRPC adapter of CoordinatorEngine (see service.h).
#include "coordinator/service.h"

#include <algorithm>
#include <string>
#include <utility>

#include "common/trace_context.h"
#include "coordinator/worker_clients.h"
#include "server/security.h"

namespace dsa {
namespace {

namespace cv1 = ::dsa::coordinator::v1;

grpc::Status ToGrpc(const absl::Status& status) {
  return {static_cast<grpc::StatusCode>(status.code()), std::string(status.message())};
}

// A Generate call's writer and context as the engine's stream.
class GrpcGenerateStream final : public GenerateStream {
 public:
  GrpcGenerateStream(grpc::ServerContext& context, grpc::ServerWriter<cv1::GenerateEvent>& writer)
      : context_(context), writer_(writer) {}
  bool Write(const cv1::GenerateEvent& event) override { return writer_.Write(event); }
  bool IsCancelled() override { return context_.IsCancelled(); }
  void TryCancel() override { context_.TryCancel(); }

 private:
  grpc::ServerContext& context_;
  grpc::ServerWriter<cv1::GenerateEvent>& writer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServiceImpl>> CoordinatorServiceImpl::Create(
    const CoordinatorOptions& options, CoordinatorMetrics* metrics, AddressResolver resolve) {
  const int max_backoff_ms = static_cast<int>(
      std::clamp<int64_t>(options.worker_check_interval_ms,
                          std::max<int64_t>(options.worker_check_timeout_ms, 1), int64_t{60000}));
  auto engine = CoordinatorEngine::Create(
      options, metrics, GrpcWorkerClients(options.worker_security, max_backoff_ms), &RealClock(),
      std::move(resolve));
  if (!engine.ok()) return engine.status();
  return std::unique_ptr<CoordinatorServiceImpl>(new CoordinatorServiceImpl(*std::move(engine)));
}

grpc::Status CoordinatorServiceImpl::Generate(grpc::ServerContext* context,
                                              const cv1::GenerateRequest* request,
                                              grpc::ServerWriter<cv1::GenerateEvent>* writer) {
  std::string traceparent;
  if (auto it = context->client_metadata().find(kTraceparentKey);
      it != context->client_metadata().end()) {
    traceparent.assign(it->second.data(), it->second.size());
  }
  GrpcGenerateStream stream(*context, *writer);
  return ToGrpc(engine_->Generate(*request, CallerIdentity(*context), traceparent, stream));
}

grpc::Status CoordinatorServiceImpl::Abort(grpc::ServerContext* context,
                                           const cv1::AbortRequest* request,
                                           cv1::AbortResponse* /*response*/) {
  return ToGrpc(engine_->Abort(request->request_id(), CallerIdentity(*context)));
}

grpc::Status CoordinatorServiceImpl::GetLoad(grpc::ServerContext* /*context*/,
                                             const cv1::GetLoadRequest* /*request*/,
                                             cv1::GetLoadResponse* response) {
  *response = engine_->GetLoad();
  return grpc::Status::OK;
}

}  // namespace dsa
