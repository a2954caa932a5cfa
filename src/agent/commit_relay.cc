// CommitRelay (src/agent/commit_relay.h).
#include "agent/commit_relay.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "agent/replicator.h"
#include "base/log.h"

namespace safepoint::agent {

using json = nlohmann::json;

double MonotonicSeconds();  // node_agent.cc

namespace {

constexpr size_t kMaxHanded = 256;
constexpr size_t kMaxQueued = 4096;  // notes waiting for the agent's loop

template <typename T>
bool Get(const json& j, const char* key, T* out) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned()) return false;
  *out = it->get<T>();
  return true;
}

}  // namespace

CommitRelay::CommitRelay(Replicator* replicator, std::function<void()> notify)
    : replicator_(replicator), notify_(std::move(notify)) {}

CommitRelay::~CommitRelay() { Stop(); }

void CommitRelay::Stop() {
  worker_.RequestStop();
  probe_worker_.RequestStop();
  worker_.Join();
  probe_worker_.Join();
}

bool CommitRelay::Flush(double seconds) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!worker_.started()) return true;
  return sent_.wait_for(lock, std::chrono::duration<double>(seconds),
                        [this] { return announcements_.empty() && !in_flight_; });
}

bool CommitRelay::Active() const { return replicator_->NodeCountAndIndex().first > 1; }

bool CommitRelay::Committer() const {
  const auto [nodes, index] = replicator_->NodeCountAndIndex();
  return nodes > 1 && index == 0;
}

bool CommitRelay::HandOver(uint64_t step, uint64_t attempt, uint32_t world_size,
                           const std::map<uint32_t, Fact>& facts) {
  const Replicator::MembershipView m = replicator_->Nodes();
  if (m.nodes.size() < 2 || facts.empty()) return false;
  const double now = MonotonicSeconds();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (m.node_index != 0 && now < backoff_until_) {
      ToStorageLocked(step);
      return false;
    }
  }
  if (m.node_index != 0) {
    const std::vector<Status> sent =
        replicator_->Note({m.nodes[0]}, "facts", EncodeFacts(step, attempt, world_size, facts));
    if (!sent.front().ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      ++counters_.hand_over_failed;
      ToStorageLocked(step);
      backoff_until_ = MonotonicSeconds() + kBackoffSeconds;
      spdlog::warn(
          "step {}: the committer (node '{}') did not take this node's facts ({}); this node "
          "commits through storage for {:g} s",
          step, m.nodes[0].node, sent.front().ToString(), kBackoffSeconds);
      return false;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.handed_over;
  handed_[step] = Handed{attempt, now, now, false, false, world_size, facts};
  while (handed_.size() > kMaxHanded) handed_.erase(handed_.begin());
  return true;
}

bool CommitRelay::HandedOver(uint64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  return handed_.contains(step);
}

bool CommitRelay::Answers(uint64_t step, double now) const {
  const double grace = Committer() ? kCommitterGraceSeconds : kGraceSeconds;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handed_.find(step);
  if (it == handed_.end()) return false;
  const Handed& h = it->second;
  // Overdue and not fallen back: asked about, the answer not in yet (the waits polled storage
  // here, once per ask, before: a step slower than the grace cost every node a COMMIT read).
  return !h.fell_back && (h.overdue || now - h.at < grace) && now - h.since < kPatienceSeconds;
}

void CommitRelay::Progress(uint64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handed_.find(step);
  if (it != handed_.end() && !it->second.overdue) it->second.at = MonotonicSeconds();
}

void CommitRelay::ToStorageLocked(uint64_t step) {
  to_storage_.insert(step);
  while (to_storage_.size() > kMaxHanded) to_storage_.erase(to_storage_.begin());
}

void CommitRelay::Heard(uint64_t step, const std::string& node) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!committed_.empty() && step <= *committed_.rbegin() && !handed_.contains(step)) return;
  heard_[step].insert(node);
  while (heard_.size() > kMaxHanded) heard_.erase(heard_.begin());
}

std::vector<std::pair<uint64_t, uint64_t>> CommitRelay::TakeOverdue(double now) {
  const bool committer = Committer();
  std::vector<std::pair<uint64_t, uint64_t>> out, ask, probe;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t fell_back = fall_back_.size();  // counted where they fell back
    out.swap(fall_back_);
    const double grace = committer ? kCommitterGraceSeconds : kGraceSeconds;
    for (auto& [step, h] : handed_) {
      if (h.overdue) continue;
      if (now - h.at < grace) {
        // The committer probes the nodes it lacks facts from, every kGraceSeconds without
        // progress: a lost node would otherwise hold the step for kCommitterGraceSeconds.
        if (committer && now - h.at >= kGraceSeconds && now - h.probed >= kGraceSeconds) {
          h.probed = now;
          probe.emplace_back(step, h.attempt);
        }
        continue;
      }
      h.overdue = true;
      h.fell_back = committer;
      (committer ? out : ask).emplace_back(step, h.attempt);
    }
    counters_.overdue += out.size() - fell_back;
    counters_.asked += ask.size();
  }
  for (const auto& [step, attempt] : ask) Queue({Announcement::Kind::kAsk, step, attempt, {}});
  for (const auto& [step, attempt] : probe) {
    Queue({Announcement::Kind::kProbe, step, attempt, {}});
  }
  return out;
}

std::vector<std::pair<uint64_t, uint64_t>> CommitRelay::Committed(uint64_t step) {
  const bool committer = Committer();
  std::vector<std::pair<uint64_t, uint64_t>> older;
  std::lock_guard<std::mutex> lock(mu_);
  // Older hand-overs too: a step older than a committed one is not asked about again (its
  // waits, if any, poll storage), or a step that can never commit would be asked about forever.
  // The committer lists each once (those it fell back for are listed already).
  const auto end = handed_.upper_bound(step);
  for (auto it = handed_.begin(); committer && it != end; ++it) {
    if (it->first != step && !it->second.fell_back)
      older.emplace_back(it->first, it->second.attempt);
  }
  handed_.erase(handed_.begin(), end);
  heard_.erase(heard_.begin(), heard_.upper_bound(step));
  to_storage_.erase(to_storage_.begin(), to_storage_.upper_bound(step));
  committed_.insert(step);
  while (committed_.size() > kMaxHanded) committed_.erase(committed_.begin());
  counters_.listed_older += older.size();
  return older;
}

void CommitRelay::Ask(const Announcement& a) {
  const Replicator::MembershipView m = replicator_->Nodes();
  if (m.nodes.size() < 2) return;
  std::string facts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handed_.find(a.step);
    if (it == handed_.end()) return;  // committed meanwhile
    facts = EncodeFacts(a.step, it->second.attempt, it->second.world_size, it->second.facts);
  }
  const Status s = replicator_->Note({m.nodes[0]}, "ask", facts).front();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handed_.find(a.step);
    if (it == handed_.end()) return;  // committed meanwhile
    if (s.ok()) {  // it has this node's facts and waits for other nodes': another grace
      it->second.at = MonotonicSeconds();
      it->second.overdue = false;
      return;
    }
    if (s.code() == StatusCode::kAlreadyExists) {
      ++counters_.commits_received;
      commits_in_.push_back(CommitNote{m.nodes[0].node, a.step, a.attempt, {}});
    } else {
      ++counters_.overdue;
      it->second.fell_back = true;
      ToStorageLocked(a.step);
      fall_back_.emplace_back(a.step, a.attempt);
      spdlog::warn(
          "step {}: the committer (node '{}') cannot commit it ({}); falling back to "
          "storage",
          a.step, m.nodes[0].node, s.ToString());
    }
  }
  notify_();
}

void CommitRelay::Probe(const Announcement& a) {
  const Replicator::MembershipView m = replicator_->Nodes();
  std::vector<replica::Peer> missing;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handed_.find(a.step);
    if (it == handed_.end() || it->second.overdue) return;  // committed or listed meanwhile
    auto heard = heard_.find(a.step);
    for (size_t i = 0; i < m.nodes.size(); ++i) {
      if (i == m.node_index || (heard != heard_.end() && heard->second.contains(m.nodes[i].node)))
        continue;
      missing.push_back(m.nodes[i]);
    }
  }
  if (missing.empty()) return;  // every node's facts came (another attempt's ledger lacks some)
  // A node that cannot be reached within the peer timeout is gone. One that answers that it
  // commits the step through storage (its hand-over failed, or it backs off from this committer)
  // put its facts in its report. One that answers that the step is committed committed it by
  // listing it and could not tell this node. Any other answer, a refusal included (an agent too
  // old for probes), is a node that lives and has yet to hand its facts over.
  const std::vector<Status> sent =
      replicator_->Note(missing, "probe", json{{"step", a.step}}.dump());
  std::vector<std::string> gone, to_storage;
  std::optional<std::string> committed_by;
  for (size_t i = 0; i < sent.size(); ++i) {
    if (sent[i].code() == StatusCode::kUnavailable) gone.push_back(missing[i].node);
    if (sent[i].code() == StatusCode::kCancelled) to_storage.push_back(missing[i].node);
    if (sent[i].code() == StatusCode::kAlreadyExists) committed_by = missing[i].node;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    counters_.probed += sent.size();
    counters_.probed_gone += gone.size();
    counters_.probed_to_storage += to_storage.size();
    auto it = handed_.find(a.step);
    if (it == handed_.end() || it->second.overdue) return;  // committed or listed meanwhile
    if (committed_by) {                                     // learnt as from a commit note
      ++counters_.commits_received;
      commits_in_.push_back(CommitNote{*committed_by, a.step, it->second.attempt, {}});
    } else if (!gone.empty() || !to_storage.empty()) {  // the agent lists the step now
      it->second.overdue = true;
      it->second.fell_back = true;
      ++counters_.overdue;
      fall_back_.emplace_back(a.step, it->second.attempt);
    } else {
      return;  // every node it lacks facts from is only slow
    }
  }
  if (!committed_by) {
    const std::vector<std::string>& named = gone.empty() ? to_storage : gone;
    spdlog::warn(
        "step {}: node '{}'{} {}; committing through storage now", a.step, named.front(),
        named.size() > 1 ? fmt::format(" (and {} other nodes)", named.size() - 1) : std::string(),
        gone.empty() ? "commits it through storage (its facts are in its report)"
                     : "cannot be reached and its facts of the step did not arrive");
  }
  notify_();
}

Status CommitRelay::OnNote(const std::string& from, const std::string& kind,
                           const std::string& body) {
  if (kind == "probe") {
    // The committer lacks this node's facts of a step: whether this node lives, whether it
    // commits the step through storage (then its facts are in its report), and whether the step
    // is committed here (by this node's listing, if its commit note did not reach the committer).
    const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
    uint64_t step = 0;
    if (!j.is_object() || !Get(j, "step", &step)) return Status::OK();
    std::lock_guard<std::mutex> lock(mu_);
    if (committed_.contains(step)) return AlreadyExists("committed");
    if (to_storage_.contains(step)) return Cancelled("committing it through storage");
    return Status::OK();
  }
  if (kind == "facts") {
    SP_ASSIGN_OR_RETURN(FactsNote note, DecodeFacts(body));
    note.from = from;
    std::lock_guard<std::mutex> lock(mu_);
    if (facts_in_.size() >= kMaxQueued) return ResourceExhausted("too many notes queued");
    ++counters_.facts_received;
    facts_in_.push_back(std::move(note));
  } else if (kind == "commit") {
    SP_ASSIGN_OR_RETURN(CommitNote note, DecodeCommit(body));
    note.from = from;
    std::lock_guard<std::mutex> lock(mu_);
    if (commits_in_.size() >= kMaxQueued) return ResourceExhausted("too many notes queued");
    ++counters_.commits_received;
    commits_in_.push_back(std::move(note));
  } else if (kind == "ask") {
    // A node whose hand-over no commit answered hands its facts over again (the committer may
    // have restarted since and lost them): AlreadyExists when the step is committed (the asker
    // learns it), else taken as a facts note (OK: the asker waits another grace).
    SP_ASSIGN_OR_RETURN(FactsNote note, DecodeFacts(body));
    note.from = from;
    std::lock_guard<std::mutex> lock(mu_);
    if (committed_.contains(note.step)) return AlreadyExists("committed");
    if (facts_in_.size() >= kMaxQueued) return ResourceExhausted("too many notes queued");
    ++counters_.facts_received;
    facts_in_.push_back(std::move(note));
  } else {
    return InvalidArgument("unknown note '" + kind + "'");
  }
  notify_();
  return Status::OK();
}

void CommitRelay::Take(std::vector<FactsNote>* facts, std::vector<CommitNote>* commits) {
  std::lock_guard<std::mutex> lock(mu_);
  facts->swap(facts_in_);
  commits->swap(commits_in_);
  facts_in_.clear();
  commits_in_.clear();
}

void CommitRelay::Announce(uint64_t step, uint64_t attempt, std::vector<uint64_t> pruned) {
  Queue({Announcement::Kind::kCommit, step, attempt, std::move(pruned)});
}

void CommitRelay::Queue(Announcement a) {
  if (a.kind == Announcement::Kind::kProbe) {
    QueueProbe(std::move(a));
    return;
  }
  // Started on first use, from the agent's loop: a thread made before the agent blocked its
  // signals (for its signalfd) would take a SIGTERM and end the process without its flush.
  if (!worker_.started()) {
    worker_.Start({.take = [this] { return Loop::TakeFront(announcements_, &in_flight_); },
                   .run =
                       [this](Announcement& t) {
                         switch (t.kind) {
                           case Announcement::Kind::kCommit:
                             Send(t);
                             break;
                           case Announcement::Kind::kAsk:
                             Ask(t);
                             break;
                           case Announcement::Kind::kProbe:
                             break;  // on probe_worker_
                         }
                         {
                           std::lock_guard<std::mutex> lock(mu_);
                           in_flight_.reset();
                         }
                         sent_.notify_all();
                       }});
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    announcements_.push_back(std::move(a));
  }
  worker_.Wake();
}

void CommitRelay::QueueProbe(Announcement a) {
  // A worker of its own: a probe of a node that does not answer (cut off, its agent stopped)
  // takes the peer timeout, and the commit notes to every other node would wait behind it.
  if (!probe_worker_.started()) {
    probe_worker_.Start({.take = [this] { return Loop::TakeFront(probes_, &probe_in_flight_); },
                         .run =
                             [this](Announcement& t) {
                               Probe(t);
                               std::lock_guard<std::mutex> lock(mu_);
                               probe_in_flight_.reset();
                             }});
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    // One probe of a step at a time: a slow answer must not pile more of them up.
    const auto same = [&](const Announcement& q) { return q.step == a.step; };
    if ((probe_in_flight_ && same(*probe_in_flight_)) ||
        std::any_of(probes_.begin(), probes_.end(), same)) {
      return;
    }
    probes_.push_back(std::move(a));
  }
  probe_worker_.Wake();
}

void CommitRelay::Send(const Announcement& a) {
  const Replicator::MembershipView m = replicator_->Nodes();
  std::vector<replica::Peer> others;
  {
    // A node that could not be told lately is left out (its agent asks, or polls storage): a
    // cut node would hold every announcement for the peer service's timeout.
    std::lock_guard<std::mutex> lock(mu_);
    const double now = MonotonicSeconds();
    for (size_t i = 0; i < m.nodes.size(); ++i) {
      auto quiet = quiet_until_.find(m.nodes[i].node);
      if (i == m.node_index || (quiet != quiet_until_.end() && now < quiet->second)) continue;
      others.push_back(m.nodes[i]);
    }
  }
  if (others.empty()) return;
  const std::vector<Status> sent =
      replicator_->Note(others, "commit", EncodeCommit(a.step, a.attempt, a.pruned));
  size_t failed = 0;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < sent.size(); ++i) {
    if (sent[i].ok()) continue;
    ++failed;
    quiet_until_[others[i].node] = MonotonicSeconds() + kBackoffSeconds;
    spdlog::warn(
        "step {}: node '{}' was not told of its commit ({}); no commit notes to it for {:g} s",
        a.step, others[i].node, sent[i].ToString(), kBackoffSeconds);
  }
  counters_.announced += sent.size() - failed;
  counters_.announce_failed += failed;
}

CommitRelay::Counters CommitRelay::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

std::string CommitRelay::EncodeFacts(uint64_t step, uint64_t attempt, uint32_t world_size,
                                     const std::map<uint32_t, Fact>& facts) {
  json rows = json::array();
  for (const auto& [rank, f] : facts) {
    rows.push_back({rank, f.size, f.header_crc, f.packed ? 1 : 0, f.elsewhere ? 1 : 0});
  }
  return json{{"step", step}, {"attempt", attempt}, {"world", world_size}, {"facts", rows}}.dump();
}

Result<CommitRelay::FactsNote> CommitRelay::DecodeFacts(const std::string& body) {
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  FactsNote n;
  auto rows = j.is_object() ? j.find("facts") : j.end();
  uint64_t world = 0;
  if (!j.is_object() || !Get(j, "step", &n.step) || !Get(j, "attempt", &n.attempt) ||
      !Get(j, "world", &world) || world == 0 || world > UINT32_MAX || rows == j.end() ||
      !rows->is_array()) {
    return Corruption("malformed facts note");
  }
  n.world_size = static_cast<uint32_t>(world);
  for (const json& r : *rows) {
    if (!r.is_array() || r.size() != 5) return Corruption("malformed facts note");
    for (const json& v : r) {
      if (!v.is_number_unsigned()) return Corruption("malformed facts note");
    }
    const uint64_t rank = r[0].get<uint64_t>(), crc = r[2].get<uint64_t>();
    if (rank >= n.world_size || crc > UINT32_MAX || r[3].get<uint64_t>() > 1 ||
        r[4].get<uint64_t>() > 1) {
      return Corruption("facts note: a row out of range");
    }
    n.facts[static_cast<uint32_t>(rank)] =
        Fact{r[1].get<uint64_t>(), static_cast<uint32_t>(crc), r[3].get<uint64_t>() == 1,
             r[4].get<uint64_t>() == 1};
  }
  return n;
}

std::string CommitRelay::EncodeCommit(uint64_t step, uint64_t attempt,
                                      const std::vector<uint64_t>& pruned) {
  return json{{"step", step}, {"attempt", attempt}, {"pruned", pruned}}.dump();
}

Result<CommitRelay::CommitNote> CommitRelay::DecodeCommit(const std::string& body) {
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  CommitNote n;
  auto pruned = j.is_object() ? j.find("pruned") : j.end();
  if (!j.is_object() || !Get(j, "step", &n.step) || !Get(j, "attempt", &n.attempt) ||
      pruned == j.end() || !pruned->is_array() || pruned->size() > 4096) {
    return Corruption("malformed commit note");
  }
  for (const json& p : *pruned) {
    if (!p.is_number_unsigned()) return Corruption("malformed commit note");
    n.pruned.push_back(p.get<uint64_t>());
  }
  return n;
}

}  // namespace safepoint::agent
