// The in-process transport (see in_process_transport.h).
#include "transport/in_process_transport.h"

#include <functional>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "indexer_service/layer_select.h"

namespace dsa {

InProcessSelectionTransport::InProcessSelectionTransport(Indexer* indexer, IndexerMetrics* metrics)
    : indexer_(indexer), metrics_(metrics) {
  thread_ = std::thread([this] { RunLoop(); });
}

InProcessSelectionTransport::~InProcessSelectionTransport() { (void)Close(); }

void InProcessSelectionTransport::RunLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    queued_.wait(lock, [this] { return !queue_.empty() || closed_; });
    if (queue_.empty()) return;  // closed and drained
    auto [id, request] = std::move(queue_.front());
    queue_.pop_front();
    if (!outstanding_.contains(id)) continue;  // forgotten before it ran
    lock.unlock();
    int groups_applied = 0;
    std::function<void()> on_enqueued;
    if (request.on_device()) {
      on_enqueued = [this, id = id] {
        std::lock_guard<std::mutex> guard(mutex_);
        if (!outstanding_.contains(id)) return;
        enqueued_ids_[id] = true;
        answered_.notify_all();
      };
    }
    absl::StatusOr<LayerSelection> answer =
        RunLayerSelect(*indexer_, request, metrics_, &groups_applied, std::move(on_enqueued));
    if (!answer.ok()) {
      absl::Status refused = answer.status();
      refused.SetPayload(kGroupsAppliedPayload, absl::Cord(absl::StrCat(groups_applied)));
      answer = std::move(refused);
    }
    lock.lock();
    auto it = outstanding_.find(id);
    if (it == outstanding_.end()) continue;  // forgotten while it ran: dropped
    it->second = std::move(answer);
    answered_ids_[id] = true;
    answered_.notify_all();
  }
}

absl::StatusOr<uint64_t> InProcessSelectionTransport::Submit(LayerSelectRequest request) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return absl::UnavailableError("the in-process selection transport is closed");
  const uint64_t id = next_id_++;
  outstanding_.emplace(id, absl::UnavailableError("not yet answered"));
  queue_.emplace_back(id, std::move(request));
  queued_.notify_one();
  return id;
}

absl::StatusOr<LayerSelection> InProcessSelectionTransport::Await(uint64_t request_id,
                                                                  absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!outstanding_.contains(request_id)) {
    return absl::NotFoundError(
        absl::StrCat("select request ", request_id, " was never submitted or is collected"));
  }
  // Answered, or no longer outstanding (forgotten, or collected by another Await meanwhile).
  const auto ready = [this, request_id] {
    return answered_ids_.contains(request_id) || !outstanding_.contains(request_id);
  };
  if (deadline == absl::InfiniteFuture()) {
    answered_.wait(lock, ready);
  } else if (!answered_.wait_until(lock, absl::ToChronoTime(deadline), ready)) {
    return absl::DeadlineExceededError(
        absl::StrCat("no selection for request ", request_id, " before the deadline"));
  }
  auto it = outstanding_.find(request_id);
  if (it == outstanding_.end()) {
    return absl::NotFoundError(
        absl::StrCat("select request ", request_id, " was forgotten or collected while awaited"));
  }
  absl::StatusOr<LayerSelection> answer = std::move(it->second);
  outstanding_.erase(it);
  answered_ids_.erase(request_id);
  enqueued_ids_.erase(request_id);
  return answer;
}

int InProcessSelectionTransport::device_ordinal() const { return indexer_->DeviceOrdinal(); }

absl::Status InProcessSelectionTransport::AwaitEnqueued(uint64_t request_id, absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto ready = [this, request_id] {
    return enqueued_ids_.contains(request_id) || answered_ids_.contains(request_id) ||
           !outstanding_.contains(request_id);
  };
  if (deadline == absl::InfiniteFuture()) {
    answered_.wait(lock, ready);
  } else if (!answered_.wait_until(lock, absl::ToChronoTime(deadline), ready)) {
    return absl::DeadlineExceededError(absl::StrCat("the selections of request ", request_id,
                                                    " were not enqueued before the deadline"));
  }
  auto it = outstanding_.find(request_id);
  if (it == outstanding_.end()) {
    return absl::NotFoundError(
        absl::StrCat("select request ", request_id, " was never submitted or is collected"));
  }
  if (enqueued_ids_.contains(request_id)) return absl::OkStatus();
  return it->second.status();  // answered: OK, or the refusal (kept for Await)
}

void InProcessSelectionTransport::Forget(uint64_t request_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  outstanding_.erase(request_id);
  answered_ids_.erase(request_id);
  enqueued_ids_.erase(request_id);
  answered_.notify_all();  // an Await of it ends with NOT_FOUND
}

absl::Status InProcessSelectionTransport::Close() {
  std::lock_guard<std::mutex> close_lock(close_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    queued_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  return absl::OkStatus();
}

}  // namespace dsa
