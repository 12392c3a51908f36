// host:port addresses, checked by one parser everywhere (flags, Prefill's indexer_worker, the
// coordinator's workers).
#pragma once

#include <functional>
#include <string>
#include <vector>

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

/// The addresses ("ip:port", IPv6 as "[ip]:port", sorted, no duplicates) that `name_port`
/// ("NAME:PORT") resolves to. Errors: INVALID_ARGUMENT (not NAME:PORT), NOT_FOUND (NAME does not
/// resolve; the message has getaddrinfo's reason), UNAVAILABLE (a temporary resolver failure).
using AddressResolver =
    std::function<absl::StatusOr<std::vector<std::string>>(const std::string& name_port)>;

/// AddressResolver over getaddrinfo (the system resolver: Kubernetes' cluster DNS in a pod; a
/// headless Service's name resolves to its ready pods' addresses).
absl::StatusOr<std::vector<std::string>> ResolveDnsAddresses(const std::string& name_port);

}  // namespace dsa
