// The coordinator's engine: validation, admission and placement (coordinator/scheduler.h), prefill
// off the decode loops, continuous batching with one decode loop per attention worker, speculative
// rows (seeded acceptance for the pattern model; n-gram drafts verified by a real model), real
// token ids with end-of-sequence and stop tokens, multi-turn sessions, worker watch, request
// migration, metrics and drain, over injected worker clients and an injected clock
// (docs/coordinator.md). coordinator/service.h is its gRPC adapter.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/host_port.h"
#include "common/trace_context.h"
#include "coordinator/acceptance_model.h"
#include "coordinator/engine_core.h"
#include "coordinator/metrics.h"
#include "coordinator/options.h"
#include "coordinator/request.h"
#include "coordinator/scheduler.h"
#include "coordinator/served_model.h"
#include "coordinator/worker_clients.h"
#include "dsa/attention/v1/attention.pb.h"
#include "dsa/coordinator/v1/coordinator.pb.h"
#include "dsa/indexer/v1/indexer.pb.h"

namespace dsa {

class DecodeLoops;
class WorkerPool;

/// Most stop_token_ids a request may carry.
inline constexpr int kMaxStopTokenIds = 256;

/// INVALID_ARGUMENT with a precise message when `request` breaks the contract of
/// coordinator.proto whatever the model: request_id 1..128 bytes; a context (context_length >= 1,
/// or context_tokens with >= 1 token, each id >= 0); prefix ids only with context_length, at most
/// ceil(context / 512); max_new_tokens >= 1; draft_length 0..kMaxDraftLength; overrides in range
/// (rho, gamma in [0, 1), top_k in [1, kMaxTopK], acceptance_rate in [0, 1]); sampling in range
/// (temperature 0 or in (0, 100], top_p in [0, 1], not NaN); at most kMaxStopTokenIds stop ids,
/// each >= 0; session_id at most 128 bytes; context + max_new_tokens + draft below 2^31 slots.
/// Messages name the field, and for a list the index and the value.
absl::Status ValidateGenerateRequest(const dsa::coordinator::v1::GenerateRequest& request);

/// The checks that need the model (after ValidateGenerateRequest): a real model needs
/// context_tokens (INVALID_ARGUMENT naming the model), every context and stop token id below its
/// vocab_size (INVALID_ARGUMENT naming the index and the value), and context + max_new_tokens at
/// most its max_context (RESOURCE_EXHAUSTED with the numbers; a model limit, DESIGN.md 5's "too
/// long a context"). The pattern model ignores sampling, stop_token_ids and ignore_eos.
absl::Status ValidateGenerateRequestForModel(const dsa::coordinator::v1::GenerateRequest& request,
                                             const ServedModel& model);

/// The coordinator's engine: dsa.coordinator.v1.CoordinatorService without gRPC, over injected
/// worker clients (worker_clients.h) and an injected clock. Thread-safe; each Generate runs on
/// its caller's thread.
///
/// Workers: RefreshWorkers (at Create, then every worker_check_interval_ms on the watch thread)
/// takes in every fixed or resolved address that answers its first check (GetInfo of an attention
/// worker, GetLoad of an indexer worker; they must agree on the full layers and H, D) and marks
/// every known worker ready or not: ready while it is still listed and its grpc.health.v1
/// "readiness" is SERVING (a server without the health service: while its GetInfo / GetLoad
/// answers). New sequences go only to ready workers; what a worker that is not ready holds stays
/// there (its requests move only when a call to it fails). The coordinator is ready
/// (SetReadinessListener) while at least one worker of each kind is; Generate answers UNAVAILABLE
/// while it is not.
///
/// Generate: after validation and admission, the handler thread itself runs the request's
/// evictions and its Prefill (so prefills never stall a decode loop), writes Admitted, then hands
/// the sequence to its attention worker's decode loop and writes the events that loop produces.
/// Each decode loop sends one DecodeStep with every running sequence of its worker.
/// The pattern model (ServedModel::real false): rows = min(d + 1, tokens left); the accepted count
/// a of a speculative step is drawn from AcceptanceModel (seed mixed with the request id, step =
/// the request's verification count), Commit(a), and a Tokens event with count = a + 1; at
/// max_new_tokens it queues Finished (FINISH_REASON_LENGTH).
/// A real model: the prefill's next_token is the first generated token (its own Tokens event:
/// the time to first token). A step's rows are 1 + the drafts ProposeNgramDraft finds in the
/// sequence's tokens (at most d, and at most tokens left - 1), with tokens = [the last token,
/// drafts...]; a = the leading drafts equal to the worker's sampled_tokens, and the step emits
/// drafts[0, a) + sampled_tokens[a], cut after the first end-of-sequence token (unless
/// ignore_eos) or stop token and at max_new_tokens; Commit(kept - 1) for a speculative step, so
/// the worker's KV holds the sequence's tokens but the last (the next step's input).
/// At the end it releases the sequence (donor: Release with keep_indexer_sequence; session: kept,
/// with a real model's token history for the next turn's check).
///
/// Backpressure: events go through a per-request queue of at most max_pending_events; the handler
/// writes them with the synchronous stream Write, so a slow reader fills only its own queue, and
/// the decode loop leaves a sequence whose queue is full out of its DecodeStep until the reader
/// catches up. A slow reader slows only itself; memory per request stays bounded.
///
/// Failures: a DecodeStep error is retried once per sequence alone, so the sequences the attention
/// worker left intact (it rolls back every sequence the indexer did not apply) go on. A sequence
/// that still fails with a worker's failure (UNAVAILABLE, DEADLINE_EXCEEDED: a hung worker, whose
/// batch is not retried, and whose step is cancelled as soon as hung_worker_checks consecutive
/// checks could not reach it; ABORTED, INTERNAL, UNKNOWN; NOT_FOUND: the worker lost it in a
/// restart; FAILED_PRECONDITION: the attention worker marked it broken because another sequence's
/// failure came after its indexer had advanced it) migrates (Dynamo's request migration): it leaves
/// both workers (released on each; what a dead worker could not release is released when it answers
/// again), the workers are checked at once (RefreshWorkers), and the request is placed again ahead
/// of the queue with its context plus the tokens generated so far, prefilled there (a real model:
/// with those tokens, its next_token is the request's next token) and decoded on, its stream
/// unchanged but for the longer gap; Finished.migrations counts the moves. A prefill
/// that fails so migrates too, but for FAILED_PRECONDITION from the Prefill that creates the
/// sequence: nothing existed to break, so that is the workers refusing the request (an indexer
/// without audits refusing overrides.miss_target), which every worker of a deployment would
/// answer alike; the request ends at once with it, naming both workers, no worker suspected.
/// Past max_migrations, or for any other status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...), the
/// request ends with the status. Abort and a client cancelling its
/// stream end the request with CANCELLED at the decode loop's next iteration (queued ones at once).
/// A stream's status is sent only after its sequence was released on the workers (or retained), so
/// a client that saw the end finds that reflected in GetLoad and in the placement of its next
/// request.
class CoordinatorEngine {
 public:
  /// Validates the options, runs a first RefreshWorkers (each check bounded by
  /// worker_check_timeout_ms; workers that do not answer are looked at again at the next one, so
  /// the coordinator starts, not ready, when none does) and, with run_loops, starts the watch
  /// threads. `metrics` is caller-owned and outlives the engine; `workers` makes the client of
  /// each worker address; `clock` (outlives the engine) times stalls, latencies and durations;
  /// `resolve` resolves the *_dns names. Errors: INVALID_ARGUMENT (no source of workers of a
  /// kind, a bad address or option, a missing collaborator).
  static absl::StatusOr<std::unique_ptr<CoordinatorEngine>> Create(
      const CoordinatorOptions& options, CoordinatorMetrics* metrics,
      std::shared_ptr<WorkerClientFactory> workers, const Clock* clock = &RealClock(),
      AddressResolver resolve = ResolveDnsAddresses);

  /// Stops the decode loops (Stop).
  ~CoordinatorEngine();
  CoordinatorEngine(const CoordinatorEngine&) = delete;
  CoordinatorEngine& operator=(const CoordinatorEngine&) = delete;

  /// Resolves the *_dns names, takes in new workers that answer, and sets every known worker's
  /// readiness (see the class comment), logging each change with its reason. A worker whose
  /// instance id changed restarted: its slot is retired (nothing placed there again, its retained
  /// sequences forgotten) and the new instance is taken in afresh, its shape checked again. Then
  /// fails the queued requests that no ready worker could hold (UNAVAILABLE), updates
  /// dsa_coordinator_workers, tells the readiness listener and retries the Releases that did not
  /// reach their workers. A name that fails to resolve keeps its last answer (logged).
  /// Thread-safe; calls are serialized and shared: a call that waited for another's refresh
  /// returns without its own when a refresh that began after the call has ended meanwhile (its
  /// checks are as fresh), so the handlers of the requests of one failed worker, each of which
  /// refreshes before it migrates, cost two rounds of checks, not one each.
  void RefreshWorkers();

  /// Calls of RefreshWorkers waiting for the one in progress (tests).
  int RefreshesWaiting() const;

  /// `listener` is called now with whether the coordinator is ready, then on every change (from
  /// the thread that runs RefreshWorkers). Replaces any earlier listener.
  void SetReadinessListener(std::function<void(bool ready)> listener);

  /// The attention workers' full layers (GetInfo), the indexer sequences' num_layers; 0 until
  /// the first attention worker was taken in.
  int num_full_layers() const;

  /// The model the attention workers run; nullopt until the first one was taken in. Attention
  /// workers must agree on it (a worker that runs another is refused, as for H and D), and it
  /// changes only while nothing is held or queued (Scheduler::Idle).
  std::optional<ServedModel> model() const;

  /// Validates, admits (or queues), places, prefills and writes Admitted, Tokens per decode step
  /// and Finished to `stream`; returns when the request has ended. `caller` is the call's
  /// CallerIdentity: it scopes the request id (only it may Abort the request; another caller may
  /// use the same id) and the session (another caller's session of the same id is another
  /// session). `traceparent` is the router's W3C traceparent ("" or malformed: a new trace).
  /// Returns OK after Finished; INVALID_ARGUMENT (ValidateGenerateRequest,
  /// ValidateGenerateRequestForModel, a session context shorter than its sequence or, with a real
  /// model, not starting with its tokens); ALREADY_EXISTS (this caller has a request of that id in
  /// flight); RESOURCE_EXHAUSTED (queue full, larger than any worker's whole capacity, or beyond
  /// the model's max_context, with the numbers); FAILED_PRECONDITION (the session has a turn
  /// queued or running); UNAVAILABLE
  /// (draining, not ready, or a worker's UNAVAILABLE); CANCELLED (Abort, the stream cancelled, a
  /// stalled reader); any other status a worker returned for this request.
  absl::Status Generate(const dsa::coordinator::v1::GenerateRequest& request,
                        const std::string& caller, absl::string_view traceparent,
                        GenerateStream& stream);

  /// Ends a request in flight (queued: at once; running: at its decode loop's next iteration) with
  /// CANCELLED. NOT_FOUND if `caller` has no request with that id in flight (another caller's
  /// request of that id included: ids are scoped per caller, so they cannot be probed).
  absl::Status Abort(const std::string& request_id, const std::string& caller);

  /// Queued and running requests, retained sequences, the model, and the index-key cache per
  /// indexer worker
  /// from its GetLoad (asked at once, each bounded by worker_check_timeout_ms; a worker that does
  /// not answer reports the coordinator's reservations). The indexers' answers are reused for
  /// load_cache_ms of the clock; concurrent calls wait for one round of asks and share it.
  dsa::coordinator::v1::GetLoadResponse GetLoad();

  /// Begins a drain: new Generate calls get UNAVAILABLE, queued requests end with UNAVAILABLE,
  /// running ones go on.
  void StartDrain();

  /// Stops the decode loops and joins them. Idempotent. Requests still decoding stay unfinished:
  /// call after the transport has stopped delivering calls.
  void Stop();

  /// Without run_loops: one iteration of the decode loop of the attention worker at `address`
  /// (ends its cancelled and stalled requests, then one DecodeStep over the rest with its Commits,
  /// retries and migrations). Returns the sequences it stepped or ended (0: nothing to do).
  /// NOT_FOUND for an address not taken in; FAILED_PRECONDITION with run_loops.
  absl::StatusOr<int> StepWorker(const std::string& address);

  /// Waits until the attention worker at `address` has at least `count` sequences decoding (their
  /// prefills done); false after `timeout` (a test's safety net, not a pacing).
  bool AwaitDecoding(const std::string& address, int count, absl::Duration timeout);

  /// Ends every Generate whose Write has been blocked for stall_timeout_ms by the clock (its
  /// client stopped reading and its flow-control window is full): the request ends with CANCELLED
  /// saying why, and its stream is cancelled (TryCancel), so no call waits on a client forever.
  /// The stall watch thread calls it a few times per timeout; without run_loops the caller does.
  void CheckStalledWrites();

 private:
  CoordinatorEngine(const CoordinatorOptions& options, CoordinatorMetrics* metrics,
                    std::shared_ptr<WorkerClientFactory> workers, const Clock& clock,
                    AddressResolver resolve, Scheduler scheduler);

  // The worker pool's `refreshed` hook: hands queued requests to workers that became ready, and
  // fails the queued ones no ready worker could hold (UNAVAILABLE).
  void WorkersRefreshedLocked(bool any_became_ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // The stall watch's body: CheckStalledWrites a quarter of the stall timeout apart.
  void WatchStalledWrites();
  // Ends an admitted request: LeaveWorkers, then the stream's status (`status` unless one is
  // already set) and queued admissions.
  void EndSequence(const std::shared_ptr<InFlightRequest>& request, const absl::Status& status,
                   bool completed, bool worker_failed = false);
  // Takes an admitted request off its workers: scheduler Finish, attention Release (and, after a
  // worker's failure, the indexer's Release too, so nothing is left orphaned there), evictions.
  // Releases a worker could not take are kept for ReleaseUnreleased.
  void LeaveWorkers(const std::shared_ptr<InFlightRequest>& request, bool completed,
                    bool worker_failed);
  // A request's sequence failed with `status`: migrates it (LeaveWorkers, then kMigrating for its
  // handler) when the status is a worker's failure and it has migrations left, else EndSequence.
  // A status while the request is kPrefilling answers its Prefill, which creates the sequence
  // unless it continues a session's: a FAILED_PRECONDITION there is a refusal, not a failure.
  void FailSequence(const std::shared_ptr<InFlightRequest>& request, const absl::Status& status);
  // The handler's side of a migration: checks the workers, then places the request again (ahead
  // of the queue) with its context plus its generated tokens. Not OK: the status to end with.
  absl::Status PlaceAgain(const std::shared_ptr<InFlightRequest>& request);
  // Retries the releases that failed because a worker was unreachable, on workers that are ready
  // now; forgets those of retired workers (a restarted process holds nothing).
  void ReleaseUnreleased();
  // Sets the stream's status and counts the outcome (first call wins).
  void SetFinalLocked(InFlightRequest& request, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // Marks a request cancelled; a queued one ends at once.
  void AbortLocked(InFlightRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // Hands admissions to their waiting handlers.
  void DeliverAdmissionsLocked(std::vector<Admission> admissions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // A Release a worker did not take (it was unreachable): retried by ReleaseUnreleased.
  struct Unreleased {
    bool attention = false;  // an attention worker's Release, else an indexer worker's
    int slot = 0;
    uint64_t sequence_id = 0;
    bool keep_indexer_sequence = false;  // the attention Release's flag (a retained donor)
    // Counted in undelivered_ (the scheduler waits for it). Not for an evicted sequence (the
    // scheduler forgot it) nor once its worker restarted (its space was freed then).
    bool counted = true;
  };
  // Drops evicted sequences on their workers; a Release that did not reach its worker is retried
  // by ReleaseUnreleased (not counted: the scheduler forgot the sequence already).
  void CarryOutEvictions(const std::vector<Eviction>& evictions);
  // Releases `sequence_id` on attention worker `attention` (skipped when it is -1) with its flag
  // `keep_indexer_sequence`, and, unless that flag is set, directly on indexer worker `indexer`
  // when `indexer_too` or the attention Release failed: an attention worker that could not reach
  // the indexer drops its KV and answers the indexer's error, so a retry of its Release would
  // find nothing (the direct one answers NOT_FOUND when the attention worker's already did).
  // Each Release within `timeout`, carrying a child of `trace` (may be null). Returns the
  // Releases that did not reach their worker (UNAVAILABLE, DEADLINE_EXCEEDED), counted; a
  // worker's NOT_FOUND (it lost the sequence) counts as delivered.
  std::vector<Unreleased> ReleaseSequence(int attention, int indexer, uint64_t sequence_id,
                                          bool keep_indexer_sequence, bool indexer_too,
                                          absl::Duration timeout, const TraceContext* trace);
  // One Release of `sequence_id` on attention (`attention`) or indexer worker `slot`, within
  // `timeout`, carrying a child of `trace` (may be null); the worker's status.
  absl::Status ReleaseOnWorker(bool attention, int slot, uint64_t sequence_id,
                               bool keep_indexer_sequence, absl::Duration timeout,
                               const TraceContext* trace);
  // Prefill of an admitted request on its attention worker, cancelled when its stream is (the
  // client left) or the request is aborted; `*cancelled` says whether that happened, so that the
  // CANCELLED it brings back is not read as the worker's failure. Cut short too when the
  // worker's checks stop reaching it (HungCut; then UNAVAILABLE, CallStatus).
  absl::Status Prefill(GenerateStream& stream, const InFlightRequest& request,
                       const Admission& admission, dsa::attention::v1::PrefillResponse* response,
                       bool* cancelled);

  const std::unique_ptr<EngineCore> core_;
  const std::unique_ptr<WorkerPool> pool_;
  const std::unique_ptr<DecodeLoops> decode_;
  std::atomic<uint64_t> sampling_seeds_drawn_{0};  // seeds picked for requests without one
  std::thread watch_;                              // WorkerPool::WatchWorkers
  std::thread stall_watch_;                        // WatchStalledWrites, when stall_timeout_ms > 0

  // (caller, request id) -> the request in flight: request ids are scoped per caller.
  absl::flat_hash_map<std::pair<std::string, std::string>, std::shared_ptr<InFlightRequest>> by_id_
      ABSL_GUARDED_BY(core_->mu);
  // A Release a worker did not take (it was unreachable): retried by ReleaseUnreleased. The
  // scheduler keeps the sequence's reservations (no ReleaseDone) until every Release of it was
  // delivered or its worker retired, so nothing is placed into space a worker still holds. A
  // restarted worker's Releases go on to its new process, which may hold what was placed there
  // before the restart was seen.
  std::vector<Unreleased> unreleased_ ABSL_GUARDED_BY(core_->mu);
  // Sequence -> its Unreleased entries left; ReleaseDone when the last one is delivered.
  absl::flat_hash_map<uint64_t, int> undelivered_ ABSL_GUARDED_BY(core_->mu);
  absl::flat_hash_map<uint64_t, std::shared_ptr<InFlightRequest>> by_ticket_
      ABSL_GUARDED_BY(core_->mu);
  uint64_t next_ticket_ ABSL_GUARDED_BY(core_->mu) = 1;
  std::atomic<bool> stopped_{false};
};

}  // namespace dsa
