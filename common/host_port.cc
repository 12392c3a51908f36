// See host_port.h.
#include "common/host_port.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

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

absl::StatusOr<std::vector<std::string>> ResolveDnsAddresses(const std::string& name_port) {
  DSA_ASSIGN_OR_RETURN(const HostPort parsed, ParseHostPort(name_port, /*min_port=*/1));
  const int port = parsed.port;
  std::string name = parsed.host;
  if (name.front() == '[') {
    name = name.substr(1, name.size() - 2);  // a bracketed IPv6 address
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int error = getaddrinfo(name.c_str(), nullptr, &hints, &found);
  if (error != 0) {
    const std::string message = absl::StrCat("cannot resolve ", name, ": ", gai_strerror(error));
    return error == EAI_AGAIN ? absl::UnavailableError(message) : absl::NotFoundError(message);
  }
  std::vector<std::string> addresses;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char host[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr, host,
                sizeof(host));
      addresses.push_back(absl::StrCat(host, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr, host,
                sizeof(host));
      addresses.push_back(absl::StrCat("[", host, "]:", port));
    }
  }
  freeaddrinfo(found);
  std::sort(addresses.begin(), addresses.end());
  addresses.erase(std::unique(addresses.begin(), addresses.end()), addresses.end());
  return addresses;
}

}  // namespace dsa
