// Tests of CopyStep (tier_copy.cc): copies between memory and POSIX tiers are bit-exact and
// committed with the destination's protocol; corrupt sources, failing destinations and
// cancellation leave the destination's visible steps as they were.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "safepoint/checkpoint.h"
#include "storage/faulty/faulty_storage.h"
#include "testing/test_util.h"

namespace safepoint::tier_copy_test {
namespace {

using test::CommittedSteps;
using test::TempDir;

// A shard of about 8 MiB (three 4 MiB checksum chunks) whose bytes depend on (step, rank, salt).
Status SaveTestShard(CheckpointStore& store, uint64_t step, uint32_t rank, uint32_t world,
                     float salt = 0, uint64_t attempt = 0, bool overwrite = false) {
  std::vector<float> big(2 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = float(step * 1000 + rank + i) + salt;
  std::vector<TensorSource> sources;
  sources.push_back({{"big", DType::kFloat32, {big.size()}, {}, {}}, big.data(), big.size() * 4});
  Dict d;
  d.items.emplace_back(Value(std::string("step")), Value(int64_t(step)));
  ImageMeta meta = test::TestImageMeta("test", step, rank, world);
  meta.attempt = attempt;
  SP_ASSIGN_OR_RETURN(std::string extras, EncodeExtras(Value(std::move(d))));
  return SaveShard(store, meta, sources, extras, SaveOptions{overwrite}).status();
}

Status SaveStep(CheckpointStore& store, uint64_t step, uint32_t world, float salt = 0) {
  for (uint32_t r = 0; r < world; ++r)
    SP_RETURN_IF_ERROR(SaveTestShard(store, step, r, world, salt));
  return Status::OK();
}

// The destination holds exactly the source's objects of `step`, byte for byte, and loads.
void ExpectSameStep(CheckpointStore& src, CheckpointStore& dst, uint64_t step) {
  auto src_objects = src.storage().List(StepPrefix(step));
  auto dst_objects = dst.storage().List(StepPrefix(step));
  ASSERT_OK(src_objects);
  ASSERT_OK(dst_objects);
  ASSERT_EQ(src_objects->size(), dst_objects->size());
  for (size_t i = 0; i < src_objects->size(); ++i) {
    const std::string& name = (*src_objects)[i].name;
    EXPECT_EQ((*dst_objects)[i].name, name);
    EXPECT_TRUE(test::ReadWholeObject(src.storage(), name) ==
                test::ReadWholeObject(dst.storage(), name))
        << name << " differs";
  }
  auto commit = dst.ReadCommit(step);
  ASSERT_OK(commit);
  for (uint32_t r = 0; r < commit->world_size; ++r) {
    auto a = LoadShard(src, step, r);
    auto b = LoadShard(dst, step, r);
    ASSERT_OK(a);
    ASSERT_OK(b);
    ASSERT_EQ(a->image.size, b->image.size);
    EXPECT_EQ(std::memcmp(a->image.bytes().data(), b->image.bytes().data(), a->image.size), 0);
  }
}

std::unique_ptr<CheckpointStore> PosixStore(const TempDir& dir) {
  auto storage = NewPosixStorage(dir.path());
  EXPECT_OK(storage);
  return std::make_unique<CheckpointStore>(std::shared_ptr<Storage>(std::move(storage).value()));
}

TEST(TierCopyTest, MultiRankStepCopiesFromMemoryToFileAndBackBitExact) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  CheckpointStore mem(NewMemoryStorage());
  auto file = PosixStore(dir);
  ASSERT_OK(SaveStep(mem, 3, 1));
  ASSERT_OK(SaveStep(mem, 7, 3));
  auto commit = mem.ReadCommit(7);
  ASSERT_OK(commit);

  std::vector<CopyProgress> seen;
  CopyOptions options;
  options.progress = [&](const CopyProgress& p) { seen.push_back(p); };
  auto copied = CopyStep(mem, *file, 7, options);
  ASSERT_OK(copied);
  EXPECT_FALSE(copied->already_there);
  EXPECT_EQ(copied->bytes, commit->total_bytes());
  EXPECT_EQ(CommittedSteps(*file), std::vector<uint64_t>{7});  // only the step asked for
  ExpectSameStep(mem, *file, 7);
  ASSERT_FALSE(seen.empty());
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].bytes_total, commit->total_bytes());
    if (i > 0) EXPECT_GT(seen[i].bytes_done, seen[i - 1].bytes_done);
  }
  EXPECT_EQ(seen.back().bytes_done, commit->total_bytes());

  CheckpointStore back(NewMemoryStorage());
  auto again = CopyStep(*file, back, 7);
  ASSERT_OK(again);
  ExpectSameStep(*file, back, 7);
  ExpectSameStep(mem, back, 7);
}

TEST(TierCopyTest, ReplacedStepKeepsItsGeneration) {
  CheckpointStore mem(NewMemoryStorage());
  ASSERT_OK(SaveStep(mem, 4, 2));
  for (uint32_t r = 0; r < 2; ++r) ASSERT_OK(SaveTestShard(mem, 4, r, 2, 0.5f, 9, true));
  auto commit = mem.ReadCommit(4);
  ASSERT_OK(commit);
  ASSERT_EQ(commit->generation, 9u);
  TempDir dir;  // the file tier it is copied to
  ASSERT_TRUE(dir.ok());
  auto file = PosixStore(dir);
  ASSERT_OK(CopyStep(mem, *file, 4));
  auto copied = file->ReadCommit(4);
  ASSERT_OK(copied);
  EXPECT_EQ(copied->generation, 9u);
  EXPECT_EQ(EncodeCommitRecord(*copied), EncodeCommitRecord(*commit));
  ExpectSameStep(mem, *file, 4);
  auto names = file->storage().List(StepPrefix(4));
  ASSERT_OK(names);
  ASSERT_EQ(names->size(), 3u);
  EXPECT_EQ((*names)[1].name, ImageObjectName(4, 0, 9));
}

TEST(TierCopyTest, CorruptSourceChunkIsCorruptionAndCommitsNothing) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  auto file = PosixStore(dir);
  ASSERT_OK(SaveStep(*file, 2, 1));
  ASSERT_OK(SaveStep(*file, 5, 2));
  // One flipped bit in the second chunk of rank 1's image.
  const std::string path = dir.path() + "/" + ImageObjectName(5, 1);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good());
    f.seekg((4 << 20) + 12345);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp((4 << 20) + 12345);
    f.write(&c, 1);
  }
  CheckpointStore dst(NewMemoryStorage());
  ASSERT_OK(CopyStep(*file, dst, 2));
  auto copied = CopyStep(*file, dst, 5);
  ASSERT_EQ(copied.status().code(), StatusCode::kCorruption) << copied.status().ToString();
  EXPECT_NE(copied.status().message().find(path), std::string::npos) << copied.status().ToString();
  EXPECT_NE(copied.status().message().find("copying step 5"), std::string::npos);
  EXPECT_EQ(CommittedSteps(dst), std::vector<uint64_t>{2});
  EXPECT_EQ(dst.storage().Open(CommitObjectName(5)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(dst.storage().Open(ImageObjectName(5, 1)).status().code(), StatusCode::kNotFound);
}

TEST(TierCopyTest, DestinationFailuresLeaveItsStepsUnchanged) {
  CheckpointStore src(NewMemoryStorage());
  ASSERT_OK(SaveStep(src, 6, 2));
  // A failed chunk write, a failed image publish, a failed COMMIT publish (the third publish).
  for (const FaultSpec spec :
       {FaultSpec{.op = FaultOp::kWrite, .nth = 2}, FaultSpec{.op = FaultOp::kSync, .nth = 1},
        FaultSpec{.op = FaultOp::kPublish, .nth = 3, .kind = FaultKind::kENOSPC}}) {
    SCOPED_TRACE(std::string(FaultOpName(spec.op)));
    auto faulty = std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
    CheckpointStore dst(faulty);
    ASSERT_OK(SaveStep(dst, 1, 1));
    faulty->Arm(spec);
    auto copied = CopyStep(src, dst, 6);
    ASSERT_FALSE(copied.ok());
    EXPECT_EQ(faulty->fired(), 1u);
    EXPECT_NE(copied.status().message().find("copying step 6 from " + src.storage().uri()),
              std::string::npos)
        << copied.status().ToString();
    EXPECT_EQ(CommittedSteps(dst), std::vector<uint64_t>{1});
    // The step's leftovers are an uncommitted directory that CleanUp removes once it is older
    // than the newest step (and its objects older than the grace: none here).
    faulty->Clear();
    ASSERT_OK(SaveStep(dst, 8, 1));
    ASSERT_OK(dst.CleanUp(std::chrono::seconds(0)));
    EXPECT_TRUE(dst.storage().List(StepPrefix(6))->empty());
    // And copying again succeeds.
    ASSERT_OK(CopyStep(src, dst, 6));
    ExpectSameStep(src, dst, 6);
  }
}

TEST(TierCopyTest, SecondCopyIsAlreadyThereAndWritesNothing) {
  CheckpointStore src(NewMemoryStorage());
  ASSERT_OK(SaveStep(src, 6, 2));
  auto faulty = std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  CheckpointStore dst(faulty);
  auto first = CopyStep(src, dst, 6);
  ASSERT_OK(first);
  EXPECT_FALSE(first->already_there);
  const uint64_t creates = faulty->count(FaultOp::kCreate);
  auto second = CopyStep(src, dst, 6);
  ASSERT_OK(second);
  EXPECT_TRUE(second->already_there);
  EXPECT_EQ(second->bytes, 0u);
  EXPECT_EQ(faulty->count(FaultOp::kCreate), creates);
}

TEST(TierCopyTest, ADifferentRecordOnTheDestinationIsAlreadyExistsNamingBoth) {
  CheckpointStore src(NewMemoryStorage("tier-copy-src"));
  CheckpointStore dst(NewMemoryStorage("tier-copy-dst"));
  ASSERT_OK(SaveStep(src, 6, 1));
  ASSERT_OK(SaveStep(dst, 6, 1, 0.25f));
  auto before = test::ReadWholeObject(dst.storage(), CommitObjectName(6));
  auto copied = CopyStep(src, dst, 6);
  ASSERT_EQ(copied.status().code(), StatusCode::kAlreadyExists) << copied.status().ToString();
  EXPECT_NE(copied.status().message().find("mem://tier-copy-src"), std::string::npos)
      << copied.status().ToString();
  EXPECT_NE(copied.status().message().find("mem://tier-copy-dst"), std::string::npos)
      << copied.status().ToString();
  EXPECT_EQ(test::ReadWholeObject(dst.storage(), CommitObjectName(6)), before);
  auto shard = LoadShard(dst, 6, 0);
  ASSERT_OK(shard);
}

TEST(TierCopyTest, ConcurrentCopiesOfOneStepBothSucceed) {
  CheckpointStore src(NewMemoryStorage());
  ASSERT_OK(SaveStep(src, 6, 2));
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  auto a = PosixStore(dir);
  auto b = PosixStore(dir);  // a second view of one directory, like a second agent
  Result<CopyResult> ra = InvalidArgument("not run"), rb = InvalidArgument("not run");
  std::thread t([&] { ra = CopyStep(src, *a, 6); });
  rb = CopyStep(src, *b, 6);
  t.join();
  ASSERT_OK(ra);
  ASSERT_OK(rb);
  ExpectSameStep(src, *a, 6);
}

TEST(TierCopyTest, CancelledCopyCommitsNothing) {
  CheckpointStore src(NewMemoryStorage());
  ASSERT_OK(SaveStep(src, 6, 2));
  for (const bool before_start : {true, false}) {
    SCOPED_TRACE(before_start ? "cancelled before" : "cancelled after the first chunk");
    CheckpointStore dst(NewMemoryStorage());
    std::atomic<bool> cancel{before_start};
    CopyOptions options;
    options.cancel = &cancel;
    options.parallelism = 1;
    uint64_t done = 0;
    options.progress = [&](const CopyProgress& p) {
      done = p.bytes_done;
      cancel.store(true);
    };
    auto copied = CopyStep(src, dst, 6, options);
    ASSERT_EQ(copied.status().code(), StatusCode::kCancelled) << copied.status().ToString();
    EXPECT_TRUE(CommittedSteps(dst).empty());
    EXPECT_EQ(dst.storage().Open(CommitObjectName(6)).status().code(), StatusCode::kNotFound);
    if (before_start) {
      EXPECT_EQ(done, 0u);
    } else {
      EXPECT_EQ(done, uint64_t{4} << 20);  // one chunk, then nothing more
    }
  }
}

TEST(TierCopyTest, MissingSourceStepIsNotFound) {
  CheckpointStore src(NewMemoryStorage());
  CheckpointStore dst(NewMemoryStorage());
  ASSERT_OK(SaveStep(src, 1, 1));
  auto copied = CopyStep(src, dst, 2);
  ASSERT_EQ(copied.status().code(), StatusCode::kNotFound) << copied.status().ToString();
  EXPECT_NE(copied.status().message().find("step 2"), std::string::npos);
  EXPECT_TRUE(CommittedSteps(dst).empty());
}

}  // namespace
}  // namespace safepoint::tier_copy_test
