// The coordinator's worker pool: discovery of its attention and indexer workers (fixed addresses
// and DNS names), their checks (health, readiness, reachability), the shape and model they must
// agree on, restarts, and the indexers' loads (docs/coordinator.md "Workers and readiness"). It
// knows nothing of requests: the parts above it (engine.h) hook into each refresh.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/host_port.h"
#include "coordinator/engine_core.h"
#include "coordinator/scheduler.h"
#include "coordinator/served_model.h"
#include "coordinator/worker_clients.h"
#include "dsa/attention/v1/attention.pb.h"
#include "dsa/common/v1/lease.pb.h"
#include "dsa/indexer/v1/indexer.pb.h"
#include "nlohmann/json.hpp"

namespace dsa {

/// The model of an attention worker's GetInfo (an empty name with vocab_size 0 is "pattern";
/// the pattern model has no end-of-sequence token), or why the coordinator cannot serve it
/// (INVALID_ARGUMENT: a negative vocab_size or max_context, an eos_token_id outside the
/// vocabulary).
absl::StatusOr<ServedModel> ModelOfAttentionWorker(const dsa::attention::v1::GetInfoResponse& info);

/// Whether a call's status says it did not reach its worker (UNAVAILABLE, DEADLINE_EXCEEDED): a
/// Release that did so is kept for a retry, a check that did so counts as unreached.
bool WorkerUnreached(const absl::Status& status);

/// The cancellation predicate of one call to an attention worker (CoordinatorOptions::
/// hung_worker_checks): true once the worker's consecutive lost checks reach the threshold with
/// one at least lost since the call began (a worker that just resumed, whose counter a check has
/// not reset yet, is not cut); remembers that it cut, so the CANCELLED that follows is read as
/// the worker's hang whatever the counter says by then. Thread-safe.
class HungCut {
 public:
  HungCut(const std::atomic<int>& unreached_checks, int hung_worker_checks)
      : unreached_checks_(unreached_checks),
        threshold_(hung_worker_checks),
        at_start_(unreached_checks.load()) {}
  bool Poll() {
    const int now = unreached_checks_.load();
    if (threshold_ > 0 && now >= threshold_ && now > at_start_) cut_ = true;
    return cut_.load();
  }
  bool cut() const { return cut_.load(); }

 private:
  const std::atomic<int>& unreached_checks_;
  const int threshold_;
  const int at_start_;
  std::atomic<bool> cut_{false};
};

/// The attention and indexer workers the coordinator knows, in fixed slots per kind, over injected
/// worker clients (worker_clients.h) and a resolver of DNS names. Thread-safe.
///
/// RefreshWorkers (at the engine's start, then every worker_check_interval_ms on the watch thread)
/// takes in every fixed or resolved address that answers its first check (GetInfo of an attention
/// worker, GetLoad of an indexer worker; they must agree on the full layers and H, D) and marks
/// every known worker ready or not: ready while it is still listed and its grpc.health.v1
/// "readiness" is SERVING (a server without the health service: while its GetInfo / GetLoad
/// answers). New sequences go only to ready workers; what a worker that is not ready holds stays
/// there (its requests move only when a call to it fails). The coordinator is ready
/// (SetReadinessListener) while at least one worker of each kind is.
///
/// Leases (EngineCore::LeasesOn, contracts/lease.h): each check renews the coordinator's lease on
/// the worker after its GetInfo / GetLoad, and a worker is taken in only once a renewal succeeded.
/// A renewal that did not reach the worker counts as an unreached check; one refused
/// FAILED_PRECONDITION (a newer instance of this coordinator's name owns the worker now) or
/// otherwise keeps the worker out, or not ready, with the reason; one that says the lease was not
/// live (renewed false) on a worker already taken in means the worker released everything this
/// coordinator held there (the lease expired while it was paused or cut off), which is handled as
/// a restart. A worker that does not implement RenewLease holds no leases: it is taken as renewed.
///
/// Slots: a slot below the published count (NumAttentionLocked, NumIndexersLocked) never changes
/// but for its flags, so threads read its address and client without a lock; its `ready` and
/// `retired` flags are guarded by the core's mu.
class WorkerPool {
 public:
  /// Worker slots of each kind: clients (and the decode loops above) live in fixed slots so that
  /// threads may read a slot below the published count without a lock; a worker that leaves keeps
  /// its slot.
  static constexpr int kMaxWorkersPerKind = 1024;

  /// One attention worker: its client, and what its GetInfo said when it was taken in.
  struct AttentionWorker {
    std::string address;
    std::shared_ptr<AttentionWorkerClient> client;
    bool ready = true;     // guarded by the core's mu
    bool retired = false;  // guarded by the core's mu; restarted or gone
    // Consecutive checks that did not reach it (UNAVAILABLE, DEADLINE_EXCEEDED); read unlocked
    // by the calls in flight to it.
    std::atomic<int> unreached_checks{0};
    // A call to it failed as a worker's failure since the last check that reached it, and how
    // many have (guarded by the core's mu): a check that then times out takes it out of
    // placements at once.
    bool call_failed = false;
    uint64_t call_failures = 0;
    // The last check that reached it (or its taking in), by the core's clock; guarded by the
    // core's mu. GetLoad says how long a worker has not answered from it.
    absl::Time last_reached = absl::InfinitePast();
    std::string instance_id;  // GetInfo's, when taken in
    ServedModel model;        // GetInfo's, when taken in
    int num_full_layers = 0;
    int64_t num_heads = 0;
    int64_t head_dim = 0;
  };
  /// One indexer worker: its client, and what its GetLoad said when it was taken in.
  struct IndexerWorker {
    std::string address;
    std::shared_ptr<IndexerWorkerClient> client;
    bool ready = true;     // guarded by the core's mu
    bool retired = false;  // guarded by the core's mu; restarted or gone
    // Consecutive checks that did not reach it, a call's failure since, and the last check that
    // did reach it (as AttentionWorker's).
    std::atomic<int> unreached_checks{0};
    bool call_failed = false;
    uint64_t call_failures = 0;
    absl::Time last_reached = absl::InfinitePast();
    std::string instance_id;  // GetLoad's, when taken in
    int64_t num_heads = 0;
    int64_t head_dim = 0;
    // Placement holds (HoldIndexerLocked, BeginPrefillLocked), guarded by the core's mu. While
    // `held_back` the scheduler does not place on it, whatever its checks say.
    absl::Time held_until = absl::InfinitePast();
    int holds = 0;           // consecutive holds, with no Prefill through it succeeding between
    bool held_back = false;  // the scheduler's readiness taken away by a hold or a probe
    bool probation = false;  // taken in again after a restart; no Prefill through it succeeded
    bool probing = false;    // the probe Prefill of its probation runs
  };

  /// What the parts above the pool do at points of a refresh. Set once (SetHooks) before the first
  /// RefreshWorkers; any may be empty.
  struct Hooks {
    /// Under the core's mu: attention worker `slot` was taken in (its decode loop starts).
    std::function<void(int slot)> attention_added;
    /// Under the core's mu, once every worker's readiness is set: `any_became_ready` says whether
    /// a worker became ready (queued requests may fit now). Before the coordinator's readiness is
    /// worked out and the worker gauges are set.
    std::function<void(bool any_became_ready)> refreshed;
    /// Unlocked, last: `evictions` are the releases of what the workers retired in this refresh
    /// held (the scheduler forgot them); then the Releases that waited for a worker to answer.
    std::function<void(const std::vector<Eviction>& evictions)> after_refresh;
  };

  /// Shortest and longest hold of an indexer that a Prefill could not reach (HoldIndexerLocked):
  /// the first hold is the shortest, each later one without a Prefill through it succeeding in
  /// between doubles, up to the longest.
  static constexpr absl::Duration kMinIndexerHold = absl::Milliseconds(100);
  static constexpr absl::Duration kMaxIndexerHold = absl::Seconds(2);

  /// When a request whose Prefill could not reach its indexer may be placed again
  /// (HoldIndexerLocked).
  struct IndexerHold {
    absl::Time until;        // the hold's end, by the core's clock
    bool placeable = false;  // the scheduler may still place on the indexer (see below)
  };

  /// The indexers' GetLoad answers by slot (AskIndexerLoads): `statuses[i]` is OK where
  /// `loads[i]` is the worker's answer.
  struct IndexerLoads {
    std::vector<dsa::indexer::v1::GetLoadResponse> loads;
    std::vector<absl::Status> statuses;
  };

  /// `core` outlives the pool; `workers` makes the client of each worker address; `resolve`
  /// resolves the *_dns names. Sets the worker gauges to none.
  WorkerPool(EngineCore* core, std::shared_ptr<WorkerClientFactory> workers,
             AddressResolver resolve);
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// Sets the hooks of every later refresh (see Hooks).
  void SetHooks(Hooks hooks);

  /// Resolves the *_dns names, takes in new workers that answer, and sets every known worker's
  /// readiness (see the class comment), logging each change with its reason. A worker whose
  /// instance id changed restarted: its slot is retired (nothing placed there again, its retained
  /// sequences forgotten) and the new instance is taken in afresh, its shape checked again. Then
  /// the `refreshed` hook (which fails the queued requests that no ready worker could hold),
  /// dsa_coordinator_workers, the readiness listener and the `after_refresh` hook (the releases
  /// of what retired workers held, and of what did not reach its workers). A name that fails to
  /// resolve keeps its last answer (logged). Does nothing once the core is stopping.
  /// Thread-safe; calls are serialized and shared: a call that waited for another's refresh
  /// returns without its own when a refresh that began after the call has ended meanwhile (its
  /// checks are as fresh), so the handlers of the requests of one failed worker, each of which
  /// refreshes before it migrates, cost two rounds of checks, not one each.
  void RefreshWorkers();

  /// Calls of RefreshWorkers waiting for the one in progress (tests).
  int RefreshesWaiting() const { return refreshes_waiting_.load(); }

  /// `listener` is called now with whether the coordinator is ready, then on every change (from
  /// the thread that runs RefreshWorkers). Replaces any earlier listener.
  void SetReadinessListener(std::function<void(bool ready)> listener);

  /// The watch thread's body: RefreshWorkers every worker_check_interval_ms until the core is
  /// stopping.
  void WatchWorkers();

  /// Runs `f` while no RefreshWorkers runs (none in progress, none starting): once the core is
  /// stopping, no worker is taken in (and no decode loop started) after `f` began.
  void WithoutRefreshes(absl::FunctionRef<void()> f);

  /// The attention workers' full layers (GetInfo), the indexer sequences' num_layers; 0 until
  /// the first attention worker was taken in.
  int num_full_layers() const;

  /// The model the attention workers run; nullopt until the first one was taken in. Attention
  /// workers must agree on it (a worker that runs another is refused, as for H and D), and it
  /// changes only while nothing is held or queued (Scheduler::Idle).
  std::optional<ServedModel> model() const;
  std::optional<ServedModel> ModelLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    return model_;
  }

  /// Readiness: a ready worker of each kind.
  bool ReadyLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);

  /// Slots taken in so far ([0, count) are set).
  int NumAttentionLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) { return num_attention_; }
  int NumIndexersLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) { return num_indexers_; }
  /// The worker in `slot` (below the published count; see the class comment for its fields).
  AttentionWorker& attention(int slot) const { return *attention_[slot]; }
  IndexerWorker& indexer(int slot) const { return *indexers_[slot]; }
  /// The slot of the worker at `address` that is taken in and not retired; nullopt if none.
  std::optional<int> AttentionSlotLocked(const std::string& address) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  std::optional<int> IndexerSlotLocked(const std::string& address) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);

  /// Readmission that waits for the data plane. The coordinator's checks reach an indexer that
  /// restarted before the attention workers' connections to it work again (theirs may still be
  /// waiting out a reconnection backoff), so a placement there can fail at once, before anything
  /// is held: the attention worker's Prefill answers UNAVAILABLE or DEADLINE_EXCEEDED naming the
  /// indexer. Such a failure holds the indexer back from new placements (HoldIndexerLocked), and
  /// an indexer taken in again after a restart takes one placement at a time, a probe, until a
  /// Prefill through it succeeds (BeginPrefillLocked). An indexer is never held back while it is
  /// the last ready one, so that a hold never makes the coordinator unready or fails what is
  /// queued: its requests wait out the hold instead.
  ///
  /// A Prefill through indexer `slot` could not reach it (`why`): holds it back from new
  /// placements until the returned time (kMinIndexerHold, doubling with each hold while no
  /// Prefill through it succeeds, up to kMaxIndexerHold); a hold in force is kept as it is. Logs
  /// each new hold. `placeable`: the indexer was the last ready one, so the scheduler may still
  /// place on it, and the caller should wait until the hold's end before placing again.
  IndexerHold HoldIndexerLocked(int slot, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  /// A Prefill begins through indexer `slot`: on probation (taken in again after a restart) its
  /// first one is a probe, and while it runs the indexer takes no other placement (unless it is
  /// the last ready one).
  void BeginPrefillLocked(int slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  /// A Prefill through indexer `slot` ended other than by not reaching it: `reached` (it
  /// succeeded) ends the indexer's hold and probation at once; otherwise only a probe's hold
  /// ends. Returns whether the indexer became placeable again.
  bool EndPrefillLocked(int slot, bool reached) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  /// Ends the holds whose time has passed by the core's clock; returns whether an indexer
  /// became placeable again. RefreshWorkers calls it too.
  bool ReleaseExpiredHoldsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);

  /// Whether the last hung_worker_checks (> 0) checks of a worker whose counter is
  /// `unreached_checks` could not reach it: Releases are not sent to it, and a migration off it
  /// does not check it again.
  bool KnownUnreachable(const std::atomic<int>& unreached_checks) const;

  /// The status for a request of a `call` ("step", "commit", "prefill") to `w` that ended with
  /// `status`: UNAVAILABLE naming the lost checks when the call was `cut` (HungCut) and ended
  /// CANCELLED (`*hung` set); else the worker's status, CANCELLED from a worker (it cancelled the
  /// call, e.g. while shutting down) read as UNAVAILABLE (`*hung` set for DEADLINE_EXCEEDED).
  /// `hung` may be null.
  absl::Status CallStatus(const AttentionWorker& w, const absl::Status& status, const char* call,
                          bool cut, bool* hung) const;

  /// The GetLoad answers of the indexers in slots [0, ask.size()) whose `ask` is set (asked at
  /// once, each bounded by worker_check_timeout_ms; the others' statuses say "not asked"). The
  /// answers are reused for load_cache_ms of the clock while asked of the same slots; concurrent
  /// calls wait for one round of asks and share it.
  IndexerLoads AskIndexerLoads(const std::vector<bool>& ask);

 private:
  // What one check of a worker saw (RefreshWorkers).
  struct Probe {
    std::string address;
    std::shared_ptr<AttentionWorkerClient> attention_client;  // the kind checked
    std::shared_ptr<IndexerWorkerClient> indexer_client;
    // Of GetInfo / GetLoad, or of RenewLease when that did not reach the worker (an unreached
    // check either way).
    absl::Status status;
    // The lease renewal after an OK GetInfo / GetLoad (EngineCore::LeasesOn): OK with
    // `lease_state`; UNIMPLEMENTED from a worker that holds no leases (taken as renewed); other
    // errors refuse the worker (`lease_refused`, `reason` says why).
    absl::Status lease_status = absl::OkStatus();
    dsa::common::v1::LeaseState lease_state;
    bool leased = false;         // renewed OK (not UNIMPLEMENTED)
    bool lease_refused = false;  // FAILED_PRECONDITION (superseded), INVALID_ARGUMENT, ...
    dsa::attention::v1::GetInfoResponse info;
    dsa::indexer::v1::GetLoadResponse load;
    bool healthy = false;  // readiness SERVING, or no health service and the call above OK
    std::string reason;    // why not healthy
  };
  // The indexers' last GetLoad answers (AskIndexerLoads), by slot, and when they were asked for.
  // Held across a round of asks, so that concurrent calls share one round.
  struct CachedLoads {
    absl::Time asked = absl::InfinitePast();
    std::vector<bool> asked_slots;  // the slots asked
    IndexerLoads answers;
  };

  // The addresses of a kind: fixed ones, then each name's resolution (the last good answer when
  // it fails now). Called with refresh_mu_ held.
  std::vector<std::string> WantedAddresses(const std::vector<std::string>& fixed,
                                           const std::vector<std::string>& names)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(refresh_mu_);
  // Checks one worker of a kind (`attention` true: GetInfo; false: GetLoad), then its readiness,
  // through the client of a known worker, else a new one from the factory. A GetInfo / GetLoad
  // that answers UNAVAILABLE is asked once more with wait_for_ready (for at most five
  // kWorkerInitialReconnectBackoff, 500 ms) before the probe says so, unless `call_failed` (a call
  // to the worker failed since its last answered check: that failure confirms it).
  Probe ProbeWorker(const std::string& address, bool attention,
                    std::shared_ptr<AttentionWorkerClient> attention_client,
                    std::shared_ptr<IndexerWorkerClient> indexer_client, bool call_failed) const;
  // Renews the core's lease on `probe`'s worker through `client` after its GetInfo / GetLoad
  // answered, setting the probe's lease fields (and its status, when the renewal did not reach
  // the worker).
  void RenewLease(Probe& probe, bool attention, absl::Duration timeout) const;
  // Whether `probe`'s worker fits the shape of the workers ready now (an empty string) or why
  // not; with none ready any shape fits (the full layers change only while nothing is held).
  std::string CheckShapeLocked(const Probe& probe, bool attention)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // Retires a known worker's slot (a restart): not ready for good, its address free for the new
  // instance; co-located, the pair goes together. The releases of the retained sequences the
  // scheduler forgot are added to `evictions`, for the caller to carry out unlocked.
  void RetireLocked(int slot, bool attention, std::vector<Eviction>* evictions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // Sets indexer `slot`'s held_back, and the scheduler's readiness of it (ready and not held).
  void SetHeldBackLocked(int slot, bool held) ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // Whether an indexer other than `slot` is ready and not held back.
  bool OtherIndexerPlaceableLocked(int slot) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu);
  // Logs `message` for `key` unless the last message logged for it was the same.
  void LogOnce(const std::string& key, const char* level, const char* message,
               nlohmann::json fields) ABSL_EXCLUSIVE_LOCKS_REQUIRED(refresh_mu_);

  EngineCore* const core_;  // not owned
  const std::shared_ptr<WorkerClientFactory> workers_;
  const AddressResolver resolve_;
  Hooks hooks_;  // set before the first refresh, then read-only
  // kMaxWorkersPerKind slots each; [0, num_attention_) / [0, num_indexers_) are set, and a set
  // slot never changes (its flags aside).
  std::vector<std::unique_ptr<AttentionWorker>> attention_;
  std::vector<std::unique_ptr<IndexerWorker>> indexers_;

  absl::Mutex refresh_mu_ ABSL_ACQUIRED_BEFORE(core_->mu);  // serializes RefreshWorkers
  std::atomic<uint64_t> refreshes_begun_{0};                // RefreshWorkers that did their checks
  std::atomic<int> refreshes_waiting_{0};                   // for refresh_mu_
  absl::Mutex load_mu_ ABSL_ACQUIRED_BEFORE(core_->mu);
  CachedLoads indexer_loads_ ABSL_GUARDED_BY(load_mu_);
  absl::flat_hash_map<std::string, std::vector<std::string>> dns_answers_
      ABSL_GUARDED_BY(refresh_mu_);  // name -> last good answer
  // key -> the last message logged for it (LogOnce)
  absl::flat_hash_map<std::string, std::string> logged_ ABSL_GUARDED_BY(refresh_mu_);
  std::function<void(bool)> readiness_listener_ ABSL_GUARDED_BY(refresh_mu_);
  std::optional<bool> told_ready_ ABSL_GUARDED_BY(refresh_mu_);

  int num_attention_ ABSL_GUARDED_BY(core_->mu) = 0;
  int num_indexers_ ABSL_GUARDED_BY(core_->mu) = 0;
  absl::flat_hash_map<std::string, int> attention_by_address_ ABSL_GUARDED_BY(core_->mu);
  absl::flat_hash_map<std::string, int> indexer_by_address_ ABSL_GUARDED_BY(core_->mu);
  // The scheduler's, once an attention worker came.
  int num_full_layers_ ABSL_GUARDED_BY(core_->mu) = 0;
  std::optional<ServedModel> model_ ABSL_GUARDED_BY(core_->mu);  // once an attention worker came
};

}  // namespace dsa
