// Tests of the commit relay (src/agent/commit_relay.h): its notes' wire format, and two nodes'
// real agents (safepointd, started by the ranks' clients, each node its own shm directory) that
// commit a job's steps without the second node asking storage, and fall back to storage when the
// committer is gone.
#include "agent/commit_relay.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "agent/replicator.h"
#include "protocol/protocol.h"
#include "safepoint/checkpoint.h"
#include "safepoint/client.h"
#include "safepoint/replication.h"
#include "testing/test_util.h"

#ifndef SAFEPOINTD_PATH
#error "SAFEPOINTD_PATH must name the built safepointd binary"
#endif

namespace safepoint::commit_relay_test {
namespace {

using agent::CommitRelay;
using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr double kDeadlineSeconds = 30;  // only a failing test waits this long

TEST(CommitRelayNotesTest, FactsAndCommitsRoundTrip) {
  std::map<uint32_t, CommitRelay::Fact> facts;
  facts[3] = {4096 + 17, 0xdeadbeef, false, true};
  facts[4] = {uint64_t{1} << 40, 7, true, false};
  ASSERT_OK_AND_ASSIGN(CommitRelay::FactsNote n,
                       CommitRelay::DecodeFacts(CommitRelay::EncodeFacts(9, 77, 8, facts)));
  EXPECT_EQ(n.step, 9u);
  EXPECT_EQ(n.attempt, 77u);
  EXPECT_EQ(n.world_size, 8u);
  EXPECT_EQ(n.facts, facts);
  ASSERT_OK_AND_ASSIGN(CommitRelay::CommitNote c,
                       CommitRelay::DecodeCommit(CommitRelay::EncodeCommit(9, 77, {5, 6})));
  EXPECT_EQ(c.step, 9u);
  EXPECT_EQ(c.attempt, 77u);
  EXPECT_EQ(c.pruned, (std::vector<uint64_t>{5, 6}));
}

TEST(CommitRelayNotesTest, MalformedNotesAreRefused) {
  for (const char* bad : {"", "[]", "{\"step\":1}", "not json",
                          R"({"step":1,"attempt":1,"world":2,"facts":[[2,1,1,0,0]]})",
                          R"({"step":1,"attempt":1,"world":2,"facts":[[0,1,4294967296,0,0]]})",
                          R"({"step":1,"attempt":1,"world":2,"facts":[[0,1,1,2,0]]})",
                          R"({"step":1,"attempt":1,"world":0,"facts":[]})",
                          R"({"step":-1,"attempt":1,"world":2,"facts":[]})"}) {
    EXPECT_EQ(CommitRelay::DecodeFacts(bad).status().code(), StatusCode::kCorruption) << bad;
  }
  for (const char* bad :
       {"", "{}", R"({"step":1,"attempt":1})", R"({"step":1,"attempt":1,"pruned":["x"]})"}) {
    EXPECT_EQ(CommitRelay::DecodeCommit(bad).status().code(), StatusCode::kCorruption) << bad;
  }
}

// A 2-rank job whose ranks are on two nodes (two shm directories, so two agents) writing one
// checkpoint directory, with the membership the Python layer sends (redundancy none);
// ThreeNodes: the same with three.
class TwoNodes : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(tmp_.ok());
    storage_ = tmp_.path() + "/ckpt";
    for (int n = 0; n < nodes_; ++n) {
      shm_[n] = tmp_.path() + "/shm-node" + std::to_string(n);
      ASSERT_EQ(::mkdir(shm_[n].c_str(), 0700), 0);
    }
  }
  void TearDown() override {
    for (int n = 0; n < nodes_ && HasFailure(); ++n) {
      if (auto text = test::ReadFileToString(protocol::AgentLogPath(JobDir(n)))) {
        std::cerr << "---- agent of node " << n << " ----\n" << *text;
      }
    }
    for (int n = 0; n < nodes_; ++n) {
      client_[n].reset();
      const std::string dir = JobDir(n);
      uint32_t pid = 0;
      if (protocol::AgentAlive(dir, &pid) && pid > 1) {
        ::kill(static_cast<pid_t>(pid), SIGCONT);
        ::kill(static_cast<pid_t>(pid), SIGKILL);
      }
    }
  }
  std::string JobDir(int n) const {
    return shm_[n] + "/safepoint-" + std::to_string(::geteuid()) + "-" + job_;
  }
  pid_t AgentPid(int n) const {
    uint32_t pid = 0;
    EXPECT_TRUE(protocol::AgentAlive(JobDir(n), &pid));
    return static_cast<pid_t>(pid);
  }

  // Connects both ranks and gives both agents the membership: node 0 (rank 0's) commits.
  void Connect() {
    for (uint32_t n = 0; n < static_cast<uint32_t>(nodes_); ++n) {
      ClientOptions o;
      o.storage = storage_;
      o.job = job_;
      o.shm_dir = shm_[n];
      o.rank = n;
      o.world_size = static_cast<uint32_t>(nodes_);
      o.keep = 2;
      o.attempt = 5;
      o.agent_binary = SAFEPOINTD_PATH;
      o.agent_start_timeout_s = kDeadlineSeconds;
      ASSERT_OK_AND_ASSIGN(client_[n], SnapshotClient::Connect(o));
    }
    std::vector<PeerNode> nodes;
    for (uint32_t n = 0; n < static_cast<uint32_t>(nodes_); ++n) {
      ASSERT_OK_AND_ASSIGN(std::string address,
                           client_[n]->PeerSetup("n" + std::to_string(n), "127.0.0.1", 5));
      nodes.push_back({"n" + std::to_string(n), address});
    }
    for (uint32_t n = 0; n < static_cast<uint32_t>(nodes_); ++n) {
      ASSERT_OK(client_[n]->SetMembership(
          Membership{"epoch1", n, nodes, "none", std::string(64, 'a'), 0}));
    }
  }

  // Both ranks save step 1 and wait for its commit.
  void CommitStep1() {
    Save(0, 1);
    Save(1, 1);
    ASSERT_OK(client_[0]->Wait(kDeadlineSeconds));
    ASSERT_OK(client_[1]->Wait(kDeadlineSeconds));
  }

  // Node `early` saves `step` and hands it over; its rank waits while node 1 - early's rank
  // saves `step` only past the relay's grace plus `extra_ms` (a slow node). Returns the wait's
  // status (the client serves one call at a time: its status is read after the wait).
  safepoint::Status WaitWhileTheOtherSavesLate(int early, uint64_t step, int extra_ms) {
    Save(early, step);
    EXPECT_TRUE(WaitFor([&] { return Status(early)["commit_relay"]["handed_over"] == step; }));
    safepoint::Status waited = Unavailable("not waited");
    std::thread waiter([&] { waited = client_[early]->Wait(kDeadlineSeconds); });
    std::this_thread::sleep_for(
        std::chrono::milliseconds(static_cast<int>(CommitRelay::kGraceSeconds * 1000) + extra_ms));
    Save(1 - early, step);
    waiter.join();
    return waited;
  }

  void Save(int n, uint64_t step) {
    std::vector<float> data(4096, float(step * 10 + n));
    TensorSource t{{"w", DType::kFloat32, {data.size()}, {}, {}}, data.data(), data.size() * 4};
    auto r = client_[n]->Save(step, {t}, "", /*persist=*/true);
    ASSERT_OK(r);
    ASSERT_TRUE(r->saved);
  }

  // Stops the committer's agent (node 0) before node 1 ever reached it and saves node 1's
  // `step`: node 1's hand-over fails after the peer timeout (its connection never got through),
  // so it writes its facts report and lists the step. Returns the stopped agent's pid, and in
  // `failed` whether node 1 got that far; the caller resumes the agent (SIGCONT).
  pid_t FailNode1HandOver(uint64_t step, bool* failed) {
    const pid_t committer = AgentPid(0);
    const double lists = Status(1)["storage_requests"]["file"]["list"].get<double>();
    EXPECT_EQ(::kill(committer, SIGSTOP), 0);
    Save(1, step);
    *failed = WaitFor([&] {
      const json s = Status(1);
      return s["commit_relay"]["hand_over_failed"] == 1 &&
             s["storage_requests"]["file"]["list"].get<double>() > lists;
    });
    return committer;
  }

  // Whether rank `rank`'s image of `step` (attempt 5) is published, polled until the deadline.
  bool Published(uint64_t step, uint32_t rank) {
    return WaitFor([&] {
      auto store = OpenCheckpointStore(storage_);
      auto held = store.ok() ? (*store)->HoldsImageOfAttempt(step, rank, 5) : Result<bool>(false);
      return held.ok() && *held;
    });
  }

  // Polls `done` every 10 ms until it holds (true) or the deadline passes (false).
  bool WaitFor(const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

  json Status(int n) {
    auto s = client_[n]->AgentStatus();
    EXPECT_OK(s);
    return s.ok() ? json::parse(*s) : json::object();
  }

  std::vector<uint64_t> Committed() {
    std::vector<uint64_t> out;
    auto store = OpenCheckpointStore(storage_);
    if (!store.ok()) return out;
    auto list = (*store)->ListCommitted();
    if (list.ok()) {
      for (const auto& c : *list) out.push_back(c.step);
    }
    return out;
  }

  // Names in the step's directory other than the images and the COMMIT record.
  std::vector<std::string> Reports(uint64_t step) {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(storage_ + "/step-" + std::to_string(step), ec)) {
      const std::string name = e.path().filename();
      if (name.rfind("facts", 0) == 0) out.push_back(name);
    }
    return out;
  }

  test::TempDir tmp_;
  int nodes_ = 2;  // ThreeNodes: 3
  std::string storage_, shm_[3];
  std::string job_ = "relay";
  std::unique_ptr<SnapshotClient> client_[3];
};

TEST_F(TwoNodes, TheCommitterCommitsAndTellsTheOtherNodeWhichAsksStorageNothing) {
  Connect();
  json before;
  for (uint64_t step = 1; step <= 3; ++step) {
    if (step == 2) before = Status(1)["storage_requests"]["file"];
    // Node 1's image first: its facts reach the committer before the committer's own image.
    Save(1, step);
    Save(0, step);
    ASSERT_OK(client_[0]->Wait(kDeadlineSeconds));
    ASSERT_OK(client_[1]->Wait(kDeadlineSeconds));
  }
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{2, 3}));
  for (uint64_t step : {2, 3}) EXPECT_TRUE(Reports(step).empty()) << step;
  const json s0 = Status(0), s1 = Status(1);
  const json& relay0 = s0["commit_relay"];
  const json& relay1 = s1["commit_relay"];
  EXPECT_EQ(relay0["committer"], true) << s0.dump();
  EXPECT_EQ(relay1["committer"], false) << s1.dump();
  EXPECT_EQ(relay0["facts_received"], 3) << relay0.dump();
  EXPECT_EQ(relay1["handed_over"], 3) << relay1.dump();
  EXPECT_EQ(relay1["commits_received"], 3) << relay1.dump();
  EXPECT_EQ(relay1["overdue"], 0) << relay1.dump();
  // For steps 2 and 3 node 1's agent wrote its images (create, write, put each) and asked
  // nothing else.
  const json& req = s1["storage_requests"]["file"];
  for (const char* op : {"list", "head", "get", "delete"}) {
    EXPECT_EQ(req[op].get<double>() - before[op].get<double>(), 0)
        << op << ": " << before.dump() << " -> " << req.dump();
  }
  EXPECT_EQ(req["put"].get<double>() - before["put"].get<double>(), 2) << req.dump();
}

TEST_F(TwoNodes, ANodeWaitingLongerThanTheGraceAsksTheCommitterNotStorage) {
  Connect();
  CommitStep1();
  const json before = Status(1)["storage_requests"]["file"];
  // Node 1 hands step 2 over and its rank waits; the committer's rank saves past the relay's
  // grace (a slow node). Node 1 asks the committer, which holds its facts and waits for its
  // own image; node 1's wait is answered by the commit note, and storage is asked nothing
  // (once per ask, before, on every node of a job slower than the grace).
  ASSERT_OK(WaitWhileTheOtherSavesLate(/*early=*/1, 2, 1500));
  ASSERT_OK(client_[0]->Wait(kDeadlineSeconds));
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{1, 2}));
  const json s1 = Status(1);
  EXPECT_GE(s1["commit_relay"]["asked"], 1) << s1.dump();
  EXPECT_EQ(s1["commit_relay"]["overdue"], 0) << s1.dump();
  EXPECT_EQ(s1["commit_relay"]["commits_received"], 2) << s1.dump();
  const json& req = s1["storage_requests"]["file"];
  for (const char* op : {"list", "head", "get", "delete"}) {
    EXPECT_EQ(req[op].get<double>() - before[op].get<double>(), 0)
        << op << ": " << before.dump() << " -> " << req.dump();
  }
}

TEST_F(TwoNodes, WithTheCommitterGoneTheOtherNodeCommitsThroughStorage) {
  Connect();
  CommitStep1();
  // Rank 0's image of step 2 is published, then its node's agent dies before node 1's facts
  // arrive: node 1 cannot hand them over, and commits step 2 by listing it.
  Save(0, 2);
  ASSERT_TRUE(Published(2, 0)) << "rank 0's image was not published";
  const pid_t committer = AgentPid(0);
  ASSERT_EQ(::kill(committer, SIGKILL), 0);
  Save(1, 2);
  ASSERT_OK(client_[1]->Wait(kDeadlineSeconds));
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{1, 2}));
  const json relay1 = Status(1)["commit_relay"];
  EXPECT_EQ(relay1["hand_over_failed"], 1) << relay1.dump();
}

TEST_F(TwoNodes, AStepHandedOverToACommitterThatDiedStillCommits) {
  Connect();
  CommitStep1();
  // Node 1 hands its facts of step 2 over; then the committer's agent dies with them. Rank 0's
  // client starts a new one (with the peer setup and membership again), which persists rank
  // 0's image: it commits the step by itself (an adopted snapshot's listing commit) or once
  // node 1, getting no commit note within the relay's grace, hands its facts over again.
  Save(1, 2);
  ASSERT_TRUE(WaitFor([&] { return Status(1)["commit_relay"]["handed_over"] == 2; }));
  ASSERT_EQ(::kill(AgentPid(0), SIGKILL), 0);
  Save(0, 2);
  ASSERT_OK(client_[0]->Wait(kDeadlineSeconds));
  ASSERT_OK(client_[1]->Wait(kDeadlineSeconds));
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{1, 2}));
  const json relay1 = Status(1)["commit_relay"];
  EXPECT_EQ(relay1["hand_over_failed"], 0) << relay1.dump();
  EXPECT_EQ(relay1["overdue"], 0) << relay1.dump();  // it never fell back to storage
}

TEST_F(TwoNodes, TheCommitterCommitsThroughStorageWhenTheOtherNodeFellBack) {
  Connect();
  // The committer's agent stops answering before node 1 ever reached it: node 1's hand-over of
  // step 1 fails after the peer timeout (5 s here; its connection never got through), so node 1
  // writes its facts report and lists the step (incomplete). The committer, going on, persists
  // rank 0's image; no other node's facts reach it, and once its probe learns that node 1 commits
  // the step through storage (not after its 30 s grace, as before) it lists the step itself,
  // reading node 1's report. (Stopped later, the committer would still get node 1's
  // facts: a note over the connection kept from an earlier step waits in its socket.)
  bool failed = false;
  const pid_t committer = FailNode1HandOver(1, &failed);
  // Rank 0's image comes once node 1 listed the step without it (else node 1 could commit it).
  Save(0, 1);  // its note waits in the stopped agent's socket
  ASSERT_EQ(::kill(committer, SIGCONT), 0);
  ASSERT_TRUE(failed);
  ASSERT_OK(client_[0]->Wait(2 * kDeadlineSeconds + CommitRelay::kCommitterGraceSeconds));
  ASSERT_OK(client_[1]->Wait(2 * kDeadlineSeconds + CommitRelay::kCommitterGraceSeconds));
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{1}));
  const json relay0 = Status(0)["commit_relay"];
  EXPECT_EQ(relay0["overdue"], 1) << relay0.dump();
  EXPECT_EQ(relay0["probed_to_storage"], 1) << relay0.dump();
  EXPECT_EQ(relay0["probed_gone"], 0) << relay0.dump();
}

TEST_F(TwoNodes, TheCommitterListsAtOnceWhenANodeWhoseFactsItLacksIsGone) {
  Connect();
  // Node 1 cannot hand step 1 over (the committer's agent is stopped): it writes its facts
  // report and lists the step, then its agent dies, as on a lost node. The committer, going on,
  // persists rank 0's image and lacks node 1's facts: its probe finds node 1 gone, and it lists
  // the step (reading node 1's report) instead of waiting out kCommitterGraceSeconds.
  bool failed = false;
  const pid_t committer = FailNode1HandOver(1, &failed);
  ASSERT_TRUE(failed);
  ASSERT_EQ(::kill(AgentPid(1), SIGKILL), 0);
  ASSERT_EQ(::kill(committer, SIGCONT), 0);
  Save(0, 1);
  ASSERT_OK(client_[0]->Wait(2 * kDeadlineSeconds + CommitRelay::kCommitterGraceSeconds));
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{1}));
  const json relay0 = Status(0)["commit_relay"];
  EXPECT_EQ(relay0["overdue"], 1) << relay0.dump();
  EXPECT_GE(relay0["probed_gone"], 1) << relay0.dump();
}

TEST_F(TwoNodes, TheCommitterProbesASlowNodeAndWaitsForItsFacts) {
  Connect();
  CommitStep1();
  // The committer's image of step 2 first; node 1's rank saves past the relay's grace (a slow
  // node). The committer probes node 1, which answers: it waits for node 1's facts and commits
  // from them instead of listing the step.
  ASSERT_OK(WaitWhileTheOtherSavesLate(/*early=*/0, 2, 2500));
  ASSERT_OK(client_[1]->Wait(kDeadlineSeconds));
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{1, 2}));
  const json s0 = Status(0);
  EXPECT_GE(s0["commit_relay"]["probed"], 1) << s0.dump();
  EXPECT_EQ(s0["commit_relay"]["probed_gone"], 0) << s0.dump();
  EXPECT_EQ(s0["commit_relay"]["overdue"], 0) << s0.dump();  // it did not list the step
}

TEST_F(TwoNodes, AStepANewerCommitOvertookStillCommits) {
  Connect();
  // Node 1 cannot hand step 1 over (the committer's agent is stopped before node 1 ever
  // reached it): it writes its facts report and lists step 1, which lacks rank 0's image.
  bool failed = false;
  const pid_t committer = FailNode1HandOver(1, &failed);
  ASSERT_EQ(::kill(committer, SIGCONT), 0);
  ASSERT_TRUE(failed);
  // The committer persists rank 0's steps 1 and 2 and holds them, waiting for node 1's facts.
  Save(0, 1);
  ASSERT_TRUE(Published(1, 0));
  Save(0, 2);
  ASSERT_TRUE(Published(2, 0));
  // Node 1, still backing off from the committer, commits step 2 by listing it (whole) and
  // tells the committer. Step 1 is whole too: the committer lists it once then, instead of
  // dropping its hand-over with step 2's commit (it stayed uncommitted: OPEN-6), unless its
  // probe learnt first that node 1 commits step 1 through storage (it lists it then).
  Save(1, 2);
  ASSERT_OK(client_[1]->Wait(kDeadlineSeconds));
  ASSERT_OK(client_[0]->Wait(kDeadlineSeconds));
  EXPECT_TRUE(WaitFor([&] {
    return Committed() == std::vector<uint64_t>{1, 2};
  })) << ::testing::PrintToString(Committed());
  const json relay0 = Status(0)["commit_relay"];
  EXPECT_GE(relay0["listed_older"].get<int>() + relay0["probed_to_storage"].get<int>(), 1)
      << relay0.dump();
}

TEST_F(TwoNodes, ACommitNoteToADeadNodeFailsAndTheCommitStands) {
  Connect();
  Save(1, 1);
  ASSERT_TRUE(WaitFor([&] { return Status(1)["commit_relay"]["handed_over"] == 1; }));
  // Node 1's agent dies once its facts are handed over: the committer commits step 1 and cannot
  // tell node 1, which it then leaves out of its commit notes for a while.
  ASSERT_EQ(::kill(AgentPid(1), SIGKILL), 0);
  Save(0, 1);
  ASSERT_OK(client_[0]->Wait(kDeadlineSeconds));
  EXPECT_EQ(Committed(), (std::vector<uint64_t>{1}));
  EXPECT_TRUE(WaitFor([&] { return Status(0)["commit_relay"]["announce_failed"] == 1; }))
      << Status(0)["commit_relay"].dump();
}

class ThreeNodes : public TwoNodes {
 protected:
  ThreeNodes() { nodes_ = 3; }
};

// The committer probes on a worker of its own: a probe of a node that does not answer (its
// agent stopped: the peer timeout, 5 s here) does not hold the commit notes of a step that
// completed meanwhile. Before, both went out on one worker, and every other node learnt the
// commit only after the probe timed out (or asked after its own grace).
TEST_F(ThreeNodes, AProbeOfANodeThatDoesNotAnswerHoldsNoCommitNote) {
  Connect();
  for (int n = 0; n < 3; ++n) Save(n, 1);
  for (int n = 0; n < 3; ++n) ASSERT_OK(client_[n]->Wait(kDeadlineSeconds));
  // Node 1 hands step 2 over, then its agent stops answering.
  Save(1, 2);
  ASSERT_TRUE(WaitFor([&] { return Status(1)["commit_relay"]["handed_over"] == 2; }));
  ASSERT_EQ(::kill(AgentPid(1), SIGSTOP), 0);
  // The committer's steps 2 and 3; node 2 has saved neither. Past the grace the committer
  // probes node 2 for step 2 (it answers: a slow node) and nodes 1 and 2 for step 3 (node 1
  // does not answer: that probe waits out the peer timeout).
  Save(0, 2);
  Save(0, 3);
  ASSERT_TRUE(Published(3, 0));
  ASSERT_TRUE(WaitFor([&] { return Status(0)["commit_relay"]["probed"] >= 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  // Node 2 saves step 2: the committer commits it and tells node 2 while its probe of node 1
  // for step 3 still waits.
  Save(2, 2);
  ASSERT_OK(client_[2]->Wait(kDeadlineSeconds));
  const json relay0 = Status(0)["commit_relay"];
  const json relay2 = Status(2)["commit_relay"];
  EXPECT_EQ(relay0["probed_gone"], 0) << relay0.dump();
  EXPECT_EQ(relay2["commits_received"], 2) << relay2.dump();
  EXPECT_EQ(relay2["asked"], 0) << relay2.dump();
  EXPECT_TRUE(WaitFor([&] {
    return Committed() == std::vector<uint64_t>{1, 2};
  })) << ::testing::PrintToString(Committed());
  // The probe then finds node 1 gone.
  EXPECT_TRUE(WaitFor([&] { return Status(0)["commit_relay"]["probed_gone"] >= 1; }))
      << Status(0)["commit_relay"].dump();
}

// The committer's side of an "ask": the facts are taken again until the step is committed,
// then the asker is told so.
TEST(CommitRelayAskTest, TheCommitterTakesTheFactsAgainUntilTheStepIsCommitted) {
  agent::Replicator replicator("job", [] {});
  int woken = 0;
  CommitRelay relay(&replicator, [&] { ++woken; });
  std::map<uint32_t, CommitRelay::Fact> facts;
  facts[1] = {4096, 9, false, false};
  const std::string ask = CommitRelay::EncodeFacts(7, 3, 2, facts);
  ASSERT_OK(relay.OnNote("n1", "ask", ask));
  std::vector<CommitRelay::FactsNote> in;
  std::vector<CommitRelay::CommitNote> commits;
  relay.Take(&in, &commits);
  ASSERT_EQ(in.size(), 1u);
  EXPECT_EQ(in[0].from, "n1");
  EXPECT_EQ(in[0].facts, facts);
  EXPECT_EQ(woken, 1);
  relay.Committed(7);
  EXPECT_EQ(relay.OnNote("n1", "ask", ask).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(relay.OnNote("n1", "what", ask).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(relay.OnNote("n1", "facts", "{").code(), StatusCode::kCorruption);
  relay.Take(&in, &commits);
  EXPECT_TRUE(in.empty() && commits.empty());
}

// A probe (the committer lacks this node's facts of a step) is answered AlreadyExists once the
// step is committed here, OK otherwise (a node that lives and has yet to hand them over); the
// answer for a step this node commits through storage is TheCommitterCommitsThroughStorage...'s.
TEST(CommitRelayAskTest, AProbeIsAnsweredWithWhatThisNodeKnowsOfTheStep) {
  agent::Replicator replicator("job", [] {});
  int woken = 0;
  CommitRelay relay(&replicator, [&] { ++woken; });
  EXPECT_OK(relay.OnNote("n0", "probe", R"({"step":7})"));
  relay.Committed(7);
  EXPECT_EQ(relay.OnNote("n0", "probe", R"({"step":7})").code(), StatusCode::kAlreadyExists);
  EXPECT_OK(relay.OnNote("n0", "probe", R"({"step":8})"));
  EXPECT_OK(relay.OnNote("n0", "probe", "{}"));  // an older committer's probe names no step
  EXPECT_EQ(woken, 0);                           // a probe does not wake the agent's loop
  std::vector<CommitRelay::FactsNote> in;
  std::vector<CommitRelay::CommitNote> commits;
  relay.Take(&in, &commits);
  EXPECT_TRUE(in.empty() && commits.empty());
}

}  // namespace
}  // namespace safepoint::commit_relay_test
