// IndexerClients whose data plane is NCCL (dsa-attention --transport nccl): the control plane over
// gRPC (GrpcIndexerClient), the selections over an NCCL communicator bootstrapped over the same
// channel (ConnectNcclSelectionTransport: one communicator per attention-indexer pair).
#pragma once

#include "transport/indexer_client.h"
#include "transport/nccl_bootstrap.h"

namespace dsa {

/// A factory that, for each indexer address, opens the gRPC channel and the NCCL data plane
/// (OpenDataPlane, both ranks joining) before it hands the client over. Errors (the address is not
/// used until a later call succeeds): ConnectNcclSelectionTransport's, with the address in the
/// message: UNIMPLEMENTED (the indexer was built without NCCL), FAILED_PRECONDITION (it has no
/// GPU), INVALID_ARGUMENT (H or D differ), UNAVAILABLE (CUDA or NCCL failed here, or the peer did
/// not join within options.connect_timeout; two ranks on one GPU cannot join).
IndexerClientFactory NcclIndexerClientFactory(NcclConnectOptions options);

}  // namespace dsa
