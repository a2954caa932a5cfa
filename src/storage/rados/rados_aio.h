// Parallel librados aio for RadosStorage (rados_storage.cc's top comment, "Time bounds"): ops run
// with a window in flight; transient failures are retried with backoff and jitter, each retry
// after fetching the newest OSD map; our own wait is bounded beyond librados's op timeout. Also
// the striping of a byte range over an object's data chunks, and an op's result as a Status.
// Private to storage/rados.
//
// Thread safety: RunAio may be called from many threads, each with ops of its own.
#pragma once

#include <rados/librados.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "safepoint/status.h"
#include "storage/rados/rados_cluster.h"

namespace safepoint::internal::rados {

struct AioOp {
  enum Kind { kWrite, kRead, kRemove, kTouch, kWriteFull, kCreateExclusive } kind;
  rados_ioctx_t io = nullptr;
  std::string oid;
  const char* wbuf = nullptr;
  char* rbuf = nullptr;
  size_t len = 0;
  uint64_t off = 0;
  int rv = 0;  // result: bytes read (kRead) or 0, or -errno
  int attempts = 0;
  rados_write_op_t wop = nullptr;
};

// Runs `ops` on `cluster` with up to `window` in flight; transient failures are retried up to
// `retries` times with backoff. Returns after every op finished; each op's rv holds its final
// result. Once `*cancelled` is true (checked at least every 100 ms while waiting), the ops in
// flight are cancelled and the others neither started nor retried: they end with -ECANCELED.
// The newest OSD map is fetched (RefreshMap: waiting at most timeout_s) before the first attempt
// when an earlier call's op ended with a transient error, and before every retry; an op that
// ends with one marks the map suspect.
void RunAio(const std::shared_ptr<Cluster>& cluster, int timeout_s, int retries,
            std::vector<AioOp>& ops, size_t window, const std::atomic<bool>* cancelled = nullptr);

// Whether a librados result is worth retrying (a timeout, a lost connection, a busy OSD).
bool Transient(int rv);

// The Status of a finished op: "<what>: <error>", its code from the errno (a full pool is
// ResourceExhausted naming `pool`, a timeout Unavailable naming `timeout_s`).
Status OpStatus(const std::string& what, const AioOp& op, const std::string& pool, int timeout_s);

// The data object of chunk `chunk` of the write `id` of the head object `head_oid`.
std::string DataOid(const std::string& head_oid, const std::string& id, uint64_t chunk);

// The range [offset, offset + len) of the write `id` of `head_oid`, split at chunk boundaries:
// one copy of `proto` per chunk the range touches, aimed at that chunk's data object, with the
// piece's offset in the chunk and its length, and its buffer pointer (proto's wbuf or rbuf: the
// range's first byte) advanced to the piece.
std::vector<AioOp> SplitAtChunks(const AioOp& proto, const std::string& head_oid,
                                 const std::string& id, uint64_t chunk_size, uint64_t offset,
                                 uint64_t len);

}  // namespace safepoint::internal::rados
