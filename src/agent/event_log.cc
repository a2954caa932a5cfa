// The agent's JSON-lines event log (src/agent/event_log.h).
#include "agent/event_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "base/log.h"
#include "base/owned_file.h"

namespace safepoint::agent {

uint64_t EventLogMaxBytes() {
  const char* v = std::getenv("SAFEPOINT_EVENT_LOG_MAX_BYTES");
  if (v == nullptr || *v == '\0') return EventLog::kDefaultMaxBytes;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  return (end != nullptr && *end == '\0' && n >= 1024) ? n : EventLog::kDefaultMaxBytes;
}

Status EventLog::Open(const std::string& path, uint64_t max_bytes) {
  // The path may be in a directory another user can write (/tmp, a shared log directory): a
  // symlink or a file planted there is refused (owned_file.h), never written to.
  SP_ASSIGN_OR_RETURN(internal::UniqueFd fd, internal::OpenOwnedForAppend(path, 0600, "event log"));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus("stat", path, errno);
  fd_ = std::move(fd);
  path_ = path;
  max_bytes_ = max_bytes;
  size_ = static_cast<uint64_t>(st.st_size);
  return Status::OK();
}

void EventLog::Close() {
  fd_.Reset();
  path_.clear();
}

void EventLog::Rotate() {
  const std::string old = path_ + ".1";
  if (::rename(path_.c_str(), old.c_str()) != 0) {
    spdlog::warn("event log: cannot rotate {}: {}", path_, std::strerror(errno));
    size_ = 0;  // keep appending; try again after another max_bytes
    return;
  }
  if (Status s = Open(std::string(path_), max_bytes_); !s.ok()) {
    spdlog::error("event log: {}; events are no longer logged", s.ToString());
    Close();
  }
}

void EventLog::Write(const std::string& event, const std::string& job,
                     const nlohmann::json& fields) {
  if (!fd_) return;
  const auto now = std::chrono::system_clock::now();
  const int64_t ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  ::gmtime_r(&secs, &tm);
  char when[40];
  std::snprintf(when, sizeof(when), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(ms % 1000));
  nlohmann::ordered_json line = {
      {"time", when}, {"ts", static_cast<double>(ms) / 1000.0}, {"event", event}, {"job", job}};
  for (auto it = fields.begin(); it != fields.end(); ++it) line[it.key()] = it.value();
  // Invalid UTF-8 in an error text must not make dump() throw: replace it.
  std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  if (size_ > 0 && size_ + text.size() > max_bytes_) Rotate();
  if (!fd_) return;
  const ssize_t n = ::write(fd_.get(), text.data(), text.size());
  if (n != static_cast<ssize_t>(text.size())) {
    if (write_errors_++ == 0) {
      spdlog::warn("event log: cannot write {}: {}", path_,
                   n < 0 ? std::strerror(errno) : "short write");
    }
    return;
  }
  size_ += text.size();
}

}  // namespace safepoint::agent
