// NodeAgent's answers to waits (src/agent/node_agent.h): whether a step a rank waits for is
// committed (by this agent, or by another node's agent: storage asked less and less often while
// the wait lasts), pruned by retention, or can never commit (this agent's own ranks, or another
// node's abandoned record), and the commits the lower tiers learn of (docs/architecture.md,
// "Committing at scale").
#include <algorithm>
#include <set>

#include "agent/node_agent.h"
#include "base/log.h"
#include "base/process.h"

namespace safepoint::agent {

using protocol::MessageType;

bool NodeAgent::PendingHere(uint64_t step) const {
  return std::any_of(ranks_.begin(), ranks_.end(),
                     [step](const auto& kv) { return kv.second.pending.contains(step); });
}

bool NodeAgent::StepCommitted(uint64_t step) {
  if (committed_cache_.contains(step)) return true;
  if (!store_) return false;
  // Made durable before it is believed (ConfirmCommit): a visible COMMIT may not be yet.
  if (store_->ConfirmCommit(step).ok()) {
    MarkCommitted(step);
    return true;
  }
  return false;
}

// With several nodes, the agent that writes a step's last image commits it and runs retention:
// when the storage already holds `keep` newer committed steps (an earlier run's), the step is
// removed right after its commit, and the other nodes' agents never see its COMMIT. Their waits
// for it are answered once this agent persisted its share and `keep` newer steps are committed:
// retention would remove the step the moment it commits, so no restore can ever load it.
bool NodeAgent::SupersededOnStorage(uint64_t step) {
  if (!store_ || !config_) return false;
  // One listing every few seconds, not one per poll: the newer steps that decide this are an
  // earlier run's, on storage before this wait began (while the job's ranks wait for `step`,
  // the job commits no newer one), so a listing a few seconds old answers as a new one would.
  const double now = MonotonicSeconds();
  if (!polled_steps_ || now - polled_steps_at_ > kListingSeconds) {
    auto all = store_->ListCommitted();
    if (!all.ok()) return false;
    polled_steps_at_ = now;
    polled_steps_.emplace();
    for (const auto& c : *all) polled_steps_->push_back(c.step);
  }
  const size_t newer = std::count_if(polled_steps_->begin(), polled_steps_->end(),
                                     [step](uint64_t s) { return s > step; });
  if (newer < std::max<uint32_t>(config_->keep, 1)) return false;
  if (std::find(pruned_.begin(), pruned_.end(), step) == pruned_.end()) {
    pruned_.push_back(step);
    while (pruned_.size() > 256) pruned_.pop_front();
    spdlog::warn(
        "step {} is not committed and the storage holds {} newer committed steps (keep {}): "
        "retention removes it when it commits (left by an earlier run?); its waits are answered",
        step, newer, config_->keep);
  }
  return true;
}

// A rank that will persist nothing more: closed, or no process of it alive (its pid from its
// hello, else, for a rank only adopted, the slots' writers).
bool NodeAgent::RankGone(const RankState& rs) const {
  if (rs.closed) return true;
  if (rs.connected) return false;
  if (rs.pid != 0) return !internal::ProcessAlive({rs.pid, 0});
  if (!rs.arena) return false;
  for (const SlotInfo& s : rs.arena->Slots()) {
    if (s.writer_pid != 0 && internal::ProcessAlive({s.writer_pid, s.writer_start_ticks})) {
      return false;
    }
  }
  return true;
}

// A wait for a step that `rank` persisted, which is not committed: is the step final without a
// commit? Storage may hold another rank's image of the step of another save attempt (a crashed
// run's leftover, or the rank re-saved the step after a restart), or none, and the step commits
// only from images of one attempt. While another node's agent may still write an image, or a rank
// of this node may still persist the step, nothing is final: decided only where this agent serves
// every rank of the job and, for every rank, nothing of the step is queued and either its image
// of this attempt was written here, or its process will persist nothing more of the step (it
// closed, is gone, asked for a later step since its hello, or its persist of the step failed:
// the agent retries no persist). Then a last TryCommit (what the worker would have done) commits
// the step if the images belong together after all (OK), and otherwise the wait gets an error
// naming the step and why, instead of waiting until its timeout.
std::optional<Status> NodeAgent::StepNeverCommits(uint64_t step, uint32_t rank) {
  if (!config_ || !store_) return std::nullopt;
  const auto own = ranks_[rank].persisted_attempt.find(step);
  if (own == ranks_[rank].persisted_attempt.end()) return std::nullopt;
  const uint64_t attempt = own->second;
  std::vector<std::string> why;
  for (uint32_t r = 0; r < config_->world_size; ++r) {
    const auto found = ranks_.find(r);
    if (found == ranks_.end()) return std::nullopt;  // served elsewhere, or not connected yet
    const RankState& rs = found->second;
    if (rs.pending.contains(step)) return std::nullopt;
    const auto written = rs.persisted_attempt.find(step);
    const auto outcome = rs.outcomes.find(step);
    if (written != rs.persisted_attempt.end() && written->second == attempt &&
        outcome != rs.outcomes.end() && outcome->second.ok()) {
      continue;  // its image of this attempt is on storage
    }
    const std::string who = "rank " + std::to_string(r);
    if (rs.newest_asked && *rs.newest_asked > step) {
      why.push_back(who + " went on to step " + std::to_string(*rs.newest_asked) +
                    " without persisting this one");
    } else if (RankGone(rs)) {
      why.push_back(who + (rs.closed ? " closed" : " is gone") + " without persisting it");
    } else if (outcome != rs.outcomes.end() && !outcome->second.ok() &&
               (written == rs.persisted_attempt.end() || written->second != attempt)) {
      // Its persist of the step failed (a storage brownout) and no persist is retried: its own
      // wait got the error, and no image of this attempt comes unless it saves the step again.
      why.push_back(who + "'s persist of it failed");
    } else {
      return std::nullopt;  // that rank may still persist the step
    }
    if (written != rs.persisted_attempt.end() && written->second != attempt) {
      why.back() +=
          " (its image of the step is of save attempt " + std::to_string(written->second) + ")";
    } else if (outcome != rs.outcomes.end() && !outcome->second.ok()) {
      why.back() += " (" + outcome->second.message() + ")";
    }
  }
  auto committed = store_->TryCommitOfAttempt(step, config_->world_size, opt_.job, attempt);
  if (committed.ok() && *committed) {
    MarkCommitted(step);
    return Status::OK();
  }
  if (!committed.ok()) {
    spdlog::warn("step {}: checking its images failed: {}", step, committed.status().ToString());
    return std::nullopt;  // looked at again at the next poll
  }
  if (why.empty()) return std::nullopt;  // every image was written here: the storage decides
  std::string reasons;
  for (const std::string& w : why) reasons += (reasons.empty() ? "" : "; ") + w;
  Status s = Cancelled(
      "step " + std::to_string(step) + " can never be committed: not every rank has an image " +
      "of it of save attempt " + std::to_string(attempt) + " on " + config_->storage +
      ", and no rank will write one (" + reasons +
      "); an image of another attempt (a crashed run's, or the step saved again after a " +
      "restart) is never committed with it. The newest committed step is " + NewestCommittedText());
  spdlog::error("{}", s.message());
  return s;
}

std::string NodeAgent::NewestCommittedText() const {
  return newest_committed_ ? std::to_string(*newest_committed_) : std::string("none");
}

std::optional<Status> NodeAgent::StepAbandonedElsewhere(uint64_t step, uint32_t rank) {
  if (!store_ || !config_) return std::nullopt;
  const auto own = ranks_[rank].persisted_attempt.find(step);
  if (own == ranks_[rank].persisted_attempt.end()) return std::nullopt;
  const uint64_t attempt = own->second;
  CommitPoll& p = commit_polls_[step];
  auto polled = p.abandoned.find(attempt);
  if (polled == p.abandoned.end()) {  // one read a poll of the step, for all its waits here
    std::optional<CheckpointStore::AbandonedImage> record;
    if (auto read = store_->ReadAbandoned(step, attempt); read.ok() && *read) {
      // The record only ends waits early: an image of that rank and attempt published after
      // all (the same step saved again, a replica's holder that wrote it) outweighs it.
      auto held = store_->HoldsImageOfAttempt(step, (*read)->rank, attempt);
      if (held.ok() && !*held) record = std::move(**read);
    }
    polled = p.abandoned.emplace(attempt, std::move(record)).first;
  }
  if (!polled->second) return std::nullopt;
  Status s = Cancelled(
      "step " + std::to_string(step) + " can never be committed: another node's agent reported " +
      "that a rank of save attempt " + std::to_string(attempt) + " will never have an image of " +
      "it on " + config_->storage + " (rank " + std::to_string(polled->second->rank) + ": " +
      polled->second->why +
      "); the step commits only from images of one attempt. The newest committed step is " +
      NewestCommittedText());
  spdlog::error("{}", s.message());
  return s;
}

bool NodeAgent::CommitPollDue(uint64_t step, double now) {
  // Handed over to the committer (CommitRelay): its commit note answers; storage is asked only
  // once the relay gave up on it (no answer within its grace, and the committer cannot help).
  if (relay_.Answers(step, now)) return false;
  auto [at, fresh] = commit_polls_.try_emplace(step);
  CommitPoll& p = at->second;
  // A step this node has not handed over yet, where the relay runs: a rank's wait can come
  // before another rank's save of the step reached this agent (their sockets are read in turn),
  // and the hand-over after that rank's image answers it. Storage is asked from the relay's
  // grace on (at W = 512 on 64 nodes a third of the agents polled once a run, before).
  if (fresh) {
    p.next = relay_.Active() && !relay_.HandedOver(step) ? now + CommitRelay::kGraceSeconds : now;
  }
  if (p.pass == now) return true;  // another wait of the step, in this pass
  if (now < p.next) return false;
  p.pass = now;
  p.next = now + p.interval;
  p.interval = std::min(p.interval * 2, kMaxCommitPollSeconds);
  p.answer = StepCommitted(step) || SupersededOnStorage(step);
  p.abandoned.clear();
  return true;
}

void NodeAgent::AnswerWaits() {
  const double now = MonotonicSeconds();
  // Where other nodes persist ranks of the job, a wait that no commit answers reads, at each of
  // the step's commit polls, whether one of them gave its rank's image up (docs/architecture.md,
  // "Committing at scale").
  const bool elsewhere = config_ && config_->world_size > 0 && !HostsEveryRank();
  for (auto& c : clients_) {
    if (c->waits.empty()) continue;
    std::vector<std::pair<uint64_t, bool>> still;
    RankState& rs = ranks_[c->rank];
    for (const auto& [step, persisted] : c->waits) {
      // ckpt.wait() also waits for the rank's snapshots to reach their peers.
      if (replicator_.Busy(c->rank)) {
        still.emplace_back(step, persisted);
        continue;
      }
      if (!persisted) {  // only replication was asked for
        Reply(*c, MessageType::kWaitReply, Encode(protocol::WaitReply{step, Status::OK()}));
        continue;
      }
      auto it = rs.outcomes.find(step);
      if (it != rs.outcomes.end() && !it->second.ok()) {
        Reply(*c, MessageType::kWaitReply, Encode(protocol::WaitReply{step, it->second}));
        continue;
      }
      // A step committed and then pruned by retention was saved all the same.
      const bool pruned = std::find(pruned_.begin(), pruned_.end(), step) != pruned_.end();
      // No step commits before every image of it is published: while this agent still persists
      // one, storage is not asked. Then it is asked once for all the step's waits here, less
      // and less often while they last (CommitPollDue): another node's agent commits it.
      const bool poll = it != rs.outcomes.end() && !PendingHere(step) && CommitPollDue(step, now);
      if (committed_cache_.contains(step) || pruned || (poll && commit_polls_[step].answer)) {
        Reply(*c, MessageType::kWaitReply, Encode(protocol::WaitReply{step, Status::OK()}));
        continue;
      }
      if (poll) {
        std::optional<Status> never = StepNeverCommits(step, c->rank);
        if (!never && elsewhere) never = StepAbandonedElsewhere(step, c->rank);
        if (never) {
          Reply(*c, MessageType::kWaitReply, Encode(protocol::WaitReply{step, *never}));
          continue;
        }
      }
      if (it == rs.outcomes.end() && !rs.pending.contains(step)) {
        const Status s =
            StepCommitted(step)
                ? Status::OK()
                : NotFound("step " + std::to_string(step) + " of rank " + std::to_string(c->rank) +
                           " is not being persisted by this agent (was it restarted?)");
        Reply(*c, MessageType::kWaitReply, Encode(protocol::WaitReply{step, s}));
        continue;
      }
      still.emplace_back(step, persisted);
    }
    c->waits.swap(still);
  }
  // Forget the schedules of steps no longer waited for.
  std::set<uint64_t> waited;
  for (const auto& c : clients_) {
    for (const auto& w : c->waits) waited.insert(w.first);
  }
  std::erase_if(commit_polls_, [&](const auto& kv) { return !waited.contains(kv.first); });
  // Clean closes whose flush is done.
  for (auto& [rank, rs] : ranks_) {
    if (rs.close_client < 0 || !rs.pending.empty()) continue;
    if (rank == 0 && !history_.Settled()) continue;  // its history's close, where advise reads
    for (auto& c : clients_) {
      if (c->fd.get() != rs.close_client || !c->closing) continue;
      Status removed = rs.arena ? rs.arena->Remove() : Status::OK();
      rs.arena.reset();
      rs.closed = true;
      Reply(*c, MessageType::kCloseReply, Encode(protocol::CloseReply{removed}));
      spdlog::info("rank {} closed cleanly; its snapshots were removed", rank);
    }
    rs.close_client = -1;
  }
}

// A step this node persisted may have been committed by another node's agent (the last image to
// arrive commits); the lower tiers learn of it here, about once a second.
void NodeAgent::PollCommitsForTiers() {
  if (!tiers_.started()) return;
  const double now = MonotonicSeconds();
  if (now - last_tier_poll_ < 1.0) return;
  last_tier_poll_ = now;
  std::optional<uint64_t> newest_persisted;
  for (auto& [rank, rs] : ranks_) {
    if (rs.last_persisted_step) {
      newest_persisted = std::max(newest_persisted.value_or(0), *rs.last_persisted_step);
    }
  }
  if (newest_persisted && !committed_cache_.contains(*newest_persisted)) {
    // A step handed over to the committer is learned from its commit note, within the grace.
    if (relay_.Answers(*newest_persisted, now)) return;
    StepCommitted(*newest_persisted);
  }
}

}  // namespace safepoint::agent
