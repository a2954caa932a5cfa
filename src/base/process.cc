#include "base/process.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

namespace safepoint::internal {

std::optional<uint64_t> ProcessStartTicks(uint32_t pid) {
  if (pid == 0) return std::nullopt;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%u/stat", pid);
  std::FILE* f = std::fopen(path, "re");
  if (f == nullptr) return std::nullopt;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses; fields resume after the
  // last ')'. starttime is field 22, i.e. the 20th after comm.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return std::nullopt;
  ++p;
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p + 1, ' ');
    if (p == nullptr) return std::nullopt;
  }
  unsigned long long ticks = 0;
  if (std::sscanf(p + 1, "%llu", &ticks) != 1) return std::nullopt;
  return ticks;
}

ProcessId SelfProcessId() {
  const auto pid = static_cast<uint32_t>(::getpid());
  return {pid, ProcessStartTicks(pid).value_or(0)};
}

bool ProcessAlive(const ProcessId& id) {
  if (id.pid == 0) return false;
  if (id.start_ticks != 0) {
    const auto ticks = ProcessStartTicks(id.pid);
    return ticks && *ticks == id.start_ticks;
  }
  return ::kill(static_cast<pid_t>(id.pid), 0) == 0 || errno == EPERM;
}

}  // namespace safepoint::internal
