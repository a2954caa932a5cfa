// The measurement history: where it lives, what is written, what is learned from it.
#include "advisor/history.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include "safepoint/storage.h"
#include "testing/test_util.h"

namespace safepoint::advisor::history_test {
namespace {

using test::ReadFileToString;
using test::TempDir;
using test::WriteStringToFile;

TEST(HistoryPathTest, LocalCheckpointDirectoryElseTheEnvironmentElseNone) {
  EXPECT_EQ(HistoryPath("/ckpt/run1/", "j"), "/ckpt/run1/safepoint-history.jsonl");
  EXPECT_EQ(HistoryPath("file:///ckpt/run1", "j"), "/ckpt/run1/safepoint-history.jsonl");
  ::unsetenv("SAFEPOINT_HISTORY_DIR");
  EXPECT_EQ(HistoryPath("s3://bucket/run1", "j"), "");
  ::setenv("SAFEPOINT_HISTORY_DIR", "/var/lib/sp", 1);
  EXPECT_EQ(HistoryPath("s3://bucket/run1", "j"), "/var/lib/sp/j.history.jsonl");
  ::unsetenv("SAFEPOINT_HISTORY_DIR");
}

TEST(HistoryTest, MissingFileIsNotFoundNamingIt) {
  auto h = ReadHistory("/nonexistent/safepoint-history.jsonl");
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kNotFound);
  EXPECT_NE(h.status().message().find("/nonexistent/safepoint-history.jsonl"), std::string::npos);
}

TEST(HistoryTest, WritesAndSummarizesMeasurements) {
  TempDir dir;
  const std::string path = dir.path() + "/safepoint-history.jsonl";
  {
    ASSERT_OK_AND_ASSIGN(auto w, HistoryWriter::Open(path, /*save_line_gap=*/0));
    ASSERT_OK(w.RecordStart(1));
    for (double s : {0.1, 0.3, 0.2}) ASSERT_OK(w.RecordSave(s));
    ASSERT_OK(w.RecordPersist("path", 4, 1000));
    ASSERT_OK(w.RecordPersist("path", 6, 1000));
    ASSERT_OK(w.RecordPersist("tier 1", 30, 1000));
    ASSERT_OK(w.RecordRestore("memory", 0.5));
    ASSERT_OK(w.RecordClose());
  }
  uint64_t skipped = 0;
  ASSERT_OK_AND_ASSIGN(auto h, ReadHistory(path, &skipped));
  EXPECT_EQ(skipped, 0u);
  ASSERT_TRUE(h.save.has_value());
  EXPECT_DOUBLE_EQ(h.save->seconds, 0.2);
  EXPECT_EQ(h.save->samples, 3u);
  EXPECT_DOUBLE_EQ(h.persist.at("path").seconds, 5);
  EXPECT_EQ(h.persist.at("path").samples, 2u);
  EXPECT_DOUBLE_EQ(h.persist.at("tier 1").seconds, 30);
  EXPECT_DOUBLE_EQ(h.restore.at("memory").seconds, 0.5);
  EXPECT_EQ(h.runs, 1u);
  EXPECT_EQ(h.interruptions, 0u);  // closed cleanly
  EXPECT_FALSE(h.learned_mtbf_seconds.has_value());
}

TEST(HistoryTest, SaveLinesAreRateLimited) {
  TempDir dir;
  const std::string path = dir.path() + "/h.jsonl";
  ASSERT_OK_AND_ASSIGN(auto w, HistoryWriter::Open(path, /*save_line_gap=*/3600));
  ASSERT_OK(w.RecordStart(1));
  for (int i = 0; i < 100; ++i) ASSERT_OK(w.RecordSave(0.01 * (i % 7)));
  auto text = ReadFileToString(path).value_or("");
  EXPECT_EQ(text.find("\"save\""), std::string::npos);  // buffered
  ASSERT_OK(w.RecordClose());
  text = ReadFileToString(path).value_or("");
  EXPECT_NE(text.find("\"n\":100"), std::string::npos) << text;
}

TEST(HistoryTest, RestartsWithoutCloseAreInterruptionsAndGiveTheMtbf) {
  TempDir dir;
  const std::string path = dir.path() + "/h.jsonl";
  // Three runs: the first two end without "close" (killed), the third closes. Uptime 100 + 200
  // + 60 s, two interruptions; restarts took 10 and 20 s.
  ASSERT_TRUE(WriteStringToFile(path,
                                "{\"t\":1000,\"ev\":\"start\",\"run\":1}\n"
                                "{\"t\":1100,\"ev\":\"save\",\"n\":5,\"seconds\":0.2}\n"
                                "not json\n"
                                "{\"t\":1110,\"ev\":\"start\",\"run\":2}\n"
                                "{\"t\":1310,\"ev\":\"save\",\"n\":5,\"seconds\":0.4}\n"
                                "{\"t\":1330,\"ev\":\"start\",\"run\":3}\n"
                                "{\"t\":1340,\"ev\":\"restore\",\"source\":\"memory\","
                                "\"seconds\":1.5}\n"
                                "{\"t\":1380,\"ev\":\"close\"}\n"
                                "{\"t\":1390,\"ev\":\"future-event\",\"x\":1}\n"));
  uint64_t skipped = 0;
  ASSERT_OK_AND_ASSIGN(auto h, ReadHistory(path, &skipped));
  EXPECT_EQ(skipped, 1u);
  EXPECT_EQ(h.runs, 3u);
  EXPECT_EQ(h.interruptions, 2u);
  EXPECT_DOUBLE_EQ(h.uptime_seconds, 100 + 200 + 60);
  ASSERT_TRUE(h.learned_mtbf_seconds.has_value());
  EXPECT_DOUBLE_EQ(*h.learned_mtbf_seconds, (360 + 10 + 20) / 2.0);  // restarts count too
  ASSERT_TRUE(h.restart.has_value());
  EXPECT_DOUBLE_EQ(h.restart->seconds, 15);
  EXPECT_EQ(h.interruption_times, (std::vector<double>{1100, 1310}));
}

TEST(HistoryTest, UnmeasuredRestoresAreEstimatedFromSizeAndBandwidth) {
  TempDir dir;
  const std::string path = dir.path() + "/h.jsonl";
  {
    ASSERT_OK_AND_ASSIGN(auto w, HistoryWriter::Open(path, /*save_line_gap=*/0));
    ASSERT_OK(w.RecordStart(1));
    ASSERT_OK(w.RecordSave(0.5));
    // The path writes 4 GB in 8 s (0.5 GB/s); tier 1 records no size and took 20 s.
    ASSERT_OK(w.RecordPersist("path", 8, 4'000'000'000));
    ASSERT_OK(w.RecordPersist("tier 1", 20, 0));
    ASSERT_OK(w.RecordClose());
  }
  ASSERT_OK_AND_ASSIGN(auto h, ReadHistory(path));
  EXPECT_DOUBLE_EQ(h.persist.at("path").bytes, 4e9);
  EXPECT_DOUBLE_EQ(h.persist.at("tier 1").bytes, 0);
  auto mem = EstimateRestore(h, "memory");
  ASSERT_TRUE(mem.has_value());
  EXPECT_DOUBLE_EQ(mem->seconds, 0.5);  // the same bytes copied back at the save's bandwidth
  EXPECT_EQ(mem->how.rfind("estimated", 0), 0u) << mem->how;
  EXPECT_NE(mem->how.find("copy bandwidth"), std::string::npos) << mem->how;
  auto p = EstimateRestore(h, "path");
  ASSERT_TRUE(p.has_value());
  EXPECT_DOUBLE_EQ(p->seconds, 8);
  EXPECT_NE(p->how.find("persist bandwidth"), std::string::npos) << p->how;
  auto t = EstimateRestore(h, "tier 1");  // no size of its own: the state over its bandwidth
  ASSERT_TRUE(t.has_value());
  EXPECT_DOUBLE_EQ(t->seconds, 20);
  EXPECT_FALSE(EstimateRestore(h, "tier 2").has_value());  // never written: nothing to go on
  HistorySummary empty;
  EXPECT_FALSE(EstimateRestore(empty, "memory").has_value());
}

// An object store cannot append: the lines go to segments, published whole on Sync(), and a
// reader of the checkpoint path finds them with no $SAFEPOINT_HISTORY_DIR (issue 21).
TEST(HistoryTest, ObjectStoreHistoryIsKeptInSegmentsBesideTheCheckpoints) {
  ::unsetenv("SAFEPOINT_HISTORY_DIR");
  const std::string uri = "mem://history-segments";
  ASSERT_OK_AND_ASSIGN(auto storage, OpenStorage(uri));
  std::shared_ptr<Storage> shared(std::move(storage));
  EXPECT_EQ(ReadJobHistory(uri, "j").status().code(), StatusCode::kNotFound);

  auto first = HistoryWriter::InStorage(shared, "00000000000000000001-7", /*save_line_gap=*/0);
  ASSERT_OK(first.RecordStart(1));
  ASSERT_OK(first.RecordSave(0.25));
  EXPECT_TRUE(first.unsynced());
  EXPECT_EQ(ReadJobHistory(uri, "j").status().code(), StatusCode::kNotFound);  // not yet
  ASSERT_OK(first.Sync());
  EXPECT_FALSE(first.unsynced());
  // Enough lines to fill a segment: the writer goes on in the next one.
  uint64_t persists = 0;
  while (first.path().find("-0000.jsonl") != std::string::npos) {
    ASSERT_OK(first.RecordPersist("path", 2, 1000));
    ++persists;
    if (persists % 1000 == 0) ASSERT_OK(first.Sync());
    ASSERT_LT(persists, kSegmentBytes);  // it must roll over
  }
  ASSERT_OK(first.RecordPersist("path", 2, 1000));
  ++persists;
  ASSERT_OK(first.Sync());
  ASSERT_OK_AND_ASSIGN(auto segments, shared->List(kHistorySegmentPrefix));
  EXPECT_EQ(segments.size(), 2u);
  // A later agent of the job (no close from the first run: an interruption) in a segment of
  // its own.
  auto second = HistoryWriter::InStorage(shared, "00000000000000000002-8", /*save_line_gap=*/0);
  ASSERT_OK(second.RecordStart(2));
  ASSERT_OK(second.RecordRestore("path", 3));
  ASSERT_OK(second.RecordClose());
  ASSERT_OK(second.Sync());

  uint64_t skipped = 0;
  ASSERT_OK_AND_ASSIGN(auto h, ReadJobHistory(uri, "j", &skipped));
  EXPECT_EQ(skipped, 0u);
  EXPECT_EQ(h.runs, 2u);
  EXPECT_EQ(h.interruptions, 1u);
  EXPECT_EQ(h.persist.at("path").samples, persists);
  EXPECT_EQ(h.save->samples, 1u);
  EXPECT_DOUBLE_EQ(h.restore.at("path").seconds, 3);
  EXPECT_NE(h.path.find("safepoint-history/"), std::string::npos) << h.path;
}

// A history that an earlier version wrote to $SAFEPOINT_HISTORY_DIR for an object store is
// still read, merged in time order with the segments the agent writes now.
TEST(HistoryTest, LegacyHistoryDirIsStillReadAndMergedWithTheSegments) {
  TempDir dir;
  const std::string uri = "mem://history-legacy";
  ::setenv("SAFEPOINT_HISTORY_DIR", dir.path().c_str(), 1);
  ASSERT_TRUE(WriteStringToFile(dir.path() + "/j.history.jsonl",
                                "{\"t\":1000,\"ev\":\"start\",\"run\":1}\n"
                                "{\"t\":1100,\"ev\":\"save\",\"n\":4,\"seconds\":0.2}\n"));
  ASSERT_OK_AND_ASSIGN(auto h0, ReadJobHistory(uri, "j"));  // the legacy file alone
  EXPECT_EQ(h0.runs, 1u);
  ASSERT_OK_AND_ASSIGN(auto storage, OpenStorage(uri));
  auto w = HistoryWriter::InStorage(std::shared_ptr<Storage>(std::move(storage)), "2-1", 0);
  ASSERT_OK(w.RecordStart(2));
  ASSERT_OK(w.RecordClose());
  ASSERT_OK(w.Sync());
  ASSERT_OK_AND_ASSIGN(auto h, ReadJobHistory(uri, "j"));
  ::unsetenv("SAFEPOINT_HISTORY_DIR");
  EXPECT_EQ(h.runs, 2u);
  EXPECT_EQ(h.interruptions, 1u);  // the legacy run had no close, and came first
  EXPECT_EQ(h.save->samples, 4u);
  EXPECT_NE(h.path.find("j.history.jsonl"), std::string::npos) << h.path;
}

TEST(HistoryTest, LocalJobHistoryIsTheFileInTheCheckpointDirectory) {
  TempDir dir;
  {
    ASSERT_OK_AND_ASSIGN(auto w, HistoryWriter::Open(HistoryPath(dir.path(), "j"), 0));
    ASSERT_OK(w.RecordStart(1));
    ASSERT_OK(w.RecordClose());
  }
  ASSERT_OK_AND_ASSIGN(auto h, ReadJobHistory("file://" + dir.path(), "j"));
  EXPECT_EQ(h.runs, 1u);
  EXPECT_EQ(h.path, dir.path() + "/safepoint-history.jsonl");
}

// Issue 35: the job's history in a checkpoint directory other users can write (a shared
// filesystem) was appended to through a symlink, or into a file, that another user planted.
TEST(HistoryTest, ASymlinkAtTheHistoryPathIsRefusedAndNothingIsWrittenThroughIt) {
  TempDir dir;
  const std::string victim = dir.path() + "/victim";
  ASSERT_TRUE(WriteStringToFile(victim, "precious\n"));
  const std::string path = HistoryPath(dir.path(), "j");
  ASSERT_EQ(::symlink(victim.c_str(), path.c_str()), 0);
  auto w = HistoryWriter::Open(path, 0);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument) << w.status().ToString();
  EXPECT_NE(w.status().message().find("symlink"), std::string::npos) << w.status().ToString();
  EXPECT_NE(w.status().message().find(path), std::string::npos) << w.status().ToString();
  EXPECT_EQ(ReadFileToString(victim).value_or(""), "precious\n");
}

TEST(HistoryTest, AHistoryFileWritableByOthersOrOfAnotherUserIsRefused) {
  TempDir dir;
  const std::string path = HistoryPath(dir.path(), "j");
  {
    const safepoint::internal::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600));
    ASSERT_TRUE(fd.valid());
    ASSERT_EQ(::fchmod(fd.get(), 0666), 0);
  }
  auto w = HistoryWriter::Open(path, 0);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("writable by group or others (mode 0666)"), std::string::npos)
      << w.status().ToString();
  if (::geteuid() == 0) {
    ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
    ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);  // nobody's
    w = HistoryWriter::Open(path, 0);
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.status().message().find("owned by uid 65534"), std::string::npos)
        << w.status().ToString();
  }
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 0);
}

}  // namespace
}  // namespace safepoint::advisor::history_test
