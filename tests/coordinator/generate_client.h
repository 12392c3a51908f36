// Calls of the coordinator's Generate for its tests: a request, and one call run to its end with
// every event kept. Shared by the in-process fixture (service_fixture.h), the tests over the real
// attention worker (with_attention_test.cc) and the binary's tests
// (dsa_coordinator_binary_test.cc), so it needs nothing beyond the generated stubs and gRPC.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "dsa/coordinator/v1/coordinator.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace dsa::coordinator_testing {

inline ::dsa::coordinator::v1::GenerateRequest Request(const std::string& id, int64_t context,
                                                       int64_t max_new, int draft = 0) {
  ::dsa::coordinator::v1::GenerateRequest r;
  r.set_request_id(id);
  r.set_context_length(context);
  r.set_max_new_tokens(max_new);
  r.set_draft_length(draft);
  return r;
}

struct Stream {
  grpc::Status status;
  std::vector<::dsa::coordinator::v1::GenerateEvent> events;
  int64_t TokenCount() const {
    int64_t n = 0;
    for (const auto& e : events) n += e.has_tokens() ? e.tokens().count() : 0;
    return n;
  }
  const ::dsa::coordinator::v1::Admitted* admitted() const {
    return !events.empty() && events.front().has_admitted() ? &events.front().admitted() : nullptr;
  }
  // Whether any event is of the kind `has` tells (e.g. &GenerateEvent::has_finished).
  bool Any(bool (::dsa::coordinator::v1::GenerateEvent::*has)() const) const {
    for (const auto& e : events) {
      if ((e.*has)()) return true;
    }
    return false;
  }
};

// Runs one Generate call to its end, or to `timeout`; notifies `admitted` (when given) on the
// first Admitted event, so that a caller on another thread knows the request is running.
inline Stream Generate(::dsa::coordinator::v1::CoordinatorService::Stub& stub,
                       const ::dsa::coordinator::v1::GenerateRequest& request,
                       std::chrono::seconds timeout = std::chrono::seconds(30),
                       absl::Notification* admitted = nullptr) {
  Stream stream;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  auto reader = stub.Generate(&context, request);
  ::dsa::coordinator::v1::GenerateEvent event;
  while (reader->Read(&event)) {
    if (event.has_admitted() && admitted != nullptr && !admitted->HasBeenNotified()) {
      admitted->Notify();
    }
    stream.events.push_back(event);
  }
  stream.status = reader->Finish();
  return stream;
}

}  // namespace dsa::coordinator_testing
