// TierChain: the agent's workers that fill a job's lower storage tiers (include/safepoint/tiers.h).
//
// Tier 0 is the job's own storage, written by the PersistQueue. Tier i >= 1 has a worker thread
// of its own that copies committed steps from tier i-1 with CopyStep (every chunk verified on the
// way, the tier's own commit protocol, the COMMIT record last and exclusive), prunes the tier to
// its `keep` newest steps and then offers the step to tier i+1. A worker copies only the newest
// step offered to it (a slow tier skips steps instead of queueing them), only when the tier's
// schedule says it is due (TierDue), and pins the step on the tier above while it copies so that
// that tier's retention cannot delete it underneath. A failed copy is retried with backoff (up
// to kMaxAttempts, and again whenever a newer step is offered); a failing or stalled tier (every
// storage request is bounded in time by its backend) never holds up the tiers above it: each
// tier has its own thread and the agent's loop only posts offers.
//
// Only the agent of the node that runs rank 0 fills lower tiers (it reads every rank's image
// from tier 0, which is shared by the job's nodes), so a multi-node job copies each step once.
//
// Threads: Start, Committed, Busy, States and Stop are called from the agent's main thread;
// each worker (a WorkerLoop that drops its candidate on stop) touches only its own Worker (under
// its mutex), the shared StepPins and the stores.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "base/worker_loop.h"
#include "safepoint/checkpoint.h"
#include "safepoint/tiers.h"

namespace safepoint::agent {

// Steps that a lower tier is copying from the tier above; that tier's retention keeps them.
class StepPins {
 public:
  void Pin(size_t tier, uint64_t step);
  void Unpin(size_t tier, uint64_t step);
  bool Pinned(size_t tier, uint64_t step) const;

 private:
  mutable std::mutex mu_;
  std::multiset<std::pair<size_t, uint64_t>> pins_;
};

// Deletes the committed steps of `store` beyond its newest `keep` (at least 1), except those
// pinned on `tier` and those a tag of `store` or of `also_tagged_in` (a tier's: the job's own
// storage) names, then removes what failed writes left. Returns the steps deleted.
std::vector<uint64_t> PruneSteps(CheckpointStore& store, uint32_t keep, const StepPins* pins,
                                 size_t tier, CheckpointStore* also_tagged_in = nullptr);

// What status() shows of one tier.
struct TierState {
  size_t index = 0;  // 1-based: tier 1 is the first below the job's storage
  TierSpec spec;
  bool open = false;  // its storage is reachable (opened), and its catch-up was offered
  std::optional<uint64_t> newest;     // newest committed step on it (as far as known)
  int64_t last_copy_unix_ns = 0;      // when its last copy committed (0: none by this agent)
  std::optional<uint64_t> pending;    // the step waiting to be copied
  std::optional<uint64_t> in_flight;  // the step being copied
  uint64_t copies = 0, failures = 0, skipped = 0;  // skipped: offered but not due
  uint64_t last_copy_bytes = 0;
  double last_copy_seconds = 0;
  double last_lag_seconds = 0;  // from the step's commit on tier 0 to its commit here
  std::string last_error;       // of the last failed attempt (empty after a success)
};

class TierChain {
 public:
  static constexpr int kMaxAttempts = 5;  // per step, before the tier waits for a newer one

  // `retry_base_seconds`: the first retry's delay; each next one doubles it (at most 60 s).
  explicit TierChain(std::function<void()> notify, double retry_base_seconds = 1.0);
  ~TierChain();  // Stop(0)
  TierChain(const TierChain&) = delete;
  TierChain& operator=(const TierChain&) = delete;

  // Starts one worker per tier below `primary` (tier 0). Called once; no-op for no tiers.
  void Start(std::string job, std::shared_ptr<CheckpointStore> primary, std::vector<TierSpec> tiers,
             std::shared_ptr<StepPins> pins);
  bool started() const { return !workers_.empty(); }

  // `step` committed on tier 0 (at `commit_unix_ns`).
  void Committed(uint64_t step);

  // A copy is queued, in flight, or waiting for a retry that may still succeed.
  bool Busy() const;
  std::vector<TierState> States() const;

  // Lets the workers finish what they have for up to `grace_seconds`, then cancels the copies
  // in flight (their partial data stays uncommitted; the tier's CleanUp removes it later) and
  // joins. Idempotent.
  void Stop(double grace_seconds);

 private:
  struct Worker;
  void Offer(size_t index, uint64_t step);
  bool Open(Worker& w);  // the worker's `prepare`: false when stopped first
  internal::WorkerLoop<uint64_t>::Next Take(Worker& w);  // under w.mu
  void Run(Worker& w, uint64_t step);
  bool CopyOne(Worker& w, uint64_t step);

  const std::function<void()> notify_;
  const double retry_base_seconds_;
  std::string job_;
  std::shared_ptr<CheckpointStore> primary_;
  std::shared_ptr<StepPins> pins_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<bool> cancel_{false};
};

}  // namespace safepoint::agent
