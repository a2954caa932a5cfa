#include "shm/stage_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "base/process.h"
#include "shm/arena.h"
#include "testing/test_util.h"

namespace safepoint::internal::stage_file_test {
namespace {

namespace fs = std::filesystem;

class StageFileTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(tmp_.ok()) << "mkdtemp failed"; }

  static mode_t Mode(const std::string& path) {
    struct stat st;
    EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
    return st.st_mode & 0777;
  }

  test::TempDir tmp_{"sp-stage"};
  const std::string& shm_dir_ = tmp_.path();
};

TEST_F(StageFileTest, IsAPrivatePreallocatedFileNamedAfterItsOwner) {
  auto f = StageFile::Create(shm_dir_, 3 << 20);
  ASSERT_OK(f);
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
  ASSERT_OK((*f)->Remove());
  EXPECT_FALSE(fs::exists((*f)->path()));
  EXPECT_EQ((*f)->data().back(), std::byte{7});  // the mapping outlives the name
  EXPECT_OK((*f)->Remove());
}

TEST_F(StageFileTest, TheStagingDirectoryIsNoJobDirectory) {
  ASSERT_OK(StageFile::Create(shm_dir_, 1));
  auto jobs = ListJobDirectories(shm_dir_);
  ASSERT_OK(jobs);
  EXPECT_TRUE(jobs->empty());
}

TEST_F(StageFileTest, RemoveDeadStageFilesTakesThoseOfDeadProcessesOnly) {
  ASSERT_OK_AND_ASSIGN(auto mine, StageFile::Create(shm_dir_, 1 << 20));
  // The child dies without removing its file, as a SIGKILLed process would.
  ASSERT_EQ(test::RunInChild([&] { return StageFile::Create(shm_dir_, 2 << 20).ok() ? 0 : 1; }), 0);
  const std::string dir = StageDirectory(shm_dir_);
  ASSERT_TRUE(test::WriteStringToFile(dir + "/notes.txt", "not a staging file"));
  ASSERT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 3);

  auto counted = RemoveDeadStageFiles(shm_dir_, /*dry_run=*/true);
  ASSERT_OK(counted);
  EXPECT_EQ(counted->files, 1u);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 3);

  auto removed = RemoveDeadStageFiles(shm_dir_);
  ASSERT_OK(removed);
  EXPECT_EQ(removed->files, 1u);
  EXPECT_GE(removed->bytes, uint64_t{2} << 20);
  EXPECT_TRUE(fs::exists(mine->path()));
  EXPECT_TRUE(fs::exists(dir + "/notes.txt"));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 2);
}

TEST_F(StageFileTest, NoStagingDirectoryIsNothingToRemove) {
  auto removed = RemoveDeadStageFiles(shm_dir_);
  ASSERT_OK(removed);
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
}  // namespace safepoint::internal::stage_file_test
