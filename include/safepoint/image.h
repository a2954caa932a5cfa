// The image: the byte layout of one rank's shard of one step (docs/format.md is normative).
//
// The same bytes live in shared memory, on disk and in object stores. An image is built by an
// ImageBuilder from tensors that stay where they are (no copy until Fill) plus the encoded
// non-tensor state ("extras"), and read by ImageReader, which never trusts a byte: every offset
// and count is bounds-checked and every checksum verified before data is handed out.
//
// Thread safety: an ImageBuilder is immutable after Create(); Fill() and ChunkCrc() may be called
// from many threads for disjoint ranges. ImageReader is immutable after Parse().
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "safepoint/status.h"

namespace safepoint {

enum class DType : uint8_t {
  kFloat32 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kFloat64 = 4,
  kInt8 = 5,
  kInt16 = 6,
  kInt32 = 7,
  kInt64 = 8,
  kUInt8 = 9,
  kBool = 10,
  kFloat8E4M3FN = 11,
  kFloat8E5M2 = 12,
  kComplex64 = 13,  // two float32: real, imaginary
  kComplex128 = 14,
  kUInt16 = 15,
  kUInt32 = 16,
  kUInt64 = 17,
  kFloat8E4M3FNUZ = 18,
  kFloat8E5M2FNUZ = 19,
  kFloat8E8M0FNU = 20,
};

// Size of one element in bytes; 0 for an unknown code.
size_t DTypeSize(DType dtype);
// "float32", "bfloat16", "float8_e4m3fn", ... (torch's names without "torch.").
std::string_view DTypeName(DType dtype);
Result<DType> DTypeFromName(std::string_view name);
bool IsValidDType(uint8_t code);

inline constexpr uint32_t kImageFormatVersion = 1;
inline constexpr size_t kImageHeaderSize = 4096;
inline constexpr size_t kImageAlignment = 4096;         // every section starts on this boundary
inline constexpr uint64_t kDefaultChunkSize = 4 << 20;  // bytes covered by one CRC-32C
inline constexpr size_t kMaxJobLength = 64;
inline constexpr size_t kMaxRank = 1 << 24;
inline constexpr size_t kMaxNdim = 32;
inline constexpr size_t kMaxNameLength = 1 << 20;

// Lineage of a step (docs/format.md, "Lineage"): the step the saving run was restored from and
// the user's metadata. Kept in the image header, so it travels wherever the image goes (memory,
// files, object stores, other tiers). All empty for a fresh run without metadata: such a
// header is byte for byte what builds before lineage wrote.
inline constexpr size_t kMaxParentLocationLength = 1024;
inline constexpr size_t kMaxLineageMetadataLength = 2048;
struct Lineage {
  bool has_parent = false;  // the run was restored from parent_step (false: a fresh run)
  uint64_t parent_step = 0;
  // The checkpoint the parent step was restored from (a path or URI, UTF-8), empty when it is
  // this image's own checkpoint (a resume, also when the copy read was on a lower tier).
  std::string parent_location;
  // A JSON object, UTF-8, at most kMaxLineageMetadataLength bytes (empty: none). Its keys and
  // values are the caller's (code version, config hash, ...).
  std::string metadata;
  bool operator==(const Lineage&) const = default;
};

// Identity of an image.
struct ImageMeta {
  std::string job;  // [A-Za-z0-9._-]{0,64}
  uint64_t step = 0;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  int64_t create_time_ns = 0;  // wall clock; set by the builder when 0
  // Identifies one save attempt of a step across its ranks (0: none given). A step commits only
  // from images of one attempt, so the image of an earlier, unfinished or replaced attempt
  // (a rank that crashed after persisting, a re-saved step) is never committed beside new ones.
  uint64_t attempt = 0;
  Lineage lineage;
};

// Checks the lineage's sizes, UTF-8 and that metadata is a JSON object; InvalidArgument
// naming the field otherwise.
Status ValidateLineage(const Lineage& lineage);

// Describes one tensor of the shard. For a shard of a larger tensor, global_shape and
// global_offset give the box this shard covers; both empty means the tensor is whole.
struct TensorSpec {
  std::string name;  // UTF-8, unique within the image, 1..kMaxNameLength bytes
  DType dtype = DType::kFloat32;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> global_shape;
  std::vector<uint64_t> global_offset;
  // The tensor's bytes are not in this image but in another rank's image of the same step (a
  // replica that rank writes; the loader finds it by name and box). No data, offset 0.
  bool elsewhere = false;
};

// What makes two tensors (of one rank or of two) replicas of each other, the one definition:
// the same name, dtype, shape and box in the global tensor (a whole tensor is the box of its own
// shape at offset 0). Equal keys, equal identity; `elsewhere` is not part of it. The replica plan
// of data-parallel saves, the check that a step holds every replica it names, and the loader's
// choice between copies of a box all compare these keys.
std::string ReplicaKey(const TensorSpec& spec);

// Tensor index ranges [first, last) of an image whose bytes another rank's image of the same
// step holds (replicas written once: they become TensorSpec::elsewhere when stored).
using SkipRanges = std::vector<std::pair<uint32_t, uint32_t>>;

// A tensor to write: contiguous, row-major, little-endian bytes that stay valid until the image
// has been filled.
struct TensorSource {
  TensorSpec spec;
  const void* data = nullptr;
  uint64_t nbytes = 0;  // must equal the product of shape times DTypeSize
  // The caller puts the bytes in place itself before FillAll (e.g. asynchronous copies from a
  // GPU into the pinned destination); Fill leaves that range alone. data is unused.
  bool staged = false;
};

// A tensor of a parsed image.
struct TensorEntry {
  TensorSpec spec;
  uint64_t offset = 0;  // from the start of the image
  uint64_t nbytes = 0;
};

// Section offsets and sizes of an image (from its header).
struct ImageLayout {
  uint64_t image_size = 0;
  uint64_t chunk_size = kDefaultChunkSize;
  uint64_t index_offset = 0, index_size = 0;  // size without padding
  uint64_t data_offset = 0, data_size = 0;
  uint64_t extras_offset = 0, extras_size = 0;
  uint64_t checksums_offset = 0, checksums_size = 0;
  uint64_t tensor_count = 0;
  uint32_t index_crc = 0, extras_crc = 0, header_crc = 0;
  bool has_elsewhere = false;  // some tensors are held by other ranks' images (header flag 1)
  // Chunks cover [0, checksums_offset).
  uint64_t chunk_count() const { return (checksums_offset + chunk_size - 1) / chunk_size; }
};

class ImageBuilder {
 public:
  // Plans the layout. Validates names (unique, non-empty UTF-8), shapes, dtypes, nbytes, shard
  // boxes and the job name; InvalidArgument naming the tensor otherwise.
  static Result<std::unique_ptr<ImageBuilder>> Create(ImageMeta meta,
                                                      std::vector<TensorSource> tensors,
                                                      std::string extras,
                                                      uint64_t chunk_size = kDefaultChunkSize);

  const ImageMeta& meta() const { return meta_; }
  const ImageLayout& layout() const { return layout_; }
  uint64_t size() const { return layout_.image_size; }
  uint64_t chunk_count() const { return layout_.chunk_count(); }
  const std::vector<TensorSource>& tensors() const { return tensors_; }
  uint64_t tensor_offset(size_t i) const { return offsets_[i]; }
  const std::string& extras() const { return extras_; }

  // Writes image bytes [offset, offset + dst.size()) into dst, for any range that ends at or
  // before layout().checksums_offset: header, index, tensor data, extras, zero padding.
  void Fill(uint64_t offset, std::span<std::byte> dst) const;

  // The caller's own bytes of image range [offset, offset + len) where the range lies inside one
  // tensor's data (not staged, not elsewhere), so that a writer can send them without filling a
  // copy; an empty span otherwise (the range touches the header, index, padding or extras, or
  // two tensors).
  std::span<const std::byte> SourceBytes(uint64_t offset, uint64_t len) const;

  // The checksum section (layout().checksums_offset to size()) from the per-chunk CRCs, which
  // the caller computed over the filled bytes of each chunk.
  std::vector<std::byte> ChecksumSection(std::span<const uint32_t> chunk_crcs) const;

  // Fills a whole image into `dst` (dst.size() == size()) with `threads` threads, checksums
  // included. Used for snapshots into memory.
  void FillAll(std::span<std::byte> dst, size_t threads) const;

  // Reuses this plan for the next image of a state with the same structure (the same tensor
  // specs and extras; a save checks that before): a new step and creation time in the header,
  // and the bytes of tensor i now at data[i]. Costs one pointer store per tensor instead of
  // validating and indexing every tensor again (Create). data.size() must be tensors().size().
  void Rebind(uint64_t step, std::span<const void* const> data);
  // The same in two parts, for a caller that fills the image while it learns the addresses:
  // the header for `step` first, then each tensor's address before any Fill reads it.
  void Rebind(uint64_t step);
  void SetTensorData(size_t i, const void* data) { tensors_[i].data = data; }

 private:
  ImageBuilder() = default;
  ImageMeta meta_;
  ImageLayout layout_;
  std::vector<TensorSource> tensors_;
  std::vector<uint64_t> offsets_;
  std::string extras_;
  std::vector<std::byte> header_;  // kImageHeaderSize bytes
  std::vector<std::byte> index_;   // index section, unpadded
};

// Parses and validates the fixed header. `source` names the file or slot for messages.
Result<std::pair<ImageMeta, ImageLayout>> ParseImageHeader(std::span<const std::byte> header,
                                                           std::string_view source);

// Parses and validates the checksum section against the layout; returns one CRC per chunk.
Result<std::vector<uint32_t>> ParseChecksumSection(std::span<const std::byte> section,
                                                   const ImageLayout& layout,
                                                   std::string_view source);

// Verifies the CRC of chunk `index` whose bytes are `chunk` (the last chunk may be short).
Status VerifyChunk(std::span<const std::byte> chunk, uint64_t index, uint32_t expected,
                   std::string_view source);

// Copies a complete image from `src` into `dst` (same size) with `threads` threads and verifies
// every chunk CRC of the copy as it is made (each piece is checksummed while it is still in the
// core's cache). The header is parsed from the copy. Used for hot reload from shared memory.
Status CopyVerifiedImage(std::span<const std::byte> src, std::span<std::byte> dst,
                         std::string_view source, size_t threads);

// A byte range of an image to copy out: image[offset, offset + length) -> dst.
struct ImageCopy {
  uint64_t offset = 0;
  uint64_t length = 0;
  std::byte* dst = nullptr;
};

// Verifies every chunk CRC of a complete image held in memory and copies `copies` (ranges of its
// data that do not overlap each other; dst outside the image) out of it in the same pass, with
// `threads` threads: each piece is checksummed right after it was copied, while it is in the
// core's cache. On an error (Corruption naming the chunk) the destinations hold unspecified
// bytes and must not be used. Restore-in-place from shared memory (hot reload) uses it.
// `copied_chunks_only`: verify only the chunks the copies overlap (for a caller that checked
// the header, index and extras through their own checksums, ImageReader::Verify::kStructure,
// and reads some tensors of another rank's image: a damaged chunk it does not read is no
// reason to refuse the ones it does).
Status VerifyAndCopyOut(std::span<const std::byte> image, std::span<const ImageCopy> copies,
                        std::string_view source, size_t threads, bool copied_chunks_only = false);

// VerifyAndCopyOut one chunk at a time, for a caller that learns the copies' destinations as it
// goes (a restore that walks its targets while the chunks whose targets are known are copied:
// SnapshotClient's streamed load). Make checks the header, the checksum section and the copies'
// ranges and sorts the copies by offset; a copy's dst may be set (set_dst) until the first
// Chunk() of a chunk it overlaps starts. Chunk(i) verifies chunk i and copies out of it what
// the copies hold there; distinct chunks may be done by distinct threads at once.
class ImageCopyOut {
 public:
  static Result<ImageCopyOut> Make(std::span<const std::byte> image, std::vector<ImageCopy> copies,
                                   std::string_view source, bool copied_chunks_only = false);
  size_t chunk_count() const { return crcs_.size(); }
  const std::vector<ImageCopy>& copies() const { return copies_; }  // by offset
  void set_dst(size_t copy, std::byte* dst) { copies_[copy].dst = dst; }
  // The copies chunk i overlaps: [first, last) of copies().
  std::pair<size_t, size_t> ChunkCopies(size_t i) const;
  // Corruption naming the chunk when its checksum does not match (its copies' destinations
  // then hold unspecified bytes).
  Status Chunk(size_t i) const;

 private:
  std::span<const std::byte> image_;
  uint64_t chunk_size_ = 0, covered_ = 0;
  std::vector<uint32_t> crcs_;
  std::vector<ImageCopy> copies_;
  std::vector<bool> wanted_;  // empty: every chunk
  bool stream_ = false;       // copies past the caches (StreamCopy)
  std::string source_;
};

// The parsed index of an earlier image, kept by a caller that parses images of one structure
// again and again (hot restores from the snapshot slots): an image whose index section and the
// layout fields it is checked against are byte-for-byte those of the last parse reuses its
// entries instead of parsing and allocating them anew (issue 21: at 100,000 tensors the parse
// was most of a restore's time beside the copy). Snapshots saved with a reused plan have equal
// index sections. Not thread-safe; one per caller.
struct ParsedIndex {
  std::string bytes;  // the index section the entries were parsed from
  uint64_t data_offset = 0, data_size = 0, tensor_count = 0;
  bool has_elsewhere = false;
  std::shared_ptr<const std::vector<TensorEntry>> entries;
};

class ImageReader {
 public:
  enum class Verify { kAll, kStructure };
  // Parses a complete image held in memory (the bytes must outlive the reader). kAll verifies
  // every chunk CRC (using `threads`); kStructure only the header, index, extras and checksum
  // section (for callers that verified the chunks while reading them). `cache`: the index of
  // the caller's last parse (ParsedIndex), reused when equal and replaced otherwise; the index
  // checksum is verified either way.
  static Result<ImageReader> Parse(std::span<const std::byte> image, std::string_view source,
                                   Verify verify = Verify::kAll, size_t threads = 1,
                                   ParsedIndex* cache = nullptr);

  const ImageMeta& meta() const { return meta_; }
  const ImageLayout& layout() const { return layout_; }
  const std::vector<TensorEntry>& tensors() const { return *tensors_; }
  // Empty for a tensor held elsewhere (TensorSpec::elsewhere).
  std::span<const std::byte> tensor_data(size_t i) const {
    if (tensors()[i].spec.elsewhere) return {};
    return image_.subspan(tensors()[i].offset, tensors()[i].nbytes);
  }
  std::span<const std::byte> extras() const {
    return image_.subspan(layout_.extras_offset, layout_.extras_size);
  }

 private:
  std::span<const std::byte> image_;
  ImageMeta meta_;
  ImageLayout layout_;
  // Shared with a ParsedIndex when it came from one (never written after the parse).
  std::shared_ptr<const std::vector<TensorEntry>> tensors_ =
      std::make_shared<const std::vector<TensorEntry>>();
};

// Parses and validates the index section (bounds, overlaps, sizes, names).
Result<std::vector<TensorEntry>> ParseIndex(std::span<const std::byte> index,
                                            const ImageLayout& layout, std::string_view source);

}  // namespace safepoint
