// Storage: one interface for every storage tier (local NVMe, shared filesystems, object stores).
//
// A Storage is a flat namespace of immutable objects under one root (a checkpoint directory or a
// bucket prefix). Object names are relative, '/'-separated paths ("step-00000000000000000010/
// rank-00000.img"); ValidateObjectName() is the single check that keeps a name inside the root
// (no "..", no absolute paths, no empty components, no NUL, no reserved ".tmp." infix).
//
// Writing: Create() returns a WritableObject that is invisible to List/Open until Publish()
// returns OK. Publish() makes the data durable and then publishes it atomically under its name
// (POSIX: fsync the temporary file, rename it into place, fsync the directory; object store: one
// PUT / complete-multipart). If any WriteAt() fails, or Publish() fails before the object is
// visible, the object is lost: the caller must rewrite it from its source, never retry a failed
// sync and trust it. A backend that can fail after the object became visible (POSIX: the
// directory fsync after the rename) returns IOError and leaves it visible but perhaps not
// durable: the caller must not count it durable and must not delete it (another writer may have
// published an equal object under that name meanwhile); rewriting it makes it durable.
// Destroying a WritableObject that was not published removes its temporary data.
//
// Reading: Open() returns a ReadableObject for positional reads into caller buffers.
//
// Thread safety: Storage, WritableObject::WriteAt and ReadableObject::ReadAt may be called from
// many threads at once (that is how large objects are written and read in parallel).
// Create/Publish/Abort of one WritableObject are called by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "safepoint/status.h"

namespace safepoint {

// Direct I/O alignment: buffers, offsets and lengths that are multiples of this may bypass the
// page cache (O_DIRECT) where the filesystem supports it.
inline constexpr size_t kDirectIOAlignment = 4096;

struct ObjectInfo {
  std::string name;
  uint64_t size = 0;
  int64_t mtime_ns = 0;  // 0 where the backend does not know
};

class WritableObject {
 public:
  virtual ~WritableObject() = default;

  // Writes `data` at `offset`. Fails with IOError (EIO, short write) or ResourceExhausted
  // (ENOSPC). After a failure the object must be aborted.
  virtual Status WriteAt(uint64_t offset, std::span<const std::byte> data) = 0;

  // Durably publishes the object under its name, replacing an existing object of that name
  // atomically. On failure the temporary data is removed and, in general, nothing is published;
  // an IOError after the object became visible leaves it published but not known to be durable
  // (see the top of this file). Either way the object cannot be written or published again.
  virtual Status Publish() = 0;

  // Like Publish, but only when no object of this name exists: AlreadyExists (nothing
  // published, the temporary data removed) when one does. Atomic against concurrent publishers:
  // of several PublishIfAbsent calls for one name, at most one succeeds. The commit layer writes
  // COMMIT records this way where a step must not be committed twice (copies between tiers).
  virtual Status PublishIfAbsent() = 0;

  // Removes the temporary data. Idempotent; called by the destructor when not published.
  virtual void Abort() = 0;
};

class ReadableObject {
 public:
  virtual ~ReadableObject() = default;

  virtual uint64_t size() const = 0;

  // Reads exactly dst.size() bytes at `offset`. Reading past the end of the object is a
  // Corruption error that names the object ("truncated").
  virtual Status ReadAt(uint64_t offset, std::span<std::byte> dst) const = 0;
};

struct StorageCapabilities {
  bool atomic_rename = true;  // Publish replaces atomically (POSIX); object stores: single PUT
  bool direct_io = false;     // O_DIRECT is used for aligned requests
  bool durable = true;        // data survives a process crash (false: in-memory)
  // No request of a process takes effect after the process is gone (a POSIX syscall has
  // finished or never happened; in-memory). False for object stores, where a request a killed
  // client had sent may still be carried out later: the chunk GC (src/checkpoint/chunk_gc.cc)
  // breaks a dead holder's lock at once only where this is true.
  bool requests_end_with_process = false;
  // The request shape the backend serves best, for readers and writers of large objects: spans
  // of preferred_io_size bytes aligned to it (an object store's part or chunk size; 0: no
  // preference, the caller's own request size), at most io_parallelism of them at a time (0:
  // the caller's default thread count).
  uint64_t preferred_io_size = 0;
  size_t io_parallelism = 0;
};

class Storage {
 public:
  virtual ~Storage() = default;

  // The URI this storage was opened with, for messages ("file:///ckpt").
  virtual const std::string& uri() const = 0;
  virtual StorageCapabilities capabilities() const = 0;

  // Starts writing object `name`. `size_hint` (may be 0) lets the backend preallocate.
  virtual Result<std::unique_ptr<WritableObject>> Create(std::string_view name,
                                                         uint64_t size_hint) = 0;

  // Opens a published object. NotFound when it does not exist.
  virtual Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) = 0;

  // Published objects whose names start with `prefix` ("" for all), sorted by name. Temporary
  // objects of writes in progress or interrupted writes are never listed.
  virtual Result<std::vector<ObjectInfo>> List(std::string_view prefix) = 0;

  // Deletes a published object. Deleting a missing object is OK (idempotent).
  virtual Status Delete(std::string_view name) = 0;

  // Removes temporary data left by interrupted writes under `prefix` whose writers are gone
  // (crashed processes), for temporaries whose target object name satisfies `remove_if` (all
  // when empty). Must not disturb writes that are in progress in this process; callers choose
  // `remove_if` so that no writer in another process is live either (the commit layer removes
  // only leftovers of steps older than the newest committed one). Returns the number removed.
  using LeftoverFilter = std::function<bool(std::string_view object_name)>;
  virtual Result<size_t> RemoveLeftovers(std::string_view prefix,
                                         const LeftoverFilter& remove_if) = 0;
  Result<size_t> RemoveLeftovers(std::string_view prefix) { return RemoveLeftovers(prefix, {}); }

  // Full name of an object for messages ("/ckpt/step-.../rank-00000.img").
  virtual std::string Describe(std::string_view name) const = 0;
};

// Checks that `name` is a relative object name that cannot escape the storage root:
// non-empty, at most 4096 bytes, '/'-separated components that are non-empty, not "." or "..",
// without NUL or backslash, and without the reserved ".tmp." infix. InvalidArgument otherwise.
Status ValidateObjectName(std::string_view name);

// Checks a List/RemoveLeftovers prefix: "" or a string whose part up to its last '/' is a valid
// object name (the directory it selects) and whose last part has no NUL or backslash, so that a
// prefix can never select anything outside the root. InvalidArgument otherwise.
Status ValidateObjectPrefix(std::string_view prefix);

// Storage factories by URI scheme. "file:///abs/path" and plain paths (absolute or relative)
// open POSIX storage; "mem://name" opens a process-wide in-memory storage of that name.
using StorageFactory =
    std::function<Result<std::unique_ptr<Storage>>(std::string_view uri, std::string_view rest)>;
void RegisterStorageScheme(std::string scheme, StorageFactory factory);
Result<std::unique_ptr<Storage>> OpenStorage(std::string_view uri);

// Storage requests counted per URI scheme, for this process (docs/operations.md, "Storage
// requests"). Every Storage that OpenStorage returns counts what it is asked: `list` (List),
// `head` (Open: a stat or HEAD), `get` (ReadAt: a pread or ranged GET), `create` (Create), `write`
// (WriteAt: a pwrite or part upload), `put` (Publish/PublishIfAbsent: the rename or PUT/complete
// that makes an object visible), `del` (Delete) and `cleanup` (RemoveLeftovers). Metadata bytes
// are the names and sizes a List returns (the name plus 16 bytes an entry) and every byte read
// or written of an object that is not tensor data (COMMIT records, manifests, job records: every
// name that neither ends in ".img" nor lies under "chunks/"); data bytes are the rest.
struct StorageRequestCounts {
  uint64_t list = 0, head = 0, get = 0, create = 0, write = 0, put = 0, del = 0, cleanup = 0;
  uint64_t metadata_bytes = 0, data_bytes_read = 0, data_bytes_written = 0;
  uint64_t requests() const { return list + head + get + create + write + put + del + cleanup; }
};
// The counts since this process started, by scheme ("file", "s3", "rados", "mem"), sorted.
std::vector<std::pair<std::string, StorageRequestCounts>> StorageRequestCountsByScheme();
// True for an object holding tensor data (an image or a content chunk), false for metadata.
bool IsDataObjectName(std::string_view name);

// Implementations (also reachable through OpenStorage).
struct PosixStorageOptions {
  bool use_direct_io = true;  // try O_DIRECT; falls back to buffered I/O where refused
  bool create = true;         // create the root directory if missing
};
Result<std::unique_ptr<Storage>> NewPosixStorage(std::string root,
                                                 PosixStorageOptions options = {});
// In-memory storage. Instances created with the same non-empty `name` share their objects
// (like one directory opened twice); an empty name gives a private instance.
std::unique_ptr<Storage> NewMemoryStorage(std::string name = "");

}  // namespace safepoint
