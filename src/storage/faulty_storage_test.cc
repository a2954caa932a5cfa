// Tests of FaultyStorage: every fault point fires on the Nth operation with the documented code,
// names the object, leaves nothing published (but for a failed directory sync, which leaves the
// object visible), and stops firing when cleared; short writes, sticky faults, flipped bits,
// seeded 1-in-N faults and the simulated power loss (unpublished data, names whose directory
// sync failed or lied, torn data). Each test runs over an in-memory base and over a POSIX base
// in a fresh directory, where leftovers would be real files.
#include "storage/faulty/faulty_storage.h"

#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "safepoint/storage.h"
#include "testing/test_util.h"

namespace safepoint {

// Readable test names in gtest output (found by argument-dependent lookup).
void PrintTo(FaultOp op, std::ostream* os) { *os << FaultOpName(op); }
void PrintTo(FaultKind kind, std::ostream* os) { *os << FaultKindName(kind); }

namespace faulty_storage_test {
namespace {

using test::PatternBytes;
using test::PutObject;
using test::ReadWholeObject;
using test::TempDir;

enum class BaseKind { kMemory, kPosix };

// A base storage plus the FaultyStorage over it.
class FaultyFixture {
 public:
  explicit FaultyFixture(BaseKind kind, uint64_t seed = 0) {
    if (kind == BaseKind::kMemory) {
      base_ = NewMemoryStorage();
    } else {
      if (!dir_.ok()) return;
      auto opened = NewPosixStorage(dir_.path());
      if (!opened.ok()) return;
      base_ = std::move(opened).value();
    }
    faulty_ = std::make_unique<FaultyStorage>(base_, seed);
  }
  bool ok() const { return faulty_ != nullptr; }
  // Files with ".tmp." in their name in the POSIX base (0 for the memory base).
  size_t TemporaryFiles() const {
    size_t n = 0;
    if (!dir_.ok()) return n;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir_.path())) {
      if (entry.path().filename().string().find(".tmp.") != std::string::npos) ++n;
    }
    return n;
  }
  Storage& base() { return *base_; }
  FaultyStorage& faulty() { return *faulty_; }
  std::unique_ptr<FaultyStorage>& faulty_ptr() { return faulty_; }

 private:
  TempDir dir_{"safepoint-faulty-test"};  // before base_: removed after it
  std::shared_ptr<Storage> base_;
  std::unique_ptr<FaultyStorage> faulty_;
};

std::string BaseName(BaseKind kind) { return kind == BaseKind::kMemory ? "Memory" : "Posix"; }
void PrintTo(BaseKind kind, std::ostream* os) { *os << BaseName(kind); }

bool IsWriteOp(FaultOp op) {
  return op == FaultOp::kCreate || op == FaultOp::kWrite || op == FaultOp::kSync ||
         op == FaultOp::kPublish || op == FaultOp::kDirSync;
}

std::string ObjectName(int i) { return "step/obj-" + std::to_string(i); }

// One unit of work that performs exactly one operation of `op` on object ObjectName(i).
Status RunUnit(FaultyStorage& fs, FaultOp op, int i) {
  const std::string name = ObjectName(i);
  switch (op) {
    case FaultOp::kCreate:
    case FaultOp::kWrite:
    case FaultOp::kSync:
    case FaultOp::kPublish:
    case FaultOp::kDirSync: {
      auto w = fs.Create(name, 100);
      if (!w.ok()) return w.status();
      SP_RETURN_IF_ERROR((*w)->WriteAt(0, PatternBytes(100, i)));
      return (*w)->Publish();  // on failure the writer is destroyed here, which aborts it
    }
    case FaultOp::kOpen:
    case FaultOp::kRead: {
      auto r = fs.Open(name);
      if (!r.ok()) return r.status();
      std::vector<std::byte> buf((*r)->size());
      SP_RETURN_IF_ERROR((*r)->ReadAt(0, buf));
      return buf == PatternBytes(100, i) ? Status::OK()
                                         : Corruption(name + ": wrong data read back");
    }
    case FaultOp::kList: {
      auto list = fs.List(name);
      if (!list.ok()) return list.status();
      return list->size() == 1 ? Status::OK() : Corruption(name + ": not listed");
    }
    case FaultOp::kDelete:
    case FaultOp::kDeleteDirSync:
      return fs.Delete(name);
    case FaultOp::kCount_:
      break;
  }
  return InvalidArgument("bad op");
}

void Populate(Storage& storage, int i) {
  ASSERT_OK(PutObject(storage, ObjectName(i), PatternBytes(100, i)));
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
  // A failed directory sync is an I/O error whatever the errno: the object was published.
  const StatusCode expected = kind == FaultKind::kENOSPC && op != FaultOp::kDirSync
                                  ? StatusCode::kResourceExhausted
                                  : StatusCode::kIOError;

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

  if (op == FaultOp::kDirSync) {
    // Published before the directory sync failed: visible, and the error names the directory.
    EXPECT_EQ(ReadWholeObject(fx.base(), ObjectName(2)), PatternBytes(100, 2));
    EXPECT_NE(s.message().find(fs.Describe("step") + ": dirsync"), std::string::npos)
        << s.ToString();
    EXPECT_EQ(fs.undurable(), 1u);
    ASSERT_OK(fs.Delete(ObjectName(2)));
  } else if (IsWriteOp(op)) {
    // Nothing published, no temporary data left behind in the base.
    EXPECT_FALSE(Exists(fx.base(), 2));
    auto listed = fx.base().List("");
    ASSERT_OK(listed);
    ASSERT_EQ(listed->size(), 1u);
    EXPECT_EQ((*listed)[0].name, ObjectName(1));
    auto leftovers = fx.base().RemoveLeftovers("");
    ASSERT_OK(leftovers);
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
                                         FaultOp::kPublish, FaultOp::kDirSync, FaultOp::kOpen,
                                         FaultOp::kRead, FaultOp::kList, FaultOp::kDelete),
                       ::testing::Values(FaultKind::kEIO, FaultKind::kENOSPC),
                       ::testing::Values(BaseKind::kMemory, BaseKind::kPosix)),
    [](const auto& info) {
      std::string name(FaultOpName(std::get<0>(info.param)));
      name[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(name[0])));
      name += FaultKindName(std::get<1>(info.param));
      return name + "Over" + BaseName(std::get<2>(info.param));
    });

class FaultyStorageTest : public ::testing::TestWithParam<BaseKind> {};

TEST_P(FaultyStorageTest, ShortWriteWritesHalfThenFails) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  fs.Arm(FaultSpec{FaultOp::kWrite, 2, FaultKind::kShortWrite, false});
  auto w = fs.Create("short", 0);
  ASSERT_OK(w);
  const std::vector<std::byte> data = PatternBytes(1000, 1);
  ASSERT_OK((*w)->WriteAt(0, std::span(data).first(10)));
  Status s = (*w)->WriteAt(10, std::span(data).subspan(10));
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_NE(s.message().find("short write"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find(fs.Describe("short")), std::string::npos) << s.ToString();
  if (GetParam() == BaseKind::kMemory) {
    // The memory base publishes whatever reached it: exactly the first half of the request.
    ASSERT_OK((*w)->Publish());
    auto r = fx.base().Open("short");
    ASSERT_OK(r);
    ASSERT_EQ((*r)->size(), 10u + 495u);
    std::vector<std::byte> back((*r)->size());
    ASSERT_OK((*r)->ReadAt(0, back));
    EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin()));
  } else {
    // The POSIX base only sees a successful half write; the caller aborts as it must.
    (*w)->Abort();
    EXPECT_FALSE(fx.base().Open("short").ok());
    auto leftovers = fx.base().RemoveLeftovers("");
    ASSERT_OK(leftovers);
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
  ASSERT_OK(r);
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
  EXPECT_OK(fs.Create("a", 0));
  auto second = fs.Create("b", 0);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted);
  // Re-arming resets the count: "nth" counts from the Arm() call.
  fs.Arm(FaultSpec{FaultOp::kCreate, 2, FaultKind::kEIO, false});
  EXPECT_OK(fs.Create("c", 0));
  EXPECT_EQ(fs.Create("d", 0).status().code(), StatusCode::kIOError);
  EXPECT_EQ(fs.count(FaultOp::kCreate), 4u);
  EXPECT_EQ(fs.count(FaultOp::kOpen), 0u);
}

TEST_P(FaultyStorageTest, PowerLossLosesUnpublishedObjects) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  ASSERT_OK(PutObject(fs, "kept", PatternBytes(100, 1)));
  auto lost1 = fs.Create("lost/1", 0);
  auto lost2 = fs.Create("lost/2", 0);
  ASSERT_TRUE(lost1.ok() && lost2.ok());
  ASSERT_OK((*lost1)->WriteAt(0, PatternBytes(5000, 2)));
  ASSERT_OK((*lost2)->WriteAt(0, PatternBytes(5000, 3)));
  if (GetParam() == BaseKind::kPosix) {
    ASSERT_EQ(fx.TemporaryFiles(), 2u);
  }
  const uint64_t epoch = fs.epoch();
  ASSERT_OK(fs.SimulatePowerLoss());
  EXPECT_EQ(fs.epoch(), epoch + 1);

  // The temporary data is gone from the base already, before the writers are told.
  EXPECT_EQ(fx.TemporaryFiles(), 0u);
  auto leftovers = fx.base().RemoveLeftovers("");
  ASSERT_OK(leftovers);
  EXPECT_EQ(*leftovers, 0u);

  Status w = (*lost1)->WriteAt(5000, PatternBytes(10, 4));
  EXPECT_EQ(w.code(), StatusCode::kIOError) << w.ToString();
  EXPECT_NE(w.message().find(fs.Describe("lost/1")), std::string::npos) << w.ToString();
  Status p = (*lost1)->Publish();
  EXPECT_EQ(p.code(), StatusCode::kIOError) << p.ToString();
  EXPECT_EQ((*lost2)->Publish().code(), StatusCode::kIOError);
  (*lost2)->Abort();

  auto list = fs.List("");
  ASSERT_OK(list);
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].name, "kept");

  // Writers created after the power loss work normally.
  ASSERT_OK(PutObject(fs, "lost/1", PatternBytes(10, 5)));
  EXPECT_OK(fx.base().Open("lost/1"));
}

TEST_P(FaultyStorageTest, PowerLossWhileThreadsAreWriting) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  auto w = fs.Create("busy", 0);
  ASSERT_OK(w);
  const std::vector<std::byte> chunk = PatternBytes(4096, 6);
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
  ASSERT_OK(fs.SimulatePowerLoss());
  for (auto& t : threads) t.join();
  EXPECT_EQ(lost.load(), 4);
  EXPECT_EQ((*w)->Publish().code(), StatusCode::kIOError);
  EXPECT_FALSE(fx.base().Open("busy").ok());
}

TEST_P(FaultyStorageTest, ObjectsOutliveTheStorageThatMadeThem) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  auto w = fx.faulty().Create("orphan", 0);
  ASSERT_OK(w);
  fx.faulty_ptr().reset();
  ASSERT_OK((*w)->WriteAt(0, PatternBytes(10, 7)));
  ASSERT_OK((*w)->Publish());
  EXPECT_OK(fx.base().Open("orphan"));
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

// A failed directory sync: the object is visible at once; a power loss takes the name back to
// what it showed before (the previous version, or nothing) unless a later successful sync of
// the same directory (a Publish or a Delete there) made it durable.
TEST_P(FaultyStorageTest, PowerLossRevertsNamesWhoseDirectorySyncFailed) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  ASSERT_OK(PutObject(fs, "a/replaced", PatternBytes(300, 1)));
  ASSERT_OK(PutObject(fs, "c/deleted", PatternBytes(300, 1)));
  fs.Arm({.op = FaultOp::kDirSync, .kind = FaultKind::kEIO, .sticky = true});
  Status replaced = PutObject(fs, "a/replaced", PatternBytes(200, 2));
  EXPECT_EQ(replaced.code(), StatusCode::kIOError) << replaced.ToString();
  EXPECT_NE(replaced.message().find(fs.Describe("a") + ": dirsync"), std::string::npos)
      << replaced.ToString();
  EXPECT_EQ(PutObject(fs, "a/replaced", PatternBytes(100, 3)).code(), StatusCode::kIOError);
  EXPECT_EQ(PutObject(fs, "a/created", PatternBytes(100, 4)).code(), StatusCode::kIOError);
  EXPECT_EQ(PutObject(fs, "b/created", PatternBytes(100, 5)).code(), StatusCode::kIOError);
  EXPECT_EQ(PutObject(fs, "c/created", PatternBytes(100, 6)).code(), StatusCode::kIOError);
  fs.Clear();
  // Visible, newest version first.
  EXPECT_EQ(ReadWholeObject(fs, "a/replaced"), PatternBytes(100, 3));
  EXPECT_EQ(ReadWholeObject(fs, "b/created"), PatternBytes(100, 5));
  EXPECT_EQ(fs.undurable(), 4u);
  // A successful publish in b/ and a delete in c/ sync those directories.
  ASSERT_OK(PutObject(fs, "b/other", PatternBytes(10, 7)));
  ASSERT_OK(fs.Delete("c/deleted"));
  EXPECT_EQ(fs.undurable(), 2u);

  ASSERT_OK(fs.SimulatePowerLoss());
  EXPECT_EQ(fs.undurable(), 0u);
  EXPECT_EQ(ReadWholeObject(fs, "a/replaced"), PatternBytes(300, 1));  // the last durable one
  EXPECT_EQ(fs.Open("a/created").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(ReadWholeObject(fs, "b/created"), PatternBytes(100, 5));
  EXPECT_EQ(ReadWholeObject(fs, "c/created"), PatternBytes(100, 6));
  // Nothing else changes at a second power loss.
  ASSERT_OK(fs.SimulatePowerLoss());
  EXPECT_EQ(ReadWholeObject(fs, "a/replaced"), PatternBytes(300, 1));
}

// A delete whose directory sync fails removes the object from view and says so (an IOError
// naming it, whatever the errno); one whose sync lies reports success. A power loss brings such
// an object back, unless a later successful sync of its directory made the removal durable.
// Deleting a missing object syncs nothing.
TEST_P(FaultyStorageTest, PowerLossBringsBackDeletesWhoseDirectorySyncFailed) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  ASSERT_OK(PutObject(fs, "a/failed", PatternBytes(100, 1)));
  ASSERT_OK(PutObject(fs, "b/lied", PatternBytes(100, 2)));
  ASSERT_OK(PutObject(fs, "c/synced_later", PatternBytes(100, 3)));
  fs.Arm({.op = FaultOp::kDeleteDirSync, .kind = FaultKind::kENOSPC});
  const Status failed = fs.Delete("a/failed");
  EXPECT_EQ(failed.code(), StatusCode::kIOError) << failed.ToString();
  EXPECT_NE(failed.message().find(fs.Describe("a") + ": deletedirsync"), std::string::npos)
      << failed.ToString();
  EXPECT_NE(failed.message().find(fs.Describe("a/failed")), std::string::npos) << failed.ToString();
  EXPECT_EQ(fs.Open("a/failed").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(fs.undurable(), 1u);
  fs.Arm({.op = FaultOp::kDeleteDirSync, .kind = FaultKind::kUnsynced});
  ASSERT_OK(fs.Delete("b/lied"));
  EXPECT_EQ(fs.Open("b/lied").status().code(), StatusCode::kNotFound);
  fs.Arm({.op = FaultOp::kDeleteDirSync, .kind = FaultKind::kEIO, .sticky = true});
  EXPECT_EQ(fs.Delete("c/synced_later").code(), StatusCode::kIOError);
  ASSERT_OK(fs.Delete("c/missing"));
  EXPECT_EQ(fs.count(FaultOp::kDeleteDirSync), 3u);
  EXPECT_EQ(fs.undurable(), 3u);
  fs.Clear();
  ASSERT_OK(PutObject(fs, "c/other", PatternBytes(10, 4)));  // syncs c/
  EXPECT_EQ(fs.undurable(), 2u);

  ASSERT_OK(fs.SimulatePowerLoss());
  EXPECT_EQ(ReadWholeObject(fs, "a/failed"), PatternBytes(100, 1));
  EXPECT_EQ(ReadWholeObject(fs, "b/lied"), PatternBytes(100, 2));
  EXPECT_EQ(fs.Open("c/synced_later").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(fs.undurable(), 0u);
}

// PublishIfAbsent passes the fault points of Publish: a failed sync or rename publishes nothing;
// a failed directory sync leaves a new object visible but not durable (a power loss removes it,
// as nothing was there before). Finding the name taken, it syncs the directory as the POSIX
// driver does: that makes the existing name durable, and a failure there is an IOError.
TEST_P(FaultyStorageTest, PublishIfAbsentHasTheFaultPointsOfPublish) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  auto publish_if_absent = [&](std::string_view name, int seed) -> Status {
    SP_ASSIGN_OR_RETURN(auto w, fs.Create(name, 0));
    SP_RETURN_IF_ERROR(w->WriteAt(0, PatternBytes(100, seed)));
    return w->PublishIfAbsent();
  };
  for (FaultOp op : {FaultOp::kSync, FaultOp::kPublish}) {
    fs.Arm({.op = op, .kind = FaultKind::kEIO});
    EXPECT_EQ(publish_if_absent("a/obj", 1).code(), StatusCode::kIOError) << FaultOpName(op);
    EXPECT_EQ(fs.Open("a/obj").status().code(), StatusCode::kNotFound);
  }
  fs.Arm({.op = FaultOp::kDirSync, .kind = FaultKind::kEIO});
  EXPECT_EQ(publish_if_absent("a/obj", 2).code(), StatusCode::kIOError);
  EXPECT_EQ(ReadWholeObject(fs, "a/obj"), PatternBytes(100, 2));
  EXPECT_EQ(fs.undurable(), 1u);
  // The name is taken: AlreadyExists, and the directory sync made the name durable.
  fs.Clear();
  EXPECT_EQ(publish_if_absent("a/obj", 3).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(fs.undurable(), 0u);
  // The same with a failing directory sync: the name is taken but not known durable.
  ASSERT_OK(publish_if_absent("b/obj", 4));
  fs.Arm({.op = FaultOp::kDirSync, .kind = FaultKind::kEIO});
  const Status taken = publish_if_absent("b/obj", 5);
  EXPECT_EQ(taken.code(), StatusCode::kIOError) << taken.ToString();
  EXPECT_NE(taken.message().find("already exists"), std::string::npos) << taken.ToString();
  EXPECT_EQ(ReadWholeObject(fs, "b/obj"), PatternBytes(100, 4));
  // A new name whose directory sync failed is gone after a power loss.
  fs.Arm({.op = FaultOp::kDirSync, .kind = FaultKind::kEIO});
  EXPECT_EQ(publish_if_absent("c/obj", 6).code(), StatusCode::kIOError);
  fs.Clear();
  ASSERT_OK(fs.SimulatePowerLoss());
  EXPECT_EQ(fs.Open("c/obj").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(ReadWholeObject(fs, "a/obj"), PatternBytes(100, 2));
  EXPECT_EQ(ReadWholeObject(fs, "b/obj"), PatternBytes(100, 4));
  EXPECT_EQ(fx.TemporaryFiles(), 0u);
}

// A data sync that lies: the object reads back whole until the power fails, and torn after it
// (cut off, or zeros from a seeded offset on), unless it was rewritten honestly before.
TEST_P(FaultyStorageTest, PowerLossTearsDataWhoseSyncLied) {
  for (uint64_t seed = 0; seed < 8; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    FaultyFixture fx(GetParam(), seed);
    ASSERT_TRUE(fx.ok());
    FaultyStorage& fs = fx.faulty();
    const std::vector<std::byte> data = PatternBytes(10000, 1);
    fs.Arm({.op = FaultOp::kSync, .kind = FaultKind::kUnsynced, .sticky = true});
    ASSERT_OK(PutObject(fs, "torn", data));
    ASSERT_OK(PutObject(fs, "rewritten", data));
    fs.Clear();
    ASSERT_OK(PutObject(fs, "rewritten", data));
    EXPECT_EQ(ReadWholeObject(fs, "torn"), data);
    EXPECT_EQ(fs.undurable(), 1u);
    ASSERT_OK(fs.SimulatePowerLoss());
    EXPECT_EQ(ReadWholeObject(fs, "rewritten"), data);
    const std::vector<std::byte> torn = ReadWholeObject(fs, "torn");
    ASSERT_LE(torn.size(), data.size());
    EXPECT_NE(torn, data);
    size_t intact = 0;  // the prefix that survived
    while (intact < torn.size() && torn[intact] == data[intact]) ++intact;
    for (size_t i = intact; i < torn.size(); ++i) {
      ASSERT_EQ(torn[i], std::byte{0}) << "offset " << i;
    }
  }
}

TEST_P(FaultyStorageTest, BitFlipChangesOneBitOfWhatIsReadOrWritten) {
  FaultyFixture fx(GetParam());
  ASSERT_TRUE(fx.ok());
  FaultyStorage& fs = fx.faulty();
  const std::vector<std::byte> data = PatternBytes(5000, 1);
  auto differing_bits = [&](const std::vector<std::byte>& got) {
    int bits = 0;
    for (size_t i = 0; i < data.size(); ++i) {
      bits += std::popcount(static_cast<unsigned>(got[i] ^ data[i]));
    }
    return bits;
  };
  ASSERT_OK(PutObject(fs, "obj", data));
  fs.Arm({.op = FaultOp::kRead, .kind = FaultKind::kBitFlip});
  const std::vector<std::byte> read = ReadWholeObject(fs, "obj");
  ASSERT_EQ(read.size(), data.size());
  EXPECT_EQ(differing_bits(read), 1);
  EXPECT_EQ(ReadWholeObject(fx.base(), "obj"), data);  // the stored data is intact
  EXPECT_EQ(ReadWholeObject(fs, "obj"), data);         // and the next read too

  fs.Arm({.op = FaultOp::kWrite, .kind = FaultKind::kBitFlip});
  ASSERT_OK(PutObject(fs, "obj", data));
  const std::vector<std::byte> stored = ReadWholeObject(fx.base(), "obj");
  ASSERT_EQ(stored.size(), data.size());
  EXPECT_EQ(differing_bits(stored), 1);
  EXPECT_EQ(fs.fired(), 2u);
}

// 1-in-N faults: the same seed fires on the same operations; another seed on others; about one
// operation in N fails.
TEST_P(FaultyStorageTest, OneInNFaultsFollowTheSeed) {
  auto failures = [&](uint64_t seed) {
    FaultyFixture fx(GetParam(), seed);
    EXPECT_TRUE(fx.ok());
    std::vector<int> failed;
    if (!fx.ok()) return failed;
    Populate(fx.base(), 1);
    fx.faulty().Arm({.op = FaultOp::kOpen, .kind = FaultKind::kEIO, .one_in = 10});
    for (int i = 0; i < 1000; ++i) {
      auto r = fx.faulty().Open(ObjectName(1));
      if (!r.ok()) {
        EXPECT_EQ(r.status().code(), StatusCode::kIOError);
        failed.push_back(i);
      }
    }
    EXPECT_EQ(fx.faulty().fired(), failed.size());
    return failed;
  };
  const std::vector<int> a = failures(1);
  EXPECT_EQ(failures(1), a);
  EXPECT_NE(failures(2), a);
  EXPECT_GT(a.size(), 50u);
  EXPECT_LT(a.size(), 200u);
}

INSTANTIATE_TEST_SUITE_P(Bases, FaultyStorageTest,
                         ::testing::Values(BaseKind::kMemory, BaseKind::kPosix),
                         [](const auto& info) { return BaseName(info.param); });

}  // namespace
}  // namespace faulty_storage_test
}  // namespace safepoint
