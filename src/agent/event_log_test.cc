// The agent's JSON-lines event log (src/agent/event_log.h): one parseable line per event, the
// common fields in front, bounded by rotation.
#include "agent/event_log.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <sstream>

#include "testing/test_util.h"

namespace safepoint::agent::event_log_test {
namespace {

using test::ReadJsonLines;
using test::TempDir;

TEST(EventLogTest, WritesOneJsonObjectPerLineWithTheCommonFieldsFirst) {
  TempDir dir;
  const std::string path = dir.path() + "/events.jsonl";
  EventLog log;
  ASSERT_OK(log.Open(path));
  log.Write("persist", "run1", {{"rank", 1}, {"step", 7}, {"bytes", 4096}, {"seconds", 0.5}});
  log.Write("failure", "run1", {{"error", "line one\nline \"two\" \xff"}});  // not valid UTF-8
  const auto lines = ReadJsonLines(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["event"], "persist");
  EXPECT_EQ(lines[0]["job"], "run1");
  EXPECT_EQ(lines[0]["step"], 7);
  EXPECT_EQ(lines[0]["seconds"], 0.5);
  EXPECT_TRUE(lines[0]["ts"].is_number());
  const std::string when = lines[0]["time"];
  EXPECT_EQ(when.size(), 24u) << when;  // 2026-12-01T10:46:32.123Z
  EXPECT_EQ(when.back(), 'Z');
  const auto text = test::ReadFileToString(path);
  ASSERT_TRUE(text.has_value());
  EXPECT_EQ(text->find("{\"time\""), 0u);  // the common fields come first, in order
  EXPECT_NE(text->find("\"event\":\"persist\",\"job\":\"run1\""), std::string::npos);
  EXPECT_EQ(lines[1]["event"], "failure");
  EXPECT_NE(lines[1]["error"].get<std::string>().find("line \"two\""), std::string::npos);
  EXPECT_EQ(log.write_errors(), 0u);
}

TEST(EventLogTest, AppendsToAnExistingLog) {
  TempDir dir;
  const std::string path = dir.path() + "/events.jsonl";
  {
    EventLog log;
    ASSERT_OK(log.Open(path));
    log.Write("save", "j", {{"step", 1}});
  }
  EventLog log;
  ASSERT_OK(log.Open(path));
  log.Write("save", "j", {{"step", 2}});
  const auto lines = ReadJsonLines(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1]["step"], 2);
}

TEST(EventLogTest, RotatesAtTheLimitSoThatItStaysBounded) {
  TempDir dir;
  const std::string path = dir.path() + "/events.jsonl";
  EventLog log;
  ASSERT_OK(log.Open(path, /*max_bytes=*/2000));
  for (int i = 0; i < 200; ++i) log.Write("save", "job", {{"step", i}, {"bytes", 123456789}});
  struct stat now {
  }, old{};
  ASSERT_EQ(::stat(path.c_str(), &now), 0);
  ASSERT_EQ(::stat((path + ".1").c_str(), &old), 0);
  EXPECT_LE(now.st_size, 2000);
  EXPECT_LE(old.st_size, 2000);
  // Both files hold whole lines, and the newest event is in the current file.
  const auto current = ReadJsonLines(path);
  const auto previous = ReadJsonLines(path + ".1");
  ASSERT_FALSE(current.empty());
  ASSERT_FALSE(previous.empty());
  EXPECT_EQ(current.back()["step"], 199);
  EXPECT_EQ(previous.back()["step"].get<int>() + 1, current.front()["step"].get<int>());
}

TEST(EventLogTest, OpenNamesThePathWhenItCannotBeCreated) {
  TempDir dir;
  EventLog log;
  const std::string path = dir.path() + "/missing/events.jsonl";
  Status s = log.Open(path);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_NE(s.message().find(path), std::string::npos);
  log.Write("save", "j", {});  // closed: a no-op
  EXPECT_FALSE(log.is_open());
}

}  // namespace
}  // namespace safepoint::agent::event_log_test
