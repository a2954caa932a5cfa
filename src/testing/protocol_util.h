// Helpers for the tests of the agent's wire protocol (src/protocol/protocol.h) and of the agent.
#pragma once

#include <cstdint>
#include <string>

#include "base/bytes.h"

namespace safepoint::test {

// A frame header (length, version, type; little-endian) with arbitrary fields, valid or not.
inline std::string FrameHeader(uint32_t length, uint16_t version, uint16_t type) {
  std::string out;
  internal::AppendLE<uint32_t>(out, length);
  internal::AppendLE<uint16_t>(out, version);
  internal::AppendLE<uint16_t>(out, type);
  return out;
}

}  // namespace safepoint::test
