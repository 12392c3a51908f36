// The attention side of the NCCL data plane's bootstrap (see nccl_bootstrap.h).
#include "transport/nccl_bootstrap.h"

#include <algorithm>
#include <string>
#include <utility>

#include "contracts/grpc_status.h"
#include "grpcpp/grpcpp.h"

namespace dsa {

namespace v1 = ::dsa::indexer::v1;

absl::StatusOr<std::unique_ptr<NcclSelectionTransport>> ConnectNcclSelectionTransport(
    v1::IndexerService::StubInterface& stub, const NcclConnectOptions& options) {
  const absl::Time deadline = options.transport.clock->Now() + options.connect_timeout;
  if (cudaError_t e = cudaSetDevice(options.link.cuda_device); e != cudaSuccess) {
    return CudaError("cudaSetDevice", e);
  }
  ncclUniqueId unique_id;
  if (ncclResult_t r = ncclGetUniqueId(&unique_id); r != ncclSuccess) {
    return NcclError("ncclGetUniqueId", r);
  }
  // Rank 0 starts joining first (non-blocking), so the indexer's join can complete while it
  // answers the RPC.
  absl::StatusOr<std::shared_ptr<NcclLink>> link =
      StartTwoRankNcclLink(unique_id, /*rank=*/0, options.link);
  if (!link.ok()) return link.status();

  v1::OpenDataPlaneRequest request;
  request.set_nccl_unique_id(std::string(unique_id.internal, sizeof(unique_id.internal)));
  request.set_num_ranks(2);
  request.set_indexer_rank(1);
  request.set_attention_cuda_device(options.link.cuda_device);
  request.set_num_heads(options.num_heads);
  request.set_head_dim(options.head_dim);
  request.set_max_top_k(options.transport.limits.max_top_k);
  request.set_max_message_bytes(options.transport.limits.max_message_bytes);
  request.set_attention_worker(options.attention_worker);
  v1::OpenDataPlaneResponse response;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  const grpc::Status rpc = stub.OpenDataPlane(&context, request, &response);
  if (!rpc.ok()) {
    const absl::Status status = FromGrpcStatus(rpc, "OpenDataPlane");
    (*link)->Abort(status);
    return status;
  }
  if (absl::Status s = (*link)->WaitReady(deadline); !s.ok()) return s;
  NcclTransportOptions transport = options.transport;
  if (response.max_message_bytes() > 0) {
    transport.limits.max_message_bytes =
        std::min(transport.limits.max_message_bytes, response.max_message_bytes());
  }
  return std::make_unique<NcclSelectionTransport>(std::move(*link), transport);
}

}  // namespace dsa
