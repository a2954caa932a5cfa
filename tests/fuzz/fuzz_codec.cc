// libFuzzer target: the compressed-chunk decoder (src/codec). An input is read as a frame: it
// must decode or be Corruption, and never decode past its declared size (ASan watches the
// buffer, which is exactly that size). The input is also encoded as a chunk, with an element size
// and a mode drawn from its length, and must decode back to itself.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "codec/codec.h"

using safepoint::StatusCode;
namespace codec = safepoint::codec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);

  auto declared = codec::DecodedSize(in);
  if (!declared.ok()) {
    if (declared.status().code() != StatusCode::kCorruption) __builtin_trap();
  } else if (*declared <= (16u << 20)) {
    std::vector<std::byte> raw(*declared);
    safepoint::Status s = codec::DecodeChunk(in, raw);
    if (!s.ok() && s.code() != StatusCode::kCorruption) __builtin_trap();
  }

  const int element_size = 1 << (size % 4);
  const auto mode = static_cast<codec::Mode>((size / 4) % 4);
  std::vector<std::byte> frame;
  auto method = codec::EncodeChunk(in, element_size, mode, &frame);
  if (!method.ok()) __builtin_trap();
  std::vector<std::byte> back(size);
  if (!codec::DecodeChunk(frame, back).ok()) __builtin_trap();
  if (size && std::memcmp(back.data(), data, size) != 0) __builtin_trap();
  return 0;
}
