// host:port addresses, checked by one parser everywhere (flags, Prefill's indexer_worker, the
// coordinator's workers).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace dsa {

/// An address split into its host (as written: a name, an IPv4 address, or an IPv6 address in
/// brackets) and its port.
struct HostPort {
  std::string host;
  int port = 0;
};

/// Parses "host:port": host a name, an IPv4 address or a bracketed IPv6 address, without white
/// space; port a decimal number from `min_port` to 65535. INVALID_ARGUMENT naming what is wrong,
/// e.g. "port 70000 is out of range 0..65535 in 127.0.0.1:70000".
absl::StatusOr<HostPort> ParseHostPort(const std::string& address, int min_port);

}  // namespace dsa
