// The coordinator's view of its workers, injected into CoordinatorEngine: one client per attention
// worker (dsa.attention.v1) and per indexer worker (dsa.indexer.v1), made by a factory from the
// worker's address. GrpcWorkerClients dials them; the tests give in-memory workers that fail on
// demand (tests/coordinator/fake_workers.h).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "dsa/attention/v1/attention.pb.h"
#include "dsa/common/v1/lease.pb.h"
#include "dsa/indexer/v1/indexer.pb.h"
#include "server/security.h"

namespace dsa {

/// How one call to a worker is made.
struct WorkerCall {
  /// The call's deadline, from when it starts; absl::InfiniteDuration() sets none.
  absl::Duration timeout = absl::Seconds(30);
  std::string traceparent;  // W3C traceparent sent as gRPC metadata; "" sends none
  /// Polled while the call runs; true cancels it (a Prefill ends with its Generate call). May be
  /// empty (never cancelled).
  std::function<bool()> cancelled;
  /// true: a call whose connection is not open waits, up to `timeout`, for the channel to
  /// (re)connect instead of failing UNAVAILABLE at once (gRPC's wait_for_ready).
  bool wait_for_ready = false;
};

/// The first reconnection backoff of the gRPC worker channels (GrpcWorkerClients, at most its
/// `max_reconnect_backoff_ms`): how soon a channel tries again after a connection failed.
inline constexpr absl::Duration kWorkerInitialReconnectBackoff = absl::Milliseconds(100);

/// What a readiness check of a worker saw.
struct WorkerReadiness {
  bool ready = false;
  std::string reason;      // why not ready ("" when ready)
  bool timed_out = false;  // no answer within the timeout (DEADLINE_EXCEEDED): a lost check
};

/// Calls every worker answers. Thread-safe: the engine calls from many threads at once. A call's
/// status is the worker's (UNAVAILABLE when it cannot be reached, DEADLINE_EXCEEDED past the
/// timeout, CANCELLED when `cancelled` said so or the worker cancelled it).
class WorkerClient {
 public:
  virtual ~WorkerClient() = default;
  /// grpc.health.v1 "readiness": ready when SERVING, or when the worker has no health service
  /// (UNIMPLEMENTED, NOT_FOUND); not ready with the reason otherwise.
  virtual WorkerReadiness CheckReadiness(absl::Duration timeout) = 0;
};

/// One attention worker (dsa.attention.v1.AttentionService).
class AttentionWorkerClient : public WorkerClient {
 public:
  virtual absl::Status GetInfo(const WorkerCall& call,
                               dsa::attention::v1::GetInfoResponse* response) = 0;
  virtual absl::Status Prefill(const WorkerCall& call,
                               const dsa::attention::v1::PrefillRequest& request,
                               dsa::attention::v1::PrefillResponse* response) = 0;
  virtual absl::Status DecodeStep(const WorkerCall& call,
                                  const dsa::attention::v1::DecodeStepRequest& request,
                                  dsa::attention::v1::DecodeStepResponse* response) = 0;
  /// One Commit per entry, all in flight at once (the speculative sequences of one step); the
  /// status of each, in order. Each call's timeout is `timeout`; `cancelled` (may be empty) is
  /// polled while they run, and true cancels every one still running (CANCELLED).
  struct TracedCommit {
    dsa::attention::v1::CommitRequest request;
    std::string traceparent;
  };
  virtual std::vector<absl::Status> Commit(absl::Duration timeout,
                                           const std::vector<TracedCommit>& commits,
                                           const std::function<bool()>& cancelled) = 0;
  virtual absl::Status Release(const WorkerCall& call,
                               const dsa::attention::v1::ReleaseRequest& request) = 0;
  /// Renews this coordinator's `lease` on the sequences it prefilled here; `*state` says what the
  /// worker held under it (renewed false: new here, or it had expired and everything it held was
  /// released). FAILED_PRECONDITION: the instance was superseded by a newer one of the same owner;
  /// INVALID_ARGUMENT, PERMISSION_DENIED as the worker's RenewLease; UNIMPLEMENTED from a worker
  /// that holds no leases.
  virtual absl::Status RenewLease(const WorkerCall& call, const dsa::common::v1::Lease& lease,
                                  dsa::common::v1::LeaseState* state) = 0;
};

/// One indexer worker (dsa.indexer.v1.IndexerService).
class IndexerWorkerClient : public WorkerClient {
 public:
  virtual absl::Status GetLoad(const WorkerCall& call,
                               dsa::indexer::v1::GetLoadResponse* response) = 0;
  virtual absl::Status Release(const WorkerCall& call,
                               const dsa::indexer::v1::ReleaseRequest& request) = 0;
  /// Renews this coordinator's `lease` on the sequences created here under it (by its attention
  /// workers' Prefills); as AttentionWorkerClient::RenewLease.
  virtual absl::Status RenewLease(const WorkerCall& call, const dsa::common::v1::Lease& lease,
                                  dsa::common::v1::LeaseState* state) = 0;
};

/// Makes the client of a worker from its host:port. Thread-safe. The engine keeps one client per
/// worker it knows and asks again for an address it does not.
class WorkerClientFactory {
 public:
  virtual ~WorkerClientFactory() = default;
  virtual std::shared_ptr<AttentionWorkerClient> Attention(const std::string& address) = 0;
  virtual std::shared_ptr<IndexerWorkerClient> Indexer(const std::string& address) = 0;
};

/// The gRPC clients: one channel per worker, dialed with `security` (TLS, mutual TLS), whose
/// reconnection backoff is at most `max_reconnect_backoff_ms` (so a worker that comes back is seen
/// at the next check, not after gRPC's default of 2 minutes).
std::shared_ptr<WorkerClientFactory> GrpcWorkerClients(ClientSecurity security,
                                                       int max_reconnect_backoff_ms);

}  // namespace dsa
