// LoadShard with a COMMIT record the caller already has (include/safepoint/checkpoint.h): one
// process of the job found the newest step and handed its record's bytes to the ranks, so that
// a rank reads its own image alone (issue 32, "Restore that asks storage once per job"), still
// verified against the record: a damaged or foreign image is Corruption, a replaced step loads
// its new record.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "safepoint/checkpoint.h"
#include "testing/test_util.h"

namespace safepoint::shard_io_test {
namespace {

using test::AsBytes;
using test::TempDir;

constexpr size_t kElems = 64 << 10;  // 256 KiB of "big": several checksum chunks

// A shard whose bytes are a pure function of (step, rank, version).
struct Shard : test::TwoTensorShard {
  Shard(uint64_t step, uint32_t rank, uint64_t version = 0)
      : TwoTensorShard(step, rank, /*seed=*/step + 100 * version, kElems) {}
};

Status Save(CheckpointStore& store, uint64_t step, uint32_t world, uint64_t version = 0,
            uint64_t attempt = 0, bool overwrite = false) {
  for (uint32_t rank = 0; rank < world; ++rank) {
    Shard s(step, rank, version);
    ImageMeta m = test::TestImageMeta("test", step, rank, world);
    m.attempt = attempt;
    SP_RETURN_IF_ERROR(
        SaveShard(store, m, s.sources, s.extras, SaveOptions{.overwrite = overwrite, .pack = {}})
            .status());
  }
  return Status::OK();
}

void ExpectShard(const LoadedShard& shard, uint64_t step, uint32_t rank, uint64_t version = 0) {
  Shard want(step, rank, version);
  EXPECT_EQ(shard.commit.step, step);
  ASSERT_EQ(shard.reader.tensors().size(), 2u);
  auto big = shard.reader.tensor_data(0);
  ASSERT_EQ(big.size(), want.big.size() * 4);
  EXPECT_EQ(std::memcmp(big.data(), want.big.data(), big.size()), 0) << "rank " << rank;
}

// Records the name of every object opened and every prefix listed.
class RecordingStorage : public test::ForwardingStorage {
 public:
  using ForwardingStorage::ForwardingStorage;
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    {
      std::lock_guard lock(mu_);
      opened_.emplace_back(name);
    }
    return inner_->Open(name);
  }
  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    {
      std::lock_guard lock(mu_);
      ++lists_;
    }
    return inner_->List(prefix);
  }
  std::vector<std::string> TakeOpened() {
    std::lock_guard lock(mu_);
    return std::exchange(opened_, {});
  }
  int TakeLists() {
    std::lock_guard lock(mu_);
    return std::exchange(lists_, 0);
  }

 private:
  std::mutex mu_;
  std::vector<std::string> opened_;
  int lists_ = 0;
};

// What the job's finder hands to the ranks: the newest record's bytes (one List, one read).
std::string FindNewest(CheckpointStore& store) {
  auto steps = store.StepsWithCommit();
  EXPECT_TRUE(steps.ok()) << steps.status().ToString();
  if (!steps.ok()) return "";
  auto newest = store.NewestCommitted(*steps);
  EXPECT_TRUE(newest.ok() && newest->has_value());
  return newest.ok() && *newest ? EncodeCommitRecord(**newest) : "";
}

TEST(LoadShardWithRecord, ReadsTheRanksImageAndNoCommitRecord) {
  auto recording = std::make_shared<RecordingStorage>(NewMemoryStorage());
  CheckpointStore store(recording);
  constexpr uint32_t kWorld = 4;
  ASSERT_OK(Save(store, 2, kWorld));
  ASSERT_OK(Save(store, 5, kWorld));
  const std::string bytes = FindNewest(store);
  recording->TakeOpened();
  recording->TakeLists();
  // Each rank decodes the bytes it was handed (their CRC checked) and loads its image alone.
  ASSERT_OK_AND_ASSIGN(CommitRecord handed, DecodeCommitRecord(AsBytes(bytes), "handed"));
  for (uint32_t rank = 0; rank < kWorld; ++rank) {
    ASSERT_OK_AND_ASSIGN(LoadedShard shard, LoadShard(store, handed, rank));
    ExpectShard(shard, 5, rank);
    EXPECT_EQ(recording->TakeOpened(), std::vector<std::string>{ImageObjectName(5, rank)});
    EXPECT_EQ(recording->TakeLists(), 0);
  }
  // LoadShard with the step alone reads the COMMIT record too (what the record saves).
  ASSERT_OK(LoadShard(store, 5, 0));
  EXPECT_EQ(recording->TakeOpened(),
            (std::vector<std::string>{CommitObjectName(5), ImageObjectName(5, 0)}));
}

TEST(LoadShardWithRecord, DamagedHandedBytesAreRefusedByTheirChecksum) {
  CheckpointStore store(NewMemoryStorage());
  ASSERT_OK(Save(store, 1, 1));
  std::string bytes = FindNewest(store);
  bytes[30] ^= 0x01;  // a byte of its commit time
  EXPECT_EQ(DecodeCommitRecord(AsBytes(bytes), "handed").status().code(), StatusCode::kCorruption);
}

TEST(LoadShardWithRecord, ADamagedImageIsCorruption) {
  TempDir dir;
  ASSERT_OK_AND_ASSIGN(auto store, OpenCheckpointStore(dir.path()));
  ASSERT_OK(Save(*store, 3, 2));
  ASSERT_OK_AND_ASSIGN(CommitRecord handed,
                       DecodeCommitRecord(AsBytes(FindNewest(*store)), "handed"));
  // One byte of rank 1's tensor data flipped on storage.
  const std::string image = dir.path() + "/" + ImageObjectName(3, 1);
  const auto size = std::filesystem::file_size(image);
  {
    std::fstream f(image, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size / 2));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x40;
    f.seekp(static_cast<std::streamoff>(size / 2));
    f.write(&c, 1);
  }
  ASSERT_OK(LoadShard(*store, handed, 0));
  auto damaged = LoadShard(*store, handed, 1);
  EXPECT_EQ(damaged.status().code(), StatusCode::kCorruption) << damaged.status().ToString();
}

TEST(LoadShardWithRecord, AnImageTheRecordDoesNotNameIsCorruption) {
  // Rank 1's image replaced on storage by the image of the same rank and step of another save
  // (another save attempt: another header, whole and valid on its own): not the image the
  // record names.
  TempDir dir, other_dir;
  ASSERT_OK_AND_ASSIGN(auto store, OpenCheckpointStore(dir.path()));
  ASSERT_OK_AND_ASSIGN(auto other, OpenCheckpointStore(other_dir.path()));
  ASSERT_OK(Save(*store, 4, 2));
  ASSERT_OK(Save(*other, 4, 2, /*version=*/0, /*attempt=*/9));
  ASSERT_OK_AND_ASSIGN(CommitRecord handed,
                       DecodeCommitRecord(AsBytes(FindNewest(*store)), "handed"));
  std::filesystem::copy_file(other_dir.path() + "/" + ImageObjectName(4, 1),
                             dir.path() + "/" + ImageObjectName(4, 1),
                             std::filesystem::copy_options::overwrite_existing);
  ASSERT_OK(LoadShard(*store, handed, 0));
  auto foreign = LoadShard(*store, handed, 1);
  EXPECT_EQ(foreign.status().code(), StatusCode::kCorruption) << foreign.status().ToString();
}

TEST(LoadShardWithRecord, ARecordOfAnotherSaveLoadsTheStoredRecordsImages) {
  // A handed record of another save of the step (another attempt) does not name the stored
  // images: the rank reads the step's record from storage and loads the images it names,
  // checked against it, never an image no stored record names.
  auto recording = std::make_shared<RecordingStorage>(NewMemoryStorage());
  CheckpointStore store(recording);
  CheckpointStore other(NewMemoryStorage());
  ASSERT_OK(Save(other, 4, 2, /*version=*/0, /*attempt=*/9));
  ASSERT_OK(Save(store, 4, 2));
  ASSERT_OK_AND_ASSIGN(CommitRecord stale,
                       DecodeCommitRecord(AsBytes(FindNewest(other)), "handed"));
  const std::string stored = FindNewest(store);
  ASSERT_NE(EncodeCommitRecord(stale), stored);
  recording->TakeOpened();
  ASSERT_OK_AND_ASSIGN(LoadedShard shard, LoadShard(store, stale, 1));
  EXPECT_EQ(EncodeCommitRecord(shard.commit), stored);
  ExpectShard(shard, 4, 1);
  const auto opened = recording->TakeOpened();
  EXPECT_NE(std::find(opened.begin(), opened.end(), CommitObjectName(4)), opened.end());
}

TEST(LoadShardWithRecord, AStepReplacedSinceTheLookupLoadsItsNewRecord) {
  CheckpointStore store(NewMemoryStorage());
  ASSERT_OK(Save(store, 6, 2, /*version=*/0, /*attempt=*/1));
  ASSERT_OK_AND_ASSIGN(CommitRecord handed,
                       DecodeCommitRecord(AsBytes(FindNewest(store)), "handed"));
  // Replaced whole after the lookup: the handed record's images are gone.
  ASSERT_OK(Save(store, 6, 2, /*version=*/1, /*attempt=*/2, /*overwrite=*/true));
  for (uint32_t rank = 0; rank < 2; ++rank) {
    ASSERT_OK_AND_ASSIGN(LoadedShard shard, LoadShard(store, handed, rank));
    EXPECT_EQ(shard.commit.generation, 2u);
    ExpectShard(shard, 6, rank, /*version=*/1);
  }
}

TEST(LoadShardWithRecord, ARankOutsideTheRecordsWorldIsInvalid) {
  CheckpointStore store(NewMemoryStorage());
  ASSERT_OK(Save(store, 1, 2));
  ASSERT_OK_AND_ASSIGN(CommitRecord handed,
                       DecodeCommitRecord(AsBytes(FindNewest(store)), "handed"));
  EXPECT_EQ(LoadShard(store, handed, 2).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace safepoint::shard_io_test
