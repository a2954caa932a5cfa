// NodeAgent: the agent process of one job on one node (safepointd; src/agent/agent.h).
//
// Files of the agent, each with one job:
//   node_agent.cc     the poll loop and the rank bookkeeping (which snapshot is persisted,
//                     queued, failed); start and exit
//   agent_clients.cc  client connections and message dispatch, emergency flushes, closes
//   waits.cc          answering waits: committed here or by another node, pruned, never
//   adoption.cc       taking over a job that an earlier agent left (job.json, leases, snapshots)
//   world_change.cc   a job restarted with another world size: the previous world's snapshots
//                     persisted, then dropped; the new world's hellos answered after that
//   status.cc         the status document (`safepoint status`, ckpt.status())
//   telemetry.*       Prometheus metrics (metrics.*, metrics_server.*) and the event log
//                     (event_log.*): one call where each event happens, gauges sampled
//   history_recorder.* the job's measurement history (the agent serving rank 0 keeps it)
//   persist_queue.*   the worker that writes snapshots to storage, commits and prunes
//   replicator.*      peer replication: pushes snapshots to other nodes, rebuilds from them
//   tier_copier.*     copies committed steps down the job's storage tiers
//   job_config.*      job.json: what a job persists to
//   agent.h           AgentOptions and RunAgent, what safepointd and `safepoint agent` call
// The messages and frames between clients and the agent are src/protocol/protocol.h.
//
// Threads: everything in NodeAgent runs on the main thread, except the PersistQueue's worker, the
// Replicator's workers and the TierChain's workers, which touch only their own state and wake the
// loop through an eventfd.
//
// Ownership: the agent owns the job directory's lock (one agent per job), the listening socket
// and the arenas it maps; the training processes own their slots' contents. The agent never
// writes a slot except its lease bit (src/shm/arena.h).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "agent/agent.h"
#include "agent/history_recorder.h"
#include "agent/job_config.h"
#include "agent/persist_queue.h"
#include "agent/replicator.h"
#include "agent/telemetry.h"
#include "agent/tier_copier.h"
#include "base/unique_fd.h"
#include "protocol/protocol.h"
#include "safepoint/checkpoint.h"
#include "shm/arena.h"

namespace safepoint::agent {

// What the agent knows of one rank of the job.
struct RankState {
  std::unique_ptr<Arena> arena;
  uint32_t pid = 0;
  bool connected = false;
  bool closed = false;   // closed cleanly
  bool adopted = false;  // its snapshots were found in the job directory at this agent's start
  int close_client = -1;
  std::optional<uint64_t> last_persisted_step;
  double last_persist_seconds = 0;
  uint64_t last_persist_bytes = 0;
  uint64_t persists_ok = 0, persists_failed = 0, persists_superseded = 0;
  uint64_t emergency_flushes = 0;
  // Frames received from the rank's process after its hello, status requests aside: one per
  // save (its snapshot note, which carries its report), plus waits, restores' reports, ...
  uint64_t messages_received = 0;
  std::string last_error;
  std::map<uint64_t, Status> outcomes;  // step -> result of persisting this rank's image
  // step -> (slot, generation) of the snapshot persisted for it. Generations count per slot, so
  // the same step saved again into the other slot may carry an equal generation: match both.
  std::map<uint64_t, std::pair<uint32_t, uint64_t>> persisted_generation;
  std::map<uint64_t, uint64_t> persisted_attempt;  // step -> save attempt of the image written
  // The newest step the rank's connected process asked to persist (reset at its hello): a rank
  // that asked for a later step never asks for an earlier one.
  std::optional<uint64_t> newest_asked;
  std::multiset<uint64_t> pending;  // steps queued or in flight, once per task
};

// One connection.
struct Client {
  internal::UniqueFd fd;
  internal::UniqueFd pidfd;  // invalid when pidfd_open failed
  uint32_t pid = 0;
  protocol::FrameDecoder decoder;
  bool hello = false;
  uint32_t rank = 0;
  uint64_t attempt = 0;  // the save attempt of its hello: that of every snapshot it notes
  bool closing = false;
  bool broken = false;   // a reply could not be sent: drop the connection
  bool refused = false;  // its hello was refused
  // A hello of another world size than the job's, answered once the world change is done
  // (world_change.cc); meanwhile the client gets a kAck every few seconds.
  std::optional<protocol::HelloRequest> parked_hello;
  double last_beat = 0;                          // when it last got one
  std::vector<std::pair<uint64_t, bool>> waits;  // (step, persisted) the client waits for
};

class NodeAgent {
 public:
  explicit NodeAgent(AgentOptions options);
  // Serves until told to stop; returns the process exit status (src/agent/agent.h).
  int Run();

 private:
  using json = nlohmann::json;

  // node_agent.cc
  Status Setup();
  void Loop();
  void Accept();
  void HandleClientData(size_t idx);
  Status HandleMessage(Client& c, const protocol::Message& m);
  Status HandleHello(Client& c, const protocol::HelloRequest& hello);
  Status HandleSnapshot(Client& c, protocol::SnapshotNote note);
  void DropClient(size_t idx, bool died);
  void EmergencyFlush(uint32_t rank, FlushReason reason);
  Status EnsureRank(uint32_t rank);
  Status Configure(const JobConfig& config, std::shared_ptr<CheckpointStore> store);
  void SaveJobConfig();
  void Enqueue(PersistTask t);
  void DrainResults();
  void DrainReplication();
  // commit_notes.cc: the commit relay's notes (facts other nodes handed over, commits the
  // committer announced), its overdue hand-overs, and the results of its commit-only tasks.
  void DrainRelay();
  void RelayCommitDone(const PersistResult& r);
  json RelayStatusJson() const;  // the status's "commit_relay" section (null: not used)
  // `step` is committed (told by the committer, or committed here): waits, tiers and retention's
  // removals (`pruned`) learn of it.
  void LearnCommitted(uint64_t step, const std::vector<uint64_t>& pruned);
  // `step` is committed, however this agent learnt it: the cache, the newest, the lower tiers,
  // and the telemetry's commit event at the next RefreshTelemetry (each step once, in order,
  // an older step committed after a newer one included).
  void MarkCommitted(uint64_t step);
  // Ends the relay's hand-overs of `step` and older ones; on the committer, queues one listing
  // commit of each older one that no commit answered (CommitRelay::Committed).
  void EndHandOvers(uint64_t step);
  Status HandlePeerMessage(Client& c, const protocol::Message& m);
  // waits.cc
  void PollCommitsForTiers();
  void AnswerWaits();
  // Whether a persist of `step` of any rank of this agent is queued or in flight.
  bool PendingHere(uint64_t step) const;
  bool StepCommitted(uint64_t step);
  // Why `step`, which `rank` persisted, can never commit (nullopt: it still may); OK when a last
  // look committed it after all. See waits.cc.
  std::optional<Status> StepNeverCommits(uint64_t step, uint32_t rank);
  bool RankGone(const RankState& rs) const;
  // A wait for `step` (`rank`'s image of it persisted) where other nodes' agents persist ranks of
  // the job: the error when one of them reported that its rank's image of the attempt will never
  // be written (CheckpointStore::ReportAbandoned) and none is stored; read at the step's polls.
  std::optional<Status> StepAbandonedElsewhere(uint64_t step, uint32_t rank);
  // Whether every rank of the job's world is served here (a job on one node).
  bool HostsEveryRank() const;
  // The ranks of the job's world whose processes of save attempt `attempt` are connected to
  // this agent now (of those whose snapshots it adopted, the ones that asked it for a persist
  // since their hello).
  uint32_t ConnectedRanks(uint64_t attempt) const;
  // The newest committed step this agent knows of, or "none" (for messages).
  std::string NewestCommittedText() const;
  // The save attempt of t's snapshot, from its header in shared memory (0: unknown).
  uint64_t SnapshotAttempt(const PersistTask& t);
  // The storage holds `keep` committed steps newer than `step`: retention removes it at commit.
  bool SupersededOnStorage(uint64_t step);
  void Reply(Client& c, protocol::MessageType type, const std::string& payload);
  void ReplyError(Client& c, const std::string& msg);
  // A hello refused: the error, and the client no longer keeps an idle agent alive.
  void RefuseHello(Client& c, const std::string& msg);
  bool Idle();
  bool AllClosed();
  void Shutdown();
  void Wake();

  // adoption.cc
  void Adopt();

  // world_change.cc
  // A process of the job's previous world that still runs: (rank, pid), if any.
  std::optional<std::pair<uint32_t, uint32_t>> LivePreviousRank();
  // Parks the hello of `c` (world size `world_size`, not the job's) until the previous world's
  // snapshots are persisted and dropped; starts that change if none is under way.
  void BeginWorldChange(Client& c, const protocol::HelloRequest& hello);
  // Called by the loop: beats the parked hellos, and once the previous world's persists are
  // done, drops its snapshots, reconfigures the job and answers the parked hellos (or refuses
  // them when a snapshot could not be persisted).
  void AdvanceWorldChange();

  // status.cc
  json StatusJson();

  // telemetry.cc
  void RefreshTelemetry(bool now = false);
  void HandleReport(Client& c, const protocol::ReportNote& note);
  void ConfigureTelemetry(const protocol::HelloRequest& hello);
  void StartTelemetry();

  AgentOptions opt_;
  Telemetry telemetry_;  // metrics and the event log (constructed before the workers that report)
  HistoryRecorder history_;  // the job's measurement history (when this agent serves rank 0)
  std::string job_dir_;
  internal::UniqueFd lock_fd_, listen_fd_, signal_fd_, event_fd_;
  std::optional<JobConfig> config_;
  // When the commit of a waited step is asked of storage: once at once, then at doubling
  // intervals from kFirstCommitPollSeconds up to kMaxCommitPollSeconds, once per pass for every
  // wait of the step on this agent (a node's ranks all wait for one step).
  static constexpr double kFirstCommitPollSeconds = 0.2;
  static constexpr double kMaxCommitPollSeconds = 1.0;
  struct CommitPoll {
    double next = 0;
    double interval = kFirstCommitPollSeconds;
    double pass = -1;  // the pass (AnswerWaits' `now`) that asked last
    bool answer = false;
    // save attempt -> another node's abandoned record of the step, read at this pass
    std::map<uint64_t, std::optional<CheckpointStore::AbandonedImage>> abandoned;
  };
  // Whether `step`'s commit is to be asked of storage in the pass `now`.
  bool CommitPollDue(uint64_t step, double now);
  std::map<uint64_t, CommitPoll> commit_polls_;
  // Committed steps on storage, listed at most every kListingSeconds (SupersededOnStorage).
  static constexpr double kListingSeconds = 5;
  std::optional<std::vector<uint64_t>> polled_steps_;
  double polled_steps_at_ = 0;
  bool config_written_ = false;  // job.json holds config_ (written, or read by Adopt)
  Status config_saved_;          // the last attempt to write job.json (reported in status)
  std::shared_ptr<CheckpointStore> store_;
  std::map<uint32_t, RankState> ranks_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::set<uint64_t> committed_cache_;
  // The steps this agent committed and its retention then removed, newest last (bounded): a
  // wait for one of them is answered OK, the save did not fail. A step saved again leaves it.
  std::deque<uint64_t> pruned_;
  std::optional<uint64_t> newest_committed_;
  std::vector<uint64_t> commits_to_tell_;  // MarkCommitted since the last RefreshTelemetry
  bool stopping_ = false;
  bool saw_client_ = false;
  // A hello was refused since a rank last connected: once nothing else keeps it busy the agent
  // exits at once, instead of after idle_exit_seconds (`safepoint gc` sees the job idle).
  bool refused_ = false;
  // The world size a world change is under way to (world_change.cc), and since when.
  std::optional<uint32_t> world_change_;
  double world_change_since_ = 0;
  double last_busy_;
  // When the last local client went away without closing (the job was torn down here), for
  // the flush of other nodes' replicas (Replicator::EnqueueFlushHeld) a few seconds later.
  std::optional<double> torn_down_since_;
  bool held_flushed_ = false;  // this teardown's flush of other nodes' replicas was asked for
  std::shared_ptr<StepPins> pins_ = std::make_shared<StepPins>();
  // What the job's image writers reported published (this agent's persists; with peers, other
  // nodes' agents): the commits that need no listing (commit_ledger.h).
  std::shared_ptr<CommitLedger> ledger_ = std::make_shared<CommitLedger>();
  PersistQueue queue_;
  Replicator replicator_;
  CommitRelay relay_;  // where the job spans nodes: commits without asking storage
  TierChain tiers_;    // fills the job's lower storage tiers (on the node that runs rank 0)
  double last_tier_poll_ = 0;
  double last_telemetry_ = 0;
};

double MonotonicSeconds();
double TierRetrySeconds();
double ShutdownGraceSeconds();

// How long a stopping agent lets its persists, then its tier copies, run before it cancels them
// (one deadline for both; $SAFEPOINT_SHUTDOWN_GRACE_SECONDS overrides).
inline constexpr double kShutdownGraceSeconds = 30;
// At exit, how long the commit relay may take to send the commit notes it queued.
inline constexpr double kRelayFlushSeconds = 5;

}  // namespace safepoint::agent
