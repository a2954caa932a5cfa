// PosixStorage: Storage on a local or shared POSIX filesystem under one root directory.
//
// Layout: object "a/b/c" is the file <root>/a/b/c. Directories are created on demand and removed
// again by Delete() once empty; the root itself is never removed. Nothing below the root is
// reached through a symbolic link: every path is resolved one component at a time with
// O_NOFOLLOW from the root, List() skips symlinks, and Open() of a symlink is NotFound. The root
// itself may be a symlink (the caller chose it).
//
// Write protocol (Create ... Publish):
//   1. Create the missing parent directories; fsync the parent of each directory created.
//   2. Open "<dir>/<base>.tmp.<16 random hex digits>" with O_CREAT|O_EXCL|O_CLOEXEC, mode 0644,
//      and register its inode in the process-wide set of live temporaries. With use_direct_io,
//      open it a second time with O_DIRECT (filesystems that refuse it, e.g. ramfs or older
//      tmpfs, answer EINVAL: the object then uses buffered I/O only). A size hint is
//      preallocated with fallocate(2), skipped on EOPNOTSUPP (not posix_fallocate, which glibc
//      emulates there by writing every block). Preallocating also keeps parallel O_DIRECT writes
//      from being serialised as size-extending writes, and makes ENOSPC show up in Create.
//   3. WriteAt: pwrite loops (EINTR and partial writes are retried). A request whose address,
//      offset and length are multiples of kDirectIOAlignment goes to the O_DIRECT descriptor, an
//      aligned request with an unaligned length sends its aligned prefix there; the rest goes
//      through the page cache. The first failed write poisons the object: Publish refuses it.
//   4. Publish: trim any unused preallocation, fsync the temporary file, rename it over the final
//      name, fsync the directory. A failed fsync is never retried. Up to the rename, a failure
//      removes the temporary file and publishes nothing: the caller rewrites the object. Once
//      renamed, the object is published and is never unlinked again, whatever fails next:
//      another writer may have renamed an equal object over it meanwhile (two committers of one
//      COMMIT), and the rename has already replaced the previous version. If the directory fsync
//      then fails, Publish returns an IOError that names the directory: the object is visible
//      but its name may not survive a power loss (which may bring back the previous version or
//      nothing). The caller must neither report it durable nor delete it; writing it again, or
//      any later successful fsync of the same directory, makes the name durable.
//   5. Abort (or the destructor of an unpublished object) unlinks the temporary file.
//   PublishIfAbsent is step 4 with renameat2(RENAME_NOREPLACE) in place of the rename. EEXIST
//   fsyncs the directory (the existing name may be another writer's, not yet made durable: the
//   answer must not report an object that a power cut takes back; a failed fsync is IOError),
//   removes the temporary file and is AlreadyExists. A filesystem that refuses the flag (EINVAL,
//   or ENOSYS from an old kernel; some network filesystems) gets link(temporary, name), which is
//   exclusive as well, then unlink(temporary); a temporary whose unlink fails stays behind as a
//   leftover (RemoveLeftovers only removes that second name of the published file).
//
// Reads: Open() opens the file O_RDONLY, plus O_DIRECT where accepted; ReadAt() uses pread loops
// and picks the descriptor by alignment as writes do. Reading past the end is Corruption.
//
// Leftovers: a process that crashes mid-write leaves "*.tmp.<16 hex>" files, which List() never
// shows. RemoveLeftovers(prefix) deletes those that no writer of this process holds open (it
// checks the registry of live temporaries by inode). It cannot see writers in other processes:
// callers must only call it for prefixes that no live writer anywhere uses (safepoint's commit
// layer guarantees this by calling it for steps whose writers are known to be gone).
//
// Thread safety: every method may be called from many threads; WriteAt/ReadAt are positional.
#include "storage/posix/posix_storage.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "base/kill_point.h"
#include "base/random.h"
#include "base/unique_fd.h"
#include "safepoint/storage.h"

namespace safepoint {

namespace {

using internal::PosixPublishSync;
using internal::PosixPublishSyncHook;
using internal::UniqueDir;
using internal::UniqueFd;
using SyncHook = std::shared_ptr<const PosixPublishSyncHook>;  // null: none (always, but in tests)

constexpr uint64_t kAlignMask = kDirectIOAlignment - 1;
// Linux transfers at most 0x7ffff000 bytes per read/write call; ask for no more than that.
constexpr size_t kMaxIoBytes = 0x7ffff000;
// How often Create retries when its directory is removed under it by a concurrent Delete.
constexpr int kCreateAttempts = 8;
constexpr std::string_view kTmpInfix = ".tmp.";
constexpr size_t kTmpSuffixHexDigits = 16;

bool IsAligned(const void* p, uint64_t offset) {
  return (reinterpret_cast<uintptr_t>(p) & kAlignMask) == 0 && (offset & kAlignMask) == 0;
}

std::string JoinPath(std::string_view dir, std::string_view name) {
  std::string out(dir);
  if (name.empty()) return out;
  if (out.empty() || out.back() != '/') out += '/';
  out += name;
  return out;
}

// Splits "a/b/c" into "a/b" and "c" ("" and "c" for "c").
std::pair<std::string_view, std::string_view> SplitName(std::string_view name) {
  size_t slash = name.rfind('/');
  if (slash == std::string_view::npos) return {std::string_view(), name};
  return {name.substr(0, slash), name.substr(slash + 1)};
}

// "<base>.tmp.<16 lowercase hex digits>": the only names RemoveLeftovers deletes.
bool IsTemporaryName(std::string_view file_name) {
  size_t pos = file_name.rfind(kTmpInfix);
  if (pos == std::string_view::npos || pos == 0) return false;
  std::string_view hex = file_name.substr(pos + kTmpInfix.size());
  return hex.size() == kTmpSuffixHexDigits && std::all_of(hex.begin(), hex.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

// The inodes of the temporary files that writers of this process hold open. A writer takes
// `sweep_mu` shared while it creates and registers its temporary file; RemoveLeftovers takes it
// exclusively while it checks and unlinks one candidate, so it can never see a temporary that
// exists but is not registered yet.
class LiveTemporaries {
 public:
  static LiveTemporaries& Get() {
    static LiveTemporaries* live = new LiveTemporaries();  // never destroyed: usable at exit
    return *live;
  }

  std::shared_mutex& sweep_mu() { return sweep_mu_; }

  void Add(dev_t dev, ino_t ino) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert({dev, ino});
  }
  void Remove(dev_t dev, ino_t ino) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase({dev, ino});
  }
  bool Contains(dev_t dev, ino_t ino) {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.count({dev, ino}) > 0;
  }

 private:
  std::shared_mutex sweep_mu_;
  std::mutex mu_;
  std::set<std::pair<dev_t, ino_t>> live_;
};

// Opens `name` in directory `dir_fd` a second time with O_DIRECT, checking that it is the same
// file as `same_as`. Returns an invalid descriptor where the filesystem refuses O_DIRECT (EINVAL)
// and sets *refused; other failures are errors.
Status OpenDirect(int dir_fd, const std::string& name, const std::string& path, int access,
                  const struct stat& same_as, UniqueFd* out, bool* refused) {
  *refused = false;
  int fd = ::openat(dir_fd, name.c_str(), access | O_DIRECT | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    int err = errno;
    if (err == EINVAL) {
      *refused = true;
      return Status::OK();
    }
    return ErrnoStatus("open (O_DIRECT)", path, err);
  }
  UniqueFd direct(fd);
  struct stat st;
  if (::fstat(direct.get(), &st) != 0) return ErrnoStatus("fstat", path, errno);
  // Replaced between the two opens (another process renamed over it): use buffered I/O only.
  if (st.st_dev != same_as.st_dev || st.st_ino != same_as.st_ino) return Status::OK();
  *out = std::move(direct);
  return Status::OK();
}

// Positional I/O on a buffered descriptor and an optional O_DIRECT descriptor of the same file.
// Requests go to the direct descriptor when their address and offset are aligned and at least
// one aligned block remains; EINVAL from the direct descriptor turns direct I/O off for the file.
class DualDescriptorIo {
 public:
  void Init(UniqueFd buffered, UniqueFd direct) {
    buffered_ = std::move(buffered);
    direct_ = std::move(direct);
    direct_enabled_.store(direct_.valid(), std::memory_order_relaxed);
  }

  void SetDirect(UniqueFd direct) {
    direct_ = std::move(direct);
    direct_enabled_.store(direct_.valid(), std::memory_order_relaxed);
  }

  int buffered_fd() const { return buffered_.get(); }
  bool direct_enabled() const { return direct_enabled_.load(std::memory_order_relaxed); }
  UniqueFd& buffered() { return buffered_; }
  UniqueFd& direct() { return direct_; }

  // Transfers n bytes at `offset`; returns 0, an errno, or -1 for end of file (reads only).
  template <bool kWrite, typename Ptr>
  int Transfer(Ptr p, size_t n, uint64_t offset) {
    while (n > 0) {
      const bool direct = direct_enabled() && n >= kDirectIOAlignment && IsAligned(p, offset);
      size_t chunk = std::min(n, kMaxIoBytes);
      if (direct) chunk &= ~static_cast<size_t>(kAlignMask);
      const int fd = direct ? direct_.get() : buffered_.get();
      ssize_t r;
      if constexpr (kWrite) {
        r = ::pwrite(fd, p, chunk, static_cast<off_t>(offset));
      } else {
        r = ::pread(fd, p, chunk, static_cast<off_t>(offset));
      }
      if (r < 0) {
        int err = errno;
        if (err == EINTR) continue;
        if (direct && err == EINVAL) {
          // The filesystem accepted O_DIRECT at open but refuses this transfer (e.g. a logical
          // block size above kDirectIOAlignment): use the page cache from now on.
          direct_enabled_.store(false, std::memory_order_relaxed);
          continue;
        }
        return err;
      }
      if (r == 0) {
        if (!kWrite) return -1;
        return EIO;  // a regular file that accepts no bytes at all: treat as an I/O error
      }
      p += r;
      offset += static_cast<uint64_t>(r);
      n -= static_cast<size_t>(r);
    }
    return 0;
  }

 private:
  UniqueFd buffered_;
  UniqueFd direct_;
  std::atomic<bool> direct_enabled_{false};
};

class PosixWritableObject final : public WritableObject {
 public:
  // `tmp_fd` is the created temporary file, registered in LiveTemporaries under `tmp_stat`.
  PosixWritableObject(std::string path, std::string dir_path, UniqueFd dir_fd,
                      std::string base_name, std::string tmp_name, UniqueFd tmp_fd,
                      const struct stat& tmp_stat, SyncHook sync_hook)
      : path_(std::move(path)),
        dir_path_(std::move(dir_path)),
        tmp_path_(JoinPath(dir_path_, tmp_name)),
        base_name_(std::move(base_name)),
        tmp_name_(std::move(tmp_name)),
        dir_fd_(std::move(dir_fd)),
        tmp_dev_(tmp_stat.st_dev),
        tmp_ino_(tmp_stat.st_ino),
        sync_hook_(std::move(sync_hook)) {
    io_.Init(std::move(tmp_fd), UniqueFd());
  }

  ~PosixWritableObject() override { Abort(); }

  // Second half of Create: the O_DIRECT descriptor and the preallocation. On failure the caller
  // destroys the object, which removes the temporary file.
  Status Setup(bool use_direct_io, uint64_t size_hint, bool* direct_refused) {
    *direct_refused = false;
    struct stat st = {};
    st.st_dev = tmp_dev_;
    st.st_ino = tmp_ino_;
    if (use_direct_io) {
      UniqueFd direct;
      SP_RETURN_IF_ERROR(
          OpenDirect(dir_fd_.get(), tmp_name_, tmp_path_, O_WRONLY, st, &direct, direct_refused));
      io_.SetDirect(std::move(direct));
    }
    if (size_hint > 0) {
      if (size_hint > static_cast<uint64_t>(INT64_MAX)) {
        return InvalidArgument(path_ + ": size hint " + std::to_string(size_hint) + " too large");
      }
      int rc;
      do {
        rc = ::fallocate(io_.buffered_fd(), 0, 0, static_cast<off_t>(size_hint));
      } while (rc != 0 && errno == EINTR);
      if (rc != 0) {
        int err = errno;
        if (err != EOPNOTSUPP && err != ENOSYS) {
          return ErrnoStatus("fallocate of " + std::to_string(size_hint) + " bytes", tmp_path_,
                             err);
        }
      } else {
        preallocated_ = size_hint;
      }
    }
    return Status::OK();
  }

  Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    if (state_.load(std::memory_order_acquire) != State::kWriting) return NotWritable();
    if (data.size() > static_cast<uint64_t>(INT64_MAX) ||
        offset > static_cast<uint64_t>(INT64_MAX) - data.size()) {
      return RecordFailure(InvalidArgument(tmp_path_ + ": write of " + std::to_string(data.size()) +
                                           " bytes at offset " + std::to_string(offset) +
                                           " exceeds the file size limit"));
    }
    int err = io_.Transfer<true>(data.data(), data.size(), offset);
    if (err != 0) {
      return RecordFailure(ErrnoStatus(
          "pwrite of " + std::to_string(data.size()) + " bytes at offset " + std::to_string(offset),
          tmp_path_, err));
    }
    if (data.empty()) return Status::OK();
    const uint64_t end = offset + data.size();
    uint64_t seen = written_end_.load(std::memory_order_relaxed);
    while (seen < end && !written_end_.compare_exchange_weak(seen, end)) {
    }
    return Status::OK();
  }

  Status Publish() override { return PublishAs(/*exclusive=*/false); }
  Status PublishIfAbsent() override { return PublishAs(/*exclusive=*/true); }

  // Publish (replacing) or PublishIfAbsent (exclusive).
  Status PublishAs(bool exclusive) {
    if (state_.load(std::memory_order_acquire) != State::kWriting) return NotWritable();
    {
      std::lock_guard<std::mutex> lock(failure_mu_);
      if (!failure_.ok()) {
        Status s = failure_.WithContext("not publishing " + path_ + " after a failed write");
        Abort();
        return s;
      }
    }
    const uint64_t end = written_end_.load();
    if (preallocated_ > end && ::ftruncate(io_.buffered_fd(), static_cast<off_t>(end)) != 0) {
      return Fail(ErrnoStatus("ftruncate to " + std::to_string(end) + " bytes", tmp_path_, errno));
    }
    // Never retried: after a failed fsync the kernel may have dropped the dirty pages, and a
    // second fsync would report success for data that is gone.
    SP_KILL_POINT("posix.publish.before_fsync");
    if (int err = Fsync(PosixPublishSync::kFile, io_.buffered_fd()); err != 0) {
      return Fail(ErrnoStatus("fsync", tmp_path_, err));
    }
    io_.direct().Reset();
    if (int err = io_.buffered().Close(); err != 0) {
      return Fail(ErrnoStatus("close", tmp_path_, err));
    }
    SP_KILL_POINT("posix.publish.before_rename");
    if (exclusive) {
      SP_RETURN_IF_ERROR(RenameNoReplace());
    } else if (::renameat(dir_fd_.get(), tmp_name_.c_str(), dir_fd_.get(), base_name_.c_str()) !=
               0) {
      return Fail(ErrnoStatus("rename to " + path_, tmp_path_, errno));
    }
    LiveTemporaries::Get().Remove(tmp_dev_, tmp_ino_);
    // From here on the object is published: its name shows the new data to every reader, and
    // may already have been replaced by another writer's equal object (two committers of one
    // COMMIT). Nothing below may unlink it.
    state_.store(State::kPublished, std::memory_order_release);
    SP_KILL_POINT("posix.publish.before_dir_fsync");
    const int err = Fsync(PosixPublishSync::kDirectory, dir_fd_.get());
    dir_fd_.Reset();
    if (err != 0) {
      // The rename may not survive a power loss: report it, as an I/O error whatever the errno
      // (ENOSPC would read as "not written"), and leave the object in place. The caller must
      // not report it durable; writing it again (or any later successful fsync of this
      // directory) makes the name durable.
      const Status s = ErrnoStatus("fsync", dir_path_, err);
      return IOError(s.message())
          .WithContext("publishing " + path_ + " (visible, but it may not survive a power loss)");
    }
    return Status::OK();
  }

  void Abort() override {
    State writing = State::kWriting;
    if (!state_.compare_exchange_strong(writing, State::kAborted)) return;  // published: keep it
    io_.direct().Reset();
    io_.buffered().Reset();
    // A temporary that cannot be unlinked here (e.g. EIO) stays behind under its ".tmp." name:
    // it is never listed, and RemoveLeftovers() deletes it once it is no longer registered.
    ::unlinkat(dir_fd_.get(), tmp_name_.c_str(), 0);
    LiveTemporaries::Get().Remove(tmp_dev_, tmp_ino_);
    dir_fd_.Reset();
  }

 private:
  enum class State { kWriting, kPublished, kAborted };

  Status NotWritable() const {
    return InvalidArgument(path_ + (state_.load() == State::kPublished
                                        ? ": already published"
                                        : ": write was aborted or failed to publish"));
  }

  Status RecordFailure(Status s) {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.ok()) failure_ = s;
    return s;
  }

  // fsync(fd), or the errno the test hook answers for `sync`. Returns 0 or an errno.
  int Fsync(PosixPublishSync sync, int fd) const {
    if (sync_hook_ != nullptr) {
      if (int err = (*sync_hook_)(sync, path_); err != 0) return err;
    }
    return ::fsync(fd) == 0 ? 0 : errno;
  }

  // Moves the temporary file to the final name unless that name exists (then AlreadyExists and
  // the temporary is removed). On success the final name shows the object.
  Status RenameNoReplace() {
    int err = 0;
    if (sync_hook_ != nullptr) err = (*sync_hook_)(PosixPublishSync::kRenameNoReplace, path_);
    if (err == 0) {
      if (::renameat2(dir_fd_.get(), tmp_name_.c_str(), dir_fd_.get(), base_name_.c_str(),
                      RENAME_NOREPLACE) == 0) {
        return Status::OK();
      }
      err = errno;
    }
    if (err == EEXIST) return Exists();
    if (err != EINVAL && err != ENOSYS) {
      return Fail(ErrnoStatus("rename (RENAME_NOREPLACE) to " + path_, tmp_path_, err));
    }
    // The filesystem refuses the flag: a hard link is exclusive too.
    if (::linkat(dir_fd_.get(), tmp_name_.c_str(), dir_fd_.get(), base_name_.c_str(), 0) != 0) {
      err = errno;
      if (err == EEXIST) return Exists();
      return Fail(ErrnoStatus("link to " + path_, tmp_path_, err));
    }
    // Published. A temporary name that cannot be removed is a leftover (never listed); removing
    // it later removes only that name.
    ::unlinkat(dir_fd_.get(), tmp_name_.c_str(), 0);
    return Status::OK();
  }

  // The name exists: another writer published it, perhaps without a directory fsync yet (it may
  // be between its rename and its fsync, or its fsync failed). Sync the directory, so that the
  // object this answer reports is durable like one this writer published, then fail.
  Status Exists() {
    if (int err = Fsync(PosixPublishSync::kDirectory, dir_fd_.get()); err != 0) {
      const Status s = ErrnoStatus("fsync", dir_path_, err);
      return Fail(
          IOError(s.message())
              .WithContext(path_ +
                           " already exists (not replaced), but it may not survive a power loss"));
    }
    return Fail(AlreadyExists(path_ + ": already exists (not replaced)"));
  }

  // Publish failed: remove the temporary file, return `s`.
  Status Fail(Status s) {
    Abort();
    return s;
  }

  const std::string path_;       // final path, for messages
  const std::string dir_path_;   // its directory
  const std::string tmp_path_;   // the temporary file
  const std::string base_name_;  // final name within the directory
  const std::string tmp_name_;   // temporary name within the directory
  UniqueFd dir_fd_;
  DualDescriptorIo io_;
  const dev_t tmp_dev_;
  const ino_t tmp_ino_;
  const SyncHook sync_hook_;
  uint64_t preallocated_ = 0;
  std::atomic<uint64_t> written_end_{0};
  std::atomic<State> state_{State::kWriting};
  std::mutex failure_mu_;
  Status failure_;
};

class PosixReadableObject final : public ReadableObject {
 public:
  PosixReadableObject(std::string path, UniqueFd fd, UniqueFd direct_fd, uint64_t size)
      : path_(std::move(path)), size_(size) {
    io_.Init(std::move(fd), std::move(direct_fd));
  }

  uint64_t size() const override { return size_; }

  Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
    if (offset > size_ || dst.size() > size_ - offset) return Truncated(offset, dst.size(), size_);
    int err = io_.Transfer<false>(dst.data(), dst.size(), offset);
    if (err == -1) {
      // The file shrank after it was opened.
      struct stat st;
      uint64_t now = ::fstat(io_.buffered_fd(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
      return Truncated(offset, dst.size(), now);
    }
    if (err != 0) {
      return ErrnoStatus(
          "pread of " + std::to_string(dst.size()) + " bytes at offset " + std::to_string(offset),
          path_, err);
    }
    return Status::OK();
  }

 private:
  Status Truncated(uint64_t offset, size_t n, uint64_t size) const {
    return Corruption(path_ + ": truncated: wanted " + std::to_string(n) + " bytes at offset " +
                      std::to_string(offset) + ", object has " + std::to_string(size) + " bytes");
  }

  const std::string path_;
  const uint64_t size_;
  // Transfer() only changes the direct-I/O switch, which is atomic.
  mutable DualDescriptorIo io_;
};

// Creates every missing directory of the absolute path `dir`, fsyncing the parent of each.
Status MakeRootDirectories(const std::string& dir) {
  std::string path;
  size_t pos = 0;
  while (pos < dir.size()) {
    size_t next = dir.find('/', pos + 1);
    if (next == std::string::npos) next = dir.size();
    std::string parent = path.empty() ? "/" : path;
    path = dir.substr(0, next);
    pos = next;
    if (::mkdir(path.c_str(), 0755) == 0) {
      UniqueFd pfd(::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      if (!pfd.valid()) return ErrnoStatus("open", parent, errno);
      if (::fsync(pfd.get()) != 0) return ErrnoStatus("fsync", parent, errno);
      continue;
    }
    int err = errno;
    struct stat st;
    if (err == EEXIST || ::stat(path.c_str(), &st) == 0) continue;  // checked by the caller
    return ErrnoStatus("mkdir", path, err);
  }
  return Status::OK();
}

class PosixStorage final : public Storage {
 public:
  PosixStorage(std::string root, PosixStorageOptions options, SyncHook sync_hook)
      : root_(std::move(root)),
        uri_("file://" + root_),
        options_(options),
        sync_hook_(std::move(sync_hook)) {}

  const std::string& uri() const override { return uri_; }

  StorageCapabilities capabilities() const override {
    StorageCapabilities caps;
    caps.atomic_rename = true;
    caps.direct_io = options_.use_direct_io && !direct_refused_.load(std::memory_order_relaxed);
    caps.durable = true;
    caps.requests_end_with_process = true;
    return caps;
  }

  std::string Describe(std::string_view name) const override { return JoinPath(root_, name); }

  Result<std::unique_ptr<WritableObject>> Create(std::string_view name,
                                                 uint64_t size_hint) override {
    SP_RETURN_IF_ERROR(ValidateObjectName(name));
    const std::string path = Describe(name);
    auto [dir_rel, base] = SplitName(name);
    const std::string dir_path = Describe(dir_rel);
    for (int attempt = 0;; ++attempt) {
      UniqueFd dir_fd;
      SP_RETURN_IF_ERROR(OpenDirectory(dir_rel, /*create=*/true, &dir_fd));
      std::string tmp_name = std::string(base) + std::string(kTmpInfix) + internal::RandomHex16();
      int err = 0;
      UniqueFd fd;
      struct stat st;
      {
        std::shared_lock<std::shared_mutex> lock(LiveTemporaries::Get().sweep_mu());
        fd = UniqueFd(::openat(dir_fd.get(), tmp_name.c_str(),
                               O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644));
        if (!fd.valid()) {
          err = errno;
        } else if (::fstat(fd.get(), &st) != 0) {
          err = errno;
          fd.Reset();
          ::unlinkat(dir_fd.get(), tmp_name.c_str(), 0);
          return ErrnoStatus("fstat", JoinPath(dir_path, tmp_name), err);
        } else {
          LiveTemporaries::Get().Add(st.st_dev, st.st_ino);
        }
      }
      if (fd.valid()) {
        auto object = std::make_unique<PosixWritableObject>(path, dir_path, std::move(dir_fd),
                                                            std::string(base), std::move(tmp_name),
                                                            std::move(fd), st, sync_hook_);
        bool refused = false;
        const bool try_direct =
            options_.use_direct_io && !direct_refused_.load(std::memory_order_relaxed);
        Status s = object->Setup(try_direct, size_hint, &refused);
        if (refused) direct_refused_.store(true, std::memory_order_relaxed);
        if (!s.ok()) return s;  // `object` removes its temporary file
        return std::unique_ptr<WritableObject>(std::move(object));
      }
      // EEXIST: the random name collided. ENOENT: a concurrent Delete() removed the (empty)
      // directory after we opened it. Both are retried with a fresh name and directory.
      if ((err == EEXIST || err == ENOENT) && attempt + 1 < kCreateAttempts) continue;
      return ErrnoStatus("open (O_CREAT|O_EXCL)", JoinPath(dir_path, tmp_name), err);
    }
  }

  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    SP_ASSIGN_OR_RETURN(ObjectDirectory at, OpenObjectDirectory(name));
    const std::string& path = at.path;
    if (at.status.code() == StatusCode::kNotFound) return ErrnoStatus("open", path, ENOENT);
    if (at.blocked) return NotFound(path + ": no such object (" + at.status.message() + ")");
    SP_RETURN_IF_ERROR(at.status);
    const std::string& base_name = at.base;
    const UniqueFd& dir_fd = at.fd;
    // O_NONBLOCK so that a FIFO planted in the tree cannot block us; cleared below.
    UniqueFd fd(
        ::openat(dir_fd.get(), base_name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
    if (!fd.valid()) {
      int err = errno;
      if (err == ELOOP) {
        return NotFound(path + ": is a symbolic link, which storage does not follow");
      }
      return ErrnoStatus("open", path, err);
    }
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("fstat", path, errno);
    if (!S_ISREG(st.st_mode)) {
      return NotFound(path + (S_ISDIR(st.st_mode) ? ": is a directory, not an object"
                                                  : ": is not a regular file"));
    }
    if (::fcntl(fd.get(), F_SETFL, 0) != 0) return ErrnoStatus("fcntl(F_SETFL)", path, errno);
    UniqueFd direct;
    if (options_.use_direct_io && !direct_refused_.load(std::memory_order_relaxed)) {
      bool refused = false;
      SP_RETURN_IF_ERROR(
          OpenDirect(dir_fd.get(), base_name, path, O_RDONLY, st, &direct, &refused));
      if (refused) direct_refused_.store(true, std::memory_order_relaxed);
    }
    return std::unique_ptr<ReadableObject>(std::make_unique<PosixReadableObject>(
        path, std::move(fd), std::move(direct), static_cast<uint64_t>(st.st_size)));
  }

  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    SP_RETURN_IF_ERROR(ValidateObjectPrefix(prefix));
    std::vector<ObjectInfo> out;
    SP_RETURN_IF_ERROR(Walk(prefix, [&](int dir_fd, const std::string& file_name,
                                        const std::string& rel, const struct stat& st) {
      // Temporaries and files that could not have been written through this interface (and
      // could not be opened through it) are not objects.
      if (rel.find(kTmpInfix) != std::string::npos || !ValidateObjectName(rel).ok()) {
        return Status::OK();
      }
      out.push_back(ObjectInfo{rel, static_cast<uint64_t>(st.st_size), MtimeNs(st)});
      return Status::OK();
    }));
    std::sort(out.begin(), out.end(),
              [](const ObjectInfo& a, const ObjectInfo& b) { return a.name < b.name; });
    return out;
  }

  Status Delete(std::string_view name) override {
    SP_ASSIGN_OR_RETURN(ObjectDirectory at, OpenObjectDirectory(name));
    if (at.status.code() == StatusCode::kNotFound || at.blocked) return Status::OK();  // none
    SP_RETURN_IF_ERROR(at.status);
    if (::unlinkat(at.fd.get(), at.base.c_str(), 0) != 0) {
      int err = errno;
      if (err == ENOENT) return Status::OK();
      return ErrnoStatus("unlink", at.path, err);
    }
    if (::fsync(at.fd.get()) != 0) return ErrnoStatus("fsync", Describe(at.dir_rel), errno);
    at.fd.Reset();
    // Remove the directories that this made empty, deepest first, never the root.
    std::string_view dir = at.dir_rel;
    while (!dir.empty()) {
      auto [parent_rel, leaf] = SplitName(dir);
      UniqueFd parent_fd;
      Status ps = OpenDirectory(parent_rel, /*create=*/false, &parent_fd);
      if (ps.code() == StatusCode::kNotFound) break;
      SP_RETURN_IF_ERROR(ps);
      if (::unlinkat(parent_fd.get(), std::string(leaf).c_str(), AT_REMOVEDIR) != 0) {
        int err = errno;
        // Not empty (another object, or a writer's temporary) or already gone: done.
        if (err == ENOTEMPTY || err == EEXIST || err == ENOENT || err == EBUSY) break;
        return ErrnoStatus("rmdir", Describe(dir), err);
      }
      if (::fsync(parent_fd.get()) != 0) {
        return ErrnoStatus("fsync", Describe(parent_rel), errno);
      }
      dir = parent_rel;
    }
    return Status::OK();
  }

  Result<size_t> RemoveLeftovers(std::string_view prefix,
                                 const LeftoverFilter& remove_if) override {
    SP_RETURN_IF_ERROR(ValidateObjectPrefix(prefix));
    size_t removed = 0;
    LiveTemporaries& live = LiveTemporaries::Get();
    SP_RETURN_IF_ERROR(Walk(prefix, [&](int dir_fd, const std::string& file_name,
                                        const std::string& rel, const struct stat&) {
      if (!IsTemporaryName(file_name)) return Status::OK();
      if (remove_if && !remove_if(std::string_view(rel).substr(0, rel.rfind(kTmpInfix)))) {
        return Status::OK();
      }
      std::unique_lock<std::shared_mutex> lock(live.sweep_mu());
      struct stat st;  // again, under the lock: the walk's stat may be stale
      if (::fstatat(dir_fd, file_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) return Status::OK();
        return ErrnoStatus("stat", Describe(rel), errno);
      }
      if (!S_ISREG(st.st_mode) || live.Contains(st.st_dev, st.st_ino)) return Status::OK();
      SP_KILL_POINT("store.cleanup.before_remove");
      if (::unlinkat(dir_fd, file_name.c_str(), 0) != 0) {
        if (errno == ENOENT) return Status::OK();
        return ErrnoStatus("unlink", Describe(rel), errno);
      }
      ++removed;
      return Status::OK();
    }));
    return removed;
  }

 private:
  using FileVisitor = std::function<Status(int dir_fd, const std::string& file_name,
                                           const std::string& rel, const struct stat& st)>;

  // Where object `name` lives: its directory, opened without creating anything (`status`:
  // NotFound when missing; `blocked` as for OpenDirectory), and its file name there.
  struct ObjectDirectory {
    std::string path;          // the object's full path, for messages
    std::string_view dir_rel;  // the directory, relative to the root (a view into the name)
    std::string base;          // the file name within it
    UniqueFd fd;
    bool blocked = false;
    Status status;
  };
  // InvalidArgument for an invalid name; every other outcome is in the result.
  Result<ObjectDirectory> OpenObjectDirectory(std::string_view name) const {
    SP_RETURN_IF_ERROR(ValidateObjectName(name));
    ObjectDirectory at;
    at.path = Describe(name);
    const auto [dir_rel, base] = SplitName(name);
    at.dir_rel = dir_rel;
    at.base = std::string(base);
    at.status = OpenDirectory(dir_rel, /*create=*/false, &at.fd, &at.blocked);
    return at;
  }

  // Opens the directory `rel` ("" for the root) below the root without following symlinks,
  // creating missing components when `create`. NotFound when a component is missing. When a
  // component exists but is not a directory (a file, or a symlink, which is not followed), the
  // error is IOError and *blocked, if given, is set.
  Status OpenDirectory(std::string_view rel, bool create, UniqueFd* out,
                       bool* blocked = nullptr) const {
    if (blocked != nullptr) *blocked = false;
    UniqueFd cur(::open(root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!cur.valid()) return ErrnoStatus("open", root_, errno);
    std::string path = root_;
    std::string_view rest = rel;
    while (!rest.empty()) {
      const size_t slash = rest.find('/');
      const std::string component(rest.substr(0, slash));
      rest = slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
      const std::string parent_path = path;
      path = JoinPath(path, component);
      int fd = -1;
      for (int attempt = 0; attempt < 2; ++attempt) {
        fd =
            ::openat(cur.get(), component.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0 || errno != ENOENT || !create || attempt > 0) break;
        if (::mkdirat(cur.get(), component.c_str(), 0755) != 0 && errno != EEXIST) {
          return ErrnoStatus("mkdir", path, errno);
        }
        // Also after EEXIST: the thread that created it may not have fsynced the parent yet,
        // and no object may be published before its directory entry is durable.
        if (::fsync(cur.get()) != 0) return ErrnoStatus("fsync", parent_path, errno);
      }
      if (fd < 0) {
        const int err = errno;
        if (err == ENOTDIR || err == ELOOP) {
          if (blocked != nullptr) *blocked = true;
          struct stat st;
          if (::fstatat(cur.get(), component.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
              S_ISLNK(st.st_mode)) {
            return ErrnoStatus("open (symbolic links below the storage root are not followed)",
                               path, ELOOP);
          }
        }
        return ErrnoStatus("open directory", path, err);
      }
      cur = UniqueFd(fd);
    }
    *out = std::move(cur);
    return Status::OK();
  }

  // Calls `visit` for every regular file below the root whose relative name starts with
  // `prefix`, starting at the directory the prefix names. Symlinks are skipped; entries that
  // vanish during the walk are skipped. A missing start directory yields nothing.
  Status Walk(std::string_view prefix, const FileVisitor& visit) const {
    size_t slash = prefix.rfind('/');
    std::string_view start = slash == std::string_view::npos ? "" : prefix.substr(0, slash);
    UniqueFd dir_fd;
    bool blocked = false;
    Status s = OpenDirectory(start, /*create=*/false, &dir_fd, &blocked);
    // Missing, or a file or symlink where the prefix needs a directory: nothing below it.
    if (s.code() == StatusCode::kNotFound || blocked) return Status::OK();
    SP_RETURN_IF_ERROR(s);
    std::string rel_dir(start);
    if (!rel_dir.empty()) rel_dir += '/';
    return WalkDirectory(std::move(dir_fd), rel_dir, prefix, visit);
  }

  // `rel_dir` is the directory's relative name with a trailing '/' ("" for the root).
  Status WalkDirectory(UniqueFd fd, const std::string& rel_dir, std::string_view prefix,
                       const FileVisitor& visit) const {
    const std::string dir_path =
        Describe(std::string_view(rel_dir).substr(0, rel_dir.empty() ? 0 : rel_dir.size() - 1));
    UniqueDir dir(::fdopendir(fd.get()));
    if (!dir) return ErrnoStatus("opendir", dir_path, errno);  // `fd` still closes it
    // The stream owns the descriptor now (closedir closes it); `dfd` stays valid while it is open.
    const int dfd = fd.Release();
    while (true) {
      errno = 0;
      const struct dirent* entry = ::readdir(dir.get());
      if (entry == nullptr) {
        if (errno != 0) return ErrnoStatus("readdir", dir_path, errno);
        break;
      }
      const std::string file_name(entry->d_name);
      if (file_name == "." || file_name == "..") continue;
      const std::string rel = rel_dir + file_name;
      const std::string rel_as_dir = rel + '/';
      // A directory is walked when it can contain a match, a file visited when it matches.
      const bool dir_may_match = rel_as_dir.starts_with(prefix) || prefix.starts_with(rel_as_dir);
      const bool file_matches = std::string_view(rel).starts_with(prefix);
      switch (entry->d_type) {
        case DT_DIR:
          if (!dir_may_match) continue;
          break;
        case DT_REG:
          if (!file_matches) continue;
          break;
        case DT_UNKNOWN:  // the filesystem does not say: ask stat below
          break;
        default:  // symlinks, devices, FIFOs, sockets: never objects, never followed
          continue;
      }
      struct stat st;
      if (::fstatat(dfd, file_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) continue;  // removed during the walk
        return ErrnoStatus("stat", Describe(rel), errno);
      }
      if (S_ISDIR(st.st_mode) && dir_may_match) {
        UniqueFd child(
            ::openat(dfd, file_name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        if (!child.valid()) {
          const int err = errno;
          if (err == ENOENT || err == ENOTDIR || err == ELOOP) continue;  // replaced under us
          return ErrnoStatus("open directory", Describe(rel), err);
        }
        SP_RETURN_IF_ERROR(WalkDirectory(std::move(child), rel_as_dir, prefix, visit));
      } else if (S_ISREG(st.st_mode) && file_matches) {
        SP_RETURN_IF_ERROR(visit(dfd, file_name, rel, st));
      }
    }
    return Status::OK();
  }

  const std::string root_;  // absolute, normalised, no trailing '/' (except "/")
  const std::string uri_;
  const PosixStorageOptions options_;
  const SyncHook sync_hook_;
  mutable std::atomic<bool> direct_refused_{false};
};

Result<std::unique_ptr<Storage>> OpenPosixStorage(std::string root, PosixStorageOptions options,
                                                  SyncHook sync_hook) {
  if (root.empty()) return InvalidArgument("empty storage root path");
  if (root.find('\0') != std::string::npos) {
    return InvalidArgument("storage root path contains a NUL byte");
  }
  if (root.front() != '/') {
    std::string cwd(PATH_MAX, '\0');
    if (::getcwd(cwd.data(), cwd.size()) == nullptr) {
      return ErrnoStatus("getcwd (to resolve the relative storage root)", root, errno);
    }
    cwd.resize(std::strlen(cwd.c_str()));
    root = JoinPath(cwd, root);
  }
  root = std::filesystem::path(root).lexically_normal().string();
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  if (options.create) SP_RETURN_IF_ERROR(MakeRootDirectories(root));
  struct stat st;
  if (::stat(root.c_str(), &st) != 0) return ErrnoStatus("stat (storage root)", root, errno);
  if (!S_ISDIR(st.st_mode)) return InvalidArgument(root + ": storage root is not a directory");
  return std::unique_ptr<Storage>(
      std::make_unique<PosixStorage>(std::move(root), options, std::move(sync_hook)));
}

}  // namespace

Result<std::unique_ptr<Storage>> NewPosixStorage(std::string root, PosixStorageOptions options) {
  return OpenPosixStorage(std::move(root), options, nullptr);
}

namespace internal {

Result<std::unique_ptr<Storage>> NewPosixStorageWithSyncHook(std::string root,
                                                             PosixStorageOptions options,
                                                             PosixPublishSyncHook hook) {
  return OpenPosixStorage(std::move(root), options,
                          std::make_shared<const PosixPublishSyncHook>(std::move(hook)));
}

}  // namespace internal

}  // namespace safepoint
