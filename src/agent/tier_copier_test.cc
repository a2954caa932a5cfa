// TierChain: lower storage tiers filled from the tier above on their own schedules.
#include "agent/tier_copier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "checkpoint/versions.h"
#include "safepoint/checkpoint.h"
#include "storage/faulty/faulty_storage.h"
#include "testing/test_util.h"

namespace safepoint::agent::tier_copier_test {
namespace {

std::string Unique(const std::string& what) {
  static std::atomic<int> n{0};
  return "mem://tier-test-" + what + "-" + std::to_string(::getpid()) + "-" + std::to_string(++n);
}

Status Save(CheckpointStore& store, uint64_t step) {
  std::vector<float> data(100000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = float(step * 7 + i);
  std::vector<TensorSource> t;
  t.push_back({{"w", DType::kFloat32, {data.size()}, {}, {}}, data.data(), data.size() * 4});
  return SaveShard(store, test::TestImageMeta("tiers", step, 0, 1), t, *EncodeExtras(Value()))
      .status();
}

std::vector<uint64_t> Steps(const std::string& uri) {
  auto store = OpenCheckpointStore(uri);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  if (!store.ok()) return {};
  return test::CommittedSteps(**store);
}

void WaitIdle(const TierChain& chain) {
  // Bounded so that a hang fails the test instead of the whole run; never a timing assertion.
  for (int i = 0; i < 30000 && chain.Busy(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_FALSE(chain.Busy());
}

TEST(TierChainTest, CopiesStepsDownTheTiersOnTheirSchedulesAndKeepsTheirNewest) {
  const std::string primary_uri = Unique("primary");
  ASSERT_OK_AND_ASSIGN(auto primary, OpenCheckpointStore(primary_uri));
  std::shared_ptr<CheckpointStore> shared(std::move(primary));
  const std::string t1 = Unique("t1"), t2 = Unique("t2");
  TierChain chain({}, 0.001);
  chain.Start("tiers", shared, {{t1, 2, 0, 2}, {t2, 4, 0, 1}}, std::make_shared<StepPins>());
  for (uint64_t step = 1; step <= 8; ++step) {
    ASSERT_OK(Save(*shared, step));
    chain.Committed(step);
    WaitIdle(chain);
  }
  // Tier 1 takes its first step, then the multiples of 2; keeps 2. Tier 2 takes what tier 1
  // received when due: 1 (its first), 4 and 8; keeps 1.
  EXPECT_EQ(Steps(t1), (std::vector<uint64_t>{6, 8}));
  EXPECT_EQ(Steps(t2), (std::vector<uint64_t>{8}));
  const auto states = chain.States();
  ASSERT_EQ(states.size(), 2u);
  EXPECT_EQ(states[0].copies, 5u);  // 1 2 4 6 8
  EXPECT_EQ(states[1].copies, 3u);  // 1 4 8
  EXPECT_EQ(states[0].newest, 8u);
  EXPECT_EQ(states[0].failures, 0u);
  EXPECT_GT(states[1].last_copy_unix_ns, 0);
  // Bit-exact on the lowest tier.
  ASSERT_OK_AND_ASSIGN(auto low, OpenCheckpointStore(t2));
  ASSERT_OK_AND_ASSIGN(LoadedShard shard, LoadShard(*low, 8, 0));
  auto w = shard.reader.tensor_data(0);
  std::vector<float> want(100000);
  for (size_t i = 0; i < want.size(); ++i) want[i] = float(8 * 7 + i);
  ASSERT_EQ(w.size(), want.size() * 4);
  EXPECT_EQ(std::memcmp(w.data(), want.data(), w.size()), 0);
  chain.Stop(10);
}

TEST(TierChainTest, ATierCatchesUpWithTheTierAboveWhenItStarts) {
  const std::string primary_uri = Unique("primary");
  ASSERT_OK_AND_ASSIGN(auto primary, OpenCheckpointStore(primary_uri));
  std::shared_ptr<CheckpointStore> shared(std::move(primary));
  for (uint64_t step : {3, 5}) ASSERT_OK(Save(*shared, step));
  const std::string t1 = Unique("t1");
  TierChain chain({}, 0.001);
  chain.Start("tiers", shared, {{t1, 0, 0, 3}}, std::make_shared<StepPins>());
  WaitIdle(chain);
  // The newest step above when the agent (re)started.
  for (int i = 0; i < 10000 && Steps(t1).empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(Steps(t1), (std::vector<uint64_t>{5}));
  chain.Stop(10);
}

// The tier above opened only after the tier below had started (unreachable at first, or simply
// slower to open): the tier below must still catch up with the newest step of the tier above,
// although that step needs no copy into the tier above (it holds it already). The crash
// campaign checks the same after each round (tests/crash/crashtest.py, "tiers caught up").
TEST(TierChainTest, ATierCatchesUpWhenTheTierAboveOpensAfterIt) {
  const std::string primary_uri = Unique("primary");
  ASSERT_OK_AND_ASSIGN(auto primary, OpenCheckpointStore(primary_uri));
  std::shared_ptr<CheckpointStore> shared(std::move(primary));
  const std::string t1 = Unique("t1"), t2 = Unique("t2");
  ASSERT_OK_AND_ASSIGN(auto tier1, OpenCheckpointStore(t1));
  ASSERT_OK_AND_ASSIGN(auto tier2, OpenCheckpointStore(t2));
  // As a killed agent left them: tier 1 received step 8, tier 2 (every 4) not yet.
  for (uint64_t step : {4, 8}) {
    ASSERT_OK(Save(*shared, step));
    ASSERT_OK(CopyStep(*shared, *tier1, step).status());
  }
  ASSERT_OK(CopyStep(*shared, *tier2, 4).status());
  // Tier 1 cannot be opened until tier 2 has started.
  auto reachable = std::make_shared<std::atomic<bool>>(false);
  RegisterStorageScheme(
      "tier-test-late",
      [reachable, t1](std::string_view, std::string_view) -> Result<std::unique_ptr<Storage>> {
        if (!reachable->load()) return Unavailable("tier-test-late://: not reachable yet");
        return OpenStorage(t1);
      });
  TierChain chain({}, 0.001);
  chain.Start("tiers", shared, {{"tier-test-late://x", 2, 0, 2}, {t2, 4, 0, 2}},
              std::make_shared<StepPins>());
  for (int i = 0; i < 10000 && !chain.States()[1].open; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(chain.States()[1].open);
  reachable->store(true);
  for (int i = 0; i < 10000 && !chain.States()[0].open; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(chain.States()[0].open);
  // Bounded: a tier that never catches up fails here instead of hanging.
  for (int i = 0; i < 10000 && Steps(t2) != std::vector<uint64_t>{4, 8}; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  WaitIdle(chain);
  EXPECT_EQ(Steps(t2), (std::vector<uint64_t>{4, 8}));
  EXPECT_EQ(Steps(t1), (std::vector<uint64_t>{4, 8}));
  chain.Stop(10);
}

TEST(TierChainTest, AFailingTierIsReportedAndDoesNotHoldUpTheTierAbove) {
  const std::string primary_uri = Unique("primary");
  ASSERT_OK_AND_ASSIGN(auto primary, OpenCheckpointStore(primary_uri));
  std::shared_ptr<CheckpointStore> shared(std::move(primary));
  // Tier 2 fails every publish (EIO), like a full or broken object store.
  auto faulty = std::make_shared<FaultyStorage>(std::shared_ptr<Storage>(NewMemoryStorage()));
  faulty->Arm({FaultOp::kPublish, 1, FaultKind::kEIO, /*sticky=*/true});
  RegisterStorageScheme(
      "tier-test-faulty",
      [faulty](std::string_view, std::string_view) -> Result<std::unique_ptr<Storage>> {
        return std::unique_ptr<Storage>(std::make_unique<FaultyStorage>(faulty));
      });
  const std::string t1 = Unique("t1");
  TierChain chain({}, 0.001);
  chain.Start("tiers", shared, {{t1, 0, 0, 3}, {"tier-test-faulty://x", 0, 0, 3}},
              std::make_shared<StepPins>());
  for (uint64_t step = 1; step <= 3; ++step) {
    ASSERT_OK(Save(*shared, step));
    chain.Committed(step);
    WaitIdle(chain);
  }
  EXPECT_EQ(Steps(t1), (std::vector<uint64_t>{1, 2, 3}));
  const auto states = chain.States();
  EXPECT_EQ(states[0].failures, 0u);
  EXPECT_EQ(states[1].copies, 0u);
  EXPECT_GE(states[1].failures, static_cast<uint64_t>(TierChain::kMaxAttempts));
  EXPECT_NE(states[1].last_error.find("step 3"), std::string::npos) << states[1].last_error;
  EXPECT_FALSE(states[1].newest.has_value());
  chain.Stop(10);
}

TEST(TierChainTest, ACorruptStepAboveIsNeverCommittedBelow) {
  auto base = std::shared_ptr<Storage>(NewMemoryStorage());
  auto shared = std::make_shared<CheckpointStore>(base);
  ASSERT_OK(Save(*shared, 1));
  // Flip a byte in the middle of the image's tensor data (rewrite the object).
  const std::string name = ImageObjectName(1, 0);
  std::vector<std::byte> bytes = test::ReadWholeObject(*base, name);
  ASSERT_FALSE(bytes.empty());
  bytes[bytes.size() / 2] ^= std::byte{0x40};
  ASSERT_OK(test::PutObject(*base, name, bytes));
  const std::string t1 = Unique("t1");
  TierChain chain({}, 0.001);
  chain.Start("tiers", shared, {{t1, 0, 0, 3}}, std::make_shared<StepPins>());
  chain.Committed(1);
  WaitIdle(chain);
  EXPECT_TRUE(Steps(t1).empty());
  const auto states = chain.States();
  EXPECT_GT(states[0].failures, 0u);
  EXPECT_NE(states[0].last_error.find("orrupt"), std::string::npos) << states[0].last_error;
  chain.Stop(10);
}

TEST(PruneStepsTest, KeepsTheNewestAndEveryPinnedStep) {
  auto store = std::make_shared<CheckpointStore>(std::shared_ptr<Storage>(NewMemoryStorage()));
  for (uint64_t step = 1; step <= 5; ++step) ASSERT_OK(Save(*store, step));
  StepPins pins;
  pins.Pin(0, 2);
  pins.Pin(1, 3);  // another tier's pin does not count
  EXPECT_EQ(PruneSteps(*store, 2, &pins, 0), (std::vector<uint64_t>{1, 3}));
  ASSERT_OK_AND_ASSIGN(auto left, store->ListCommitted());
  ASSERT_EQ(left.size(), 3u);
  EXPECT_EQ(left[0].step, 2u);
  pins.Unpin(0, 2);
  EXPECT_EQ(PruneSteps(*store, 2, &pins, 0), (std::vector<uint64_t>{2}));
}

// Tags keep steps past retention: a tag of the store itself, and for a tier one of the job's
// own storage (`also_tagged_in`). Unreadable tags stop retention instead of guessing.
TEST(PruneStepsTest, KeepsTaggedSteps) {
  auto store = std::make_shared<CheckpointStore>(std::shared_ptr<Storage>(NewMemoryStorage()));
  auto primary = std::make_shared<CheckpointStore>(std::shared_ptr<Storage>(NewMemoryStorage()));
  for (uint64_t step = 1; step <= 6; ++step) ASSERT_OK(Save(*store, step));
  ASSERT_OK(Save(*primary, 3));
  ASSERT_OK(WriteTag(*store, {"base", 1, 0}, false));
  ASSERT_OK(WriteTag(*primary, {"best", 3, 0}, false));
  EXPECT_EQ(PruneSteps(*store, 2, nullptr, 1, primary.get()), (std::vector<uint64_t>{2, 4}));
  ASSERT_OK_AND_ASSIGN(auto left, store->ListCommitted());
  ASSERT_EQ(left.size(), 4u);
  EXPECT_EQ(left[0].step, 1u);
  EXPECT_EQ(left[1].step, 3u);
  ASSERT_OK(DeleteTag(*primary, "best"));
  EXPECT_EQ(PruneSteps(*store, 2, nullptr, 1, primary.get()), (std::vector<uint64_t>{3}));
  ASSERT_OK(Save(*store, 7));
  ASSERT_OK_AND_ASSIGN(auto w, store->storage().Create("tags/damaged", 1));
  ASSERT_OK(w->WriteAt(0, std::span<const std::byte>(reinterpret_cast<const std::byte*>("x"), 1)));
  ASSERT_OK(w->Publish());
  EXPECT_TRUE(PruneSteps(*store, 2, nullptr, 0).empty());
  ASSERT_OK(store->storage().Delete("tags/damaged"));
  EXPECT_EQ(PruneSteps(*store, 2, nullptr, 0), (std::vector<uint64_t>{5}));
}

}  // namespace
}  // namespace safepoint::agent::tier_copier_test
