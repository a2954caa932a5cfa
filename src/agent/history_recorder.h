// HistoryRecorder: the job's measurement history (src/advisor/history.h) as the agent that
// serves rank 0 keeps it. The ranks' saves and restores arrive as reports (a save's inside its
// snapshot note: one message per save); the persists and tier copies are the agent's own. No
// training process polls for them or writes the history (issue 21), so it is kept wherever the
// job's storage is: appended to `safepoint-history.jsonl` in a local checkpoint directory, in
// segments under `safepoint-history/` in an object store.
//
// Rates: "save" lines at most every kLineGapSeconds (the median and count of the saves in
// between, a heartbeat too); a level's "persist" line at most every kLineGapSeconds (a sample of
// the persists, enough for the medians); a segment is published at most every kSyncSeconds while
// lines wait, and at once when rank 0 closes or goes away and when the agent exits.
//
// A failure to write is logged once and reported in the status (`history.error`); recording
// goes on (a later write may succeed).
//
// Threads: every method on the agent's main thread. Segments are published by a worker of
// their own (an object store's PUT may stall for its timeout; the main loop must not), which
// retries a failed segment every kRetrySeconds; Stop gives it a deadline, then cancels its
// request (CancelStorageRequests).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "advisor/history.h"
#include "agent/tier_copier.h"

namespace safepoint::agent {

class HistoryRecorder {
 public:
  static constexpr double kLineGapSeconds = 10;
  static constexpr double kSyncSeconds = 30;
  static constexpr double kRetrySeconds = 5;

  HistoryRecorder() = default;
  ~HistoryRecorder() { Stop(0); }
  HistoryRecorder(const HistoryRecorder&) = delete;
  HistoryRecorder& operator=(const HistoryRecorder&) = delete;

  // Starts recording the history of the job that persists to `storage_uri`. Idempotent.
  // `wake`: called by the worker after each attempt to publish (wakes the agent's loop).
  void Open(const std::string& storage_uri, const std::string& job,
            std::function<void()> wake = {});
  bool open() const { return writer_.has_value(); }

  void Started(uint64_t run);  // a Checkpointer of run (save attempt) `run` began
  // A save of rank 0 (of `step`, when known); `shape` gives the job's shape, asked for when a
  // save line is due (and before the first).
  void Saved(double blocking_seconds, std::optional<uint64_t> step = std::nullopt,
             const std::function<advisor::JobShape()>& shape = {});
  void Persisted(const std::string& level, double seconds, uint64_t bytes);
  void Restored(const std::string& level, double seconds);
  // The lower tiers' copies since the last call ("persist" lines of "tier N").
  void TierStates(const std::vector<TierState>& states);
  void Closed();  // rank 0 closed cleanly: its buffered saves and a "close" line
  void Ended();   // rank 0's process went away without closing: its buffered saves, no "close"
  // Hands waiting lines of a segment writer to the worker, at most every kSyncSeconds unless
  // `now`.
  void Sync(bool now = false);
  // Lets the worker publish what waits for up to `timeout_s`, then cancels it. Recording goes
  // on into the local file only (an object store's lines are no longer published).
  void Stop(double timeout_s);
  // Whether the worker is done with what it was handed: published, or its last attempt
  // failed (it retries later). A clean close of rank 0 is answered once it is (the job's
  // history is then where `safepoint advise` reads it). True for a local file.
  bool Settled();

  // Where the history goes ("" before Open) and the last write error ("" when none).
  std::string where() const { return writer_ ? writer_->path() : std::string(); }
  std::string error();

 private:
  void Check(const Status& s);
  void Publish();  // the worker

  std::optional<advisor::HistoryWriter> writer_;
  std::map<std::string, double> last_persist_line_;  // level -> monotonic seconds
  std::map<size_t, uint64_t> tier_copies_;           // tier index -> copies seen
  double last_sync_ = 0;

  // The segment publisher: storage_ and worker_ are set once by Open; the rest under mu_.
  std::shared_ptr<Storage> storage_;
  std::thread worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> pending_;  // segment name -> its newest contents
  bool busy_ = false;                           // a segment is being published
  bool last_failed_ = false;                    // the last attempt to publish failed
  std::function<void()> wake_;
  bool stopping_ = false;
  std::string error_;
};

}  // namespace safepoint::agent
