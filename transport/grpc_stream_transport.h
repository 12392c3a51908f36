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

#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "transport/selection_transport.h"

namespace dsa {

class GrpcStreamTransport final : public SelectionTransport {
 public:
  /// Opens the stream on `channel` (not yet connected is fine: the first write connects).
  explicit GrpcStreamTransport(std::shared_ptr<grpc::Channel> channel);
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
