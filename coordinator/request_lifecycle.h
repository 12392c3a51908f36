// The life of a Generate request in the coordinator: validation, admission and placement
// (coordinator/scheduler.h), the prefill on its handler thread, the hand-off to its attention
// worker's decode loop, the events written to its stream, Abort, stalled readers, drain, and at
// its end the release of its sequence, or its migration off a failed worker (docs/coordinator.md,
// "A request's life", "Backpressure", "Failures, Abort, drain").
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "coordinator/decode_loops.h"
#include "coordinator/engine_core.h"
#include "coordinator/generate.h"
#include "coordinator/releases.h"
#include "coordinator/request.h"
#include "coordinator/scheduler.h"
#include "coordinator/worker_pool.h"
#include "dsa/attention/v1/attention.pb.h"

namespace dsa {

/// The requests in flight, over the worker pool, the decode loops and the Releases. Thread-safe;
/// each Generate runs on its caller's thread (CoordinatorEngine's class comment says what a
/// request goes through).
class RequestLifecycle {
 public:
  /// `core`, `pool` and `decode` outlive it. Sets the queue's gauge bound (max_queue).
  RequestLifecycle(EngineCore* core, WorkerPool* pool, DecodeLoops* decode);
  RequestLifecycle(const RequestLifecycle&) = delete;
  RequestLifecycle& operator=(const RequestLifecycle&) = delete;

  /// CoordinatorEngine::Generate (its doc lists what it returns).
  absl::Status Generate(const GenerateSpec& request, const std::string& caller,
                        absl::string_view traceparent, GenerateStream& stream);

  /// CoordinatorEngine::Abort.
  absl::Status Abort(const std::string& request_id, const std::string& caller);

  /// CoordinatorEngine::StartDrain.
  void StartDrain();

  /// CoordinatorEngine::CheckStalledWrites.
  void CheckStalledWrites();

  /// CoordinatorEngine::AwaitPlacementWaits.
  bool AwaitPlacementWaits(int count, absl::Duration timeout);

  /// Placements again of one request whose Prefill could not reach its indexer that count as no
  /// migration (WorkerPool::HoldIndexerLocked); later ones are migrations. With the holds'
  /// backoff they span about 9 s.
  static constexpr int kMaxUnreachedPlacements = 8;

  /// The stall watch's body: CheckStalledWrites a quarter of the stall timeout apart, until the
  /// core is stopping.
  void WatchStalledWrites();

  /// The worker pool's `refreshed` hook: hands queued requests to workers that became ready, and
  /// fails the queued ones no ready worker could hold (UNAVAILABLE).
  void WorkersRefreshedLocked(bool any_became_ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);

  /// The worker pool's `after_refresh` hook: releases what retired workers held (`evictions`),
  /// then retries the Releases that did not reach their workers.
  void AfterRefresh(const std::vector<Eviction>& evictions);

  /// Ends an admitted request: LeaveWorkers, then the stream's status (`status` unless one is
  /// already set; CANCELLED with its reason for a request cancelled before it completed) and
  /// queued admissions. The decode loops' `end` hook.
  void EndSequence(const std::shared_ptr<InFlightRequest>& request, const absl::Status& status,
                   bool completed, bool worker_failed = false);

  /// A request's sequence failed with `status`: migrates it (LeaveWorkers, then kMigrating for its
  /// handler) when the status is a worker's failure and it has migrations left, else EndSequence.
  /// A status while the request is kPrefilling answers its Prefill, which creates the sequence
  /// unless it continues a session's: a FAILED_PRECONDITION there is a refusal, not a failure.
  /// The decode loops' `fail` hook.
  void FailSequence(const std::shared_ptr<InFlightRequest>& request, const absl::Status& status);

 private:
  // Takes an admitted request off its workers: scheduler Finish, attention Release (and, after a
  // worker's failure, the indexer's Release too, so nothing is left orphaned there), evictions.
  // Releases a worker could not take are kept for ReleaseUnreleased.
  void LeaveWorkers(const std::shared_ptr<InFlightRequest>& request, bool completed,
                    bool worker_failed);
  // The handler's side of a migration: checks the workers, then places the request again (ahead
  // of the queue) with its context plus its generated tokens. Not OK: the status to end with.
  absl::Status PlaceAgain(const std::shared_ptr<InFlightRequest>& request);
  // Retries the releases that failed because a worker was unreachable, on workers that are ready
  // now; forgets those of retired workers (a restarted process holds nothing). Then queued
  // requests may fit.
  void ReleaseUnreleased();
  // A request refused before it was queued: counts it (outcome "rejected", its code), logs one
  // "request rejected" line (its id, caller, trace id, code and reason) and returns `status`.
  // Called without the core's lock (it writes to the log).
  absl::Status Rejected(const GenerateSpec& spec, const std::string& caller,
                        absl::string_view traceparent, absl::Status status);
  // Sets the stream's status and counts the outcome (first call wins).
  void SetFinalLocked(InFlightRequest& request, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // Marks a request cancelled; a queued one ends at once.
  void AbortLocked(InFlightRequest& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // Hands admissions to their waiting handlers.
  void DeliverAdmissionsLocked(std::vector<Admission> admissions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // Prefill of an admitted request on its attention worker, cancelled when its stream is (the
  // client left) or the request is aborted; `*cancelled` says whether that happened, so that the
  // CANCELLED it brings back is not read as the worker's failure. Cut short too when the
  // worker's checks stop reaching it (HungCut; then UNAVAILABLE, WorkerPool::CallStatus).
  absl::Status Prefill(GenerateStream& stream, const InFlightRequest& request,
                       const Admission& admission, dsa::attention::v1::PrefillResponse* response,
                       bool* cancelled);

  EngineCore* const core_;     // not owned
  WorkerPool* const pool_;     // not owned
  DecodeLoops* const decode_;  // not owned
  SequenceReleases releases_;
  std::atomic<uint64_t> sampling_seeds_drawn_{0};  // seeds picked for requests without one
  // (caller, request id) -> the request in flight: request ids are scoped per caller.
  absl::flat_hash_map<std::pair<std::string, std::string>, std::shared_ptr<InFlightRequest>> by_id_
      ABSL_GUARDED_BY(core_->mu);
  absl::flat_hash_map<uint64_t, std::shared_ptr<InFlightRequest>> by_ticket_
      ABSL_GUARDED_BY(core_->mu);
  uint64_t next_ticket_ ABSL_GUARDED_BY(core_->mu) = 1;
  // Waits for a request's place_after begun so far (AwaitPlacementWaits), and their signal.
  int placement_waits_ ABSL_GUARDED_BY(core_->mu) = 0;
  absl::CondVar placement_waits_changed_;
};

}  // namespace dsa
