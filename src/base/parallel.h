// Parallel loops for copies, checksums and I/O.
//
// ParallelFor(n, threads, fn) runs fn(i) for i in [0, n) on up to `threads` threads (the caller is
// one of them) and returns when all are done. It is not a pool: each call starts its threads and
// joins them (tens of microseconds per thread, small beside the megabytes each call moves; the
// per-save cost for many small tensors is issue 14's to measure). Indices are handed out one at
// a time, so uneven items balance. Functions must not throw. A call from inside a ParallelFor
// runs inline on the calling thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <mutex>

#include "safepoint/status.h"

namespace safepoint::internal {

// Number of threads used for I/O by default: 16 (or the number of cores, if more), enough to
// keep a device queue busy even on a machine with few cores (I/O threads mostly wait). On the
// development VM, reads scaled from 2.1 GB/s with 4 threads to 5.1 GB/s with 16.
// SAFEPOINT_IO_THREADS overrides it.
size_t DefaultIoThreads();
// Number of threads used for memory copies and checksums: the number of cores.
size_t DefaultCpuThreads();

void ParallelFor(size_t n, size_t threads, const std::function<void(size_t)>& fn);

// Keeps the first error of a parallel loop; failed() lets the other iterations stop early.
class FirstError {
 public:
  void Set(Status s) {
    if (s.ok()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.ok()) status_ = std::move(s);
    failed_.store(true, std::memory_order_relaxed);
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  Status status() {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  std::mutex mu_;
  Status status_;
  std::atomic<bool> failed_{false};
};

}  // namespace safepoint::internal
