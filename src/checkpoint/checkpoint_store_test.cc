#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "safepoint/checkpoint.h"
#include "storage/faulty/faulty_storage.h"
#include "storage/posix/posix_storage.h"
#include "testing/test_util.h"

namespace safepoint::checkpoint_store_test {
namespace {

using test::AsBytes;
using test::CommittedSteps;
using test::TempDir;

// A shard whose bytes are a pure function of (step, rank).
// "big" depends on the step (and the rank).
struct Shard : test::TwoTensorShard {
  Shard(uint64_t step, uint32_t rank, size_t big_elems = 3 << 20)
      : TwoTensorShard(step, rank, /*seed=*/step, big_elems) {}
};

ImageMeta Meta(uint64_t step, uint32_t rank, uint32_t world) {
  return test::TestImageMeta("test", step, rank, world);
}

Status Save(CheckpointStore& store, uint64_t step, uint32_t rank = 0, uint32_t world = 1) {
  Shard s(step, rank);
  return SaveShard(store, Meta(step, rank, world), s.sources, s.extras).status();
}

// Checks that `shard` is exactly what Shard(step, rank, big_elems) wrote, for its step.
void ExpectShard(const LoadedShard& shard, uint32_t rank, size_t big_elems = 3 << 20) {
  Shard want(shard.commit.step, rank, big_elems);
  ASSERT_EQ(shard.reader.tensors().size(), 2u);
  auto big = shard.reader.tensor_data(0);
  ASSERT_EQ(big.size(), want.big.size() * 4);
  EXPECT_EQ(std::memcmp(big.data(), want.big.data(), big.size()), 0)
      << "step " << shard.commit.step << ", rank " << rank;
  auto enc = EncodeExtras(shard.extras);
  EXPECT_EQ(*enc, want.extras);
}

// Loads and checks that the content is exactly what Shard(step, rank) wrote.
void ExpectLoads(CheckpointStore& store, std::optional<uint64_t> step, uint64_t expect_step,
                 uint32_t rank = 0) {
  auto shard = LoadShard(store, step, rank);
  ASSERT_OK(shard);
  EXPECT_EQ(shard->commit.step, expect_step);
  ExpectShard(*shard, rank);
}

TEST(CheckpointStoreTest, SaveLoadAndSteps) {
  CheckpointStore store(NewMemoryStorage());
  EXPECT_EQ(LoadShard(store, std::nullopt, 0).status().code(), StatusCode::kNotFound);
  ASSERT_OK(Save(store, 5));
  ASSERT_OK(Save(store, 10));
  EXPECT_EQ(CommittedSteps(store), (std::vector<uint64_t>{5, 10}));
  ExpectLoads(store, std::nullopt, 10);
  ExpectLoads(store, 5, 5);
  EXPECT_EQ(LoadShard(store, 7, 0).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(LoadShard(store, 10, 3).status().code(), StatusCode::kInvalidArgument);
}

TEST(CheckpointStoreTest, StepIsInvisibleUntilEveryRankWrote) {
  CheckpointStore store(NewMemoryStorage());
  for (uint32_t r : {3u, 0u, 2u}) {
    ASSERT_OK(Save(store, 1, r, 4));
    EXPECT_TRUE(CommittedSteps(store).empty());
  }
  ASSERT_OK(Save(store, 1, 1, 4));
  EXPECT_EQ(CommittedSteps(store), (std::vector<uint64_t>{1}));
  for (uint32_t r = 0; r < 4; ++r) ExpectLoads(store, std::nullopt, 1, r);
  auto commit = store.ReadCommit(1);
  ASSERT_OK(commit);
  EXPECT_EQ(commit->world_size, 4u);
  EXPECT_EQ(commit->job, "test");
}

// Regression (found while building the DCP adapter): with two ranks, re-saving a committed
// step on one rank committed it again at once, pairing the other rank's old image with the new
// one; so did a new save beside the image an unfinished earlier save left. Images now carry
// their save attempt, and a step commits only from images of one attempt.
TEST(CheckpointStoreTest, StepCommitsOnlyFromImagesOfOneAttempt) {
  CheckpointStore store(NewMemoryStorage());
  auto save = [&](uint32_t rank, uint64_t attempt) {
    Shard s(1, rank);
    ImageMeta m = Meta(1, rank, 2);
    m.attempt = attempt;
    return SaveShard(store, m, s.sources, s.extras);
  };
  // A crashed run (attempt 7) left rank 0's image; the restarted run (attempt 8) saves again.
  ASSERT_OK(save(0, 7));
  auto r1 = save(1, 8);
  ASSERT_OK(r1);
  EXPECT_FALSE(r1->committed);
  EXPECT_TRUE(CommittedSteps(store).empty());  // never the mix of attempts 7 and 8
  auto r0 = save(0, 8);
  ASSERT_OK(r0);
  EXPECT_TRUE(r0->committed);
  EXPECT_EQ(CommittedSteps(store), (std::vector<uint64_t>{1}));

  // The committed step is immutable: a plain re-save is refused (CommittedStepIs... below).
  EXPECT_EQ(save(1, 9).status().code(), StatusCode::kAlreadyExists);
  for (uint32_t r = 0; r < 2; ++r) ExpectLoads(store, 1, 1, r);
}

TEST(CheckpointStoreTest, StepCommitsOnlyWhenEveryReplicaLeftElsewhereIsHeld) {
  std::vector<float> a(1000, 1.5f), b(10, 2.5f);
  auto save = [&](CheckpointStore& store, uint32_t rank, bool a_elsewhere, bool with_a) {
    std::vector<TensorSource> t;
    if (with_a) {
      TensorSource s{{"a", DType::kFloat32, {1000}, {}, {}}, a.data(), 4000};
      s.spec.elsewhere = a_elsewhere;
      t.push_back(s);
    }
    t.push_back({{"b" + std::to_string(rank), DType::kFloat32, {10}, {}, {}}, b.data(), 40});
    return SaveShard(store, Meta(4, rank, 2), t, *EncodeExtras(Value()));
  };
  {  // rank 0 leaves "a" to rank 1, which holds it: commits, and rank 1's bytes are "a"
    CheckpointStore store(NewMemoryStorage());
    ASSERT_OK(save(store, 0, true, true));
    auto r = save(store, 1, false, true);
    ASSERT_OK(r);
    EXPECT_TRUE(r->committed);
  }
  {  // nobody holds "a": the commit fails, naming the tensor, and the step stays invisible
    CheckpointStore store(NewMemoryStorage());
    ASSERT_OK(save(store, 0, true, true));
    auto r = save(store, 1, false, false);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
    EXPECT_NE(r.status().message().find("'a'"), std::string::npos) << r.status().message();
    EXPECT_TRUE(CommittedSteps(store).empty());
  }
}

TEST(CheckpointStoreTest, CommitRecordRoundTripAndCorruption) {
  const CommitRecord r{.step = 42,
                       .world_size = 3,
                       .commit_time_ns = 123,
                       .job = "j",
                       .images = {{4096, 1}, {8192, 2}, {12288, 3}}};
  std::string enc = EncodeCommitRecord(r);
  auto dec = DecodeCommitRecord(AsBytes(enc), "c");
  ASSERT_OK(dec);
  EXPECT_EQ(dec->images[2].size, 12288u);
  EXPECT_EQ(dec->total_bytes(), 4096u + 8192 + 12288);
  for (size_t i = 0; i < enc.size(); ++i) {
    std::string bad = enc;
    bad[i] ^= 0x04;
    EXPECT_EQ(DecodeCommitRecord(AsBytes(bad), "c").status().code(), StatusCode::kCorruption) << i;
  }
  for (size_t n = 0; n < enc.size(); n += 7) {
    EXPECT_FALSE(DecodeCommitRecord(AsBytes(enc.substr(0, n)), "c").ok());
  }
}

TEST(CheckpointStoreTest, StepNamesParse) {
  EXPECT_EQ(StepPrefix(42), "step-00000000000000000042/");
  EXPECT_EQ(ImageObjectName(42, 3), "step-00000000000000000042/rank-00003.img");
  EXPECT_EQ(StepFromObjectName("step-00000000000000000042/COMMIT"), 42u);
  EXPECT_EQ(StepFromObjectName("step-18446744073709551615/x"), 18446744073709551615ull);
  EXPECT_FALSE(StepFromObjectName("step-99999999999999999999/x"));  // overflows u64
  EXPECT_FALSE(StepFromObjectName("step-0000000000000000004x/x"));
  EXPECT_FALSE(StepFromObjectName("other"));
}

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

TEST(CheckpointStoreTest, CorruptNewestFallsBackToOlder) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  ASSERT_OK(Save(store, 1));
  ASSERT_OK(Save(store, 2));
  // Replace step 2's image with a copy that has one flipped byte in the tensor data.
  auto obj = mem->Open(ImageObjectName(2, 0));
  ASSERT_OK(obj);
  std::vector<std::byte> bytes((*obj)->size());
  ASSERT_OK((*obj)->ReadAt(0, bytes));
  bytes[3 << 20] ^= std::byte{0x40};
  auto w = mem->Create(ImageObjectName(2, 0), bytes.size());
  ASSERT_OK((*w)->WriteAt(0, bytes));
  ASSERT_OK((*w)->Publish());

  auto exact = LoadShard(store, 2, 0);
  EXPECT_EQ(exact.status().code(), StatusCode::kCorruption);
  EXPECT_NE(exact.status().message().find("rank-00000.img"), std::string::npos);
  EXPECT_NE(exact.status().message().find("chunk 0"), std::string::npos)
      << exact.status().message();
  auto newest = LoadShard(store, std::nullopt, 0);
  ASSERT_OK(newest);
  EXPECT_EQ(newest->commit.step, 1u);
  ASSERT_EQ(newest->skipped.size(), 1u);
  EXPECT_NE(newest->skipped[0].find("step 2"), std::string::npos);
}

// Issue 35: a step whose rank 0 leaves tensor "huge" (of `shape`, uint8) to another rank's image
// ("elsewhere"), and no image of the step holds it: the COMMIT record is forged past the
// commit's check (CheckReplicasHeld), as a hostile or damaged checkpoint directory would hold it.
// Rank 1 (when `world` is 2) holds only its own tensor.
void ForgeStepLeavingATensorToNobody(CheckpointStore& store, uint64_t step, uint32_t world,
                                     std::vector<uint64_t> shape) {
  std::vector<float> small(17, 1.0f);
  for (uint32_t r = 0; r < world; ++r) {
    std::vector<TensorSource> t;
    if (r == 0) {
      TensorSource huge{{"huge", DType::kUInt8, shape, {}, {}}, nullptr, 0};
      huge.spec.elsewhere = true;
      uint64_t n = 1;
      for (uint64_t d : shape) n *= d;
      huge.nbytes = n;
      t.push_back(huge);
    }
    t.push_back({{"small" + std::to_string(r), DType::kFloat32, {17}, {}, {}}, small.data(), 68});
    auto saved = SaveShard(store, Meta(step, r, world), t, *EncodeExtras(Value()));
    // The commit (at the last rank) refuses the step: nobody holds "huge".
    ASSERT_TRUE(r + 1 < world || !saved.ok()) << "the forged step committed by itself";
  }
  CommitRecord record;
  record.step = step;
  record.world_size = world;
  record.job = "test";
  for (uint32_t r = 0; r < world; ++r) {
    auto obj = store.storage().Open(ImageObjectName(step, r));
    ASSERT_OK(obj);
    std::vector<std::byte> header(kImageHeaderSize);
    ASSERT_OK((*obj)->ReadAt(0, header));
    auto parsed = ParseImageHeader(header, "forged");
    ASSERT_OK(parsed);
    record.images.push_back({parsed->second.image_size, parsed->second.header_crc, false});
  }
  ASSERT_OK(test::PutObject(store.storage(), CommitObjectName(step),
                            AsBytes(EncodeCommitRecord(record))));
}

// The entry of 2^40 bytes passed verify and inspect (the image itself is intact), and a load
// allocated it before looking for it in another image: bounded now by the largest image of the
// step (the image that held it would be at least as large), so that verify (ReadImage), inspect
// (ReadMetadata) and load refuse the step as corrupt, and a load of the newest step falls back.
TEST(CheckpointStoreTest, ATensorLeftElsewhereLargerThanAnyImageIsCorruption) {
  CheckpointStore store(NewMemoryStorage());
  ASSERT_OK(Save(store, 1));
  ASSERT_NO_FATAL_FAILURE(ForgeStepLeavingATensorToNobody(store, 2, 1, {uint64_t{1} << 40}));
  ASSERT_OK_AND_ASSIGN(CommitRecord commit, store.ReadCommit(2));
  auto md = store.ReadMetadata(commit, 0);
  EXPECT_EQ(md.status().code(), StatusCode::kCorruption) << md.status().ToString();
  EXPECT_NE(md.status().message().find("'huge'"), std::string::npos) << md.status().ToString();
  auto image = store.ReadImage(commit, 0);
  EXPECT_EQ(image.status().code(), StatusCode::kCorruption) << image.status().ToString();
  auto exact = LoadShard(store, 2, 0);
  EXPECT_EQ(exact.status().code(), StatusCode::kCorruption) << exact.status().ToString();
  ASSERT_OK_AND_ASSIGN(LoadedShard newest, LoadShard(store, std::nullopt, 0));
  EXPECT_EQ(newest.commit.step, 1u);
  ASSERT_EQ(newest.skipped.size(), 1u);
  EXPECT_EQ(newest.skipped[0].rfind("step 2: ", 0), 0u) << newest.skipped[0];
}

// Of a plausible size but held by no image of the step: a load checks that some image holds
// every tensor its image leaves elsewhere before handing the image out (and anything is
// allocated for those tensors), and falls back to the older step.
TEST(CheckpointStoreTest, ALoadChecksThatEveryTensorLeftElsewhereIsHeld) {
  CheckpointStore store(NewMemoryStorage());
  ASSERT_OK(Save(store, 1, 0, 2));
  ASSERT_OK(Save(store, 1, 1, 2));
  ASSERT_NO_FATAL_FAILURE(ForgeStepLeavingATensorToNobody(store, 2, 2, {1000}));
  auto exact = LoadShard(store, 2, 0);
  EXPECT_EQ(exact.status().code(), StatusCode::kCorruption) << exact.status().ToString();
  EXPECT_NE(exact.status().message().find("step 2"), std::string::npos)
      << exact.status().ToString();
  EXPECT_NE(exact.status().message().find("'huge'"), std::string::npos)
      << exact.status().ToString();
  ASSERT_OK_AND_ASSIGN(LoadedShard newest, LoadShard(store, std::nullopt, 0));
  EXPECT_EQ(newest.commit.step, 1u);
  ASSERT_EQ(newest.skipped.size(), 1u);
  EXPECT_EQ(newest.skipped[0].rfind("step 2: ", 0), 0u) << newest.skipped[0];
  // Rank 1 leaves nothing elsewhere: its image of step 2 loads.
  ASSERT_OK_AND_ASSIGN(LoadedShard one, LoadShard(store, 2, 1));
  EXPECT_EQ(one.commit.step, 2u);
  // `safepoint inspect` still shows the image (its entry is within bounds).
  ASSERT_OK_AND_ASSIGN(CommitRecord commit, store.ReadCommit(2));
  EXPECT_OK(store.ReadMetadata(commit, 0));
}

// What `safepoint verify` and `safepoint inspect` say of such steps: each command's exit status
// and output (stdout and stderr).
std::pair<int, std::string> RunCli(const std::string& args) {
  std::string out;
  FILE* p = ::popen((std::string(SAFEPOINT_CLI_PATH) + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(CheckpointStoreTest, VerifyReportsATensorLeftElsewhereThatNoImageHolds) {
  for (uint64_t size : {uint64_t{1} << 40, uint64_t{1000}}) {
    SCOPED_TRACE(size);
    TempDir dir;
    auto posix = NewPosixStorage(dir.path());
    ASSERT_OK(posix);
    CheckpointStore store(std::shared_ptr<Storage>(std::move(*posix)));
    ASSERT_OK(Save(store, 1, 0, 2));
    ASSERT_OK(Save(store, 1, 1, 2));
    ASSERT_NO_FATAL_FAILURE(ForgeStepLeavingATensorToNobody(store, 2, 2, {size}));
    auto [rc, out] = RunCli("verify --all " + dir.path());
    EXPECT_NE(rc, 0) << out;
    EXPECT_NE(out.find("DAMAGED  step 2"), std::string::npos) << out;
    EXPECT_NE(out.find("'huge'"), std::string::npos) << out;
    EXPECT_EQ(out.find("DAMAGED  step 1"), std::string::npos) << out;
    std::tie(rc, out) = RunCli("inspect --step 2 " + dir.path());
    EXPECT_EQ(rc != 0, size > 1000) << out;  // a tensor larger than any image of the step
  }
}

// A counting wrapper: how many bytes were read, to show that range reads read only what they need.
class CountingStorage : public test::ForwardingStorage {
 public:
  using ForwardingStorage::ForwardingStorage;
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    SP_ASSIGN_OR_RETURN(auto obj, inner_->Open(name));
    return std::unique_ptr<ReadableObject>(new Counted(std::move(obj), &bytes_read));
  }
  std::atomic<uint64_t> bytes_read{0};

 private:
  struct Counted : ReadableObject {
    Counted(std::unique_ptr<ReadableObject> o, std::atomic<uint64_t>* n)
        : obj(std::move(o)), count(n) {}
    uint64_t size() const override { return obj->size(); }
    Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
      *count += dst.size();
      return obj->ReadAt(offset, dst);
    }
    std::unique_ptr<ReadableObject> obj;
    std::atomic<uint64_t>* count;
  };
};

// Records where each read of an object landed in memory.
class LandingStorage : public test::ForwardingStorage {
 public:
  using ForwardingStorage::ForwardingStorage;
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    SP_ASSIGN_OR_RETURN(auto obj, inner_->Open(name));
    return std::unique_ptr<ReadableObject>(new Recorded(std::move(obj), this));
  }
  std::vector<std::pair<uint64_t, const std::byte*>> Landings() {
    std::lock_guard<std::mutex> lock(mu_);
    return landings_;
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    landings_.clear();
  }

 private:
  struct Recorded : ReadableObject {
    Recorded(std::unique_ptr<ReadableObject> o, LandingStorage* s) : obj(std::move(o)), owner(s) {}
    uint64_t size() const override { return obj->size(); }
    Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
      {
        std::lock_guard<std::mutex> lock(owner->mu_);
        owner->landings_.emplace_back(offset, dst.data());
      }
      return obj->ReadAt(offset, dst);
    }
    std::unique_ptr<ReadableObject> obj;
    LandingStorage* owner;
  };
  std::mutex mu_;
  std::vector<std::pair<uint64_t, const std::byte*>> landings_;
};

// A restore reads whole chunks of a tensor straight into the target (memory already faulted
// in), with no staging copy, and still verifies each of them; partial chunks at the ends are
// staged. A flipped byte in a chunk read in place is an error naming the chunk.
TEST(CheckpointStoreTest, RangeReadsLandWholeChunksInTheirDestination) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  auto landing = std::make_shared<LandingStorage>(mem);
  CheckpointStore store(landing);
  // "big" has 3 Mi + 1234 floats: it starts inside chunk 0 and ends inside chunk 3, so chunks
  // 1 and 2 lie wholly inside it and the ends are partial.
  const size_t elems = (3 << 20) + 1234;
  {
    Shard s(5, 0, elems);
    ASSERT_OK(SaveShard(store, Meta(5, 0, 1), s.sources, s.extras).status());
  }
  Shard want(5, 0, elems);
  auto commit = store.ReadCommit(5);
  ASSERT_OK(commit);
  auto md = store.ReadMetadata(*commit, 0);
  ASSERT_OK(md);
  const TensorEntry& big = md->tensors[0];
  const uint64_t chunk = md->layout.chunk_size;
  ASSERT_LT(big.offset, chunk);
  ASSERT_GT(big.offset + big.nbytes, 3 * chunk);
  std::vector<float> dst(elems);
  auto* d = reinterpret_cast<std::byte*>(dst.data());
  std::vector<CheckpointStore::Range> ranges = {{big.offset, big.nbytes, d}};
  landing->Clear();
  ASSERT_OK(store.ReadRanges(*md, ranges));
  EXPECT_EQ(std::memcmp(dst.data(), want.big.data(), big.nbytes), 0);
  std::set<uint64_t> in_place;
  for (auto [offset, where] : landing->Landings()) {
    if (where >= d && where < d + big.nbytes) {
      EXPECT_EQ(where, d + (offset - big.offset));
      in_place.insert(offset);
    }
  }
  EXPECT_EQ(in_place, (std::set<uint64_t>{chunk, 2 * chunk}));

  // Corrupt chunk 2 (read in place): the read fails and names it.
  auto obj = mem->Open(ImageObjectName(5, 0));
  std::vector<std::byte> bytes((*obj)->size());
  ASSERT_OK((*obj)->ReadAt(0, bytes));
  bytes[2 * chunk + 4096] ^= std::byte{0x10};
  auto w = mem->Create(ImageObjectName(5, 0), bytes.size());
  ASSERT_OK((*w)->WriteAt(0, bytes));
  ASSERT_OK((*w)->Publish());
  Status s = store.ReadRanges(*md, ranges);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("chunk 2"), std::string::npos) << s.message();
}

TEST(CheckpointStoreTest, RangeReadsReadOnlyTheirChunksAndVerifyThem) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  auto counting = std::make_shared<CountingStorage>(mem);
  CheckpointStore store(counting);
  ASSERT_OK(Save(store, 3));  // "big": 12 MiB of float32, three 4 MiB chunks and more
  auto commit = store.ReadCommit(3);
  ASSERT_OK(commit);
  auto md = store.ReadMetadata(*commit, 0);
  ASSERT_OK(md);
  ASSERT_EQ(md->chunk_crcs.size(), md->layout.chunk_count());
  const TensorEntry& big = md->tensors[0];
  Shard want(3, 0);

  // Elements [1'000'000, 1'100'000) straddle the boundary of two chunks; one more range sits in
  // the same chunk; a third is the small tensor.
  std::vector<float> a(100'000), b(10), c(17);
  std::vector<CheckpointStore::Range> ranges = {
      {big.offset + 4'000'000, a.size() * 4, reinterpret_cast<std::byte*>(a.data())},
      {big.offset + 4'000'000 + 40, b.size() * 4, reinterpret_cast<std::byte*>(b.data())},
      {md->tensors[1].offset, 68, reinterpret_cast<std::byte*>(c.data())}};
  counting->bytes_read = 0;
  ASSERT_OK(store.ReadRanges(*md, ranges));
  EXPECT_EQ(std::memcmp(a.data(), want.big.data() + 1'000'000, a.size() * 4), 0);
  EXPECT_EQ(std::memcmp(b.data(), want.big.data() + 1'000'010, b.size() * 4), 0);
  EXPECT_EQ(std::memcmp(c.data(), want.small.data(), 68), 0);
  // At most the chunks that cover the ranges were read: 2 for the big ranges, 1 for the small.
  EXPECT_LE(counting->bytes_read.load(), 3 * md->layout.chunk_size);
  // Chunk 2 (inside "big", touched by no range) was not read.
  EXPECT_LE(counting->bytes_read.load(), md->layout.image_size - md->layout.chunk_size);

  // A range outside the image's data is refused.
  std::vector<CheckpointStore::Range> bad = {
      {md->layout.checksums_offset - 4, 8, reinterpret_cast<std::byte*>(c.data())}};
  EXPECT_EQ(store.ReadRanges(*md, bad).code(), StatusCode::kInvalidArgument);

  // One flipped byte in the second chunk: ranges touching that chunk fail, naming it; a range
  // elsewhere still reads.
  auto obj = mem->Open(ImageObjectName(3, 0));
  std::vector<std::byte> bytes((*obj)->size());
  ASSERT_OK((*obj)->ReadAt(0, bytes));
  bytes[md->layout.chunk_size + 100] ^= std::byte{0x01};
  auto w = mem->Create(ImageObjectName(3, 0), bytes.size());
  ASSERT_OK((*w)->WriteAt(0, bytes));
  ASSERT_OK((*w)->Publish());
  Status s = store.ReadRanges(*md, ranges);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("chunk 1"), std::string::npos) << s.message();
  std::vector<CheckpointStore::Range> small_only = {ranges[2]};
  EXPECT_OK(store.ReadRanges(*md, small_only));
}

// Announces a preferred request shape (as object stores do) and records the requests it gets.
class ShapedStorage : public test::ForwardingStorage {
 public:
  struct Request {
    std::string name;
    uint64_t offset, size;
    bool operator<(const Request& o) const { return offset < o.offset; }
  };
  ShapedStorage(std::shared_ptr<Storage> inner, uint64_t io_size, size_t parallelism)
      : ForwardingStorage(std::move(inner)), io_size_(io_size), parallelism_(parallelism) {}
  StorageCapabilities capabilities() const override {
    StorageCapabilities caps = inner_->capabilities();
    caps.preferred_io_size = io_size_;
    caps.io_parallelism = parallelism_;
    return caps;
  }
  Result<std::unique_ptr<WritableObject>> Create(std::string_view n, uint64_t size) override {
    SP_ASSIGN_OR_RETURN(auto obj, inner_->Create(n, size));
    return std::unique_ptr<WritableObject>(new Writer(std::move(obj), this, std::string(n)));
  }
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    SP_ASSIGN_OR_RETURN(auto obj, inner_->Open(name));
    return std::unique_ptr<ReadableObject>(new Reader(std::move(obj), this, std::string(name)));
  }

  // The requests to object `name` since the last call (of any object), sorted by offset.
  std::vector<Request> TakeReads(const std::string& name) { return Take(reads_, name); }
  std::vector<Request> TakeWrites(const std::string& name) { return Take(writes_, name); }

 private:
  std::vector<Request> Take(std::vector<Request>& v, const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Request> out;
    for (auto& r : v) {
      if (r.name == name) out.push_back(std::move(r));
    }
    v.clear();
    std::sort(out.begin(), out.end());
    return out;
  }
  void Record(std::vector<Request>& v, const std::string& name, uint64_t offset, uint64_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    v.push_back({name, offset, size});
  }
  struct Reader : ReadableObject {
    Reader(std::unique_ptr<ReadableObject> o, ShapedStorage* s, std::string n)
        : obj(std::move(o)), st(s), name(std::move(n)) {}
    uint64_t size() const override { return obj->size(); }
    Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
      st->Record(st->reads_, name, offset, dst.size());
      return obj->ReadAt(offset, dst);
    }
    std::unique_ptr<ReadableObject> obj;
    ShapedStorage* st;
    std::string name;
  };
  struct Writer : WritableObject {
    Writer(std::unique_ptr<WritableObject> o, ShapedStorage* s, std::string n)
        : obj(std::move(o)), st(s), name(std::move(n)) {}
    Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
      st->Record(st->writes_, name, offset, data.size());
      return obj->WriteAt(offset, data);
    }
    Status Publish() override { return obj->Publish(); }
    Status PublishIfAbsent() override { return obj->PublishIfAbsent(); }
    void Abort() override { obj->Abort(); }
    std::unique_ptr<WritableObject> obj;
    ShapedStorage* st;
    std::string name;
  };
  const uint64_t io_size_;
  const size_t parallelism_;
  std::mutex mu_;
  std::vector<Request> reads_, writes_;
};

TEST(CheckpointStoreTest, ImagesMoveInTheStoragesPreferredRequestsAndEveryChunkIsVerified) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  // Three chunks per request; the image (four chunks, the last one short) does not end on a
  // request boundary.
  auto shaped = std::make_shared<ShapedStorage>(mem, 3 * kDefaultChunkSize, 2);
  CheckpointStore store(shaped);
  ASSERT_OK(Save(store, 1));
  auto commit = store.ReadCommit(1);
  ASSERT_OK(commit);
  auto md = store.ReadMetadata(*commit, 0);
  ASSERT_OK(md);
  const ImageLayout& l = md->layout;
  ASSERT_EQ(l.chunk_size, kDefaultChunkSize);
  ASSERT_EQ(l.chunk_count(), 4u);
  const uint64_t span = 3 * l.chunk_size;
  ASSERT_NE(l.checksums_offset % span, 0u);

  // Written as two data requests (three chunks, then the short rest) and the checksum section.
  const std::string image = ImageObjectName(1, 0);
  std::vector<ShapedStorage::Request> writes = shaped->TakeWrites(image);
  ASSERT_EQ(writes.size(), 3u);
  EXPECT_EQ(writes[0].offset, 0u);
  EXPECT_EQ(writes[0].size, span);
  EXPECT_EQ(writes[1].offset, span);
  EXPECT_EQ(writes[1].size, l.checksums_offset - span);
  EXPECT_EQ(writes[2].offset, l.checksums_offset);

  // Read back the same way, bit-exact to the last byte.
  shaped->TakeReads(image);
  auto loaded = LoadShard(store, 1, 0);
  ASSERT_OK(loaded);
  ExpectShard(*loaded, 0);
  std::vector<ShapedStorage::Request> data_reads;
  for (const auto& r : shaped->TakeReads(image)) {
    // Besides the data: the header and the checksum section.
    const bool header = r.offset == 0 && r.size == kImageHeaderSize;
    if (!header && r.offset < l.checksums_offset) data_reads.push_back(r);
  }
  ASSERT_EQ(data_reads.size(), 2u);
  EXPECT_EQ(data_reads[0].offset, 0u);
  EXPECT_EQ(data_reads[0].size, span);
  EXPECT_EQ(data_reads[1].offset, span);
  EXPECT_EQ(data_reads[1].size, l.checksums_offset - span);

  // One flipped byte in the middle chunk of the first request: the load fails naming chunk 1.
  auto obj = mem->Open(ImageObjectName(1, 0));
  ASSERT_OK(obj);
  std::vector<std::byte> bytes((*obj)->size());
  ASSERT_OK((*obj)->ReadAt(0, bytes));
  bytes[l.chunk_size + l.chunk_size / 2] ^= std::byte{0x10};
  auto w = mem->Create(ImageObjectName(1, 0), bytes.size());
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, bytes));
  ASSERT_OK((*w)->Publish());
  auto bad = LoadShard(store, 1, 0);
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("chunk 1"), std::string::npos) << bad.status().message();

  // A preferred size that is not a multiple of the chunk size: one chunk per request.
  auto odd = std::make_shared<ShapedStorage>(mem, l.chunk_size + 4096, 3);
  CheckpointStore odd_store(odd);
  ASSERT_OK(Save(odd_store, 2));
  const std::vector<ShapedStorage::Request> odd_writes = odd->TakeWrites(ImageObjectName(2, 0));
  EXPECT_EQ(odd_writes.size(), l.chunk_count() + 1);  // the chunks and the checksum section
  for (const auto& r : odd_writes) EXPECT_LE(r.size, l.chunk_size);
  ASSERT_OK(LoadShard(odd_store, 2, 0));
  for (const auto& r : odd->TakeReads(ImageObjectName(2, 0))) EXPECT_LE(r.size, l.chunk_size);
}

TEST(CheckpointStoreTest, ImageReplacedAfterCommitIsDetected) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  ASSERT_OK(Save(store, 1));
  // A valid image of another step under step 1's name: checksums pass, the commit does not.
  Shard s(9, 0);
  auto b = ImageBuilder::Create(Meta(9, 0, 1), s.sources, s.extras);
  std::vector<std::byte> bytes((*b)->size());
  (*b)->FillAll(bytes, 2);
  auto w = mem->Create(ImageObjectName(1, 0), bytes.size());
  ASSERT_OK((*w)->WriteAt(0, bytes));
  ASSERT_OK((*w)->Publish());
  EXPECT_EQ(LoadShard(store, 1, 0).status().code(), StatusCode::kCorruption);
}

TEST(CheckpointStoreTest, CorruptCommitRecordHidesOnlyThatStep) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  ASSERT_OK(Save(store, 1));
  ASSERT_OK(Save(store, 2));
  auto w = mem->Create(CommitObjectName(2), 3);
  ASSERT_OK((*w)->WriteAt(0, AsBytes("xyz")));
  ASSERT_OK((*w)->Publish());
  std::vector<std::string> problems;
  auto c = store.ListCommitted(&problems);
  ASSERT_OK(c);
  ASSERT_EQ(c->size(), 1u);
  EXPECT_EQ((*c)[0].step, 1u);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("COMMIT"), std::string::npos);
  ExpectLoads(store, std::nullopt, 1);
}

TEST(CheckpointStoreTest, CleanUpRemovesOnlyAbandonedOlderSteps) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  ASSERT_OK(Save(store, 1, 0, 2));  // never completed: abandoned once 3 commits
  ASSERT_OK(Save(store, 2));
  ASSERT_OK(Save(store, 4, 1, 2));  // newer than the newest commit: maybe in progress
  ASSERT_OK(Save(store, 3));        // commits 3 and cleans up: step 1's image is too young
  auto names = [&] {
    auto objects = mem->List("");
    EXPECT_OK(objects);
    std::vector<std::string> out;
    for (auto& o : *objects) out.push_back(o.name);
    return out;
  };
  EXPECT_EQ(names(), (std::vector<std::string>{ImageObjectName(1, 0), CommitObjectName(2),
                                               ImageObjectName(2, 0), CommitObjectName(3),
                                               ImageObjectName(3, 0), ImageObjectName(4, 1)}));
  // Once older than the grace (none here), it goes; the newer uncommitted step stays.
  ASSERT_OK(store.CleanUp(std::chrono::seconds(0)));
  EXPECT_EQ(names(), (std::vector<std::string>{CommitObjectName(2), ImageObjectName(2, 0),
                                               CommitObjectName(3), ImageObjectName(3, 0),
                                               ImageObjectName(4, 1)}));
  ExpectLoads(store, 2, 2);
}

// Two writers of one root, each saving another step: the newer step commits while the older
// one's image is published and its other rank has yet to write. The newer commit's clean-up
// leaves that image alone, and the older step then commits whole and loads. (Before the grace,
// the clean-up removed it: the older save's commit then failed, or, when it had already found
// every image, wrote a COMMIT record naming an image that was gone.)
TEST(CheckpointStoreTest, ACommitsCleanUpLeavesAnOlderStepBeingWrittenAlone) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  ASSERT_OK(Save(store, 1, 0, 2));  // the older save: rank 0 published, rank 1 still writing
  ASSERT_OK(Save(store, 2));        // the newer save commits and cleans up
  ASSERT_OK(Save(store, 1, 1, 2));  // the older save's last rank: commits step 1
  EXPECT_EQ(CommittedSteps(store), (std::vector<uint64_t>{1, 2}));
  ExpectLoads(store, 1, 1, 0);
  ExpectLoads(store, 1, 1, 1);
}

TEST(CheckpointStoreTest, PosixLeftoversOfAKilledWriterAreIgnoredAndRemoved) {
  namespace fs = std::filesystem;
  TempDir tmp_dir;
  ASSERT_TRUE(tmp_dir.ok());
  const fs::path dir = tmp_dir.path();
  auto store = OpenCheckpointStore(dir.string());
  ASSERT_OK(store);
  ASSERT_OK(Save(**store, 1));
  // What a writer killed mid-save leaves: a temporary image in step 2's directory.
  fs::create_directories(dir / "step-00000000000000000002");
  const fs::path tmp = dir / "step-00000000000000000002" / "rank-00000.img.tmp.0123456789abcdef";
  std::ofstream(tmp) << "partial";
  // And one of a step newer than any commit, whose writer may still be running elsewhere.
  fs::create_directories(dir / "step-00000000000000000005");
  const fs::path newer = dir / "step-00000000000000000005" / "rank-00001.img.tmp.0123456789abcdef";
  std::ofstream(newer) << "in progress";
  EXPECT_EQ(CommittedSteps(**store), (std::vector<uint64_t>{1}));
  ExpectLoads(**store, std::nullopt, 1);
  ASSERT_OK(Save(**store, 3));  // commits 3 and removes step 2's leftovers
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_TRUE(fs::exists(newer));
  ExpectLoads(**store, std::nullopt, 3);
}

// --- Replacing a committed step (SaveOptions::overwrite) -------------------------------------

// Saves Shard(step, rank, elems) with `attempt`; elems tells the versions of a step apart.
Result<SaveResult> SaveVersion(CheckpointStore& store, uint64_t step, uint32_t rank, uint32_t world,
                               uint64_t attempt, size_t elems, bool overwrite) {
  Shard s(step, rank, elems);
  ImageMeta m = Meta(step, rank, world);
  m.attempt = attempt;
  return SaveShard(store, m, s.sources, s.extras, SaveOptions{overwrite});
}

// The number of elements of "big" in rank's image of the newest step (the version loaded).
size_t LoadedVersion(CheckpointStore& store, uint32_t rank) {
  auto shard = LoadShard(store, std::nullopt, rank);
  EXPECT_TRUE(shard.ok()) << shard.status().ToString();
  return shard.ok() ? shard->reader.tensors()[0].nbytes / 4 : 0;
}

std::vector<std::string> ObjectNames(Storage& storage, uint64_t step) {
  std::vector<std::string> names;
  auto objects = storage.List(StepPrefix(step));
  EXPECT_TRUE(objects.ok());
  if (objects.ok()) {
    for (const auto& o : *objects) names.push_back(o.name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Regression (issue 9, defect 8): safepoint.save of a committed step silently replaced it.
TEST(CheckpointStoreTest, CommittedStepIsImmutableUnlessOverwritten) {
  CheckpointStore store(NewMemoryStorage());
  ASSERT_TRUE(SaveVersion(store, 1, 0, 1, 0, 1000, false).ok());
  auto again = SaveVersion(store, 1, 0, 1, 0, 2000, false);
  ASSERT_EQ(again.status().code(), StatusCode::kAlreadyExists) << again.status().ToString();
  EXPECT_NE(again.status().message().find("step 1 is already committed"), std::string::npos)
      << again.status().message();
  EXPECT_EQ(LoadedVersion(store, 0), 1000u);

  // overwrite needs an attempt that names the new images.
  EXPECT_EQ(SaveVersion(store, 1, 0, 1, 0, 2000, true).status().code(),
            StatusCode::kInvalidArgument);
  auto replaced = SaveVersion(store, 1, 0, 1, 5, 2000, true);
  ASSERT_TRUE(replaced.ok()) << replaced.status().ToString();
  EXPECT_TRUE(replaced->committed);
  EXPECT_EQ(LoadedVersion(store, 0), 2000u);
  auto commit = store.ReadCommit(1);
  ASSERT_TRUE(commit.ok());
  EXPECT_EQ(commit->generation, 5u);
  // The old image is gone; only what the record names is left.
  EXPECT_EQ(ObjectNames(store.storage(), 1),
            (std::vector<std::string>{CommitObjectName(1), ImageObjectName(1, 0, 5)}));
  // The same attempt again would overwrite the committed images in place: refused.
  EXPECT_EQ(SaveVersion(store, 1, 0, 1, 5, 3000, true).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(SaveVersion(store, 1, 0, 1, 6, 3000, true).ok());
  EXPECT_EQ(LoadedVersion(store, 0), 3000u);
  EXPECT_EQ(SaveVersion(store, 1, 0, 1, 6, 4000, false).status().code(),
            StatusCode::kAlreadyExists);
}

TEST(CheckpointStoreTest, ReplacingAMultiRankStepShowsTheOldOrTheNewStepNeverAMix) {
  CheckpointStore store(NewMemoryStorage());
  for (uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(SaveVersion(store, 3, r, 2, 7, 1000, false).ok());
  // Rank 0 of the replacing save (attempt 8) is done; the step is still the old one on every
  // rank (before, the step was un-committed here: nothing to load).
  auto r0 = SaveVersion(store, 3, 0, 2, 8, 2000, true);
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  EXPECT_FALSE(r0->committed);
  EXPECT_EQ(CommittedSteps(store), (std::vector<uint64_t>{3}));
  EXPECT_EQ(LoadedVersion(store, 0), 1000u);
  EXPECT_EQ(LoadedVersion(store, 1), 1000u);
  auto old_commit = store.ReadCommit(3);
  ASSERT_TRUE(old_commit.ok());
  // The agent's plain commit of the old images cannot undo a replacement either (below).
  auto r1 = SaveVersion(store, 3, 1, 2, 8, 2000, true);
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_TRUE(r1->committed);
  EXPECT_EQ(LoadedVersion(store, 0), 2000u);
  EXPECT_EQ(LoadedVersion(store, 1), 2000u);
  EXPECT_EQ(ObjectNames(store.storage(), 3),
            (std::vector<std::string>{CommitObjectName(3), ImageObjectName(3, 0, 8),
                                      ImageObjectName(3, 1, 8)}));
  // A reader that still holds the old record finds its images gone; LoadShard reads the new
  // record instead of failing.
  EXPECT_EQ(store.ReadImage(*old_commit, 0).status().code(), StatusCode::kNotFound);
  auto again = store.TryCommit(3, 2, "test", 7);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(*again);
  EXPECT_EQ(store.ReadCommit(3)->generation, 8u);
}

// A plain commit (generation 0) that checked the record before a replacement committed must not
// publish over the replacement's record: its record would name the images the replacement has
// removed, and the step would be lost. The plain committer's COMMIT is held between its data
// sync and its rename while a replacing save runs to the end.
TEST(CheckpointStoreTest, APlainCommitRacingAReplacementNeverUndoesIt) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::function<void()> before_commit_rename;
  auto storage = internal::NewPosixStorageWithSyncHook(
      dir.path(), {}, [&](internal::PosixPublishSync sync, std::string_view path) {
        if (sync == internal::PosixPublishSync::kFile && path.ends_with(CommitObjectName(4)) &&
            before_commit_rename) {
          std::exchange(before_commit_rename, nullptr)();
        }
        return 0;
      });
  ASSERT_OK(storage);
  CheckpointStore store(std::shared_ptr<Storage>(std::move(storage).value()));
  ASSERT_TRUE(SaveVersion(store, 4, 0, 1, 0, 1000, false).ok());
  Result<SaveResult> replaced = InvalidArgument("not run");
  before_commit_rename = [&] { replaced = SaveVersion(store, 4, 0, 1, 9, 2000, true); };
  auto plain = store.TryCommit(4, 1, "test", 0);  // e.g. a rank committing again
  ASSERT_OK(replaced);
  ASSERT_TRUE(replaced->committed);
  ASSERT_OK(plain);
  EXPECT_TRUE(*plain);
  auto commit = store.ReadCommit(4);
  ASSERT_OK(commit);
  EXPECT_EQ(commit->generation, 9u);
  EXPECT_EQ(LoadedVersion(store, 0), 2000u);
}

// The agent's writes (docs/reliability.md, "Two writers of one image"): each image is named by
// its attempt and published only where the name is free, in either layout; the commit names that
// attempt's images, and a commit of another attempt finds the step committed and changes nothing.
TEST(CheckpointStoreTest, TheAgentsImagesAreNamedByAttemptAndNeverWrittenOver) {
  CheckpointStore store(NewMemoryStorage());
  const PackOptions plain, packed = MakePackOptions("zstd", false);
  auto image = [](uint32_t rank, uint64_t attempt, uint64_t chunk_size) {
    Shard s(6, rank, 1 << 12);
    ImageMeta m = Meta(6, rank, 2);
    m.attempt = attempt;
    auto b = ImageBuilder::Create(m, s.sources, s.extras, chunk_size);
    EXPECT_OK(b.status());
    std::vector<std::byte> bytes((*b)->size());
    (*b)->FillAll(bytes, 1);
    return bytes;
  };
  auto write = [&](uint32_t rank, uint64_t attempt, uint64_t chunk_size, const PackOptions& o) {
    const std::vector<std::byte> bytes = image(rank, attempt, chunk_size);
    return store.WriteImageBytesOfAttempt(bytes, 6, rank, o).status();
  };
  ASSERT_OK(write(0, 7, 1 << 20, plain));
  EXPECT_EQ(write(0, 7, 64 << 10, plain).code(), StatusCode::kAlreadyExists);
  ASSERT_OK(write(1, 7, 1 << 20, packed));
  EXPECT_EQ(write(1, 7, 64 << 10, packed).code(), StatusCode::kAlreadyExists);
  auto objects = store.storage().List(StepPrefix(6));
  ASSERT_OK(objects);
  std::vector<std::string> names;
  for (const ObjectInfo& o : *objects) names.push_back(o.name);
  EXPECT_EQ(names, (std::vector<std::string>{ImageObjectName(6, 0, 7), PackedObjectName(6, 1, 7)}));
  EXPECT_TRUE(*store.HoldsImageOfAttempt(6, 0, 7));
  EXPECT_FALSE(*store.HoldsImageOfAttempt(6, 0, 8));

  // A later attempt's image of rank 0 lies beside attempt 7's; its commit waits for rank 1's.
  ASSERT_OK(write(0, 8, 1 << 20, plain));
  ASSERT_OK_AND_ASSIGN(bool committed, store.TryCommitOfAttempt(6, 2, "test", 8));
  EXPECT_FALSE(committed);
  ASSERT_OK_AND_ASSIGN(committed, store.TryCommitOfAttempt(6, 2, "test", 7));
  EXPECT_TRUE(committed);
  ASSERT_OK(write(1, 8, 1 << 20, plain));
  ASSERT_OK_AND_ASSIGN(committed, store.TryCommitOfAttempt(6, 2, "test", 8));
  EXPECT_TRUE(committed);  // committed already, by attempt 7: its record stays
  auto commit = store.ReadCommit(6);
  ASSERT_OK(commit);
  EXPECT_EQ(commit->generation, 7u);
  for (uint32_t rank = 0; rank < 2; ++rank) {
    auto shard = LoadShard(store, 6, rank);
    ASSERT_OK(shard);
    EXPECT_EQ(shard->reader.meta().attempt, 7u);
  }
}

// An agent's commit that finds the step committed by another writer makes that record durable
// before it says so: the other writer may have died between publishing its COMMIT and syncing
// the directory (docs/format.md, step 7), and a step reported committed must survive a power loss.
TEST(CheckpointStoreTest, AnAttemptsCommitFoundCommittedMakesTheRecordDurable) {
  auto faulty = std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  CheckpointStore store(faulty);
  Shard shard(6, 0, 1 << 12);
  ImageMeta meta = Meta(6, 0, 1);
  meta.attempt = 7;
  auto builder = ImageBuilder::Create(meta, shard.sources, shard.extras, 1 << 20);
  ASSERT_OK(builder);
  std::vector<std::byte> bytes((*builder)->size());
  (*builder)->FillAll(bytes, 1);
  ASSERT_OK(store.WriteImageBytesOfAttempt(bytes, 6, 0, PackOptions{}));
  // The first writer's COMMIT becomes visible, and its directory sync lies.
  faulty->Arm({FaultOp::kDirSync, 1, FaultKind::kUnsynced});
  ASSERT_OK_AND_ASSIGN(bool committed, store.TryCommitOfAttempt(6, 1, "test", 7));
  EXPECT_TRUE(committed);
  faulty->Clear();
  EXPECT_EQ(faulty->undurable(), 1u);
  // The second writer finds the record: it is committed, and durable now.
  ASSERT_OK_AND_ASSIGN(committed, store.TryCommitOfAttempt(6, 1, "test", 7));
  EXPECT_TRUE(committed);
  EXPECT_EQ(faulty->undurable(), 0u);
  ASSERT_OK(faulty->SimulatePowerLoss());
  ASSERT_OK_AND_ASSIGN(CommitRecord record, store.ReadCommit(6));
  EXPECT_EQ(record.generation, 7u);
  ASSERT_OK(LoadShard(store, 6, 0));
}

TEST(CheckpointStoreTest, CommitRecordOfAReplacedStepRoundTrips) {
  CommitRecord r;
  r.step = 9;
  r.world_size = 2;
  r.images = {{4096, 1}, {8192, 2}};
  r.generation = 0x1234;
  const std::string enc = EncodeCommitRecord(r);
  EXPECT_EQ(enc.size(), 104u + 12 * 2 + 8);
  auto span = [](const std::string& x) {
    return std::span<const std::byte>(reinterpret_cast<const std::byte*>(x.data()), x.size());
  };
  auto dec = DecodeCommitRecord(span(enc), "c");
  ASSERT_TRUE(dec.ok()) << dec.status().ToString();
  EXPECT_EQ(dec->generation, 0x1234u);
  EXPECT_EQ(ImageObjectName(*dec, 1), "step-00000000000000000009/rank-00001.g0000000000001234.img");
  for (size_t i = 0; i < enc.size(); ++i) {
    std::string bad = enc;
    bad[i] ^= 0x04;
    EXPECT_EQ(DecodeCommitRecord(span(bad), "c").status().code(), StatusCode::kCorruption) << i;
  }
  r.generation = 0;
  EXPECT_EQ(EncodeCommitRecord(r).size(), 104u + 12 * 2);  // plain records stay version 1
}

}  // namespace
}  // namespace safepoint::checkpoint_store_test
