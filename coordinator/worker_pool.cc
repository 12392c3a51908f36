// The coordinator's worker pool (see worker_pool.h).
#include "coordinator/worker_pool.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/server.h"

namespace dsa {
namespace {

namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;

// A worker's status for a request: CANCELLED from a worker (it cancelled the call, e.g. while
// shutting down) means the worker was lost, so UNAVAILABLE (retryable); other codes unchanged.
absl::Status WorkerStatus(const absl::Status& status, const std::string& address) {
  if (status.code() != absl::StatusCode::kCancelled) return status;
  return absl::UnavailableError(
      absl::StrCat("attention worker ", address, " cancelled the call: ", status.message()));
}

// How long a check waits, after a connection failed, for the worker's channel to reconnect
// before the failure counts: a few of the channels' first backoffs (gRPC adds up to 20 % jitter).
const absl::Duration kConnectConfirmWindow = 5 * kWorkerInitialReconnectBackoff;

}  // namespace

absl::StatusOr<ServedModel> ModelOfAttentionWorker(const av1::GetInfoResponse& info) {
  ServedModel model;
  model.name = info.model().empty() && info.vocab_size() == 0 ? "pattern" : info.model();
  model.vocab_size = info.vocab_size();
  model.max_context = info.max_context();
  if (model.vocab_size < 0 || model.max_context < 0) {
    return absl::InvalidArgumentError(absl::StrCat("it reports vocab_size ", model.vocab_size,
                                                   " and max_context ", model.max_context,
                                                   " (both must be >= 0)"));
  }
  if (model.real()) {
    model.eos_token_id = info.eos_token_id();
    if (model.eos_token_id < -1 || model.eos_token_id >= model.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("it reports eos_token_id ", model.eos_token_id,
                                                     ", outside its vocabulary [0, ",
                                                     model.vocab_size, ") and not -1"));
    }
  }
  return model;
}

bool WorkerUnreached(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable ||
         status.code() == absl::StatusCode::kDeadlineExceeded;
}

WorkerPool::WorkerPool(EngineCore* core, std::shared_ptr<WorkerClientFactory> workers,
                       AddressResolver resolve)
    : core_(core),
      workers_(std::move(workers)),
      resolve_(std::move(resolve)),
      attention_(kMaxWorkersPerKind),
      indexers_(kMaxWorkersPerKind) {
  core_->metrics->SetWorkers(/*attention=*/false, 0, 0);
  core_->metrics->SetWorkers(/*attention=*/true, 0, 0);
}

void WorkerPool::SetHooks(Hooks hooks) { hooks_ = std::move(hooks); }

void WorkerPool::WatchWorkers() {
  while (true) {
    {
      absl::MutexLock lock(&core_->mu);
      const absl::Time until =
          absl::Now() + absl::Milliseconds(core_->options.worker_check_interval_ms);
      while (!core_->stopping && !core_->watch_wake.WaitWithDeadline(&core_->mu, until)) {
      }
      if (core_->stopping) return;
    }
    RefreshWorkers();
  }
}

void WorkerPool::SetReadinessListener(std::function<void(bool ready)> listener) {
  absl::MutexLock refresh(&refresh_mu_);
  readiness_listener_ = std::move(listener);
  bool ready = false;
  {
    absl::MutexLock lock(&core_->mu);
    ready = ReadyLocked();
  }
  told_ready_ = ready;
  if (readiness_listener_) readiness_listener_(ready);
}

int WorkerPool::num_full_layers() const {
  absl::MutexLock lock(&core_->mu);
  return num_full_layers_;
}

std::optional<ServedModel> WorkerPool::model() const {
  absl::MutexLock lock(&core_->mu);
  return model_;
}

bool WorkerPool::ReadyLocked() const {
  return core_->scheduler.ReadyIndexers() > 0 && core_->scheduler.ReadyAttentions() > 0;
}

std::vector<std::string> WorkerPool::WantedAddresses(const std::vector<std::string>& fixed,
                                                     const std::vector<std::string>& names) {
  std::vector<std::string> wanted = fixed;
  for (const std::string& name : names) {
    absl::StatusOr<std::vector<std::string>> resolved = resolve_(name);
    if (resolved.ok()) {
      dns_answers_[name] = *resolved;
      logged_.erase(absl::StrCat("dns ", name));
    } else {
      LogOnce(absl::StrCat("dns ", name), "warn", "cannot resolve workers; keeping the last answer",
              {{"name", name}, {"status", resolved.status().ToString()}});
    }
    const auto& answer = dns_answers_[name];
    wanted.insert(wanted.end(), answer.begin(), answer.end());
  }
  std::vector<std::string> unique;
  for (const std::string& address : wanted) {
    if (std::find(unique.begin(), unique.end(), address) == unique.end()) {
      unique.push_back(address);
    }
  }
  return unique;
}

WorkerPool::Probe WorkerPool::ProbeWorker(const std::string& address, bool attention,
                                          std::shared_ptr<AttentionWorkerClient> attention_client,
                                          std::shared_ptr<IndexerWorkerClient> indexer_client,
                                          bool call_failed) const {
  const absl::Duration timeout = absl::Milliseconds(core_->options.worker_check_timeout_ms);
  Probe probe;
  probe.address = address;
  WorkerClient* client = nullptr;
  if (attention) {
    probe.attention_client =
        attention_client != nullptr ? std::move(attention_client) : workers_->Attention(address);
    client = probe.attention_client.get();
  } else {
    probe.indexer_client =
        indexer_client != nullptr ? std::move(indexer_client) : workers_->Indexer(address);
    client = probe.indexer_client.get();
  }
  auto ask = [&](const WorkerCall& call) {
    return attention ? probe.attention_client->GetInfo(call, &probe.info)
                     : probe.indexer_client->GetLoad(call, &probe.load);
  };
  probe.status = ask({timeout, "", {}});
  if (probe.status.code() == absl::StatusCode::kUnavailable && !call_failed) {
    // Nothing listening counts only once a second try, waiting for the channel's reconnect,
    // agrees: gRPC 1.51 can fail a connect still in progress with another call's errno (gRPC
    // pull request 35064), and one such check would keep a healthy worker out of placements for
    // a whole check interval. A worker that is down costs its check at most the window more;
    // the checks run at once, so a refresh does too. Not after a call to it failed: that failure
    // agrees already, and the migrations waiting on this refresh should not wait longer.
    const absl::Status again = ask({std::min(timeout, kConnectConfirmWindow), "", {}, true});
    if (again.ok()) probe.status = again;
  }
  if (!probe.status.ok()) {
    probe.reason =
        absl::StrCat(attention ? "GetInfo" : "GetLoad", " failed: ", probe.status.message());
    return probe;
  }
  if (core_->LeasesOn()) {
    RenewLease(probe, attention, timeout);
    if (!probe.status.ok() || probe.lease_refused) return probe;
  }
  const WorkerReadiness readiness = client->CheckReadiness(timeout);
  probe.healthy = readiness.ready;
  probe.reason = readiness.reason;
  // A health check that got no answer in time is a lost check, as a GetInfo / GetLoad would be.
  if (readiness.timed_out) probe.status = absl::DeadlineExceededError(readiness.reason);
  return probe;
}

void WorkerPool::RenewLease(Probe& probe, bool attention, absl::Duration timeout) const {
  const WorkerCall call{timeout, "", {}};
  probe.lease_status =
      attention ? probe.attention_client->RenewLease(call, core_->lease, &probe.lease_state)
                : probe.indexer_client->RenewLease(call, core_->lease, &probe.lease_state);
  const absl::Status& renewal = probe.lease_status;
  if (renewal.ok()) {
    probe.leased = true;
    return;
  }
  if (renewal.code() == absl::StatusCode::kUnimplemented) return;  // it holds no leases
  if (WorkerUnreached(renewal)) {
    probe.status = absl::Status(renewal.code(), absl::StrCat("RenewLease: ", renewal.message()));
    probe.reason = absl::StrCat("RenewLease failed: ", renewal.message());
    return;
  }
  probe.lease_refused = true;
  probe.reason =
      renewal.code() == absl::StatusCode::kFailedPrecondition
          ? absl::StrCat("a newer instance of this coordinator (name ", core_->options.name,
                         ") owns its sequences now: ", renewal.message())
          : absl::StrCat("RenewLease failed: ", renewal.ToString());
}

std::string WorkerPool::CheckShapeLocked(const Probe& probe, bool attention) {
  const int64_t heads = attention ? probe.info.num_heads() : probe.load.num_heads();
  const int64_t dim = attention ? probe.info.head_dim() : probe.load.head_dim();
  if (attention && probe.info.num_full_layers() < 1) return "it reports no full layer";
  // The shape of the workers ready now (any one: they all agree).
  int64_t ready_heads = 0;
  int64_t ready_dim = 0;
  int ready_layers = 0;
  for (int j = 0; j < num_attention_; ++j) {
    if (!attention_[j]->ready) continue;
    ready_heads = attention_[j]->num_heads;
    ready_dim = attention_[j]->head_dim;
    ready_layers = attention_[j]->num_full_layers;
  }
  for (int i = 0; i < num_indexers_ && ready_heads == 0; ++i) {
    if (!indexers_[i]->ready) continue;
    ready_heads = indexers_[i]->num_heads;
    ready_dim = indexers_[i]->head_dim;
  }
  if (ready_heads != 0 && (heads != ready_heads || dim != ready_dim)) {
    return absl::StrCat("it has H = ", heads, ", D = ", dim,
                        " but the ready workers have H = ", ready_heads, ", D = ", ready_dim);
  }
  if (!attention) return "";
  if (ready_layers != 0 && probe.info.num_full_layers() != ready_layers) {
    return absl::StrCat("attention workers disagree on the number of full layers: it has ",
                        probe.info.num_full_layers(), ", the ready workers have ", ready_layers);
  }
  // The model: every ready attention worker runs the same (its name, vocabulary, end-of-sequence
  // token and context), and it changes only while nothing is held or queued.
  absl::StatusOr<ServedModel> model = ModelOfAttentionWorker(probe.info);
  if (!model.ok()) return std::string(model.status().message());
  for (int j = 0; j < num_attention_; ++j) {
    if (attention_[j]->ready && attention_[j]->model != *model) {
      return absl::StrCat("attention workers disagree on the model: it runs ", model->ToString(),
                          ", the ready workers run ", attention_[j]->model.ToString());
    }
  }
  if (model_.has_value() && *model_ != *model && !core_->scheduler.Idle()) {
    return absl::StrCat("it runs ", model->ToString(), ", the sequences held or queued were made ",
                        "for ", model_->ToString());
  }
  if (probe.info.num_full_layers() != num_full_layers_) {
    if (absl::Status set = core_->scheduler.SetNumFullLayers(probe.info.num_full_layers());
        !set.ok()) {
      return absl::StrCat("it has ", probe.info.num_full_layers(), " full layers, the sequences ",
                          "held have ", num_full_layers_, ": ", set.message());
    }
    num_full_layers_ = probe.info.num_full_layers();
  }
  if (!model_.has_value() || *model_ != *model) {
    if (model_.has_value()) {
      LogJson(
          "warn", "the model changed",
          {{"from", model_->ToString()}, {"to", model->ToString()}, {"address", probe.address}});
    }
    model_ = *model;
  }
  return "";
}

void WorkerPool::RetireLocked(int slot, bool attention, std::vector<Eviction>* evictions) {
  for (bool kind : {true, false}) {
    if (kind != attention && !core_->options.colocated)
      continue;  // co-located: the pair goes together
    if (kind) {
      attention_[slot]->ready = false;
      attention_[slot]->retired = true;
      attention_[slot]->unreached_checks = 0;  // no longer checked: nothing to cut on
      attention_by_address_.erase(attention_[slot]->address);
      if (auto forgotten = core_->scheduler.RetireAttention(slot); forgotten.ok()) {
        evictions->insert(evictions->end(), forgotten->begin(), forgotten->end());
      }
    } else {
      indexers_[slot]->ready = false;
      indexers_[slot]->retired = true;
      indexers_[slot]->unreached_checks = 0;
      indexer_by_address_.erase(indexers_[slot]->address);
      if (auto forgotten = core_->scheduler.RetireIndexer(slot); forgotten.ok()) {
        evictions->insert(evictions->end(), forgotten->begin(), forgotten->end());
      }
    }
  }
}

void WorkerPool::LogOnce(const std::string& key, const char* level, const char* message,
                         nlohmann::json fields) {
  const std::string text = absl::StrCat(message, " ", fields.dump());
  if (logged_[key] == text) return;
  logged_[key] = text;
  LogJson(level, message, std::move(fields));
}

void WorkerPool::RefreshWorkers() {
  const uint64_t begun_before = refreshes_begun_.load();
  ++refreshes_waiting_;
  absl::MutexLock refresh(&refresh_mu_);
  --refreshes_waiting_;
  // A refresh that began after this call has ended (this one holds the lock now): nothing to add.
  if (refreshes_begun_.load() != begun_before) return;
  ++refreshes_begun_;
  const std::vector<std::string> attention_wanted =
      WantedAddresses(core_->options.attention_addresses, core_->options.attention_dns);
  const std::vector<std::string> indexer_wanted =
      core_->options.colocated
          ? attention_wanted
          : WantedAddresses(core_->options.indexer_addresses, core_->options.indexer_dns);
  // Every wanted or known (not retired) address of each kind, with the client of a known one.
  struct Target {
    std::string address;
    bool attention;
    bool wanted;
    int slot;  // -1: not taken in yet
    // The worker's count of failed calls when its check began: a check that answers clears
    // call_failed only if no call failed while it ran.
    uint64_t call_failures_before;
    bool call_failed;  // a call to it failed since its last answered check, when this one began
    std::shared_ptr<AttentionWorkerClient> attention_client;
    std::shared_ptr<IndexerWorkerClient> indexer_client;
  };
  std::vector<Target> targets;
  {
    absl::MutexLock lock(&core_->mu);
    if (core_->stopping) return;
    for (bool attention : {true, false}) {
      const std::vector<std::string>& wanted = attention ? attention_wanted : indexer_wanted;
      const auto& by_address = attention ? attention_by_address_ : indexer_by_address_;
      auto target_of = [&](const std::string& address, bool is_wanted, int slot) {
        Target target{address, attention, is_wanted, slot, 0, false, nullptr, nullptr};
        if (slot >= 0 && attention) {
          target.attention_client = attention_[slot]->client;
          target.call_failures_before = attention_[slot]->call_failures;
          target.call_failed = attention_[slot]->call_failed;
        }
        if (slot >= 0 && !attention) {
          target.indexer_client = indexers_[slot]->client;
          target.call_failures_before = indexers_[slot]->call_failures;
          target.call_failed = indexers_[slot]->call_failed;
        }
        return target;
      };
      for (const std::string& address : wanted) {
        auto it = by_address.find(address);
        targets.push_back(target_of(address, true, it == by_address.end() ? -1 : it->second));
      }
      for (const auto& [address, slot] : by_address) {
        if (std::find(wanted.begin(), wanted.end(), address) == wanted.end()) {
          targets.push_back(target_of(address, false, slot));
        }
      }
    }
  }
  // Check them all at once: a dead worker costs one timeout, not one each.
  std::vector<Probe> probes(targets.size());
  {
    std::vector<std::thread> checks;
    checks.reserve(targets.size());
    for (size_t t = 0; t < targets.size(); ++t) {
      checks.emplace_back([&, t] {
        probes[t] =
            ProbeWorker(targets[t].address, targets[t].attention, targets[t].attention_client,
                        targets[t].indexer_client, targets[t].call_failed);
      });
    }
    for (std::thread& check : checks) check.join();
  }
  for (size_t t = 0; t < targets.size(); ++t) {
    const Probe& probe = probes[t];
    const char* kind = targets[t].attention ? "attention" : "indexer";
    if (probe.leased && probe.lease_state.superseded_released() > 0) {
      LogJson("info",
              absl::StrCat("released ", probe.lease_state.superseded_released(),
                           " sequences of this coordinator's earlier instance")
                  .c_str(),
              {{"kind", kind}, {"address", probe.address}, {"name", core_->options.name}});
    }
    if (probe.lease_status.code() == absl::StatusCode::kUnimplemented) {
      LogOnce(absl::StrCat("lease ", kind, " ", probe.address), "warn",
              "worker holds no leases: its sequences outlive this coordinator",
              {{"kind", kind}, {"address", probe.address}});
    }
  }
  auto probe_of = [&](const std::string& address, bool attention) -> Probe* {
    for (size_t t = 0; t < targets.size(); ++t) {
      if (targets[t].address == address && targets[t].attention == attention) return &probes[t];
    }
    return nullptr;
  };
  auto instance_of = [](const Probe& p, bool attention) -> const std::string& {
    return attention ? p.info.instance_id() : p.load.instance_id();
  };

  bool ready = false;
  std::vector<Eviction> retire_evictions;  // what retired workers' slots held, released below
  // Indexers retired as restarted in this refresh: their new instance is taken in on probation.
  std::vector<std::string> restarted_indexers;
  {
    absl::MutexLock lock(&core_->mu);
    bool any_became_ready = false;
    // A known worker that answers with another instance id restarted: what the scheduler thinks
    // it holds is gone. Retire its slot; the new instance is taken in below like a new worker.
    for (size_t t = 0; t < targets.size(); ++t) {
      Target& target = targets[t];
      const Probe& probe = probes[t];
      if (target.slot < 0 || !probe.status.ok()) continue;
      const std::string& now = instance_of(probe, target.attention);
      std::string& then = target.attention ? attention_[target.slot]->instance_id
                                           : indexers_[target.slot]->instance_id;
      if (then.empty()) then = now;  // a server that did not say before: nothing to compare
      // The same process, but this coordinator's lease there had run out (it was paused or cut
      // off past the ttl): the worker released everything the lease held, as a restart would.
      const bool lease_expired = probe.leased && !probe.lease_state.renewed();
      if (!lease_expired && (now.empty() || now == then)) continue;
      if (lease_expired && (now.empty() || now == then)) {
        LogJson("warn", "worker's lease expired",
                {{"kind", target.attention ? "attention" : "indexer"},
                 {"address", target.address},
                 {"lease_ttl_ms", core_->options.lease_ttl_ms},
                 {"reason",
                  "this coordinator's lease there was not renewed within its ttl: the worker "
                  "released the sequences it held for it; handled as a restart"}});
      } else {
        LogJson("warn", "worker restarted",
                {{"kind", target.attention ? "attention" : "indexer"},
                 {"address", target.address},
                 {"reason", "its instance id changed: the sequences it held are gone"}});
      }
      const int slot = target.slot;
      if (!target.attention && !core_->options.colocated) {
        restarted_indexers.push_back(target.address);
      }
      RetireLocked(slot, target.attention, &retire_evictions);
      for (Target& other : targets) {  // co-located: the other half of the pair too
        if (other.slot == slot &&
            (other.attention == target.attention || core_->options.colocated)) {
          other.slot = -1;
        }
      }
    }
    // Consecutive lost checks of each known worker; a check that timed out keeps a ready worker
    // ready until unready_after_timed_out_checks of them in a row.
    std::vector<bool> timed_out_tolerated(targets.size(), false);
    for (size_t t = 0; t < targets.size(); ++t) {
      const Target& target = targets[t];
      if (target.slot < 0) continue;
      const Probe& probe = probes[t];
      std::atomic<int>& unreached_checks = target.attention
                                               ? attention_[target.slot]->unreached_checks
                                               : indexers_[target.slot]->unreached_checks;
      bool& call_failed = target.attention ? attention_[target.slot]->call_failed
                                           : indexers_[target.slot]->call_failed;
      const uint64_t call_failures = target.attention ? attention_[target.slot]->call_failures
                                                      : indexers_[target.slot]->call_failures;
      if (WorkerUnreached(probe.status)) {
        ++unreached_checks;
      } else {
        unreached_checks = 0;
        (target.attention ? attention_[target.slot]->last_reached
                          : indexers_[target.slot]->last_reached) = core_->clock.Now();
      }
      // A slow answer alone is tolerated; one after a call to the worker failed is not, nor one
      // that has its calls cut (hung_worker_checks), which a migration off it does not check
      // again.
      const int lost = unreached_checks.load();
      const int hung = core_->options.hung_worker_checks;
      timed_out_tolerated[t] =
          probe.status.code() == absl::StatusCode::kDeadlineExceeded && !call_failed &&
          lost < core_->options.unready_after_timed_out_checks && (hung == 0 || lost < hung);
      if (probe.status.ok() && call_failures == target.call_failures_before) call_failed = false;
    }
    auto tolerated_of = [&](const std::string& address, bool attention) {
      for (size_t t = 0; t < targets.size(); ++t) {
        if (targets[t].address == address && targets[t].attention == attention) {
          return static_cast<bool>(timed_out_tolerated[t]);
        }
      }
      return false;
    };
    int unreached[2] = {0, 0};  // [attention]
    for (size_t t = 0; t < targets.size(); ++t) {
      Target& target = targets[t];
      const Probe& probe = probes[t];
      const char* kind = target.attention ? "attention" : "indexer";
      const std::string key = absl::StrCat(kind, " ", target.address);
      if (target.slot < 0) {  // not taken in yet
        if (!target.wanted) continue;
        if (core_->options.colocated && !target.attention)
          continue;  // taken in with its attention half
        ++unreached[target.attention ? 1 : 0];
        const Probe* indexer_half =
            core_->options.colocated ? probe_of(target.address, false) : nullptr;
        const absl::Status& failed =
            !probe.status.ok() ? probe.status
                               : (indexer_half != nullptr ? indexer_half->status : probe.status);
        if (!failed.ok()) {
          LogOnce(key, "warn", "worker unreachable",
                  {{"kind", kind},
                   {"address", target.address},
                   {"reason", std::string(failed.message())}});
          continue;  // looked at again at the next refresh
        }
        // Taken in only under a lease renewed there, so that no sequence is placed where this
        // coordinator cannot hold it.
        std::string refusal = probe.lease_refused ? probe.reason : "";
        if (refusal.empty() && indexer_half != nullptr && indexer_half->lease_refused) {
          refusal = indexer_half->reason;
        }
        if (refusal.empty()) refusal = CheckShapeLocked(probe, target.attention);
        if (refusal.empty() && indexer_half != nullptr) {
          refusal = CheckShapeLocked(*indexer_half, /*attention=*/false);
        }
        if (refusal.empty() &&
            (target.attention ? num_attention_ : num_indexers_) >= kMaxWorkersPerKind) {
          refusal = absl::StrCat("the coordinator holds ", kMaxWorkersPerKind, " ", kind,
                                 " workers already");
        }
        if (!refusal.empty()) {
          LogOnce(key, "error", "worker refused",
                  {{"kind", kind}, {"address", target.address}, {"reason", refusal}});
          continue;
        }
        auto add_indexer = [&](const Probe& p) -> bool {
          absl::StatusOr<int> slot =
              core_->scheduler.AddIndexer({p.address, p.load.capacity_blocks()});
          if (!slot.ok()) {
            LogOnce(key, "error", "worker refused",
                    {{"kind", "indexer"},
                     {"address", p.address},
                     {"reason", slot.status().ToString()}});
            return false;
          }
          auto worker = std::make_unique<IndexerWorker>();
          worker->address = p.address;
          worker->client = p.indexer_client;
          worker->ready = p.healthy;
          worker->instance_id = p.load.instance_id();
          worker->last_reached = core_->clock.Now();
          worker->num_heads = p.load.num_heads();
          worker->head_dim = p.load.head_dim();
          // The attention workers' connections to the earlier process may not work yet.
          worker->probation = std::find(restarted_indexers.begin(), restarted_indexers.end(),
                                        p.address) != restarted_indexers.end();
          indexers_[*slot] = std::move(worker);
          indexer_by_address_[p.address] = *slot;
          num_indexers_ = *slot + 1;
          (void)core_->scheduler.SetIndexerReady(*slot, p.healthy);
          LogJson("info", "worker taken in",
                  {{"kind", "indexer"},
                   {"address", p.address},
                   {"ready", p.healthy},
                   {"probation", indexers_[*slot]->probation},
                   {"capacity_blocks", p.load.capacity_blocks()}});
          return true;
        };
        if (!target.attention) {
          if (!add_indexer(probe)) continue;
          --unreached[0];
          logged_.erase(key);
          any_became_ready |= probe.healthy;
          continue;
        }
        if (indexer_half != nullptr && !add_indexer(*indexer_half)) continue;
        absl::StatusOr<int> slot =
            core_->scheduler.AddAttention({probe.address, probe.info.kv_capacity_slots()});
        if (!slot.ok()) {
          LogOnce(key, "error", "worker refused",
                  {{"kind", "attention"},
                   {"address", probe.address},
                   {"reason", slot.status().ToString()}});
          continue;
        }
        const bool healthy = probe.healthy && (indexer_half == nullptr || indexer_half->healthy);
        auto worker = std::make_unique<AttentionWorker>();
        worker->address = probe.address;
        worker->client = probe.attention_client;
        worker->ready = healthy;
        worker->instance_id = probe.info.instance_id();
        worker->last_reached = core_->clock.Now();
        worker->model = *model_;  // CheckShapeLocked set it to this worker's
        worker->num_full_layers = probe.info.num_full_layers();
        worker->num_heads = probe.info.num_heads();
        worker->head_dim = probe.info.head_dim();
        attention_[*slot] = std::move(worker);
        attention_by_address_[probe.address] = *slot;
        num_attention_ = *slot + 1;
        (void)core_->scheduler.SetAttentionReady(*slot, healthy);
        if (indexer_half != nullptr) {
          indexers_[*slot]->ready = healthy;
          (void)core_->scheduler.SetIndexerReady(*slot, healthy);
        }
        if (hooks_.attention_added) hooks_.attention_added(*slot);
        LogJson("info", "worker taken in",
                {{"kind", "attention"},
                 {"address", probe.address},
                 {"ready", healthy},
                 {"num_full_layers", probe.info.num_full_layers()},
                 {"kv_capacity_slots", probe.info.kv_capacity_slots()}});
        --unreached[1];
        logged_.erase(key);
        any_became_ready |= healthy;
        continue;
      }
      // A known worker: ready while wanted and healthy (a co-located pair: both halves); a check
      // that timed out, short of unready_after_timed_out_checks in a row, leaves it as it was.
      bool& flag =
          target.attention ? attention_[target.slot]->ready : indexers_[target.slot]->ready;
      const bool tolerated = timed_out_tolerated[t];
      if (tolerated && flag) {
        LogJson("warn", "worker check timed out: still placed on",
                {{"kind", kind},
                 {"address", target.address},
                 {"timed_out_checks", (target.attention ? attention_[target.slot]->unreached_checks
                                                        : indexers_[target.slot]->unreached_checks)
                                          .load()},
                 {"unready_after", core_->options.unready_after_timed_out_checks},
                 {"reason", probe.reason}});
      }
      bool healthy = target.wanted && (tolerated ? flag : probe.healthy);
      std::string reason = target.wanted ? probe.reason : "it left the DNS answer";
      // A worker of a model the coordinator no longer serves (the model changed while it was not
      // ready) takes no new sequence.
      if (healthy && target.attention && model_.has_value() &&
          attention_[target.slot]->model != *model_) {
        healthy = false;
        reason = absl::StrCat("it runs ", attention_[target.slot]->model.ToString(),
                              ", the coordinator now serves ", model_->ToString());
      }
      if (core_->options.colocated) {
        const Probe* other = probe_of(target.address, !target.attention);
        // The other half's timed-out check leaves it as it was, so the pair follows its flag.
        const bool other_tolerated = tolerated_of(target.address, !target.attention);
        const bool other_ready = other_tolerated
                                     ? (target.attention ? indexers_[target.slot]->ready
                                                         : attention_[target.slot]->ready)
                                     : other == nullptr || other->healthy;
        if (!other_ready && healthy) {
          healthy = false;
          reason = other_tolerated ? "its other half is not ready" : other->reason;
        }
      }
      if (flag == healthy) continue;
      flag = healthy;
      if (target.attention) {
        (void)core_->scheduler.SetAttentionReady(target.slot, healthy);
      } else {
        (void)core_->scheduler.SetIndexerReady(target.slot,
                                               healthy && !indexers_[target.slot]->held_back);
      }
      any_became_ready |= healthy;
      if (healthy) {
        LogJson("info", "worker ready", {{"kind", kind}, {"address", target.address}});
      } else {
        LogJson("warn", "worker not ready",
                {{"kind", kind}, {"address", target.address}, {"reason", reason}});
      }
    }
    // Wanted but not taken in (no answer, or refused): not ready. Co-located, a pair is one.
    const int unreached_attention = unreached[1];
    const int unreached_indexers = core_->options.colocated ? unreached[1] : unreached[0];
    any_became_ready |= ReleaseExpiredHoldsLocked();
    if (hooks_.refreshed) hooks_.refreshed(any_became_ready);
    ready = ReadyLocked();
    auto known = [](const auto& workers, int count) {
      int n = 0;
      for (int i = 0; i < count; ++i) n += workers[i]->retired ? 0 : 1;
      return n;
    };
    const int indexers = known(indexers_, num_indexers_);
    const int attention = known(attention_, num_attention_);
    core_->metrics->SetWorkers(/*attention=*/false, core_->scheduler.ReadyIndexers(),
                               indexers - core_->scheduler.ReadyIndexers() + unreached_indexers);
    core_->metrics->SetWorkers(
        /*attention=*/true, core_->scheduler.ReadyAttentions(),
        attention - core_->scheduler.ReadyAttentions() + unreached_attention);
  }
  if (!told_ready_.has_value() || *told_ready_ != ready) {
    told_ready_ = ready;
    if (readiness_listener_) readiness_listener_(ready);
  }
  // What retired workers held, then what failed workers could not release, on those that answer
  // again.
  if (hooks_.after_refresh) hooks_.after_refresh(retire_evictions);
}

void WorkerPool::SetHeldBackLocked(int slot, bool held) {
  IndexerWorker& w = *indexers_[slot];
  if (w.held_back == held) return;
  w.held_back = held;
  if (w.ready && !w.retired) (void)core_->scheduler.SetIndexerReady(slot, !held);
}

bool WorkerPool::OtherIndexerPlaceableLocked(int slot) const {
  for (int i = 0; i < num_indexers_; ++i) {
    const IndexerWorker& w = *indexers_[i];
    if (i != slot && w.ready && !w.retired && !w.held_back) return true;
  }
  return false;
}

WorkerPool::IndexerHold WorkerPool::HoldIndexerLocked(int slot, const absl::Status& why) {
  IndexerWorker& w = *indexers_[slot];
  const absl::Time now = core_->clock.Now();
  const bool was_probing = w.probing;
  w.probing = false;
  if (w.retired) return {now, false};
  if (!was_probing && now < w.held_until) return {w.held_until, !w.held_back};  // in force
  const absl::Duration hold =
      std::min(kMinIndexerHold * (int64_t{1} << std::min(w.holds, 10)), kMaxIndexerHold);
  ++w.holds;
  w.held_until = now + hold;
  SetHeldBackLocked(slot, OtherIndexerPlaceableLocked(slot));
  LogJson("warn", "indexer held back from placements",
          {{"address", w.address},
           {"hold_ms", absl::ToInt64Milliseconds(hold)},
           {"holds", w.holds},
           {"placeable", !w.held_back},
           {"reason",
            absl::StrCat("an attention worker's Prefill could not reach it (its connection to a "
                         "restarted indexer may not work yet): ",
                         why.message())}});
  return {w.held_until, !w.held_back};
}

void WorkerPool::BeginPrefillLocked(int slot) {
  IndexerWorker& w = *indexers_[slot];
  if (!w.probation || w.probing || w.retired) return;
  w.probing = true;
  w.held_until = absl::InfiniteFuture();  // until the probe ends
  SetHeldBackLocked(slot, OtherIndexerPlaceableLocked(slot));
}

bool WorkerPool::EndPrefillLocked(int slot, bool reached) {
  IndexerWorker& w = *indexers_[slot];
  if (!reached && !w.probing) return false;
  const bool was_held = w.held_back;
  w.probing = false;
  w.held_until = absl::InfinitePast();
  if (reached) {
    if (w.holds > 0 || w.probation) {
      LogJson("info", "indexer reached by a Prefill: placements on it resume",
              {{"address", w.address}, {"holds", w.holds}});
    }
    w.holds = 0;
    w.probation = false;
  }
  SetHeldBackLocked(slot, false);
  return was_held && w.ready && !w.retired;
}

bool WorkerPool::ReleaseExpiredHoldsLocked() {
  const absl::Time now = core_->clock.Now();
  bool released = false;
  for (int i = 0; i < num_indexers_; ++i) {
    IndexerWorker& w = *indexers_[i];
    if (!w.held_back || w.probing || now < w.held_until) continue;
    SetHeldBackLocked(i, false);
    released |= w.ready && !w.retired;
  }
  // Nor does a hold outlast the other indexers' readiness: with none left to place on, the held
  // ones take placements again (their requests then wait out the hold instead).
  if (!OtherIndexerPlaceableLocked(-1)) {
    for (int i = 0; i < num_indexers_; ++i) {
      if (!indexers_[i]->held_back) continue;
      SetHeldBackLocked(i, false);
      released |= indexers_[i]->ready && !indexers_[i]->retired;
    }
  }
  return released;
}

bool WorkerPool::KnownUnreachable(const std::atomic<int>& unreached_checks) const {
  return core_->options.hung_worker_checks > 0 &&
         unreached_checks.load() >= core_->options.hung_worker_checks;
}

absl::Status WorkerPool::CallStatus(const AttentionWorker& w, const absl::Status& status,
                                    const char* call, bool cut, bool* hung) const {
  const bool cancelled_by_cut = cut && status.code() == absl::StatusCode::kCancelled;
  if (hung != nullptr) {
    *hung = cancelled_by_cut || status.code() == absl::StatusCode::kDeadlineExceeded;
  }
  if (!cancelled_by_cut) return WorkerStatus(status, w.address);
  return absl::UnavailableError(
      absl::StrCat("attention worker ", w.address, " did not answer ", w.unreached_checks.load(),
                   " consecutive checks while the ", call,
                   " ran (hung or partitioned): it was cancelled (--hung-worker-checks)"));
}

void WorkerPool::WithoutRefreshes(absl::FunctionRef<void()> f) {
  absl::MutexLock refresh(&refresh_mu_);
  f();
}

std::optional<int> WorkerPool::AttentionSlotLocked(const std::string& address) const {
  auto found = attention_by_address_.find(address);
  if (found == attention_by_address_.end()) return std::nullopt;
  return found->second;
}

std::optional<int> WorkerPool::IndexerSlotLocked(const std::string& address) const {
  auto found = indexer_by_address_.find(address);
  if (found == indexer_by_address_.end()) return std::nullopt;
  return found->second;
}

WorkerPool::IndexerLoads WorkerPool::AskIndexerLoads(const std::vector<bool>& ask) {
  const size_t count = ask.size();
  absl::MutexLock loads_lock(&load_mu_);
  CachedLoads& cached = indexer_loads_;
  if (cached.asked_slots != ask ||
      core_->clock.Now() - cached.asked >= absl::Milliseconds(core_->options.load_cache_ms)) {
    cached.asked_slots = ask;
    cached.answers.loads.assign(count, iv1::GetLoadResponse());
    cached.answers.statuses.assign(count, absl::UnavailableError("not asked"));
    const WorkerCall call{absl::Milliseconds(core_->options.worker_check_timeout_ms), "", {}};
    std::vector<std::thread> asks;
    for (size_t i = 0; i < count; ++i) {
      if (!ask[i]) continue;
      asks.emplace_back([&, i] {
        cached.answers.statuses[i] = indexers_[i]->client->GetLoad(call, &cached.answers.loads[i]);
      });
    }
    for (std::thread& ask : asks) ask.join();
    cached.asked = core_->clock.Now();
  }
  return cached.answers;
}

}  // namespace dsa
