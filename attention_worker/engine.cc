// The attention worker's engine (see engine.h).
#include "attention_worker/engine.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attention_worker/pattern_attention_model.h"
#include "common/limits.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"

namespace dsa {

namespace {

// Slots of index keys generated and appended as one chunk during Prefill (2 MiB of fp32 keys at
// D = 128); the client splits further where its wire needs it.
constexpr int64_t kPrefillChunkSlots = 4096;

// The indexer caps a layer at 2^31 slots (indexer_service/indexer.h); a longer context can never
// be served, and refusing it here keeps every slot count far from int64 overflow.
constexpr int64_t kMaxContextSlots = (int64_t{1} << 31) - 1;

// A decode step generates its groups' indexer inputs on several threads only with at least this
// many groups a thread (a group of one row is about 0.1-0.2 ms of the pattern model at H = 64).
constexpr int kMinGroupsPerGenerationThread = 4;

// Whether a failed select's status came from the transport (the outcome on the indexer unknown)
// rather than from the indexer refusing the request.
bool IsTransportFailure(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
         code == absl::StatusCode::kCancelled || code == absl::StatusCode::kUnknown ||
         code == absl::StatusCode::kInternal || code == absl::StatusCode::kAborted;
}

// For a select the indexer refused: the number of leading groups it applied, from the status
// payload the transport attaches (kGroupsAppliedPayload); without it, every group counts as
// applied (the safe assumption).
int AppliedGroups(const absl::Status& status, int num_groups) {
  const auto payload = status.GetPayload(kGroupsAppliedPayload);  // absl::optional<absl::Cord>
  int applied = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &applied)) {
    return num_groups;
  }
  return std::clamp(applied, 0, num_groups);
}

// The checks every Prefill passes before anything changes.
// A real model's token ids: `expected` of them, each in [0, vocab); the synthetic model takes none.
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

// The real model's context limit.
absl::Status CheckModelContext(const ModelShape& shape, int64_t slots) {
  if (shape.max_context > 0 && slots > shape.max_context) {
    return absl::ResourceExhaustedError(absl::StrCat("a context of ", slots, " slots is over the ",
                                                     shape.max_context, " of the model ",
                                                     shape.name));
  }
  return absl::OkStatus();
}

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
  const int64_t max_ids = (context + kPrefixBlockSlots - 1) / kPrefixBlockSlots;
  if (static_cast<int64_t>(spec.prefix_block_ids.size()) > max_ids) {
    return absl::InvalidArgumentError(
        absl::StrCat(spec.prefix_block_ids.size(), " prefix block ids for a context of ", context,
                     " slots; at most ceil(context / ", kPrefixBlockSlots, ") = ", max_ids));
  }
  const int64_t prefix_slots = spec.prefix_slots;
  if (prefix_slots < 0 || prefix_slots % 64 != 0 || prefix_slots > context) {
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

// One sequence: its place on the indexer and its length (its KV lives in the backend).
struct AttentionEngine::Sequence {
  std::mutex mutex;  // guards everything below
  uint64_t id = 0;
  bool live = false;   // false while being created and after release (then NOT_FOUND)
  std::string broken;  // non-empty: why the sequence may differ from the indexer's
  std::string indexer_worker;
  std::vector<uint64_t> prefix_block_ids;
  int64_t length = 0;       // committed slots (t of the next step)
  int pending_rows = 0;     // > 0: a step of that many rows awaits Commit
  int64_t kv_slots = 0;     // slots held in the backend (and counted in kv_used_slots_)
  int top_k = 0;            // K of the indexer sequence
  SamplingParams sampling;  // a real model's draws (set by a successful prefill)
};

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

// The state of one decode step: the batch, its indexer requests and their selections.
struct AttentionEngine::StepState {
  struct Member {
    std::shared_ptr<Sequence> sequence;
    int rows = 0;
    int64_t first_position = 0;  // t
    int batch = 0;               // index into batches
    // Per full layer (rank): the selections int32 [rows, top_k] (host), or with the device form
    // their place on the GPU (null until enqueued).
    std::vector<std::vector<int32_t>> selections;
    std::vector<const int32_t*> device_selections;
    std::vector<int> top_k;
    int64_t batch_row = 0;  // the member's first row in its batch's requests
    int step_row = 0;       // the member's first row in the step's ModelStep
    int64_t blocks_scored = 0;
    int64_t blocks_visible = 0;
    int audited_rows = 0;
    double audit_miss_rate_sum = 0;
    std::vector<SequenceStepResult::AuditedRow> audited;
    bool touched = false;  // the indexer may have applied part of this step
  };
  struct Batch {  // the members on one indexer worker
    std::shared_ptr<IndexerClient> client;
    std::vector<int> members;
    // Per full layer (rank): request id once submitted (0 = not submitted), and whether its
    // answer was collected.
    std::vector<uint64_t> request_ids;
    std::vector<bool> collected;
    // The device-resident path (AttentionEngineOptions::device_selects): the requests' form, and
    // per full layer whether its selections are enqueued on the GPU and waited for.
    bool device_form = false;
    int device_top_k = 0;
    int64_t rows = 0;
    std::vector<DeviceSelectSlot> device_slots;
    std::vector<bool> submitted_on_device;
    std::vector<bool> enqueued;
    std::vector<bool> awaited_on_device;
  };
  std::vector<Member> members;  // request order
  std::vector<Batch> batches;
  std::vector<std::unique_lock<std::mutex>> locks;  // the members' locks, increasing id order
  int64_t total_rows = 0;                           // KV slots reserved for the step
  std::vector<double> selection_wait_seconds;       // per model layer
  std::unique_ptr<DeviceStep> device_step;          // when a batch has the device form
  std::unique_ptr<ModelStep> model_step;            // the model's pass over the step's rows
  // Rows attended over device selections, reported to the observer once their host selections
  // are read (the step's end).
  struct Observation {
    size_t member = 0;
    int row = 0;
    int model_layer = 0;
    int attended_layer = 0;
    int full_rank = 0;
    std::vector<float> output;
  };
  std::vector<Observation> observations;
};

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

bool AttentionEngine::UsesDeviceSelects(const std::shared_ptr<IndexerClient>& client,
                                        const std::vector<int>& members, const StepState& step) {
  const int ordinal = model_->device_ordinal();
  if (!options_.device_selects || ordinal < 0 || step.device_step != nullptr) return false;
  if (client->Selections().device_ordinal() != ordinal) return false;
  {
    std::lock_guard<std::mutex> lock(clients_mutex_);
    if (host_only_clients_.contains(client.get())) return false;
  }
  for (int i : members) {  // one K a request: the row stride of its device selections
    if (step.members[i].sequence->top_k != step.members[members[0]].sequence->top_k) return false;
  }
  std::lock_guard<std::mutex> lock(device_selects_mutex_);
  if (!device_selects_tried_) {
    device_selects_tried_ = true;
    device_selects_status_ = model_->EnableDeviceSelects();
  }
  return device_selects_status_.ok();
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
    DSA_RETURN_IF_ERROR(CheckIndexerShape(*client));
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

absl::Status AttentionEngine::PlanStep(std::span<const StepMember> members, StepState& step) {
  if (members.empty()) {
    return absl::InvalidArgumentError("a decode step needs at least one sequence");
  }
  const int num_full = static_cast<int>(schedule_.full_layers().size());
  step.members.resize(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    const StepMember& s = members[i];
    if (s.rows < 1 || s.rows > kMaxStepRows) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s.sequence_id, " asks for ",
                                                     s.rows, " rows; rows must be in 1..",
                                                     kMaxStepRows));
    }
    for (size_t j = 0; j < i; ++j) {
      if (members[j].sequence_id == s.sequence_id) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", s.sequence_id, " appears twice in the step"));
      }
    }
    step.members[i].sequence = FindSequence(s.sequence_id);
    if (step.members[i].sequence == nullptr) {
      return absl::NotFoundError(absl::StrCat("sequence ", s.sequence_id, " not found"));
    }
    step.members[i].rows = s.rows;
    DSA_RETURN_IF_ERROR(ValidateTokens(model_->shape(), s.tokens, s.rows,
                                       absl::StrCat("sequence ", s.sequence_id, "'s step")));
  }
  // Lock the batch in increasing id order (no deadlock with concurrent steps).
  std::vector<int> order(step.members.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return step.members[a].sequence->id < step.members[b].sequence->id;
  });
  step.locks.reserve(order.size());
  for (int i : order) step.locks.emplace_back(step.members[i].sequence->mutex);
  int64_t total_rows = 0;
  for (StepState::Member& m : step.members) {
    const Sequence& s = *m.sequence;
    DSA_RETURN_IF_ERROR(CheckUsable(s, /*check_pending=*/true));
    DSA_RETURN_IF_ERROR(CheckModelContext(model_->shape(), s.length + m.rows));
    m.first_position = s.length;
    m.selections.resize(num_full);
    m.top_k.resize(num_full);
    total_rows += Footprint(m.first_position + m.rows) - Footprint(m.first_position);
  }
  DSA_RETURN_IF_ERROR(ReserveKv(total_rows));
  step.total_rows = total_rows;
  // The model's pass over every row (the synthetic model writes the rows' KV here).
  std::vector<ModelRow> model_rows;
  for (size_t i = 0; i < step.members.size(); ++i) {
    StepState::Member& m = step.members[i];
    m.step_row = static_cast<int>(model_rows.size());
    for (int r = 0; r < m.rows; ++r) {
      model_rows.push_back(ModelRow{m.sequence->id, m.first_position + r,
                                    members[i].tokens.empty() ? -1 : members[i].tokens[r],
                                    m.sequence->sampling});
    }
    m.sequence->kv_slots = m.first_position + m.rows;  // rolled back from here on a failure
  }
  auto model_step = model_->BeginStep(model_rows);
  if (!model_step.ok()) return RollbackStep(model_step.status(), step);
  step.model_step = *std::move(model_step);
  // Batches by indexer worker, in order of first appearance.
  std::map<std::string, int> batch_of;
  for (size_t i = 0; i < step.members.size(); ++i) {
    StepState::Member& m = step.members[i];
    const std::string& address = m.sequence->indexer_worker;
    auto [it, inserted] = batch_of.emplace(address, static_cast<int>(step.batches.size()));
    if (inserted) {
      auto client = GetClient(address);
      if (!client.ok()) return RollbackStep(client.status(), step);
      StepState::Batch batch;
      batch.client = *client;
      batch.request_ids.assign(num_full, 0);
      batch.collected.assign(num_full, false);
      step.batches.push_back(std::move(batch));
    }
    m.batch = it->second;
    StepState::Batch& batch = step.batches[m.batch];
    batch.members.push_back(static_cast<int>(i));
    m.batch_row = batch.rows;
    batch.rows += m.rows;
    m.device_selections.assign(num_full, nullptr);
  }
  // Each layer's select to an indexer worker carries its batch's rows: its answer must fit a
  // message (common/limits.h), or every sequence of the batch would fail at the first layer.
  for (const StepState::Batch& batch : step.batches) {
    int64_t bound = kSelectResponseFramingBytes;
    for (int i : batch.members) {
      bound += SelectResponseBytesBound(step.members[i].rows, step.members[i].sequence->top_k);
    }
    if (bound > kMaxReceiveMessageBytes) {
      return RollbackStep(
          absl::ResourceExhaustedError(absl::StrCat(
              "the step's selections from indexer worker ", batch.client->address(), " could take ",
              bound, " bytes a layer, over the message limit of ", kMaxReceiveMessageBytes,
              " bytes (kMaxReceiveMessageBytes): step fewer sequences")),
          step);
    }
  }
  for (StepState::Batch& batch : step.batches) {
    if (!UsesDeviceSelects(batch.client, batch.members, step)) continue;
    auto device_step = model_->BeginDeviceStep();
    if (!device_step.ok()) break;  // host queries for this step
    step.device_step = *std::move(device_step);
    batch.device_form = true;
    batch.device_top_k = step.members[batch.members[0]].sequence->top_k;
    batch.device_slots.assign(num_full, DeviceSelectSlot{});
    batch.submitted_on_device.assign(num_full, false);
    batch.enqueued.assign(num_full, false);
    batch.awaited_on_device.assign(num_full, false);
  }
  step.selection_wait_seconds.assign(schedule_.num_layers(), 0.0);
  return absl::OkStatus();
}

absl::Status AttentionEngine::RollbackStep(absl::Status status, StepState& step) {
  std::vector<uint64_t> broken;
  for (StepState::Member& m : step.members) {
    if (m.sequence->kv_slots != m.first_position) (void)ResizeKv(*m.sequence, m.first_position);
    if (m.touched) {
      m.sequence->broken =
          absl::StrCat("a decode step at position ", m.first_position,
                       " failed after the indexer applied part of it: ", status.message());
      broken.push_back(m.sequence->id);
    }
  }
  FreeKv(step.total_rows);
  step.total_rows = 0;
  if (broken.empty()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(status.message(), "; sequences ", absl::StrJoin(broken, ", "),
                                   " may have advanced on the indexer and are now broken "
                                   "(release them)"));
}

absl::Status AttentionEngine::SubmitLayer(int f, StepState& step) {
  if (absl::Status s = step.model_step->PrepareIndexerInputs(schedule_.full_layers()[f], f);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("full layer ", f, " indexer inputs: ", s.message()));
  }
  for (size_t b = 0; b < step.batches.size(); ++b) {
    DSA_RETURN_IF_ERROR(SubmitBatchLayer(f, static_cast<int>(b), step));
  }
  return absl::OkStatus();
}

absl::Status AttentionEngine::SubmitBatchLayer(int f, int b, StepState& step) {
  StepState::Batch& batch = step.batches[b];
  const int num_heads = model_->shape().num_heads;
  const int head_dim = model_->shape().head_dim;
  const bool on_device = batch.device_form;
  LayerSelectRequest select;
  select.num_heads = num_heads;
  select.head_dim = head_dim;
  const int num_groups = static_cast<int>(batch.members.size());
  select.groups.resize(num_groups);
  if (on_device) {
    // The queries on the backend's stream; the head weights and new keys (H and D a row) below.
    std::vector<int64_t> positions;
    positions.reserve(batch.rows);
    for (int i : batch.members) {
      const StepState::Member& m = step.members[i];
      for (int r = 0; r < m.rows; ++r) positions.push_back(m.first_position + r);
    }
    auto slot = step.device_step->PrepareSelect(f, positions, batch.device_top_k);
    if (!slot.ok()) {
      return absl::Status(slot.status().code(),
                          absl::StrCat("full layer ", f, " indexer queries on the device: ",
                                       slot.status().message()));
    }
    batch.device_slots[f] = *slot;
    select.device = DeviceSelectBuffers{slot->queries, slot->queries_ready, slot->selections,
                                        batch.device_top_k, slot->selections_ready};
  }
  // The groups' indexer inputs (the synthetic model's pure functions of (layer, positions), or the
  // real model's, computed for every row at PrepareIndexerInputs): on up to prefill_threads
  // threads when the batch is large enough to pay for them.
  std::vector<absl::Status> generated(num_groups);
  const int threads =
      num_groups >= kMinGroupsPerGenerationThread * 2
          ? std::min(options_.prefill_threads, num_groups / kMinGroupsPerGenerationThread)
          : 1;
  ParallelFor(num_groups, threads, [&](int64_t g) {
    const StepState::Member& m = step.members[batch.members[g]];
    SelectRowGroup& group = select.groups[g];
    group.sequence_id = m.sequence->id;
    group.layer = f;
    group.first_position = m.first_position;
    group.num_rows = m.rows;
    if (!on_device) group.queries.resize(static_cast<size_t>(m.rows) * num_heads * head_dim);
    group.head_weights.resize(static_cast<size_t>(m.rows) * num_heads);
    group.new_index_keys.resize(static_cast<size_t>(m.rows) * head_dim);
    generated[g] =
        step.model_step->IndexerInputs(f, m.step_row, m.rows, m.sequence->prefix_block_ids,
                                       group.queries, group.head_weights, group.new_index_keys);
  });
  for (const absl::Status& status : generated) DSA_RETURN_IF_ERROR(status);
  auto id = batch.client->Selections().Submit(std::move(select));
  if (!id.ok()) {
    DropClient(batch.client);
    return absl::Status(id.status().code(),
                        absl::StrCat("indexer worker ", batch.client->address(), ", full layer ", f,
                                     ": ", id.status().message()));
  }
  batch.request_ids[f] = *id;
  if (on_device) batch.submitted_on_device[f] = true;
  return absl::OkStatus();
}

// The device form's half of collecting full layer f: waits (host) until the batch's selections
// are enqueued on the GPU and points its members at them. An indexer that cannot take the form
// gets the layer again with host queries (then collected as any host request). Other errors are
// left to the host answer (Await), which reports them.
absl::Status AttentionEngine::CollectDeviceLayer(int f, int b, StepState& step) {
  StepState::Batch& batch = step.batches[b];
  if (batch.submitted_on_device.empty() || !batch.submitted_on_device[f] || batch.enqueued[f] ||
      batch.collected[f] || batch.request_ids[f] == 0) {
    return absl::OkStatus();
  }
  SelectionTransport& transport = batch.client->Selections();
  const absl::Status enqueued =
      transport.AwaitEnqueued(batch.request_ids[f], Now() + options_.select_timeout);
  if (enqueued.ok()) {
    batch.enqueued[f] = true;
    for (int i : batch.members) {
      StepState::Member& m = step.members[i];
      m.device_selections[f] =
          batch.device_slots[f].selections + static_cast<size_t>(m.batch_row) * batch.device_top_k;
      m.top_k[f] = batch.device_top_k;
    }
    return absl::OkStatus();
  }
  if (enqueued.code() != absl::StatusCode::kUnimplemented) return absl::OkStatus();
  // Refused before anything changed: the answer is that refusal; host queries from now on. Any
  // other answer (a transport that has no AwaitEnqueued, a late success) is not resent.
  auto refused = transport.Await(batch.request_ids[f], Now() + options_.select_timeout);
  if (refused.status().code() != absl::StatusCode::kUnimplemented) {
    batch.collected[f] = true;
    for (int i : batch.members) step.members[i].touched = true;
    return absl::InternalError(
        absl::StrCat("indexer worker ", batch.client->address(),
                     "'s transport said it takes device forms, but could not say when full layer ",
                     f, "'s selections were enqueued: ", enqueued.message()));
  }
  batch.request_ids[f] = 0;
  {
    std::lock_guard<std::mutex> lock(clients_mutex_);
    host_only_clients_[batch.client.get()] = true;
  }
  // Later layers go with host queries too (earlier ones, already enqueued, stay on the device).
  batch.device_form = false;
  batch.submitted_on_device[f] = false;
  return SubmitBatchLayer(f, b, step);
}

absl::Status AttentionEngine::CollectLayer(int f, StepState& step, bool device_answers) {
  absl::Status first_error;
  for (StepState::Batch& batch : step.batches) {
    if (batch.request_ids[f] == 0 || batch.collected[f]) continue;
    // A device-form answer enqueued on the GPU is read by the host at the step's end (its blocks
    // and audit figures), or at once for the observer (its host selections).
    const bool enqueued = !batch.enqueued.empty() && batch.enqueued[f];
    if (enqueued && !device_answers) continue;
    batch.collected[f] = true;
    SelectionTransport& transport = batch.client->Selections();
    auto answer = transport.Await(batch.request_ids[f], Now() + options_.select_timeout);
    const int num_groups = static_cast<int>(batch.members.size());
    if (!answer.ok()) {
      if (answer.status().code() == absl::StatusCode::kDeadlineExceeded) {
        transport.Forget(batch.request_ids[f]);  // a late answer is dropped
        // A device-form select may still run later and write the step's buffers.
        if (!batch.submitted_on_device.empty() && batch.submitted_on_device[f]) {
          step.device_step->Abandon();
        }
      }
      const int applied = IsTransportFailure(answer.status().code())
                              ? num_groups
                              : AppliedGroups(answer.status(), num_groups);
      for (int g = 0; g < applied; ++g) step.members[batch.members[g]].touched = true;
      if (answer.status().code() == absl::StatusCode::kUnavailable) DropClient(batch.client);
      if (first_error.ok()) {
        first_error =
            absl::Status(answer.status().code(),
                         absl::StrCat("indexer worker ", batch.client->address(), ", full layer ",
                                      f, " select: ", answer.status().message()));
      }
      continue;
    }
    for (int i : batch.members) step.members[i].touched = true;
    if (static_cast<int>(answer->groups.size()) != num_groups) {
      if (first_error.ok()) {
        first_error = absl::InternalError(absl::StrCat("indexer worker ", batch.client->address(),
                                                       " answered ", answer->groups.size(),
                                                       " selections for ", num_groups, " groups"));
      }
      continue;
    }
    for (int g = 0; g < num_groups; ++g) {
      StepState::Member& m = step.members[batch.members[g]];
      GroupSelection& selection = answer->groups[g];
      if (selection.num_rows != m.rows || selection.top_k < 1 ||
          selection.selections.size() != static_cast<size_t>(m.rows) * selection.top_k) {
        if (first_error.ok()) {
          first_error = absl::InternalError(
              absl::StrCat("indexer worker ", batch.client->address(), " answered group ", g,
                           " with ", selection.selections.size(), " selection entries for ", m.rows,
                           " rows of K = ", selection.top_k));
        }
        continue;
      }
      if (m.device_selections[f] != nullptr && selection.top_k != m.top_k[f]) {
        if (first_error.ok()) {
          first_error = absl::InternalError(absl::StrCat(
              "indexer worker ", batch.client->address(), " answered group ", g,
              " with K = ", selection.top_k, " but its device selections hold K = ", m.top_k[f]));
        }
        continue;
      }
      m.top_k[f] = selection.top_k;
      m.selections[f] = std::move(selection.selections);
      m.blocks_scored += selection.blocks_scored;
      m.blocks_visible += selection.blocks_visible;
      m.audited_rows += static_cast<int>(selection.audit_miss_rates.size());
      for (double rate : selection.audit_miss_rates) m.audit_miss_rate_sum += rate;
      for (double rate : selection.audit_miss_rates) m.audited.push_back({f, rate});
    }
  }
  return first_error;
}

absl::Status AttentionEngine::AttendLayer(int l, int fs, StepState& step) {
  const int attended = schedule_.AttendedLayer(l);
  // Device selections: the attention stream waits for them on the GPU (once a step and layer).
  for (StepState::Batch& batch : step.batches) {
    if (batch.enqueued.empty() || !batch.enqueued[fs] || batch.awaited_on_device[fs]) continue;
    if (absl::Status s = step.device_step->WaitForSelections(fs); !s.ok()) {
      return absl::InternalError(absl::StrCat("layer ", l, " waiting for the selection of layer ",
                                              attended, " on the GPU: ", s.message()));
    }
    batch.awaited_on_device[fs] = true;
  }
  std::vector<AttentionRowRef> rows;
  std::vector<std::span<const int32_t>> host_selections;  // for the observer
  for (StepState::Member& m : step.members) {
    const int top_k = m.top_k[fs];
    for (int r = 0; r < m.rows; ++r) {
      const std::span<const int32_t> host =
          m.selections[fs].empty()
              ? std::span<const int32_t>()
              : std::span<const int32_t>(m.selections[fs].data() + static_cast<size_t>(r) * top_k,
                                         static_cast<size_t>(top_k));
      if (m.device_selections[fs] != nullptr) {
        rows.push_back(AttentionRowRef{m.sequence->id,
                                       m.first_position + r,
                                       {},
                                       m.device_selections[fs] + static_cast<size_t>(r) * top_k,
                                       top_k});
      } else {
        rows.push_back(AttentionRowRef{m.sequence->id, m.first_position + r, host});
      }
      host_selections.push_back(host);
    }
  }
  std::vector<float> outputs;
  if (options_.observer) outputs.resize(rows.size() * model_->output_values_per_row());
  if (absl::Status s = step.model_step->AttendLayer(l, rows, outputs); !s.ok()) {
    return absl::InternalError(absl::StrCat("layer ", l, " attention over the selection of layer ",
                                            attended, ": ", s.message()));
  }
  if (options_.observer) {
    const auto per_row = static_cast<size_t>(model_->output_values_per_row());
    size_t r = 0;
    for (size_t i = 0; i < step.members.size(); ++i) {
      const StepState::Member& m = step.members[i];
      for (int row = 0; row < m.rows; ++row, ++r) {
        const std::span<const float> output(outputs.data() + r * per_row, per_row);
        if (m.device_selections[fs] == nullptr) {
          options_.observer(AttendedRow{rows[r].sequence_id, l, attended, rows[r].position,
                                        host_selections[r], output});
        } else {
          // Its host selection is read at the step's end (the attention read the device's,
          // ordered by the event alone): reported then.
          step.observations.push_back(StepState::Observation{
              i, row, l, attended, fs, std::vector<float>(output.begin(), output.end())});
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DecodeStepResult> AttentionEngine::DecodeStep(std::span<const StepMember> members) {
  const absl::Time start = Now();
  StepState step;
  DSA_RETURN_IF_ERROR(PlanStep(members, step));
  const int num_full = static_cast<int>(schedule_.full_layers().size());
  // On a failure: collect every answer still outstanding (so we know what was applied).
  // The observer's rows that waited for their host selections (an empty one if it never came).
  auto report_observations = [&] {
    for (const StepState::Observation& o : step.observations) {
      const StepState::Member& m = step.members[o.member];
      const int top_k = m.top_k[o.full_rank];
      const std::vector<int32_t>& selection = m.selections[o.full_rank];
      const std::span<const int32_t> row =
          selection.size() >= static_cast<size_t>(o.row + 1) * top_k
              ? std::span<const int32_t>(selection.data() + static_cast<size_t>(o.row) * top_k,
                                         static_cast<size_t>(top_k))
              : std::span<const int32_t>();
      options_.observer(AttendedRow{m.sequence->id, o.model_layer, o.attended_layer,
                                    m.first_position + o.row, row, o.output});
    }
    step.observations.clear();
  };
  auto fail = [&](absl::Status status) -> absl::Status {
    for (int f = 0; f < num_full; ++f) (void)CollectLayer(f, step, /*device_answers=*/true);
    (void)model_->Synchronize();
    report_observations();
    step.device_step.reset();  // its buffers back to the backend (or abandoned)
    return RollbackStep(std::move(status), step);
  };
  for (int l = 0; l < schedule_.num_layers(); ++l) {
    if (full_rank_[l] >= 0) {
      if (absl::Status s = SubmitLayer(full_rank_[l], step); !s.ok()) return fail(s);
    }
    const int fs = full_rank_[schedule_.AttendedLayer(l)];
    const absl::Time wait_start = Now();
    for (size_t b = 0; b < step.batches.size(); ++b) {
      if (absl::Status s = CollectDeviceLayer(fs, static_cast<int>(b), step); !s.ok()) {
        return fail(s);
      }
    }
    if (absl::Status s = CollectLayer(fs, step, /*device_answers=*/false); !s.ok()) return fail(s);
    step.selection_wait_seconds[l] = absl::ToDoubleSeconds(Now() - wait_start);
    if (absl::Status s = AttendLayer(l, fs, step); !s.ok()) return fail(s);
  }
  // Selections no layer attends (the last k full layers') still have to be collected, and the
  // host answers of those that went to the GPU read.
  for (int f = 0; f < num_full; ++f) {
    for (size_t b = 0; b < step.batches.size(); ++b) {
      if (absl::Status s = CollectDeviceLayer(f, static_cast<int>(b), step); !s.ok()) {
        return fail(s);
      }
    }
    if (absl::Status s = CollectLayer(f, step, /*device_answers=*/true); !s.ok()) return fail(s);
    for (StepState::Batch& batch : step.batches) {
      // Waited for on the GPU too, so that the step's buffers are free once the stream is.
      if (!batch.enqueued.empty() && batch.enqueued[f] && !batch.awaited_on_device[f]) {
        if (absl::Status s = step.device_step->WaitForSelections(f); !s.ok()) return fail(s);
        batch.awaited_on_device[f] = true;
      }
    }
  }
  if (absl::Status s = model_->Synchronize(); !s.ok()) {
    return fail(absl::InternalError(absl::StrCat("the decode step's attention: ", s.message())));
  }
  step.device_step.reset();
  report_observations();
  auto sampled = step.model_step->Finish();
  if (!sampled.ok()) {
    return fail(absl::Status(sampled.status().code(), absl::StrCat("sampling the step's tokens: ",
                                                                   sampled.status().message())));
  }

  DecodeStepResult result;
  result.sequences.reserve(step.members.size());
  for (StepState::Member& m : step.members) {
    Sequence& s = *m.sequence;
    if (m.rows == 1) {
      s.length = m.first_position + 1;
    } else {
      s.pending_rows = m.rows;
    }
    SequenceStepResult& out =
        result.sequences.emplace_back(SequenceStepResult{s.id,
                                                         m.first_position,
                                                         m.blocks_scored,
                                                         m.blocks_visible,
                                                         m.audited_rows,
                                                         m.audit_miss_rate_sum,
                                                         std::move(m.audited),
                                                         {}});
    if (!sampled->empty()) {
      out.sampled_tokens.assign(sampled->begin() + m.step_row,
                                sampled->begin() + m.step_row + m.rows);
    }
  }
  result.selection_wait_seconds = std::move(step.selection_wait_seconds);
  int host_selects = 0;
  for (const StepState::Batch& batch : step.batches) {
    for (bool on_device : batch.submitted_on_device) result.device_selects += on_device;
    for (uint64_t id : batch.request_ids) host_selects += id != 0;
  }
  host_selects -= result.device_selects;
  if (metrics_ != nullptr) metrics_->RecordSelects(host_selects, result.device_selects);
  if (metrics_ != nullptr) {
    metrics_->RecordDecodeStep(absl::ToDoubleSeconds(Now() - start));
    metrics_->RecordSelectionWaits(result.selection_wait_seconds);
  }
  return result;
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
