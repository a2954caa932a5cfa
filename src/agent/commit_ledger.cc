// CommitLedger (src/agent/commit_ledger.h).
#include "agent/commit_ledger.h"

#include "base/log.h"

namespace safepoint::agent {

std::optional<CommitLedger::Ready> CommitLedger::Add(uint64_t step, uint64_t attempt,
                                                     uint32_t world_size, uint32_t rank,
                                                     const Fact& fact) {
  std::lock_guard<std::mutex> lock(mu_);
  if (world_size == 0 || rank >= world_size) return std::nullopt;
  auto [it, fresh] = entries_.try_emplace({step, attempt});
  Entry& e = it->second;
  if (fresh) {
    e.world_size = world_size;
    e.facts.resize(world_size);
  } else if (e.world_size != world_size) {
    spdlog::warn("commit ledger: step {} reported for {} ranks and for {}; keeping the first", step,
                 e.world_size, world_size);
    return std::nullopt;
  }
  if (e.facts[rank]) {
    if (!(*e.facts[rank] == fact)) {
      spdlog::warn("commit ledger: rank {}'s image of step {} reported twice, differently", rank,
                   step);
    }
    return std::nullopt;
  }
  e.facts[rank] = fact;
  if (++e.have < e.world_size) {
    while (entries_.size() > kMaxPending) entries_.erase(entries_.begin());
    return std::nullopt;
  }
  Ready ready{step, attempt, {}};
  ready.facts.reserve(e.world_size);
  for (auto& f : e.facts) ready.facts.push_back(*f);
  entries_.erase(it);
  return ready;
}

std::map<uint32_t, CommitLedger::Fact> CommitLedger::Known(uint64_t step, uint64_t attempt) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<uint32_t, Fact> out;
  auto it = entries_.find({step, attempt});
  if (it == entries_.end()) return out;
  for (uint32_t r = 0; r < it->second.facts.size(); ++r) {
    if (it->second.facts[r]) out.emplace(r, *it->second.facts[r]);
  }
  return out;
}

uint32_t CommitLedger::Count(uint64_t step, uint64_t attempt) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find({step, attempt});
  return it == entries_.end() ? 0 : it->second.have;
}

void CommitLedger::Forget(uint64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(entries_.begin(), entries_.upper_bound({step, UINT64_MAX}));
}

void CommitLedger::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.clear();
}

size_t CommitLedger::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

}  // namespace safepoint::agent
