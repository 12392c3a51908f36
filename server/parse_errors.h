// Requests that do not parse (docs/reliability.md, "Hostile input"): every RPC of the three
// services answers a message that is not a valid protobuf of its request type - malformed bytes, a
// wrong wire type, a string field that is not UTF-8 - with INVALID_ARGUMENT and a message saying
// so, never gRPC's bare INTERNAL or a stream that ends OK as if the client had half-closed.
//
// Unary and server-streaming methods: gRPC parses the request before the handler runs and, on
// failure, answers INTERNAL with an empty message; ParseErrorInterceptorFactory's interceptor
// sees that no request message arrived and replaces that status. Client- and bidi-streaming
// methods: the synchronous API's Read returns false for an unparseable message exactly as at the
// end of the stream, so a streaming handler that must tell them apart reads grpc::ByteBuffer
// (ServeStreamingMethodRaw) and parses each message with ParseStreamMessage.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/server_interceptor.h"

namespace dsa {

/// The interceptor factory (thread-safe, stateless): for a unary or server-streaming call whose
/// request message did not parse, the status sent becomes INVALID_ARGUMENT "<method>: the request
/// is not a valid message of the method's request type (malformed protobuf, or a string field
/// that is not UTF-8)". Other calls pass unchanged.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewParseErrorInterceptorFactory();

/// Installs the interceptors every dsa server runs on `builder`: the parse-error one, then
/// `more` (RunServer adds the request log, server/server.h). RunServer calls it; so do tests that
/// stand up a service on their own builder.
void AddServerInterceptors(
    grpc::ServerBuilder& builder,
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> more = {});

/// Parses message `index` (0-based) of a stream into `message`. INVALID_ARGUMENT "message
/// <index> of the stream is not a valid <full type name> (malformed protobuf, or a string field
/// that is not UTF-8)" when it does not parse; `message` is then unspecified.
absl::Status ParseStreamMessage(grpc::ByteBuffer& buffer, int64_t index,
                                google::protobuf::Message* message);

}  // namespace dsa
