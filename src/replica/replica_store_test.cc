#include "replica/replica_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base/crc32c.h"
#include "replica/erasure.h"
#include "testing/test_util.h"

namespace safepoint::replica::replica_store_test {
namespace {

namespace fs = std::filesystem;
using internal::Crc32c;

constexpr uint64_t kHeader = 4096;

// A copy of `n` bytes of pattern `seed`; payload_crc and image_crc set.
ReplicaMeta CopyMeta(const std::string& source, uint32_t rank, uint64_t step, uint64_t complete_ns,
                     const std::vector<std::byte>& payload) {
  ReplicaMeta m;
  m.source_node = source;
  m.rank = rank;
  m.step = step;
  m.complete_ns = complete_ns;
  m.attempt = complete_ns * 3 + 1;  // any value: it must survive the round trip
  m.image_bytes = payload.size();
  m.image_crc = Crc32c(payload);
  m.kind = ReplicaMeta::Kind::kCopy;
  m.payload_bytes = payload.size();
  m.payload_crc = Crc32c(payload);
  return m;
}

Status Put(ReplicaStore& store, const ReplicaMeta& meta, std::span<const std::byte> payload) {
  SP_ASSIGN_OR_RETURN(auto w, store.Begin(meta));
  SP_RETURN_IF_ERROR(w->Write(0, payload));
  return w->Commit();
}

std::vector<std::string> DirNames(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

void FlipByte(const std::string& path, uint64_t offset) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  unsigned char b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= 0x40;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

bool Same(const ReplicaMeta& a, const ReplicaMeta& b) {
  return a.source_node == b.source_node && a.rank == b.rank && a.step == b.step &&
         a.complete_ns == b.complete_ns && a.attempt == b.attempt &&
         a.image_bytes == b.image_bytes && a.image_crc == b.image_crc && a.kind == b.kind &&
         a.index == b.index && a.k == b.k && a.p == b.p && a.piece_bytes == b.piece_bytes &&
         a.payload_bytes == b.payload_bytes && a.payload_crc == b.payload_crc;
}

class ReplicaStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(tmp_.ok());
    ASSERT_OK_AND_ASSIGN(store_, ReplicaStore::Open(tmp_.path()));
  }
  std::string dir() const { return tmp_.Join("replicas"); }

  test::TempDir tmp_{"replica-store"};
  std::unique_ptr<ReplicaStore> store_;
};

TEST_F(ReplicaStoreTest, CopyRoundTripsThroughAPrivateDirectory) {
  const auto payload = test::PatternBytes(100000, 1);
  const ReplicaMeta m = CopyMeta("node-1", 3, 40, 12345, payload);
  ASSERT_OK(Put(*store_, m, payload));

  struct stat st;
  ASSERT_EQ(::stat(dir().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(DirNames(dir()), std::vector<std::string>{"node-1.rank-3.step-40.12345.copy-0"});
  EXPECT_EQ(fs::file_size(dir() + "/node-1.rank-3.step-40.12345.copy-0"), kHeader + 100000);

  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  ASSERT_EQ(list.size(), 1u);
  EXPECT_TRUE(Same(list[0], m));
  ASSERT_OK_AND_ASSIGN(ReplicaView view, store_->Read(list[0]));
  EXPECT_TRUE(Same(view.meta, m));
  EXPECT_EQ(test::FirstMismatch(view.payload, 1), -1);
  ASSERT_EQ(view.payload.size(), payload.size());
  EXPECT_GE(store_->bytes(), kHeader + 100000);

  // A second store over the same directory (an agent restarted) finds it.
  ASSERT_OK_AND_ASSIGN(auto again, ReplicaStore::Open(tmp_.path()));
  ASSERT_OK_AND_ASSIGN(auto list2, again->List());
  ASSERT_EQ(list2.size(), 1u);
  EXPECT_TRUE(Same(list2[0], m));
}

TEST_F(ReplicaStoreTest, FragmentsRoundTripAndListSortsAndFiltersByRank) {
  ASSERT_OK_AND_ASSIGN(auto codec, EcCodec::Create(2, 1));
  EcLayout l;
  l.k = 2;
  l.p = 1;
  l.image_bytes = 1000;
  l.piece_bytes = 128;
  const auto image = test::PatternBytes(l.image_bytes, 9);
  std::vector<std::vector<std::byte>> frags(3, std::vector<std::byte>(l.fragment_bytes()));
  for (uint64_t s = 0; s < l.stripes(); ++s) {
    std::vector<std::byte*> out;
    for (auto& f : frags) out.push_back(f.data() + s * l.piece_bytes);
    codec->EncodeStripe(l, image, s, out);
  }
  for (uint32_t f : {2, 0, 1}) {
    ReplicaMeta m;
    m.source_node = "n0";
    m.rank = 1;
    m.step = 7;
    m.complete_ns = 99;
    m.image_bytes = l.image_bytes;
    m.image_crc = Crc32c(image);
    m.kind = ReplicaMeta::Kind::kFragment;
    m.index = f;
    m.k = 2;
    m.p = 1;
    m.piece_bytes = l.piece_bytes;
    m.payload_bytes = l.fragment_bytes();
    m.payload_crc = Crc32c(frags[f]);
    ASSERT_OK(Put(*store_, m, frags[f]));
  }
  const auto copy = test::PatternBytes(10, 2);
  ASSERT_OK(Put(*store_, CopyMeta("n1", 0, 9, 1, copy), copy));
  ASSERT_OK(Put(*store_, CopyMeta("n1", 2, 3, 1, copy), copy));
  ASSERT_OK(Put(*store_, CopyMeta("n1", 1, 8, 1, copy), copy));

  ASSERT_OK_AND_ASSIGN(auto all, store_->List());
  ASSERT_EQ(all.size(), 6u);
  std::vector<std::string> order;
  for (const auto& m : all) {
    order.push_back(std::to_string(m.rank) + "/" + std::to_string(m.step) + "/" +
                    std::to_string(static_cast<int>(m.kind)) + "/" + std::to_string(m.index));
  }
  EXPECT_EQ(order, (std::vector<std::string>{"0/9/1/0", "1/7/2/0", "1/7/2/1", "1/7/2/2", "1/8/1/0",
                                             "2/3/1/0"}));
  ASSERT_OK_AND_ASSIGN(auto rank1, store_->List(1));
  ASSERT_EQ(rank1.size(), 4u);

  // Fragments 1 and 2 read back decode to the image.
  std::vector<ReplicaView> views;
  for (const auto& m : rank1) {
    if (m.kind == ReplicaMeta::Kind::kFragment && m.index > 0) {
      ASSERT_OK_AND_ASSIGN(auto v, store_->Read(m));
      views.push_back(std::move(v));
    }
  }
  ASSERT_EQ(views.size(), 2u);
  const std::vector<uint32_t> idx = {views[0].meta.index, views[1].meta.index};
  const std::vector<std::span<const std::byte>> spans = {views[0].payload, views[1].payload};
  std::vector<std::byte> out(l.image_bytes);
  ASSERT_OK(codec->Decode(l, idx, spans, out));
  EXPECT_EQ(test::FirstMismatch(out, 9), -1);
}

TEST_F(ReplicaStoreTest, EmptyImageRoundTrips) {
  const std::vector<std::byte> empty;
  const ReplicaMeta m = CopyMeta("n", 0, 1, 1, empty);
  ASSERT_OK(Put(*store_, m, empty));
  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  ASSERT_EQ(list.size(), 1u);
  ASSERT_OK_AND_ASSIGN(auto view, store_->Read(list[0]));
  EXPECT_TRUE(view.payload.empty());
}

TEST_F(ReplicaStoreTest, CommitReplacesAnEqualReplica) {
  const auto payload = test::PatternBytes(5000, 4);
  const ReplicaMeta m = CopyMeta("n", 0, 1, 1, payload);
  ASSERT_OK(Put(*store_, m, payload));
  ASSERT_OK(Put(*store_, m, payload));
  EXPECT_EQ(DirNames(dir()).size(), 1u);
  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  EXPECT_EQ(list.size(), 1u);
}

TEST_F(ReplicaStoreTest, APayloadThatDoesNotMatchTheSendersCrcIsNeverVisible) {
  const auto payload = test::PatternBytes(5000, 4);
  ReplicaMeta m = CopyMeta("n", 0, 1, 1, payload);
  {
    ASSERT_OK_AND_ASSIGN(auto w, store_->Begin(m));
    auto flipped = payload;
    flipped[4999] ^= std::byte{1};
    ASSERT_OK(w->Write(0, flipped));
    const Status s = w->Commit();
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
    EXPECT_NE(s.message().find("n.rank-0.step-1.1.copy-0"), std::string::npos) << s.ToString();
    ASSERT_OK_AND_ASSIGN(auto list, store_->List());
    EXPECT_TRUE(list.empty());
  }
  EXPECT_TRUE(DirNames(dir()).empty());  // the writer removed its temporary file
  // A writer dropped without Commit leaves nothing either.
  { ASSERT_OK_AND_ASSIGN(auto w, store_->Begin(m)); }
  EXPECT_TRUE(DirNames(dir()).empty());
  // Committing twice is refused.
  ASSERT_OK_AND_ASSIGN(auto w, store_->Begin(m));
  // Written out of order, as chunks land.
  ASSERT_OK(w->Write(3000, std::span(payload).subspan(3000)));
  ASSERT_OK(w->Write(0, std::span(payload).first(3000)));
  // Nothing past the payload's end.
  EXPECT_EQ(w->Write(4999, std::span(payload).first(2)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w->Write(5001, {}).code(), StatusCode::kInvalidArgument);
  ASSERT_OK(w->Commit());
  EXPECT_EQ(w->Write(0, std::span(payload).first(1)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(w->Commit().code(), StatusCode::kInvalidArgument);
}

TEST_F(ReplicaStoreTest, ACorruptPayloadIsListedButNotRead) {
  const auto payload = test::PatternBytes(20000, 5);
  const ReplicaMeta m = CopyMeta("n", 0, 1, 1, payload);
  ASSERT_OK(Put(*store_, m, payload));
  FlipByte(dir() + "/n.rank-0.step-1.1.copy-0", kHeader + 12345);
  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  ASSERT_EQ(list.size(), 1u);
  auto view = store_->Read(m);
  EXPECT_EQ(view.status().code(), StatusCode::kCorruption) << view.status().ToString();
  EXPECT_NE(view.status().message().find("payload CRC32C"), std::string::npos);
  EXPECT_NE(view.status().message().find("n.rank-0.step-1.1.copy-0"), std::string::npos);
}

TEST_F(ReplicaStoreTest, ACorruptHeaderIsSkippedByListAndRefusedByRead) {
  const auto payload = test::PatternBytes(3000, 6);
  const ReplicaMeta good = CopyMeta("n", 0, 1, 1, payload);
  const ReplicaMeta bad = CopyMeta("n", 0, 2, 1, payload);
  ASSERT_OK(Put(*store_, good, payload));
  ASSERT_OK(Put(*store_, bad, payload));
  for (uint64_t offset : {uint64_t{0}, uint64_t{50}, uint64_t{90}, uint64_t{2000}, kHeader - 1}) {
    SCOPED_TRACE("offset " + std::to_string(offset));
    FlipByte(dir() + "/n.rank-0.step-2.1.copy-0", offset);
    ASSERT_OK_AND_ASSIGN(auto list, store_->List());
    ASSERT_EQ(list.size(), 1u);
    EXPECT_EQ(list[0].step, 1u);
    EXPECT_EQ(store_->Read(bad).status().code(), StatusCode::kCorruption);
    FlipByte(dir() + "/n.rank-0.step-2.1.copy-0", offset);  // repaired
    ASSERT_OK_AND_ASSIGN(auto list2, store_->List());
    EXPECT_EQ(list2.size(), 2u);
  }
  // A file renamed to another replica's name, a short file and a stranger are skipped too.
  fs::rename(dir() + "/n.rank-0.step-2.1.copy-0", dir() + "/n.rank-0.step-3.1.copy-0");
  std::ofstream(dir() + "/stranger") << "hello";
  std::ofstream(dir() + "/n.rank-0.step-4.1.copy-0") << "short";
  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].step, 1u);
  ReplicaMeta renamed = bad;
  renamed.step = 3;
  EXPECT_EQ(store_->Read(renamed).status().code(), StatusCode::kCorruption);
}

TEST_F(ReplicaStoreTest, ATruncatedOrExtendedFileIsRefusedWithoutSigbus) {
  const auto payload = test::PatternBytes(3 * 4096, 7);
  const ReplicaMeta m = CopyMeta("n", 0, 1, 1, payload);
  ASSERT_OK(Put(*store_, m, payload));
  const std::string path = dir() + "/n.rank-0.step-1.1.copy-0";
  fs::resize_file(path, kHeader + 4096);  // mapping the header's size would fault past the end
  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  EXPECT_TRUE(list.empty());
  auto view = store_->Read(m);
  EXPECT_EQ(view.status().code(), StatusCode::kCorruption) << view.status().ToString();
  fs::resize_file(path, kHeader + 5 * 4096);
  EXPECT_EQ(store_->Read(m).status().code(), StatusCode::kCorruption);
}

TEST_F(ReplicaStoreTest, AMetaThatDoesNotMatchTheFileIsRefused) {
  const auto payload = test::PatternBytes(4000, 8);
  const ReplicaMeta m = CopyMeta("n", 0, 1, 1, payload);
  ASSERT_OK(Put(*store_, m, payload));
  ReplicaMeta lie = m;
  lie.payload_bytes = lie.image_bytes = uint64_t{1} << 40;
  auto view = store_->Read(lie);
  EXPECT_EQ(view.status().code(), StatusCode::kCorruption) << view.status().ToString();
  lie = m;
  lie.payload_crc ^= 1;
  EXPECT_EQ(store_->Read(lie).status().code(), StatusCode::kCorruption);
  lie = m;
  lie.step = 2;
  EXPECT_EQ(store_->Read(lie).status().code(), StatusCode::kNotFound);
  lie.source_node = "../n";
  EXPECT_EQ(store_->Read(lie).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(ReplicaStoreTest, BeginRefusesMetasThatCannotBeRight) {
  const auto payload = test::PatternBytes(100, 8);
  const ReplicaMeta ok = CopyMeta("node_A-1.x", 0, 1, 1, payload);
  ReplicaMeta frag = ok;
  frag.kind = ReplicaMeta::Kind::kFragment;
  frag.k = 2;
  frag.p = 2;
  frag.piece_bytes = 64;
  frag.index = 3;
  frag.payload_bytes = 64;  // 100 bytes: 1 stripe of 128, fragments of 64
  ASSERT_OK(store_->Begin(ok));
  ASSERT_OK(store_->Begin(frag));

  std::vector<std::pair<std::string, ReplicaMeta>> cases;
  for (const std::string& name :
       std::vector<std::string>{"", "..", ".", ".tmp-x", ".hidden", "a/b", "../../etc", "a b",
                                "\xc3\xa9", std::string(65, 'a'), std::string("a\0b", 3)}) {
    ReplicaMeta m = ok;
    m.source_node = name;
    cases.emplace_back("source '" + name + "'", m);
  }
  // `base` with `change` applied, named `what`.
  auto add = [&](const std::string& what, ReplicaMeta base, auto change) {
    change(base);
    cases.emplace_back(what, base);
  };
  add("copy payload != image", ok, [](ReplicaMeta& m) { m.payload_bytes = 99; });
  add("copy index 1", ok, [](ReplicaMeta& m) { m.index = 1; });
  add("kind 7", ok, [](ReplicaMeta& m) { m.kind = static_cast<ReplicaMeta::Kind>(7); });
  add("payload 2^64-1", ok, [](ReplicaMeta& m) { m.image_bytes = m.payload_bytes = ~uint64_t{0}; });
  add("fragment index k+p", frag, [](ReplicaMeta& m) { m.index = 4; });
  add("fragment payload lies", frag, [](ReplicaMeta& m) { m.payload_bytes = uint64_t{1} << 50; });
  add("k 0", frag, [](ReplicaMeta& m) { m.k = 0; });
  add("p 40", frag, [](ReplicaMeta& m) { m.p = 40; });
  add("piece 0", frag, [](ReplicaMeta& m) { m.piece_bytes = 0; });
  for (const auto& [what, meta] : cases) {
    auto w = store_->Begin(meta);
    EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument)
        << what << ": " << w.status().ToString();
  }
  EXPECT_EQ(DirNames(tmp_.path()), std::vector<std::string>{"replicas"});
  EXPECT_TRUE(DirNames(dir()).empty());
}

TEST_F(ReplicaStoreTest, AHugeMetaIsResourceExhaustedNamingTheBytes) {
  // A copy whose sizes agree but that no shared memory holds: refused before any byte is mapped.
  std::vector<std::byte> none;
  ReplicaMeta m = CopyMeta("n", 0, 1, 1, none);
  m.image_bytes = m.payload_bytes = uint64_t{1} << 52;
  auto w = store_->Begin(m);
  ASSERT_EQ(w.status().code(), StatusCode::kResourceExhausted) << w.status().ToString();
  EXPECT_NE(w.status().message().find(std::to_string(kHeader + (uint64_t{1} << 52)) + " bytes"),
            std::string::npos)
      << w.status().ToString();
  EXPECT_NE(w.status().message().find("free"), std::string::npos) << w.status().ToString();
  EXPECT_TRUE(DirNames(dir()).empty());
}

TEST_F(ReplicaStoreTest, TemporaryFilesOfACrashedWriterAreNeverListedAndRemovedAtOpen) {
  const auto payload = test::PatternBytes(30000, 10);
  const ReplicaMeta m = CopyMeta("n", 0, 1, 1, payload);
  ASSERT_OK(Put(*store_, m, payload));
  // A writer that dies between Begin and Commit, and one that dies after writing every byte.
  for (int fill = 0; fill < 2; ++fill) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ReplicaMeta m2 = CopyMeta("n", 0, 2 + fill, 1, payload);
      auto w = store_->Begin(m2);
      if (!w.ok()) ::_exit(1);
      if (fill && !(*w)->Write(0, payload).ok()) ::_exit(1);
      ::_exit(0);  // no destructor runs
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  // A whole, valid replica file under a temporary name is not listed either.
  fs::copy_file(dir() + "/n.rank-0.step-1.1.copy-0", dir() + "/.tmp-0123-n.rank-0.step-9.1.copy-0");
  EXPECT_EQ(DirNames(dir()).size(), 4u);
  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].step, 1u);

  ASSERT_OK_AND_ASSIGN(auto reopened, ReplicaStore::Open(tmp_.path()));
  EXPECT_EQ(DirNames(dir()), std::vector<std::string>{"n.rank-0.step-1.1.copy-0"});
  ASSERT_OK_AND_ASSIGN(auto list2, reopened->List());
  EXPECT_EQ(list2.size(), 1u);
}

TEST_F(ReplicaStoreTest, PruneKeepsTheNewestSnapshotsOfEachSourceAndRank) {
  const auto small = test::PatternBytes(100, 11);
  struct Snap {
    std::string source;
    uint32_t rank;
    uint64_t step, complete_ns;
  };
  // Inserted out of order; step 5 of a/0 exists twice (a re-taken snapshot: complete_ns orders).
  const std::vector<Snap> snaps = {
      {"a", 0, 5, 200}, {"a", 0, 3, 100}, {"a", 0, 5, 100}, {"a", 0, 4, 900}, {"a", 1, 1, 1},
      {"a", 1, 2, 1},   {"b", 0, 9, 1},   {"b", 0, 1, 1},   {"b", 0, 2, 1},
  };
  for (const Snap& s : snaps) {
    ASSERT_OK(Put(*store_, CopyMeta(s.source, s.rank, s.step, s.complete_ns, small), small));
  }
  // Two fragments of one more snapshot of b/0, newer than all.
  for (uint32_t f : {0, 1}) {
    ReplicaMeta m = CopyMeta("b", 0, 10, 1, small);
    m.kind = ReplicaMeta::Kind::kFragment;
    m.k = 1;
    m.p = 1;
    m.piece_bytes = 128;
    m.index = f;
    m.payload_bytes = 128;
    const auto frag = test::PatternBytes(128, f);
    m.payload_crc = Crc32c(frag);
    ASSERT_OK(Put(*store_, m, frag));
  }
  ASSERT_OK_AND_ASSIGN(uint64_t freed, store_->Prune(2));
  // a/0 keeps (5,200), (5,100); a/1 keeps both; b/0 keeps step 10 (2 fragments) and step 9.
  EXPECT_EQ(freed, 4 * (kHeader + 100));
  EXPECT_EQ(DirNames(dir()),
            (std::vector<std::string>{"a.rank-0.step-5.100.copy-0", "a.rank-0.step-5.200.copy-0",
                                      "a.rank-1.step-1.1.copy-0", "a.rank-1.step-2.1.copy-0",
                                      "b.rank-0.step-10.1.frag-0", "b.rank-0.step-10.1.frag-1",
                                      "b.rank-0.step-9.1.copy-0"}));
  ASSERT_OK_AND_ASSIGN(freed, store_->Prune(2));
  EXPECT_EQ(freed, 0u);
  ASSERT_OK_AND_ASSIGN(freed, store_->Prune(1));
  EXPECT_EQ(freed, 3 * (kHeader + 100));
  EXPECT_EQ(DirNames(dir()),
            (std::vector<std::string>{"a.rank-0.step-5.200.copy-0", "a.rank-1.step-2.1.copy-0",
                                      "b.rank-0.step-10.1.frag-0", "b.rank-0.step-10.1.frag-1"}));
  ASSERT_OK_AND_ASSIGN(freed, store_->Prune(0));
  EXPECT_EQ(freed, 2 * (kHeader + 100) + 2 * (kHeader + 128));
  EXPECT_TRUE(DirNames(dir()).empty());
  EXPECT_EQ(store_->bytes(), 0u);
}

TEST_F(ReplicaStoreTest, RemoveSourceRemovesOnlyThatNodesReplicas) {
  const auto small = test::PatternBytes(100, 12);
  for (const char* source : {"a", "ab", "b"}) {
    for (uint32_t rank : {0, 1})
      ASSERT_OK(Put(*store_, CopyMeta(source, rank, 1, 1, small), small));
  }
  const uint64_t before = store_->bytes();
  ASSERT_OK(store_->RemoveSource("a"));
  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  std::set<std::string> sources;
  for (const auto& m : list) sources.insert(m.source_node);
  EXPECT_EQ(sources, (std::set<std::string>{"ab", "b"}));
  EXPECT_EQ(list.size(), 4u);
  EXPECT_LT(store_->bytes(), before);
  EXPECT_EQ(store_->RemoveSource("../b").code(), StatusCode::kInvalidArgument);
  ASSERT_OK(store_->RemoveSource("nobody"));
}

TEST_F(ReplicaStoreTest, WritersOnSeveralThreadsWhileListingAndPruning) {
  const auto payload = test::PatternBytes(10000, 15);
  std::vector<std::thread> threads;
  std::vector<Status> errors(4);
  for (uint32_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t step = 1; step <= 20 && errors[t].ok(); ++step) {
        errors[t] = Put(*store_, CopyMeta("n" + std::to_string(t), t, step, 1, payload), payload);
        if (errors[t].ok() && step % 5 == 0) errors[t] = store_->List().status();
        if (errors[t].ok() && step % 7 == 0) errors[t] = store_->Prune(3).status();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const Status& s : errors) EXPECT_OK(s);
  ASSERT_OK(store_->Prune(3));
  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  ASSERT_EQ(list.size(), 12u);
  for (const auto& m : list) {
    EXPECT_GE(m.step, 18u);
    EXPECT_OK(store_->Read(m));
  }
}

// A pruned replica's file is kept as a spare (never listed) and the next replica reuses its pages:
// no fresh shared memory for snapshot after snapshot of the same size.
TEST_F(ReplicaStoreTest, PrunedFilesAreReusedForTheNextReplica) {
  const auto payload = test::PatternBytes(4 << 20, 21);
  ASSERT_OK(Put(*store_, CopyMeta("n", 0, 1, 1, payload), payload));
  ASSERT_OK(Put(*store_, CopyMeta("n", 0, 2, 1, payload), payload));
  ASSERT_OK_AND_ASSIGN(uint64_t freed, store_->Prune(1));
  EXPECT_EQ(freed, kHeader + payload.size());
  // Step 1's file is a spare now: same inode, another name, not listed.
  std::vector<std::string> names = DirNames(dir());
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[1], "n.rank-0.step-2.1.copy-0");
  ASSERT_TRUE(names[0].starts_with(".spare-")) << names[0];
  struct stat spare;
  ASSERT_EQ(::stat((dir() + "/" + names[0]).c_str(), &spare), 0);
  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  ASSERT_EQ(list.size(), 1u);
  // The next replica (a little smaller) is written into the spare's file.
  const auto next = test::PatternBytes((4 << 20) - 1000, 22);
  ASSERT_OK(Put(*store_, CopyMeta("n", 0, 3, 1, next), next));
  struct stat reused;
  ASSERT_EQ(::stat((dir() + "/n.rank-0.step-3.1.copy-0").c_str(), &reused), 0);
  EXPECT_EQ(reused.st_ino, spare.st_ino);
  EXPECT_EQ(static_cast<uint64_t>(reused.st_size), kHeader + next.size());
  EXPECT_EQ(DirNames(dir()),
            (std::vector<std::string>{"n.rank-0.step-2.1.copy-0", "n.rank-0.step-3.1.copy-0"}));
  ASSERT_OK_AND_ASSIGN(list, store_->List());
  ASSERT_EQ(list.size(), 2u);
  ASSERT_OK_AND_ASSIGN(ReplicaView view, store_->Read(list[1]));
  EXPECT_TRUE(std::equal(view.payload.begin(), view.payload.end(), next.begin(), next.end()));
  // A larger one reuses it too, growing it.
  ASSERT_OK(store_->Prune(1));
  view = {};
  const auto big = test::PatternBytes((6 << 20) + 5, 23);
  ASSERT_OK(Put(*store_, CopyMeta("n", 0, 4, 1, big), big));
  ASSERT_OK_AND_ASSIGN(list, store_->List());
  ASSERT_EQ(list.size(), 2u);
  ASSERT_OK_AND_ASSIGN(view, store_->Read(list[1]));
  EXPECT_TRUE(std::equal(view.payload.begin(), view.payload.end(), big.begin(), big.end()));
  // Spares go when the store is opened again (an earlier agent's).
  ASSERT_OK(store_->Prune(1));
  view = {};
  ASSERT_EQ(DirNames(dir()).size(), 2u);
  ASSERT_OK_AND_ASSIGN(auto reopened, ReplicaStore::Open(tmp_.path()));
  EXPECT_EQ(DirNames(dir()), std::vector<std::string>{"n.rank-0.step-4.1.copy-0"});
}

// A replica that a reader has mapped is not recycled under it when it is pruned.
TEST_F(ReplicaStoreTest, AMappedReplicaIsRemovedNotRecycled) {
  const auto payload = test::PatternBytes(2 << 20, 24);
  ASSERT_OK(Put(*store_, CopyMeta("n", 0, 1, 1, payload), payload));
  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  ASSERT_OK_AND_ASSIGN(ReplicaView view, store_->Read(list[0]));
  ASSERT_OK(Put(*store_, CopyMeta("n", 0, 2, 1, payload), payload));
  ASSERT_OK(store_->Prune(1));
  EXPECT_EQ(DirNames(dir()), std::vector<std::string>{"n.rank-0.step-2.1.copy-0"});
  const auto other = test::PatternBytes(2 << 20, 25);
  ASSERT_OK(Put(*store_, CopyMeta("n", 0, 3, 1, other), other));
  EXPECT_TRUE(std::equal(view.payload.begin(), view.payload.end(), payload.begin(), payload.end()));
  EXPECT_EQ(Crc32c(view.payload), list[0].payload_crc);
}

// A budget store (ReplicaStoreOptions::budget) opened on the fixture's directory.
std::unique_ptr<ReplicaStore> OpenWithBudget(const std::string& job_dir,
                                             const std::shared_ptr<uint64_t>& budget,
                                             bool spares_without_budget = true) {
  ReplicaStoreOptions o;
  o.budget = [budget]() -> std::optional<uint64_t> {
    if (*budget == 0) return std::nullopt;
    return *budget;
  };
  o.spares_without_budget = spares_without_budget;
  auto store = ReplicaStore::Open(job_dir, std::move(o));
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  return store.ok() ? std::move(*store) : nullptr;
}

// A budget store with room for one replica of `bytes` (and 1 MiB), not two.
std::unique_ptr<ReplicaStore> OpenWithRoomForOne(const std::string& job_dir, uint64_t bytes) {
  return OpenWithBudget(job_dir, std::make_shared<uint64_t>(kHeader + bytes + (1 << 20)));
}

// Budget mode: room for one replica of the rank, not two. The next replica is received into
// the previous one's file (the same pages): that one is given up (no longer listed or readable)
// when the new one begins, and no second file is ever made.
TEST_F(ReplicaStoreTest, OverTheBudgetTheNextReplicaIsReceivedIntoThePreviousOnesPages) {
  const auto one = test::PatternBytes(4 << 20, 41);
  auto store = OpenWithRoomForOne(tmp_.path(), one.size());
  ASSERT_TRUE(store);
  const ReplicaMeta first = CopyMeta("n", 0, 1, 1, one);
  ASSERT_OK(Put(*store, first, one));
  struct stat before;
  ASSERT_EQ(::stat((dir() + "/n.rank-0.step-1.1.copy-0").c_str(), &before), 0);
  // A replica of another rank has no previous one: it is never refused by the budget.
  ASSERT_OK(Put(*store, CopyMeta("n", 1, 1, 1, one), one));
  EXPECT_EQ(store->received_in_place(), 0u);

  const auto two = test::PatternBytes(4 << 20, 42);
  const ReplicaMeta second = CopyMeta("n", 0, 2, 1, two);
  ASSERT_OK_AND_ASSIGN(auto w, store->Begin(second));
  EXPECT_EQ(store->received_in_place(), 1u);
  // While it is received: rank 0 has no replica here (the old one is given up), one file only.
  ASSERT_OK_AND_ASSIGN(auto listed, store->List(0));
  EXPECT_TRUE(listed.empty());
  EXPECT_EQ(store->Read(first).status().code(), StatusCode::kNotFound);
  std::vector<std::string> names = DirNames(dir());
  ASSERT_EQ(names.size(), 2u);
  ASSERT_TRUE(names[0].starts_with(".tmp-")) << names[0];
  EXPECT_EQ(names[1], "n.rank-1.step-1.1.copy-0");
  struct stat receiving;
  ASSERT_EQ(::stat((dir() + "/" + names[0]).c_str(), &receiving), 0);
  EXPECT_EQ(receiving.st_ino, before.st_ino);  // the previous replica's file and pages
  ASSERT_OK(w->Write(0, two));
  ASSERT_OK(w->Commit());
  ASSERT_OK(store->Prune(1));
  struct stat after;
  ASSERT_EQ(::stat((dir() + "/n.rank-0.step-2.1.copy-0").c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino);
  EXPECT_EQ(DirNames(dir()),
            (std::vector<std::string>{"n.rank-0.step-2.1.copy-0", "n.rank-1.step-1.1.copy-0"}));
  ASSERT_OK_AND_ASSIGN(listed, store->List(0));
  ASSERT_EQ(listed.size(), 1u);
  ASSERT_OK_AND_ASSIGN(ReplicaView view, store->Read(listed[0]));
  EXPECT_TRUE(std::equal(view.payload.begin(), view.payload.end(), two.begin(), two.end()));
}

// Budget mode, a transfer cut off (the writer dropped before Commit): the rank has no replica
// on this node at all (the previous one was given up), so nothing partial is ever served.
TEST_F(ReplicaStoreTest, ACutTransferInBudgetModeLeavesNoReplicaToServe) {
  const auto one = test::PatternBytes(2 << 20, 43);
  auto store = OpenWithRoomForOne(tmp_.path(), one.size());
  ASSERT_TRUE(store);
  const ReplicaMeta first = CopyMeta("n", 0, 1, 1, one);
  ASSERT_OK(Put(*store, first, one));
  const auto two = test::PatternBytes(2 << 20, 44);
  {
    ASSERT_OK_AND_ASSIGN(auto w, store->Begin(CopyMeta("n", 0, 2, 1, two)));
    ASSERT_OK(w->Write(0, std::span(two).first(two.size() / 2)));  // half of it arrived
  }
  ASSERT_OK_AND_ASSIGN(auto listed, store->List());
  EXPECT_TRUE(listed.empty());
  EXPECT_EQ(store->Read(first).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(DirNames(dir()).empty());
  EXPECT_EQ(store->bytes(), 0u);
}

// A replica a reader has mapped (a rebuild reading it) is never given up for the next one.
TEST_F(ReplicaStoreTest, BudgetModeNeverReceivesIntoAReplicaBeingRead) {
  const auto one = test::PatternBytes(2 << 20, 45);
  auto store = OpenWithRoomForOne(tmp_.path(), one.size());
  ASSERT_TRUE(store);
  const ReplicaMeta first = CopyMeta("n", 0, 1, 1, one);
  ASSERT_OK(Put(*store, first, one));
  ASSERT_OK_AND_ASSIGN(ReplicaView view, store->Read(first));
  const auto two = test::PatternBytes(2 << 20, 46);
  ASSERT_OK(Put(*store, CopyMeta("n", 0, 2, 1, two), two));
  EXPECT_EQ(store->received_in_place(), 0u);
  EXPECT_TRUE(std::equal(view.payload.begin(), view.payload.end(), one.begin(), one.end()));
  ASSERT_OK_AND_ASSIGN(auto listed, store->List());
  EXPECT_EQ(listed.size(), 2u);
}

// Two readers of one replica (a rebuild and a flush): it stays pinned until both are done.
TEST_F(ReplicaStoreTest, BudgetModeKeepsAReplicaPinnedUntilItsLastReaderIsDone) {
  const auto one = test::PatternBytes(2 << 20, 47);
  auto store = OpenWithRoomForOne(tmp_.path(), one.size());
  ASSERT_TRUE(store);
  const ReplicaMeta first = CopyMeta("n", 0, 1, 1, one);
  ASSERT_OK(Put(*store, first, one));
  auto a = std::make_optional(store->Read(first));
  ASSERT_TRUE(a->ok()) << a->status().ToString();
  ASSERT_OK_AND_ASSIGN(ReplicaView b, store->Read(first));
  a.reset();  // the first reader is done, the second still reads
  const auto two = test::PatternBytes(2 << 20, 48);
  ASSERT_OK(Put(*store, CopyMeta("n", 0, 2, 1, two), two));
  EXPECT_EQ(store->received_in_place(), 0u);
  EXPECT_TRUE(std::equal(b.payload.begin(), b.payload.end(), one.begin(), one.end()));
}

// After a restart from an older step (a later save attempt), the replica of the earlier
// attempt is the previous one, whatever its step: it is given up, not kept past the budget.
TEST_F(ReplicaStoreTest, BudgetModeGivesUpTheReplicaOfAnEarlierAttemptWhateverItsStep) {
  const auto one = test::PatternBytes(2 << 20, 49);
  auto store = OpenWithRoomForOne(tmp_.path(), one.size());
  ASSERT_TRUE(store);
  ASSERT_OK(Put(*store, CopyMeta("n", 0, 9, 1, one), one));  // attempt 4
  const auto two = test::PatternBytes(2 << 20, 50);
  const ReplicaMeta later = CopyMeta("n", 0, 5, 2, two);  // attempt 7, an older step
  ASSERT_OK(Put(*store, later, two));
  EXPECT_EQ(store->received_in_place(), 1u);
  ASSERT_OK_AND_ASSIGN(auto listed, store->List());
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].step, 5u);
}

// The same snapshot pushed again (the sender retried) never gives up the whole replica of it
// that the node holds: if the second transfer is cut off, the first copy is still served.
TEST_F(ReplicaStoreTest, BudgetModeNeverGivesUpTheSnapshotBeingReceivedAgain) {
  const auto one = test::PatternBytes(2 << 20, 51);
  auto store = OpenWithRoomForOne(tmp_.path(), one.size());
  ASSERT_TRUE(store);
  const ReplicaMeta first = CopyMeta("n", 0, 1, 1, one);
  ASSERT_OK(Put(*store, first, one));
  {
    auto w = store->Begin(first);
    if (w.ok()) ASSERT_OK((*w)->Write(0, std::span(one).first(one.size() / 2)));  // cut off
  }
  EXPECT_EQ(store->received_in_place(), 0u);
  ASSERT_OK_AND_ASSIGN(ReplicaView view, store->Read(first));
  EXPECT_TRUE(std::equal(view.payload.begin(), view.payload.end(), one.begin(), one.end()));
}

// Spares are kept only while the store's files fit the budget, and not at all without one
// when spares_without_budget is off (the agent's default).
TEST_F(ReplicaStoreTest, SparesNeverPassTheBudget) {
  const auto one = test::PatternBytes(4 << 20, 47);
  const uint64_t file = kHeader + one.size();
  auto budget = std::make_shared<uint64_t>(3 * file);
  auto store = OpenWithBudget(tmp_.path(), budget);
  ASSERT_TRUE(store);
  auto spares = [&] {
    size_t n = 0;
    for (const std::string& name : DirNames(dir())) n += name.starts_with(".spare-");
    return n;
  };
  // Room for two files: the previous replica stays while the next is received, then it is
  // kept as a spare (2 files <= the budget) and the next push reuses it.
  ASSERT_OK(Put(*store, CopyMeta("n", 0, 1, 1, one), one));
  ASSERT_OK(Put(*store, CopyMeta("n", 0, 2, 1, one), one));
  EXPECT_EQ(store->received_in_place(), 0u);
  ASSERT_OK(store->Prune(1));
  EXPECT_EQ(spares(), 1u);
  EXPECT_EQ(store->spare_bytes(), file);
  EXPECT_LE(store->bytes(), *budget);
  // The budget shrinks (the job's slots grew) below two files: the pruned replica is not kept.
  ASSERT_OK(Put(*store, CopyMeta("n", 0, 3, 1, one), one));  // into the spare
  EXPECT_EQ(spares(), 0u);
  *budget = file + file / 2;
  ASSERT_OK(store->Prune(1));
  EXPECT_EQ(spares(), 0u);
  EXPECT_EQ(DirNames(dir()), std::vector<std::string>{"n.rank-0.step-3.1.copy-0"});
  // Every later push stays within it: received in place, no spare.
  for (uint64_t step = 4; step < 8; ++step) {
    ASSERT_OK(Put(*store, CopyMeta("n", 0, step, 1, one), one));
    ASSERT_OK(store->Prune(1));
    EXPECT_LE(store->bytes(), *budget);
    EXPECT_EQ(spares(), 0u);
  }
  EXPECT_EQ(store->received_in_place(), 4u);
  // Spares left from a roomier budget: a Begin that would pass the budget takes one and
  // removes the others.
  *budget = 4 * file;
  ASSERT_OK(Put(*store, CopyMeta("n", 0, 8, 1, one), one));
  ASSERT_OK(Put(*store, CopyMeta("m", 0, 1, 1, one), one));
  ASSERT_OK(Put(*store, CopyMeta("m", 0, 2, 1, one), one));
  ASSERT_OK(store->Prune(1));
  ASSERT_EQ(spares(), 2u);
  EXPECT_LE(store->bytes(), *budget);
  *budget = file + file / 2;
  ASSERT_OK(Put(*store, CopyMeta("k", 0, 1, 1, one), one));  // another source: a new file
  EXPECT_EQ(spares(), 0u);
  EXPECT_EQ(DirNames(dir()),
            (std::vector<std::string>{"k.rank-0.step-1.1.copy-0", "m.rank-0.step-2.1.copy-0",
                                      "n.rank-0.step-8.1.copy-0"}));

  // No budget and spares_without_budget off: a pruned replica is simply removed.
  test::TempDir other{"replica-store-nospares"};
  auto none = OpenWithBudget(other.path(), std::make_shared<uint64_t>(0), false);
  ASSERT_TRUE(none);
  ASSERT_OK(Put(*none, CopyMeta("n", 0, 1, 1, one), one));
  ASSERT_OK(Put(*none, CopyMeta("n", 0, 2, 1, one), one));
  ASSERT_OK(none->Prune(1));
  EXPECT_EQ(DirNames(other.Join("replicas")), std::vector<std::string>{"n.rank-0.step-2.1.copy-0"});
  EXPECT_EQ(none->received_in_place(), 0u);
}

// Commit with the CRCs given at the end (a push's receiver): a wrong one is Corruption and
// nothing becomes visible.
TEST_F(ReplicaStoreTest, CommitWithCrcsGivenAtTheEnd) {
  const auto payload = test::PatternBytes(100000, 26);
  ReplicaMeta m = CopyMeta("n", 0, 1, 1, payload);
  const uint32_t crc = m.payload_crc;
  m.image_crc = m.payload_crc = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto w, store_->Begin(m));
    ASSERT_OK(w->Write(0, payload));
    EXPECT_EQ(w->Commit(crc ^ 1, crc ^ 1, std::nullopt).code(), StatusCode::kCorruption);
    EXPECT_EQ(w->Commit(crc, crc, crc ^ 1).code(), StatusCode::kCorruption);
    EXPECT_EQ(w->Commit(crc, crc ^ 2, crc).code(), StatusCode::kCorruption);  // copy: equal
  }
  EXPECT_TRUE(DirNames(dir()).empty());
  ASSERT_OK_AND_ASSIGN(auto w, store_->Begin(m));
  ASSERT_OK(w->Write(0, payload));
  ASSERT_OK(w->Commit(crc, crc, std::nullopt));
  ASSERT_OK_AND_ASSIGN(auto list, store_->List());
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].payload_crc, crc);
  EXPECT_EQ(list[0].image_crc, crc);
  EXPECT_OK(store_->Read(list[0]));
}

TEST(ReplicaStoreOpenTest, OpenFailsNamingTheDirectory) {
  test::TempDir tmp("replica-store-open");
  ASSERT_TRUE(tmp.ok());
  auto missing = ReplicaStore::Open(tmp.Join("no-such-job"));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("no-such-job/replicas"), std::string::npos);
  std::ofstream(tmp.Join("replicas")) << "a file";
  auto file = ReplicaStore::Open(tmp.path());
  ASSERT_FALSE(file.ok());
  EXPECT_NE(file.status().message().find("replicas"), std::string::npos);
}

// A small tmpfs on a temporary directory, unmounted when the test ends.
struct SmallTmpfs {
  explicit SmallTmpfs(const std::string& name) : tmp(name) {}
  ~SmallTmpfs() {
    if (mounted) ::umount2(tmp.path().c_str(), MNT_DETACH);
  }
  // Mounts it with `options`: empty when mounted, or why it could not be (a reason to skip).
  std::string Mount(const char* options) {
    if (::geteuid() != 0) return "mounting a small tmpfs needs root";
    if (::mount("tmpfs", tmp.path().c_str(), "tmpfs", 0, options) != 0) {
      return std::string("cannot mount a tmpfs: ") + std::strerror(errno);
    }
    mounted = true;
    return "";
  }
  test::TempDir tmp;
  bool mounted = false;
};

TEST(ReplicaStoreFullTest, AFullTmpfsIsResourceExhaustedNotSigbus) {
  SmallTmpfs fs("replica-store-full");
  ASSERT_TRUE(fs.tmp.ok());
  if (std::string why = fs.Mount("size=1m,mode=0700"); !why.empty()) GTEST_SKIP() << why;
  const test::TempDir& tmp = fs.tmp;
  ASSERT_OK_AND_ASSIGN(auto store, ReplicaStore::Open(tmp.path()));

  const auto big = test::PatternBytes(600 << 10, 13);
  const ReplicaMeta first = CopyMeta("n", 0, 1, 1, big);
  // Reserved: every byte of the payload can be written.
  ASSERT_OK_AND_ASSIGN(auto w1, store->Begin(first));
  // A second one of the same size does not fit beside it while the first is being received.
  const ReplicaMeta second = CopyMeta("n", 1, 1, 1, big);
  auto w2 = store->Begin(second);
  ASSERT_EQ(w2.status().code(), StatusCode::kResourceExhausted) << w2.status().ToString();
  EXPECT_NE(w2.status().message().find(std::to_string(kHeader + big.size()) + " bytes"),
            std::string::npos)
      << w2.status().ToString();
  ASSERT_OK(w1->Write(0, big));
  ASSERT_OK(w1->Commit());
  // Nor after it was committed; the failed attempt left no file behind.
  auto w3 = store->Begin(second);
  ASSERT_EQ(w3.status().code(), StatusCode::kResourceExhausted) << w3.status().ToString();
  EXPECT_EQ(DirNames(tmp.Join("replicas")), std::vector<std::string>{"n.rank-0.step-1.1.copy-0"});
  // Fill what is left with a plain file, so that even a small replica finds no room.
  {
    std::ofstream f(tmp.Join("filler"), std::ios::binary);
    const std::string block(4096, 'x');
    while (f.write(block.data(), block.size())) {
    }
  }
  const auto tiny = test::PatternBytes(1, 14);
  auto w4 = store->Begin(CopyMeta("n", 2, 1, 1, tiny));
  EXPECT_EQ(w4.status().code(), StatusCode::kResourceExhausted) << w4.status().ToString();
  // Pruning makes room again.
  ASSERT_OK_AND_ASSIGN(uint64_t freed, store->Prune(0));
  EXPECT_EQ(freed, kHeader + big.size());
  ASSERT_OK(Put(*store, CopyMeta("n", 2, 1, 1, tiny), tiny));
  ASSERT_OK_AND_ASSIGN(auto list, store->List());
  EXPECT_EQ(list.size(), 1u);
}

}  // namespace
}  // namespace safepoint::replica::replica_store_test

namespace safepoint::replica::replica_store_test {
namespace {

// Spares hold shared memory; a Begin that needs it removes them first, and a replica that does
// not fit even then is still ResourceExhausted (never a SIGBUS), leaving no file behind.
TEST(ReplicaStoreFullTest, SparesGiveWayWhenMemoryIsNeeded) {
  SmallTmpfs fs("replica-store-spares");
  ASSERT_TRUE(fs.tmp.ok());
  if (std::string why = fs.Mount("size=8m,mode=0700"); !why.empty()) GTEST_SKIP() << why;
  const test::TempDir& tmp = fs.tmp;
  ASSERT_OK_AND_ASSIGN(auto store, ReplicaStore::Open(tmp.path()));
  const auto mid = test::PatternBytes(3 << 19, 31);  // 1.5 MiB
  for (uint32_t rank : {0, 1})
    for (uint64_t step : {1, 2}) ASSERT_OK(Put(*store, CopyMeta("n", rank, step, 1, mid), mid));
  ASSERT_OK(store->Prune(1));
  auto spares = [&] {
    int n = 0;
    for (const std::string& name : DirNames(tmp.Join("replicas"))) n += name.starts_with(".");
    return n;
  };
  ASSERT_EQ(spares(), 2);
  // 4 MiB: one spare's pages and the other's freed memory.
  const auto big = test::PatternBytes(4 << 20, 32);
  ASSERT_OK(Put(*store, CopyMeta("n", 2, 1, 1, big), big));
  EXPECT_EQ(spares(), 0);
  ASSERT_OK(store->Prune(0));
  ASSERT_EQ(spares(), 3);
  EXPECT_GT(store->bytes(), 0u);
  // Too big even without spares.
  const auto huge = test::PatternBytes(9 << 20, 33);
  auto w = store->Begin(CopyMeta("n", 3, 1, 1, huge));
  ASSERT_EQ(w.status().code(), StatusCode::kResourceExhausted) << w.status().ToString();
  EXPECT_TRUE(DirNames(tmp.Join("replicas")).empty());
  EXPECT_EQ(store->bytes(), 0u);
  // ReleaseSpares gives their memory back.
  ASSERT_OK(Put(*store, CopyMeta("n", 0, 5, 1, mid), mid));
  ASSERT_OK(store->Prune(0));
  ASSERT_EQ(spares(), 1);
  EXPECT_GE(store->ReleaseSpares(), mid.size());
  EXPECT_EQ(spares(), 0);
}

}  // namespace
}  // namespace safepoint::replica::replica_store_test
