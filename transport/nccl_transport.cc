// SelectionTransport over NCCL, the attention side (see nccl_transport.h).
#include "transport/nccl_transport.h"

#include <span>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace dsa {

NcclSelectionTransport::Slot::~Slot() {
  if (answered != nullptr) cudaEventDestroy(answered);
}

NcclSelectionTransport::NcclSelectionTransport(std::shared_ptr<NcclLink> link,
                                               const NcclTransportOptions& options)
    : link_(std::move(link)), options_(options) {}

NcclSelectionTransport::~NcclSelectionTransport() {
  (void)Close();
  // The link is released or aborted: no operation still uses the slots' buffers.
  std::lock_guard<std::mutex> lock(mutex_);
  cudaSetDevice(link_->cuda_device());
  cudaStreamSynchronize(link_->stream());
  slots_.clear();
  free_slots_.clear();
  retired_.clear();
}

void NcclSelectionTransport::FailLocked(const absl::Status& reason) {
  if (failed_.ok()) {
    failed_ = reason.code() == absl::StatusCode::kUnavailable
                  ? reason
                  : absl::UnavailableError(std::string(reason.message()));
  }
  link_->Abort(failed_);
  for (auto& [id, slot] : slots_) {
    if (!slot->answered_seen) slot->failed = true;
  }
}

void NcclSelectionTransport::RecycleLocked(std::map<uint64_t, std::shared_ptr<Slot>>::iterator it) {
  std::shared_ptr<Slot> slot = std::move(it->second);
  slots_.erase(it);
  if (slot->answered_seen && !slot->failed) {
    free_slots_.push_back(std::move(slot));
  } else {
    retired_.push_back(std::move(slot));  // an aborted operation may still name its buffers
  }
}

void NcclSelectionTransport::ReapLocked(absl::Time now) {
  for (auto it = slots_.begin(); it != slots_.end();) {
    Slot& slot = *it->second;
    if (!slot.answered_seen && !slot.failed &&
        link_->Wait(NcclEndpoint::kAttention, slot.answer_seq, slot.answered, absl::InfinitePast())
            .ok()) {
      slot.answered_seen = true;
    }
    if (!slot.answered_seen && !slot.failed && now - slot.submitted > options_.peer_timeout) {
      FailLocked(absl::UnavailableError(
          absl::StrCat("the indexer did not answer request ", slot.request_id,
                       " within peer_timeout ", absl::FormatDuration(options_.peer_timeout),
                       "; the NCCL communicator was aborted (indexer lost)")));
    }
    if (slot.forgotten && (slot.answered_seen || slot.failed)) {
      RecycleLocked(it++);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<uint64_t> NcclSelectionTransport::Submit(LayerSelectRequest request) {
  if (request.on_device()) {
    return absl::InvalidArgumentError(
        "the NCCL transport takes host-form requests (it stages them itself); a device-form "
        "request needs the in-process transport");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (closing_ || closed_) return absl::UnavailableError("the NCCL transport is closed");
  ReapLocked(options_.clock->Now());
  if (!failed_.ok()) return failed_;
  if (static_cast<int>(slots_.size()) >= options_.max_outstanding) {
    return absl::ResourceExhaustedError(absl::StrCat(
        slots_.size(), " requests outstanding: max_outstanding ", options_.max_outstanding));
  }
  auto sizes = SizeWireRequest(request, options_.limits);
  if (!sizes.ok()) return sizes.status();
  std::shared_ptr<Slot> slot;
  if (!free_slots_.empty()) {
    slot = std::move(free_slots_.back());
    free_slots_.pop_back();
  } else {
    slot = std::make_shared<Slot>();
    cudaSetDevice(link_->cuda_device());
    if (cudaError_t e = cudaEventCreateWithFlags(&slot->answered, cudaEventDisableTiming);
        e != cudaSuccess) {
      return absl::ResourceExhaustedError(absl::StrCat("cudaEventCreate: ", cudaGetErrorString(e)));
    }
  }
  const int64_t request_bytes = kWireHeaderBytes + sizes->payload_bytes;
  for (auto [buffer, bytes] :
       {std::pair{&slot->host_send, request_bytes}, std::pair{&slot->device_send, request_bytes},
        std::pair{&slot->host_answer, sizes->response_bytes},
        std::pair{&slot->device_answer, sizes->response_bytes}}) {
    if (absl::Status s = buffer->Reserve(bytes); !s.ok()) {
      free_slots_.push_back(std::move(slot));
      return s;
    }
  }
  const uint64_t id = next_id_++;
  PackWireRequest(request, id, *sizes,
                  std::span<uint8_t>(slot->host_send.data(), static_cast<size_t>(request_bytes)));
  slot->request_id = id;
  slot->answer_bytes = sizes->response_bytes;
  slot->rows.clear();
  for (const SelectRowGroup& group : request.groups) slot->rows.push_back(group.num_rows);
  slot->submitted = options_.clock->Now();
  slot->answered_seen = slot->failed = slot->forgotten = false;

  // Header (the whole message is staged with it), payload, then the answer's receive.
  uint8_t* device = slot->device_send.data();
  NcclOp header{.send = true,
                .device = device,
                .bytes = kWireHeaderBytes,
                .host = slot->host_send.data(),
                .copy_bytes = request_bytes};
  NcclOp payload{.send = true, .device = device + kWireHeaderBytes, .bytes = sizes->payload_bytes};
  NcclOp answer{.send = false,
                .device = slot->device_answer.data(),
                .bytes = sizes->response_bytes,
                .host = slot->host_answer.data(),
                .copy_bytes = sizes->response_bytes,
                .done = slot->answered};
  absl::StatusOr<uint64_t> posted = link_->Post(NcclEndpoint::kAttention, header);
  if (posted.ok()) posted = link_->Post(NcclEndpoint::kAttention, payload);
  if (posted.ok()) posted = link_->Post(NcclEndpoint::kAttention, answer);
  if (!posted.ok()) {
    // A part of the request may be on the wire: the pair is out of step from here.
    FailLocked(posted.status());
    return failed_;
  }
  slot->answer_seq = *posted;
  slots_.emplace(id, std::move(slot));
  return id;
}

absl::StatusOr<LayerSelection> NcclSelectionTransport::DecodeAnswerLocked(Slot& slot) {
  const std::span<const uint8_t> answer(slot.host_answer.data(),
                                        static_cast<size_t>(slot.answer_bytes));
  auto header = DecodeWireHeader(answer, options_.limits);
  if (!header.ok()) {
    return absl::InternalError(absl::StrCat("the answer to request ", slot.request_id,
                                            " is corrupt: ", header.status().message()));
  }
  if (header->request_id != slot.request_id ||
      (header->kind != WireKind::kSelection && header->kind != WireKind::kError)) {
    FailLocked(absl::UnavailableError(
        absl::StrCat("NCCL data plane out of step: a message of kind ",
                     static_cast<int>(header->kind), " for request ", header->request_id,
                     " arrived as the answer to request ", slot.request_id)));
    return failed_;
  }
  const std::span<const uint8_t> payload = answer.subspan(kWireHeaderBytes);
  if (header->kind == WireKind::kError) return UnpackWireError(*header, payload);
  auto selection = UnpackWireSelection(*header, payload, options_.limits);
  if (!selection.ok()) {
    return absl::InternalError(absl::StrCat("the answer to request ", slot.request_id,
                                            " is corrupt: ", selection.status().message()));
  }
  if (selection->groups.size() != slot.rows.size()) {
    return absl::InternalError(absl::StrCat("the answer to request ", slot.request_id, " has ",
                                            selection->groups.size(), " groups, the request ",
                                            slot.rows.size()));
  }
  for (size_t g = 0; g < slot.rows.size(); ++g) {
    if (selection->groups[g].num_rows != slot.rows[g]) {
      return absl::InternalError(absl::StrCat("the answer to request ", slot.request_id, ", group ",
                                              g, ": ", selection->groups[g].num_rows,
                                              " rows, the request sent ", slot.rows[g]));
    }
  }
  return selection;
}

absl::StatusOr<LayerSelection> NcclSelectionTransport::Await(uint64_t request_id,
                                                             absl::Time deadline) {
  std::shared_ptr<Slot> slot;
  // The slot's fields as of this request (a slot is reused once its request is collected).
  uint64_t answer_seq = 0;
  cudaEvent_t answered_event = nullptr;
  absl::Time peer_deadline;
  // Whether `slot` still holds this request (another thread may have collected it meanwhile).
  auto still_ours = [&] {
    auto it = slots_.find(request_id);
    return it != slots_.end() && it->second == slot && !slot->forgotten;
  };
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = slots_.find(request_id);
    if (it == slots_.end() || it->second->forgotten) {
      return absl::NotFoundError(
          absl::StrCat("request ", request_id, " was never submitted or is already collected"));
    }
    slot = it->second;
    answer_seq = slot->answer_seq;
    answered_event = slot->answered;
    peer_deadline = slot->submitted + options_.peer_timeout;
  }
  auto collected = [&] {
    return absl::NotFoundError(absl::StrCat("request ", request_id, " is already collected"));
  };
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!still_ours()) return collected();
      if (slot->failed) {
        RecycleLocked(slots_.find(request_id));
        return failed_;
      }
      if (slot->answered_seen) break;
    }
    // Wait for the caller's deadline or the peer timeout, whichever comes first.
    const absl::Status waited = link_->Wait(NcclEndpoint::kAttention, answer_seq, answered_event,
                                            std::min(deadline, peer_deadline));
    std::lock_guard<std::mutex> lock(mutex_);
    if (!still_ours()) return collected();
    if (waited.ok()) {
      slot->answered_seen = true;
      break;
    }
    if (waited.code() != absl::StatusCode::kDeadlineExceeded) {
      FailLocked(waited);
      continue;  // reports failed_ above
    }
    if (options_.clock->Now() >= peer_deadline && !slot->answered_seen) {
      ReapLocked(options_.clock->Now());  // fails the link: the peer is lost
      continue;
    }
    if (!slot->answered_seen) {
      return absl::DeadlineExceededError(
          absl::StrCat("no answer to request ", request_id, " by the deadline"));
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!still_ours()) return collected();
  absl::StatusOr<LayerSelection> answer = DecodeAnswerLocked(*slot);
  if (still_ours()) RecycleLocked(slots_.find(request_id));
  return answer;
}

void NcclSelectionTransport::Forget(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = slots_.find(request_id);
  if (it == slots_.end()) return;
  it->second->forgotten = true;
  ReapLocked(options_.clock->Now());
}

absl::Status NcclSelectionTransport::Close() {
  std::lock_guard<std::mutex> close_lock(close_mutex_);
  std::vector<std::shared_ptr<Slot>> in_flight;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return close_status_;
    closing_ = true;
    for (auto& [id, slot] : slots_) {
      if (!slot->answered_seen && !slot->failed) in_flight.push_back(slot);
    }
  }
  const absl::Time deadline = options_.clock->Now() + options_.close_timeout;
  absl::Status status;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    status = failed_;
  }
  for (const std::shared_ptr<Slot>& slot : in_flight) {
    if (!status.ok()) break;
    status = link_->Wait(NcclEndpoint::kAttention, slot->answer_seq, slot->answered, deadline);
    std::lock_guard<std::mutex> lock(mutex_);
    if (status.ok()) slot->answered_seen = true;
  }
  if (status.ok()) {
    // The close message: the indexer side ends its session on it.
    NcclStagingBuffer host(NcclStagingBuffer::Kind::kHost);
    NcclStagingBuffer device(NcclStagingBuffer::Kind::kDevice);
    cudaEvent_t sent = nullptr;
    status = host.Reserve(kWireHeaderBytes);
    if (status.ok()) status = device.Reserve(kWireHeaderBytes);
    if (status.ok()) {
      cudaSetDevice(link_->cuda_device());
      if (cudaError_t e = cudaEventCreateWithFlags(&sent, cudaEventDisableTiming);
          e != cudaSuccess) {
        status = CudaError("cudaEventCreate", e);
      }
    }
    if (status.ok()) {
      PackWireClose(std::span<uint8_t>(host.data(), kWireHeaderBytes));
      auto posted = link_->Post(NcclEndpoint::kAttention, {.send = true,
                                                           .device = device.data(),
                                                           .bytes = kWireHeaderBytes,
                                                           .host = host.data(),
                                                           .copy_bytes = kWireHeaderBytes,
                                                           .done = sent});
      status = posted.ok() ? link_->Wait(NcclEndpoint::kAttention, *posted, sent, deadline)
                           : posted.status();
    }
    if (!status.ok()) {
      link_->Abort(status);  // the buffers below must not be named by a live operation
    } else {
      status = link_->Release(NcclEndpoint::kAttention, deadline);
    }
    cudaStreamSynchronize(link_->stream());
    if (sent != nullptr) cudaEventDestroy(sent);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!status.ok()) {
    FailLocked(absl::UnavailableError(absl::StrCat("close: ", status.message())));
    status = failed_;
  }
  (void)link_->Release(NcclEndpoint::kAttention, deadline);
  closed_ = true;
  close_status_ = status;
  return status;
}

}  // namespace dsa
