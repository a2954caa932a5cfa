#include "shm/stage_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "base/process.h"
#include "safepoint/arena.h"

namespace safepoint::internal {
namespace {

namespace fs = std::filesystem;

class StageFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = fs::temp_directory_path().string() + "/sp-stage-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    shm_dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(shm_dir_); }

  static mode_t Mode(const std::string& path) {
    struct stat st;
    EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
    return st.st_mode & 0777;
  }

  std::string shm_dir_;
};

TEST_F(StageFileTest, IsAPrivatePreallocatedFileNamedAfterItsOwner) {
  auto f = StageFile::Create(shm_dir_, 3 << 20);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const std::string dir = StageDirectory(shm_dir_);
  EXPECT_EQ(fs::path((*f)->path()).parent_path(), dir);
  EXPECT_EQ(Mode(dir), 0700u);
  EXPECT_EQ(Mode((*f)->path()), 0600u);
  const ProcessId me = SelfProcessId();
  EXPECT_EQ(fs::path((*f)->path())
                .filename()
                .string()
                .rfind(std::to_string(me.pid) + "-" + std::to_string(me.start_ticks) + "-", 0),
            0u);
  struct stat st;
  ASSERT_EQ(::stat((*f)->path().c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 3 << 20);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, uint64_t{3} << 20);  // reserved
  ASSERT_EQ((*f)->data().size(), size_t{3} << 20);
  (*f)->data().back() = std::byte{7};
  ASSERT_TRUE((*f)->Remove().ok());
  EXPECT_FALSE(fs::exists((*f)->path()));
  EXPECT_EQ((*f)->data().back(), std::byte{7});  // the mapping outlives the name
  EXPECT_TRUE((*f)->Remove().ok());
}

TEST_F(StageFileTest, TheStagingDirectoryIsNoJobDirectory) {
  ASSERT_TRUE(StageFile::Create(shm_dir_, 1).ok());
  auto jobs = ListJobDirectories(shm_dir_);
  ASSERT_TRUE(jobs.ok());
  EXPECT_TRUE(jobs->empty());
}

TEST_F(StageFileTest, RemoveDeadStageFilesTakesThoseOfDeadProcessesOnly) {
  auto mine = StageFile::Create(shm_dir_, 1 << 20);
  ASSERT_TRUE(mine.ok());
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // dies without removing its file, as a SIGKILLed process would
    auto f = StageFile::Create(shm_dir_, 2 << 20);
    ::_exit(f.ok() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const std::string dir = StageDirectory(shm_dir_);
  std::ofstream(dir + "/notes.txt") << "not a staging file";
  ASSERT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 3);

  auto counted = RemoveDeadStageFiles(shm_dir_, /*dry_run=*/true);
  ASSERT_TRUE(counted.ok()) << counted.status().ToString();
  EXPECT_EQ(counted->files, 1u);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 3);

  auto removed = RemoveDeadStageFiles(shm_dir_);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(removed->files, 1u);
  EXPECT_GE(removed->bytes, uint64_t{2} << 20);
  EXPECT_TRUE(fs::exists((*mine)->path()));
  EXPECT_TRUE(fs::exists(dir + "/notes.txt"));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 2);
}

TEST_F(StageFileTest, NoStagingDirectoryIsNothingToRemove) {
  auto removed = RemoveDeadStageFiles(shm_dir_);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(removed->files, 0u);
}

TEST_F(StageFileTest, RefusesAStagingDirectoryOthersCanEnter) {
  const std::string dir = StageDirectory(shm_dir_);
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  ::chmod(dir.c_str(), 0755);
  auto f = StageFile::Create(shm_dir_, 1);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find(dir), std::string::npos);
  EXPECT_FALSE(RemoveDeadStageFiles(shm_dir_).ok());
}

TEST_F(StageFileTest, AMissingShmDirectoryIsNamed) {
  auto f = StageFile::Create(shm_dir_ + "/missing", 1);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find(shm_dir_ + "/missing"), std::string::npos);
}

}  // namespace
}  // namespace safepoint::internal
