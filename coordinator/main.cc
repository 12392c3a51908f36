// `dsa-coordinator`: the router-facing coordinator binary. Serves dsa.coordinator.v1
// (Generate, Abort, GetLoad) over the attention and indexer workers given by --attention and
// --indexer or found by --attention-dns and --indexer-dns, with grpc.health.v1 ("liveness",
// "readiness": ready while a worker of each kind is), server reflection, Prometheus /metrics and
// the SIGTERM drain (new requests UNAVAILABLE, queued ones failed, running ones finish within
// --shutdown-grace-ms). See docs/services.md "Coordinator".
#include <unistd.h>

#include <array>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/host_port.h"
#include "contracts/limits.h"
#include "coordinator/metrics.h"
#include "coordinator/scheduler.h"
#include "coordinator/service.h"
#include "prometheus/registry.h"
#include "server/flag_file.h"
#include "server/server.h"

namespace {

// "<hostname>:<port of --listen>": the same for every start of this coordinator on this host (or
// pod), distinct for two coordinators on one host. With port 0 (a free one, a new one each
// start) the pid stands in for it: each start is a new owner.
std::string DefaultName(const std::string& listen) {
  std::array<char, 256> host{};
  if (gethostname(host.data(), host.size() - 1) != 0) host = {};
  absl::StatusOr<dsa::HostPort> parsed = dsa::ParseHostPort(listen, /*min_port=*/0);
  const int port = parsed.ok() ? parsed->port : 0;
  if (port == 0) return absl::StrCat(host.data(), ":0-pid", getpid());
  return absl::StrCat(host.data(), ":", port);
}

}  // namespace

int main(int argc, char** argv) {  // NOLINT(bugprone-exception-escape): CLI11 parse errors
                                   // are caught by ParseServerFlags; others end the process.
  dsa::BlockTerminationSignals();
  CLI::App app{
      "dsa-coordinator: the DSA serving front door (admission, prefix-aware placement, continuous "
      "batching, speculative decoding, sessions) over attention and indexer workers"};
  dsa::ServerFlags server_flags = dsa::DefaultServerFlags(dsa::ServerComponent::kCoordinator);
  dsa::AddServerFlags(app, server_flags);
  dsa::CoordinatorOptions options;
  app.add_option("--indexer", options.indexer_addresses,
                 "host:port of an indexer worker (repeat for several)")
      ->check(dsa::HostPortValidator(1, /*allow_empty=*/false));
  app.add_option("--attention", options.attention_addresses,
                 "host:port of an attention worker (repeat for several)")
      ->check(dsa::HostPortValidator(1, /*allow_empty=*/false));
  app.add_option("--indexer-dns", options.indexer_dns,
                 "NAME:PORT of a headless Service: every address NAME resolves to is an indexer "
                 "worker, re-resolved every --worker-check-interval-ms (repeat for several)")
      ->check(dsa::HostPortValidator(1, /*allow_empty=*/false));
  app.add_option("--attention-dns", options.attention_dns,
                 "NAME:PORT of a headless Service of attention workers (as --indexer-dns)")
      ->check(dsa::HostPortValidator(1, /*allow_empty=*/false));
  app.add_option("--worker-check-interval-ms", options.worker_check_interval_ms,
                 "How often the workers are resolved and their readiness checked; 0 = only at "
                 "start")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  std::string name;
  app.add_option("--name", name,
                 "Owner of this coordinator's leases on its workers' sequences: keep it the same "
                 "across restarts (a restart then frees what the last run held at once) and "
                 "distinct between coordinators sharing workers; default "
                 "\"<hostname>:<port of --listen>\"");
  app.add_option("--lease-ttl-ms", options.lease_ttl_ms,
                 "Workers release this coordinator's sequences when it has not renewed its lease "
                 "(every worker check) for this long; in [1, 600000], >= 3 x "
                 "--worker-check-interval-ms")
      ->capture_default_str();
  app.add_option("--worker-check-timeout-ms", options.worker_check_timeout_ms,
                 "Deadline of each check of a worker")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--unready-after-timed-out-checks", options.unready_after_timed_out_checks,
                 "A ready worker leaves placements once this many consecutive checks got no "
                 "answer within --worker-check-timeout-ms (1 = the first); one that refuses the "
                 "connection or answers not ready leaves at once")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--load-cache-ms", options.load_cache_ms,
                 "GetLoad reuses the indexers' loads for this long, and one GetLoad asks them at "
                 "a time (each indexer gets at most one GetLoad per interval); 0 = ask every call")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  dsa::CoordinatorBuckets buckets;
  app.add_option("--ttft-buckets", buckets.time_to_first_token,
                 "Bucket bounds (seconds, increasing) of the time-to-first-token histogram")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--itl-buckets", buckets.inter_token_latency,
                 "Bucket bounds (seconds, increasing) of the inter-token-latency histogram")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--max-queue", options.max_queue,
                 "Requests waiting for admission at most; a full queue refuses with "
                 "RESOURCE_EXHAUSTED")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag(
      "--colocated", options.colocated,
      "Each --attention worker i holds --indexer worker i in its process (dsa-attention "
      "--transport inprocess; list both in the same order): a sequence placed on indexer i "
      "runs on attention worker i");
  app.add_option("--max-running", options.max_running_per_attention,
                 "Running sequences per attention worker at most")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-queued-per-caller", options.max_queued_per_caller,
                 "Requests of one caller (its token or certificate name, else its peer host) "
                 "waiting for admission at most; more are refused with RESOURCE_EXHAUSTED naming "
                 "this limit; -1 = a quarter of --max-queue (at least 1), 0 = no limit")
      ->check(CLI::Range(-1, 1000000))
      ->capture_default_str();
  app.add_option("--max-running-per-caller", options.max_running_per_caller,
                 "Running requests of one caller at most (its further ones wait, other callers' "
                 "go first); -1 = the ready attention workers' slots (--max-running each) less a "
                 "quarter, 0 = no limit")
      ->check(CLI::Range(-1, 1000000))
      ->capture_default_str();
  std::vector<std::string> caller_weights;
  app.add_option("--caller-weight", caller_weights,
                 "NAME=W: the caller's weight in the fair queuing between callers (default 1; a "
                 "caller of weight 2 is admitted twice as often as one of 1 while both wait); "
                 "repeat for several");
  app.add_option("--max-migrations", options.max_migrations,
                 "Times a running request may move off a failed worker to a surviving one "
                 "(re-prefill of its context and generated tokens) before the failure ends it; 0 "
                 "= never")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--hung-worker-checks", options.hung_worker_checks,
                 "A decode step, its commits or a prefill in flight to an attention worker are "
                 "cancelled, and their requests migrate, once this many consecutive checks of the "
                 "worker (one at least during the call) could not reach it (a hung or partitioned "
                 "process); releases wait for such a worker to answer; 0 = never: calls wait for "
                 "their deadlines")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--top-k", options.top_k, "K: slots each selection keeps")
      ->check(CLI::Range(1, dsa::kMaxTopK))
      ->capture_default_str();
  app.add_option("--target-block-sparsity", options.target_block_sparsity,
                 "SPIN rho: fraction of context blocks to skip, in [0, 1)")
      ->check(CLI::Range(0.0, 0.999999))
      ->capture_default_str();
  app.add_option("--exploration-fraction", options.exploration_fraction,
                 "SPIN gamma: fraction of the block budget drawn at random, in [0, 1)")
      ->check(CLI::Range(0.0, 0.999999))
      ->capture_default_str();
  app.add_flag("--all-keep", options.all_keep, "SPIN off: every block scored");
  app.add_option("--acceptance-rate", options.acceptance_rate,
                 "Per-token acceptance probability of the seeded speculative acceptance model")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--seed", options.seed, "Seed of the acceptance draws (mixed with request ids)")
      ->capture_default_str();
  app.add_option("--ngram-min", options.ngram.min_ngram,
                 "A real model's drafts: the shortest n-gram prompt lookup matches (vLLM's "
                 "prompt_lookup_min)")
      ->check(CLI::Range(1, dsa::kMaxNgram))
      ->capture_default_str();
  app.add_option("--ngram-max", options.ngram.max_ngram,
                 "A real model's drafts: the longest n-gram prompt lookup tries first (vLLM's "
                 "prompt_lookup_max), >= --ngram-min")
      ->check(CLI::Range(1, dsa::kMaxNgram))
      ->capture_default_str();
  app.add_option("--retain-finished", options.retain_finished,
                 "Keep finished sequences' index keys as prefix donors while space allows")
      ->capture_default_str();
  app.add_option("--stall-timeout-ms", options.stall_timeout_ms,
                 "End a request whose client has left its events unread this long (frees its "
                 "sequence); 0 = never")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--rpc-timeout-ms", options.rpc_timeout_ms,
                 "Deadline of each DecodeStep, Commit, Release and GetLoad call to a worker")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  std::string auth_tokens_file;
  app.add_option("--auth-tokens-file", auth_tokens_file,
                 "Bearer tokens of the router-facing API, one \"CLIENT TOKEN\" line each: every "
                 "call must carry \"authorization: Bearer TOKEN\" (needs --tls-cert)")
      ->check(CLI::ExistingFile);
  dsa::AddFlagSources(app, "dsa-coordinator");
  if (const int exit_code = dsa::ParseServerFlags(app, argc, argv); exit_code >= 0) {
    return exit_code;
  }

  for (const auto& [bounds, flag] : {std::pair{&buckets.time_to_first_token, "--ttft-buckets"},
                                     std::pair{&buckets.inter_token_latency, "--itl-buckets"}}) {
    if (absl::Status valid = dsa::ValidateBuckets(*bounds, flag); !valid.ok()) {
      std::fprintf(stderr, "%s\n", std::string(valid.message()).c_str());
      return 2;
    }
  }
  if (auto weights = dsa::ParseCallerWeights(caller_weights); weights.ok()) {
    options.caller_weights = *std::move(weights);
  } else {
    std::fprintf(stderr, "--caller-weight: %s\n", std::string(weights.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<dsa::ClientSecurity> worker_security = dsa::ClientSecurityFrom(server_flags.tls);
  if (!worker_security.ok()) {
    std::fprintf(stderr, "%s\n", std::string(worker_security.status().message()).c_str());
    return 2;
  }
  options.worker_security = *worker_security;
  options.name = name.empty() ? DefaultName(server_flags.listen) : name;
  std::shared_ptr<dsa::BearerTokenAuthenticator> tokens;
  if (!auth_tokens_file.empty()) {
    auto loaded = dsa::BearerTokenAuthenticator::Load(auth_tokens_file);
    if (!loaded.ok()) {
      std::fprintf(stderr, "%s\n", std::string(loaded.status().message()).c_str());
      return 2;
    }
    tokens = *loaded;
  }
  auto registry = std::make_shared<prometheus::Registry>();
  dsa::CoordinatorMetrics metrics(*registry, buckets);
  auto service =
      dsa::CoordinatorServiceImpl::Create(options, &metrics, dsa::ResolveDnsAddresses, tokens);
  if (!service.ok()) {
    dsa::LogJson("error", "cannot start the coordinator",
                 {{"status", service.status().ToString()}});
    return 2;
  }
  dsa::ServerSpec spec;
  spec.name = "dsa-coordinator";
  spec.component = dsa::ServerComponent::kCoordinator;
  spec.services = {service->get()};
  spec.registry = registry;
  spec.auth = tokens;
  spec.banner_fields = {{"indexers", options.indexer_addresses},
                        {"attention_workers", options.attention_addresses},
                        {"indexer_dns", options.indexer_dns},
                        {"attention_dns", options.attention_dns},
                        {"max_queue", options.max_queue},
                        {"max_running", options.max_running_per_attention},
                        {"max_queued_per_caller", options.max_queued_per_caller},
                        {"max_running_per_caller", options.max_running_per_caller},
                        {"colocated", options.colocated},
                        {"name", options.name},
                        {"lease_ttl_ms", options.lease_ttl_ms},
                        {"dials_with_tls", options.worker_security.tls()},
                        {"bearer_token_clients", tokens != nullptr ? tokens->size() : 0}};
  spec.watch_readiness = [&service](std::function<void(bool)> set_ready) {
    (*service)->SetReadinessListener(std::move(set_ready));
  };
  spec.on_drain = [&service] { (*service)->StartDrain(); };
  spec.on_stopped = [&service] { (*service)->Stop(); };
  return dsa::RunServer(server_flags, spec);
}
