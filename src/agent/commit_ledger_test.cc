// The commit from reported facts: CommitLedger, CheckpointStore::CommitFromFacts, and a job on one
// node whose agent commits each step without listing it or reading any image's header.
#include "agent/commit_ledger.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "agent/persist_queue.h"
#include "safepoint/image.h"
#include "shm/arena.h"
#include "testing/test_util.h"

namespace safepoint::agent::commit_ledger_test {
namespace {

using Fact = CheckpointStore::ImageFact;
constexpr uint64_t kStep = 7;
constexpr uint64_t kAttempt = 0x5eed;

TEST(CommitLedgerTest, CompletesOnceWhenEveryRankOfOneAttemptReported) {
  CommitLedger ledger;
  EXPECT_FALSE(ledger.Add(kStep, kAttempt, 3, 0, {100, 1, false, false}));
  EXPECT_FALSE(ledger.Add(kStep, kAttempt + 1, 3, 1, {101, 2, false, false}))
      << "another attempt's image counts for that attempt only";
  EXPECT_FALSE(ledger.Add(kStep, kAttempt, 3, 2, {102, 3, true, false}));
  EXPECT_FALSE(ledger.Add(kStep, kAttempt, 3, 2, {999, 9, false, false})) << "reported twice";
  auto ready = ledger.Add(kStep, kAttempt, 3, 1, {101, 2, false, true});
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->step, kStep);
  EXPECT_EQ(ready->attempt, kAttempt);
  ASSERT_EQ(ready->facts.size(), 3u);
  EXPECT_EQ(ready->facts[0], (Fact{100, 1, false, false}));
  EXPECT_EQ(ready->facts[1], (Fact{101, 2, false, true}));
  EXPECT_EQ(ready->facts[2], (Fact{102, 3, true, false})) << "the first report of a rank holds";
  EXPECT_EQ(ledger.pending(), 1u) << "the other attempt's entry stays";
  ledger.Forget(kStep);
  EXPECT_EQ(ledger.pending(), 0u);
}

TEST(CommitLedgerTest, RefusesReportsThatDoNotFitAndStaysBounded) {
  CommitLedger ledger;
  EXPECT_FALSE(ledger.Add(1, kAttempt, 2, 2, {}));  // rank outside the world
  EXPECT_FALSE(ledger.Add(1, kAttempt, 0, 0, {}));
  EXPECT_FALSE(ledger.Add(1, kAttempt, 2, 0, {}));
  EXPECT_FALSE(ledger.Add(1, kAttempt, 3, 1, {})) << "another world size for one step";
  for (uint64_t step = 2; step < 2 + 2 * CommitLedger::kMaxPending; ++step) {
    ledger.Add(step, kAttempt, 2, 0, {});
  }
  EXPECT_EQ(ledger.pending(), CommitLedger::kMaxPending);
  EXPECT_FALSE(ledger.Add(1, kAttempt, 2, 1, {})) << "the oldest step was dropped";
  EXPECT_TRUE(ledger.Add(1 + 2 * CommitLedger::kMaxPending, kAttempt, 2, 1, {}));
}

// Counts the requests that a commit without listing must not make.
class CountingStorage : public test::ForwardingStorage {
 public:
  using ForwardingStorage::ForwardingStorage;
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    if (name.ends_with(".img") || name.ends_with(".pack")) ++image_opens;
    return inner_->Open(name);
  }
  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    if (prefix.starts_with(StepPrefix(kStep))) ++lists;  // retention lists the root, not a step
    return inner_->List(prefix);
  }
  std::atomic<int> image_opens{0}, lists{0};  // of step kStep
};

ImageMeta MetaOf(uint32_t rank, uint32_t world) {
  ImageMeta m = test::TestImageMeta("ledger", kStep, rank, world);
  m.attempt = kAttempt;
  return m;
}

// The record CommitFromFacts writes is the one the listing commit writes for the same images.
TEST(CommitFromFactsTest, WritesTheRecordTheListingCommitWrites) {
  constexpr uint32_t kWorld = 3;
  auto listing = std::make_shared<CheckpointStore>(std::shared_ptr<Storage>(NewMemoryStorage()));
  auto from_facts = std::make_shared<CheckpointStore>(std::shared_ptr<Storage>(NewMemoryStorage()));
  std::vector<Fact> facts;
  for (uint32_t r = 0; r < kWorld; ++r) {
    test::TwoTensorShard shard{kStep, r, kStep, 1 << 10};
    ASSERT_OK_AND_ASSIGN(auto b,
                         ImageBuilder::Create(MetaOf(r, kWorld), shard.sources, shard.extras));
    const PackOptions pack = MakePackOptions(r == 1 ? "zstd" : "none", false);
    ASSERT_OK(listing->WriteImageOfAttempt(*b, pack).status());
    ASSERT_OK_AND_ASSIGN(auto stats, from_facts->WriteImageOfAttempt(*b, pack));
    facts.push_back({b->layout().image_size, b->layout().header_crc, stats.packed, false});
    ASSERT_OK_AND_ASSIGN(auto stored, from_facts->StoredImageOfAttempt(kStep, r, kAttempt));
    ASSERT_TRUE(stored);
    EXPECT_EQ(*stored, facts.back()) << "the stored image's fact is the writer's";
  }
  ASSERT_OK_AND_ASSIGN(bool a, listing->TryCommitOfAttempt(kStep, kWorld, "ledger", kAttempt));
  ASSERT_OK_AND_ASSIGN(bool b, from_facts->CommitFromFacts(kStep, "ledger", kAttempt, facts));
  EXPECT_TRUE(a && b);
  ASSERT_OK_AND_ASSIGN(CommitRecord ra, listing->ReadCommit(kStep));
  ASSERT_OK_AND_ASSIGN(CommitRecord rb, from_facts->ReadCommit(kStep));
  rb.commit_time_ns = ra.commit_time_ns;
  EXPECT_EQ(EncodeCommitRecord(ra), EncodeCommitRecord(rb));
  for (uint32_t r = 0; r < kWorld; ++r) ASSERT_OK(LoadShard(*from_facts, kStep, r));
}

TEST(CommitFromFactsTest, AValidRecordIsKeptAndAFactOfAnotherImageFailsTheLoad) {
  auto store = std::make_shared<CheckpointStore>(std::shared_ptr<Storage>(NewMemoryStorage()));
  test::TwoTensorShard shard{kStep, 0, kStep, 1 << 10};
  ASSERT_OK_AND_ASSIGN(auto b, ImageBuilder::Create(MetaOf(0, 1), shard.sources, shard.extras));
  ASSERT_OK(store->WriteImageOfAttempt(*b, {}).status());
  const Fact right{b->layout().image_size, b->layout().header_crc, false, false};
  ASSERT_OK_AND_ASSIGN(bool first, store->CommitFromFacts(kStep, "ledger", kAttempt, {right}));
  ASSERT_TRUE(first);
  ASSERT_OK_AND_ASSIGN(CommitRecord before, store->ReadCommit(kStep));
  Fact wrong = right;
  wrong.header_crc ^= 1;
  ASSERT_OK_AND_ASSIGN(bool again, store->CommitFromFacts(kStep, "ledger", kAttempt, {wrong}));
  EXPECT_TRUE(again) << "the step is committed";
  ASSERT_OK_AND_ASSIGN(CommitRecord after, store->ReadCommit(kStep));
  EXPECT_EQ(EncodeCommitRecord(before), EncodeCommitRecord(after)) << "never replaced";

  // A record built from a wrong fact (a writer that lied or a bug) names an image the store does
  // not hold: the load refuses it rather than returning other bytes.
  auto other = std::make_shared<CheckpointStore>(std::shared_ptr<Storage>(NewMemoryStorage()));
  ASSERT_OK(other->WriteImageOfAttempt(*b, {}).status());
  ASSERT_OK(other->CommitFromFacts(kStep, "ledger", kAttempt, {wrong}).status());
  EXPECT_EQ(LoadShard(*other, kStep, 0).status().code(), StatusCode::kCorruption);
}

TEST(CommitFromFactsTest, ATensorLeftToAnotherRankThatNoImageHoldsIsRefused) {
  auto store = std::make_shared<CheckpointStore>(std::shared_ptr<Storage>(NewMemoryStorage()));
  std::vector<Fact> facts;
  for (uint32_t r = 0; r < 2; ++r) {
    test::TwoTensorShard shard{kStep, r, kStep, 1 << 10};
    if (r == 1) {  // left to another rank, and none holds it
      shard.sources[0].spec.elsewhere = true;
      shard.sources[0].spec.name = "held-by-nobody";
    }
    ASSERT_OK_AND_ASSIGN(auto b, ImageBuilder::Create(MetaOf(r, 2), shard.sources, shard.extras));
    ASSERT_OK(store->WriteImageOfAttempt(*b, {}).status());
    facts.push_back(
        {b->layout().image_size, b->layout().header_crc, false, b->layout().has_elsewhere});
  }
  ASSERT_TRUE(facts[1].elsewhere);
  EXPECT_EQ(store->CommitFromFacts(kStep, "ledger", kAttempt, facts).status().code(),
            StatusCode::kCorruption);
  EXPECT_EQ(store->ReadCommit(kStep).status().code(), StatusCode::kNotFound);
}

// A job of four ranks on one node: the agent's persist worker commits each step from the facts of
// its own writes, without listing the step or opening any image.
TEST(LedgerCommitTest, AJobOnOneNodeCommitsWithoutListingOrReadingImages) {
  constexpr uint32_t kWorld = 4;
  test::TempDir tmp("safepoint-ledger-test");
  ASSERT_TRUE(tmp.ok());
  ASSERT_OK_AND_ASSIGN(std::string job_dir, JobDirectory(tmp.path(), "ledger", true));
  auto counting = std::make_shared<CountingStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  auto store = std::make_shared<CheckpointStore>(counting);
  PersistQueue queue([] {});
  queue.Start(job_dir, PersistTarget{.job = "ledger",
                                     .store = store,
                                     .world_size = kWorld,
                                     .keep = 100,
                                     .ledger = std::make_shared<CommitLedger>()});
  queue.SetHostsEveryRank(true);
  std::vector<std::unique_ptr<Arena>> arenas;
  std::vector<test::TwoTensorShard> shards;
  for (uint32_t r = 0; r < kWorld; ++r) shards.emplace_back(kStep, r, kStep, 1 << 10);
  for (uint32_t r = 0; r < kWorld; ++r) {
    ASSERT_OK_AND_ASSIGN(auto arena, Arena::Open(job_dir, r));
    ASSERT_OK_AND_ASSIGN(
        auto b, ImageBuilder::Create(MetaOf(r, kWorld), shards[r].sources, shards[r].extras));
    ASSERT_OK_AND_ASSIGN(auto ticket, arena->BeginWrite(b->size()));
    ASSERT_EQ(ticket.first, Arena::Acquire::kAcquired);
    b->FillAll(ticket.second.data, 1);
    arena->FinishWrite(ticket.second, kStep, b->size(), /*leased=*/false);
    queue.Enqueue({.rank = r,
                   .slot = ticket.second.slot,
                   .generation = arena->Slots()[ticket.second.slot].generation,
                   .step = kStep});
    arenas.push_back(std::move(arena));
  }
  std::vector<PersistResult> results;
  while (results.size() < kWorld) {
    for (auto& r : queue.TakeResults()) results.push_back(std::move(r));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  queue.Stop();
  for (const auto& r : results) ASSERT_OK(r.status);
  EXPECT_TRUE(results.back().committed) << "the last image's report completes the step";
  for (uint32_t r = 0; r + 1 < kWorld; ++r) EXPECT_FALSE(results[r].committed);
  EXPECT_EQ(queue.ledger_commits(), 1u);
  EXPECT_EQ(counting->lists.load(), 0) << "the step was listed";
  EXPECT_EQ(counting->image_opens.load(), 0) << "an image was opened";
  for (uint32_t r = 0; r < kWorld; ++r) ASSERT_OK(LoadShard(*store, kStep, r));
}

}  // namespace
}  // namespace safepoint::agent::commit_ledger_test
