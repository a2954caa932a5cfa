// The replica file (little-endian), one per copy or fragment:
//
//   [0, 4096)      header
//     0   8  magic "SPREPL\0\1"
//     8   4  version (1)
//     12  4  header bytes (4096)
//     16  4  rank            20  4  kind (1 copy, 2 fragment)
//     24  4  index           28  4  k
//     32  4  p               36  4  image CRC32C
//     40  4  payload CRC32C  44  4  source node length (1..64)
//     48  8  step            56  8  complete_ns
//     64  8  image bytes     72  8  piece bytes
//     80  8  payload bytes
//     88  64 source node (zero-padded)
//     152 8  attempt (the image's save attempt)
//     ... zero ...
//     4092 4 CRC32C of bytes [0, 4092)
//   [4096, 4096 + payload bytes)  payload
//
// Write: open ".tmp-<random>-<name>" (O_EXCL), check free space, fallocate the whole file (so a
// full tmpfs is an error now, not a SIGBUS when the mapping is written), map it, let the caller
// fill the payload, verify its CRC, write the header, rename to "<name>". Read: the header's CRC,
// its fields against the name and the caller's meta, the file size against payload bytes (a
// mapping past the end of a file would SIGBUS), then the payload's CRC.
#include "replica/replica_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "base/bytes.h"
#include "base/crc32c.h"
#include "base/kill_point.h"
#include "base/log.h"
#include "base/random.h"
#include "base/unique_fd.h"
#include "replica/erasure.h"

namespace safepoint::replica {

namespace {

using internal::Crc32c;
using internal::HumanBytes;
using internal::LoadLE;
using internal::StoreLE;
using internal::UniqueDir;
using internal::UniqueFd;

constexpr uint64_t kHeaderBytes = 4096;
constexpr char kMagic[8] = {'S', 'P', 'R', 'E', 'P', 'L', '\0', '\1'};
constexpr uint32_t kVersion = 1;
constexpr size_t kMaxSourceBytes = 64;
constexpr size_t kHeaderCrcOffset = kHeaderBytes - 4;
constexpr std::string_view kTempPrefix = ".tmp-";
// A spare: the file of a replica that was pruned, kept (never listed) so that the next replica
// it can hold reuses its pages instead of allocating fresh ones (and freeing the old ones).
constexpr std::string_view kSparePrefix = ".spare-";
// Smaller files are simply removed (their pages cost little), and at most this many are kept.
constexpr uint64_t kMinSpareBytes = 1 << 20;
constexpr size_t kMaxSpares = 16;
// Larger payloads cannot be a file size (off_t) after the header.
constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 62;

// [A-Za-z0-9._-]{1,64}, not starting with '.' (so that no replica is taken for a temporary
// file, and no name is "." or "..").
Status ValidateSourceNode(std::string_view name) {
  if (name.empty() || name.size() > kMaxSourceBytes || name[0] == '.' ||
      !internal::IsJobNameText(name)) {
    std::string shown(name.substr(0, 80));
    for (char& c : shown) {
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
    }
    return InvalidArgument("replica source node '" + shown +
                           "' is not 1 to 64 characters of [A-Za-z0-9._-] not starting with '.'");
  }
  return Status::OK();
}

std::string FileName(const ReplicaMeta& m) {
  return m.source_node + ".rank-" + std::to_string(m.rank) + ".step-" + std::to_string(m.step) +
         "." + std::to_string(m.complete_ns) + "." +
         (m.kind == ReplicaMeta::Kind::kCopy ? "copy-" : "frag-") + std::to_string(m.index);
}

// Names, kinds and sizes that fit together (what a peer's meta must satisfy before it costs
// memory).
Status ValidateMeta(const ReplicaMeta& m) {
  SP_RETURN_IF_ERROR(ValidateSourceNode(m.source_node));
  const std::string what = "replica of node " + m.source_node + " rank " + std::to_string(m.rank) +
                           " step " + std::to_string(m.step);
  if (m.payload_bytes > kMaxPayloadBytes) {
    return InvalidArgument(what + ": payload of " + std::to_string(m.payload_bytes) +
                           " bytes is too large");
  }
  switch (m.kind) {
    case ReplicaMeta::Kind::kCopy:
      if (m.index != 0) {
        return InvalidArgument(what + ": a copy has index 0, not " + std::to_string(m.index));
      }
      if (m.payload_bytes != m.image_bytes) {
        return InvalidArgument(what + ": a copy's payload of " + std::to_string(m.payload_bytes) +
                               " bytes is not the image's " + std::to_string(m.image_bytes));
      }
      return Status::OK();
    case ReplicaMeta::Kind::kFragment: {
      EcLayout layout;
      layout.k = m.k;
      layout.p = m.p;
      layout.image_bytes = m.image_bytes;
      layout.piece_bytes = m.piece_bytes;
      SP_RETURN_IF_ERROR(layout.Validate().WithContext(what));
      if (m.index >= m.k + m.p) {
        return InvalidArgument(what + ": fragment index " + std::to_string(m.index) +
                               " is not below k+p = " + std::to_string(m.k + m.p));
      }
      if (m.payload_bytes != layout.fragment_bytes()) {
        return InvalidArgument(what + ": a fragment's payload of " +
                               std::to_string(m.payload_bytes) + " bytes is not the " +
                               std::to_string(layout.fragment_bytes()) +
                               " bytes of ec:" + std::to_string(m.k) + "+" + std::to_string(m.p) +
                               " over " + std::to_string(m.image_bytes) + " image bytes");
      }
      return Status::OK();
    }
  }
  return InvalidArgument(what + ": unknown kind " + std::to_string(static_cast<uint32_t>(m.kind)));
}

void EncodeHeader(const ReplicaMeta& m, std::byte* h) {
  std::memset(h, 0, kHeaderBytes);
  std::memcpy(h, kMagic, sizeof(kMagic));
  StoreLE<uint32_t>(h + 8, kVersion);
  StoreLE<uint32_t>(h + 12, kHeaderBytes);
  StoreLE<uint32_t>(h + 16, m.rank);
  StoreLE<uint32_t>(h + 20, static_cast<uint32_t>(m.kind));
  StoreLE<uint32_t>(h + 24, m.index);
  StoreLE<uint32_t>(h + 28, m.k);
  StoreLE<uint32_t>(h + 32, m.p);
  StoreLE<uint32_t>(h + 36, m.image_crc);
  StoreLE<uint32_t>(h + 40, m.payload_crc);
  StoreLE<uint32_t>(h + 44, static_cast<uint32_t>(m.source_node.size()));
  StoreLE<uint64_t>(h + 48, m.step);
  StoreLE<uint64_t>(h + 56, m.complete_ns);
  StoreLE<uint64_t>(h + 64, m.image_bytes);
  StoreLE<uint64_t>(h + 72, m.piece_bytes);
  StoreLE<uint64_t>(h + 80, m.payload_bytes);
  std::memcpy(h + 88, m.source_node.data(), m.source_node.size());
  StoreLE<uint64_t>(h + 152, m.attempt);
  StoreLE<uint32_t>(h + kHeaderCrcOffset, Crc32c(0, h, kHeaderCrcOffset));
}

// The meta of a header, or the reason it is not one.
Result<ReplicaMeta> DecodeHeader(const std::byte* h) {
  if (std::memcmp(h, kMagic, sizeof(kMagic)) != 0) return Corruption("not a replica file (magic)");
  const uint32_t crc = LoadLE<uint32_t>(h + kHeaderCrcOffset);
  if (crc != Crc32c(0, h, kHeaderCrcOffset)) return Corruption("header CRC32C mismatch");
  if (LoadLE<uint32_t>(h + 8) != kVersion || LoadLE<uint32_t>(h + 12) != kHeaderBytes) {
    return Corruption("unknown replica file version " + std::to_string(LoadLE<uint32_t>(h + 8)));
  }
  ReplicaMeta m;
  m.rank = LoadLE<uint32_t>(h + 16);
  m.kind = static_cast<ReplicaMeta::Kind>(LoadLE<uint32_t>(h + 20));
  m.index = LoadLE<uint32_t>(h + 24);
  m.k = LoadLE<uint32_t>(h + 28);
  m.p = LoadLE<uint32_t>(h + 32);
  m.image_crc = LoadLE<uint32_t>(h + 36);
  m.payload_crc = LoadLE<uint32_t>(h + 40);
  const uint32_t source_len = LoadLE<uint32_t>(h + 44);
  m.step = LoadLE<uint64_t>(h + 48);
  m.complete_ns = LoadLE<uint64_t>(h + 56);
  m.image_bytes = LoadLE<uint64_t>(h + 64);
  m.piece_bytes = LoadLE<uint64_t>(h + 72);
  m.payload_bytes = LoadLE<uint64_t>(h + 80);
  if (source_len == 0 || source_len > kMaxSourceBytes) {
    return Corruption("source node length " + std::to_string(source_len));
  }
  m.source_node.assign(reinterpret_cast<const char*>(h + 88), source_len);
  m.attempt = LoadLE<uint64_t>(h + 152);
  Status s = ValidateMeta(m);
  if (!s.ok()) return Corruption(s.message());
  return m;
}

bool SameMeta(const ReplicaMeta& a, const ReplicaMeta& b) {
  return std::tie(a.source_node, a.rank, a.step, a.complete_ns, a.attempt, a.image_bytes,
                  a.image_crc, a.kind, a.index, a.k, a.p, a.piece_bytes, a.payload_bytes,
                  a.payload_crc) == std::tie(b.source_node, b.rank, b.step, b.complete_ns,
                                             b.attempt, b.image_bytes, b.image_crc, b.kind, b.index,
                                             b.k, b.p, b.piece_bytes, b.payload_bytes,
                                             b.payload_crc);
}

// Reads and checks the header of the open file `fd` at `path` named `name`: its CRC, that the
// name is the one its meta gives, and that the file holds exactly its payload.
Result<ReplicaMeta> ReadHeader(int fd, const std::string& path, const std::string& name) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus("stat", path, errno);
  if (!S_ISREG(st.st_mode)) return Corruption(path + ": not a regular file");
  std::vector<std::byte> h(kHeaderBytes);
  const ssize_t n = ::pread(fd, h.data(), h.size(), 0);
  if (n < 0) return ErrnoStatus("read", path, errno);
  if (static_cast<uint64_t>(n) < kHeaderBytes) {
    return Corruption(path + ": " + std::to_string(n) + " bytes, shorter than a replica header");
  }
  auto meta = DecodeHeader(h.data());
  if (!meta.ok()) return meta.status().WithContext(path);
  if (FileName(*meta) != name) {
    return Corruption(path + ": the header describes " + FileName(*meta));
  }
  if (static_cast<uint64_t>(st.st_size) != kHeaderBytes + meta->payload_bytes) {
    return Corruption(path + ": " + std::to_string(st.st_size) + " bytes, the header says " +
                      std::to_string(kHeaderBytes + meta->payload_bytes));
  }
  return meta;
}

class Mapping {
 public:
  Mapping(void* p, size_t n, std::shared_ptr<void> pin = nullptr)
      : p_(p), n_(n), pin_(std::move(pin)) {}
  ~Mapping() {
    if (p_ != nullptr) ::munmap(p_, n_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  std::byte* data() const { return static_cast<std::byte*>(p_); }

 private:
  void* p_;
  size_t n_;
  std::shared_ptr<void> pin_;  // Read: keeps the file from being recycled while mapped
};

class PosixReplicaWriter final : public ReplicaWriter {
 public:
  PosixReplicaWriter(ReplicaMeta meta, std::string tmp, std::string path, UniqueFd fd)
      : meta_(std::move(meta)), tmp_(std::move(tmp)), path_(std::move(path)), fd_(std::move(fd)) {}
  ~PosixReplicaWriter() override {
    if (!committed_) ::unlink(tmp_.c_str());
  }

  Status Write(uint64_t offset, std::span<const std::byte> bytes) override {
    if (committed_) return InvalidArgument(path_ + ": replica already committed");
    if (offset > meta_.payload_bytes || bytes.size() > meta_.payload_bytes - offset) {
      return InvalidArgument(tmp_ + ": " + std::to_string(bytes.size()) + " bytes at offset " +
                             std::to_string(offset) + " pass the payload's " +
                             std::to_string(meta_.payload_bytes));
    }
    return PwriteAll(bytes, kHeaderBytes + offset);
  }

  Status Commit() override { return Commit(meta_.image_crc, meta_.payload_crc, std::nullopt); }

  Status Commit(uint32_t image_crc, uint32_t payload_crc,
                std::optional<uint32_t> received_crc) override {
    if (committed_) return InvalidArgument(path_ + ": replica already committed");
    meta_.image_crc = image_crc;
    meta_.payload_crc = payload_crc;
    if (meta_.kind == ReplicaMeta::Kind::kCopy && image_crc != payload_crc) {
      return Corruption(path_ + ": a copy's image CRC32C " + std::to_string(image_crc) +
                        " is not its payload's " + std::to_string(payload_crc));
    }
    uint32_t crc = 0;
    if (received_crc) {
      crc = *received_crc;
    } else {
      SP_ASSIGN_OR_RETURN(crc, PayloadCrc());
    }
    if (crc != meta_.payload_crc) {
      return Corruption(path_ + ": received payload of " + std::to_string(meta_.payload_bytes) +
                        " bytes has CRC32C " + std::to_string(crc) + ", the sender's is " +
                        std::to_string(meta_.payload_crc));
    }
    std::vector<std::byte> header(kHeaderBytes);
    EncodeHeader(meta_, header.data());
    SP_RETURN_IF_ERROR(PwriteAll(header, 0));
    SP_KILL_POINT("replica.receive.before_visible");
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) return ErrnoStatus("rename", tmp_, errno);
    committed_ = true;
    fd_.Reset();  // a writer kept around must not keep the file's pages alive after a Prune
    return Status::OK();
  }

 private:
  Status PwriteAll(std::span<const std::byte> bytes, uint64_t at) {
    while (!bytes.empty()) {
      const ssize_t n = ::pwrite(fd_.get(), bytes.data(), bytes.size(), static_cast<off_t>(at));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return ErrnoStatus("write", tmp_, errno);
      if (n == 0) return IOError(tmp_ + ": write wrote nothing");
      bytes = bytes.subspan(static_cast<size_t>(n));
      at += static_cast<uint64_t>(n);
    }
    return Status::OK();
  }

  // The payload's CRC32C, read back from the file (a caller that did not count it as it wrote).
  Result<uint32_t> PayloadCrc() {
    std::vector<std::byte> block(std::min<uint64_t>(meta_.payload_bytes, 1 << 20));
    uint32_t crc = 0;
    for (uint64_t done = 0; done < meta_.payload_bytes;) {
      const size_t want =
          static_cast<size_t>(std::min<uint64_t>(block.size(), meta_.payload_bytes - done));
      const ssize_t n =
          ::pread(fd_.get(), block.data(), want, static_cast<off_t>(kHeaderBytes + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return ErrnoStatus("read", tmp_, errno);
      if (n == 0)
        return IOError(tmp_ + ": the payload is shorter than its " +
                       std::to_string(meta_.payload_bytes) + " bytes");
      crc = Crc32c(crc, block.data(), static_cast<size_t>(n));
      done += static_cast<uint64_t>(n);
    }
    return crc;
  }

  ReplicaMeta meta_;
  std::string tmp_, path_;
  UniqueFd fd_;
  bool committed_ = false;
};

class PosixReplicaStore final : public ReplicaStore {
 public:
  PosixReplicaStore(std::string dir, ReplicaStoreOptions options)
      : dir_(std::move(dir)), options_(std::move(options)) {}

  Status RemoveTemporaries() {
    SP_ASSIGN_OR_RETURN(std::vector<std::string> names, Names());
    for (const std::string& name : names) {
      const bool spare = name.starts_with(kSparePrefix);
      if (!name.starts_with(kTempPrefix) && !spare) continue;
      const std::string path = dir_ + "/" + name;
      if (::unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus("unlink", path, errno);
      if (!spare) spdlog::info("{}: removed an unfinished replica of an earlier agent", path);
    }
    return Status::OK();
  }

  Result<std::unique_ptr<ReplicaWriter>> Begin(const ReplicaMeta& meta) override {
    SP_RETURN_IF_ERROR(ValidateMeta(meta));
    const std::string name = FileName(meta);
    const std::string path = dir_ + "/" + name;
    const uint64_t size = kHeaderBytes + meta.payload_bytes;
    auto no_room = [&](uint64_t free_bytes) {
      return ResourceExhausted(dir_ + ": replica " + name + " needs " + std::to_string(size) +
                               " bytes (" + HumanBytes(size) + ") of shared memory, " +
                               std::to_string(free_bytes) + " bytes (" + HumanBytes(free_bytes) +
                               ") are free");
    };
    auto free_bytes = [&]() -> uint64_t {
      struct statvfs vfs;
      if (::statvfs(dir_.c_str(), &vfs) != 0) return 0;
      return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    };
    const std::string tmp =
        dir_ + "/" + std::string(kTempPrefix) + internal::RandomHex16() + "-" + name;
    const std::optional<uint64_t> room = Budget();
    UniqueFd fd;
    uint64_t reused = 0;
    // Over the budget next to what the store holds (spares aside, they give way): the previous
    // replica of this source rank is given up and received into.
    const uint64_t held = room ? bytes() : 0, spares = room ? spare_bytes() : 0;
    if (room && (held > spares ? held - spares : 0) + size > *room) {
      if (std::optional<uint64_t> allocated = GiveUpPrevious(meta, name, tmp)) {
        fd = UniqueFd(::open(tmp.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
        if (!fd) {
          ::unlink(tmp.c_str());
        } else {
          reused = std::min(*allocated, size);
          in_place_.fetch_add(1);
          spdlog::info("{}: receiving {} in place of the previous replica (budget {})", dir_, name,
                       HumanBytes(*room));
        }
      }
    }
    // A spare's pages are reused: only what it lacks is allocated afresh.
    std::optional<Spare> spare;
    if (!fd) spare = TakeSpare(size);
    if (spare) {
      if (::rename(spare->path.c_str(), tmp.c_str()) == 0) {
        fd = UniqueFd(::open(tmp.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
        if (!fd) ::unlink(tmp.c_str());
        reused = std::min(spare->allocated, size);
      } else {
        ::unlink(spare->path.c_str());
      }
    }
    auto fail = [&](Status s) {
      ::unlink(tmp.c_str());
      return s;
    };
    if (fd) {
      struct stat st;
      if (::fstat(fd.get(), &st) != 0) return fail(ErrnoStatus("stat", tmp, errno));
      // A larger spare gives its pages past `size` back.
      if (static_cast<uint64_t>(st.st_size) > size &&
          ::ftruncate(fd.get(), static_cast<off_t>(size)) != 0)
        return fail(ErrnoStatus("ftruncate", tmp, errno));
    }
    // Room for what is not reused; spares give theirs back first (and past the budget).
    const uint64_t needed = size - reused;
    if (room) TrimSpares(*room, needed);
    if (free_bytes() < needed) ReleaseSpares();
    if (const uint64_t f = free_bytes(); f < needed) return fail(no_room(f));
    if (!fd) {
      fd = UniqueFd(::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
      if (!fd) return ErrnoStatus("create", tmp, errno);
    }
    // Reserves every page not yet allocated (a reused spare's are kept as they are).
    if (::fallocate(fd.get(), 0, 0, static_cast<off_t>(size)) != 0) {
      const int err = errno;
      if (err == ENOSPC || err == EDQUOT || err == EFBIG) return fail(no_room(free_bytes()));
      if (err != EOPNOTSUPP) return fail(ErrnoStatus("fallocate", tmp, err));
      // A file system without fallocate (not tmpfs): reserve nothing, size the file.
      if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
        return fail(ErrnoStatus("ftruncate", tmp, errno));
      }
    }
    return std::unique_ptr<ReplicaWriter>(new PosixReplicaWriter(meta, tmp, path, std::move(fd)));
  }

  Result<std::vector<ReplicaMeta>> List(std::optional<uint32_t> rank) override {
    SP_ASSIGN_OR_RETURN(std::vector<Entry> entries, Entries());
    std::vector<ReplicaMeta> out;
    for (Entry& e : entries) {
      if (!rank || e.meta.rank == *rank) out.push_back(std::move(e.meta));
    }
    std::sort(out.begin(), out.end(), [](const ReplicaMeta& a, const ReplicaMeta& b) {
      return std::tie(a.rank, a.step, a.complete_ns, a.kind, a.index, a.source_node) <
             std::tie(b.rank, b.step, b.complete_ns, b.kind, b.index, b.source_node);
    });
    return out;
  }

  Result<ReplicaView> Read(const ReplicaMeta& meta) override {
    SP_RETURN_IF_ERROR(ValidateSourceNode(meta.source_node));
    const std::string name = FileName(meta);
    const std::string path = dir_ + "/" + name;
    // Pinned while mapped: a replica pruned meanwhile is removed, not recycled under the reader.
    std::shared_ptr<void> pin;
    UniqueFd fd;
    {
      std::lock_guard lock(mu_);
      fd = UniqueFd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
      if (!fd) return ErrnoStatus("open", path, errno);
      struct stat st;
      if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("stat", path, errno);
      std::erase_if(readers_, [](const auto& r) { return r.second.expired(); });
      // A second reader of the same file shares the first one's pin: the file stays pinned
      // until the last of them is done.
      auto& held = readers_[st.st_ino];
      pin = held.lock();
      if (!pin) {
        pin = std::make_shared<ino_t>(st.st_ino);
        held = pin;
      }
    }
    SP_ASSIGN_OR_RETURN(ReplicaMeta found, ReadHeader(fd.get(), path, name));
    if (!SameMeta(found, meta)) {
      return Corruption(path +
                        ": the replica's header does not match the meta asked for "
                        "(payload " +
                        std::to_string(found.payload_bytes) + " bytes CRC " +
                        std::to_string(found.payload_crc) + ", asked " +
                        std::to_string(meta.payload_bytes) + " bytes CRC " +
                        std::to_string(meta.payload_crc) + ")");
    }
    const uint64_t size = kHeaderBytes + found.payload_bytes;
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
    if (p == MAP_FAILED) return ErrnoStatus("mmap", path, errno);
    auto map = std::make_shared<Mapping>(p, size, std::move(pin));
    ReplicaView view;
    view.payload = {map->data() + kHeaderBytes, static_cast<size_t>(found.payload_bytes)};
    const uint32_t crc = Crc32c(view.payload);
    if (crc != found.payload_crc) {
      return Corruption(path + ": payload CRC32C " + std::to_string(crc) + ", the header says " +
                        std::to_string(found.payload_crc));
    }
    view.meta = std::move(found);
    view.mapping = std::move(map);
    return view;
  }

  Result<uint64_t> Prune(uint32_t keep) override {
    const std::optional<uint64_t> room = Budget();
    std::lock_guard lock(mu_);
    SP_ASSIGN_OR_RETURN(std::vector<Entry> entries, Entries());
    // The snapshots (step, complete_ns) of each (source, rank), newest first.
    using Snapshot = std::pair<uint64_t, uint64_t>;
    std::map<std::pair<std::string, uint32_t>, std::vector<Snapshot>> snapshots;
    for (const Entry& e : entries) {
      snapshots[{e.meta.source_node, e.meta.rank}].emplace_back(e.meta.step, e.meta.complete_ns);
    }
    for (auto& [key, list] : snapshots) {
      std::sort(list.begin(), list.end(), std::greater<>());
      list.erase(std::unique(list.begin(), list.end()), list.end());
      if (list.size() > keep) list.resize(keep);
    }
    uint64_t freed = 0;
    for (const Entry& e : entries) {
      const auto& kept = snapshots[{e.meta.source_node, e.meta.rank}];
      if (std::find(kept.begin(), kept.end(), Snapshot(e.meta.step, e.meta.complete_ns)) !=
          kept.end()) {
        continue;
      }
      SP_RETURN_IF_ERROR(Remove(e, &freed, room ? true : options_.spares_without_budget, room));
    }
    return freed;
  }

  Status RemoveSource(const std::string& source_node) override {
    SP_RETURN_IF_ERROR(ValidateSourceNode(source_node));
    std::lock_guard lock(mu_);
    SP_ASSIGN_OR_RETURN(std::vector<Entry> entries, Entries());
    uint64_t freed = 0;
    for (const Entry& e : entries) {
      if (e.meta.source_node == source_node) SP_RETURN_IF_ERROR(Remove(e, &freed, false));
    }
    return Status::OK();
  }

  uint64_t ReleaseSpares() override {
    std::vector<Spare> spares;
    {
      std::lock_guard lock(spare_mu_);
      spares.swap(spares_);
    }
    uint64_t freed = 0;
    for (const Spare& s : spares) {
      if (::unlink(s.path.c_str()) == 0) freed += s.allocated;
    }
    return freed;
  }

  uint64_t spare_bytes() override {
    std::lock_guard lock(spare_mu_);
    uint64_t total = 0;
    for (const Spare& s : spares_) total += s.allocated;
    return total;
  }

  uint64_t received_in_place() override { return in_place_.load(); }

  uint64_t bytes() override {
    auto names = Names();
    if (!names.ok()) return 0;
    uint64_t total = 0;
    for (const std::string& name : *names) {
      struct stat st;
      const std::string path = dir_ + "/" + name;
      if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
        total += static_cast<uint64_t>(st.st_blocks) * 512;
      }
    }
    return total;
  }

 private:
  struct Entry {
    ReplicaMeta meta;
    std::string path;
    uint64_t size = 0;
  };

  // Every name in the directory but "." and "..".
  Result<std::vector<std::string>> Names() {
    UniqueDir d(::opendir(dir_.c_str()));
    if (!d) return ErrnoStatus("opendir", dir_, errno);
    std::vector<std::string> out;
    errno = 0;
    while (const dirent* e = ::readdir(d.get())) {
      const std::string_view name = e->d_name;
      if (name != "." && name != "..") out.emplace_back(name);
      errno = 0;
    }
    if (errno != 0) return ErrnoStatus("readdir", dir_, errno);
    return out;
  }

  // Every committed replica with a valid header; the others are logged.
  Result<std::vector<Entry>> Entries() {
    SP_ASSIGN_OR_RETURN(std::vector<std::string> names, Names());
    std::vector<Entry> out;
    for (const std::string& name : names) {
      if (name.starts_with(kTempPrefix) || name.starts_with(kSparePrefix)) continue;
      const std::string path = dir_ + "/" + name;
      UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
      if (!fd) {
        if (errno == ENOENT) continue;  // removed meanwhile
        spdlog::warn("{}: skipped: {}", path, ErrnoStatus("open", path, errno).ToString());
        continue;
      }
      auto meta = ReadHeader(fd.get(), path, name);
      if (!meta.ok()) {
        spdlog::warn("skipped a replica file that is not valid: {}", meta.status().ToString());
        continue;
      }
      out.push_back({std::move(*meta), path, 0});
      out.back().size = kHeaderBytes + out.back().meta.payload_bytes;
    }
    return out;
  }

  // The budget now, if there is one.
  std::optional<uint64_t> Budget() const {
    if (!options_.budget) return std::nullopt;
    return options_.budget();
  }

  // Removes spares (largest first) while the store's files and `needed` more bytes pass `room`.
  void TrimSpares(uint64_t room, uint64_t needed) {
    for (;;) {
      const uint64_t total = bytes();
      if (total + needed <= room) return;
      Spare s;
      {
        std::lock_guard lock(spare_mu_);
        if (spares_.empty()) return;
        auto it = std::max_element(
            spares_.begin(), spares_.end(),
            [](const Spare& a, const Spare& b) { return a.allocated < b.allocated; });
        s = std::move(*it);
        spares_.erase(it);
      }
      ::unlink(s.path.c_str());
    }
  }

  // Gives up the previous replica of `meta`'s source node and rank (the oldest snapshot, not
  // newer than meta's, that no reader has mapped): renames its file to `tmp`, where it is never
  // listed. Returns the bytes of pages it holds; nullopt when there is none to give up. A
  // replica of an earlier save attempt (the job restarted from an older step) is older than
  // any of a later attempt, whatever its step. The incoming snapshot's own file, held whole
  // already (a push sent again), is never given up for itself.
  std::optional<uint64_t> GiveUpPrevious(const ReplicaMeta& meta, const std::string& name,
                                         const std::string& tmp) {
    std::lock_guard lock(mu_);
    auto entries = Entries();
    if (!entries.ok()) return std::nullopt;
    auto order = [](const ReplicaMeta& m) { return std::tie(m.attempt, m.step, m.complete_ns); };
    std::vector<const Entry*> candidates;
    for (const Entry& e : *entries) {
      if (e.meta.source_node != meta.source_node || e.meta.rank != meta.rank) continue;
      if (order(e.meta) > order(meta)) continue;
      if (e.path == dir_ + "/" + name) continue;
      candidates.push_back(&e);
    }
    std::sort(candidates.begin(), candidates.end(), [&](const Entry* a, const Entry* b) {
      return std::tuple_cat(order(a->meta), std::tie(a->meta.index)) <
             std::tuple_cat(order(b->meta), std::tie(b->meta.index));
    });
    for (const Entry* e : candidates) {
      struct stat st;
      if (::lstat(e->path.c_str(), &st) != 0) continue;
      auto reader = readers_.find(st.st_ino);
      if (reader != readers_.end() && !reader->second.expired()) continue;
      if (::rename(e->path.c_str(), tmp.c_str()) != 0) continue;
      return static_cast<uint64_t>(st.st_blocks) * 512;
    }
    return std::nullopt;
  }

  // Removes a replica (mu_ held): its file becomes a spare if `recycle`, it is worth keeping,
  // nobody has it mapped and the store's files then fit `room` (when given), else it is unlinked.
  Status Remove(const Entry& e, uint64_t* freed, bool recycle = true,
                std::optional<uint64_t> room = std::nullopt) {
    struct stat st;
    if (recycle && room && bytes() > *room) recycle = false;
    if (recycle && e.size >= kMinSpareBytes && ::lstat(e.path.c_str(), &st) == 0) {
      auto reader = readers_.find(st.st_ino);
      const bool mapped = reader != readers_.end() && !reader->second.expired();
      std::lock_guard lock(spare_mu_);
      if (!mapped && spares_.size() < kMaxSpares) {
        const std::string spare = dir_ + "/" + std::string(kSparePrefix) + internal::RandomHex16();
        if (::rename(e.path.c_str(), spare.c_str()) == 0) {
          spares_.push_back({spare, static_cast<uint64_t>(st.st_blocks) * 512});
          *freed += e.size;
          return Status::OK();
        }
      }
    }
    if (::unlink(e.path.c_str()) != 0) {
      if (errno == ENOENT) return Status::OK();
      return ErrnoStatus("unlink", e.path, errno);
    }
    *freed += e.size;
    return Status::OK();
  }

  struct Spare {
    std::string path;
    uint64_t allocated = 0;  // bytes of pages it holds
  };

  // The spare that best holds `size` bytes (the smallest that holds them all, else the largest),
  // taken out of the pool.
  std::optional<Spare> TakeSpare(uint64_t size) {
    std::lock_guard lock(spare_mu_);
    if (spares_.empty()) return std::nullopt;
    auto better = [size](const Spare& a, const Spare& b) {
      const bool a_fits = a.allocated >= size, b_fits = b.allocated >= size;
      if (a_fits != b_fits) return a_fits;
      return a_fits ? a.allocated < b.allocated : a.allocated > b.allocated;
    };
    auto it = std::min_element(spares_.begin(), spares_.end(), better);
    Spare s = std::move(*it);
    spares_.erase(it);
    return s;
  }

  const std::string dir_;
  const ReplicaStoreOptions options_;
  std::atomic<uint64_t> in_place_{0};
  std::mutex mu_;  // Prune, RemoveSource and the readers_ of Read, one at a time
  std::map<ino_t, std::weak_ptr<void>> readers_;  // guarded by mu_: files Read has mapped
  std::mutex spare_mu_;                           // after mu_ when both are held
  std::vector<Spare> spares_;                     // guarded by spare_mu_
};

}  // namespace

Result<std::unique_ptr<ReplicaStore>> ReplicaStore::Open(const std::string& job_dir,
                                                         ReplicaStoreOptions options) {
  const std::string dir = job_dir + "/replicas";
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return ErrnoStatus("mkdir", dir, errno);
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) return ErrnoStatus("stat", dir, errno);
  if (!S_ISDIR(st.st_mode)) return InvalidArgument(dir + ": not a directory");
  auto store = std::make_unique<PosixReplicaStore>(dir, std::move(options));
  SP_RETURN_IF_ERROR(store->RemoveTemporaries());
  return std::unique_ptr<ReplicaStore>(std::move(store));
}

}  // namespace safepoint::replica
