// Packed images: one rank's image of a step stored as a small manifest object plus shared,
// content-addressed chunk objects that steps (and runs) sharing a checkpoint directory share.
// The bytes are specified in docs/format.md ("Packed steps"); the garbage collector's protocol
// in docs/operations.md ("Chunk garbage collection") and at CollectGarbage in pack.cc.
//
// A packed image reads back through OpenPackedImage as a ReadableObject that holds exactly the
// plain image's bytes, so every reader of CheckpointStore (whole images, range reads, tier
// copies, verify, inspect) reads packed and plain images alike.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "safepoint/checkpoint.h"

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

std::string EncodePackedManifest(const PackedManifest& manifest);
// Validates every field (CRC, sizes, the image header and its sections' CRCs, one entry per
// chunk with the chunk's size); Corruption naming `source` otherwise.
Result<PackedManifest> DecodePackedManifest(std::span<const std::byte> data,
                                            std::string_view source);
Result<PackedManifest> ReadPackedManifest(Storage& storage, const std::string& name);

// The image a manifest describes, as an object of the image's size. Reads of the header, index,
// extras and checksum section come from the manifest; other reads fetch and decode the chunks
// they cover, each checked against the image's chunk CRC. A missing chunk object is Corruption
// naming the step, the chunk and the object.
Result<std::unique_ptr<ReadableObject>> OpenPackedImage(std::shared_ptr<Storage> storage,
                                                        const std::string& manifest_name);

// Where a packed write takes the image's bytes from (CheckpointStore::WritePacked).
struct CheckpointStore::PackSource {
  std::string manifest_name;
  ImageMeta meta;
  ImageLayout layout;
  std::vector<TensorEntry> tensors;  // for each chunk's element size (compression)
  // Fills image chunk `chunk` (its whole length) into `dst`, or returns a view of it (an image
  // already in memory) and leaves `dst` alone.
  std::function<Result<std::span<const std::byte>>(uint64_t chunk, std::span<std::byte> dst)> chunk;
  // The checksum section for the chunks' CRCs, to store in the manifest.
  std::function<Result<std::vector<std::byte>>(std::span<const uint32_t> crcs)> checksums;
};

// Object names in the chunk store.
inline constexpr std::string_view kChunkPrefix = "chunks/";
inline constexpr std::string_view kGcLockName = "chunks/gc-lock";
inline constexpr std::string_view kIntentPrefix = "chunks/inflight/";

namespace internal {
// Who holds an intent or the GC lock: the record docs/format.md ("Packed steps") specifies.
struct ChunkStoreHolder {
  int64_t time_ns = 0;  // wall clock when published
  uint64_t step = 0;
  uint32_t rank = 0;
  int64_t pid = 0;
  std::string host;
  // Version 2 records name the process exactly; a version 1 record (written by safepoint
  // before them, or where /proc could not tell) leaves these empty: its holder is unknown.
  int version = 1;
  std::string boot_id;       // /proc/sys/kernel/random/boot_id
  uint64_t pid_ns = 0;       // the inode of the holder's pid namespace (/proc/<pid>/ns/pid)
  uint64_t start_ticks = 0;  // field 22 of /proc/<pid>/stat
};
// The record of the live process `pid` of this host (version 2), or a version 1 record where
// /proc cannot name it exactly.
ChunkStoreHolder ChunkStoreHolderOf(int64_t pid, uint64_t step, uint32_t rank, int64_t time_ns);
std::string EncodeChunkStoreHolder(const ChunkStoreHolder& holder);
// nullopt when `data` does not start with a time; a version 1 holder where the rest is not a
// valid version 2 record.
std::optional<ChunkStoreHolder> DecodeChunkStoreHolder(std::span<const std::byte> data);
enum class HolderLiveness { kAlive, kDead, kUnknown };
// kDead only when provably dead: a version 2 record of this boot and this process's pid
// namespace, and no process with its pid or one that started at another time (or a zombie).
HolderLiveness LivenessOf(const ChunkStoreHolder& holder);

// Tests only: sets what compression="auto" has learned about the tier at `uri` (its write
// bandwidth and one encoder thread's speed, bytes/s, 0 = not measured yet; the probe's stored /
// raw), so that a test of the per-tier choice does not depend on timing.
void SetTierLearningForTest(const std::string& uri, double write_bps, double encode_bps_thread,
                            double probe_ratio);
// Tests only: the raw bytes per second that auto's plain writes and its compressed
// (non-incremental) writes to `uri` achieved; 0 = not measured yet.
void SetTierRatesForTest(const std::string& uri, double plain_bps, double compressed_bps);
}  // namespace internal

}  // namespace safepoint
