#include "base/parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

namespace safepoint::internal {

namespace {
thread_local bool in_parallel_for = false;
}

size_t DefaultCpuThreads() { return std::max(1u, std::thread::hardware_concurrency()); }
size_t DefaultIoThreads() {
  // SAFEPOINT_IO_THREADS overrides the default (for tuning on a given device).
  static const size_t n = [] {
    if (const char* env = std::getenv("SAFEPOINT_IO_THREADS")) {
      const long v = std::strtol(env, nullptr, 10);
      if (v >= 1 && v <= 256) return static_cast<size_t>(v);
    }
    return std::max<size_t>(16, DefaultCpuThreads());
  }();
  return n;
}

void ParallelFor(size_t n, size_t threads, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  threads = std::min(std::max<size_t>(threads, 1), n);
  if (threads == 1 || in_parallel_for) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Work is handed out one index at a time so that uneven items balance across workers.
  std::atomic<size_t> next{0};
  auto worker = [&] {
    in_parallel_for = true;
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
    in_parallel_for = false;
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

}  // namespace safepoint::internal
