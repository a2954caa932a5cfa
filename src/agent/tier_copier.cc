// TierChain (src/agent/tier_copier.h).
#include "agent/tier_copier.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "base/clock.h"
#include "base/kill_point.h"
#include "checkpoint/chunk_gc.h"
#include "checkpoint/versions.h"
#include "storage/cancellable.h"

namespace safepoint::agent {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

void StepPins::Pin(size_t tier, uint64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  pins_.insert({tier, step});
}

void StepPins::Unpin(size_t tier, uint64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = pins_.find({tier, step}); it != pins_.end()) pins_.erase(it);
}

bool StepPins::Pinned(size_t tier, uint64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  return pins_.contains({tier, step});
}

std::vector<uint64_t> PruneSteps(CheckpointStore& store, uint32_t keep, const StepPins* pins,
                                 size_t tier, CheckpointStore* also_tagged_in) {
  std::vector<uint64_t> pruned;
  std::vector<ObjectInfo> listing;  // CleanUp's, below: one List for both
  auto all = store.ListCommitted(nullptr, &listing);
  if (!all.ok()) return pruned;
  const size_t n = std::max<uint32_t>(keep, 1);
  // Tagged steps are kept past retention (src/checkpoint/versions.h). Tags that cannot be read
  // might name any step: then nothing is deleted this time.
  std::set<uint64_t> tagged;
  for (CheckpointStore* s : {&store, also_tagged_in}) {
    if (s == nullptr || all->size() <= n) continue;
    auto steps = TaggedSteps(*s);
    if (!steps.ok()) {
      spdlog::warn("retention of {} deletes nothing: {}", store.storage().uri(),
                   steps.status().ToString());
      return pruned;
    }
    tagged.merge(*steps);
  }
  for (size_t i = 0; i + n < all->size(); ++i) {
    const uint64_t step = (*all)[i].step;
    if (pins != nullptr && pins->Pinned(tier, step)) continue;  // a lower tier copies it now
    if (tagged.contains(step)) continue;
    if (Status s = store.DeleteStep(step); s.ok()) {
      pruned.push_back(step);
    } else {
      // E.g. a removal whose directory sync failed: the step may come back after a power loss,
      // whole (its COMMIT goes first); the next prune deletes it again.
      spdlog::warn("retention of {} could not delete step {}: {}", store.storage().uri(), step,
                   s.ToString());
    }
    SP_KILL_POINT("agent.tier.mid_prune");  // before the next step's DeleteStep or the CleanUp
  }
  if (!all->empty()) store.CleanUpListed(listing, all->back().step).status().IgnoreError();
  // Chunks only the pruned steps referenced (packed layout); defers while saves are in flight.
  if (!pruned.empty()) CollectChunkGarbage(store.storage()).status().IgnoreError();
  return pruned;
}

struct TierChain::Worker {
  size_t index = 0;  // 1-based
  TierSpec spec;
  mutable std::mutex mu;                   // guards everything below
  std::shared_ptr<CheckpointStore> store;  // once opened
  std::optional<uint64_t> candidate;       // the newest step offered and not yet copied
  int attempts = 0;                        // failed attempts of `candidate`
  Clock::time_point retry_at{};
  std::optional<uint64_t> last;  // the step it received last
  int64_t last_ns = 0;           // when that step committed (wall clock)
  TierState state;
  internal::WorkerLoop<uint64_t> loop{mu, internal::WorkerLoop<uint64_t>::OnStop::kDrop};
};

TierChain::TierChain(std::function<void()> notify, double retry_base_seconds)
    : notify_(std::move(notify)), retry_base_seconds_(retry_base_seconds) {}

TierChain::~TierChain() { Stop(0); }

void TierChain::Start(std::string job, std::shared_ptr<CheckpointStore> primary,
                      std::vector<TierSpec> tiers, std::shared_ptr<StepPins> pins) {
  if (started() || tiers.empty()) return;
  job_ = std::move(job);
  primary_ = std::move(primary);
  pins_ = std::move(pins);
  for (size_t i = 0; i < tiers.size(); ++i) {
    auto w = std::make_unique<Worker>();
    w->index = i + 1;
    w->spec = tiers[i];
    w->state.index = i + 1;
    w->state.spec = tiers[i];
    workers_.push_back(std::move(w));
  }
  for (auto& w : workers_) {
    Worker* raw = w.get();
    w->loop.Start({.prepare = [this, raw] { return Open(*raw); },
                   .take = [this, raw] { return Take(*raw); },
                   .run = [this, raw](uint64_t& step) { Run(*raw, step); }});
  }
}

void TierChain::Committed(uint64_t step) { Offer(1, step); }

void TierChain::Offer(size_t index, uint64_t step) {
  if (index < 1 || index > workers_.size()) return;
  Worker& w = *workers_[index - 1];
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.candidate && step <= *w.candidate) return;
    w.candidate = step;
    w.attempts = 0;
    w.retry_at = Clock::time_point{};
    w.state.pending = step;
  }
  w.loop.Wake();
}

bool TierChain::Busy() const {
  for (const auto& w : workers_) {
    std::lock_guard<std::mutex> lock(w->mu);
    if (w->state.in_flight || (w->candidate && w->attempts < kMaxAttempts)) return true;
  }
  return false;
}

std::vector<TierState> TierChain::States() const {
  std::vector<TierState> out;
  for (const auto& w : workers_) {
    std::lock_guard<std::mutex> lock(w->mu);
    out.push_back(w->state);
  }
  return out;
}

void TierChain::Stop(double grace_seconds) {
  if (workers_.empty()) return;
  const auto deadline = Clock::now() + std::chrono::duration<double>(grace_seconds);
  while (Busy() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  cancel_ = true;
  // A copy in flight on a stalled tier would otherwise wait out its request's timeout times its
  // attempts: its storage's requests end now (S3: the transfer and backoff are cut short).
  for (auto& w : workers_) {
    std::lock_guard<std::mutex> lock(w->mu);
    if (w->store) internal::CancelStorageRequests(w->store->storage());
  }
  for (auto& w : workers_) w->loop.RequestStop();
  for (auto& w : workers_) w->loop.Join();
}

bool TierChain::Open(Worker& w) {
  // Open the tier's storage; an unreachable tier is retried with backoff (and reported).
  double backoff = retry_base_seconds_;
  std::shared_ptr<CheckpointStore> store;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(w.mu);
      if (w.loop.stopping()) return false;
    }
    auto opened = OpenCheckpointStore(w.spec.uri);
    if (opened.ok()) {
      store = std::shared_ptr<CheckpointStore>(std::move(opened).value());
      break;
    }
    spdlog::error("tier {} ({}): cannot open its storage, retrying in {:.1f} s: {}", w.index,
                  w.spec.uri, backoff, opened.status().ToString());
    std::unique_lock<std::mutex> lock(w.mu);
    ++w.state.failures;
    w.state.last_error = opened.status().ToString();
    // A step waiting for an unreachable tier counts its attempts too: after kMaxAttempts the
    // tier no longer keeps the agent busy (it still retries, and reports the error).
    if (w.candidate) ++w.attempts;
    w.loop.SleepUnlessStopping(
        lock, std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(backoff)));
    backoff = std::min(backoff * 2, 60.0);
  }
  std::optional<uint64_t> newest;
  int64_t newest_ns = 0;
  if (auto list = store->ListCommitted(); list.ok() && !list->empty()) {
    newest = list->back().step;
    newest_ns = list->back().commit_time_ns;
  } else if (!list.ok()) {
    spdlog::warn("tier {} ({}): cannot list its steps: {}", w.index, w.spec.uri,
                 list.status().ToString());
  }
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.store = store;
    w.state.last_error.clear();
    w.attempts = 0;
    w.last = newest;
    w.last_ns = newest_ns;
    w.state.newest = newest;
  }
  // The tier below may have started before this one was open (it found no store above to catch
  // up from): offer it this tier's newest step, which no copy into this tier will offer when
  // this tier holds it already (TierChainTest.ATierCatchesUpWhenTheTierAboveOpensAfterIt).
  if (newest) Offer(w.index + 1, *newest);
  // Catch up: the newest step of the tier above is due if the schedule says so (an agent that
  // restarted, or steps committed while this tier could not be opened).
  std::shared_ptr<CheckpointStore> upper = primary_;
  if (w.index > 1) {
    Worker& above = *workers_[w.index - 2];
    std::lock_guard<std::mutex> lock(above.mu);
    upper = above.store;
  }
  if (upper) {
    if (auto list = upper->ListCommitted(); list.ok() && !list->empty()) {
      Offer(w.index, list->back().step);
    }
  }
  // Open only now: a status that shows the tier open with nothing pending or in flight means
  // that its catch-up was decided (an agent that adopted a job copies right after it starts;
  // a reader who waits for the tiers to be idle must not take the moment before for idle).
  std::lock_guard<std::mutex> lock(w.mu);
  w.state.open = true;
  return true;
}

// The next step to copy: the candidate, once its retry is due and when the tier's schedule wants
// it (else it is skipped).
internal::WorkerLoop<uint64_t>::Next TierChain::Take(Worker& w) {
  using Loop = internal::WorkerLoop<uint64_t>;
  if (!w.candidate || w.attempts >= TierChain::kMaxAttempts) return Loop::Wait();
  if (Clock::now() < w.retry_at) return Loop::Wait(w.retry_at);
  const uint64_t step = *w.candidate;
  const double since = w.last_ns > 0 ? static_cast<double>(UnixNanos() - w.last_ns) / 1e9 : 1e18;
  if (!TierDue(w.spec, step, w.last, since)) {
    ++w.state.skipped;
    w.candidate.reset();
    w.state.pending.reset();
    return Loop::Wait();
  }
  w.state.in_flight = step;
  w.state.pending.reset();
  return Loop::Run(step);
}

void TierChain::Run(Worker& w, uint64_t step) {
  const bool done = CopyOne(w, step);
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.state.in_flight.reset();
    if (done && w.candidate == step) w.candidate.reset();
    if (!done && w.candidate == step) {
      ++w.attempts;
      const double delay = std::min(retry_base_seconds_ * (1 << w.attempts), 60.0);
      w.retry_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(delay));
      if (w.attempts < TierChain::kMaxAttempts) w.state.pending = step;
    }
    if (w.candidate) w.state.pending = w.candidate;
  }
  if (notify_) notify_();
}

// Copies `step` from the tier above into w's tier. True when done with it (copied, or gone from
// the tier above, which is no failure); false after a failure (retried).
bool TierChain::CopyOne(Worker& w, uint64_t step) {
  std::shared_ptr<CheckpointStore> upper = primary_;
  if (w.index > 1) {
    Worker& above = *workers_[w.index - 2];
    std::lock_guard<std::mutex> lock(above.mu);
    upper = above.store;
  }
  auto fail = [&](const Status& s) {
    spdlog::error("tier {} ({}): copying step {} failed: {}", w.index, w.spec.uri, step,
                  s.ToString());
    std::lock_guard<std::mutex> lock(w.mu);
    ++w.state.failures;
    w.state.last_error = "step " + std::to_string(step) + ": " + s.ToString();
    return false;
  };
  if (!upper) return fail(Unavailable("the tier above cannot be opened"));
  const size_t above = w.index - 1;
  pins_->Pin(above, step);
  struct Unpin {
    StepPins& pins;
    size_t tier;
    uint64_t step;
    ~Unpin() { pins.Unpin(tier, step); }
  } unpin{*pins_, above, step};
  auto record = upper->ReadCommit(step);
  if (!record.ok()) {
    if (record.status().code() == StatusCode::kNotFound) {
      spdlog::info("tier {} ({}): step {} is gone from the tier above; not copied", w.index,
                   w.spec.uri, step);
      return true;
    }
    return fail(record.status());
  }
  CopyOptions options;
  options.cancel = &cancel_;
  options.layout = MakePackOptions(w.spec.compression, w.spec.incremental);
  auto copied = CopyStep(*upper, *w.store, step, options);
  if (!copied.ok()) return fail(copied.status());
  // The tags of the tier above that name steps this tier holds, so that they protect those
  // steps here also when the tier above is lost. Not a reason to fail the copy: retention on
  // this tier also honours the tags of the job's path.
  if (auto tags = MirrorTags(*upper, *w.store); !tags.ok()) {
    spdlog::warn("tier {} ({}): copying the tags of the tier above failed: {}", w.index, w.spec.uri,
                 tags.status().ToString());
  } else {
    for (const std::string& name : *tags)
      spdlog::info("tier {} ({}): tag '{}' copied from the tier above", w.index, w.spec.uri, name);
  }
  SP_KILL_POINT("agent.tier.before_prune");
  const std::vector<uint64_t> pruned =
      PruneSteps(*w.store, w.spec.keep, pins_.get(), w.index, primary_.get());
  const int64_t now = UnixNanos();
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.last = std::max(w.last.value_or(0), step);
    w.last_ns = now;
    w.state.newest = std::max(w.state.newest.value_or(0), step);
    ++w.state.copies;
    w.state.last_copy_unix_ns = now;
    w.state.last_copy_bytes = copied->bytes;
    w.state.last_copy_seconds = copied->seconds;
    w.state.last_lag_seconds =
        record->commit_time_ns > 0 ? static_cast<double>(now - record->commit_time_ns) / 1e9 : 0;
    w.state.last_error.clear();
  }
  spdlog::info("tier {} ({}): step {} {} ({} bytes in {:.3f} s){}", w.index, w.spec.uri, step,
               copied->already_there ? "was there already" : "copied", copied->bytes,
               copied->seconds, pruned.empty() ? "" : ", older steps pruned");
  Offer(w.index + 1, step);
  return true;
}

}  // namespace safepoint::agent
