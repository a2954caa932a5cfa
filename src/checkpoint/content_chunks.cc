// Work over a packed image's content chunks (content_chunks.h).
#include "checkpoint/content_chunks.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "base/parallel.h"

namespace safepoint::internal {

void ForEachContentChunk(size_t begin, size_t end, size_t threads,
                         const std::function<void(size_t)>& fn) {
  const size_t n = end - begin;
  threads = std::max<size_t>(1, std::min(threads, n));
  if (threads == 1) {
    for (size_t i = begin; i < end; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{begin};
  auto run = [&] {
    for (size_t i = next++; i < end; i = next++) fn(i);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(run);
  run();
  for (auto& t : pool) t.join();
}

size_t InnerThreads(uint64_t checksum_chunks) {
  const size_t io = DefaultIoThreads();
  return std::max<size_t>(1, io / std::max<size_t>(1, std::min<uint64_t>(checksum_chunks, io)));
}

void CopyOverlap(std::span<const std::byte> data, uint64_t at, uint64_t begin,
                 std::span<std::byte> dst) {
  const uint64_t lo = std::max(at, begin), hi = std::min(at + data.size(), begin + dst.size());
  if (lo < hi) std::memcpy(dst.data() + (lo - begin), data.data() + (lo - at), hi - lo);
}

}  // namespace safepoint::internal
