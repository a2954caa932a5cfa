// Work over a packed image's content chunks (pack_manifest.h), shared by the packed reader and
// writer: running a checksum chunk's content chunks on threads of their own, and copying the
// part of a chunk that overlaps a range of the image.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

namespace safepoint::internal {

// Runs fn(i) for i in [begin, end) on up to `threads` threads of its own (the caller one of
// them). For the content chunks of one checksum chunk, whose objects are written or read one
// request each: ParallelFor runs nested calls inline, and a checksum chunk may hold many.
void ForEachContentChunk(size_t begin, size_t end, size_t threads,
                         const std::function<void(size_t)>& fn);

// Threads per checksum chunk for its content chunks: the I/O threads spread over the checksum
// chunks that are worked on at once.
size_t InnerThreads(uint64_t checksum_chunks);

// Copies the part of `data` (image bytes from `at`) that lies in [begin, begin + dst.size())
// into dst.
void CopyOverlap(std::span<const std::byte> data, uint64_t at, uint64_t begin,
                 std::span<std::byte> dst);

}  // namespace safepoint::internal
