#include "base/process.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

namespace safepoint::internal {

namespace {

// Fields 3 (state) and 22 (start time) of /proc/<pid>/stat.
struct StatFields {
  char state = 0;
  uint64_t start_ticks = 0;
};

// nullopt when there is no such process, /proc would not say, or the line does not parse.
std::optional<StatFields> ReadStat(uint32_t pid) {
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
  if (p == nullptr || p[1] != ' ' || p[2] == '\0') return std::nullopt;
  StatFields out;
  out.state = p[2];
  ++p;
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p + 1, ' ');
    if (p == nullptr) return std::nullopt;
  }
  unsigned long long ticks = 0;
  if (std::sscanf(p + 1, "%llu", &ticks) != 1) return std::nullopt;
  out.start_ticks = ticks;
  return out;
}

// The number of threads /proc/<pid>/task lists, or nullopt when it cannot be read.
std::optional<size_t> ThreadCount(uint32_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* tasks = opendir(dir.c_str());
  if (tasks == nullptr) return std::nullopt;
  size_t threads = 0;
  while (const dirent* e = readdir(tasks)) {
    if (e->d_name[0] != '.') ++threads;
  }
  closedir(tasks);
  return threads;
}

}  // namespace

std::optional<uint64_t> ProcessStartTicks(uint32_t pid) {
  const auto stat = ReadStat(pid);
  if (!stat) return std::nullopt;
  return stat->start_ticks;
}

ProcessId SelfProcessId() {
  const auto pid = static_cast<uint32_t>(::getpid());
  return {pid, ProcessStartTicks(pid).value_or(0)};
}

bool ProcessAlive(const ProcessId& id) {
  if (id.pid == 0) return false;
  ProcessId judged = id;
  if (judged.start_ticks == 0) {
    // No start time recorded: judge whichever process has the pid now (EPERM: it exists).
    if (::kill(static_cast<pid_t>(id.pid), 0) != 0 && errno != EPERM) return false;
    judged.start_ticks = ProcessStartTicks(id.pid).value_or(0);
    if (judged.start_ticks == 0) return true;  // it exists and /proc would not say more
  }
  // One rule for liveness: ProcessStateOf's (a zombie whose every thread has exited is dead).
  switch (ProcessStateOf(judged)) {
    case ProcessState::kAlive:
      return true;
    case ProcessState::kDead:
      return false;
    case ProcessState::kUnknown:
      break;
  }
  // /proc would not say all (e.g. a zombie's task list unreadable): alive while the pid's start
  // time still matches.
  return ProcessStartTicks(id.pid) == judged.start_ticks;
}

ProcessState ProcessStateOf(const ProcessId& id) {
  if (id.pid == 0) return ProcessState::kUnknown;
  const auto stat = ReadStat(id.pid);
  if (!stat) {
    // No such process (ENOENT), or /proc would not say: only a missing directory proves it.
    const std::string dir = "/proc/" + std::to_string(id.pid);
    struct stat st;
    return ::stat(dir.c_str(), &st) != 0 && errno == ENOENT ? ProcessState::kDead
                                                            : ProcessState::kUnknown;
  }
  if (id.start_ticks == 0) return ProcessState::kUnknown;
  if (stat->start_ticks != id.start_ticks) return ProcessState::kDead;  // the pid was reused
  // The process itself: alive unless a zombie whose every thread has exited (a zombie leader
  // whose other threads run still lists them in task/).
  if (stat->state != 'Z') return ProcessState::kAlive;
  const auto threads = ThreadCount(id.pid);
  if (!threads) return ProcessState::kUnknown;
  return *threads <= 1 ? ProcessState::kDead : ProcessState::kAlive;
}

bool ValidBootId(std::string_view id) {
  return id.size() == 36 && std::all_of(id.begin(), id.end(), [](char c) {
           return c == '-' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

std::string BootId() {
  std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "re");
  if (f == nullptr) return "";
  char buf[64] = {};
  const bool ok = std::fgets(buf, sizeof(buf), f) != nullptr;
  std::fclose(f);
  if (!ok) return "";
  std::string id(buf);
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return ValidBootId(id) ? id : "";
}

uint64_t PidNamespaceOf(int64_t pid) {
  const std::string path =
      pid == ::getpid() ? "/proc/self/ns/pid" : "/proc/" + std::to_string(pid) + "/ns/pid";
  char buf[64] = {};
  const ssize_t n = readlink(path.c_str(), buf, sizeof(buf) - 1);
  if (n <= 0) return 0;
  unsigned long long inode = 0;
  if (std::sscanf(buf, "pid:[%llu]", &inode) != 1) return 0;
  return inode;
}

bool ProcIsOwnNamespace() {
  char buf[32] = {};
  const ssize_t n = readlink("/proc/self", buf, sizeof(buf) - 1);
  return n > 0 && std::string_view(buf, n) == std::to_string(::getpid());
}

}  // namespace safepoint::internal
