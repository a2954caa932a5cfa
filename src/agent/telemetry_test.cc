// What the agent's Telemetry makes of its events (src/agent/telemetry.h): metrics and event log.
#include "agent/telemetry.h"

#include <gtest/gtest.h>

#include <sstream>

#include "testing/test_util.h"

namespace safepoint::agent::telemetry_test {
namespace {

using test::ReadJsonLines;
using test::TempDir;

class TelemetryTest : public ::testing::Test {
 protected:
  TempDir dir_;
  const std::string log_ = dir_.path() + "/events.jsonl";  // for tests that open an event log
  Telemetry t{"j"};
};

TEST_F(TelemetryTest, FailureCountersExistAtZeroFromTheStart) {
  const std::string text = t.registry().Render();
  EXPECT_NE(
      text.find("safepoint_persists_total{safepoint_job=\"j\",tier=\"0\",result=\"failed\"} 0"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("safepoint_checksum_failures_total{safepoint_job=\"j\",where=\"memory\"} 0"),
            std::string::npos);
  t.SetTierUris({"/nvme/run1", "s3://user:secret@bucket/run1?timeout=2"});
  const std::string tiers = t.registry().Render();
  EXPECT_NE(
      tiers.find("safepoint_persists_total{safepoint_job=\"j\",tier=\"1\",result=\"failed\"} 0"),
      std::string::npos);
  // A tier's URI is a label without its query or user info.
  EXPECT_NE(tiers.find("tier=\"1\",uri=\"s3://bucket/run1\"} 1"), std::string::npos) << tiers;
  EXPECT_EQ(tiers.find("secret"), std::string::npos);
}

TEST_F(TelemetryTest, CountsEachCommitOnceAndLearnsTheInterval) {
  const Labels tier0 = {{"tier", "0"}};
  t.KnownCommit(0, 10, 1000);  // found at start: no count
  EXPECT_EQ(t.registry().Value("safepoint_commits_total", tier0), 0);
  EXPECT_EQ(t.registry().Value("safepoint_last_commit_timestamp_seconds", tier0), 1000);
  t.Committed(0, 11, 1060);
  t.Committed(0, 11, 1061);  // the same step seen again (another rank's persist, a poll)
  t.Committed(0, 9, 1062);   // older than the newest found at start: not this agent's to count
  EXPECT_EQ(t.registry().Value("safepoint_commits_total", tier0), 1);
  EXPECT_EQ(t.registry().Value("safepoint_last_commit_timestamp_seconds", tier0), 1060);
  EXPECT_EQ(t.registry().Value("safepoint_commit_interval_seconds", tier0), 60);
  t.Committed(0, 12, 1160);  // moving average: 0.7 * 60 + 0.3 * 100
  EXPECT_DOUBLE_EQ(t.registry().Value("safepoint_commit_interval_seconds", tier0), 72);
  EXPECT_EQ(t.registry().Value("safepoint_newest_committed_step", tier0), 12);
}

// The commit relay's committer can finish an older step's commit after a newer one's (a step
// that other nodes' facts completed, queued behind its own persists): it is a commit all the
// same, counted and logged once, and the gauges stay on the newest step.
TEST_F(TelemetryTest, AnOlderStepCommittedAfterANewerOneIsCountedAndLoggedOnce) {
  ASSERT_OK(t.OpenEventLog(log_));
  const Labels tier0 = {{"tier", "0"}};
  t.Committed(0, 1, 1000);
  t.Committed(0, 3, 1010);
  t.Committed(0, 2, 1020);
  t.Committed(0, 2, 1021);  // seen again
  t.Committed(0, 3, 1022);
  EXPECT_EQ(t.registry().Value("safepoint_commits_total", tier0), 3);
  EXPECT_EQ(t.registry().Value("safepoint_newest_committed_step", tier0), 3);
  EXPECT_EQ(t.registry().Value("safepoint_last_commit_timestamp_seconds", tier0), 1010);
  std::vector<nlohmann::json> commits;
  for (const auto& e : ReadJsonLines(log_)) {
    if (e["event"] == "commit") commits.push_back(e);
  }
  ASSERT_EQ(commits.size(), 3u);
  EXPECT_EQ(commits[0]["step"], 1);
  EXPECT_EQ(commits[1]["step"], 3);
  EXPECT_EQ(commits[2]["step"], 2);
  EXPECT_EQ(commits[2]["after_newer"], 3);
  EXPECT_FALSE(commits[1].contains("after_newer"));
}

TEST_F(TelemetryTest, TierCopiesAndFailuresBecomeMetricsAndEvents) {
  ASSERT_OK(t.OpenEventLog(log_));
  TierState st;
  st.index = 1;
  st.open = true;
  t.TierStates({st});
  st.copies = 1;
  st.newest = 4;
  st.last_copy_bytes = 100;
  st.last_copy_seconds = 0.5;
  st.last_copy_unix_ns = 2'000'000'000'000'000'000;
  t.TierStates({st});
  t.TierStates({st});  // unchanged: nothing new
  st.failures = 1;
  st.pending = 6;
  st.last_error = "IOError: s3://bucket/run1/step-6: timed out";
  t.TierStates({st});
  MetricsRegistry& r = t.registry();
  EXPECT_EQ(r.Value("safepoint_persists_total", {{"tier", "1"}, {"result", "ok"}}), 1);
  EXPECT_EQ(r.Value("safepoint_persists_total", {{"tier", "1"}, {"result", "failed"}}), 1);
  EXPECT_EQ(r.Value("safepoint_persisted_bytes_total", {{"tier", "1"}}), 100);
  EXPECT_EQ(r.Value("safepoint_persist_seconds", {{"tier", "1"}}), 1);  // observations
  EXPECT_EQ(r.Value("safepoint_commits_total", {{"tier", "1"}}), 1);
  EXPECT_EQ(r.Value("safepoint_last_commit_timestamp_seconds", {{"tier", "1"}}), 2e9);
  EXPECT_EQ(r.Value("safepoint_tier_pending_steps", {{"tier", "1"}}), 1);
  EXPECT_EQ(r.Value("safepoint_failures_total", {{"kind", "tier_copy"}, {"code", "IOError"}}), 1);
  const auto ev = ReadJsonLines(log_);
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0]["event"], "commit");
  EXPECT_EQ(ev[0]["tier"], 1);
  EXPECT_EQ(ev[0]["step"], 4);
  EXPECT_EQ(ev[1]["event"], "failure");
  EXPECT_EQ(ev[1]["kind"], "tier_copy");
  EXPECT_EQ(ev[1]["step"], 6);
  EXPECT_EQ(ev[1]["error"], st.last_error);
}

TEST_F(TelemetryTest, PersistResultsByOutcome) {
  ASSERT_OK(t.OpenEventLog(log_));
  PersistResult ok;
  ok.task.rank = 2;
  ok.task.step = 7;
  ok.bytes = 4096;
  ok.seconds = 0.25;
  ok.committed = true;
  t.Persisted(ok);
  PersistResult full = ok;
  full.task.step = 8;
  full.committed = false;
  full.status = Status(StatusCode::kResourceExhausted, "/ckpt/step-8/rank-2.img: no space");
  t.Persisted(full);
  PersistResult damaged = full;
  damaged.status = Status(StatusCode::kCorruption, "/ckpt/step-8: checksum mismatch");
  t.Persisted(damaged);
  MetricsRegistry& r = t.registry();
  EXPECT_EQ(r.Value("safepoint_persists_total", {{"tier", "0"}, {"result", "ok"}}), 1);
  EXPECT_EQ(r.Value("safepoint_persists_total", {{"tier", "0"}, {"result", "failed"}}), 2);
  EXPECT_EQ(
      r.Value("safepoint_failures_total", {{"kind", "persist"}, {"code", "ResourceExhausted"}}), 1);
  EXPECT_EQ(r.Value("safepoint_checksum_failures_total", {{"where", "persist"}}), 1);
  EXPECT_EQ(r.Value("safepoint_commits_total", {{"tier", "0"}}), 1);
  const auto ev = ReadJsonLines(log_);
  ASSERT_EQ(ev.size(), 4u);  // persist, commit, failure, failure
  EXPECT_EQ(ev[0]["event"], "persist");
  EXPECT_EQ(ev[0]["rank"], 2);
  EXPECT_EQ(ev[0]["reason"], "requested");
  EXPECT_EQ(ev[1]["event"], "commit");
  EXPECT_EQ(ev[2]["event"], "failure");
  EXPECT_EQ(ev[2]["code"], "ResourceExhausted");
  EXPECT_EQ(ev[2]["error"], "/ckpt/step-8/rank-2.img: no space");
}

TEST_F(TelemetryTest, ClientReportsAndReplicationOutcomes) {
  t.Saved(1, 5, /*saved=*/true, 0.002, 1000);
  t.Saved(1, 6, /*saved=*/false, 0.0, 0);
  t.Restored(1, 5, "peer", 1.5, 0);
  t.ChecksumFailure(1, 5, "memory", "slot 0: chunk 3 checksum mismatch");
  PushOutcome pushed;
  pushed.task.rank = 1;
  pushed.task.step = 5;
  pushed.is_protected = true;
  pushed.seconds = 0.75;
  t.Replicated(pushed);
  PushOutcome lost = pushed;
  lost.task.rank = 2;
  lost.is_protected = false;
  lost.status = Unavailable("node b: peer timed out");
  t.Replicated(lost);
  MetricsRegistry& r = t.registry();
  EXPECT_EQ(r.Value("safepoint_saves_total", {{"rank", "1"}}), 1);
  EXPECT_EQ(r.Value("safepoint_saves_skipped_total", {{"rank", "1"}}), 1);
  EXPECT_EQ(r.Value("safepoint_snapshot_bytes_total", {{"rank", "1"}}), 1000);
  EXPECT_EQ(r.Value("safepoint_save_blocking_seconds", {{"rank", "1"}}), 1);  // observations
  EXPECT_EQ(r.Value("safepoint_restores_total", {{"source", "peer"}}), 1);
  EXPECT_EQ(r.Value("safepoint_checksum_failures_total", {{"where", "memory"}}), 1);
  EXPECT_EQ(r.Value("safepoint_replication_protected", {{"rank", "1"}}), 1);
  EXPECT_EQ(r.Value("safepoint_replication_protected", {{"rank", "2"}}), 0);
  EXPECT_EQ(r.Value("safepoint_replication_lag_seconds", {{"rank", "1"}}), 0.75);
  EXPECT_EQ(r.Value("safepoint_replication_pushes_total", {{"result", "ok"}}), 1);
  EXPECT_EQ(r.Value("safepoint_replication_pushes_total", {{"result", "failed"}}), 1);
  EXPECT_EQ(r.Value("safepoint_failures_total", {{"kind", "replication"}, {"code", "Unavailable"}}),
            1);
}

}  // namespace
}  // namespace safepoint::agent::telemetry_test
