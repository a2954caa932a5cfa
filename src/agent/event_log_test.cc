// The agent's JSON-lines event log (src/agent/event_log.h): one parseable line per event, the
// common fields in front, bounded by rotation.
#include "agent/event_log.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <future>
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

// Issue 35: the agent (root) appended through a symlink another user planted at the log's
// path, and wrote events into a 0666 file that user created first (and could read). Refused
// now, and nothing is written; the agent goes on without its log (Telemetry::OpenEventLog).
TEST(EventLogTest, ASymlinkAtThePathIsRefusedAndNothingIsWrittenThroughIt) {
  TempDir dir;
  const std::string target = dir.path() + "/victim";
  ASSERT_TRUE(test::WriteStringToFile(target, "precious\n"));
  const std::string path = dir.path() + "/events.jsonl";
  ASSERT_EQ(::symlink(target.c_str(), path.c_str()), 0);
  EventLog log;
  Status s = log.Open(path);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(path), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("symlink"), std::string::npos) << s.ToString();
  log.Write("save", "j", {{"step", 1}});
  EXPECT_FALSE(log.is_open());
  EXPECT_EQ(test::ReadFileToString(target).value_or(""), "precious\n");
}

TEST(EventLogTest, AFileWritableByOthersIsRefusedAndLeftUntouched) {
  TempDir dir;
  const std::string path = dir.path() + "/events.jsonl";
  {
    const safepoint::internal::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600));
    ASSERT_TRUE(fd.valid());
    ASSERT_EQ(::fchmod(fd.get(), 0666), 0);  // as another user would leave it for us
  }
  EventLog log;
  Status s = log.Open(path);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("writable by group or others (mode 0666)"), std::string::npos)
      << s.ToString();
  log.Write("save", "j", {{"step", 1}});
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 0);
}

TEST(EventLogTest, AFileOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another uid";
  TempDir dir;
  const std::string path = dir.path() + "/events.jsonl";
  {
    const safepoint::internal::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600));
    ASSERT_TRUE(fd.valid());
    ASSERT_EQ(::fchown(fd.get(), 65534, 65534), 0);  // nobody's, mode 0600: not group-writable
  }
  EventLog log;
  Status s = log.Open(path);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("owned by uid 65534"), std::string::npos) << s.ToString();
  log.Write("save", "j", {{"step", 1}});
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 0);
}

TEST(EventLogTest, AFifoAtThePathIsRefusedWithoutBlocking) {
  TempDir dir;
  const std::string path = dir.path() + "/events.jsonl";
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  EventLog log;
  // Without O_NONBLOCK the open would wait for a reader for ever: given 10 s, then a reader.
  auto opened = std::async(std::launch::async, [&] { return log.Open(path); });
  const bool blocked = opened.wait_for(std::chrono::seconds(10)) != std::future_status::ready;
  if (blocked) {
    const safepoint::internal::UniqueFd reader(::open(path.c_str(), O_RDONLY | O_NONBLOCK));
    opened.wait();
  }
  EXPECT_FALSE(blocked) << "the open waited for a reader of the FIFO";
  Status s = opened.get();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("not a regular file"), std::string::npos) << s.ToString();
}

TEST(EventLogTest, ANewLogIsPrivateToItsOwner) {
  TempDir dir;
  const std::string path = dir.path() + "/events.jsonl";
  const mode_t old = ::umask(0);
  EventLog log;
  const Status s = log.Open(path);
  ::umask(old);
  ASSERT_OK(s);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
}

}  // namespace
}  // namespace safepoint::agent::event_log_test
