// The agent's measurement history (history_recorder.h).
#include "agent/history_recorder.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <memory>

#include "agent/node_agent.h"
#include "safepoint/storage.h"
#include "storage/cancellable.h"

namespace safepoint::agent {

void HistoryRecorder::Open(const std::string& storage_uri, const std::string& job,
                           std::function<void()> wake) {
  if (writer_) return;
  wake_ = std::move(wake);
  if (advisor::HistoryIsLocal(storage_uri)) {
    auto w = advisor::HistoryWriter::Open(advisor::HistoryPath(storage_uri, job), kLineGapSeconds);
    if (!w.ok()) return Check(w.status());
    writer_.emplace(std::move(w).value());
  } else {
    // An object store cannot append: this agent's lines go to segments of their own, named
    // by its start time and pid so that readers take them in order after earlier agents'.
    auto storage = OpenStorage(storage_uri);
    if (!storage.ok()) return Check(storage.status());
    const auto ns = static_cast<uint64_t>(advisor::NowSeconds() * 1e9);
    char stem[64];
    std::snprintf(stem, sizeof(stem), "%020llu-%d", static_cast<unsigned long long>(ns),
                  static_cast<int>(::getpid()));
    storage_ = std::shared_ptr<Storage>(std::move(storage).value());
    writer_.emplace(advisor::HistoryWriter::InStorage(storage_, stem, kLineGapSeconds));
    worker_ = std::thread([this] { Publish(); });
  }
  spdlog::info("recording the job's measurement history in {}", writer_->path());
}

void HistoryRecorder::Check(const Status& s) {
  if (s.ok()) return;
  std::lock_guard lock(mu_);
  if (error_.empty()) spdlog::warn("measurement history: {}", s.ToString());
  error_ = s.ToString();
}

std::string HistoryRecorder::error() {
  std::lock_guard lock(mu_);
  return error_;
}

void HistoryRecorder::Started(uint64_t run) {
  if (writer_) Check(writer_->RecordStart(run));
}

void HistoryRecorder::Saved(double blocking_seconds, std::optional<uint64_t> step,
                            const std::function<advisor::JobShape()>& shape) {
  if (!writer_) return;
  if (shape && (!writer_->has_shape() || writer_->SaveLineDue())) writer_->SetShape(shape());
  Check(writer_->RecordSave(blocking_seconds, step));
}

void HistoryRecorder::Persisted(const std::string& level, double seconds, uint64_t bytes) {
  // A persist that wrote nothing (the image stored or the step committed already, e.g. at a
  // close after a requested persist) is no persist time: it would pull the advisor's median down.
  if (!writer_ || bytes == 0) return;
  const double now = MonotonicSeconds();
  auto it = last_persist_line_.find(level);
  if (it != last_persist_line_.end() && now - it->second < kLineGapSeconds) return;
  last_persist_line_[level] = now;
  Check(writer_->RecordPersist(level, seconds, bytes));
}

void HistoryRecorder::Restored(const std::string& level, double seconds) {
  if (writer_) Check(writer_->RecordRestore(level, seconds));
}

void HistoryRecorder::TierStates(const std::vector<TierState>& states) {
  for (const TierState& t : states) {
    uint64_t& seen = tier_copies_[t.index];
    if (t.copies == seen) continue;
    seen = t.copies;
    if (t.last_copy_seconds > 0) {
      Persisted("tier " + std::to_string(t.index), t.last_copy_seconds, t.last_copy_bytes);
    }
  }
}

void HistoryRecorder::Closed() {
  if (!writer_) return;
  Check(writer_->RecordClose());
  Sync(/*now=*/true);
}

void HistoryRecorder::Ended() {
  if (!writer_) return;
  Check(writer_->Flush());
  Sync(/*now=*/true);
}

void HistoryRecorder::Sync(bool now) {
  if (!writer_ || !writer_->unsynced() || !worker_.joinable()) return;
  const double t = MonotonicSeconds();
  if (!now && t - last_sync_ < kSyncSeconds) return;
  last_sync_ = t;
  std::optional<advisor::HistoryWriter::Segment> segment = writer_->TakeSegment();
  if (!segment) return;
  std::lock_guard lock(mu_);
  pending_[segment->name] = std::move(segment->data);  // a newer take holds all the lines
  cv_.notify_all();
}

void HistoryRecorder::Publish() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
    if (pending_.empty()) return;  // stopping, all published
    auto it = pending_.begin();
    advisor::HistoryWriter::Segment segment{it->first, std::move(it->second)};
    pending_.erase(it);
    busy_ = true;
    lock.unlock();
    const Status s = advisor::HistoryWriter::PublishSegment(*storage_, segment);
    lock.lock();
    busy_ = false;
    last_failed_ = !s.ok();
    cv_.notify_all();
    if (wake_) wake_();  // under mu_: Stop clears it
    if (s.ok()) continue;
    if (error_.empty()) spdlog::warn("measurement history: {}", s.ToString());
    error_ = s.ToString();
    if (stopping_) return;                                        // cancelled, or out of time
    pending_.try_emplace(segment.name, std::move(segment.data));  // unless a newer one waits
    cv_.wait_for(lock, std::chrono::duration<double>(kRetrySeconds), [&] { return stopping_; });
  }
}

bool HistoryRecorder::Settled() {
  std::lock_guard lock(mu_);
  return !busy_ && (pending_.empty() || last_failed_);
}

void HistoryRecorder::Stop(double timeout_s) {
  if (!worker_.joinable()) return;
  Sync(/*now=*/true);
  {
    std::unique_lock lock(mu_);
    wake_ = {};  // the agent's loop (and its eventfd) may be gone next
    stopping_ = true;
    cv_.notify_all();
    const bool done = cv_.wait_for(lock, std::chrono::duration<double>(std::max(0.0, timeout_s)),
                                   [&] { return pending_.empty() && !busy_; });
    if (!done) {
      spdlog::warn("measurement history: {} not published before the agent's exit",
                   writer_ ? writer_->path() : std::string("a segment"));
    }
  }
  internal::CancelStorageRequests(*storage_);  // a stalled request ends now
  worker_.join();
}

}  // namespace safepoint::agent
