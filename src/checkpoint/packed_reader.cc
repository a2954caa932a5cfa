// Reading a packed image (packed_reader.h): fetching, decoding and verifying the content chunks
// that a read of the image covers.
#include "checkpoint/packed_reader.h"

#include <algorithm>

#include "base/aligned_buffer.h"
#include "base/crc32c.h"
#include "base/parallel.h"
#include "checkpoint/content_chunks.h"
#include "checkpoint/pack_manifest.h"
#include "codec/codec.h"

namespace safepoint {

using internal::AlignedBuffer;
using internal::CopyOverlap;
using internal::Crc32c;
using internal::FirstError;

namespace {

class PackedImageObject final : public ReadableObject {
 public:
  PackedImageObject(std::shared_ptr<Storage> storage, std::string name, PackedManifest manifest)
      : storage_(std::move(storage)), name_(std::move(name)), m_(std::move(manifest)) {}

  uint64_t size() const override { return m_.layout.image_size; }

  Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
    const ImageLayout& l = m_.layout;
    if (offset > l.image_size || dst.size() > l.image_size - offset) {
      return Corruption(storage_->Describe(name_) + ": read of [" + std::to_string(offset) + ", +" +
                        std::to_string(dst.size()) + ") past the end of the image (" +
                        std::to_string(l.image_size) + " bytes): truncated");
    }
    const uint64_t end = offset + dst.size();
    // Sections the manifest holds.
    if (Within(offset, end, 0, m_.header.size())) {
      CopyOverlap(m_.header, 0, offset, dst);
      return Status::OK();
    }
    if (Within(offset, end, l.index_offset, m_.index.size())) {
      CopyOverlap(m_.index, l.index_offset, offset, dst);
      return Status::OK();
    }
    if (Within(offset, end, l.extras_offset, m_.extras.size())) {
      CopyOverlap(m_.extras, l.extras_offset, offset, dst);
      return Status::OK();
    }
    // Chunks, then what lies past them (the checksum section).
    const uint64_t covered = l.checksums_offset;
    if (offset < covered) {
      const uint64_t first = offset / l.chunk_size;
      const uint64_t last = (std::min(end, covered) - 1) / l.chunk_size;
      for (uint64_t c = first; c <= last; ++c) {
        const uint64_t at = c * l.chunk_size;
        const uint64_t len = std::min(l.chunk_size, covered - at);
        if (at >= offset && at + len <= end) {
          SP_RETURN_IF_ERROR(Decode(c, dst.subspan(at - offset, len)));
        } else {
          AlignedBuffer buf(len);
          if (!buf.ok()) return ResourceExhausted("out of memory for a chunk");
          SP_RETURN_IF_ERROR(Decode(c, buf.span()));
          CopyOverlap(buf.span(), at, offset, dst);
        }
      }
    }
    if (end > covered) CopyOverlap(m_.checksums, covered, offset, dst);
    return Status::OK();
  }

 private:
  static bool Within(uint64_t lo, uint64_t hi, uint64_t begin, uint64_t size) {
    return lo >= begin && hi <= begin + size;
  }

  // Decodes checksum chunk `c` into `raw` (its whole length) from its content chunks and checks
  // it against the image's CRC.
  Status Decode(uint64_t c, std::span<std::byte> raw) const {
    const uint64_t at = c * m_.layout.chunk_size;
    FirstError error;
    internal::ForEachContentChunk(
        m_.first_chunk[c], m_.first_chunk[c + 1], internal::InnerThreads(m_.layout.chunk_count()),
        [&](size_t i) {
          if (error.failed()) return;
          const PackedManifest::Chunk& ref = m_.chunks[i];
          error.Set(DecodePiece(i, raw.subspan(ref.offset - at, ref.raw_size)));
        });
    SP_RETURN_IF_ERROR(error.status());
    if (Crc32c(raw) != m_.chunk_crcs[c]) {
      return Corruption(storage_->Describe(name_) + " (step " + std::to_string(m_.meta.step) +
                        ", rank " + std::to_string(m_.meta.rank) + "): checksum chunk " +
                        std::to_string(c) + " decoded from its chunks does not match its CRC");
    }
    return Status::OK();
  }

  // Fetches and decodes content chunk `i` into `raw` (its size).
  Status DecodePiece(size_t i, std::span<std::byte> raw) const {
    const PackedManifest::Chunk& ref = m_.chunks[i];
    const std::string object = ChunkObjectName(ref.sha256);
    auto where = [&] {
      return storage_->Describe(name_) + " (step " + std::to_string(m_.meta.step) + ", rank " +
             std::to_string(m_.meta.rank) + "): chunk " + std::to_string(i) + " (" +
             storage_->Describe(object) + ")";
    };
    auto obj = storage_->Open(object);
    if (!obj.ok()) {
      if (obj.status().code() == StatusCode::kNotFound) {
        return Corruption(where() +
                          " is missing: it was removed behind safepoint's back (only "
                          "safepoint's GC may remove chunks)");
      }
      return obj.status().WithContext(where());
    }
    const uint64_t max = uint64_t{ref.raw_size} + ref.raw_size / 8 + 65536;
    if ((*obj)->size() > max) {
      return Corruption(where() + ": frame of " + std::to_string((*obj)->size()) + " bytes for a " +
                        std::to_string(ref.raw_size) + "-byte chunk");
    }
    AlignedBuffer frame((*obj)->size());
    if (!frame.ok()) return ResourceExhausted("out of memory for a chunk frame");
    if (Status s = (*obj)->ReadAt(0, frame.span()); !s.ok()) return s.WithContext(where());
    auto decoded = codec::DecodedSize(frame.span());
    if (!decoded.ok()) return Corruption(where() + ": " + decoded.status().message());
    if (*decoded != raw.size()) {
      return Corruption(where() + ": frame decodes to " + std::to_string(*decoded) +
                        " bytes, the image's chunk has " + std::to_string(raw.size()));
    }
    if (Status s = codec::DecodeChunk(frame.span(), raw); !s.ok()) {
      return Corruption(where() + ": " + s.message());
    }
    return Status::OK();
  }

  std::shared_ptr<Storage> storage_;
  std::string name_;
  PackedManifest m_;
};

}  // namespace

Result<std::unique_ptr<ReadableObject>> OpenPackedImage(std::shared_ptr<Storage> storage,
                                                        const std::string& manifest_name) {
  SP_ASSIGN_OR_RETURN(PackedManifest m, ReadPackedManifest(*storage, manifest_name));
  return std::unique_ptr<ReadableObject>(
      new PackedImageObject(std::move(storage), manifest_name, std::move(m)));
}

}  // namespace safepoint
