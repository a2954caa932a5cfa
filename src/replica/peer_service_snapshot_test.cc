// PeerService::FetchSnapshot end to end (peer_service_snapshot.cc): a node of one job serves one
// of its own snapshots (a buffer standing for a slot, with the checksums "recorded when it was
// taken") and a node of another job fetches it with the first job's name and secret, as a torchft
// heal does; services in one process on 127.0.0.1.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "base/crc32c.h"
#include "replica/peer_node_for_test.h"
#include "replica/peer_service.h"
#include "testing/test_util.h"

namespace safepoint::replica::peer_service_snapshot_test {
namespace {

constexpr char kSenderSecret[] = "sender-job-secret-0123456789abcdef";
constexpr char kReceiverSecret[] = "receiver-job-secret-0123456789abcd";
constexpr uint64_t kChunk = 256 << 10;
constexpr uint64_t kStep = 7;
constexpr uint64_t kCompleteNs = 123456;

using Node = PeerNodeForTest;

// The snapshot the sender serves: its image, the checksums recorded for its whole chunks when it
// was "taken", and what the source answers.
struct Snapshot {
  std::vector<std::byte> image = test::PatternBytes((3 << 20) + 123, 5);
  std::vector<uint32_t> recorded;
  std::atomic<bool> taken{true};
  // Calls of the source so far; from call `superseded_from_call` on, it serves a newer snapshot
  // (another completion time).
  std::atomic<int> calls{0};
  int superseded_from_call = 1 << 30;
  // Chunks still_valid lets through before the slot "is overwritten".
  std::atomic<int> valid_chunks{1 << 30};
  Snapshot() {
    for (uint64_t off = 0; off + kChunk <= image.size(); off += kChunk) {
      recorded.push_back(internal::Crc32c(0, image.data() + off, kChunk));
    }
  }
};

class SnapshotFetchTest : public ::testing::Test {
 protected:
  Node* Start(const std::string& job, const std::string& name, const std::string& secret) {
    PeerServiceOptions o = PeerOptionsForTest(job, name, secret);
    o.chunk_bytes = kChunk;
    auto n = StartPeerNodeForTest(o);
    if (!n) return nullptr;
    nodes_.push_back(std::move(n));
    return nodes_.back().get();
  }

  void SetUp() override {
    sender_ = Start("torchft-a", "sender", kSenderSecret);
    receiver_ = Start("torchft-b", "receiver", kReceiverSecret);
    ASSERT_TRUE(sender_ && receiver_);
    sender_->svc->SetSnapshotSource(
        [this](uint32_t rank, uint64_t step) { return Serve(rank, step); });
  }

  Result<ServedSnapshot> Serve(uint32_t rank, uint64_t step) {
    const int call = ++snap_.calls;
    if (!snap_.taken || rank != 0 || step != kStep) return NotFound("no such snapshot here");
    ServedSnapshot s;
    s.id = SnapshotId{rank, step, kCompleteNs + (call >= snap_.superseded_from_call ? 1 : 0), 3};
    s.image = snap_.image;
    s.crc_chunk_bytes = kChunk;
    s.recorded_crcs = snap_.recorded;
    s.still_valid = [this] { return snap_.valid_chunks.fetch_sub(1) > 0; };
    return s;
  }

  SnapshotOrigin Origin() const {
    return SnapshotOrigin{Peer{"sender", sender_->svc->address()}, "torchft-a", kSenderSecret};
  }

  // Fetches into got_; counts the calls of the destination.
  Status Fetch(const SnapshotOrigin& origin) {
    return receiver_->svc->FetchSnapshot(
        origin, 0, kStep,
        [this](const ReplicaMeta& m) -> Result<FetchDestination> {
          ++destinations_;
          got_.assign(m.image_bytes, std::byte{0});
          return FetchDestination{got_, nullptr};
        },
        &meta_);
  }

  std::vector<std::unique_ptr<Node>> nodes_;
  Node* sender_ = nullptr;
  Node* receiver_ = nullptr;
  Snapshot snap_;
  std::vector<std::byte> got_;
  ReplicaMeta meta_;
  int destinations_ = 0;
};

TEST_F(SnapshotFetchTest, AnotherJobsNodeFetchesTheSnapshotBitExactWithThatJobsSecret) {
  ASSERT_OK(Fetch(Origin()));
  EXPECT_EQ(got_, snap_.image);
  EXPECT_EQ(meta_.source_node, "sender");
  EXPECT_EQ(meta_.step, kStep);
  EXPECT_EQ(meta_.complete_ns, kCompleteNs);
  EXPECT_EQ(meta_.attempt, 3u);
  EXPECT_EQ(meta_.image_bytes, snap_.image.size());
  EXPECT_EQ(snap_.calls.load(), 3);  // describe, fetch, describe again
  // Nothing was kept as a replica on either side.
  ASSERT_OK_AND_ASSIGN(auto held, receiver_->store->List());
  EXPECT_TRUE(held.empty());
}

TEST_F(SnapshotFetchTest, NotTakenYetIsNotFoundAndReceivesNothingThenFetches) {
  snap_.taken = false;
  Status s = Fetch(Origin());
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_EQ(destinations_, 0);
  snap_.taken = true;
  ASSERT_OK(Fetch(Origin()));
  EXPECT_EQ(got_, snap_.image);
}

TEST_F(SnapshotFetchTest, ASnapshotTakenWhileTheFetchWaitsIsFetchedOverTheSameConnection) {
  snap_.taken = false;
  std::atomic<int> asked{0};
  sender_->svc->SetSnapshotSource([this, &asked](uint32_t rank, uint64_t step) {
    if (++asked == 3) snap_.taken = true;  // taken while the receiver waits
    return Serve(rank, step);
  });
  SnapshotOrigin origin = Origin();
  origin.wait_s = 60;
  ASSERT_OK(Fetch(origin));
  EXPECT_EQ(got_, snap_.image);
  EXPECT_EQ(destinations_, 1);
  // Three describes (two unanswered), the fetch, the describe after it; one connection: the
  // sender rejected nothing and dropped nothing.
  EXPECT_EQ(asked.load(), 5);
  EXPECT_EQ(sender_->svc->stats().peers_rejected, 0u);
  EXPECT_EQ(receiver_->svc->stats().transfers_failed, 0u);
}

TEST_F(SnapshotFetchTest, AWaitEndsWithNotFoundWhenTheSnapshotIsNeverTaken) {
  snap_.taken = false;
  SnapshotOrigin origin = Origin();
  origin.wait_s = 0.2;
  Status s = Fetch(origin);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_GT(snap_.calls.load(), 1);  // asked again while it waited
  EXPECT_EQ(destinations_, 0);
}

TEST_F(SnapshotFetchTest, AServiceWithoutASnapshotSourceAnswersNotFound) {
  sender_->svc->SetSnapshotSource(nullptr);
  Status s = Fetch(Origin());
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_NE(s.message().find("serves no snapshots"), std::string::npos) << s.ToString();
}

TEST_F(SnapshotFetchTest, AWrongSecretOrJobIsRefusedBeforeAnythingIsSent) {
  SnapshotOrigin wrong_secret = Origin();
  wrong_secret.secret = kReceiverSecret;
  Status s = Fetch(wrong_secret);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("authentication failed"), std::string::npos) << s.ToString();
  SnapshotOrigin wrong_job = Origin();
  wrong_job.job = "torchft-b";
  s = Fetch(wrong_job);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("is of job 'torchft-b'"), std::string::npos) << s.ToString();
  SnapshotOrigin short_secret = Origin();
  short_secret.secret = "short";
  EXPECT_EQ(Fetch(short_secret).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(destinations_, 0);
  EXPECT_EQ(snap_.calls.load(), 0);  // the source was never asked
  // The wrong job is refused by the sender; a wrong secret is found by the receiver first (the
  // sender's proof does not verify with it), which then sends no proof of its own.
  EXPECT_EQ(sender_->svc->stats().peers_rejected, 1u);
}

TEST_F(SnapshotFetchTest, AByteChangedInMemorySinceTheSnapshotFailsItsRecordedChecksum) {
  snap_.image[kChunk + 17] ^= std::byte{0x40};  // after the checksums were recorded
  Status s = Fetch(Origin());
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
  EXPECT_NE(s.message().find("fails its CRC32C"), std::string::npos) << s.ToString();
}

TEST_F(SnapshotFetchTest, ASlotOverwrittenWhileSentIsCancelledAsSuperseded) {
  snap_.valid_chunks = 2;  // the writer begins to overwrite the slot after two chunks
  Status s = Fetch(Origin());
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s.ToString();
  EXPECT_NE(s.message().find("superseded while it was sent"), std::string::npos) << s.ToString();
}

TEST_F(SnapshotFetchTest, ASnapshotSupersededBetweenDescribeAndFetchIsCancelled) {
  snap_.superseded_from_call = 2;
  Status s = Fetch(Origin());
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s.ToString();
  EXPECT_NE(s.message().find("superseded by a newer one before it was sent"), std::string::npos)
      << s.ToString();
}

TEST_F(SnapshotFetchTest, ASnapshotSupersededAfterItsLastChunkIsCancelled) {
  snap_.superseded_from_call = 3;  // the describe after the transfer finds a newer one
  Status s = Fetch(Origin());
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s.ToString();
  EXPECT_NE(s.message().find("superseded while it was sent"), std::string::npos) << s.ToString();
}

TEST_F(SnapshotFetchTest, ASenderGoneMidHealFailsTheFetch) {
  Status s = receiver_->svc->FetchSnapshot(
      Origin(), 0, kStep,
      [this](const ReplicaMeta& m) -> Result<FetchDestination> {
        sender_->svc.reset();  // the live replica's agent dies between describe and fetch
        got_.assign(m.image_bytes, std::byte{0});
        return FetchDestination{got_, nullptr};
      },
      &meta_);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
}

}  // namespace
}  // namespace safepoint::replica::peer_service_snapshot_test
