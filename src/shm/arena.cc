// Arenas of snapshot slots in shared memory (src/shm/arena.h).
#include "shm/arena.h"

#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>

#include "base/bytes.h"
#include "base/clock.h"
#include "base/parallel.h"
#include "base/process.h"
#include "base/random.h"
#include "base/unique_fd.h"
#include "shm/rank_claim.h"

namespace safepoint {

namespace {

using internal::HumanBytes;
using internal::ProcessAlive;
using internal::ProcessId;

constexpr char kSlotMagic[8] = {'S', 'P', 'S', 'L', 'O', 'T', '1', '\0'};
constexpr uint32_t kSlotVersion = 1;
constexpr uint64_t kSlotHeaderSize = kSlotHeaderBytes;
constexpr uint64_t kCapacityQuantum = 2 << 20;
constexpr uint64_t kLeasedBit = 0x10;
constexpr uint64_t kStateMask = 0x0F;

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "slot control words must be lock-free to be shared between processes");

// The control block at the start of every slot file. Only atomics are shared between processes.
struct SlotHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_size;
  uint64_t capacity;
  uint32_t rank;
  uint32_t slot;
  std::atomic<uint64_t> word;  // generation << 8 | leased bit | state
  std::atomic<uint64_t> step;
  std::atomic<uint64_t> image_size;
  std::atomic<int64_t> complete_time_ns;
  // The process that last took the slot for writing: pid and start time (clock ticks since boot,
  // 0 when unknown), so that a recycled pid is not taken for it. Written by SetWriter, read by
  // ReadWriter: writer_pid is 0 while the pair changes.
  std::atomic<uint32_t> writer_pid;
  std::atomic<uint64_t> writer_start_ticks;
  // Slot 0's only: the rank's newest write of a snapshot to storage by the agent (RecordPersist):
  // its step + 1 (0: none recorded, as in slot files of older versions) and how long it took.
  std::atomic<uint64_t> persist_nanos;
  std::atomic<uint64_t> persisted_step_plus1;
};
static_assert(offsetof(SlotHeader, writer_pid) == 64);
static_assert(offsetof(SlotHeader, writer_start_ticks) == 72);
static_assert(offsetof(SlotHeader, persist_nanos) == 80);
static_assert(offsetof(SlotHeader, persisted_step_plus1) == 88);
static_assert(sizeof(SlotHeader) <= kSlotHeaderSize);

uint64_t Word(uint64_t gen, SlotState s, bool leased = false) {
  return (gen << 8) | (leased ? kLeasedBit : 0) | static_cast<uint64_t>(s);
}
uint64_t GenOf(uint64_t w) { return w >> 8; }
SlotState StateOf(uint64_t w) { return static_cast<SlotState>(w & kStateMask); }
bool LeasedOf(uint64_t w) { return w & kLeasedBit; }

// Records `self` as the slot's writer. Only one process writes a slot at a time (it holds the
// slot WRITING), so the pair changes only when another process takes the slot over: the pid is
// cleared first, so that a reader never takes one process's pid with another's start time.
void SetWriter(SlotHeader* h, const ProcessId& self) {
  if (h->writer_pid.load(std::memory_order_relaxed) == self.pid &&
      h->writer_start_ticks.load(std::memory_order_relaxed) == self.start_ticks) {
    return;
  }
  h->writer_pid.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  h->writer_start_ticks.store(self.start_ticks, std::memory_order_relaxed);
  h->writer_pid.store(self.pid, std::memory_order_release);
}

// The slot's writer, read consistently against SetWriter (a writer killed between its stores
// leaves pid 0: no writer).
ProcessId ReadWriter(const SlotHeader* h) {
  ProcessId id;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    id.pid = h->writer_pid.load(std::memory_order_acquire);
    id.start_ticks = h->writer_start_ticks.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (id.pid != 0 && h->writer_pid.load(std::memory_order_relaxed) == id.pid) return id;
    ::sched_yield();
  }
  return {};
}

// A slot file is created under "<final name>.tmp.<pid>-<start ticks>-<random>" and renamed into
// place: the name says who creates it, so that gc can tell a creator that still runs (the job is
// live) from one that died before the rename (the file is an orphan nobody else can take).
std::string SlotTemporaryPath(const std::string& path, const ProcessId& creator) {
  return path + ".tmp." + std::to_string(creator.pid) + "-" + std::to_string(creator.start_ticks) +
         "-" + internal::RandomHex16();
}

// The creator a slot file's temporary name records, or nullopt for any other name (a temporary
// of an older version, which named no creator, included: nothing proves its creator dead).
std::optional<ProcessId> SlotTemporaryCreator(const char* name) {
  unsigned rank, slot, pid;
  unsigned long long ticks;
  char random[17] = {};
  int consumed = 0;
  if (std::sscanf(name, "rank-%u.slot-%u.tmp.%u-%llu-%16[0-9a-f]%n", &rank, &slot, &pid, &ticks,
                  random, &consumed) != 5 ||
      name[consumed] != '\0' || std::strlen(random) != 16 || pid == 0) {
    return std::nullopt;
  }
  return ProcessId{pid, ticks};
}

}  // namespace

std::string_view SlotStateName(SlotState s) {
  switch (s) {
    case SlotState::kFree:
      return "FREE";
    case SlotState::kWriting:
      return "WRITING";
    case SlotState::kComplete:
      return "COMPLETE";
  }
  return "UNKNOWN";
}

// A mapped slot file.
class SlotFile {
 public:
  ~SlotFile() {
    if (map_ != nullptr) ::munmap(map_, map_size_);
  }

  static Result<std::unique_ptr<SlotFile>> Open(const std::string& path, uint32_t rank,
                                                uint32_t slot) {
    auto f = std::unique_ptr<SlotFile>(new SlotFile());
    f->path_ = path;
    f->fd_.Reset(::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
    if (!f->fd_) return ErrnoStatus("open", path, errno);
    struct stat st;
    if (::fstat(f->fd_.get(), &st) != 0) return ErrnoStatus("stat", path, errno);
    if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
      return InvalidArgument(path +
                             ": not a private regular file of this user; refusing to use it");
    }
    if (static_cast<uint64_t>(st.st_size) < kSlotHeaderSize) {
      return Corruption(path + ": slot file is truncated");
    }
    f->ino_ = st.st_ino;
    f->map_size_ = st.st_size;
    void* p = ::mmap(nullptr, f->map_size_, PROT_READ | PROT_WRITE, MAP_SHARED, f->fd_.get(), 0);
    if (p == MAP_FAILED) return ErrnoStatus("mmap", path, errno);
    f->map_ = static_cast<std::byte*>(p);
    const SlotHeader* h = f->header();
    if (std::memcmp(h->magic, kSlotMagic, 8) != 0 || h->version != kSlotVersion ||
        h->header_size != kSlotHeaderSize || h->rank != rank || h->slot != slot ||
        h->capacity > f->map_size_ - kSlotHeaderSize) {
      return Corruption(path + ": not a valid slot file of rank " + std::to_string(rank) +
                        " slot " + std::to_string(slot));
    }
    return f;
  }

  // Creates the slot file: space reserved (fallocate), every page written once (pre-faulted),
  // published by rename. `word` is the initial control word, `writer` the process creating it.
  static Result<std::unique_ptr<SlotFile>> Create(const std::string& path, uint32_t rank,
                                                  uint32_t slot, uint64_t capacity, uint64_t word,
                                                  const ProcessId& writer) {
    const uint64_t size = kSlotHeaderSize + capacity;
    const std::string dir = path.substr(0, path.rfind('/'));
    struct statvfs vfs;
    if (::statvfs(dir.c_str(), &vfs) == 0) {
      const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
      if (free_bytes < size) {
        return ResourceExhausted(
            dir + ": a snapshot slot for rank " + std::to_string(rank) + " needs " +
            std::to_string(size) + " bytes (" + HumanBytes(size) + ") of shared memory, but only " +
            std::to_string(free_bytes) + " bytes (" + HumanBytes(free_bytes) +
            ") are free. Each rank keeps " +
            "2 slots of its state's size: enlarge /dev/shm (e.g. "
            "`docker run --shm-size=...`, or `mount -o remount,size=... /dev/shm`) or point "
            "shm_dir / SAFEPOINT_SHM_DIR at a larger tmpfs or a local disk directory");
      }
    }
    const std::string tmp = SlotTemporaryPath(path, writer);
    auto f = std::unique_ptr<SlotFile>(new SlotFile());
    f->path_ = path;
    f->fd_.Reset(::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!f->fd_) return ErrnoStatus("create", tmp, errno);
    auto fail = [&](Status s) {
      ::unlink(tmp.c_str());
      return s;
    };
    if (::fallocate(f->fd_.get(), 0, 0, static_cast<off_t>(size)) != 0) {
      if (errno != EOPNOTSUPP) {
        Status s = ErrnoStatus("fallocate", tmp, errno);
        if (s.code() == StatusCode::kResourceExhausted) {
          s = ResourceExhausted(dir + ": no room for a " + HumanBytes(size) +
                                " snapshot slot of rank " + std::to_string(rank) +
                                " in shared memory; enlarge /dev/shm or set shm_dir");
        }
        return fail(s);
      }
      if (::ftruncate(f->fd_.get(), static_cast<off_t>(size)) != 0) {
        return fail(ErrnoStatus("ftruncate", tmp, errno));
      }
    }
    struct stat st;
    if (::fstat(f->fd_.get(), &st) != 0) return fail(ErrnoStatus("stat", tmp, errno));
    f->ino_ = st.st_ino;
    f->map_size_ = size;
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, f->fd_.get(), 0);
    if (p == MAP_FAILED) return fail(ErrnoStatus("mmap", tmp, errno));
    f->map_ = static_cast<std::byte*>(p);
    f->populated_ = capacity;  // in this process's page tables from the writes below
    // Pre-fault: write every page once now, so that saves copy into warm pages.
    const uint64_t piece = 64 << 20;
    internal::ParallelFor((size + piece - 1) / piece, internal::DefaultCpuThreads(), [&](size_t i) {
      const uint64_t off = i * piece;
      std::memset(f->map_ + off, 0, std::min(piece, size - off));
    });
    SlotHeader* h = f->header();
    std::memcpy(h->magic, kSlotMagic, 8);
    h->version = kSlotVersion;
    h->header_size = kSlotHeaderSize;
    h->capacity = capacity;
    h->rank = rank;
    h->slot = slot;
    h->word.store(word, std::memory_order_relaxed);
    SetWriter(h, writer);
    if (::rename(tmp.c_str(), path.c_str()) != 0) return fail(ErrnoStatus("rename", tmp, errno));
    return f;
  }

  SlotHeader* header() const { return reinterpret_cast<SlotHeader*>(map_); }
  std::span<std::byte> data() const { return {map_ + kSlotHeaderSize, header()->capacity}; }
  uint64_t capacity() const { return header()->capacity; }
  uint64_t ino() const { return ino_; }
  uint64_t map_size() const { return map_size_; }
  const std::string& path() const { return path_; }
  // Image bytes from the start that this mapping has in the page tables (PopulateForRead, or
  // written when created): a later read of them needs no populate call again.
  uint64_t populated() const { return populated_; }
  void set_populated(uint64_t n) { populated_ = n; }

 private:
  SlotFile() = default;
  std::string path_;
  internal::UniqueFd fd_;
  std::byte* map_ = nullptr;
  uint64_t map_size_ = 0;
  uint64_t ino_ = 0;
  uint64_t populated_ = 0;
};

// ---------------------------------------------------------------------------------------------

bool HasLaterCopy(const std::vector<SlotInfo>& slots, const SlotInfo& s) {
  return std::any_of(slots.begin(), slots.end(), [&s](const SlotInfo& o) {
    return o.index != s.index && o.state == SlotState::kComplete && o.step == s.step &&
           o.complete_time_ns > s.complete_time_ns;
  });
}

Status ValidateJobName(const std::string& job) {
  if (job.empty() || job.size() > 64) {
    return InvalidArgument("job name '" + job + "' must have 1..64 characters");
  }
  if (!internal::IsJobNameText(job)) {
    return InvalidArgument("job name '" + job + "' may only use [A-Za-z0-9._-]");
  }
  if (job == "." || job == "..") return InvalidArgument("job name '" + job + "' is reserved");
  return Status::OK();
}

namespace {
std::string JobDirPrefix() { return "safepoint-" + std::to_string(::geteuid()) + "-"; }

// `path` quoted for a POSIX shell.
std::string ShellQuoted(const std::string& path) {
  std::string out = "'";
  for (const char c : path) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

// "uid N (name)", or "uid N" where the user database has no name for it.
std::string Owner(uid_t uid) {
  std::string out = "uid " + std::to_string(uid);
  struct passwd pw {};
  struct passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr) {
    out += std::string(" (") + found->pw_name + ")";
  }
  return out;
}

// Why `path` (the job directory's name) cannot be this user's job directory, and the way out:
// what it is, who owns it, and the command that clears it. Another local user who creates the
// name first blocks the job (failing closed: its snapshots would be theirs to read); only root
// or that user can remove it from a sticky directory such as /dev/shm.
Status CheckPrivateDirectory(const std::string& path) {
  const internal::UniqueFd fd(
      ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) {
    const int err = errno;
    if (err == ELOOP || err == ENOTDIR) {
      struct stat lst {};
      const bool found = ::lstat(path.c_str(), &lst) == 0;
      const bool link = found && S_ISLNK(lst.st_mode);
      const std::string who = found ? ", owned by " + Owner(lst.st_uid) : "";
      const std::string what = link ? "a symlink" : "not a directory";
      return InvalidArgument(path + ": exists but is " + what + who +
                             "; refusing to use it for snapshots (it blocks this job: remove it, "
                             "as root or as its owner: rm -- " +
                             ShellQuoted(path) + ", or use another job name or shm_dir)");
    }
    return ErrnoStatus("open", path, err);
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("stat", path, errno);
  if (st.st_uid != ::geteuid()) {
    return InvalidArgument(path + ": owned by " + Owner(st.st_uid) + ", not by this user (" +
                           Owner(::geteuid()) +
                           "); refusing to use it for snapshots (another user created it first, "
                           "which blocks this job: remove it, as root or as its owner: rm -rf -- " +
                           ShellQuoted(path) + ", or use another job name or shm_dir)");
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return InvalidArgument(path + ": accessible to other users (mode " + mode +
                           "); refusing to use it (make it private: chmod 700 " +
                           ShellQuoted(path) + ")");
  }
  return Status::OK();
}
}  // namespace

Result<std::string> JobDirectory(const std::string& shm_dir, const std::string& job, bool create) {
  SP_RETURN_IF_ERROR(ValidateJobName(job));
  const std::string path = shm_dir + "/" + JobDirPrefix() + job;
  if (create && ::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    Status s = ErrnoStatus("mkdir", path, errno);
    if (s.code() == StatusCode::kNotFound) {
      return NotFound(shm_dir + ": the shared-memory directory does not exist");
    }
    return s;
  }
  SP_RETURN_IF_ERROR(CheckPrivateDirectory(path));
  return path;
}

namespace {
// Calls `fn(job, path, checked)` for every entry of `shm_dir` named like a job directory with a
// valid job name; `checked` is CheckPrivateDirectory(path). A missing `shm_dir` has none.
Status ForEachJobEntry(const std::string& shm_dir,
                       const std::function<void(std::string job, const std::string& path,
                                                const Status& checked)>& fn) {
  const internal::UniqueDir d(::opendir(shm_dir.c_str()));
  if (!d) return errno == ENOENT ? Status::OK() : ErrnoStatus("opendir", shm_dir, errno);
  const std::string prefix = JobDirPrefix();
  while (dirent* e = ::readdir(d.get())) {
    const std::string name = e->d_name;
    if (name.rfind(prefix, 0) != 0) continue;
    std::string job = name.substr(prefix.size());
    if (!ValidateJobName(job).ok()) continue;
    const std::string path = shm_dir + "/" + name;
    fn(std::move(job), path, CheckPrivateDirectory(path));
  }
  return Status::OK();
}
}  // namespace

Result<std::vector<std::pair<std::string, std::string>>> ListJobDirectories(
    const std::string& shm_dir) {
  std::vector<std::pair<std::string, std::string>> out;
  SP_RETURN_IF_ERROR(ForEachJobEntry(
      shm_dir, [&](std::string job, const std::string& path, const Status& checked) {
        if (checked.ok()) out.emplace_back(std::move(job), path);
      }));
  std::sort(out.begin(), out.end());
  return out;
}

Result<std::vector<BlockedJobEntry>> ListBlockedJobEntries(const std::string& shm_dir) {
  std::vector<BlockedJobEntry> out;
  SP_RETURN_IF_ERROR(
      ForEachJobEntry(shm_dir, [&](std::string job, const std::string& path, const Status& why) {
        if (why.ok() || why.code() != StatusCode::kInvalidArgument) return;  // usable, or gone
        struct stat st {};
        if (::lstat(path.c_str(), &st) != 0) return;
        BlockedJobEntry b;
        b.job = std::move(job);
        b.path = path;
        b.owner_uid = st.st_uid;
        b.kind = "other";
        if (S_ISLNK(st.st_mode)) b.kind = "symlink";
        if (S_ISDIR(st.st_mode)) b.kind = "directory";
        if (S_ISREG(st.st_mode)) b.kind = "file";
        b.problem = why.message();
        out.push_back(std::move(b));
      }));
  std::sort(out.begin(), out.end(),
            [](const BlockedJobEntry& a, const BlockedJobEntry& b) { return a.path < b.path; });
  return out;
}

Result<std::vector<uint32_t>> ListArenaRanks(const std::string& job_dir) {
  const internal::UniqueDir d(::opendir(job_dir.c_str()));
  if (!d) return ErrnoStatus("opendir", job_dir, errno);
  std::vector<uint32_t> ranks;
  while (dirent* e = ::readdir(d.get())) {
    unsigned rank, slot;
    int consumed = 0;
    if (std::sscanf(e->d_name, "rank-%u.slot-%u%n", &rank, &slot, &consumed) == 2 &&
        e->d_name[consumed] == '\0') {
      ranks.push_back(rank);
    }
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return ranks;
}

Result<uint64_t> JobShmBytes(const std::string& job_dir, std::optional<uint32_t> except_rank) {
  const internal::UniqueDir d(::opendir(job_dir.c_str()));
  if (!d) return ErrnoStatus("opendir", job_dir, errno);
  uint64_t total = 0;
  while (dirent* e = ::readdir(d.get())) {
    unsigned rank, slot;
    int consumed = 0;
    if (std::sscanf(e->d_name, "rank-%u.slot-%u%n", &rank, &slot, &consumed) != 2 ||
        e->d_name[consumed] != '\0' || (except_rank && rank == *except_rank)) {
      continue;
    }
    struct stat st;
    if (::fstatat(::dirfd(d.get()), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
      total += static_cast<uint64_t>(st.st_blocks) * 512;
    }
  }
  return total;
}

uint64_t SlotFileBytes(uint64_t image_size) {
  uint64_t capacity = image_size + image_size / 64 + (64 << 10);
  capacity = (capacity + kCapacityQuantum - 1) / kCapacityQuantum * kCapacityQuantum;
  return kSlotHeaderBytes + capacity;
}

namespace {

void Populate(const std::byte* data, size_t size, int advice) {
  if (size == 0) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data) & ~(page - 1);
  const auto end = reinterpret_cast<uintptr_t>(data) + size;
  ::madvise(reinterpret_cast<void*>(begin), end - begin, advice);
}

}  // namespace

// Linux 5.14; older headers lack them.
void PopulateForRead(std::span<const std::byte> bytes) {
#ifndef MADV_POPULATE_READ
  constexpr int MADV_POPULATE_READ = 22;
#endif
  Populate(bytes.data(), bytes.size(), MADV_POPULATE_READ);
}

void PopulateForWrite(std::span<std::byte> bytes) {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;
#endif
  Populate(bytes.data(), bytes.size(), MADV_POPULATE_WRITE);
}

bool SlotKeptFor(uint64_t capacity, uint64_t image_size) {
  return capacity >= image_size && kSlotHeaderBytes + capacity <= 2 * SlotFileBytes(image_size);
}

Result<std::vector<uint32_t>> LiveSlotWriters(const std::string& job_dir) {
  internal::UniqueDir d(::opendir(job_dir.c_str()));
  if (!d) return ErrnoStatus("opendir", job_dir, errno);
  struct Named {
    std::string name;
    unsigned rank, slot;
  };
  std::vector<Named> slots;
  std::vector<uint32_t> live;
  while (dirent* e = ::readdir(d.get())) {
    unsigned rank, slot;
    int consumed = 0;
    if (std::sscanf(e->d_name, "rank-%u.slot-%u%n", &rank, &slot, &consumed) == 2 &&
        e->d_name[consumed] == '\0') {
      slots.push_back({e->d_name, rank, slot});
    } else if (const auto creator = SlotTemporaryCreator(e->d_name);
               creator && ProcessAlive(*creator)) {
      live.push_back(creator->pid);  // creating its first slot file: it will write into it
    }
  }
  d.Reset();
  for (const auto& [name, rank, slot] : slots) {
    auto file = SlotFile::Open(job_dir + "/" + name, rank, slot);
    if (!file.ok()) {
      // Removed meanwhile, or not a valid slot file (which no writer can use either).
      const StatusCode c = file.status().code();
      if (c == StatusCode::kNotFound || c == StatusCode::kCorruption ||
          c == StatusCode::kInvalidArgument) {
        continue;
      }
      return file.status();
    }
    const ProcessId writer = ReadWriter((*file)->header());
    if (ProcessAlive(writer)) live.push_back(writer.pid);
  }
  std::sort(live.begin(), live.end());
  live.erase(std::unique(live.begin(), live.end()), live.end());
  return live;
}

Result<SlotTemporariesRemoved> RemoveDeadSlotTemporaries(const std::string& job_dir, bool dry_run) {
  SP_RETURN_IF_ERROR(CheckPrivateDirectory(job_dir));
  internal::UniqueDir d(::opendir(job_dir.c_str()));
  if (!d) return ErrnoStatus("opendir", job_dir, errno);
  std::vector<std::string> dead;
  while (dirent* e = ::readdir(d.get())) {
    const auto creator = SlotTemporaryCreator(e->d_name);
    if (creator && !ProcessAlive(*creator)) dead.emplace_back(e->d_name);
  }
  d.Reset();
  SlotTemporariesRemoved out;
  for (const std::string& name : dead) {
    const std::string path = job_dir + "/" + name;
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (!dry_run && ::unlink(path.c_str()) != 0) {
      if (errno == ENOENT) continue;  // another gc was faster
      return ErrnoStatus("unlink", path, errno);
    }
    ++out.files;
    out.bytes += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return out;
}

Result<uint64_t> RemoveJobDirectory(const std::string& job_dir) {
  SP_RETURN_IF_ERROR(CheckPrivateDirectory(job_dir));
  SP_ASSIGN_OR_RETURN(const std::vector<uint32_t> writers, LiveSlotWriters(job_dir));
  if (!writers.empty()) {
    return InvalidArgument(job_dir + ": training process " + std::to_string(writers.front()) +
                           " still uses its snapshots; not removing the directory");
  }
  internal::UniqueDir d(::opendir(job_dir.c_str()));
  if (!d) return ErrnoStatus("opendir", job_dir, errno);
  std::vector<std::string> names;
  bool replicas = false;  // the agent's replicas of other nodes' snapshots (src/replica)
  while (dirent* e = ::readdir(d.get())) {
    const std::string n = e->d_name;
    if (n == "." || n == "..") continue;
    if (n == "replicas") {
      replicas = true;
      continue;
    }
    const bool ours =
        n.rfind("rank-", 0) == 0 || n.rfind("agent.", 0) == 0 || n.rfind("job.json", 0) == 0 ||
        n.rfind("claim-", 0) == 0 ||      // the ranks' claims (src/shm/rank_claim.h)
        n.rfind("events.jsonl", 0) == 0;  // the agent's default event log (and its rotation)
    if (!ours) {
      return InvalidArgument(job_dir + ": contains '" + n +
                             "', which safepoint did not create; "
                             "not removing the directory");
    }
    names.push_back(n);
  }
  d.Reset();
  uint64_t freed = 0;
  if (replicas) {
    // Only regular files, in a directory of ours (not a symlink): replica files and the
    // temporaries of receives that never finished.
    const std::string dir = job_dir + "/replicas";
    struct stat st;
    if (::lstat(dir.c_str(), &st) != 0) return ErrnoStatus("lstat", dir, errno);
    if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) {
      return InvalidArgument(dir + " is not a directory of this user; not removing the job");
    }
    internal::UniqueDir rd(::opendir(dir.c_str()));
    if (!rd) return ErrnoStatus("opendir", dir, errno);
    std::vector<std::string> files;
    while (dirent* e = ::readdir(rd.get())) {
      const std::string n = e->d_name;
      if (n == "." || n == "..") continue;
      struct stat fst;
      const std::string path = dir + "/" + n;
      if (::lstat(path.c_str(), &fst) != 0 || !S_ISREG(fst.st_mode)) {
        return InvalidArgument(path + " is not a replica file; not removing the job");
      }
      freed += static_cast<uint64_t>(fst.st_blocks) * 512;
      files.push_back(path);
    }
    rd.Reset();
    for (const auto& path : files) {
      if (::unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus("unlink", path, errno);
    }
    if (::rmdir(dir.c_str()) != 0 && errno != ENOENT) return ErrnoStatus("rmdir", dir, errno);
  }
  for (const auto& n : names) {
    const std::string path = job_dir + "/" + n;
    struct stat st;
    if (::lstat(path.c_str(), &st) == 0) freed += static_cast<uint64_t>(st.st_blocks) * 512;
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoStatus("unlink", path, errno);
  }
  if (::rmdir(job_dir.c_str()) != 0 && errno != ENOENT) return ErrnoStatus("rmdir", job_dir, errno);
  return freed;
}

// ---------------------------------------------------------------------------------------------

Arena::~Arena() = default;

ProcessId Arena::Self() {
  // Read from /proc once per process (a child forked after Open reads its own).
  if (self_pid_ != static_cast<uint32_t>(::getpid())) {
    const ProcessId self = internal::SelfProcessId();
    self_pid_ = self.pid;
    self_start_ticks_ = self.start_ticks;
  }
  return {self_pid_, self_start_ticks_};
}

std::string Arena::SlotPath(uint32_t slot) const {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "/rank-%05u.slot-%u", rank_, slot);
  return job_dir_ + buf;
}

Result<std::unique_ptr<Arena>> Arena::Open(const std::string& job_dir, uint32_t rank,
                                           uint32_t slots) {
  if (slots < 2 || slots > 16) return InvalidArgument("an arena needs 2..16 slots");
  auto a = std::unique_ptr<Arena>(new Arena());
  a->job_dir_ = job_dir;
  a->rank_ = rank;
  a->slots_.resize(slots);
  a->usable_slots_ = slots;
  SP_RETURN_IF_ERROR(a->Refresh());
  return a;
}

Status Arena::Refresh() {
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    const std::string path = SlotPath(i);
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno != ENOENT) return ErrnoStatus("stat", path, errno);
      slots_[i].reset();
      continue;
    }
    if (slots_[i] && slots_[i]->ino() == st.st_ino) continue;
    auto opened = SlotFile::Open(path, rank_, i);
    if (!opened.ok() && opened.status().code() == StatusCode::kNotFound) {
      // Removed between the stat and the open: as absent. The agent drops a previous world's
      // slots while the ranks of the new one connect (AgentTest.RestartWithFewerRanks... failed
      // once under ASan: a new rank's connect failed with this NotFound).
      slots_[i].reset();
      continue;
    }
    SP_ASSIGN_OR_RETURN(slots_[i], std::move(opened));
  }
  // The rank's claim, once the agent wrote one (a new file when it was removed and written again).
  struct stat st;
  const std::string claim = ClaimPath(job_dir_, rank_);
  if (::lstat(claim.c_str(), &st) != 0) {
    if (errno != ENOENT) return ErrnoStatus("stat", claim, errno);
    claim_.reset();
  } else if (!claim_ || claim_->ino() != st.st_ino) {
    auto opened = RankClaim::Open(job_dir_, rank_);
    if (opened.ok()) {
      claim_ = std::move(opened).value();
    } else if (opened.status().code() == StatusCode::kNotFound) {
      claim_.reset();
    } else {
      return opened.status();
    }
  }
  return Status::OK();
}

bool Arena::ClaimHeld() const {
  return claim_epoch_ == 0 || !claim_ || claim_->epoch() == claim_epoch_;
}

bool Arena::SupersededWriter(const ProcessId& writer) const {
  return claim_ && claim_->FindSuperseded(writer).has_value();
}

Status Arena::CheckClaim() const {
  if (ClaimHeld()) return Status::OK();
  return Superseded(SupersededMessage(job_dir_, rank_, internal::SelfProcessId(), claim_->Owner()));
}

std::vector<SlotInfo> Arena::Slots() const {
  std::vector<SlotInfo> out(slots_.size());
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    out[i].index = i;
    if (!slots_[i]) continue;
    const SlotHeader* h = slots_[i]->header();
    for (;;) {  // a consistent read of the fields against the state word
      const uint64_t w1 = h->word.load(std::memory_order_acquire);
      out[i].step = h->step.load(std::memory_order_relaxed);
      out[i].image_size = h->image_size.load(std::memory_order_relaxed);
      out[i].complete_time_ns = h->complete_time_ns.load(std::memory_order_relaxed);
      const ProcessId writer = ReadWriter(h);
      out[i].writer_pid = writer.pid;
      out[i].writer_start_ticks = writer.start_ticks;
      std::atomic_thread_fence(std::memory_order_acquire);
      const uint64_t w2 = h->word.load(std::memory_order_relaxed);
      if ((w1 & ~kLeasedBit) != (w2 & ~kLeasedBit)) continue;
      out[i].state = StateOf(w2);
      out[i].leased = LeasedOf(w2);
      out[i].generation = GenOf(w2);
      break;
    }
    out[i].capacity = slots_[i]->capacity();
    if (out[i].state == SlotState::kComplete && out[i].image_size > out[i].capacity) {
      out[i].state = SlotState::kWriting;  // impossible unless damaged: never read it
    }
  }
  return out;
}

std::span<std::byte> Arena::SlotData(uint32_t slot) {
  if (slot >= slots_.size() || !slots_[slot]) return {};
  return slots_[slot]->data();
}

std::span<std::byte> Arena::SlotDataForRead(uint32_t slot, uint64_t size) {
  if (slot >= slots_.size() || !slots_[slot]) return {};
  SlotFile& f = *slots_[slot];
  const std::span<std::byte> out = f.data().subspan(0, std::min(size, f.capacity()));
  if (f.populated() < out.size()) {
    PopulateForRead(out);
    f.set_populated(out.size());
  }
  return out;
}

uint64_t Arena::mapped_bytes() const {
  uint64_t n = 0;
  for (const auto& s : slots_) n += s ? s->map_size() : 0;
  return n;
}

std::optional<SlotInfo> Arena::NewestComplete() const {
  std::optional<SlotInfo> best;
  for (const SlotInfo& s : Slots()) {
    if (s.state != SlotState::kComplete) continue;
    // Of two snapshots of one step, the one completed last (generations count per slot).
    if (!best || s.step > best->step ||
        (s.step == best->step && s.complete_time_ns > best->complete_time_ns)) {
      best = s;
    }
  }
  return best;
}

Status Arena::EnsureCapacity(uint32_t slot, uint64_t image_size, double* seconds) {
  *seconds = 0;
  if (slots_[slot] && SlotKeptFor(slots_[slot]->capacity(), image_size)) return Status::OK();
  const auto t0 = std::chrono::steady_clock::now();
  // Headroom so that small changes of the non-tensor state do not re-lay the slot out.
  const uint64_t capacity = SlotFileBytes(image_size) - kSlotHeaderBytes;
  uint64_t word = Word(0, SlotState::kWriting);
  if (slots_[slot]) word = slots_[slot]->header()->word.load(std::memory_order_acquire);
  SP_ASSIGN_OR_RETURN(slots_[slot],
                      SlotFile::Create(SlotPath(slot), rank_, slot, capacity, word, Self()));
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return Status::OK();
}

Status Arena::Reserve(uint64_t image_size) {
  SP_RETURN_IF_ERROR(Refresh());
  // Take every slot this writer may overwrite now (FREE, torn, or an older COMPLETE one) at
  // once, growing each as it is taken, then give them all back.
  std::vector<SlotWriteTicket> taken;
  Status status;
  for (uint32_t i = 0; i < usable_slots_; ++i) {
    auto ticket = Take(image_size, /*keep_newest=*/true);
    if (!ticket.ok()) {
      status = ticket.status();
      break;
    }
    if (ticket->first == Acquire::kBusy) break;
    taken.push_back(ticket->second);
  }
  for (const SlotWriteTicket& t : taken) AbortWrite(t);
  return status;
}

Result<std::pair<Arena::Acquire, SlotWriteTicket>> Arena::BeginWrite(uint64_t image_size) {
  return Take(image_size, /*keep_newest=*/usable_slots_ > 1);
}

void Arena::set_usable_slots(uint32_t n) {
  usable_slots_ = std::clamp<uint32_t>(n, 1, slot_count());
}

uint64_t Arena::DropUnusableSlots() {
  uint64_t freed = 0;
  if (!ClaimHeld()) return 0;  // superseded: the slots are the new owner's to manage
  const std::vector<SlotInfo> info = Slots();
  for (uint32_t i = usable_slots_; i < slots_.size(); ++i) {
    if (!slots_[i] || info[i].leased) continue;
    const ProcessId writer{info[i].writer_pid, info[i].writer_start_ticks};
    if (info[i].state == SlotState::kWriting && writer.pid != Self().pid && ProcessAlive(writer)) {
      continue;
    }
    // Unlinked, the file's pages go back when the last process that maps it lets go.
    if (::unlink(SlotPath(i).c_str()) == 0) freed += slots_[i]->map_size();
    slots_[i].reset();
  }
  return freed;
}

Result<std::pair<Arena::Acquire, SlotWriteTicket>> Arena::Take(uint64_t image_size,
                                                               bool keep_newest) {
  SP_RETURN_IF_ERROR(Refresh());
  SP_RETURN_IF_ERROR(CheckClaim());
  const ProcessId self = Self();
  for (int attempt = 0; attempt < 100; ++attempt) {
    const std::vector<SlotInfo> info = Slots();
    // The snapshot kept is the one completed last, not the one of the highest step: after the
    // ranks resumed from an older step, a higher step left in memory by the abandoned run is
    // the stale one (keeping it by step overwrote the newest save of the resumed run, found by
    // the crash campaign, seed 3172031226).
    auto later = [](const SlotInfo& a, const SlotInfo& b) {
      return a.complete_time_ns != b.complete_time_ns ? a.complete_time_ns > b.complete_time_ns
                                                      : a.step > b.step;
    };
    std::optional<uint32_t> newest;
    for (const SlotInfo& s : info) {
      if (s.state != SlotState::kComplete) continue;
      if (!newest || later(s, info[*newest])) newest = s.index;
    }
    // Preference: a slot that does not exist yet or is FREE, then a torn one (WRITING by a dead
    // writer, or by this process after a failed save), then the COMPLETE one completed first.
    std::vector<const SlotInfo*> order;
    // Slots a superseded process (src/shm/rank_claim.h) may still be writing: taken by replacing
    // the file (that process keeps writing the old one, which nobody maps again), never by a CAS
    // on a word it writes too.
    std::vector<bool> replace(info.size(), false);
    for (const SlotInfo& s : info) {
      if (s.index >= usable_slots_) continue;
      if (keep_newest && newest && s.index == *newest) continue;
      if (s.leased) continue;
      const ProcessId writer{s.writer_pid, s.writer_start_ticks};
      if (s.state == SlotState::kWriting && writer.pid != self.pid && ProcessAlive(writer) &&
          slots_[s.index]) {
        if (!SupersededWriter(writer)) {
          return InvalidArgument(job_dir_ + ": process " + std::to_string(s.writer_pid) +
                                 " is writing rank " + std::to_string(rank_) +
                                 "'s snapshots; two processes cannot save the same rank");
        }
        replace[s.index] = true;
      }
      order.push_back(&s);
    }
    std::stable_sort(order.begin(), order.end(), [](const SlotInfo* a, const SlotInfo* b) {
      auto rank_of = [](const SlotInfo* s) {
        return s->state == SlotState::kFree ? 0 : s->state == SlotState::kWriting ? 1 : 2;
      };
      if (rank_of(a) != rank_of(b)) return rank_of(a) < rank_of(b);
      return a->complete_time_ns != b->complete_time_ns ? a->complete_time_ns < b->complete_time_ns
                                                        : a->step < b->step;
    });
    if (order.empty()) return std::make_pair(Acquire::kBusy, SlotWriteTicket{});
    const SlotInfo& s = *order.front();
    SlotWriteTicket t;
    t.slot = s.index;
    t.generation = s.generation + 1;
    if (replace[s.index]) {
      slots_[s.index].reset();  // EnsureCapacity lays out a new file under the slot's name
    } else if (slots_[s.index]) {
      const uint64_t before = Word(s.generation, s.state, false);
      uint64_t expected = before;
      SlotHeader* h = slots_[s.index]->header();
      if (!h->word.compare_exchange_strong(expected, Word(t.generation, SlotState::kWriting),
                                           std::memory_order_seq_cst)) {
        continue;  // the agent leased it or it changed: choose again
      }
      // Taken; still the rank's writer? (A takeover that came first is seen here, before a byte
      // is written; one that comes later sees this slot WRITING and removes its file.)
      if (!ClaimHeld()) {
        expected = Word(t.generation, SlotState::kWriting);
        h->word.compare_exchange_strong(expected, before, std::memory_order_seq_cst);
        return CheckClaim();
      }
      SetWriter(h, self);
    }
    Status cap = EnsureCapacity(s.index, image_size, &t.create_seconds);
    if (!cap.ok()) {
      if (slots_[s.index]) AbortWrite(t);
      return cap;
    }
    t.relaid_out = t.create_seconds > 0;
    SlotHeader* h = slots_[s.index]->header();
    h->word.store(Word(t.generation, SlotState::kWriting), std::memory_order_release);
    SetWriter(h, self);
    t.data = slots_[s.index]->data().subspan(0, image_size);
    return std::make_pair(Acquire::kAcquired, t);
  }
  return std::make_pair(Acquire::kBusy, SlotWriteTicket{});
}

// The time a snapshot becomes current: now, and later than every other slot's (only the rank's
// one writer calls this), so that the order holds even if the wall clock steps back.
int64_t Arena::NextCompletionNs() const {
  int64_t t = UnixNanos();
  for (const auto& s : slots_) {
    if (s) t = std::max(t, s->header()->complete_time_ns.load(std::memory_order_relaxed) + 1);
  }
  return t;
}

bool Arena::FinishWrite(const SlotWriteTicket& t, uint64_t step, uint64_t image_size, bool leased) {
  SlotHeader* h = slots_[t.slot]->header();
  h->step.store(step, std::memory_order_relaxed);
  h->image_size.store(image_size, std::memory_order_relaxed);
  h->complete_time_ns.store(NextCompletionNs(), std::memory_order_relaxed);
  // Superseded since the slot was taken: never COMPLETE. Checked before the state word changes;
  // a takeover after this check sees the word WRITING or COMPLETE, and removes the file while it
  // is WRITING (arena.h).
  if (!ClaimHeld()) {
    AbortWrite(t);
    return false;
  }
  uint64_t expected = Word(t.generation, SlotState::kWriting);
  return h->word.compare_exchange_strong(expected, Word(t.generation, SlotState::kComplete, leased),
                                         std::memory_order_seq_cst);
}

void Arena::AbortWrite(const SlotWriteTicket& t) {
  if (!slots_[t.slot]) return;
  uint64_t expected = Word(t.generation, SlotState::kWriting);
  slots_[t.slot]->header()->word.compare_exchange_strong(
      expected, Word(t.generation, SlotState::kFree), std::memory_order_acq_rel);
}

bool Arena::MarkResumed(uint32_t slot, uint64_t generation) {
  if (slot >= slots_.size() || !slots_[slot]) return false;
  if (!ClaimHeld()) return false;  // a superseded process's load never reorders the slots
  SlotHeader* h = slots_[slot]->header();
  const uint64_t w = h->word.load(std::memory_order_acquire);
  if (StateOf(w) != SlotState::kComplete || GenOf(w) != generation) return false;
  // Only this rank's writer changes the slot's state, so it stays this snapshot (the agent may
  // lease it meanwhile, which changes nothing here).
  h->complete_time_ns.store(NextCompletionNs(), std::memory_order_release);
  return true;
}

bool Arena::Lease(uint32_t slot, uint64_t generation) {
  if (slot >= slots_.size() || !slots_[slot]) return false;
  uint64_t expected = Word(generation, SlotState::kComplete, false);
  return slots_[slot]->header()->word.compare_exchange_strong(
      expected, Word(generation, SlotState::kComplete, true), std::memory_order_acq_rel);
}

void Arena::Release(uint32_t slot, uint64_t generation) {
  if (slot >= slots_.size() || !slots_[slot]) return;
  uint64_t expected = Word(generation, SlotState::kComplete, true);
  slots_[slot]->header()->word.compare_exchange_strong(
      expected, Word(generation, SlotState::kComplete, false), std::memory_order_acq_rel);
}

void Arena::RecordPersist(uint64_t step, double seconds) {
  if (slots_.empty() || !slots_[0]) return;
  SlotHeader* h = slots_[0]->header();
  // Invalidate, write the time, then publish it under the step (readers check it twice).
  h->persisted_step_plus1.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  h->persist_nanos.store(static_cast<uint64_t>(std::max(0.0, seconds) * 1e9),
                         std::memory_order_relaxed);
  h->persisted_step_plus1.store(step + 1, std::memory_order_release);
}

std::optional<std::pair<uint64_t, double>> Arena::LastPersist() const {
  if (slots_.empty() || !slots_[0]) return std::nullopt;
  const SlotHeader* h = slots_[0]->header();
  const uint64_t s1 = h->persisted_step_plus1.load(std::memory_order_acquire);
  const uint64_t nanos = h->persist_nanos.load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (s1 == 0 || h->persisted_step_plus1.load(std::memory_order_relaxed) != s1) {
    return std::nullopt;  // none, or being recorded right now
  }
  return std::make_pair(s1 - 1, static_cast<double>(nanos) / 1e9);
}

void Arena::ClearLeases() {
  for (auto& s : slots_) {
    if (!s) continue;
    s->header()->word.fetch_and(~kLeasedBit, std::memory_order_acq_rel);
  }
}

uint32_t Arena::RemoveWritingSlots() {
  Refresh().IgnoreError();  // what could be mapped
  uint32_t removed = 0;
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i]) continue;
    // Sequentially consistent: ordered after the claim's epoch store (RankClaim::SetOwner).
    const uint64_t w = slots_[i]->header()->word.load(std::memory_order_seq_cst);
    if (StateOf(w) != SlotState::kWriting) continue;
    struct stat st;
    const std::string path = SlotPath(i);
    if (::lstat(path.c_str(), &st) == 0 && st.st_ino == slots_[i]->ino() &&
        ::unlink(path.c_str()) == 0) {
      ++removed;
    }
    slots_[i].reset();
  }
  return removed;
}

Status Arena::Remove() {
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    slots_[i].reset();
    if (::unlink(SlotPath(i).c_str()) != 0 && errno != ENOENT) {
      return ErrnoStatus("unlink", SlotPath(i), errno);
    }
  }
  claim_.reset();
  return RemoveClaimUnlessNeeded(job_dir_, rank_);
}

}  // namespace safepoint
