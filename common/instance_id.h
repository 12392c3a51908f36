// A random id of this process's start, so that peers can tell a restarted server at the same
// address from the one they knew (the workers' GetLoad / GetInfo report it to the coordinator).
#pragma once

#include <string>

namespace dsa {

/// 32 lowercase hex digits (128 random bits), drawn once per process on the first call and the
/// same for every later call. Thread-safe.
const std::string& ProcessInstanceId();

}  // namespace dsa
