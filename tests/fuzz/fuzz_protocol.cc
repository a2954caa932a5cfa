// libFuzzer target: the agent protocol's frame decoder fed in arbitrary pieces, and every message
// payload decoded as each typed message the agent and the client parse (src/protocol/protocol.h).
// Errors are fine; crashes, exceptions, hangs and unbounded buffering are not.
#include <cstddef>
#include <cstdint>

#include "protocol/protocol.h"

namespace {

using namespace safepoint::protocol;  // NOLINT: the protocol under test

// Decodes `payload` as every message type; a decoded message must encode and decode again.
template <typename T>
void DecodeAs(const std::string& payload) {
  T out;
  if (!Decode(payload, &out).ok()) return;
  if constexpr (!std::is_same_v<T, EmptyRequest>) {
    T again;
    if (!Decode(Encode(out), &again).ok()) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  FrameDecoder decoder;
  const size_t piece = 1 + data[0] % 64;
  for (size_t off = 1; off < size; off += piece) {
    const size_t n = std::min(piece, size - off);
    decoder.Feed({reinterpret_cast<const std::byte*>(data + off), n});
    for (;;) {
      auto m = decoder.Next();
      if (!m.ok()) return 0;  // the agent closes such a connection
      if (!*m) break;
      const std::string& p = (*m)->payload;
      DecodeAs<EmptyRequest>(p);
      DecodeAs<HelloRequest>(p);
      DecodeAs<HelloReply>(p);
      DecodeAs<SnapshotNote>(p);
      DecodeAs<WaitRequest>(p);
      DecodeAs<WaitReply>(p);
      DecodeAs<CloseReply>(p);
      DecodeAs<ErrorReply>(p);
      DecodeAs<PeerSetupRequest>(p);
      DecodeAs<PeerSetupReply>(p);
      DecodeAs<Membership>(p);
      DecodeAs<AckReply>(p);
      DecodeAs<PeerListRequest>(p);
      DecodeAs<PeerListReply>(p);
      DecodeAs<PeerFetchRequest>(p);
      DecodeAs<PeerFetchReply>(p);
      DecodeAs<PauseNote>(p);
      DecodeAs<ReportNote>(p);
    }
  }
  return 0;
}
