// Adoption: a new agent takes over what an earlier agent of the job left (src/agent/node_agent.h).
//
// An agent that died, or exited while idle, leaves the slots in shared memory as they were.
// The next agent of the job (started by the client's next call, or as a sidecar) reads job.json
// to learn where the job persists, maps every rank's arena it finds, clears stale leases (their
// holder is gone: only one agent runs per job), and, if emergency flushes are on, persists the
// COMPLETE snapshots newer than the newest committed step. A job directory without job.json is
// a new job: the first hello configures it. A job.json that cannot be read or names a storage
// that cannot be opened is logged and the job waits for a hello to configure it.
#include "agent/node_agent.h"
#include "base/log.h"

namespace safepoint::agent {

void NodeAgent::Adopt() {
  auto config = ReadJobConfig(job_dir_);
  if (!config.ok()) {
    spdlog::error("cannot adopt the job's snapshots: {}", config.status().ToString());
    return;
  }
  if (!config->has_value()) return;  // a new job
  auto store = OpenCheckpointStore((*config)->storage);
  if (!store.ok()) {
    spdlog::error("cannot adopt the job's snapshots: {}", store.status().ToString());
    return;
  }
  if (Status s = Configure(**config, std::move(store).value()); !s.ok()) {
    spdlog::error("cannot adopt the job's snapshots: {}", s.ToString());
    return;
  }
  config_written_ = true;
  auto ranks = ListArenaRanks(job_dir_);
  if (!ranks.ok()) {
    spdlog::error("cannot list the job's snapshots: {}", ranks.status().ToString());
    return;
  }
  for (uint32_t rank : *ranks) {
    if (Status s = EnsureRank(rank); !s.ok()) {
      spdlog::error("cannot adopt the snapshots of rank {}: {}", rank, s.ToString());
      continue;
    }
    RankState& r = ranks_[rank];
    r.adopted = true;
    r.arena->ClearLeases();
    spdlog::info("adopted the snapshots of rank {}", rank);
    if (!opt_.emergency_flush) continue;
    // Of two snapshots of one step, only the current one: persisting the other last would
    // leave an image of another attempt that the step can never commit with (crash campaign,
    // seed 866710947).
    const std::vector<SlotInfo> slots = r.arena->Slots();
    for (const SlotInfo& s : slots) {
      if (s.state != SlotState::kComplete || (newest_committed_ && s.step <= *newest_committed_) ||
          HasLaterCopy(slots, s)) {
        continue;
      }
      Enqueue({rank, s.index, s.generation, s.step, /*leased=*/false, FlushReason::kAdopted, {}});
      telemetry_.FlushQueued(rank, s.step, FlushReason::kAdopted);
    }
  }
}

}  // namespace safepoint::agent
