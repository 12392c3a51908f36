// DSA_CHECK: crash loudly on a broken invariant (never for what a request or the environment can
// cause; those get an absl::Status). Abseil 2022 has no absl/log, so this is the project's one
// copy.
#pragma once

#include <cstdio>
#include <cstdlib>

#define DSA_CHECK(condition, message)                                                           \
  do {                                                                                          \
    if (!(condition)) {                                                                         \
      std::fprintf(stderr, "%s:%d: invariant failed: %s: %s\n", __FILE__, __LINE__, #condition, \
                   message);                                                                    \
      std::abort();                                                                             \
    }                                                                                           \
  } while (false)
