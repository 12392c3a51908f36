// The coordinator's engine: validation, admission and placement (coordinator/scheduler.h), prefill
// off the decode loops, continuous batching with one decode loop per attention worker, speculative
// rows (seeded acceptance for the pattern model; n-gram drafts verified by a real model), real
// token ids with end-of-sequence and stop tokens, multi-turn sessions, worker watch, request
// migration, metrics and drain, over injected worker clients and an injected clock
// (docs/coordinator.md). coordinator/service.h is its gRPC adapter.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/host_port.h"
#include "coordinator/generate.h"
#include "coordinator/metrics.h"
#include "coordinator/options.h"
#include "coordinator/request_validation.h"
#include "coordinator/scheduler.h"
#include "coordinator/served_model.h"

namespace dsa {

class DecodeLoops;
struct EngineCore;
class WorkerClientFactory;
class RequestLifecycle;
class WorkerPool;

/// The coordinator's engine: dsa.coordinator.v1.CoordinatorService without gRPC, in plain structs
/// (generate.h), over injected worker clients (worker_clients.h) and an injected clock.
/// Thread-safe; each Generate runs on its caller's thread.
///
/// Parts, each over the ones before it, all under one lock (EngineCore, engine_core.h):
/// WorkerPool (worker_pool.h: discovery, checks, readiness, shape and model, the indexers' loads;
/// it knows no requests), DecodeLoops (decode_loops.h: one decode loop per attention worker) and
/// RequestLifecycle (request_lifecycle.h: admission, placement, prefill, events, Abort, stalls,
/// drain and migration, with SequenceReleases, releases.h). The engine makes them, wires the
/// hooks through which a lower part calls up, and answers GetLoad from all three.
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
/// max_new_tokens it queues Finished (FinishReason::kLength).
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
  /// `resolve` resolves the *_dns names. Draws the lease's instance id unless options.instance_id
  /// gives one. Errors: INVALID_ARGUMENT (no source of workers of a kind, a bad address or
  /// option, among them a name empty or over 256 bytes and a lease_ttl_ms outside [1, 600000] or
  /// below 3 x worker_check_interval_ms, a missing collaborator).
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
  /// TenantIdentity (server/security.h): it scopes the request id (only it may Abort the request;
  /// another caller may use the same id), the session (another caller's session of the same id is
  /// another session) and prefix sharing (only its own donors), and it is what the per-caller
  /// limits and the fair queuing count. `traceparent` is the router's W3C traceparent ("" or
  /// malformed: a new trace). Returns OK after Finished; INVALID_ARGUMENT (ValidateGenerateRequest,
  /// ValidateGenerateRequestForModel, a session context shorter than its sequence or, with a real
  /// model, not starting with its tokens); ALREADY_EXISTS (this caller has a request of that id in
  /// flight); RESOURCE_EXHAUSTED (queue full, the caller's queued requests at
  /// max_queued_per_caller, larger than any worker's whole capacity, or beyond the model's
  /// max_context, with the numbers); FAILED_PRECONDITION (the session has a turn
  /// queued or running); UNAVAILABLE
  /// (draining, not ready, or a worker's UNAVAILABLE); CANCELLED (Abort, the stream cancelled, a
  /// stalled reader); any other status a worker returned for this request.
  absl::Status Generate(const GenerateSpec& request, const std::string& caller,
                        absl::string_view traceparent, GenerateStream& stream);

  /// Ends a request in flight (queued: at once; running: at its decode loop's next iteration) with
  /// CANCELLED. NOT_FOUND if `caller` has no request with that id in flight (another caller's
  /// request of that id included: ids are scoped per caller, so they cannot be probed).
  absl::Status Abort(const std::string& request_id, const std::string& caller);

  /// Queued and running requests, retained sequences, the model, and the index-key cache per
  /// indexer worker
  /// from its GetLoad (asked at once, each bounded by worker_check_timeout_ms; a worker that does
  /// not answer reports the coordinator's reservations). The indexers' answers are reused for
  /// load_cache_ms of the clock; concurrent calls wait for one round of asks and share it.
  CoordinatorLoad GetLoad();

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

  /// Waits until, since the engine started, requests whose Prefill could not reach their indexer
  /// began to wait out its hold before they are placed again (until the engine's clock passes
  /// it) at least `count` times; false after `timeout` (a test's safety net, not a pacing).
  bool AwaitPlacementWaits(int count, absl::Duration timeout);

  /// Ends every Generate whose Write has been blocked for stall_timeout_ms by the clock (its
  /// client stopped reading and its flow-control window is full): the request ends with CANCELLED
  /// saying why, and its stream is cancelled (TryCancel), so no call waits on a client forever.
  /// The stall watch thread calls it a few times per timeout; without run_loops the caller does.
  void CheckStalledWrites();

 private:
  CoordinatorEngine(const CoordinatorOptions& options, CoordinatorMetrics* metrics,
                    std::shared_ptr<WorkerClientFactory> workers, const Clock& clock,
                    AddressResolver resolve, Scheduler scheduler);

  // The parts, each over the ones before it; they share the core's lock.
  const std::unique_ptr<EngineCore> core_;
  const std::unique_ptr<WorkerPool> pool_;
  const std::unique_ptr<DecodeLoops> decode_;
  const std::unique_ptr<RequestLifecycle> lifecycle_;
  std::thread watch_;        // WorkerPool::WatchWorkers
  std::thread stall_watch_;  // RequestLifecycle::WatchStalledWrites, when stall_timeout_ms > 0
  std::atomic<bool> stopped_{false};
};

}  // namespace dsa
