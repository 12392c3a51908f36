// What the parts of the coordinator's engine (engine.h) share: the options, the metrics and the
// clock, and one lock over the scheduler and every part's bookkeeping, so that a change that
// spans the worker pool, the decode loops and the requests is seen whole.
#pragma once

#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/metrics.h"
#include "coordinator/options.h"
#include "coordinator/scheduler.h"
#include "dsa/common/v1/lease.pb.h"

namespace dsa {

/// The state every part of a CoordinatorEngine reads and changes under `mu`. Owned by the engine;
/// the parts hold a pointer to it. A part's own fields marked "guarded by mu" are guarded by this
/// `mu` too. Lock order: a part's own mutexes (the worker pool's refresh and load locks) before it.
struct EngineCore {
  EngineCore(const CoordinatorOptions& options, CoordinatorMetrics* metrics, const Clock& clock,
             Scheduler scheduler)
      : options(options), metrics(metrics), clock(clock), scheduler(std::move(scheduler)) {
    lease.set_owner(options.name);
    lease.set_instance_id(options.instance_id);
    lease.set_ttl_ms(options.lease_ttl_ms);
  }
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;

  /// Deadline of DecodeStep, Commit, Release and GetLoad calls (CoordinatorOptions::
  /// rpc_timeout_ms).
  absl::Duration RpcTimeout() const { return absl::Milliseconds(options.rpc_timeout_ms); }

  /// Whether this coordinator holds its workers' sequences under a lease: only when something
  /// renews it, i.e. the watch thread checks the workers (worker_check_interval_ms > 0) or the
  /// caller does (run_loops false). With neither, the sequences are held until released.
  bool LeasesOn() const { return !options.run_loops || options.worker_check_interval_ms > 0; }

  const CoordinatorOptions options;
  CoordinatorMetrics* const metrics;  // not owned
  const Clock& clock;                 // times stalls, latencies and durations
  /// This start's lease (owner = options.name, instance_id, ttl_ms = options.lease_ttl_ms), sent
  /// with every Prefill and renewed at every check while LeasesOn().
  dsa::common::v1::Lease lease;

  mutable absl::Mutex mu;
  Scheduler scheduler ABSL_GUARDED_BY(mu);
  bool draining ABSL_GUARDED_BY(mu) = false;  // StartDrain: no new requests
  bool stopping ABSL_GUARDED_BY(mu) = false;  // Stop: the threads end
  absl::CondVar watch_wake;                   // stopping (the watch threads wait on it)
};

}  // namespace dsa
