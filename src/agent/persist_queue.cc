// PersistQueue (src/agent/persist_queue.h).
#include "agent/persist_queue.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "base/kill_point.h"
#include "base/log.h"
#include "base/parallel.h"
#include "shm/arena.h"
#include "storage/cancellable.h"

namespace safepoint::agent {

std::string_view FlushReasonName(FlushReason reason) {
  switch (reason) {
    case FlushReason::kRequested:
      return "requested";
    case FlushReason::kEmergency:
      return "emergency flush";
    case FlushReason::kClose:
      return "close";
    case FlushReason::kAdopted:
      return "adopted";
    case FlushReason::kShutdown:
      return "shutdown";
  }
  return "unknown";
}

PersistQueue::PersistQueue(std::function<void()> notify) : notify_(std::move(notify)) {}

PersistQueue::~PersistQueue() { Stop(); }

void PersistQueue::Start(std::string job_dir, PersistTarget target) {
  job_dir_ = std::move(job_dir);
  target_ = std::move(target);
  // Tasks run in the order queued; on stop, what is queued still runs.
  worker_.Start({.take = [this] { return Loop::TakeFront(queue_, &in_flight_); },
                 .run = [this](PersistTask& t) { Run(t); }});
}

void PersistQueue::Run(const PersistTask& t) {
  PersistResult r = Persist(t);
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.reset();
    results_.push_back(std::move(r));
  }
  notify_();
}

void PersistQueue::Enqueue(PersistTask task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (task.commit_only == PersistTask::CommitOnly::kNo) {
      queue_.push_back(std::move(task));
    } else {
      // A commit-only task goes ahead of the persists, behind the commit-only tasks queued
      // before it: the commit relay's committer would otherwise commit a step that other nodes'
      // facts completed only after its own whole backlog of persists (those of the next steps
      // included, whose commits then came first), and every node's wait for it with it.
      auto at = std::find_if(queue_.begin(), queue_.end(), [](const PersistTask& q) {
        return q.commit_only == PersistTask::CommitOnly::kNo;
      });
      queue_.insert(at, std::move(task));
    }
  }
  worker_.Wake();
}

bool PersistQueue::CommitQueued(uint64_t step) const {
  auto commit_of = [step](const PersistTask& t) {
    return t.step == step && t.commit_only != PersistTask::CommitOnly::kNo;
  };
  std::lock_guard<std::mutex> lock(mu_);
  if (in_flight_ && commit_of(*in_flight_)) return true;
  for (const PersistResult& r : results_) {
    if (commit_of(r.task)) return true;
  }
  return std::any_of(queue_.begin(), queue_.end(), commit_of);
}

void PersistQueue::SetWorldSize(uint32_t world_size) {
  std::lock_guard<std::mutex> lock(mu_);
  target_.world_size = world_size;
}

bool PersistQueue::Contains(uint32_t rank, uint32_t slot, uint64_t generation) const {
  auto same = [&](const PersistTask& t) {
    return t.rank == rank && t.slot == slot && t.generation == generation;
  };
  std::lock_guard<std::mutex> lock(mu_);
  if (in_flight_ && same(*in_flight_)) return true;
  for (const PersistResult& r : results_) {
    if (same(r.task)) return true;
  }
  return std::any_of(queue_.begin(), queue_.end(), same);
}

std::vector<PersistResult> PersistQueue::TakeResults() {
  std::vector<PersistResult> out;
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(results_);
  return out;
}

PersistQueue::Progress PersistQueue::progress() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {queue_.size(), in_flight_};
}

bool PersistQueue::Busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !queue_.empty() || in_flight_.has_value();
}

void PersistQueue::Stop() { worker_.Stop(); }

bool PersistQueue::Stop(double grace_seconds) {
  if (!worker_.started()) return true;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_seconds);
  while (Busy() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const Progress left = progress();
  const bool drained = left.queued == 0 && !left.in_flight;
  if (!drained) {
    // A stalled storage would otherwise hold the agent for its requests' timeout times their
    // attempts per task: its requests end now, and the tasks left fail without being sent.
    cancelled_ = true;
    internal::CancelStorageRequests(target_.store->storage());
  }
  worker_.Stop();
  return drained;
}

// The stored image of a snapshot whose replicas other ranks write: the same tensors, extras and
// identity, with the skipped tensors marked "elsewhere" (no bytes). Every chunk of the snapshot
// is verified first, so the checksums of the new layout cover bytes that were checked
// end to end; the builder's tensors point into shared memory (held under the slot's lease).
Result<std::unique_ptr<ImageBuilder>> PersistQueue::WithoutReplicas(
    std::span<const std::byte> image, const std::string& source, const SkipRanges& skip) {
  SP_ASSIGN_OR_RETURN(
      ImageReader reader,
      ImageReader::Parse(image, source, ImageReader::Verify::kAll, internal::DefaultCpuThreads()));
  std::vector<TensorSource> tensors;
  tensors.reserve(reader.tensors().size());
  for (size_t i = 0; i < reader.tensors().size(); ++i) {
    const TensorEntry& e = reader.tensors()[i];
    tensors.push_back({e.spec, reader.tensor_data(i).data(), e.nbytes});
  }
  for (const auto& [first, last] : skip) {
    if (first >= last || last > tensors.size()) {
      return InvalidArgument(source + ": skip range [" + std::to_string(first) + ", " +
                             std::to_string(last) + ") is outside the snapshot's " +
                             std::to_string(tensors.size()) + " tensors");
    }
    for (uint32_t i = first; i < last; ++i) tensors[i].spec.elsewhere = true;
  }
  auto extras = reader.extras();
  return ImageBuilder::Create(
      reader.meta(), std::move(tensors),
      std::string(reinterpret_cast<const char*>(extras.data()), extras.size()),
      reader.layout().chunk_size);
}

// Retention: keep the newest `keep` committed steps (never fewer than one).
std::vector<uint64_t> PersistQueue::Prune() {
  return PruneSteps(*target_.store, target_.keep, target_.pins.get(), /*tier=*/0);
}

// The step's commit once rank t.rank's image (`fact`, nullopt where unknown) is published: from
// the ledger when its facts are complete; else, where other nodes' agents write ranks of the job
// or the snapshot is not a first persist (an adopted or flushed one, whose fellow images may
// have been published by an agent that died), by listing the step (TryCommitOfAttempt).
bool PersistQueue::QueuedForStep(uint64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::any_of(queue_.begin(), queue_.end(), [step](const PersistTask& q) {
    return q.step == step && q.commit_only == PersistTask::CommitOnly::kNo;
  });
}

bool PersistQueue::FinishedOnNode(const PersistTask& t, uint64_t attempt) {
  if (t.ranks_here == 0) return true;
  std::lock_guard<std::mutex> lock(mu_);
  const std::pair<uint64_t, uint64_t> key{t.step, attempt};
  auto [at, fresh] = finished_.try_emplace(key);
  if (fresh) {
    finished_order_.push_back(key);
    if (finished_order_.size() > kFinishedSteps) {
      finished_.erase(finished_order_.front());
      finished_order_.pop_front();
    }
  }
  at->second.insert(t.rank);
  return at->second.size() >= t.ranks_here;
}

Result<bool> PersistQueue::Commit(const PersistTask& t, uint64_t attempt,
                                  const std::optional<CheckpointStore::ImageFact>& fact) {
  if (fact && target_.ledger) {
    if (auto ready = target_.ledger->Add(t.step, attempt, target_.world_size, t.rank, *fact)) {
      ++ledger_commits_;
      return target_.store->CommitFromFacts(t.step, target_.job, attempt, ready->facts);
    }
    if (t.reason == FlushReason::kRequested && hosts_every_rank_.load()) return false;
  }
  // Ranks of other nodes: the listing commit, tried once this agent's last image of the step is
  // published (an earlier one would only find it missing), after this node's facts report
  // (docs/architecture.md, "Committing at scale"): the committer reads N reports, not W headers.
  // The last image is the one after which the requested persists of the step of t.ranks_here
  // ranks have finished here (FinishedOnNode): the queue alone runs dry between its ranks'
  // snapshots, which made several reports and listings a step (4,096 ranks on 64 nodes: 27 a node
  // a step).
  if (t.reason == FlushReason::kRequested && !FinishedOnNode(t, attempt)) return false;
  if (t.reason == FlushReason::kRequested && QueuedForStep(t.step)) return false;
  std::map<uint32_t, CheckpointStore::ImageFact> known;
  if (target_.ledger) known = target_.ledger->Known(t.step, attempt);
  // The commit relay: the committer gets this node's facts over the peer service and commits
  // from its ledger; storage is asked nothing more here (CommitRelay falls back to it when no
  // commit follows).
  if (t.reason == FlushReason::kRequested && target_.relay &&
      target_.relay->HandOver(t.step, attempt, target_.world_size, known)) {
    return false;
  }
  return ListingCommit(t.step, attempt, known, t.reason == FlushReason::kRequested);
}

Result<bool> PersistQueue::ListingCommit(
    uint64_t step, uint64_t attempt, const std::map<uint32_t, CheckpointStore::ImageFact>& known,
    bool report) {
  if (report && !known.empty()) {
    if (Status s = target_.store->WriteFactsReport(step, attempt, known); !s.ok()) {
      spdlog::warn(
          "step {}: this node's facts report was not written ({}); the commit reads "
          "its images' headers instead",
          step, s.ToString());
    }
  }
  return target_.store->TryCommitOfAttemptWithFacts(step, target_.world_size, target_.job, attempt,
                                                    known);
}

PersistResult PersistQueue::CommitOnly(const PersistTask& t) {
  PersistResult r;
  r.task = t;
  r.attempt = t.attempt;
  Result<bool> committed = false;
  if (t.commit_only == PersistTask::CommitOnly::kFromFacts) {
    ++ledger_commits_;
    committed = target_.store->CommitFromFacts(t.step, target_.job, t.attempt, *t.facts);
  } else {
    std::map<uint32_t, CheckpointStore::ImageFact> known;
    if (target_.ledger) known = target_.ledger->Known(t.step, t.attempt);
    committed = ListingCommit(t.step, t.attempt, known, /*report=*/true);
  }
  Committed(r, committed);
  return r;
}

// Only where other nodes persist ranks of the job (one node's waits decide from the agent's own
// outcomes: NodeAgent::StepNeverCommits) and nothing else could still give the rank an image of
// the attempt: a newer snapshot took the step's place, no slot holds the step or is being
// written (the step could be saved again into it), and no image of it is stored. The record
// only ends other nodes' waits early; their agents also check that no image of it is stored
// before they act on it. A failed report costs only those waits their early end.
void PersistQueue::ReportAbandoned(const PersistTask& t, Arena& arena) {
  if (hosts_every_rank_.load() || t.attempt == 0 || !arena.Refresh().ok()) return;
  bool newer = false;
  for (const SlotInfo& s : arena.Slots()) {
    if (s.state == SlotState::kWriting) return;
    if (s.state != SlotState::kComplete) continue;
    if (s.step == t.step) return;  // saved again: persisted, or persisted when asked
    newer |= s.step > t.step;
  }
  if (!newer) return;
  auto held = target_.store->HoldsImageOfAttempt(t.step, t.rank, t.attempt);
  if (!held.ok() || *held) return;
  const Status s = target_.store->ReportAbandoned(
      t.step, t.attempt, t.rank,
      "its snapshot of step " + std::to_string(t.step) +
          " was overwritten by a newer one before its agent persisted it");
  if (!s.ok()) {
    spdlog::warn(
        "step {}: could not tell the other nodes that rank {} will write no image of it "
        "({}); their waits for it end by their timeout",
        t.step, t.rank, s.ToString());
  }
}

PersistResult PersistQueue::Persist(const PersistTask& t) {
  PersistResult r;
  r.task = t;
  if (cancelled_) {
    r.status = Cancelled("the agent stopped before step " + std::to_string(t.step) + " of rank " +
                         std::to_string(t.rank) +
                         " was persisted (its storage did not finish "
                         "within the shutdown grace); the snapshot stays in shared memory");
    return r;
  }
  if (t.commit_only != PersistTask::CommitOnly::kNo) return CommitOnly(t);
  auto arena = Arena::Open(job_dir_, t.rank);
  if (!arena.ok()) {
    r.status = arena.status();
    return r;
  }
  if (!t.leased && !(*arena)->Lease(t.slot, t.generation)) {
    r.superseded = true;
    ReportAbandoned(t, **arena);
    return r;
  }
  struct Releaser {
    Arena& a;
    const PersistTask& t;
    ~Releaser() { a.Release(t.slot, t.generation); }
  } releaser{**arena, t};
  const auto slots = (*arena)->Slots();
  if (t.slot >= slots.size()) {
    r.status = InvalidArgument("slot " + std::to_string(t.slot) + " does not exist");
    return r;
  }
  const SlotInfo& s = slots[t.slot];
  if (s.state != SlotState::kComplete || s.generation != t.generation || s.step != t.step) {
    r.superseded = true;
    ReportAbandoned(t, **arena);
    return r;
  }
  auto image = (*arena)->SlotData(t.slot).subspan(0, s.image_size);
  const std::string source =
      job_dir_ + " rank " + std::to_string(t.rank) + " slot " + std::to_string(t.slot);
  auto header = ParseImageHeader(image, source);
  if (!header.ok()) {
    r.status = header.status();
    return r;
  }
  if (header->first.step != t.step || header->first.rank != t.rank ||
      header->first.world_size != target_.world_size || header->second.image_size != image.size()) {
    r.status = Corruption(source + ": the snapshot's header does not match its slot");
    return r;
  }
  r.attempt = header->first.attempt;
  SP_KILL_POINT("agent.persist.leased");
  // A committed step is never replaced. Either this very snapshot is committed already (persisted
  // twice: adopted, flushed), or an earlier run committed the step before the ranks resumed from
  // an older one and saved it again: that commit is a complete checkpoint of one attempt, and
  // replacing it would leave the step uncommitted until every rank's new image is there, so a
  // crash in between (or a stale snapshot of the step, adopted after a restart) would lose a step
  // already reported committed. Found by the crash campaign (seed 858721433).
  // A COMMIT that can be read is not yet proof: its writer's directory sync may have failed (or
  // not run yet), and a power loss would take it back. It is made durable before the step is
  // reported committed; when that fails the persist fails and nothing is reported.
  // A requested persist (the snapshot's first) asks nothing before its write: its image is
  // named by its attempt and published only where that name is free, and its commit publishes
  // only where no record exists, so neither can replace what another writer or committer
  // stored; asking first would cost every image two requests more (docs/architecture.md,
  // "Committing at scale").
  const bool first_persist = t.reason == FlushReason::kRequested;
  std::optional<CheckpointStore::ImageFact> fact;
  if (!first_persist) {
    if (auto commit = target_.store->ConfirmCommit(t.step); commit.ok()) {
      r.committed = true;
      return r;
    } else if (commit.status().code() == StatusCode::kIOError) {
      r.status = commit.status();
      return r;
    }
    // This snapshot's image stored already (persisted before an agent died, then adopted): only
    // the commit is left to try.
    auto stored = target_.store->StoredImageOfAttempt(t.step, t.rank, header->first.attempt);
    if (!stored.ok()) {
      r.status = stored.status();
      return r;
    }
    fact = *stored;
  }
  // With replicas left to other ranks the stored image is laid out anew.
  std::unique_ptr<ImageBuilder> relaid;
  if (!fact && !t.skip.empty()) {
    auto b = WithoutReplicas(image, source, t.skip);
    if (!b.ok()) {
      r.status = b.status();
      return r;
    }
    relaid = std::move(*b);
  }
  // The image is named by its attempt and published only where that name is free: another
  // writer of this snapshot (the elected holder of its replica after this node was declared
  // lost, or this agent's predecessor's last request) may have published it since the check
  // above, and a commit may have counted that image; AlreadyExists leaves it, and only the
  // commit is left to try (docs/reliability.md, "Two writers of one rank's image").
  if (!fact) {
    auto stats = relaid
                     ? target_.store->WriteImageOfAttempt(*relaid, target_.pack)
                     : target_.store->WriteImageBytesOfAttempt(image, t.step, t.rank, target_.pack);
    if (stats.ok()) {
      r.bytes = stats->bytes;
      r.seconds = stats->seconds;
      (*arena)->RecordPersist(t.step, r.seconds);
      const ImageLayout& l = relaid ? relaid->layout() : header->second;
      fact = CheckpointStore::ImageFact{l.image_size, l.header_crc, stats->packed, l.has_elsewhere};
    } else if (stats.status().code() != StatusCode::kAlreadyExists) {
      r.status = stats.status();
      return r;
    } else {
      auto stored = target_.store->StoredImageOfAttempt(t.step, t.rank, header->first.attempt);
      if (!stored.ok()) {
        r.status = stored.status();
        return r;
      }
      fact = *stored;  // nullopt: the other writer's image is torn; the commit lists
    }
  }
  SP_KILL_POINT("agent.persist.before_commit");
  Committed(r, Commit(t, header->first.attempt, fact));
  return r;
}

// The outcome of a task's commit: on success, the ledger forgets the step and retention runs.
void PersistQueue::Committed(PersistResult& r, const Result<bool>& committed) {
  if (!committed.ok()) {
    r.status = committed.status();
    return;
  }
  r.committed = *committed;
  if (r.committed) {
    if (target_.ledger) target_.ledger->Forget(r.task.step);
    SP_KILL_POINT("agent.persist.before_prune");
    r.pruned = Prune();
  }
}

}  // namespace safepoint::agent
