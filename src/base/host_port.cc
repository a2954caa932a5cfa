// The host:port parser (src/base/host_port.h).
#include "base/host_port.h"

#include <charconv>

namespace safepoint::internal {

Result<HostPort> ParseHostPort(std::string_view text) {
  auto bad = [&](const char* why) {
    return InvalidArgument("address '" + std::string(text) + "': " + why +
                           " (expected HOST:PORT or [IPV6]:PORT)");
  };
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) return bad("no port");
  std::string_view host = text.substr(0, colon);
  const std::string_view port = text.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
    if (host.empty()) return bad("empty brackets");
  } else if (host.find(':') != std::string_view::npos) {
    return bad("an IPv6 host must be in brackets");
  } else if (host.find_first_of("[]") != std::string_view::npos) {
    return bad("unbalanced brackets");
  }
  unsigned n = 0;
  const auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), n);
  if (port.empty() || ec != std::errc() || ptr != port.data() + port.size() || n > 65535)
    return bad("the port is not a number in [0, 65535]");
  return HostPort{std::string(host), static_cast<uint16_t>(n)};
}

std::string FormatHostPort(std::string_view host, uint16_t port) {
  const bool bracket = host.find(':') != std::string_view::npos;
  std::string out;
  out.reserve(host.size() + 8);
  if (bracket) out += '[';
  out += host;
  if (bracket) out += ']';
  out += ':';
  out += std::to_string(port);
  return out;
}

}  // namespace safepoint::internal
