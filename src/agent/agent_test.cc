// Tests of the real agent binary (safepointd) as a child process: its protocol robustness, its
// single-instance lock, and persisting / flushing / closing with a SnapshotClient.
#include "agent/agent.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "advisor/history.h"
#include "agent/job_config.h"
#include "base/process.h"
#include "base/unique_fd.h"
#include "protocol/protocol.h"
#include "safepoint/checkpoint.h"
#include "safepoint/client.h"
#include "shm/arena.h"
#include "testing/protocol_util.h"
#include "testing/test_util.h"

#ifndef SAFEPOINTD_PATH
#error "SAFEPOINTD_PATH must name the built safepointd binary"
#endif

namespace safepoint::agent_test {
namespace {

using namespace safepoint::protocol;  // NOLINT: the protocol under test

namespace fs = std::filesystem;
using internal::UniqueFd;
using test::FrameHeader;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr double kDeadlineSeconds = 30;  // generous: only a failing test waits this long

// A shard whose bytes are a pure function of the step.
struct Shard {
  std::vector<float> big, small;
  std::vector<TensorSource> sources;
  std::string extras;

  explicit Shard(uint64_t step) : big(256 << 10), small(33) {
    for (size_t i = 0; i < big.size(); ++i) big[i] = float(step * 1000 + i);
    for (size_t i = 0; i < small.size(); ++i) small[i] = float(step) - float(i);
    sources.push_back({{"big", DType::kFloat32, {big.size()}, {}, {}}, big.data(), big.size() * 4});
    sources.push_back(
        {{"small", DType::kFloat32, {small.size()}, {}, {}}, small.data(), small.size() * 4});
    Dict d;
    d.items.emplace_back(Value(std::string("step")), Value(int64_t(step)));
    d.items.emplace_back(Value(std::string("big")), Value(TensorRef{0, 0}));
    extras = *EncodeExtras(Value(std::move(d)));
  }
};

// The reader holds exactly Shard(step)'s bytes.
void ExpectShard(const ImageReader& reader, const Value& extras, uint64_t step) {
  const Shard want(step);
  EXPECT_EQ(reader.meta().step, step);
  ASSERT_EQ(reader.tensors().size(), 2u);
  EXPECT_EQ(reader.tensors()[0].spec.name, "big");
  auto big = reader.tensor_data(0);
  ASSERT_EQ(big.size(), want.big.size() * 4);
  EXPECT_EQ(std::memcmp(big.data(), want.big.data(), big.size()), 0);
  auto small = reader.tensor_data(1);
  ASSERT_EQ(small.size(), want.small.size() * 4);
  EXPECT_EQ(std::memcmp(small.data(), want.small.data(), small.size()), 0);
  auto enc = EncodeExtras(extras);
  ASSERT_OK(enc);
  EXPECT_EQ(*enc, want.extras);
}

bool SendAll(int fd, const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// What came back on a connection until the agent closed it (or the deadline passed).
struct Outcome {
  bool closed = false;
  std::vector<Message> messages;
  std::string error;  // a malformed reply, if any
};

Outcome ReadUntilClosed(int fd, double timeout_s) {
  Outcome out;
  FrameDecoder decoder;
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    if (left <= 0) return out;
    auto m = ReceiveMessage(fd, decoder, left);
    if (m.ok()) {
      out.messages.push_back(std::move(*m));
      continue;
    }
    if (m.status().code() == StatusCode::kUnavailable) {
      out.closed = true;  // EOF or ECONNRESET
    } else if (m.status().code() != StatusCode::kCancelled) {
      out.error = m.status().ToString();
    }
    return out;
  }
}

class AgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(tmp_dir_.ok()) << "mkdtemp failed";
    tmp_ = tmp_dir_.path();
    shm_ = tmp_ + "/shm";
    storage_ = tmp_ + "/ckpt";
    ASSERT_EQ(::mkdir(shm_.c_str(), 0700), 0);
    job_dir_ = shm_ + "/safepoint-" + std::to_string(::geteuid()) + "-" + job_;
  }

  void TearDown() override {
    for (auto& [pid, reaped] : children_) {
      if (reaped) continue;
      ::kill(pid, SIGKILL);
      int status;
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
    // An agent that a SnapshotClient started on demand is not our child.
    uint32_t pid = 0;
    if (AgentAlive(job_dir_, &pid) && pid > 1) {
      ::kill(static_cast<pid_t>(pid), SIGKILL);
      const auto deadline = Clock::now() + std::chrono::seconds(10);
      while (AgentAlive(job_dir_) && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    if (HasFailure()) {
      // The logs of the agents this test started, and of the one a client started.
      logs_.push_back(AgentLogPath(job_dir_));
      for (const auto& log : logs_) {
        if (auto text = test::ReadFileToString(log)) {
          std::cerr << "---- " << log << " ----\n" << *text;
        }
      }
    }
  }

  // Starts safepointd for the job as a child process (not waiting for it), with `extra_args`.
  pid_t Spawn(const std::vector<std::string>& extra_args = {}) {
    const std::string log = tmp_ + "/agent-" + std::to_string(logs_.size()) + ".log";
    logs_.push_back(log);
    std::vector<std::string> args = {SAFEPOINTD_PATH, "--job", job_, "--shm-dir", shm_};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
      if (out >= 0) {
        ::dup2(out, 1);
        ::dup2(out, 2);
      }
      ::syscall(SYS_close_range, 3, ~0U, 0);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    EXPECT_GT(pid, 0) << std::strerror(errno);
    if (pid > 0) children_[pid] = false;
    return pid;
  }

  // Starts the agent (agent_) and waits until its socket accepts connections; a fatal failure
  // when it exits or does not listen within the deadline.
  void StartAgent(const std::vector<std::string>& extra_args = {}) {
    agent_ = Spawn(extra_args);
    ASSERT_GT(agent_, 0);
    ASSERT_TRUE(WaitUntil([&] { return !Running(agent_) || TryConnect().valid(); }))
        << "the agent did not listen within the deadline";
    ASSERT_TRUE(Running(agent_)) << "the agent exited at start";
  }

  // The exit status of a child (waitpid's), or nullopt if it is still running at the deadline.
  std::optional<int> WaitExit(pid_t pid, double timeout_s = kDeadlineSeconds) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    for (;;) {
      int status;
      const pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        children_[pid] = true;
        return status;
      }
      if (Clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  // The child `pid` exits (within the deadline) with exit status `code`.
  void ExpectExitsWith(pid_t pid, int code) {
    const std::optional<int> status = WaitExit(pid);
    ASSERT_TRUE(status) << "process " << pid << " did not exit";
    ASSERT_TRUE(WIFEXITED(*status)) << "process " << pid << ": wait status " << *status;
    EXPECT_EQ(WEXITSTATUS(*status), code);
  }

  bool Running(pid_t pid) {
    int status;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      children_[pid] = true;
      return false;
    }
    return true;
  }

  // A connection to the agent's socket (not valid when none could be made).
  UniqueFd TryConnect() {
    const std::string path = AgentSocketPath(job_dir_);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof(addr.sun_path)) return UniqueFd();
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (fd.valid() && ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      fd.Reset();
    }
    return fd;
  }

  // TryConnect, and a test failure when it could not connect.
  UniqueFd Connect() {
    UniqueFd fd = TryConnect();
    EXPECT_TRUE(fd.valid()) << "cannot connect to " << AgentSocketPath(job_dir_);
    return fd;
  }

  // Polls `done` until it holds or the deadline passed; whether it held.
  bool WaitUntil(const std::function<bool()>& done) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(kDeadlineSeconds);
    while (!done()) {
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

  // Asks for the agent's status on `fd` and parses it.
  std::optional<json> QueryStatus(int fd, double timeout_s = kDeadlineSeconds) {
    if (!SendMessage(fd, MessageType::kStatus, "{}").ok()) {
      ADD_FAILURE() << "sending kStatus failed";
      return std::nullopt;
    }
    FrameDecoder decoder;
    auto reply = ReceiveMessage(fd, decoder, timeout_s);
    if (!reply.ok()) {
      ADD_FAILURE() << "no status reply: " << reply.status().ToString();
      return std::nullopt;
    }
    if (reply->type != MessageType::kStatusReply) {
      ADD_FAILURE() << "status answered with type " << int(reply->type) << ": " << reply->payload;
      return std::nullopt;
    }
    json j = json::parse(reply->payload, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      ADD_FAILURE() << "status reply is not a JSON object: " << reply->payload;
      return std::nullopt;
    }
    return j;
  }

  // A well-formed client on a fresh connection gets a status from agent_.
  void ExpectServes() {
    EXPECT_TRUE(Running(agent_)) << "the agent exited";
    const UniqueFd fd = Connect();
    if (!fd.valid()) return;
    auto j = QueryStatus(fd.get());
    ASSERT_TRUE(j);
    EXPECT_EQ((*j)["job"], job_);
    EXPECT_EQ((*j)["agent_pid"], agent_);
  }

  // Connects and says hello as rank 0; the connection, or an invalid one after a test failure.
  UniqueFd ConnectAndHello() {
    UniqueFd fd = Connect();
    if (!fd.valid()) return fd;
    EXPECT_OK(SendMessage(fd.get(), MessageType::kHello, HelloPayload()));
    FrameDecoder d;
    auto reply = ReceiveMessage(fd.get(), d, kDeadlineSeconds);
    EXPECT_OK(reply);
    if (!reply.ok() || reply->type != MessageType::kHelloReply) {
      ADD_FAILURE() << "hello answered with " << (reply.ok() ? reply->payload : "nothing");
      return UniqueFd();
    }
    return fd;
  }

  std::string HelloPayload() const {
    return json{
        {"rank", 0}, {"world_size", 1}, {"storage", storage_}, {"keep", 3}, {"pid", ::getpid()}}
        .dump();
  }

  ClientOptions Options() const {
    ClientOptions o;
    o.storage = storage_;
    o.job = job_;
    o.shm_dir = shm_;
    o.keep = 10;
    o.agent_binary = SAFEPOINTD_PATH;
    o.agent_start_timeout_s = kDeadlineSeconds;
    o.copy_threads = 2;
    return o;
  }

  // Options of rank `rank` of a 2-rank job (both ranks on this agent's node), of `attempt`.
  ClientOptions RankOptions(uint32_t rank, uint64_t attempt = 0) const {
    ClientOptions o = Options();
    o.rank = rank;
    o.world_size = 2;
    o.attempt = attempt;
    return o;
  }

  void SaveStep(SnapshotClient& c, uint64_t step, bool persist) {
    Shard s(step);
    auto r = c.Save(step, s.sources, s.extras, persist);
    ASSERT_OK(r);
    EXPECT_TRUE(r->saved);
    EXPECT_EQ(r->persist_requested, persist);
    EXPECT_TRUE(r->agent_error.empty()) << r->agent_error;
  }

  // Saves step 1 of a Shard(1) with persist but without notify (the agent is not told), then
  // SIGKILLs the agent; `first`: its pid.
  void SaveUnnotifiedThenKillAgent(SnapshotClient* client, uint32_t* first) {
    ASSERT_TRUE(AgentAlive(job_dir_, first));
    Shard one(1);
    ASSERT_OK_AND_ASSIGN(SnapshotResult r1, client->Save(1, one.sources, one.extras,
                                                         /*persist=*/true, /*notify=*/false));
    ASSERT_TRUE(r1.saved);
    ASSERT_EQ(::kill(static_cast<pid_t>(*first), SIGKILL), 0);
  }

  std::vector<uint64_t> Committed() {
    std::vector<uint64_t> out;
    auto store = OpenCheckpointStore(storage_);
    if (!store.ok()) return out;
    auto list = (*store)->ListCommitted();
    EXPECT_OK(list);
    if (!list.ok()) return out;
    for (const auto& c : *list) out.push_back(c.step);
    return out;
  }

  // Loads `step` from storage and checks it is bit-exact.
  void ExpectOnStorage(std::optional<uint64_t> step, uint64_t want_step) {
    auto store = OpenCheckpointStore(storage_);
    ASSERT_OK(store);
    auto shard = LoadShard(**store, step, 0);
    ASSERT_OK(shard);
    EXPECT_EQ(shard->commit.step, want_step);
    EXPECT_TRUE(shard->skipped.empty());
    ExpectShard(shard->reader, shard->extras, want_step);
  }

  std::vector<std::string> SlotFiles() {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(job_dir_, ec)) {
      const std::string name = e.path().filename();
      if (name.rfind("rank-", 0) == 0) out.push_back(name);
    }
    return out;
  }

  const std::string job_ = "agent-test";
  test::TempDir tmp_dir_{"spag", "/tmp"};  // short: the socket path must fit sun_path
  std::string tmp_, shm_, storage_, job_dir_;
  pid_t agent_ = -1;                // started by StartAgent
  std::map<pid_t, bool> children_;  // pid -> reaped
  std::vector<std::string> logs_;
};

TEST_F(AgentTest, ServesStatus) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  ExpectServes();
  uint32_t pid = 0;
  EXPECT_TRUE(AgentAlive(job_dir_, &pid));
  EXPECT_EQ(pid, static_cast<uint32_t>(agent_));
  struct stat st;
  ASSERT_EQ(::stat(AgentSocketPath(job_dir_).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

// Each malformed input closes that connection only (possibly after a kError reply); the agent
// keeps serving well-formed clients, including one that stays connected throughout.
TEST_F(AgentTest, MalformedInputClosesOnlyThatConnection) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  UniqueFd steady = Connect();
  ASSERT_TRUE(steady.valid());
  ASSERT_TRUE(QueryStatus(steady.get()));

  std::mt19937_64 rng(99);
  std::string random_garbage(512, '\0');
  for (auto& c : random_garbage) c = char(rng());
  random_garbage.replace(0, 4, "\xff\xff\xff\x7f");

  const std::string hello = EncodeFrame(MessageType::kHello, HelloPayload());
  struct Case {
    std::string name;
    std::string bytes;
  };
  const std::vector<Case> cases = {
      {"text garbage", "GET / HTTP/1.1\r\nHost: safepoint\r\n\r\n"},
      {"random garbage", random_garbage},
      {"bad version", FrameHeader(6, kProtocolVersion + 1, uint16_t(MessageType::kStatus)) + "{}"},
      {"version 0", FrameHeader(6, 0, uint16_t(MessageType::kStatus)) + "{}"},
      {"oversized length", FrameHeader(kMaxMessageBytes + 1, kProtocolVersion, 4)},
      {"huge length", FrameHeader(0xFFFFFFFFu, kProtocolVersion, 4)},
      {"length below header", FrameHeader(2, kProtocolVersion, 4)},
      {"unknown type", FrameHeader(6, kProtocolVersion, 77) + "{}"},
      {"invalid JSON", EncodeFrame(MessageType::kHello, R"({"rank": 0, "storage": )")},
      {"JSON that is not an object", EncodeFrame(MessageType::kStatus, "[1, 2, 3]")},
      {"hello missing fields", EncodeFrame(MessageType::kHello, R"({"rank": 0})")},
      {"hello with wrong types",
       EncodeFrame(MessageType::kHello,
                   R"({"rank": 0, "world_size": 1, "keep": 1, "storage": 5})")},
      {"snapshot missing fields after hello",
       hello + EncodeFrame(MessageType::kSnapshot, R"({"slot": 0})")},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    UniqueFd fd = Connect();
    ASSERT_TRUE(fd.valid());
    ASSERT_TRUE(SendAll(fd.get(), c.bytes));
    const Outcome out = ReadUntilClosed(fd.get(), 2);
    fd.Reset();
    EXPECT_TRUE(out.closed) << "the agent kept the connection open";
    EXPECT_TRUE(out.error.empty()) << out.error;
    for (const Message& m : out.messages) {
      if (m.type == MessageType::kHelloReply) continue;  // the well-formed hello before
      EXPECT_EQ(m.type, MessageType::kError) << m.payload;
      json j = json::parse(m.payload, nullptr, false);
      EXPECT_TRUE(j.is_object() && j.contains("error")) << m.payload;
    }
    ExpectServes();
    auto steady_status = QueryStatus(steady.get());
    ASSERT_TRUE(steady_status);
    EXPECT_EQ((*steady_status)["job"], job_);
  }
  // Nothing was persisted or committed because of any of it.
  EXPECT_TRUE(Committed().empty());
  steady.Reset();
  EXPECT_TRUE(Running(agent_));
}

// A request that needs a hello, sent before it, is a protocol violation: refused with kError and
// that connection is closed, like any other malformed input.
TEST_F(AgentTest, SnapshotBeforeHelloClosesTheConnection) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  UniqueFd fd = Connect();
  ASSERT_TRUE(fd.valid());
  const std::string snapshot =
      json{{"slot", 0}, {"generation", 1}, {"step", 1}, {"persist", true}, {"leased", false}}
          .dump();
  ASSERT_TRUE(SendAll(fd.get(), EncodeFrame(MessageType::kSnapshot, snapshot)));
  const Outcome out = ReadUntilClosed(fd.get(), 2);
  fd.Reset();
  ASSERT_FALSE(out.messages.empty()) << "no kError reply";
  EXPECT_EQ(out.messages[0].type, MessageType::kError) << out.messages[0].payload;
  EXPECT_TRUE(out.closed) << "the agent kept the connection open after refusing it";
  ExpectServes();
  EXPECT_TRUE(Committed().empty());
}

// The agent validates the slot a client names: an out-of-range slot (claimed already leased)
// must not make it read past its slot table. (A release build usually survives the
// out-of-bounds read by luck; with -D_GLIBCXX_ASSERTIONS or ASan the agent aborts.)
TEST_F(AgentTest, SnapshotOfASlotThatDoesNotExistIsHarmless) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  UniqueFd fd = ConnectAndHello();
  ASSERT_TRUE(fd.valid());
  for (uint32_t slot : {2u, 9u, 15u}) {
    // The agent may refuse these by closing the connection: later sends may fail.
    SendMessage(
        fd.get(), MessageType::kSnapshot,
        json{{"slot", slot}, {"generation", 1}, {"step", slot}, {"persist", true}, {"leased", true}}
            .dump())
        .IgnoreError();
  }
  // Wait until the agent worked through them; it must still be alive and serve.
  const auto deadline = Clock::now() + std::chrono::duration<double>(kDeadlineSeconds);
  for (;;) {
    ASSERT_TRUE(Running(agent_)) << "the agent crashed";
    UniqueFd probe = TryConnect();
    ASSERT_TRUE(probe.valid()) << "the agent stopped listening";
    auto j = QueryStatus(probe.get());
    probe.Reset();
    ASSERT_TRUE(j);
    if ((*j)["queued"] == 0 && (*j)["in_flight"].is_null()) {
      for (auto& r : (*j)["ranks"]) EXPECT_EQ(r["persists_ok"], 0) << r.dump();
      break;
    }
    ASSERT_LT(Clock::now(), deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(Committed().empty());
  fd.Reset();
  ExpectServes();
}

// A client that sends requests but never reads the replies must not wedge the agent for everyone
// else: its replies back up, and the agent has to keep serving other clients meanwhile.
TEST_F(AgentTest, ClientThatNeverReadsDoesNotWedgeTheAgent) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  UniqueFd stuck = Connect();
  ASSERT_TRUE(stuck.valid());
  ASSERT_TRUE(QueryStatus(stuck.get()));  // accepted and served before it floods
  std::string requests;
  for (int i = 0; i < 5000; ++i) requests += EncodeFrame(MessageType::kStatus, "{}");
  // Non-blocking: once both socket buffers are full, this side stops sending too.
  ASSERT_EQ(::fcntl(stuck.get(), F_SETFL, O_NONBLOCK), 0);
  size_t off = 0;
  const auto send_deadline = Clock::now() + std::chrono::seconds(2);
  while (off < requests.size() && Clock::now() < send_deadline) {
    const ssize_t n =
        ::send(stuck.get(), requests.data() + off, requests.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<size_t>(n);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // Wait until the unread replies pile up on this side: the agent is answering the flood.
  const auto pile_deadline = Clock::now() + std::chrono::duration<double>(kDeadlineSeconds);
  for (int queued = 0; queued < (16 << 10) && Clock::now() < pile_deadline;) {
    ASSERT_EQ(::ioctl(stuck.get(), FIONREAD, &queued), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // Another client is still served (in well under the deadline a wedged agent would need).
  UniqueFd fd = Connect();
  ASSERT_TRUE(fd.valid());
  auto j = QueryStatus(fd.get(), 5);
  fd.Reset();
  EXPECT_TRUE(j) << "the agent stopped serving while one client did not read its replies";
  stuck.Reset();
  EXPECT_TRUE(Running(agent_));
}

TEST_F(AgentTest, SecondAgentForTheSameJobExitsWith3) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  const pid_t second = Spawn();
  ASSERT_GT(second, 0);
  ExpectExitsWith(second, 3);
  // The first one is undisturbed: same socket, same lock.
  ExpectServes();
  uint32_t pid = 0;
  EXPECT_TRUE(AgentAlive(job_dir_, &pid));
  EXPECT_EQ(pid, static_cast<uint32_t>(agent_));
}

// A client starts the agent on demand, saves with persist=true, and the steps are committed.
TEST_F(AgentTest, ClientPersistsStepsThatLoadBitExact) {
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(Options()));
  uint32_t agent_pid = 0;
  ASSERT_TRUE(AgentAlive(job_dir_, &agent_pid)) << "the client did not start an agent";
  for (uint64_t step = 1; step <= 4; ++step) SaveStep(*client, step, /*persist=*/true);
  Status w = client->Wait(kDeadlineSeconds);
  ASSERT_OK(w);
  EXPECT_EQ(client->last_persist_step(), std::optional<uint64_t>(4));

  // Every persisted step is committed (keep = 10) and loads bit-exact.
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{1, 2, 3, 4}));
  for (uint64_t step = 1; step <= 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ExpectOnStorage(step, step);
  }
  ExpectOnStorage(std::nullopt, 4);

  // Hot reload from memory: the newest snapshot.
  auto mem = client->LoadNewest(std::nullopt);
  ASSERT_OK(mem);
  EXPECT_EQ(mem->step, 4u);
  ExpectShard(mem->reader, mem->extras, 4);
  EXPECT_OK(client->LoadNewest(4));
  EXPECT_EQ(client->LoadNewest(5).status().code(), StatusCode::kNotFound);
  // In place with the extras the caller knows: equal bytes are not decoded again; other bytes
  // (step 3's) are, as without them.
  const Shard four(4), three(3);
  ASSERT_NE(four.extras, three.extras);
  auto known = client->LoadNewest(std::nullopt, /*in_place=*/true, {}, &four.extras);
  ASSERT_OK(known);
  EXPECT_TRUE(known->extras_known);
  EXPECT_TRUE(std::holds_alternative<std::monostate>(known->extras.v));
  auto other = client->LoadStep(4, /*in_place=*/true, {}, &three.extras);
  ASSERT_OK(other);
  EXPECT_FALSE(other->extras_known);
  ExpectShard(other->reader, other->extras, 4);

  auto status = client->AgentStatus();
  ASSERT_OK(status);
  json j = json::parse(*status, nullptr, false);
  ASSERT_TRUE(j.is_object()) << *status;
  EXPECT_EQ(j["agent_pid"], agent_pid);
  EXPECT_EQ(j["newest_committed"], 4);
  ASSERT_EQ(j["ranks"].size(), 1u);
  EXPECT_EQ(j["ranks"][0]["persists_ok"], 4);
  EXPECT_EQ(j["ranks"][0]["persists_failed"], 0);
  for (auto& s : j["ranks"][0]["slots"]) EXPECT_FALSE(s["leased"].get<bool>()) << s.dump();

  // A further Wait with nothing new asked returns at once.
  EXPECT_OK(client->Wait(kDeadlineSeconds));
}

// SIGTERM: the agent flushes the newest snapshot that was never persisted and exits 0.
TEST_F(AgentTest, SigtermFlushesTheNewestSnapshot) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(Options()));
  SaveStep(*client, 5, /*persist=*/false);
  SaveStep(*client, 6, /*persist=*/false);
  // Nothing asked a persist: nothing is on storage yet (and Wait has nothing to wait for).
  EXPECT_OK(client->Wait(kDeadlineSeconds));
  EXPECT_TRUE(Committed().empty());

  ASSERT_EQ(::kill(agent_, SIGTERM), 0);
  ExpectExitsWith(agent_, 0);

  const auto committed = Committed();
  ASSERT_FALSE(committed.empty());
  EXPECT_EQ(committed.back(), 6u);
  ExpectOnStorage(std::nullopt, 6);
  // The snapshots stay in memory for a restarted job.
  auto mem = client->LoadNewest(std::nullopt);
  ASSERT_OK(mem);
  EXPECT_EQ(mem->step, 6u);
  EXPECT_FALSE(SlotFiles().empty());
}

// A rank that dies without closing: its newest snapshot is flushed (emergency flush).
TEST_F(AgentTest, DeadClientIsFlushed) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  const int exit_code = test::RunInChild([&] {
    auto c = SnapshotClient::Connect(Options());
    if (!c.ok()) return 2;
    Shard s(7);
    auto r = (*c)->Save(7, s.sources, s.extras, /*persist=*/false);
    return r.ok() && r->saved ? 0 : 3;  // dies without Close
  });
  ASSERT_EQ(exit_code, 0) << "the child failed to save";
  WaitUntil([&] { return !Committed().empty(); });
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{7}));
  ExpectOnStorage(7, 7);
  ExpectServes();
}

// Clean close: the newest snapshot is persisted, the rank's slot files are removed and the
// on-demand agent exits.
TEST_F(AgentTest, CleanCloseRemovesSlotsAndTheAgentExits) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(Options()));
  SaveStep(*client, 1, /*persist=*/true);
  SaveStep(*client, 2, /*persist=*/false);
  EXPECT_EQ(SlotFiles().size(), 2u);
  Status closed = client->Close(kDeadlineSeconds);
  ASSERT_OK(closed);
  EXPECT_TRUE(SlotFiles().empty()) << "slot files left: " << SlotFiles().size();

  ExpectExitsWith(agent_, 0);  // the only rank closed
  EXPECT_TRUE(SlotFiles().empty());
  EXPECT_FALSE(AgentAlive(job_dir_));
  EXPECT_FALSE(fs::exists(AgentSocketPath(job_dir_)));

  const auto committed = Committed();
  ASSERT_FALSE(committed.empty());
  EXPECT_EQ(committed.back(), 2u);
  ExpectOnStorage(std::nullopt, 2);
  client.reset();
}

// Found by the crash campaign (tests/crash): a training process killed after it marked a slot
// COMPLETE and leased for a persist, but before it told the agent, left that lease held. The
// emergency flush failed to lease the slot ("superseded") and nobody released it, so the rank's
// next process, with one slot holding its newest snapshot and the other leased, waited forever
// in save(). The flush takes the lease over: the step is persisted and the lease released.
TEST_F(AgentTest, DeadClientsUnannouncedLeaseIsTakenOverByTheFlush) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  const int exit_code = test::RunInChild([&] {
    auto c = SnapshotClient::Connect(Options());  // hello: the agent watches this process
    if (!c.ok()) return 2;
    auto arena = Arena::Open(job_dir_, 0);
    if (!arena.ok()) return 3;
    Shard s(7);
    auto b = ImageBuilder::Create(test::TestImageMeta(job_, 7, 0, 1), s.sources, s.extras);
    if (!b.ok()) return 4;
    auto t = (*arena)->BeginWrite((*b)->size());
    if (!t.ok() || t->first != Arena::Acquire::kAcquired) return 5;
    (*b)->FillAll(t->second.data, 1);
    // What SnapshotClient::Save does for a persisted step, up to the kill point
    // "client.save.after_complete": COMPLETE and leased, the agent not told.
    (*arena)->FinishWrite(t->second, 7, (*b)->size(), /*leased=*/true);
    return 0;
  });
  ASSERT_EQ(exit_code, 0) << "the child failed";
  auto leased = [&] {
    auto arena = Arena::Open(job_dir_, 0);
    if (!arena.ok()) return true;
    for (const SlotInfo& s : (*arena)->Slots()) {
      if (s.leased) return true;
    }
    return false;
  };
  WaitUntil([&] { return !Committed().empty() && !leased(); });
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{7}));
  ExpectOnStorage(7, 7);
  EXPECT_FALSE(leased()) << "the dead writer's lease is still held";
  // The rank's next process saves twice (both slots) without waiting forever.
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(Options()));
  SaveStep(*client, 8, /*persist=*/false);
  SaveStep(*client, 9, /*persist=*/true);
  ASSERT_OK(client->Wait(kDeadlineSeconds));
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{7, 9}));
  ExpectServes();
}

// Regression (crash campaign, seed 2279128066, round 24): the agent remembered a persisted step
// by its slot generation only. Generations count per slot, so when the ranks resumed from an
// older step and saved that step again into the other slot with an equal generation, the agent
// took the new snapshot for the one it had persisted and skipped it: rank 0's image stayed the
// one from the earlier run, the step never committed, and wait() hung.
TEST_F(AgentTest, StepSavedAgainIntoTheOtherSlotIsPersistedAgain) {
  auto options = [&](uint32_t rank, uint64_t attempt) { return RankOptions(rank, attempt); };
  {
    // Run 1: rank 0 saves step 2 (slot 0, generation 1) and it is persisted; rank 1 dies first.
    auto r0 = SnapshotClient::Connect(options(0, 1));
    ASSERT_OK(r0);
    SaveStep(**r0, 2, /*persist=*/true);
    for (int i = 0; i < 200 && Committed().empty(); ++i) {
      auto st = (*r0)->AgentStatus();  // wait until the agent persisted it (never committed)
      if (st.ok() && json::parse(*st)["ranks"][0]["persists_ok"] == 1) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  // Run 2 (a new attempt): both ranks save step 2; rank 0's goes into slot 1, generation 1.
  auto r0 = SnapshotClient::Connect(options(0, 2));
  auto r1 = SnapshotClient::Connect(options(1, 2));
  ASSERT_TRUE(r0.ok() && r1.ok());
  SaveStep(**r0, 2, /*persist=*/true);
  SaveStep(**r1, 2, /*persist=*/true);
  Status w0 = (*r0)->Wait(kDeadlineSeconds);
  Status w1 = (*r1)->Wait(kDeadlineSeconds);
  ASSERT_OK(w0);
  ASSERT_OK(w1);
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{2}));
}

// Found by the crash campaign (tests/crash): an agent started on demand that died while starting
// (there: SIGKILLed while it adopted the job's snapshots) left the training process waiting out
// the whole start timeout for an agent that was gone, then failing. The client starts it again.
TEST_F(AgentTest, ClientRestartsAnAgentThatDiedWhileStarting) {
  // An "agent" that dies at its first start and is the real one afterwards.
  const std::string script = tmp_ + "/dies-once";
  ASSERT_TRUE(test::WriteStringToFile(
      script, std::string("#!/bin/sh\n") +
                  "if [ ! -e \"$0.started\" ]; then : > \"$0.started\"; exit 1; fi\n" + "exec " +
                  SAFEPOINTD_PATH + " \"$@\"\n"));
  ASSERT_EQ(::chmod(script.c_str(), 0700), 0);
  ClientOptions options = Options();
  options.agent_binary = script;
  auto client = SnapshotClient::Connect(options);
  ASSERT_OK(client);
  EXPECT_TRUE(fs::exists(script + ".started"));
  uint32_t pid = 0;
  ASSERT_TRUE(AgentAlive(job_dir_, &pid));
  SaveStep(**client, 3, /*persist=*/true);
  ASSERT_OK((*client)->Wait(kDeadlineSeconds));
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{3}));
}

// Found by the node-loss campaign (seed 1005935286, round 30): with dedupe or redundancy a save
// tells the agent only after a collective of the ranks. A rank whose agent had been killed
// copied its next snapshot and entered that collective without restarting it, while another
// rank waited for the commit of the previous step, which needed this node's image: neither
// went on. A save that does not notify now restarts a dead agent first, and the new agent
// persists the snapshot the dead one left, with nobody telling it.
TEST_F(AgentTest, SaveWithoutNotifyRestartsADeadAgentWhichPersistsWhatItLeft) {
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(Options()));
  uint32_t first = 0;
  ASSERT_NO_FATAL_FAILURE(SaveUnnotifiedThenKillAgent(client.get(), &first));
  ASSERT_TRUE(WaitUntil([&] { return !AgentAlive(job_dir_); })) << "the agent did not die";

  Shard two(2);
  ASSERT_OK_AND_ASSIGN(SnapshotResult r2, client->Save(2, two.sources, two.extras,
                                                       /*persist=*/false, /*notify=*/false));
  EXPECT_TRUE(r2.saved);
  uint32_t second = 0;
  ASSERT_TRUE(AgentAlive(job_dir_, &second)) << "the save did not restart the dead agent";
  EXPECT_NE(second, first);
  // Nobody tells the new agent about step 1: it adopted the arena and persists it.
  EXPECT_TRUE(WaitUntil([&] { return Committed() == std::vector<uint64_t>{1}; }))
      << "step 1 was not committed";
  ExpectOnStorage(1, 1);
  EXPECT_EQ(client->Notify({}), "");
}

// Issue 22, defect 2: an agent that dies after its rank's last poll (the rank then waits in a
// collective for a rank that waits in wait() for this node's images) was restarted by nobody:
// the client restarted it only when it next talked to it, after the collective, and the job
// hung. The client now watches its agent from a thread of its own, so a new agent adopts the
// slots and persists them while the rank makes no call at all. Before the fix no agent came
// back and the step was never committed (WaitUntil gave up).
TEST_F(AgentTest, AgentThatDiesWhileItsRankMakesNoCallIsRestartedAndPersistsWhatItLeft) {
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(Options()));
  uint32_t first = 0;
  ASSERT_NO_FATAL_FAILURE(SaveUnnotifiedThenKillAgent(client.get(), &first));
  // No call of the client from here on until the step is committed.
  EXPECT_TRUE(WaitUntil([&] { return Committed() == std::vector<uint64_t>{1}; }))
      << "step 1 was not committed: no agent came back";
  uint32_t second = 0;
  EXPECT_TRUE(AgentAlive(job_dir_, &second));
  EXPECT_NE(second, first);
  ExpectOnStorage(1, 1);
  EXPECT_EQ(client->Notify({}), "");
  EXPECT_OK(client->Close(kDeadlineSeconds));
}

// Issue 22: a restarted agent listened for peers on a new port, which its peers learned only at
// the next Checkpointer start (their pushes to this node failed until then). The client now
// asks the new agent for the dead one's port, so the address in the peers' membership stays
// right. Before the fix the new agent took a free port.
TEST_F(AgentTest, AgentRestartedAfterItDiedListensForPeersOnTheSamePort) {
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(Options()));
  ASSERT_OK_AND_ASSIGN(const std::string address, client->PeerSetup("n0", "127.0.0.1", 10));
  uint32_t first = 0;
  ASSERT_TRUE(AgentAlive(job_dir_, &first));
  ASSERT_EQ(::kill(static_cast<pid_t>(first), SIGKILL), 0);
  uint32_t second = 0;
  ASSERT_TRUE(WaitUntil([&] { return AgentAlive(job_dir_, &second) && second != first; }));
  // The next call reconnects and sends the peer setup again; asking again returns the address
  // the new agent listens on.
  ASSERT_OK(client->AgentStatus());
  ASSERT_OK_AND_ASSIGN(const std::string again, client->PeerSetup("n0", "127.0.0.1", 10));
  EXPECT_EQ(again, address);
  EXPECT_OK(client->Close(kDeadlineSeconds));
}

// When no agent can be started (here: this client may start none), the save still goes into
// memory: failing it would leave the other ranks in the collective that comes before Notify.
// Notify then says why the agent could not be told.
TEST_F(AgentTest, SaveWithoutNotifyWhoseAgentCannotBeRestartedStillSnapshots) {
  StartAgent();
  ClientOptions options = Options();
  options.agent_binary.clear();  // this client may start no agent
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(options));
  ASSERT_EQ(::kill(agent_, SIGKILL), 0);
  ASSERT_TRUE(WaitExit(agent_));
  ASSERT_TRUE(WaitUntil([&] { return !AgentAlive(job_dir_); }));
  Shard one(1);
  ASSERT_OK_AND_ASSIGN(SnapshotResult r, client->Save(1, one.sources, one.extras,
                                                      /*persist=*/true, /*notify=*/false));
  EXPECT_TRUE(r.saved);
  EXPECT_EQ(client->ReviveAgentIfGone().code(), StatusCode::kUnavailable);
  const std::string error = client->Notify({});
  EXPECT_NE(error.find("none may be started here"), std::string::npos) << error;
}

// Issue 9, defect 6: an agent that cannot write job.json (here: a full tmpfs) keeps serving, but
// says so in its status and log, and writes the file at a later hello once there is room again;
// before, the error was ignored and a later agent could not adopt the job without a word.
TEST_F(AgentTest, JobConfigWriteFailureIsReportedAndRetried) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
  if (::mount("tmpfs", shm_.c_str(), "tmpfs", 0, "size=1m,mode=0700") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs: " << std::strerror(errno);
  }
  struct Unmount {
    std::string dir;
    ~Unmount() { ::umount2(dir.c_str(), MNT_DETACH); }
  } unmount{shm_};
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  // Fill the file system.
  const std::string filler = shm_ + "/filler";
  ASSERT_TRUE(test::FillFileSystem(filler));
  UniqueFd fd = ConnectAndHello();
  ASSERT_TRUE(fd.valid());
  auto status = QueryStatus(fd.get());
  ASSERT_TRUE(status);
  ASSERT_TRUE((*status)["job_config_error"].is_string()) << status->dump();
  const std::string error = (*status)["job_config_error"].get<std::string>();
  EXPECT_NE(error.find("job.json"), std::string::npos) << error;
  EXPECT_NE(error.find("No space left"), std::string::npos) << error;
  EXPECT_FALSE(fs::exists(job_dir_ + "/job.json"));
  fd.Reset();

  // Room again: the next hello writes it, and the status clears.
  ASSERT_EQ(::unlink(filler.c_str()), 0);
  UniqueFd fd2 = ConnectAndHello();
  ASSERT_TRUE(fd2.valid());
  auto status2 = QueryStatus(fd2.get());
  ASSERT_TRUE(status2);
  EXPECT_TRUE((*status2)["job_config_error"].is_null()) << status2->dump();
  EXPECT_TRUE(fs::exists(job_dir_ + "/job.json"));
  fd2.Reset();
}

// A wait for a step that retention prunes as soon as it is committed (the storage already holds
// `keep` newer steps, e.g. from an earlier run) is answered: the step was committed. It used to
// hang: its outcome was OK, but it was no longer in the committed cache and its COMMIT was gone.
TEST_F(AgentTest, WaitForAStepPrunedRightAfterItsCommitIsAnswered) {
  ClientOptions o = Options();
  o.keep = 2;
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(o));
  SaveStep(*client, 59, /*persist=*/true);
  SaveStep(*client, 60, /*persist=*/true);
  ASSERT_OK(client->Wait(kDeadlineSeconds));
  ASSERT_EQ(Committed(), (std::vector<uint64_t>{59, 60}));

  // A new run starts over from step 0 into the same path.
  SaveStep(*client, 0, /*persist=*/true);
  EXPECT_OK(client->Wait(kDeadlineSeconds));  // the deadline only turns a hang into a failure
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{59, 60}));
  auto status = client->AgentStatus();
  ASSERT_OK(status);
  json j = json::parse(*status, nullptr, false);
  ASSERT_TRUE(j.is_object()) << *status;
  EXPECT_EQ(j["ranks"][0]["persists_ok"], 3);
  EXPECT_EQ(j["ranks"][0]["persists_failed"], 0);
}

// The same with two nodes: the agent of the node whose rank writes the step's last image commits
// it and prunes it at once; the other node's agent never sees its COMMIT. Here rank 1 is on the
// other node and never reaches this agent. Rank 0's wait hung: its step neither committed nor
// failed here. It is answered once `keep` newer steps are committed.
TEST_F(AgentTest, WaitForAStepAnotherNodePrunesRightAfterItsCommitIsAnswered) {
  auto options = [&](uint32_t rank) {
    ClientOptions o = RankOptions(rank);
    o.keep = 2;
    return o;
  };
  ASSERT_OK_AND_ASSIGN(auto r0, SnapshotClient::Connect(options(0)));
  {
    ASSERT_OK_AND_ASSIGN(auto r1, SnapshotClient::Connect(options(1)));
    for (uint64_t step : {59, 60}) {
      SaveStep(*r0, step, /*persist=*/true);
      SaveStep(*r1, step, /*persist=*/true);
    }
    ASSERT_OK(r1->Wait(kDeadlineSeconds));
  }
  ASSERT_OK(r0->Wait(kDeadlineSeconds));
  ASSERT_EQ(Committed(), (std::vector<uint64_t>{59, 60}));

  // A new run starts over from step 0; rank 1 saves it on the other node.
  SaveStep(*r0, 0, /*persist=*/true);
  EXPECT_OK(r0->Wait(kDeadlineSeconds));  // the deadline only turns a hang into a failure
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{59, 60}));
}

// The frames a client sent just before it exited arrive together with the end of its
// connection: each complete frame is handled before the disconnect. Here the snapshot note that
// asks to persist step 7 (with the emergency flush off, nothing else would persist it); the
// agent is stopped while the child saves and exits, so that the note and the EOF are read in
// the same turn.
TEST_F(AgentTest, SnapshotNoteSentJustBeforeExitIsHandled) {
  ASSERT_NO_FATAL_FAILURE(StartAgent({"--no-emergency-flush"}));
  const pid_t agent = agent_;
  const int exit_code = test::RunInChild([&] {
    auto c = SnapshotClient::Connect(Options());
    if (!c.ok()) return 2;
    if (::kill(agent, SIGSTOP) != 0) return 4;
    Shard s(7);
    auto r = (*c)->Save(7, s.sources, s.extras, /*persist=*/true);
    return r.ok() && r->saved ? 0 : 3;  // exits without Close, the agent still stopped
  });
  ASSERT_EQ(::kill(agent_, SIGCONT), 0);
  ASSERT_EQ(exit_code, 0) << "the child failed to save";
  // The deadline only turns a lost note into a failure.
  EXPECT_TRUE(WaitUntil([&] { return !Committed().empty(); })) << "step 7 was never persisted";
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{7}));
  ExpectServes();
}

// The reported case: a training process's last report (metrics of its final save) arrives
// together with the end of its connection. It reaches the event log. The agent is stopped while
// the report is sent and the connection closed, so that both are read in the same turn.
TEST_F(AgentTest, ReportSentJustBeforeClosingIsHandled) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  UniqueFd fd = ConnectAndHello();
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(::kill(agent_, SIGSTOP), 0);
  ReportNote note;
  note.event = "save";
  note.step = 424242;
  note.nanos = 1000;
  note.bytes = 4096;
  const Status sent = SendMessage(fd.get(), MessageType::kReport, Encode(note));
  fd.Reset();
  ASSERT_EQ(::kill(agent_, SIGCONT), 0);
  ASSERT_OK(sent);
  const std::string events = EventLogPath(job_dir_);
  // The deadline only turns a lost report into a failure.
  EXPECT_TRUE(WaitUntil([&] {
    auto text = test::ReadFileToString(events);
    return text && text->find("424242") != std::string::npos;
  })) << "the report never reached "
      << events;
  ExpectServes();
}

// One message per save (issue 21): the snapshot note carries the save's report, whether the
// client sends it from Save (notify) or after measuring the save itself (Notify with a report).
// Status requests are not counted.
TEST_F(AgentTest, EachSaveIsOneMessageToTheAgent) {
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(Options()));
  auto received = [&]() -> uint64_t {
    auto status = client->AgentStatus();
    EXPECT_OK(status);
    if (!status.ok()) return 0;
    json j = json::parse(*status, nullptr, false);
    return j["ranks"][0]["messages_received"].get<uint64_t>();
  };
  const uint64_t before = received();
  for (uint64_t step = 1; step <= 3; ++step) SaveStep(*client, step, /*persist=*/step == 3);
  for (uint64_t step = 4; step <= 5; ++step) {
    Shard s(step);
    ASSERT_OK_AND_ASSIGN(SnapshotResult r, client->Save(step, s.sources, s.extras,
                                                        /*persist=*/true, /*notify=*/false));
    ASSERT_TRUE(r.saved);
    EXPECT_EQ(client->Notify({}, SaveReport{step, 0.01, r.image_bytes}), "");
  }
  EXPECT_EQ(received() - before, 5u);
  // The reports arrived with the notes: the event log has each save.
  const std::string events = EventLogPath(job_dir_);
  EXPECT_TRUE(WaitUntil([&] {
    auto text = test::ReadFileToString(events);
    size_t saves = 0;
    for (size_t at = 0; text && (at = text->find("\"event\":\"save\"", at)) != std::string::npos;
         ++at) {
      ++saves;
    }
    return saves >= 5;
  })) << test::ReadFileToString(events).value_or("no event log");
}

// The agent that serves rank 0 keeps the job's measurement history from what the ranks send
// anyway (the start report, the saves' notes, the close) and its own persists: nothing polls
// it for them. The history is where `safepoint advise PATH` reads it.
TEST_F(AgentTest, AgentRecordsTheJobsHistoryWithoutBeingPolled) {
  {
    ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(Options()));
    client->Report("start", 42, true, 0, 0);
    for (uint64_t step = 1; step <= 4; ++step) {
      Shard s(step);
      ASSERT_OK_AND_ASSIGN(SnapshotResult r, client->Save(step, s.sources, s.extras,
                                                          /*persist=*/true, /*notify=*/false));
      EXPECT_EQ(client->Notify({}, SaveReport{step, 0.125, r.image_bytes}), "");
    }
    ASSERT_OK(client->Wait(kDeadlineSeconds));
    client->Report("restore", 4, true, 0.5, 100, "storage", "", "path");
    ASSERT_OK(client->Close(kDeadlineSeconds));
  }
  uint64_t skipped = 0;
  ASSERT_OK_AND_ASSIGN(auto h, advisor::ReadJobHistory(storage_, job_, &skipped));
  EXPECT_EQ(h.path, storage_ + "/safepoint-history.jsonl");
  EXPECT_EQ(skipped, 0u);
  EXPECT_EQ(h.runs, 1u);
  EXPECT_EQ(h.interruptions, 0u);  // closed cleanly
  ASSERT_TRUE(h.save.has_value());
  EXPECT_EQ(h.save->samples, 4u);
  EXPECT_DOUBLE_EQ(h.save->seconds, 0.125);
  ASSERT_TRUE(h.persist.contains("path"));
  EXPECT_GE(h.persist.at("path").samples, 1u);
  EXPECT_GT(h.persist.at("path").bytes, 0);
  ASSERT_TRUE(h.restore.contains("path"));
  EXPECT_DOUBLE_EQ(h.restore.at("path").seconds, 0.5);
}

// wait() over stored images of mixed attempts: rank 1's image of step 5 on storage is of an
// earlier save attempt (its process then closed), and rank 0 of the next attempt persists step 5
// and waits. Rank 1 will write no image of step 5 of this attempt, so the step can never commit:
// wait() says so at once, naming the step and why, instead of waiting until its timeout.
TEST_F(AgentTest, WaitForAStepWhoseImagesAreOfMixedAttemptsFailsAtOnceNamingWhy) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  auto options = [&](uint32_t rank, uint64_t attempt) {
    ClientOptions o = RankOptions(rank, attempt);
    o.agent_binary.clear();
    return o;
  };
  // Rank 0 of the new attempt is connected first (else the agent exits once rank 1 closed).
  ASSERT_OK_AND_ASSIGN(auto rank0, SnapshotClient::Connect(options(0, 22)));
  {
    ASSERT_OK_AND_ASSIGN(auto old_rank1, SnapshotClient::Connect(options(1, 11)));
    SaveStep(*old_rank1, 5, /*persist=*/true);
    ASSERT_OK(old_rank1->Close(kDeadlineSeconds));  // answered once its image is written
  }
  SaveStep(*rank0, 5, /*persist=*/true);
  const Status w = rank0->Wait(kDeadlineSeconds);
  EXPECT_EQ(w.code(), StatusCode::kCancelled) << w.ToString();
  for (const char* part :
       {"step 5 can never be committed", "attempt 22", "rank 1 closed", "attempt 11"}) {
    EXPECT_NE(w.message().find(part), std::string::npos) << part << " not in " << w.ToString();
  }
  EXPECT_TRUE(Committed().empty());
  ExpectServes();
}

// A wait for a step whose persist failed for another rank of this node (found by the storage
// brownout rounds, tests/crash/brownout_campaign.py seed 2026120541 round 2: the OSD stopped
// while rank 0's image of step 5 was written, rank 1's written after it resumed). The agent
// never retries a failed persist, so no image of rank 0 of this attempt will come unless the
// rank saves the step again; rank 0's own wait fails at once with the persist's error, and rank
// 1's wait must end too (naming rank 0 and its error), not at its timeout, or never: in a job in
// lockstep, rank 0 then waits for rank 1 in the next collective. Here a file where the step's
// directory goes fails rank 0's persist, and is gone when rank 1's is written.
TEST_F(AgentTest, AWaitForAStepWhoseImageFailedToPersistOnAnotherRankEndsNamingIt) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  ASSERT_OK_AND_ASSIGN(auto rank0, SnapshotClient::Connect(RankOptions(0, 22)));
  ASSERT_OK_AND_ASSIGN(auto rank1, SnapshotClient::Connect(RankOptions(1, 22)));
  const std::string in_the_way = storage_ + "/step-00000000000000000005";
  std::ofstream(in_the_way) << "in the way";
  SaveStep(*rank0, 5, /*persist=*/true);
  const Status own = rank0->Wait(kDeadlineSeconds);
  ASSERT_FALSE(own.ok());
  ASSERT_EQ(own.message().find("timed out"), std::string::npos) << own.ToString();
  ASSERT_EQ(::unlink(in_the_way.c_str()), 0);
  SaveStep(*rank1, 5, /*persist=*/true);
  const Status w = rank1->Wait(kDeadlineSeconds);
  EXPECT_EQ(w.code(), StatusCode::kCancelled) << w.ToString();
  for (const char* part :
       {"step 5 can never be committed", "save attempt 22", "rank 0's persist of it failed"}) {
    EXPECT_NE(w.message().find(part), std::string::npos) << part << " not in " << w.ToString();
  }
  EXPECT_TRUE(Committed().empty());
  SaveStep(*rank0, 6, /*persist=*/true);  // the job goes on
  SaveStep(*rank1, 6, /*persist=*/true);
  ASSERT_OK(rank0->Wait(kDeadlineSeconds));
  ASSERT_OK(rank1->Wait(kDeadlineSeconds));
  EXPECT_EQ(Committed(), std::vector<uint64_t>{6});
  ExpectServes();
}

// The same wait on a job of two nodes (found by the node campaign, seed 20261202 with
// --partitions 6; docs/reliability.md). Rank 1, on another node (its own shm directory and
// agent), asks to persist step 5, but its snapshot is overwritten by steps 6 and 7 before its
// agent gets to it (there: the agent died, and its successor cleared the slot's lease when it
// adopted the arena; here the agent is stopped and the lease cleared as the successor does).
// Rank 0's agent serves only rank 0, so it cannot tell from its own ranks that step 5 can never
// commit: rank 1's agent reports the image it will never write (step-5/abandoned.g<attempt>),
// and rank 0's wait ends with CancelledError naming it, instead of at its timeout (or never).
TEST_F(AgentTest, AWaitForAStepARankOnAnotherNodeNeverPersistsEndsAtOnce) {
  const std::string other_shm = tmp_ + "/shm-node1";
  ASSERT_EQ(::mkdir(other_shm.c_str(), 0700), 0);
  const std::string other_job_dir =
      other_shm + "/safepoint-" + std::to_string(::geteuid()) + "-" + job_;
  ClientOptions o0 = RankOptions(0, 22);
  ClientOptions o1 = RankOptions(1, 22);
  o1.shm_dir = other_shm;  // another node: its own agent
  ASSERT_OK_AND_ASSIGN(auto rank0, SnapshotClient::Connect(o0));
  ASSERT_OK_AND_ASSIGN(auto rank1, SnapshotClient::Connect(o1));
  uint32_t other = 0;
  ASSERT_TRUE(AgentAlive(other_job_dir, &other));
  ASSERT_GT(other, 1u);
  const pid_t other_agent = static_cast<pid_t>(other);
  struct Reaper {  // the other node's agent is not this fixture's child
    pid_t pid;
    ~Reaper() {
      ::kill(pid, SIGCONT);
      ::kill(pid, SIGKILL);
    }
  } reaper{other_agent};
  ASSERT_EQ(::kill(other_agent, SIGSTOP), 0);
  SaveStep(*rank1, 5, /*persist=*/true);  // the note waits in the stopped agent's socket
  {
    ASSERT_OK_AND_ASSIGN(auto arena, Arena::Open(other_job_dir, 1));
    arena->ClearLeases();
  }
  SaveStep(*rank1, 6, /*persist=*/false);
  SaveStep(*rank1, 7, /*persist=*/false);  // into step 5's slot
  ASSERT_EQ(::kill(other_agent, SIGCONT), 0);
  SaveStep(*rank0, 5, /*persist=*/true);
  const Status w = rank0->Wait(kDeadlineSeconds);
  EXPECT_EQ(w.code(), StatusCode::kCancelled) << w.ToString();
  for (const char* part : {"step 5 can never be committed", "save attempt 22",
                           "rank 1:", "overwritten by a newer one"}) {
    EXPECT_NE(w.message().find(part), std::string::npos) << part << " not in " << w.ToString();
  }
  EXPECT_TRUE(Committed().empty());
  SaveStep(*rank0, 8, /*persist=*/true);  // the job goes on
  SaveStep(*rank1, 8, /*persist=*/true);
  ASSERT_OK(rank0->Wait(kDeadlineSeconds));
  ASSERT_OK(rank1->Wait(kDeadlineSeconds));
  EXPECT_EQ(Committed(), std::vector<uint64_t>{8});
}

// The world size committed for each step on storage.
std::map<uint64_t, uint32_t> CommittedWorlds(const std::string& storage) {
  std::map<uint64_t, uint32_t> out;
  auto store = OpenCheckpointStore(storage);
  if (!store.ok()) return out;
  auto list = (*store)->ListCommitted();
  if (!list.ok()) return out;
  for (const auto& c : *list) out[c.step] = c.world_size;
  return out;
}

// Issue 36: a 2-rank job killed, restarted with 1 rank under the same job name. The agent (here
// without emergency flushes, so that only the world change persists) persists the newest step
// both ranks hold before it answers the new rank's hello, drops every snapshot of the previous
// world, and the job goes on with world size 1.
TEST_F(AgentTest, RestartWithAnotherWorldSizePersistsThenDropsThePreviousWorldsSnapshots) {
  ASSERT_NO_FATAL_FAILURE(StartAgent({"--no-emergency-flush"}));
  for (uint32_t rank : {0u, 1u}) {
    const int rc = test::RunInChild([&] {
      auto c = SnapshotClient::Connect(RankOptions(rank, /*attempt=*/41));
      if (!c.ok()) return 2;
      for (uint64_t step : {1, 2}) {
        Shard s(step);
        auto r = (*c)->Save(step, s.sources, s.extras, /*persist=*/step == 1);
        if (!r.ok() || !r->saved) return 3;
      }
      // Rank 1, the second, waits until step 1 is committed; both die unclosed.
      return rank == 0 || (*c)->Wait(kDeadlineSeconds).ok() ? 0 : 4;
    });
    ASSERT_EQ(rc, 0) << "rank " << rank << " of the first run failed";
  }
  ASSERT_TRUE(WaitUntil([&] { return Committed() == std::vector<uint64_t>{1}; }));
  EXPECT_EQ(SlotFiles().size(), 4u);  // two slots of each rank: steps 1 and 2

  ASSERT_OK_AND_ASSIGN(auto one, SnapshotClient::Connect(Options()));  // rank 0 of 1
  // Answered only after step 2, in memory alone, was persisted by both ranks and committed.
  EXPECT_EQ(CommittedWorlds(storage_), (std::map<uint64_t, uint32_t>{{1, 2}, {2, 2}}));
  EXPECT_TRUE(SlotFiles().empty()) << "left: " << SlotFiles().size();
  auto config = agent::ReadJobConfig(job_dir_);
  ASSERT_OK(config);
  ASSERT_TRUE(config->has_value());
  EXPECT_EQ((*config)->world_size, 1u);
  auto mem = one->LoadNewest(std::nullopt);
  EXPECT_EQ(mem.status().code(), StatusCode::kNotFound) << mem.status().ToString();

  SaveStep(*one, 3, /*persist=*/true);
  ASSERT_OK(one->Wait(kDeadlineSeconds));
  EXPECT_EQ(CommittedWorlds(storage_), (std::map<uint64_t, uint32_t>{{1, 2}, {2, 2}, {3, 1}}));
  ExpectOnStorage(3, 3);
  const UniqueFd fd = Connect();
  auto st = QueryStatus(fd.get());
  ASSERT_TRUE(st);
  EXPECT_EQ((*st)["world_size"], 1);
  EXPECT_TRUE((*st)["world_size_changing_to"].is_null());
  EXPECT_EQ((*st)["ranks"].size(), 1u) << st->dump();
}

// Growing (1 -> 2): both new ranks wait for the change, which drops rank 0's snapshot of the
// previous world; rank 1's hello arriving while it is under way waits with rank 0's.
TEST_F(AgentTest, RestartWithMoreRanksAnswersEveryNewRankAfterTheChange) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  ASSERT_EQ(test::RunInChild([&] {
              auto c = SnapshotClient::Connect(Options());
              if (!c.ok()) return 2;
              Shard s(4);
              auto r = (*c)->Save(4, s.sources, s.extras, /*persist=*/false);
              return r.ok() && r->saved ? 0 : 3;
            }),
            0);
  std::vector<std::thread> ranks;
  std::vector<Status> got(2);
  std::vector<std::unique_ptr<SnapshotClient>> clients(2);
  for (uint32_t rank : {0u, 1u}) {
    ranks.emplace_back([&, rank] {
      auto c = SnapshotClient::Connect(RankOptions(rank, /*attempt=*/42));
      got[rank] = c.status();
      if (c.ok()) clients[rank] = std::move(*c);
    });
  }
  for (auto& t : ranks) t.join();
  ASSERT_OK(got[0]);
  ASSERT_OK(got[1]);
  EXPECT_EQ(CommittedWorlds(storage_), (std::map<uint64_t, uint32_t>{{4, 1}}));
  EXPECT_TRUE(SlotFiles().empty());
  for (uint32_t rank : {0u, 1u}) SaveStep(*clients[rank], 5, /*persist=*/true);
  for (uint32_t rank : {0u, 1u}) ASSERT_OK(clients[rank]->Wait(kDeadlineSeconds));
  EXPECT_EQ(CommittedWorlds(storage_), (std::map<uint64_t, uint32_t>{{4, 1}, {5, 2}}));
}

// 4 -> 3: every rank of the previous world is dropped, also rank 3, which the new world lacks;
// the step the four ranks held only in memory is committed with world size 4 first.
TEST_F(AgentTest, RestartWithFewerRanksDropsEveryRankOfThePreviousWorld) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  auto options = [&](uint32_t rank, uint32_t world, uint64_t attempt) {
    ClientOptions o = RankOptions(rank, attempt);
    o.world_size = world;
    return o;
  };
  for (uint32_t rank = 0; rank < 4; ++rank) {
    ASSERT_EQ(test::RunInChild([&] {
                auto c = SnapshotClient::Connect(options(rank, 4, 44));
                if (!c.ok()) return 2;
                Shard s(6);
                auto r = (*c)->Save(6, s.sources, s.extras, /*persist=*/false);
                return r.ok() && r->saved ? 0 : 3;  // dies unclosed
              }),
              0);
  }
  std::vector<std::thread> ranks;
  std::vector<Status> got(3);
  std::vector<std::unique_ptr<SnapshotClient>> clients(3);
  for (uint32_t rank = 0; rank < 3; ++rank) {
    ranks.emplace_back([&, rank] {
      auto c = SnapshotClient::Connect(options(rank, 3, 45));
      got[rank] = c.status();
      if (c.ok()) clients[rank] = std::move(*c);
    });
  }
  for (auto& t : ranks) t.join();
  for (const Status& s : got) ASSERT_OK(s);
  EXPECT_EQ(CommittedWorlds(storage_), (std::map<uint64_t, uint32_t>{{6, 4}}));
  EXPECT_TRUE(SlotFiles().empty()) << "left: " << SlotFiles().size();
  for (uint32_t rank = 0; rank < 3; ++rank) SaveStep(*clients[rank], 7, /*persist=*/true);
  for (uint32_t rank = 0; rank < 3; ++rank) ASSERT_OK(clients[rank]->Wait(kDeadlineSeconds));
  EXPECT_EQ(CommittedWorlds(storage_), (std::map<uint64_t, uint32_t>{{6, 4}, {7, 3}}));
  EXPECT_EQ(SlotFiles().size(), 3u);  // one slot of each new rank
}

// A process of another world size while a rank of the job's world still runs is refused, naming
// that rank and its pid; nothing is dropped.
TEST_F(AgentTest, AnotherWorldSizeWhileARankOfTheJobRunsIsRefused) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  ASSERT_OK_AND_ASSIGN(auto rank0, SnapshotClient::Connect(RankOptions(0, 43)));
  SaveStep(*rank0, 1, /*persist=*/false);
  auto other = SnapshotClient::Connect(Options());
  ASSERT_FALSE(other.ok());
  const std::vector<std::string> parts = {"runs with world size 2",
                                          "rank 0, pid " + std::to_string(::getpid())};
  for (const std::string& part : parts) {
    EXPECT_NE(other.status().message().find(part), std::string::npos)
        << part << " not in " << other.status().ToString();
  }
  EXPECT_FALSE(SlotFiles().empty());
  SaveStep(*rank0, 2, /*persist=*/false);  // the job goes on
  ExpectServes();
}

// Issue 35's defect: a stale process (its run left it hung in a collective, say by a network
// partition) still holds rank 0 on this node when the job's next run puts rank 0 here again. The
// newer run's process (another save attempt, started later) takes the rank instead of being
// refused with "rank 0 is already connected"; the stale one can no longer save, wait or say hello,
// and nothing it does reaches memory or storage.
TEST_F(AgentTest, ANewerRunTakesTheRankFromAStaleProcessThatStillRuns) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  // Every process of this test is a child of a test process that runs no thread of its own, so
  // each fork is of a single-threaded process (ThreadSanitizer does not support the others).
  int ready_fds[2], go_fds[2];
  ASSERT_EQ(::pipe(ready_fds), 0);
  UniqueFd ready_read(ready_fds[0]), ready_write(ready_fds[1]);
  ASSERT_EQ(::pipe(go_fds), 0);
  UniqueFd go_read(go_fds[0]), go_write(go_fds[1]);
  const pid_t stale = ::fork();
  ASSERT_GE(stale, 0);
  if (stale == 0) {  // the stale process: saves step 1, then hangs until the newer run took over
    ready_read.Reset();
    go_write.Reset();
    ClientOptions o = Options();
    o.attempt = 111;
    auto c = SnapshotClient::Connect(o);
    if (!c.ok()) ::_exit(2);
    Shard one(1);
    auto r = (*c)->Save(1, one.sources, one.extras, /*persist=*/true);
    if (!r.ok() || !r->saved || !(*c)->Wait(kDeadlineSeconds).ok()) ::_exit(3);
    const char ok = 1;
    if (::write(ready_write.get(), &ok, 1) != 1) ::_exit(4);
    char byte;
    if (::read(go_read.get(), &byte, 1) != 1) ::_exit(5);
    // Every save, wait and hello fails, naming the newer run.
    Shard three(3);
    auto saved = (*c)->Save(3, three.sources, three.extras, /*persist=*/true);
    if (saved.ok() || saved.status().code() != StatusCode::kSuperseded ||
        saved.status().message().find("save attempt 222") == std::string::npos) {
      std::fprintf(stderr, "stale save: %s\n",
                   saved.ok() ? "ok" : saved.status().ToString().c_str());
      ::_exit(6);
    }
    const Status waited = (*c)->Wait(kDeadlineSeconds);
    if (waited.code() != StatusCode::kSuperseded) {
      std::fprintf(stderr, "stale wait: %s\n", waited.ToString().c_str());
      ::_exit(7);
    }
    auto again = SnapshotClient::Connect(o);
    if (again.ok() || again.status().code() != StatusCode::kSuperseded) {
      std::fprintf(stderr, "stale hello: %s\n",
                   again.ok() ? "ok" : again.status().ToString().c_str());
      ::_exit(8);
    }
    ::_exit(0);
  }
  children_[stale] = false;
  ready_write.Reset();
  go_read.Reset();
  char ok = 0;
  ASSERT_EQ(::read(ready_read.get(), &ok, 1), 1);
  // The agent tells the runs' processes apart by their start times, in clock ticks since boot
  // (10 ms): the newer one must start a tick after the stale one, which a fork right after may
  // not (it was refused, "rank 0 is already connected", under load). Wait for the next tick.
  const std::optional<uint64_t> stale_ticks = internal::ProcessStartTicks(stale);
  ASSERT_TRUE(stale_ticks.has_value());
  const auto ticks_now = [] {
    timespec ts{};
    ::clock_gettime(CLOCK_BOOTTIME, &ts);
    const uint64_t hz = static_cast<uint64_t>(::sysconf(_SC_CLK_TCK));
    return static_cast<uint64_t>(ts.tv_sec) * hz +
           static_cast<uint64_t>(ts.tv_nsec) / (1000000000ull / hz);
  };
  while (ticks_now() <= *stale_ticks) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  // The newer run's process (started after the stale one): resumes from the stale one's
  // snapshot, saves step 2, dies unclosed.
  ASSERT_EQ(test::RunInChild([&] {
              ClientOptions o = Options();
              o.attempt = 222;
              auto c = SnapshotClient::Connect(o);
              if (!c.ok()) {
                std::fprintf(stderr, "newer run refused: %s\n", c.status().ToString().c_str());
                return 2;
              }
              auto loaded = (*c)->LoadNewest(std::nullopt);
              if (!loaded.ok() || loaded->step != 1) return 3;
              Shard s(2);
              auto r = (*c)->Save(2, s.sources, s.extras, /*persist=*/true);
              if (!r.ok() || !r->saved || !r->agent_error.empty()) return 4;
              return (*c)->Wait(kDeadlineSeconds).ok() ? 0 : 5;
            }),
            0);
  ASSERT_EQ(::write(go_write.get(), "g", 1), 1);  // the stale process wakes
  ExpectExitsWith(stale, 0);
  // Memory and storage hold the newer run's step 2; nothing of step 3.
  ASSERT_OK_AND_ASSIGN(auto arena, Arena::Open(job_dir_, 0));
  ASSERT_TRUE(arena->NewestComplete());
  EXPECT_EQ(arena->NewestComplete()->step, 2u);
  ASSERT_TRUE(WaitUntil([&] {
    return Committed() == std::vector<uint64_t>{1, 2};
  })) << Committed().size();
  // A later run takes the rank as usual.
  ClientOptions next = Options();
  next.attempt = 333;
  ASSERT_EQ(test::RunInChild([&] {
              auto c = SnapshotClient::Connect(next);
              if (!c.ok()) return 2;
              auto loaded = (*c)->LoadNewest(std::nullopt);
              return loaded.ok() && loaded->step == 2 ? 0 : 3;
            }),
            0);
}

// A process of an earlier run (started before the rank's process, of another save attempt) is
// refused as superseded; one of the same run is refused as a second process of the rank.
TEST_F(AgentTest, AnOlderRunsProcessNeverTakesTheRankFromANewerOne) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  int ready_fds[2], done_fds[2];
  ASSERT_EQ(::pipe(ready_fds), 0);
  UniqueFd ready_read(ready_fds[0]), ready_write(ready_fds[1]);
  ASSERT_EQ(::pipe(done_fds), 0);
  UniqueFd done_read(done_fds[0]), done_write(done_fds[1]);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // the newer run's rank 0 (started after this test process)
    ready_read.Reset();
    done_write.Reset();
    ClientOptions o = Options();
    o.attempt = 222;
    o.agent_binary.clear();
    auto c = SnapshotClient::Connect(o);
    const char ok = c.ok() ? 1 : 0;
    if (::write(ready_write.get(), &ok, 1) != 1) ::_exit(1);
    char byte;
    while (::read(done_read.get(), &byte, 1) > 0) {
    }
    ::_exit(0);
  }
  children_[child] = false;
  ready_write.Reset();
  done_read.Reset();
  char ok = 0;
  ASSERT_EQ(::read(ready_read.get(), &ok, 1), 1);
  ASSERT_EQ(ok, 1);
  ClientOptions older = Options();
  older.attempt = 111;
  older.agent_binary.clear();
  auto refused = SnapshotClient::Connect(older);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kSuperseded) << refused.status().ToString();
  older.attempt = 222;
  refused = SnapshotClient::Connect(older);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("already connected (pid " + std::to_string(child)),
            std::string::npos)
      << refused.status().ToString();
  done_write.Reset();
  ExpectExitsWith(child, 0);
}

// A refused process (another path under the job's name) leaves no idle agent behind: the agent,
// serving no rank, exits once its work is done instead of after the idle time (60 s here).
TEST_F(AgentTest, ARefusedProcessDoesNotKeepTheAgentAlive) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  ASSERT_EQ(test::RunInChild([&] {
              auto c = SnapshotClient::Connect(Options());
              if (!c.ok()) return 2;
              Shard s(3);
              auto r = (*c)->Save(3, s.sources, s.extras, /*persist=*/false);
              return r.ok() && r->saved ? 0 : 3;  // dies unclosed: flushed
            }),
            0);
  ASSERT_TRUE(WaitUntil([&] { return !Committed().empty(); }));
  ClientOptions elsewhere = Options();
  elsewhere.storage = tmp_ + "/other";
  elsewhere.agent_binary.clear();
  auto refused = SnapshotClient::Connect(elsewhere);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("already persists to " + storage_), std::string::npos)
      << refused.status().ToString();
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);  // not a storage error
  const std::optional<int> status = WaitExit(agent_, /*timeout_s=*/20);
  ASSERT_TRUE(status) << "the agent is still running after the refusal";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status;
  EXPECT_FALSE(SlotFiles().empty());  // the snapshot stays for the job's next agent
}

// The job's next run under the same name, with another path, meets the agent of the run before
// in the moment it exits (every rank closed cleanly): the client waits for that agent to exit
// and starts the job's next one. Refused as a conflict before ("already persists to"), which
// make test met when one test opened the same job twice in a row. The window is held open here
// by a connection that never says hello (it keeps the agent alive).
TEST_F(AgentTest, TheNextRunWithAnotherPathWaitsForTheExitingAgentOfTheRunBefore) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  UniqueFd holder = TryConnect();
  ASSERT_TRUE(holder.valid());
  {
    ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(Options()));
    SaveStep(*client, 1, /*persist=*/true);
    ASSERT_OK(client->Wait(kDeadlineSeconds));
    ASSERT_OK(client->Close(kDeadlineSeconds));
  }
  ClientOptions next = Options();
  next.storage = tmp_ + "/next";
  std::optional<Result<std::unique_ptr<SnapshotClient>>> connected;
  std::thread t([&] { connected.emplace(SnapshotClient::Connect(next)); });
  // The old agent refuses it as exiting (it stays while the holder is connected), and the client
  // keeps waiting rather than failing.
  EXPECT_TRUE(WaitUntil([&] {
    auto log = test::ReadFileToString(logs_.front());  // the agent StartAgent spawned
    return log && log->find("is exiting (every rank of its run closed)") != std::string::npos;
  }));
  EXPECT_TRUE(Running(agent_));
  holder.Reset();
  t.join();
  ASSERT_TRUE(connected.has_value());
  ASSERT_OK(connected->status());
  ExpectExitsWith(agent_, 0);
  SaveStep(***connected, 2, /*persist=*/true);
  ASSERT_OK((**connected)->Wait(kDeadlineSeconds));
  ASSERT_OK((**connected)->Close(kDeadlineSeconds));
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{1}));  // the first run's path
  auto store = OpenCheckpointStore(next.storage);
  ASSERT_OK(store.status());
  auto steps = (*store)->ListCommitted();
  ASSERT_OK(steps.status());
  ASSERT_EQ(steps->size(), 1u);
  EXPECT_EQ(steps->front().step, 2u);
}

// A checkpoint path the agent cannot create (a file in the way): the agent refuses the hello with
// the storage's status, and the client keeps its code (a storage error naming the path, not
// "InvalidArgument: the agent refused this process").
TEST_F(AgentTest, APathTheAgentCannotCreateIsAStorageErrorNamingIt) {
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  { std::ofstream(tmp_ + "/a-file") << "x"; }
  ClientOptions o = Options();
  o.storage = tmp_ + "/a-file/ckpt";
  o.agent_binary.clear();
  auto refused = SnapshotClient::Connect(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kIOError) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find(tmp_ + "/a-file"), std::string::npos)
      << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("cannot use the checkpoint path"), std::string::npos)
      << refused.status().ToString();
}

// The refusal's text as the agent sends it (a Status's ToString()): storage codes are kept, the
// rest is InvalidArgument.
TEST(HelloRefusalTest, StorageRefusalsKeepTheirCodeAndOthersAreInvalidArgument) {
  const Status io = internal::HelloRefusal("IOError: /x/ckpt: mkdir failed: Not a directory");
  EXPECT_EQ(io.code(), StatusCode::kIOError);
  EXPECT_TRUE(io.message().starts_with("/x/ckpt: mkdir failed")) << io.ToString();
  EXPECT_EQ(internal::HelloRefusal("ResourceExhausted: /x/ckpt: no space").code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(internal::HelloRefusal("NotFound: /x/ckpt: no such bucket").code(),
            StatusCode::kNotFound);
  const Status exiting = internal::HelloRefusal("Unavailable: job j's agent ... is exiting");
  EXPECT_EQ(exiting.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(exiting.message().starts_with("job j's agent")) << exiting.ToString();
  const Status other =
      internal::HelloRefusal("InvalidArgument: job j already persists to /a with world size 2");
  EXPECT_EQ(other.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(other.message().starts_with("the safepoint agent refused this process: "))
      << other.ToString();
}

// An S3 gateway on loopback that lists nothing, has no objects, and never answers an upload
// (PUT or POST): a tier 0 that stalled. Each connection gets one answer and is closed; a stalled
// one is held open until the server is destroyed.
class StallingS3Server {
 public:
  StallingS3Server() {
    fd_.Reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (::bind(fd_.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
        ::listen(fd_.get(), 16) != 0 ||
        ::getsockname(fd_.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      return;
    }
    port_ = ntohs(a.sin_port);
    accept_ = std::thread([this] { Accept(); });
  }
  ~StallingS3Server() {
    stop_ = true;
    ::shutdown(fd_.get(), SHUT_RDWR);  // wakes accept()
    if (accept_.joinable()) accept_.join();
    for (auto& t : connections_) t.join();
  }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  int stalled() const { return stalled_.load(); }

 private:
  void Accept() {
    for (;;) {
      const int c = ::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      connections_.emplace_back([this, c] { Serve(UniqueFd(c)); });
    }
  }
  void Serve(UniqueFd c) {
    std::string request;
    char buf[4096];
    while (request.find("\r\n\r\n") == std::string::npos) {
      const ssize_t n = ::read(c.get(), buf, sizeof(buf));
      if (n <= 0) return;
      request.append(buf, static_cast<size_t>(n));
    }
    const std::string line = request.substr(0, request.find("\r\n"));
    std::string answer;
    if (line.rfind("PUT ", 0) == 0 || line.rfind("POST ", 0) == 0) {
      ++stalled_;
      while (!stop_) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return;
    } else if (line.find("list-type=2") != std::string::npos) {
      const std::string body =
          "<?xml version=\"1.0\"?><ListBucketResult><IsTruncated>false</IsTruncated>"
          "</ListBucketResult>";
      answer =
          "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    } else if (line.rfind("DELETE ", 0) == 0) {
      answer = "HTTP/1.1 204 No Content\r\n\r\n";
    } else if (line.rfind("HEAD ", 0) == 0) {
      answer = "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n";
    } else {
      const std::string body = "<Error><Code>NoSuchKey</Code></Error>";
      answer = "HTTP/1.1 404 Not Found\r\nContent-Length: " + std::to_string(body.size()) +
               "\r\n\r\n" + body;
    }
    answer.insert(answer.find("\r\n") + 2, "Connection: close\r\n");
    SendAll(c.get(), answer);
  }

  UniqueFd fd_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> stalled_{0};
  std::thread accept_;
  std::vector<std::thread> connections_;  // only the accept thread adds, until it is joined
};

// Sets or unsets environment variables for the scope (the agents started meanwhile inherit them).
class ScopedSetenv {
 public:
  void Set(const char* name, const std::string& value) {
    const char* old = std::getenv(name);
    saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    ::setenv(name, value.c_str(), 1);
  }
  void Unset(const char* name) {
    Set(name, "");
    ::unsetenv(name);
  }
  ~ScopedSetenv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) {
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      } else {
        ::unsetenv(it->first.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// SIGTERM while the agent's own storage (tier 0) stalls in the middle of persisting: the agent
// cancels the upload after its shutdown grace and exits, instead of waiting out the request's
// timeout for each of its attempts (here 600 s times 5); the snapshot stays in shared memory.
TEST_F(AgentTest, SigtermWhilePersistingToAStalledStorageEndsAfterTheGraceKeepingTheSnapshot) {
  StallingS3Server s3;
  ASSERT_NE(s3.port(), 0);
  ScopedSetenv env;
  for (const char* v : {"AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
                        "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE",
                        "AWS_CONFIG_FILE", "SAFEPOINT_STORAGE_TIMEOUT"}) {
    env.Unset(v);
  }
  env.Set("AWS_ENDPOINT_URL", s3.endpoint());
  env.Set("AWS_ACCESS_KEY_ID", "k");
  env.Set("AWS_SECRET_ACCESS_KEY", "s");
  env.Set("SAFEPOINT_SHUTDOWN_GRACE_SECONDS", "1");
  storage_ = "s3://bucket/p?timeout=600&retries=4";
  ASSERT_NO_FATAL_FAILURE(StartAgent());
  ClientOptions o = Options();
  o.agent_binary.clear();  // no new agent after this one stops
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(o));
  SaveStep(*client, 3, /*persist=*/true);
  ASSERT_TRUE(WaitUntil([&] { return s3.stalled() > 0; })) << "the upload never started";

  ASSERT_EQ(::kill(agent_, SIGTERM), 0);
  ExpectExitsWith(agent_, 0);  // before the fix it still waited on the upload at the deadline
  auto log = test::ReadFileToString(logs_.back());
  ASSERT_TRUE(log);
  EXPECT_NE(log->find("did not finish within the shutdown grace"), std::string::npos) << *log;
  // The snapshot stays in shared memory, not leased: a later agent adopts and persists it.
  ASSERT_OK_AND_ASSIGN(auto arena, Arena::Open(job_dir_, 0));
  bool kept = false;
  for (const SlotInfo& slot : arena->Slots()) {
    if (slot.state == SlotState::kComplete && slot.step == 3) kept = !slot.leased;
  }
  EXPECT_TRUE(kept) << "step 3's snapshot is gone from shared memory or still leased";
  auto mem = client->LoadNewest(std::nullopt);
  ASSERT_OK(mem);
  EXPECT_EQ(mem->step, 3u);
}

// Replicated state copied once per node (issue 21): a rank leaves tensors another rank of the
// node copies out of its snapshots, and fills them from that rank's slot when it loads.
TEST_F(AgentTest, ACopySkipLeavesTensorsToAnotherRankWhoseSlotFillsThem) {
  ASSERT_OK_AND_ASSIGN(auto zero, SnapshotClient::Connect(RankOptions(0, 77)));
  ASSERT_OK_AND_ASSIGN(auto one, SnapshotClient::Connect(RankOptions(1, 77)));
  Shard s1(1);
  ASSERT_OK(zero->Save(1, s1.sources, s1.extras, /*persist=*/false));
  ASSERT_OK(one->Save(1, s1.sources, s1.extras, /*persist=*/false));
  const uint64_t full = Shard(1).big.size() * 4;

  EXPECT_EQ(zero->SetCopySkip({{0, 3}}).code(), StatusCode::kInvalidArgument);  // 2 tensors
  EXPECT_TRUE(zero->LastCopySkip().empty());
  ASSERT_OK(zero->SetCopySkip({{0, 1}}));  // "big" is rank 1's to copy
  EXPECT_EQ(zero->LastCopySkip(), (SkipRanges{{0, 1}}));

  // Step 2 of the same structure: rank 0's snapshot has no bytes of "big".
  Shard s2(2);
  const void* data[] = {s2.big.data(), s2.small.data()};
  ASSERT_OK_AND_ASSIGN(SnapshotResult r0, zero->SaveLike(2, data, /*persist=*/false));
  ASSERT_OK_AND_ASSIGN(SnapshotResult r1, one->SaveLike(2, data, /*persist=*/false));
  EXPECT_LT(r0.image_bytes + full / 2, r1.image_bytes);
  ASSERT_OK_AND_ASSIGN(MemorySnapshot mem, zero->LoadStep(2));
  ASSERT_EQ(mem.reader.tensors().size(), 2u);
  EXPECT_TRUE(mem.reader.tensors()[0].spec.elsewhere);
  EXPECT_TRUE(mem.reader.tensor_data(0).empty());

  // Filled from rank 1's slot, bit for bit; a tensor no other rank holds is left unfilled.
  std::vector<float> big(s2.big.size()), nothing(4);
  std::vector<TensorFill> fills(2);
  fills[0].spec = s2.sources[0].spec;
  fills[0].dst = reinterpret_cast<std::byte*>(big.data());
  fills[0].nbytes = big.size() * 4;
  fills[1].spec = {"absent", DType::kFloat32, {4}, {}, {}};
  fills[1].dst = reinterpret_cast<std::byte*>(nothing.data());
  fills[1].nbytes = 16;
  EXPECT_EQ(zero->FillFromSiblings(2, 77, fills), (std::vector<bool>{true, false}));
  EXPECT_EQ(big, s2.big);
  // Only a snapshot of the same step and save attempt counts.
  EXPECT_EQ(zero->FillFromSiblings(2, 78, fills), (std::vector<bool>{false, false}));
  EXPECT_EQ(zero->FillFromSiblings(3, 77, fills), (std::vector<bool>{false, false}));

  // A restore in place fills "big" from rank 1's slot in the same load.
  std::fill(big.begin(), big.end(), 0.0f);
  std::vector<float> small(s2.small.size());
  std::vector<TensorFill> targets(2);
  targets[0] = fills[0];
  targets[1].spec = s2.sources[1].spec;
  targets[1].dst = reinterpret_cast<std::byte*>(small.data());
  targets[1].nbytes = small.size() * 4;
  ASSERT_OK(zero->LoadStep(2, /*in_place=*/true, targets));
  EXPECT_EQ(targets[0].entry, 0);
  EXPECT_EQ(targets[1].entry, 1);
  EXPECT_EQ(big, s2.big);
  EXPECT_EQ(small, s2.small);

  // A full save of the same structure keeps leaving "big" out; one of another structure copies
  // everything and forgets the skip.
  Shard s3(3);
  ASSERT_OK_AND_ASSIGN(SnapshotResult r3, zero->Save(3, s3.sources, s3.extras, false));
  EXPECT_EQ(r3.image_bytes, r0.image_bytes);
  EXPECT_EQ(zero->LastCopySkip(), (SkipRanges{{0, 1}}));
  std::vector<TensorSource> other = s3.sources;
  other[1].spec.name = "renamed";
  ASSERT_OK_AND_ASSIGN(SnapshotResult r4, zero->Save(4, other, s3.extras, false));
  EXPECT_EQ(r4.image_bytes, r1.image_bytes);
  EXPECT_TRUE(zero->LastCopySkip().empty());
}

// A restore whose targets' addresses come as its walk goes (issue 21, item 3): each target
// gets the snapshot's bytes once it is published, the load ends like LoadNewest in place, a walk
// of another structure stops it, and a damaged chunk fails it as it fails any load in place.
TEST_F(AgentTest, AStreamedLoadFillsEachTargetOnceItsAddressIsPublished) {
  ASSERT_OK_AND_ASSIGN(auto client, SnapshotClient::Connect(RankOptions(0)));
  Shard s1(1);
  ASSERT_OK(client->Save(1, s1.sources, s1.extras, /*persist=*/false));
  std::vector<float> big(s1.big.size()), small(s1.small.size());
  std::vector<TensorFill> fills(2);
  for (size_t k = 0; k < 2; ++k) {
    fills[k].spec = s1.sources[k].spec;
    fills[k].nbytes = s1.sources[k].nbytes;
    fills[k].hint = static_cast<int64_t>(k);
  }
  const std::vector<size_t> walk = {1, 3};  // the walk's tensors 0 and 2 are not restored here
  {
    ASSERT_OK_AND_ASSIGN(auto stream,
                         client->BeginStreamedLoad(std::nullopt, std::nullopt, fills, walk));
    stream->Publish(0, nullptr);  // not a target: ignored
    stream->Publish(1, big.data());
    stream->Publish(2, nullptr);
    stream->Publish(3, small.data());
    ASSERT_OK_AND_ASSIGN(MemorySnapshot mem, stream->Finish(true, nullptr));
    EXPECT_EQ(mem.step, 1u);
    EXPECT_FALSE(mem.extras_known);
  }
  EXPECT_EQ(big, s1.big);
  EXPECT_EQ(small, s1.small);
  EXPECT_EQ(fills[0].entry, 0);
  EXPECT_EQ(fills[1].entry, 1);

  // The walk left the plan's structure before the last target: nothing more is copied.
  std::fill(small.begin(), small.end(), -1.0f);
  {
    ASSERT_OK_AND_ASSIGN(auto stream, client->BeginStreamedLoad(1, std::nullopt, fills, walk));
    stream->Publish(1, big.data());
    EXPECT_EQ(stream->Finish(true, nullptr).status().code(), StatusCode::kCancelled);
  }
  {
    ASSERT_OK_AND_ASSIGN(auto stream, client->BeginStreamedLoad(1, std::nullopt, fills, walk));
    EXPECT_EQ(stream->Finish(false, nullptr).status().code(), StatusCode::kCancelled);
  }
  EXPECT_EQ(small, std::vector<float>(small.size(), -1.0f));

  // Not found, and walk positions that do not increase.
  EXPECT_EQ(client->BeginStreamedLoad(9, std::nullopt, fills, walk).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(client->BeginStreamedLoad(std::nullopt, 2, fills, walk).status().code(),
            StatusCode::kNotFound);
  const std::vector<size_t> backwards = {3, 1};
  EXPECT_EQ(client->BeginStreamedLoad(1, std::nullopt, fills, backwards).status().code(),
            StatusCode::kInvalidArgument);

  // One bit of "big" flipped in the slot: the load fails with the chunk named.
  ASSERT_OK_AND_ASSIGN(MemorySnapshot copy, client->LoadStep(1));
  const uint64_t at = copy.reader.tensors()[0].offset + 4 * 1000;
  ASSERT_OK_AND_ASSIGN(auto arena, Arena::Open(job_dir_, 0));
  std::optional<SlotInfo> slot = arena->NewestComplete();
  ASSERT_TRUE(slot);
  arena->SlotData(slot->index)[at] ^= std::byte{0x10};
  ASSERT_OK_AND_ASSIGN(auto stream, client->BeginStreamedLoad(1, std::nullopt, fills, walk));
  stream->Publish(1, big.data());
  stream->Publish(3, small.data());
  Result<MemorySnapshot> damaged = stream->Finish(true, nullptr);
  EXPECT_EQ(damaged.status().code(), StatusCode::kCorruption);
  EXPECT_NE(damaged.status().message().find("chunk"), std::string::npos)
      << damaged.status().ToString();
}

}  // namespace
}  // namespace safepoint::agent_test
