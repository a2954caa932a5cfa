// CommitLedger: what the writers of a job's images reported having published, by step and save
// attempt, so that the committer writes a step's COMMIT record once every rank's image is there
// without listing the step or reading any image's header (CheckpointStore::CommitFromFacts;
// docs/architecture.md, "Committing at scale").
//
// Facts come from this agent's persist worker; when the job spans nodes, each agent writes the
// facts it holds of a step as its node's facts report (CheckpointStore::WriteFactsReport) and the
// listing commit reads the reports. Thread-safe. Bounded: at most kMaxPending (step, attempt)
// entries are kept, the oldest step dropped first (its commit then falls back to the listing
// commit, TryCommitOfAttempt, reading the headers of the images no report covers).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "safepoint/checkpoint.h"

namespace safepoint::agent {

class CommitLedger {
 public:
  using Fact = CheckpointStore::ImageFact;
  static constexpr size_t kMaxPending = 64;

  struct Ready {
    uint64_t step = 0;
    uint64_t attempt = 0;
    std::vector<Fact> facts;  // one per rank, in rank order
  };
  // Records that rank's image of (step, attempt) of a world of `world_size` is published, as
  // `fact`. Returns the step's facts when this report completed them (every rank of that world,
  // one attempt), once; nullopt otherwise. A second report of one rank keeps the first (an image
  // of one attempt is published once).
  std::optional<Ready> Add(uint64_t step, uint64_t attempt, uint32_t world_size, uint32_t rank,
                           const Fact& fact);
  // The facts reported so far of (step, attempt), by rank (empty once it completed).
  std::map<uint32_t, Fact> Known(uint64_t step, uint64_t attempt) const;
  // How many ranks' facts of (step, attempt) are reported so far (0 once it completed).
  uint32_t Count(uint64_t step, uint64_t attempt) const;
  // Drops every entry of steps <= `step` (committed, or older than a committed step). A later
  // report of such a step starts a new entry (a run resumed from an older step saves it again).
  void Forget(uint64_t step);
  void Clear();  // a changed world size
  size_t pending() const;

 private:
  struct Entry {
    uint32_t world_size = 0;
    uint32_t have = 0;
    std::vector<std::optional<Fact>> facts;
  };
  mutable std::mutex mu_;
  std::map<std::pair<uint64_t, uint64_t>, Entry> entries_;  // (step, attempt)
};

}  // namespace safepoint::agent
