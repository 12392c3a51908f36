// IndexerClient over gRPC: dsa.indexer.v1.IndexerService's unary calls and AppendIndexKeys stream
// for the control plane, a GrpcStreamTransport (SelectStream) for the data plane.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "transport/grpc_stream_transport.h"
#include "transport/indexer_client.h"

namespace dsa {

class GrpcIndexerClient final : public IndexerClient {
 public:
  /// A client of the indexer worker at `address` (host:port) on a channel that takes answers up to
  /// kMaxReceiveMessageBytes (indexer_service/grpc_service.h). Connects lazily.
  explicit GrpcIndexerClient(std::string address);
  /// The same on `channel`, with `data_plane` (e.g. an NCCL transport bootstrapped over this
  /// channel) in place of the SelectStream.
  GrpcIndexerClient(std::string address, std::shared_ptr<grpc::Channel> channel,
                    std::unique_ptr<SelectionTransport> data_plane);

  /// The channel a client of `address` uses (a receive limit of kMaxReceiveMessageBytes).
  static std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address);
  ~GrpcIndexerClient() override;  // Close()s

  const std::string& address() const override { return address_; }
  absl::StatusOr<IndexerShape> GetShape(absl::Time deadline) override;
  absl::Status CreateSequence(const IndexerSequenceSpec& spec, absl::Time deadline) override;
  /// Chunks go out as AppendIndexKeysRequest messages, each split under kMaxAppendChunkBytes.
  std::unique_ptr<IndexKeyAppend> BeginAppend(uint64_t sequence_id, absl::Time deadline) override;
  absl::Status BeginTurn(uint64_t sequence_id, absl::Time deadline) override;
  absl::Status Commit(uint64_t sequence_id, int accepted, absl::Time deadline) override;
  absl::Status Release(uint64_t sequence_id, absl::Time deadline) override;
  /// The injected data plane, or the SelectStream (opened on first use).
  SelectionTransport& Selections() override;
  absl::Status Close() override;

  /// A factory of GrpcIndexerClient for any address.
  static IndexerClientFactory Factory();

 private:
  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<dsa::indexer::v1::IndexerService::Stub> stub_;
  std::mutex transport_mutex_;  // guards transport_
  std::unique_ptr<SelectionTransport> transport_;
};

}  // namespace dsa
