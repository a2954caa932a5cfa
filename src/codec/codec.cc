// The codec's first cut: every frame is kRaw. The byte-plane and zstd methods replace this body;
// the frame layout is in docs/format.md ("Compressed chunks").
#include "codec/codec.h"

#include <cstring>
#include <string>

#include "base/bytes.h"
#include "base/crc32c.h"

namespace safepoint::codec {
namespace {

using internal::Crc32c;
using internal::LoadLE;
using internal::StoreLE;

// magic "SPZ1", method u8, 3 reserved, raw_size u64, payload_size u64, raw CRC-32C u32, 4 reserved.
constexpr size_t kFrameHeader = 32;
constexpr char kMagic[4] = {'S', 'P', 'Z', '1'};

}  // namespace

Result<Mode> ParseMode(std::string_view text) {
  if (text == "auto") return Mode::kAuto;
  if (text == "none") return Mode::kNone;
  if (text == "zstd") return Mode::kZstd;
  if (text == "planes") return Mode::kPlanes;
  return InvalidArgument("compression '" + std::string(text) +
                         "' is not one of auto, none, zstd, planes");
}

std::string_view ModeName(Mode mode) {
  switch (mode) {
    case Mode::kAuto:
      return "auto";
    case Mode::kNone:
      return "none";
    case Mode::kZstd:
      return "zstd";
    case Mode::kPlanes:
      return "planes";
  }
  return "?";
}

std::string_view MethodName(Method method) {
  switch (method) {
    case Method::kRaw:
      return "raw";
    case Method::kZstd:
      return "zstd";
    case Method::kPlanes:
      return "planes";
  }
  return "?";
}

Result<Method> EncodeChunk(std::span<const std::byte> raw, int element_size, Mode mode,
                           std::vector<std::byte>* out) {
  if (element_size != 1 && element_size != 2 && element_size != 4 && element_size != 8)
    return InvalidArgument("element size " + std::to_string(element_size) + " is not 1, 2, 4 or 8");
  size_t at = out->size();
  out->resize(at + kFrameHeader + raw.size());
  std::byte* h = out->data() + at;
  std::memset(h, 0, kFrameHeader);
  std::memcpy(h, kMagic, 4);
  h[4] = std::byte{static_cast<uint8_t>(Method::kRaw)};
  StoreLE<uint64_t>(h + 8, raw.size());
  StoreLE<uint64_t>(h + 16, raw.size());
  StoreLE<uint32_t>(h + 24, Crc32c(raw));
  if (!raw.empty()) std::memcpy(h + kFrameHeader, raw.data(), raw.size());
  return Method::kRaw;
}

Result<uint64_t> DecodedSize(std::span<const std::byte> frame) {
  if (frame.size() < kFrameHeader || std::memcmp(frame.data(), kMagic, 4) != 0)
    return Corruption("compressed chunk: not a frame (" + std::to_string(frame.size()) + " bytes)");
  return LoadLE<uint64_t>(frame.data() + 8);
}

Status DecodeChunk(std::span<const std::byte> frame, std::span<std::byte> raw) {
  SP_ASSIGN_OR_RETURN(uint64_t size, DecodedSize(frame));
  if (size != raw.size())
    return Corruption("compressed chunk: decodes to " + std::to_string(size) + " bytes, expected " +
                      std::to_string(raw.size()));
  auto method = static_cast<Method>(std::to_integer<uint8_t>(frame[4]));
  uint64_t payload = LoadLE<uint64_t>(frame.data() + 16);
  if (method != Method::kRaw || payload != size || frame.size() != kFrameHeader + payload)
    return Corruption("compressed chunk: malformed frame");
  if (size) std::memcpy(raw.data(), frame.data() + kFrameHeader, size);
  if (Crc32c(raw) != LoadLE<uint32_t>(frame.data() + 24))
    return Corruption("compressed chunk: decoded bytes fail their CRC-32C");
  return Status::OK();
}

}  // namespace safepoint::codec
