#include "shm/rank_claim.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/process.h"
#include "shm/arena.h"
#include "testing/test_util.h"

namespace safepoint::rank_claim_test {
namespace {

using internal::ProcessId;

class RankClaimTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(tmp_.ok());
    ASSERT_OK_AND_ASSIGN(job_dir_, JobDirectory(tmp_.path(), "claim", true));
  }
  test::TempDir tmp_{"sp-claim"};
  std::string job_dir_;
};

TEST_F(RankClaimTest, OpenFindsNoneUntilTheAgentWritesOne) {
  EXPECT_EQ(RankClaim::Open(job_dir_, 3).status().code(), StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(auto created, RankClaim::OpenOrCreate(job_dir_, 3));
  EXPECT_EQ(created->Owner().process.pid, 0u);
  EXPECT_GT(created->epoch(), 0u);
  ASSERT_OK_AND_ASSIGN(auto opened, RankClaim::Open(job_dir_, 3));
  EXPECT_EQ(opened->epoch(), created->epoch());
  struct stat st;
  ASSERT_EQ(::stat(ClaimPath(job_dir_, 3).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(ClaimPath(job_dir_, 3), job_dir_ + "/claim-00003");
  // Another rank's claim is not this one.
  EXPECT_EQ(RankClaim::Open(job_dir_, 4).status().code(), StatusCode::kNotFound);
}

TEST_F(RankClaimTest, TheEpochMovesOnOnlyWhenAnotherProcessOwnsTheRank) {
  ASSERT_OK_AND_ASSIGN(auto claim, RankClaim::OpenOrCreate(job_dir_, 0));
  const ProcessId a{100, 5000}, b{101, 6000};
  const uint64_t ea = claim->SetOwner(a, 7);
  EXPECT_EQ(claim->epoch(), ea);
  EXPECT_EQ(claim->SetOwner(a, 7), ea);  // the same process says hello again
  EXPECT_EQ(claim->SetOwner(a, 8), ea);  // a second client of the same process
  EXPECT_EQ(claim->Owner().attempt, 8u);
  const uint64_t eb = claim->SetOwner(b, 9);
  EXPECT_GT(eb, ea);
  const ClaimOwner o = claim->Owner();
  EXPECT_EQ(o.process, b);
  EXPECT_EQ(o.attempt, 9u);
  EXPECT_EQ(o.epoch, eb);
  EXPECT_GT(o.since_ns, 0);
  // A pid used again by another process is another process.
  EXPECT_GT(claim->SetOwner({101, 6001}, 9), eb);
}

TEST_F(RankClaimTest, AClaimWrittenAgainNeverRepeatsAnEpoch) {
  uint64_t first = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto claim, RankClaim::OpenOrCreate(job_dir_, 0));
    first = claim->SetOwner({100, 5000}, 7);
  }
  ASSERT_OK(RemoveClaimUnlessNeeded(job_dir_, 0));
  EXPECT_EQ(RankClaim::Open(job_dir_, 0).status().code(), StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(auto again, RankClaim::OpenOrCreate(job_dir_, 0));
  EXPECT_GT(again->SetOwner({100, 5000}, 7), first);
}

TEST_F(RankClaimTest, SupersededProcessesAreFoundNewestFirstAndTheOldestMakesRoom) {
  ASSERT_OK_AND_ASSIGN(auto claim, RankClaim::OpenOrCreate(job_dir_, 0));
  for (uint32_t i = 1; i <= RankClaim::kFencedSlots + 2; ++i) {
    claim->AddSuperseded({{i, 1000 + i}, i, {i + 1, 2000 + i}, i + 1, int64_t{i}});
  }
  const auto all = claim->Superseded();
  ASSERT_EQ(all.size(), RankClaim::kFencedSlots);
  EXPECT_EQ(all.front().process.pid, RankClaim::kFencedSlots + 2);
  EXPECT_EQ(all.back().process.pid, 3u);
  EXPECT_FALSE(claim->FindSuperseded({1, 1001}));  // made room
  ASSERT_TRUE(claim->FindSuperseded({5, 1005}));
  EXPECT_EQ(claim->FindSuperseded({5, 1005})->by_attempt, 6u);
  EXPECT_FALSE(claim->FindSuperseded({5, 1006}));  // the pid, of another process
}

TEST_F(RankClaimTest, AClaimThatMustRefuseALiveSupersededProcessStays) {
  ASSERT_OK_AND_ASSIGN(auto claim, RankClaim::OpenOrCreate(job_dir_, 0));
  claim->AddSuperseded({internal::SelfProcessId(), 1, {1, 1}, 2, 0});
  ASSERT_OK(RemoveClaimUnlessNeeded(job_dir_, 0));
  EXPECT_OK(RankClaim::Open(job_dir_, 0));
  ASSERT_OK_AND_ASSIGN(auto other, RankClaim::OpenOrCreate(job_dir_, 1));
  other->AddSuperseded({{1u << 30, 1}, 1, {1, 1}, 2, 0});  // no such process
  ASSERT_OK(RemoveClaimUnlessNeeded(job_dir_, 1));
  EXPECT_EQ(RankClaim::Open(job_dir_, 1).status().code(), StatusCode::kNotFound);
}

TEST_F(RankClaimTest, RefusesAClaimFileAccessibleToOthers) {
  ASSERT_OK(RankClaim::OpenOrCreate(job_dir_, 0));
  ASSERT_EQ(::chmod(ClaimPath(job_dir_, 0).c_str(), 0644), 0);
  EXPECT_EQ(RankClaim::Open(job_dir_, 0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace safepoint::rank_claim_test
