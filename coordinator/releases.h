// The coordinator's Releases of sequences on its workers: of requests that ended or migrate, of
// evicted donors and sessions, and the retries of those a worker could not take (it was
// unreachable), so that nothing is left orphaned on a worker and nothing is placed into space a
// worker still holds (docs/coordinator.md, "Failures, Abort, drain").
#pragma once

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/trace_context.h"
#include "coordinator/engine_core.h"
#include "coordinator/scheduler.h"
#include "coordinator/worker_pool.h"

namespace dsa {

/// The Releases of the sequences the scheduler let go, over a WorkerPool's clients. Thread-safe.
///
/// A Release a worker did not take (UNAVAILABLE, DEADLINE_EXCEEDED, or not sent because the
/// worker's last checks did not reach it) is kept and retried (RetryUnreleased) once the worker is
/// ready again. The scheduler keeps the sequence's reservations (no ReleaseDone) until every
/// Release of it was delivered or its worker retired, so nothing is placed into space a worker
/// still holds. A restarted worker's Releases go on to its new process, which may hold what was
/// placed there before the restart was seen. A worker's NOT_FOUND (it lost the sequence) counts as
/// delivered.
class SequenceReleases {
 public:
  /// `core` and `pool` outlive it.
  SequenceReleases(EngineCore* core, WorkerPool* pool);
  SequenceReleases(const SequenceReleases&) = delete;
  SequenceReleases& operator=(const SequenceReleases&) = delete;

  /// Releases a sequence that left its workers (the scheduler's Finish asked for it) on attention
  /// worker `attention` with its flag `keep_indexer_sequence` and, as ReleaseSequence says, on
  /// indexer worker `indexer` (`indexer_too`: after a worker's failure, since the attention worker
  /// may be gone). Each Release within `timeout`, carrying a child of `trace` (may be null). When
  /// every Release reached its worker, the scheduler's ReleaseDone (the space is free): returns
  /// the evictions it asks for, for the caller to carry out; else the Releases left are retried
  /// and the scheduler waits for them.
  std::vector<Eviction> ReleaseFinished(int attention, int indexer, uint64_t sequence_id,
                                        bool keep_indexer_sequence, bool indexer_too,
                                        absl::Duration timeout, const TraceContext* trace);

  /// Drops evicted sequences on their workers (within rpc_timeout_ms); a Release that did not
  /// reach its worker is retried by RetryUnreleased (the scheduler forgot the sequence already).
  void CarryOutEvictions(const std::vector<Eviction>& evictions);

  /// Retries the Releases that did not reach their workers, on workers that are ready now (each
  /// within worker_check_timeout_ms); those of a retired worker go to the worker at its address
  /// now, once it is taken in and ready, and its space is counted free at once (a restarted
  /// process holds nothing of the old one). ReleaseDone for every sequence whose Releases are all
  /// delivered now, and the evictions that asks for. Returns whether any Release was delivered or
  /// forgotten (space may be free: the caller admits queued requests).
  bool RetryUnreleased();

 private:
  // A Release a worker did not take (it was unreachable): retried by RetryUnreleased.
  struct Unreleased {
    bool attention = false;  // an attention worker's Release, else an indexer worker's
    int slot = 0;
    uint64_t sequence_id = 0;
    bool keep_indexer_sequence = false;  // the attention Release's flag (a retained donor)
    // Counted in undelivered_ (the scheduler waits for it). Not for an evicted sequence (the
    // scheduler forgot it) nor once its worker restarted (its space was freed then).
    bool counted = true;
  };

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

  EngineCore* const core_;  // not owned
  WorkerPool* const pool_;  // not owned
  // The Releases to retry (see the class comment).
  std::vector<Unreleased> unreleased_ ABSL_GUARDED_BY(core_->mu);
  // Sequence -> its Unreleased entries left; ReleaseDone when the last one is delivered.
  absl::flat_hash_map<uint64_t, int> undelivered_ ABSL_GUARDED_BY(core_->mu);
};

}  // namespace dsa
