// The attention worker's gRPC adapter: dsa.attention.v1.AttentionService over an AttentionEngine
// (engine.h), the only place where the engine's plain structs and absl::Status become protos and
// grpc::Status (DESIGN.md sections 3 and 5; docs/services.md "Attention worker model").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention_worker/engine.h"
#include "attention_worker/metrics.h"
#include "attention_worker/pattern_model.h"
#include "common/clock.h"
#include "common/mli_schedule.h"
#include "dsa/attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "indexer_service/grpc_service.h"
#include "server/security.h"
#include "server/sequence_leases.h"
#include "transport/indexer_client.h"

namespace dsa {

/// The attention worker's settings with the CPU backend (the pattern model and the MLI schedule are
/// passed separately): the CPU backend's shapes and seed, and the engine's own options.
struct AttentionWorkerOptions {
  /// Dk = Dv of the CPU backend's KV cache and attention queries, >= 1.
  int kv_dim = 32;
  /// Attention query heads (MQA: all share a slot's key and value), >= 1.
  int attention_heads = 8;
  /// Seed of the KV cache and the attention queries (Philox4x32 key), see KvCacheRow.
  uint64_t seed = 0;
  /// Capacity, timeouts, threads (also the CPU backend's fill threads) and observer.
  AttentionEngineOptions engine;
};

/// An engine with the CPU backend (kv_dim, attention_heads, seed) and `indexer_clients`.
/// Errors: AttentionEngine::Create's and CpuAttentionBackend::Create's INVALID_ARGUMENT.
absl::StatusOr<std::unique_ptr<AttentionEngine>> MakeCpuAttentionEngine(
    MliSchedule schedule, PatternModel model, const AttentionWorkerOptions& options,
    IndexerClientFactory indexer_clients, AttentionMetrics* metrics = nullptr);

/// dsa.attention.v1.AttentionService over an engine it owns. Every RPC converts its request to the
/// engine's plain form, calls the engine and answers with the engine's status code and message
/// unchanged (see AttentionEngine for what each does and returns). Thread-safe as the engine is.
/// Sequences belong to the caller whose Prefill created them (CallerIdentity: the client
/// certificate's common name under mutual TLS; "" for every caller on plaintext): another
/// caller's Prefill, DecodeStep, Commit or Release of one is refused with PERMISSION_DENIED
/// "sequence N belongs to another caller" before the engine is called.
class AttentionServiceImpl final : public dsa::attention::v1::AttentionService::Service {
 public:
  ///
  /// Sequences prefilled with a coordinator's lease (PrefillRequest.lease) are released, with
  /// their indexer sequences, when it ends (SequenceLeases on `clock`, which must outlive the
  /// service): ReleaseExpiredLeases, called every kLeaseSweepPeriod by the binary, releases those
  /// of leases not renewed in time, and a Prefill or RenewLease under a new instance of an owner
  /// releases the earlier instances' at once. An owner's leases belong to the caller that first
  /// used them (a coordinator's identity; anyone's on plaintext).
  explicit AttentionServiceImpl(std::unique_ptr<AttentionEngine> engine,
                                const Clock* clock = &RealClock());

  /// The default wiring: the CPU backend and gRPC indexer clients (MakeCpuAttentionEngine with
  /// GrpcIndexerClient::Factory()).
  static absl::StatusOr<std::unique_ptr<AttentionServiceImpl>> Create(
      MliSchedule schedule, PatternModel model, const AttentionWorkerOptions& options,
      AttentionMetrics* metrics = nullptr);

  AttentionEngine& engine() { return *engine_; }

  grpc::Status GetInfo(grpc::ServerContext* context,
                       const dsa::attention::v1::GetInfoRequest* request,
                       dsa::attention::v1::GetInfoResponse* response) override;
  /// AttentionEngine::Prefill; also INVALID_ARGUMENT for an unknown SPIN enum value, and
  /// ALREADY_EXISTS "sequence N is being created by another call" while another Prefill of the
  /// id is in progress (OwnerTable::Claim). The lease is checked first (INVALID_ARGUMENT,
  /// FAILED_PRECONDITION, PERMISSION_DENIED as RenewLease, the message starting "lease: "), so a
  /// refused one prefills nothing; a continue moves the sequence to the request's lease.
  grpc::Status Prefill(grpc::ServerContext* context,
                       const dsa::attention::v1::PrefillRequest* request,
                       dsa::attention::v1::PrefillResponse* response) override;
  grpc::Status DecodeStep(grpc::ServerContext* context,
                          const dsa::attention::v1::DecodeStepRequest* request,
                          dsa::attention::v1::DecodeStepResponse* response) override;
  grpc::Status Commit(grpc::ServerContext* context,
                      const dsa::attention::v1::CommitRequest* request,
                      dsa::attention::v1::CommitResponse* response) override;
  grpc::Status Release(grpc::ServerContext* context,
                       const dsa::attention::v1::ReleaseRequest* request,
                       dsa::attention::v1::ReleaseResponse* response) override;

  /// Renews a coordinator's lease (SequenceLeases::Renew), releasing what it hands back (the
  /// sequences of the owner's earlier instances; of this lease when it had already expired), and
  /// answers with the lease's state. INVALID_ARGUMENT (no owner or instance, a name over 256
  /// bytes, ttl outside [1 ms, 10 min]), FAILED_PRECONDITION (a superseded instance),
  /// PERMISSION_DENIED (the owner is another caller's), RESOURCE_EXHAUSTED (too many owners).
  grpc::Status RenewLease(grpc::ServerContext* context,
                          const dsa::attention::v1::RenewLeaseRequest* request,
                          dsa::attention::v1::RenewLeaseResponse* response) override;

  /// Releases the sequences (and their indexer sequences) of every lease not renewed for its
  /// ttl; the binary calls it every kLeaseSweepPeriod, tests on their clock. Returns how many.
  int64_t ReleaseExpiredLeases();

  /// The leases of this worker's sequences.
  const SequenceLeases& leases() const { return leases_; }

  /// Sequences with a recorded owner (a fuzz harness checks none is left behind).
  size_t owned_sequences() const { return owners_.size(); }

  /// Co-located (--transport inprocess): the indexer service this worker serves at its port,
  /// whose sequences the engine creates in process, past that service's checks. A Prefill's
  /// caller then owns the indexer sequence too (claimed before it is created, forgotten when it
  /// fails or is released, kept with keep_indexer_sequence), so that only that caller (the
  /// coordinator, which releases prefix donors' index keys there) or an operator may use it
  /// through the port; and the indexer sequence is held there under the Prefill's lease
  /// (attached by Prefill, detached by Release unless kept), so that the indexer's sweep
  /// releases a kept prefix donor whose coordinator is gone. Call before the server starts;
  /// `indexer_service` outlives this service.
  void ShareIndexerWith(IndexerServiceImpl* indexer_service) {
    colocated_indexer_owners_ = &indexer_service->owners();
    colocated_indexer_ = indexer_service;
  }

  /// Closes every indexer client's data plane (after the server stopped). Idempotent.
  void CloseTransports() { engine_->CloseIndexerClients(); }

 private:
  // Prefill once the sequence id is the caller's, under `lease` (decoded and checked).
  grpc::Status OwnedPrefill(grpc::ServerContext* context,
                            const dsa::attention::v1::PrefillRequest* request,
                            const SequenceLease& lease,
                            dsa::attention::v1::PrefillResponse* response);
  // Puts sequence `id` under `lease` for `caller`, and its co-located indexer sequence too,
  // releasing what that hands back. Errors as RenewLease.
  absl::Status AttachLease(uint64_t id, const SequenceLease& lease, const std::string& caller);
  // Releases sequences whose lease ended (`reason`: "expired", "superseded"), on the indexer too,
  // with a log line naming how many; NOT_FOUND (released meanwhile) is ignored.
  void ReleaseLeased(const std::vector<uint64_t>& ids, const char* reason);

  std::unique_ptr<AttentionEngine> engine_;
  OwnerTable owners_;      // sequence id -> the caller whose Prefill created it
  SequenceLeases leases_;  // sequence id -> the coordinator lease it is held under
  OwnerTable* colocated_indexer_owners_ = nullptr;   // ShareIndexerWith
  IndexerServiceImpl* colocated_indexer_ = nullptr;  // ShareIndexerWith
};

}  // namespace dsa
