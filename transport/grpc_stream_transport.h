// SelectionTransport over dsa.indexer.v1.IndexerService/SelectStream: one bidirectional gRPC stream
// per (attention worker, indexer worker) pair; the indexer answers requests in the order they
// arrive (two threads submitting at once may write in either order; ids are matched, not assumed).
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "transport/selection_transport.h"

namespace dsa {

class GrpcStreamTransport final : public SelectionTransport {
 public:
  /// How long Close() waits, by default, for the indexer to end the stream after WritesDone. A
  /// live indexer answers what is outstanding and ends it within a round trip; the grace is only
  /// spent in full on a peer that is hung or unreachable, and bounds how long Close blocks then.
  static constexpr absl::Duration kDefaultCloseGrace = absl::Seconds(5);

  /// Opens the stream on `channel` (not yet connected is fine: the first write connects).
  /// `close_grace` (wall-clock time, >= 0): how long Close() waits for the indexer to end the
  /// stream before it cancels the stream (see kDefaultCloseGrace).
  explicit GrpcStreamTransport(std::shared_ptr<grpc::Channel> channel,
                               absl::Duration close_grace = kDefaultCloseGrace);
  ~GrpcStreamTransport() override;  // Close()s

  /// Encodes the layer as one SelectRequest (fp32 tensors) and writes it on the stream.
  absl::StatusOr<uint64_t> Submit(LayerSelectRequest request) override;
  /// The answer decoded; INTERNAL when it does not match the request (group count, shapes).
  absl::StatusOr<LayerSelection> Await(uint64_t request_id, absl::Time deadline) override;
  void Forget(uint64_t request_id) override;
  absl::Status Close() override;
  /// The read side finished (the stream's status arrived) or Close ran.
  bool ended() const override;

 private:
  void ReadLoop();

  const absl::Duration close_grace_;
  std::unique_ptr<dsa::indexer::v1::IndexerService::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<
      grpc::ClientReaderWriter<dsa::indexer::v1::SelectRequest, dsa::indexer::v1::SelectResponse>>
      stream_;
  std::thread reader_;

  std::mutex write_mutex_;  // one writer at a time (gRPC streams allow one outstanding write)
  bool writes_done_ = false;

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable arrived_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::vector<int>> outstanding_;  // submitted, not yet collected: rows a group
  std::map<uint64_t, dsa::indexer::v1::SelectResponse> responses_;
  bool ended_ = false;         // the read side finished
  absl::Status final_status_;  // the stream's status once ended_
  bool closed_ = false;
  std::mutex close_mutex_;  // serializes Close()
};

}  // namespace dsa
