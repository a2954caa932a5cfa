// PersistQueue: the agent's worker that writes snapshots from shared memory to the storage tier,
// commits steps and applies retention.
//
// Tasks run one at a time, in the order they were queued, on one worker thread. A task names a
// slot and the generation the snapshot had when it was queued; the worker leases the slot (or
// takes over the lease the client already holds), checks that the slot still holds that very
// snapshot (else the task is *superseded*: a newer save overwrote it first), verifies the
// header against the slot, and writes the image with the commit protocol, named by its save
// attempt and never over another writer's image (CheckpointStore::WriteImageBytesOfAttempt, or
// WriteImageOfAttempt when replicas are left to other ranks). It then tries to commit the step
// (TryCommitOfAttempt: every rank's image of one attempt is there) and, when the
// step committed, prunes to the newest `keep` committed steps (never fewer than one) and removes
// leftovers. The lease is released whatever happened. A step already committed is never written
// again: the agent never replaces a committed step.
//
// Threads: Enqueue, Contains, TakeResults, progress() and Stop() are called from the agent's main
// thread; the worker thread runs the tasks and calls `notify` after each result (the main loop's
// eventfd). The worker maps slots through an Arena of its own. Its loop is a WorkerLoop that
// drains on stop.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "agent/commit_ledger.h"
#include "agent/commit_relay.h"
#include "agent/tier_copier.h"
#include "base/worker_loop.h"
#include "safepoint/checkpoint.h"
#include "safepoint/image.h"
#include "safepoint/status.h"

namespace safepoint {
class Arena;
}  // namespace safepoint

namespace safepoint::agent {

// Why a snapshot is persisted.
enum class FlushReason {
  kRequested,  // the client asked for it (persist_every)
  kEmergency,  // its writer died without closing
  kClose,      // the rank closed cleanly: its newest snapshot
  kAdopted,    // a new agent found it newer than the newest committed step
  kShutdown,   // the agent was told to stop
};
std::string_view FlushReasonName(FlushReason reason);

struct PersistTask {
  uint32_t rank = 0;
  uint32_t slot = 0;
  uint64_t generation = 0;
  uint64_t step = 0;
  bool leased = false;  // the slot lease is already held for this task
  FlushReason reason = FlushReason::kRequested;
  SkipRanges skip;  // tensors other ranks write (replicas); empty: write every tensor
  // The snapshot's save attempt, read from its header when it was queued (0: unknown). Where the
  // snapshot is overwritten before it is persisted, the step of that attempt is reported
  // abandoned to the other nodes (CheckpointStore::ReportAbandoned).
  uint64_t attempt = 0;
  // Requested persists on several nodes: the ranks whose processes of this save attempt were
  // connected to this agent when the task was queued (NodeAgent::ConnectedRanks). The commit writes
  // the node's facts report and lists the step once requested persists of the step of that many
  // ranks have finished here (its last image of the step), not each time the queue runs dry between
  // its ranks' snapshots. 0: no such wait.
  uint32_t ranks_here = 0;
  // A task that persists nothing and commits the step of save `attempt`
  // (docs/architecture.md, "Committing at scale"): kFromFacts, from every rank's facts (the
  // committer's ledger completed with facts other nodes handed over: CommitRelay); kListing,
  // the listing commit after this node's facts report (a hand-over no commit answered).
  enum class CommitOnly { kNo, kFromFacts, kListing };
  CommitOnly commit_only = CommitOnly::kNo;
  std::shared_ptr<const std::vector<CheckpointStore::ImageFact>> facts = nullptr;  // kFromFacts
};

struct PersistResult {
  PersistTask task;
  Status status;
  bool superseded = false;  // the slot no longer held the snapshot: nothing was written
  bool committed = false;   // the step is committed (by this task or before it)
  uint64_t attempt = 0;     // the save attempt of the snapshot (from its header)
  uint64_t bytes = 0;
  double seconds = 0;
  std::vector<uint64_t> pruned;  // committed steps removed by retention
};

// Where and how a job persists; fixed once the job is configured.
struct PersistTarget {
  std::string job;
  std::shared_ptr<CheckpointStore> store;
  uint32_t world_size = 1;
  uint32_t keep = 3;
  std::shared_ptr<StepPins> pins;  // steps the first lower tier copies (retention keeps them)
  PackOptions pack;                // how images are stored (compression, incremental)
  // What the job's image writers reported published, for commits without listing (optional).
  std::shared_ptr<CommitLedger> ledger;
  // Where the job spans nodes: hands this node's facts to the committer instead of listing
  // (optional; outlives the queue's worker).
  CommitRelay* relay = nullptr;
};

class PersistQueue {
 public:
  explicit PersistQueue(std::function<void()> notify);
  ~PersistQueue();  // Stop()
  PersistQueue(const PersistQueue&) = delete;
  PersistQueue& operator=(const PersistQueue&) = delete;

  // Starts the worker for the snapshots in `job_dir`, persisting to `target`. Called once,
  // before the first Enqueue.
  void Start(std::string job_dir, PersistTarget target);
  bool started() const { return worker_.started(); }

  // Persists run in the order they were queued; a commit-only task runs before them, after the
  // commit-only tasks queued before it.
  void Enqueue(PersistTask task);
  // True while a commit-only task of `step` is queued, in flight, or finished but its result
  // not taken yet.
  bool CommitQueued(uint64_t step) const;
  // The job's world size changed (NodeAgent's world change): the steps persisted from now on
  // commit with `world_size` images, and a snapshot of another world size is refused as its
  // header does not match. Only while nothing is queued or in flight (!Busy()).
  void SetWorldSize(uint32_t world_size);
  // Whether this agent serves every rank of the job's world (a job on one node): a requested
  // persist's commit then waits for the ledger's facts of every rank and never lists the step.
  void SetHostsEveryRank(bool every) { hosts_every_rank_ = every; }
  // Commits written from the ledger's facts (for tests and the status).
  uint64_t ledger_commits() const { return ledger_commits_.load(); }
  // True while the snapshot (rank, slot, generation) is queued, in flight, or finished but its
  // result not taken yet.
  bool Contains(uint32_t rank, uint32_t slot, uint64_t generation) const;
  // The results finished since the last call, in order.
  std::vector<PersistResult> TakeResults();

  struct Progress {
    size_t queued = 0;
    std::optional<PersistTask> in_flight;
  };
  Progress progress() const;
  bool Busy() const;  // queued or in flight

  // Runs what is queued to the end, then stops the worker. Idempotent.
  void Stop();
  // Stop, bounded: lets the queue run for up to `grace_seconds`; what is still queued or in
  // flight then is cancelled (the storage's requests in flight end at once, e.g. a stalled S3
  // upload; the tasks left fail with Cancelled without touching the storage) and the worker
  // stops. The snapshots stay in shared memory for a later agent. True when nothing had to be
  // cancelled.
  bool Stop(double grace_seconds);

 private:
  using Loop = internal::WorkerLoop<PersistTask>;
  void Run(const PersistTask& t);  // on the worker: Persist, then the result
  PersistResult Persist(const PersistTask& t);
  Result<std::unique_ptr<ImageBuilder>> WithoutReplicas(std::span<const std::byte> image,
                                                        const std::string& source,
                                                        const SkipRanges& skip);
  bool QueuedForStep(uint64_t step) const;  // another persist of `step` waits in the queue
  // t's snapshot was overwritten before it was persisted: where other nodes' agents wait for the
  // step's commit, tells them that this rank's image of the attempt will never be written.
  void ReportAbandoned(const PersistTask& t, Arena& arena);
  Result<bool> Commit(const PersistTask& t, uint64_t attempt,
                      const std::optional<CheckpointStore::ImageFact>& fact);
  // Records a commit's outcome in `r`; when the step committed, retention runs.
  void Committed(PersistResult& r, const Result<bool>& committed);
  // A CommitOnly task: the commit, then retention when it committed.
  PersistResult CommitOnly(const PersistTask& t);
  // The listing commit of (step, attempt) with the facts `known` here (by rank), after this
  // node's facts report of them where `report`.
  Result<bool> ListingCommit(uint64_t step, uint64_t attempt,
                             const std::map<uint32_t, CheckpointStore::ImageFact>& known,
                             bool report);
  std::vector<uint64_t> Prune();

  const std::function<void()> notify_;
  // Written by Start before the worker exists, then read-only (but for target_.world_size,
  // which SetWorldSize writes under mu_ while the worker is idle: the worker reads it after it
  // took its next task under mu_).
  std::string job_dir_;
  PersistTarget target_;

  std::atomic<bool> cancelled_{false};  // Stop(grace) gave up: the tasks left fail at once
  std::atomic<bool> hosts_every_rank_{false};
  std::atomic<uint64_t> ledger_commits_{0};

  // Whether requested persists of t's step and save attempt have now finished here for
  // t.ranks_here ranks (t's among them): the node's last image of the step.
  bool FinishedOnNode(const PersistTask& t, uint64_t attempt);

  mutable std::mutex mu_;  // guards everything below
  // (step, attempt) -> the ranks whose requested persist of it finished here; the newest
  // kFinishedSteps keys by insertion (a step rolled back to is new again).
  static constexpr size_t kFinishedSteps = 64;
  std::map<std::pair<uint64_t, uint64_t>, std::set<uint32_t>> finished_;
  std::deque<std::pair<uint64_t, uint64_t>> finished_order_;
  std::deque<PersistTask> queue_;
  std::optional<PersistTask> in_flight_;
  std::vector<PersistResult> results_;
  Loop worker_{mu_, Loop::OnStop::kDrain};
};

}  // namespace safepoint::agent
