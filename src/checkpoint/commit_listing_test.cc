// CheckpointStore::ListCommitted's known records: the agent's retention lists the committed
// steps at every commit, and a record read or published before is not read again while the
// listing shows it unchanged (issue 32: a committed step's requests beyond its images).
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "safepoint/checkpoint.h"
#include "testing/test_util.h"

namespace safepoint::commit_listing_test {
namespace {

using test::AsBytes;
using test::CommittedSteps;
using test::TempDir;

// Storage requests of the "file" scheme since the process started (OpenStorage counts them).
StorageRequestCounts FileCounts() {
  for (const auto& [scheme, counts] : StorageRequestCountsByScheme()) {
    if (scheme == "file") return counts;
  }
  return {};
}

// Record reads (opens and reads) that `f` made.
template <typename F>
uint64_t RecordReads(F&& f) {
  const StorageRequestCounts before = FileCounts();
  f();
  const StorageRequestCounts after = FileCounts();
  return (after.head - before.head) + (after.get - before.get);
}

void Save(CheckpointStore& store, uint64_t step) {
  std::vector<float> data(64, float(step));
  TensorSource t{{"w", DType::kFloat32, {data.size()}, {}, {}}, data.data(), data.size() * 4};
  ASSERT_OK(SaveShard(store, test::TestImageMeta("test", step, 0, 1), {t}, *EncodeExtras(Value()))
                .status());
}

TEST(CommitListingTest, KnownRecordsAreNotReadAgainUntilTheyChange) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string path = tmp.path() + "/ck";
  ASSERT_OK_AND_ASSIGN(auto store, OpenCheckpointStore(path));
  for (uint64_t step = 1; step <= 3; ++step) Save(*store, step);

  // Records this store published are taken from the listing.
  std::vector<uint64_t> steps;
  EXPECT_EQ(RecordReads([&] { steps = CommittedSteps(*store); }), 0u);
  EXPECT_EQ(steps, (std::vector<uint64_t>{1, 2, 3}));

  // Another store (another process) reads each once, then not again.
  ASSERT_OK_AND_ASSIGN(auto other, OpenCheckpointStore(path));
  EXPECT_GE(RecordReads([&] { steps = CommittedSteps(*other); }), 3u);
  EXPECT_EQ(RecordReads([&] { steps = CommittedSteps(*other); }), 0u);
  EXPECT_EQ(steps, (std::vector<uint64_t>{1, 2, 3}));

  // A record replaced (one byte flipped: same size, another modification time) is read again,
  // found damaged and skipped.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::vector<std::byte> record = test::ReadWholeObject(store->storage(), CommitObjectName(2));
  ASSERT_FALSE(record.empty());
  record[record.size() / 2] ^= std::byte{0x10};
  ASSERT_OK(test::PutObject(store->storage(), CommitObjectName(2), record));
  std::vector<std::string> problems;
  uint64_t reads = RecordReads([&] {
    auto list = store->ListCommitted(&problems);
    ASSERT_OK(list);
    steps.clear();
    for (const auto& c : *list) steps.push_back(c.step);
  });
  EXPECT_GE(reads, 1u);
  EXPECT_EQ(steps, (std::vector<uint64_t>{1, 3}));
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("step-00000000000000000002"), std::string::npos) << problems[0];

  // A deleted step is gone from the next listing.
  ASSERT_OK(store->DeleteStep(3));
  EXPECT_EQ(CommittedSteps(*store), (std::vector<uint64_t>{1}));
}

TEST(CommitListingTest, EveryFewListingsReadEveryRecord) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  ASSERT_OK_AND_ASSIGN(auto store, OpenCheckpointStore(tmp.path() + "/ck"));
  Save(*store, 1);
  Save(*store, 2);
  // A record damaged in place with its size and time kept (bit rot) is found within
  // kReverifyListings listings.
  int reading = 0;
  for (uint64_t i = 0; i < CheckpointStore::kReverifyListings; ++i) {
    if (RecordReads([&] { CommittedSteps(*store); }) > 0) ++reading;
  }
  EXPECT_EQ(reading, 1);
}

// Retention's clean-up works from the listing ListCommitted made: an object of an uncommitted
// step that is gone since (another agent's clean-up) is passed over, the rest removed.
TEST(CommitListingTest, CleanUpFromAStaleListingPassesOverWhatIsGone) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  ASSERT_OK_AND_ASSIGN(auto store, OpenCheckpointStore(tmp.path() + "/ck"));
  Save(*store, 1);
  Save(*store, 3);
  // Two leftovers of step 2, never committed.
  for (const char* name :
       {"step-00000000000000000002/rank-00000.img", "step-00000000000000000002/rank-00001.img"}) {
    ASSERT_OK(test::PutObject(store->storage(), name, AsBytes("left")));
  }
  std::vector<ObjectInfo> listing;
  ASSERT_OK_AND_ASSIGN(auto committed, store->ListCommitted(nullptr, &listing));
  ASSERT_EQ(committed.size(), 2u);
  ASSERT_OK(store->storage().Delete("step-00000000000000000002/rank-00000.img"));
  ASSERT_OK_AND_ASSIGN(size_t removed, store->CleanUpListed(listing, committed.back().step,
                                                            std::chrono::seconds(0)));
  EXPECT_GE(removed, 1u);  // the leftover, and whatever else RemoveLeftovers finds to remove
  EXPECT_EQ(store->storage().Open("step-00000000000000000002/rank-00001.img").status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(CommittedSteps(*store), (std::vector<uint64_t>{1, 3}));
}

}  // namespace
}  // namespace safepoint::commit_listing_test
