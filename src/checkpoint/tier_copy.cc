// CopyStep: a committed step copied from one storage tier to another (checkpoint.h).
//
// The copy is a save on the destination that takes its images from the source instead of a
// builder, with the same commit protocol (checkpoint_store.cc, steps 1-7):
//   1. Read the source's COMMIT record. If the destination has the step committed already: an
//      equal record is the same step (already_there, nothing written); another record is
//      AlreadyExists naming both; a corrupt record is an error (the step must be removed first).
//   2. For each rank: read the image's header, index, extras and checksum section through
//      ReadMetadata (header checked against the record), and its checksum section's bytes again
//      (they must parse to the same checksums). Then stream its chunks, `parallelism` at a time,
//      each into its own reusable aligned buffer: read, verified against its CRC (chunk 0's
//      header also against the record), written at the same offset of a new object of the same
//      name on the destination. The checksum section follows; the object is published (data
//      sync, rename, directory sync). A failure aborts that object: nothing of it is visible.
//   3. Publish the source's COMMIT record bytes with PublishIfAbsent. Only now is the step
//      visible on the destination. Finding a record there (a concurrent copy): equal is success,
//      different is AlreadyExists.
// Images are published with Publish (replacing), as a save's are: what an uncommitted step
// directory holds is a leftover, and a concurrent copy of the same step writes equal bytes.
// Memory in use: `parallelism` chunks (4 MiB each by default) plus one checksum section.
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/kill_point.h"
#include "base/parallel.h"
#include "checkpoint/packed_writer.h"
#include "safepoint/checkpoint.h"

namespace safepoint {

namespace {

using internal::AlignedBuffer;
using internal::FirstError;

std::string Describe(const CommitRecord& r) {
  std::string out = "generation " + std::to_string(r.generation) + ", " +
                    std::to_string(r.world_size) + " ranks, " + std::to_string(r.total_bytes()) +
                    " bytes, committed at " + std::to_string(r.commit_time_ns) + " ns";
  if (!r.job.empty()) out += ", job '" + r.job + "'";
  return out;
}

// What the destination holds for the record's step: true when the same record is committed.
Result<bool> CommittedThere(CheckpointStore& dst, const CommitRecord& record,
                            const std::string& src_uri) {
  auto existing = dst.ReadCommit(record.step);
  if (existing.ok()) {
    if (SameStep(*existing, record)) return true;
    return AlreadyExists(dst.storage().uri() + ": step " + std::to_string(record.step) +
                         " is already committed with another record (" + Describe(*existing) +
                         ") than " + src_uri + "'s (" + Describe(record) + ")");
  }
  if (existing.status().code() == StatusCode::kNotFound) return false;
  if (existing.status().code() == StatusCode::kCorruption) {
    return existing.status().WithContext("the destination has a damaged COMMIT record for step " +
                                         std::to_string(record.step) +
                                         "; remove the step there first");
  }
  return existing.status();
}

// Chunk-sized buffers for the chunks in flight, reused across the chunks and images of a copy.
class BufferPool {
 public:
  explicit BufferPool(size_t size) : size_(size) {}
  AlignedBuffer Take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        AlignedBuffer b = std::move(free_.back());
        free_.pop_back();
        return b;
      }
    }
    return AlignedBuffer(size_);
  }
  void Give(AlignedBuffer b) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(b));
  }

 private:
  const size_t size_;
  std::mutex mu_;
  std::vector<AlignedBuffer> free_;
};

class StepCopier {
 public:
  StepCopier(CheckpointStore& src, CheckpointStore& dst, const CommitRecord& record,
             const CopyOptions& options)
      : src_(src), dst_(dst), record_(record), options_(options) {
    progress_.bytes_total = record.total_bytes();
  }

  const CommitRecord& record() const { return record_; }

  Status CheckCancelled() const {
    if (options_.cancel != nullptr && options_.cancel->load(std::memory_order_relaxed)) {
      return Cancelled("cancelled");
    }
    return Status::OK();
  }

  Status CopyImage(uint32_t rank) {
    SP_ASSIGN_OR_RETURN(CheckpointStore::Metadata md, src_.ReadMetadata(record_, rank));
    const ImageLayout& layout = md.layout;
    SP_ASSIGN_OR_RETURN(auto in, src_.OpenImage(md));
    // The checksum section, as bytes to write; it must be the one ReadMetadata validated.
    AlignedBuffer tail(layout.image_size - layout.checksums_offset);
    if (!tail.ok()) return ResourceExhausted(md.source + ": cannot allocate a read buffer");
    SP_RETURN_IF_ERROR(in->ReadAt(layout.checksums_offset, tail.span()));
    SP_ASSIGN_OR_RETURN(auto crcs, ParseChecksumSection(tail.span(), layout, md.source));
    if (crcs != md.chunk_crcs) {
      return Corruption(md.source + ": checksum section changed while the image was copied");
    }
    const uint64_t chunks = md.chunk_crcs.size();
    if (chunks == 0 || layout.chunk_size == 0 ||
        (chunks - 1) * layout.chunk_size >= layout.checksums_offset ||
        chunks * layout.chunk_size < layout.checksums_offset) {
      return Corruption(md.source + ": checksum section does not cover the image");
    }

    if (options_.layout.packed()) {
      // A packed image on the destination, its chunks taken from the source, each verified.
      PackSource ps;
      ps.manifest_name = PackedObjectName(record_.step, rank, record_.generation);
      ps.meta = md.meta;
      ps.layout = layout;
      ps.tensors = md.tensors;
      ps.chunk = [&](uint64_t c, std::span<std::byte> dst) -> Result<std::span<const std::byte>> {
        SP_RETURN_IF_ERROR(CheckCancelled());
        auto chunk =
            dst.first(std::min(layout.chunk_size, layout.checksums_offset - c * layout.chunk_size));
        SP_RETURN_IF_ERROR(CheckpointStore::ReadChunk(md, *in, c, chunk));
        if (c == 0) SP_RETURN_IF_ERROR(CheckHeader(chunk, rank, md.source));
        SP_KILL_POINT("tier_copy.mid_image");
        Advance(chunk.size());
        return std::span<const std::byte>(chunk);
      };
      ps.checksums = [&](std::span<const uint32_t> crcs) -> Result<std::vector<std::byte>> {
        if (!std::equal(crcs.begin(), crcs.end(), md.chunk_crcs.begin(), md.chunk_crcs.end())) {
          return Corruption(md.source + ": a chunk changed while the image was copied");
        }
        return std::vector<std::byte>(tail.span().begin(), tail.span().end());
      };
      auto written = WritePackedImage(dst_.storage(), ps, options_.layout);
      if (written.ok()) {
        record_.images[rank].packed = true;
        Advance(tail.size());
        return Status::OK();
      }
      if (written.status().code() != StatusCode::kUnavailable) return written.status();
      // The destination's chunk GC is running: this image goes plain.
      progress_.bytes_done -= std::min(progress_.bytes_done, layout.checksums_offset);
    }
    record_.images[rank].packed = false;
    const std::string name = ImageObjectName(record_, rank);
    SP_ASSIGN_OR_RETURN(auto out, dst_.storage().Create(name, layout.image_size));
    const std::string target = dst_.storage().Describe(name);
    if (!pool_ || pool_size_ != layout.chunk_size) {
      pool_ = std::make_unique<BufferPool>(layout.chunk_size);
      pool_size_ = layout.chunk_size;
    }
    FirstError error;
    internal::ParallelFor(chunks, std::max<size_t>(1, options_.parallelism), [&](size_t i) {
      if (error.failed()) return;
      if (Status s = CheckCancelled(); !s.ok()) return error.Set(std::move(s));
      AlignedBuffer buf = pool_->Take();
      if (!buf.ok()) {
        return error.Set(ResourceExhausted("out of memory for a " +
                                           std::to_string(layout.chunk_size) + "-byte buffer"));
      }
      const uint64_t off = i * layout.chunk_size;
      auto chunk = buf.span().first(std::min(layout.chunk_size, layout.checksums_offset - off));
      Status s = CheckpointStore::ReadChunk(md, *in, i, chunk);
      if (s.ok() && i == 0) s = CheckHeader(chunk, rank, md.source);
      if (s.ok()) s = out->WriteAt(off, chunk);
      pool_->Give(std::move(buf));
      if (!s.ok()) return error.Set(std::move(s));
      SP_KILL_POINT("tier_copy.mid_image");
      Advance(chunk.size());
    });
    SP_RETURN_IF_ERROR(error.status());
    SP_RETURN_IF_ERROR(out->WriteAt(layout.checksums_offset, tail.span()));
    SP_RETURN_IF_ERROR(CheckCancelled());
    SP_KILL_POINT("tier_copy.before_image_publish");
    SP_RETURN_IF_ERROR(out->Publish());
    Advance(tail.size());
    return Status::OK();
  }

  Status PublishCommit(const std::string& encoded) {
    SP_RETURN_IF_ERROR(CheckCancelled());
    const std::string name = CommitObjectName(record_.step);
    SP_ASSIGN_OR_RETURN(auto out, dst_.storage().Create(name, encoded.size()));
    SP_RETURN_IF_ERROR(
        out->WriteAt(0, {reinterpret_cast<const std::byte*>(encoded.data()), encoded.size()}));
    Status s = out->PublishIfAbsent();
    if (s.code() != StatusCode::kAlreadyExists) return s;
    // Another copy of the step committed it meanwhile: the same record is success.
    SP_ASSIGN_OR_RETURN(bool same, CommittedThere(dst_, record_, src_.storage().uri()));
    if (!same) return s;
    return Status::OK();
  }

 private:
  // Chunk 0 holds the header: it must be the one the COMMIT record names.
  Status CheckHeader(std::span<const std::byte> chunk0, uint32_t rank, const std::string& source) {
    if (chunk0.size() < kImageHeaderSize)
      return Corruption(source + ": image shorter than a header");
    SP_ASSIGN_OR_RETURN(auto parsed, ParseImageHeader(chunk0.first(kImageHeaderSize), source));
    const auto& [meta, layout] = parsed;
    if (layout.header_crc != record_.images[rank].header_crc || meta.step != record_.step ||
        meta.rank != rank || meta.world_size != record_.world_size) {
      return Corruption(source + ": image header does not match the COMMIT record");
    }
    return Status::OK();
  }

  void Advance(uint64_t bytes) {
    std::lock_guard<std::mutex> lock(progress_mu_);
    progress_.bytes_done += bytes;
    if (options_.progress) options_.progress(progress_);
  }

  CheckpointStore& src_;
  CheckpointStore& dst_;
  CommitRecord record_;  // the source's, with the destination's layout of each image
  const CopyOptions& options_;
  std::unique_ptr<BufferPool> pool_;
  uint64_t pool_size_ = 0;
  std::mutex progress_mu_;
  CopyProgress progress_;
};

}  // namespace

Result<CopyResult> CopyStep(CheckpointStore& src, CheckpointStore& dst, uint64_t step,
                            const CopyOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string src_uri = src.storage().uri();
  const std::string what =
      "copying step " + std::to_string(step) + " from " + src_uri + " to " + dst.storage().uri();
  SP_ASSIGN_OR_RETURN(CommitRecord record, src.ReadCommit(step));
  SP_ASSIGN_OR_RETURN(bool there, CommittedThere(dst, record, src_uri));
  CopyResult result;
  if (!there) {
    StepCopier copier(src, dst, record, options);
    for (uint32_t rank = 0; rank < record.world_size; ++rank) {
      Status s = copier.CopyImage(rank);
      if (!s.ok()) return s.WithContext(what);
    }
    SP_KILL_POINT("tier_copy.before_commit");
    // The source's record, with each image's layout as the destination stores it.
    Status s = copier.PublishCommit(EncodeCommitRecord(copier.record()));
    if (!s.ok()) return s.WithContext(what);
    SP_KILL_POINT("tier_copy.after_commit");
    result.bytes = record.total_bytes();
  } else {
    result.already_there = true;
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace safepoint
