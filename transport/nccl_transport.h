// SelectionTransport over NCCL point-to-point between an attention GPU and an indexer GPU (the
// attention side; NcclSelectionServer in nccl_server.h is the indexer side). Submit packs a layer's
// request (nccl_wire.h) into pinned memory and posts, on the link's stream, the request's header
// and payload sends and the receive of its answer; Await polls the answer's CUDA event (and the
// communicator's async error) until the caller's deadline. The indexer answers in order; ids are
// checked. A peer that does not answer within peer_timeout, or an NCCL error, aborts the
// communicator and fails every outstanding request with UNAVAILABLE: no call ever hangs.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "transport/nccl_comm_impl.h"
#include "transport/nccl_wire.h"
#include "transport/selection_transport.h"

namespace dsa {

/// Settings of an NcclSelectionTransport.
struct NcclTransportOptions {
  /// Message sizes; the indexer side must use the same (OpenDataPlane settles them).
  WireLimits limits{};
  /// Requests submitted and not yet answered (forgotten ones included) at most; Submit beyond it
  /// answers RESOURCE_EXHAUSTED. Each holds its own staging buffers.
  int max_outstanding = 64;
  /// An answer not back this long after its Submit means the indexer is lost: the communicator is
  /// aborted and every outstanding request fails with UNAVAILABLE.
  absl::Duration peer_timeout = absl::Seconds(10);
  /// Bound on Close: waiting for the outstanding answers, sending the close message, finalizing.
  absl::Duration close_timeout = absl::Seconds(5);
  /// The clock of peer_timeout and close_timeout, and of the deadlines Await takes. Its time base
  /// must be the link's (NcclLink waits on the system clock): SystemClock, the default, outside
  /// tests. Not owned; must outlive the transport.
  const Clock* clock = &SystemClock();
};

/// Thread-safe: any thread may Submit and Await (NCCL calls are serialized by the link).
class NcclSelectionTransport final : public SelectionTransport {
 public:
  /// Serves the kAttention endpoint of `link`, which must be ready (WaitReady OK; a loopback link
  /// is ready when created). The indexer side, NcclSelectionServer, serves kIndexer with the same
  /// limits.
  NcclSelectionTransport(std::shared_ptr<NcclLink> link, const NcclTransportOptions& options);
  /// Close()s, then frees the staging buffers.
  ~NcclSelectionTransport() override;
  NcclSelectionTransport(const NcclSelectionTransport&) = delete;
  NcclSelectionTransport& operator=(const NcclSelectionTransport&) = delete;

  /// Packs and posts `request` (nothing is sent when it fails). INVALID_ARGUMENT for a request the
  /// wire cannot carry (SizeWireRequest: no groups, tensor sizes that do not match num_rows, H,
  /// D); RESOURCE_EXHAUSTED for one over `limits` (naming the limit), over max_outstanding, or
  /// staging memory; UNAVAILABLE once closed or after the peer was lost (the message says why).
  absl::StatusOr<uint64_t> Submit(LayerSelectRequest request) override;

  /// See SelectionTransport::Await. Besides: INTERNAL when this answer is corrupt (its header or
  /// payload fails the wire checks, or it does not match the request's groups and rows); a
  /// wrong request id aborts the link (the two sides are out of step: UNAVAILABLE for all).
  absl::StatusOr<LayerSelection> Await(uint64_t request_id, absl::Time deadline) override;

  /// See SelectionTransport::Forget: the answer is still received (the receive is posted), then
  /// its buffers are reused.
  void Forget(uint64_t request_id) override;

  /// Waits (up to close_timeout in all) for the outstanding answers, which stay awaitable, sends
  /// the close message and releases the link. OK when all of it finished; UNAVAILABLE when the
  /// peer was lost before or during it (the link is aborted, unanswered requests fail).
  absl::Status Close() override;

  /// The link's device (for the attention engine's placement).
  int cuda_device() const { return link_->cuda_device(); }

 private:
  struct Slot {
    Slot()
        : host_send(NcclStagingBuffer::Kind::kHost),
          device_send(NcclStagingBuffer::Kind::kDevice),
          host_answer(NcclStagingBuffer::Kind::kHost),
          device_answer(NcclStagingBuffer::Kind::kDevice) {}
    ~Slot();
    NcclStagingBuffer host_send, device_send, host_answer, device_answer;
    cudaEvent_t answered = nullptr;  // recorded after the answer is in host_answer
    uint64_t request_id = 0;
    uint64_t answer_seq = 0;  // the answer receive's sequence on the attention endpoint
    int64_t answer_bytes = 0;
    std::vector<int> rows;  // per group, to check the answer against
    absl::Time submitted;
    bool answered_seen = false;  // the event completed
    bool failed = false;         // the link was lost before the answer came
    bool forgotten = false;
  };

  // Aborts the link with `reason` and marks every unanswered slot failed.
  void FailLocked(const absl::Status& reason);
  // Slots forgotten whose answer has arrived go back to the free list; an unanswered slot past
  // peer_timeout fails the link.
  void ReapLocked(absl::Time now);
  // Decodes the answer in `slot` (its event completed).
  absl::StatusOr<LayerSelection> DecodeAnswerLocked(Slot& slot);
  void RecycleLocked(std::map<uint64_t, std::shared_ptr<Slot>>::iterator it);

  const std::shared_ptr<NcclLink> link_;
  const NcclTransportOptions options_;

  std::mutex close_mutex_;  // serializes Close
  std::mutex mutex_;        // guards everything below; Submit's posts happen under it (order)
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::shared_ptr<Slot>> slots_;  // submitted, not collected (id order)
  std::vector<std::shared_ptr<Slot>> free_slots_;
  std::vector<std::shared_ptr<Slot>> retired_;  // failed: freed after the stream drained
  absl::Status failed_;                         // OK, or why the data plane is lost
  bool closing_ = false;
  bool closed_ = false;
  absl::Status close_status_;
};

}  // namespace dsa
