// The real and the fake clock (see clock.h).
#include "common/clock.h"

#include <chrono>

namespace dsa {
namespace {

class SteadyClock final : public Clock {
 public:
  absl::Time Now() const override {
    return absl::UnixEpoch() +
           absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
  }
};

class AbslClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

}  // namespace

Clock& RealClock() {
  static Clock* const clock = new SteadyClock();
  return *clock;
}

Clock& SystemClock() {
  static Clock* const clock = new AbslClock();
  return *clock;
}

absl::Time FakeClock::Now() const {
  absl::MutexLock lock(&mu_);
  return now_;
}

void FakeClock::Advance(absl::Duration d) {
  if (d < absl::ZeroDuration()) return;
  absl::MutexLock lock(&mu_);
  now_ += d;
}

}  // namespace dsa
