// The coordinator service: dsa.coordinator.v1.CoordinatorService over attention workers
// (dsa.attention.v1) and indexer workers (dsa.indexer.v1), per docs/services.md "Coordinator":
// validation, admission and placement (coordinator/scheduler.h), prefill off the decode loops,
// continuous batching with one decode loop per attention worker, speculative rows with seeded
// acceptance, multi-turn sessions, metrics and drain.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/acceptance_model.h"
#include "coordinator/metrics.h"
#include "coordinator/scheduler.h"
#include "dsa/attention/v1/attention.grpc.pb.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace dsa {

/// Deployment settings of the coordinator (the dsa-coordinator flags).
struct CoordinatorOptions {
  std::vector<std::string> indexer_addresses;    // host:port, >= 1
  std::vector<std::string> attention_addresses;  // host:port, >= 1
  int max_queue = 64;                            // queued requests at most
  int max_running_per_attention = 32;            // running sequences per attention worker
  int top_k = 2048;                              // K of every sequence unless overridden
  double target_block_sparsity = 0.4;            // SPIN rho in [0, 1)
  double exploration_fraction = 0.05;            // SPIN gamma in [0, 1)
  bool all_keep = false;                         // SPIN off
  double acceptance_rate = 0.7;                  // of the seeded acceptance model, [0, 1]
  uint64_t seed = 0;            // acceptance draws (mixed with the request id) and SPIN
  bool retain_finished = true;  // keep finished sequences as prefix donors
  /// Indexer worker i is co-located in attention worker i (dsa-attention --transport inprocess,
  /// usually the same address): sequences on indexer i run on attention worker i.
  bool colocated = false;
  int64_t startup_timeout_ms = 10000;  // how long Create retries unreachable workers
  int64_t rpc_timeout_ms = 30000;      // deadline of DecodeStep, Commit, Release and GetLoad calls
  /// Events a request's stream may have waiting for its reader (backpressure; >= 2).
  int max_pending_events = 16;
  /// A request whose reader has left its event queue full this long is ended (CANCELLED, the
  /// message says why) and its sequence released, so a client that stops reading cannot hold a
  /// running slot, KV and index-key blocks forever. 0 = never.
  int64_t stall_timeout_ms = 60000;
};

/// INVALID_ARGUMENT with a precise message when `request` breaks the contract of
/// coordinator.proto: request_id 1..128 bytes; a context (context_length >= 1, or context_tokens
/// with >= 1 token); at most ceil(context / 512) prefix ids; max_new_tokens >= 1; draft_length
/// 0..4; overrides in range (rho, gamma in [0, 1), top_k >= 1, acceptance_rate in [0, 1]);
/// session_id at most 128 bytes; context + max_new_tokens + draft below 2^31 slots.
absl::Status ValidateGenerateRequest(const dsa::coordinator::v1::GenerateRequest& request);

/// dsa.coordinator.v1.CoordinatorService. Thread-safe; every RPC runs on a gRPC thread.
///
/// Generate: after validation and admission, the handler thread itself runs the request's
/// evictions and its Prefill (so prefills never stall a decode loop), writes Admitted, then hands
/// the sequence to its attention worker's decode loop and writes the events that loop produces.
/// Each decode loop sends one DecodeStep with every running sequence of its worker (rows =
/// min(d + 1, tokens left)), draws the accepted count a of a speculative step from
/// AcceptanceModel (seed mixed with the request id, step = the request's verification count),
/// calls Commit(a), and queues a Tokens event (count = a + 1); at max_new_tokens it queues
/// Finished and releases the sequence (donor: Release with keep_indexer_sequence; session: kept).
///
/// Backpressure: events go through a per-request queue of at most max_pending_events; the handler
/// writes them with the synchronous stream Write, so a slow reader fills only its own queue, and
/// the decode loop leaves a sequence whose queue is full out of its DecodeStep until the reader
/// catches up. A slow reader slows only itself; memory per request stays bounded.
///
/// Failures: a DecodeStep error is retried once per sequence alone, so the sequences the attention
/// worker left intact (it rolls back every sequence the indexer did not apply) go on and only the
/// failing ones end with the worker's status. A sequence the indexer may already have advanced for
/// some layers before another sequence's failure is marked broken by the attention worker and ends
/// too (FAILED_PRECONDITION naming the cause): a failure after the first full layer can thus end
/// the batch's other sequences (docs/services.md, known limits). DEADLINE_EXCEEDED (rpc_timeout_ms:
/// a hung worker) ends the whole batch without retries. Abort and a client cancelling its stream
/// end the request with CANCELLED at the decode loop's next iteration (queued ones at once). A
/// stream's status is sent only after its sequence was released on the workers (or retained), so a
/// client that saw the end finds that reflected in GetLoad and in the placement of its next
/// request.
class CoordinatorServiceImpl final : public dsa::coordinator::v1::CoordinatorService::Service {
 public:
  /// Connects to every worker: GetInfo of each attention worker (their num_full_layers must agree)
  /// and GetLoad of each indexer worker (capacity; H and D must equal the attention workers'),
  /// retrying unreachable workers until startup_timeout_ms. Starts one decode loop per attention
  /// worker. `metrics` is caller-owned and outlives the service. Errors: INVALID_ARGUMENT (no
  /// workers, bad options), UNAVAILABLE / DEADLINE_EXCEEDED (a worker unreachable until the
  /// deadline; the message names it), FAILED_PRECONDITION (workers disagree on full layers or on
  /// the indexer shape).
  static absl::StatusOr<std::unique_ptr<CoordinatorServiceImpl>> Create(
      const CoordinatorOptions& options, CoordinatorMetrics* metrics);

  /// Stops the decode loops (Stop).
  ~CoordinatorServiceImpl() override;

  /// Validates, admits (or queues), places, prefills and streams Admitted, Tokens per decode step
  /// and Finished. The stream's status: OK after Finished; INVALID_ARGUMENT
  /// (ValidateGenerateRequest, a session context shorter than its sequence); ALREADY_EXISTS (the
  /// request id is in flight); RESOURCE_EXHAUSTED (queue full, or larger than any worker's whole
  /// capacity, with the numbers); FAILED_PRECONDITION (the session has a turn queued or running);
  /// UNAVAILABLE (draining, or a worker's UNAVAILABLE); CANCELLED (Abort, client cancel); any
  /// other status a worker returned for this request.
  grpc::Status Generate(grpc::ServerContext* context,
                        const dsa::coordinator::v1::GenerateRequest* request,
                        grpc::ServerWriter<dsa::coordinator::v1::GenerateEvent>* writer) override;

  /// Ends a request in flight (queued: at once; running: at its decode loop's next iteration) with
  /// CANCELLED. NOT_FOUND if no request with that id is in flight.
  grpc::Status Abort(grpc::ServerContext* context,
                     const dsa::coordinator::v1::AbortRequest* request,
                     dsa::coordinator::v1::AbortResponse* response) override;

  /// Queued and running requests, retained sequences, and the index-key cache per indexer worker
  /// from its GetLoad (a worker that does not answer reports the coordinator's reservations).
  /// Always OK.
  grpc::Status GetLoad(grpc::ServerContext* context,
                       const dsa::coordinator::v1::GetLoadRequest* request,
                       dsa::coordinator::v1::GetLoadResponse* response) override;

  /// Begins a drain (dsa::ServerSpec::on_drain): new Generate calls get UNAVAILABLE, queued
  /// requests end with UNAVAILABLE, running ones go on.
  void StartDrain();

  /// Stops the decode loops and joins them (dsa::ServerSpec::on_stopped). Idempotent. Requests
  /// still decoding stay unfinished: call after the gRPC server has stopped.
  void Stop();

  /// Number of attention workers' full layers (GetInfo), the indexer sequences' num_layers.
  int num_full_layers() const { return num_full_layers_; }

 private:
  using Clock = std::chrono::steady_clock;
  enum class Phase { kQueued, kPrefilling, kDecoding, kEnded };

  // One Generate call in flight.
  struct Request {
    std::string id;
    uint64_t ticket = 0;
    dsa::coordinator::v1::GenerateRequest proto;
    SequenceDemand demand;
    Clock::time_point arrival;
    // Guarded by the service's mu_.
    Phase phase = Phase::kQueued;
    std::optional<Admission> admission;
    bool cancel_requested = false;
    std::string cancel_reason = "aborted";  // the CANCELLED status's message
    // The Generate call's context while its handler runs (TryCancel unblocks a Write that a
    // stalled reader holds); null once the handler returns.
    grpc::ServerContext* server_context = nullptr;
    std::optional<Clock::time_point> stalled_since;  // event queue full since
    std::deque<dsa::coordinator::v1::GenerateEvent> events;
    std::optional<grpc::Status> final_status;
    absl::CondVar changed;  // admission, an event, the final status
    // Owned by the decode loop once the request is decoding.
    int64_t generated = 0;
    uint64_t verification_steps = 0;
    std::optional<AcceptanceModel> acceptance;
    int first_count = 0;
    Clock::time_point first_token_time;
    Clock::time_point last_step_time;
  };

  // One attention worker: its stub and decode loop.
  struct AttentionWorker {
    std::string address;
    std::unique_ptr<dsa::attention::v1::AttentionService::Stub> stub;
    std::vector<std::shared_ptr<Request>> decoding;  // guarded by mu_
    absl::CondVar wake;                              // new work, room in an event queue, stop
    std::thread loop;
  };
  struct IndexerWorker {
    std::string address;
    std::unique_ptr<dsa::indexer::v1::IndexerService::Stub> stub;
  };

  CoordinatorServiceImpl(const CoordinatorOptions& options, CoordinatorMetrics* metrics,
                         int num_full_layers, Scheduler scheduler);

  // The decode loop of attention worker `worker`.
  void DecodeLoop(int worker);
  // One DecodeStep over `batch` (rows per request); the results per request, or the step's status.
  struct StepOutcome {
    grpc::Status status;
    dsa::attention::v1::DecodeStepResponse response;
    double seconds = 0;
  };
  StepOutcome RunStep(int worker, const std::vector<std::shared_ptr<Request>>& batch,
                      const std::vector<int>& rows);
  // Applies a successful step to its batch: draws the accepted counts of speculative sequences
  // and commits them concurrently, then advances each sequence (a failed Commit ends its request).
  void ApplyStep(int worker, const std::vector<std::shared_ptr<Request>>& batch,
                 const std::vector<int>& rows, const StepOutcome& outcome);
  // One sequence's step result with `accepted` drafts committed: Tokens event, metrics, and
  // Finished (and EndSequence) at max_new_tokens.
  void AdvanceSequence(const std::shared_ptr<Request>& request, int rows, int accepted,
                       const dsa::attention::v1::SequenceStepResult& result,
                       const dsa::attention::v1::DecodeStepResponse& response, double seconds);
  // Ends an admitted request: scheduler Finish, attention Release, evictions, queued admissions.
  // `status` becomes the stream's status unless one is already set.
  void EndSequence(const std::shared_ptr<Request>& request, const grpc::Status& status,
                   bool completed);
  // Sets the stream's status and counts the outcome (first call wins).
  void SetFinalLocked(Request& request, const grpc::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks a request cancelled; a queued one ends at once.
  void AbortLocked(Request& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands admissions to their waiting handlers.
  void DeliverAdmissionsLocked(std::vector<Admission> admissions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops evicted sequences on their workers (best effort; failures are logged).
  void CarryOutEvictions(const std::vector<Eviction>& evictions);
  // Prefill of an admitted request on its attention worker.
  grpc::Status Prefill(grpc::ServerContext* context, const Request& request,
                       const Admission& admission, dsa::attention::v1::PrefillResponse* response);
  std::chrono::system_clock::time_point RpcDeadline() const;

  const CoordinatorOptions options_;
  CoordinatorMetrics* const metrics_;  // not owned
  const int num_full_layers_;
  std::vector<std::unique_ptr<AttentionWorker>> attention_;
  std::vector<IndexerWorker> indexers_;

  absl::Mutex mu_;
  Scheduler scheduler_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Request>> by_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<Request>> by_ticket_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stopped_{false};
};

}  // namespace dsa
