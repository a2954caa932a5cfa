// Packed images: the manifest, the chunk store, reading packed steps through every read path,
// and the chunk store's garbage collector (refcounts by marking, in-flight saves, crashes).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "base/bytes.h"
#include "base/crc32c.h"
#include "base/digest.h"
#include "checkpoint/chunk_gc.h"
#include "checkpoint/chunk_store_holder.h"
#include "checkpoint/compression_policy.h"
#include "checkpoint/pack_manifest.h"
#include "codec/codec.h"
#include "safepoint/checkpoint.h"
#include "testing/test_util.h"

namespace safepoint::pack_test {
namespace {

using test::AsBytes;

// A shard whose big tensor is a function of `seed` and whose small tensor and extras change
// with `step`: steps with one seed share the big tensor's middle chunks.
using Shard = test::TwoTensorShard;  // (step, rank, seed): "big" from the seed

PackOptions Incremental() { return {Compression::kNone, true}; }

Result<SaveResult> Save(CheckpointStore& store, uint64_t step, uint64_t seed,
                        PackOptions pack = Incremental(), uint32_t rank = 0, uint32_t world = 1,
                        std::string job = "test") {
  Shard s(step, rank, seed);
  SaveOptions options;
  options.pack = pack;
  return SaveShard(store, test::TestImageMeta(job, step, rank, world), s.sources, s.extras,
                   options);
}

void ExpectShard(CheckpointStore& store, uint64_t step, uint64_t seed, uint32_t rank = 0) {
  auto shard = LoadShard(store, step, rank);
  ASSERT_OK(shard);
  Shard want(step, rank, seed);
  auto big = shard->reader.tensor_data(0);
  ASSERT_EQ(big.size(), want.big.size() * 4);
  EXPECT_EQ(std::memcmp(big.data(), want.big.data(), big.size()), 0) << "step " << step;
  auto small = shard->reader.tensor_data(1);
  ASSERT_EQ(small.size(), 68u);
  EXPECT_EQ(std::memcmp(small.data(), want.small.data(), 68), 0) << "step " << step;
  EXPECT_EQ(*EncodeExtras(shard->extras), want.extras);
}

std::vector<std::string> Names(Storage& storage, std::string_view prefix) {
  std::vector<std::string> out;
  auto objects = storage.List(prefix);
  EXPECT_OK(objects);
  if (!objects.ok()) return out;
  for (auto& o : *objects) out.push_back(o.name);
  return out;
}

std::vector<std::string> ChunkNames(Storage& storage) {
  std::vector<std::string> out;
  for (auto& n : Names(storage, "chunks/")) {
    if (!n.starts_with(kIntentPrefix) && n != kGcLockName) out.push_back(n);
  }
  return out;
}

// The chunk objects step `step`'s manifest (rank 0) references.
std::set<std::string> ChunksOf(Storage& storage, uint64_t step) {
  std::set<std::string> out;
  auto m = ReadPackedManifest(storage, PackedObjectName(step, 0));
  EXPECT_OK(m);
  if (!m.ok()) return out;
  for (auto& c : m->chunks) out.insert(ChunkObjectName(c.sha256));
  return out;
}

std::set<std::string> Minus(std::set<std::string> a, const std::set<std::string>& b) {
  for (auto& x : b) a.erase(x);
  return a;
}

// Saves steps 1 and 2 into `store` (over `storage`) and sets `*only_1` to the chunks only step 1's
// manifest names.
void SaveOneAndTwo(CheckpointStore& store, Storage& storage, std::set<std::string>* only_1) {
  ASSERT_OK(Save(store, 1, 1));
  ASSERT_OK(Save(store, 2, 2));
  *only_1 = Minus(ChunksOf(storage, 1), ChunksOf(storage, 2));
}

TEST(PackTest, CommitRecordOfAPackedStepIsVersion3AndRoundTrips) {
  CommitRecord r{.step = 7,
                 .world_size = 2,
                 .commit_time_ns = 5,
                 .job = "j",
                 .images = {{4096, 1, true}, {8192, 2, false}}};
  const std::string enc = EncodeCommitRecord(r);
  EXPECT_EQ(internal::LoadLE<uint32_t>(AsBytes(enc).data() + 8), kCommitFormatVersionPacked);
  ASSERT_OK_AND_ASSIGN(auto dec, DecodeCommitRecord(AsBytes(enc), "c"));
  EXPECT_TRUE(dec.images[0].packed);
  EXPECT_FALSE(dec.images[1].packed);
  EXPECT_EQ(EncodeCommitRecord(dec), enc);
  EXPECT_EQ(ImageObjectName(dec, 0), "step-00000000000000000007/rank-00000.pack");
  EXPECT_EQ(ImageObjectName(dec, 1), "step-00000000000000000007/rank-00001.img");
  for (size_t i = 0; i < enc.size(); ++i) {
    std::string bad = enc;
    bad[i] ^= 0x04;
    EXPECT_EQ(DecodeCommitRecord(AsBytes(bad), "c").status().code(), StatusCode::kCorruption) << i;
  }
  // Without a packed image the record stays what it was (version 1).
  r.images[0].packed = false;
  EXPECT_EQ(internal::LoadLE<uint32_t>(AsBytes(EncodeCommitRecord(r)).data() + 8),
            kCommitFormatVersion);
  CommitRecord other = dec;
  other.images[0].packed = false;
  EXPECT_TRUE(SameStep(dec, other));
  other.images[0].header_crc = 9;
  EXPECT_FALSE(SameStep(dec, other));
}

TEST(PackTest, ManifestRoundTripsAndEveryFlippedBitIsCorruption) {
  CheckpointStore store(NewMemoryStorage());
  ASSERT_OK(Save(store, 1, 1));
  ASSERT_OK_AND_ASSIGN(auto commit, store.ReadCommit(1));
  ASSERT_TRUE(commit.images[0].packed);
  const std::string name = PackedObjectName(1, 0);
  const auto bytes = test::ReadWholeObject(store.storage(), name);
  ASSERT_OK_AND_ASSIGN(auto m, DecodePackedManifest(bytes, name));
  EXPECT_EQ(m.layout.image_size, commit.images[0].size);
  EXPECT_EQ(m.layout.header_crc, commit.images[0].header_crc);
  EXPECT_GT(m.chunks.size(), m.layout.chunk_count());  // the header and big's tail apart
  const std::string enc = EncodePackedManifest(m);
  ASSERT_EQ(enc.size(), bytes.size());
  EXPECT_EQ(std::memcmp(enc.data(), bytes.data(), enc.size()), 0);
  for (size_t i = 0; i < enc.size(); i += 3) {
    std::string bad = enc;
    bad[i] ^= 0x10;
    EXPECT_EQ(DecodePackedManifest(AsBytes(bad), "m").status().code(), StatusCode::kCorruption)
        << i;
  }
  for (size_t n = 0; n < enc.size(); n += 101) {
    EXPECT_FALSE(DecodePackedManifest(AsBytes(enc.substr(0, n)), "m").ok());
  }
  // Every chunk object is named by the SHA-256 of the chunk's raw bytes.
  ASSERT_OK_AND_ASSIGN(auto shard, LoadShard(store, 1, 0));
  uint64_t at = 0;
  for (size_t c = 0; c < m.chunks.size(); ++c) {
    EXPECT_EQ(m.chunks[c].offset, at);
    const auto digest = internal::Sha256(shard.image.bytes().subspan(at, m.chunks[c].raw_size));
    EXPECT_TRUE(std::equal(digest.begin(), digest.end(), m.chunks[c].sha256.begin())) << c;
    at += m.chunks[c].raw_size;
  }
  EXPECT_EQ(at, m.layout.checksums_offset);
}

TEST(PackTest, PackedStepsReadThroughEveryReadPath) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  ASSERT_OK(Save(store, 1, 1));
  ASSERT_OK(Save(store, 2, 1, PackOptions{Compression::kAuto, false}));  // plain or packed
  ASSERT_OK(Save(store, 3, 1, PackOptions{Compression::kZstd, false}));  // packed, not shared
  for (uint64_t step : {1, 2, 3}) ExpectShard(store, step, 1);
  ASSERT_OK_AND_ASSIGN(auto commit, store.ReadCommit(3));
  EXPECT_TRUE(commit.images[0].packed);
  // Newest without a step.
  ASSERT_OK_AND_ASSIGN(auto newest, LoadShard(store, std::nullopt, 0));
  EXPECT_EQ(newest.commit.step, 3u);
  // Metadata and range reads.
  ASSERT_OK_AND_ASSIGN(auto md, store.ReadMetadata(commit, 0));
  ASSERT_EQ(md.tensors.size(), 2u);
  EXPECT_EQ(md.name, PackedObjectName(3, 0));
  Shard want(3, 0, 1);
  std::vector<float> part(1000), small(17);
  std::vector<CheckpointStore::Range> ranges = {
      {md.tensors[0].offset + 4 * 1048000, 4000, reinterpret_cast<std::byte*>(part.data())},
      {md.tensors[1].offset, 68, reinterpret_cast<std::byte*>(small.data())}};
  ASSERT_OK(store.ReadRanges(md, ranges));
  EXPECT_EQ(std::memcmp(part.data(), want.big.data() + 1048000, 4000), 0);
  EXPECT_EQ(std::memcmp(small.data(), want.small.data(), 68), 0);
  // Tier copies: packed to plain, plain to packed, packed to packed.
  CheckpointStore plain(NewMemoryStorage());
  ASSERT_OK(CopyStep(store, plain, 3));
  ASSERT_OK_AND_ASSIGN(auto plain_commit, plain.ReadCommit(3));
  EXPECT_FALSE(plain_commit.images[0].packed);
  EXPECT_TRUE(SameStep(plain_commit, commit));
  ExpectShard(plain, 3, 1);
  CopyOptions packed_copy;
  packed_copy.layout = Incremental();
  CheckpointStore packed(NewMemoryStorage());
  ASSERT_OK(CopyStep(plain, packed, 3, packed_copy));
  ASSERT_OK(CopyStep(store, packed, 1, packed_copy));
  ASSERT_OK_AND_ASSIGN(auto packed_commit, packed.ReadCommit(3));
  EXPECT_TRUE(packed_commit.images[0].packed);
  ExpectShard(packed, 3, 1);
  ExpectShard(packed, 1, 1);
  // Copying again finds the same step there, whatever its layout.
  ASSERT_OK_AND_ASSIGN(auto again, CopyStep(store, packed, 3, packed_copy));
  EXPECT_TRUE(again.already_there);
}

TEST(PackTest, AnIncrementalStepWritesOnlyTheChunksThatChanged) {
  CheckpointStore store(NewMemoryStorage());
  ASSERT_OK_AND_ASSIGN(auto first, Save(store, 1, 1));
  ASSERT_OK_AND_ASSIGN(auto second, Save(store, 2, 1));  // same big tensor, new small and extras
  ASSERT_OK_AND_ASSIGN(auto m, ReadPackedManifest(store.storage(), PackedObjectName(2, 0)));
  // The big tensor's chunks were stored by step 1 and are not written again; the header's, and
  // big's last bytes with small, and the extras, are new.
  ASSERT_OK_AND_ASSIGN(auto md, store.ReadMetadata(*store.ReadCommit(2), 0));
  const uint64_t big_begin = md.tensors[0].offset, big_end = big_begin + md.tensors[0].nbytes;
  size_t fresh = 0;
  for (const auto& c : m.chunks) {
    const bool only_big = c.offset >= big_begin && c.offset + c.raw_size <= big_end;
    EXPECT_EQ(c.method == PackedManifest::kMethodStoredBefore, only_big) << c.offset;
    fresh += !only_big;
  }
  EXPECT_EQ(fresh, 3u);  // the header, big's tail with small, the extras
  EXPECT_GT(first.stored_bytes, 12u << 20);
  EXPECT_LT(second.stored_bytes, 200u << 10);  // two small chunks and the manifest
  EXPECT_EQ(ChunkNames(store.storage()).size(), m.chunks.size() + 3);
  ExpectShard(store, 1, 1);
  ExpectShard(store, 2, 1);
  // Not incremental: every chunk is encoded and written (equal ones are kept as they are).
  ASSERT_OK(Save(store, 3, 1, PackOptions{Compression::kZstd, false}));
  ASSERT_OK_AND_ASSIGN(auto m3, ReadPackedManifest(store.storage(), PackedObjectName(3, 0)));
  for (const auto& c : m3.chunks) EXPECT_NE(c.method, PackedManifest::kMethodStoredBefore);
  ExpectShard(store, 3, 1);
}

TEST(PackTest, GcRemovesOnlyChunksNoManifestReferences) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  ASSERT_OK(Save(store, 1, 1));
  ASSERT_OK(Save(store, 2, 2));
  ASSERT_OK(Save(store, 3, 2));
  // Another run sharing the directory, with its own steps and data.
  ASSERT_OK(Save(store, 100, 7, Incremental(), 0, 1, "other"));
  const size_t before = ChunkNames(*mem).size();
  const auto only_1 = Minus(Minus(Minus(ChunksOf(*mem, 1), ChunksOf(*mem, 2)), ChunksOf(*mem, 3)),
                            ChunksOf(*mem, 100));
  ASSERT_GT(only_1.size(), 3u);
  ASSERT_OK_AND_ASSIGN(auto nothing, CollectChunkGarbage(store.storage()));
  EXPECT_FALSE(nothing.deferred) << nothing.reason;
  EXPECT_EQ(nothing.removed, 0u);
  EXPECT_EQ(nothing.manifests, 4u);
  ASSERT_OK(store.DeleteStep(1));  // its big tensor's chunks are now referenced by nothing
  ASSERT_OK_AND_ASSIGN(auto gc, CollectChunkGarbage(store.storage()));
  EXPECT_FALSE(gc.deferred) << gc.reason;
  EXPECT_EQ(gc.removed, only_1.size());  // step 1's chunks, which no later step shares
  EXPECT_GT(gc.removed_bytes, 12u << 20);
  EXPECT_EQ(ChunkNames(*mem).size(), before - only_1.size());
  ExpectShard(store, 2, 2);
  ExpectShard(store, 3, 2);
  ExpectShard(store, 100, 7);
  // Every chunk a remaining manifest names is there.
  std::set<std::string> chunks;
  for (auto& n : ChunkNames(*mem)) chunks.insert(n);
  for (uint64_t step : {2, 3, 100}) {
    ASSERT_OK_AND_ASSIGN(auto m, ReadPackedManifest(*mem, PackedObjectName(step, 0)));
    for (auto& c : m.chunks) EXPECT_TRUE(chunks.contains(ChunkObjectName(c.sha256)));
  }
  EXPECT_TRUE(Names(*mem, std::string(kIntentPrefix)).empty());
  EXPECT_TRUE(Names(*mem, std::string(kGcLockName)).empty());
}

TEST(PackTest, GcDefersWhileASaveIsInFlightAndRemovesStaleIntents) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  std::set<std::string> only_1;
  ASSERT_NO_FATAL_FAILURE(SaveOneAndTwo(store, *mem, &only_1));
  const size_t all = ChunkNames(*mem).size();
  ASSERT_OK(store.DeleteStep(1));
  // A save in flight (its intent, written now): nothing is removed.
  const std::string now = std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             std::chrono::system_clock::now().time_since_epoch())
                                             .count());
  const std::string live = std::string(kIntentPrefix) + "00000000000000000003.r0.0000000000000001";
  ASSERT_OK(test::PutObject(*mem, live, AsBytes(now + " 3 0 1 host\n")));
  ASSERT_OK_AND_ASSIGN(auto deferred, CollectChunkGarbage(store.storage()));
  EXPECT_TRUE(deferred.deferred);
  EXPECT_EQ(deferred.removed, 0u);
  EXPECT_EQ(ChunkNames(*mem).size(), all);
  // A crashed save's intent, hours old, no longer holds the GC back.
  ASSERT_OK(mem->Delete(live));
  const std::string stale = std::string(kIntentPrefix) + "00000000000000000003.r0.0000000000000002";
  ASSERT_OK(test::PutObject(*mem, stale, AsBytes("1000 3 0 1 host\n")));
  ASSERT_OK_AND_ASSIGN(auto gc, CollectChunkGarbage(store.storage()));
  EXPECT_FALSE(gc.deferred) << gc.reason;
  EXPECT_EQ(gc.stale_intents, 1u);
  EXPECT_EQ(gc.removed, only_1.size());
  ExpectShard(store, 2, 2);
  // Another GC holding a fresh lock: this one defers.
  ASSERT_OK(test::PutObject(*mem, std::string(kGcLockName), AsBytes(now + " 0 0 1 host\n")));
  ASSERT_OK_AND_ASSIGN(auto locked, CollectChunkGarbage(store.storage()));
  EXPECT_TRUE(locked.deferred);
}

TEST(PackTest, ASaveThatFindsTheGcLockWritesThePlainImage) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  ASSERT_OK(test::PutObject(*mem, std::string(kGcLockName), AsBytes("1 0 0 1 host\n")));
  ASSERT_OK(Save(store, 1, 1));
  ASSERT_OK_AND_ASSIGN(auto commit, store.ReadCommit(1));
  EXPECT_FALSE(commit.images[0].packed);
  EXPECT_TRUE(ChunkNames(*mem).empty());
  EXPECT_TRUE(Names(*mem, std::string(kIntentPrefix)).empty());
  ExpectShard(store, 1, 1);
}

// --- Locks and intents of dead holders ---------------------------------------------------------

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The identity docs/format.md records for process `pid` of this host.
struct Identity {
  int64_t pid = 0;
  std::string boot_id;
  uint64_t pid_ns = 0;
  uint64_t start_ticks = 0;
};

Identity IdentityOf(pid_t pid) {
  Identity id;
  id.pid = pid;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> id.boot_id;
  char link[64] = {};
  const std::string ns = "/proc/" + std::to_string(pid) + "/ns/pid";
  EXPECT_GT(readlink(ns.c_str(), link, sizeof(link) - 1), 0) << ns;
  unsigned long long inode = 0;
  EXPECT_EQ(std::sscanf(link, "pid:[%llu]", &inode), 1) << link;
  id.pid_ns = inode;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  std::string rest = line.substr(line.rfind(')') + 2);  // field 3 onwards
  std::istringstream fields(rest);
  std::string f;
  for (int field = 3; field <= 22; ++field) fields >> f;
  id.start_ticks = std::stoull(f);
  EXPECT_EQ(id.boot_id.size(), 36u);
  return id;
}

// A version 2 holder record (docs/format.md "Packed steps"), written byte by byte here.
std::string RecordOf(const Identity& id, int64_t time_ns, uint64_t step = 0) {
  std::string out = std::to_string(time_ns) + " " + std::to_string(step) + " 0 " +
                    std::to_string(id.pid) + " host 2 " + id.boot_id + " " +
                    std::to_string(id.pid_ns) + " " + std::to_string(id.start_ticks);
  char crc[16];
  std::snprintf(crc, sizeof(crc), " %08x", internal::Crc32c(0, out.data(), out.size()));
  return out + crc + "\n";
}

// A process that is gone: forked, named while it runs, then killed (SIGKILL, as the crash
// campaign kills) and, unless `reap` is false, reaped. `zombie` receives the pid to reap later.
Identity KilledProcess(bool reap = true, pid_t* zombie = nullptr) {
  const pid_t child = fork();
  if (child == 0) {
    for (;;) pause();
  }
  EXPECT_GT(child, 0);
  Identity id = IdentityOf(child);
  EXPECT_EQ(kill(child, SIGKILL), 0);
  if (reap) {
    int status = 0;
    EXPECT_EQ(waitpid(child, &status, 0), child);
  } else {
    // Wait until it is a zombie (killed, not reaped).
    siginfo_t info{};
    EXPECT_EQ(waitid(P_PID, child, &info, WEXITED | WNOWAIT), 0);
    *zombie = child;
  }
  return id;
}

TEST(PackTest, AKilledGcsLockIsBrokenAtOnceByTheNextSaveAndTheNextGc) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  const std::string lock(kGcLockName);
  ASSERT_OK(test::PutObject(*mem, lock, AsBytes(RecordOf(KilledProcess(), NowNs()))));
  // The next packed save writes packed (not the plain image after waiting for the lock).
  ASSERT_OK_AND_ASSIGN(auto saved, Save(store, 1, 1));
  ASSERT_OK_AND_ASSIGN(auto commit, store.ReadCommit(1));
  EXPECT_TRUE(commit.images[0].packed);
  EXPECT_FALSE(ChunkNames(*mem).empty());
  EXPECT_TRUE(Names(*mem, lock).empty());
  ExpectShard(store, 1, 1);
  // The next GC runs (and removes step 1's chunks once step 1 is gone).
  ASSERT_OK(test::PutObject(*mem, lock, AsBytes(RecordOf(KilledProcess(), NowNs()))));
  ASSERT_OK(Save(store, 2, 2));  // breaks that lock too
  ASSERT_OK(test::PutObject(*mem, lock, AsBytes(RecordOf(KilledProcess(), NowNs()))));
  const auto only_1 = Minus(ChunksOf(*mem, 1), ChunksOf(*mem, 2));
  ASSERT_OK(store.DeleteStep(1));
  ASSERT_OK_AND_ASSIGN(auto gc, CollectChunkGarbage(store.storage()));
  EXPECT_FALSE(gc.deferred) << gc.reason;
  EXPECT_EQ(gc.removed, only_1.size());
  EXPECT_TRUE(Names(*mem, lock).empty());
  ExpectShard(store, 2, 2);
  // A killed GC that its parent has not reaped yet (a zombie) is dead too.
  pid_t zombie = 0;
  ASSERT_OK(test::PutObject(*mem, lock, AsBytes(RecordOf(KilledProcess(false, &zombie), NowNs()))));
  ASSERT_OK_AND_ASSIGN(auto again, CollectChunkGarbage(store.storage()));
  EXPECT_FALSE(again.deferred) << again.reason;
  int status = 0;
  EXPECT_EQ(waitpid(zombie, &status, 0), zombie);
  // A holder whose pid is now another process's (here this one's, which started later).
  Identity reused = IdentityOf(getpid());
  reused.start_ticks -= 1;
  ASSERT_OK(test::PutObject(*mem, lock, AsBytes(RecordOf(reused, NowNs()))));
  ASSERT_OK_AND_ASSIGN(auto reused_gc, CollectChunkGarbage(store.storage()));
  EXPECT_FALSE(reused_gc.deferred) << reused_gc.reason;
}

TEST(PackTest, AKilledSavesIntentDoesNotHoldTheGcBack) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  std::set<std::string> only_1;
  ASSERT_NO_FATAL_FAILURE(SaveOneAndTwo(store, *mem, &only_1));
  ASSERT_OK(store.DeleteStep(1));
  const std::string dead = std::string(kIntentPrefix) + "00000000000000000003.r0.0000000000000001";
  ASSERT_OK(test::PutObject(*mem, dead, AsBytes(RecordOf(KilledProcess(), NowNs(), 3))));
  ASSERT_OK_AND_ASSIGN(auto gc, CollectChunkGarbage(store.storage()));
  EXPECT_FALSE(gc.deferred) << gc.reason;
  EXPECT_EQ(gc.stale_intents, 1u);
  EXPECT_EQ(gc.removed, only_1.size());
  EXPECT_TRUE(Names(*mem, std::string(kIntentPrefix)).empty());
  ExpectShard(store, 2, 2);
}

TEST(PackTest, ALiveForeignOrOldFormatHoldersLockIsNotBrokenBeforeItIsStale) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  ASSERT_OK(Save(store, 1, 1));
  const std::string lock(kGcLockName);
  const Identity dead = KilledProcess();
  Identity other_boot = dead;
  other_boot.boot_id[0] = other_boot.boot_id[0] == '0' ? '1' : '0';
  Identity other_ns = dead;
  other_ns.pid_ns += 1;
  std::string bad_crc = RecordOf(dead, NowNs());
  bad_crc[bad_crc.size() - 2] = bad_crc[bad_crc.size() - 2] == '0' ? '1' : '0';
  const std::vector<std::pair<std::string, std::string>> held = {
      {"this process", RecordOf(IdentityOf(getpid()), NowNs())},
      {"another boot", RecordOf(other_boot, NowNs())},
      {"another pid namespace", RecordOf(other_ns, NowNs())},
      {"a damaged record", bad_crc},
      {"the old format", std::to_string(NowNs()) + " 0 0 " + std::to_string(dead.pid) + " host\n"},
  };
  for (const auto& [what, record] : held) {
    SCOPED_TRACE(what);
    ASSERT_OK(test::PutObject(*mem, lock, AsBytes(record)));
    ASSERT_OK_AND_ASSIGN(auto gc, CollectChunkGarbage(store.storage()));
    EXPECT_TRUE(gc.deferred);
    const auto there = test::ReadWholeObject(*mem, lock);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(there.data()), there.size()), record);
  }
  // A save waits for this process's lock, then writes the plain image.
  ASSERT_OK(test::PutObject(*mem, lock, AsBytes(held[0].second)));
  ASSERT_OK(Save(store, 2, 2));
  ASSERT_OK_AND_ASSIGN(auto commit, store.ReadCommit(2));
  EXPECT_FALSE(commit.images[0].packed);
  // The age rule still breaks a foreign holder's stale lock (and an old record's).
  ASSERT_OK(test::PutObject(*mem, lock, AsBytes(RecordOf(other_boot, 1000))));
  ASSERT_OK_AND_ASSIGN(auto stale, CollectChunkGarbage(store.storage()));
  EXPECT_FALSE(stale.deferred) << stale.reason;
  // An intent of this (live) process holds the GC back however the record was made.
  const std::string live = std::string(kIntentPrefix) + "00000000000000000003.r0.0000000000000002";
  ASSERT_OK(test::PutObject(*mem, live, AsBytes(RecordOf(IdentityOf(getpid()), NowNs(), 3))));
  ASSERT_OK_AND_ASSIGN(auto deferred, CollectChunkGarbage(store.storage()));
  EXPECT_TRUE(deferred.deferred);
}

// Trained-like weights: fp32 values of a narrow normal distribution (as weights and Adam moments
// are after training) and the same values rounded to bf16, whose high bytes compress and low
// mantissa bytes barely do.
struct TrainedShard {
  std::vector<float> fp32;
  std::vector<uint16_t> bf16;
  std::vector<TensorSource> sources;
  std::string extras;

  explicit TrainedShard(uint64_t step) : fp32(1 << 20), bf16(3 << 20) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (auto& v : fp32) v = normal(rng);
    for (auto& v : bf16) {
      const float f = normal(rng);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      v = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);  // round to even
    }
    sources.push_back(
        {{"w.bf16", DType::kBFloat16, {bf16.size()}, {}, {}}, bf16.data(), bf16.size() * 2});
    sources.push_back(
        {{"m.fp32", DType::kFloat32, {fp32.size()}, {}, {}}, fp32.data(), fp32.size() * 4});
    Dict d;
    d.items.emplace_back(Value(std::string("step")), Value(int64_t(step)));
    extras = *EncodeExtras(Value(std::move(d)));
  }
};

Result<SaveResult> SaveTrained(CheckpointStore& store, uint64_t step, PackOptions pack) {
  TrainedShard s(step);
  SaveOptions options;
  options.pack = pack;
  return SaveShard(store, test::TestImageMeta("trained", step, 0, 1), s.sources, s.extras, options);
}

void ExpectTrained(CheckpointStore& store, uint64_t step) {
  ASSERT_OK_AND_ASSIGN(auto shard, LoadShard(store, step, 0));
  TrainedShard want(step);
  auto bf16 = shard.reader.tensor_data(0);
  auto fp32 = shard.reader.tensor_data(1);
  ASSERT_EQ(bf16.size(), want.bf16.size() * 2);
  ASSERT_EQ(fp32.size(), want.fp32.size() * 4);
  EXPECT_EQ(std::memcmp(bf16.data(), want.bf16.data(), bf16.size()), 0);
  EXPECT_EQ(std::memcmp(fp32.data(), want.fp32.data(), fp32.size()), 0);
}

// For each tensor of `step`'s manifest: raw and stored bytes of the chunks written for it.
std::vector<std::pair<uint64_t, uint64_t>> TensorBytes(Storage& storage, uint64_t step,
                                                       CheckpointStore& store) {
  auto m = ReadPackedManifest(storage, PackedObjectName(step, 0));
  EXPECT_OK(m);
  auto md = store.ReadMetadata(*store.ReadCommit(step), 0);
  EXPECT_OK(md);
  std::vector<std::pair<uint64_t, uint64_t>> out(md->tensors.size());
  for (const auto& c : m->chunks) {
    for (size_t t = 0; t < md->tensors.size(); ++t) {
      const auto& e = md->tensors[t];
      if (c.offset >= e.offset && c.offset < e.offset + e.nbytes) {
        out[t].first += c.raw_size;
        out[t].second += c.stored_size;
      }
    }
  }
  return out;
}

// compression="auto" chooses per tier from what it measured (injected here, not timed): where
// one encoder thread is slower than the tier takes bytes it writes the plain image (and packed
// chunks raw when incremental); where the tier is slower than the encoder it compresses, and the
// step reads back bit-exact with a ratio above 1 on bf16 and fp32 alike.
TEST(PackTest, AutoCompressesOnASlowTierAndNotOnAFastOne) {
  auto fast = std::shared_ptr<Storage>(NewMemoryStorage("auto-fast-tier"));
  auto slow = std::shared_ptr<Storage>(NewMemoryStorage("auto-slow-tier"));
  internal::SetTierLearningForTest(fast->uri(), /*write_bps=*/1e12, /*encode_bps_thread=*/1e6,
                                   /*probe_ratio=*/0.7);
  internal::SetTierLearningForTest(slow->uri(), /*write_bps=*/1e6, /*encode_bps_thread=*/1e10,
                                   /*probe_ratio=*/0.7);
  CheckpointStore fast_store(fast), slow_store(slow);

  ASSERT_OK(SaveTrained(fast_store, 1, {Compression::kAuto, false}));
  ASSERT_OK_AND_ASSIGN(auto fast_commit, fast_store.ReadCommit(1));
  EXPECT_FALSE(fast_commit.images[0].packed);
  EXPECT_EQ(PackReportFor(fast->uri()).mode, "auto:none");
  ExpectTrained(fast_store, 1);

  ASSERT_OK(SaveTrained(slow_store, 1, {Compression::kAuto, false}));
  ASSERT_OK_AND_ASSIGN(auto slow_commit, slow_store.ReadCommit(1));
  EXPECT_TRUE(slow_commit.images[0].packed);
  EXPECT_EQ(PackReportFor(slow->uri()).mode, "auto:auto");
  EXPECT_GT(PackReportFor(slow->uri()).ratio, 1.05);
  ExpectTrained(slow_store, 1);
  const auto bytes = TensorBytes(*slow, 1, slow_store);
  ASSERT_EQ(bytes.size(), 2u);
  for (size_t t = 0; t < 2; ++t) {
    EXPECT_LT(bytes[t].second, bytes[t].first) << "tensor " << t << " not compressed";
  }
  // bf16 compresses more than fp32 (its exponent-bearing byte is half the bytes, not a quarter).
  EXPECT_LT(double(bytes[0].second) / double(bytes[0].first),
            double(bytes[1].second) / double(bytes[1].first));

  // Incremental on the fast tier: packed, chunks raw.
  ASSERT_OK(SaveTrained(fast_store, 2, {Compression::kAuto, true}));
  for (const auto& [raw, stored] : TensorBytes(*fast, 2, fast_store)) {
    EXPECT_GE(stored, raw);
  }
  ExpectTrained(fast_store, 2);
}

// compression="auto" (not incremental) that measured its compressed writes to a tier slower, in
// raw bytes per second, than its plain writes there goes back to the plain image, whatever the
// probe said: the probe times the encoder alone, not beside the packed layout's hashing on the
// same cores and its per-chunk objects.
TEST(PackTest, AutoWritesPlainWhereItsCompressedWritesWereSlowerThanPlainOnes) {
  auto tier = std::shared_ptr<Storage>(NewMemoryStorage("auto-measured-slower"));
  internal::SetTierLearningForTest(tier->uri(), /*write_bps=*/1e6, /*encode_bps_thread=*/1e10,
                                   /*probe_ratio=*/0.7);
  internal::SetTierRatesForTest(tier->uri(), /*plain_bps=*/1e9, /*compressed_bps=*/1e8);
  CheckpointStore store(tier);
  ASSERT_OK(SaveTrained(store, 1, {Compression::kAuto, false}));
  ASSERT_OK_AND_ASSIGN(auto commit, store.ReadCommit(1));
  EXPECT_FALSE(commit.images[0].packed);
  EXPECT_EQ(PackReportFor(tier->uri()).mode, "auto:none");
  ExpectTrained(store, 1);
  // Where the compressed writes were the faster, it compresses.
  internal::SetTierLearningForTest(tier->uri(), 1e6, 1e10, 0.7);
  internal::SetTierRatesForTest(tier->uri(), /*plain_bps=*/1e8, /*compressed_bps=*/1e9);
  ASSERT_OK(SaveTrained(store, 2, {Compression::kAuto, false}));
  ASSERT_OK_AND_ASSIGN(auto second, store.ReadCommit(2));
  EXPECT_TRUE(second.images[0].packed);
  ExpectTrained(store, 2);
}

// Incremental with compression="auto" on a slow tier whose encoder speed was never measured (no
// plain auto save probed it): the write probes the encoder and compresses. It used to take the
// unmeasured encoder as "too slow" and store every chunk raw, on every tier, forever.
TEST(PackTest, IncrementalAutoProbesTheEncoderAndCompressesOnASlowTier) {
  auto slow = std::shared_ptr<Storage>(NewMemoryStorage("auto-slow-incremental"));
  internal::SetTierLearningForTest(slow->uri(), /*write_bps=*/1e3, /*encode_bps_thread=*/0,
                                   /*probe_ratio=*/1);
  CheckpointStore store(slow);
  ASSERT_OK(SaveTrained(store, 1, {Compression::kAuto, true}));
  EXPECT_EQ(PackReportFor(slow->uri()).mode, "auto:auto");
  EXPECT_GT(PackReportFor(slow->uri()).ratio, 1.05);
  for (const auto& [raw, stored] : TensorBytes(*slow, 1, store)) EXPECT_LT(stored, raw);
  ExpectTrained(store, 1);
}

// The same for a tier copy (an s3:// tier with compression="auto" is filled this way, by a process
// that never saved to it): the copy probes the encoder on the step's chunks and compresses.
TEST(PackTest, TierCopyWithAutoProbesTheEncoderAndCompressesOnASlowTier) {
  CheckpointStore src(NewMemoryStorage());
  ASSERT_OK(SaveTrained(src, 1, PackOptions{}));
  for (bool incremental : {false, true}) {
    auto slow = std::shared_ptr<Storage>(
        NewMemoryStorage(std::string("auto-slow-copy-") + (incremental ? "incremental" : "full")));
    internal::SetTierLearningForTest(slow->uri(), /*write_bps=*/1e3, /*encode_bps_thread=*/0,
                                     /*probe_ratio=*/1);
    CheckpointStore dst(slow);
    CopyOptions copy;
    copy.layout = {Compression::kAuto, incremental};
    ASSERT_OK(CopyStep(src, dst, 1, copy));
    ASSERT_OK_AND_ASSIGN(auto commit, dst.ReadCommit(1));
    EXPECT_TRUE(commit.images[0].packed);
    for (const auto& [raw, stored] : TensorBytes(*slow, 1, dst)) EXPECT_LT(stored, raw);
    EXPECT_EQ(PackReportFor(slow->uri()).mode, "auto:auto");
    ExpectTrained(dst, 1);
  }
}

TEST(PackTest, MissingOrCorruptChunksAreErrorsNamingTheStepAndTheChunk) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  ASSERT_OK(Save(store, 1, 1));
  ASSERT_OK(Save(store, 2, 2));
  ASSERT_OK_AND_ASSIGN(auto m, ReadPackedManifest(*mem, PackedObjectName(2, 0)));
  const std::string missing = ChunkObjectName(m.chunks[1].sha256);
  ASSERT_OK(mem->Delete(missing));
  auto shard = LoadShard(store, 2, 0);
  ASSERT_EQ(shard.status().code(), StatusCode::kCorruption);
  EXPECT_NE(shard.status().message().find("step 2"), std::string::npos)
      << shard.status().ToString();
  EXPECT_NE(shard.status().message().find("chunk 1"), std::string::npos)
      << shard.status().ToString();
  EXPECT_NE(shard.status().message().find(missing), std::string::npos) << shard.status().ToString();
  EXPECT_NE(shard.status().message().find("behind safepoint's back"), std::string::npos);
  // The newest step that reads back intact is loaded instead.
  ASSERT_OK_AND_ASSIGN(auto fallback, LoadShard(store, std::nullopt, 0));
  EXPECT_EQ(fallback.commit.step, 1u);
  EXPECT_EQ(fallback.skipped.size(), 1u);
  // A chunk whose bytes changed is never handed out.
  ASSERT_EQ(m.chunks[3].offset, 2 * m.layout.chunk_size);  // header, then big's chunks
  const std::string changed = ChunkObjectName(m.chunks[3].sha256);
  auto frame = test::ReadWholeObject(*mem, changed);
  frame[frame.size() / 2] ^= std::byte{1};
  ASSERT_OK(test::PutObject(*mem, changed, frame));
  ASSERT_OK_AND_ASSIGN(auto commit, store.ReadCommit(2));
  ASSERT_OK_AND_ASSIGN(auto md, store.ReadMetadata(commit, 0));
  std::vector<std::byte> dst(16);
  std::vector<CheckpointStore::Range> ranges = {{2 * md.layout.chunk_size + 8, 16, dst.data()}};
  auto read = store.ReadRanges(md, ranges);
  EXPECT_EQ(read.code(), StatusCode::kCorruption);
  EXPECT_NE(read.message().find("chunk 3"), std::string::npos) << read.ToString();
}

// Saves, prunes and collections running at once (two threads, one shared directory): whatever
// the interleaving, no committed step loses a chunk, and once quiet a GC leaves only what
// manifests reference.
TEST(PackTest, GcRunningBesideSavesAndPrunesNeverRemovesAChunkACommittedStepNeeds) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  CheckpointStore store(mem);
  std::atomic<bool> done{false};
  std::atomic<int> collections{0}, deferred{0};
  std::thread gc([&] {
    while (!done.load()) {
      auto r = CollectChunkGarbage(store.storage());
      EXPECT_OK(r);
      ++collections;
      if (r.ok() && r->deferred) ++deferred;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  int packed = 0;  // saves that found the GC's lock write plain images (both kinds happen)
  for (uint64_t step = 1; step <= 24; ++step) {
    ASSERT_OK_AND_ASSIGN(auto r, Save(store, step, step / 4));  // big changes every 4 steps
    packed += r.stored_bytes > 0;
    if (step > 3) ASSERT_OK(store.DeleteStep(step - 3));
  }
  done = true;
  gc.join();
  EXPECT_GT(collections.load(), 0);
  EXPECT_GT(packed, 0);
  ASSERT_OK_AND_ASSIGN(auto committed, store.ListCommitted());
  ASSERT_EQ(committed.size(), 3u);
  for (auto& c : committed) ExpectShard(store, c.step, c.step / 4);
  ASSERT_OK_AND_ASSIGN(auto last, CollectChunkGarbage(store.storage()));
  EXPECT_FALSE(last.deferred) << last.reason;
  std::set<std::string> wanted;
  for (auto& c : committed) {
    if (c.images[0].packed) {
      for (auto& n : ChunksOf(*mem, c.step)) wanted.insert(n);
    }
  }
  std::set<std::string> there;
  for (auto& n : ChunkNames(*mem)) there.insert(n);
  EXPECT_EQ(there, wanted);
}

// A storage that "dies" after `budget` durable mutations (publishes and deletes): every later one
// fails, as if the process had been killed just then; what it had published stays.
class DyingStorage : public test::ForwardingStorage {
 public:
  DyingStorage(std::shared_ptr<Storage> inner, int budget)
      : ForwardingStorage(std::move(inner)), budget_(budget) {}

  bool Spend() { return budget_.fetch_sub(1) > 0; }
  bool dead() const { return budget_.load() <= 0; }

  Result<std::unique_ptr<WritableObject>> Create(std::string_view name, uint64_t size) override {
    if (dead()) return IOError("killed");
    SP_ASSIGN_OR_RETURN(auto w, ForwardingStorage::Create(name, size));
    return std::unique_ptr<WritableObject>(new Writable(std::move(w), this));
  }
  Status Delete(std::string_view name) override {
    if (!Spend()) return IOError("killed");
    return ForwardingStorage::Delete(name);
  }
  Result<size_t> RemoveLeftovers(std::string_view prefix, const LeftoverFilter& f) override {
    if (dead()) return IOError("killed");
    return ForwardingStorage::RemoveLeftovers(prefix, f);
  }

 private:
  class Writable : public WritableObject {
   public:
    Writable(std::unique_ptr<WritableObject> inner, DyingStorage* s)
        : inner_(std::move(inner)), s_(s) {}
    Status WriteAt(uint64_t o, std::span<const std::byte> d) override {
      return inner_->WriteAt(o, d);
    }
    Status Publish() override {
      if (!s_->Spend()) return IOError("killed");
      return inner_->Publish();
    }
    Status PublishIfAbsent() override {
      if (!s_->Spend()) return IOError("killed");
      return inner_->PublishIfAbsent();
    }
    void Abort() override { inner_->Abort(); }

   private:
    std::unique_ptr<WritableObject> inner_;
    DyingStorage* s_;
  };
  std::atomic<int> budget_;
};

// Kills a packed save, a retention prune and a GC after every number of durable operations;
// after each, with the crashed GC's lock and the crashed save's intent gone stale (removed, as
// a later GC does once they are old), a GC and every committed step must load.
TEST(PackTest, AKillAtAnyMomentOfASavePruneOrGcLeavesEveryCommittedStepLoadable) {
  for (int budget = 0; budget < 40; ++budget) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
    {
      CheckpointStore store(mem);
      ASSERT_OK(Save(store, 1, 1));
      ASSERT_OK(Save(store, 2, 2));
    }
    auto dying = std::make_shared<DyingStorage>(mem, budget);
    CheckpointStore doomed(dying);
    // A save of step 3 sharing step 2's big tensor, the prune of step 1, a GC.
    Status s = Save(doomed, 3, 2).status();
    if (s.ok()) s = doomed.DeleteStep(1);
    if (s.ok()) s = CollectChunkGarbage(doomed.storage()).status();
    // What a later GC does with what the dead process left once it is stale.
    for (auto& n : Names(*mem, std::string(kIntentPrefix))) ASSERT_OK(mem->Delete(n));
    ASSERT_OK(mem->Delete(kGcLockName));
    CheckpointStore store(mem);
    ASSERT_OK(store.CleanUp());
    ASSERT_OK_AND_ASSIGN(auto gc, CollectChunkGarbage(store.storage()));
    EXPECT_FALSE(gc.deferred) << gc.reason;
    ASSERT_OK_AND_ASSIGN(auto committed, store.ListCommitted());
    for (auto& c : committed) ExpectShard(store, c.step, c.step == 1 ? 1 : 2);
    std::set<uint64_t> steps;
    for (auto& c : committed) steps.insert(c.step);
    EXPECT_TRUE(steps.contains(2));
    // Nothing but what manifests reference is left (an uncommitted newer step's manifest
    // stays until a newer step commits and CleanUp removes it).
    std::set<std::string> wanted;
    for (auto& n : Names(*mem, "step-")) {
      if (!n.ends_with(".pack")) continue;
      ASSERT_OK_AND_ASSIGN(auto m, ReadPackedManifest(*mem, n));
      for (auto& ch : m.chunks) wanted.insert(ChunkObjectName(ch.sha256));
    }
    std::set<std::string> there;
    for (auto& n : ChunkNames(*mem)) there.insert(n);
    EXPECT_EQ(there, wanted);
    if (s.ok()) {
      EXPECT_EQ(steps, (std::set<uint64_t>{2, 3}));
      break;  // the budget covered everything
    }
  }
}

}  // namespace
}  // namespace safepoint::pack_test
