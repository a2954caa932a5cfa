// RadosStorage beyond the conformance suite: options, chunking, PublishIfAbsent, and faults of a
// real Ceph cluster (a full pool, an OSD killed mid-upload, a stalled OSD). The cluster is the
// one scripts/with-ceph.sh starts for `make test`; every test that needs it skips when
// $SAFEPOINT_TEST_RADOS_URI is unset, and the fault tests also need $SAFEPOINT_TEST_CEPH_DIR
// (the daemons' pid files, the ceph CLI's configuration).
#include "storage/rados/rados_storage.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "safepoint/checkpoint.h"
#include "safepoint/storage.h"
#include "storage/cancellable.h"
#include "testing/test_util.h"

namespace safepoint::rados_storage_test {
namespace {

using test::AlignedTestBuffer;
using test::FillPattern;
using test::FirstMismatch;
using test::PatternBytes;

// A base URI unique to this test: $SAFEPOINT_TEST_RADOS_URI/<suite>.<test>.<pid>, plus `query`.
std::string TestUri(std::string_view query = "") {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string uri = std::getenv("SAFEPOINT_TEST_RADOS_URI");
  uri += "/";
  uri += info->test_suite_name();
  uri += ".";
  uri += info->name();
  uri += "." + std::to_string(::getpid());
  if (!query.empty()) uri += "?" + std::string(query);
  return uri;
}

#define SKIP_WITHOUT_CEPH()                                                                  \
  do {                                                                                       \
    if (std::getenv("SAFEPOINT_TEST_RADOS_URI") == nullptr) {                                \
      GTEST_SKIP() << "$SAFEPOINT_TEST_RADOS_URI is not set (scripts/with-ceph.sh sets it)"; \
    }                                                                                        \
  } while (0)

#define SKIP_WITHOUT_CEPH_DIR()                                                             \
  do {                                                                                      \
    SKIP_WITHOUT_CEPH();                                                                    \
    if (std::getenv("SAFEPOINT_TEST_CEPH_DIR") == nullptr) {                                \
      GTEST_SKIP() << "$SAFEPOINT_TEST_CEPH_DIR is not set (scripts/with-ceph.sh sets it)"; \
    }                                                                                       \
  } while (0)

std::string CephDir() { return std::getenv("SAFEPOINT_TEST_CEPH_DIR"); }

// Runs a shell command; returns its exit status and stdout.
int Shell(const std::string& cmd, std::string* out = nullptr) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) {
    if (out) out->append(buf, n);
  }
  const int rc = ::pclose(p);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::string Ceph(const std::string& args) {
  return "timeout 60 ceph -c " + CephDir() + "/ceph.conf " + args;
}

pid_t DaemonPid(const std::string& name) {
  std::ifstream f(CephDir() + "/run/" + name + ".pid");
  pid_t pid = 0;
  f >> pid;
  return pid;
}

// The rados CLI on the pool of $SAFEPOINT_TEST_RADOS_URI (the cluster's CEPH_CONF and CEPH_ARGS
// are in the environment): "rm OID", "put OID FILE", "ls"; `ns` selects the namespace.
int RadosCli(const std::string& args, std::string* out = nullptr, const std::string& ns = "") {
  std::string pool = std::string(std::getenv("SAFEPOINT_TEST_RADOS_URI")).substr(8);
  pool = pool.substr(0, pool.find('/'));
  return Shell("timeout 60 rados -p '" + pool + "'" + (ns.empty() ? "" : " -N '" + ns + "'") + " " +
                   args + " 2>&1",
               out);
}

// The head object's name of `name` in the storage at `uri` (rados://POOL/PREFIX[?options]).
std::string HeadOid(const std::string& uri, std::string_view name) {
  const std::string rest = uri.substr(8, uri.find('?') - 8);
  return rest.substr(rest.find('/') + 1) + "/" + std::string(name);
}

// Writes `data` in pieces of `piece` bytes from `threads` threads and publishes it.
Status WriteParallel(Storage& s, std::string_view name, std::span<const std::byte> data,
                     size_t piece, size_t threads) {
  auto w = s.Create(name, data.size());
  if (!w.ok()) return w.status();
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status first;
  std::vector<std::thread> ts;
  for (size_t t = 0; t < threads; ++t) {
    ts.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) * piece < data.size();) {
        const size_t off = i * piece;
        Status st = (*w)->WriteAt(off, data.subspan(off, std::min(piece, data.size() - off)));
        if (!st.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          if (first.ok()) first = st;
          return;
        }
      }
    });
  }
  for (auto& t : ts) t.join();
  if (!first.ok()) {
    (*w)->Abort();
    return first;
  }
  return (*w)->Publish();
}

// ---- no cluster needed ------------------------------------------------------------------------

TEST(RadosOptionsTest, ParsesKnownKeysAndRejectsOthers) {
  auto o = internal::ParseRadosOptions("rados://p/x", "timeout=7&retries=2&chunk_size=64K");
  ASSERT_OK(o);
  EXPECT_EQ(o->timeout_s, 7);
  EXPECT_EQ(o->retries, 2);
  EXPECT_EQ(o->chunk_size, 64u << 10);
  EXPECT_EQ(internal::ParseRadosOptions("u", "chunk_size=2M")->chunk_size, 2u << 20);
  for (std::string_view bad :
       {"timeout=0", "timeout=x", "chunk_size=1", "chunk_size=2T", "bogus=1", "retries=-1"}) {
    auto r = internal::ParseRadosOptions("rados://p/x", bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("rados://p/x"), std::string::npos) << r.status().ToString();
  }
  EXPECT_EQ(OpenStorage("rados://p/x?nope=1").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenStorage("rados:///x").status().code(), StatusCode::kInvalidArgument);
}

TEST(RadosOptionsTest, MalformedUrisAreInvalidArgumentNamingTheUri) {
  for (const std::string uri :
       {"rados://", "rados://?timeout=1", "rados://p/a//b", "rados://p/../x",
        "rados://p/x?chunk_size=", "rados://p/x?chunk_size=2G", "rados://p/x?timeout=-1"}) {
    auto r = OpenStorage(uri);
    ASSERT_FALSE(r.ok()) << uri;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument)
        << uri << ": " << r.status().ToString();
    EXPECT_NE(r.status().message().find(uri), std::string::npos) << r.status().ToString();
  }
}

// The keys every object store shares read as they do for s3:// (src/storage/uri_options.h).
TEST(RadosOptionsTest, SharesTheSyntaxOfOtherBackends) {
  auto o = internal::ParseRadosOptions("rados://p/x", "timeout=2.5&retries=100&chunk_size=16MiB");
  ASSERT_OK(o);
  EXPECT_EQ(o->timeout_s, 3);  // librados takes whole seconds: rounded up
  EXPECT_EQ(o->retries, 100);
  EXPECT_EQ(o->chunk_size, 16u << 20);
  for (std::string_view bad : {"retries=101", "timeout=1e3", "chunk_size=4k2", "timeout="}) {
    auto r = internal::ParseRadosOptions("rados://p/x", bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status().ToString();
  }
}

TEST(RadosOptionsTest, DefaultTimeoutFromTheEnvironmentIsCheckedWhole) {
  const char* saved = std::getenv("SAFEPOINT_STORAGE_TIMEOUT");
  const std::string restore = saved ? saved : "";
  ::setenv("SAFEPOINT_STORAGE_TIMEOUT", "7", 1);
  EXPECT_EQ(internal::ParseRadosOptions("u", "")->timeout_s, 7);
  ::setenv("SAFEPOINT_STORAGE_TIMEOUT", "7.5", 1);
  EXPECT_EQ(internal::ParseRadosOptions("u", "")->timeout_s, 8);
  ::setenv("SAFEPOINT_STORAGE_TIMEOUT", "7x", 1);  // was read as 7 (atoi)
  EXPECT_EQ(internal::ParseRadosOptions("u", "").status().code(), StatusCode::kInvalidArgument);
  if (saved) {
    ::setenv("SAFEPOINT_STORAGE_TIMEOUT", restore.c_str(), 1);
  } else {
    ::unsetenv("SAFEPOINT_STORAGE_TIMEOUT");
  }
}

// ---- against the test cluster -----------------------------------------------------------------

TEST(RadosStorageTest, MissingPoolIsNotFoundNamingThePool) {
  SKIP_WITHOUT_CEPH();
  auto r = OpenStorage("rados://no-such-pool-safepoint/x");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().ToString();
  EXPECT_NE(r.status().message().find("\"no-such-pool-safepoint\""), std::string::npos)
      << r.status().ToString();
}

TEST(RadosStorageTest, UriDropsTheQueryAndDescribeNamesTheObject) {
  SKIP_WITHOUT_CEPH();
  const std::string base = TestUri();
  ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(base + "/?timeout=30&chunk_size=64K"));
  EXPECT_EQ(s->uri(), base);
  EXPECT_EQ(s->Describe("a/b"), base + "/a/b");
}

TEST(RadosStorageTest, SmallChunksRoundTripAcrossChunkBoundaries) {
  SKIP_WITHOUT_CEPH();
  // 4 KiB chunks: every read and write below spans or ends inside chunks.
  ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(TestUri("chunk_size=4K")));
  const size_t total = 37 * 4096 + 555;
  AlignedTestBuffer src(total);
  FillPattern(src.span(), 31, 0);
  ASSERT_OK(WriteParallel(*s, "obj", src.span(), 3001, 4));
  ASSERT_OK_AND_ASSIGN(auto r, s->Open("obj"));
  ASSERT_EQ(r->size(), total);
  for (auto [off, len] : std::vector<std::pair<size_t, size_t>>{
           {0, total}, {4095, 2}, {4096, 4096}, {1, 3 * 4096}, {total - 600, 600}, {8191, 1}}) {
    AlignedTestBuffer dst(len, 1);
    ASSERT_OK(r->ReadAt(off, dst.span()));
    EXPECT_EQ(FirstMismatch(dst.span(), 31, off), -1) << off << "+" << len;
  }
  auto list = s->List("");
  ASSERT_OK(list);
  ASSERT_EQ(list->size(), 1u);  // the 38 data objects are never listed
  EXPECT_EQ((*list)[0].size, total);
  EXPECT_GT((*list)[0].mtime_ns, 0);
}

TEST(RadosStorageTest, ReplacingAnObjectRemovesTheOldData) {
  SKIP_WITHOUT_CEPH();
  ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(TestUri("chunk_size=4K")));
  ASSERT_OK(test::PutObject(*s, "x", PatternBytes(20000, 1)));
  ASSERT_OK(test::PutObject(*s, "x", PatternBytes(9000, 2)));
  EXPECT_EQ(test::ReadWholeObject(*s, "x"), PatternBytes(9000, 2));
  // Nothing of the first version is left over: Publish removed its data objects.
  ASSERT_OK_AND_ASSIGN(size_t leftovers, s->RemoveLeftovers(""));
  EXPECT_EQ(leftovers, 0u);
  // Delete removes the head and the data.
  ASSERT_OK(s->Delete("x"));
  ASSERT_OK_AND_ASSIGN(leftovers, s->RemoveLeftovers(""));
  EXPECT_EQ(leftovers, 0u);
}

TEST(RadosStorageTest, PublishIfAbsentRefusesAnExistingObjectAndKeepsIt) {
  SKIP_WITHOUT_CEPH();
  ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(TestUri()));
  ASSERT_OK_AND_ASSIGN(auto first, s->Create("COMMIT", 0));
  ASSERT_OK(first->WriteAt(0, PatternBytes(100, 3)));
  ASSERT_OK_AND_ASSIGN(auto second, s->Create("COMMIT", 0));
  ASSERT_OK(second->WriteAt(0, PatternBytes(200, 4)));
  ASSERT_OK(first->PublishIfAbsent());
  Status st = second->PublishIfAbsent();
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists) << st.ToString();
  EXPECT_NE(st.message().find(s->Describe("COMMIT")), std::string::npos) << st.ToString();
  EXPECT_EQ(test::ReadWholeObject(*s, "COMMIT"), PatternBytes(100, 3));
  // The loser's data is gone, not left over.
  ASSERT_OK_AND_ASSIGN(size_t leftovers, s->RemoveLeftovers(""));
  EXPECT_EQ(leftovers, 0u);
}

TEST(RadosStorageTest, PublishIfAbsentFromManyThreadsHasOneWinner) {
  SKIP_WITHOUT_CEPH();
  ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(TestUri()));
  constexpr int kWriters = 8;
  std::atomic<int> won{0}, refused{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < kWriters; ++i) {
    ts.emplace_back([&, i] {
      auto w = s->Create("once", 0);
      if (!w.ok() || !(*w)->WriteAt(0, PatternBytes(64, 10 + i)).ok()) return;
      Status st = (*w)->PublishIfAbsent();
      if (st.ok()) ++won;
      if (st.code() == StatusCode::kAlreadyExists) ++refused;
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(won.load(), 1);
  EXPECT_EQ(refused.load(), kWriters - 1);
}

TEST(RadosStorageTest, LeftoversOfACrashedWriterAreRemovedButNotThoseOfALiveOne) {
  SKIP_WITHOUT_CEPH();
  const std::string uri = TestUri("chunk_size=4K");
  ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(uri));
  // A writer in another process that dies before publishing leaves its data objects. (This
  // binary again, not fork(): a forked child has no librados threads.)
  ASSERT_EQ(
      Shell("SAFEPOINT_TEST_RADOS_CRASH_URI='" + uri + "' /proc/" + std::to_string(::getpid()) +
            "/exe --gtest_filter=RadosCrashHelper.WriteThenDie >/dev/null 2>&1"),
      0);
  ASSERT_OK_AND_ASSIGN(auto live, s->Create("step-2/img", 0));
  ASSERT_OK(live->WriteAt(0, PatternBytes(10000, 6)));
  ASSERT_OK(test::PutObject(*s, "step-0/img", PatternBytes(10000, 7)));

  EXPECT_TRUE(s->List("")->size() == 1);
  // A filter that refuses step-1 keeps it.
  ASSERT_OK_AND_ASSIGN(size_t removed, s->RemoveLeftovers("", [](std::string_view name) {
    return !name.starts_with("step-1/");
  }));
  EXPECT_EQ(removed, 0u);
  ASSERT_OK_AND_ASSIGN(removed, s->RemoveLeftovers(""));
  EXPECT_EQ(removed, 1u);  // the crashed writer's; not the live one's, not the published one's
  ASSERT_OK(live->Publish());
  EXPECT_EQ(test::ReadWholeObject(*s, "step-2/img"), PatternBytes(10000, 6));
  EXPECT_EQ(test::ReadWholeObject(*s, "step-0/img"), PatternBytes(10000, 7));
}

TEST(RadosStorageTest, CheckpointStoreRoundTrip) {
  SKIP_WITHOUT_CEPH();
  // Small chunks, so that the image's ranges span many data objects.
  ASSERT_OK_AND_ASSIGN(auto opened, OpenStorage(TestUri("chunk_size=64K")));
  CheckpointStore store(std::shared_ptr<Storage>(std::move(opened)));
  std::vector<float> big(1 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = float(i) * 0.5f;
  std::vector<TensorSource> sources;
  sources.push_back({{"big", DType::kFloat32, {big.size()}, {}, {}}, big.data(), big.size() * 4});
  Dict d;
  d.items.emplace_back(Value(std::string("big")), Value(TensorRef{0, 0}));
  const std::string extras = *EncodeExtras(Value(std::move(d)));
  auto saved = SaveShard(store, test::TestImageMeta("rados", 3, 0, 1), sources, extras);
  ASSERT_OK(saved);
  EXPECT_TRUE(saved->committed);
  ASSERT_OK_AND_ASSIGN(LoadedShard shard, LoadShard(store, std::nullopt, 0));
  EXPECT_EQ(shard.commit.step, 3u);
  ASSERT_EQ(shard.reader.tensors().size(), 1u);
  auto back = shard.reader.tensor_data(0);
  ASSERT_EQ(back.size(), big.size() * 4);
  EXPECT_EQ(std::memcmp(back.data(), big.data(), back.size()), 0);
  ASSERT_OK_AND_ASSIGN(auto committed, store.ListCommitted());
  ASSERT_EQ(committed.size(), 1u);
  ASSERT_OK(store.DeleteStep(3));
  EXPECT_EQ(LoadShard(store, std::nullopt, 0).status().code(), StatusCode::kNotFound);
}

TEST(RadosStorageTest, CorruptHeadIsCorruptionAndAForeignObjectIsNotListed) {
  SKIP_WITHOUT_CEPH();
  const std::string uri = TestUri();
  ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(uri));
  ASSERT_OK(test::PutObject(*s, "good", PatternBytes(100, 8)));
  test::TempDir dir;
  ASSERT_TRUE(dir.ok());
  // The head's magic, then zeros: the CRC does not match.
  ASSERT_TRUE(
      test::WriteStringToFile(dir.Join("bad"), std::string("SPRADOSH") + std::string(56, '\0')));
  ASSERT_TRUE(test::WriteStringToFile(dir.Join("short"), "SPRADOSH"));
  ASSERT_TRUE(test::WriteStringToFile(dir.Join("foreign"), "not a head at all, someone else's"));
  for (const char* name : {"bad", "short", "foreign"}) {
    std::string out;
    ASSERT_EQ(RadosCli("put '" + HeadOid(uri, name) + "' '" + dir.Join(name) + "'", &out), 0)
        << out;
  }
  for (const char* name : {"bad", "short", "foreign"}) {
    auto r = s->Open(name);
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << name << ": " << r.status().ToString();
    EXPECT_NE(r.status().message().find(s->Describe(name)), std::string::npos)
        << r.status().ToString();
  }
  // List refuses a damaged head of ours, but passes over what is not ours.
  auto list = s->List("");
  EXPECT_EQ(list.status().code(), StatusCode::kCorruption) << list.status().ToString();
  for (const char* name : {"bad", "short"}) {
    ASSERT_EQ(RadosCli("rm '" + HeadOid(uri, name) + "'"), 0);
  }
  list = s->List("");
  ASSERT_OK(list);
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name, "good");
}

TEST(RadosStorageTest, MissingDataChunkIsCorruptionAndOnlyForTheRangesThatNeedIt) {
  SKIP_WITHOUT_CEPH();
  const std::string uri = TestUri("chunk_size=4K");
  ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(uri));
  ASSERT_OK(test::PutObject(*s, "x", PatternBytes(3 * 4096 + 10, 9)));
  // The data objects are "<head oid>@<data id>.<chunk>" in the data namespace: lose chunk 1.
  std::string objects;
  ASSERT_EQ(RadosCli("ls", &objects, "safepoint.data"), 0) << objects;
  std::string chunk1;
  for (size_t at = 0, nl; at < objects.size(); at = nl + 1) {
    nl = objects.find('\n', at);
    if (nl == std::string::npos) nl = objects.size();
    const std::string oid = objects.substr(at, nl - at);
    if (oid.starts_with(HeadOid(uri, "x") + "@") && oid.ends_with(".1")) chunk1 = oid;
  }
  ASSERT_FALSE(chunk1.empty()) << objects;
  ASSERT_EQ(RadosCli("rm '" + chunk1 + "'", nullptr, "safepoint.data"), 0);

  ASSERT_OK_AND_ASSIGN(auto r, s->Open("x"));
  AlignedTestBuffer all(r->size());
  Status st = r->ReadAt(0, all.span());
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find(s->Describe("x")), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find(chunk1), std::string::npos) << st.ToString();
  // Chunks 0 and 2 are intact and read back.
  AlignedTestBuffer first(4096);
  ASSERT_OK(r->ReadAt(0, first.span()));
  EXPECT_EQ(FirstMismatch(first.span(), 9, 0), -1);
  AlignedTestBuffer third(4096 + 10);
  ASSERT_OK(r->ReadAt(2 * 4096, third.span()));
  EXPECT_EQ(FirstMismatch(third.span(), 9, 2 * 4096), -1);
  // Delete still removes the rest.
  ASSERT_OK(s->Delete("x"));
  ASSERT_OK_AND_ASSIGN(size_t leftovers, s->RemoveLeftovers(""));
  EXPECT_EQ(leftovers, 0u);
}

// Leftovers beside published objects: each write's head decides (a batch of heads is read).
TEST(RadosStorageTest, LeftoversAreJudgedByTheirOwnObjectsHead) {
  SKIP_WITHOUT_CEPH();
  const std::string uri = TestUri("chunk_size=4K");
  ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(uri));
  for (const char* name : {"a", "b", "d"}) {
    ASSERT_OK(test::PutObject(*s, name, PatternBytes(9000, name[0])));
  }
  test::TempDir dir;
  ASSERT_TRUE(dir.ok());
  ASSERT_TRUE(test::WriteStringToFile(dir.Join("junk"), "left over"));
  // Data objects of writes that never published: of "a" (published under another data id), of
  // "c" (no head at all); and one of "b" whose first chunk is missing.
  for (const std::string oid :
       {HeadOid(uri, "a") + "@00000000000000a1.0", HeadOid(uri, "a") + "@00000000000000a1.1",
        HeadOid(uri, "c") + "@00000000000000c1.0", HeadOid(uri, "b") + "@00000000000000b1.2"}) {
    std::string out;
    ASSERT_EQ(RadosCli("put '" + oid + "' '" + dir.Join("junk") + "'", &out, "safepoint.data"), 0)
        << out;
  }
  ASSERT_OK_AND_ASSIGN(size_t removed, s->RemoveLeftovers(""));
  EXPECT_EQ(removed, 3u);
  std::string objects;
  ASSERT_EQ(RadosCli("ls", &objects, "safepoint.data"), 0) << objects;
  for (const char* id : {"@00000000000000a1.", "@00000000000000b1.", "@00000000000000c1."}) {
    EXPECT_EQ(objects.find(id), std::string::npos) << id << " left in\n" << objects;
  }
  for (const char* name : {"a", "b", "d"}) {
    EXPECT_EQ(test::ReadWholeObject(*s, name), PatternBytes(9000, name[0])) << name;
  }
  ASSERT_OK_AND_ASSIGN(removed, s->RemoveLeftovers(""));
  EXPECT_EQ(removed, 0u);
}

// Run by the test above in a process of its own: writes an object and exits without publishing
// or aborting it (a crash). Skips unless that test runs it.
TEST(RadosCrashHelper, WriteThenDie) {
  const char* uri = std::getenv("SAFEPOINT_TEST_RADOS_CRASH_URI");
  if (uri == nullptr) GTEST_SKIP() << "run by LeftoversOfACrashedWriterAreRemoved...";
  auto s = OpenStorage(uri);
  if (!s.ok()) ::_exit(2);
  auto w = (*s)->Create("step-1/img", 0);
  if (!w.ok() || !(*w)->WriteAt(0, PatternBytes(10000, 5)).ok()) ::_exit(3);
  ::_exit(0);  // no destructor, no Abort
}

// ---- faults -----------------------------------------------------------------------------------

// A pool of its own with a quota, so that filling it disturbs no other test.
TEST(RadosFaultTest, FullPoolIsResourceExhaustedAndNothingPartialIsVisible) {
  SKIP_WITHOUT_CEPH_DIR();
  const std::string pool = "sp-quota-" + std::to_string(::getpid());
  ASSERT_EQ(Shell(Ceph("osd pool create " + pool + " 8 8 >/dev/null 2>&1")), 0);
  struct DropPool {
    std::string pool;
    ~DropPool() {
      (void)Shell(Ceph("osd pool delete " + pool + " " + pool +
                       " --yes-i-really-really-mean-it >/dev/null 2>&1"));
    }
  } drop{pool};
  ASSERT_EQ(Shell(Ceph("osd pool set " + pool + " size 1 --yes-i-really-mean-it >/dev/null 2>&1")),
            0);
  ASSERT_OK_AND_ASSIGN(auto s, OpenStorage("rados://" + pool + "/q?chunk_size=1M&timeout=20"));
  AlignedTestBuffer before(3 << 20);
  FillPattern(before.span(), 40, 0);
  ASSERT_OK(WriteParallel(*s, "kept", before.span(), 1 << 20, 2));

  // Below what the pool holds already: the monitor flags it full at its next statistics.
  ASSERT_EQ(Shell(Ceph("osd pool set-quota " + pool + " max_bytes 1048576 >/dev/null 2>&1")), 0);
  bool flagged = false;
  for (int i = 0; i < 240 && !flagged; ++i) {  // polls the state, up to about 2 minutes
    std::string dump;
    Shell(Ceph("osd pool ls detail 2>/dev/null | grep \"'" + pool + "'\""), &dump);
    flagged = dump.find("full_quota") != std::string::npos;
    if (!flagged) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  ASSERT_TRUE(flagged) << "the monitor never flagged pool " << pool << " full";

  AlignedTestBuffer more(4 << 20);
  FillPattern(more.span(), 41, 0);
  // The full flag reaches this client with its next OSD map, a moment after the monitor set it
  // (Ceph enforces quotas eventually): a write that still went through is deleted and retried.
  Status st;
  for (int i = 0; i < 120; ++i) {
    st = WriteParallel(*s, "refused", more.span(), 1 << 20, 2);
    if (!st.ok()) break;
    ASSERT_OK(s->Delete("refused"));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_NE(st.message().find("\"" + pool + "\""), std::string::npos) << st.ToString();
  EXPECT_EQ(s->Open("refused").status().code(), StatusCode::kNotFound);
  auto list = s->List("");
  ASSERT_OK(list);
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name, "kept");
  // What was published before still reads back bit-exact, and a full pool can be cleaned up.
  ASSERT_OK_AND_ASSIGN(auto r, s->Open("kept"));
  AlignedTestBuffer back(before.span().size());
  ASSERT_OK(r->ReadAt(0, back.span()));
  EXPECT_EQ(FirstMismatch(back.span(), 40, 0), -1);
  EXPECT_OK(s->Delete("kept"));
}

// One test for the OSD faults, so that no two tests stop or kill the one OSD at once.
TEST(RadosFaultTest, KilledOrStalledOsdGivesAnErrorOrASuccessfulRetryNeverAPartialObject) {
  SKIP_WITHOUT_CEPH_DIR();
  const std::string script = std::string(SAFEPOINT_SOURCE_DIR) + "/scripts/ceph-cluster.sh";
  // -- SIGKILL mid-upload, restarted by the script while the upload retries.
  {
    ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(TestUri("timeout=10&retries=6")));
    AlignedTestBuffer data(192 << 20);
    FillPattern(data.span(), 50, 0);
    std::atomic<bool> started{false};
    Status result;
    std::thread writer([&] {
      auto w = s->Create("big", data.span().size());
      if (!w.ok()) {
        result = w.status();
        return;
      }
      constexpr size_t kPiece = 4 << 20;
      for (size_t off = 0; off < data.span().size() && result.ok(); off += kPiece) {
        result = (*w)->WriteAt(off, data.span().subspan(off, kPiece));
        started = true;
      }
      if (result.ok()) result = (*w)->Publish();
    });
    while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const pid_t osd = DaemonPid("osd.0");
    ASSERT_GT(osd, 0);
    ASSERT_EQ(::kill(osd, SIGKILL), 0);
    const int restarted = Shell(script + " restart-osd " + CephDir() + " 2>&1");
    writer.join();
    ASSERT_EQ(restarted, 0) << "the OSD did not come back";
    auto r = s->Open("big");
    if (result.ok()) {
      ASSERT_OK(r);
      AlignedTestBuffer back(data.span().size());
      ASSERT_OK((*r)->ReadAt(0, back.span()));
      EXPECT_EQ(FirstMismatch(back.span(), 50, 0), -1);
    } else {
      EXPECT_TRUE(result.code() == StatusCode::kUnavailable ||
                  result.code() == StatusCode::kIOError)
          << result.ToString();
      EXPECT_NE(result.message().find(s->Describe("big")), std::string::npos) << result.ToString();
      EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << "a failed upload is visible";
    }
    std::cerr << "after SIGKILL of the OSD: " << (result.ok() ? "OK" : result.ToString()) << "\n";
  }
  // -- SIGSTOP: an op fails after the timeout, then SIGCONT.
  {
    ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(TestUri("timeout=3&retries=1")));
    ASSERT_OK(test::PutObject(*s, "before", PatternBytes(5000, 51)));
    // Readers opened before the stall (reads go through librados's C++ API): one of this storage,
    // and one of a storage whose timeout (60 s) only a cancellation cuts short.
    ASSERT_OK_AND_ASSIGN(auto reader, s->Open("before"));
    ASSERT_OK_AND_ASSIGN(auto patient, OpenStorage(TestUri("timeout=60&retries=0")));
    ASSERT_OK_AND_ASSIGN(auto patient_reader, patient->Open("before"));
    const pid_t osd = DaemonPid("osd.0");
    ASSERT_GT(osd, 0);
    ASSERT_EQ(::kill(osd, SIGSTOP), 0);
    struct Cont {
      pid_t pid;
      ~Cont() { ::kill(pid, SIGCONT); }
    } cont{osd};
    Status st = test::PutObject(*s, "stalled", PatternBytes(5000, 52));
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
    EXPECT_NE(st.message().find("timeout"), std::string::npos) << st.ToString();
    EXPECT_NE(st.message().find(s->Describe("stalled")), std::string::npos) << st.ToString();
    auto r = s->Open("before");
    EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
    // A data read of the open object times out the same way, naming the object.
    std::vector<std::byte> back(5000);
    st = reader->ReadAt(0, back);
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
    EXPECT_NE(st.message().find(s->Describe("before")), std::string::npos) << st.ToString();
    // A read in flight when its storage is cancelled (a stopping agent's CancelRequests) ends
    // with the cancellation, not after the 60 s timeout's answer: librados's read is cancelled.
    Status cancelled_read;
    std::thread t([&] { cancelled_read = patient_reader->ReadAt(0, back); });
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    internal::CancelStorageRequests(*patient);
    t.join();
    EXPECT_EQ(cancelled_read.code(), StatusCode::kUnavailable) << cancelled_read.ToString();
    EXPECT_NE(cancelled_read.message().find(std::strerror(ECANCELED)), std::string::npos)
        << cancelled_read.ToString();
    // SIGCONT, and a re-peer: a lone OSD's PGs stay "laggy" after a pause (a test artefact).
    ASSERT_EQ(Shell(script + " resume-osd " + CephDir() + " 2>&1"), 0);
    // Back: what was published reads back, the stalled object never appeared.
    EXPECT_EQ(test::ReadWholeObject(*s, "before"), PatternBytes(5000, 51));
    EXPECT_EQ(s->Open("stalled").status().code(), StatusCode::kNotFound);
  }
  // -- SIGKILL while idle, without retries: a call fails while the OSD is dead; once it is back
  // (at a new address), the next listing and read succeed at their first attempt. Before the
  // client fetched the newest OSD map after a failed op, every later op of the process went to
  // the dead address and timed out (issue 35's OPEN-2, a rados:// tier that never caught up).
  {
    // A timeout above what a freshly restarted OSD may take to answer a first request on a
    // loaded machine (the point is the attempt count, not the time).
    ASSERT_OK_AND_ASSIGN(auto s, OpenStorage(TestUri("timeout=6&retries=0")));
    ASSERT_OK(test::PutObject(*s, "idle", PatternBytes(3000, 53)));
    const pid_t osd = DaemonPid("osd.0");
    ASSERT_GT(osd, 0);
    ASSERT_EQ(::kill(osd, SIGKILL), 0);
    auto during = s->List("");
    EXPECT_EQ(during.status().code(), StatusCode::kUnavailable) << during.status().ToString();
    EXPECT_EQ(s->Open("idle").status().code(), StatusCode::kUnavailable);
    ASSERT_EQ(Shell(script + " restart-osd " + CephDir() + " 2>&1"), 0);
    auto list = s->List("idle");  // the prefix is the test's: the blocks above wrote there
    ASSERT_OK(list);
    ASSERT_EQ(list->size(), 1u);
    EXPECT_EQ((*list)[0].name, "idle");
    EXPECT_EQ(test::ReadWholeObject(*s, "idle"), PatternBytes(3000, 53));
  }
}

}  // namespace
}  // namespace safepoint::rados_storage_test
