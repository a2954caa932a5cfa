// Lossless compression of checkpoint chunks on their way to storage (never in shared memory, never
// on the save's blocking path). A chunk is encoded into a self-describing *frame*; a frame decodes
// only into exactly the bytes it was made from, and a reader that gets anything else gets
// Corruption. The frame's bytes are specified in docs/format.md ("Compressed chunks").
//
// This header is the contract between the codec (src/codec/codec.cc) and its users: the packed
// step layout on storage tiers (src/checkpoint) and the CLI. Keep it small.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "safepoint/status.h"

namespace safepoint::codec {

// How a frame's payload is coded. Stored in frames: values are never reused.
enum class Method : uint8_t {
  kRaw = 0,     // the bytes as they are
  kZstd = 1,    // zstd over the whole chunk
  kPlanes = 2,  // bytes grouped by significance (byte planes), each plane coded or kept raw
};

// What a caller asks for. kAuto lets the codec pick per chunk what pays (and the writer per tier
// whether compressing pays at all); kNone never compresses.
enum class Mode : uint8_t { kAuto = 0, kNone = 1, kZstd = 2, kPlanes = 3 };

// Every mode, in the order their names are listed to users: the one list of compression names
// (the Python package takes it from _core.COMPRESSIONS).
inline constexpr std::array<Mode, 4> kModes = {Mode::kAuto, Mode::kNone, Mode::kZstd,
                                               Mode::kPlanes};

// "auto" | "none" | "zstd" | "planes"; InvalidArgument naming the accepted values otherwise.
Result<Mode> ParseMode(std::string_view text);
std::string_view ModeName(Mode mode);
std::string_view MethodName(Method method);

// Appends the frame of `raw` to *out and returns the method used. `element_size` is the width of
// the values in `raw` (1, 2, 4 or 8: the dtype's size; 1 when unknown or mixed). A chunk that does
// not shrink under the requested mode is stored kRaw, so a frame is never much larger than `raw`.
// Thread-safe; callers encode chunks in parallel.
Result<Method> EncodeChunk(std::span<const std::byte> raw, int element_size, Mode mode,
                           std::vector<std::byte>* out);

// Decodes `frame` into `raw`, which must be exactly the frame's decoded size. Corruption (naming
// what is wrong) for a truncated or malformed frame, a size that differs, or decoded bytes whose
// CRC-32C differs from the one the frame records. Never writes past `raw`.
Status DecodeChunk(std::span<const std::byte> frame, std::span<std::byte> raw);

// The decoded size a well-formed frame declares, or Corruption. Reads the header only.
Result<uint64_t> DecodedSize(std::span<const std::byte> frame);

// Every frame starts with a header of this many bytes, which says how long the frame is.
inline constexpr size_t kFrameHeaderSize = 40;

// From a frame's first kFrameHeaderSize bytes (or more): the whole frame's size in bytes, and the
// method it was coded with. Corruption for a malformed header.
Result<uint64_t> FrameSize(std::span<const std::byte> header);
Result<Method> FrameMethod(std::span<const std::byte> header);

}  // namespace safepoint::codec
