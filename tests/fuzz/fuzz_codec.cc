// libFuzzer target: the compressed-chunk decoder (src/codec). An input is read as a frame: it
// must decode or be Corruption, and never decode past its declared size (ASan watches the
// buffer, which is exactly that size). A copy whose header and payload CRCs are recomputed is
// decoded too, so that mutations reach the plane table and the zstd decoder instead of stopping
// at a CRC. The input is also encoded as a chunk, with an element size and a mode drawn from its
// length, and must decode back to itself.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "base/bytes.h"
#include "base/crc32c.h"
#include "codec/codec.h"

using safepoint::StatusCode;
namespace codec = safepoint::codec;

namespace {

// Decodes `frame` into a buffer of exactly the size it declares (when that is small).
void DecodeOne(std::span<const std::byte> frame) {
  auto declared = codec::DecodedSize(frame);
  if (!declared.ok()) {
    if (declared.status().code() != StatusCode::kCorruption) __builtin_trap();
    return;
  }
  if (*declared > (16u << 20)) return;
  std::vector<std::byte> raw(*declared);
  safepoint::Status s = codec::DecodeChunk(frame, raw);
  if (!s.ok() && s.code() != StatusCode::kCorruption) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  DecodeOne(in);

  if (size >= codec::kFrameHeaderSize) {
    // The same bytes with valid header and payload CRCs (docs/format.md: payload CRC at 28,
    // header CRC of bytes [0, 32) at 32).
    std::vector<std::byte> sealed(in.begin(), in.end());
    using safepoint::internal::Crc32c;
    safepoint::internal::StoreLE<uint32_t>(
        sealed.data() + 28,
        Crc32c(0, sealed.data() + codec::kFrameHeaderSize, size - codec::kFrameHeaderSize));
    safepoint::internal::StoreLE<uint32_t>(sealed.data() + 32, Crc32c(0, sealed.data(), 32));
    DecodeOne(sealed);
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
