// Parallel loops for copies, checksums and I/O.
//
// ParallelFor(n, threads, fn) runs fn(i) for i in [0, n) on up to `threads` threads (the caller is
// one of them) and returns when all are done. It is not a pool: each call starts its threads and
// joins them (tens of microseconds per thread, small beside the megabytes each call moves; the
// per-save cost for many small tensors is issue 14's to measure). Indices are handed out one at
// a time, so uneven items balance. Functions must not throw. A call from inside a ParallelFor
// runs inline on the calling thread.
#pragma once

#include <cstddef>
#include <functional>

namespace safepoint::internal {

// Number of threads used for I/O by default: 16 (or the number of cores, if more), enough to
// keep a device queue busy even on a machine with few cores (I/O threads mostly wait). On the
// development VM, reads scaled from 2.1 GB/s with 4 threads to 5.1 GB/s with 16.
// SAFEPOINT_IO_THREADS overrides it.
size_t DefaultIoThreads();
// Number of threads used for memory copies and checksums: the number of cores.
size_t DefaultCpuThreads();

void ParallelFor(size_t n, size_t threads, const std::function<void(size_t)>& fn);

}  // namespace safepoint::internal
