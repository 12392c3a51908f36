// See parse_errors.h.
#include "server/parse_errors.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/impl/codegen/proto_utils.h"

namespace dsa {
namespace {

using grpc::experimental::InterceptionHookPoints;
using grpc::experimental::ServerRpcInfo;

// One per call. A unary or server-streaming call receives exactly one request message before its
// handler runs; POST_RECV_MESSAGE without a message means gRPC failed to parse it.
class ParseErrorInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit ParseErrorInterceptor(ServerRpcInfo* info)
      : method_(info->method()),
        single_request_(info->type() == ServerRpcInfo::Type::UNARY ||
                        info->type() == ServerRpcInfo::Type::SERVER_STREAMING) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (single_request_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      unparsed_ = true;
    }
    if (unparsed_ && methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      methods->ModifySendStatus(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat(method_,
                       ": the request is not a valid message of the method's request type "
                       "(malformed protobuf, or a string field that is not UTF-8)")));
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
  const bool single_request_;
  bool unparsed_ = false;
};

class ParseErrorInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(ServerRpcInfo* info) override {
    return new ParseErrorInterceptor(info);
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
NewParseErrorInterceptorFactory() {
  return std::make_unique<ParseErrorInterceptorFactory>();
}

void AddServerInterceptors(
    grpc::ServerBuilder& builder,
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> more) {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> factories;
  factories.push_back(NewParseErrorInterceptorFactory());
  for (auto& factory : more) factories.push_back(std::move(factory));
  builder.experimental().SetInterceptorCreators(std::move(factories));
}

absl::Status ParseStreamMessage(grpc::ByteBuffer& buffer, int64_t index,
                                google::protobuf::Message* message) {
  const grpc::Status status =
      grpc::SerializationTraits<google::protobuf::Message>::Deserialize(&buffer, message);
  if (status.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "message ", index, " of the stream is not a valid ", message->GetDescriptor()->full_name(),
      " (malformed protobuf, or a string field that is not UTF-8)"));
}

}  // namespace dsa
