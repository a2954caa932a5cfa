// Telemetry: what the agent tells monitoring about its job: the Prometheus metrics (served over
// HTTP by a MetricsServer when the job asks for it) and the JSON-lines event log
// (docs/operations.md, "Metrics" and "Event log").
//
// The agent calls one method per event where the event happens (a save reported by a client, a
// persist done, a flush queued, a restore reported, a replication push done); each updates the
// metrics and appends one line to the event log. NodeAgent::RefreshTelemetry (telemetry.cc) runs
// on every turn of the agent's loop: a newer commit on tier 0 (also one another node made) and
// the change of each lower tier's copy and failure counters become events there; the state
// that is not an event (pending work, shared memory, connected ranks) is sampled into gauges
// about once a second.
//
// Every metric carries the label safepoint_job (one endpoint per agent, and one agent per job and
// node; `job` itself is the label Prometheus gives every target, so it is not used). No metric
// has a step or tensor label: label values are bounded by ranks, tiers, result kinds and
// status codes.
//
// Threads: the agent's loop only; the registry is also read by the HTTP server's threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "agent/event_log.h"
#include "agent/metrics.h"
#include "agent/metrics_server.h"
#include "agent/persist_queue.h"
#include "agent/replicator.h"
#include "agent/tier_copier.h"
#include "safepoint/storage.h"

namespace safepoint::agent {

class Telemetry {
 public:
  explicit Telemetry(const std::string& job);

  // Serves /metrics on `address` (once: a later different address is refused with a warning,
  // the first one stays). The error, if any, is kept for the status document.
  Status StartMetrics(const std::string& address);
  void StopMetrics() { server_.Stop(); }
  std::string metrics_url() const { return server_.url(); }
  const std::string& metrics_error() const { return metrics_error_; }
  // Appends events to `path` from now on (the default one in the job directory, or the user's).
  Status OpenEventLog(const std::string& path);
  const std::string& event_log_path() const { return events_.path(); }
  const std::string& event_log_error() const { return event_log_error_; }

  // --- events ---
  // A client's save (or skipped save, `saved` false), with the time it blocked training.
  void Saved(uint32_t rank, uint64_t step, bool saved, double blocking_seconds, uint64_t bytes);
  // A client restored `step` from `source` (memory, peer, storage).
  void Restored(uint32_t rank, uint64_t step, const std::string& source, double seconds,
                uint64_t bytes);
  // A client found damaged bytes (a snapshot or a stored image failed its checksums).
  void ChecksumFailure(uint32_t rank, uint64_t step, const std::string& where,
                       const std::string& error);
  void Persisted(const PersistResult& r);  // tier 0: one rank's image written (or failed)
  void FlushQueued(uint32_t rank, uint64_t step, FlushReason reason);
  void Replicated(const PushOutcome& o);
  // `step` is committed on tier `tier` (tier 0: seen by this agent, whoever committed it).
  // Counted once per step, an older step committed after a newer one included (the commit
  // relay's committer can finish a step's commit after the next one's); not the steps found
  // committed at start (KnownCommit) or older. The gauges follow the newest step.
  void Committed(size_t tier, uint64_t step, double unix_seconds, uint64_t bytes = 0,
                 double seconds = 0);
  // The newest commit found on a tier when the agent starts (gauges only, no event).
  void KnownCommit(size_t tier, uint64_t step, double unix_seconds);

  // --- sampled state ---
  // The job's storage tiers: 0 is the job's own storage, then the lower tiers.
  void SetTierUris(const std::vector<std::string>& uris);
  // The lower tiers' states: copies and failures since the last call become events.
  void TierStates(const std::vector<TierState>& states);
  void SetPending(size_t persists_pending);
  void SetSharedMemory(uint64_t used, uint64_t free, uint64_t size);
  void SetRanksConnected(size_t n);
  // The agent process's storage requests by scheme (StorageRequestCountsByScheme): what grew
  // since the last call is added to the counters.
  void SetStorageRequests(const std::vector<std::pair<std::string, StorageRequestCounts>>& now);

  MetricsRegistry& registry() { return registry_; }

 private:
  void Failure(const std::string& kind, const Status& s, uint32_t rank, uint64_t step,
               std::optional<size_t> tier);

  const std::string job_;
  MetricsRegistry registry_;
  MetricsServer server_;
  std::string metrics_error_;
  EventLog events_;
  std::string event_log_error_;
  // Per tier: the last commit seen (unix seconds), for the interval between commits.
  struct Told {
    std::optional<uint64_t> floor;  // the newest commit found at start: it and older not counted
    std::set<uint64_t> steps;       // counted, the newest kMaxToldSteps
    // The newest commit told: the floor or the newest counted.
    std::optional<uint64_t> Newest() const {
      if (steps.empty()) return floor;
      return std::max(floor.value_or(0), *steps.rbegin());
    }
  };
  static constexpr size_t kMaxToldSteps = 1024;
  std::map<size_t, Told> told_;  // per tier
  std::map<size_t, double> last_commit_;
  std::map<size_t, double> interval_;  // moving average of the interval between commits
  std::map<size_t, TierState> last_states_;
  std::map<std::string, StorageRequestCounts> storage_told_;  // per scheme: added so far
};

}  // namespace safepoint::agent
