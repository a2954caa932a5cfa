// A world change: the job restarted with another world size (src/agent/node_agent.h).
//
// A job's snapshots in shared memory belong to the world size that saved them: rank r of a world
// of N holds its shard of N. When the job is restarted with M != N ranks under the same job name
// and path (a node lost for good, a job scaled up or down after a crash), none of them fits a
// rank of the new world, and the storage, which reads any saving world's images into any other
// (resharding), serves the restore instead. So the agent, given a hello of world size M by a job
// configured for N:
//   1. refuses it while a process of the previous world still runs (the job name is in use:
//      two worlds would persist to one path), naming that rank and its pid;
//   2. otherwise parks the hello (the process waits; a kAck every few seconds tells it the
//      agent is alive) and persists every snapshot of the previous world that is newer than the
//      newest committed step and not persisted yet (what an emergency flush does; also with
//      --no-emergency-flush, since the snapshots are about to go), oldest first, so that the
//      newest step every rank of the previous world holds is committed before the restore lists
//      the steps;
//   3. once nothing is queued or in flight, checks that each such snapshot was persisted; if
//      one failed, the parked hellos are refused with the error and nothing is dropped (the
//      next attempt persists them again);
//   4. removes every rank's slot files of the previous world (the shared memory is given back),
//      then sets the world size in job.json, in that order: an agent that dies in between leaves
//      either the previous configuration with what is left of its snapshots (the next hello
//      changes the world again) or the new one with no snapshot of the previous world;
//   5. answers the parked hellos as any hello of the job's world size. Each new client maps its
//      rank's slot files again after its hello (SnapshotClient::Hello), so it never writes into
//      a file removed in step 4.
// Hellos of a third world size while a change is under way are refused. A change whose parked
// processes all went away is abandoned (nothing was dropped).
//
// On a multi-node job each node's agent does this for its own ranks: the previous world's ranks
// on other nodes are persisted by their own agents (their emergency flush), and the step commits
// when the last image of it is written, on whichever node.
#include <algorithm>
#include <set>

#include "agent/node_agent.h"
#include "base/log.h"
#include "base/process.h"

namespace safepoint::agent {

using protocol::MessageType;

namespace {

// How often a parked hello is told that the agent is still at it (the client waits 30 s for
// each message).
constexpr double kParkedHelloBeatSeconds = 5;

}  // namespace

std::optional<std::pair<uint32_t, uint32_t>> NodeAgent::LivePreviousRank() {
  for (const auto& c : clients_) {
    if (c->hello && internal::ProcessAlive({c->pid, 0})) return std::make_pair(c->rank, c->pid);
  }
  for (auto& [rank, rs] : ranks_) {
    if (rs.closed) continue;
    if (rs.pid != 0 && internal::ProcessAlive({rs.pid, 0}) && rs.connected) {
      return std::make_pair(rank, rs.pid);
    }
    if (!rs.arena || !rs.arena->Refresh().ok()) continue;
    for (const SlotInfo& s : rs.arena->Slots()) {
      if (s.writer_pid != 0 && internal::ProcessAlive({s.writer_pid, s.writer_start_ticks})) {
        return std::make_pair(rank, s.writer_pid);
      }
    }
  }
  return std::nullopt;
}

void NodeAgent::BeginWorldChange(Client& c, const protocol::HelloRequest& hello) {
  c.parked_hello = hello;
  c.last_beat = MonotonicSeconds();
  if (world_change_) return;  // under way: this hello waits with the others
  world_change_ = hello.world_size;
  world_change_since_ = MonotonicSeconds();
  spdlog::info(
      "job {} restarts with world size {} (it ran with {}): persisting the previous world's "
      "snapshots not yet committed, then dropping them from shared memory",
      opt_.job, hello.world_size, config_->world_size);
  // Every rank of the previous world whose slot files are here, also those this agent never
  // served (adopted by an agent whose hellos all were of the new world, or left by a rank that
  // never connected).
  if (auto on_disk = ListArenaRanks(job_dir_); on_disk.ok()) {
    for (uint32_t rank : *on_disk) {
      if (Status s = EnsureRank(rank); !s.ok()) {
        spdlog::error("cannot open the snapshots of rank {}: {}", rank, s.ToString());
      }
    }
  }
  for (auto& [rank, rs] : ranks_) {
    if (!rs.closed) EmergencyFlush(rank, FlushReason::kEmergency);
  }
}

void NodeAgent::AdvanceWorldChange() {
  if (!world_change_) return;
  const double now = MonotonicSeconds();
  bool parked = false;
  for (auto& c : clients_) {
    if (!c->parked_hello) continue;
    parked = true;
    if (now - c->last_beat >= kParkedHelloBeatSeconds) {
      c->last_beat = now;
      Reply(*c, MessageType::kAck, Encode(protocol::AckReply{Status::OK()}));
    }
  }
  if (!parked) {
    spdlog::info("the processes of world size {} went away; the job stays at world size {}",
                 *world_change_, config_->world_size);
    world_change_.reset();
    return;
  }
  // A process of the previous world that is gone but whose connection was not dropped yet: its
  // drop (and flush) comes first.
  for (const auto& c : clients_) {
    if (c->hello) return;
  }
  DrainResults();
  if (queue_.Busy()) return;

  const uint32_t from = config_->world_size;
  const uint32_t to = *world_change_;
  std::vector<std::string> unsaved;
  std::optional<uint64_t> newest_dropped;
  for (auto& [rank, rs] : ranks_) {
    if (!rs.arena || !rs.arena->Refresh().ok()) continue;
    const std::vector<SlotInfo> slots = rs.arena->Slots();
    for (const SlotInfo& s : slots) {
      if (s.state != SlotState::kComplete) continue;
      newest_dropped = std::max(newest_dropped.value_or(0), s.step);
      if (HasLaterCopy(slots, s) || (newest_committed_ && s.step <= *newest_committed_)) continue;
      const auto it = rs.outcomes.find(s.step);
      if (it != rs.outcomes.end() && it->second.ok()) continue;  // written (committed or not)
      unsaved.push_back(
          "rank " + std::to_string(rank) + " step " + std::to_string(s.step) + ": " +
          (it == rs.outcomes.end() ? std::string("not persisted") : it->second.ToString()));
    }
  }
  if (!unsaved.empty()) {
    std::string list;
    for (const std::string& u : unsaved) list += (list.empty() ? "" : "; ") + u;
    const std::string msg =
        "job " + opt_.job + " cannot change its world size from " + std::to_string(from) + " to " +
        std::to_string(to) + ": snapshots of the previous world newer than its newest " +
        "committed step could not be persisted to " + config_->storage + " (" + list +
        "); they stay in shared memory. Make the storage writable and restart (they are " +
        "persisted then), restart with world size " + std::to_string(from) +
        ", or use another job name";
    spdlog::error("{}", msg);
    for (auto& c : clients_) {
      if (!c->parked_hello) continue;
      c->parked_hello.reset();
      RefuseHello(*c, msg);
    }
    world_change_.reset();
    return;
  }

  // Drop the previous world's snapshots: every rank's slot files, those no RankState knows too.
  const auto shm_bytes = JobShmBytes(job_dir_);
  const uint64_t bytes = shm_bytes.ok() ? *shm_bytes : 0;
  std::set<uint32_t> ranks;
  for (const auto& [rank, rs] : ranks_) ranks.insert(rank);
  if (auto on_disk = ListArenaRanks(job_dir_); on_disk.ok()) {
    ranks.insert(on_disk->begin(), on_disk->end());
  }
  for (uint32_t rank : ranks) {
    Status s;
    if (auto it = ranks_.find(rank); it != ranks_.end() && it->second.arena) {
      s = it->second.arena->Remove();
    } else if (auto arena = Arena::Open(job_dir_, rank); arena.ok()) {
      s = (*arena)->Remove();
    } else {
      s = arena.status();
    }
    if (!s.ok()) spdlog::error("cannot remove the snapshots of rank {}: {}", rank, s.ToString());
  }
  ranks_.clear();
  saw_client_ = false;  // no rank of the new world yet: AllClosed must not hold for an empty job
  config_->world_size = to;
  queue_.SetWorldSize(to);
  ledger_->Clear();
  replicator_.SetStorage(store_, to);
  SaveJobConfig();
  world_change_.reset();
  spdlog::info(
      "job {} now runs with world size {} (was {}): the previous world's snapshots were "
      "persisted (newest committed step: {}) and dropped from shared memory ({} bytes, newest "
      "snapshot: step {}) in {:.3f} s; the restore reads the newest committed step from storage, "
      "resharded",
      opt_.job, to, from, NewestCommittedText(), bytes,
      newest_dropped ? std::to_string(*newest_dropped) : "none",
      MonotonicSeconds() - world_change_since_);

  for (auto& c : clients_) {
    if (!c->parked_hello) continue;
    const protocol::HelloRequest hello = *c->parked_hello;
    c->parked_hello.reset();
    if (Status s = HandleHello(*c, hello); !s.ok()) {
      spdlog::warn("pid {}: {}; closing its connection", c->pid, s.message());
      c->broken = true;
    }
  }
}

}  // namespace safepoint::agent
