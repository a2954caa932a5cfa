// The commit from reported facts: CommitLedger, CheckpointStore::CommitFromFacts, and a job on one
// node whose agent commits each step without listing it or reading any image's header.
#include "agent/commit_ledger.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

#include "agent/persist_queue.h"
#include "checkpoint/small_object.h"
#include "safepoint/image.h"
#include "shm/arena.h"
#include "testing/test_util.h"

namespace safepoint::agent::commit_ledger_test {
namespace {

using internal::WriteSmallObject;
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
  EXPECT_EQ(ledger.Count(kStep, kAttempt), 2u) << "a rank reported twice counts once";
  EXPECT_EQ(ledger.Count(kStep, kAttempt + 1), 1u);
  EXPECT_EQ(ledger.Count(kStep + 1, kAttempt), 0u);
  auto ready = ledger.Add(kStep, kAttempt, 3, 1, {101, 2, false, true});
  ASSERT_TRUE(ready);
  EXPECT_EQ(ledger.Count(kStep, kAttempt), 0u) << "completed";
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

// Persists step kStep of a job of kWorld ranks split over `nodes` agents' persist queues (each its
// own job directory, all writing one store) and returns the queues' results.
constexpr uint32_t kWorld = 4;
std::vector<PersistResult> PersistOnNodes(uint32_t nodes,
                                          const std::shared_ptr<CheckpointStore>& store,
                                          const test::TempDir& tmp, uint64_t* ledger_commits) {
  std::vector<PersistResult> results;
  std::vector<std::unique_ptr<PersistQueue>> queues;
  std::vector<std::string> dirs;
  for (uint32_t n = 0; n < nodes; ++n) {
    const std::string shm = tmp.path() + "/node" + std::to_string(n);
    std::filesystem::create_directories(shm);
    auto dir = JobDirectory(shm, "ledger", true);
    EXPECT_OK(dir.status());
    dirs.push_back(*dir);
    queues.push_back(std::make_unique<PersistQueue>([] {}));
    queues.back()->Start(*dir, PersistTarget{.job = "ledger",
                                             .store = store,
                                             .world_size = kWorld,
                                             .keep = 100,
                                             .ledger = std::make_shared<CommitLedger>()});
    queues.back()->SetHostsEveryRank(nodes == 1);
  }
  std::vector<std::unique_ptr<Arena>> arenas;
  std::vector<test::TwoTensorShard> shards;
  for (uint32_t r = 0; r < kWorld; ++r) shards.emplace_back(kStep, r, kStep, 1 << 10);
  for (uint32_t r = 0; r < kWorld; ++r) {
    const uint32_t node = r * nodes / kWorld;
    auto arena = Arena::Open(dirs[node], r);
    EXPECT_OK(arena.status());
    auto b = ImageBuilder::Create(MetaOf(r, kWorld), shards[r].sources, shards[r].extras);
    EXPECT_OK(b.status());
    auto ticket = (*arena)->BeginWrite((*b)->size());
    EXPECT_OK(ticket.status());
    (*b)->FillAll(ticket->second.data, 1);
    (*arena)->FinishWrite(ticket->second, kStep, (*b)->size(), /*leased=*/false);
    queues[node]->Enqueue({.rank = r,
                           .slot = ticket->second.slot,
                           .generation = (*arena)->Slots()[ticket->second.slot].generation,
                           .step = kStep});
    arenas.push_back(std::move(*arena));
  }
  while (results.size() < kWorld) {
    for (auto& q : queues) {
      for (auto& r : q->TakeResults()) results.push_back(std::move(r));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  *ledger_commits = 0;
  for (auto& q : queues) {
    q->Stop();
    *ledger_commits += q->ledger_commits();
  }
  return results;
}

// A job of four ranks on one node: the agent's persist worker commits each step from the facts of
// its own writes, without listing the step or opening any image.
TEST(LedgerCommitTest, AJobOnOneNodeCommitsWithoutListingOrReadingImages) {
  test::TempDir tmp("safepoint-ledger-test");
  ASSERT_TRUE(tmp.ok());
  auto counting = std::make_shared<CountingStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  auto store = std::make_shared<CheckpointStore>(counting);
  uint64_t ledger_commits = 0;
  const auto results = PersistOnNodes(1, store, tmp, &ledger_commits);
  for (const auto& r : results) ASSERT_OK(r.status);
  EXPECT_TRUE(results.back().committed) << "the last image's report completes the step";
  for (uint32_t r = 0; r + 1 < kWorld; ++r) EXPECT_FALSE(results[r].committed);
  EXPECT_EQ(ledger_commits, 1u);
  EXPECT_EQ(counting->lists.load(), 0) << "the step was listed";
  EXPECT_EQ(counting->image_opens.load(), 0) << "an image was opened";
  for (uint32_t r = 0; r < kWorld; ++r) ASSERT_OK(LoadShard(*store, kStep, r));
}

// Two nodes of two ranks each: each agent writes its node's facts report after its last image,
// and the agent that finds every image published commits from the reports, opening no image.
TEST(LedgerCommitTest, NodesReportTheirFactsAndTheCommitOpensNoImage) {
  test::TempDir tmp("safepoint-ledger-test");
  ASSERT_TRUE(tmp.ok());
  auto counting = std::make_shared<CountingStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  auto store = std::make_shared<CheckpointStore>(counting);
  uint64_t ledger_commits = 0;
  const auto results = PersistOnNodes(2, store, tmp, &ledger_commits);
  for (const auto& r : results) ASSERT_OK(r.status);
  ASSERT_OK(store->ReadCommit(kStep));
  EXPECT_EQ(counting->image_opens.load(), 0) << "an image's header was read";
  // One listing per node when its images are queued together; a rank whose task came after the
  // node's queue ran dry lists once more.
  EXPECT_LE(counting->lists.load(), static_cast<int>(kWorld));
  for (uint32_t r = 0; r < kWorld; ++r) ASSERT_OK(LoadShard(*store, kStep, r));
}

// A damaged or lying facts report is a hint that fails: the commit reads the headers instead and
// the record it writes is the true one.
TEST(LedgerCommitTest, ADamagedFactsReportCostsHeaderReadsNotTheStep) {
  auto counting = std::make_shared<CountingStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  auto store = std::make_shared<CheckpointStore>(counting);
  std::map<uint32_t, Fact> truth;
  for (uint32_t r = 0; r < 2; ++r) {
    test::TwoTensorShard shard{kStep, r, kStep, 1 << 10};
    ASSERT_OK_AND_ASSIGN(auto b, ImageBuilder::Create(MetaOf(r, 2), shard.sources, shard.extras));
    ASSERT_OK(store->WriteImageOfAttempt(*b, {}).status());
    truth[r] = {b->layout().image_size, b->layout().header_crc, false, false};
  }
  std::map<uint32_t, Fact> lie = truth;
  lie[1].size += 1;  // a size the listing contradicts
  ASSERT_OK(store->WriteFactsReport(kStep, kAttempt, lie));
  ASSERT_OK(WriteSmallObject(store->storage(),
                             StepPrefix(kStep) + "facts-00009.g" + std::string(16, '0'), "junk"));
  ASSERT_OK_AND_ASSIGN(bool committed,
                       store->TryCommitOfAttemptWithFacts(kStep, 2, "ledger", kAttempt, {}));
  EXPECT_TRUE(committed);
  EXPECT_EQ(counting->image_opens.load(), 1) << "rank 1's header, whose reported fact was wrong";
  ASSERT_OK_AND_ASSIGN(CommitRecord record, store->ReadCommit(kStep));
  EXPECT_EQ(record.images[1].size, truth[1].size);
  for (uint32_t r = 0; r < 2; ++r) ASSERT_OK(LoadShard(*store, kStep, r));
}

// A node's abandoned record of (step, attempt): read back only for that step and attempt, whole;
// a damaged or foreign object at its name reads as none (the wait goes on to its timeout), and
// an overlong reason is bounded.
TEST(AbandonedRecordTest, ReadsBackOnlyWholeAndForItsStepAndAttempt) {
  auto store = std::make_shared<CheckpointStore>(std::shared_ptr<Storage>(NewMemoryStorage()));
  ASSERT_OK_AND_ASSIGN(auto none, store->ReadAbandoned(kStep, kAttempt));
  EXPECT_FALSE(none);
  ASSERT_OK(store->ReportAbandoned(kStep, kAttempt, 3, "overwritten\nbefore it was persisted"));
  ASSERT_OK_AND_ASSIGN(auto got, store->ReadAbandoned(kStep, kAttempt));
  ASSERT_TRUE(got);
  EXPECT_EQ(got->rank, 3u);
  EXPECT_EQ(got->why, "overwritten before it was persisted");
  ASSERT_OK_AND_ASSIGN(auto other_attempt, store->ReadAbandoned(kStep, kAttempt + 1));
  EXPECT_FALSE(other_attempt);
  ASSERT_OK_AND_ASSIGN(auto other_step, store->ReadAbandoned(kStep + 1, kAttempt));
  EXPECT_FALSE(other_step);
  // The step's images and commit are untouched by it: the step lists as not committed.
  ASSERT_OK_AND_ASSIGN(auto committed, store->ListCommitted());
  EXPECT_TRUE(committed.empty());

  char name[64];
  std::snprintf(name, sizeof(name), "abandoned.g%016llx",
                static_cast<unsigned long long>(kAttempt));
  ASSERT_OK_AND_ASSIGN(auto bytes,
                       internal::ReadSmallObject(store->storage(), StepPrefix(kStep) + name, 4096));
  std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  text[text.find("overwritten")] = 'O';  // a changed byte: the CRC no longer matches
  ASSERT_OK(WriteSmallObject(store->storage(), StepPrefix(kStep) + name, text));
  ASSERT_OK_AND_ASSIGN(auto damaged, store->ReadAbandoned(kStep, kAttempt));
  EXPECT_FALSE(damaged);

  ASSERT_OK(store->ReportAbandoned(kStep, kAttempt, 1, std::string(100000, 'x')));
  ASSERT_OK_AND_ASSIGN(auto bounded, store->ReadAbandoned(kStep, kAttempt));
  ASSERT_TRUE(bounded);
  EXPECT_EQ(bounded->rank, 1u);
  EXPECT_LE(bounded->why.size(), 1024u);
}

}  // namespace
}  // namespace safepoint::agent::commit_ledger_test
