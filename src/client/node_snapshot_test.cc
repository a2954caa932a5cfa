// ReadNodeSnapshot (include/safepoint/client.h): another job's snapshot on this node, read from
// its slot files as a torchft heal between replicas of one node does (python/safepoint/torchft.py,
// mode "peer"). Each failure is an error that says what happened, never a wrong state.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "safepoint/client.h"
#include "safepoint/extras.h"
#include "safepoint/image.h"
#include "shm/arena.h"
#include "testing/test_util.h"

namespace safepoint {
namespace {

constexpr char kJob[] = "sender";

std::vector<float> Weights(uint64_t step) {
  std::vector<float> w(300 << 10);  // 1.2 MiB: several chunks of the image
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(step * 1000 + i);
  return w;
}

class NodeSnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(tmp_.ok());
    ASSERT_OK_AND_ASSIGN(job_dir_, JobDirectory(tmp_.path(), kJob, /*create=*/true));
    ASSERT_OK_AND_ASSIGN(arena_, Arena::Open(job_dir_, 0));
  }

  // The sender's training process takes a snapshot of `step` (image of job `job`).
  SlotWriteTicket Take(uint64_t step, const std::string& job = kJob) {
    std::vector<float> w = Weights(step);
    ImageMeta meta;
    meta.job = job;
    meta.step = step;
    meta.rank = 0;
    meta.world_size = 1;
    std::vector<TensorSource> sources;
    sources.push_back({{"w", DType::kFloat32, {w.size()}, {}, {}}, w.data(), w.size() * 4});
    Dict d;
    d.items.emplace_back(Value(std::string("step")), Value(static_cast<int64_t>(step)));
    auto extras = EncodeExtras(Value(std::move(d)));
    EXPECT_OK(extras);
    auto b = ImageBuilder::Create(meta, std::move(sources), *extras);
    EXPECT_OK(b);
    auto t = arena_->BeginWrite((*b)->size());
    EXPECT_OK(t);
    (*b)->FillAll(t->second.data, 1);
    EXPECT_TRUE(arena_->FinishWrite(t->second, step, (*b)->size()));
    return t->second;
  }

  void ExpectStep(const MemorySnapshot& got, uint64_t step) const {
    EXPECT_EQ(got.step, step);
    EXPECT_EQ(got.reader.meta().job, kJob);
    ASSERT_EQ(got.reader.tensors().size(), 1u);
    const std::vector<float> want = Weights(step);
    std::span<const std::byte> bytes = got.reader.tensor_data(0);
    ASSERT_EQ(bytes.size(), want.size() * 4);
    EXPECT_EQ(std::memcmp(bytes.data(), want.data(), bytes.size()), 0);
    EXPECT_EQ(got.image.source.rfind(job_dir_ + "/rank-", 0), 0u) << got.image.source;
  }

  test::TempDir tmp_{"sp-node-snapshot"};
  std::string job_dir_;
  std::unique_ptr<Arena> arena_;
};

TEST_F(NodeSnapshotTest, ReadsTheStepVerifiedIntoItsOwnCopy) {
  SlotWriteTicket first = Take(5);
  Take(6);
  ASSERT_OK_AND_ASSIGN(MemorySnapshot got, ReadNodeSnapshot(tmp_.path(), kJob, 0, 5, 0));
  ExpectStep(got, 5);
  // A private copy: the sender's next snapshot overwrites step 5's slot, the copy stays.
  Take(7);
  ASSERT_EQ(arena_->Slots()[first.slot].step, 7u);
  ExpectStep(got, 5);
  ASSERT_OK_AND_ASSIGN(MemorySnapshot seven, ReadNodeSnapshot(tmp_.path(), kJob, 0, 7, 0));
  ExpectStep(seven, 7);
}

TEST_F(NodeSnapshotTest, WaitsForTheSnapshotToBeTaken) {
  std::thread sender([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    Take(3);
  });
  Result<MemorySnapshot> got = ReadNodeSnapshot(tmp_.path(), kJob, 0, 3, 60);
  sender.join();
  ASSERT_OK(got);
  ExpectStep(*got, 3);
}

TEST_F(NodeSnapshotTest, AStepNotTakenInTimeIsNotFound) {
  Take(1);
  Result<MemorySnapshot> got = ReadNodeSnapshot(tmp_.path(), kJob, 0, 2, 0.05);
  EXPECT_EQ(got.status().code(), StatusCode::kNotFound);
  EXPECT_NE(
      got.status().message().find("step 2 of job sender on this node: not taken within 0.05 s"),
      std::string::npos)
      << got.status().ToString();
}

TEST_F(NodeSnapshotTest, MemoryThisProcessCannotOpenIsUnavailable) {
  // No such job here (another user's job directory has another name: its uid's).
  Result<MemorySnapshot> got = ReadNodeSnapshot(tmp_.path(), "elsewhere", 0, 1, 0);
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable) << got.status().ToString();
  EXPECT_EQ(ReadNodeSnapshot(tmp_.path(), "../x", 0, 1, 0).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(NodeSnapshotTest, AByteChangedSinceTheSnapshotFailsItsChecksum) {
  SlotWriteTicket t = Take(4);
  t.data[t.data.size() / 2] ^= std::byte{0x10};  // in the tensor's bytes
  Result<MemorySnapshot> got = ReadNodeSnapshot(tmp_.path(), kJob, 0, 4, 0);
  EXPECT_EQ(got.status().code(), StatusCode::kCorruption) << got.status().ToString();
}

TEST_F(NodeSnapshotTest, AnImageOfAnotherJobIsRefused) {
  Take(8, "impostor");
  Result<MemorySnapshot> got = ReadNodeSnapshot(tmp_.path(), kJob, 0, 8, 0);
  EXPECT_EQ(got.status().code(), StatusCode::kCorruption) << got.status().ToString();
  EXPECT_NE(got.status().message().find("job impostor's step 8"), std::string::npos);
}

}  // namespace
}  // namespace safepoint
