// The check that scripts/tsan.sh's ThreadSanitizer can see absl::Mutex (docs/reliability.md,
// "ThreadSanitizer"): two threads increment one counter 100,000 times each, under an absl::Mutex
// ("guarded") or not ("unguarded"), and the main thread Awaits both under the Mutex. Under TSan
// with an instrumented Abseil, "guarded" must run clean and "unguarded" must be reported as a data
// race; with Debian's uninstrumented Abseil "guarded" is reported too, which is what the script
// rules out before it trusts the suites' silence.
//
// usage: tsan_mutex_canary guarded|unguarded    (exit 0; TSan's own exit code on a report)
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/synchronization/mutex.h"

namespace {

constexpr int kIncrementsPerThread = 100000;

absl::Mutex mu;
int counter = 0;
int finished ABSL_GUARDED_BY(mu) = 0;

void Increment(bool guarded) {
  for (int i = 0; i < kIncrementsPerThread; ++i) {
    if (guarded) {
      absl::MutexLock lock(&mu);
      ++counter;
    } else {
      ++counter;
    }
  }
  absl::MutexLock lock(&mu);
  ++finished;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 ||
      (std::strcmp(argv[1], "guarded") != 0 && std::strcmp(argv[1], "unguarded") != 0)) {
    std::fprintf(stderr, "usage: %s guarded|unguarded\n", argv[0]);
    return 2;
  }
  const bool guarded = std::strcmp(argv[1], "guarded") == 0;
  std::thread a(Increment, guarded);
  std::thread b(Increment, guarded);
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](int* done) { return *done == 2; }, &finished));
  }
  a.join();
  b.join();
  absl::MutexLock lock(&mu);
  std::printf("counter %d\n", counter);
  return 0;
}
