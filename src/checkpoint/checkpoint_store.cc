// CheckpointStore: writing images, reading committed steps, deleting and cleaning up (the
// commit protocol itself, and reading COMMIT records, are in commit.cc).

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_set>

#include "base/aligned_buffer.h"
#include "base/bytes.h"
#include "base/clock.h"
#include "base/crc32c.h"
#include "base/kill_point.h"
#include "base/parallel.h"
#include "checkpoint/commit_record.h"
#include "checkpoint/compression_policy.h"
#include "checkpoint/packed_reader.h"
#include "checkpoint/packed_writer.h"
#include "checkpoint/small_object.h"
#include "safepoint/checkpoint.h"

namespace safepoint {

using internal::AlignedBuffer;
using internal::AppendLE;
using internal::Crc32c;
using internal::FirstError;
using internal::kCommitFixed;
using internal::LoadLE;
using internal::ReadSmallObject;
using internal::WriteSmallObject;

namespace {

constexpr uint64_t kIoPiece = 8 << 20;  // request size for images already in memory

// A small pool of chunk-sized staging buffers, reused across saves so that their pages are
// faulted in once per process rather than once per save.
class StagingPool {
 public:
  AlignedBuffer Take(size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->size() == size) {
        AlignedBuffer b = std::move(*it);
        free_.erase(it);
        return b;
      }
    }
    return AlignedBuffer(size);
  }
  void Give(AlignedBuffer b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < 16) free_.push_back(std::move(b));
  }

 private:
  std::mutex mu_;
  std::vector<AlignedBuffer> free_;
};

StagingPool& Staging() {
  static StagingPool* pool = new StagingPool();
  return *pool;
}

// How to split a large read or write of checksum chunks of `chunk` bytes into requests: the
// storage's preferred request size where it is a multiple of the chunk size (several chunks per
// request, aligned to it; an object store's part or chunk size), else one chunk per request; at
// most the storage's preferred number in flight, else the default I/O thread count.
struct IoShape {
  uint64_t chunks_per_request = 1;
  size_t threads = 1;
};

IoShape ShapeFor(const Storage& storage, uint64_t chunk) {
  const StorageCapabilities caps = storage.capabilities();
  IoShape shape;
  shape.threads = caps.io_parallelism > 0 ? caps.io_parallelism : internal::DefaultIoThreads();
  if (chunk > 0 && caps.preferred_io_size > chunk && caps.preferred_io_size % chunk == 0) {
    shape.chunks_per_request = caps.preferred_io_size / chunk;
  }
  return shape;
}

// Faults in the pages of a fresh destination buffer on the calling thread. A backend may receive
// on few threads of its own (librados: one messenger thread per OSD connection), which would
// otherwise zero every fresh page of a large image one after another while the readers wait.
// MADV_POPULATE_WRITE (Linux 5.14) faults the range in inside one system call; where the kernel
// lacks it, every page is written once.
void Prefault(std::byte* p, size_t n) {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;
#endif
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{4095};
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
  if (n > 0 && madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0) {
    return;
  }
  for (size_t i = 0; i < n; i += 4096) reinterpret_cast<volatile std::byte*>(p)[i] = std::byte{0};
}

// The one choice between the layouts (CheckpointStore::WriteImage / WriteImageBytes with
// PackOptions): where `options` asks for packed and the compression policy agrees, the packed
// writer writes the image from packed() (its source); else, or when the chunk store's GC is
// running, plain() writes the plain image, whose time teaches the policy (auto) the tier's
// plain write speed.
template <typename PackedSource, typename PlainWrite>
Result<WriteStats> WriteWithLayout(Storage& storage, const PackOptions& options,
                                   PackedSource&& packed, PlainWrite&& plain) {
  const std::string& uri = storage.uri();
  internal::CompressionPolicy& policy = internal::CompressionPolicy::Get();
  if (options.packed()) {
    SP_ASSIGN_OR_RETURN(PackSource src, packed());
    if (policy.WantPacked(uri, options, src.sample, src.sample_element_size)) {
      auto stats = WritePackedImage(storage, src, options);
      if (stats.ok() || stats.status().code() != StatusCode::kUnavailable) return stats;
      // The chunk store's GC is running: this image is written plain.
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  Result<WriteStats> stats = plain();
  if (stats.ok()) policy.WrotePlain(uri, options, stats->bytes, SecondsSince(t0));
  return stats;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CheckpointStore

CheckpointStore::CheckpointStore(std::shared_ptr<Storage> storage) : storage_(std::move(storage)) {}

Result<WriteStats> CheckpointStore::WriteImage(const ImageBuilder& image, uint64_t generation) {
  return WritePlain(image, generation, /*exclusive=*/false);
}

Result<WriteStats> CheckpointStore::WritePlain(const ImageBuilder& image, uint64_t generation,
                                               bool exclusive) {
  const auto t0 = std::chrono::steady_clock::now();
  const ImageLayout& l = image.layout();
  const std::string name = ImageObjectName(image.meta().step, image.meta().rank, generation);
  SP_ASSIGN_OR_RETURN(auto w, storage_->Create(name, l.image_size));

  // Requests of one or more whole chunks (the storage's preferred size), each chunk CRC'd.
  const uint64_t chunks = image.chunk_count();
  const IoShape shape = ShapeFor(*storage_, l.chunk_size);
  const uint64_t span = shape.chunks_per_request * l.chunk_size;
  const uint64_t requests = (chunks + shape.chunks_per_request - 1) / shape.chunks_per_request;
  std::vector<uint32_t> crcs(chunks);
  // A request inside one tensor is sent from the tensor's own bytes, without a staging copy,
  // where the storage copies or streams what it is given anyway (object stores, memory); a file
  // system written with O_DIRECT takes them only when page-aligned (else the page cache would).
  const bool direct_io = storage_->capabilities().direct_io;
  FirstError error;
  internal::ParallelFor(requests, shape.threads, [&](size_t k) {
    if (error.failed()) return;
    const uint64_t first = k * shape.chunks_per_request;
    const uint64_t last = std::min(chunks, first + shape.chunks_per_request);
    const uint64_t off = first * l.chunk_size;
    const uint64_t len = std::min(last * l.chunk_size, l.checksums_offset) - off;
    std::span<const std::byte> data = image.SourceBytes(off, len);
    if (direct_io && reinterpret_cast<uintptr_t>(data.data()) % kDirectIOAlignment != 0) {
      data = {};
    }
    AlignedBuffer buf;
    if (data.empty()) {
      buf = Staging().Take(span);
      if (!buf.ok()) {
        error.Set(ResourceExhausted("out of memory for a " + std::to_string(span) +
                                    "-byte staging buffer"));
        return;
      }
      image.Fill(off, buf.span().subspan(0, len));
      data = buf.span().subspan(0, len);
    }
    for (uint64_t i = first; i < last; ++i) {
      const uint64_t at = (i - first) * l.chunk_size;
      crcs[i] = Crc32c(0, data.data() + at, std::min(l.chunk_size, len - at));
    }
    error.Set(w->WriteAt(off, data));
    if (buf.size() > 0) Staging().Give(std::move(buf));
  });
  SP_RETURN_IF_ERROR(error.status());

  const std::vector<std::byte> section = image.ChecksumSection(crcs);
  AlignedBuffer tail(section.size());
  if (!tail.ok()) return ResourceExhausted("out of memory for the checksum section");
  std::memcpy(tail.data(), section.data(), section.size());
  SP_RETURN_IF_ERROR(w->WriteAt(l.checksums_offset, tail.span()));
  SP_RETURN_IF_ERROR(exclusive ? w->PublishIfAbsent() : w->Publish());
  WriteStats stats;
  stats.bytes = l.image_size;
  stats.seconds = SecondsSince(t0);
  return stats;
}

Result<WriteStats> CheckpointStore::WriteImageBytes(std::span<const std::byte> image, uint64_t step,
                                                    uint32_t rank) {
  return WritePlainBytes(image, step, rank, /*generation=*/0, /*exclusive=*/false);
}

Result<WriteStats> CheckpointStore::WritePlainBytes(std::span<const std::byte> image, uint64_t step,
                                                    uint32_t rank, uint64_t generation,
                                                    bool exclusive) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string name = ImageObjectName(step, rank, generation);
  SP_ASSIGN_OR_RETURN(auto w, storage_->Create(name, image.size()));
  // Pieces of kIoPiece, or of the storage's preferred size where that is a multiple of it.
  const IoShape shape = ShapeFor(*storage_, kIoPiece);
  const uint64_t piece = shape.chunks_per_request * kIoPiece;
  const uint64_t pieces = (image.size() + piece - 1) / piece;
  FirstError error;
  internal::ParallelFor(pieces, shape.threads, [&](size_t i) {
    if (error.failed()) return;
    const uint64_t off = i * piece;
    error.Set(w->WriteAt(off, image.subspan(off, std::min<uint64_t>(piece, image.size() - off))));
    SP_KILL_POINT("store.write.after_piece");
  });
  SP_RETURN_IF_ERROR(error.status());
  SP_RETURN_IF_ERROR(exclusive ? w->PublishIfAbsent() : w->Publish());
  WriteStats stats;
  stats.bytes = image.size();
  stats.seconds = SecondsSince(t0);
  return stats;
}

Result<WriteStats> CheckpointStore::WriteImage(const ImageBuilder& image, uint64_t generation,
                                               const PackOptions& options) {
  return WriteWithLayout(
      *storage_, options, [&]() -> Result<PackSource> { return PackSourceOf(image, generation); },
      [&] { return WriteImage(image, generation); });
}

Result<WriteStats> CheckpointStore::WriteImageBytes(std::span<const std::byte> image, uint64_t step,
                                                    uint32_t rank, const PackOptions& options) {
  return WriteWithLayout(
      *storage_, options, [&] { return PackSourceOf(image, step, rank); },
      [&] { return WriteImageBytes(image, step, rank); });
}

Result<WriteStats> CheckpointStore::WriteImageOfAttempt(const ImageBuilder& image,
                                                        const PackOptions& options) {
  const uint64_t attempt = image.meta().attempt;
  return WriteWithLayout(
      *storage_, options,
      [&]() -> Result<PackSource> {
        PackSource src = PackSourceOf(image, attempt);
        src.exclusive = true;
        return src;
      },
      [&] { return WritePlain(image, attempt, /*exclusive=*/true); });
}

Result<WriteStats> CheckpointStore::WriteImageBytesOfAttempt(std::span<const std::byte> image,
                                                             uint64_t step, uint32_t rank,
                                                             const PackOptions& options) {
  SP_ASSIGN_OR_RETURN(auto header, ParseImageHeader(image, storage_->Describe(StepPrefix(step))));
  const uint64_t attempt = header.first.attempt;
  return WriteWithLayout(
      *storage_, options,
      [&]() -> Result<PackSource> {
        SP_ASSIGN_OR_RETURN(PackSource src, PackSourceOf(image, step, rank, attempt));
        src.exclusive = true;
        return src;
      },
      [&] { return WritePlainBytes(image, step, rank, attempt, /*exclusive=*/true); });
}

Result<std::unique_ptr<ReadableObject>> CheckpointStore::OpenImageObject(const std::string& name) {
  if (name.ends_with(".pack")) return OpenPackedImage(storage_, name);
  return storage_->Open(name);
}

Result<std::vector<TensorEntry>> CheckpointStore::ReadIndex(const CommitRecord& commit,
                                                            uint32_t rank) {
  const std::string name = ImageObjectName(commit, rank);
  const std::string source = storage_->Describe(name);
  SP_ASSIGN_OR_RETURN(auto obj, OpenImageObject(name));
  std::vector<std::byte> header(kImageHeaderSize);
  SP_RETURN_IF_ERROR(obj->ReadAt(0, header));
  SP_ASSIGN_OR_RETURN(auto parsed, ParseImageHeader(header, source));
  if (parsed.second.header_crc != commit.images[rank].header_crc ||
      parsed.second.image_size != obj->size()) {
    return Corruption(source + ": image header does not match the COMMIT record");
  }
  std::vector<std::byte> index(parsed.second.index_size);
  SP_RETURN_IF_ERROR(obj->ReadAt(parsed.second.index_offset, index));
  return ParseIndex(index, parsed.second, source);
}

Status CheckpointStore::CheckReplicasHeld(const CommitRecord& commit, uint32_t rank,
                                          const std::vector<TensorEntry>& entries) {
  std::map<std::string, const TensorSpec*> wanted;  // ReplicaKey -> the first entry of it
  for (const TensorEntry& e : entries) {
    if (e.spec.elsewhere) wanted.try_emplace(ReplicaKey(e.spec), &e.spec);
  }
  for (uint32_t r = 0; r < commit.world_size && !wanted.empty(); ++r) {
    if (r == rank) continue;
    SP_ASSIGN_OR_RETURN(auto other, ReadIndex(commit, r));
    for (const TensorEntry& e : other) {
      if (!e.spec.elsewhere) wanted.erase(ReplicaKey(e.spec));
    }
  }
  if (wanted.empty()) return Status::OK();
  return Corruption(storage_->uri() + ": step " + std::to_string(commit.step) + ": rank " +
                    std::to_string(rank) + " left tensor '" + wanted.begin()->second->name +
                    "' to another rank, but no image of the step holds it");
}

Status CheckpointStore::CheckReplicasHeld(const CommitRecord& commit) {
  std::vector<std::vector<TensorEntry>> indexes;
  std::unordered_set<std::string> held;
  for (uint32_t r = 0; r < commit.world_size; ++r) {
    SP_ASSIGN_OR_RETURN(auto entries, ReadIndex(commit, r));
    for (const TensorEntry& e : entries) {
      if (!e.spec.elsewhere) held.insert(ReplicaKey(e.spec));
    }
    indexes.push_back(std::move(entries));
  }
  for (uint32_t r = 0; r < commit.world_size; ++r) {
    for (const TensorEntry& e : indexes[r]) {
      if (e.spec.elsewhere && !held.contains(ReplicaKey(e.spec))) {
        return Corruption(storage_->uri() + ": step " + std::to_string(commit.step) + ": rank " +
                          std::to_string(r) + " left tensor '" + e.spec.name +
                          "' to another rank, but no image of the step holds it");
      }
    }
  }
  return Status::OK();
}

namespace {
// A tensor left to another rank's image ("elsewhere") takes no bytes in its own image, so its
// index entry's size is bounded by nothing there: its bytes are in another image of the step,
// which is then at least as large. Checked against the largest image the COMMIT record names,
// before anything is allocated for it (a forged [2**40] entry passed verify and inspect, and a
// load allocated it before finding that no image held it: issue 35).
Status CheckElsewhereBound(const std::vector<TensorEntry>& entries, const CommitRecord& commit,
                           const std::string& source) {
  uint64_t largest = 0;
  for (const auto& image : commit.images) largest = std::max(largest, image.size);
  for (size_t i = 0; i < entries.size(); ++i) {
    const TensorEntry& e = entries[i];
    if (e.spec.elsewhere && e.nbytes > largest) {
      return Corruption(source + ": index entry " + std::to_string(i) + ": tensor '" + e.spec.name +
                        "' of " + std::to_string(e.nbytes) +
                        " bytes is left to another rank's image, but no image of step " +
                        std::to_string(commit.step) + " is that large (the largest has " +
                        std::to_string(largest) + " bytes)");
    }
  }
  return Status::OK();
}
}  // namespace

Result<LoadedImage> CheckpointStore::ReadImage(const CommitRecord& commit, uint32_t rank) {
  if (rank >= commit.world_size) {
    return InvalidArgument(storage_->uri() + ": step " + std::to_string(commit.step) +
                           " was saved by " + std::to_string(commit.world_size) + " ranks; rank " +
                           std::to_string(rank) + " does not exist");
  }
  const std::string name = ImageObjectName(commit, rank);
  const std::string source = storage_->Describe(name);
  SP_ASSIGN_OR_RETURN(auto obj, OpenImageObject(name));
  const auto& expected = commit.images[rank];
  if (obj->size() != expected.size) {
    return Corruption(source + ": object has " + std::to_string(obj->size()) +
                      " bytes, the COMMIT record says " + std::to_string(expected.size));
  }
  if (expected.size < kImageHeaderSize || expected.size % kImageAlignment != 0) {
    return Corruption(source + ": invalid image size " + std::to_string(expected.size));
  }
  const size_t size = expected.size;
  // Small pages (docs/benchmarks.md, "Object storage tiers: S3"): on a guest whose free memory
  // goes back to the hypervisor (free page reporting), a fresh huge page is a 2 MiB block that
  // was given back, and faulting 1 GiB of them in cost 2-5 s of CPU where small pages, which the
  // kernel hands out from memory it kept, cost 0.4-1.4 s; that made every other load twice as
  // slow.
  auto owner = std::make_shared<internal::AlignedBuffer>(size, /*huge_pages=*/false);
  if (!owner->ok()) {
    return ResourceExhausted(source + ": cannot allocate " + std::to_string(size) +
                             " bytes to read the image");
  }
  std::byte* raw = owner->data();
  std::shared_ptr<std::byte> buffer(owner, raw);

  // Header first: it gives the layout and the chunk size, and must be the committed one.
  SP_RETURN_IF_ERROR(obj->ReadAt(0, {raw, kImageHeaderSize}));
  SP_ASSIGN_OR_RETURN(auto parsed, ParseImageHeader({raw, kImageHeaderSize}, source));
  const ImageMeta& meta = parsed.first;  // no structured binding: lambdas below use it
  const ImageLayout& layout = parsed.second;
  if (layout.header_crc != expected.header_crc) {
    return Corruption(source + ": image header does not match the COMMIT record (replaced?)");
  }
  if (meta.step != commit.step || meta.rank != rank || meta.world_size != commit.world_size ||
      layout.image_size != size) {
    return Corruption(source + ": image header names another step, rank or size");
  }
  auto tail = std::span<std::byte>(raw + layout.checksums_offset, size - layout.checksums_offset);
  SP_RETURN_IF_ERROR(obj->ReadAt(layout.checksums_offset, tail));
  SP_ASSIGN_OR_RETURN(auto crcs, ParseChecksumSection(tail, layout, source));

  // Requests of one or more whole chunks (the storage's preferred size, aligned to it); every
  // chunk of a request is verified when it has landed. Nothing is handed out before all are.
  const uint64_t covered = layout.checksums_offset;
  const uint64_t chunks = crcs.size();
  const IoShape shape = ShapeFor(*storage_, layout.chunk_size);
  const uint64_t requests = (chunks + shape.chunks_per_request - 1) / shape.chunks_per_request;
  FirstError error;
  internal::ParallelFor(requests, shape.threads, [&](size_t k) {
    if (error.failed()) return;
    const uint64_t first = k * shape.chunks_per_request;
    const uint64_t last = std::min(chunks, first + shape.chunks_per_request);
    const uint64_t off = first * layout.chunk_size;
    const uint64_t end = std::min(last * layout.chunk_size, covered);
    Prefault(raw + off, end - off);
    Status s = obj->ReadAt(off, {raw + off, end - off});
    for (uint64_t i = first; s.ok() && i < last; ++i) {
      const uint64_t at = i * layout.chunk_size;
      s = VerifyChunk({raw + at, std::min(layout.chunk_size, covered - at)}, i, crcs[i], source);
    }
    error.Set(std::move(s));
  });
  SP_RETURN_IF_ERROR(error.status());
  if (layout.has_elsewhere) {
    SP_ASSIGN_OR_RETURN(auto entries,
                        ParseIndex({raw + layout.index_offset, layout.index_size}, layout, source));
    SP_RETURN_IF_ERROR(CheckElsewhereBound(entries, commit, source));
  }
  return LoadedImage{std::move(buffer), size, source};
}

Result<CheckpointStore::Metadata> CheckpointStore::ReadMetadata(const CommitRecord& commit,
                                                                uint32_t rank) {
  if (rank >= commit.world_size) {
    return InvalidArgument(storage_->uri() + ": step " + std::to_string(commit.step) +
                           " has no rank " + std::to_string(rank));
  }
  const std::string name = ImageObjectName(commit, rank);
  Metadata md;
  md.name = name;
  md.source = storage_->Describe(name);
  SP_ASSIGN_OR_RETURN(auto obj, OpenImageObject(name));
  if (obj->size() != commit.images[rank].size) {
    return Corruption(md.source + ": object has " + std::to_string(obj->size()) +
                      " bytes, the COMMIT record says " + std::to_string(commit.images[rank].size));
  }
  std::vector<std::byte> header(kImageHeaderSize);
  SP_RETURN_IF_ERROR(obj->ReadAt(0, header));
  SP_ASSIGN_OR_RETURN(auto parsed, ParseImageHeader(header, md.source));
  md.meta = std::move(parsed.first);
  md.layout = parsed.second;
  if (md.layout.header_crc != commit.images[rank].header_crc ||
      md.layout.image_size != obj->size()) {
    return Corruption(md.source + ": image header does not match the COMMIT record");
  }
  std::vector<std::byte> index(md.layout.index_size);
  SP_RETURN_IF_ERROR(obj->ReadAt(md.layout.index_offset, index));
  SP_ASSIGN_OR_RETURN(md.tensors, ParseIndex(index, md.layout, md.source));
  SP_RETURN_IF_ERROR(CheckElsewhereBound(md.tensors, commit, md.source));
  std::vector<std::byte> extras(md.layout.extras_size);
  SP_RETURN_IF_ERROR(obj->ReadAt(md.layout.extras_offset, extras));
  if (Crc32c(0, extras.data(), extras.size()) != md.layout.extras_crc) {
    return Corruption(md.source + ": corrupt image: extras checksum mismatch");
  }
  SP_ASSIGN_OR_RETURN(md.extras, DecodeExtras(extras, md.tensors.size(), md.source));
  std::vector<std::byte> checksums(md.layout.image_size - md.layout.checksums_offset);
  SP_RETURN_IF_ERROR(obj->ReadAt(md.layout.checksums_offset, checksums));
  SP_ASSIGN_OR_RETURN(md.chunk_crcs, ParseChecksumSection(checksums, md.layout, md.source));
  return md;
}

Status CheckpointStore::ReadRanges(const Metadata& md, std::span<const Range> ranges) {
  const ImageLayout& layout = md.layout;
  const uint64_t covered = layout.checksums_offset;  // chunks cover [0, checksums_offset)
  std::vector<uint64_t> chunks;
  for (const Range& r : ranges) {
    if (r.length == 0) continue;
    if (r.offset > covered || r.length > covered - r.offset || r.dst == nullptr) {
      return InvalidArgument(md.source + ": range [" + std::to_string(r.offset) + ", +" +
                             std::to_string(r.length) + ") lies outside the image's data");
    }
    for (uint64_t c = r.offset / layout.chunk_size; c * layout.chunk_size < r.offset + r.length;
         ++c) {
      chunks.push_back(c);
    }
  }
  std::sort(chunks.begin(), chunks.end());
  chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
  if (chunks.empty()) return Status::OK();
  if (chunks.back() >= md.chunk_crcs.size()) {
    return Corruption(md.source + ": checksum section has too few chunks");
  }
  SP_ASSIGN_OR_RETURN(auto obj, OpenImage(md));
  const bool direct_io = storage_->capabilities().direct_io;
  FirstError error;
  internal::ParallelFor(chunks.size(), internal::DefaultIoThreads(), [&](size_t k) {
    if (error.failed()) return;
    const uint64_t c = chunks[k];
    const uint64_t off = c * layout.chunk_size;
    const uint64_t len = std::min(layout.chunk_size, covered - off);
    // A chunk that lies wholly inside one range is read straight into that range's destination
    // (a restore's target tensor: memory that is already faulted in) and verified there, where
    // the storage reads it there as well as into a staging buffer: without direct I/O, or with
    // the destination aligned for it (else the read would fall back to the page cache, slower
    // than a direct read and one copy). The others go through a reused staging buffer,
    // verified before any byte is copied out.
    const Range* home = nullptr;
    for (const Range& r : ranges) {
      if (r.length != 0 && r.offset <= off && off + len <= r.offset + r.length &&
          (!direct_io ||
           (reinterpret_cast<uintptr_t>(r.dst) - r.offset) % kDirectIOAlignment == 0)) {
        home = &r;
        break;
      }
    }
    AlignedBuffer staged;
    std::span<std::byte> landed;
    if (home != nullptr) {
      landed = {home->dst + (off - home->offset), len};
    } else {
      staged = Staging().Take(layout.chunk_size);
      if (!staged.ok()) {
        error.Set(ResourceExhausted(md.source + ": cannot allocate a read buffer"));
        return;
      }
      landed = staged.span().subspan(0, len);
    }
    Status s = ReadChunk(md, *obj, c, landed);
    if (s.ok()) {
      for (const Range& r : ranges) {  // each other range's part inside this chunk
        const uint64_t lo = std::max(r.offset, off), hi = std::min(r.offset + r.length, off + len);
        if (lo < hi && &r != home) {
          std::memcpy(r.dst + (lo - r.offset), landed.data() + (lo - off), hi - lo);
        }
      }
    }
    if (staged.ok()) Staging().Give(std::move(staged));
    error.Set(std::move(s));
  });
  return error.status();
}

Result<std::unique_ptr<ReadableObject>> CheckpointStore::OpenImage(const Metadata& md) {
  // Match the object to the metadata: a replaced image must not be read with the old checksums.
  SP_ASSIGN_OR_RETURN(auto obj, OpenImageObject(md.name));
  if (obj->size() != md.layout.image_size) {
    return Corruption(md.source + ": object has " + std::to_string(obj->size()) +
                      " bytes, its header says " + std::to_string(md.layout.image_size));
  }
  return obj;
}

Status CheckpointStore::ReadChunk(const Metadata& md, const ReadableObject& image, uint64_t chunk,
                                  std::span<std::byte> dst) {
  const uint64_t covered = md.layout.checksums_offset;
  const uint64_t off = chunk * md.layout.chunk_size;
  if (chunk >= md.chunk_crcs.size() || off >= covered ||
      dst.size() != std::min(md.layout.chunk_size, covered - off)) {
    return InvalidArgument(md.source + ": no checksum chunk " + std::to_string(chunk) + " of " +
                           std::to_string(dst.size()) + " bytes");
  }
  SP_RETURN_IF_ERROR(image.ReadAt(off, dst));
  return VerifyChunk(dst, chunk, md.chunk_crcs[chunk], md.source);
}

Status CheckpointStore::DeleteStep(uint64_t step) {
  {
    std::lock_guard<std::mutex> lock(known_mu_);
    known_commits_.erase(step);
  }
  SP_RETURN_IF_ERROR(storage_->Delete(CommitObjectName(step)));
  SP_KILL_POINT("store.delete.after_commit");
  SP_ASSIGN_OR_RETURN(auto objects, storage_->List(StepPrefix(step)));
  for (const auto& o : objects) {
    SP_RETURN_IF_ERROR(storage_->Delete(o.name));
    SP_KILL_POINT("store.delete.after_object");
  }
  return Status::OK();
}

Result<size_t> CheckpointStore::CleanUp(std::chrono::seconds grace) {
  // One List; the newest valid record is read newest first (one COMMIT read in the common
  // case, not one per step kept). A step with a COMMIT object is committed even when its record
  // did not read back just now (a bit flipped on the way, a damaged record): clean-up never
  // removes it.
  SP_ASSIGN_OR_RETURN(auto objects, storage_->List("step-"));
  const std::vector<uint64_t> committed_steps = StepsWithCommitIn(objects);
  SP_ASSIGN_OR_RETURN(std::optional<CommitRecord> newest_record, NewestCommitted(committed_steps));
  if (!newest_record) return size_t{0};
  return RemoveUncommitted(objects, committed_steps, newest_record->step, grace);
}

Result<size_t> CheckpointStore::CleanUpListed(const std::vector<ObjectInfo>& listing,
                                              uint64_t newest, std::chrono::seconds grace) {
  return RemoveUncommitted(listing, StepsWithCommitIn(listing), newest, grace);
}

Result<size_t> CheckpointStore::RemoveUncommitted(const std::vector<ObjectInfo>& objects,
                                                  const std::vector<uint64_t>& committed_steps,
                                                  uint64_t newest, std::chrono::seconds grace) {
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  const int64_t grace_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(grace).count();
  size_t removed = 0;
  for (const auto& o : objects) {
    auto step = StepFromObjectName(o.name);
    if (!step || *step >= newest) continue;
    // Young (or from a clock ahead of ours): perhaps a concurrent writer's, about to commit.
    if (o.mtime_ns != 0 && now_ns - o.mtime_ns < grace_ns) continue;
    if (!std::binary_search(committed_steps.begin(), committed_steps.end(), *step)) {
      SP_KILL_POINT("store.cleanup.before_remove");
      const Status s = storage_->Delete(o.name);
      if (s.code() == StatusCode::kNotFound) continue;  // removed since the listing
      SP_RETURN_IF_ERROR(s);
      ++removed;
    }
  }
  SP_ASSIGN_OR_RETURN(size_t n, storage_->RemoveLeftovers("step-", [newest](std::string_view name) {
    auto step = StepFromObjectName(name);
    return step && *step < newest;
  }));
  removed += n;
  return removed;
}

Result<std::unique_ptr<CheckpointStore>> OpenCheckpointStore(std::string_view path) {
  SP_ASSIGN_OR_RETURN(auto storage, OpenStorage(path));
  return std::make_unique<CheckpointStore>(std::shared_ptr<Storage>(std::move(storage)));
}

}  // namespace safepoint
