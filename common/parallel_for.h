// A minimal fork-join loop for the host's generators (index keys, KV rows): no pool kept between
// calls, the caller's thread takes part.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace dsa {

/// Runs fn(i) for every i in [0, n) on up to `threads` threads (the caller's included), item i on
/// thread i % workers; returns when all are done. fn must be safe to call concurrently for
/// distinct i. threads < 1 counts as 1.
template <typename Fn>
void ParallelFor(int64_t n, int threads, const Fn& fn) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  if (workers == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int64_t w = 1; w < workers; ++w) {
    pool.emplace_back([&fn, n, w, workers] {
      for (int64_t i = w; i < n; i += workers) fn(i);
    });
  }
  for (int64_t i = 0; i < n; i += workers) fn(i);
  for (std::thread& t : pool) t.join();
}

}  // namespace dsa
