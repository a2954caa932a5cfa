// Replicator: the agent's side of peer replication (docs/replication.md). A sibling of
// PersistQueue: the server feeds it COMPLETE snapshots and client requests, it works on threads of
// its own, and the server drains its results on the poll loop.
//
// - Pushes: each snapshot of a local rank is sent, straight from its slot, to the nodes that
//   placement names (src/protocol/redundancy.h) as whole copies or erasure-coded fragments. The
//   slot is not leased: training never waits for replication. The push checks between chunks and
//   at the end that the slot still holds that snapshot; when the rank's writer has started to
//   overwrite it, the push is *superseded* (receivers drop what they got) and the newest snapshot
//   is pushed next. Queued pushes of a rank are coalesced to its newest snapshot.
// - Requests of restoring ranks: which snapshots of a rank the peers can rebuild (List), and
//   rebuilding one into a slot of the rank's arena (Fetch): the agent writes the slot as the
//   rank's writer would (the rank waits for the reply and writes nothing meanwhile), so that the
//   restore is then an ordinary, verified hot reload.
// - What peers send this node is kept by the PeerService in the ReplicaStore of the job directory.
//
// Threads: Configure, Enqueue*, TakeResults, Status and Stop are called from the agent's main
// thread; one worker thread runs pushes, another runs list and fetch requests (a restore never
// waits behind a long push). `notify` wakes the main loop after each result. Both are WorkerLoops
// that drop what is queued on stop (replicas are a cache).
// Stop retires the peer service (PeerService::Retire): it refuses pushes from then on and keeps
// UCX alive, so a process that stopped a Replicator with a running service ends with _exit
// (RunAgent does).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "base/worker_loop.h"
#include "protocol/protocol.h"
#include "protocol/redundancy.h"
#include "replica/peer_service.h"
#include "replica/replica_store.h"
#include "safepoint/checkpoint.h"
#include "safepoint/status.h"

namespace safepoint::agent {

struct PushTask {
  uint32_t rank = 0;
  uint32_t slot = 0;
  uint64_t generation = 0;
  uint64_t step = 0;
};

struct PushOutcome {
  PushTask task;
  Status status;            // OK: every target holds its part
  bool superseded = false;  // the slot was overwritten first: nothing kept
  std::vector<std::pair<std::string, Status>> targets;  // node -> its part's outcome
  bool is_protected = false;  // the snapshot survives the loss of tolerated_losses() nodes
  uint64_t bytes = 0;
  double seconds = 0;
  double paused_seconds = 0;
};

// A request of a client, answered on the loop with `reply_type` and `payload`.
struct PeerRequest {
  int client_fd = -1;  // -1: the agent's own request (FlushHeld), not answered
  uint32_t client_pid = 0;
  protocol::MessageType type =
      protocol::MessageType::kPeerList;  // kPeerList, kPeerFetch, or kShutdown: FlushHeld
  uint32_t rank = 0;
  uint64_t step = 0, attempt = 0;
  // kPeerFetch of a heal (replicator_heal.cc): the rank's snapshot of `step` straight from the
  // agent of another job that took it, waiting up to timeout_s for it to be taken.
  std::optional<replica::SnapshotOrigin> origin = std::nullopt;
  double timeout_s = 0;
};
struct PeerAnswer {
  int client_fd = -1;
  uint32_t client_pid = 0;
  protocol::MessageType reply_type = protocol::MessageType::kPeerListReply;
  std::string payload;
};

// The origin a heal's kPeerFetch names (PeerFetchRequest::from_*); InvalidArgument when its
// secret is not lowercase hex of at least 16 bytes or a field is empty.
Result<replica::SnapshotOrigin> HealOrigin(const protocol::PeerFetchRequest& request);

class Replicator {
 public:
  Replicator(std::string job, std::function<void()> notify);
  ~Replicator();  // Stop()
  Replicator(const Replicator&) = delete;
  Replicator& operator=(const Replicator&) = delete;

  // Starts the peer service (once) on `bind_host` for `node`; returns its address. A later call
  // with another node or host is refused (an agent serves one node).
  Result<std::string> Setup(const std::string& job_dir, const protocol::PeerSetupRequest& request);
  // Applies a membership note (a new epoch replaces the peers, the secret and the limits).
  Status Configure(const Membership& note);
  // The job's nodes as the last membership named them, and this node's index (no nodes: no
  // membership yet). The commit relay's committer is nodes[0].
  struct MembershipView {
    std::vector<replica::Peer> nodes;
    uint32_t node_index = 0;
  };
  MembershipView Nodes() const;
  // How many nodes the membership names (0: none yet) and this node's index, without copying
  // them (the commit relay asks on every commit).
  std::pair<size_t, uint32_t> NodeCountAndIndex() const;
  // Notes to other nodes' agents (the commit relay); Unavailable for each where the peer
  // service does not run (not set up, or stopped).
  std::vector<Status> Note(const std::vector<replica::Peer>& peers, const std::string& kind,
                           const std::string& body);
  // Where notes from other nodes go (set before Setup).
  void SetNoteHandler(replica::PeerService::NoteHandler handler);
  bool enabled() const;     // configured with a redundancy
  bool configured() const;  // the peer service runs
  void SetPaused(bool paused);

  // Where the job persists: FlushHeld writes there.
  void SetStorage(std::shared_ptr<CheckpointStore> store, uint32_t world_size);
  // The job was torn down on this node: persist the newest snapshot of other nodes' ranks that
  // this node keeps replicas of, when its step is not committed yet (its own node may be lost
  // and unable to flush it), so that the step can commit on storage. Of the live holders of a
  // snapshot one writes it: the first holder of a whole copy by node name, else the first holder
  // of a fragment, which rebuilds it from K fragments. Runs on the request worker.
  void EnqueueFlushHeld();

  void EnqueuePush(PushTask task);
  void EnqueueRequest(PeerRequest request);
  // True while a push of one of `rank`'s snapshots is queued or running.
  bool Busy(uint32_t rank) const;
  // True when this node keeps replicas of other nodes' snapshots.
  bool holds_replicas() const;
  // Spare replica files (kept to receive the next push without fresh pages) give their memory
  // back when the job's shared memory runs low (under a quarter free): training processes
  // allocate their slots there too.
  void ReleaseSparesWhenMemoryIsLow();
  // Removes every replica this node keeps (the job ended cleanly here). Call after Stop().
  void RemoveReplicas();
  std::vector<PushOutcome> TakeOutcomes();
  std::vector<PeerAnswer> TakeAnswers();

  // The "replication" section of the agent's status.
  nlohmann::json StatusJson() const;

  void Stop();

 private:
  using PushLoop = internal::WorkerLoop<PushTask>;
  using RequestLoop = internal::WorkerLoop<PeerRequest>;
  void StartWorkers();  // under mu_
  // On the workers: one task, then its result and `notify`.
  void RunPush(const PushTask& t);
  void RunRequest(const PeerRequest& r);
  PushOutcome Push(const PushTask& t);
  PeerAnswer List(const PeerRequest& r);
  PeerAnswer Fetch(const PeerRequest& r);
  // replicator_heal.cc: a heal's fetch into one of the rank's slots (PeerRequest::origin), and
  // this node's own snapshots as the peer service serves them.
  PeerAnswer HealFetch(const PeerRequest& r);
  Result<replica::ServedSnapshot> ServeSnapshot(uint32_t rank, uint64_t step);
  void FlushHeld();
  Status FlushOne(const replica::ReplicaMeta& newest, const std::vector<replica::Holding>& parts);
  // Peers other than this node, under mu_.
  std::vector<replica::Peer> OtherPeersLocked() const;

  const std::string job_;
  const std::function<void()> notify_;
  std::string job_dir_, node_, bind_host_;
  std::unique_ptr<replica::ReplicaStore> store_;
  std::unique_ptr<replica::PeerService> service_;
  // Held shared by Note while it uses service_, exclusively by Stop before it retires it.
  std::shared_mutex service_use_;
  replica::PeerService::NoteHandler note_handler_;  // set before Setup
  std::shared_ptr<CheckpointStore> storage_;        // set once, before any FlushHeld
  uint32_t world_size_ = 0;
  std::atomic<uint64_t> max_shm_bytes_{0};  // the job's cap (PeerSetupRequest); 0: none

  mutable std::mutex mu_;  // guards everything below
  std::string epoch_;
  uint32_t node_index_ = 0;
  std::vector<replica::Peer> nodes_;
  replica::Redundancy redundancy_;
  bool paused_ = false;
  std::deque<PushTask> pushes_;
  std::optional<PushTask> push_in_flight_;
  std::deque<PeerRequest> requests_;
  std::vector<PushOutcome> outcomes_;
  std::vector<PeerAnswer> answers_;
  std::map<uint32_t, PushOutcome> last_push_;  // rank -> its latest finished push
  uint64_t pushes_ok_ = 0, pushes_failed_ = 0, pushes_superseded_ = 0;
  uint64_t held_flushed_ = 0, held_flush_failed_ = 0;
  PushLoop push_worker_{mu_, PushLoop::OnStop::kDrop};
  RequestLoop request_worker_{mu_, RequestLoop::OnStop::kDrop};
};

}  // namespace safepoint::agent
