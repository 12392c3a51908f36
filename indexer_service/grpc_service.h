// The gRPC adapter of the indexer worker: dsa.indexer.v1.IndexerService served over a dsa::Indexer
// (DESIGN.md sections 3 and 5). The only place where the engine's absl::Status becomes
// grpc::Status.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/clock.h"
#include "contracts/grpc_status.h"
#include "contracts/limits.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "indexer_service/data_plane.h"
#include "indexer_service/indexer.h"
#include "indexer_service/metrics.h"
#include "proto/indexer_codec.h"
#include "server/security.h"
#include "server/sequence_leases.h"

namespace dsa {

// kMaxReceiveMessageBytes (contracts/limits.h) is the receive limit a server of this service sets,
// so that chunks up to kMaxAppendChunkBytes reach the handler and are refused deterministically as
// above. A message over it is failed by gRPC itself before the handler sees it; the handler then
// undoes the call's chunks only if gRPC has already marked the call cancelled when the stream ends.

/// Decodes, validates and runs one SelectRequest against `indexer` (shared by Select and
/// SelectStream; exposed for tests and in-process callers).
///
/// Per group: queries fp32, bf16 or fp8 e4m3fn [rows, H, D] (rows >= 1), head_weights fp32
/// [rows, H], finite; row r is at position first_position + r. Optional new_index_keys fp32, bf16
/// or fp8 e4m3fn [n, D], finite: the step's new keys, appended to the layer before its rows select
/// (one message per layer carries a decode step); with n > 0 the rows must end at the layer's
/// newest slot (slot count + n - 1), and no other group of the request may address that layer.
/// Every group is checked (tensors, sequence, layer, positions below the layer's slot count plus
/// its new keys) before anything runs, so such a bad group changes nothing. Then every group's new
/// keys are appended, all or none (a full pool: RESOURCE_EXHAUSTED, nothing appended), and the
/// groups select as one Indexer::SelectBatch (one scoring pass when their sequences differ). An
/// engine error then (a position not after the layer's last selected one, a pending speculative
/// step) changes nothing when the sequences differ; when a sequence has several groups, the groups
/// before the failing one stay applied. The new keys of every group not applied are removed; the
/// message names the group. Before anything runs, the answer's size is bounded
/// (SelectResponseBytesBound over the groups of known sequences): over kMaxReceiveMessageBytes, the
/// request is refused with RESOURCE_EXHAUSTED naming the limit. Errors: INVALID_ARGUMENT (no
/// groups, dtype, shape, non-finite values, layer, positions, rows not ending at the newest slot, a
/// layer with new keys in two groups), NOT_FOUND (sequence), OUT_OF_RANGE (a row's key not
/// appended), FAILED_PRECONDITION (a step awaits Commit), RESOURCE_EXHAUSTED (new keys do not fit).
/// `response` gets request_id echoed and one GroupSelection per group, in order: selections int32
/// [rows, K], best first, -1 padding; audit_miss_rates per row when the indexer audited the group.
/// `metrics` (optional) records every group that ran.
/// `groups_applied` (optional) gets the number of leading groups applied when it fails (0 unless a
/// sequence has several groups).
absl::Status RunSelect(Indexer& indexer, const dsa::indexer::v1::SelectRequest& request,
                       dsa::indexer::v1::SelectResponse* response,
                       IndexerMetrics* metrics = nullptr, int* groups_applied = nullptr);

/// dsa.indexer.v1.IndexerService over a dsa::Indexer (and optional IndexerMetrics) that the caller
/// owns and keeps alive for the server's lifetime. Thread-safe (the engine serializes its state;
/// calls run on gRPC's threads). Every RPC answers with the engine's status code and message
/// unchanged. With metrics, selects are recorded and the cache gauges follow every change.
class IndexerServiceImpl final : public dsa::indexer::v1::IndexerService::Service {
 public:
  /// Serves AppendIndexKeys and SelectStream over grpc::ByteBuffer (server/parse_errors.h), so
  /// that an unparseable message inside either stream fails the call with INVALID_ARGUMENT instead
  /// of looking like the stream's end.
  ///
  /// Sequences belong to the caller that created them (CallerIdentity: the client certificate's
  /// common name under mutual TLS; "" for every caller on plaintext): another caller's append,
  /// select, Commit, BeginTurn or Release of one is refused with PERMISSION_DENIED "sequence N
  /// belongs to another caller", unless it is one of `operator_identities` (the coordinator,
  /// which releases the sequences of a dead attention worker). A prefix source is read, never
  /// changed, and must be the caller's too (cloning it would read its index keys): attention
  /// workers that share prefixes on one indexer share one identity.
  ///
  /// Sequences created with a coordinator's lease (CreateSequenceRequest.lease) are released when
  /// it ends (SequenceLeases on `clock`, which must outlive the service): ReleaseExpiredLeases,
  /// called every kLeaseSweepPeriod by the binary, releases those of leases not renewed in time,
  /// and a create or RenewLease under a new instance of an owner releases the earlier instances'
  /// at once. Any caller may use any owner's lease here: the callers are the attention workers,
  /// each creating under its coordinator's lease, and the coordinator renewing it.
  explicit IndexerServiceImpl(Indexer* indexer, IndexerMetrics* metrics = nullptr,
                              std::vector<std::string> operator_identities = {},
                              const Clock* clock = &RealClock());

  /// Registers a sequence (Indexer::CreateSequence, or CreateSequenceFromPrefix when
  /// prefix_source_id is set). SPIN settings: unset mode = SPIN on at rho 0.4; all_keep = SPIN
  /// off; unset optional fields and UNSPECIFIED enums take the paper's defaults. Errors:
  /// ALREADY_EXISTS (also while another CreateSequence of the id is in progress: a duplicate
  /// is refused rather than raced, OwnerTable::Claim); INVALID_ARGUMENT (num_layers, top_k, SPIN
  /// values, an unknown enum value, prefix_slots without prefix_source_id, prefix length, the
  /// lease as RenewLease); FAILED_PRECONDITION (a superseded lease instance);
  /// NOT_FOUND (prefix source); PERMISSION_DENIED (the sequence id or the prefix source is another
  /// caller's); FAILED_PRECONDITION (the prefix source has a step awaiting Commit);
  /// RESOURCE_EXHAUSTED.
  grpc::Status CreateSequence(grpc::ServerContext* context,
                              const dsa::indexer::v1::CreateSequenceRequest* request,
                              dsa::indexer::v1::CreateSequenceResponse* response) override;

  /// Client stream of chunks, each keys fp32, bf16 or fp8 e4m3fn [num_keys, D] for one (sequence,
  /// layer) with first_slot equal to that layer's slot count. Chunks are validated and appended as
  /// they arrive; on any error (or cancellation) every chunk this call appended is removed again
  /// (Indexer::TruncateIndexKeys), so a failed call changes nothing. One append call per layer at a
  /// time (a concurrent append to the same layer would see its first_slot refused).
  /// Response: keys_appended over all chunks. Errors: NOT_FOUND; INVALID_ARGUMENT (a message that
  /// does not parse, dtype, shape, non-finite key, layer); FAILED_PRECONDITION (first_slot differs
  /// from the layer's slot count, the layer's verifier rows await Commit); RESOURCE_EXHAUSTED (pool
  /// full, layer over 2^31 slots, a chunk over kMaxAppendChunkBytes); CANCELLED (the client went
  /// away). Served raw (the constructor's comment); the stream's messages as bytes.
  grpc::Status AppendIndexKeysRaw(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<dsa::indexer::v1::AppendIndexKeysResponse, grpc::ByteBuffer>*
          stream);

  /// AppendIndexKeysRaw's work over any source of messages (the raw handler's stream, a fuzz
  /// harness): `read` gives the next message's bytes (false at the end), `cancelled` says whether
  /// the client went away, `write` sends the response (false if it could not). Same answers.
  grpc::Status AppendIndexKeysFrom(
      const std::string& caller, const std::function<bool(grpc::ByteBuffer*)>& read,
      const std::function<bool()>& cancelled,
      const std::function<bool(const dsa::indexer::v1::AppendIndexKeysResponse&)>& write);

  /// Selections for row groups of many sequences in one call; see RunSelect for shapes, dtypes,
  /// atomicity and errors.
  grpc::Status Select(grpc::ServerContext* context, const dsa::indexer::v1::SelectRequest* request,
                      dsa::indexer::v1::SelectResponse* response) override;

  /// Bidirectional stream of SelectRequests (per-layer traffic): one SelectResponse per request,
  /// in order, each as Select would answer. A refused request is answered with its status in
  /// SelectResponse.error (same code and message as Select's) and the stream goes on, since one
  /// stream carries many sequences; OK when the client half-closes, CANCELLED if it goes away,
  /// INVALID_ARGUMENT naming the message when one does not parse (the requests before it stand).
  /// Served raw (the constructor's comment).
  grpc::Status SelectStreamRaw(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<dsa::indexer::v1::SelectResponse, grpc::ByteBuffer>* stream);
  /// SelectStreamRaw's work over any source of messages (as AppendIndexKeysFrom).
  grpc::Status SelectStreamFrom(
      const std::string& caller, const std::function<bool(grpc::ByteBuffer*)>& read,
      const std::function<bool(const dsa::indexer::v1::SelectResponse&)>& write);

  /// Indexer::Commit: NOT_FOUND, FAILED_PRECONDITION (nothing pending), OUT_OF_RANGE (accepted).
  grpc::Status Commit(grpc::ServerContext* context, const dsa::indexer::v1::CommitRequest* request,
                      dsa::indexer::v1::CommitResponse* response) override;

  /// Indexer::BeginTurn: NOT_FOUND, FAILED_PRECONDITION (a step awaits Commit).
  grpc::Status BeginTurn(grpc::ServerContext* context,
                         const dsa::indexer::v1::BeginTurnRequest* request,
                         dsa::indexer::v1::BeginTurnResponse* response) override;

  /// Indexer::Release: NOT_FOUND.
  grpc::Status Release(grpc::ServerContext* context,
                       const dsa::indexer::v1::ReleaseRequest* request,
                       dsa::indexer::v1::ReleaseResponse* response) override;

  /// The pool's usage in 64-slot blocks, the sequence count and the worker's H and D. Always OK.
  grpc::Status GetLoad(grpc::ServerContext* context,
                       const dsa::indexer::v1::GetLoadRequest* request,
                       dsa::indexer::v1::GetLoadResponse* response) override;

  /// Renews a coordinator's lease (SequenceLeases::Renew), releasing what it hands back (the
  /// sequences of the owner's earlier instances; of this lease when it had already expired).
  /// Responds with the lease's state. INVALID_ARGUMENT (no owner or instance, a name over 256
  /// bytes, ttl outside [1 ms, 10 min]), FAILED_PRECONDITION (a superseded instance),
  /// RESOURCE_EXHAUSTED (too many owners with live leases).
  grpc::Status RenewLease(grpc::ServerContext* context,
                          const dsa::indexer::v1::RenewLeaseRequest* request,
                          dsa::indexer::v1::RenewLeaseResponse* response) override;

  /// Releases the sequences of every lease not renewed for its ttl (the binary calls it every
  /// kLeaseSweepPeriod; tests on their clock). Returns how many it released.
  int64_t ReleaseExpiredLeases();

  /// The leases of this worker's sequences.
  const SequenceLeases& leases() const { return leases_; }
  /// Puts sequence `id`, created in process past this service (a co-located attention worker),
  /// under `lease` as CreateSequence would, releasing what that hands back; DetachLease takes it
  /// out (released in process). Errors as RenewLease.
  absl::Status AttachLease(uint64_t id, const SequenceLease& lease);
  void DetachLease(uint64_t id) { leases_.Detach(id); }

  /// Sequences with a recorded owner (a fuzz harness checks none is left behind).
  size_t owned_sequences() const { return owners_.size(); }
  /// Who owns each sequence: a co-located attention worker records there the owner of the
  /// sequences it creates in process (AttentionServiceImpl::ShareOwnersWith).
  OwnerTable& owners() { return owners_; }

  /// Sets what OpenDataPlane delegates to; call before the server starts. Without one,
  /// OpenDataPlane answers UNIMPLEMENTED ("built without NCCL").
  void SetDataPlaneOpener(DataPlaneOpener opener) { data_plane_opener_ = std::move(opener); }

  /// Bootstraps a data plane through the injected DataPlaneOpener (its status unchanged), with
  /// the caller's identity and its owner check (DataPlaneCaller); UNIMPLEMENTED when there is
  /// none.
  grpc::Status OpenDataPlane(grpc::ServerContext* context,
                             const dsa::indexer::v1::OpenDataPlaneRequest* request,
                             dsa::indexer::v1::OpenDataPlaneResponse* response) override;

 private:
  // CreateSequence once the id is the caller's.
  grpc::Status CreateOwnedSequence(const dsa::indexer::v1::CreateSequenceRequest* request,
                                   dsa::indexer::v1::CreateSequenceResponse* response);
  // OK when every group's sequence may be used by `caller` (owners_).
  absl::Status CheckOwned(const dsa::indexer::v1::SelectRequest& request,
                          const std::string& caller) const;
  // Sets the cache gauges from the engine's usage (no-op without metrics).
  void UpdateCacheMetrics();
  // Releases sequences whose lease ended (`reason`: "expired", "superseded"), with a log line
  // naming how many; the engine's NOT_FOUND (released meanwhile) is ignored.
  void ReleaseLeased(const std::vector<uint64_t>& ids, const char* reason);

  Indexer* indexer_;                   // not owned
  IndexerMetrics* metrics_;            // not owned; may be null
  OwnerTable owners_;                  // sequence id -> the caller that created it
  SequenceLeases leases_;              // sequence id -> the coordinator lease it is held under
  DataPlaneOpener data_plane_opener_;  // may be empty
};

}  // namespace dsa
