// Writing a packed image (packed_writer.h; bytes in docs/format.md, "Packed steps").
//
// Writing a packed image of step s, rank r (WritePackedImage):
//   W1. Publish an intent record "chunks/inflight/<step>.r<rank>.<random>": a save is in flight.
//   W2. If "chunks/gc-lock" exists, a GC may be deleting chunks: break it if its holder is
//       provably dead (chunk_store_holder.h), else wait for it to go (a GC is short; up to
//       kGcWait), then go on (that GC has ended, and any later one finds the intent). If it is
//       still there, delete the intent and write the plain image instead (the caller does);
//       nothing of the chunk store is relied on.
//   W3. For every image chunk, in parallel: take its raw bytes, CRC-32C and SHA-256 them; unless
//       incremental and "chunks/<hh>/<sha256>" exists, encode it (codec::EncodeChunk) and
//       publish it with PublishIfAbsent (an equal chunk another writer published is as good).
//   W4. Publish the manifest "step-S/rank-R.pack" (or rank-R.g<gen>.pack); the agent's writes
//       (PackSource::exclusive) only where the name is free.
//   W5. Delete the intent. The step commits later (TryCommit) like a plain one.
// Why the garbage collector (G1-G6) never removes a chunk such a write relies on: chunk_gc.cc.
// A killed writer leaves an intent (GC defers until it is stale or its holder is seen dead),
// published chunks and perhaps a manifest (an uncommitted step's: CleanUp removes it, then GC
// its chunks): garbage only.
#include "checkpoint/packed_writer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "base/aligned_buffer.h"
#include "base/clock.h"
#include "base/crc32c.h"
#include "base/digest.h"
#include "base/kill_point.h"
#include "base/parallel.h"
#include "base/random.h"
#include "checkpoint/chunk_store_holder.h"
#include "checkpoint/compression_policy.h"
#include "checkpoint/content_chunks.h"
#include "checkpoint/pack_manifest.h"
#include "checkpoint/small_object.h"
#include "codec/codec.h"

namespace safepoint {

using internal::AlignedBuffer;
using internal::CompressionPolicy;
using internal::Crc32c;
using internal::FirstError;

namespace {

// How long a packed save waits for a running GC before it writes the plain image instead.
constexpr std::chrono::milliseconds kGcWait(2000);
constexpr size_t kMinProbe = 256 << 10;   // bytes: a chunk large enough to time the encoder on
constexpr uint64_t kMaxSample = 4 << 20;  // bytes of the largest tensor auto probes on

// The element size the codec splits a tensor of `dtype` by (1: bytes).
int CodecElementSize(DType dtype) {
  const size_t size = DTypeSize(dtype);
  return size == 2 || size == 4 || size == 8 ? static_cast<int>(size) : 1;
}

// Element size of the tensor that holds the middle of each content chunk (1 where none does).
std::vector<int> ElementSizes(const std::vector<PackedManifest::Chunk>& chunks,
                              const std::vector<TensorEntry>& tensors) {
  std::vector<int> out(chunks.size(), 1);
  std::vector<const TensorEntry*> held;
  for (const auto& t : tensors) {
    if (!t.spec.elsewhere && t.nbytes > 0) held.push_back(&t);
  }
  std::sort(held.begin(), held.end(),
            [](const TensorEntry* a, const TensorEntry* b) { return a->offset < b->offset; });
  for (size_t c = 0; c < chunks.size(); ++c) {
    const uint64_t mid = chunks[c].offset + chunks[c].raw_size / 2;
    auto it = std::upper_bound(held.begin(), held.end(), mid,
                               [](uint64_t v, const TensorEntry* t) { return v < t->offset; });
    if (it == held.begin()) continue;
    const TensorEntry* t = *(it - 1);
    if (mid < t->offset + t->nbytes) out[c] = CodecElementSize(t->spec.dtype);
  }
  return out;
}

}  // namespace

PackSource PackSourceOf(const ImageBuilder& image, uint64_t generation) {
  PackSource src;
  src.manifest_name = PackedObjectName(image.meta().step, image.meta().rank, generation);
  src.meta = image.meta();
  src.layout = image.layout();
  for (size_t i = 0; i < image.tensors().size(); ++i) {
    const TensorSource& t = image.tensors()[i];
    src.tensors.push_back({t.spec, image.tensor_offset(i), t.nbytes});
  }
  src.chunk = [&image](uint64_t c, std::span<std::byte> dst) -> Result<std::span<const std::byte>> {
    const ImageLayout& l = image.layout();
    const uint64_t at = c * l.chunk_size;
    auto out = dst.first(std::min(l.chunk_size, l.checksums_offset - at));
    image.Fill(at, out);
    return std::span<const std::byte>(out);
  };
  src.checksums = [&image](std::span<const uint32_t> crcs) -> Result<std::vector<std::byte>> {
    return image.ChecksumSection(crcs);
  };
  // A sample straight from the largest tensor's memory (not staged: the builder has it).
  const TensorSource* best = nullptr;
  for (const auto& t : image.tensors()) {
    if (!t.spec.elsewhere && !t.staged && t.data != nullptr &&
        (best == nullptr || t.nbytes > best->nbytes)) {
      best = &t;
    }
  }
  if (best != nullptr) {
    src.sample = {static_cast<const std::byte*>(best->data),
                  static_cast<size_t>(std::min<uint64_t>(best->nbytes, kMaxSample))};
    src.sample_element_size = CodecElementSize(best->spec.dtype);
  }
  return src;
}

Result<PackSource> PackSourceOf(std::span<const std::byte> image, uint64_t step, uint32_t rank,
                                uint64_t generation) {
  const std::string source =
      "the image of step " + std::to_string(step) + ", rank " + std::to_string(rank) + " in memory";
  if (image.size() < kImageHeaderSize) return InvalidArgument(source + ": too small");
  SP_ASSIGN_OR_RETURN(auto parsed, ParseImageHeader(image.first(kImageHeaderSize), source));
  const ImageLayout l = parsed.second;
  if (l.image_size != image.size() || parsed.first.step != step || parsed.first.rank != rank) {
    return InvalidArgument(source + ": its header names another step, rank or size");
  }
  PackSource src;
  SP_ASSIGN_OR_RETURN(src.tensors,
                      ParseIndex(image.subspan(l.index_offset, l.index_size), l, source));
  src.manifest_name = PackedObjectName(step, rank, generation);
  src.meta = parsed.first;
  src.layout = l;
  src.chunk = [image, l](uint64_t c, std::span<std::byte>) -> Result<std::span<const std::byte>> {
    const uint64_t at = c * l.chunk_size;
    return image.subspan(at, std::min(l.chunk_size, l.checksums_offset - at));
  };
  src.checksums = [image, l,
                   source](std::span<const uint32_t> crcs) -> Result<std::vector<std::byte>> {
    // The image's own section, which must hold the CRCs of the bytes just read.
    auto tail = image.subspan(l.checksums_offset);
    SP_ASSIGN_OR_RETURN(auto want, ParseChecksumSection(tail, l, source));
    if (!std::equal(want.begin(), want.end(), crcs.begin(), crcs.end())) {
      return Corruption(source + ": a chunk does not match its checksum");
    }
    return std::vector<std::byte>(tail.begin(), tail.end());
  };
  // A sample for probing the encoder: up to 4 MiB of the largest tensor.
  const TensorEntry* best = nullptr;
  for (const auto& t : src.tensors) {
    if (!t.spec.elsewhere && (best == nullptr || t.nbytes > best->nbytes)) best = &t;
  }
  if (best != nullptr && best->offset + best->nbytes <= image.size()) {
    src.sample = image.subspan(best->offset, std::min<uint64_t>(best->nbytes, kMaxSample));
    src.sample_element_size = CodecElementSize(best->spec.dtype);
  }
  return src;
}

Result<WriteStats> WritePackedImage(Storage& storage, const PackSource& src,
                                    const PackOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string& uri = storage.uri();
  const ImageLayout& l = src.layout;
  const uint64_t chunks = l.chunk_count();

  // W1: the intent, removed on every way out.
  const std::string intent = std::string(kIntentPrefix) + StepPrefix(src.meta.step).substr(5, 20) +
                             ".r" + std::to_string(src.meta.rank) + "." + internal::RandomHex16();
  SP_RETURN_IF_ERROR(internal::WriteSmallObject(
      storage, intent, internal::HolderRecord(src.meta.step, src.meta.rank),
      /*exclusive=*/true));
  struct IntentGuard {
    Storage& s;
    const std::string& name;
    ~IntentGuard() { s.Delete(name).IgnoreError(); }
  } guard{storage, intent};
  SP_KILL_POINT("pack.write.after_intent");
  // W2: a GC that may be deleting chunks: wait a little for it to end, else the caller writes
  // the plain image. The lock of a GC that is provably dead is broken at once.
  for (auto pause = std::chrono::milliseconds(10), waited = std::chrono::milliseconds(0);;) {
    auto held = internal::ReadSmallObject(storage, kGcLockName, 4096);
    if (!held.ok() && held.status().code() == StatusCode::kNotFound) break;
    if (!held.ok() && held.status().code() != StatusCode::kCorruption) return held.status();
    if (held.ok()) {
      if (std::string why = internal::DeadHolder(storage, *held); !why.empty()) {
        SP_ASSIGN_OR_RETURN(bool gone,
                            internal::DeleteIfUnchanged(storage, kGcLockName, *held,
                                                        "a killed chunk GC's lock: " + why));
        if (gone) continue;  // look again: another GC may hold it by now
      }
    }
    if (waited >= kGcWait) {
      return Unavailable(uri + ": the chunk store's garbage collector is running");
    }
    std::this_thread::sleep_for(pause);
    waited += pause;
    pause = std::min(pause * 2, kGcWait / 8);
  }

  // With auto, a tier whose encoder speed this process never measured (a tier copy: no sample
  // in memory) is probed on the first large chunk of 2-, 4- or 8-byte values that this write
  // encodes; chunks encoded before that one are stored raw.
  std::atomic<codec::Mode> mode{CompressionPolicy::Get().Choose(uri, options.compression)};
  std::atomic<bool> probe{options.compression == Compression::kAuto &&
                          CompressionPolicy::Get().NeedsProbe(uri)};
  std::once_flag probed;

  PackedManifest m;
  m.meta = src.meta;
  m.layout = l;
  m.header.resize(kImageHeaderSize);
  m.index.resize(l.index_size);
  m.extras.resize(l.extras_size);
  for (const auto& [offset, size] : PlanContentChunks(l, src.tensors)) {
    PackedManifest::Chunk c;
    c.raw_size = static_cast<uint32_t>(size);
    m.chunks.push_back(c);
  }
  if (!IndexContentChunks(l, m.chunks, &m.first_chunk)) {
    return InvalidArgument(storage.Describe(src.manifest_name) + ": bad content chunk plan");
  }
  const std::vector<int> element_sizes = ElementSizes(m.chunks, src.tensors);
  std::vector<uint32_t> crcs(chunks);
  std::atomic<uint64_t> stored{0}, new_raw{0}, new_chunks{0}, encode_ns{0}, encoded_raw{0};
  FirstError error;
  const size_t threads = std::max<size_t>(1, storage.capabilities().io_parallelism > 0
                                                 ? storage.capabilities().io_parallelism
                                                 : internal::DefaultIoThreads());
  // Stores content chunk `i` (raw bytes `raw`) unless incremental and it is there.
  auto store_chunk = [&](size_t i, std::span<const std::byte> raw) -> Status {
    PackedManifest::Chunk& ref = m.chunks[i];
    const internal::Sha256Digest digest = internal::Sha256(raw);
    std::copy(digest.begin(), digest.end(), ref.sha256.begin());
    const std::string name = ChunkObjectName(ref.sha256);
    if (options.incremental) {
      auto there = storage.Open(name);
      if (there.ok()) {
        ref.stored_size = (*there)->size();
        ref.method = PackedManifest::kMethodStoredBefore;
        return Status::OK();
      }
      if (there.status().code() != StatusCode::kNotFound) return there.status();
    }
    std::vector<std::byte> frame;
    frame.reserve(raw.size() + 64);
    if (probe.load() && element_sizes[i] > 1 && raw.size() >= kMinProbe) {
      std::call_once(probed, [&] {
        CompressionPolicy::Get().Probe(uri, raw, element_sizes[i]);
        mode = CompressionPolicy::Get().Choose(uri, options.compression);
        probe = false;
      });
    }
    const auto e0 = std::chrono::steady_clock::now();
    auto method = codec::EncodeChunk(raw, element_sizes[i], mode.load(), &frame);
    encode_ns += static_cast<uint64_t>(SecondsSince(e0) * 1e9);
    if (!method.ok()) return method.status();
    encoded_raw += raw.size();
    ref.method = static_cast<uint8_t>(*method);
    ref.stored_size = frame.size();
    SP_ASSIGN_OR_RETURN(auto w, storage.Create(name, frame.size()));
    Status s = w->WriteAt(0, frame);
    if (s.ok()) s = w->PublishIfAbsent();
    if (s.code() == StatusCode::kAlreadyExists) return Status::OK();  // an equal chunk is there
    if (!s.ok()) return s.WithContext("writing " + storage.Describe(name));
    stored += frame.size();
    new_raw += raw.size();
    ++new_chunks;
    SP_KILL_POINT("pack.write.after_chunk");
    return Status::OK();
  };
  // W3: every checksum chunk in parallel, its content chunks one after another.
  internal::ParallelFor(chunks, threads, [&](size_t c) {
    if (error.failed()) return;
    const uint64_t at = c * l.chunk_size;
    const uint64_t len = std::min(l.chunk_size, l.checksums_offset - at);
    AlignedBuffer buf(len);
    if (!buf.ok()) return error.Set(ResourceExhausted("out of memory for a chunk buffer"));
    auto raw = src.chunk(c, buf.span());
    if (!raw.ok()) return error.Set(raw.status());
    if (raw->size() != len) return error.Set(InvalidArgument("chunk source gave the wrong size"));
    crcs[c] = Crc32c(*raw);
    internal::CopyOverlap(*raw, at, 0, m.header);
    internal::CopyOverlap(*raw, at, l.index_offset, m.index);
    internal::CopyOverlap(*raw, at, l.extras_offset, m.extras);
    internal::ForEachContentChunk(
        m.first_chunk[c], m.first_chunk[c + 1], internal::InnerThreads(chunks), [&](size_t i) {
          if (error.failed()) return;
          error.Set(store_chunk(i, raw->subspan(m.chunks[i].offset - at, m.chunks[i].raw_size)));
        });
  });
  SP_RETURN_IF_ERROR(error.status());
  SP_ASSIGN_OR_RETURN(m.checksums, src.checksums(crcs));
  m.chunk_crcs = crcs;
  // W4: the manifest.
  const std::string manifest = EncodePackedManifest(m);
  SP_KILL_POINT("pack.write.before_manifest");
  SP_RETURN_IF_ERROR(
      internal::WriteSmallObject(storage, src.manifest_name, manifest, src.exclusive));
  SP_KILL_POINT("pack.write.after_manifest");

  WriteStats stats;
  stats.bytes = l.image_size;
  stats.seconds = SecondsSince(t0);
  stats.packed = true;
  stats.stored_bytes = stored + manifest.size();
  stats.new_raw_bytes = new_raw;
  stats.chunks = m.chunks.size();
  stats.new_chunks = new_chunks;
  stats.compression = std::string(codec::ModeName(mode.load()));
  // What the tier took, with the encoders' time (spread over the threads) taken out.
  const double encode_s = static_cast<double>(encode_ns.load()) * 1e-9 /
                          static_cast<double>(std::min(threads, internal::DefaultCpuThreads()));
  CompressionPolicy::Get().Wrote(uri, stats.stored_bytes, stats.seconds - encode_s);
  if (options.compression == Compression::kAuto && !options.incremental &&
      mode.load() != codec::Mode::kNone) {
    CompressionPolicy::Get().Moved(uri, /*compressed=*/true, l.image_size, stats.seconds);
  }
  CompressionPolicy::Get().Encoded(uri, encoded_raw, stored,
                                   options.compression == Compression::kAuto
                                       ? "auto:" + std::string(codec::ModeName(mode.load()))
                                       : std::string(codec::ModeName(mode.load())));
  return stats;
}

}  // namespace safepoint
