// Copies whose destination is not read again soon: a restore's copy out of a snapshot slot into
// the training state (hundreds of MiB, far past the caches).
#pragma once

#include <cstddef>

namespace safepoint::internal {

// memcpy(dst, src, n), with non-temporal stores for the bulk on x86-64: the destination's
// cache lines are written without being read first (a plain memcpy of a range past the caches
// reads each destination line before it overwrites it) and without evicting the source, which
// the caller may checksum next. 20-25% faster than memcpy for the restore's 256 KiB pieces on
// this project's machines (docs/benchmarks.md). Ends with a store fence: the bytes are visible
// to other threads in the usual order once it returns. Plain memcpy elsewhere and for copies
// under 64 KiB (for a few KiB memcpy is faster: 100,000 tensors of 1-4 KiB copied 15% slower
// with streaming stores).
void StreamCopy(void* dst, const void* src, size_t n);

// Copies of at least this many bytes in all are worth streaming (smaller ones may be read from
// the cache right after).
inline constexpr size_t kStreamCopyMinTotal = size_t{8} << 20;

}  // namespace safepoint::internal
