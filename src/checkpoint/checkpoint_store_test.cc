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

#include "checkpoint/store_test_shard.h"
#include "safepoint/checkpoint.h"
#include "storage/faulty/faulty_storage.h"
#include "storage/posix/posix_storage.h"
#include "testing/test_util.h"

namespace safepoint::checkpoint_store_test {
namespace {

using test::AsBytes;
using test::CommittedSteps;
using test::TempDir;
using namespace store_test;  // NOLINT(build/namespaces)

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
