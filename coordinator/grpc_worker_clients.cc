// The coordinator's gRPC worker clients (see worker_clients.h): one channel per worker, calls
// with deadlines and traceparent metadata, cancellation polled from WorkerCall::cancelled.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/trace_context.h"
#include "contracts/grpc_status.h"
#include "coordinator/worker_clients.h"
#include "dsa/attention/v1/attention.grpc.pb.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/health_check.h"
#include "server/server.h"

namespace dsa {
namespace {

namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;

// How often a call with a cancellation predicate looks at it.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(20);

void Prepare(const WorkerCall& call, grpc::ClientContext& context) {
  if (call.timeout != absl::InfiniteDuration()) {
    context.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(call.timeout));
  }
  if (!call.traceparent.empty()) context.AddMetadata(kTraceparentKey, call.traceparent);
  // Only when asked: an explicit false would override a service config's waitForReady.
  if (call.wait_for_ready) context.set_wait_for_ready(true);
}

// Waits for `done`; while it waits, polls `cancelled` (may be empty: no polling) and calls
// `cancel` once, the first time it answers true.
void AwaitCancellable(absl::Notification& done, const std::function<bool()>& cancelled,
                      const std::function<void()>& cancel) {
  if (!cancelled) {
    done.WaitForNotification();
    return;
  }
  bool cancelling = false;
  while (!done.WaitForNotificationWithTimeout(kCancelPoll)) {
    if (!cancelling && cancelled()) {
      cancel();
      cancelling = true;
    }
  }
}

// Runs `start(context, done)` (an async unary call) and waits for it, cancelling it when
// `call.cancelled` turns true.
template <typename Start>
absl::Status Unary(const WorkerCall& call, Start start) {
  grpc::ClientContext context;
  Prepare(call, context);
  grpc::Status status;
  absl::Notification done;
  start(&context, [&status, &done](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  AwaitCancellable(done, call.cancelled, [&context] { context.TryCancel(); });
  return FromGrpcStatus(status);
}

WorkerReadiness Readiness(grpc::Channel& channel, absl::Duration timeout) {
  const HealthCheckResult health =
      CheckHealth(channel, kReadinessService, absl::ToChronoMilliseconds(timeout),
                  /*wait_for_ready=*/false);
  const grpc::StatusCode code = health.call.error_code();
  if (health.serving == 1 || code == grpc::StatusCode::UNIMPLEMENTED ||
      code == grpc::StatusCode::NOT_FOUND) {
    return {true, ""};
  }
  return {false,
          health.call.ok() ? "its readiness is not SERVING (draining?)"
                           : absl::StrCat("its health check failed: ", health.call.error_message()),
          code == grpc::StatusCode::DEADLINE_EXCEEDED};
}

class GrpcAttentionWorkerClient final : public AttentionWorkerClient {
 public:
  explicit GrpcAttentionWorkerClient(std::shared_ptr<grpc::Channel> channel)
      : channel_(std::move(channel)), stub_(av1::AttentionService::NewStub(channel_)) {}

  WorkerReadiness CheckReadiness(absl::Duration timeout) override {
    return Readiness(*channel_, timeout);
  }
  absl::Status GetInfo(const WorkerCall& call, av1::GetInfoResponse* response) override {
    const av1::GetInfoRequest request;
    return Unary(call, [&](grpc::ClientContext* c, auto done) {
      stub_->async()->GetInfo(c, &request, response, std::move(done));
    });
  }
  absl::Status Prefill(const WorkerCall& call, const av1::PrefillRequest& request,
                       av1::PrefillResponse* response) override {
    return Unary(call, [&](grpc::ClientContext* c, auto done) {
      stub_->async()->Prefill(c, &request, response, std::move(done));
    });
  }
  absl::Status DecodeStep(const WorkerCall& call, const av1::DecodeStepRequest& request,
                          av1::DecodeStepResponse* response) override {
    return Unary(call, [&](grpc::ClientContext* c, auto done) {
      stub_->async()->DecodeStep(c, &request, response, std::move(done));
    });
  }
  std::vector<absl::Status> Commit(absl::Duration timeout, const std::vector<TracedCommit>& commits,
                                   const std::function<bool()>& cancelled) override {
    const size_t n = commits.size();
    std::vector<grpc::Status> statuses(n);
    std::vector<grpc::ClientContext> contexts(n);
    std::vector<av1::CommitResponse> responses(n);
    std::atomic<size_t> pending{n};
    absl::Notification done;
    if (n == 0) done.Notify();
    for (size_t i = 0; i < n; ++i) {
      Prepare({timeout, commits[i].traceparent, {}}, contexts[i]);
      stub_->async()->Commit(&contexts[i], &commits[i].request, &responses[i],
                             [&statuses, &pending, &done, i](grpc::Status status) {
                               statuses[i] = std::move(status);
                               if (--pending == 0) done.Notify();
                             });
    }
    AwaitCancellable(done, cancelled, [&contexts] {
      for (grpc::ClientContext& context : contexts) context.TryCancel();
    });
    std::vector<absl::Status> out;
    out.reserve(n);
    for (const grpc::Status& status : statuses) out.push_back(FromGrpcStatus(status));
    return out;
  }
  absl::Status Release(const WorkerCall& call, const av1::ReleaseRequest& request) override {
    av1::ReleaseResponse response;
    return Unary(call, [&](grpc::ClientContext* c, auto done) {
      stub_->async()->Release(c, &request, &response, std::move(done));
    });
  }
  absl::Status RenewLease(const WorkerCall& call, const dsa::common::v1::Lease& lease,
                          dsa::common::v1::LeaseState* state) override {
    av1::RenewLeaseRequest request;
    *request.mutable_lease() = lease;
    av1::RenewLeaseResponse response;
    absl::Status status = Unary(call, [&](grpc::ClientContext* c, auto done) {
      stub_->async()->RenewLease(c, &request, &response, std::move(done));
    });
    if (status.ok()) *state = response.state();
    return status;
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<av1::AttentionService::Stub> stub_;
};

class GrpcIndexerWorkerClient final : public IndexerWorkerClient {
 public:
  explicit GrpcIndexerWorkerClient(std::shared_ptr<grpc::Channel> channel)
      : channel_(std::move(channel)), stub_(iv1::IndexerService::NewStub(channel_)) {}

  WorkerReadiness CheckReadiness(absl::Duration timeout) override {
    return Readiness(*channel_, timeout);
  }
  absl::Status GetLoad(const WorkerCall& call, iv1::GetLoadResponse* response) override {
    const iv1::GetLoadRequest request;
    return Unary(call, [&](grpc::ClientContext* c, auto done) {
      stub_->async()->GetLoad(c, &request, response, std::move(done));
    });
  }
  absl::Status Release(const WorkerCall& call, const iv1::ReleaseRequest& request) override {
    iv1::ReleaseResponse response;
    return Unary(call, [&](grpc::ClientContext* c, auto done) {
      stub_->async()->Release(c, &request, &response, std::move(done));
    });
  }
  absl::Status RenewLease(const WorkerCall& call, const dsa::common::v1::Lease& lease,
                          dsa::common::v1::LeaseState* state) override {
    iv1::RenewLeaseRequest request;
    *request.mutable_lease() = lease;
    iv1::RenewLeaseResponse response;
    absl::Status status = Unary(call, [&](grpc::ClientContext* c, auto done) {
      stub_->async()->RenewLease(c, &request, &response, std::move(done));
    });
    if (status.ok()) *state = response.state();
    return status;
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<iv1::IndexerService::Stub> stub_;
};

class GrpcFactory final : public WorkerClientFactory {
 public:
  GrpcFactory(ClientSecurity security, int max_backoff_ms)
      : security_(std::move(security)), max_backoff_ms_(max_backoff_ms) {}

  std::shared_ptr<AttentionWorkerClient> Attention(const std::string& address) override {
    return std::make_shared<GrpcAttentionWorkerClient>(Channel(address));
  }
  std::shared_ptr<IndexerWorkerClient> Indexer(const std::string& address) override {
    return std::make_shared<GrpcIndexerWorkerClient>(Channel(address));
  }

 private:
  std::shared_ptr<grpc::Channel> Channel(const std::string& address) const {
    grpc::ChannelArguments args;
    const int initial_backoff_ms =
        std::min(max_backoff_ms_,
                 static_cast<int>(absl::ToInt64Milliseconds(kWorkerInitialReconnectBackoff)));
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, initial_backoff_ms);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, initial_backoff_ms);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, max_backoff_ms_);
    return NewChannel(address, security_, args);
  }

  const ClientSecurity security_;
  const int max_backoff_ms_;
};

}  // namespace

std::shared_ptr<WorkerClientFactory> GrpcWorkerClients(ClientSecurity security,
                                                       int max_reconnect_backoff_ms) {
  return std::make_shared<GrpcFactory>(std::move(security), std::max(max_reconnect_backoff_ms, 1));
}

}  // namespace dsa
