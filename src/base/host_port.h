// HostPort: the one parser of a "host:port" address (the peer service's peers, the metrics
// server's listen address).
//
// Forms: "HOST:PORT", "[IPV6]:PORT" (the brackets are not part of the host) and ":PORT" (host
// empty: the caller decides what that means, e.g. every interface). PORT is a decimal number in
// [0, 65535]; a caller that needs a real port rejects 0 itself. An IPv6 address must be in
// brackets ("::1:80" is ambiguous). Anything else is InvalidArgument naming the text and why.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "safepoint/status.h"

namespace safepoint::internal {

struct HostPort {
  std::string host;  // without brackets; empty for ":PORT"
  uint16_t port = 0;
};

Result<HostPort> ParseHostPort(std::string_view text);

// "host:port", or "[host]:port" when the host holds a ':' (IPv6): what ParseHostPort reads back.
std::string FormatHostPort(std::string_view host, uint16_t port);

}  // namespace safepoint::internal
