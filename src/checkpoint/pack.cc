// Packed images (pack.h, docs/format.md "Packed steps") and the chunk store's garbage collector.
//
// Writing a packed image of step s, rank r (CheckpointStore::WritePacked):
//   W1. Publish an intent record "chunks/inflight/<step>.r<rank>.<random>": a save is in flight.
//   W2. If "chunks/gc-lock" exists, a GC may be deleting chunks: break it if its holder is
//       provably dead (below), else wait for it to go (a GC is short; up to kGcWait), then go
//       on (that GC has ended, and any later one finds the intent). If it is still there,
//       delete the intent and write the plain image instead (the caller does); nothing of the
//       chunk store is relied on.
//   W3. For every image chunk, in parallel: take its raw bytes, CRC-32C and SHA-256 them; unless
//       incremental and "chunks/<hh>/<sha256>" exists, encode it (codec::EncodeChunk) and
//       publish it with PublishIfAbsent (an equal chunk another writer published is as good).
//   W4. Publish the manifest "step-S/rank-R.pack" (or rank-R.g<gen>.pack).
//   W5. Delete the intent. The step commits later (TryCommit) like a plain one.
// Garbage collection (CollectGarbage): mark and sweep, every manifest is a root.
//   G1. Publish "chunks/gc-lock" with PublishIfAbsent (a lock older than kGcLockStale, or one
//       whose holder is provably dead, is broken first: its GC crashed or overran; a GC stops
//       deleting after kGcBudget).
//   G2. List the intents: those of crashed saves (older than kIntentStale, or of a provably
//       dead holder) are removed; any other means a save is in flight: release the lock and
//       defer (nothing removed).
//   G3. List the chunk objects; G4. read every manifest (committed or not, any job) and mark the
//       chunks they reference; G4b. check that the lock still holds this GC's record (else
//       defer); G5. delete the unmarked chunks; G6. delete the lock if it is still this one's.
// Why no save can lose a chunk: a writer whose intent (W1) precedes G2 makes the GC defer; one
// whose intent follows G2 also follows G1, so its W2 finds the lock and it writes no manifest
// that references existing chunks. A manifest published before G4 is read at G4. The storage
// must be linearizable for single objects and List (POSIX, RADOS, S3 since 2020 are).
// Kills: a killed writer leaves an intent (GC defers until it is stale or its holder is seen
// dead), published chunks and perhaps a manifest (an uncommitted step's: CleanUp removes it,
// then GC its chunks): garbage only. A killed GC leaves its lock (writers write plain images
// until it is broken) and chunks that it had not yet deleted. Committed steps only ever
// reference chunks of manifests, which G4 marks.
// Dead holders. Intent and lock records name their process exactly (boot id, pid namespace,
// pid, start time: docs/format.md). A holder is provably dead when it ran on this boot in this
// process's pid namespace and its pid is gone or names a process that started at another time
// (or an exited zombie). Its lock or intent is removed at once, but only on storage where no
// request of a dead process still lands later (requests_end_with_process: POSIX, memory; on an
// object store a killed client's request may still be carried out, so only the age rules apply
// there). That keeps the argument above: a dead GC deletes nothing more, and a dead writer
// publishes nothing more (a manifest it published is read at G4). A holder on another host,
// boot or namespace, or a record without the identity (version 1), is judged by age only.
// Breaking a lock (stale or dead) races with other breakers: B1 and B2 both judge the record R
// dead, B1 deletes it, a GC C publishes its lock L, and B2's delete must not remove L. Storage
// has no conditional delete, so a breaker reads the lock again just before its Delete and
// deletes only if it still holds R (records are unique: time in ns, pid, start time); left is
// the window between that read and the Delete. Should B2 remove L in it, C finds its lock gone
// at G4b and defers before deleting anything (and G6 removes no lock but its own); the
// remaining hazard needs B2 to stall between two adjacent calls for all of C's G1-G4 and a
// writer to start in exactly that time.
#include "checkpoint/pack.h"

#include <dirent.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "base/aligned_buffer.h"
#include "base/bytes.h"
#include "base/crc32c.h"
#include "base/digest.h"
#include "base/kill_point.h"
#include "base/parallel.h"
#include "base/process.h"
#include "base/random.h"
#include "codec/codec.h"

namespace safepoint {

using internal::AlignedBuffer;
using internal::AppendLE;
using internal::Crc32c;
using internal::FirstError;
using internal::LoadLE;

static_assert(static_cast<int>(Compression::kAuto) == static_cast<int>(codec::Mode::kAuto));
static_assert(static_cast<int>(Compression::kNone) == static_cast<int>(codec::Mode::kNone));
static_assert(static_cast<int>(Compression::kZstd) == static_cast<int>(codec::Mode::kZstd));
static_assert(static_cast<int>(Compression::kPlanes) == static_cast<int>(codec::Mode::kPlanes));

namespace {

constexpr char kManifestMagic[8] = {'S', 'P', 'P', 'A', 'C', 'K', '\0', '\1'};
constexpr int64_t kIntentStaleNs = 3600LL * 1000000000;  // a save's intent outlives no save
constexpr int64_t kGcLockStaleNs = 600LL * 1000000000;   // a GC's lock, twice its budget
constexpr int64_t kGcBudgetNs = 300LL * 1000000000;      // a GC stops deleting after this
// How long a packed save waits for a running GC before it writes the plain image instead.
constexpr std::chrono::milliseconds kGcWait(2000);
constexpr size_t kMinProbe = 256 << 10;  // bytes: a chunk large enough to time the encoder on

int64_t WallNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

Status WriteSmall(Storage& storage, std::string_view name, const std::string& data,
                  bool exclusive) {
  SP_ASSIGN_OR_RETURN(auto w, storage.Create(name, data.size()));
  SP_RETURN_IF_ERROR(w->WriteAt(0, {reinterpret_cast<const std::byte*>(data.data()), data.size()}));
  return exclusive ? w->PublishIfAbsent() : w->Publish();
}

Result<std::vector<std::byte>> ReadWhole(Storage& storage, std::string_view name, uint64_t max) {
  SP_ASSIGN_OR_RETURN(auto r, storage.Open(name));
  if (r->size() > max) {
    return Corruption(storage.Describe(name) + ": unexpectedly large (" +
                      std::to_string(r->size()) + " bytes)");
  }
  std::vector<std::byte> data(r->size());
  SP_RETURN_IF_ERROR(r->ReadAt(0, data));
  return data;
}

// The leading decimal digits of a holder record: its time (0 where there are none).
int64_t HolderTimePrefix(std::span<const std::byte> data) {
  int64_t t = 0;
  for (std::byte b : data) {
    const char c = static_cast<char>(b);
    if (c < '0' || c > '9') break;
    if (t > (INT64_MAX - 9) / 10) return 0;
    t = t * 10 + (c - '0');
  }
  return t;
}

std::string HolderRecord(uint64_t step, uint32_t rank) {
  return internal::EncodeChunkStoreHolder(
      internal::ChunkStoreHolderOf(getpid(), step, rank, WallNs()));
}

// Deletes `name` (the GC lock or an intent, whose record `data` the caller read and judged
// dead or stale) if it still holds exactly `data`: true when it is gone (deleted here or by
// another). Every record is unique (its time in ns, pid and host), so a record read again
// equal to `data` is the same lock, not a new one; the remaining window, between that read and
// the Delete, is argued at the top of this file ("Breaking a lock").
Result<bool> DeleteIfUnchanged(Storage& storage, std::string_view name,
                               std::span<const std::byte> data, const std::string& why) {
  auto again = ReadWhole(storage, name, 4096);
  if (!again.ok()) {
    if (again.status().code() == StatusCode::kNotFound) return true;
    return again.status();
  }
  if (!std::equal(again->begin(), again->end(), data.begin(), data.end())) return false;
  SP_RETURN_IF_ERROR(storage.Delete(name));
  spdlog::warn("{}: removed ({})", storage.Describe(name), why);
  return true;
}

// "pid 4711 on host (started at tick 123, boot 0f3e...)" for messages.
std::string DescribeHolder(const internal::ChunkStoreHolder& h) {
  std::string out = "pid " + std::to_string(h.pid) + " on " + h.host;
  if (h.version >= 2) {
    out += " (started at tick " + std::to_string(h.start_ticks) + ", boot " + h.boot_id +
           ", pid namespace " + std::to_string(h.pid_ns) + ")";
  }
  return out;
}

// Why the record `data` may be removed now ("" when it may not): its holder is provably dead,
// where the storage carries out no request of a dead process.
std::string DeadHolder(Storage& storage, std::span<const std::byte> data) {
  if (!storage.capabilities().requests_end_with_process) return "";
  auto h = internal::DecodeChunkStoreHolder(data);
  if (!h || internal::LivenessOf(*h) != internal::HolderLiveness::kDead) return "";
  return "its holder, " + DescribeHolder(*h) + ", is dead";
}

// --- What compression pays on each tier (PackOptions::compression == kAuto) ------------------

struct TierLearning {
  double write_bps = 0;          // bytes/s the tier took
  double encode_bps_thread = 0;  // raw bytes/s one encoder thread made frames of
  double probe_ratio = 1;        // stored / raw of the probe
  uint64_t raw = 0, stored = 0;  // chunks this process encoded for the tier
  // Raw (image) bytes/s of auto's plain writes and of its compressed, non-incremental ones.
  double plain_bps = 0, compressed_bps = 0;
  std::string mode;
};

class Advisor {
 public:
  static Advisor& Get() {
    static Advisor* a = new Advisor();
    return *a;
  }
  // The codec mode for a write to `uri` that asked for `requested`.
  codec::Mode Choose(const std::string& uri, Compression requested) {
    if (requested != Compression::kAuto) return static_cast<codec::Mode>(requested);
    std::lock_guard<std::mutex> lock(mu_);
    const TierLearning& t = tiers_[uri];
    const double threads = static_cast<double>(internal::DefaultCpuThreads());
    // What was measured beats what was predicted: compressed writes that moved the image
    // slower than plain ones did (the encoder shares the cores with SHA-256 and the other
    // processes, and the packed layout writes an object per chunk) mean plain.
    const bool measured_slower =
        t.plain_bps > 0 && t.compressed_bps > 0 && t.compressed_bps < t.plain_bps;
    if (!measured_slower && t.write_bps > 0 && t.encode_bps_thread > 0 && t.probe_ratio < 0.95 &&
        t.encode_bps_thread * threads >= t.write_bps) {
      return codec::Mode::kAuto;
    }
    return codec::Mode::kNone;
  }
  bool NeedsProbe(const std::string& uri) {
    std::lock_guard<std::mutex> lock(mu_);
    return tiers_[uri].encode_bps_thread == 0;
  }
  // Encodes `sample` once to learn the encoder's speed and ratio on this kind of data.
  void Probe(const std::string& uri, std::span<const std::byte> sample, int element_size) {
    if (sample.empty()) return;
    std::vector<std::byte> frame;
    const auto t0 = std::chrono::steady_clock::now();
    auto m = codec::EncodeChunk(sample, element_size, codec::Mode::kAuto, &frame);
    const double s = std::max(1e-9, SecondsSince(t0));
    if (!m.ok()) return;
    std::lock_guard<std::mutex> lock(mu_);
    TierLearning& t = tiers_[uri];
    t.encode_bps_thread = static_cast<double>(sample.size()) / s;
    t.probe_ratio = static_cast<double>(frame.size()) / static_cast<double>(sample.size());
  }
  void SetForTest(const std::string& uri, double write_bps, double encode_bps_thread,
                  double probe_ratio) {
    std::lock_guard<std::mutex> lock(mu_);
    TierLearning& t = tiers_[uri];
    t.write_bps = write_bps;
    t.encode_bps_thread = encode_bps_thread;
    t.probe_ratio = probe_ratio;
  }
  void SetRatesForTest(const std::string& uri, double plain_bps, double compressed_bps) {
    std::lock_guard<std::mutex> lock(mu_);
    TierLearning& t = tiers_[uri];
    t.plain_bps = plain_bps;
    t.compressed_bps = compressed_bps;
  }
  // Raw bytes/s of one of auto's plain (`compressed` false) or compressed image writes.
  void Moved(const std::string& uri, bool compressed, uint64_t bytes, double seconds) {
    if (bytes < (1 << 20) || seconds <= 0) return;  // too small to say anything
    std::lock_guard<std::mutex> lock(mu_);
    double& bps = compressed ? tiers_[uri].compressed_bps : tiers_[uri].plain_bps;
    const double now = static_cast<double>(bytes) / seconds;
    bps = bps == 0 ? now : 0.5 * bps + 0.5 * now;
  }
  void Wrote(const std::string& uri, uint64_t bytes, double seconds) {
    if (bytes < (1 << 20) || seconds <= 0) return;  // too small to say anything
    std::lock_guard<std::mutex> lock(mu_);
    TierLearning& t = tiers_[uri];
    const double bps = static_cast<double>(bytes) / seconds;
    t.write_bps = t.write_bps == 0 ? bps : 0.5 * t.write_bps + 0.5 * bps;
  }
  void Encoded(const std::string& uri, uint64_t raw, uint64_t stored, std::string mode) {
    std::lock_guard<std::mutex> lock(mu_);
    TierLearning& t = tiers_[uri];
    t.raw += raw;
    t.stored += stored;
    t.mode = std::move(mode);
  }
  void Plain(const std::string& uri, std::string mode) {
    std::lock_guard<std::mutex> lock(mu_);
    tiers_[uri].mode = std::move(mode);
  }
  PackReport Report(const std::string& uri) {
    std::lock_guard<std::mutex> lock(mu_);
    PackReport r;
    auto it = tiers_.find(uri);
    if (it == tiers_.end()) return r;
    const TierLearning& t = it->second;
    r.mode = t.mode;
    r.raw_bytes = t.raw;
    r.stored_bytes = t.stored;
    r.ratio = t.stored > 0 ? static_cast<double>(t.raw) / static_cast<double>(t.stored) : 1.0;
    r.write_bps = t.write_bps;
    r.encode_bps = t.encode_bps_thread * static_cast<double>(internal::DefaultCpuThreads());
    return r;
  }

 private:
  std::mutex mu_;
  std::map<std::string, TierLearning> tiers_;
};

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
    if (mid < t->offset + t->nbytes) {
      const size_t size = DTypeSize(t->spec.dtype);
      out[c] = size == 2 || size == 4 || size == 8 ? static_cast<int>(size) : 1;
    }
  }
  return out;
}

// Per checksum chunk, the index of its first content chunk, plus a sentinel (chunks.size()).
// False when the content chunks do not partition [0, checksums_offset) within checksum chunks.
bool IndexContentChunks(const ImageLayout& l, std::vector<PackedManifest::Chunk>& chunks,
                        std::vector<size_t>* first) {
  first->assign(l.chunk_count() + 1, chunks.size());
  uint64_t at = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    chunks[i].offset = at;
    const uint64_t size = chunks[i].raw_size;
    if (size == 0 || at >= l.checksums_offset || size > l.checksums_offset - at) return false;
    const uint64_t c = at / l.chunk_size;
    if ((at + size - 1) / l.chunk_size != c) return false;  // crosses a checksum chunk
    if (at % l.chunk_size == 0) (*first)[c] = i;
    at += size;
  }
  return at == l.checksums_offset;
}

// Runs fn(i) for i in [begin, end) on up to `threads` threads of its own (the caller one of
// them). For the content chunks of one checksum chunk, whose objects are written or read one
// request each: ParallelFor runs nested calls inline, and a checksum chunk may hold many.
void ForEachContentChunk(size_t begin, size_t end, size_t threads,
                         const std::function<void(size_t)>& fn) {
  const size_t n = end - begin;
  threads = std::max<size_t>(1, std::min(threads, n));
  if (threads == 1) {
    for (size_t i = begin; i < end; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{begin};
  auto run = [&] {
    for (size_t i = next++; i < end; i = next++) fn(i);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(run);
  run();
  for (auto& t : pool) t.join();
}

// Threads per checksum chunk for its content chunks: the I/O threads spread over the checksum
// chunks that are worked on at once.
size_t InnerThreads(uint64_t checksum_chunks) {
  const size_t io = internal::DefaultIoThreads();
  return std::max<size_t>(1, io / std::max<size_t>(1, std::min<uint64_t>(checksum_chunks, io)));
}

// Copies the part of `data` (image bytes from `at`) that lies in [begin, begin + dst.size())
// into dst.
void CopyOverlap(std::span<const std::byte> data, uint64_t at, uint64_t begin,
                 std::span<std::byte> dst) {
  const uint64_t lo = std::max(at, begin), hi = std::min(at + data.size(), begin + dst.size());
  if (lo < hi) std::memcpy(dst.data() + (lo - begin), data.data() + (lo - at), hi - lo);
}

// --- The image a manifest describes ------------------------------------------------------------

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
    ForEachContentChunk(m_.first_chunk[c], m_.first_chunk[c + 1],
                        InnerThreads(m_.layout.chunk_count()), [&](size_t i) {
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

// --- Names, options ----------------------------------------------------------------------------

std::string ChunkObjectName(std::span<const uint8_t, 32> sha256) {
  const std::string hex = internal::ToHex(sha256.data(), sha256.size());
  return std::string(kChunkPrefix) + hex.substr(0, 2) + "/" + hex;
}

Result<Compression> ParseCompression(std::string_view text) {
  SP_ASSIGN_OR_RETURN(codec::Mode m, codec::ParseMode(text));
  return static_cast<Compression>(m);
}

std::string_view CompressionName(Compression c) {
  return codec::ModeName(static_cast<codec::Mode>(c));
}

PackOptions MakePackOptions(std::string_view compression, bool incremental) {
  auto c = ParseCompression(compression);
  return {c.ok() ? *c : Compression::kNone, incremental};
}

PackReport PackReportFor(const std::string& uri) { return Advisor::Get().Report(uri); }

namespace internal {

namespace {
// The first line of a small file, or "" when it cannot be read.
std::string FirstLine(const char* path) {
  std::FILE* f = std::fopen(path, "re");
  if (f == nullptr) return "";
  char buf[256] = {};
  const bool ok = std::fgets(buf, sizeof(buf), f) != nullptr;
  std::fclose(f);
  if (!ok) return "";
  std::string line(buf);
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

// A boot id as the kernel writes it: 36 characters of lower-case hex and '-'.
bool ValidBootId(std::string_view id) {
  return id.size() == 36 && std::all_of(id.begin(), id.end(), [](char c) {
           return c == '-' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// The inode of `pid`'s pid namespace ("pid:[4026531836]"), or 0.
uint64_t PidNamespaceOf(int64_t pid) {
  const std::string path =
      pid == getpid() ? "/proc/self/ns/pid" : "/proc/" + std::to_string(pid) + "/ns/pid";
  char buf[64] = {};
  const ssize_t n = readlink(path.c_str(), buf, sizeof(buf) - 1);
  if (n <= 0) return 0;
  unsigned long long inode = 0;
  if (std::sscanf(buf, "pid:[%llu]", &inode) != 1) return 0;
  return inode;
}

// Whether this process's /proc is of its own pid namespace, so that /proc/<pid> names the pids
// getpid() gives (a /proc mounted from another namespace names others).
bool ProcIsOurs() {
  char buf[32] = {};
  const ssize_t n = readlink("/proc/self", buf, sizeof(buf) - 1);
  return n > 0 && std::string_view(buf, n) == std::to_string(getpid());
}

// Parses unsigned decimal `text` (no sign, no spaces) into `out`.
bool ParseU64(std::string_view text, uint64_t* out) {
  if (text.empty() || text.size() > 19) return false;
  uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  *out = v;
  return true;
}
}  // namespace

ChunkStoreHolder ChunkStoreHolderOf(int64_t pid, uint64_t step, uint32_t rank, int64_t time_ns) {
  ChunkStoreHolder h;
  h.time_ns = time_ns;
  h.step = step;
  h.rank = rank;
  h.pid = pid;
  h.host = HostName();
  const std::string boot = FirstLine("/proc/sys/kernel/random/boot_id");
  const uint64_t ns = PidNamespaceOf(pid);
  const uint64_t start = pid > 0 && pid <= INT32_MAX && ProcIsOurs()
                             ? ProcessStartTicks(static_cast<uint32_t>(pid)).value_or(0)
                             : 0;
  if (ValidBootId(boot) && ns != 0 && start != 0) {
    h.version = 2;
    h.boot_id = boot;
    h.pid_ns = ns;
    h.start_ticks = start;
  }
  return h;
}

std::string EncodeChunkStoreHolder(const ChunkStoreHolder& h) {
  std::string host = h.host.empty() ? "?" : h.host;
  std::replace_if(
      host.begin(), host.end(), [](char c) { return c <= ' ' || c > '~'; }, '?');
  std::string out = std::to_string(h.time_ns) + " " + std::to_string(h.step) + " " +
                    std::to_string(h.rank) + " " + std::to_string(h.pid) + " " + host;
  if (h.version >= 2) {
    out += " 2 " + h.boot_id + " " + std::to_string(h.pid_ns) + " " + std::to_string(h.start_ticks);
    char crc[16];
    std::snprintf(crc, sizeof(crc), " %08x", Crc32c(0, out.data(), out.size()));
    out += crc;
  }
  return out + "\n";
}

std::optional<ChunkStoreHolder> DecodeChunkStoreHolder(std::span<const std::byte> data) {
  std::string_view text(reinterpret_cast<const char*>(data.data()), data.size());
  if (text.ends_with('\n')) text.remove_suffix(1);
  std::vector<std::string_view> f;
  for (size_t at = 0; at <= text.size() && f.size() < 16;) {
    const size_t end = std::min(text.find(' ', at), text.size());
    f.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  // The time as readers before version 2 take it: the leading digits (none: no record).
  const int64_t t = HolderTimePrefix(data);
  if (t == 0) return std::nullopt;
  ChunkStoreHolder h;
  h.time_ns = t;
  uint64_t step = 0, rank = 0, pid = 0;
  if (f.size() >= 5 && ParseU64(f[1], &step) && ParseU64(f[2], &rank) && ParseU64(f[3], &pid) &&
      rank <= UINT32_MAX && pid <= INT32_MAX) {
    h.step = step;
    h.rank = static_cast<uint32_t>(rank);
    h.pid = static_cast<int64_t>(pid);
    h.host = std::string(f[4]);
  }
  // Version 2: ten fields, the last the CRC-32C (8 hex digits) of the bytes before its space.
  uint64_t ns = 0, start = 0;
  if (f.size() == 10 && f[5] == "2" && ValidBootId(f[6]) && ParseU64(f[7], &ns) &&
      ParseU64(f[8], &start) && f[9].size() == 8 && h.pid != 0 && ns != 0 && start != 0) {
    const size_t body = text.size() - 9;
    char want[9];
    std::snprintf(want, sizeof(want), "%08x", Crc32c(0, text.data(), body));
    if (f[9] == want) {
      h.version = 2;
      h.boot_id = std::string(f[6]);
      h.pid_ns = ns;
      h.start_ticks = start;
    }
  }
  return h;
}

HolderLiveness LivenessOf(const ChunkStoreHolder& h) {
  if (h.version < 2 || h.pid <= 0 || h.pid > INT32_MAX) return HolderLiveness::kUnknown;
  if (!ProcIsOurs() || FirstLine("/proc/sys/kernel/random/boot_id") != h.boot_id ||
      PidNamespaceOf(getpid()) != h.pid_ns) {
    return HolderLiveness::kUnknown;  // another host, boot or namespace: its pids are not ours
  }
  const std::string dir = "/proc/" + std::to_string(h.pid);
  const std::string line = FirstLine((dir + "/stat").c_str());
  if (line.empty()) {
    // No such process (ENOENT), or /proc would not say: only a missing directory proves it.
    struct stat st;
    return ::stat(dir.c_str(), &st) != 0 && errno == ENOENT ? HolderLiveness::kDead
                                                            : HolderLiveness::kUnknown;
  }
  const auto start = ProcessStartTicks(static_cast<uint32_t>(h.pid));
  if (!start) return HolderLiveness::kUnknown;
  if (*start != h.start_ticks) return HolderLiveness::kDead;  // the pid was reused
  // The holder itself: alive unless a zombie whose every thread has exited (a zombie leader
  // whose other threads run still lists them in task/).
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'Z') {
    return HolderLiveness::kAlive;
  }
  DIR* tasks = opendir((dir + "/task").c_str());
  if (tasks == nullptr) return HolderLiveness::kUnknown;
  size_t threads = 0;
  while (const dirent* e = readdir(tasks)) {
    if (e->d_name[0] != '.') ++threads;
  }
  closedir(tasks);
  return threads <= 1 ? HolderLiveness::kDead : HolderLiveness::kAlive;
}

void SetTierLearningForTest(const std::string& uri, double write_bps, double encode_bps_thread,
                            double probe_ratio) {
  Advisor::Get().SetForTest(uri, write_bps, encode_bps_thread, probe_ratio);
}
void SetTierRatesForTest(const std::string& uri, double plain_bps, double compressed_bps) {
  Advisor::Get().SetRatesForTest(uri, plain_bps, compressed_bps);
}
}  // namespace internal

std::vector<std::pair<uint64_t, uint64_t>> PlanContentChunks(
    const ImageLayout& l, const std::vector<TensorEntry>& tensors) {
  // Where a content chunk may end: checksum-chunk boundaries and the start of the data and the
  // extras sections (always: the header, index and extras change with every step), tensors.
  std::vector<uint64_t> cuts = {l.data_offset, l.extras_offset};
  for (const auto& t : tensors) {
    if (!t.spec.elsewhere && t.nbytes > 0) cuts.push_back(t.offset);
  }
  for (uint64_t b = l.chunk_size; b < l.checksums_offset; b += l.chunk_size) cuts.push_back(b);
  cuts.push_back(l.checksums_offset);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  while (!cuts.empty() && cuts.back() > l.checksums_offset) cuts.pop_back();
  auto hard = [&](uint64_t cut) {
    return cut % l.chunk_size == 0 || cut == l.checksums_offset || cut == l.data_offset ||
           cut == l.extras_offset;
  };
  std::vector<std::pair<uint64_t, uint64_t>> out;
  uint64_t start = 0;
  for (size_t i = 0; i < cuts.size(); ++i) {
    const uint64_t cut = cuts[i];
    if (cut <= start) continue;
    // Small tensors next to each other share a content chunk (never with a large one).
    if (!hard(cut) && i + 1 < cuts.size() && cut - start < PackedManifest::kMinPiece &&
        cuts[i + 1] - cut < PackedManifest::kMinPiece) {
      continue;
    }
    out.emplace_back(start, cut - start);
    start = cut;
  }
  return out;
}

// --- Manifest ------------------------------------------------------------------------------------

std::string EncodePackedManifest(const PackedManifest& m) {
  std::string out(kManifestMagic, 8);
  AppendLE<uint32_t>(out, PackedManifest::kVersion);
  AppendLE<uint32_t>(out, PackedManifest::kEntrySize);
  AppendLE<uint64_t>(out, m.layout.image_size);
  AppendLE<uint64_t>(out, m.layout.chunk_size);
  AppendLE<uint64_t>(out, m.chunks.size());
  AppendLE<uint32_t>(out, m.layout.header_crc);
  out.append(20, '\0');  // reserved
  auto append = [&](const std::vector<std::byte>& b) {
    out.append(reinterpret_cast<const char*>(b.data()), b.size());
  };
  append(m.header);
  append(m.index);
  append(m.extras);
  append(m.checksums);
  for (const auto& c : m.chunks) {
    out.append(reinterpret_cast<const char*>(c.sha256.data()), 32);
    AppendLE<uint64_t>(out, c.stored_size);
    AppendLE<uint32_t>(out, c.raw_size);
    out.push_back(static_cast<char>(c.method));
    out.append(3, '\0');
  }
  AppendLE<uint32_t>(out, Crc32c(0, out.data(), out.size()));
  return out;
}

Result<PackedManifest> DecodePackedManifest(std::span<const std::byte> d, std::string_view source) {
  auto bad = [&](const std::string& what) {
    return Corruption(std::string(source) + ": corrupt manifest: " + what);
  };
  constexpr size_t kFixed = PackedManifest::kFixedSize;
  if (d.size() < kFixed + kImageHeaderSize + 4) return bad("truncated");
  if (std::memcmp(d.data(), kManifestMagic, 8) != 0) return bad("bad magic");
  if (Crc32c(0, d.data(), d.size() - 4) != LoadLE<uint32_t>(&d[d.size() - 4])) {
    return bad("checksum mismatch");
  }
  if (LoadLE<uint32_t>(&d[8]) != PackedManifest::kVersion) {
    return bad("unsupported version " + std::to_string(LoadLE<uint32_t>(&d[8])));
  }
  if (LoadLE<uint32_t>(&d[12]) != PackedManifest::kEntrySize) return bad("bad entry size");
  for (size_t i = 44; i < kFixed; ++i) {
    if (d[i] != std::byte{0}) return bad("reserved bytes are not zero");
  }
  PackedManifest m;
  m.header.assign(d.begin() + kFixed, d.begin() + kFixed + kImageHeaderSize);
  SP_ASSIGN_OR_RETURN(auto parsed, ParseImageHeader(m.header, source));
  m.meta = std::move(parsed.first);
  m.layout = parsed.second;
  const ImageLayout& l = m.layout;
  const uint64_t chunks = LoadLE<uint64_t>(&d[32]);
  if (LoadLE<uint64_t>(&d[16]) != l.image_size || LoadLE<uint64_t>(&d[24]) != l.chunk_size ||
      LoadLE<uint32_t>(&d[40]) != l.header_crc || chunks < l.chunk_count() ||
      chunks > l.checksums_offset / 64 + l.chunk_count()) {
    return bad("fields disagree with the image header");
  }
  const uint64_t tail = l.image_size - l.checksums_offset;
  // Sizes come from a validated header (canonical layout), so these sums do not overflow.
  const uint64_t want = kFixed + kImageHeaderSize + l.index_size + l.extras_size + tail +
                        PackedManifest::kEntrySize * chunks + 4;
  if (d.size() != want) {
    return bad("size " + std::to_string(d.size()) + ", expected " + std::to_string(want));
  }
  size_t at = kFixed + kImageHeaderSize;
  auto take = [&](uint64_t n) {
    std::vector<std::byte> v(d.begin() + at, d.begin() + at + n);
    at += n;
    return v;
  };
  m.index = take(l.index_size);
  m.extras = take(l.extras_size);
  m.checksums = take(tail);
  if (Crc32c(m.index) != l.index_crc) return bad("index checksum mismatch");
  if (Crc32c(m.extras) != l.extras_crc) return bad("extras checksum mismatch");
  SP_ASSIGN_OR_RETURN(m.chunk_crcs, ParseChecksumSection(m.checksums, l, source));
  m.chunks.resize(chunks);
  for (uint64_t i = 0; i < chunks; ++i, at += PackedManifest::kEntrySize) {
    PackedManifest::Chunk& c = m.chunks[i];
    std::memcpy(c.sha256.data(), &d[at], 32);
    c.stored_size = LoadLE<uint64_t>(&d[at + 32]);
    c.raw_size = LoadLE<uint32_t>(&d[at + 40]);
    c.method = static_cast<uint8_t>(d[at + 44]);
    if (d[at + 45] != std::byte{0} || d[at + 46] != std::byte{0} || d[at + 47] != std::byte{0}) {
      return bad("reserved bytes of chunk " + std::to_string(i) + " are not zero");
    }
    if (c.method > static_cast<uint8_t>(codec::Method::kPlanes) &&
        c.method != PackedManifest::kMethodStoredBefore) {
      return bad("chunk " + std::to_string(i) + " has unknown method " + std::to_string(c.method));
    }
  }
  if (!IndexContentChunks(l, m.chunks, &m.first_chunk)) {
    return bad("its chunks do not partition the image within its checksum chunks");
  }
  return m;
}

Result<PackedManifest> ReadPackedManifest(Storage& storage, const std::string& name) {
  SP_ASSIGN_OR_RETURN(auto data, ReadWhole(storage, name, uint64_t{1} << 34));
  return DecodePackedManifest(data, storage.Describe(name));
}

Result<std::unique_ptr<ReadableObject>> OpenPackedImage(std::shared_ptr<Storage> storage,
                                                        const std::string& manifest_name) {
  SP_ASSIGN_OR_RETURN(PackedManifest m, ReadPackedManifest(*storage, manifest_name));
  return std::unique_ptr<ReadableObject>(
      new PackedImageObject(std::move(storage), manifest_name, std::move(m)));
}

Result<std::unique_ptr<ReadableObject>> CheckpointStore::OpenImageObject(const std::string& name) {
  if (name.ends_with(".pack")) return OpenPackedImage(storage_, name);
  return storage_->Open(name);
}

// --- Writing -----------------------------------------------------------------------------------

Result<WriteStats> CheckpointStore::WritePacked(const PackSource& src, const PackOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  Storage& storage = *storage_;
  const std::string& uri = storage.uri();
  const ImageLayout& l = src.layout;
  const uint64_t chunks = l.chunk_count();

  // W1: the intent, removed on every way out.
  const std::string intent = std::string(kIntentPrefix) + StepPrefix(src.meta.step).substr(5, 20) +
                             ".r" + std::to_string(src.meta.rank) + "." + internal::RandomHex16();
  SP_RETURN_IF_ERROR(WriteSmall(storage, intent, HolderRecord(src.meta.step, src.meta.rank),
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
    auto held = ReadWhole(storage, kGcLockName, 4096);
    if (!held.ok() && held.status().code() == StatusCode::kNotFound) break;
    if (!held.ok() && held.status().code() != StatusCode::kCorruption) return held.status();
    if (held.ok()) {
      if (std::string why = DeadHolder(storage, *held); !why.empty()) {
        SP_ASSIGN_OR_RETURN(bool gone, DeleteIfUnchanged(storage, kGcLockName, *held,
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
  std::atomic<codec::Mode> mode{Advisor::Get().Choose(uri, options.compression)};
  std::atomic<bool> probe{options.compression == Compression::kAuto &&
                          Advisor::Get().NeedsProbe(uri)};
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
        Advisor::Get().Probe(uri, raw, element_sizes[i]);
        mode = Advisor::Get().Choose(uri, options.compression);
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
    CopyOverlap(*raw, at, 0, m.header);
    CopyOverlap(*raw, at, l.index_offset, m.index);
    CopyOverlap(*raw, at, l.extras_offset, m.extras);
    ForEachContentChunk(
        m.first_chunk[c], m.first_chunk[c + 1], InnerThreads(chunks), [&](size_t i) {
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
  SP_RETURN_IF_ERROR(WriteSmall(storage, src.manifest_name, manifest, /*exclusive=*/false));
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
  Advisor::Get().Wrote(uri, stats.stored_bytes, stats.seconds - encode_s);
  if (options.compression == Compression::kAuto && !options.incremental &&
      mode.load() != codec::Mode::kNone) {
    Advisor::Get().Moved(uri, /*compressed=*/true, l.image_size, stats.seconds);
  }
  Advisor::Get().Encoded(uri, encoded_raw, stored,
                         options.compression == Compression::kAuto
                             ? "auto:" + std::string(codec::ModeName(mode.load()))
                             : std::string(codec::ModeName(mode.load())));
  return stats;
}

namespace {
// Whether `options` asks for a packed write here and now (auto without incremental packs only
// where compressing pays on this tier), probing the encoder with `sample` when it must.
bool WantPacked(const std::string& uri, const PackOptions& options,
                std::span<const std::byte> sample, int element_size) {
  if (!options.packed()) return false;
  if (options.compression != Compression::kAuto) return true;
  // Incremental too: WritePacked's choice needs the encoder's speed.
  Advisor& a = Advisor::Get();
  if (a.NeedsProbe(uri)) a.Probe(uri, sample, element_size);
  return options.incremental || a.Choose(uri, Compression::kAuto) != codec::Mode::kNone;
}

// A sample of tensor bytes for probing the encoder: up to 4 MiB of the largest tensor.
std::pair<std::span<const std::byte>, int> SampleOf(const std::vector<TensorEntry>& tensors,
                                                    std::span<const std::byte> image) {
  const TensorEntry* best = nullptr;
  for (const auto& t : tensors) {
    if (!t.spec.elsewhere && (best == nullptr || t.nbytes > best->nbytes)) best = &t;
  }
  if (best == nullptr || best->offset + best->nbytes > image.size()) return {{}, 1};
  const size_t size = DTypeSize(best->spec.dtype);
  return {image.subspan(best->offset, std::min<uint64_t>(best->nbytes, 4 << 20)),
          size == 2 || size == 4 || size == 8 ? static_cast<int>(size) : 1};
}

std::vector<TensorEntry> EntriesOf(const ImageBuilder& image) {
  std::vector<TensorEntry> out;
  for (size_t i = 0; i < image.tensors().size(); ++i) {
    const TensorSource& t = image.tensors()[i];
    out.push_back({t.spec, image.tensor_offset(i), t.nbytes});
  }
  return out;
}
}  // namespace

namespace {

// Writes a plain image with `write`; with auto, its time teaches the advisor the tier's write
// speed and that plain was chosen.
template <typename F>
Result<WriteStats> WritePlain(const std::string& uri, const PackOptions& options, F&& write) {
  const auto t0 = std::chrono::steady_clock::now();
  Result<WriteStats> stats = write();
  if (stats.ok() && options.compression == Compression::kAuto) {
    const double seconds = SecondsSince(t0);
    Advisor::Get().Wrote(uri, stats->bytes, seconds);
    Advisor::Get().Moved(uri, /*compressed=*/false, stats->bytes, seconds);
    Advisor::Get().Plain(uri, "auto:none");
  }
  return stats;
}

}  // namespace

Result<WriteStats> CheckpointStore::WriteImage(const ImageBuilder& image, uint64_t generation,
                                               const PackOptions& options) {
  const std::string& uri = storage_->uri();
  std::vector<TensorEntry> entries = EntriesOf(image);
  bool packed = options.packed();
  if (packed && options.compression == Compression::kAuto) {
    // A sample straight from the largest tensor's memory (not staged: the builder has it).
    const TensorSource* best = nullptr;
    for (const auto& t : image.tensors()) {
      if (!t.spec.elsewhere && !t.staged && t.data != nullptr &&
          (best == nullptr || t.nbytes > best->nbytes)) {
        best = &t;
      }
    }
    std::span<const std::byte> sample;
    int element = 1;
    if (best != nullptr) {
      sample = {static_cast<const std::byte*>(best->data),
                static_cast<size_t>(std::min<uint64_t>(best->nbytes, 4 << 20))};
      const size_t size = DTypeSize(best->spec.dtype);
      element = size == 2 || size == 4 || size == 8 ? static_cast<int>(size) : 1;
    }
    packed = WantPacked(uri, options, sample, element);
  }
  if (packed) {
    PackSource src;
    src.manifest_name = PackedObjectName(image.meta().step, image.meta().rank, generation);
    src.meta = image.meta();
    src.layout = image.layout();
    src.tensors = std::move(entries);
    const ImageLayout& l = image.layout();
    src.chunk = [&](uint64_t c, std::span<std::byte> dst) -> Result<std::span<const std::byte>> {
      const uint64_t at = c * l.chunk_size;
      auto out = dst.first(std::min(l.chunk_size, l.checksums_offset - at));
      image.Fill(at, out);
      return std::span<const std::byte>(out);
    };
    src.checksums = [&](std::span<const uint32_t> crcs) -> Result<std::vector<std::byte>> {
      return image.ChecksumSection(crcs);
    };
    auto stats = WritePacked(src, options);
    if (stats.ok() || stats.status().code() != StatusCode::kUnavailable) return stats;
    // The chunk store's GC is running: this image is written plain.
  }
  return WritePlain(uri, options, [&] { return WriteImage(image, generation); });
}

Result<WriteStats> CheckpointStore::WriteImageBytes(std::span<const std::byte> image, uint64_t step,
                                                    uint32_t rank, const PackOptions& options) {
  const std::string& uri = storage_->uri();
  if (options.packed()) {
    const std::string source = "the image of step " + std::to_string(step) + ", rank " +
                               std::to_string(rank) + " in memory";
    if (image.size() < kImageHeaderSize) return InvalidArgument(source + ": too small");
    SP_ASSIGN_OR_RETURN(auto parsed, ParseImageHeader(image.first(kImageHeaderSize), source));
    const ImageLayout l = parsed.second;
    if (l.image_size != image.size() || parsed.first.step != step || parsed.first.rank != rank) {
      return InvalidArgument(source + ": its header names another step, rank or size");
    }
    SP_ASSIGN_OR_RETURN(auto tensors,
                        ParseIndex(image.subspan(l.index_offset, l.index_size), l, source));
    auto [sample, element] = SampleOf(tensors, image);
    if (WantPacked(uri, options, sample, element)) {
      PackSource src;
      src.manifest_name = PackedObjectName(step, rank);
      src.meta = parsed.first;
      src.layout = l;
      src.tensors = std::move(tensors);
      src.chunk = [&](uint64_t c, std::span<std::byte>) -> Result<std::span<const std::byte>> {
        const uint64_t at = c * l.chunk_size;
        return image.subspan(at, std::min(l.chunk_size, l.checksums_offset - at));
      };
      src.checksums = [&](std::span<const uint32_t> crcs) -> Result<std::vector<std::byte>> {
        // The image's own section, which must hold the CRCs of the bytes just read.
        auto tail = image.subspan(l.checksums_offset);
        SP_ASSIGN_OR_RETURN(auto want, ParseChecksumSection(tail, l, source));
        if (!std::equal(want.begin(), want.end(), crcs.begin(), crcs.end())) {
          return Corruption(source + ": a chunk does not match its checksum");
        }
        return std::vector<std::byte>(tail.begin(), tail.end());
      };
      auto stats = WritePacked(src, options);
      if (stats.ok() || stats.status().code() != StatusCode::kUnavailable) return stats;
    }
  }
  return WritePlain(uri, options, [&] { return WriteImageBytes(image, step, rank); });
}

// --- Garbage collection --------------------------------------------------------------------------

Result<GcStats> CheckpointStore::CollectGarbage() {
  Storage& storage = *storage_;
  const int64_t start = WallNs();
  GcStats stats;
  // A directory without a chunk store (plain steps only) has nothing to collect.
  SP_ASSIGN_OR_RETURN(auto any, storage.List(kChunkPrefix));
  if (any.empty()) return stats;
  // G1: the lock; a stale one (its GC crashed or overran) or a dead holder's is broken.
  const std::string mine = HolderRecord(0, 0);
  Status locked = WriteSmall(storage, kGcLockName, mine, /*exclusive=*/true);
  for (int attempt = 0; locked.code() == StatusCode::kAlreadyExists && attempt < 4; ++attempt) {
    auto held = ReadWhole(storage, kGcLockName, 4096);
    if (!held.ok() && held.status().code() != StatusCode::kNotFound) break;
    if (held.ok()) {
      std::string why = DeadHolder(storage, *held);
      if (why.empty() && start - HolderTimePrefix(*held) > kGcLockStaleNs) {
        why = "older than 10 minutes: its garbage collection crashed or overran";
      }
      if (why.empty()) break;
      SP_ASSIGN_OR_RETURN(
          bool gone, DeleteIfUnchanged(storage, kGcLockName, *held, "a chunk GC's lock: " + why));
      if (!gone) continue;  // another took it meanwhile: judge that one
    }
    locked = WriteSmall(storage, kGcLockName, mine, /*exclusive=*/true);
  }
  if (locked.code() == StatusCode::kAlreadyExists) {
    stats.deferred = true;
    stats.reason = "another garbage collection holds " + storage.Describe(kGcLockName);
    return stats;
  }
  SP_RETURN_IF_ERROR(locked);
  // Removes the lock at the end (G6) if it is still this one's.
  auto still_mine = [&] {
    auto held = ReadWhole(storage, kGcLockName, 4096);
    return held.ok() &&
           std::string_view(reinterpret_cast<const char*>(held->data()), held->size()) == mine;
  };
  struct LockGuard {
    Storage& s;
    const std::function<bool()> mine;
    ~LockGuard() {
      if (mine()) s.Delete(kGcLockName).IgnoreError();
    }
  } guard{storage, still_mine};
  SP_KILL_POINT("pack.gc.after_lock");

  // G2: saves in flight; those of crashed saves (dead or stale) are removed.
  SP_ASSIGN_OR_RETURN(auto intents, storage.List(kIntentPrefix));
  size_t live = 0;
  for (const auto& o : intents) {
    auto data = ReadWhole(storage, o.name, 4096);
    if (!data.ok()) {
      if (data.status().code() == StatusCode::kNotFound) continue;  // that save finished
      return data.status();
    }
    const int64_t t = HolderTimePrefix(*data);
    std::string why = DeadHolder(storage, *data);
    if (why.empty() && t != 0 && start - t > kIntentStaleNs) why = "older than an hour";
    if (why.empty()) {
      ++live;
      continue;
    }
    // An intent's name is never reused (a random part), so deleting it removes no other.
    SP_RETURN_IF_ERROR(storage.Delete(o.name));
    spdlog::warn("{}: removed (a killed save's intent: {})", storage.Describe(o.name), why);
    ++stats.stale_intents;
  }
  if (live > 0) {
    stats.deferred = true;
    stats.reason = std::to_string(live) + " save(s) in flight";
    return stats;
  }
  // G3: the chunks there are.
  SP_ASSIGN_OR_RETURN(auto objects, storage.List(kChunkPrefix));
  std::vector<ObjectInfo> chunks;
  for (auto& o : objects) {
    // chunks/<hh>/<64 hex>
    const std::string_view rest = std::string_view(o.name).substr(kChunkPrefix.size());
    uint8_t digest[32];
    if (rest.size() == 67 && rest[2] == '/' && rest.substr(0, 2) == rest.substr(3, 2) &&
        internal::FromHex(rest.substr(3), digest, 32)) {
      chunks.push_back(std::move(o));
    }
  }
  stats.chunks = chunks.size();
  // G4: every manifest is a root.
  SP_ASSIGN_OR_RETURN(auto steps, storage.List("step-"));
  std::unordered_set<std::string> referenced;
  for (const auto& o : steps) {
    if (!o.name.ends_with(".pack") || !StepFromObjectName(o.name)) continue;
    auto m = ReadPackedManifest(storage, o.name);
    if (!m.ok()) {
      if (m.status().code() == StatusCode::kNotFound) continue;  // deleted meanwhile
      // A manifest that does not read back may still name chunks a reader needs: keep all.
      stats.deferred = true;
      stats.reason = m.status().message();
      return stats;
    }
    ++stats.manifests;
    for (const auto& c : m->chunks) referenced.insert(ChunkObjectName(c.sha256));
  }
  // The lock must still be this one's before anything goes (see "Breaking a lock" above).
  if (!still_mine()) {
    stats.deferred = true;
    stats.reason = storage.Describe(kGcLockName) + " was removed by another process meanwhile";
    return stats;
  }
  // G5: the rest goes.
  for (const auto& o : chunks) {
    if (referenced.contains(o.name)) {
      ++stats.referenced;
      continue;
    }
    if (WallNs() - start > kGcBudgetNs) break;  // the lock must not go stale while deleting
    SP_KILL_POINT("pack.gc.before_delete");
    SP_RETURN_IF_ERROR(storage.Delete(o.name));
    ++stats.removed;
    stats.removed_bytes += o.size;
  }
  // Temporaries of chunk writes that crashed: no chunk writer is live now (none has an intent,
  // and new ones find the lock and write no chunks).
  SP_ASSIGN_OR_RETURN(size_t leftovers,
                      storage.RemoveLeftovers(kChunkPrefix, [](std::string_view name) {
                        return !name.starts_with(kIntentPrefix) && name != kGcLockName;
                      }));
  stats.removed += leftovers;
  SP_KILL_POINT("pack.gc.before_unlock");
  return stats;
}

}  // namespace safepoint
