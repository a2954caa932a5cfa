// EventLog: the agent's JSON-lines event log, for log shippers (docs/operations.md, "Event log").
//
// One JSON object per line, one line per event (a save, persist, commit, flush, restore or
// failure), appended with a single write(2) to a file opened with O_APPEND, so that a reader
// never sees half a line unless the disk is full. Every line has "time" (RFC 3339, UTC,
// milliseconds), "ts" (unix seconds), "event" and "job"; the other fields depend on the event
// (rank, step, tier, bytes, seconds, error, ...).
//
// Bounded: once the file reaches `max_bytes` it is renamed to PATH.1 (replacing an older PATH.1)
// and a new PATH is started, so the log takes at most about twice `max_bytes`. Shippers that
// follow a file by name (Fluent Bit's tail, Vector's file source, Promtail) handle the rename.
//
// A write that fails is counted and logged once, never retried: the log must not stop the agent.
//
// The path may lie in a directory other local users can write: the file is opened without
// following a symlink and created mode 0600, and one that is not a regular file of the agent's
// uid, or that group or others can write, is refused (base/owned_file.h): the agent then runs
// without its event log, saying why in agent.log and its status (`event_log_error`).
//
// Threads: one thread at a time (the agent's loop).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "base/unique_fd.h"
#include "safepoint/status.h"

namespace safepoint::agent {

class EventLog {
 public:
  static constexpr uint64_t kDefaultMaxBytes = 4 << 20;

  EventLog() = default;
  // Opens (creates, appends to) `path`. Replaces a file opened before. InvalidArgument for a
  // file another user could have planted (above).
  Status Open(const std::string& path, uint64_t max_bytes = kDefaultMaxBytes);
  void Close();
  bool is_open() const { return static_cast<bool>(fd_); }
  const std::string& path() const { return path_; }
  uint64_t write_errors() const { return write_errors_; }

  // Appends `fields` with "time", "ts", "event" and "job" in front. No-op when closed.
  void Write(const std::string& event, const std::string& job, const nlohmann::json& fields);

 private:
  void Rotate();

  internal::UniqueFd fd_;
  std::string path_;
  uint64_t max_bytes_ = kDefaultMaxBytes;
  uint64_t size_ = 0;
  uint64_t write_errors_ = 0;
};

// The agent's default event log size limit: $SAFEPOINT_EVENT_LOG_MAX_BYTES, else kDefaultMaxBytes.
uint64_t EventLogMaxBytes();

}  // namespace safepoint::agent
