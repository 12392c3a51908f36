// The indexer side of the NCCL data plane: one thread per attention worker that receives its
// requests over the link (nccl_link.h), runs them (RunLayerSelect over the Indexer) and sends the
// answers back, in order; and NcclDataPlanes, which opens them for the OpenDataPlane RPC. The
// attention side is NcclSelectionTransport (nccl_transport.h, nccl_bootstrap.h).
//
// Lifetime: Start() begins serving at once. The session ends (the thread returns, the link is
// released) when the attention side sends its close message (final status OK); when the link
// fails (an NCCL or CUDA error, a header that does not decode, a peer that stops in the middle of
// a request for peer_timeout: UNAVAILABLE or INTERNAL, the link aborted so the peer fails too);
// or on Stop() (CANCELLED; the link is aborted, so an attention side still waiting gets
// UNAVAILABLE). Idle waiting for the next request is unbounded: an attention worker that dies
// while idle is noticed by NCCL's async error where the network reports it, otherwise by the
// owner (NcclDataPlanes stops the old server when the worker opens a new data plane).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "dsa/indexer/v1/indexer.pb.h"
#include "indexer_service/data_plane.h"
#include "indexer_service/indexer.h"
#include "indexer_service/metrics.h"
#include "transport/nccl_comm_impl.h"
#include "transport/nccl_wire.h"

namespace dsa {

/// Settings of an NcclSelectionServer.
struct NcclServerOptions {
  /// Must equal the attention side's (OpenDataPlane settles them).
  WireLimits limits{};
  /// Once a request's header has arrived, its payload must arrive and its answer be taken within
  /// this long, else the peer is lost (UNAVAILABLE, link aborted).
  absl::Duration peer_timeout = absl::Seconds(10);
  /// The clock of peer_timeout, of the idle checks and of the deadlines Wait takes (NcclDataPlanes:
  /// also of connect_timeout). Its time base must be the link's (NcclLink waits on the system
  /// clock): SystemClock, the default, outside tests. Not owned; must outlive the server.
  const Clock* clock = &SystemClock();
};

/// Thread-safe (Stop, Wait and the counters from any thread).
class NcclSelectionServer {
 public:
  /// Serves the kIndexer endpoint of `link` (ready: WaitReady OK) with RunLayerSelect over
  /// `indexer` (and `metrics`, optional, which also gets the cache gauges after every request);
  /// both outlive the server. `check_owned` (optional) holds every request's sequences to the
  /// caller that opened the data plane (WithOwnerCheck: a refused request answers its
  /// PERMISSION_DENIED with groups_applied 0). RESOURCE_EXHAUSTED when the first staging buffers
  /// cannot be had.
  static absl::StatusOr<std::unique_ptr<NcclSelectionServer>> Start(
      Indexer& indexer, IndexerMetrics* metrics, std::shared_ptr<NcclLink> link,
      const NcclServerOptions& options, SequenceOwnerCheck check_owned = nullptr);
  /// The same with another handler (tests and the transport benchmark answer without an Indexer).
  static absl::StatusOr<std::unique_ptr<NcclSelectionServer>> StartWithHandler(
      WireSelectHandler handler, std::shared_ptr<NcclLink> link, const NcclServerOptions& options);

  /// Stop()s.
  ~NcclSelectionServer();
  NcclSelectionServer(const NcclSelectionServer&) = delete;
  NcclSelectionServer& operator=(const NcclSelectionServer&) = delete;

  /// Ends the session now if it is still running (the link is aborted) and joins the thread.
  /// Bounded: the thread is never inside an NCCL call that waits for the peer. Idempotent.
  void Stop();

  /// Waits until the session ended, up to `deadline`: its final status (OK after the peer's close
  /// message), or DEADLINE_EXCEEDED while it is still serving.
  absl::Status Wait(absl::Time deadline);

  /// True until the session ended.
  bool serving() const;
  /// Requests answered (selections and refusals).
  int64_t requests_answered() const { return requests_answered_.load(); }

 private:
  NcclSelectionServer(WireSelectHandler handler, std::shared_ptr<NcclLink> link,
                      const NcclServerOptions& options);
  void Serve();
  absl::Status ServeOne(bool* closed);
  void Finish(const absl::Status& status);

  const WireSelectHandler handler_;
  const std::shared_ptr<NcclLink> link_;
  const NcclServerOptions options_;
  // Staging: header, payload, answer; and their events.
  NcclStagingBuffer host_header_{NcclStagingBuffer::Kind::kHost};
  NcclStagingBuffer device_header_{NcclStagingBuffer::Kind::kDevice};
  NcclStagingBuffer host_payload_{NcclStagingBuffer::Kind::kHost};
  NcclStagingBuffer device_payload_{NcclStagingBuffer::Kind::kDevice};
  NcclStagingBuffer host_answer_{NcclStagingBuffer::Kind::kHost};
  NcclStagingBuffer device_answer_{NcclStagingBuffer::Kind::kDevice};
  cudaEvent_t header_done_ = nullptr, payload_done_ = nullptr, answer_done_ = nullptr;

  std::atomic<bool> stop_{false};
  std::atomic<int64_t> requests_answered_{0};
  mutable std::mutex mutex_;  // guards done_ and final_status_
  std::condition_variable ended_;
  bool done_ = false;
  absl::Status final_status_;
  std::mutex stop_mutex_;  // serializes Stop
  std::thread thread_;
};

/// The indexer side's settings.
struct NcclDataPlaneOptions {
  NcclLinkOptions link{};  // link.cuda_device: the indexer's GPU
  NcclServerOptions server{};
  /// Bound on joining the communicator once the request arrived.
  absl::Duration connect_timeout = absl::Seconds(30);
  /// How a data plane's link is joined: null (production) joins the request's two-rank
  /// communicator as rank 1 on link.cuda_device and waits for it up to connect_timeout. Tests
  /// on one GPU inject a loopback link here (NCCL refuses two ranks on one device).
  std::function<absl::StatusOr<std::shared_ptr<NcclLink>>(const ncclUniqueId&)> join;
};

/// The indexer's data planes: what IndexerServiceImpl::SetDataPlaneOpener gets (Opener()), one
/// NcclSelectionServer per attention worker. Thread-safe. Destruction stops every server; it must
/// come before the IndexerServiceImpl's, whose owner table the servers' checks
/// (DataPlaneCaller::check_owned) read.
class NcclDataPlanes {
 public:
  /// `indexer` and `metrics` (optional) outlive this object.
  NcclDataPlanes(Indexer& indexer, IndexerMetrics* metrics, const NcclDataPlaneOptions& options);
  ~NcclDataPlanes();
  NcclDataPlanes(const NcclDataPlanes&) = delete;
  NcclDataPlanes& operator=(const NcclDataPlanes&) = delete;

  /// Checks `request` (INVALID_ARGUMENT: id not NCCL_UNIQUE_ID_BYTES long, ranks other than 2 and
  /// 1, max_top_k < 1, max_message_bytes below 64 KiB, H or D differing from the indexer's: the
  /// message names the field and both values), joins the communicator as rank 1 (UNAVAILABLE if
  /// it does not come up within connect_timeout), starts its server, whose selects are held to
  /// `caller`'s sequences (caller.check_owned). A worker name already served stops its old server
  /// first (that worker restarted). A name belongs to the caller (caller.identity) that first
  /// opened a data plane under it, for this object's lifetime: another caller gets
  /// PERMISSION_DENIED and nothing changes, so one caller cannot take over or lock out another's
  /// attention worker. Sessions that ended are dropped.
  absl::Status Open(const dsa::indexer::v1::OpenDataPlaneRequest& request,
                    const DataPlaneCaller& caller,
                    dsa::indexer::v1::OpenDataPlaneResponse* response);

  /// Open as an IndexerServiceImpl DataPlaneOpener (this object outlives the service's calls).
  DataPlaneOpener Opener();

  /// Data planes still serving.
  int num_serving() const;

 private:
  struct Session {
    uint64_t id = 0;
    std::string attention_worker;
    std::unique_ptr<NcclSelectionServer> server;
  };
  Indexer& indexer_;
  IndexerMetrics* metrics_;
  const NcclDataPlaneOptions options_;
  mutable std::mutex mutex_;
  uint64_t next_id_ = 1;
  std::vector<Session> sessions_;
  std::map<std::string, std::string> name_owners_;  // attention worker name -> identity
};

}  // namespace dsa
