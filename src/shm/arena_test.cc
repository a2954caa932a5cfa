#include "shm/arena.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>

#include "base/process.h"
#include "base/unique_fd.h"
#include "safepoint/extras.h"
#include "safepoint/image.h"
#include "shm/rank_claim.h"
#include "testing/test_util.h"

namespace safepoint::arena_test {
namespace {

namespace fs = std::filesystem;

using test::KillLeavingZombie;
using test::ReadFileToString;
using test::WriteStringToFile;

std::string Prefix() { return "safepoint-" + std::to_string(::geteuid()) + "-"; }

// A rank-0 shard of `step` whose bytes are a pure function of the step.
struct Shard {
  std::vector<float> data;
  std::unique_ptr<ImageBuilder> builder;

  explicit Shard(uint64_t step, size_t elems = 16 << 10) : data(elems) {
    for (size_t i = 0; i < data.size(); ++i) data[i] = float(step * 7 + i);
    ImageMeta meta;
    meta.job = "arena";
    meta.step = step;
    meta.rank = 0;
    std::vector<TensorSource> sources;
    sources.push_back(
        {{"w", DType::kFloat32, {data.size()}, {}, {}}, data.data(), data.size() * sizeof(float)});
    Dict d;
    d.items.emplace_back(Value(std::string("step")), Value(int64_t(step)));
    auto extras = EncodeExtras(Value(std::move(d)));
    EXPECT_OK(extras);
    auto b = ImageBuilder::Create(meta, std::move(sources), *extras);
    EXPECT_OK(b);
    builder = std::move(b).value();
  }
  uint64_t size() const { return builder->size(); }
};

// Checks that `image` is a valid image of Shard(step, elems).
void ExpectImage(std::span<const std::byte> image, uint64_t step, size_t elems = 16 << 10) {
  auto reader = ImageReader::Parse(image, "slot");
  ASSERT_OK(reader);
  EXPECT_EQ(reader->meta().step, step);
  ASSERT_EQ(reader->tensors().size(), 1u);
  Shard want(step, elems);
  auto got = reader->tensor_data(0);
  ASSERT_EQ(got.size(), want.data.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(got.data(), want.data.data(), got.size()), 0);
}

// Takes a slot, fills it with Shard(step) and marks it COMPLETE.
SlotWriteTicket Save(Arena& arena, uint64_t step, bool leased = false, size_t elems = 16 << 10) {
  Shard s(step, elems);
  auto t = arena.BeginWrite(s.size());
  EXPECT_OK(t);
  if (!t.ok()) return {};
  EXPECT_EQ(t->first, Arena::Acquire::kAcquired);
  if (t->first != Arena::Acquire::kAcquired) return {};
  s.builder->FillAll(t->second.data, 1);
  arena.FinishWrite(t->second, step, s.size(), leased);
  return t->second;
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path().filename());
  std::sort(out.begin(), out.end());
  return out;
}

std::string SlotPathOf(const std::string& job_dir, uint32_t rank, uint32_t slot) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "/rank-%05u.slot-%u", rank, slot);
  return job_dir + buf;
}

// --- Job directories -------------------------------------------------------------------------

// A fresh temporary directory, tmp_, for every test.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(tmp_.ok()) << "mkdtemp failed"; }

  // Where the job directory of `job` is (or would be) in tmp_.
  std::string JobPath(const std::string& job) const { return tmp_.Join(Prefix() + job); }

  test::TempDir tmp_{"sp-arena"};
};

using ArenaJobDirectoryTest = TempDirTest;

TEST_F(ArenaJobDirectoryTest, CreatesPrivateDirectory) {
  auto dir = JobDirectory(tmp_.path(), "job1", /*create=*/true);
  ASSERT_OK(dir);
  EXPECT_EQ(*dir, JobPath("job1"));
  struct stat st;
  ASSERT_EQ(::lstat(dir->c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  // Idempotent, and found without create.
  auto again = JobDirectory(tmp_.path(), "job1", true);
  ASSERT_OK(again);
  EXPECT_EQ(*again, *dir);
  auto found = JobDirectory(tmp_.path(), "job1", false);
  ASSERT_OK(found);
  EXPECT_EQ(*found, *dir);
  EXPECT_EQ(JobDirectory(tmp_.path(), "nope", false).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(JobDirectory(tmp_.path() + "/missing", "job1", true).status().code(),
            StatusCode::kNotFound);
}

TEST_F(ArenaJobDirectoryTest, ValidatesJobNames) {
  const std::vector<std::string> bad_names = {
      "", "a/b", "..", ".", "sp ace", "x\n", std::string(65, 'a')};
  for (const std::string& bad : bad_names) {
    SCOPED_TRACE(bad);
    EXPECT_EQ(JobDirectory(tmp_.path(), bad, true).status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_OK(ValidateJobName(std::string(64, 'a')));
  EXPECT_OK(ValidateJobName("A-z_0.9"));
  // Nothing was created by the refused names.
  EXPECT_TRUE(ListDir(tmp_.path()).empty());
}

TEST_F(ArenaJobDirectoryTest, RefusesSymlink) {
  const std::string target = tmp_.path() + "/elsewhere";
  ASSERT_EQ(::mkdir(target.c_str(), 0700), 0);
  const std::string path = JobPath("job");
  ASSERT_EQ(::symlink(target.c_str(), path.c_str()), 0);
  for (bool create : {true, false}) {
    auto dir = JobDirectory(tmp_.path(), "job", create);
    EXPECT_EQ(dir.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(dir.status().message().find(path), std::string::npos) << dir.status().message();
  }
  // A dangling symlink is refused as well (and nothing is created at its target).
  const std::string dangling = JobPath("dangling");
  ASSERT_EQ(::symlink((tmp_.path() + "/ghost").c_str(), dangling.c_str()), 0);
  EXPECT_FALSE(JobDirectory(tmp_.path(), "dangling", true).ok());
  EXPECT_FALSE(fs::exists(tmp_.path() + "/ghost"));
}

TEST_F(ArenaJobDirectoryTest, RefusesDirectoryAccessibleToOthers) {
  const std::string path = JobPath("job");
  ASSERT_EQ(::mkdir(path.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(path.c_str(), 0755), 0);
  auto dir = JobDirectory(tmp_.path(), "job", true);
  EXPECT_EQ(dir.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dir.status().message().find(path), std::string::npos) << dir.status().message();
  // Not "fixed" behind the user's back.
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0755u);
}

// Issue 35: another local user who creates the job directory's name first blocks the job's
// agent (failing closed is right); the error names the way out: who owns the entry, its path,
// and the command that removes it (as root or as its owner: the shm directory is sticky).
TEST_F(ArenaJobDirectoryTest, ADirectoryOfAnotherUserNamesItsOwnerAndHowToRemoveIt) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory to another uid";
  const std::string path = JobPath("job");
  ASSERT_EQ(::mkdir(path.c_str(), 0700), 0);
  ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);
  for (bool create : {true, false}) {
    auto dir = JobDirectory(tmp_.path(), "job", create);
    ASSERT_FALSE(dir.ok());
    const std::string m = dir.status().message();
    EXPECT_EQ(dir.status().code(), StatusCode::kInvalidArgument) << m;
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find("owned by uid 65534"), std::string::npos) << m;
    EXPECT_NE(m.find("rm -rf -- '" + path + "'"), std::string::npos) << m;
  }
}

TEST_F(ArenaJobDirectoryTest, EveryRefusalNamesTheCommandThatClearsIt) {
  const std::string target = tmp_.path() + "/elsewhere";
  ASSERT_EQ(::mkdir(target.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(target.c_str(), JobPath("link").c_str()), 0);
  ASSERT_TRUE(WriteStringToFile(JobPath("file"), "x"));
  ASSERT_EQ(::mkdir(JobPath("open").c_str(), 0700), 0);
  ASSERT_EQ(::chmod(JobPath("open").c_str(), 0755), 0);
  const std::pair<std::string, std::string> cases[] = {
      {"link", "rm -- '" + JobPath("link") + "'"},
      {"file", "rm -- '" + JobPath("file") + "'"},
      {"open", "chmod 700 '" + JobPath("open") + "'"}};
  for (const auto& [job, command] : cases) {
    SCOPED_TRACE(job);
    auto dir = JobDirectory(tmp_.path(), job, true);
    ASSERT_FALSE(dir.ok());
    EXPECT_NE(dir.status().message().find(command), std::string::npos) << dir.status().message();
  }
}

TEST_F(ArenaJobDirectoryTest, RefusesFile) {
  const std::string path = JobPath("job");
  ASSERT_TRUE(WriteStringToFile(path, "not a directory"));
  EXPECT_EQ(JobDirectory(tmp_.path(), "job", true).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(JobDirectory(tmp_.path(), "job", false).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(ArenaJobDirectoryTest, ListJobDirectories) {
  auto none = ListJobDirectories(tmp_.path() + "/missing");
  ASSERT_OK(none);
  EXPECT_TRUE(none->empty());

  auto b = JobDirectory(tmp_.path(), "beta", true);
  auto a = JobDirectory(tmp_.path(), "alpha", true);
  ASSERT_TRUE(a.ok() && b.ok());
  // Things that must not be listed.
  const std::string open = JobPath("open");
  ASSERT_EQ(::mkdir(open.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open.c_str(), 0755), 0);
  ASSERT_EQ(::symlink(a->c_str(), JobPath("link").c_str()), 0);
  ASSERT_TRUE(WriteStringToFile(JobPath("file"), "x"));
  ASSERT_EQ(::mkdir(JobPath("bad name").c_str(), 0700), 0);
  const std::string other_user = "/safepoint-" + std::to_string(::geteuid() + 1) + "-other";
  ASSERT_EQ(::mkdir((tmp_.path() + other_user).c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((tmp_.path() + "/unrelated").c_str(), 0700), 0);

  auto list = ListJobDirectories(tmp_.path());
  ASSERT_OK(list);
  std::vector<std::pair<std::string, std::string>> want = {{"alpha", *a}, {"beta", *b}};
  EXPECT_EQ(*list, want);
}

// --- Arenas ----------------------------------------------------------------------------------

// tmp_ holds the job directory job_dir_ of job "arena".
class ArenaTest : public TempDirTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(TempDirTest::SetUp());
    ASSERT_OK_AND_ASSIGN(job_dir_, JobDirectory(tmp_.path(), "arena", true));
  }
  std::unique_ptr<Arena> Open(uint32_t slots = kDefaultSlots, uint32_t rank = 0) {
    auto a = Arena::Open(job_dir_, rank, slots);
    EXPECT_OK(a);
    return a.ok() ? std::move(a).value() : nullptr;
  }

  std::string job_dir_;
};

TEST_F(ArenaTest, OpenCreatesNothing) {
  EXPECT_EQ(Arena::Open(job_dir_, 0, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Arena::Open(job_dir_, 0, 17).status().code(), StatusCode::kInvalidArgument);
  auto arena = Open(3);
  ASSERT_TRUE(arena);
  EXPECT_EQ(arena->slot_count(), 3u);
  EXPECT_TRUE(ListDir(job_dir_).empty());
  for (const SlotInfo& s : arena->Slots()) {
    EXPECT_EQ(s.state, SlotState::kFree);
    EXPECT_EQ(s.capacity, 0u);
    EXPECT_FALSE(s.leased);
  }
  EXPECT_FALSE(arena->NewestComplete());
  EXPECT_EQ(arena->mapped_bytes(), 0u);
  EXPECT_TRUE(arena->SlotData(0).empty());
  EXPECT_TRUE(arena->SlotData(7).empty());
}

TEST_F(ArenaTest, FirstSavesUseFreeSlotsThenTheOldest) {
  auto arena = Open(3);
  ASSERT_TRUE(arena);
  std::vector<uint32_t> used;
  for (uint64_t step = 1; step <= 7; ++step) {
    Shard s(step);
    auto t = arena->BeginWrite(s.size());
    ASSERT_OK(t);
    ASSERT_EQ(t->first, Arena::Acquire::kAcquired);
    EXPECT_EQ(t->second.data.size(), s.size());
    EXPECT_EQ(t->second.relaid_out, step <= 3) << "step " << step;
    s.builder->FillAll(t->second.data, 1);
    arena->FinishWrite(t->second, step, s.size());
    used.push_back(t->second.slot);
    auto newest = arena->NewestComplete();
    ASSERT_TRUE(newest);
    EXPECT_EQ(newest->step, step);
    EXPECT_EQ(newest->index, t->second.slot);
    EXPECT_EQ(newest->image_size, s.size());
    EXPECT_GT(newest->complete_time_ns, 0);
    EXPECT_EQ(newest->writer_pid, static_cast<uint32_t>(::getpid()));
  }
  EXPECT_EQ(used, (std::vector<uint32_t>{0, 1, 2, 0, 1, 2, 0}));
  for (const SlotInfo& s : arena->Slots()) {
    EXPECT_EQ(s.state, SlotState::kComplete);
    ExpectImage(arena->SlotData(s.index).subspan(0, s.image_size), s.step);
  }
}

// A reader's view of a slot (another process's arena, as a restarted rank or a sibling opens
// it): the image's bytes, at most the slot's capacity, the same again after a new snapshot.
TEST_F(ArenaTest, SlotDataForReadIsTheImageCappedAtTheCapacity) {
  auto writer = Open(2);
  ASSERT_TRUE(writer);
  Shard s(1);
  auto t = writer->BeginWrite(s.size());
  ASSERT_OK(t);
  s.builder->FillAll(t->second.data, 1);
  writer->FinishWrite(t->second, 1, s.size());
  auto reader = Open(2);
  ASSERT_TRUE(reader);
  const uint32_t slot = t->second.slot;
  EXPECT_TRUE(reader->SlotDataForRead(5, s.size()).empty());
  auto got = reader->SlotDataForRead(slot, s.size());
  EXPECT_EQ(got.data(), reader->SlotData(slot).data());
  ExpectImage(got, 1);
  EXPECT_EQ(reader->SlotDataForRead(slot, 1 << 30).size(), reader->SlotData(slot).size());
  // Step 2 in the same slot file (the writer's third save takes slot `slot` again).
  for (uint64_t step = 2; step <= 3; ++step) {
    Shard n(step);
    auto w = writer->BeginWrite(n.size());
    ASSERT_OK(w);
    n.builder->FillAll(w->second.data, 1);
    writer->FinishWrite(w->second, step, n.size());
  }
  ASSERT_OK(reader->Refresh());
  ExpectImage(reader->SlotDataForRead(slot, s.size()), 3);
}

TEST_F(ArenaTest, NeverOverwritesTheSnapshotCompletedLast) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  // Steps out of order too (ranks that resumed from an older step save lower steps again): the
  // snapshot kept while a slot is written is the one completed last, whatever its step.
  const uint64_t steps[] = {10, 20, 5, 30, 25, 26, 40};
  std::optional<SlotInfo> last;
  for (uint64_t step : steps) {
    Shard s(step);
    auto t = arena->BeginWrite(s.size());
    ASSERT_OK(t);
    ASSERT_EQ(t->first, Arena::Acquire::kAcquired);
    if (last) {
      EXPECT_NE(t->second.slot, last->index) << "step " << step;
      // While the slot is written, the previous save is still there, intact.
      const SlotInfo during = arena->Slots()[last->index];
      EXPECT_EQ(during.state, SlotState::kComplete);
      EXPECT_EQ(during.step, last->step);
      ExpectImage(arena->SlotData(during.index).subspan(0, during.image_size), during.step);
    }
    EXPECT_EQ(arena->Slots()[t->second.slot].state, SlotState::kWriting);
    s.builder->FillAll(t->second.data, 1);
    arena->FinishWrite(t->second, step, s.size());
    last = arena->Slots()[t->second.slot];
  }
  auto newest = arena->NewestComplete();
  ASSERT_TRUE(newest);
  EXPECT_EQ(newest->step, 40u);
}

// Regression (crash campaign, seed 3172031226): slots held step 10 of a run that was then
// abandoned (the ranks resumed from step 8) and the resumed run's step 9; saving step 10 again
// kept the old step 10 (the higher step) and overwrote step 9, the newest save that every rank
// had made, so the ranks could only agree on step 8.
TEST_F(ArenaTest, AfterAResumeTheStaleHigherStepIsOverwrittenFirst) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  for (uint64_t step : {10, 9, 10}) Save(*arena, step);
  std::vector<uint64_t> held;
  for (const SlotInfo& s : arena->Slots()) held.push_back(s.step);
  std::sort(held.begin(), held.end());
  EXPECT_EQ(held, (std::vector<uint64_t>{9, 10}));
}

// Regression (issue 9, defect 10; crash campaign, seed 866710947): slots held step 5 and a step
// 6 that an abandoned run completed later (its peer never did), so the ranks resumed from step 5.
// The next save kept the stale 6, the snapshot completed last, and overwrote 5: killed during
// that save, the rank was left without the step the ranks had agreed on, and the ranks resumed
// from an older step on storage. The snapshot a run resumes from is kept.
TEST_F(ArenaTest, TheSnapshotResumedFromIsKeptWhileTheNextSaveIsWritten) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  for (uint64_t step : {5, 6}) Save(*arena, step);
  std::optional<SlotInfo> five;
  for (const SlotInfo& s : arena->Slots()) {
    if (s.step == 5) five = s;
  }
  ASSERT_TRUE(five);
  ASSERT_TRUE(arena->MarkResumed(five->index, five->generation));
  EXPECT_EQ(arena->NewestComplete()->step, 6u);  // by step, loads still see 6 as newest

  Shard six(6);
  auto t = arena->BeginWrite(six.size());
  ASSERT_TRUE(t.ok() && t->first == Arena::Acquire::kAcquired);
  EXPECT_NE(t->second.slot, five->index);
  const SlotInfo during = arena->Slots()[five->index];
  EXPECT_EQ(during.state, SlotState::kComplete);
  EXPECT_EQ(during.step, 5u);
  ExpectImage(arena->SlotData(five->index).subspan(0, during.image_size), 5);
  arena->AbortWrite(t->second);  // killed during the save: step 5 is what is left
  ASSERT_TRUE(arena->NewestComplete());
  EXPECT_EQ(arena->NewestComplete()->step, 5u);
  // A slot that no longer holds the snapshot is not marked.
  EXPECT_FALSE(arena->MarkResumed(t->second.slot, t->second.generation - 1));
}

TEST_F(ArenaTest, AbortWriteFreesTheSlot) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  Save(*arena, 1);
  Shard s(2);
  auto t = arena->BeginWrite(s.size());
  ASSERT_OK(t);
  ASSERT_EQ(t->first, Arena::Acquire::kAcquired);
  arena->AbortWrite(t->second);
  EXPECT_EQ(arena->Slots()[t->second.slot].state, SlotState::kFree);
  EXPECT_EQ(arena->NewestComplete()->step, 1u);
  auto t2 = arena->BeginWrite(s.size());
  ASSERT_OK(t2);
  ASSERT_EQ(t2->first, Arena::Acquire::kAcquired);
  EXPECT_EQ(t2->second.slot, t->second.slot);
  EXPECT_GT(t2->second.generation, t->second.generation);
}

TEST_F(ArenaTest, GenerationIncreases) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  std::vector<uint64_t> last(2, 0);
  for (uint64_t step = 1; step <= 8; ++step) {
    const auto t = Save(*arena, step);
    EXPECT_GT(t.generation, last[t.slot]) << "step " << step;
    last[t.slot] = t.generation;
    const SlotInfo info = arena->Slots()[t.slot];
    EXPECT_EQ(info.generation, t.generation);
    EXPECT_EQ(info.step, step);
  }
  // Another process's view (a fresh mapping) sees the same generations.
  auto other = Open(2);
  ASSERT_TRUE(other);
  for (const SlotInfo& s : other->Slots()) EXPECT_EQ(s.generation, last[s.index]);
}

TEST_F(ArenaTest, LeasedSlotIsNeverOverwritten) {
  auto arena = Open(2);
  auto agent = Open(2);  // the agent's own mapping
  ASSERT_TRUE(arena && agent);
  const auto t1 = Save(*arena, 1);
  const auto t2 = Save(*arena, 2);
  ASSERT_EQ(t1.slot, 0u);
  ASSERT_EQ(t2.slot, 1u);
  ASSERT_OK(agent->Refresh());
  ASSERT_TRUE(agent->Lease(t1.slot, t1.generation));
  EXPECT_TRUE(arena->Slots()[t1.slot].leased);
  EXPECT_EQ(arena->Slots()[t1.slot].state, SlotState::kComplete);
  // Slot 1 is the newest, slot 0 is leased: nothing may be overwritten.
  Shard s(3);
  for (int i = 0; i < 3; ++i) {
    auto t = arena->BeginWrite(s.size());
    ASSERT_OK(t);
    EXPECT_EQ(t->first, Arena::Acquire::kBusy);
  }
  ExpectImage(arena->SlotData(0).subspan(0, arena->Slots()[0].image_size), 1);
  agent->Release(t1.slot, t1.generation);
  EXPECT_FALSE(arena->Slots()[t1.slot].leased);
  auto t = arena->BeginWrite(s.size());
  ASSERT_OK(t);
  ASSERT_EQ(t->first, Arena::Acquire::kAcquired);
  EXPECT_EQ(t->second.slot, t1.slot);
}

TEST_F(ArenaTest, LeasedOldSlotIsSkippedWhenAnotherIsAvailable) {
  auto arena = Open(3);
  ASSERT_TRUE(arena);
  const auto t1 = Save(*arena, 1);
  Save(*arena, 2);
  Save(*arena, 3);
  ASSERT_TRUE(arena->Lease(t1.slot, t1.generation));  // the oldest one is being persisted
  const auto t4 = Save(*arena, 4);
  EXPECT_NE(t4.slot, t1.slot);
  EXPECT_EQ(t4.slot, 1u);  // the oldest that is not leased
  ExpectImage(arena->SlotData(t1.slot).subspan(0, arena->Slots()[t1.slot].image_size), 1);
}

TEST_F(ArenaTest, FinishWriteLeasedHandsOverLeased) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  const auto t1 = Save(*arena, 1, /*leased=*/true);
  SlotInfo info = arena->Slots()[t1.slot];
  EXPECT_EQ(info.state, SlotState::kComplete);
  EXPECT_TRUE(info.leased);
  EXPECT_EQ(info.generation, t1.generation);
  // A leased COMPLETE slot is still a snapshot for readers.
  ASSERT_TRUE(arena->NewestComplete());
  EXPECT_EQ(arena->NewestComplete()->index, t1.slot);
  // Already leased: a second lease fails; the agent releases the one it was handed.
  EXPECT_FALSE(arena->Lease(t1.slot, t1.generation));
  const auto t2 = Save(*arena, 2);
  EXPECT_NE(t2.slot, t1.slot);
  Shard s(3);
  auto busy = arena->BeginWrite(s.size());
  ASSERT_OK(busy);
  EXPECT_EQ(busy->first, Arena::Acquire::kBusy);  // slot 0 leased, slot 1 newest
  arena->Release(t1.slot, t1.generation);
  EXPECT_FALSE(arena->Slots()[t1.slot].leased);
  const auto t3 = Save(*arena, 3);
  EXPECT_EQ(t3.slot, t1.slot);
}

TEST_F(ArenaTest, LeaseFailsForAStaleGeneration) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  EXPECT_FALSE(arena->Lease(0, 0));  // no slot file yet
  EXPECT_FALSE(arena->Lease(5, 1));  // out of range
  const auto t1 = Save(*arena, 1);
  EXPECT_FALSE(arena->Lease(t1.slot, t1.generation - 1));
  EXPECT_FALSE(arena->Lease(t1.slot, t1.generation + 1));
  EXPECT_FALSE(arena->Slots()[t1.slot].leased);
  // Releasing with a wrong generation does not touch a real lease.
  ASSERT_TRUE(arena->Lease(t1.slot, t1.generation));
  arena->Release(t1.slot, t1.generation + 1);
  EXPECT_TRUE(arena->Slots()[t1.slot].leased);
  arena->Release(t1.slot, t1.generation);
  EXPECT_FALSE(arena->Slots()[t1.slot].leased);
  // Once the slot is overwritten, the old generation can no longer be leased.
  Save(*arena, 2);
  const auto t3 = Save(*arena, 3);
  ASSERT_EQ(t3.slot, t1.slot);
  EXPECT_FALSE(arena->Lease(t1.slot, t1.generation));
  EXPECT_TRUE(arena->Lease(t3.slot, t3.generation));
  // A slot being written cannot be leased.
  arena->Release(t3.slot, t3.generation);
  Shard s(4);
  auto t4 = arena->BeginWrite(s.size());
  ASSERT_OK(t4);
  ASSERT_EQ(t4->first, Arena::Acquire::kAcquired);
  EXPECT_FALSE(arena->Lease(t4->second.slot, t4->second.generation));
  EXPECT_FALSE(arena->Lease(t4->second.slot, t4->second.generation - 1));
}

// The agent's newest persist time, recorded in slot 0's control block for the writer to read.
TEST_F(ArenaTest, RecordPersistIsReadFromSharedMemory) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  arena->RecordPersist(4, 1.0);  // no slot file yet: nowhere to record it
  EXPECT_FALSE(arena->LastPersist());
  const auto t1 = Save(*arena, 0);
  EXPECT_FALSE(arena->LastPersist());  // nothing recorded yet
  arena->RecordPersist(0, 0.25);       // step 0 is a step like any other
  ASSERT_TRUE(arena->LastPersist());
  EXPECT_EQ(arena->LastPersist()->first, 0u);
  EXPECT_DOUBLE_EQ(arena->LastPersist()->second, 0.25);
  // Another process (the agent's Arena) records; the writer's sees it, whichever slot held it.
  auto agent = Open(2);
  ASSERT_TRUE(agent);
  Save(*arena, 1);
  Save(*arena, 2);
  agent->RecordPersist(1, 0.5);
  ASSERT_TRUE(arena->LastPersist());
  EXPECT_EQ(arena->LastPersist()->first, 1u);
  EXPECT_DOUBLE_EQ(arena->LastPersist()->second, 0.5);
  EXPECT_EQ(t1.slot, 0u);
}

TEST_F(ArenaTest, ClearLeases) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  const auto t1 = Save(*arena, 1, true);
  const auto t2 = Save(*arena, 2, true);
  arena->ClearLeases();
  for (const SlotInfo& s : arena->Slots()) {
    EXPECT_FALSE(s.leased);
    EXPECT_EQ(s.state, SlotState::kComplete);
  }
  EXPECT_EQ(arena->Slots()[t1.slot].generation, t1.generation);
  EXPECT_EQ(arena->Slots()[t2.slot].generation, t2.generation);
}

// A writer killed mid-copy leaves a WRITING slot: never read, and reused before a good snapshot.
TEST_F(ArenaTest, SlotOfADeadWriterIsReusedAndNeverRead) {
  auto arena = Open(3);
  ASSERT_TRUE(arena);
  Save(*arena, 1);
  Save(*arena, 2);
  Save(*arena, 3);
  const uint64_t size = Shard(4).size();
  pid_t child = -1;
  const int exit_code = test::RunInChild(
      [&] {
        auto a = Arena::Open(job_dir_, 0, 3);
        if (!a.ok()) return 2;
        auto t = (*a)->BeginWrite(size);
        if (!t.ok() || t->first != Arena::Acquire::kAcquired) return 3;
        // Half a copy of garbage, then death without FinishWrite.
        std::memset(t->second.data.data(), 0xAB, t->second.data.size() / 2);
        return t->second.slot == 0 ? 0 : 4;
      },
      &child);
  ASSERT_EQ(exit_code, 0) << "the child did not take slot 0";

  SlotInfo torn = arena->Slots()[0];
  EXPECT_EQ(torn.state, SlotState::kWriting);
  EXPECT_EQ(torn.writer_pid, static_cast<uint32_t>(child));
  auto newest = arena->NewestComplete();
  ASSERT_TRUE(newest);
  EXPECT_EQ(newest->step, 3u);
  // A fresh reader (e.g. a new agent) never takes it for a snapshot either.
  auto reader = Open(3);
  ASSERT_TRUE(reader);
  for (const SlotInfo& s : reader->Slots()) {
    if (s.index == 0) EXPECT_NE(s.state, SlotState::kComplete);
  }
  EXPECT_FALSE(reader->Lease(0, torn.generation));

  // The torn slot is taken before the oldest good snapshot (step 2 in slot 1).
  Shard s(4);
  auto t = arena->BeginWrite(s.size());
  ASSERT_OK(t);
  ASSERT_EQ(t->first, Arena::Acquire::kAcquired);
  EXPECT_EQ(t->second.slot, 0u);
  EXPECT_GT(t->second.generation, torn.generation);
  s.builder->FillAll(t->second.data, 1);
  arena->FinishWrite(t->second, 4, s.size());
  EXPECT_EQ(arena->NewestComplete()->step, 4u);
  ExpectImage(arena->SlotData(0).subspan(0, s.size()), 4);
  ExpectImage(arena->SlotData(1).subspan(0, arena->Slots()[1].image_size), 2);
}

// Two live processes cannot write the same rank.
TEST_F(ArenaTest, LiveSecondWriterIsRefused) {
  auto arena = Open(3);
  ASSERT_TRUE(arena);
  Save(*arena, 1);
  const uint64_t size = Shard(2).size();
  // The child says on `ready` whether it took a slot, then writes until `done` is closed.
  int ready_fds[2], done_fds[2];
  ASSERT_EQ(::pipe(ready_fds), 0);
  internal::UniqueFd ready_read(ready_fds[0]), ready_write(ready_fds[1]);
  ASSERT_EQ(::pipe(done_fds), 0);
  internal::UniqueFd done_read(done_fds[0]), done_write(done_fds[1]);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ready_read.Reset();
    done_write.Reset();
    auto a = Arena::Open(job_dir_, 0, 3);
    char ok = 0;
    if (a.ok()) {
      auto t = (*a)->BeginWrite(size);
      ok = t.ok() && t->first == Arena::Acquire::kAcquired ? 1 : 0;
    }
    if (::write(ready_write.get(), &ok, 1) != 1) ::_exit(1);
    char c;
    while (::read(done_read.get(), &c, 1) > 0) {
    }
    ::_exit(0);
  }
  ready_write.Reset();
  done_read.Reset();
  char ok = 0;
  ASSERT_EQ(::read(ready_read.get(), &ok, 1), 1);
  EXPECT_EQ(ok, 1);
  auto t = arena->BeginWrite(size);
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find(std::to_string(child)), std::string::npos)
      << t.status().message();
  done_write.Reset();  // the child exits
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  // Now the other writer is dead (and reaped): its slot is reused.
  auto t2 = arena->BeginWrite(size);
  ASSERT_OK(t2);
  EXPECT_EQ(t2->first, Arena::Acquire::kAcquired);
}

// --- a newer run takes the rank over (src/shm/rank_claim.h) ---------------------------------

// The slot-level defect behind issue 35: a stale process (its run superseded while it still ran)
// kept saving into the rank's slots, and what it completed last became the "newest" snapshot, the
// one loads read and the one the next save of the new run kept. A superseded writer now neither
// begins nor completes a write, nor reorders the slots by a load.
TEST_F(ArenaTest, ASupersededWriterNeitherBeginsNorCompletesAWrite) {
  ASSERT_OK_AND_ASSIGN(auto claim, RankClaim::OpenOrCreate(job_dir_, 0));
  const internal::ProcessId self = internal::SelfProcessId();
  auto writer = Open();
  ASSERT_TRUE(writer);
  writer->set_claim_epoch(claim->SetOwner(self, 111));
  Save(*writer, 1);
  ASSERT_OK(writer->CheckClaim());
  // A save in progress when a newer run's process takes the rank.
  Shard two(2);
  auto begun = writer->BeginWrite(two.size());
  ASSERT_OK(begun);
  ASSERT_EQ(begun->first, Arena::Acquire::kAcquired);
  two.builder->FillAll(begun->second.data, 1);
  const internal::ProcessId newer{self.pid + 1, self.start_ticks + 1};
  claim->AddSuperseded({self, 111, newer, 222, 0});
  claim->SetOwner(newer, 222);
  // The agent removes what is being written (the takeover's second half).
  auto agent = Open();
  ASSERT_TRUE(agent);
  EXPECT_EQ(agent->RemoveWritingSlots(), 1u);
  EXPECT_FALSE(writer->FinishWrite(begun->second, 2, two.size()));
  const Status why = writer->CheckClaim();
  EXPECT_EQ(why.code(), StatusCode::kSuperseded);
  EXPECT_NE(why.message().find("process " + std::to_string(newer.pid)), std::string::npos)
      << why.message();
  // Only step 1 is in memory; the next save is refused before it takes a slot.
  auto reader = Open();
  ASSERT_TRUE(reader);
  ASSERT_TRUE(reader->NewestComplete());
  EXPECT_EQ(reader->NewestComplete()->step, 1u);
  EXPECT_EQ(writer->BeginWrite(two.size()).status().code(), StatusCode::kSuperseded);
  EXPECT_EQ(writer->Reserve(two.size()).code(), StatusCode::kSuperseded);
  const SlotInfo one = *reader->NewestComplete();
  EXPECT_FALSE(writer->MarkResumed(one.index, one.generation));
  EXPECT_EQ(reader->NewestComplete()->complete_time_ns, one.complete_time_ns);
  writer->set_usable_slots(1);
  EXPECT_EQ(writer->DropUnusableSlots(), 0u);
  // The rank's new owner saves as usual.
  auto owner = Open();
  ASSERT_TRUE(owner);
  owner->set_claim_epoch(claim->epoch());
  Save(*owner, 3);
  ASSERT_OK(reader->Refresh());
  EXPECT_EQ(reader->NewestComplete()->step, 3u);
}

// A takeover between a superseded writer's check and its CAS: it gives the slot back without
// writing, and the slot keeps its snapshot.
TEST_F(ArenaTest, AWriterSupersededBeforeItTookTheSlotGivesItBackUntouched) {
  ASSERT_OK_AND_ASSIGN(auto claim, RankClaim::OpenOrCreate(job_dir_, 0));
  const internal::ProcessId self = internal::SelfProcessId();
  auto writer = Open();
  ASSERT_TRUE(writer);
  writer->set_claim_epoch(claim->SetOwner(self, 111));
  Save(*writer, 1);
  Save(*writer, 2);
  claim->SetOwner({self.pid + 1, self.start_ticks + 1}, 222);
  EXPECT_EQ(writer->BeginWrite(Shard(3).size()).status().code(), StatusCode::kSuperseded);
  auto reader = Open();
  std::vector<uint64_t> steps;
  for (const SlotInfo& s : reader->Slots()) {
    EXPECT_EQ(s.state, SlotState::kComplete);
    steps.push_back(s.step);
  }
  std::sort(steps.begin(), steps.end());
  EXPECT_EQ(steps, (std::vector<uint64_t>{1, 2}));
}

// The new owner finds a slot that the superseded process (alive) is writing: it takes the slot by
// laying out a new file, so the two never write the same memory and the new snapshot stays whole.
TEST_F(ArenaTest, ASlotASupersededProcessIsWritingIsTakenByANewFile) {
  ASSERT_OK_AND_ASSIGN(auto claim, RankClaim::OpenOrCreate(job_dir_, 0));
  const uint64_t stale_epoch = claim->SetOwner({1, 1}, 111);
  auto arena = Open();
  ASSERT_TRUE(arena);
  Save(*arena, 1);  // slot 0: the newest snapshot, kept by every writer
  const uint64_t size = Shard(2).size();
  int ready_fds[2], done_fds[2];
  ASSERT_EQ(::pipe(ready_fds), 0);
  internal::UniqueFd ready_read(ready_fds[0]), ready_write(ready_fds[1]);
  ASSERT_EQ(::pipe(done_fds), 0);
  internal::UniqueFd done_read(done_fds[0]), done_write(done_fds[1]);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // the stale writer: takes slot 1, writes garbage until told, then finishes
    ready_read.Reset();
    done_write.Reset();
    auto a = Arena::Open(job_dir_, 0);
    char ok = 0;
    std::optional<SlotWriteTicket> t;
    if (a.ok()) {
      (*a)->set_claim_epoch(stale_epoch);
      auto begun = (*a)->BeginWrite(size);
      if (begun.ok() && begun->first == Arena::Acquire::kAcquired) t = begun->second;
      ok = t ? 1 : 0;
    }
    if (::write(ready_write.get(), &ok, 1) != 1) ::_exit(1);
    char c;
    while (::read(done_read.get(), &c, 1) > 0) {
    }
    if (!t) ::_exit(2);
    std::memset(t->data.data(), 0xAB, t->data.size());
    ::_exit((*a)->FinishWrite(*t, 99, size) ? 3 : 0);
  }
  ready_write.Reset();
  done_read.Reset();
  char ok = 0;
  ASSERT_EQ(::read(ready_read.get(), &ok, 1), 1);
  ASSERT_EQ(ok, 1);
  const auto child_id =
      internal::ProcessId{static_cast<uint32_t>(child),
                          internal::ProcessStartTicks(static_cast<uint32_t>(child)).value_or(0)};
  // A newer run takes the rank (this process), recording the child as superseded.
  claim->AddSuperseded({child_id, 111, internal::SelfProcessId(), 222, 0});
  arena->set_claim_epoch(claim->SetOwner(internal::SelfProcessId(), 222));
  struct stat before;
  ASSERT_EQ(::stat(SlotPathOf(job_dir_, 0, 1).c_str(), &before), 0);
  Shard three(3);
  auto t = arena->BeginWrite(three.size());
  ASSERT_OK(t);
  ASSERT_EQ(t->first, Arena::Acquire::kAcquired);
  EXPECT_EQ(t->second.slot, 1u);
  struct stat after;
  ASSERT_EQ(::stat(SlotPathOf(job_dir_, 0, 1).c_str(), &after), 0);
  EXPECT_NE(after.st_ino, before.st_ino);
  three.builder->FillAll(t->second.data, 1);
  done_write.Reset();  // the child scribbles over its slot and tries to complete step 99
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the superseded writer completed its snapshot";
  EXPECT_TRUE(arena->FinishWrite(t->second, 3, three.size()));
  auto reader = Open();
  ASSERT_TRUE(reader->NewestComplete());
  EXPECT_EQ(reader->NewestComplete()->step, 3u);
  ExpectImage(reader->SlotData(1).subspan(0, three.size()), 3);
}

// gc's check: the writers recorded in the slots, by pid and start time (docs/format.md: the pid at
// offset 64 and the start time at offset 72 of the control block).
TEST_F(ArenaTest, LiveSlotWritersNamesRunningWritersOnly) {
  auto arena = Open();
  ASSERT_TRUE(arena);
  auto none = LiveSlotWriters(job_dir_);
  ASSERT_OK(none);
  EXPECT_TRUE(none->empty());
  Save(*arena, 1);
  const auto self = static_cast<uint32_t>(::getpid());
  EXPECT_EQ(arena->Slots()[0].writer_pid, self);
  EXPECT_GT(arena->Slots()[0].writer_start_ticks, 0u);
  EXPECT_EQ(*LiveSlotWriters(job_dir_), std::vector<uint32_t>{self});
  EXPECT_EQ(RemoveJobDirectory(job_dir_).status().code(), StatusCode::kInvalidArgument);

  // Another process takes the other slot and exits: it is not live, this process still is.
  const uint64_t size = Shard(2).size();
  pid_t child = -1;
  const int exit_code = test::RunInChild(
      [&] {
        auto a = Arena::Open(job_dir_, 0);
        if (!a.ok()) return 2;
        auto t = (*a)->BeginWrite(size);
        return t.ok() && t->first == Arena::Acquire::kAcquired && t->second.slot == 1 ? 0 : 3;
      },
      &child);
  ASSERT_EQ(exit_code, 0);
  ASSERT_OK(arena->Refresh());  // the child created slot 1
  EXPECT_EQ(arena->Slots()[1].writer_pid, static_cast<uint32_t>(child));
  EXPECT_EQ(*LiveSlotWriters(job_dir_), std::vector<uint32_t>{self});

  // A pid that runs but started at another time is a recycled pid, not the writer.
  {
    const internal::UniqueFd fd(::open(SlotPathOf(job_dir_, 0, 0).c_str(), O_RDWR | O_CLOEXEC));
    ASSERT_TRUE(fd.valid()) << std::strerror(errno);
    const uint64_t other_start = arena->Slots()[0].writer_start_ticks + 1;
    ASSERT_EQ(::pwrite(fd.get(), &other_start, sizeof(other_start), 72), 8);
  }
  EXPECT_EQ(arena->Slots()[0].writer_pid, self);
  EXPECT_TRUE(LiveSlotWriters(job_dir_)->empty());
  // A rank of more than 5 digits ("rank-123456.slot-0") is found too.
  auto wide = Open(kDefaultSlots, 123456);
  ASSERT_TRUE(wide);
  Save(*wide, 1);
  EXPECT_EQ(*ListArenaRanks(job_dir_), (std::vector<uint32_t>{0, 123456}));
  EXPECT_EQ(*LiveSlotWriters(job_dir_), std::vector<uint32_t>{self});
  ASSERT_OK(wide->Remove());
  arena.reset();
  auto freed = RemoveJobDirectory(job_dir_);
  ASSERT_OK(freed);
  EXPECT_GT(*freed, 0u);
  EXPECT_FALSE(fs::exists(job_dir_));
}

// Forks a child that runs `body` and then tells the parent through a pipe, waiting until killed;
// returns its pid once it has told.
pid_t ChildThatWaitsAfter(const std::function<void(int ready_fd)>& body) {
  int ready[2];
  EXPECT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(ready[0]);
    body(ready[1]);
    const char c = 1;
    (void)!::write(ready[1], &c, 1);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char c = 0;
  EXPECT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  return child;
}

// A writer that was killed and not yet reaped (a zombie) has unmapped its slots and saves no
// more: gc does not keep its job for it.
TEST_F(ArenaTest, AZombieSlotWriterIsNotLive) {
  const uint64_t size = Shard(1).size();
  const pid_t child = ChildThatWaitsAfter([&](int) {
    auto a = Arena::Open(job_dir_, 0);
    if (!a.ok() || !(*a)->BeginWrite(size).ok()) ::_exit(3);
  });
  EXPECT_EQ(*LiveSlotWriters(job_dir_), std::vector<uint32_t>{static_cast<uint32_t>(child)});
  KillLeavingZombie(child);
  EXPECT_TRUE(LiveSlotWriters(job_dir_)->empty());
  ASSERT_OK(RemoveJobDirectory(job_dir_));
  EXPECT_EQ(::waitpid(child, nullptr, 0), child);
}

// A process killed while creating a slot file (created under a temporary name, not yet renamed
// into place) leaves a file that no writer takes: gc removes it once its creator is dead (a
// zombie too), and while the creator runs keeps it and counts the creator as a live writer.
TEST_F(ArenaTest, GcRemovesASlotFileWhoseCreatorDiedBeforeNamingIt) {
  static int ready_fd = -1;
  // The child stops inside the slot file's creation: its fallocate goes past RLIMIT_FSIZE, and
  // the SIGXFSZ handler tells the parent and waits there until the child is killed.
  const pid_t child = ChildThatWaitsAfter([&](int fd) {
    ready_fd = fd;
    struct sigaction sa = {};
    sa.sa_handler = [](int) {
      const char c = 1;
      (void)!::write(ready_fd, &c, 1);
      for (;;) ::pause();
    };
    ::sigaction(SIGXFSZ, &sa, nullptr);
    const rlimit limit{1 << 20, 1 << 20};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    auto a = Arena::Open(job_dir_, 0);
    if (a.ok()) (void)(*a)->BeginWrite(Shard(1, 4 << 20).size());
    ::_exit(3);  // the creation did not stop where it should
  });
  auto temporaries = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(job_dir_)) {
      const std::string n = e.path().filename();
      if (n.find(".tmp.") != std::string::npos) names.push_back(n);
    }
    return names;
  };
  ASSERT_EQ(temporaries().size(), 1u);
  EXPECT_EQ(*LiveSlotWriters(job_dir_), std::vector<uint32_t>{static_cast<uint32_t>(child)});
  auto kept = RemoveDeadSlotTemporaries(job_dir_);
  ASSERT_OK(kept);
  EXPECT_EQ(kept->files, 0u);
  EXPECT_EQ(temporaries().size(), 1u);

  KillLeavingZombie(child);
  EXPECT_TRUE(LiveSlotWriters(job_dir_)->empty());
  auto listed = RemoveDeadSlotTemporaries(job_dir_, /*dry_run=*/true);
  ASSERT_OK(listed);
  EXPECT_EQ(listed->files, 1u);
  EXPECT_EQ(temporaries().size(), 1u);
  auto removed = RemoveDeadSlotTemporaries(job_dir_);
  ASSERT_OK(removed);
  EXPECT_EQ(removed->files, 1u);
  EXPECT_TRUE(temporaries().empty());
  EXPECT_EQ(::waitpid(child, nullptr, 0), child);
}

// gc removes a job whose agent kept other nodes' replicas (src/replica: <job_dir>/replicas), and
// refuses one whose replicas directory holds something that is not a regular file.
TEST_F(ArenaTest, RemoveJobDirectoryRemovesTheReplicas) {
  ASSERT_TRUE(fs::create_directory(job_dir_ + "/replicas"));
  ASSERT_TRUE(test::WriteStringToFile(job_dir_ + "/replicas/node1.rank-1.step-5.9.copy-0", "copy"));
  ASSERT_TRUE(test::WriteStringToFile(job_dir_ + "/replicas/.tmp-0123456789abcdef-x", "partial"));
  fs::create_symlink("/etc/passwd", job_dir_ + "/replicas/link");
  EXPECT_EQ(RemoveJobDirectory(job_dir_).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(fs::exists("/etc/passwd"));
  fs::remove(job_dir_ + "/replicas/link");
  auto freed = RemoveJobDirectory(job_dir_);
  ASSERT_OK(freed);
  EXPECT_FALSE(fs::exists(job_dir_));
}

// gc removes a job whose agent kept its default event log (and its rotated part) in the job
// directory (src/agent/event_log.h).
TEST_F(ArenaTest, RemoveJobDirectoryRemovesTheAgentsEventLog) {
  ASSERT_TRUE(test::WriteStringToFile(job_dir_ + "/events.jsonl", "{}\n"));
  ASSERT_TRUE(test::WriteStringToFile(job_dir_ + "/events.jsonl.1", "{}\n"));
  auto freed = RemoveJobDirectory(job_dir_);
  ASSERT_OK(freed);
  EXPECT_FALSE(fs::exists(job_dir_));
}

// Growing a slot re-creates its file; what it held before is gone, the other slot is untouched.
TEST_F(ArenaTest, CapacityGrowthRelaysOutTheSlot) {
  auto arena = Open(2);
  auto reader = Open(2);  // another process's mapping, refreshed only later
  ASSERT_TRUE(arena && reader);
  const auto t1 = Save(*arena, 1);
  const auto t2 = Save(*arena, 2);
  ASSERT_OK(reader->Refresh());
  const uint64_t old_capacity = arena->Slots()[t1.slot].capacity;
  struct stat before;
  ASSERT_EQ(::stat(SlotPathOf(job_dir_, 0, t1.slot).c_str(), &before), 0);

  const size_t big_elems = (old_capacity / sizeof(float)) + (1 << 20);
  Shard big(3, big_elems);
  ASSERT_GT(big.size(), old_capacity);
  auto t = arena->BeginWrite(big.size());
  ASSERT_OK(t);
  ASSERT_EQ(t->first, Arena::Acquire::kAcquired);
  EXPECT_EQ(t->second.slot, t1.slot);
  EXPECT_TRUE(t->second.relaid_out);
  EXPECT_GT(t->second.generation, t1.generation);
  EXPECT_EQ(t->second.data.size(), big.size());
  struct stat after;
  ASSERT_EQ(::stat(SlotPathOf(job_dir_, 0, t1.slot).c_str(), &after), 0);
  EXPECT_NE(after.st_ino, before.st_ino);
  EXPECT_EQ(after.st_mode & 0777, 0600u);
  // Nothing stale: the new slot holds none of step 1's bytes.
  const auto fresh = arena->SlotData(t1.slot);
  EXPECT_GE(fresh.size(), big.size());
  EXPECT_TRUE(
      std::all_of(fresh.begin(), fresh.end(), [](std::byte b) { return b == std::byte{0}; }));
  {
    SlotInfo info = arena->Slots()[t1.slot];
    EXPECT_EQ(info.state, SlotState::kWriting);
    EXPECT_GE(info.capacity, big.size());
    EXPECT_EQ(info.generation, t->second.generation);
  }
  // The reader's old mapping shows the replaced slot as being written, never as step 1.
  auto seen = reader->NewestComplete();
  ASSERT_TRUE(seen);
  EXPECT_EQ(seen->step, 2u);
  EXPECT_NE(reader->Slots()[t1.slot].state, SlotState::kComplete);

  big.builder->FillAll(t->second.data, 1);
  arena->FinishWrite(t->second, 3, big.size());
  ExpectImage(arena->SlotData(t1.slot).subspan(0, big.size()), 3, big_elems);
  ExpectImage(arena->SlotData(t2.slot).subspan(0, arena->Slots()[t2.slot].image_size), 2);

  ASSERT_OK(reader->Refresh());
  seen = reader->NewestComplete();
  ASSERT_TRUE(seen);
  EXPECT_EQ(seen->step, 3u);
  EXPECT_EQ(seen->index, t1.slot);
  ExpectImage(reader->SlotData(seen->index).subspan(0, seen->image_size), 3, big_elems);

  // A small image fits the small slot; a big one grows it once, and only once.
  Shard small(4);
  auto t4 = arena->BeginWrite(small.size());
  ASSERT_OK(t4);
  EXPECT_EQ(t4->second.slot, t2.slot);
  EXPECT_FALSE(t4->second.relaid_out);
  arena->AbortWrite(t4->second);
  Shard big5(5, big_elems);
  auto t5 = arena->BeginWrite(big5.size());
  ASSERT_OK(t5);
  EXPECT_EQ(t5->second.slot, t2.slot);
  EXPECT_TRUE(t5->second.relaid_out);
  big5.builder->FillAll(t5->second.data, 1);
  arena->FinishWrite(t5->second, 5, big5.size());
  Shard big6(6, big_elems);
  auto t6 = arena->BeginWrite(big6.size());
  ASSERT_OK(t6);
  EXPECT_EQ(t6->second.slot, t1.slot);
  EXPECT_FALSE(t6->second.relaid_out);
}

// Reserve lays every slot out ahead of time, so that the saves that follow do not.
TEST_F(ArenaTest, ReserveLaysOutEverySlot) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  Shard s(1);
  ASSERT_OK(arena->Reserve(s.size()));
  for (const SlotInfo& info : arena->Slots()) {
    EXPECT_GE(info.capacity, s.size()) << "slot " << info.index;
    EXPECT_NE(info.state, SlotState::kComplete);
    EXPECT_NE(info.state, SlotState::kWriting) << "slot " << info.index;
  }
  EXPECT_FALSE(arena->NewestComplete());
  for (uint64_t step = 1; step <= 2; ++step) {
    Shard shard(step);
    auto t = arena->BeginWrite(shard.size());
    ASSERT_OK(t);
    ASSERT_EQ(t->first, Arena::Acquire::kAcquired);
    EXPECT_FALSE(t->second.relaid_out) << "step " << step << " slot " << t->second.slot;
    shard.builder->FillAll(t->second.data, 1);
    arena->FinishWrite(t->second, step, shard.size());
  }
}

TEST_F(ArenaTest, ReserveKeepsSnapshotsAndIsANoOpWhenLargeEnough) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  const auto t1 = Save(*arena, 1);
  const uint64_t cap = arena->Slots()[t1.slot].capacity;
  // Grows what it may (not the newest snapshot), keeps step 1 readable.
  ASSERT_OK(arena->Reserve(cap + 1));
  auto newest = arena->NewestComplete();
  ASSERT_TRUE(newest);
  EXPECT_EQ(newest->step, 1u);
  ExpectImage(arena->SlotData(t1.slot).subspan(0, newest->image_size), 1);
  EXPECT_GE(arena->Slots()[1 - t1.slot].capacity, cap + 1);
  EXPECT_NE(arena->Slots()[1 - t1.slot].state, SlotState::kWriting);
  // Large enough already: nothing is re-created.
  struct stat a0, a1, b0, b1;
  ASSERT_EQ(::stat(SlotPathOf(job_dir_, 0, 0).c_str(), &a0), 0);
  ASSERT_EQ(::stat(SlotPathOf(job_dir_, 0, 1).c_str(), &a1), 0);
  ASSERT_OK(arena->Reserve(Shard(2).size()));
  ASSERT_EQ(::stat(SlotPathOf(job_dir_, 0, 0).c_str(), &b0), 0);
  ASSERT_EQ(::stat(SlotPathOf(job_dir_, 0, 1).c_str(), &b1), 0);
  EXPECT_EQ(a0.st_ino, b0.st_ino);
  EXPECT_EQ(a1.st_ino, b1.st_ino);
  EXPECT_EQ(arena->NewestComplete()->step, 1u);
}

// Budget mode (ClientOptions::max_shm_bytes below two snapshots): one usable slot, which the
// next save overwrites once it is not leased; the other slot files are given back.
TEST_F(ArenaTest, OneUsableSlotIsOverwrittenOnceNotLeasedAndTheOthersAreDropped) {
  auto arena = Open(2);
  auto agent = Open(2);
  ASSERT_TRUE(arena && agent);
  Save(*arena, 1);
  Save(*arena, 2);  // slot 1: the newest
  arena->set_usable_slots(1);
  EXPECT_EQ(arena->usable_slots(), 1u);
  // Slot 0 is taken (never slot 1, which is past the usable ones), then slot 0 again although
  // it holds the newest snapshot.
  const auto t3 = Save(*arena, 3, /*leased=*/true);
  EXPECT_EQ(t3.slot, 0u);
  // Slot 1's file is given back, except while it is leased: here it is not.
  EXPECT_GT(arena->DropUnusableSlots(), 0u);
  EXPECT_FALSE(fs::exists(SlotPathOf(job_dir_, 0, 1)));
  EXPECT_EQ(arena->Slots()[1].state, SlotState::kFree);
  // The only slot is leased (the agent persists step 3): a save is busy, and step 3 intact.
  Shard s(4);
  auto busy = arena->BeginWrite(s.size());
  ASSERT_OK(busy);
  EXPECT_EQ(busy->first, Arena::Acquire::kBusy);
  ExpectImage(arena->SlotData(0).subspan(0, arena->Slots()[0].image_size), 3);
  ASSERT_OK(agent->Refresh());
  agent->Release(t3.slot, t3.generation);
  const auto t4 = Save(*arena, 4);
  EXPECT_EQ(t4.slot, 0u);
  EXPECT_EQ(arena->NewestComplete()->step, 4u);
  // Reserve never takes the slot of the newest snapshot, even with one usable slot.
  ASSERT_OK(arena->Reserve(Shard(5, 64 << 10).size()));
  EXPECT_EQ(arena->NewestComplete()->step, 4u);
  ExpectImage(arena->SlotData(0).subspan(0, arena->Slots()[0].image_size), 4);
  EXPECT_FALSE(fs::exists(SlotPathOf(job_dir_, 0, 1)));
  // Back to two slots: the next save keeps step 4 and writes slot 1 again.
  arena->set_usable_slots(2);
  EXPECT_EQ(Save(*arena, 5).slot, 1u);
  ExpectImage(arena->SlotData(0).subspan(0, arena->Slots()[0].image_size), 4);
}

TEST_F(ArenaTest, DropUnusableSlotsKeepsALeasedSlot) {
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  Save(*arena, 1);
  const auto t2 = Save(*arena, 2, /*leased=*/true);  // slot 1, being persisted
  arena->set_usable_slots(1);
  EXPECT_EQ(arena->DropUnusableSlots(), 0u);
  EXPECT_TRUE(fs::exists(SlotPathOf(job_dir_, 0, 1)));
  ExpectImage(arena->SlotData(1).subspan(0, arena->Slots()[1].image_size), 2);
  arena->Release(t2.slot, t2.generation);
  EXPECT_GT(arena->DropUnusableSlots(), 0u);
  EXPECT_FALSE(fs::exists(SlotPathOf(job_dir_, 0, 1)));
}

TEST_F(ArenaTest, SlotFilesArePrivateAndNoTemporariesRemain) {
  auto arena = Open(2, /*rank=*/7);
  ASSERT_TRUE(arena);
  Save(*arena, 1);
  Save(*arena, 2);
  EXPECT_EQ(ListDir(job_dir_),
            (std::vector<std::string>{"rank-00007.slot-0", "rank-00007.slot-1"}));
  for (uint32_t i = 0; i < 2; ++i) {
    struct stat st;
    ASSERT_EQ(::lstat(SlotPathOf(job_dir_, 7, i).c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(st.st_uid, ::geteuid());
  }
  EXPECT_GT(arena->mapped_bytes(), 0u);
  // A rank's arena never sees another rank's slots.
  auto other = Open(2, 0);
  ASSERT_TRUE(other);
  EXPECT_FALSE(other->NewestComplete());
  ASSERT_OK(arena->Remove());
  EXPECT_TRUE(ListDir(job_dir_).empty());
  EXPECT_FALSE(arena->NewestComplete());
}

TEST_F(ArenaTest, RefusesSlotFileAccessibleToOthers) {
  {
    auto arena = Open(2);
    ASSERT_TRUE(arena);
    Save(*arena, 1);
  }
  ASSERT_EQ(::chmod(SlotPathOf(job_dir_, 0, 0).c_str(), 0644), 0);
  EXPECT_EQ(Arena::Open(job_dir_, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(ArenaTest, RefusesDamagedSlotFile) {
  ASSERT_TRUE(WriteStringToFile(SlotPathOf(job_dir_, 0, 1), std::string(8192, 'x')));
  ASSERT_EQ(::chmod(SlotPathOf(job_dir_, 0, 1).c_str(), 0600), 0);
  EXPECT_EQ(Arena::Open(job_dir_, 0).status().code(), StatusCode::kCorruption);
  ASSERT_TRUE(WriteStringToFile(SlotPathOf(job_dir_, 0, 1), "short"));
  EXPECT_EQ(Arena::Open(job_dir_, 0).status().code(), StatusCode::kCorruption);
}

// A symlink planted at a slot path is never followed: Open / Refresh fail and the target is
// neither read nor written.
TEST_F(ArenaTest, SymlinkAtSlotPathIsNotFollowed) {
  const std::string target = tmp_.Join("target");
  const std::string original(16384, 'T');
  ASSERT_TRUE(WriteStringToFile(target, original));
  ASSERT_EQ(::chmod(target.c_str(), 0600), 0);
  auto target_unchanged = [&] { return ReadFileToString(target) == original; };

  // Planted before the arena is opened.
  ASSERT_EQ(::symlink(target.c_str(), SlotPathOf(job_dir_, 0, 0).c_str()), 0);
  auto opened = Arena::Open(job_dir_, 0);
  EXPECT_FALSE(opened.ok());
  EXPECT_NE(opened.status().message().find("slot-0"), std::string::npos)
      << opened.status().message();
  EXPECT_TRUE(target_unchanged());
  ASSERT_EQ(::unlink(SlotPathOf(job_dir_, 0, 0).c_str()), 0);

  // Planted (replacing a real slot file) while the arena is open.
  auto arena = Open(2);
  ASSERT_TRUE(arena);
  Save(*arena, 1);
  Save(*arena, 2);
  ASSERT_EQ(::unlink(SlotPathOf(job_dir_, 0, 0).c_str()), 0);
  ASSERT_EQ(::symlink(target.c_str(), SlotPathOf(job_dir_, 0, 0).c_str()), 0);
  EXPECT_FALSE(arena->Refresh().ok());
  Shard s(3);
  auto t = arena->BeginWrite(s.size());
  EXPECT_FALSE(t.ok());
  EXPECT_FALSE(arena->Reserve(s.size()).ok());
  EXPECT_TRUE(target_unchanged());
  struct stat st;
  ASSERT_EQ(::lstat(SlotPathOf(job_dir_, 0, 0).c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));

  // A dangling symlink: nothing is created at its target.
  const std::string ghost = tmp_.path() + "/ghost";
  ASSERT_EQ(::unlink(SlotPathOf(job_dir_, 0, 0).c_str()), 0);
  ASSERT_EQ(::symlink(ghost.c_str(), SlotPathOf(job_dir_, 0, 0).c_str()), 0);
  EXPECT_FALSE(Arena::Open(job_dir_, 0).ok());
  EXPECT_FALSE(arena->BeginWrite(s.size()).ok());
  EXPECT_FALSE(fs::exists(ghost));
}

// Readers that follow the protocol (lease, or copy and re-check the generation) never see a torn
// image, while a writer saves as fast as it can.
TEST_F(ArenaTest, ConcurrentReaderNeverSeesATornImage) {
  auto writer = Open(2);
  ASSERT_TRUE(writer);
  Save(*writer, 1);
  constexpr uint64_t kSteps = 300;
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::atomic<uint64_t> parsed{0};

  std::thread reader_thread([&] {
    auto reader = Arena::Open(job_dir_, 0);
    if (!reader.ok()) {
      ++failures;
      return;
    }
    std::vector<std::byte> copy;
    // `image` is a whole image of `slot`'s step.
    auto check = [&](std::span<const std::byte> image, const SlotInfo& slot, const char* what) {
      auto r = ImageReader::Parse(image, what);
      if (!r.ok() || r->meta().step != slot.step) {
        ADD_FAILURE() << "step " << slot.step << ": " << r.status().ToString();
        ++failures;
      } else {
        ++parsed;
      }
    };
    for (uint64_t i = 0; !done.load() || i < 4; ++i) {
      if (!(*reader)->Refresh().ok()) {
        ++failures;
        continue;
      }
      // This view may hold no COMPLETE slot: Refresh maps the slot files that exist at that
      // moment, and a writer that runs several saves before the next read (a loaded machine)
      // may have put the newest snapshot into a file this view has not mapped yet while it
      // overwrites the one it has. What must never happen is reading a torn image, below.
      auto newest = (*reader)->NewestComplete();
      if (!newest) continue;
      if (i % 2 == 0) {
        // Lease, read in place, release.
        if (!(*reader)->Lease(newest->index, newest->generation)) continue;
        check((*reader)->SlotData(newest->index).subspan(0, newest->image_size), *newest,
              "leased slot");
        (*reader)->Release(newest->index, newest->generation);
      } else {
        // Copy, then check that the slot did not change meanwhile (what LoadNewest does).
        auto image = (*reader)->SlotData(newest->index).subspan(0, newest->image_size);
        copy.assign(image.begin(), image.end());
        std::atomic_thread_fence(std::memory_order_acquire);
        const SlotInfo now = (*reader)->Slots()[newest->index];
        if (now.generation != newest->generation || now.state != SlotState::kComplete) continue;
        check(copy, *newest, "copied slot");
      }
    }
  });

  uint64_t last_step = 1;
  for (uint64_t step = 2; step <= kSteps && last_step + 1 == step; ++step) {
    // Every fifth image is larger: slots are re-laid out while the reader maps them.
    Shard s(step, step % 5 == 0 ? (1 << 20) : (16 << 10));
    for (;;) {
      auto t = writer->BeginWrite(s.size());
      if (!t.ok()) {
        ADD_FAILURE() << t.status().ToString();
        break;
      }
      if (t->first == Arena::Acquire::kBusy) {
        std::this_thread::yield();
        continue;
      }
      s.builder->FillAll(t->second.data, 1);
      writer->FinishWrite(t->second, step, s.size());
      last_step = step;
      break;
    }
  }
  done = true;
  reader_thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(parsed.load(), 0u);
  auto newest = writer->NewestComplete();
  ASSERT_TRUE(newest);
  EXPECT_EQ(newest->step, kSteps);
  ExpectImage(writer->SlotData(newest->index).subspan(0, newest->image_size), kSteps,
              kSteps % 5 == 0 ? (1 << 20) : (16 << 10));
}

// --- Too little shared memory: a clear error, never a SIGBUS ---------------------------------

class ArenaTmpfsTest : public TempDirTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(TempDirTest::SetUp());
    if (::mount("tmpfs", tmp_.path().c_str(), "tmpfs", 0, "size=4m,mode=0700") != 0) {
      GTEST_SKIP() << "cannot mount a tmpfs (" << std::strerror(errno) << "); needs root";
    }
    mounted_ = true;
    ASSERT_OK_AND_ASSIGN(job_dir_, JobDirectory(tmp_.path(), "small", true));
  }
  void TearDown() override {
    if (mounted_) ::umount2(tmp_.path().c_str(), MNT_DETACH);
  }

  bool mounted_ = false;
  std::string job_dir_;
};

TEST_F(ArenaTmpfsTest, TooLittleSpaceIsResourceExhausted) {
  auto a = Arena::Open(job_dir_, 0);
  ASSERT_OK(a);
  Arena& arena = **a;

  // An image larger than the whole tmpfs.
  Shard huge(1, 1 << 20);  // 4 MiB of tensor data
  auto t = arena.BeginWrite(huge.size());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kResourceExhausted);
  const std::string& msg = t.status().message();
  EXPECT_NE(msg.find(job_dir_), std::string::npos) << msg;
  EXPECT_NE(msg.find("needs"), std::string::npos) << msg;
  EXPECT_NE(msg.find("free"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bytes"), std::string::npos) << msg;
  EXPECT_TRUE(ListDir(job_dir_).empty()) << "a failed slot creation left files behind";
  for (const SlotInfo& s : arena.Slots()) EXPECT_EQ(s.state, SlotState::kFree);

  // One slot of ~1 MiB fits; the second does not.
  Shard one(2, 256 << 10);
  auto t1 = arena.BeginWrite(one.size());
  ASSERT_OK(t1);
  ASSERT_EQ(t1->first, Arena::Acquire::kAcquired);
  one.builder->FillAll(t1->second.data, 1);
  arena.FinishWrite(t1->second, 2, one.size());

  Shard two(3, 256 << 10);
  auto t2 = arena.BeginWrite(two.size());
  ASSERT_FALSE(t2.ok());
  EXPECT_EQ(t2.status().code(), StatusCode::kResourceExhausted) << t2.status().ToString();
  EXPECT_NE(t2.status().message().find("needs"), std::string::npos) << t2.status().message();
  // The failure did not damage the snapshot that is there, nor leave a slot WRITING.
  auto newest = arena.NewestComplete();
  ASSERT_TRUE(newest);
  EXPECT_EQ(newest->step, 2u);
  ExpectImage(arena.SlotData(newest->index).subspan(0, newest->image_size), 2, 256 << 10);
  for (const SlotInfo& s : arena.Slots()) EXPECT_NE(s.state, SlotState::kWriting);
  EXPECT_EQ(ListDir(job_dir_), (std::vector<std::string>{"rank-00000.slot-0"}));
  EXPECT_FALSE(arena.Reserve(two.size()).ok());
}

// Slot files are pre-faulted with their space reserved: filling the tmpfs afterwards does not turn
// a later save into a SIGBUS.
TEST_F(ArenaTmpfsTest, FullTmpfsAfterCreationDoesNotSigbus) {
  auto a = Arena::Open(job_dir_, 0);
  ASSERT_OK(a);
  Arena& arena = **a;
  Shard first(1, 256 << 10);
  {
    auto t = arena.BeginWrite(first.size());
    ASSERT_OK(t);
    // Abort: the slot file exists (reserved) but holds nothing yet.
    arena.AbortWrite(t->second);
  }
  ASSERT_TRUE(test::FillFileSystem(tmp_.Join("filler")));
  auto t = arena.BeginWrite(first.size());
  ASSERT_OK(t);
  ASSERT_EQ(t->first, Arena::Acquire::kAcquired);
  EXPECT_FALSE(t->second.relaid_out);
  first.builder->FillAll(t->second.data, 1);  // would SIGBUS on unreserved tmpfs pages
  arena.FinishWrite(t->second, 1, first.size());
  ExpectImage(arena.SlotData(t->second.slot).subspan(0, first.size()), 1, 256 << 10);
  // The second slot cannot be created: an error, not a crash.
  Shard second(2, 256 << 10);
  auto t2 = arena.BeginWrite(second.size());
  EXPECT_EQ(t2.status().code(), StatusCode::kResourceExhausted) << t2.status().ToString();
}

}  // namespace
}  // namespace safepoint::arena_test
