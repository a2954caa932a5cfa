// POSIX-specific tests of PosixStorage, beyond the conformance suite: the files on disk (no
// temporary left after a failed or aborted write), RemoveLeftovers against live writers, symlinks
// inside the root, names that try to escape it, O_DIRECT on tmpfs and its fallback where the
// filesystem refuses it, and ENOSPC on a real, tiny filesystem (tests that need to mount one
// skip themselves where mounting is not permitted).
#include "storage/posix/posix_storage.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "safepoint/storage.h"
#include "testing/test_util.h"

namespace safepoint::posix_storage_test {
namespace {

namespace fs = std::filesystem;

using test::AlignedTestBuffer;
using test::PatternBytes;
using test::ReadWholeObject;
using test::TempDir;

// A filesystem of type `type` mounted on a fresh directory, unmounted at the end. ok() is false
// (with the reason) where mounting is not permitted, e.g. in an unprivileged container.
class ScopedMount {
 public:
  ScopedMount(const char* type, const char* options) {
    if (dir_.path().empty()) {
      reason_ = "mkdtemp failed";
      return;
    }
    if (::mount(type, dir_.path().c_str(), type, 0, options) != 0) {
      reason_ = std::string("mount -t ") + type + (options ? std::string(" -o ") + options : "") +
                " failed: " + std::strerror(errno) + " (needs root / CAP_SYS_ADMIN)";
      return;
    }
    mounted_ = true;
  }
  ~ScopedMount() {
    if (mounted_) ::umount2(dir_.path().c_str(), MNT_DETACH);
  }
  bool ok() const { return mounted_; }
  const std::string& reason() const { return reason_; }
  const std::string& path() const { return dir_.path(); }

 private:
  TempDir dir_;
  bool mounted_ = false;
  std::string reason_;
};

// Every file below `dir` whose name contains ".tmp.", relative to `dir`.
std::vector<std::string> TemporaryFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.find(".tmp.") != std::string::npos) {
      out.push_back(fs::relative(entry.path(), dir).string());
    }
  }
  return out;
}

void WriteFile(const std::string& path, std::string_view content) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << content;
}

std::unique_ptr<Storage> MustOpen(const std::string& root, bool direct = true) {
  PosixStorageOptions options;
  options.use_direct_io = direct;
  auto s = NewPosixStorage(root, options);
  EXPECT_OK(s);
  return s.ok() ? std::move(s).value() : nullptr;
}

TEST(PosixStorageTest, TemporaryFileExistsOnlyWhileWriting) {
  TempDir dir("safepoint-posix-test");
  auto storage = MustOpen(dir.path());
  ASSERT_NE(storage, nullptr);

  // Published: the temporary is renamed into place.
  {
    auto w = storage->Create("a/b/obj", 0);
    ASSERT_OK(w);
    ASSERT_OK((*w)->WriteAt(0, PatternBytes(100, 1)));
    auto temps = TemporaryFiles(dir.path());
    ASSERT_EQ(temps.size(), 1u);
    EXPECT_TRUE(temps[0].starts_with("a/b/obj.tmp.")) << temps[0];
    EXPECT_EQ(temps[0].size(), std::string("a/b/obj.tmp.").size() + 16) << temps[0];
    ASSERT_OK((*w)->Publish());
    EXPECT_TRUE(TemporaryFiles(dir.path()).empty());
    EXPECT_EQ(fs::file_size(dir.path() + "/a/b/obj"), 100u);
  }
  // Aborted.
  {
    auto w = storage->Create("a/b/aborted", 1 << 20);
    ASSERT_OK(w);
    ASSERT_OK((*w)->WriteAt(0, PatternBytes(100, 2)));
    EXPECT_EQ(TemporaryFiles(dir.path()).size(), 1u);
    (*w)->Abort();
    EXPECT_TRUE(TemporaryFiles(dir.path()).empty());
  }
  // Destroyed unpublished.
  {
    auto w = storage->Create("c/destroyed", 0);
    ASSERT_OK(w);
    EXPECT_EQ(TemporaryFiles(dir.path()).size(), 1u);
  }
  EXPECT_TRUE(TemporaryFiles(dir.path()).empty());
  // A failed write poisons the object: Publish refuses, and the temporary goes away.
  {
    auto w = storage->Create("c/failed", 0);
    ASSERT_OK(w);
    ASSERT_OK((*w)->WriteAt(0, PatternBytes(100, 3)));
    Status bad = (*w)->WriteAt(UINT64_MAX - 10, PatternBytes(100, 3));
    EXPECT_FALSE(bad.ok());
    Status p = (*w)->Publish();
    EXPECT_FALSE(p.ok());
    EXPECT_NE(p.message().find(dir.path() + "/c/failed"), std::string::npos) << p.ToString();
    EXPECT_TRUE(TemporaryFiles(dir.path()).empty());
    EXPECT_FALSE(fs::exists(dir.path() + "/c/failed"));
  }
}

TEST(PosixStorageTest, PublishedFilesHaveTheWrittenSizeAndMode) {
  TempDir dir("safepoint-posix-test");
  auto storage = MustOpen(dir.path());
  ASSERT_NE(storage, nullptr);
  auto w = storage->Create("obj", 1 << 20);  // preallocated far beyond what is written
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, PatternBytes(10, 4)));
  ASSERT_OK((*w)->Publish());
  struct stat st;
  ASSERT_EQ(::stat((dir.path() + "/obj").c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 10);
  const mode_t mask = ::umask(0);
  ::umask(mask);
  EXPECT_EQ(st.st_mode & 0777, 0644 & ~mask);
}

TEST(PosixStorageTest, RemoveLeftoversSparesLiveWriters) {
  TempDir dir("safepoint-posix-test");
  auto storage = MustOpen(dir.path());
  ASSERT_NE(storage, nullptr);
  // Stale temporaries, as a crashed process leaves them.
  WriteFile(dir.path() + "/step-1/x.tmp.0123456789abcdef", "stale");
  WriteFile(dir.path() + "/y.tmp.fedcba9876543210", "stale");
  // Not temporaries by the naming rule: never removed.
  WriteFile(dir.path() + "/step-1/notes.tmp.txt", "keep");
  WriteFile(dir.path() + "/step-1/z.tmp.0123456789ABCDEF", "keep");
  // A live writer of this process.
  auto live = storage->Create("step-1/live", 0);
  ASSERT_OK(live);
  ASSERT_OK((*live)->WriteAt(0, PatternBytes(100, 5)));
  ASSERT_EQ(TemporaryFiles(dir.path()).size(), 5u);

  // Nothing of this is listed.
  auto list = storage->List("");
  ASSERT_OK(list);
  EXPECT_TRUE(list->empty());

  auto removed = storage->RemoveLeftovers("step-1/");
  ASSERT_OK(removed);
  EXPECT_EQ(*removed, 1u);
  EXPECT_FALSE(fs::exists(dir.path() + "/step-1/x.tmp.0123456789abcdef"));
  EXPECT_TRUE(fs::exists(dir.path() + "/y.tmp.fedcba9876543210"));  // outside the prefix

  removed = storage->RemoveLeftovers("");
  ASSERT_OK(removed);
  EXPECT_EQ(*removed, 1u);
  EXPECT_FALSE(fs::exists(dir.path() + "/y.tmp.fedcba9876543210"));
  EXPECT_TRUE(fs::exists(dir.path() + "/step-1/notes.tmp.txt"));
  EXPECT_TRUE(fs::exists(dir.path() + "/step-1/z.tmp.0123456789ABCDEF"));

  // A second view of the same directory (another Storage object in this process) must not
  // remove the live writer's temporary either.
  auto other = MustOpen(dir.path() + "/./");
  ASSERT_NE(other, nullptr);
  removed = other->RemoveLeftovers("");
  ASSERT_OK(removed);
  EXPECT_EQ(*removed, 0u);

  ASSERT_OK((*live)->Publish());
  auto r = storage->Open("step-1/live");
  ASSERT_OK(r);
  EXPECT_EQ((*r)->size(), 100u);
}

TEST(PosixStorageTest, SymlinksInsideTheRootAreNotFollowed) {
  TempDir dir("safepoint-posix-test");
  const std::string root = dir.path() + "/root";
  const std::string outside = dir.path() + "/outside";
  WriteFile(outside + "/secret", "secret");
  WriteFile(outside + "/x.tmp.0123456789abcdef", "not ours");
  auto storage = MustOpen(root);
  ASSERT_NE(storage, nullptr);
  auto w = storage->Create("real/obj", 0);
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, PatternBytes(10, 6)));
  ASSERT_OK((*w)->Publish());
  fs::create_directory_symlink(outside, root + "/link");
  fs::create_symlink(outside + "/secret", root + "/flink");
  fs::create_directory_symlink(outside, root + "/real/nested-link");

  auto list = storage->List("");
  ASSERT_OK(list);
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name, "real/obj");
  auto below_link = storage->List("link/");
  ASSERT_OK(below_link);
  EXPECT_TRUE(below_link->empty());

  for (std::string_view name : {"link/secret", "flink", "real/nested-link/secret"}) {
    auto r = storage->Open(name);
    ASSERT_FALSE(r.ok()) << name;
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().ToString();
  }
  auto through = storage->Create("link/new", 0);
  ASSERT_FALSE(through.ok());
  EXPECT_NE(through.status().message().find(root + "/link"), std::string::npos)
      << through.status().ToString();
  EXPECT_FALSE(fs::exists(outside + "/new"));
  EXPECT_TRUE(TemporaryFiles(outside).size() == 1);  // only the hand-made one

  ASSERT_OK(storage->Delete("link/secret"));
  EXPECT_TRUE(fs::exists(outside + "/secret"));
  auto removed = storage->RemoveLeftovers("");
  ASSERT_OK(removed);
  EXPECT_EQ(*removed, 0u);
  EXPECT_TRUE(fs::exists(outside + "/x.tmp.0123456789abcdef"));
}

TEST(PosixStorageTest, NamesCannotEscapeTheRoot) {
  TempDir dir("safepoint-posix-test");
  const std::string root = dir.path() + "/root";
  auto storage = MustOpen(root);
  ASSERT_NE(storage, nullptr);
  for (std::string_view name : {"../escape", "a/../../escape", "/tmp/escape", "./../escape"}) {
    auto w = storage->Create(name, 0);
    ASSERT_FALSE(w.ok()) << name;
    EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument) << w.status().ToString();
    EXPECT_EQ(storage->Delete(name).code(), StatusCode::kInvalidArgument);
  }
  EXPECT_FALSE(fs::exists(dir.path() + "/escape"));
  EXPECT_EQ(storage->List("../").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(storage->RemoveLeftovers("../").status().code(), StatusCode::kInvalidArgument);
  // The root is stored absolute and normalised; Describe names the full path.
  auto same = MustOpen(dir.path() + "/root/../root/");
  ASSERT_NE(same, nullptr);
  EXPECT_EQ(same->Describe("a/b"), root + "/a/b");
  EXPECT_EQ(same->uri(), "file://" + root);
}

TEST(PosixStorageTest, DeleteRemovesEmptyParentsButNeverTheRoot) {
  TempDir dir("safepoint-posix-test");
  const std::string root = dir.path() + "/root";
  auto storage = MustOpen(root);
  ASSERT_NE(storage, nullptr);
  for (std::string_view name : {"s/a/b/one", "s/a/two"}) {
    auto w = storage->Create(name, 0);
    ASSERT_OK(w);
    ASSERT_OK((*w)->Publish());
  }
  ASSERT_OK(storage->Delete("s/a/b/one"));
  EXPECT_FALSE(fs::exists(root + "/s/a/b"));
  EXPECT_TRUE(fs::exists(root + "/s/a"));  // still holds "two"
  ASSERT_OK(storage->Delete("s/a/two"));
  EXPECT_FALSE(fs::exists(root + "/s"));
  EXPECT_TRUE(fs::is_directory(root));
  // A directory that holds a writer's temporary is not removed under it.
  auto w = storage->Create("t/pending", 0);
  ASSERT_OK(w);
  {
    auto other = storage->Create("t/other", 0);
    ASSERT_OK(other);
    ASSERT_OK((*other)->Publish());
  }
  ASSERT_OK(storage->Delete("t/other"));
  EXPECT_TRUE(fs::is_directory(root + "/t"));
  ASSERT_OK((*w)->Publish());
  EXPECT_OK(storage->Open("t/pending"));
  // Deleting a directory is not deleting an object.
  EXPECT_FALSE(storage->Delete("t").ok());
}

TEST(PosixStorageTest, RootHandling) {
  TempDir dir("safepoint-posix-test");
  PosixStorageOptions no_create;
  no_create.create = false;
  auto missing = NewPosixStorage(dir.path() + "/missing", no_create);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();
  EXPECT_NE(missing.status().message().find(dir.path() + "/missing"), std::string::npos);

  auto nested = NewPosixStorage(dir.path() + "/x/y/z");
  ASSERT_OK(nested);
  EXPECT_TRUE(fs::is_directory(dir.path() + "/x/y/z"));

  WriteFile(dir.path() + "/file", "x");
  auto not_dir = NewPosixStorage(dir.path() + "/file");
  ASSERT_FALSE(not_dir.ok());
  EXPECT_NE(not_dir.status().message().find(dir.path() + "/file"), std::string::npos);
  EXPECT_EQ(NewPosixStorage("").status().code(), StatusCode::kInvalidArgument);
}

TEST(PosixStorageTest, ErrorsNameThePathAndTheCall) {
  TempDir dir("safepoint-posix-test");
  auto storage = MustOpen(dir.path());
  ASSERT_NE(storage, nullptr);
  auto r = storage->Open("no/such");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find(dir.path() + "/no/such"), std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find("open"), std::string::npos) << r.status().ToString();

  // A file where a directory is needed.
  WriteFile(dir.path() + "/plain", "x");
  auto w = storage->Create("plain/child", 0);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find(dir.path() + "/plain"), std::string::npos)
      << w.status().ToString();
}

// Regression (issue 9, defect 4): when the directory fsync after the rename failed, Publish
// unlinked the final name again, deleting the new version (and with it the old one, which the
// rename had replaced). The object stays published; the error names the directory.
TEST(PosixStorageTest, FailedDirectoryFsyncLeavesTheObjectPublished) {
  TempDir dir("safepoint-posix-test");
  int fail_next_directory_sync = 0;
  auto opened = internal::NewPosixStorageWithSyncHook(
      dir.path(), {}, [&](internal::PosixPublishSync sync, std::string_view) {
        if (sync != internal::PosixPublishSync::kDirectory) return 0;
        return std::exchange(fail_next_directory_sync, 0);
      });
  ASSERT_OK(opened);
  Storage& storage = **opened;
  auto put = [&](std::string_view name, int seed) {
    return test::PutObject(storage, name, PatternBytes(1000, seed));
  };
  ASSERT_OK(put("step/obj", 1));
  fail_next_directory_sync = EIO;
  Status s = put("step/obj", 2);
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_NE(s.message().find(dir.path() + "/step: fsync failed"), std::string::npos)
      << s.ToString();
  EXPECT_NE(s.message().find(dir.path() + "/step/obj"), std::string::npos) << s.ToString();
  // Renamed into place before the fsync failed: visible, with the new data, never withdrawn.
  EXPECT_EQ(ReadWholeObject(storage, "step/obj"), PatternBytes(1000, 2));
  EXPECT_TRUE(TemporaryFiles(dir.path()).empty());
  // ENOSPC from a directory fsync is still an I/O error: the object is not "not written".
  fail_next_directory_sync = ENOSPC;
  EXPECT_EQ(put("step/other", 3).code(), StatusCode::kIOError);
  EXPECT_EQ(ReadWholeObject(storage, "step/other"), PatternBytes(1000, 3));
}

// Regression (issue 9, defect 4): two committers publish equal objects under one name; the
// first one's directory fsync fails after the second one published. Withdrawing the first one
// unlinked the second one's object, which it had already reported durable.
TEST(PosixStorageTest, FailedDirectoryFsyncNeverRemovesAnotherWritersObject) {
  TempDir dir("safepoint-posix-test");
  std::function<void()> during_first_directory_sync;
  int directory_syncs = 0;
  auto opened = internal::NewPosixStorageWithSyncHook(
      dir.path(), {}, [&](internal::PosixPublishSync sync, std::string_view) {
        if (sync != internal::PosixPublishSync::kDirectory || ++directory_syncs != 1) return 0;
        during_first_directory_sync();
        return EIO;
      });
  ASSERT_OK(opened);
  Storage& storage = **opened;
  auto first = storage.Create("step/COMMIT", 0);
  auto second = storage.Create("step/COMMIT", 0);
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_OK((*first)->WriteAt(0, PatternBytes(100, 4)));
  ASSERT_OK((*second)->WriteAt(0, PatternBytes(100, 4)));
  Status second_published = InvalidArgument("not run");
  during_first_directory_sync = [&] { second_published = (*second)->Publish(); };
  EXPECT_EQ((*first)->Publish().code(), StatusCode::kIOError);
  ASSERT_OK(second_published);
  EXPECT_EQ(ReadWholeObject(storage, "step/COMMIT"), PatternBytes(100, 4));
}

// A filesystem that refuses renameat2(RENAME_NOREPLACE) (EINVAL; ENOSYS on old kernels) gets
// link + unlink, which is as exclusive: absent -> published, present -> AlreadyExists, and no
// temporary file stays behind either way.
TEST(PosixStorageTest, PublishIfAbsentFallsBackToLinkWhereTheFlagIsRefused) {
  for (int refusal : {EINVAL, ENOSYS}) {
    TempDir dir("safepoint-posix-test");
    int asked = 0;
    auto opened = internal::NewPosixStorageWithSyncHook(
        dir.path(), {}, [&](internal::PosixPublishSync sync, std::string_view) {
          if (sync != internal::PosixPublishSync::kRenameNoReplace) return 0;
          ++asked;
          return refusal;
        });
    ASSERT_OK(opened);
    Storage& storage = **opened;
    auto publish_if_absent = [&](int seed) -> Status {
      SP_ASSIGN_OR_RETURN(auto w, storage.Create("step/COMMIT", 0));
      SP_RETURN_IF_ERROR(w->WriteAt(0, PatternBytes(100, seed)));
      return w->PublishIfAbsent();
    };
    ASSERT_OK(publish_if_absent(1));
    EXPECT_EQ(ReadWholeObject(storage, "step/COMMIT"), PatternBytes(100, 1));
    EXPECT_TRUE(TemporaryFiles(dir.path()).empty());
    const Status again = publish_if_absent(2);
    EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again.ToString();
    EXPECT_EQ(ReadWholeObject(storage, "step/COMMIT"), PatternBytes(100, 1));
    EXPECT_TRUE(TemporaryFiles(dir.path()).empty());
    EXPECT_EQ(asked, 2);
    struct stat st;
    ASSERT_EQ(::stat((dir.path() + "/step/COMMIT").c_str(), &st), 0);
    EXPECT_EQ(st.st_nlink, 1u) << "the temporary's name was not removed";
  }
}

// A failed fsync of the data is never retried and publishes nothing: the old version stays.
TEST(PosixStorageTest, FailedFileFsyncPublishesNothing) {
  TempDir dir("safepoint-posix-test");
  bool fail = false;
  auto opened = internal::NewPosixStorageWithSyncHook(
      dir.path(), {}, [&](internal::PosixPublishSync sync, std::string_view) {
        return sync == internal::PosixPublishSync::kFile && fail ? EIO : 0;
      });
  ASSERT_OK(opened);
  Storage& storage = **opened;
  for (int seed : {1, 2}) {
    fail = seed == 2;
    auto w = storage.Create("obj", 0);
    ASSERT_OK(w);
    ASSERT_OK((*w)->WriteAt(0, PatternBytes(100, seed)));
    Status s = (*w)->Publish();
    EXPECT_EQ(s.ok(), !fail) << s.ToString();
  }
  EXPECT_EQ(ReadWholeObject(storage, "obj"), PatternBytes(100, 1));
  EXPECT_TRUE(TemporaryFiles(dir.path()).empty());
}

void RoundTripAligned(Storage& storage) {
  constexpr size_t kSize = 1 << 20;
  AlignedTestBuffer src(kSize);
  const std::vector<std::byte> pattern = PatternBytes(kSize, 7);
  std::memcpy(src.data(), pattern.data(), kSize);
  auto w = storage.Create("direct/obj", kSize);
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, src.span().first(kSize / 2)));
  ASSERT_OK((*w)->WriteAt(kSize / 2, src.span().subspan(kSize / 2)));
  ASSERT_OK((*w)->Publish());
  auto r = storage.Open("direct/obj");
  ASSERT_OK(r);
  AlignedTestBuffer dst(kSize);
  ASSERT_OK((*r)->ReadAt(0, dst.span()));
  EXPECT_EQ(std::memcmp(dst.data(), pattern.data(), kSize), 0);
  std::vector<std::byte> odd(1000);
  ASSERT_OK((*r)->ReadAt(4097, odd));
  EXPECT_EQ(std::memcmp(odd.data(), pattern.data() + 4097, odd.size()), 0);
}

TEST(PosixStorageTest, DirectIoOnDevShm) {
  if (!fs::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  TempDir dir("safepoint-posix-test", "/dev/shm");
  ASSERT_FALSE(dir.path().empty());
  auto storage = MustOpen(dir.path());
  ASSERT_NE(storage, nullptr);
  // tmpfs refuses O_DIRECT before Linux 6.6 and accepts it since: either way the data is right
  // and capabilities() says which path was taken.
  RoundTripAligned(*storage);
  const int probe = ::open((dir.path() + "/probe").c_str(), O_CREAT | O_WRONLY | O_DIRECT, 0644);
  const bool accepts = probe >= 0;
  if (probe >= 0) ::close(probe);
  EXPECT_EQ(storage->capabilities().direct_io, accepts);
}

TEST(PosixStorageTest, DirectIoFallsBackWhereRefused) {
  // ramfs has no O_DIRECT support at all: open(O_DIRECT) fails with EINVAL.
  ScopedMount mount("ramfs", nullptr);
  if (!mount.ok()) GTEST_SKIP() << mount.reason();
  auto storage = MustOpen(mount.path());
  ASSERT_NE(storage, nullptr);
  EXPECT_TRUE(storage->capabilities().direct_io);  // not known to be refused yet
  RoundTripAligned(*storage);
  EXPECT_FALSE(storage->capabilities().direct_io);
  EXPECT_TRUE(TemporaryFiles(mount.path()).empty());
}

TEST(PosixStorageTest, DirectIoIsUsedWhereAccepted) {
  TempDir dir("safepoint-posix-test");
  const int probe = ::open((dir.path() + "/probe").c_str(), O_CREAT | O_WRONLY | O_DIRECT, 0644);
  if (probe < 0) GTEST_SKIP() << "/tmp does not accept O_DIRECT: " << std::strerror(errno);
  ::close(probe);
  auto storage = MustOpen(dir.path());
  ASSERT_NE(storage, nullptr);
  RoundTripAligned(*storage);
  EXPECT_TRUE(storage->capabilities().direct_io);
  auto buffered = MustOpen(dir.path(), /*direct=*/false);
  ASSERT_NE(buffered, nullptr);
  EXPECT_FALSE(buffered->capabilities().direct_io);
}

TEST(PosixStorageTest, NoSpaceOnATinyFilesystem) {
  ScopedMount mount("tmpfs", "size=1m");
  if (!mount.ok()) GTEST_SKIP() << mount.reason();
  auto storage = MustOpen(mount.path());
  ASSERT_NE(storage, nullptr);

  // Without a size hint the failure comes from a write.
  {
    auto w = storage->Create("big", 0);
    ASSERT_OK(w);
    Status s = (*w)->WriteAt(0, PatternBytes(2 << 20, 8));
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
    EXPECT_NE(s.message().find(mount.path() + "/big.tmp."), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("pwrite"), std::string::npos) << s.ToString();
    Status p = (*w)->Publish();
    EXPECT_EQ(p.code(), StatusCode::kResourceExhausted) << p.ToString();
  }
  EXPECT_TRUE(TemporaryFiles(mount.path()).empty());
  EXPECT_FALSE(storage->Open("big").ok());

  // With a size hint Create fails up front (fallocate).
  {
    auto w = storage->Create("hinted", 4 << 20);
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.status().code(), StatusCode::kResourceExhausted) << w.status().ToString();
    EXPECT_NE(w.status().message().find("fallocate"), std::string::npos) << w.status().ToString();
  }
  EXPECT_TRUE(TemporaryFiles(mount.path()).empty());

  // The space is back: a small object still fits.
  auto w = storage->Create("small", 1000);
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, PatternBytes(1000, 9)));
  ASSERT_OK((*w)->Publish());
  EXPECT_OK(storage->Open("small"));
}

}  // namespace
}  // namespace safepoint::posix_storage_test
