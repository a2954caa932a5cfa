// libFuzzer target: the agent protocol's frame decoder fed in arbitrary pieces, and the JSON
// payloads the agent parses. Errors are fine; crashes, hangs and unbounded buffering are not.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>

#include "agent/protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  safepoint::agent::FrameDecoder decoder;
  const size_t piece = 1 + data[0] % 64;
  for (size_t off = 1; off < size; off += piece) {
    const size_t n = std::min(piece, size - off);
    decoder.Feed({reinterpret_cast<const std::byte*>(data + off), n});
    for (;;) {
      auto m = decoder.Next();
      if (!m.ok()) return 0;  // the agent closes such a connection
      if (!*m) break;
      auto j = nlohmann::json::parse((*m)->payload, nullptr, /*allow_exceptions=*/false);
      if (!j.is_discarded() && j.is_object()) {
        (void)j.value("step", uint64_t{0});
      }
    }
  }
  return 0;
}
