// CommitRelay: a job on several nodes commits without asking storage (docs/architecture.md,
// "Committing at scale"). Over the peer service (src/replica/peer_service.h, notes), each node's
// agent hands the facts of its images of a step (CommitLedger::Fact: what the COMMIT record says
// of each) to one agent, the committer (the first node of the job's membership); the committer's
// ledger completes with every rank's facts, it writes the COMMIT record (the only storage request
// of the commit) and tells the other agents, which answer their ranks' waits from that note.
// Without the relay each node wrote its facts report, listed the step and polled its COMMIT
// while its ranks waited: requests that grew with the number of nodes.
//
// Storage stays the authority and the fallback: a node that cannot hand its facts over (no
// membership, the committer unreachable or refusing) writes its facts report and lists the step
// as before. A node whose hand-over no commit answered within kGraceSeconds asks the committer
// again (an "ask" note, with its facts: a restarted committer lost them): committed (this node
// learns it), or taken (the committer waits for other nodes' facts: this node waits another
// grace), or the committer cannot be reached: this node then falls back to storage (its facts
// report and the listing commit; its waits poll storage from then on). The committer falls back the
// same way when no node's facts reached it for kCommitterGraceSeconds while the step is incomplete
// (another node may have fallen back: its facts are in its report), and sooner when a node whose
// facts of the step are missing is gone or fell back: after kGraceSeconds without progress it
// probes those nodes (a "probe" note), and one that cannot be reached (its agent died, its node
// was lost) or answers that it commits the step through storage (its hand-over failed, or it
// backs off from the committer) makes it list the step at once; one that answers that the step
// is committed (it committed it through storage and could not tell the committer) ends it as a
// commit note would. So while the committer lives and
// every node reaches it, no agent asks storage anything to commit, however slow the nodes. The
// relay carries only what storage would have said: a commit note is sent after the COMMIT
// record is durable, and facts only of published images.
//
// Threads: HandOver runs on the persist worker (it blocks for one note, bounded by the peer
// service's timeout; after a failure the committer is not asked for kBackoffSeconds); OnNote on
// the peer service's progress thread (it queues and wakes the agent's loop); Announce (called from
// the agent's loop, which also calls Stop) sends on a worker of its own, started by its first
// call, and the committer's probes on another (a probe of a node that does not answer takes the
// peer timeout: commit notes do not wait behind it); the rest is called from the agent's loop.
// Every method is thread-safe.
#pragma once

#include <condition_variable>
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

#include "base/worker_loop.h"
#include "safepoint/checkpoint.h"
#include "safepoint/status.h"

namespace safepoint::agent {

class Replicator;

class CommitRelay {
 public:
  using Fact = CheckpointStore::ImageFact;
  // A hand-over that no commit note answered this long is asked about again (see above).
  static constexpr double kGraceSeconds = 5;
  // The committer falls back to storage after this long without another node's facts while a
  // step it handed over (its own images published) is incomplete: only a node that could not
  // reach it leaves it so (that node's facts are in its report), a rare case that may wait.
  static constexpr double kCommitterGraceSeconds = 30;
  // After a note to a node failed, notes to it go to storage (hand-overs) or are not sent
  // (commit notes: that node asks) this long.
  static constexpr double kBackoffSeconds = 30;

  CommitRelay(Replicator* replicator, std::function<void()> notify);
  ~CommitRelay();  // Stop()
  CommitRelay(const CommitRelay&) = delete;
  CommitRelay& operator=(const CommitRelay&) = delete;

  // Whether the job's membership spans several nodes (the relay is used), and whether this node
  // is the committer.
  bool Active() const;
  bool Committer() const;

  // Persist worker, after this node's last image of (step, attempt) of a world of `world_size`:
  // `facts` (by rank) are what this node published. The committer keeps them in its own ledger
  // already: it only notes the hand-over. Another node sends them to the committer. True when the
  // committer has them (this node then neither lists the step nor writes its facts report).
  bool HandOver(uint64_t step, uint64_t attempt, uint32_t world_size,
                const std::map<uint32_t, Fact>& facts);
  // Whether the relay answers `step` at `now` (MonotonicSeconds), so that its waits do not ask
  // storage: this node handed it over, no commit of it is known here, and the relay has not
  // fallen back to storage for it: within kGraceSeconds of the hand-over or of the committer's
  // last "waiting for other nodes", and while an ask is on its way (on the committer, within
  // kCommitterGraceSeconds of the last facts that arrived). A step handed over
  // kPatienceSeconds ago is left to storage whatever the committer says: by then the committer
  // itself fell back (kCommitterGraceSeconds), and only storage tells a wait that another node
  // abandoned the step (its abandoned record).
  bool Answers(uint64_t step, double now) const;
  // Whether this node handed `step` over (and no commit of it is known here yet).
  bool HandedOver(uint64_t step) const;
  static constexpr double kPatienceSeconds = kCommitterGraceSeconds + kGraceSeconds;
  // The committer: facts of `step` arrived from another node (its grace starts again).
  void Progress(uint64_t step);
  // The committer: `node` handed over facts of `step` (it is not probed for that step).
  void Heard(uint64_t step, const std::string& node);
  // Steps whose hand-over no commit answered for kGraceSeconds before `now`, each once:
  // (step, attempt), for the agent to fall back to storage. Another node's are first asked of
  // the committer (on the relay's worker): they come back here only when it does not hold this
  // node's facts or cannot be reached. The committer's come back after kCommitterGraceSeconds,
  // or once a probe (every kGraceSeconds without progress, on the relay's worker) found a node
  // gone whose facts of the step it lacks.
  std::vector<std::pair<uint64_t, uint64_t>> TakeOverdue(double now);
  // The step is committed (this agent committed it, or learned it): its hand-over and those of
  // older steps are done. On the committer, the older steps whose hand-over no commit answered
  // are returned, (step, attempt), for the agent to try once by listing each: a newer step can
  // commit first where a node fell back to storage (its facts never reached the committer's
  // ledger, and its listing commit found the newer step whole), and then nothing else would
  // commit the older one, though every image of it may be published.
  std::vector<std::pair<uint64_t, uint64_t>> Committed(uint64_t step);

  // What other nodes' agents sent: OnNote (the peer service's handler) queues them, the agent's
  // loop takes them.
  struct FactsNote {
    std::string from;  // the sending node
    uint64_t step = 0, attempt = 0;
    uint32_t world_size = 0;
    std::map<uint32_t, Fact> facts;
  };
  struct CommitNote {
    std::string from;
    uint64_t step = 0, attempt = 0;
    std::vector<uint64_t> pruned;  // steps the committer's retention removed with it
  };
  Status OnNote(const std::string& from, const std::string& kind, const std::string& body);
  void Take(std::vector<FactsNote>* facts, std::vector<CommitNote>* commits);

  // The committer: tells every other node of the membership that `step` committed, and which
  // steps its retention removed (sent on the relay's worker; a node that misses it polls).
  void Announce(uint64_t step, uint64_t attempt, std::vector<uint64_t> pruned);

  struct Counters {
    uint64_t handed_over = 0;  // steps whose facts the committer took (or, there, kept)
    uint64_t hand_over_failed = 0;
    uint64_t asked = 0;    // hand-overs no commit note answered in time: the committer asked
    uint64_t overdue = 0;  // hand-overs this node then committed through storage
    uint64_t facts_received = 0, commits_received = 0;
    uint64_t announced = 0, announce_failed = 0;  // commit notes sent, per node
    uint64_t listed_older = 0;       // the committer: older steps a newer commit left, listed once
    uint64_t probed = 0;             // the committer: nodes probed for a step's missing facts
    uint64_t probed_gone = 0;        // of those, unreachable (the step was listed at once)
    uint64_t probed_to_storage = 0;  // of those, committing it through storage (listed too)
  };
  Counters counters() const;

  // Waits until the notes queued so far are sent (true), or `seconds` passed (false): at a clean
  // exit, before the peer service stops, so that the commits of the job's last steps reach the
  // other nodes (else their waits took the grace and fell back to storage).
  bool Flush(double seconds);
  void Stop();

  // Wire format of the notes (JSON), exposed for tests.
  static std::string EncodeFacts(uint64_t step, uint64_t attempt, uint32_t world_size,
                                 const std::map<uint32_t, Fact>& facts);
  static Result<FactsNote> DecodeFacts(const std::string& body);
  static std::string EncodeCommit(uint64_t step, uint64_t attempt,
                                  const std::vector<uint64_t>& pruned);
  static Result<CommitNote> DecodeCommit(const std::string& body);

 private:
  struct Announcement {
    // A commit note to every node, an "ask" note to the committer, or the committer's probe of
    // the nodes whose facts of the step are missing.
    enum class Kind { kCommit, kAsk, kProbe } kind = Kind::kCommit;
    uint64_t step = 0, attempt = 0;
    std::vector<uint64_t> pruned;
  };
  using Loop = internal::WorkerLoop<Announcement>;
  void Queue(Announcement a);
  void QueueProbe(Announcement a);  // on probe_worker_
  void Send(const Announcement& a);
  void Ask(const Announcement& a);
  void Probe(const Announcement& a);
  void ToStorageLocked(uint64_t step);  // this node commits `step` through storage

  Replicator* const replicator_;
  const std::function<void()> notify_;
  mutable std::mutex mu_;
  struct Handed {
    uint64_t attempt = 0;
    double since = 0;        // the hand-over
    double at = 0;           // the hand-over, or the last sign of progress
    bool overdue = false;    // past its grace: asked about (another node) or fell back
    bool fell_back = false;  // this node commits it through storage
    uint32_t world_size = 0;
    std::map<uint32_t, Fact> facts;  // what was handed over (asked again with them)
    double probed = 0;  // the committer: its last probe of the nodes it lacks facts from
  };
  std::map<uint64_t, Handed> handed_;  // step -> its hand-over, until committed (bounded)
  std::set<uint64_t> committed_;       // steps known committed here, newest kept (bounded)
  std::map<uint64_t, std::set<std::string>> heard_;  // the committer: step -> nodes with facts
  std::set<uint64_t> to_storage_;  // steps this node commits through storage (what probes learn)
  std::vector<std::pair<uint64_t, uint64_t>> fall_back_;  // asked: the committer cannot help
  double backoff_until_ = 0;                              // hand-overs to the committer
  std::map<std::string, double> quiet_until_;  // node -> no commit notes to it until then
  std::vector<FactsNote> facts_in_;
  std::vector<CommitNote> commits_in_;
  std::deque<Announcement> announcements_;
  std::optional<Announcement> in_flight_;  // the one the worker sends (Flush waits for it)
  std::condition_variable sent_;           // the worker sent one
  Counters counters_;
  Loop worker_{mu_, Loop::OnStop::kDrop};  // commit and ask notes, in order
  std::deque<Announcement> probes_;        // the committer's probes (one per step at a time)
  std::optional<Announcement> probe_in_flight_;
  Loop probe_worker_{mu_, Loop::OnStop::kDrop};
};

}  // namespace safepoint::agent
