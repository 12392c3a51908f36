// What the indexer's gRPC adapter (grpc_service.h) hands the data plane it opens for
// OpenDataPlane (the NCCL one: NcclDataPlanes in transport/nccl_server.h), kept apart from both so
// that neither depends on the other.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "dsa/indexer/v1/indexer.pb.h"

namespace dsa {

/// Who opened a data plane, for the data plane's own checks: the selects that arrive over it
/// bypass the gRPC handlers, so they are held to the same owners through `check_owned`.
struct DataPlaneCaller {
  /// The OpenDataPlane caller's identity (server/security.h CallerIdentity: the client
  /// certificate's name under mutual TLS, "" without it).
  std::string identity;
  /// OK when sequence `sequence_id` has no owner, is `identity`'s, or `identity` is an operator;
  /// else PERMISSION_DENIED "sequence <id> belongs to another caller" (OwnerTable::Check). Safe to
  /// call from any thread while the service lives.
  std::function<absl::Status(uint64_t sequence_id)> check_owned;
};

/// Opens a data plane for OpenDataPlane (the NCCL one: NcclDataPlanes in transport/
/// nccl_server.h), injected so that the gRPC adapter (IndexerServiceImpl) does not depend on NCCL.
/// Fills `response` or returns the status the RPC answers with. Called on gRPC's threads,
/// concurrently.
using DataPlaneOpener =
    std::function<absl::Status(const dsa::indexer::v1::OpenDataPlaneRequest&,
                               const DataPlaneCaller&, dsa::indexer::v1::OpenDataPlaneResponse*)>;

}  // namespace dsa
