// ProcessId: a process named so that a reused pid is not taken for the process that had it, and
// the one way safepoint asks /proc whether such a process still runs.
//
// A pid alone is recycled by the kernel; (pid, start time in clock ticks since boot, field 22 of
// /proc/<pid>/stat) names one process for the life of the machine. Records that outlive their
// writer (slot control blocks, staging files, chunk-store locks) keep both, and "is its writer
// alive?" compares both. A record read on another machine, boot or pid namespace names some
// other process: BootId and PidNamespaceOf let a record carry where its pid means something.
// Thread-safe; every call reads /proc.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace safepoint::internal {

struct ProcessId {
  uint32_t pid = 0;
  uint64_t start_ticks = 0;  // 0: unknown (a record from before start times were kept)
  bool operator==(const ProcessId&) const = default;
};

// The start time of `pid` (clock ticks since boot), or nullopt when no such process exists.
std::optional<uint64_t> ProcessStartTicks(uint32_t pid);

// This process.
ProcessId SelfProcessId();

// True while the process `id` names still runs: the pid exists and, when start_ticks is known,
// started at that time. A pid that exists but belongs to another user counts as alive when the
// start time is unknown (kill(2) answers EPERM). A zombie (exited, not yet reaped by its parent)
// whose every thread has exited is dead, as for ProcessStateOf: it has already unmapped its
// memory and released its locks, and acts no more; only its pid is held until it is reaped.
bool ProcessAlive(const ProcessId& id);

// What /proc can prove about the process `id` names, for records whose holder must be judged
// dead only when it certainly is (a lock that is broken at once):
//   kDead     no process has the pid, or the one that has it started at another time, or it is
//             a zombie whose every thread has exited (it makes no more requests);
//   kAlive    it runs (a zombie leader whose other threads still run counts: they may act);
//   kUnknown  /proc would not say, or id.start_ticks is 0 and a process has the pid.
// Only meaningful where /proc is this pid namespace's (ProcIsOwnNamespace) and the record was
// written on this boot (BootId) in this namespace (PidNamespaceOf): the caller checks those.
enum class ProcessState { kAlive, kDead, kUnknown };
ProcessState ProcessStateOf(const ProcessId& id);

// This boot's id (/proc/sys/kernel/random/boot_id: 36 characters of lower-case hex and '-'), or
// "" when it cannot be read or is not of that form.
std::string BootId();
// Whether `id` has the form of a boot id BootId returns.
bool ValidBootId(std::string_view id);

// The inode of `pid`'s pid namespace (/proc/<pid>/ns/pid, "pid:[4026531836]"), or 0.
uint64_t PidNamespaceOf(int64_t pid);

// Whether this process's /proc is of its own pid namespace, so that /proc/<pid> names the pids
// getpid() gives (a /proc mounted from another namespace names others).
bool ProcIsOwnNamespace();

}  // namespace safepoint::internal
