// SelectionTransport to an indexer engine in the attention worker's own process (co-located, as the
// MLI paper deploys it: the indexer's work runs beside attention, not before it). Requests run in
// submission order on one indexer thread of the transport, so Submit returns at once and the
// attention side goes on with its layers while the select runs (MLI's deferred stream). With a
// scoring device that takes device queries, requests may come in device form
// (LayerSelectRequest::device): queries and selections stay on the GPU, and the attention stream
// waits on the selections' event, not the host (AwaitEnqueued says when it may).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "absl/status/statusor.h"
#include "indexer_service/indexer.h"
#include "indexer_service/metrics.h"
#include "transport/selection_transport.h"

namespace dsa {

/// Thread-safe. `indexer` (and `metrics`, optional) are the caller's and must outlive the
/// transport. Answers are RunLayerSelect's (indexer_service/layer_select.h), so for the same
/// requests the selections are bit-identical to the gRPC stream's; a refused request gets the
/// engine's status with kGroupsAppliedPayload, and the other requests go on.
class InProcessSelectionTransport final : public SelectionTransport {
 public:
  explicit InProcessSelectionTransport(Indexer* indexer, IndexerMetrics* metrics = nullptr);
  ~InProcessSelectionTransport() override;  // Close()s

  /// Queues the layer for the indexer thread. UNAVAILABLE once closed.
  absl::StatusOr<uint64_t> Submit(LayerSelectRequest request) override;
  /// Waits for the answer (see SelectionTransport::Await).
  absl::StatusOr<LayerSelection> Await(uint64_t request_id, absl::Time deadline) override;
  /// The indexer's scoring device, when it takes device queries (Indexer::DeviceOrdinal).
  int device_ordinal() const override;
  /// See SelectionTransport::AwaitEnqueued; a host-form request counts as enqueued once answered.
  absl::Status AwaitEnqueued(uint64_t request_id, absl::Time deadline) override;
  void Forget(uint64_t request_id) override;
  /// Refuses new requests, runs the queued ones, joins the indexer thread. Always OK (nothing can
  /// be lost in process); idempotent.
  absl::Status Close() override;

 private:
  void RunLoop();

  Indexer* const indexer_;
  IndexerMetrics* const metrics_;

  std::mutex mutex_;  // guards everything below
  std::condition_variable queued_;
  std::condition_variable answered_;
  uint64_t next_id_ = 1;
  std::deque<std::pair<uint64_t, LayerSelectRequest>> queue_;
  // Submitted and not collected or forgotten: the answer once it is there.
  std::map<uint64_t, absl::StatusOr<LayerSelection>> outstanding_;
  std::map<uint64_t, bool> answered_ids_;  // ids of outstanding_ whose answer is in
  std::map<uint64_t, bool>
      enqueued_ids_;  // ids of outstanding_ whose device selections are enqueued
  bool closed_ = false;
  std::thread thread_;
  std::mutex close_mutex_;  // serializes Close()
};

}  // namespace dsa
