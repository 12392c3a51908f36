// See host_port.h.
#include "common/host_port.h"

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace dsa {

absl::StatusOr<HostPort> ParseHostPort(const std::string& address, int min_port) {
  if (address.empty()) return absl::InvalidArgumentError("an empty address (want host:port)");
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("\"", address, "\" is not host:port"));
  }
  HostPort parsed;
  parsed.host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  const std::string& host = parsed.host;
  if (host.find_first_of(" \t\r\n") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad host \"", host, "\" in \"", address, "\" (white space)"));
  }
  if (host.front() == '[' ? host.back() != ']' || host.size() < 3
                          : host.find(':') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad host \"", host, "\" in ", address,
                     " (an IPv6 address goes in brackets: [::1]:50051)"));
  }
  if (port.empty() || port.size() > 5 || !absl::SimpleAtoi(port, &parsed.port) ||
      port.find_first_not_of("0123456789") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("bad port \"", port, "\" in ", address));
  }
  if (parsed.port < min_port || parsed.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("port ", parsed.port, " is out of range ", min_port, "..65535 in ", address));
  }
  return parsed;
}

}  // namespace dsa
