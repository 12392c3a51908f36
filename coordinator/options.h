// The coordinator's deployment settings (the dsa-coordinator flags, docs/coordinator.md), shared
// by the engine (engine.h) and its parts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "coordinator/ngram_drafter.h"
#include "server/security.h"

namespace dsa {

/// Deployment settings of the coordinator (the dsa-coordinator flags).
struct CoordinatorOptions {
  std::vector<std::string> indexer_addresses;    // host:port of fixed indexer workers
  std::vector<std::string> attention_addresses;  // host:port of fixed attention workers
  /// NAME:PORT of headless Services (DNS): every address NAME resolves to is a worker, taken in
  /// and left out as the answer changes (RefreshWorkers). Each kind needs a fixed address or a
  /// name; co-located (below), the indexers are the attention workers and take neither.
  std::vector<std::string> indexer_dns;
  std::vector<std::string> attention_dns;
  /// How every worker is dialed (TLS, the client certificate of mutual TLS); plaintext default.
  /// Read by the gRPC adapter (GrpcWorkerClients); the engine's worker clients are injected.
  ClientSecurity worker_security;
  /// How often the watch thread runs RefreshWorkers; 0 = never (a test calls it).
  int64_t worker_check_interval_ms = 2000;
  /// Deadline of each check RefreshWorkers makes of a worker (> 0).
  int64_t worker_check_timeout_ms = 1000;
  /// A ready worker leaves placements once this many consecutive checks got no answer within
  /// worker_check_timeout_ms (>= 1; 1 = the first): one slow answer from a worker that is busy
  /// (the coordinator's own host loaded, say) does not take it out of placements. A check that
  /// finds nothing listening (UNAVAILABLE, on a second try too: WorkerPool::ProbeWorker), a
  /// worker that answers it is not ready, or a check that times out after a call to the worker
  /// failed (a step, a Prefill) takes it out at once. Its running calls are cut by
  /// hung_worker_checks, separately.
  int unready_after_timed_out_checks = 2;
  /// GetLoad reuses the indexers' loads it last asked for while they are younger than this
  /// (milliseconds, >= 0; 0 = ask on every call), and one GetLoad asks at a time: however often
  /// clients call GetLoad, each indexer gets at most one GetLoad per this interval from it.
  int64_t load_cache_ms = 100;
  int max_queue = 64;                  // queued requests at most
  int max_running_per_attention = 32;  // running sequences per attention worker
  /// Per-caller shares (callers: TenantIdentity, server/security.h), SchedulerOptions' fields of
  /// these names: queued requests of one caller at most (-1 = a quarter of max_queue, at least
  /// 1; 0 = no limit), running requests of one caller at most (-1 = the ready attention workers'
  /// running slots less a quarter; 0 = no limit), and each caller's weight in the fair queuing
  /// between callers (absent: 1).
  int max_queued_per_caller = -1;
  int max_running_per_caller = -1;
  absl::flat_hash_map<std::string, int> caller_weights;
  int top_k = 2048;                    // K of every sequence unless overridden
  double target_block_sparsity = 0.4;  // SPIN rho in [0, 1)
  double exploration_fraction = 0.05;  // SPIN gamma in [0, 1)
  bool all_keep = false;               // SPIN off
  double acceptance_rate = 0.7;        // of the seeded acceptance model, [0, 1] (pattern model)
  /// N-gram lengths of a real model's prompt-lookup drafts (ngram_drafter.h).
  NgramDraftOptions ngram;
  uint64_t seed = 0;            // acceptance draws (mixed with the request id) and SPIN
  bool retain_finished = true;  // keep finished sequences as prefix donors
  /// Indexer worker i is co-located in attention worker i (dsa-attention --transport inprocess,
  /// usually the same address): sequences on indexer i run on attention worker i.
  bool colocated = false;
  int64_t rpc_timeout_ms = 30000;  // deadline of DecodeStep, Commit, Release and GetLoad calls
  /// Events a request's stream may have waiting for its reader (backpressure; >= 2).
  int max_pending_events = 16;
  /// A request whose reader has left its event queue full this long is ended (CANCELLED, the
  /// message says why) and its sequence released, so a client that stops reading cannot hold a
  /// running slot, KV and index-key blocks forever; a stream whose Write has been blocked this
  /// long (the client's window full, also after its request finished) is cancelled, so it cannot
  /// hold a handler thread either. 0 = never.
  int64_t stall_timeout_ms = 60000;
  /// Times a running request may move off a failed worker (Migrate) before its failure ends it;
  /// 0 = a worker's failure ends its requests.
  int max_migrations = 3;
  /// A DecodeStep, the Commits of a step and a Prefill in flight to an attention worker are
  /// cancelled (and their sequences migrate) once this many consecutive checks of that worker
  /// (RefreshWorkers), one at least made while the call ran, could not reach it (GetInfo
  /// UNAVAILABLE, or no answer within worker_check_timeout_ms): a hung (SIGSTOP) or partitioned
  /// process is left after about this x (interval + check timeout), not after rpc_timeout_ms
  /// (a Prefill has no deadline at all). Releases are not sent to a worker (of either kind) in
  /// that state; they wait for it to answer. A worker that answers its checks within their
  /// timeout, however busy or draining, is never cut off. 0 = never (calls wait for their
  /// deadlines).
  int hung_worker_checks = 2;
  /// The owner of this coordinator's leases on its workers' sequences (contracts/lease.h): the
  /// same across its restarts, so that a restarted coordinator's first renewal releases what its
  /// earlier instance held at once, and distinct between coordinators that share workers.
  /// dsa-coordinator defaults it to "<hostname>:<port of --listen>". Not empty, at most 256 bytes.
  std::string name = "dsa-coordinator";
  /// How long a worker holds this coordinator's sequences without a renewal, in milliseconds, in
  /// [1, 600000] and >= 3 x worker_check_interval_ms (every check renews, so two checks may fail
  /// before the lease runs out). A coordinator that dies, hangs or is partitioned has its
  /// sequences released by the workers about this long after its last check.
  int64_t lease_ttl_ms = 10000;
  /// This start's lease instance, random per engine when empty (tests inject one). A worker that
  /// sees a new instance of `name` releases what the earlier ones held and refuses them.
  std::string instance_id;
  /// false: no decode loop, watch or stall-watch thread; the caller drives the engine with
  /// StepWorker, RefreshWorkers and CheckStalledWrites (the deterministic tests).
  bool run_loops = true;
};

}  // namespace dsa
