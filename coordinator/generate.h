// What a Generate call of the coordinator's engine (engine.h) exchanges with its client: the
// client's side of the call, GenerateStream, which the gRPC adapter (service.h) and the tests
// implement.
#pragma once

#include "dsa/coordinator/v1/coordinator.pb.h"

namespace dsa {

/// The client's side of one Generate call, as its transport gives it to the engine (the gRPC
/// adapter wraps the ServerWriter and ServerContext; the tests give a recorder).
class GenerateStream {
 public:
  virtual ~GenerateStream() = default;
  /// Sends one event, blocking while the client's flow control is full; false when the call is
  /// gone (the client left, or the call was cancelled).
  virtual bool Write(const dsa::coordinator::v1::GenerateEvent& event) = 0;
  /// Whether the call was cancelled (the client cancelled, its deadline passed, the server is
  /// shutting down, or TryCancel).
  virtual bool IsCancelled() = 0;
  /// Cancels the call from another thread: a Write in progress returns false.
  virtual void TryCancel() = 0;
};

}  // namespace dsa
