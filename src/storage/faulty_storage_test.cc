// Tests of FaultyStorage: every fault point fires on the Nth operation with the documented code,
// names the object, leaves nothing published, and stops firing when cleared; short writes,
// sticky faults and the simulated power loss (DropUnsynced). Each test runs over an in-memory
// base and over a POSIX base in a fresh directory, where leftovers would be real files.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "safepoint/faulty_storage.h"
#include "safepoint/storage.h"

namespace safepoint {

// Readable test names in gtest output (found by argument-dependent lookup).
void PrintTo(FaultOp op, std::ostream* os) { *os << FaultOpName(op); }
void PrintTo(FaultKind kind, std::ostream* os) {
  *os << (kind == FaultKind::kEIO ? "EIO" : kind == FaultKind::kENOSPC ? "ENOSPC" : "short write");
}

namespace {

#define ASSERT_OK(expr)                                    \
  do {                                                     \
    const ::safepoint::Status assert_ok_ = (expr);         \
    ASSERT_TRUE(assert_ok_.ok()) << assert_ok_.ToString(); \
  } while (0)

std::vector<std::byte> Bytes(size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 31 + seed * 7) & 0xff);
  return v;
}

enum class BaseKind { kMemory, kPosix };

// A base storage plus the FaultyStorage over it.
class FaultyFixture {
 public:
  explicit FaultyFixture(BaseKind kind) {
    if (kind == BaseKind::kMemory) {
      base_ = NewMemoryStorage();
    } else {
      std::string tmpl = "/tmp/safepoint-faulty-test-XXXXXX";
      if (::mkdtemp(tmpl.data()) == nullptr) return;
      dir_ = tmpl;
      auto opened = NewPosixStorage(dir_);
      if (!opened.ok()) return;
      base_ = std::move(opened).value();
    }
    faulty_ = std::make_unique<FaultyStorage>(base_);
  }
  ~FaultyFixture() {
    faulty_.reset();
    base_.reset();
    if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }
  bool ok() const { return faulty_ != nullptr; }
  // Files with ".tmp." in their name in the POSIX base (0 for the memory base).
  size_t TemporaryFiles() const {
    size_t n = 0;
    if (dir_.empty()) return n;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir_)) {
      if (entry.path().filename().string().find(".tmp.") != std::string::npos) ++n;
    }
    return n;
  }
  Storage& base() { return *base_; }
  FaultyStorage& faulty() { return *faulty_; }
  std::unique_ptr<FaultyStorage>& faulty_ptr() { return faulty_; }

 private:
  std::string dir_;
  std::shared_ptr<Storage> base_;
  std::unique_ptr<FaultyStorage> faulty_;
};

std::string BaseName(BaseKind kind) { return kind == BaseKind::kMemory ? "Memory" : "Posix"; }
void PrintTo(BaseKind kind, std::ostream* os) { *os << BaseName(kind); }

bool IsWriteOp(FaultOp op) {
  return op == FaultOp::kCreate || op == FaultOp::kWrite || op == FaultOp::kSync ||
         op == FaultOp::kPublish;
}

std::string ObjectName(int i) { return "step/obj-" + std::to_string(i); }

// One unit of work that performs exactly one operation of `op` on object ObjectName(i).
Status RunUnit(FaultyStorage& fs, FaultOp op, int i) {
  const std::string name = ObjectName(i);
  switch (op) {
    case FaultOp::kCreate:
    case FaultOp::kWrite:
    case FaultOp::kSync:
    case FaultOp::kPublish: {
      auto w = fs.Create(name, 100);
      if (!w.ok()) return w.status();
      SP_RETURN_IF_ERROR((*w)->WriteAt(0, Bytes(100, i)));
      return (*w)->Publish();  // on failure the writer is destroyed here, which aborts it
    }
    case FaultOp::kOpen:
    case FaultOp::kRead: {
      auto r = fs.Open(name);
      if (!r.ok()) return r.status();
      std::vector<std::byte> buf((*r)->size());
      SP_RETURN_IF_ERROR((*r)->ReadAt(0, buf));
      return buf == Bytes(100, i) ? Status::OK() : Corruption(name + ": wrong data read back");
    }
    case FaultOp::kList: {
      auto list = fs.List(name);
      if (!list.ok()) return list.status();
      return list->size() == 1 ? Status::OK() : Corruption(name + ": not listed");
    }
    case FaultOp::kDelete:
      return fs.Delete(name);
    case FaultOp::kCount_:
      break;
  }
  return InvalidArgument("bad op");
}

void Populate(Storage& storage, int i) {
  auto w = storage.Create(ObjectName(i), 100);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_OK((*w)->WriteAt(0, Bytes(100, i)));
  ASSERT_OK((*w)->Publish());
}

bool Exists(Storage& storage, int i) { return storage.Open(ObjectName(i)).ok(); }

class FaultyStorageFaultPointTest
    : public ::testing::TestWithParam<std::tuple<FaultOp, FaultKind, BaseKind>> {};

TEST_P(FaultyStorageFaultPointTest, FiresOnNthOperationThenClears) {
  const auto [op, kind, base_kind] = GetParam();
  FaultyFixture fx(base_kind);
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  if (!IsWriteOp(op)) {
    for (int i = 1; i <= 4; ++i) Populate(fx.base(), i);
  }
  const StatusCode expected =
      kind == FaultKind::kENOSPC ? StatusCode::kResourceExhausted : StatusCode::kIOError;

  fs.Arm(FaultSpec{op, /*nth=*/2, kind, /*sticky=*/false});
  ASSERT_OK(RunUnit(fs, op, 1));
  const uint64_t count_before = fs.count(op);
  Status s = RunUnit(fs, op, 2);
  EXPECT_EQ(s.code(), expected) << s.ToString();
  EXPECT_EQ(fs.count(op), count_before + 1);
  EXPECT_EQ(fs.fired(), 1u);
  const std::string subject = op == FaultOp::kList ? fx.base().uri() : fs.Describe(ObjectName(2));
  EXPECT_NE(s.message().find(subject), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("injected"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find(FaultOpName(op)), std::string::npos) << s.ToString();

  if (IsWriteOp(op)) {
    // Nothing published, no temporary data left behind in the base.
    EXPECT_FALSE(Exists(fx.base(), 2));
    auto listed = fx.base().List("");
    ASSERT_TRUE(listed.ok());
    ASSERT_EQ(listed->size(), 1u);
    EXPECT_EQ((*listed)[0].name, ObjectName(1));
    auto leftovers = fx.base().RemoveLeftovers("");
    ASSERT_TRUE(leftovers.ok()) << leftovers.status().ToString();
    EXPECT_EQ(*leftovers, 0u);
  } else if (op == FaultOp::kDelete) {
    EXPECT_TRUE(Exists(fx.base(), 2)) << "a failed delete removed the object";
  }

  // Not sticky: the next operation succeeds.
  ASSERT_OK(RunUnit(fs, op, 3));
  EXPECT_EQ(fs.fired(), 1u);

  // Armed again for the very next operation, it fails the same unit that succeeded before;
  // after Clear() that unit succeeds.
  fs.Arm(FaultSpec{op, /*nth=*/1, kind, /*sticky=*/true});
  EXPECT_EQ(RunUnit(fs, op, 2).code(), expected);
  EXPECT_EQ(RunUnit(fs, op, 2).code(), expected);
  fs.Clear();
  ASSERT_OK(RunUnit(fs, op, 2));
  if (IsWriteOp(op)) {
    EXPECT_TRUE(Exists(fx.base(), 2));
  }
  if (op == FaultOp::kDelete) {
    EXPECT_FALSE(Exists(fx.base(), 2));
  }
  EXPECT_EQ(fs.fired(), 3u);
}

INSTANTIATE_TEST_SUITE_P(
    AllOps, FaultyStorageFaultPointTest,
    ::testing::Combine(::testing::Values(FaultOp::kCreate, FaultOp::kWrite, FaultOp::kSync,
                                         FaultOp::kPublish, FaultOp::kOpen, FaultOp::kRead,
                                         FaultOp::kList, FaultOp::kDelete),
                       ::testing::Values(FaultKind::kEIO, FaultKind::kENOSPC),
                       ::testing::Values(BaseKind::kMemory, BaseKind::kPosix)),
    [](const auto& info) {
      std::string name(FaultOpName(std::get<0>(info.param)));
      name[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(name[0])));
      name += std::get<1>(info.param) == FaultKind::kEIO ? "EIO" : "ENOSPC";
      return name + "Over" + BaseName(std::get<2>(info.param));
    });

class FaultyStorageTest : public ::testing::TestWithParam<BaseKind> {};

TEST_P(FaultyStorageTest, ShortWriteWritesHalfThenFails) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  fs.Arm(FaultSpec{FaultOp::kWrite, 2, FaultKind::kShortWrite, false});
  auto w = fs.Create("short", 0);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const std::vector<std::byte> data = Bytes(1000, 1);
  ASSERT_OK((*w)->WriteAt(0, std::span(data).first(10)));
  Status s = (*w)->WriteAt(10, std::span(data).subspan(10));
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_NE(s.message().find("short write"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find(fs.Describe("short")), std::string::npos) << s.ToString();
  if (GetParam() == BaseKind::kMemory) {
    // The memory base publishes whatever reached it: exactly the first half of the request.
    ASSERT_OK((*w)->Publish());
    auto r = fx.base().Open("short");
    ASSERT_TRUE(r.ok());
    ASSERT_EQ((*r)->size(), 10u + 495u);
    std::vector<std::byte> back((*r)->size());
    ASSERT_OK((*r)->ReadAt(0, back));
    EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin()));
  } else {
    // The POSIX base only sees a successful half write; the caller aborts as it must.
    (*w)->Abort();
    EXPECT_FALSE(fx.base().Open("short").ok());
    auto leftovers = fx.base().RemoveLeftovers("");
    ASSERT_TRUE(leftovers.ok());
    EXPECT_EQ(*leftovers, 0u);
  }
  EXPECT_EQ(fs.fired(), 1u);
}

TEST_P(FaultyStorageTest, StickyFaultFailsEveryLaterOperationUntilCleared) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  Populate(fx.base(), 1);
  auto r = fs.Open(ObjectName(1));
  ASSERT_TRUE(r.ok());
  std::vector<std::byte> buf(10);
  fs.Arm(FaultSpec{FaultOp::kRead, 3, FaultKind::kEIO, /*sticky=*/true});
  ASSERT_OK((*r)->ReadAt(0, buf));
  ASSERT_OK((*r)->ReadAt(0, buf));
  for (int i = 0; i < 5; ++i) EXPECT_EQ((*r)->ReadAt(0, buf).code(), StatusCode::kIOError);
  EXPECT_EQ(fs.fired(), 5u);
  EXPECT_EQ(fs.count(FaultOp::kRead), 7u);
  fs.Clear();
  ASSERT_OK((*r)->ReadAt(0, buf));
  EXPECT_EQ(fs.fired(), 5u);
}

TEST_P(FaultyStorageTest, ArmReplacesTheFaultAndRestartsTheCount) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  fs.Arm(FaultSpec{FaultOp::kCreate, 1, FaultKind::kEIO, false});
  fs.Arm(FaultSpec{FaultOp::kCreate, 2, FaultKind::kENOSPC, false});
  EXPECT_TRUE(fs.Create("a", 0).ok());
  auto second = fs.Create("b", 0);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted);
  // Re-arming resets the count: "nth" counts from the Arm() call.
  fs.Arm(FaultSpec{FaultOp::kCreate, 2, FaultKind::kEIO, false});
  EXPECT_TRUE(fs.Create("c", 0).ok());
  EXPECT_EQ(fs.Create("d", 0).status().code(), StatusCode::kIOError);
  EXPECT_EQ(fs.count(FaultOp::kCreate), 4u);
  EXPECT_EQ(fs.count(FaultOp::kOpen), 0u);
}

TEST_P(FaultyStorageTest, DropUnsyncedLosesUnpublishedObjects) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  {
    auto kept = fs.Create("kept", 0);
    ASSERT_TRUE(kept.ok());
    ASSERT_OK((*kept)->WriteAt(0, Bytes(100, 1)));
    ASSERT_OK((*kept)->Publish());
  }
  auto lost1 = fs.Create("lost/1", 0);
  auto lost2 = fs.Create("lost/2", 0);
  ASSERT_TRUE(lost1.ok() && lost2.ok());
  ASSERT_OK((*lost1)->WriteAt(0, Bytes(5000, 2)));
  ASSERT_OK((*lost2)->WriteAt(0, Bytes(5000, 3)));
  if (GetParam() == BaseKind::kPosix) {
    ASSERT_EQ(fx.TemporaryFiles(), 2u);
  }
  const uint64_t epoch = fs.epoch();
  fs.DropUnsynced();
  EXPECT_EQ(fs.epoch(), epoch + 1);

  // The temporary data is gone from the base already, before the writers are told.
  EXPECT_EQ(fx.TemporaryFiles(), 0u);
  auto leftovers = fx.base().RemoveLeftovers("");
  ASSERT_TRUE(leftovers.ok()) << leftovers.status().ToString();
  EXPECT_EQ(*leftovers, 0u);

  Status w = (*lost1)->WriteAt(5000, Bytes(10, 4));
  EXPECT_EQ(w.code(), StatusCode::kIOError) << w.ToString();
  EXPECT_NE(w.message().find(fs.Describe("lost/1")), std::string::npos) << w.ToString();
  Status p = (*lost1)->Publish();
  EXPECT_EQ(p.code(), StatusCode::kIOError) << p.ToString();
  EXPECT_EQ((*lost2)->Publish().code(), StatusCode::kIOError);
  (*lost2)->Abort();

  auto list = fs.List("");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name, "kept");

  // Writers created after the power loss work normally.
  auto after = fs.Create("lost/1", 0);
  ASSERT_TRUE(after.ok());
  ASSERT_OK((*after)->WriteAt(0, Bytes(10, 5)));
  ASSERT_OK((*after)->Publish());
  EXPECT_TRUE(fx.base().Open("lost/1").ok());
}

TEST_P(FaultyStorageTest, DropUnsyncedWhileThreadsAreWriting) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  auto w = fs.Create("busy", 0);
  ASSERT_TRUE(w.ok());
  const std::vector<std::byte> chunk = Bytes(4096, 6);
  std::atomic<int> writes{0};
  std::atomic<int> lost{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t i = 0;; ++i) {
        Status s = (*w)->WriteAt((i * 4 + t) % 256 * chunk.size(), chunk);
        if (!s.ok()) {
          if (s.code() == StatusCode::kIOError) ++lost;
          return;
        }
        ++writes;
      }
    });
  }
  while (writes.load() < 100) std::this_thread::yield();
  fs.DropUnsynced();
  for (auto& t : threads) t.join();
  EXPECT_EQ(lost.load(), 4);
  EXPECT_EQ((*w)->Publish().code(), StatusCode::kIOError);
  EXPECT_FALSE(fx.base().Open("busy").ok());
}

TEST_P(FaultyStorageTest, ObjectsOutliveTheStorageThatMadeThem) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  auto w = fx.faulty().Create("orphan", 0);
  ASSERT_TRUE(w.ok());
  fx.faulty_ptr().reset();
  ASSERT_OK((*w)->WriteAt(0, Bytes(10, 7)));
  ASSERT_OK((*w)->Publish());
  EXPECT_TRUE(fx.base().Open("orphan").ok());
}

TEST_P(FaultyStorageTest, ForwardsEverythingWithoutFaults) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  EXPECT_EQ(fs.uri(), "faulty+" + fx.base().uri());
  EXPECT_EQ(fs.Describe("x"), fx.base().Describe("x"));
  EXPECT_EQ(fs.capabilities().durable, fx.base().capabilities().durable);
  EXPECT_EQ(fs.Create("../x", 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fs.count(FaultOp::kCreate), 0u) << "an invalid name counted as an operation";
  EXPECT_EQ(FaultOpName(FaultOp::kSync), "sync");
  EXPECT_EQ(fs.fired(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Bases, FaultyStorageTest,
                         ::testing::Values(BaseKind::kMemory, BaseKind::kPosix),
                         [](const auto& info) { return BaseName(info.param); });

}  // namespace
}  // namespace safepoint
