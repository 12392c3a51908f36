// The coordinator's engine (see engine.h).
#include "coordinator/engine.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "contracts/lease.h"
#include "contracts/limits.h"
#include "coordinator/decode_loops.h"
#include "coordinator/engine_core.h"
#include "coordinator/request_lifecycle.h"
#include "coordinator/worker_pool.h"
#include "dsa/indexer/v1/indexer.pb.h"
#include "server/log.h"

namespace dsa {
namespace {

namespace iv1 = ::dsa::indexer::v1;

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorEngine>> CoordinatorEngine::Create(
    const CoordinatorOptions& options, CoordinatorMetrics* metrics,
    std::shared_ptr<WorkerClientFactory> workers, const Clock* clock, AddressResolver resolve) {
  if (options.attention_addresses.empty() && options.attention_dns.empty()) {
    return absl::InvalidArgumentError("no attention worker (--attention or --attention-dns)");
  }
  if (options.colocated) {
    if (!options.indexer_dns.empty()) {
      return absl::InvalidArgumentError(
          "co-located indexers are the attention workers: give no --indexer-dns");
    }
    if (!options.indexer_addresses.empty() &&
        options.indexer_addresses != options.attention_addresses) {
      return absl::InvalidArgumentError(
          "co-located indexers are the attention workers: --indexer must list the --attention "
          "addresses in the same order, or be left out");
    }
  } else if (options.indexer_addresses.empty() && options.indexer_dns.empty()) {
    return absl::InvalidArgumentError("no indexer worker (--indexer or --indexer-dns)");
  }
  if (options.stall_timeout_ms < 0) {
    return absl::InvalidArgumentError("stall_timeout_ms must be >= 0");
  }
  if (options.load_cache_ms < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("load_cache_ms must be >= 0, got ", options.load_cache_ms));
  }
  if (options.worker_check_interval_ms < 0 || options.worker_check_timeout_ms < 1) {
    return absl::InvalidArgumentError(
        "worker_check_interval_ms must be >= 0 and worker_check_timeout_ms >= 1");
  }
  if (options.name.empty() || options.name.size() > kMaxLeaseNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("name (the lease owner, --name) must have 1 to ",
                                                   kMaxLeaseNameBytes, " bytes, got ",
                                                   options.name.size()));
  }
  if (options.instance_id.size() > kMaxLeaseNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("instance_id must have at most ", kMaxLeaseNameBytes, " bytes"));
  }
  if (options.lease_ttl_ms < 1 || options.lease_ttl_ms > absl::ToInt64Milliseconds(kMaxLeaseTtl)) {
    return absl::InvalidArgumentError(absl::StrCat("lease_ttl_ms (--lease-ttl-ms) must be in [1, ",
                                                   absl::ToInt64Milliseconds(kMaxLeaseTtl),
                                                   "], got ", options.lease_ttl_ms));
  }
  // Every check renews: a ttl of three intervals lets two checks fail (a slow or lost one)
  // before the workers let go of this coordinator's sequences.
  if (options.lease_ttl_ms < 3 * options.worker_check_interval_ms) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_ttl_ms (--lease-ttl-ms) must be >= 3 x worker_check_interval_ms "
                     "(--worker-check-interval-ms): every check renews the lease, so a ttl of ",
                     options.lease_ttl_ms, " ms lets it run out between checks every ",
                     options.worker_check_interval_ms, " ms; raise the ttl to ",
                     3 * options.worker_check_interval_ms, " or check more often"));
  }
  if (options.max_migrations < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_migrations must be >= 0, got ", options.max_migrations));
  }
  if (options.unready_after_timed_out_checks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("unready_after_timed_out_checks must be >= 1, got ",
                     options.unready_after_timed_out_checks));
  }
  if (options.hung_worker_checks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hung_worker_checks must be >= 0, got ", options.hung_worker_checks));
  }
  if (options.max_pending_events < 2) {
    return absl::InvalidArgumentError("max_pending_events must be >= 2");
  }
  if (options.top_k < 1 || options.top_k > kMaxTopK ||
      !(options.target_block_sparsity >= 0 && options.target_block_sparsity < 1) ||
      !(options.exploration_fraction >= 0 && options.exploration_fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("top_k must be in [1, ", kMaxTopK,
                                                   "], target_block_sparsity and "
                                                   "exploration_fraction in [0, 1)"));
  }
  // A decode step's select to one indexer worker carries every running sequence of an attention
  // worker at most: its answer must fit a message (contracts/limits.h) at the largest rows and K.
  if (options.max_running_per_attention < 1 ||
      kSelectResponseFramingBytes + int64_t{options.max_running_per_attention} *
                                        SelectResponseBytesBound(kMaxStepRows, kMaxTopK) >
          kMaxReceiveMessageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_running_per_attention must be in [1, ",
                     (kMaxReceiveMessageBytes - kSelectResponseFramingBytes) /
                         SelectResponseBytesBound(kMaxStepRows, kMaxTopK),
                     "] (a step's selections must fit the ", kMaxReceiveMessageBytes,
                     "-byte message limit), got ", options.max_running_per_attention));
  }
  if (absl::Status ngram = ValidateNgramDraftOptions(options.ngram); !ngram.ok()) {
    return ngram;
  }
  if (!AcceptanceModel::Create(options.acceptance_rate, 0, 0).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("acceptance_rate must be in [0, 1], got ", options.acceptance_rate));
  }
  if (metrics == nullptr) return absl::InvalidArgumentError("metrics are required");
  if (!resolve) return absl::InvalidArgumentError("an address resolver is required");
  if (workers == nullptr) return absl::InvalidArgumentError("a worker client factory is required");
  if (clock == nullptr) return absl::InvalidArgumentError("a clock is required");
  for (const std::vector<std::string>* list :
       {&options.indexer_addresses, &options.attention_addresses, &options.indexer_dns,
        &options.attention_dns}) {
    for (const std::string& address : *list) {
      if (absl::StatusOr<HostPort> parsed = ParseHostPort(address, /*min_port=*/1); !parsed.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("worker address: ", parsed.status().message()));
      }
    }
  }

  SchedulerOptions scheduler_options;
  scheduler_options.num_full_layers = 1;  // set from the first attention worker's GetInfo
  scheduler_options.max_queue = options.max_queue;
  scheduler_options.max_running_per_attention = options.max_running_per_attention;
  scheduler_options.max_queued_per_caller = options.max_queued_per_caller;
  scheduler_options.max_running_per_caller = options.max_running_per_caller;
  scheduler_options.caller_weights = options.caller_weights;
  scheduler_options.retain_finished = options.retain_finished;
  scheduler_options.colocated = options.colocated;
  // Sequence ids drawn at random below 2^62 (unique among those held; across coordinator
  // restarts with high probability), so that a caller who sees one cannot claim the next ones on
  // a worker before the coordinator does. Drawn under the core's mu (every scheduler call is).
  scheduler_options.draw_sequence_id = [gen = std::make_shared<absl::BitGen>()] {
    return absl::Uniform<uint64_t>(*gen, 1, uint64_t{1} << 62);
  };
  auto scheduler = Scheduler::Create(scheduler_options, {}, {});
  if (!scheduler.ok()) return scheduler.status();
  CoordinatorOptions started = options;
  if (started.instance_id.empty()) {
    // Random per engine start: the workers tell this start's lease from an earlier one's.
    absl::BitGen gen;
    started.instance_id = absl::StrCat(absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16),
                                       absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16));
  }
  LogJson("info", "coordinator lease",
          {{"name", started.name},
           {"instance_id", started.instance_id},
           {"lease_ttl_ms", started.lease_ttl_ms},
           {"held_under_lease", !started.run_loops || started.worker_check_interval_ms > 0}});
  auto engine = std::unique_ptr<CoordinatorEngine>(new CoordinatorEngine(
      started, metrics, std::move(workers), *clock, std::move(resolve), *std::move(scheduler)));
  engine->pool_->RefreshWorkers();
  if (options.run_loops && options.worker_check_interval_ms > 0) {
    engine->watch_ = std::thread([pool = engine->pool_.get()] { pool->WatchWorkers(); });
  }
  if (options.run_loops && options.stall_timeout_ms > 0) {
    engine->stall_watch_ =
        std::thread([lifecycle = engine->lifecycle_.get()] { lifecycle->WatchStalledWrites(); });
  }
  return engine;
}

CoordinatorEngine::CoordinatorEngine(const CoordinatorOptions& options, CoordinatorMetrics* metrics,
                                     std::shared_ptr<WorkerClientFactory> workers,
                                     const Clock& clock, AddressResolver resolve,
                                     Scheduler scheduler)
    : core_(std::make_unique<EngineCore>(options, metrics, clock, std::move(scheduler))),
      pool_(std::make_unique<WorkerPool>(core_.get(), std::move(workers), std::move(resolve))),
      decode_(std::make_unique<DecodeLoops>(core_.get(), pool_.get())),
      lifecycle_(std::make_unique<RequestLifecycle>(core_.get(), pool_.get(), decode_.get())) {
  WorkerPool::Hooks hooks;
  hooks.attention_added = [this](int slot) { decode_->AddWorkerLocked(slot); };
  hooks.refreshed = [this](bool any_became_ready) {
    lifecycle_->WorkersRefreshedLocked(any_became_ready);
  };
  hooks.after_refresh = [this](const std::vector<Eviction>& evictions) {
    lifecycle_->AfterRefresh(evictions);
  };
  pool_->SetHooks(std::move(hooks));
  DecodeLoops::Hooks decode_hooks;
  decode_hooks.end = [this](const std::shared_ptr<InFlightRequest>& request,
                            const absl::Status& status, bool completed) {
    lifecycle_->EndSequence(request, status, completed);
  };
  decode_hooks.fail = [this](const std::shared_ptr<InFlightRequest>& request,
                             const absl::Status& status) {
    lifecycle_->FailSequence(request, status);
  };
  decode_->SetHooks(std::move(decode_hooks));
}

CoordinatorEngine::~CoordinatorEngine() { Stop(); }

void CoordinatorEngine::Stop() {
  if (stopped_.exchange(true)) return;
  int num_attention = 0;
  {
    absl::MutexLock lock(&core_->mu);
    core_->stopping = true;
    num_attention = pool_->NumAttentionLocked();
    decode_->WakeAllLocked(num_attention);
    core_->watch_wake.SignalAll();
  }
  if (watch_.joinable()) watch_.join();
  if (stall_watch_.joinable()) stall_watch_.join();
  pool_->WithoutRefreshes([&] {  // no refresh adds a worker from here on
    {
      absl::MutexLock lock(&core_->mu);
      num_attention = pool_->NumAttentionLocked();
    }
    decode_->Join(num_attention);
  });
}

CoordinatorLoad CoordinatorEngine::GetLoad() {
  CoordinatorLoad answer;
  SchedulerLoad load;
  std::vector<bool> indexer_ready;
  std::vector<bool> indexer_retired;
  // Since when no check has reached each indexer (0 where the last one did).
  std::vector<int64_t> indexer_unreached_ms;
  {
    absl::MutexLock lock(&core_->mu);
    const absl::Time now = core_->clock.Now();
    const auto unreached_for_ms = [now](int unreached_checks, absl::Time last_reached) {
      return unreached_checks == 0
                 ? int64_t{0}
                 : std::max<int64_t>(absl::ToInt64Milliseconds(now - last_reached), 1);
    };
    load = core_->scheduler.Load();
    answer.model = pool_->ModelLocked();
    for (int i = 0; i < pool_->NumIndexersLocked(); ++i) {
      const WorkerPool::IndexerWorker& w = pool_->indexer(i);
      indexer_ready.push_back(w.ready);
      indexer_retired.push_back(w.retired);
      indexer_unreached_ms.push_back(unreached_for_ms(w.unreached_checks.load(), w.last_reached));
    }
    for (int j = 0; j < pool_->NumAttentionLocked(); ++j) {
      const WorkerPool::AttentionWorker& w = pool_->attention(j);
      if (w.retired) continue;  // restarted: its new instance has its own entry
      AttentionWorkerLoad worker;
      worker.address = w.address;
      worker.ready = w.ready;
      worker.decoding = decode_->DecodingLocked(j);
      worker.unreached_for_ms = unreached_for_ms(w.unreached_checks.load(), w.last_reached);
      worker.reachable = worker.unreached_for_ms == 0;
      answer.attention_workers.push_back(std::move(worker));
    }
  }
  answer.queued = load.queued;
  answer.running = load.running;
  answer.retained_sequences = load.retained;
  // Ask every indexer the last check reached, ready or not (a draining one still holds what it
  // held), at once, unless the last answers are recent enough and were asked of the same slots.
  // One that did not answer is reported with the coordinator's reservations on it; one the checks
  // do not reach any more with nothing, so that its last load is not shown as if it were current.
  const size_t count = indexer_ready.size();
  std::vector<bool> ask(count);
  for (size_t i = 0; i < count; ++i) ask[i] = !indexer_retired[i] && indexer_unreached_ms[i] == 0;
  const WorkerPool::IndexerLoads answers = pool_->AskIndexerLoads(ask);
  const std::vector<iv1::GetLoadResponse>& loads = answers.loads;
  const std::vector<absl::Status>& statuses = answers.statuses;
  for (size_t i = 0; i < count; ++i) {
    if (indexer_retired[i]) continue;
    IndexerWorkerLoad worker;
    worker.address = pool_->indexer(i).address;
    worker.ready = indexer_ready[i];
    worker.unreached_for_ms = indexer_unreached_ms[i];
    worker.reachable = worker.unreached_for_ms == 0;
    const iv1::GetLoadResponse& indexer_load = loads[i];
    if (!worker.reachable) {
      // Nothing known: its figures stay 0 and it adds nothing to the totals.
    } else if (statuses[i].ok()) {
      worker.cache_blocks_used = indexer_load.used_blocks();
      worker.cache_blocks_capacity = indexer_load.capacity_blocks();
      worker.sequences = static_cast<int32_t>(indexer_load.sequences());
    } else {
      worker.cache_blocks_used = load.indexers[i].used_blocks;
      worker.cache_blocks_capacity = load.indexers[i].capacity_blocks;
      worker.sequences = load.indexers[i].sequences;
    }
    answer.cache_blocks_used += worker.cache_blocks_used;
    answer.cache_blocks_capacity += worker.cache_blocks_capacity;
    answer.indexer_workers.push_back(std::move(worker));
  }
  return answer;
}

absl::Status CoordinatorEngine::Generate(const GenerateSpec& request, const std::string& caller,
                                         absl::string_view traceparent, GenerateStream& stream) {
  return lifecycle_->Generate(request, caller, traceparent, stream);
}

absl::Status CoordinatorEngine::Abort(const std::string& request_id, const std::string& caller) {
  return lifecycle_->Abort(request_id, caller);
}

void CoordinatorEngine::StartDrain() { lifecycle_->StartDrain(); }

void CoordinatorEngine::CheckStalledWrites() { lifecycle_->CheckStalledWrites(); }

absl::StatusOr<int> CoordinatorEngine::StepWorker(const std::string& address) {
  return decode_->StepWorker(address);
}

bool CoordinatorEngine::AwaitDecoding(const std::string& address, int count,
                                      absl::Duration timeout) {
  return decode_->AwaitDecoding(address, count, timeout);
}

bool CoordinatorEngine::AwaitPlacementWaits(int count, absl::Duration timeout) {
  return lifecycle_->AwaitPlacementWaits(count, timeout);
}

void CoordinatorEngine::RefreshWorkers() { pool_->RefreshWorkers(); }

int CoordinatorEngine::RefreshesWaiting() const { return pool_->RefreshesWaiting(); }

void CoordinatorEngine::SetReadinessListener(std::function<void(bool ready)> listener) {
  pool_->SetReadinessListener(std::move(listener));
}

int CoordinatorEngine::num_full_layers() const { return pool_->num_full_layers(); }

std::optional<ServedModel> CoordinatorEngine::model() const { return pool_->model(); }

}  // namespace dsa
