// The coordinator service: dsa.coordinator.v1.CoordinatorService, a thin gRPC adapter over
// CoordinatorEngine (coordinator/engine.h) with gRPC worker clients (GrpcWorkerClients) and the
// real clock, per docs/services.md "Coordinator".
#pragma once

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "common/host_port.h"
#include "coordinator/engine.h"
#include "coordinator/generate.h"
#include "coordinator/metrics.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/security.h"

namespace dsa {

/// A GenerateRequest in the engine's plain form (generate.h), field for field: the context's oneof
/// becomes whichever of context_length / context_tokens it holds (neither when unset), and the
/// optional overrides and sampling seed keep their presence. Checks nothing
/// (ValidateGenerateRequest does).
GenerateSpec ToGenerateSpec(const dsa::coordinator::v1::GenerateRequest& request);

/// An event of the engine's stream as the GenerateEvent message (Finished.stop_token_id set only
/// when the event has one).
dsa::coordinator::v1::GenerateEvent ToGenerateEventProto(const GenerateEvent& event);

/// The engine's load as the GetLoadResponse message (its model set only when known).
dsa::coordinator::v1::GetLoadResponse ToGetLoadResponse(const CoordinatorLoad& load);

/// dsa.coordinator.v1.CoordinatorService. Thread-safe; every RPC runs on a gRPC thread. Each RPC
/// is the engine's (CoordinatorEngine, whose class comment says what it does), with the caller
/// the call's TenantIdentity (its token or certificate name, else its peer host, so that callers
/// on plaintext are told apart too) and the router's traceparent from the call's metadata; the
/// messages become the engine's plain structs and back here (ToGenerateSpec, ToGenerateEventProto,
/// ToGetLoadResponse), and nowhere else.
class CoordinatorServiceImpl final : public dsa::coordinator::v1::CoordinatorService::Service {
 public:
  /// CoordinatorEngine::Create over gRPC clients dialed with options.worker_security, whose
  /// reconnection backoff is bounded by the worker check interval (so a worker that comes back
  /// is seen at the next check). `tokens`: the server's bearer tokens (ServerSpec::auth), which
  /// name the callers of calls that carry one; null when it has none. Errors: as
  /// CoordinatorEngine::Create.
  static absl::StatusOr<std::unique_ptr<CoordinatorServiceImpl>> Create(
      const CoordinatorOptions& options, CoordinatorMetrics* metrics,
      AddressResolver resolve = ResolveDnsAddresses,
      std::shared_ptr<const BearerTokenAuthenticator> tokens = nullptr);

  /// CoordinatorEngine::Generate over the call's writer: the stream's status is the engine's.
  grpc::Status Generate(grpc::ServerContext* context,
                        const dsa::coordinator::v1::GenerateRequest* request,
                        grpc::ServerWriter<dsa::coordinator::v1::GenerateEvent>* writer) override;
  /// CoordinatorEngine::Abort: NOT_FOUND, PERMISSION_DENIED (another caller's request).
  grpc::Status Abort(grpc::ServerContext* context,
                     const dsa::coordinator::v1::AbortRequest* request,
                     dsa::coordinator::v1::AbortResponse* response) override;
  /// CoordinatorEngine::GetLoad. Always OK.
  grpc::Status GetLoad(grpc::ServerContext* context,
                       const dsa::coordinator::v1::GetLoadRequest* request,
                       dsa::coordinator::v1::GetLoadResponse* response) override;

  /// The engine's (see CoordinatorEngine).
  void RefreshWorkers() { engine_->RefreshWorkers(); }
  void SetReadinessListener(std::function<void(bool ready)> listener) {
    engine_->SetReadinessListener(std::move(listener));
  }
  int num_full_layers() const { return engine_->num_full_layers(); }
  /// dsa::ServerSpec::on_drain.
  void StartDrain() { engine_->StartDrain(); }
  /// dsa::ServerSpec::on_stopped: call after the gRPC server has stopped.
  void Stop() { engine_->Stop(); }
  CoordinatorEngine& engine() { return *engine_; }

 private:
  CoordinatorServiceImpl(std::unique_ptr<CoordinatorEngine> engine,
                         std::shared_ptr<const BearerTokenAuthenticator> tokens)
      : engine_(std::move(engine)), tokens_(std::move(tokens)) {}

  std::unique_ptr<CoordinatorEngine> engine_;
  const std::shared_ptr<const BearerTokenAuthenticator> tokens_;
};

}  // namespace dsa
