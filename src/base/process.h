// ProcessId: a process named so that a reused pid is not taken for the process that had it.
//
// A pid alone is recycled by the kernel; (pid, start time in clock ticks since boot, field 22 of
// /proc/<pid>/stat) names one process for the life of the machine. Records that outlive their
// writer (slot control blocks, staging files) keep both, and "is its writer alive?" compares
// both. Thread-safe; every call reads /proc.
#pragma once

#include <cstdint>
#include <optional>

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
// start time is unknown (kill(2) answers EPERM).
bool ProcessAlive(const ProcessId& id);

}  // namespace safepoint::internal
