// Staging files in shared memory (stage_file.h).
#include "shm/stage_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <vector>

#include "base/bytes.h"
#include "base/parallel.h"
#include "base/process.h"
#include "base/random.h"
#include "base/unique_fd.h"

namespace safepoint::internal {

namespace {

constexpr char kSuffix[] = ".buf";

std::string StageFileName(const ProcessId& owner) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%u-%llu-", owner.pid,
                static_cast<unsigned long long>(owner.start_ticks));
  return buf + RandomHex16() + kSuffix;
}

// The owner named by a staging file's name; nullopt for any other name.
std::optional<ProcessId> OwnerOf(const char* name) {
  unsigned pid = 0;
  unsigned long long ticks = 0;
  char hex[17] = {};
  int consumed = 0;
  if (std::sscanf(name, "%u-%llu-%16[0-9a-f]%n", &pid, &ticks, hex, &consumed) != 3 ||
      std::strlen(hex) != 16 || std::strcmp(name + consumed, kSuffix) != 0 || pid == 0) {
    return std::nullopt;
  }
  return ProcessId{pid, ticks};
}

// Opens the staging directory (creating it when `create`): a directory of this user that no
// one else may enter, never a symlink.
Status OpenStageDirectory(const std::string& shm_dir, bool create, UniqueFd* out) {
  const std::string dir = StageDirectory(shm_dir);
  if (create && ::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    if (errno == ENOENT) return NotFound(shm_dir + ": the shared-memory directory does not exist");
    return ErrnoStatus("mkdir", dir, errno);
  }
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) return ErrnoStatus("open", dir, errno);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("stat", dir, errno);
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    return InvalidArgument(dir + ": not a private directory of this user (owner " +
                           std::to_string(st.st_uid) + ", mode " +
                           std::to_string(st.st_mode & 0777) + "); refusing to use it");
  }
  *out = std::move(fd);
  return Status::OK();
}

}  // namespace

std::string StageDirectory(const std::string& shm_dir) {
  return shm_dir + "/safepoint-stage-" + std::to_string(::geteuid());
}

Result<std::unique_ptr<StageFile>> StageFile::Create(const std::string& shm_dir, uint64_t size) {
  UniqueFd dir;
  SP_RETURN_IF_ERROR(OpenStageDirectory(shm_dir, /*create=*/true, &dir));
  const std::string name = StageFileName(SelfProcessId());
  auto f = std::unique_ptr<StageFile>(new StageFile());
  f->path_ = StageDirectory(shm_dir) + "/" + name;
  f->size_ = size;
  f->map_size_ = std::max<uint64_t>(size, 1);
  UniqueFd fd(
      ::openat(dir.get(), name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd) return ErrnoStatus("create", f->path_, errno);
  auto fail = [&](Status s) {
    ::unlinkat(dir.get(), name.c_str(), 0);
    return s;
  };
  if (::fallocate(fd.get(), 0, 0, static_cast<off_t>(f->map_size_)) != 0) {
    if (errno == ENOSPC) {
      return fail(ResourceExhausted(f->path_ + ": no room for a staging buffer of " +
                                    std::to_string(size) + " bytes (" + HumanBytes(size) +
                                    ") in shared memory; enlarge /dev/shm or point shm_dir / "
                                    "SAFEPOINT_SHM_DIR at a larger tmpfs"));
    }
    if (errno != EOPNOTSUPP) return fail(ErrnoStatus("fallocate", f->path_, errno));
    if (::ftruncate(fd.get(), static_cast<off_t>(f->map_size_)) != 0) {
      return fail(ErrnoStatus("ftruncate", f->path_, errno));
    }
  }
  void* p = ::mmap(nullptr, f->map_size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return fail(ErrnoStatus("mmap", f->path_, errno));
  f->map_ = static_cast<std::byte*>(p);
  // Pre-fault: every page written once now, so that staging copies land in warm pages.
  constexpr uint64_t kPiece = 64 << 20;
  ParallelFor((f->map_size_ + kPiece - 1) / kPiece, DefaultCpuThreads(), [&](size_t i) {
    std::byte* begin = f->map_ + i * kPiece;
    std::fill(begin, begin + std::min(kPiece, f->map_size_ - i * kPiece), std::byte{0});
  });
  return f;
}

StageFile::~StageFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

Status StageFile::Remove() {
  if (removed_) return Status::OK();
  if (::unlink(path_.c_str()) != 0 && errno != ENOENT) return ErrnoStatus("unlink", path_, errno);
  removed_ = true;
  return Status::OK();
}

Result<StageFilesRemoved> RemoveDeadStageFiles(const std::string& shm_dir, bool dry_run) {
  StageFilesRemoved out;
  UniqueFd dir;
  Status s = OpenStageDirectory(shm_dir, /*create=*/false, &dir);
  if (s.code() == StatusCode::kNotFound) return out;  // no staging file was ever made here
  SP_RETURN_IF_ERROR(s);
  const std::string dir_path = StageDirectory(shm_dir);
  UniqueFd listing_fd(::dup(dir.get()));
  if (!listing_fd) return ErrnoStatus("dup", dir_path, errno);
  UniqueDir listing(::fdopendir(listing_fd.get()));
  if (!listing) return ErrnoStatus("opendir", dir_path, errno);
  (void)listing_fd.Release();  // now owned by `listing`
  std::vector<std::string> dead;
  while (dirent* e = ::readdir(listing.get())) {
    const auto owner = OwnerOf(e->d_name);
    if (owner && !ProcessAlive(*owner)) dead.emplace_back(e->d_name);
  }
  for (const std::string& name : dead) {
    struct stat st;
    if (::fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (!dry_run && ::unlinkat(dir.get(), name.c_str(), 0) != 0) {
      if (errno == ENOENT) continue;  // another gc was faster
      return ErrnoStatus("unlink", dir_path + "/" + name, errno);
    }
    ++out.files;
    out.bytes += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return out;
}

}  // namespace safepoint::internal
