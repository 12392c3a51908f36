// IndexerClients whose data plane is NCCL (dsa-attention --transport nccl): the control plane over
// gRPC (GrpcIndexerClient), the selections over an NCCL communicator bootstrapped over the same
// channel (ConnectNcclSelectionTransport: one communicator per attention-indexer pair).
#pragma once

#include "server/security.h"
#include "transport/indexer_client.h"
#include "transport/nccl_bootstrap.h"

namespace dsa {

/// A factory of GrpcIndexerClients whose data plane is NCCL: the control plane works at once; the
/// communicator is bootstrapped (OpenDataPlane, both ranks joining, bounded by
/// options.connect_timeout) on the client's first Selections(). A bootstrap that fails makes every
/// Submit answer its error, with the address in the message: UNIMPLEMENTED (the indexer was built
/// without NCCL), FAILED_PRECONDITION (it has no GPU), INVALID_ARGUMENT (H or D differ),
/// UNAVAILABLE (CUDA or NCCL failed here, or the peer did not join in time; two ranks on one GPU
/// cannot join). INVALID_ARGUMENT for an empty address.
IndexerClientFactory NcclIndexerClientFactory(NcclConnectOptions options,
                                              ClientSecurity security = {});

}  // namespace dsa
