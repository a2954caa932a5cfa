// The manifest of a packed image: its format (docs/format.md, "Packed steps"), how an image is
// cut into content chunks, and the names of the chunk objects the manifest references.
//
// A packed image is one rank's image of a step stored as a small manifest object plus shared,
// content-addressed chunk objects that steps (and runs) sharing a checkpoint directory share.
// The manifest holds the image's header, index, extras and checksum section verbatim and one
// entry per content chunk; the chunks hold the rest of the image's bytes.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "safepoint/image.h"
#include "safepoint/status.h"
#include "safepoint/storage.h"

namespace safepoint {

// The manifest of a packed image.
struct PackedManifest {
  static constexpr uint32_t kVersion = 1;
  static constexpr size_t kFixedSize = 64;
  static constexpr size_t kEntrySize = 48;
  // Method recorded for a chunk that an earlier write stored (its frame was not made here).
  static constexpr uint8_t kMethodStoredBefore = 0xFF;

  // One content chunk: a piece of the image that lies within one checksum chunk. The pieces
  // partition [0, checksums_offset) in order; they are cut at checksum-chunk boundaries, at the
  // data and extras sections and at tensors (small neighbours merged up to kMinPiece), so that
  // a tensor that did not change is stored in chunks of its own that the next step shares.
  struct Chunk {
    std::array<uint8_t, 32> sha256{};  // of the chunk's raw bytes
    uint64_t stored_size = 0;          // of its frame, as this writer found or wrote it
    uint32_t raw_size = 0;
    uint8_t method = 0;   // codec::Method of the frame written, or kMethodStoredBefore
    uint64_t offset = 0;  // in the image (not stored: the sum of the raw sizes before it)
  };
  static constexpr uint64_t kMinPiece = 64 << 10;

  ImageMeta meta;                    // parsed from `header`
  ImageLayout layout;                // parsed from `header`
  std::vector<std::byte> header;     // the image's bytes [0, 4096)
  std::vector<std::byte> index;      // [index_offset, +index_size)
  std::vector<std::byte> extras;     // [extras_offset, +extras_size)
  std::vector<std::byte> checksums;  // [checksums_offset, image_size)
  std::vector<uint32_t> chunk_crcs;  // parsed from `checksums`
  std::vector<Chunk> chunks;         // the content chunks, in image order
  std::vector<size_t> first_chunk;   // per checksum chunk: its first content chunk (and a sentinel)
};

// The content chunks' (offset, size) for an image: see PackedManifest::Chunk.
std::vector<std::pair<uint64_t, uint64_t>> PlanContentChunks(
    const ImageLayout& layout, const std::vector<TensorEntry>& tensors);

// Sets each chunk's offset and fills `first`: per checksum chunk, the index of its first content
// chunk, plus a sentinel (chunks.size()). False when the content chunks do not partition
// [0, checksums_offset) within checksum chunks.
bool IndexContentChunks(const ImageLayout& layout, std::vector<PackedManifest::Chunk>& chunks,
                        std::vector<size_t>* first);

std::string EncodePackedManifest(const PackedManifest& manifest);
// Validates every field (CRC, sizes, the image header and its sections' CRCs, one entry per
// chunk with the chunk's size); Corruption naming `source` otherwise.
Result<PackedManifest> DecodePackedManifest(std::span<const std::byte> data,
                                            std::string_view source);
Result<PackedManifest> ReadPackedManifest(Storage& storage, const std::string& name);

// Where the chunk store keeps its objects: chunks, and the GC lock and intents (chunk_gc.h).
inline constexpr std::string_view kChunkPrefix = "chunks/";
// The object of one content-addressed chunk: "chunks/<first 2 hex digits>/<64 hex digits>".
std::string ChunkObjectName(std::span<const uint8_t, 32> sha256);

}  // namespace safepoint
