// RankClaim: which process owns a rank's snapshot slots on this node, and which processes of the
// job's older runs were superseded there (docs/reliability.md, "Superseded processes").
//
// A training process hung in a collective on a partitioned node outlives its run: the job
// restarts, and a newer incarnation of the rank comes to the same node while the stale one still
// runs, still maps the rank's slots and may save into them when it wakes. The claim settles who
// may write: one small file per rank, "<job_dir>/claim-<R>" (0600, created under a temporary name
// and renamed into place, never through a symlink), written only by the job's agent (one per job,
// flock) and read lock-free by every process that maps the rank's slots. It records
//   - the owner: the process the agent last accepted for the rank (pid and start time), its save
//     attempt, and an epoch that grows whenever the owner becomes another process;
//   - the superseded processes (the last kFencedSlots): a process of another save attempt that
//     still ran when a younger process of a newer attempt took the rank.
// A writer (Arena) holds the epoch its hello was answered with; it begins and completes a write
// only while the claim's epoch is still that one (SupersededError otherwise), and the agent, after
// it moved the epoch on, removes every slot the superseded process was writing: a snapshot
// completed after the takeover is never visible (src/shm/arena.h has the orderings).
//
// Thread safety: one writer process (the agent), any number of readers; readers of the owner and
// of the superseded list read under a sequence counter, epoch() is one atomic load.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/process.h"
#include "safepoint/status.h"

namespace safepoint {

// The rank's owner as the claim records it.
struct ClaimOwner {
  internal::ProcessId process;  // pid 0: nobody yet
  uint64_t attempt = 0;         // its save attempt (ImageMeta::attempt; 0: none given)
  uint64_t epoch = 0;           // grows whenever the owner becomes another process
  int64_t since_ns = 0;         // wall clock, when it became the owner
};

// A process that a newer incarnation of the job superseded on this rank.
struct SupersededProcess {
  internal::ProcessId process;
  uint64_t attempt = 0;
  internal::ProcessId by;  // the process that took the rank over
  uint64_t by_attempt = 0;
  int64_t time_ns = 0;  // wall clock, when
};

class RankClaim {
 public:
  static constexpr uint32_t kFencedSlots = 16;

  ~RankClaim();
  // The rank's claim; NotFound when no agent has written one yet.
  static Result<std::unique_ptr<RankClaim>> Open(const std::string& job_dir, uint32_t rank);
  // The agent's: Open, creating an empty claim (epoch 0, no owner) when there is none.
  static Result<std::unique_ptr<RankClaim>> OpenOrCreate(const std::string& job_dir, uint32_t rank);

  uint32_t rank() const { return rank_; }
  uint64_t ino() const { return ino_; }
  // The epoch now (one sequentially consistent load: src/shm/arena.cc orders it against the
  // slots' state words).
  uint64_t epoch() const;
  ClaimOwner Owner() const;
  std::vector<SupersededProcess> Superseded() const;
  // The record of `p` (pid and start time) among the superseded processes, if it is one.
  std::optional<SupersededProcess> FindSuperseded(const internal::ProcessId& p) const;

  // --- the agent's (the job's one agent: no other writer) -------------------------------------
  // `owner` (of `attempt`) owns the rank now. The epoch grows when it is another process than the
  // recorded owner (a process that says hello again, or opens a second client, keeps it).
  // Returns the epoch.
  uint64_t SetOwner(const internal::ProcessId& owner, uint64_t attempt);
  // Records that `s` was superseded (the oldest record makes room when every slot is taken).
  void AddSuperseded(const SupersededProcess& s);

 private:
  RankClaim() = default;
  std::string path_;
  uint32_t rank_ = 0;
  void* map_ = nullptr;
  uint64_t ino_ = 0;
};

// "<job_dir>/claim-<rank, 5 digits>".
std::string ClaimPath(const std::string& job_dir, uint32_t rank);
// Removes the rank's claim unless it records a superseded process that still runs (which must
// stay refused); OK when there is none.
Status RemoveClaimUnlessNeeded(const std::string& job_dir, uint32_t rank);
// The message of the SupersededError that process `self` gets: whom the rank belongs to now, since
// when, and what to do.
std::string SupersededMessage(const std::string& job_dir, uint32_t rank,
                              const internal::ProcessId& self, const ClaimOwner& owner);

}  // namespace safepoint
