// The attention worker service (see service.h).
#include "attention_worker/service.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "attention_worker/sparse_attention.h"
#include "common/philox.h"
#include "common/status_macros.h"
#include "indexer_service/grpc_service.h"
#include "proto/tensor_codec.h"
#include "transport/grpc_stream_transport.h"

namespace dsa {

namespace av1 = ::dsa::attention::v1;
namespace iv1 = ::dsa::indexer::v1;

namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Philox streams of the KV cache and the attention queries (counter word 3, high byte).
constexpr uint32_t kKeyStream = 1;
constexpr uint32_t kValueStream = 2;
constexpr uint32_t kQueryStream = 3;

PhiloxKey KeyOf(uint64_t seed) {
  return PhiloxKey{{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}};
}

// out[j] uniform in [-1, 1), pure in (seed, stream, layer, index).
void UniformVector(uint64_t seed, uint32_t stream, int layer, int64_t index, std::span<float> out) {
  const PhiloxKey key = KeyOf(seed);
  const auto lo = static_cast<uint32_t>(index);
  const auto hi = static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32);
  for (size_t j = 0; j < out.size(); j += 4) {
    const auto group = static_cast<uint32_t>(j / 4);
    const PhiloxCounter words = Philox4x32(
        PhiloxCounter{{lo, hi, static_cast<uint32_t>(layer), (stream << 24) | group}}, key);
    for (size_t w = 0; w < 4 && j + w < out.size(); ++w) {
      out[j + w] = 2.0f * UniformFloat(words.c[w]) - 1.0f;
    }
  }
}

absl::Status FromGrpc(const grpc::Status& status, absl::string_view context) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(context, ": ", status.error_message()));
}

// Runs fn(i) for i in [0, n) on up to `threads` threads (the caller's included).
template <typename Fn>
void ParallelFor(int64_t n, int threads, const Fn& fn) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  if (workers == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int64_t w = 1; w < workers; ++w) {
    pool.emplace_back([&fn, n, w, workers] {
      for (int64_t i = w; i < n; i += workers) fn(i);
    });
  }
  for (int64_t i = 0; i < n; i += workers) fn(i);
  for (std::thread& t : pool) t.join();
}

// Whether a failed select's status came from the transport (the outcome on the indexer unknown)
// rather than from the indexer refusing the request.
bool IsTransportFailure(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
         code == absl::StatusCode::kCancelled || code == absl::StatusCode::kUnknown ||
         code == absl::StatusCode::kInternal || code == absl::StatusCode::kAborted;
}

// For a select the indexer refused: the number of leading groups it applied, from the status
// payload the transport attaches (SelectError.groups_applied); without it, every group counts as
// applied (the safe assumption).
int AppliedGroups(const absl::Status& status, int num_groups) {
  const auto payload = status.GetPayload(kGroupsAppliedPayload);  // absl::optional<absl::Cord>
  int applied = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &applied)) {
    return num_groups;
  }
  return std::clamp(applied, 0, num_groups);
}

}  // namespace

void KvCacheRow(uint64_t seed, int layer, int64_t slot, std::span<float> key_out,
                std::span<float> value_out) {
  UniformVector(seed, kKeyStream, layer, slot, key_out);
  UniformVector(seed, kValueStream, layer, slot, value_out);
}

void AttentionQuery(uint64_t seed, int layer, int64_t position, std::span<float> out) {
  UniformVector(seed, kQueryStream, layer, position, out);
}

absl::Status SequenceIndexKeys(const PatternModel& model,
                               std::span<const uint64_t> prefix_block_ids, int full_layer,
                               int64_t first_slot, int64_t num_slots, std::span<float> out) {
  const int64_t head_dim = model.head_dim();
  if (first_slot < 0 || num_slots < 0 || static_cast<int64_t>(out.size()) != num_slots * head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("bad key range: first_slot ", first_slot,
                                                   ", num_slots ", num_slots, ", out size ",
                                                   out.size()));
  }
  const int64_t prefix_end = kPrefixBlockSlots * static_cast<int64_t>(prefix_block_ids.size());
  const int64_t end = first_slot + num_slots;
  int64_t slot = first_slot;
  while (slot < end) {
    float* dst = out.data() + (slot - first_slot) * head_dim;
    if (slot < prefix_end) {
      const int64_t block = slot / kPrefixBlockSlots;
      const int offset = static_cast<int>(slot % kPrefixBlockSlots);
      const int n = static_cast<int>(std::min<int64_t>(end - slot, kPrefixBlockSlots - offset));
      DSA_RETURN_IF_ERROR(
          model.PrefixBlockIndexKeys(full_layer, prefix_block_ids[block], offset, slot, n,
                                     std::span<float>(dst, static_cast<size_t>(n * head_dim))));
      slot += n;
    } else {
      DSA_RETURN_IF_ERROR(
          model.IndexKeys(full_layer, slot, end - slot,
                          std::span<float>(dst, static_cast<size_t>((end - slot) * head_dim))));
      slot = end;
    }
  }
  return absl::OkStatus();
}

// One sequence: its place on the indexer, its length and its KV cache.
struct AttentionServiceImpl::Sequence {
  std::mutex mutex;  // guards everything below
  uint64_t id = 0;
  bool live = false;   // false while being created and after release (then NOT_FOUND)
  std::string broken;  // non-empty: why the sequence may differ from the indexer's
  std::string indexer_worker;
  std::vector<uint64_t> prefix_block_ids;
  int64_t length = 0;    // committed slots (t of the next step)
  int pending_rows = 0;  // > 0: a step of that many rows awaits Commit
  int64_t kv_slots = 0;  // slots held in keys/values (and counted in kv_used_slots_)
  std::vector<std::vector<float>> keys;    // per model layer: fp32 [kv_slots, kv_dim]
  std::vector<std::vector<float>> values;  // per model layer: fp32 [kv_slots, kv_dim]
};

// The clients of one indexer worker.
struct AttentionServiceImpl::Peer {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<iv1::IndexerService::Stub> stub;
  std::mutex transport_mutex;                      // guards transport
  std::unique_ptr<GrpcStreamTransport> transport;  // created on the first decode step

  SelectionTransport& Transport() {
    std::lock_guard<std::mutex> lock(transport_mutex);
    if (transport == nullptr) transport = std::make_unique<GrpcStreamTransport>(channel);
    return *transport;
  }
};

absl::StatusOr<std::unique_ptr<AttentionServiceImpl>> AttentionServiceImpl::Create(
    MliSchedule schedule, PatternModel model, AttentionWorkerOptions options,
    AttentionMetrics* metrics) {
  const int num_full = static_cast<int>(schedule.full_layers().size());
  if (model.num_layers() != num_full) {
    return absl::InvalidArgumentError(absl::StrCat("the pattern model has ", model.num_layers(),
                                                   " layers but the schedule ", schedule.Pattern(),
                                                   " has ", num_full, " full layers"));
  }
  if (options.kv_dim < 1) {
    return absl::InvalidArgumentError(absl::StrCat("kv_dim must be >= 1, got ", options.kv_dim));
  }
  if (options.attention_heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention_heads must be >= 1, got ", options.attention_heads));
  }
  if (options.kv_capacity_slots < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_capacity_slots must be >= 0, got ", options.kv_capacity_slots));
  }
  if (options.prefill_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_threads must be >= 1, got ", options.prefill_threads));
  }
  auto service = std::unique_ptr<AttentionServiceImpl>(
      new AttentionServiceImpl(std::move(schedule), std::move(model), std::move(options), metrics));
  service->UpdateUsageMetrics();
  return service;
}

AttentionServiceImpl::AttentionServiceImpl(MliSchedule schedule, PatternModel model,
                                           AttentionWorkerOptions options,
                                           AttentionMetrics* metrics)
    : schedule_(std::move(schedule)),
      model_(std::move(model)),
      options_(std::move(options)),
      metrics_(metrics) {}

AttentionServiceImpl::~AttentionServiceImpl() { CloseTransports(); }

void AttentionServiceImpl::CloseTransports() {
  std::map<std::string, std::shared_ptr<Peer>> peers;
  {
    std::lock_guard<std::mutex> lock(peers_mutex_);
    peers.swap(peers_);
  }
  for (auto& [address, peer] : peers) {
    std::lock_guard<std::mutex> lock(peer->transport_mutex);
    if (peer->transport != nullptr) (void)peer->transport->Close();
  }
}

absl::StatusOr<std::shared_ptr<AttentionServiceImpl::Peer>> AttentionServiceImpl::GetPeer(
    const std::string& address) {
  if (address.empty()) return absl::InvalidArgumentError("no indexer_worker address");
  std::lock_guard<std::mutex> lock(peers_mutex_);
  auto it = peers_.find(address);
  if (it != peers_.end()) return it->second;
  auto peer = std::make_shared<Peer>();
  peer->address = address;
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
  peer->channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), arguments);
  peer->stub = iv1::IndexerService::NewStub(peer->channel);
  peers_[address] = peer;
  return peer;
}

void AttentionServiceImpl::DropPeer(const std::shared_ptr<Peer>& peer) {
  std::lock_guard<std::mutex> lock(peers_mutex_);
  auto it = peers_.find(peer->address);
  if (it != peers_.end() && it->second == peer) peers_.erase(it);
}

absl::Status AttentionServiceImpl::ReserveKv(int64_t num_slots) {
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

void AttentionServiceImpl::FreeKv(int64_t num_slots) {
  {
    std::lock_guard<std::mutex> lock(kv_mutex_);
    kv_used_slots_ -= num_slots;
  }
  UpdateUsageMetrics();
}

void AttentionServiceImpl::UpdateUsageMetrics() {
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

std::shared_ptr<AttentionServiceImpl::Sequence> AttentionServiceImpl::FindSequence(
    uint64_t sequence_id) {
  std::lock_guard<std::mutex> lock(sequences_mutex_);
  auto it = sequences_.find(sequence_id);
  return it == sequences_.end() ? nullptr : it->second;
}

void AttentionServiceImpl::EraseSequence(uint64_t sequence_id, const Sequence* sequence) {
  {
    std::lock_guard<std::mutex> lock(sequences_mutex_);
    auto it = sequences_.find(sequence_id);
    if (it != sequences_.end() && it->second.get() == sequence) sequences_.erase(it);
  }
  UpdateUsageMetrics();
}

void AttentionServiceImpl::ResizeKv(Sequence& sequence, int64_t num_slots) const {
  const auto size = static_cast<size_t>(num_slots * options_.kv_dim);
  sequence.keys.resize(schedule_.num_layers());
  sequence.values.resize(schedule_.num_layers());
  for (int l = 0; l < schedule_.num_layers(); ++l) {
    sequence.keys[l].resize(size);
    sequence.values[l].resize(size);
    if (size == 0) {
      sequence.keys[l].shrink_to_fit();
      sequence.values[l].shrink_to_fit();
    }
  }
  sequence.kv_slots = num_slots;
}

void AttentionServiceImpl::FillKv(Sequence& sequence, int64_t first_slot, int64_t end_slot) const {
  const int kv_dim = options_.kv_dim;
  const int64_t num_slots = end_slot - first_slot;
  // Work items: (layer, range of up to 4096 slots).
  constexpr int64_t kSlotsPerItem = 4096;
  const int64_t items_per_layer = (num_slots + kSlotsPerItem - 1) / kSlotsPerItem;
  const int64_t threads = num_slots * schedule_.num_layers() >= 4096 ? options_.prefill_threads : 1;
  ParallelFor(
      items_per_layer * schedule_.num_layers(), static_cast<int>(threads), [&](int64_t item) {
        const int layer = static_cast<int>(item / items_per_layer);
        const int64_t begin = first_slot + (item % items_per_layer) * kSlotsPerItem;
        const int64_t end = std::min(end_slot, begin + kSlotsPerItem);
        float* keys = sequence.keys[layer].data();
        float* values = sequence.values[layer].data();
        for (int64_t slot = begin; slot < end; ++slot) {
          KvCacheRow(options_.seed, layer, slot, std::span<float>(keys + slot * kv_dim, kv_dim),
                     std::span<float>(values + slot * kv_dim, kv_dim));
        }
      });
}

absl::Status AttentionServiceImpl::CheckIndexerShape(const Peer& peer) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.indexer_call_timeout));
  iv1::GetLoadResponse load;
  DSA_RETURN_IF_ERROR(FromGrpc(peer.stub->GetLoad(&context, iv1::GetLoadRequest(), &load),
                               absl::StrCat("indexer worker ", peer.address, ": GetLoad")));
  if (load.num_heads() != model_.num_heads() || load.head_dim() != model_.head_dim()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "indexer worker ", peer.address, " has H = ", load.num_heads(), ", D = ", load.head_dim(),
        " but this attention worker's model has H = ", model_.num_heads(),
        ", D = ", model_.head_dim()));
  }
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::AppendKeys(const Peer& peer, uint64_t sequence_id,
                                              std::span<const uint64_t> prefix_block_ids,
                                              int64_t first_slot, int64_t end_slot) {
  if (end_slot <= first_slot) return absl::OkStatus();
  const int head_dim = model_.head_dim();
  // Chunks of keys stay under the indexer's per-message limit with room for the header fields.
  const int64_t chunk_slots =
      std::max<int64_t>(1, (kMaxAppendChunkBytes - 4096) / (int64_t{4} * head_dim));
  struct ChunkRange {
    int layer;
    int64_t first_slot;
    int64_t num_slots;
  };
  std::vector<ChunkRange> ranges;
  for (int f = 0; f < model_.num_layers(); ++f) {
    for (int64_t slot = first_slot; slot < end_slot; slot += chunk_slots) {
      ranges.push_back({f, slot, std::min(chunk_slots, end_slot - slot)});
    }
  }

  grpc::ClientContext context;
  // Generous: the indexer appends at memory speed, this side generates about 1 us a key.
  const int64_t num_keys = (end_slot - first_slot) * model_.num_layers();
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.indexer_call_timeout +
                                          absl::Microseconds(20 * num_keys)));
  iv1::AppendIndexKeysResponse response;
  auto writer = peer.stub->AppendIndexKeys(&context, &response);
  // Chunks are generated `threads` at a time, then written in order.
  const int threads = options_.prefill_threads;
  std::vector<iv1::AppendIndexKeysRequest> batch(threads);
  std::vector<absl::Status> statuses(threads);
  bool write_failed = false;
  absl::Status status;
  for (size_t base = 0; base < ranges.size() && status.ok() && !write_failed; base += threads) {
    const size_t count = std::min<size_t>(threads, ranges.size() - base);
    ParallelFor(static_cast<int64_t>(count), threads, [&](int64_t j) {
      const ChunkRange& range = ranges[base + j];
      std::vector<float> keys(static_cast<size_t>(range.num_slots * head_dim));
      statuses[j] = SequenceIndexKeys(model_, prefix_block_ids, range.layer, range.first_slot,
                                      range.num_slots, keys);
      iv1::AppendIndexKeysRequest& chunk = batch[j];
      chunk.Clear();
      chunk.set_sequence_id(sequence_id);
      chunk.set_layer(range.layer);
      chunk.set_first_slot(range.first_slot);
      const int64_t shape[] = {range.num_slots, head_dim};
      EncodeFloatTensor(keys, shape, chunk.mutable_keys());
    });
    for (size_t j = 0; j < count; ++j) {
      if (!statuses[j].ok()) {
        status = statuses[j];
        break;
      }
      if (!writer->Write(batch[j])) {
        write_failed = true;  // the call ended; Finish says why
        break;
      }
    }
  }
  if (!status.ok()) {
    context.TryCancel();  // the indexer undoes the chunks of a cancelled call
    (void)writer->Finish();
    return status;
  }
  writer->WritesDone();
  DSA_RETURN_IF_ERROR(FromGrpc(writer->Finish(),
                               absl::StrCat("indexer worker ", peer.address, ": AppendIndexKeys")));
  if (response.keys_appended() != num_keys) {
    return absl::InternalError(absl::StrCat("indexer worker ", peer.address, " appended ",
                                            response.keys_appended(), " keys, expected ",
                                            num_keys));
  }
  return absl::OkStatus();
}

grpc::Status AttentionServiceImpl::GetInfo(grpc::ServerContext* /*context*/,
                                           const av1::GetInfoRequest* /*request*/,
                                           av1::GetInfoResponse* response) {
  response->set_num_model_layers(schedule_.num_layers());
  response->set_num_full_layers(static_cast<int32_t>(schedule_.full_layers().size()));
  response->set_lag_depth(schedule_.lag_depth());
  response->set_num_heads(model_.num_heads());
  response->set_head_dim(model_.head_dim());
  response->set_kv_capacity_slots(options_.kv_capacity_slots);
  {
    std::lock_guard<std::mutex> lock(kv_mutex_);
    response->set_kv_used_slots(kv_used_slots_);
  }
  std::lock_guard<std::mutex> lock(sequences_mutex_);
  response->set_sequences(static_cast<int32_t>(sequences_.size()));
  return grpc::Status::OK;
}

grpc::Status AttentionServiceImpl::Prefill(grpc::ServerContext* /*context*/,
                                           const av1::PrefillRequest* request,
                                           av1::PrefillResponse* response) {
  const Clock::time_point start = Clock::now();
  const absl::Status status = request->continue_sequence() ? ContinuePrefill(*request, response)
                                                           : DoPrefill(*request, response);
  if (status.ok()) {
    response->set_seconds(SecondsSince(start));
    if (metrics_ != nullptr) metrics_->RecordPrefill(response->seconds());
  }
  return ToGrpcStatus(status);
}

namespace {

// The indexer caps a layer at 2^31 slots (indexer_service/indexer.h); a longer context can never
// be served, and refusing it here keeps every slot count far from int64 overflow.
constexpr int64_t kMaxContextSlots = (int64_t{1} << 31) - 1;

// The checks every Prefill request passes before anything changes.
absl::Status ValidatePrefill(const av1::PrefillRequest& request) {
  const int64_t context = request.context_length();
  if (context < 1) {
    return absl::InvalidArgumentError(absl::StrCat("context_length must be >= 1, got ", context));
  }
  if (context > kMaxContextSlots) {
    return absl::ResourceExhaustedError(
        absl::StrCat("context_length ", context, " is too long: an indexer layer holds at most ",
                     kMaxContextSlots, " slots"));
  }
  const int64_t max_ids = (context + kPrefixBlockSlots - 1) / kPrefixBlockSlots;
  if (request.prefix_block_ids_size() > max_ids) {
    return absl::InvalidArgumentError(absl::StrCat(
        request.prefix_block_ids_size(), " prefix block ids for a context of ", context,
        " slots; at most ceil(context / ", kPrefixBlockSlots, ") = ", max_ids));
  }
  const int64_t prefix_slots = request.prefix_slots();
  if (prefix_slots < 0 || prefix_slots % 64 != 0 || prefix_slots > context) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_slots must be a multiple of 64 in [0, context_length = ", context,
                     "], got ", prefix_slots));
  }
  if (prefix_slots > 0 && !request.has_prefix_source_id()) {
    return absl::InvalidArgumentError("prefix_slots is set but prefix_source_id is not");
  }
  if (request.indexer_worker().empty() && !request.continue_sequence()) {
    return absl::InvalidArgumentError("indexer_worker (host:port) is required");
  }
  if (!request.continue_sequence() && request.settings().top_k() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("settings.top_k must be >= 1, got ", request.settings().top_k()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AttentionServiceImpl::DoPrefill(const av1::PrefillRequest& request,
                                             av1::PrefillResponse* response) {
  DSA_RETURN_IF_ERROR(ValidatePrefill(request));
  const uint64_t id = request.sequence_id();
  const int64_t context = request.context_length();
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
  std::shared_ptr<Peer> peer;
  auto run = [&]() -> absl::Status {
    DSA_RETURN_IF_ERROR(ReserveKv(context));
    kv_reserved = true;
    DSA_ASSIGN_OR_RETURN(peer, GetPeer(request.indexer_worker()));
    DSA_RETURN_IF_ERROR(CheckIndexerShape(*peer));
    iv1::CreateSequenceRequest create;
    create.set_sequence_id(id);
    create.set_num_layers(model_.num_layers());
    create.set_top_k(request.settings().top_k());
    *create.mutable_spin() = request.settings().spin();
    if (request.has_prefix_source_id()) {
      create.set_prefix_source_id(request.prefix_source_id());
      create.set_prefix_slots(request.prefix_slots());
    }
    {
      grpc::ClientContext call;
      call.set_deadline(absl::ToChronoTime(absl::Now() + options_.indexer_call_timeout));
      iv1::CreateSequenceResponse created;
      absl::Status created_status =
          FromGrpc(peer->stub->CreateSequence(&call, create, &created),
                   absl::StrCat("indexer worker ", peer->address, ": CreateSequence"));
      if (!created_status.ok()) {
        // A lost answer (deadline, connection) may hide a sequence the indexer did create: release
        // it too (NOT_FOUND there is fine). A refusal created nothing.
        indexer_created = IsTransportFailure(created_status.code());
        return created_status;
      }
    }
    indexer_created = true;
    const std::vector<uint64_t> ids(request.prefix_block_ids().begin(),
                                    request.prefix_block_ids().end());
    DSA_RETURN_IF_ERROR(AppendKeys(*peer, id, ids, request.prefix_slots(), context));
    ResizeKv(*sequence, context);
    FillKv(*sequence, 0, context);
    sequence->prefix_block_ids = ids;
    return absl::OkStatus();
  };
  absl::Status status = run();
  if (!status.ok()) {
    if (indexer_created) {
      grpc::ClientContext call;
      call.set_deadline(absl::ToChronoTime(absl::Now() + options_.indexer_call_timeout));
      iv1::ReleaseRequest release;
      release.set_sequence_id(id);
      iv1::ReleaseResponse released;
      (void)peer->stub->Release(&call, release, &released);
    }
    ResizeKv(*sequence, 0);
    if (kv_reserved) FreeKv(context);
    EraseSequence(id, sequence.get());
    return status;
  }
  sequence->indexer_worker = request.indexer_worker();
  sequence->length = context;
  sequence->live = true;
  response->set_slots(context);
  response->set_slots_appended(context - request.prefix_slots());
  UpdateUsageMetrics();
  return absl::OkStatus();
}

absl::Status AttentionServiceImpl::ContinuePrefill(const av1::PrefillRequest& request,
                                                   av1::PrefillResponse* response) {
  DSA_RETURN_IF_ERROR(ValidatePrefill(request));
  const uint64_t id = request.sequence_id();
  std::shared_ptr<Sequence> sequence = FindSequence(id);
  if (sequence == nullptr) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  std::lock_guard<std::mutex> sequence_lock(sequence->mutex);
  if (!sequence->live) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  if (!sequence->broken.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id, " is broken (", sequence->broken, "); release it"));
  }
  if (sequence->pending_rows > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id, " has a speculative step awaiting Commit"));
  }
  if (request.has_prefix_source_id()) {
    return absl::InvalidArgumentError("continue_sequence cannot take a prefix source");
  }
  if (!request.indexer_worker().empty() && request.indexer_worker() != sequence->indexer_worker) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", id, " lives on indexer worker ",
                                                   sequence->indexer_worker, ", not ",
                                                   request.indexer_worker()));
  }
  const int64_t old_length = sequence->length;
  const int64_t context = request.context_length();
  if (context < old_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "context_length ", context, " is shorter than sequence ", id, "'s ", old_length, " slots"));
  }
  DSA_RETURN_IF_ERROR(ReserveKv(context - old_length));
  std::vector<uint64_t> ids(request.prefix_block_ids().begin(), request.prefix_block_ids().end());
  if (ids.empty()) ids = sequence->prefix_block_ids;
  auto run = [&]() -> absl::Status {
    DSA_ASSIGN_OR_RETURN(std::shared_ptr<Peer> peer, GetPeer(sequence->indexer_worker));
    {
      grpc::ClientContext call;
      call.set_deadline(absl::ToChronoTime(absl::Now() + options_.indexer_call_timeout));
      iv1::BeginTurnRequest begin;
      begin.set_sequence_id(id);
      iv1::BeginTurnResponse begun;
      DSA_RETURN_IF_ERROR(FromGrpc(peer->stub->BeginTurn(&call, begin, &begun),
                                   absl::StrCat("indexer worker ", peer->address, ": BeginTurn")));
    }
    return AppendKeys(*peer, id, ids, old_length, context);
  };
  if (absl::Status status = run(); !status.ok()) {
    FreeKv(context - old_length);
    return status;
  }
  ResizeKv(*sequence, context);
  FillKv(*sequence, old_length, context);
  sequence->length = context;
  sequence->prefix_block_ids = std::move(ids);
  response->set_slots(context);
  response->set_slots_appended(context - old_length);
  return absl::OkStatus();
}

// The state of one decode step: the batch, its indexer requests and their selections.
struct AttentionServiceImpl::StepState {
  struct Member {
    std::shared_ptr<Sequence> sequence;
    int rows = 0;
    int64_t first_position = 0;  // t
    int batch = 0;               // index into batches
    int group = 0;               // its group index in the batch's requests
    // Per full layer (rank): the selections int32 [rows, top_k].
    std::vector<std::vector<int32_t>> selections;
    std::vector<int> top_k;
    int64_t blocks_scored = 0;
    int64_t blocks_visible = 0;
    int audited_rows = 0;
    double audit_miss_rate_sum = 0;
    bool touched = false;  // the indexer may have applied part of this step
  };
  struct Batch {  // the members on one indexer worker
    std::shared_ptr<Peer> peer;
    std::vector<int> members;
    // Per full layer (rank): request id once submitted (0 = not submitted), and whether its
    // answer was collected.
    std::vector<uint64_t> request_ids;
    std::vector<bool> collected;
  };
  std::vector<Member> members;  // request order
  std::vector<Batch> batches;
};

absl::Status AttentionServiceImpl::DoDecodeStep(const av1::DecodeStepRequest& request,
                                                av1::DecodeStepResponse* response) {
  if (request.sequences().empty()) {
    return absl::InvalidArgumentError("a decode step needs at least one sequence");
  }
  const int num_full = model_.num_layers();
  const int num_heads = model_.num_heads();
  const int head_dim = model_.head_dim();
  StepState step;
  step.members.resize(request.sequences_size());
  for (int i = 0; i < request.sequences_size(); ++i) {
    const av1::SequenceStep& s = request.sequences(i);
    if (s.rows() < 1 || s.rows() > 5) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s.sequence_id(), " asks for ",
                                                     s.rows(), " rows; rows must be in 1..5"));
    }
    for (int j = 0; j < i; ++j) {
      if (request.sequences(j).sequence_id() == s.sequence_id()) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", s.sequence_id(), " appears twice in the step"));
      }
    }
    step.members[i].sequence = FindSequence(s.sequence_id());
    if (step.members[i].sequence == nullptr) {
      return absl::NotFoundError(absl::StrCat("sequence ", s.sequence_id(), " not found"));
    }
    step.members[i].rows = s.rows();
  }
  // Lock the batch in increasing id order (no deadlock with concurrent steps).
  std::vector<int> order(step.members.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return step.members[a].sequence->id < step.members[b].sequence->id;
  });
  std::vector<std::unique_lock<std::mutex>> locks;
  locks.reserve(order.size());
  for (int i : order) locks.emplace_back(step.members[i].sequence->mutex);
  int64_t total_rows = 0;
  for (StepState::Member& m : step.members) {
    const Sequence& s = *m.sequence;
    if (!s.live) return absl::NotFoundError(absl::StrCat("sequence ", s.id, " not found"));
    if (!s.broken.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", s.id, " is broken (", s.broken, "); release it"));
    }
    if (s.pending_rows > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", s.id, " has a speculative step awaiting Commit"));
    }
    m.first_position = s.length;
    m.selections.resize(num_full);
    m.top_k.resize(num_full);
    total_rows += m.rows;
  }
  DSA_RETURN_IF_ERROR(ReserveKv(total_rows));
  // KV rows of the new positions, every model layer, first.
  for (StepState::Member& m : step.members) {
    ResizeKv(*m.sequence, m.first_position + m.rows);
    FillKv(*m.sequence, m.first_position, m.first_position + m.rows);
  }

  auto rollback = [&](absl::Status status) -> absl::Status {
    std::vector<uint64_t> broken;
    for (StepState::Member& m : step.members) {
      ResizeKv(*m.sequence, m.first_position);
      if (m.touched) {
        m.sequence->broken =
            absl::StrCat("a decode step at position ", m.first_position,
                         " failed after the indexer applied part of it: ", status.message());
        broken.push_back(m.sequence->id);
      }
    }
    FreeKv(total_rows);
    if (broken.empty()) return status;
    return absl::Status(status.code(),
                        absl::StrCat(status.message(), "; sequences ", absl::StrJoin(broken, ", "),
                                     " may have advanced on the indexer and are now broken "
                                     "(release them)"));
  };

  // Batches by indexer worker, in order of first appearance.
  {
    std::map<std::string, int> batch_of;
    for (size_t i = 0; i < step.members.size(); ++i) {
      StepState::Member& m = step.members[i];
      const std::string& address = m.sequence->indexer_worker;
      auto [it, inserted] = batch_of.emplace(address, static_cast<int>(step.batches.size()));
      if (inserted) {
        auto peer = GetPeer(address);
        if (!peer.ok()) return rollback(peer.status());
        StepState::Batch batch;
        batch.peer = *peer;
        batch.request_ids.assign(num_full, 0);
        batch.collected.assign(num_full, false);
        step.batches.push_back(std::move(batch));
      }
      m.batch = it->second;
      m.group = static_cast<int>(step.batches[m.batch].members.size());
      step.batches[m.batch].members.push_back(static_cast<int>(i));
    }
  }

  // Indexer inputs of full layer f for one batch.
  auto build_request = [&](int f, const StepState::Batch& batch, iv1::SelectRequest* select) {
    for (int i : batch.members) {
      const StepState::Member& m = step.members[i];
      const int rows = m.rows;
      std::vector<float> queries(static_cast<size_t>(rows) * num_heads * head_dim);
      std::vector<float> weights(static_cast<size_t>(rows) * num_heads);
      for (int r = 0; r < rows; ++r) {
        DSA_RETURN_IF_ERROR(model_.IndexerQuery(
            f, m.first_position + r,
            std::span<float>(queries.data() + static_cast<size_t>(r) * num_heads * head_dim,
                             static_cast<size_t>(num_heads) * head_dim),
            std::span<float>(weights.data() + static_cast<size_t>(r) * num_heads, num_heads)));
      }
      std::vector<float> keys(static_cast<size_t>(rows) * head_dim);
      DSA_RETURN_IF_ERROR(
          SequenceIndexKeys(model_, m.sequence->prefix_block_ids, f, m.first_position, rows, keys));
      iv1::RowGroup* group = select->add_groups();
      group->set_sequence_id(m.sequence->id);
      group->set_layer(f);
      group->set_first_position(m.first_position);
      const int64_t query_shape[] = {rows, num_heads, head_dim};
      EncodeFloatTensor(queries, query_shape, group->mutable_queries());
      const int64_t weight_shape[] = {rows, num_heads};
      EncodeFloatTensor(weights, weight_shape, group->mutable_head_weights());
      const int64_t key_shape[] = {rows, head_dim};
      EncodeFloatTensor(keys, key_shape, group->mutable_new_index_keys());
    }
    return absl::OkStatus();
  };

  // Collects full layer f's answer from every batch; marks what the indexer may have applied.
  auto collect = [&](int f) -> absl::Status {
    absl::Status first_error;
    for (StepState::Batch& batch : step.batches) {
      if (batch.request_ids[f] == 0 || batch.collected[f]) continue;
      batch.collected[f] = true;
      auto answer = batch.peer->Transport().Await(batch.request_ids[f],
                                                  absl::Now() + options_.select_timeout);
      const int num_groups = static_cast<int>(batch.members.size());
      if (!answer.ok()) {
        if (answer.status().code() == absl::StatusCode::kDeadlineExceeded) {
          batch.peer->Transport().Forget(batch.request_ids[f]);  // a late answer is dropped
        }
        const int applied = IsTransportFailure(answer.status().code())
                                ? num_groups
                                : AppliedGroups(answer.status(), num_groups);
        for (int g = 0; g < applied; ++g) step.members[batch.members[g]].touched = true;
        if (answer.status().code() == absl::StatusCode::kUnavailable) DropPeer(batch.peer);
        if (first_error.ok()) {
          first_error =
              absl::Status(answer.status().code(),
                           absl::StrCat("indexer worker ", batch.peer->address, ", full layer ", f,
                                        " select: ", answer.status().message()));
        }
        continue;
      }
      for (int i : batch.members) step.members[i].touched = true;
      if (answer->selections_size() != num_groups) {
        if (first_error.ok()) {
          first_error = absl::InternalError(
              absl::StrCat("indexer worker ", batch.peer->address, " answered ",
                           answer->selections_size(), " selections for ", num_groups, " groups"));
        }
        continue;
      }
      for (int g = 0; g < num_groups; ++g) {
        StepState::Member& m = step.members[batch.members[g]];
        const iv1::GroupSelection& selection = answer->selections(g);
        const int64_t shape[] = {m.rows, -1};
        auto values = DecodeInt32Tensor(selection.selections(), shape, "selections");
        if (!values.ok()) {
          if (first_error.ok()) first_error = absl::InternalError(values.status().message());
          continue;
        }
        m.top_k[f] = static_cast<int>(selection.selections().shape(1));
        m.selections[f] = std::move(*values);
        m.blocks_scored += selection.blocks_scored();
        m.blocks_visible += selection.blocks_visible();
        m.audited_rows += selection.audit_miss_rates_size();
        for (double rate : selection.audit_miss_rates()) m.audit_miss_rate_sum += rate;
      }
    }
    return first_error;
  };
  // On a failure: collect every answer still outstanding (so we know what was applied).
  auto fail = [&](absl::Status status) -> absl::Status {
    for (int f = 0; f < num_full; ++f) (void)collect(f);
    return rollback(std::move(status));
  };

  std::vector<int> full_rank(schedule_.num_layers(), -1);
  for (int f = 0; f < num_full; ++f) full_rank[schedule_.full_layers()[f]] = f;

  response->mutable_selection_wait_seconds()->Resize(schedule_.num_layers(), 0.0);
  const SparseAttentionShape shape{options_.attention_heads, options_.kv_dim, options_.kv_dim, 0};
  std::vector<float> query(static_cast<size_t>(options_.attention_heads) * options_.kv_dim);
  std::vector<float> output(query.size());
  for (int l = 0; l < schedule_.num_layers(); ++l) {
    if (full_rank[l] >= 0) {
      const int f = full_rank[l];
      for (StepState::Batch& batch : step.batches) {
        iv1::SelectRequest select;
        if (absl::Status s = build_request(f, batch, &select); !s.ok()) return fail(s);
        auto id = batch.peer->Transport().Submit(std::move(select));
        if (!id.ok()) {
          DropPeer(batch.peer);
          return fail(absl::Status(id.status().code(),
                                   absl::StrCat("indexer worker ", batch.peer->address,
                                                ", full layer ", f, ": ", id.status().message())));
        }
        batch.request_ids[f] = *id;
      }
    }
    const int attended = schedule_.AttendedLayer(l);
    const int fs = full_rank[attended];
    const Clock::time_point wait_start = Clock::now();
    if (absl::Status s = collect(fs); !s.ok()) return fail(s);
    response->set_selection_wait_seconds(l, SecondsSince(wait_start));

    for (StepState::Member& m : step.members) {
      const Sequence& s = *m.sequence;
      const int top_k = m.top_k[fs];
      for (int r = 0; r < m.rows; ++r) {
        const int64_t position = m.first_position + r;
        AttentionQuery(options_.seed, l, position, query);
        const int64_t num_slots = position + 1;
        const auto kv_size = static_cast<size_t>(num_slots * options_.kv_dim);
        const std::span<const int32_t> selection(
            m.selections[fs].data() + static_cast<size_t>(r) * top_k, top_k);
        const absl::Status attended_status = SparseAttention(
            shape, query, std::span<const float>(s.keys[l].data(), kv_size),
            std::span<const float>(s.values[l].data(), kv_size), num_slots, selection, output);
        if (!attended_status.ok()) {
          return fail(absl::InternalError(absl::StrCat("sequence ", s.id, " layer ", l,
                                                       " attention over the selection of layer ",
                                                       attended, ": ", attended_status.message())));
        }
        if (options_.observer) {
          options_.observer(AttendedRow{s.id, l, attended, position, selection, output});
        }
      }
    }
  }
  // Selections no layer attends (the last k full layers') still have to be collected.
  for (int f = 0; f < num_full; ++f) {
    if (absl::Status s = collect(f); !s.ok()) return fail(s);
  }

  for (StepState::Member& m : step.members) {
    Sequence& s = *m.sequence;
    if (m.rows == 1) {
      s.length = m.first_position + 1;
    } else {
      s.pending_rows = m.rows;
    }
    av1::SequenceStepResult* result = response->add_sequences();
    result->set_sequence_id(s.id);
    result->set_first_position(m.first_position);
    result->set_blocks_scored(m.blocks_scored);
    result->set_blocks_visible(m.blocks_visible);
    result->set_audited_rows(m.audited_rows);
    result->set_audit_miss_rate_sum(m.audit_miss_rate_sum);
  }
  return absl::OkStatus();
}

grpc::Status AttentionServiceImpl::DecodeStep(grpc::ServerContext* /*context*/,
                                              const av1::DecodeStepRequest* request,
                                              av1::DecodeStepResponse* response) {
  const Clock::time_point start = Clock::now();
  const absl::Status status = DoDecodeStep(*request, response);
  if (!status.ok()) {
    response->Clear();
    return ToGrpcStatus(status);
  }
  response->set_seconds(SecondsSince(start));
  if (metrics_ != nullptr) {
    metrics_->RecordDecodeStep(response->seconds());
    metrics_->RecordSelectionWaits(std::vector<double>(response->selection_wait_seconds().begin(),
                                                       response->selection_wait_seconds().end()));
  }
  return grpc::Status::OK;
}

absl::Status AttentionServiceImpl::DoCommit(const av1::CommitRequest& request) {
  const uint64_t id = request.sequence_id();
  std::shared_ptr<Sequence> sequence = FindSequence(id);
  if (sequence == nullptr) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  std::lock_guard<std::mutex> lock(sequence->mutex);
  if (!sequence->live) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  if (!sequence->broken.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id, " is broken (", sequence->broken, "); release it"));
  }
  if (sequence->pending_rows == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id, " has no speculative step awaiting Commit"));
  }
  const int draft = sequence->pending_rows - 1;
  if (request.accepted() < 0 || request.accepted() > draft) {
    return absl::OutOfRangeError(
        absl::StrCat("accepted ", request.accepted(), " outside 0..", draft, " for sequence ", id));
  }
  DSA_ASSIGN_OR_RETURN(std::shared_ptr<Peer> peer, GetPeer(sequence->indexer_worker));
  {
    grpc::ClientContext call;
    call.set_deadline(absl::ToChronoTime(absl::Now() + options_.indexer_call_timeout));
    iv1::CommitRequest commit;
    commit.set_sequence_id(id);
    commit.set_accepted(request.accepted());
    iv1::CommitResponse committed;
    DSA_RETURN_IF_ERROR(FromGrpc(peer->stub->Commit(&call, commit, &committed),
                                 absl::StrCat("indexer worker ", peer->address, ": Commit")));
  }
  const int64_t new_length = sequence->length + request.accepted() + 1;
  const int64_t dropped = sequence->kv_slots - new_length;
  ResizeKv(*sequence, new_length);
  FreeKv(dropped);
  sequence->length = new_length;
  sequence->pending_rows = 0;
  return absl::OkStatus();
}

grpc::Status AttentionServiceImpl::Commit(grpc::ServerContext* /*context*/,
                                          const av1::CommitRequest* request,
                                          av1::CommitResponse* /*response*/) {
  return ToGrpcStatus(DoCommit(*request));
}

absl::Status AttentionServiceImpl::DoRelease(const av1::ReleaseRequest& request) {
  const uint64_t id = request.sequence_id();
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
    const int64_t slots = sequence->kv_slots;
    ResizeKv(*sequence, 0);
    FreeKv(slots);
    EraseSequence(id, sequence.get());
  }
  DSA_ASSIGN_OR_RETURN(std::shared_ptr<Peer> peer, GetPeer(address));
  if (request.keep_indexer_sequence()) {
    if (!pending) return absl::OkStatus();
    // A kept sequence is a prefix donor, which must not have a step awaiting Commit: keep row 0
    // (the verified token) and drop the drafts.
    grpc::ClientContext call;
    call.set_deadline(absl::ToChronoTime(absl::Now() + options_.indexer_call_timeout));
    iv1::CommitRequest commit;
    commit.set_sequence_id(id);
    commit.set_accepted(0);
    iv1::CommitResponse committed;
    return FromGrpc(peer->stub->Commit(&call, commit, &committed),
                    absl::StrCat("KV of sequence ", id, " dropped, but indexer worker ", address,
                                 " did not commit its pending step: Commit"));
  }
  grpc::ClientContext call;
  call.set_deadline(absl::ToChronoTime(absl::Now() + options_.indexer_call_timeout));
  iv1::ReleaseRequest release;
  release.set_sequence_id(id);
  iv1::ReleaseResponse released;
  const grpc::Status status = peer->stub->Release(&call, release, &released);
  if (status.error_code() == grpc::StatusCode::NOT_FOUND) return absl::OkStatus();
  return FromGrpc(status, absl::StrCat("KV of sequence ", id, " dropped, but indexer worker ",
                                       address, " did not release it: Release"));
}

grpc::Status AttentionServiceImpl::Release(grpc::ServerContext* /*context*/,
                                           const av1::ReleaseRequest* request,
                                           av1::ReleaseResponse* /*response*/) {
  return ToGrpcStatus(DoRelease(*request));
}

}  // namespace dsa
