// IndexerClients with an NCCL data plane (see nccl_indexer_client.h).
#include "transport/nccl_indexer_client.h"

#include <memory>
#include <string>
#include <utility>

#include "common/status_macros.h"
#include "transport/grpc_indexer_client.h"

namespace dsa {

IndexerClientFactory NcclIndexerClientFactory(NcclConnectOptions options, ClientSecurity security) {
  return [options = std::move(options), security = std::move(security)](
             const std::string& address) -> absl::StatusOr<std::shared_ptr<IndexerClient>> {
    DSA_RETURN_IF_ERROR(GrpcIndexerClient::CheckAddress(address));
    // The control plane is usable at once; the communicator is bootstrapped on the first select.
    return std::shared_ptr<IndexerClient>(std::make_shared<GrpcIndexerClient>(
        address, GrpcIndexerClient::MakeChannel(address, security),
        [options](dsa::indexer::v1::IndexerService::Stub& stub)
            -> absl::StatusOr<std::unique_ptr<SelectionTransport>> {
          DSA_ASSIGN_OR_RETURN(std::unique_ptr<NcclSelectionTransport> transport,
                               ConnectNcclSelectionTransport(stub, options));
          return std::unique_ptr<SelectionTransport>(std::move(transport));
        }));
  };
}

}  // namespace dsa
