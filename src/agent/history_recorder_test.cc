// The agent's measurement history (history_recorder.h): what it records, how often, and where
// a reader of the checkpoint path finds it on an object store.
#include "agent/history_recorder.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "testing/test_util.h"

namespace safepoint::agent::history_recorder_test {
namespace {

// Whether the recorder's worker published what it was handed (the deadline only turns a lost
// segment into a failure).
bool PublishedSoon(HistoryRecorder& r) {
  for (int i = 0; i < 3000 && !r.Settled(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return r.Settled() && r.error().empty();
}

// mem:// stands for an object store (no append): the history is kept in segments under the
// checkpoint path, found there with no $SAFEPOINT_HISTORY_DIR.
TEST(HistoryRecorderTest, RecordsInSegmentsOfAnObjectStoreThatAdviseFinds) {
  ::unsetenv("SAFEPOINT_HISTORY_DIR");
  const std::string uri = "mem://recorder-history";
  HistoryRecorder r;
  r.Open(uri, "j");
  ASSERT_TRUE(r.open());
  EXPECT_NE(r.where().find("safepoint-history/"), std::string::npos) << r.where();
  r.Started(3);
  for (double s : {0.1, 0.3, 0.2}) r.Saved(s);
  r.Persisted("path", 0, 0);  // wrote nothing (stored already): not a persist time
  r.Persisted("path", 4, 1000);
  r.Persisted("path", 5, 1000);  // within kLineGapSeconds of the last line: not a line
  TierState tier;
  tier.index = 1;
  tier.copies = 1;
  tier.last_copy_seconds = 7;
  tier.last_copy_bytes = 1000;
  r.TierStates({tier});
  r.TierStates({tier});  // no new copy
  r.Restored("memory", 0.5);
  r.Sync();  // at most every kSyncSeconds: the first hands the segment to the worker
  ASSERT_TRUE(PublishedSoon(r));
  EXPECT_EQ(advisor::ReadJobHistory(uri, "j").value().runs, 1u);
  r.Closed();  // handed over at once
  ASSERT_TRUE(PublishedSoon(r));
  EXPECT_TRUE(r.error().empty()) << r.error();

  ASSERT_OK_AND_ASSIGN(auto h, advisor::ReadJobHistory(uri, "j"));
  EXPECT_EQ(h.runs, 1u);
  EXPECT_EQ(h.interruptions, 0u);  // closed
  ASSERT_TRUE(h.save.has_value());
  EXPECT_EQ(h.save->samples, 3u);
  EXPECT_DOUBLE_EQ(h.save->seconds, 0.2);
  EXPECT_EQ(h.persist.at("path").samples, 1u);
  EXPECT_DOUBLE_EQ(h.persist.at("path").seconds, 4);
  EXPECT_EQ(h.persist.at("tier 1").samples, 1u);
  EXPECT_DOUBLE_EQ(h.persist.at("tier 1").seconds, 7);
  EXPECT_DOUBLE_EQ(h.restore.at("memory").seconds, 0.5);
}

// Rank 0's process went away without closing: the saves buffered for the next "save" line are
// written (the agent outlives it), and no "close": the next start counts an interruption.
TEST(HistoryRecorderTest, RankZeroGoneWithoutClosingLeavesAnInterruption) {
  test::TempDir dir;
  {
    HistoryRecorder r;
    r.Open(dir.path(), "j");
    r.Started(1);
    r.Saved(0.1);
    r.Ended();
  }
  {
    HistoryRecorder r;
    r.Open("file://" + dir.path(), "j");
    r.Started(2);
    r.Closed();
  }
  ASSERT_OK_AND_ASSIGN(auto h, advisor::ReadJobHistory(dir.path(), "j"));
  EXPECT_EQ(h.runs, 2u);
  EXPECT_EQ(h.interruptions, 1u);
  ASSERT_TRUE(h.save.has_value());
  EXPECT_EQ(h.save->samples, 1u);
}

// Issue 35: a history file another user planted in the checkpoint directory (here 0666) is
// refused: the recorder reports why in the status and records nothing, and the job goes on.
TEST(HistoryRecorderTest, APlantedHistoryFileIsReportedAndLeftUntouched) {
  test::TempDir dir;
  const std::string path = advisor::HistoryPath(dir.path(), "j");
  {
    const safepoint::internal::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600));
    ASSERT_TRUE(fd.valid());
    ASSERT_EQ(::fchmod(fd.get(), 0666), 0);
  }
  HistoryRecorder r;
  r.Open(dir.path(), "j");
  EXPECT_FALSE(r.open());
  EXPECT_NE(r.error().find(path), std::string::npos) << r.error();
  r.Started(1);
  r.Saved(0.1);
  r.Closed();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 0);
}

}  // namespace
}  // namespace safepoint::agent::history_recorder_test
