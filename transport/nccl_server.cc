// The indexer side of the NCCL data plane (see nccl_server.h).
#include "transport/nccl_server.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "indexer_service/layer_select.h"

namespace dsa {
namespace {

// How often an idle wait for the next request looks at Stop.
constexpr absl::Duration kIdleCheck = absl::Milliseconds(50);

}  // namespace

absl::StatusOr<std::unique_ptr<NcclSelectionServer>> NcclSelectionServer::Start(
    Indexer& indexer, IndexerMetrics* metrics, std::shared_ptr<NcclLink> link,
    const NcclServerOptions& options, SequenceOwnerCheck check_owned) {
  WireSelectHandler handler = [&indexer, metrics](const LayerSelectRequest& request,
                                                  int* groups_applied) {
    absl::StatusOr<LayerSelection> selection =
        RunLayerSelect(indexer, request, metrics, groups_applied);
    if (metrics != nullptr) metrics->SetCacheUsage(indexer.Usage());  // new keys take blocks
    return selection;
  };
  return StartWithHandler(WithOwnerCheck(std::move(handler), std::move(check_owned)),
                          std::move(link), options);
}

absl::StatusOr<std::unique_ptr<NcclSelectionServer>> NcclSelectionServer::StartWithHandler(
    WireSelectHandler handler, std::shared_ptr<NcclLink> link, const NcclServerOptions& options) {
  std::unique_ptr<NcclSelectionServer> server(
      new NcclSelectionServer(std::move(handler), std::move(link), options));
  cudaSetDevice(server->link_->cuda_device());
  for (cudaEvent_t* event :
       {&server->header_done_, &server->payload_done_, &server->answer_done_}) {
    if (cudaError_t e = cudaEventCreateWithFlags(event, cudaEventDisableTiming); e != cudaSuccess) {
      return absl::ResourceExhaustedError(absl::StrCat("cudaEventCreate: ", cudaGetErrorString(e)));
    }
  }
  for (NcclStagingBuffer* buffer : {&server->host_header_, &server->device_header_}) {
    DSA_RETURN_IF_ERROR(buffer->Reserve(kWireHeaderBytes));
  }
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

NcclSelectionServer::NcclSelectionServer(WireSelectHandler handler, std::shared_ptr<NcclLink> link,
                                         const NcclServerOptions& options)
    : handler_(std::move(handler)), link_(std::move(link)), options_(options) {}

NcclSelectionServer::~NcclSelectionServer() {
  Stop();
  // The session is over (released or aborted): no operation names the buffers any more.
  cudaSetDevice(link_->cuda_device());
  cudaStreamSynchronize(link_->stream());
  for (cudaEvent_t event : {header_done_, payload_done_, answer_done_}) {
    if (event != nullptr) cudaEventDestroy(event);
  }
}

void NcclSelectionServer::Stop() {
  std::lock_guard<std::mutex> stop_lock(stop_mutex_);
  stop_ = true;
  if (serving()) link_->Abort(absl::CancelledError("the NCCL selection server was stopped"));
  if (thread_.joinable()) thread_.join();
}

bool NcclSelectionServer::serving() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !done_;
}

absl::Status NcclSelectionServer::Wait(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!done_) {
    if (ended_.wait_for(lock, absl::ToChronoNanoseconds(deadline - options_.clock->Now())) ==
            std::cv_status::timeout &&
        !done_) {
      return absl::DeadlineExceededError("the NCCL selection server is still serving");
    }
  }
  return final_status_;
}

void NcclSelectionServer::Finish(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mutex_);
  done_ = true;
  final_status_ = status;
  ended_.notify_all();
}

void NcclSelectionServer::Serve() {
  cudaSetDevice(link_->cuda_device());
  absl::Status status;
  bool closed = false;
  while (status.ok() && !closed) status = ServeOne(&closed);
  if (stop_) status = absl::CancelledError("the NCCL selection server was stopped");
  if (closed && status.ok()) {
    status = link_->Release(NcclEndpoint::kIndexer, options_.clock->Now() + options_.peer_timeout);
  } else {
    link_->Abort(status);  // the peer must not wait for answers that will not come
  }
  Finish(status);
}

absl::Status NcclSelectionServer::ServeOne(bool* closed) {
  // The next request's header: an idle wait, unbounded, that looks at Stop.
  DSA_ASSIGN_OR_RETURN(const uint64_t header_seq,
                       link_->Post(NcclEndpoint::kIndexer, {.send = false,
                                                            .device = device_header_.data(),
                                                            .bytes = kWireHeaderBytes,
                                                            .host = host_header_.data(),
                                                            .copy_bytes = kWireHeaderBytes,
                                                            .done = header_done_}));
  while (true) {
    absl::Status waited = link_->Wait(NcclEndpoint::kIndexer, header_seq, header_done_,
                                      options_.clock->Now() + kIdleCheck);
    if (waited.ok()) break;
    if (waited.code() != absl::StatusCode::kDeadlineExceeded) return waited;
    if (stop_) return absl::CancelledError("the NCCL selection server was stopped");
  }
  auto header = DecodeWireHeader(std::span<const uint8_t>(host_header_.data(), kWireHeaderBytes),
                                 options_.limits);
  if (!header.ok()) {
    // The payload's size is unknown: the stream cannot be followed from here.
    return absl::InternalError(
        absl::StrCat("a request header that does not decode: ", header.status().message()));
  }
  if (header->kind == WireKind::kClose) {
    *closed = true;
    return absl::OkStatus();
  }
  if (header->kind != WireKind::kRequest) {
    return absl::InternalError(absl::StrCat("a message of kind ", static_cast<int>(header->kind),
                                            " where a request was expected"));
  }
  DSA_RETURN_IF_ERROR(host_payload_.Reserve(header->payload_bytes));
  DSA_RETURN_IF_ERROR(device_payload_.Reserve(header->payload_bytes));
  DSA_RETURN_IF_ERROR(host_answer_.Reserve(header->response_bytes));
  DSA_RETURN_IF_ERROR(device_answer_.Reserve(header->response_bytes));

  const absl::Time deadline = options_.clock->Now() + options_.peer_timeout;
  auto lost = [&](const absl::Status& waited, const char* what) {
    if (waited.code() != absl::StatusCode::kDeadlineExceeded) return waited;
    return absl::UnavailableError(absl::StrCat("the attention side ", what, " request ",
                                               header->request_id, " within peer_timeout ",
                                               absl::FormatDuration(options_.peer_timeout)));
  };
  DSA_ASSIGN_OR_RETURN(const uint64_t payload_seq,
                       link_->Post(NcclEndpoint::kIndexer, {.send = false,
                                                            .device = device_payload_.data(),
                                                            .bytes = header->payload_bytes,
                                                            .host = host_payload_.data(),
                                                            .copy_bytes = header->payload_bytes,
                                                            .done = payload_done_}));
  if (absl::Status s = link_->Wait(NcclEndpoint::kIndexer, payload_seq, payload_done_, deadline);
      !s.ok()) {
    return lost(s, "did not send the payload of");
  }
  AnswerWireRequest(
      handler_, *header,
      std::span<const uint8_t>(host_payload_.data(), static_cast<size_t>(header->payload_bytes)),
      options_.limits,
      std::span<uint8_t>(host_answer_.data(), static_cast<size_t>(header->response_bytes)));
  DSA_ASSIGN_OR_RETURN(const uint64_t answer_seq,
                       link_->Post(NcclEndpoint::kIndexer, {.send = true,
                                                            .device = device_answer_.data(),
                                                            .bytes = header->response_bytes,
                                                            .host = host_answer_.data(),
                                                            .copy_bytes = header->response_bytes,
                                                            .done = answer_done_}));
  if (absl::Status s = link_->Wait(NcclEndpoint::kIndexer, answer_seq, answer_done_,
                                   options_.clock->Now() + options_.peer_timeout);
      !s.ok()) {
    return lost(s, "did not take the answer to");
  }
  requests_answered_.fetch_add(1);
  return absl::OkStatus();
}

}  // namespace dsa

namespace dsa {

namespace v1 = ::dsa::indexer::v1;

NcclDataPlanes::NcclDataPlanes(Indexer& indexer, IndexerMetrics* metrics,
                               const NcclDataPlaneOptions& options)
    : indexer_(indexer), metrics_(metrics), options_(options) {}

NcclDataPlanes::~NcclDataPlanes() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Session& session : sessions_) session.server->Stop();
  sessions_.clear();
}

int NcclDataPlanes::num_serving() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int serving = 0;
  for (const Session& session : sessions_) serving += session.server->serving() ? 1 : 0;
  return serving;
}

DataPlaneOpener NcclDataPlanes::Opener() {
  return [this](const v1::OpenDataPlaneRequest& request, const DataPlaneCaller& caller,
                v1::OpenDataPlaneResponse* response) { return Open(request, caller, response); };
}

absl::Status NcclDataPlanes::Open(const v1::OpenDataPlaneRequest& request,
                                  const DataPlaneCaller& caller,
                                  v1::OpenDataPlaneResponse* response) {
  const IndexerOptions& shapes = indexer_.options();
  if (request.nccl_unique_id().size() != NCCL_UNIQUE_ID_BYTES) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl_unique_id has ", request.nccl_unique_id().size(),
                     " bytes; an ncclUniqueId has ", NCCL_UNIQUE_ID_BYTES));
  }
  if (request.num_ranks() != 2 || request.indexer_rank() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_ranks ", request.num_ranks(), ", indexer_rank ", request.indexer_rank(),
                     ": a data plane is one attention rank (0) and this indexer (rank 1)"));
  }
  if (request.num_heads() != shapes.num_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_heads (H) ", request.num_heads(), " differs from this indexer's ", shapes.num_heads));
  }
  if (request.head_dim() != shapes.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim (D) ", request.head_dim(), " differs from this indexer's ", shapes.head_dim));
  }
  if (request.max_top_k() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_top_k ", request.max_top_k(), " < 1"));
  }
  if (request.max_message_bytes() < (int64_t{64} << 10)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes ", request.max_message_bytes(), " below 64 KiB"));
  }
  NcclServerOptions server_options = options_.server;
  server_options.limits.max_top_k = request.max_top_k();
  server_options.limits.max_message_bytes =
      std::min(server_options.limits.max_message_bytes, request.max_message_bytes());

  // A worker that opens again has restarted: its old session is gone. Only the caller that
  // first opened a data plane under the name may say so (the name is that caller's for this
  // object's lifetime, served or not); another caller's claim changes nothing.
  // Called under mutex_.
  auto held_by_another = [&]() -> absl::Status {
    if (request.attention_worker().empty()) return absl::OkStatus();
    auto owner = name_owners_.find(request.attention_worker());
    if (owner != name_owners_.end() && owner->second != caller.identity) {
      return absl::PermissionDeniedError(
          absl::StrCat("attention worker '", request.attention_worker(),
                       "' has a data plane opened by another caller"));
    }
    return absl::OkStatus();
  };
  std::vector<std::unique_ptr<NcclSelectionServer>> ended;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DSA_RETURN_IF_ERROR(held_by_another());
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      if (!it->server->serving() || (!request.attention_worker().empty() &&
                                     it->attention_worker == request.attention_worker())) {
        ended.push_back(std::move(it->server));
        it = sessions_.erase(it);
      } else {
        ++it;
      }
    }
  }
  ended.clear();  // stops them (outside the lock)

  ncclUniqueId unique_id;
  std::memcpy(unique_id.internal, request.nccl_unique_id().data(), NCCL_UNIQUE_ID_BYTES);
  std::shared_ptr<NcclLink> link;
  if (options_.join) {
    DSA_ASSIGN_OR_RETURN(link, options_.join(unique_id));
  } else {
    DSA_ASSIGN_OR_RETURN(link, StartTwoRankNcclLink(unique_id, /*rank=*/1, options_.link));
    DSA_RETURN_IF_ERROR(link->WaitReady(options_.server.clock->Now() + options_.connect_timeout));
  }
  DSA_ASSIGN_OR_RETURN(
      std::unique_ptr<NcclSelectionServer> server,
      NcclSelectionServer::Start(indexer_, metrics_, link, server_options, caller.check_owned));
  std::unique_lock<std::mutex> lock(mutex_);
  // Another caller may have opened one for the name while this one joined.
  if (absl::Status held = held_by_another(); !held.ok()) {
    lock.unlock();
    server->Stop();
    return held;
  }
  const uint64_t id = next_id_++;
  if (!request.attention_worker().empty()) {
    name_owners_.emplace(request.attention_worker(), caller.identity);
  }
  sessions_.push_back({id, request.attention_worker(), std::move(server)});
  response->set_indexer_cuda_device(options_.link.cuda_device);
  response->set_max_message_bytes(server_options.limits.max_message_bytes);
  response->set_data_plane_id(id);
  return absl::OkStatus();
}

}  // namespace dsa
