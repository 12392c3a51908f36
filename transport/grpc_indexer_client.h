// IndexerClient over gRPC: dsa.indexer.v1.IndexerService's unary calls and AppendIndexKeys stream
// for the control plane, a GrpcStreamTransport (SelectStream) for the data plane.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/host_port.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/security.h"
#include "transport/grpc_stream_transport.h"
#include "transport/indexer_client.h"

namespace dsa {

/// A data plane that could not be opened: every Submit answers `status` (never OK), Await
/// NOT_FOUND, Close OK.
class FailedSelectionTransport final : public SelectionTransport {
 public:
  explicit FailedSelectionTransport(absl::Status status);
  absl::StatusOr<uint64_t> Submit(LayerSelectRequest request) override;
  absl::StatusOr<LayerSelection> Await(uint64_t request_id, absl::Time deadline) override;
  void Forget(uint64_t /*request_id*/) override {}
  absl::Status Close() override { return absl::OkStatus(); }

 private:
  const absl::Status status_;
};

class GrpcIndexerClient final : public IndexerClient {
 public:
  /// A client of the indexer worker at `address` (host:port) on a channel that takes answers up to
  /// kMaxReceiveMessageBytes (indexer_service/grpc_service.h), dialed with `security` (TLS,
  /// mutual TLS; plaintext by default). Connects lazily.
  explicit GrpcIndexerClient(const std::string& address, const ClientSecurity& security = {});
  /// Makes a data plane over the client's stub (e.g. an NCCL transport bootstrapped by
  /// OpenDataPlane); its error is what the data plane's Submit answers.
  using DataPlaneMaker = std::function<absl::StatusOr<std::unique_ptr<SelectionTransport>>(
      dsa::indexer::v1::IndexerService::Stub& stub)>;
  /// The same on `channel`, with the data plane `make_data_plane` makes on the first
  /// Selections() (the control plane never waits for it) in place of the SelectStream.
  GrpcIndexerClient(std::string address, std::shared_ptr<grpc::Channel> channel,
                    DataPlaneMaker make_data_plane);

  /// Bounds of the channel's reconnection backoff (milliseconds): a restarted indexer is dialed
  /// again within kIndexerMaxReconnectBackoffMs of listening.
  static constexpr int kIndexerMinReconnectBackoffMs = 100;
  static constexpr int kIndexerMaxReconnectBackoffMs = 1000;
  /// The channel a client of `address` uses (a receive limit of kMaxReceiveMessageBytes, the
  /// reconnection backoff above, connections not shared with other channels), with `security`.
  static std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                                    const ClientSecurity& security = {});
  ~GrpcIndexerClient() override;  // Close()s

  const std::string& address() const override { return address_; }
  absl::StatusOr<IndexerShape> GetShape(absl::Time deadline) override;
  absl::Status CreateSequence(const IndexerSequenceSpec& spec, absl::Time deadline) override;
  /// Chunks go out as AppendIndexKeysRequest messages, each split under kMaxAppendChunkBytes.
  std::unique_ptr<IndexKeyAppend> BeginAppend(uint64_t sequence_id, absl::Time deadline) override;
  absl::Status BeginTurn(uint64_t sequence_id, absl::Time deadline) override;
  absl::Status Commit(uint64_t sequence_id, int accepted, absl::Time deadline) override;
  absl::Status Release(uint64_t sequence_id, absl::Time deadline) override;
  /// The made data plane, or the SelectStream, opened on first use. A data plane that could not
  /// be made is a transport whose every Submit answers the maker's error (the engine then drops
  /// this client and makes a new one on its next call).
  SelectionTransport& Selections() override;
  absl::Status Close() override;
  /// The SelectStream (or other data plane) was made and its connection has ended.
  bool DataPlaneEnded() const override;

  /// A factory of GrpcIndexerClient for any host:port address (CheckAddress), dialed with
  /// `security`.
  static IndexerClientFactory Factory(ClientSecurity security = {});

  /// OK when `address` is host:port with a port in 1..65535 (ParseHostPort); otherwise
  /// INVALID_ARGUMENT "indexer_worker: ..." saying what is wrong, before anything is dialed.
  static absl::Status CheckAddress(const std::string& address);

 private:
  // One unary call of `method` with `deadline`; its status as FromGrpcStatus gives it, prefixed
  // "indexer worker <address>: <name>".
  template <typename Request, typename Response>
  absl::Status Unary(grpc::Status (dsa::indexer::v1::IndexerService::Stub::*method)(
                         grpc::ClientContext*, const Request&, Response*),
                     const Request& request, absl::string_view name, absl::Time deadline);

  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<dsa::indexer::v1::IndexerService::Stub> stub_;
  DataPlaneMaker make_data_plane_;      // empty: the SelectStream
  mutable std::mutex transport_mutex_;  // guards transport_
  std::unique_ptr<SelectionTransport> transport_;
};

/// `inner` restricted to the indexer workers an attention worker is configured with
/// (dsa-attention --indexer-workers, --indexer-dns): an address in `addresses` as written, or one
/// that a name of `dns_names` ("NAME:PORT") resolves to now (`resolve`; asked only for addresses
/// not in `addresses`, i.e. on a client's first use). Any other address is refused with
/// PERMISSION_DENIED naming it, before anything is dialed, so that a Prefill cannot make the
/// worker connect where it names; UNAVAILABLE when it is not allowed and a name's lookup failed
/// temporarily (the resolver's UNAVAILABLE: retry). Both lists empty = `inner` unchanged.
IndexerClientFactory OnlyIndexerWorkers(IndexerClientFactory inner,
                                        std::vector<std::string> addresses,
                                        std::vector<std::string> dns_names,
                                        AddressResolver resolve = ResolveDnsAddresses);

}  // namespace dsa
