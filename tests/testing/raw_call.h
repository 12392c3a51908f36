// A test client that sends raw bytes as a call's messages, for requests that do not parse
// (server/parse_errors.h): the generated stubs can only send valid messages.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "grpcpp/support/sync_stream.h"

namespace dsa::testing {

/// What a raw call saw: its status and the responses' bytes.
struct RawCallResult {
  grpc::Status status;
  std::vector<std::string> responses;
};

/// Calls `method` ("/package.Service/Method") on `channel`, writing each of `messages` as one
/// message, half-closing, then reading every response until the status. The wire does not tell a
/// unary, client-, server- or bidi-streaming call apart, so this serves all four.
inline RawCallResult RawCall(const std::shared_ptr<grpc::Channel>& channel,
                             const std::string& method, const std::vector<std::string>& messages) {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel.get(),
          grpc::internal::RpcMethod(method.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING),
          &context));
  for (const std::string& message : messages) {
    grpc::Slice slice(message);
    grpc::ByteBuffer buffer(&slice, 1);
    if (!stream->Write(buffer)) break;
  }
  stream->WritesDone();
  RawCallResult result;
  grpc::ByteBuffer response;
  while (stream->Read(&response)) {
    std::vector<grpc::Slice> slices;
    (void)response.Dump(&slices);
    std::string bytes;
    for (const grpc::Slice& slice : slices) {
      bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    result.responses.push_back(std::move(bytes));
  }
  result.status = stream->Finish();
  return result;
}

/// Bytes that no protobuf message parses: a tag whose varint never ends.
inline std::string UnparseableMessage() { return std::string(11, '\xff'); }

}  // namespace dsa::testing
