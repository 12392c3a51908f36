// The attention worker's engine (see engine.h): sequences, KV accounting, indexer clients,
// prefill, commit and release. The decode step is engine_step.cc's.
#include "attention_worker/engine.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attention_worker/engine_internal.h"
#include "attention_worker/pattern_attention_model.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "contracts/layout.h"
#include "contracts/limits.h"

namespace dsa {

namespace engine_internal {

absl::Status ValidateTokens(const ModelShape& shape, std::span<const int32_t> tokens,
                            int64_t expected, absl::string_view what) {
  if (shape.vocab_size == 0) {
    if (tokens.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        what, " carries ", tokens.size(),
        " token ids, but this attention worker runs the synthetic pattern model (no tokens)"));
  }
  if (static_cast<int64_t>(tokens.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat(what, " carries ", tokens.size(),
                                                   " token ids; the model ", shape.name,
                                                   " needs exactly ", expected));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= shape.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(what, " token ", i, " is ", tokens[i],
                                                     ", outside the vocabulary [0, ",
                                                     shape.vocab_size, ") of ", shape.name));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckModelContext(const ModelShape& shape, int64_t slots) {
  if (shape.max_context > 0 && slots > shape.max_context) {
    return absl::ResourceExhaustedError(absl::StrCat("a context of ", slots, " slots is over the ",
                                                     shape.max_context, " of the model ",
                                                     shape.name));
  }
  return absl::OkStatus();
}

bool IsTransportFailure(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
         code == absl::StatusCode::kCancelled || code == absl::StatusCode::kUnknown ||
         code == absl::StatusCode::kInternal || code == absl::StatusCode::kAborted;
}

}  // namespace engine_internal

namespace {

using engine_internal::CheckModelContext;
using engine_internal::IsTransportFailure;
using engine_internal::ValidateTokens;

// Slots of index keys generated and appended as one chunk during Prefill (2 MiB of fp32 keys at
// D = 128); the client splits further where its wire needs it.
constexpr int64_t kPrefillChunkSlots = 4096;

// The indexer caps a layer at 2^31 slots (indexer_service/indexer.h); a longer context can never
// be served, and refusing it here keeps every slot count far from int64 overflow.
constexpr int64_t kMaxContextSlots = (int64_t{1} << 31) - 1;

// The checks every Prefill passes before anything changes.
absl::Status ValidatePrefill(const PrefillSpec& spec, const ModelShape& shape) {
  const int64_t context = spec.context_length;
  if (context < 1) {
    return absl::InvalidArgumentError(absl::StrCat("context_length must be >= 1, got ", context));
  }
  if (context > kMaxContextSlots) {
    return absl::ResourceExhaustedError(
        absl::StrCat("context_length ", context, " is too long: an indexer layer holds at most ",
                     kMaxContextSlots, " slots"));
  }
  const int64_t max_ids = (context + kPrefixBlockTokens - 1) / kPrefixBlockTokens;
  if (static_cast<int64_t>(spec.prefix_block_ids.size()) > max_ids) {
    return absl::InvalidArgumentError(
        absl::StrCat(spec.prefix_block_ids.size(), " prefix block ids for a context of ", context,
                     " slots; at most ceil(context / ", kPrefixBlockTokens, ") = ", max_ids));
  }
  const int64_t prefix_slots = spec.prefix_slots;
  if (prefix_slots < 0 || prefix_slots % kBlockSize != 0 || prefix_slots > context) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_slots must be a multiple of 64 in [0, context_length = ", context,
                     "], got ", prefix_slots));
  }
  if (prefix_slots > 0 && !spec.prefix_source_id.has_value()) {
    return absl::InvalidArgumentError("prefix_slots is set but prefix_source_id is not");
  }
  if (spec.indexer_worker.empty() && !spec.continue_sequence) {
    return absl::InvalidArgumentError("indexer_worker (host:port) is required");
  }
  if (spec.indexer_worker.size() > kMaxAddressBytes) {
    return absl::InvalidArgumentError(absl::StrCat("indexer_worker is ", spec.indexer_worker.size(),
                                                   " bytes, over the ", kMaxAddressBytes,
                                                   "-byte limit (kMaxAddressBytes)"));
  }
  if (!spec.continue_sequence && (spec.top_k < 1 || spec.top_k > kMaxTopK)) {
    return absl::InvalidArgumentError(
        absl::StrCat("settings.top_k must be in [1, ", kMaxTopK, "] (kMaxTopK), got ", spec.top_k));
  }
  if (shape.vocab_size > 0) DSA_RETURN_IF_ERROR(ValidateSamplingParams(spec.sampling));
  DSA_RETURN_IF_ERROR(CheckModelContext(shape, context));
  // A new sequence's tokens are its whole context; a continuation's are counted once its length
  // is known.
  if (!spec.continue_sequence || shape.vocab_size == 0) {
    DSA_RETURN_IF_ERROR(ValidateTokens(shape, spec.tokens, context, "the prefill"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AttentionEngine::CheckUsable(const Sequence& s, bool check_pending) {
  if (!s.live) return absl::NotFoundError(absl::StrCat("sequence ", s.id, " not found"));
  if (!s.broken.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", s.id, " is broken (", s.broken, "); release it"));
  }
  if (check_pending && s.pending_rows > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", s.id, " has a speculative step awaiting Commit"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<AttentionEngine>> AttentionEngine::Create(
    MliSchedule schedule, PatternModel model, std::unique_ptr<AttentionBackend> backend,
    IndexerClientFactory indexer_clients, AttentionEngineOptions options,
    AttentionMetrics* metrics) {
  DSA_ASSIGN_OR_RETURN(std::unique_ptr<PatternAttentionModel> pattern,
                       PatternAttentionModel::Create(std::move(model), std::move(backend)));
  return Create(std::move(schedule), std::move(pattern), std::move(indexer_clients),
                std::move(options), metrics);
}

absl::StatusOr<std::unique_ptr<AttentionEngine>> AttentionEngine::Create(
    MliSchedule schedule, std::unique_ptr<AttentionModel> model,
    IndexerClientFactory indexer_clients, AttentionEngineOptions options,
    AttentionMetrics* metrics) {
  if (model == nullptr) return absl::InvalidArgumentError("no model");
  const int num_full = static_cast<int>(schedule.full_layers().size());
  const ModelShape& shape = model->shape();
  if (shape.indexer_per_model_layer && shape.num_indexer_layers != schedule.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model ", shape.name, " has ", shape.num_indexer_layers, " layers but the schedule ",
        schedule.Pattern(), " has ", schedule.num_layers()));
  }
  if (shape.indexer_per_model_layer && shape.full_layers != schedule.full_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model ", shape.name, " makes index keys for full layers ",
                     absl::StrJoin(shape.full_layers, ","), " but the schedule ",
                     schedule.Pattern(), " has ", absl::StrJoin(schedule.full_layers(), ",")));
  }
  if (!shape.indexer_per_model_layer && shape.num_indexer_layers != num_full) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", shape.name, " model has ", shape.num_indexer_layers, " layers but the schedule ",
        schedule.Pattern(), " has ", num_full, " full layers"));
  }
  if (!indexer_clients) return absl::InvalidArgumentError("no indexer client factory");
  if (options.clock == nullptr) return absl::InvalidArgumentError("no clock");
  if (options.kv_capacity_slots < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_capacity_slots must be >= 0, got ", options.kv_capacity_slots));
  }
  if (options.prefill_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_threads must be >= 1, got ", options.prefill_threads));
  }
  auto engine = std::unique_ptr<AttentionEngine>(
      new AttentionEngine(std::move(schedule), std::move(model), std::move(indexer_clients),
                          std::move(options), metrics));
  engine->UpdateUsageMetrics();
  return engine;
}

AttentionEngine::AttentionEngine(MliSchedule schedule, std::unique_ptr<AttentionModel> model,
                                 IndexerClientFactory indexer_clients,
                                 AttentionEngineOptions options, AttentionMetrics* metrics)
    : schedule_(std::move(schedule)),
      model_(std::move(model)),
      indexer_clients_(std::move(indexer_clients)),
      options_(std::move(options)),
      metrics_(metrics),
      full_rank_(schedule_.num_layers(), -1) {
  for (size_t f = 0; f < schedule_.full_layers().size(); ++f) {
    full_rank_[schedule_.full_layers()[f]] = static_cast<int>(f);
  }
}

AttentionEngine::~AttentionEngine() { CloseIndexerClients(); }

void AttentionEngine::CloseIndexerClients() {
  std::map<std::string, std::shared_ptr<IndexerClient>> clients;
  {
    std::lock_guard<std::mutex> lock(clients_mutex_);
    clients.swap(clients_);
  }
  for (auto& [address, client] : clients) (void)client->Close();
}

absl::StatusOr<std::shared_ptr<IndexerClient>> AttentionEngine::GetClient(
    const std::string& address) {
  if (address.empty()) return absl::InvalidArgumentError("no indexer_worker address");
  {
    std::lock_guard<std::mutex> lock(clients_mutex_);
    auto it = clients_.find(address);
    if (it != clients_.end() && !it->second->DataPlaneEnded()) return it->second;
    if (it != clients_.end()) {  // its connection ended (the indexer restarted): a new client
      host_only_clients_.erase(it->second.get());
      clients_.erase(it);
    }
  }
  // Made outside the lock (a factory may dial), so other indexers' calls never wait for it; when
  // two threads make one at once, the first one stored wins.
  DSA_ASSIGN_OR_RETURN(std::shared_ptr<IndexerClient> client, indexer_clients_(address));
  std::lock_guard<std::mutex> lock(clients_mutex_);
  return clients_.emplace(address, std::move(client)).first->second;
}

void AttentionEngine::DropClient(const std::shared_ptr<IndexerClient>& client) {
  std::lock_guard<std::mutex> lock(clients_mutex_);
  auto it = clients_.find(client->address());
  if (it != clients_.end() && it->second == client) clients_.erase(it);
  host_only_clients_.erase(client.get());
}

int64_t AttentionEngine::Footprint(int64_t num_slots) const {
  const int64_t g = std::max<int64_t>(1, model_->slot_granularity());
  return (num_slots + g - 1) / g * g;
}

absl::Status AttentionEngine::ReserveKv(int64_t num_slots) {
  {
    std::lock_guard<std::mutex> lock(kv_mutex_);
    if (num_slots > options_.kv_capacity_slots - kv_used_slots_) {  // no overflow: used <= cap
      return absl::ResourceExhaustedError(absl::StrCat("KV cache full: ", num_slots,
                                                       " slots needed, ", kv_used_slots_, " of ",
                                                       options_.kv_capacity_slots, " in use"));
    }
    kv_used_slots_ += num_slots;
  }
  UpdateUsageMetrics();
  return absl::OkStatus();
}

void AttentionEngine::FreeKv(int64_t num_slots) {
  {
    std::lock_guard<std::mutex> lock(kv_mutex_);
    kv_used_slots_ -= num_slots;
  }
  UpdateUsageMetrics();
}

absl::Status AttentionEngine::ResizeKv(Sequence& sequence, int64_t num_slots) {
  DSA_RETURN_IF_ERROR(model_->Truncate(sequence.id, num_slots));
  sequence.kv_slots = std::min(sequence.kv_slots, num_slots);
  return absl::OkStatus();
}

void AttentionEngine::UpdateUsageMetrics() {
  if (metrics_ == nullptr) return;
  int64_t used = 0;
  int64_t sequences = 0;
  {
    std::lock_guard<std::mutex> lock(kv_mutex_);
    used = kv_used_slots_;
  }
  {
    std::lock_guard<std::mutex> lock(sequences_mutex_);
    sequences = static_cast<int64_t>(sequences_.size());
  }
  metrics_->SetUsage(used, options_.kv_capacity_slots, sequences);
}

std::shared_ptr<AttentionEngine::Sequence> AttentionEngine::FindSequence(uint64_t sequence_id) {
  std::lock_guard<std::mutex> lock(sequences_mutex_);
  auto it = sequences_.find(sequence_id);
  return it == sequences_.end() ? nullptr : it->second;
}

void AttentionEngine::EraseSequence(uint64_t sequence_id, const Sequence* sequence) {
  {
    std::lock_guard<std::mutex> lock(sequences_mutex_);
    auto it = sequences_.find(sequence_id);
    if (it != sequences_.end() && it->second.get() == sequence) sequences_.erase(it);
  }
  UpdateUsageMetrics();
}

absl::Status AttentionEngine::CheckIndexerShape(IndexerClient& client) {
  DSA_ASSIGN_OR_RETURN(IndexerShape shape, client.GetShape(IndexerDeadline()));
  const ModelShape& model = model_->shape();
  if (shape.num_heads != model.num_heads || shape.head_dim != model.head_dim) {
    return absl::FailedPreconditionError(absl::StrCat(
        "indexer worker ", client.address(), " has H = ", shape.num_heads, ", D = ", shape.head_dim,
        " but this attention worker's model has H = ", model.num_heads, ", D = ", model.head_dim));
  }
  return absl::OkStatus();
}

absl::Status AttentionEngine::AppendKeys(IndexerClient& client, uint64_t sequence_id,
                                         std::span<const uint64_t> prefix_block_ids,
                                         int64_t first_slot, int64_t end_slot) {
  if (end_slot <= first_slot) return absl::OkStatus();
  const int head_dim = model_->shape().head_dim;
  const int num_full = static_cast<int>(schedule_.full_layers().size());
  struct ChunkRange {
    int layer;
    int64_t first_slot;
    int64_t num_slots;
  };
  std::vector<ChunkRange> ranges;
  for (int f = 0; f < num_full; ++f) {
    for (int64_t slot = first_slot; slot < end_slot; slot += kPrefillChunkSlots) {
      ranges.push_back({f, slot, std::min(kPrefillChunkSlots, end_slot - slot)});
    }
  }
  // Generous: the indexer appends at memory speed, this side generates about 1 us a key.
  const int64_t num_keys = (end_slot - first_slot) * num_full;
  std::unique_ptr<IndexKeyAppend> append =
      client.BeginAppend(sequence_id, IndexerDeadline() + absl::Microseconds(20 * num_keys));
  // Chunks are generated `threads` at a time, then written in order.
  const int threads = options_.prefill_threads;
  std::vector<std::vector<float>> keys(threads);
  std::vector<absl::Status> statuses(threads);
  bool write_failed = false;
  absl::Status status;
  for (size_t base = 0; base < ranges.size() && status.ok() && !write_failed; base += threads) {
    const size_t count = std::min<size_t>(threads, ranges.size() - base);
    ParallelFor(static_cast<int64_t>(count), threads, [&](int64_t j) {
      const ChunkRange& range = ranges[base + j];
      keys[j].resize(static_cast<size_t>(range.num_slots * head_dim));
      statuses[j] = model_->IndexKeys(sequence_id, prefix_block_ids, range.layer, range.first_slot,
                                      range.num_slots, keys[j]);
    });
    for (size_t j = 0; j < count; ++j) {
      if (!statuses[j].ok()) {
        status = statuses[j];
        break;
      }
      const ChunkRange& range = ranges[base + j];
      if (!append->Write(range.layer, range.first_slot, keys[j], range.num_slots)) {
        write_failed = true;  // the call ended; Finish says why
        break;
      }
    }
  }
  if (!status.ok()) {
    append->Cancel();  // undoes the chunks already appended
    return status;
  }
  DSA_ASSIGN_OR_RETURN(int64_t appended, append->Finish());
  if (appended != num_keys) {
    return absl::InternalError(absl::StrCat("indexer worker ", client.address(), " appended ",
                                            appended, " keys, expected ", num_keys));
  }
  return absl::OkStatus();
}

AttentionEngineInfo AttentionEngine::GetInfo() {
  AttentionEngineInfo info;
  info.num_model_layers = schedule_.num_layers();
  info.num_full_layers = static_cast<int>(schedule_.full_layers().size());
  info.lag_depth = schedule_.lag_depth();
  const ModelShape& shape = model_->shape();
  info.num_heads = shape.num_heads;
  info.head_dim = shape.head_dim;
  info.model = shape.name;
  info.vocab_size = shape.vocab_size;
  info.eos_token_id = shape.eos_token_id;
  info.max_context = shape.max_context;
  info.kv_capacity_slots = options_.kv_capacity_slots;
  {
    std::lock_guard<std::mutex> lock(kv_mutex_);
    info.kv_used_slots = kv_used_slots_;
  }
  std::lock_guard<std::mutex> lock(sequences_mutex_);
  info.sequences = static_cast<int>(sequences_.size());
  return info;
}

absl::StatusOr<PrefillResult> AttentionEngine::Prefill(const PrefillSpec& spec) {
  const absl::Time start = Now();
  absl::StatusOr<PrefillResult> result =
      spec.continue_sequence ? ContinuePrefill(spec) : NewPrefill(spec);
  if (result.ok() && metrics_ != nullptr)
    metrics_->RecordPrefill(absl::ToDoubleSeconds(Now() - start));
  return result;
}

absl::StatusOr<PrefillResult> AttentionEngine::NewPrefill(const PrefillSpec& spec) {
  DSA_RETURN_IF_ERROR(ValidatePrefill(spec, model_->shape()));
  const uint64_t id = spec.sequence_id;
  const int64_t context = spec.context_length;
  auto sequence = std::make_shared<Sequence>();
  sequence->id = id;
  std::unique_lock<std::mutex> sequence_lock(sequence->mutex);
  {
    std::lock_guard<std::mutex> lock(sequences_mutex_);
    if (sequences_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " already exists"));
    }
    sequences_[id] = sequence;
  }
  // From here on every failure removes what was made.
  bool kv_reserved = false;
  bool indexer_created = false;
  std::shared_ptr<IndexerClient> client;
  std::optional<int32_t> next_token;
  auto run = [&]() -> absl::Status {
    DSA_RETURN_IF_ERROR(ReserveKv(Footprint(context)));
    kv_reserved = true;
    DSA_ASSIGN_OR_RETURN(client, GetClient(spec.indexer_worker));
    absl::Status shape = CheckIndexerShape(*client);
    if (shape.code() == absl::StatusCode::kUnavailable) {
      // A client made before the indexer restarted may still wait out its connection's backoff
      // while the new process listens: a fresh one dials at once. Nothing is on the indexer yet.
      DropClient(client);
      DSA_ASSIGN_OR_RETURN(client, GetClient(spec.indexer_worker));
      shape = CheckIndexerShape(*client);
    }
    DSA_RETURN_IF_ERROR(shape);
    // The KV first (a real model's forward, which also makes the index keys): a model out of
    // memory or refusing the tokens must fail before the indexer holds anything.
    DSA_ASSIGN_OR_RETURN(next_token, model_->Extend(id, 0, context, spec.tokens, spec.sampling));
    sequence->kv_slots = context;
    IndexerSequenceSpec create;
    create.sequence_id = id;
    create.options.num_layers = static_cast<int>(schedule_.full_layers().size());
    create.options.top_k = spec.top_k;
    create.options.spin = spec.spin;
    create.prefix_source_id = spec.prefix_source_id;
    create.prefix_slots = spec.prefix_source_id.has_value() ? spec.prefix_slots : 0;
    create.lease = spec.lease;
    if (absl::Status created = client->CreateSequence(create, IndexerDeadline()); !created.ok()) {
      // A lost answer (deadline, connection) may hide a sequence the indexer did create: release
      // it too (NOT_FOUND there is fine). A refusal created nothing.
      indexer_created = IsTransportFailure(created.code());
      return created;
    }
    indexer_created = true;
    DSA_RETURN_IF_ERROR(AppendKeys(*client, id, spec.prefix_block_ids, spec.prefix_slots, context));
    sequence->prefix_block_ids = spec.prefix_block_ids;
    return absl::OkStatus();
  };
  absl::Status status = run();
  model_->DropIndexKeys(id);
  if (!status.ok()) {
    if (indexer_created) (void)client->Release(id, IndexerDeadline());
    (void)ResizeKv(*sequence, 0);
    if (kv_reserved) FreeKv(Footprint(context));
    EraseSequence(id, sequence.get());
    return status;
  }
  sequence->indexer_worker = spec.indexer_worker;
  sequence->top_k = spec.top_k;
  sequence->sampling = spec.sampling;
  sequence->length = context;
  sequence->live = true;
  UpdateUsageMetrics();
  return PrefillResult{context, context - spec.prefix_slots, next_token};
}

absl::StatusOr<PrefillResult> AttentionEngine::ContinuePrefill(const PrefillSpec& spec) {
  DSA_RETURN_IF_ERROR(ValidatePrefill(spec, model_->shape()));
  const uint64_t id = spec.sequence_id;
  std::shared_ptr<Sequence> sequence = FindSequence(id);
  if (sequence == nullptr) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  std::lock_guard<std::mutex> sequence_lock(sequence->mutex);
  DSA_RETURN_IF_ERROR(CheckUsable(*sequence, /*check_pending=*/true));
  if (spec.prefix_source_id.has_value()) {
    return absl::InvalidArgumentError("continue_sequence cannot take a prefix source");
  }
  if (!spec.indexer_worker.empty() && spec.indexer_worker != sequence->indexer_worker) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", id, " lives on indexer worker ",
                                                   sequence->indexer_worker, ", not ",
                                                   spec.indexer_worker));
  }
  const int64_t old_length = sequence->length;
  const int64_t context = spec.context_length;
  if (context < old_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "context_length ", context, " is shorter than sequence ", id, "'s ", old_length, " slots"));
  }
  if (model_->shape().vocab_size > 0 && context == old_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a continuation of sequence ", id, " on the model ", model_->shape().name,
        " needs at least one new token (the last generated one); context_length is its length ",
        old_length));
  }
  DSA_RETURN_IF_ERROR(
      ValidateTokens(model_->shape(), spec.tokens, context - old_length, "the continuation"));
  const int64_t more = Footprint(context) - Footprint(old_length);
  DSA_RETURN_IF_ERROR(ReserveKv(more));
  std::vector<uint64_t> ids = spec.prefix_block_ids;
  if (ids.empty()) ids = sequence->prefix_block_ids;
  std::optional<int32_t> next_token;
  auto run = [&]() -> absl::Status {
    // The KV first: a model out of memory must fail before the indexer has changed.
    DSA_ASSIGN_OR_RETURN(next_token,
                         model_->Extend(id, old_length, context, spec.tokens, spec.sampling));
    sequence->kv_slots = context;
    DSA_ASSIGN_OR_RETURN(std::shared_ptr<IndexerClient> client,
                         GetClient(sequence->indexer_worker));
    DSA_RETURN_IF_ERROR(client->BeginTurn(id, IndexerDeadline()));
    return AppendKeys(*client, id, ids, old_length, context);
  };
  absl::Status status = run();
  model_->DropIndexKeys(id);
  if (!status.ok()) {
    // Unconditionally: a model that failed after its pass may hold more than kv_slots says.
    (void)ResizeKv(*sequence, old_length);
    FreeKv(more);
    return status;
  }
  sequence->length = context;
  sequence->sampling = spec.sampling;
  sequence->prefix_block_ids = std::move(ids);
  return PrefillResult{context, context - old_length, next_token};
}

absl::Status AttentionEngine::Commit(uint64_t id, int accepted) {
  std::shared_ptr<Sequence> sequence = FindSequence(id);
  if (sequence == nullptr) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  std::lock_guard<std::mutex> lock(sequence->mutex);
  DSA_RETURN_IF_ERROR(CheckUsable(*sequence, /*check_pending=*/false));
  if (sequence->pending_rows == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id, " has no speculative step awaiting Commit"));
  }
  const int draft = sequence->pending_rows - 1;
  if (accepted < 0 || accepted > draft) {
    return absl::OutOfRangeError(
        absl::StrCat("accepted ", accepted, " outside 0..", draft, " for sequence ", id));
  }
  DSA_ASSIGN_OR_RETURN(std::shared_ptr<IndexerClient> client, GetClient(sequence->indexer_worker));
  DSA_RETURN_IF_ERROR(client->Commit(id, accepted, IndexerDeadline()));
  const int64_t new_length = sequence->length + accepted + 1;
  const int64_t dropped = Footprint(sequence->kv_slots) - Footprint(new_length);
  (void)ResizeKv(*sequence, new_length);  // a shrink cannot fail
  FreeKv(dropped);
  sequence->length = new_length;
  sequence->pending_rows = 0;
  return absl::OkStatus();
}

absl::Status AttentionEngine::Release(uint64_t id, bool keep_indexer_sequence) {
  std::shared_ptr<Sequence> sequence = FindSequence(id);
  if (sequence == nullptr) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  std::string address;
  bool pending = false;
  {
    std::lock_guard<std::mutex> lock(sequence->mutex);
    if (!sequence->live) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
    sequence->live = false;
    address = sequence->indexer_worker;
    pending = sequence->pending_rows > 0 && sequence->broken.empty();
    const int64_t slots = Footprint(sequence->kv_slots);
    (void)ResizeKv(*sequence, 0);
    FreeKv(slots);
    EraseSequence(id, sequence.get());
  }
  DSA_ASSIGN_OR_RETURN(std::shared_ptr<IndexerClient> client, GetClient(address));
  if (keep_indexer_sequence) {
    if (!pending) return absl::OkStatus();
    // A kept sequence is a prefix donor, which must not have a step awaiting Commit: keep row 0
    // (the verified token) and drop the drafts.
    absl::Status committed = client->Commit(id, 0, IndexerDeadline());
    if (committed.ok()) return committed;
    return absl::Status(
        committed.code(),
        absl::StrCat("KV of sequence ", id, " dropped, but indexer worker ", address,
                     " did not commit its pending step: ", committed.message()));
  }
  const absl::Status released = client->Release(id, IndexerDeadline());
  if (released.ok() || released.code() == absl::StatusCode::kNotFound) return absl::OkStatus();
  return absl::Status(released.code(),
                      absl::StrCat("KV of sequence ", id, " dropped, but indexer worker ", address,
                                   " did not release it: ", released.message()));
}

}  // namespace dsa
