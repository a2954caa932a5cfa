#include "agent/persist_queue.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "safepoint/image.h"
#include "shm/arena.h"
#include "storage/faulty/faulty_storage.h"
#include "testing/test_util.h"

namespace safepoint::agent {
namespace {

constexpr uint64_t kStep = 5;

// One rank's snapshot of step kStep in a slot, and a store over FaultyStorage in which another
// writer's COMMIT of that step is visible but not durable (its directory sync failed).
class PersistQueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(tmp_.ok());
    ASSERT_OK_AND_ASSIGN(job_dir_, JobDirectory(tmp_.path(), "pq", true));
    ASSERT_OK_AND_ASSIGN(arena_, Arena::Open(job_dir_, 0));
    const ImageMeta meta = test::TestImageMeta("pq", kStep, 0, 1);
    ASSERT_OK_AND_ASSIGN(auto builder, ImageBuilder::Create(meta, shard_.sources, shard_.extras));
    ASSERT_OK_AND_ASSIGN(auto ticket, arena_->BeginWrite(builder->size()));
    ASSERT_EQ(ticket.first, Arena::Acquire::kAcquired);
    builder->FillAll(ticket.second.data, 1);
    arena_->FinishWrite(ticket.second, kStep, builder->size(), /*leased=*/false);
    slot_ = ticket.second.slot;
    generation_ = arena_->Slots()[slot_].generation;

    faulty_->Arm({FaultOp::kDirSync, 2, FaultKind::kEIO});  // #1: the image, #2: the COMMIT
    const Status saved = SaveShard(*store_, meta, shard_.sources, shard_.extras).status();
    faulty_->Clear();
    ASSERT_EQ(saved.code(), StatusCode::kIOError) << saved.ToString();
    ASSERT_OK(store_->ReadCommit(kStep));  // visible
    ASSERT_EQ(faulty_->undurable(), 1u);   // not durable
  }

  // Persists the snapshot through a PersistQueue and returns its result.
  PersistResult Persist() {
    PersistQueue queue([] {});
    queue.Start(job_dir_, PersistTarget{.job = "pq", .store = store_, .world_size = 1});
    queue.Enqueue({.rank = 0, .slot = slot_, .generation = generation_, .step = kStep});
    for (;;) {
      std::vector<PersistResult> results = queue.TakeResults();
      if (!results.empty()) return results.front();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  test::TempDir tmp_{"safepoint-persist-queue-test"};
  test::TwoTensorShard shard_{kStep, 0, kStep, 1 << 10};
  std::string job_dir_;
  std::unique_ptr<Arena> arena_;
  uint32_t slot_ = 0;
  uint64_t generation_ = 0;
  std::shared_ptr<FaultyStorage> faulty_ =
      std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  std::shared_ptr<CheckpointStore> store_ = std::make_shared<CheckpointStore>(faulty_);
};

// A COMMIT found on storage is made durable before the step is reported committed: a power
// loss afterwards keeps the step.
TEST_F(PersistQueueTest, AVisibleCommitIsMadeDurableBeforeTheStepIsReportedCommitted) {
  const PersistResult r = Persist();
  ASSERT_OK(r.status);
  EXPECT_TRUE(r.committed);
  EXPECT_EQ(faulty_->undurable(), 0u);
  ASSERT_OK(faulty_->SimulatePowerLoss());
  ASSERT_OK(store_->ReadCommit(kStep));
  ASSERT_OK(LoadShard(*store_, kStep, 0));
}

// When the COMMIT cannot be made durable, the persist fails and the step is not reported
// committed.
TEST_F(PersistQueueTest, AVisibleCommitThatCannotBeMadeDurableIsNotReportedCommitted) {
  faulty_->Arm({.op = FaultOp::kDirSync, .kind = FaultKind::kEIO, .sticky = true});
  const PersistResult r = Persist();
  EXPECT_EQ(r.status.code(), StatusCode::kIOError) << r.status.ToString();
  EXPECT_FALSE(r.committed);
}

// Regression (node-loss campaign seed 3141592653, round 25): an agent persisted rank 2's
// snapshot of step 46 (leaving replicas to other ranks), died, and the agent that adopted the
// snapshot persisted it again, written whole, just after another node's agent had committed the
// step with the first image (the check for a COMMIT came before that commit): the committed
// step no longer loaded ("image header does not match the COMMIT record"). A snapshot whose
// image of the same attempt is stored already is not written again; the commit is still tried.
TEST(PersistQueueStoredTest, ASnapshotWhoseImageIsStoredAlreadyIsNotWrittenAgain) {
  test::TempDir tmp("safepoint-persist-queue-test");
  ASSERT_TRUE(tmp.ok());
  ASSERT_OK_AND_ASSIGN(std::string job_dir, JobDirectory(tmp.path(), "pq", true));
  ASSERT_OK_AND_ASSIGN(auto arena, Arena::Open(job_dir, 0));
  test::TwoTensorShard shard{kStep, 0, kStep, 1 << 10};
  const ImageMeta meta = test::TestImageMeta("pq", kStep, 0, 2);
  ASSERT_OK_AND_ASSIGN(auto builder, ImageBuilder::Create(meta, shard.sources, shard.extras));
  ASSERT_OK_AND_ASSIGN(auto ticket, arena->BeginWrite(builder->size()));
  ASSERT_EQ(ticket.first, Arena::Acquire::kAcquired);
  builder->FillAll(ticket.second.data, 1);
  arena->FinishWrite(ticket.second, kStep, builder->size(), /*leased=*/false);
  const uint32_t slot = ticket.second.slot;
  const uint64_t generation = arena->Slots()[slot].generation;

  // The same snapshot stored already in another layout (chunk size), and rank 1's image.
  auto store = std::make_shared<CheckpointStore>(std::shared_ptr<Storage>(NewMemoryStorage()));
  ASSERT_OK_AND_ASSIGN(auto other,
                       ImageBuilder::Create(meta, shard.sources, shard.extras, 64 << 10));
  ASSERT_OK(store->WriteImage(*other).status());
  test::TwoTensorShard shard1{kStep, 1, kStep, 1 << 10};
  ASSERT_OK_AND_ASSIGN(auto rank1, ImageBuilder::Create(test::TestImageMeta("pq", kStep, 1, 2),
                                                        shard1.sources, shard1.extras));
  ASSERT_OK(store->WriteImage(*rank1).status());
  auto read_all = [&](const std::string& name) {
    auto obj = store->storage().Open(name);
    EXPECT_OK(obj.status());
    std::vector<std::byte> bytes(obj.ok() ? (*obj)->size() : 0);
    if (obj.ok()) EXPECT_OK((*obj)->ReadAt(0, bytes));
    return bytes;
  };
  const std::vector<std::byte> before = read_all(ImageObjectName(kStep, 0));

  PersistQueue queue([] {});
  queue.Start(job_dir, PersistTarget{.job = "pq", .store = store, .world_size = 2});
  queue.Enqueue({.rank = 0,
                 .slot = slot,
                 .generation = generation,
                 .step = kStep,
                 .reason = FlushReason::kAdopted});
  std::vector<PersistResult> results;
  while (results.empty()) {
    results = queue.TakeResults();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_OK(results.front().status);
  EXPECT_TRUE(results.front().committed);
  EXPECT_EQ(results.front().bytes, 0u);
  EXPECT_EQ(read_all(ImageObjectName(kStep, 0)), before) << "the stored image was rewritten";
  ASSERT_OK(LoadShard(*store, kStep, 0));
}

}  // namespace
}  // namespace safepoint::agent
