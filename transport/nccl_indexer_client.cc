// IndexerClients with an NCCL data plane (see nccl_indexer_client.h).
#include "transport/nccl_indexer_client.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "transport/grpc_indexer_client.h"

namespace dsa {

IndexerClientFactory NcclIndexerClientFactory(NcclConnectOptions options) {
  return [options = std::move(options)](
             const std::string& address) -> absl::StatusOr<std::shared_ptr<IndexerClient>> {
    if (address.empty()) return absl::InvalidArgumentError("no indexer_worker address");
    std::shared_ptr<grpc::Channel> channel = GrpcIndexerClient::MakeChannel(address);
    auto stub = dsa::indexer::v1::IndexerService::NewStub(channel);
    auto transport = ConnectNcclSelectionTransport(*stub, options);
    if (!transport.ok()) {
      return absl::Status(transport.status().code(),
                          absl::StrCat("indexer worker ", address,
                                       ": NCCL data plane: ", transport.status().message()));
    }
    return std::shared_ptr<IndexerClient>(
        std::make_shared<GrpcIndexerClient>(address, std::move(channel), std::move(*transport)));
  };
}

}  // namespace dsa
