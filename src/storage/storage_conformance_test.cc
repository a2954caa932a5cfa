// The Storage conformance suite: one parameterised suite that every backend must pass.
//
// Each instantiation names a backend factory. A factory gets a "location" that is unique to the
// test (a fresh directory under /tmp) and must return a storage over it; calling it twice with
// the same location must give two views of the same objects (like opening a directory twice).
// A new backend proves itself by adding one line to the INSTANTIATE_TEST_SUITE_P list below.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "safepoint/storage.h"
#include "storage/faulty/faulty_storage.h"
#include "testing/test_util.h"

namespace safepoint::storage_conformance_test {
namespace {

using test::AlignedTestBuffer;
using test::FillPattern;
using test::FirstMismatch;
using test::PatternBytes;
using test::TempDir;

// ---- the suite --------------------------------------------------------------------------------

struct Backend {
  std::string name;
  std::function<Result<std::unique_ptr<Storage>>(const std::string& location)> open;
  bool durable;
  // Object stores: the environment variable with the base URI (set by scripts/with-ceph.sh);
  // the tests skip when it is unset.
  const char* base_uri_env = nullptr;
};

// The storage under `$env` for a test location: a prefix unique to the test (the location is
// a fresh temporary directory), "rados://pool/base" -> "rados://pool/base/tmp_sp-XXXXXX_root".
Result<std::unique_ptr<Storage>> OpenUnderBase(const char* env, const std::string& location) {
  const char* base = std::getenv(env);
  if (base == nullptr) return InvalidArgument(std::string("$") + env + " is not set");
  std::string leaf = location;
  std::replace(leaf.begin(), leaf.end(), '/', '_');
  std::string uri = base;
  while (uri.ends_with('/')) uri.pop_back();
  return OpenStorage(uri + "/" + leaf.substr(leaf.find_first_not_of('_')));
}

void PrintTo(const Backend& backend, std::ostream* os) { *os << backend.name; }

class StorageConformanceTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (GetParam().base_uri_env != nullptr && std::getenv(GetParam().base_uri_env) == nullptr) {
      GTEST_SKIP() << "$" << GetParam().base_uri_env
                   << " is not set (scripts/with-ceph.sh sets it with a test Ceph cluster)";
    }
    ASSERT_TRUE(dir_.ok()) << "mkdtemp failed";
    location_ = dir_.path() + "/root";
    auto opened = GetParam().open(location_);
    ASSERT_OK(opened);
    storage_ = std::move(opened).value();
  }

  Result<std::unique_ptr<Storage>> Reopen() { return GetParam().open(location_); }

  // Writes `data` as object `name` in one WriteAt and publishes it.
  void Put(std::string_view name, std::span<const std::byte> data) {
    ASSERT_OK(test::PutObject(*storage_, name, data));
  }

  std::vector<std::byte> GetAll(std::string_view name) {
    return test::ReadWholeObject(*storage_, name);
  }

  // Nothing is listed, `name` is not found, and no temporary data is left to remove.
  void ExpectNothingBehind(std::string_view name) {
    EXPECT_TRUE(Names("").empty());
    EXPECT_EQ(storage_->Open(name).status().code(), StatusCode::kNotFound);
    auto leftovers = storage_->RemoveLeftovers("");
    ASSERT_OK(leftovers);
    EXPECT_EQ(*leftovers, 0u) << "temporary data of " << name << " was left behind";
  }

  std::vector<std::string> Names(std::string_view prefix) {
    auto list = storage_->List(prefix);
    EXPECT_OK(list);
    std::vector<std::string> names;
    if (list.ok()) {
      for (const ObjectInfo& info : *list) names.push_back(info.name);
    }
    return names;
  }

  TempDir dir_;
  std::string location_;
  std::unique_ptr<Storage> storage_;
};

TEST_P(StorageConformanceTest, RoundTripUnalignedBuffersAndOffsets) {
  // Three writes out of order, from buffers at odd addresses, at odd offsets and lengths.
  const size_t total = 3 * 10007 + 13;
  std::vector<std::byte> src(total + 1);
  std::span<std::byte> all(src.data() + 1, total);  // +1: an odd address
  FillPattern(all, 1, 0);
  auto w = storage_->Create("dir/unaligned.bin", 0);
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(10007, all.subspan(10007, 10007)));
  ASSERT_OK((*w)->WriteAt(2 * 10007, all.subspan(2 * 10007)));
  ASSERT_OK((*w)->WriteAt(0, all.subspan(0, 10007)));
  ASSERT_OK((*w)->Publish());

  auto r = storage_->Open("dir/unaligned.bin");
  ASSERT_OK(r);
  ASSERT_EQ((*r)->size(), total);
  std::vector<std::byte> whole(total);
  ASSERT_OK((*r)->ReadAt(0, whole));
  EXPECT_EQ(FirstMismatch(whole, 1, 0), -1);
  // Odd ranges into an odd address.
  for (uint64_t offset : {uint64_t{1}, uint64_t{4095}, uint64_t{10006}, uint64_t{total - 7}}) {
    AlignedTestBuffer buf(7, 3);
    ASSERT_OK((*r)->ReadAt(offset, buf.span()));
    EXPECT_EQ(FirstMismatch(buf.span(), 1, offset), -1) << "offset " << offset;
  }
  // A zero-byte read at the end is fine.
  ASSERT_OK((*r)->ReadAt(total, {}));
}

TEST_P(StorageConformanceTest, RoundTripAlignedBuffersAndOffsets) {
  constexpr size_t kBlock = kDirectIOAlignment;
  const size_t total = 64 * kBlock + 123;  // an unaligned tail after aligned blocks
  AlignedTestBuffer src(total);
  FillPattern(src.span(), 2, 0);
  auto w = storage_->Create("aligned.bin", total);
  ASSERT_OK(w);
  // Aligned address, offset and length.
  ASSERT_OK((*w)->WriteAt(0, src.span().first(32 * kBlock)));
  // Aligned address and offset, unaligned length (aligned prefix + tail).
  ASSERT_OK((*w)->WriteAt(32 * kBlock, src.span().subspan(32 * kBlock)));
  ASSERT_OK((*w)->Publish());

  auto r = storage_->Open("aligned.bin");
  ASSERT_OK(r);
  ASSERT_EQ((*r)->size(), total);
  {
    AlignedTestBuffer dst(16 * kBlock);
    ASSERT_OK((*r)->ReadAt(8 * kBlock, dst.span()));
    EXPECT_EQ(FirstMismatch(dst.span(), 2, 8 * kBlock), -1);
  }
  {
    AlignedTestBuffer dst(total - 60 * kBlock);  // aligned start, unaligned end at EOF
    ASSERT_OK((*r)->ReadAt(60 * kBlock, dst.span()));
    EXPECT_EQ(FirstMismatch(dst.span(), 2, 60 * kBlock), -1);
  }
  {
    AlignedTestBuffer dst(2 * kBlock, 512);  // misaligned buffer, aligned offset
    ASSERT_OK((*r)->ReadAt(kBlock, dst.span()));
    EXPECT_EQ(FirstMismatch(dst.span(), 2, kBlock), -1);
  }
  {
    AlignedTestBuffer dst(2 * kBlock);  // aligned buffer, unaligned offset
    ASSERT_OK((*r)->ReadAt(kBlock + 1, dst.span()));
    EXPECT_EQ(FirstMismatch(dst.span(), 2, kBlock + 1), -1);
  }
}

TEST_P(StorageConformanceTest, ParallelWriteAtFromManyThreads) {
  // 8 threads write interleaved chunks; chunk sizes alternate between aligned and odd so both
  // I/O paths run concurrently on one object.
  constexpr size_t kThreads = 8;
  constexpr size_t kChunks = 64;
  std::vector<uint64_t> offsets(kChunks + 1, 0);
  for (size_t i = 0; i < kChunks; ++i) {
    offsets[i + 1] = offsets[i] + (i % 2 == 0 ? 16 * kDirectIOAlignment : 12345);
  }
  const size_t total = offsets[kChunks];
  AlignedTestBuffer src(total);
  FillPattern(src.span(), 3, 0);
  auto w = storage_->Create("parallel/obj", total);
  ASSERT_OK(w);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < kChunks; i += kThreads) {
        Status s =
            (*w)->WriteAt(offsets[i], src.span().subspan(offsets[i], offsets[i + 1] - offsets[i]));
        if (!s.ok()) {
          ADD_FAILURE() << s.ToString();
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  ASSERT_OK((*w)->Publish());
  std::vector<std::byte> back = GetAll("parallel/obj");
  ASSERT_EQ(back.size(), total);
  EXPECT_EQ(FirstMismatch(back, 3, 0), -1);
}

TEST_P(StorageConformanceTest, LargeObjectReadBackInParallelRanges) {
  constexpr size_t kSize = 64ull << 20;
  constexpr size_t kChunk = 4ull << 20;
  constexpr size_t kThreads = 4;
  AlignedTestBuffer src(kSize);
  FillPattern(src.span(), 4, 0);
  {
    auto w = storage_->Create("large.bin", kSize);
    ASSERT_OK(w);
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (size_t t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (size_t off = t * kChunk; off < kSize; off += kThreads * kChunk) {
          if (!(*w)->WriteAt(off, src.span().subspan(off, kChunk)).ok()) ++failures;
        }
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_EQ(failures.load(), 0);
    ASSERT_OK((*w)->Publish());
  }
  auto r = storage_->Open("large.bin");
  ASSERT_OK(r);
  ASSERT_EQ((*r)->size(), kSize);
  AlignedTestBuffer dst(kSize);
  // Ranges of 1 MiB + 1 byte: most start unaligned, so both read paths are used.
  constexpr size_t kRange = (1ull << 20) + 1;
  const size_t ranges = (kSize + kRange - 1) / kRange;
  std::atomic<size_t> next{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < ranges;) {
        const size_t off = i * kRange;
        const size_t n = std::min(kRange, kSize - off);
        if (!(*r)->ReadAt(off, dst.span().subspan(off, n)).ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  EXPECT_EQ(FirstMismatch(dst.span(), 4, 0), -1);
  // Aligned 4 MiB reads in parallel as well (the O_DIRECT path where available).
  AlignedTestBuffer aligned(kSize);
  next = 0;
  threads.clear();
  for (size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < kSize / kChunk;) {
        if (!(*r)->ReadAt(i * kChunk, aligned.span().subspan(i * kChunk, kChunk)).ok()) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  EXPECT_EQ(FirstMismatch(aligned.span(), 4, 0), -1);
}

TEST_P(StorageConformanceTest, ObjectIsInvisibleUntilPublished) {
  auto w = storage_->Create("step-1/rank-0", 0);
  ASSERT_OK(w);
  std::vector<std::byte> data = PatternBytes(1000, 5);
  ASSERT_OK((*w)->WriteAt(0, data));
  EXPECT_TRUE(Names("").empty());
  EXPECT_TRUE(Names("step-1/").empty());
  auto missing = storage_->Open("step-1/rank-0");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();
  // Another view of the same location does not see it either.
  auto other = Reopen();
  ASSERT_OK(other);
  EXPECT_FALSE((*other)->Open("step-1/rank-0").ok());

  ASSERT_OK((*w)->Publish());
  EXPECT_EQ(Names(""), std::vector<std::string>{"step-1/rank-0"});
  EXPECT_EQ(GetAll("step-1/rank-0"), data);
  auto seen = (*other)->Open("step-1/rank-0");
  ASSERT_OK(seen);
  EXPECT_EQ((*seen)->size(), data.size());
}

TEST_P(StorageConformanceTest, AbortRemovesTemporaryData) {
  auto w = storage_->Create("a/aborted", 1 << 20);
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, PatternBytes(5000, 6)));
  (*w)->Abort();
  (*w)->Abort();  // idempotent
  EXPECT_FALSE((*w)->Publish().ok());
  EXPECT_FALSE((*w)->WriteAt(0, PatternBytes(10, 6)).ok());
  ExpectNothingBehind("a/aborted");
}

TEST_P(StorageConformanceTest, DestructorOfUnpublishedWriterRemovesTemporaryData) {
  {
    auto w = storage_->Create("b/dropped", 0);
    ASSERT_OK(w);
    ASSERT_OK((*w)->WriteAt(0, PatternBytes(5000, 7)));
  }
  ExpectNothingBehind("b/dropped");
}

TEST_P(StorageConformanceTest, WriterRejectsUseAfterPublish) {
  auto w = storage_->Create("once", 0);
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, PatternBytes(10, 8)));
  ASSERT_OK((*w)->Publish());
  EXPECT_FALSE((*w)->WriteAt(0, PatternBytes(10, 9)).ok());
  EXPECT_FALSE((*w)->Publish().ok());
  (*w)->Abort();  // after Publish: does nothing
  EXPECT_EQ(GetAll("once"), PatternBytes(10, 8));
}

TEST_P(StorageConformanceTest, RepublishReplacesAtomically) {
  Put("ckpt/state", PatternBytes(3000, 10));
  // A second writer of the same name, in progress: the old object stays readable.
  auto w = storage_->Create("ckpt/state", 0);
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, PatternBytes(777, 11)));
  EXPECT_EQ(GetAll("ckpt/state"), PatternBytes(3000, 10));
  ASSERT_OK((*w)->Publish());
  EXPECT_EQ(GetAll("ckpt/state"), PatternBytes(777, 11));
  auto list = storage_->List("");
  ASSERT_OK(list);
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name, "ckpt/state");
  EXPECT_EQ((*list)[0].size, 777u);
}

TEST_P(StorageConformanceTest, PublishIfAbsentPublishesANewName) {
  auto w = storage_->Create("step-1/COMMIT", 0);
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, PatternBytes(100, 20)));
  EXPECT_TRUE(Names("").empty());
  ASSERT_OK((*w)->PublishIfAbsent());
  EXPECT_EQ(Names(""), std::vector<std::string>{"step-1/COMMIT"});
  EXPECT_EQ(GetAll("step-1/COMMIT"), PatternBytes(100, 20));
  EXPECT_FALSE((*w)->Publish().ok());  // published: the writer is done
  auto leftovers = storage_->RemoveLeftovers("");
  ASSERT_OK(leftovers);
  EXPECT_EQ(*leftovers, 0u);
}

TEST_P(StorageConformanceTest, PublishIfAbsentKeepsAnExistingObject) {
  Put("step-1/COMMIT", PatternBytes(300, 21));
  auto w = storage_->Create("step-1/COMMIT", 0);
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, PatternBytes(50, 22)));
  const Status s = (*w)->PublishIfAbsent();
  ASSERT_EQ(s.code(), StatusCode::kAlreadyExists) << s.ToString();
  EXPECT_NE(s.message().find(storage_->Describe("step-1/COMMIT")), std::string::npos)
      << s.ToString();
  // The old bytes are intact, nothing else is listed, and the temporary data is gone.
  EXPECT_EQ(GetAll("step-1/COMMIT"), PatternBytes(300, 21));
  EXPECT_EQ(Names(""), std::vector<std::string>{"step-1/COMMIT"});
  auto leftovers = storage_->RemoveLeftovers("");
  ASSERT_OK(leftovers);
  EXPECT_EQ(*leftovers, 0u) << "PublishIfAbsent left its temporary data behind";
  EXPECT_FALSE((*w)->WriteAt(0, PatternBytes(10, 23)).ok());
  EXPECT_FALSE((*w)->Publish().ok());
  EXPECT_EQ(GetAll("step-1/COMMIT"), PatternBytes(300, 21));
}

TEST_P(StorageConformanceTest, PublishIfAbsentRaceHasExactlyOneWinner) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 20;
  for (int round = 0; round < kRounds; ++round) {
    const std::string name = "race/" + std::to_string(round);
    // Every writer is ready before any publishes, so the publishes overlap.
    std::vector<std::unique_ptr<WritableObject>> writers;
    for (int t = 0; t < kThreads; ++t) {
      auto w = storage_->Create(name, 0);
      ASSERT_OK(w);
      ASSERT_OK((*w)->WriteAt(0, PatternBytes(64 + t, static_cast<uint64_t>(t))));
      writers.push_back(std::move(w).value());
    }
    std::atomic<int> ready{0};
    std::vector<Status> results(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < kThreads) {
        }
        results[t] = writers[t]->PublishIfAbsent();
      });
    }
    for (auto& th : threads) th.join();
    int winner = -1;
    for (int t = 0; t < kThreads; ++t) {
      if (results[t].ok()) {
        EXPECT_EQ(winner, -1) << "round " << round << ": threads " << winner << " and " << t
                              << " both published";
        winner = t;
      } else {
        EXPECT_EQ(results[t].code(), StatusCode::kAlreadyExists) << results[t].ToString();
      }
    }
    ASSERT_NE(winner, -1) << "round " << round << ": nobody published";
    EXPECT_EQ(GetAll(name), PatternBytes(64 + winner, static_cast<uint64_t>(winner)));
  }
  auto leftovers = storage_->RemoveLeftovers("");
  ASSERT_OK(leftovers);
  EXPECT_EQ(*leftovers, 0u);
}

TEST_P(StorageConformanceTest, EmptyAndSparseObjects) {
  {
    auto w = storage_->Create("empty", 4096);  // a size hint that is never used
    ASSERT_OK(w);
    ASSERT_OK((*w)->Publish());
  }
  auto r = storage_->Open("empty");
  ASSERT_OK(r);
  EXPECT_EQ((*r)->size(), 0u);
  ASSERT_OK((*r)->ReadAt(0, {}));

  // Written only at the end: the size is the end of the last write and the gap reads as zeros.
  std::vector<std::byte> tail = PatternBytes(100, 12);
  {
    auto w = storage_->Create("sparse", 1 << 20);  // a hint larger than what is written
    ASSERT_OK(w);
    ASSERT_OK((*w)->WriteAt(50000, tail));
    ASSERT_OK((*w)->Publish());
  }
  std::vector<std::byte> back = GetAll("sparse");
  ASSERT_EQ(back.size(), 50100u);
  EXPECT_TRUE(std::all_of(back.begin(), back.begin() + 50000,
                          [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), back.begin() + 50000));

  // A hint smaller than what is written is only a hint.
  {
    auto w = storage_->Create("grown", 10);
    ASSERT_OK(w);
    ASSERT_OK((*w)->WriteAt(0, PatternBytes(20000, 13)));
    ASSERT_OK((*w)->Publish());
  }
  EXPECT_EQ(GetAll("grown"), PatternBytes(20000, 13));
}

TEST_P(StorageConformanceTest, ListFiltersByPrefixAndSorts) {
  const std::vector<std::string> names = {"b",   "a/2",   "a/10",    "a/1", "ab",
                                          "a.x", "c/d/e", "c/d/f/g", "c/dd"};
  for (size_t i = 0; i < names.size(); ++i) Put(names[i], PatternBytes(i + 1, 14));
  std::vector<std::string> expected = names;
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(Names(""), expected);
  EXPECT_EQ(Names("a/"), (std::vector<std::string>{"a/1", "a/10", "a/2"}));
  EXPECT_EQ(Names("a/1"), (std::vector<std::string>{"a/1", "a/10"}));
  EXPECT_EQ(Names("a"), (std::vector<std::string>{"a.x", "a/1", "a/10", "a/2", "ab"}));
  EXPECT_EQ(Names("c/d"), (std::vector<std::string>{"c/d/e", "c/d/f/g", "c/dd"}));
  EXPECT_EQ(Names("c/d/"), (std::vector<std::string>{"c/d/e", "c/d/f/g"}));
  EXPECT_EQ(Names("c/d/e"), std::vector<std::string>{"c/d/e"});
  EXPECT_TRUE(Names("zzz").empty());
  EXPECT_TRUE(Names("zzz/").empty());
  EXPECT_TRUE(Names("b/").empty());  // "b" is an object, not a directory

  auto list = storage_->List("a/");
  ASSERT_OK(list);
  for (const ObjectInfo& info : *list) {
    const size_t index = std::find(names.begin(), names.end(), info.name) - names.begin();
    EXPECT_EQ(info.size, index + 1) << info.name;
  }

  const std::vector<std::string> bad_prefixes = {
      "../", "/", "a//", "./x", "a/../b/", std::string("a\0b", 3), "x\\y"};
  for (const std::string& bad : bad_prefixes) {
    auto r = storage_->List(bad);
    ASSERT_FALSE(r.ok()) << "List(\"" << bad << "\") succeeded";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  }
}

TEST_P(StorageConformanceTest, DeleteIsIdempotent) {
  EXPECT_OK(storage_->Delete("never/existed"));
  Put("d1/d2/obj", PatternBytes(10, 15));
  Put("d1/keep", PatternBytes(10, 16));
  EXPECT_OK(storage_->Delete("d1/d2/obj"));
  EXPECT_EQ(storage_->Open("d1/d2/obj").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Names(""), std::vector<std::string>{"d1/keep"});
  EXPECT_OK(storage_->Delete("d1/d2/obj"));
  EXPECT_OK(storage_->Delete("d1/keep"));
  EXPECT_TRUE(Names("").empty());
  // The same names can be written again after their directories were cleaned up.
  Put("d1/d2/obj", PatternBytes(10, 17));
  EXPECT_EQ(GetAll("d1/d2/obj"), PatternBytes(10, 17));
}

TEST_P(StorageConformanceTest, ReadPastEndIsCorruptionNamingTheObject) {
  Put("short/object", PatternBytes(100, 18));
  auto r = storage_->Open("short/object");
  ASSERT_OK(r);
  std::vector<std::byte> buf(100);
  Status s = (*r)->ReadAt(50, buf);
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
  EXPECT_NE(s.message().find(storage_->Describe("short/object")), std::string::npos)
      << s.ToString();
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("100 bytes at offset 50"), std::string::npos) << s.ToString();
  // Offsets beyond the end, even for empty reads.
  EXPECT_EQ((*r)->ReadAt(101, {}).code(), StatusCode::kCorruption);
  EXPECT_EQ((*r)->ReadAt(UINT64_MAX, std::span<std::byte>(buf).first(1)).code(),
            StatusCode::kCorruption);
  EXPECT_OK((*r)->ReadAt(50, std::span<std::byte>(buf).first(50)));
}

TEST_P(StorageConformanceTest, OpenOfMissingObjectIsNotFound) {
  for (std::string_view name : {"missing", "no/such/dir/missing"}) {
    auto r = storage_->Open(name);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().ToString();
    EXPECT_NE(r.status().message().find(name), std::string::npos) << r.status().ToString();
  }
  Put("dir/obj", PatternBytes(1, 19));
  EXPECT_EQ(storage_->Open("dir").status().code(), StatusCode::kNotFound);
}

TEST_P(StorageConformanceTest, InvalidNamesAreRejected) {
  const std::vector<std::string> bad = {
      "../x", "/abs", "a//b", "a/./b", "a/../b", "",     "x.tmp.y", std::string("a\0b", 3),
      "a\\b", "..",   ".",    "a/",    "a/.",    "a/..", "./a",     std::string(4097, 'n')};
  for (const std::string& name : bad) {
    SCOPED_TRACE("name \"" + name.substr(0, 40) + "\"");
    Status v = ValidateObjectName(name);
    EXPECT_EQ(v.code(), StatusCode::kInvalidArgument) << v.ToString();
    auto w = storage_->Create(name, 0);
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument) << w.status().ToString();
    auto r = storage_->Open(name);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_EQ(storage_->Delete(name).code(), StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(Names("").empty());
  for (std::string_view good : {"a", "a/b.c", "step-00000000000000000010/rank-00000.img", "..a",
                                "a..", ".hidden", "a/.b", "x.tmp", "tmp.x", "a b/c-d_e"}) {
    EXPECT_OK(ValidateObjectName(good));
  }
  EXPECT_OK(ValidateObjectName(std::string(4096, 'n')));
}

TEST_P(StorageConformanceTest, TwoViewsOfOneLocationShareObjects) {
  auto other = Reopen();
  ASSERT_OK(other);
  Put("shared/obj", PatternBytes(64, 20));
  auto r = (*other)->Open("shared/obj");
  ASSERT_OK(r);
  EXPECT_EQ((*r)->size(), 64u);
  EXPECT_OK((*other)->Delete("shared/obj"));
  EXPECT_EQ(storage_->Open("shared/obj").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(storage_->uri(), (*other)->uri());
}

TEST_P(StorageConformanceTest, DescribeAndCapabilities) {
  EXPECT_FALSE(storage_->uri().empty());
  const std::string described = storage_->Describe("x/y");
  EXPECT_TRUE(std::string_view(described).ends_with("x/y")) << described;
  EXPECT_GT(described.size(), 3u);
  EXPECT_EQ(storage_->capabilities().durable, GetParam().durable);
}

Result<std::unique_ptr<Storage>> OpenPosix(const std::string& location, bool direct) {
  PosixStorageOptions options;
  options.use_direct_io = direct;
  return NewPosixStorage(location, options);
}

INSTANTIATE_TEST_SUITE_P(
    Backends, StorageConformanceTest,
    ::testing::Values(
        Backend{"PosixDirect",
                [](const std::string& location) { return OpenPosix(location, true); }, true},
        Backend{"PosixBuffered",
                [](const std::string& location) { return OpenPosix(location, false); }, true},
        // The location is unique to the test, so it makes a good private instance name.
        Backend{"Memory",
                [](const std::string& location) -> Result<std::unique_ptr<Storage>> {
                  return NewMemoryStorage(location);
                },
                false},
        Backend{"FaultyOverMemoryNoFaults",
                [](const std::string& location) -> Result<std::unique_ptr<Storage>> {
                  return std::unique_ptr<Storage>(std::make_unique<FaultyStorage>(
                      std::shared_ptr<Storage>(NewMemoryStorage(location))));
                },
                false},
        Backend{"Rados",
                [](const std::string& location) {
                  return OpenUnderBase("SAFEPOINT_TEST_RADOS_URI", location);
                },
                true, "SAFEPOINT_TEST_RADOS_URI"},
        Backend{"S3",
                [](const std::string& location) {
                  return OpenUnderBase("SAFEPOINT_TEST_S3_URI", location);
                },
                true, "SAFEPOINT_TEST_S3_URI"}),
    [](const ::testing::TestParamInfo<Backend>& info) { return info.param.name; });

// ---- the URI registry -------------------------------------------------------------------------

TEST(StorageRegistryTest, FileUrisAndPlainPathsOpenPosixStorage) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  auto by_uri = OpenStorage("file://" + dir.path() + "/a");
  ASSERT_OK(by_uri);
  EXPECT_EQ((*by_uri)->uri(), "file://" + dir.path() + "/a");
  EXPECT_EQ((*by_uri)->Describe("x/y"), dir.path() + "/a/x/y");
  EXPECT_TRUE((*by_uri)->capabilities().durable);
  EXPECT_TRUE(std::filesystem::is_directory(dir.path() + "/a"));

  auto localhost = OpenStorage("file://localhost" + dir.path() + "/a");
  ASSERT_OK(localhost);
  EXPECT_EQ((*localhost)->uri(), (*by_uri)->uri());

  auto plain = OpenStorage(dir.path() + "/a/");  // trailing slash is normalised away
  ASSERT_OK(plain);
  EXPECT_EQ((*plain)->uri(), (*by_uri)->uri());

  // A relative path is resolved against the current directory.
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  auto relative = OpenStorage("rel/./dir");
  std::filesystem::current_path(cwd);
  ASSERT_OK(relative);
  EXPECT_EQ((*relative)->uri(), "file://" + dir.path() + "/rel/dir");
  EXPECT_TRUE(std::filesystem::is_directory(dir.path() + "/rel/dir"));

  auto not_absolute = OpenStorage("file://relative/path");
  ASSERT_FALSE(not_absolute.ok());
  EXPECT_EQ(not_absolute.status().code(), StatusCode::kInvalidArgument);
}

TEST(StorageRegistryTest, MemUrisShareByName) {
  auto a = OpenStorage("mem://registry-test");
  ASSERT_OK(a);
  EXPECT_EQ((*a)->uri(), "mem://registry-test");
  EXPECT_FALSE((*a)->capabilities().durable);
  auto w = (*a)->Create("obj", 0);
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, PatternBytes(5, 21)));
  ASSERT_OK((*w)->Publish());
  EXPECT_OK(NewMemoryStorage("registry-test")->Open("obj"));
  EXPECT_FALSE(NewMemoryStorage("registry-test-other")->Open("obj").ok());
  // Unnamed instances are private.
  auto p1 = NewMemoryStorage();
  auto p2 = NewMemoryStorage();
  auto pw = p1->Create("obj", 0);
  ASSERT_OK(pw);
  ASSERT_OK((*pw)->Publish());
  EXPECT_OK(p1->Open("obj"));
  EXPECT_FALSE(p2->Open("obj").ok());
}

TEST(StorageRegistryTest, UnknownSchemeIsInvalidArgumentNamingTheScheme) {
  auto r = OpenStorage("s3x://bucket/prefix");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("\"s3x\""), std::string::npos) << r.status().ToString();
  EXPECT_EQ(OpenStorage("").status().code(), StatusCode::kInvalidArgument);
}

TEST(StorageRegistryTest, RegisteredSchemesAreUsed) {
  std::string seen_uri, seen_rest;
  RegisterStorageScheme(
      "Test-Scheme",
      [&](std::string_view uri, std::string_view rest) -> Result<std::unique_ptr<Storage>> {
        seen_uri = std::string(uri);
        seen_rest = std::string(rest);
        return NewMemoryStorage();
      });
  auto r = OpenStorage("test-scheme://host/some/where");
  ASSERT_OK(r);
  EXPECT_EQ(seen_uri, "test-scheme://host/some/where");
  EXPECT_EQ(seen_rest, "host/some/where");
  // The built-in schemes are still there after a registration.
  EXPECT_OK(OpenStorage("mem://after-register"));
}

}  // namespace
}  // namespace safepoint::storage_conformance_test
