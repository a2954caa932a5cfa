// NodeAgent's side of the commit relay (src/agent/commit_relay.h; docs/architecture.md,
// "Committing at scale"): on the committer, the facts other nodes' agents handed over go to the
// ledger, and the one that completes a step's facts queues its commit; everywhere, a commit the
// committer announced answers the waits as a commit of this agent would, and a hand-over that no
// commit answered in time falls back to storage (this node's facts report and the listing commit;
// its waits then poll storage).
#include <algorithm>

#include "agent/node_agent.h"
#include "base/log.h"

namespace safepoint::agent {

void NodeAgent::DrainRelay() {
  std::vector<CommitRelay::FactsNote> facts;
  std::vector<CommitRelay::CommitNote> commits;
  relay_.Take(&facts, &commits);
  for (CommitRelay::FactsNote& n : facts) {
    if (!config_ || n.world_size != config_->world_size || !relay_.Committer()) {
      spdlog::warn(
          "step {}: node '{}' handed over the facts of its images for a world of {} ranks, "
          "which this agent does not commit (world {}, {}); that node falls back to storage",
          n.step, n.from, n.world_size, config_ ? config_->world_size : 0,
          relay_.Committer() ? "committer" : "not the committer");
      continue;
    }
    if (committed_cache_.contains(n.step)) {  // committed already (a late or repeated note)
      relay_.Announce(n.step, n.attempt, {});
      continue;
    }
    // Progress is a rank's facts the ledger did not have: a node asking again with the same
    // facts while another node's are missing (in its report, after it fell back) must not keep
    // the committer from falling back to storage itself.
    relay_.Heard(n.step, n.from);
    const uint32_t had = ledger_->Count(n.step, n.attempt);
    bool completed = false;
    for (const auto& [rank, fact] : n.facts) {
      auto ready = ledger_->Add(n.step, n.attempt, n.world_size, rank, fact);
      if (!ready) continue;
      completed = true;
      PersistTask t;
      t.step = n.step;
      t.attempt = n.attempt;
      t.commit_only = PersistTask::CommitOnly::kFromFacts;
      t.facts =
          std::make_shared<const std::vector<CheckpointStore::ImageFact>>(std::move(ready->facts));
      queue_.Enqueue(std::move(t));
    }
    if (!completed && ledger_->Count(n.step, n.attempt) > had) relay_.Progress(n.step);
  }
  for (const CommitRelay::CommitNote& n : commits) LearnCommitted(n.step, n.pruned);
  for (const auto& [step, attempt] : relay_.TakeOverdue(MonotonicSeconds())) {
    if (committed_cache_.contains(step)) {
      EndHandOvers(step);
      continue;
    }
    spdlog::warn(
        "step {}: {}; committing through storage (this node's facts report and a listing of "
        "the step)",
        step,
        relay_.Committer()
            ? fmt::format("the nodes' facts of it did not complete it (none came for {:g} s, or "
                          "a node that lacks them is gone)",
                          CommitRelay::kCommitterGraceSeconds)
            : std::string("the committer cannot be reached"));
    PersistTask t;
    t.step = step;
    t.attempt = attempt;
    t.commit_only = PersistTask::CommitOnly::kListing;
    queue_.Enqueue(std::move(t));
  }
}

void NodeAgent::RelayCommitDone(const PersistResult& r) {
  const uint64_t step = r.task.step;
  if (!r.status.ok()) {
    // The waits poll storage; a listing commit of this node is tried again at its next image.
    spdlog::error("step {}: the commit ({}) failed: {}", step,
                  r.task.commit_only == PersistTask::CommitOnly::kFromFacts
                      ? "from every node's facts"
                      : "listing the step",
                  r.status.ToString());
    return;
  }
  if (!r.committed) return;
  spdlog::info("step {}: committed ({})", step,
               r.task.commit_only == PersistTask::CommitOnly::kFromFacts ? "from every node's facts"
                                                                         : "listing the step");
  LearnCommitted(step, r.pruned);
  if (relay_.Active()) relay_.Announce(step, r.attempt, r.pruned);
}

void NodeAgent::MarkCommitted(uint64_t step) {
  committed_cache_.insert(step);
  newest_committed_ = std::max(newest_committed_.value_or(0), step);
  tiers_.Committed(step);
  commits_to_tell_.push_back(step);
}

void NodeAgent::LearnCommitted(uint64_t step, const std::vector<uint64_t>& pruned) {
  MarkCommitted(step);
  ledger_->Forget(step);
  EndHandOvers(step);
  for (uint64_t p : pruned) {
    committed_cache_.erase(p);
    if (std::find(pruned_.begin(), pruned_.end(), p) == pruned_.end()) pruned_.push_back(p);
  }
  while (pruned_.size() > 256) pruned_.pop_front();
}

void NodeAgent::EndHandOvers(uint64_t step) {
  for (const auto& [older, attempt] : relay_.Committed(step)) {
    // Committed, or its commit queued here (this committer's ledger completed it after the newer
    // step's commit was under way): no listing.
    if (committed_cache_.contains(older) || queue_.CommitQueued(older)) continue;
    spdlog::warn(
        "step {} committed before step {}, which this node handed over and no commit answered "
        "(a node fell back to storage); listing step {} once",
        step, older, older);
    PersistTask t;
    t.step = older;
    t.attempt = attempt;
    t.commit_only = PersistTask::CommitOnly::kListing;
    queue_.Enqueue(std::move(t));
  }
}

nlohmann::json NodeAgent::RelayStatusJson() const {
  if (!relay_.Active()) return nullptr;
  const CommitRelay::Counters c = relay_.counters();
  return {{"committer", relay_.Committer()},
          {"handed_over", c.handed_over},
          {"hand_over_failed", c.hand_over_failed},
          {"asked", c.asked},
          {"overdue", c.overdue},
          {"facts_received", c.facts_received},
          {"commits_received", c.commits_received},
          {"announced", c.announced},
          {"announce_failed", c.announce_failed},
          {"listed_older", c.listed_older},
          {"probed", c.probed},
          {"probed_gone", c.probed_gone},
          {"probed_to_storage", c.probed_to_storage}};
}

}  // namespace safepoint::agent
