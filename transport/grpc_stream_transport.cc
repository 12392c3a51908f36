// The gRPC stream transport (see grpc_stream_transport.h). A reader thread files responses by
// request id; writers take turns on the stream.
#include "transport/grpc_stream_transport.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "contracts/grpc_status.h"
#include "proto/indexer_codec.h"

namespace dsa {
namespace {

namespace v1 = dsa::indexer::v1;

}  // namespace

GrpcStreamTransport::GrpcStreamTransport(std::shared_ptr<grpc::Channel> channel,
                                         absl::Duration close_grace)
    : close_grace_(std::max(close_grace, absl::ZeroDuration())),
      stub_(v1::IndexerService::NewStub(std::move(channel))) {
  stream_ = stub_->SelectStream(&context_);
  reader_ = std::thread([this] { ReadLoop(); });
}

GrpcStreamTransport::~GrpcStreamTransport() { (void)Close(); }

void GrpcStreamTransport::ReadLoop() {
  v1::SelectResponse response;
  while (stream_->Read(&response)) {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t id = response.request_id();
    if (outstanding_.contains(id)) responses_[id] = std::move(response);
    arrived_.notify_all();
  }
  const grpc::Status status = stream_->Finish();
  std::lock_guard<std::mutex> lock(mutex_);
  ended_ = true;
  final_status_ = FromGrpcStatus(status);
  arrived_.notify_all();
}

absl::StatusOr<uint64_t> GrpcStreamTransport::Submit(LayerSelectRequest layer) {
  if (layer.on_device()) {
    return absl::InvalidArgumentError(
        "the gRPC stream carries host buffers only; a device-form request needs the in-process "
        "transport");
  }
  std::vector<int> group_rows;
  group_rows.reserve(layer.groups.size());
  for (const SelectRowGroup& group : layer.groups) group_rows.push_back(group.num_rows);
  v1::SelectRequest request = EncodeSelectRequest(layer);
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_ || ended_) {
      return absl::UnavailableError(
          absl::StrCat("selection stream ended: ", ended_ ? final_status_.ToString() : "closed"));
    }
    id = next_id_++;
    outstanding_[id] = std::move(group_rows);
  }
  request.set_request_id(id);
  std::lock_guard<std::mutex> lock(write_mutex_);
  if (writes_done_ || !stream_->Write(request)) {
    std::lock_guard<std::mutex> state_lock(mutex_);
    outstanding_.erase(id);
    return absl::UnavailableError("selection stream closed while sending");
  }
  return id;
}

absl::StatusOr<LayerSelection> GrpcStreamTransport::Await(uint64_t request_id,
                                                          absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!outstanding_.contains(request_id)) {
    return absl::NotFoundError(
        absl::StrCat("select request ", request_id, " was never submitted or is collected"));
  }
  const auto ready = [this, request_id] { return responses_.contains(request_id) || ended_; };
  if (deadline == absl::InfiniteFuture()) {
    arrived_.wait(lock, ready);
  } else if (!arrived_.wait_until(lock, absl::ToChronoTime(deadline), ready)) {
    return absl::DeadlineExceededError(
        absl::StrCat("no selection for request ", request_id, " before the deadline"));
  }
  auto it = responses_.find(request_id);
  if (it != responses_.end()) {
    v1::SelectResponse response = std::move(it->second);
    responses_.erase(it);
    const std::vector<int> group_rows = std::move(outstanding_[request_id]);
    outstanding_.erase(request_id);
    if (response.has_error()) {  // the indexer refused this request; the stream goes on
      return DecodeSelectError(response.error(), request_id);
    }
    return DecodeSelectResponse(response, group_rows);
  }
  outstanding_.erase(request_id);
  if (!final_status_.ok()) return final_status_;
  return absl::UnavailableError(
      absl::StrCat("selection stream ended before answering request ", request_id));
}

void GrpcStreamTransport::Forget(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  outstanding_.erase(request_id);  // ReadLoop drops a later answer to an id not outstanding
  responses_.erase(request_id);
}

bool GrpcStreamTransport::ended() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ended_ || closed_;
}

absl::Status GrpcStreamTransport::Close() {
  std::lock_guard<std::mutex> close_lock(close_mutex_);  // one closer at a time; later ones return
  {
    std::lock_guard<std::mutex> lock(write_mutex_);
    if (!writes_done_) {
      stream_->WritesDone();
      writes_done_ = true;
    }
  }
  {
    // Give the indexer close_grace_ to finish, then cancel, so Close never hangs on a dead peer.
    std::unique_lock<std::mutex> lock(mutex_);
    if (!arrived_.wait_for(lock, absl::ToChronoNanoseconds(close_grace_),
                           [this] { return ended_; })) {
      context_.TryCancel();
    }
  }
  if (reader_.joinable()) reader_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  closed_ = true;
  return final_status_;
}

}  // namespace dsa
