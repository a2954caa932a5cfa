// CheckpointStore::ListCommitted's known records: the agent's retention lists the committed
// steps at every commit, and a record read or published before is not read again while the
// listing shows it unchanged (issue 32: a committed step's requests beyond its images).
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
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

// A checkpoint directory in a fresh temporary directory, and a store of it, for every test.
class CommitListingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(tmp_.ok());
    ASSERT_OK_AND_ASSIGN(store_, OpenCheckpointStore(path_));
  }
  TempDir tmp_;
  const std::string path_ = tmp_.path() + "/ck";
  std::unique_ptr<CheckpointStore> store_;
};

TEST_F(CommitListingTest, KnownRecordsAreNotReadAgainUntilTheyChange) {
  for (uint64_t step = 1; step <= 3; ++step) Save(*store_, step);

  // Records this store published are taken from the listing.
  std::vector<uint64_t> steps;
  EXPECT_EQ(RecordReads([&] { steps = CommittedSteps(*store_); }), 0u);
  EXPECT_EQ(steps, (std::vector<uint64_t>{1, 2, 3}));

  // Another store (another process) reads each once, then not again.
  ASSERT_OK_AND_ASSIGN(auto other, OpenCheckpointStore(path_));
  EXPECT_GE(RecordReads([&] { steps = CommittedSteps(*other); }), 3u);
  EXPECT_EQ(RecordReads([&] { steps = CommittedSteps(*other); }), 0u);
  EXPECT_EQ(steps, (std::vector<uint64_t>{1, 2, 3}));

  // A record replaced (one byte flipped: same size, another modification time) is read again,
  // found damaged and skipped.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::vector<std::byte> record = test::ReadWholeObject(store_->storage(), CommitObjectName(2));
  ASSERT_FALSE(record.empty());
  record[record.size() / 2] ^= std::byte{0x10};
  ASSERT_OK(test::PutObject(store_->storage(), CommitObjectName(2), record));
  std::vector<std::string> problems;
  uint64_t reads = RecordReads([&] {
    auto list = store_->ListCommitted(&problems);
    ASSERT_OK(list);
    steps.clear();
    for (const auto& c : *list) steps.push_back(c.step);
  });
  EXPECT_GE(reads, 1u);
  EXPECT_EQ(steps, (std::vector<uint64_t>{1, 3}));
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("step-00000000000000000002"), std::string::npos) << problems[0];

  // A deleted step is gone from the next listing.
  ASSERT_OK(store_->DeleteStep(3));
  EXPECT_EQ(CommittedSteps(*store_), (std::vector<uint64_t>{1}));
}

TEST_F(CommitListingTest, EveryFewListingsReadEveryRecord) {
  Save(*store_, 1);
  Save(*store_, 2);
  // A record damaged in place with its size and time kept (bit rot) is found within
  // kReverifyListings listings.
  int reading = 0;
  for (uint64_t i = 0; i < CheckpointStore::kReverifyListings; ++i) {
    if (RecordReads([&] { CommittedSteps(*store_); }) > 0) ++reading;
  }
  EXPECT_EQ(reading, 1);
}

// Retention's clean-up works from the listing ListCommitted made: an object of an uncommitted
// step that is gone since (another agent's clean-up) is passed over, the rest removed.
TEST_F(CommitListingTest, CleanUpFromAStaleListingPassesOverWhatIsGone) {
  Save(*store_, 1);
  Save(*store_, 3);
  // Two leftovers of step 2, never committed.
  for (const char* name :
       {"step-00000000000000000002/rank-00000.img", "step-00000000000000000002/rank-00001.img"}) {
    ASSERT_OK(test::PutObject(store_->storage(), name, AsBytes("left")));
  }
  std::vector<ObjectInfo> listing;
  ASSERT_OK_AND_ASSIGN(auto committed, store_->ListCommitted(nullptr, &listing));
  ASSERT_EQ(committed.size(), 2u);
  ASSERT_OK(store_->storage().Delete("step-00000000000000000002/rank-00000.img"));
  ASSERT_OK_AND_ASSIGN(size_t removed, store_->CleanUpListed(listing, committed.back().step,
                                                             std::chrono::seconds(0)));
  EXPECT_GE(removed, 1u);  // the leftover, and whatever else RemoveLeftovers finds to remove
  EXPECT_EQ(store_->storage().Open("step-00000000000000000002/rank-00001.img").status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(CommittedSteps(*store_), (std::vector<uint64_t>{1, 3}));
}

}  // namespace
}  // namespace safepoint::commit_listing_test
