// The checkpoint store under storage faults: failed operations, lying syncs, power losses and
// latency spikes during saves (src/storage/faulty); what a save reports and what every committed
// step still loads.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <map>
#include <random>
#include <thread>
#include <tuple>

#include "checkpoint/store_test_shard.h"
#include "safepoint/checkpoint.h"
#include "storage/faulty/faulty_storage.h"
#include "storage/posix/posix_storage.h"
#include "testing/test_util.h"

namespace safepoint::store_faults_test {
namespace {

using test::CommittedSteps;
using test::TempDir;
using namespace store_test;  // NOLINT(build/namespaces)

// Every storage operation failing with EIO, ENOSPC or a short write during a save: the save
// fails with a clear error (or, for clean-up, succeeds), every committed step still loads, no
// partial step becomes visible, and the save succeeds once the fault clears. A failed directory
// sync (kDirSync) fails the save with an IOError but leaves the object it published visible:
// when that is the COMMIT, step 4 is visible and loads, although the save was not reported. Then
// the power fails: every step reported committed still loads, and the newest loadable step is
// at least the newest one reported.
struct FaultCase {
  FaultOp op;
  FaultKind kind;
  uint64_t nth;
};

class FaultMatrixTest : public ::testing::TestWithParam<FaultCase> {};

TEST_P(FaultMatrixTest, SaveFailsCleanlyAndCommittedStepsSurvive) {
  auto base = std::shared_ptr<Storage>(NewMemoryStorage());
  auto faulty = std::make_shared<FaultyStorage>(base);
  CheckpointStore store(faulty);
  ASSERT_OK(Save(store, 1));
  ASSERT_OK(Save(store, 2));
  ASSERT_OK(store.DeleteStep(1));   // leave garbage for clean-up to delete later
  ASSERT_OK(Save(store, 3, 0, 2));  // an uncommitted step for clean-up (step 3 < 4)

  const FaultCase c = GetParam();
  faulty->Arm({c.op, c.nth, c.kind, false});
  Status s = Save(store, 4);
  const uint64_t fired = faulty->fired();
  faulty->Clear();

  if (fired == 0) {
    // This save never reaches the nth operation of this kind.
    EXPECT_OK(s);
  } else if (!s.ok()) {
    const StatusCode want = c.kind == FaultKind::kBitFlip ? StatusCode::kCorruption
                            : c.kind == FaultKind::kENOSPC && c.op != FaultOp::kDirSync
                                ? StatusCode::kResourceExhausted
                                : StatusCode::kIOError;
    EXPECT_EQ(s.code(), want) << s.ToString();
    EXPECT_NE(s.message().find("step-"), std::string::npos) << s.ToString();  // names the object
    if (c.op == FaultOp::kDirSync && CommittedSteps(store).back() == 4) {
      // The COMMIT's directory sync failed after it became visible: nothing deleted it.
      EXPECT_NE(s.message().find(CommitObjectName(4)), std::string::npos) << s.ToString();
      ExpectLoads(store, std::nullopt, 4);
    } else {
      EXPECT_EQ(CommittedSteps(store).back(), 2u);
    }
  } else {
    // The fault hit clean-up work after the commit (it loses nothing and does not fail the
    // save): the save's promise still holds, step 4 is committed and reads back exactly.
    EXPECT_TRUE(c.op == FaultOp::kDelete || c.op == FaultOp::kDeleteDirSync ||
                c.op == FaultOp::kList || c.op == FaultOp::kOpen || c.op == FaultOp::kRead)
        << FaultOpName(c.op);
    ExpectLoads(store, std::nullopt, 4);
  }
  ExpectLoads(store, 2, 2);
  for (uint64_t step : CommittedSteps(store)) ExpectLoads(store, step, step);

  ASSERT_OK(faulty->SimulatePowerLoss());
  ExpectLoads(store, 2, 2);
  ExpectLoads(store, std::nullopt, s.ok() ? 4 : 2);
  for (uint64_t step : CommittedSteps(store)) ExpectLoads(store, step, step);
  // Once the fault clears, the same save works (a failed one left no commit of step 4 behind).
  if (!s.ok()) {
    EXPECT_EQ(CommittedSteps(store).back(), 2u);
    ASSERT_OK(Save(store, 4));
  }
  ExpectLoads(store, std::nullopt, 4);
}

std::vector<FaultCase> AllFaults() {
  std::vector<FaultCase> out;
  for (int op = 0; op < static_cast<int>(FaultOp::kCount_); ++op) {
    for (uint64_t nth : {1, 2, 3}) {
      out.push_back({FaultOp(op), FaultKind::kEIO, nth});
      out.push_back({FaultOp(op), FaultKind::kENOSPC, nth});
      if (FaultOp(op) == FaultOp::kWrite) out.push_back({FaultOp(op), FaultKind::kShortWrite, nth});
      if (FaultOp(op) == FaultOp::kRead) out.push_back({FaultOp(op), FaultKind::kBitFlip, nth});
    }
  }
  return out;
}

std::string FaultCaseName(const ::testing::TestParamInfo<FaultCase>& info) {
  const FaultCase& c = info.param;
  return std::string(FaultOpName(c.op)) + "_" + std::string(FaultKindName(c.kind)) + "_" +
         std::to_string(c.nth);
}

INSTANTIATE_TEST_SUITE_P(AllOps, FaultMatrixTest, ::testing::ValuesIn(AllFaults()), FaultCaseName);

// Regression (issue 9, defect 4), on the POSIX driver: two ranks commit step 2 at once. Rank 1's
// COMMIT is renamed into place, rank 0 then publishes its equal COMMIT and reports the step
// committed, and only then does rank 1's directory fsync fail. Rank 1's save fails, but the
// step that rank 0 reported committed must stay: the driver used to unlink the COMMIT.
TEST(CheckpointStoreTest, FailedDirectoryFsyncNeverUndoesAnotherRanksCommit) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::function<void()> during_rank1_commit_sync = [] {};
  int commit_syncs = 0;
  auto storage = internal::NewPosixStorageWithSyncHook(
      dir.path(), {}, [&](internal::PosixPublishSync sync, std::string_view path) {
        if (sync != internal::PosixPublishSync::kDirectory ||
            !path.ends_with(CommitObjectName(2)) || ++commit_syncs != 1) {
          return 0;
        }
        during_rank1_commit_sync();
        return EIO;
      });
  ASSERT_OK(storage);
  CheckpointStore store(std::shared_ptr<Storage>(std::move(storage).value()));
  ASSERT_OK(Save(store, 1));
  ASSERT_OK(Save(store, 2, 0, 2));  // rank 0's image; the step waits for rank 1
  Result<bool> rank0_committed = false;
  during_rank1_commit_sync = [&] { rank0_committed = store.TryCommit(2, 2, "test", 0); };
  Status rank1 = Save(store, 2, 1, 2);
  EXPECT_EQ(rank1.code(), StatusCode::kIOError) << rank1.ToString();
  EXPECT_NE(rank1.message().find(dir.path() + "/" + StepPrefix(2).substr(0, 25) + ": fsync"),
            std::string::npos)
      << rank1.ToString();
  ASSERT_OK(rank0_committed);
  ASSERT_TRUE(*rank0_committed);
  EXPECT_EQ(CommittedSteps(store), (std::vector<uint64_t>{1, 2}));
  for (uint32_t r = 0; r < 2; ++r) ExpectLoads(store, std::nullopt, 2, r);
}

// What a committer does after its COMMIT's directory sync failed: the step is visible but not
// durable, so it is not reported; committing again (an equal record) makes it durable. Left
// alone, a power loss takes the COMMIT back, and the step before it is the newest.
TEST(CheckpointStoreTest, CommitAgainAfterAFailedDirectorySyncMakesTheStepDurable) {
  for (const bool commit_again : {false, true}) {
    SCOPED_TRACE(commit_again ? "committed again" : "left alone");
    auto faulty = std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
    CheckpointStore store(faulty);
    ASSERT_OK(Save(store, 1));
    faulty->Arm({FaultOp::kDirSync, 2, FaultKind::kEIO});  // #1: the image, #2: the COMMIT
    Status s = Save(store, 2);
    faulty->Clear();
    EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
    EXPECT_NE(s.message().find(CommitObjectName(2)), std::string::npos) << s.ToString();
    EXPECT_EQ(CommittedSteps(store), (std::vector<uint64_t>{1, 2}));  // visible
    EXPECT_EQ(faulty->undurable(), 1u);
    if (commit_again) {
      auto again = store.TryCommit(2, 1, "test", 0);
      ASSERT_OK(again);
      EXPECT_TRUE(*again);
      EXPECT_EQ(faulty->undurable(), 0u);
    }
    ASSERT_OK(faulty->SimulatePowerLoss());
    ExpectLoads(store, std::nullopt, commit_again ? 2 : 1);
    ExpectLoads(store, 1, 1);
  }
}

// Deleting a step (retention) on storage whose directory sync fails or lies after a removal:
// DeleteStep reports the failure, clean-up goes on, and after a power loss every other step is
// whole and the deleted one is either gone or whole (its COMMIT is removed first).
TEST(CheckpointStoreTest, DeleteWhoseDirectorySyncFailsLosesNoCommittedStep) {
  for (const FaultKind kind : {FaultKind::kEIO, FaultKind::kUnsynced}) {
    for (const uint64_t nth : {1, 2, 3}) {  // #1: the COMMIT, #2 and #3: the ranks' images
      SCOPED_TRACE(std::string(FaultKindName(kind)) + " at removal #" + std::to_string(nth));
      auto faulty = std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
      CheckpointStore store(faulty);
      for (uint64_t step = 1; step <= 3; ++step) {
        for (uint32_t rank = 0; rank < 2; ++rank) ASSERT_OK(Save(store, step, rank, 2));
      }
      faulty->Arm({FaultOp::kDeleteDirSync, nth, kind});
      const Status deleted = store.DeleteStep(2);
      faulty->Clear();
      if (kind == FaultKind::kEIO) {
        EXPECT_EQ(deleted.code(), StatusCode::kIOError) << deleted.ToString();
        EXPECT_NE(deleted.message().find("step-"), std::string::npos) << deleted.ToString();
      } else {
        EXPECT_OK(deleted);
      }
      EXPECT_EQ(CommittedSteps(store), (std::vector<uint64_t>{1, 3}));
      ASSERT_OK(store.CleanUp());
      ASSERT_OK(faulty->SimulatePowerLoss());
      const std::vector<uint64_t> steps = CommittedSteps(store);
      EXPECT_TRUE(steps == (std::vector<uint64_t>{1, 3}) ||
                  steps == (std::vector<uint64_t>{1, 2, 3}));
      for (const uint64_t step : steps) {
        for (uint32_t rank = 0; rank < 2; ++rank) ExpectLoads(store, step, step, rank);
      }
    }
  }
}

// Storage that lies: a data sync or a directory sync reports success and makes nothing
// durable. A power loss then tears step 2's image or COMMIT, or takes the COMMIT back (an image
// whose directory sync lied is saved by the COMMIT's sync of the same directory): a save that was
// reported committed can be lost (only honest storage keeps that promise), but loading never
// returns torn data: it falls back to the newest step that reads back intact.
TEST(CheckpointStoreTest, LyingSyncsLoseTheStepButNeverReturnTornData) {
  for (const FaultOp op : {FaultOp::kSync, FaultOp::kDirSync}) {
    for (uint64_t nth : {1, 2}) {
      for (uint64_t seed = 0; seed < 4; ++seed) {
        SCOPED_TRACE(std::string(FaultOpName(op)) + " #" + std::to_string(nth) + ", seed " +
                     std::to_string(seed));
        auto faulty =
            std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()), seed);
        CheckpointStore store(faulty);
        ASSERT_OK(Save(store, 1));
        faulty->Arm({op, nth, FaultKind::kUnsynced});
        ASSERT_OK(Save(store, 2));
        faulty->Clear();
        // The image's name is made durable by the COMMIT's (honest) sync of the same directory.
        const bool healed = op == FaultOp::kDirSync && nth == 1;
        EXPECT_EQ(faulty->undurable(), healed ? 0u : 1u);
        ASSERT_OK(faulty->SimulatePowerLoss());
        auto newest = LoadShard(store, std::nullopt, 0);
        ASSERT_OK(newest);
        ExpectShard(*newest, 0);
        if (op == FaultOp::kDirSync) {
          // The COMMIT's name went back, or nothing was lost.
          EXPECT_EQ(newest->commit.step, healed ? 2u : 1u);
        } else if (newest->commit.step == 1) {
          // Torn: the image (found corrupt) or the COMMIT (a corrupt record, skipped).
          EXPECT_TRUE(!newest->skipped.empty() ||
                      CommittedSteps(store) == std::vector<uint64_t>{1});
        }
        ExpectLoads(store, 1, 1);
      }
    }
  }
}

// One flipped bit in any read of a load is detected: the load returns exact data (of the newest
// step or, when the flip hit it, an older one) or a Corruption error, never wrong data.
TEST(CheckpointStoreTest, AFlippedBitInAnyReadIsDetected) {
  auto faulty = std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  CheckpointStore store(faulty);
  ASSERT_OK(Save(store, 1));
  ASSERT_OK(Save(store, 2));
  const uint64_t reads_per_load = [&] {
    const uint64_t before = faulty->count(FaultOp::kRead);
    EXPECT_OK(LoadShard(store, std::nullopt, 0));
    return faulty->count(FaultOp::kRead) - before;
  }();
  ASSERT_GT(reads_per_load, 3u);
  int fell_back = 0;
  for (uint64_t nth = 1; nth <= reads_per_load; ++nth) {
    SCOPED_TRACE("read #" + std::to_string(nth));
    faulty->Arm({FaultOp::kRead, nth, FaultKind::kBitFlip});
    auto shard = LoadShard(store, std::nullopt, 0);
    faulty->Clear();
    if (!shard.ok()) {
      EXPECT_EQ(shard.status().code(), StatusCode::kCorruption) << shard.status().ToString();
      continue;
    }
    ExpectShard(*shard, 0);
    fell_back += shard->commit.step == 1;
  }
  EXPECT_GT(fell_back, 0);
  ExpectLoads(store, std::nullopt, 2);
}

// The power-loss campaign: saves of 1- and 2-rank steps under seeded 1-in-N failures of every
// write-side operation (and of reads and lists), with the power failing at random moments. After
// each power loss, every step whose save was reported committed loads bit-exactly, and the
// newest loadable step is at least the newest one reported. The seed is in the test name.
class PowerLossCampaignTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(PowerLossCampaignTest, EveryStepReportedCommittedSurvives) {
  constexpr size_t kElems = 5000;  // small shards: many steps
  const uint64_t seed = GetParam();
  std::mt19937_64 rng(seed);
  auto faulty = std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()), seed);
  CheckpointStore store(faulty);
  std::map<uint64_t, uint32_t> reported;  // step -> world size
  int power_losses = 0;
  auto check = [&] {
    SCOPED_TRACE("after power loss " + std::to_string(power_losses));
    for (const auto& [step, world] : reported) {
      for (uint32_t r = 0; r < world; ++r) {
        auto shard = LoadShard(store, step, r);
        ASSERT_OK(shard) << "step " << step << " was reported committed";
        ExpectShard(*shard, r, kElems);
      }
    }
    if (reported.empty()) return;
    auto newest = LoadShard(store, std::nullopt, 0);
    ASSERT_OK(newest);
    EXPECT_GE(newest->commit.step, reported.rbegin()->first);
    ExpectShard(*newest, 0, kElems);
  };
  for (uint64_t step = 1; step <= 40; ++step) {
    for (FaultOp op :
         {FaultOp::kCreate, FaultOp::kWrite, FaultOp::kSync, FaultOp::kPublish, FaultOp::kDirSync,
          FaultOp::kDelete, FaultOp::kList, FaultOp::kOpen, FaultOp::kRead}) {
      faulty->Arm({.op = op, .kind = FaultKind::kEIO, .one_in = 40});
    }
    const uint32_t world = 1 + static_cast<uint32_t>(rng() % 2);
    for (uint32_t r = 0; r < world; ++r) {
      Shard shard(step, r, kElems);
      auto saved = SaveShard(store, Meta(step, r, world), shard.sources, shard.extras);
      if (saved.ok() && saved->committed) reported[step] = world;
    }
    if (rng() % 4 == 0 || step == 40) {
      faulty->Clear();
      ASSERT_OK(faulty->SimulatePowerLoss());
      ++power_losses;
      check();
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_GT(faulty->fired(), 10u);
  EXPECT_GT(reported.size(), 10u);
}

INSTANTIATE_TEST_SUITE_P(Seeds, PowerLossCampaignTest, ::testing::Values(1, 2, 3, 4, 5, 6),
                         [](const auto& info) { return "seed" + std::to_string(info.param); });

// Latency spikes: every operation of one kind (or the 2nd only) stalls. A save under spikes
// still commits; while it is slow, the newest committed step stays loadable, bit-exact, from
// another thread (no timing is asserted: the spikes only change interleavings).
class LatencySpikeTest : public ::testing::TestWithParam<std::tuple<FaultOp, bool>> {};

TEST_P(LatencySpikeTest, SaveUnderSpikesCommitsAndNewestStaysLoadable) {
  const auto [op, sticky] = GetParam();
  auto faulty = std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  CheckpointStore store(faulty);
  ASSERT_OK(Save(store, 1));
  // Two images of a step that never commits (world 3): a clean-up after step 3's commit
  // removes them (past the grace, none here), so that deletes run under the spikes too.
  ASSERT_OK(Save(store, 2, 0, 3));
  ASSERT_OK(Save(store, 2, 1, 3));
  faulty->Arm({op, sticky ? 1u : 2u, FaultKind::kDelay, sticky, std::chrono::milliseconds(3)});
  std::atomic<bool> done{false};
  std::atomic<int> loads{0};
  // At least one load, even when the machine is too busy to run the reader during the save
  // (the test then checks less, but asserts nothing about timing).
  std::thread reader([&] {
    do {
      auto shard = LoadShard(store, std::nullopt, 0);
      ASSERT_OK(shard);
      const uint64_t step = shard->commit.step;
      ASSERT_TRUE(step == 1 || step == 3) << step;
      Shard want(step, 0);
      auto big = shard->reader.tensor_data(0);
      ASSERT_EQ(big.size(), want.big.size() * 4);
      ASSERT_EQ(std::memcmp(big.data(), want.big.data(), big.size()), 0) << "step " << step;
      ++loads;
    } while (!done.load());
  });
  Status s = Save(store, 3);
  if (s.ok()) s = store.CleanUp(std::chrono::seconds(0)).status();
  done = true;
  reader.join();
  EXPECT_OK(s);
  EXPECT_GT(faulty->fired(), 0u) << "no spike was injected";
  EXPECT_GE(loads.load(), 1);
  faulty->Clear();
  EXPECT_EQ(CommittedSteps(store), (std::vector<uint64_t>{1, 3}));
  EXPECT_TRUE(faulty->List(StepPrefix(2))->empty()) << "step 2's images were not cleaned up";
  ExpectLoads(store, std::nullopt, 3);
  ExpectLoads(store, 1, 1);
}

INSTANTIATE_TEST_SUITE_P(
    AllOps, LatencySpikeTest,
    ::testing::Combine(::testing::Values(FaultOp::kCreate, FaultOp::kWrite, FaultOp::kSync,
                                         FaultOp::kPublish, FaultOp::kDirSync, FaultOp::kOpen,
                                         FaultOp::kRead, FaultOp::kList, FaultOp::kDelete),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<FaultOp, bool>>& info) {
      return std::string(FaultOpName(std::get<0>(info.param))) +
             (std::get<1>(info.param) ? "_every" : "_second");
    });

TEST(CheckpointStoreTest, PowerLossMidSaveLeavesNoPartialStep) {
  auto faulty = std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  CheckpointStore store(faulty);
  ASSERT_OK(Save(store, 1));
  // Rank 0 of a 2-rank step is durable; rank 1's write loses power after its first chunk.
  ASSERT_OK(Save(store, 2, 0, 2));
  Shard s(2, 1);
  auto b = ImageBuilder::Create(Meta(2, 1, 2), s.sources, s.extras);
  ASSERT_OK(b);
  auto w = faulty->Create(ImageObjectName(2, 1), (*b)->size());
  ASSERT_OK(w);
  std::vector<std::byte> chunk(kDefaultChunkSize);
  (*b)->Fill(0, chunk);
  ASSERT_OK((*w)->WriteAt(0, chunk));
  ASSERT_OK(faulty->SimulatePowerLoss());
  EXPECT_FALSE((*w)->Publish().ok());
  EXPECT_EQ(CommittedSteps(store), (std::vector<uint64_t>{1}));
  ExpectLoads(store, std::nullopt, 1);
}
}  // namespace
}  // namespace safepoint::store_faults_test
