// The clock the engines read time from, injected so that tests decide when time passes: the real
// monotonic clock in the servers, a FakeClock that moves only when told in the tests.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dsa {

/// A source of time points. Thread-safe. Only differences of its time points mean anything
/// (RealClock is monotonic, not wall time).
class Clock {
 public:
  virtual ~Clock() = default;
  /// The current time point.
  virtual absl::Time Now() const = 0;
};

/// The process's monotonic clock (std::chrono::steady_clock as an absl::Time since its epoch).
/// A static object: never destroyed, safe from any thread.
Clock& RealClock();

/// The system clock (absl::Now()): not monotonic, but the time base of the absolute deadlines
/// that gRPC, absl's waits and the transports (transport/selection_transport.h,
/// transport/indexer_client.h) take, so the clock of code that hands them deadlines. A static
/// object: never destroyed, safe from any thread.
Clock& SystemClock();

/// A clock that stands still until Advance or Set moves it (tests). Starts at absl::UnixEpoch()
/// plus one hour. Thread-safe.
class FakeClock final : public Clock {
 public:
  absl::Time Now() const override;
  /// Moves the clock forward by `d` (>= 0; a negative duration is ignored).
  void Advance(absl::Duration d);

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::UnixEpoch() + absl::Hours(1);
};

}  // namespace dsa
