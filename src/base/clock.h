// UnixNanos: the wall clock as nanoseconds since the Unix epoch.
//
// For times that leave the process (commit records, object mtimes, slot stamps): comparable
// across processes and nodes as far as their clocks agree. Durations use steady_clock instead.
#pragma once

#include <chrono>
#include <cstdint>

namespace safepoint {

inline int64_t UnixNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace safepoint
