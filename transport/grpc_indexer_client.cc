// IndexerClient over gRPC (see grpc_indexer_client.h).
#include "transport/grpc_indexer_client.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/host_port.h"
#include "common/status_macros.h"
#include "common/trace_context.h"
#include "contracts/grpc_status.h"
#include "contracts/limits.h"
#include "proto/indexer_codec.h"
#include "proto/lease_codec.h"
#include "proto/tensor_codec.h"

namespace dsa {
namespace {

// The calls made on behalf of a request carry its trace (the caller's ScopedTraceContext).
void AddTraceparent(grpc::ClientContext& context) {
  if (const std::optional<TraceContext> trace = CurrentTraceContext(); trace.has_value()) {
    context.AddMetadata(kTraceparentKey, trace->Child().ToTraceparent());
  }
}

}  // namespace
namespace {

namespace iv1 = ::dsa::indexer::v1;

// One AppendIndexKeys client stream.
class GrpcIndexKeyAppend final : public IndexKeyAppend {
 public:
  GrpcIndexKeyAppend(iv1::IndexerService::Stub* stub, const std::string& address,
                     uint64_t sequence_id, absl::Time deadline)
      : address_(address), sequence_id_(sequence_id) {
    context_.set_deadline(absl::ToChronoTime(deadline));
    AddTraceparent(context_);
    writer_ = stub->AppendIndexKeys(&context_, &response_);
  }
  ~GrpcIndexKeyAppend() override {
    if (!done_) Cancel();
  }

  bool Write(int layer, int64_t first_slot, std::span<const float> keys,
             int64_t num_keys) override {
    if (ended_ || num_keys <= 0) return !ended_;
    const int64_t head_dim = static_cast<int64_t>(keys.size()) / num_keys;
    // Chunks stay under the indexer's per-message limit with room for the header fields.
    const int64_t chunk_slots =
        std::max<int64_t>(1, (kMaxAppendChunkBytes - 4096) / (int64_t{4} * head_dim));
    for (int64_t done = 0; done < num_keys; done += chunk_slots) {
      const int64_t n = std::min(chunk_slots, num_keys - done);
      iv1::AppendIndexKeysRequest chunk;
      chunk.set_sequence_id(sequence_id_);
      chunk.set_layer(layer);
      chunk.set_first_slot(first_slot + done);
      const int64_t shape[] = {n, head_dim};
      EncodeFloatTensor(
          keys.subspan(static_cast<size_t>(done * head_dim), static_cast<size_t>(n * head_dim)),
          shape, chunk.mutable_keys());
      if (!writer_->Write(chunk)) {
        ended_ = true;  // the call ended; Finish says why
        return false;
      }
    }
    return true;
  }

  absl::StatusOr<int64_t> Finish() override {
    done_ = true;
    if (!ended_) writer_->WritesDone();
    DSA_RETURN_IF_ERROR(FromGrpcStatus(
        writer_->Finish(), absl::StrCat("indexer worker ", address_, ": AppendIndexKeys")));
    return response_.keys_appended();
  }

  void Cancel() override {
    done_ = true;
    context_.TryCancel();  // the indexer undoes the chunks of a cancelled call
    (void)writer_->Finish();
  }

 private:
  const std::string address_;
  const uint64_t sequence_id_;
  grpc::ClientContext context_;
  iv1::AppendIndexKeysResponse response_;
  std::unique_ptr<grpc::ClientWriter<iv1::AppendIndexKeysRequest>> writer_;
  bool ended_ = false;
  bool done_ = false;
};

}  // namespace

FailedSelectionTransport::FailedSelectionTransport(absl::Status status)
    : status_(std::move(status)) {}

absl::StatusOr<uint64_t> FailedSelectionTransport::Submit(LayerSelectRequest /*request*/) {
  return status_;
}

absl::StatusOr<LayerSelection> FailedSelectionTransport::Await(uint64_t request_id,
                                                               absl::Time /*deadline*/) {
  return absl::NotFoundError(absl::StrCat("select request ", request_id, " was never submitted"));
}

std::shared_ptr<grpc::Channel> GrpcIndexerClient::MakeChannel(const std::string& address,
                                                              const ClientSecurity& security) {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
  // An indexer that restarts is back within seconds, but gRPC's default backoff (1 s growing to
  // 2 min) would keep failing the calls to it long after the coordinator, whose checks use a
  // short backoff, has placed requests there again: retry the connection within a second.
  arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kIndexerMinReconnectBackoffMs);
  arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kIndexerMinReconnectBackoffMs);
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kIndexerMaxReconnectBackoffMs);
  // A channel of its own: gRPC shares connections between channels of equal arguments, so a
  // client remade after a failure (AttentionEngine drops it) would otherwise inherit the old
  // connection's backoff instead of dialing at once.
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return NewChannel(address, security, arguments);
}

GrpcIndexerClient::GrpcIndexerClient(const std::string& address, const ClientSecurity& security)
    : GrpcIndexerClient(address, MakeChannel(address, security), nullptr) {}

GrpcIndexerClient::GrpcIndexerClient(std::string address, std::shared_ptr<grpc::Channel> channel,
                                     DataPlaneMaker make_data_plane)
    : address_(std::move(address)),
      channel_(std::move(channel)),
      stub_(iv1::IndexerService::NewStub(channel_)),
      make_data_plane_(std::move(make_data_plane)) {}

GrpcIndexerClient::~GrpcIndexerClient() { (void)Close(); }

absl::StatusOr<IndexerShape> GrpcIndexerClient::GetShape(absl::Time deadline) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  iv1::GetLoadResponse load;
  DSA_RETURN_IF_ERROR(FromGrpcStatus(stub_->GetLoad(&context, iv1::GetLoadRequest(), &load),
                                     absl::StrCat("indexer worker ", address_, ": GetLoad")));
  return IndexerShape{load.num_heads(), load.head_dim()};
}

absl::Status GrpcIndexerClient::CreateSequence(const IndexerSequenceSpec& spec,
                                               absl::Time deadline) {
  iv1::CreateSequenceRequest create;
  create.set_sequence_id(spec.sequence_id);
  create.set_num_layers(spec.options.num_layers);
  create.set_top_k(spec.options.top_k);
  *create.mutable_spin() = ToSpinSettings(spec.options.spin);
  if (spec.prefix_source_id.has_value()) {
    create.set_prefix_source_id(*spec.prefix_source_id);
    create.set_prefix_slots(spec.prefix_slots);
  }
  EncodeLease(spec.lease, create.mutable_lease());
  return Unary(&iv1::IndexerService::Stub::CreateSequence, create, "CreateSequence", deadline);
}

std::unique_ptr<IndexKeyAppend> GrpcIndexerClient::BeginAppend(uint64_t sequence_id,
                                                               absl::Time deadline) {
  return std::make_unique<GrpcIndexKeyAppend>(stub_.get(), address_, sequence_id, deadline);
}

template <typename Request, typename Response>
absl::Status GrpcIndexerClient::Unary(grpc::Status (iv1::IndexerService::Stub::*method)(
                                          grpc::ClientContext*, const Request&, Response*),
                                      const Request& request, absl::string_view name,
                                      absl::Time deadline) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  AddTraceparent(context);
  Response response;
  return FromGrpcStatus((stub_.get()->*method)(&context, request, &response),
                        absl::StrCat("indexer worker ", address_, ": ", name));
}

absl::Status GrpcIndexerClient::BeginTurn(uint64_t sequence_id, absl::Time deadline) {
  iv1::BeginTurnRequest request;
  request.set_sequence_id(sequence_id);
  return Unary(&iv1::IndexerService::Stub::BeginTurn, request, "BeginTurn", deadline);
}

absl::Status GrpcIndexerClient::Commit(uint64_t sequence_id, int accepted, absl::Time deadline) {
  iv1::CommitRequest request;
  request.set_sequence_id(sequence_id);
  request.set_accepted(accepted);
  return Unary(&iv1::IndexerService::Stub::Commit, request, "Commit", deadline);
}

absl::Status GrpcIndexerClient::Release(uint64_t sequence_id, absl::Time deadline) {
  iv1::ReleaseRequest request;
  request.set_sequence_id(sequence_id);
  return Unary(&iv1::IndexerService::Stub::Release, request, "Release", deadline);
}

SelectionTransport& GrpcIndexerClient::Selections() {
  std::lock_guard<std::mutex> lock(transport_mutex_);
  if (transport_ != nullptr) return *transport_;
  if (!make_data_plane_) {
    transport_ = std::make_unique<GrpcStreamTransport>(channel_);
    return *transport_;
  }
  absl::StatusOr<std::unique_ptr<SelectionTransport>> made = make_data_plane_(*stub_);
  if (made.ok()) {
    transport_ = std::move(*made);
  } else {
    transport_ = std::make_unique<FailedSelectionTransport>(absl::Status(
        made.status().code(),
        absl::StrCat("indexer worker ", address_, ": data plane: ", made.status().message())));
  }
  return *transport_;
}

absl::Status GrpcIndexerClient::Close() {
  std::lock_guard<std::mutex> lock(transport_mutex_);
  return transport_ == nullptr ? absl::OkStatus() : transport_->Close();
}

bool GrpcIndexerClient::DataPlaneEnded() const {
  std::lock_guard<std::mutex> lock(transport_mutex_);
  return transport_ != nullptr && transport_->ended();
}

absl::Status GrpcIndexerClient::CheckAddress(const std::string& address) {
  if (address.empty()) return absl::InvalidArgumentError("no indexer_worker address");
  const absl::StatusOr<HostPort> parsed = ParseHostPort(address, /*min_port=*/1);
  if (parsed.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("indexer_worker: ", parsed.status().message()));
}

IndexerClientFactory GrpcIndexerClient::Factory(ClientSecurity security) {
  return [security = std::move(security)](
             const std::string& address) -> absl::StatusOr<std::shared_ptr<IndexerClient>> {
    DSA_RETURN_IF_ERROR(CheckAddress(address));
    return std::make_shared<GrpcIndexerClient>(address, security);
  };
}

IndexerClientFactory OnlyIndexerWorkers(IndexerClientFactory inner,
                                        std::vector<std::string> addresses,
                                        std::vector<std::string> dns_names,
                                        AddressResolver resolve) {
  if (addresses.empty() && dns_names.empty()) return inner;
  return [inner = std::move(inner), addresses = std::move(addresses),
          dns_names = std::move(dns_names), resolve = std::move(resolve)](
             const std::string& address) -> absl::StatusOr<std::shared_ptr<IndexerClient>> {
    bool allowed = std::find(addresses.begin(), addresses.end(), address) != addresses.end();
    absl::Status unresolved;  // a name that could not be looked up now
    for (size_t i = 0; !allowed && i < dns_names.size(); ++i) {
      absl::StatusOr<std::vector<std::string>> resolved = resolve(dns_names[i]);
      if (!resolved.ok()) {
        unresolved = resolved.status();
        continue;
      }
      allowed = std::find(resolved->begin(), resolved->end(), address) != resolved->end();
    }
    if (!allowed && absl::IsUnavailable(unresolved)) {
      // A resolver failure is temporary: the caller may retry (not a refusal).
      return absl::UnavailableError(absl::StrCat("cannot check indexer worker ", address,
                                                 " against --indexer-dns: ", unresolved.message()));
    }
    if (!allowed) {
      return absl::PermissionDeniedError(
          absl::StrCat("indexer worker ", address,
                       " is not one this attention worker is configured with (--indexer-workers [",
                       absl::StrJoin(addresses, ","), "], --indexer-dns [",
                       absl::StrJoin(dns_names, ","), "])"));
    }
    return inner(address);
  };
}

}  // namespace dsa
