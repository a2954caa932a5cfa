#include "agent/persist_queue.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>
#include <utility>

#include "safepoint/image.h"
#include "shm/arena.h"
#include "storage/faulty/faulty_storage.h"
#include "testing/test_util.h"

namespace safepoint::agent::persist_queue_test {
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

// Rank 0's snapshot of step kStep (a job of `world` ranks) in a slot of a fresh job directory.
struct SlotSnapshot {
  explicit SlotSnapshot(uint32_t world) : meta(test::TestImageMeta("pq", kStep, 0, world)) {}
  void Write() {  // under ASSERT_NO_FATAL_FAILURE
    ASSERT_TRUE(tmp.ok());
    ASSERT_OK_AND_ASSIGN(job_dir, JobDirectory(tmp.path(), "pq", true));
    ASSERT_OK_AND_ASSIGN(arena, Arena::Open(job_dir, 0));
    ASSERT_OK_AND_ASSIGN(auto builder, ImageBuilder::Create(meta, shard.sources, shard.extras));
    ASSERT_OK_AND_ASSIGN(auto ticket, arena->BeginWrite(builder->size()));
    ASSERT_EQ(ticket.first, Arena::Acquire::kAcquired);
    builder->FillAll(ticket.second.data, 1);
    arena->FinishWrite(ticket.second, kStep, builder->size(), /*leased=*/false);
    slot = ticket.second.slot;
    generation = arena->Slots()[slot].generation;
  }
  test::TempDir tmp{"safepoint-persist-queue-test"};
  test::TwoTensorShard shard{kStep, 0, kStep, 1 << 10};
  ImageMeta meta;
  std::string job_dir;
  std::unique_ptr<Arena> arena;
  uint32_t slot = 0;
  uint64_t generation = 0;
};

// Regression (node-loss campaign seed 3141592653, round 25): an agent persisted rank 2's
// snapshot of step 46 (leaving replicas to other ranks), died, and the agent that adopted the
// snapshot persisted it again, written whole, just after another node's agent had committed the
// step with the first image (the check for a COMMIT came before that commit): the committed
// step no longer loaded ("image header does not match the COMMIT record"). A snapshot whose
// image of the same attempt is stored already is not written again; the commit is still tried.
TEST(PersistQueueStoredTest, ASnapshotWhoseImageIsStoredAlreadyIsNotWrittenAgain) {
  SlotSnapshot snap(/*world=*/2);
  ASSERT_NO_FATAL_FAILURE(snap.Write());
  const ImageMeta& meta = snap.meta;
  const test::TwoTensorShard& shard = snap.shard;

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
  queue.Start(snap.job_dir, PersistTarget{.job = "pq", .store = store, .world_size = 2});
  queue.Enqueue({.rank = 0,
                 .slot = snap.slot,
                 .generation = snap.generation,
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

// A commit-only task (the commit relay's committer: a step other nodes' facts completed) runs
// ahead of the persists queued before it, behind the one in flight. Before, it waited for the
// committer's whole backlog, whose own persists could commit the next step first (the short
// scale run of make test, W = 512 on 8 nodes under load: step 3 committed before step 2).
TEST(PersistQueueOrderTest, ACommitOnlyTaskRunsAheadOfQueuedPersists) {
  SlotSnapshot snap(/*world=*/1);
  ASSERT_NO_FATAL_FAILURE(snap.Write());

  // The first persist's image write is held for a moment: the worker is busy with it while the
  // other two tasks are queued.
  auto faulty = std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  faulty->Arm(
      {.op = FaultOp::kWrite, .kind = FaultKind::kDelay, .delay = std::chrono::milliseconds(300)});
  auto store = std::make_shared<CheckpointStore>(faulty);
  PersistQueue queue([] {});
  queue.Start(snap.job_dir, PersistTarget{.job = "pq", .store = store, .world_size = 1});
  queue.Enqueue({.rank = 0, .slot = snap.slot, .generation = snap.generation, .step = kStep});
  while (!queue.progress().in_flight) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // A persist of a snapshot that is not there (rank 7 of the next step: nothing is written),
  // then the commit of an older step from a rank's facts.
  queue.Enqueue({.rank = 7, .slot = 0, .generation = 1, .step = kStep + 1});
  PersistTask commit;
  commit.step = kStep - 1;
  commit.attempt = 9;
  commit.commit_only = PersistTask::CommitOnly::kFromFacts;
  commit.facts = std::make_shared<const std::vector<CheckpointStore::ImageFact>>(
      std::vector<CheckpointStore::ImageFact>{{.size = 4096, .header_crc = 1}});
  queue.Enqueue(commit);
  EXPECT_TRUE(queue.CommitQueued(kStep - 1));
  EXPECT_FALSE(queue.CommitQueued(kStep));

  std::vector<PersistResult> results;
  while (results.size() < 3) {
    for (PersistResult& r : queue.TakeResults()) results.push_back(std::move(r));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(results[0].task.rank, 0u);
  ASSERT_OK(results[0].status);
  EXPECT_TRUE(results[0].committed);
  EXPECT_EQ(results[1].task.commit_only, PersistTask::CommitOnly::kFromFacts);
  ASSERT_OK(results[1].status);
  EXPECT_TRUE(results[1].committed);
  EXPECT_EQ(results[2].task.rank, 7u);
  EXPECT_EQ(results[2].bytes, 0u);
  EXPECT_FALSE(queue.CommitQueued(kStep - 1));
  ASSERT_OK(store->ReadCommit(kStep - 1));
}

// Runs `hook` (once) just before the image of rank 0 of step kStep is published: another
// writer's work slotted deterministically into the window between a persist's checks (COMMIT,
// stored image) and its publish.
class PublishHookStorage : public test::ForwardingStorage {
 public:
  using ForwardingStorage::ForwardingStorage;
  std::function<void()> hook;

  Result<std::unique_ptr<WritableObject>> Create(std::string_view name, uint64_t size) override {
    SP_ASSIGN_OR_RETURN(auto w, inner_->Create(name, size));
    if (!hook || !name.starts_with(StepPrefix(kStep) + "rank-00000")) return w;
    return std::unique_ptr<WritableObject>(new Hooked(std::move(w), std::exchange(hook, {})));
  }

 private:
  struct Hooked : WritableObject {
    Hooked(std::unique_ptr<WritableObject> w, std::function<void()> h)
        : inner(std::move(w)), hook(std::move(h)) {}
    Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
      return inner->WriteAt(offset, data);
    }
    Status Publish() override {
      return Run([&] { return inner->Publish(); });
    }
    Status PublishIfAbsent() override {
      return Run([&] { return inner->PublishIfAbsent(); });
    }
    void Abort() override { inner->Abort(); }
    Status Run(const std::function<Status()>& publish) {
      hook();
      return publish();
    }
    std::unique_ptr<WritableObject> inner;
    std::function<void()> hook;
  };
};

// Two writers of rank 0's image of step kStep racing a commit: the rank's agent, and another
// writer (the elected holder of its replica after its node was declared lost, or an adopting
// agent) whose persist publishes and commits the step in between the first one's checks and
// its publish. The first must not replace the image the commit counted.
class PersistRaceTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(tmp_.ok()); }

  // A snapshot of kStep by `rank` of 2, save `attempt`, in a job directory of its own (as one
  // agent holds it), with checksum chunks of `chunk_size` bytes (0: the default), so that two
  // snapshots of one attempt can be stored in two layouts (differing headers).
  struct Snapshot {
    std::string job_dir;
    uint32_t rank = 0, slot = 0;
    uint64_t generation = 0;
  };
  Snapshot Make(const std::string& dir, uint32_t rank, uint64_t attempt, uint64_t chunk_size) {
    Snapshot s;
    s.rank = rank;
    auto job_dir = JobDirectory(tmp_.path(), dir, true);
    EXPECT_OK(job_dir.status());
    s.job_dir = *job_dir;
    auto arena = Arena::Open(s.job_dir, rank);
    EXPECT_OK(arena.status());
    ImageMeta meta = test::TestImageMeta("pq", kStep, rank, 2);
    meta.attempt = attempt;
    test::TwoTensorShard shard{kStep, rank, attempt, 1 << 10};
    auto builder = chunk_size ? ImageBuilder::Create(meta, shard.sources, shard.extras, chunk_size)
                              : ImageBuilder::Create(meta, shard.sources, shard.extras);
    EXPECT_OK(builder.status());
    auto ticket = (*arena)->BeginWrite((*builder)->size());
    EXPECT_OK(ticket.status());
    EXPECT_EQ(ticket->first, Arena::Acquire::kAcquired);
    (*builder)->FillAll(ticket->second.data, 1);
    (*arena)->FinishWrite(ticket->second, kStep, (*builder)->size(), /*leased=*/false);
    s.slot = ticket->second.slot;
    s.generation = (*arena)->Slots()[s.slot].generation;
    return s;
  }

  // Persists `s` through a PersistQueue of its own (one agent's) and returns its result.
  PersistResult Persist(const Snapshot& s) {
    PersistQueue queue([] {});
    queue.Start(s.job_dir, PersistTarget{.job = "pq", .store = store_, .world_size = 2});
    queue.Enqueue({.rank = s.rank, .slot = s.slot, .generation = s.generation, .step = kStep});
    for (;;) {
      std::vector<PersistResult> results = queue.TakeResults();
      if (!results.empty()) return results.front();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  // Persists `first` with `second`'s persist run inside its window; returns first's result.
  PersistResult Race(const Snapshot& first, const Snapshot& second) {
    PersistResult inner;
    bool ran = false;
    storage_->hook = [&] {
      inner = Persist(second);
      ran = true;
    };
    PersistResult r = Persist(first);
    EXPECT_TRUE(ran) << "the hook did not run";
    EXPECT_OK(inner.status);
    EXPECT_TRUE(inner.committed) << "the other writer's persist did not commit the step";
    return r;
  }

  // `r` (the last persist) reports the step committed; it loads, every rank's image of `attempt`.
  void ExpectCommittedOf(const PersistResult& r, uint64_t attempt) {
    ASSERT_OK(r.status);
    EXPECT_TRUE(r.committed);
    for (uint32_t rank = 0; rank < 2; ++rank) {
      auto shard = LoadShard(*store_, kStep, rank);
      ASSERT_OK(shard.status()) << "rank " << rank;
      EXPECT_EQ(shard->reader.meta().attempt, attempt) << "rank " << rank;
    }
  }

  test::TempDir tmp_{"safepoint-persist-race-test"};
  std::shared_ptr<PublishHookStorage> storage_ =
      std::make_shared<PublishHookStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  std::shared_ptr<CheckpointStore> store_ = std::make_shared<CheckpointStore>(storage_);
};

// The same snapshot (one attempt) in two layouts: the second writer's image is committed
// first; the first writer's publish must not replace it (the COMMIT names its header).
TEST_F(PersistRaceTest, AnImageOfTheSameAttemptCommittedMeanwhileIsNotReplaced) {
  constexpr uint64_t kAttempt = 7;
  ASSERT_OK(Persist(Make("rank1", 1, kAttempt, 0)).status);
  ExpectCommittedOf(Race(Make("agent", 0, kAttempt, 0), Make("holder", 0, kAttempt, 64 << 10)),
                    kAttempt);
}

// A new attempt's persist of a step an old attempt left uncommitted (rank 0's and, meanwhile,
// rank 1's images of the old attempt): the old attempt commits between the new persist's
// checks and its publish; the new image must not replace the old one the commit counted.
TEST_F(PersistRaceTest, AnImageOfAnotherAttemptCommittedMeanwhileIsNotReplaced) {
  constexpr uint64_t kOld = 7, kNew = 8;
  ASSERT_OK(Persist(Make("old0", 0, kOld, 0)).status);
  ExpectCommittedOf(Race(Make("new0", 0, kNew, 0), Make("old1", 1, kOld, 0)), kOld);
}

// A legitimate re-save: a new attempt's images of a step the old attempt never committed.
TEST_F(PersistRaceTest, ANewAttemptCommitsAStepAnOldAttemptLeftUncommitted) {
  constexpr uint64_t kOld = 7, kNew = 8;
  ASSERT_OK(Persist(Make("old0", 0, kOld, 0)).status);
  ASSERT_OK(Persist(Make("new1", 1, kNew, 0)).status);
  ExpectCommittedOf(Persist(Make("new0", 0, kNew, 0)), kNew);
}

}  // namespace
}  // namespace safepoint::agent::persist_queue_test
