// UnixNanos: the wall clock as nanoseconds since the Unix epoch.
//
// For times that leave the process (commit records, object mtimes, slot stamps): comparable
// across processes and nodes as far as their clocks agree. Durations use steady_clock instead
// (SecondsSince).
#pragma once

#include <chrono>
#include <cstdint>

namespace safepoint {

inline int64_t UnixNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Seconds of steady_clock since `t0`.
inline double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace safepoint
