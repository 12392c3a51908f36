// The attention side of the NCCL data plane's bootstrap over the existing gRPC channel
// (dsa.indexer.v1.IndexerService/OpenDataPlane): the attention worker makes the ncclUniqueId,
// starts joining as rank 0 and sends the id with its shapes and limits; the indexer
// (NcclDataPlanes, nccl_server.h) checks them, joins as rank 1 and starts an NcclSelectionServer.
// One communicator per attention-indexer pair.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dsa/indexer/v1/indexer.grpc.pb.h"
#include "transport/nccl_comm_impl.h"
#include "transport/nccl_transport.h"

namespace dsa {

/// The attention side's settings.
struct NcclConnectOptions {
  NcclLinkOptions link{};  // link.cuda_device: the attention worker's GPU
  NcclTransportOptions transport{};
  int num_heads = 64;  // H of the queries this worker sends (checked by the indexer)
  int head_dim = 128;  // D
  /// Bound on the whole bootstrap (the RPC and both ranks joining), on transport.clock (whose time
  /// base must be the system clock's here: the deadline is also the RPC's).
  absl::Duration connect_timeout = absl::Seconds(30);
  std::string attention_worker;  // a name for the indexer's logs
};

/// Opens an NCCL data plane to the indexer behind `stub` and returns its transport. The RPC's
/// status unchanged when the indexer refuses (UNIMPLEMENTED: built without NCCL;
/// FAILED_PRECONDITION: no GPU there; INVALID_ARGUMENT: H or D differ, the message says which);
/// UNAVAILABLE when CUDA or NCCL fail here or the communicator does not come up within
/// connect_timeout. Whatever fails, the half-joined communicator is aborted (nothing hangs).
/// transport.limits.max_message_bytes becomes the smaller of the two sides'.
absl::StatusOr<std::unique_ptr<NcclSelectionTransport>> ConnectNcclSelectionTransport(
    dsa::indexer::v1::IndexerService::StubInterface& stub, const NcclConnectOptions& options);

}  // namespace dsa
