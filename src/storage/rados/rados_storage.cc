// RadosStorage: Storage in a Ceph RADOS pool through librados's C API.
//
// Layout (docs/format.md, "RADOS object layout"): a published object NAME of storage
// rados://POOL/PREFIX is a 64-byte head object "PREFIX/NAME" in the pool's default namespace,
// and its bytes live in data objects "PREFIX/NAME@<data id>.<chunk number>" in the namespace
// "safepoint.data" (chunk k holds bytes [k*chunk_size, (k+1)*chunk_size)). The head holds the
// size, the chunk size, the data id (16 random hex digits, fresh for every write), the publish
// time and a CRC32C of itself. Listing the default namespace therefore shows heads only, and a
// data object can never be mistaken for a published object.
//
// Cluster: one connected rados_t per process and configuration ($CEPH_CONF, $CEPH_ARGS, the
// timeout), shared by every RadosStorage, never shut down (connecting costs 0.1-1 s). It is
// found the way Ceph's tools find it: rados_conf_read_file(NULL) reads $CEPH_CONF or
// /etc/ceph/ceph.conf, the client name comes from --id/--user/--name in $CEPH_ARGS (default
// client.admin) and rados_conf_parse_env("CEPH_ARGS") applies the rest; keyring from the config.
//
// Time bounds: rados_osd_op_timeout, rados_mon_op_timeout and client_mount_timeout are set to
// the URI's timeout, so a stalled OSD completes an op with ETIMEDOUT; our own waits are bounded
// too (timeout + 10 s without any completion cancels what is in flight). Before a retry, and
// before the next call's first attempt once an op ended with a transient error, the client
// fetches the newest OSD map (an OSD that died and came back listens elsewhere; librados does not
// always ask on its own, and every later op would go to the dead address). Transient errors
// (ETIMEDOUT, EAGAIN, ENOTCONN, ECONNRESET, ESHUTDOWN, EBUSY, EIO) of ops and listings are
// retried `retries` times with exponential backoff and jitter (RetryBackoffSeconds, as for
// s3://); ENOENT, EDQUOT, ENOSPC, EEXIST never. Writes carry LIBRADOS_OPERATION_FULL_TRY, so a
// full pool (quota or space) answers EDQUOT/ENOSPC (ResourceExhausted naming the pool) instead of
// blocking; removals carry FULL_FORCE, so a full pool can still be cleaned up.
//
// Write protocol (Create ... Publish):
//   1. Create draws the data id and registers it in the process-wide set of live writers.
//   2. WriteAt splits its range at chunk boundaries and writes the pieces as parallel aio write
//      ops into their data objects (a window of in-flight ops), waiting for all of them before it
//      returns (the caller may reuse its buffer). Writes are idempotent, so a timed-out piece is
//      simply written again. The first failure poisons the object.
//   3. Publish creates (empty) the chunks below the size that nothing wrote, so that every chunk
//      of a published object exists and a missing one is detected as corruption; then writes the
//      head in one op: write_full (replacing a previous head atomically), or, for
//      PublishIfAbsent, an exclusive create + write_full (EEXIST -> AlreadyExists). A head write
//      that fails without a definite answer (timeout) is read back: if the head names our data id
//      the object is published; if the read fails too, Publish returns Unavailable and keeps the
//      data (RemoveLeftovers reclaims it if the head never landed). Otherwise the data is removed.
//   4. After a head replaced another, the old head's data objects are removed (best effort: what
//      is left is reclaimed by RemoveLeftovers).
//   5. Abort (or the destructor of an unpublished writer) removes the data objects written, in
//      one attempt (no retries: what a failure leaves is reclaimed by RemoveLeftovers).
//
// Reads: Open reads and checks the head; ReadAt reads only the chunks its range covers, as
// parallel aio reads straight into the caller's buffer. Bytes below the size that a chunk does
// not hold read as zeros (sparse writes); a missing chunk is Corruption (or NotFound when the
// object was deleted or replaced after Open: unlike a POSIX file, an open RADOS object does not
// pin its data).
//
// Delete removes the head first (the object disappears at once), then its data objects.
// List scans the heads of the default namespace under PREFIX and reads them in parallel for
// sizes and mtimes; objects whose first bytes are not a head (not ours) are skipped, a head with
// a bad CRC is Corruption.
// RemoveLeftovers scans the data namespace under PREFIX, reads the heads of the writes found
// there in parallel, and removes data objects that no head references and no live writer of
// this process owns. Like PosixStorage it cannot see writers
// of other processes: callers use it only where none is live.
//
// Files: the cluster connections are rados_cluster.cc's, the parallel aio with retries and the
// striping of a range over data chunks rados_aio.cc's; this file holds the head format and the
// protocols above (write, publish, read, list, delete, cleanup) and the factory.
//
// Thread safety: every method may be called from many threads (librados handles are).
#include "storage/rados/rados_storage.h"

#include <rados/librados.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "base/bytes.h"
#include "base/clock.h"
#include "base/crc32c.h"
#include "base/random.h"
#include "safepoint/storage.h"
#include "storage/cancellable.h"
#include "storage/rados/rados_aio.h"
#include "storage/rados/rados_cluster.h"
#include "storage/uri_options.h"

namespace safepoint::internal {

using namespace rados;  // NOLINT: this backend's cluster and aio layers

namespace {

constexpr char kDataNamespace[] = "safepoint.data";
constexpr char kHeadMagic[8] = {'S', 'P', 'R', 'A', 'D', 'O', 'S', 'H'};
constexpr uint32_t kHeadVersion = 1;
constexpr size_t kHeadSize = 64;
constexpr size_t kWindow = 16;         // aio ops in flight per call
constexpr size_t kListWindow = 64;     // head reads in flight per List
constexpr int kMaxTimeoutS = 1 << 20;  // larger timeouts are clamped (int arithmetic stays safe)
constexpr uint64_t kMinChunkSize = 4 << 10;
constexpr uint64_t kMaxChunkSize = 1 << 30;

// ---- small helpers ----------------------------------------------------------------------------

bool IsHex16(std::string_view s) {
  return s.size() == 16 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// The head of a published object (docs/format.md).
struct Head {
  uint64_t size = 0;
  uint64_t chunk_size = 0;
  std::string data_id;  // 16 hex digits
  int64_t mtime_ns = 0;

  uint64_t chunks() const { return chunk_size == 0 ? 0 : (size + chunk_size - 1) / chunk_size; }

  std::vector<std::byte> Encode() const {
    std::vector<std::byte> b(kHeadSize);
    std::memcpy(b.data(), kHeadMagic, 8);
    StoreLE<uint32_t>(&b[8], kHeadVersion);
    StoreLE<uint32_t>(&b[12], kHeadSize);
    StoreLE<uint64_t>(&b[16], size);
    StoreLE<uint64_t>(&b[24], chunk_size);
    std::memcpy(&b[32], data_id.data(), 16);
    StoreLE<uint64_t>(&b[48], static_cast<uint64_t>(mtime_ns));
    StoreLE<uint32_t>(&b[56], 0);
    StoreLE<uint32_t>(&b[60], Crc32c(0, b.data(), 60));
    return b;
  }
};

enum class HeadParse { kOk, kNotAHead, kCorrupt };

HeadParse DecodeHead(std::span<const std::byte> b, Head* head, std::string* why) {
  if (b.size() < 8 || std::memcmp(b.data(), kHeadMagic, 8) != 0) return HeadParse::kNotAHead;
  if (b.size() < kHeadSize) {
    *why = "head object of " + std::to_string(b.size()) + " bytes (want " +
           std::to_string(kHeadSize) + ")";
    return HeadParse::kCorrupt;
  }
  if (LoadLE<uint32_t>(&b[60]) != Crc32c(0, b.data(), 60)) {
    *why = "head CRC mismatch";
    return HeadParse::kCorrupt;
  }
  if (LoadLE<uint32_t>(&b[8]) != kHeadVersion || LoadLE<uint32_t>(&b[12]) != kHeadSize) {
    *why = "unsupported head version " + std::to_string(LoadLE<uint32_t>(&b[8]));
    return HeadParse::kCorrupt;
  }
  head->size = LoadLE<uint64_t>(&b[16]);
  head->chunk_size = LoadLE<uint64_t>(&b[24]);
  head->data_id.assign(reinterpret_cast<const char*>(&b[32]), 16);
  head->mtime_ns = static_cast<int64_t>(LoadLE<uint64_t>(&b[48]));
  if (head->chunk_size == 0 || !IsHex16(head->data_id)) {
    *why = "head with chunk size 0 or a bad data id";
    return HeadParse::kCorrupt;
  }
  return HeadParse::kOk;
}

// Process-wide ids of writers that are not yet published or aborted (RemoveLeftovers spares
// their data objects).
std::mutex& LiveMu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}
std::unordered_set<std::string>& LiveIds() {
  static auto* ids = new std::unordered_set<std::string>();
  return *ids;
}
bool IsLive(const std::string& id) {
  std::lock_guard<std::mutex> lock(LiveMu());
  return LiveIds().count(id) != 0;
}

// ---- the storage ------------------------------------------------------------------------------

struct Pool {
  std::shared_ptr<Cluster> cluster;
  std::string name;
  rados_ioctx_t heads = nullptr;  // default namespace
  rados_ioctx_t data = nullptr;   // kDataNamespace
  ~Pool() {
    if (heads) rados_ioctx_destroy(heads);
    if (data) rados_ioctx_destroy(data);
  }
};

class RadosStorage final : public Storage, public internal::CancellableStorage {
 public:
  RadosStorage(std::string uri, std::shared_ptr<Pool> pool, std::string prefix,
               RadosOptions options)
      : uri_(std::move(uri)),
        pool_(std::move(pool)),
        prefix_(std::move(prefix)),
        options_(options) {}

  const std::string& uri() const override { return uri_; }
  StorageCapabilities capabilities() const override {
    // Large reads and writes: whole data objects, as many at a time as one call keeps in flight.
    return StorageCapabilities{.atomic_rename = true,
                               .direct_io = false,
                               .durable = true,
                               .preferred_io_size = options_.chunk_size,
                               .io_parallelism = kWindow};
  }

  Result<std::unique_ptr<WritableObject>> Create(std::string_view name,
                                                 uint64_t size_hint) override;
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override;
  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override;
  Status Delete(std::string_view name) override;
  Result<size_t> RemoveLeftovers(std::string_view prefix, const LeftoverFilter& remove_if) override;

  std::string Describe(std::string_view name) const override {
    std::string d = uri_;
    if (!d.ends_with('/')) d += '/';
    d += name;
    return d;
  }

  // ---- used by the objects ----
  std::string HeadOid(std::string_view name) const { return prefix_ + std::string(name); }
  void RunOps(std::vector<AioOp>& ops, size_t window = kWindow, int retries = -1) const {
    RunAio(pool_->cluster, options_.timeout_s, retries < 0 ? options_.retries : retries, ops,
           window, &cancelled_);
  }
  // The ops in flight end with ECANCELED, later ones are not sent (the cluster is shared with
  // other RadosStorage objects and stays connected).
  void CancelRequests() override { cancelled_.store(true, std::memory_order_release); }
  Status Check(const std::string& what, const AioOp& op) const {
    return OpStatus(what, op, pool_->name, options_.timeout_s);
  }
  // Reads the head of `name`. NotFound when missing; Corruption when not a valid head.
  Result<Head> ReadHead(std::string_view name) const;
  // ReadHead of each of `names`, in parallel (kListWindow in flight). `foreign`, if given, marks
  // the objects whose Corruption is that they are no head at all (someone else's object).
  std::vector<Result<Head>> ReadHeads(const std::vector<std::string>& names,
                                      std::vector<bool>* foreign = nullptr) const;
  // Removes the data objects `oids` in parallel (ENOENT is fine: already gone). Returns the first
  // other failure as "<what> <oid> of <uri>: ..."; `retries` < 0: the URI's.
  Status RemoveDataObjects(std::vector<std::string> oids, std::string_view what,
                           int retries = -1) const;
  // Removes the data objects of a write (chunks 0 .. chunks-1 of `id`).
  Status RemoveData(const std::string& head_oid, const std::string& id, uint64_t chunks) const;
  rados_ioctx_t heads_io() const { return pool_->heads; }
  rados_ioctx_t data_io() const { return pool_->data; }
  const RadosOptions& options() const { return options_; }

 private:
  const std::string uri_;
  const std::shared_ptr<Pool> pool_;
  const std::string prefix_;  // "" or ends with '/'
  const RadosOptions options_;
  std::atomic<bool> cancelled_{false};
};

std::vector<Result<Head>> RadosStorage::ReadHeads(const std::vector<std::string>& names,
                                                  std::vector<bool>* foreign) const {
  std::vector<std::vector<std::byte>> bufs(names.size(), std::vector<std::byte>(kHeadSize));
  std::vector<AioOp> ops;
  ops.reserve(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    ops.push_back(AioOp{.kind = AioOp::kRead,
                        .io = heads_io(),
                        .oid = HeadOid(names[i]),
                        .rbuf = reinterpret_cast<char*>(bufs[i].data()),
                        .len = kHeadSize});
  }
  RunOps(ops, kListWindow);
  if (foreign != nullptr) foreign->assign(names.size(), false);
  std::vector<Result<Head>> out;
  out.reserve(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string path = Describe(names[i]);
    if (ops[i].rv == -ENOENT) {
      out.push_back(NotFound(path + ": not found"));
      continue;
    }
    if (Status s = Check("reading the head of " + path, ops[i]); !s.ok()) {
      out.push_back(std::move(s));
      continue;
    }
    Head head;
    std::string why;
    switch (DecodeHead(std::span(bufs[i]).first(static_cast<size_t>(ops[i].rv)), &head, &why)) {
      case HeadParse::kOk:
        out.push_back(std::move(head));
        break;
      case HeadParse::kNotAHead:
        if (foreign != nullptr) (*foreign)[i] = true;
        out.push_back(Corruption(path + ": not a safepoint RADOS head object (bad magic)"));
        break;
      case HeadParse::kCorrupt:
        out.push_back(Corruption(path + ": " + why));
        break;
    }
  }
  return out;
}

Result<Head> RadosStorage::ReadHead(std::string_view name) const {
  return std::move(ReadHeads({std::string(name)})[0]);
}

Status RadosStorage::RemoveDataObjects(std::vector<std::string> oids, std::string_view what,
                                       int retries) const {
  std::vector<AioOp> ops;
  ops.reserve(oids.size());
  for (std::string& oid : oids) {
    ops.push_back(AioOp{.kind = AioOp::kRemove, .io = data_io(), .oid = std::move(oid)});
  }
  RunOps(ops, kWindow, retries);
  for (const AioOp& op : ops) {
    if (op.rv < 0 && op.rv != -ENOENT) {
      return Check(std::string(what) + " " + op.oid + " of " + uri_, op);
    }
  }
  return Status::OK();
}

Status RadosStorage::RemoveData(const std::string& head_oid, const std::string& id,
                                uint64_t chunks) const {
  std::vector<std::string> oids;
  oids.reserve(chunks);
  for (uint64_t c = 0; c < chunks; ++c) oids.push_back(DataOid(head_oid, id, c));
  return RemoveDataObjects(std::move(oids), "removing data object");
}

// ---- writing ----------------------------------------------------------------------------------

class RadosWritableObject final : public WritableObject {
 public:
  RadosWritableObject(const RadosStorage* storage, std::string name)
      : storage_(storage),
        name_(std::move(name)),
        head_oid_(storage->HeadOid(name_)),
        id_(RandomHex16()),
        chunk_size_(storage->options().chunk_size) {
    std::lock_guard<std::mutex> lock(LiveMu());
    LiveIds().insert(id_);
  }

  ~RadosWritableObject() override { Abort(); }

  Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    const std::string path = storage_->Describe(name_);
    if (state_ != State::kWriting) return InvalidArgument(path + ": write after publish or abort");
    if (data.size() > UINT64_MAX - offset) {
      return InvalidArgument(path + ": write of " + std::to_string(data.size()) +
                             " bytes at offset " + std::to_string(offset) + " overflows");
    }
    if (data.empty()) return Status::OK();
    const uint64_t end = offset + data.size();
    AioOp write;
    write.kind = AioOp::kWrite;
    write.io = storage_->data_io();
    write.wbuf = reinterpret_cast<const char*>(data.data());
    std::vector<AioOp> ops = SplitAtChunks(write, head_oid_, id_, chunk_size_, offset, data.size());
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (uint64_t c = offset / chunk_size_; c <= (end - 1) / chunk_size_; ++c) {
        touched_.insert(c);  // before the write: Abort removes it even after a failure
      }
    }
    storage_->RunOps(ops);
    for (const AioOp& op : ops) {
      if (op.rv < 0) {
        failed_ = true;
        return storage_->Check("writing " + std::to_string(op.len) + " bytes at offset " +
                                   std::to_string(op.off) + " of data object " + op.oid + " of " +
                                   path,
                               op);
      }
    }
    uint64_t cur = size_.load();
    while (end > cur && !size_.compare_exchange_weak(cur, end)) {
    }
    return Status::OK();
  }

  Status Publish() override { return DoPublish(/*exclusive=*/false); }
  Status PublishIfAbsent() override { return DoPublish(/*exclusive=*/true); }

  void Abort() override {
    if (state_ != State::kWriting) return;
    state_ = State::kAborted;
    RemoveWritten();
    Unregister();
  }

 private:
  enum class State { kWriting, kPublished, kAborted };

  void Unregister() {
    std::lock_guard<std::mutex> lock(LiveMu());
    LiveIds().erase(id_);
  }

  void RemoveWritten() {
    std::vector<std::string> oids;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (uint64_t c : touched_) oids.push_back(DataOid(head_oid_, id_, c));
    }
    // One attempt, no retries: after a failure (a cluster that does not answer) the writer's
    // error must not wait for the clean-up too; what is left is reclaimed by RemoveLeftovers.
    (void)storage_->RemoveDataObjects(std::move(oids), "removing data object", /*retries=*/0);
  }

  Status DoPublish(bool exclusive) {
    const std::string path = storage_->Describe(name_);
    if (state_ != State::kWriting) {
      return InvalidArgument(path + ": publish after publish or abort");
    }
    if (failed_) {
      Abort();
      return IOError(path + ": not published: an earlier write failed");
    }
    Head head;
    head.size = size_.load();
    head.chunk_size = chunk_size_;
    head.data_id = id_;
    head.mtime_ns = UnixNanos();
    // Every chunk below the size exists, so that a lost one is detected on read.
    std::vector<AioOp> touch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (uint64_t c = 0; c < head.chunks(); ++c) {
        if (touched_.count(c)) continue;
        touched_.insert(c);
        touch.push_back(AioOp{
            .kind = AioOp::kTouch, .io = storage_->data_io(), .oid = DataOid(head_oid_, id_, c)});
      }
    }
    storage_->RunOps(touch);
    for (const AioOp& op : touch) {
      if (op.rv < 0) {
        Status s = storage_->Check("creating data object " + op.oid + " of " + path, op);
        Abort();
        return s;
      }
    }
    // The previous head, whose data a replacing publish orphans.
    Result<Head> old = exclusive ? Result<Head>(NotFound("")) : storage_->ReadHead(name_);

    const std::vector<std::byte> bytes = head.Encode();
    std::vector<AioOp> ops{AioOp{.kind = exclusive ? AioOp::kCreateExclusive : AioOp::kWriteFull,
                                 .io = storage_->heads_io(),
                                 .oid = head_oid_,
                                 .wbuf = reinterpret_cast<const char*>(bytes.data()),
                                 .len = bytes.size()}};
    storage_->RunOps(ops);
    const int rv = ops[0].rv;
    bool published = rv >= 0;
    if (!published) {
      const bool definite = rv == -EDQUOT || rv == -ENOSPC || rv == -EINVAL || rv == -EPERM ||
                            rv == -EACCES || (rv == -EEXIST && ops[0].attempts == 1);
      if (!definite) {
        // No definite answer (a timeout, or EEXIST after a retry that may have met our own first
        // attempt): the head may have landed. Ask it.
        Result<Head> now = storage_->ReadHead(name_);
        if (now.ok() && now->data_id == id_) {
          published = true;
        } else if (!now.ok() && now.status().code() != StatusCode::kNotFound &&
                   now.status().code() != StatusCode::kCorruption) {
          state_ = State::kAborted;  // the data stays: RemoveLeftovers reclaims it if unused
          Unregister();
          return Unavailable(path + ": publishing: the head write failed (" + RadosError(rv) +
                             ") and reading it back failed too (" + now.status().message() +
                             "): the object may or may not be published");
        }
      }
    }
    if (!published) {
      Status s = rv == -EEXIST ? AlreadyExists(path + ": already exists (not published)")
                               : storage_->Check("writing the head object of " + path, ops[0]);
      Abort();
      return s;
    }
    state_ = State::kPublished;
    Unregister();
    if (old.ok() && old->data_id != id_) {
      // Best effort: what fails here is reclaimed by RemoveLeftovers.
      (void)storage_->RemoveData(head_oid_, old->data_id, old->chunks());
    }
    return Status::OK();
  }

  const RadosStorage* storage_;
  const std::string name_;
  const std::string head_oid_;
  const std::string id_;
  const uint64_t chunk_size_;
  std::atomic<uint64_t> size_{0};
  std::atomic<bool> failed_{false};
  // Changed by the one thread that publishes or aborts; read by WriteAt on any thread.
  std::atomic<State> state_{State::kWriting};
  std::mutex mu_;
  std::set<uint64_t> touched_;  // chunks that may exist
};

Result<std::unique_ptr<WritableObject>> RadosStorage::Create(std::string_view name,
                                                             uint64_t size_hint) {
  SP_RETURN_IF_ERROR(ValidateObjectName(name));
  return std::unique_ptr<WritableObject>(
      std::make_unique<RadosWritableObject>(this, std::string(name)));
}

// ---- reading ----------------------------------------------------------------------------------

class RadosReadableObject final : public ReadableObject {
 public:
  RadosReadableObject(const RadosStorage* storage, std::string name, Head head)
      : storage_(storage),
        name_(std::move(name)),
        head_oid_(storage->HeadOid(name_)),
        head_(std::move(head)) {}

  uint64_t size() const override { return head_.size; }

  Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
    if (offset > head_.size || dst.size() > head_.size - offset) {
      return Corruption(storage_->Describe(name_) + ": truncated: wanted " +
                        std::to_string(dst.size()) + " bytes at offset " + std::to_string(offset) +
                        ", the object has " + std::to_string(head_.size));
    }
    if (dst.empty()) return Status::OK();
    AioOp read;
    read.kind = AioOp::kRead;
    read.io = storage_->data_io();
    read.rbuf = reinterpret_cast<char*>(dst.data());
    std::vector<AioOp> ops =
        SplitAtChunks(read, head_oid_, head_.data_id, head_.chunk_size, offset, dst.size());
    storage_->RunOps(ops);
    for (const AioOp& op : ops) {
      if (op.rv == -ENOENT) {
        // Deleted or replaced since Open, or lost.
        Result<Head> now = storage_->ReadHead(name_);
        if (!now.ok() || now->data_id != head_.data_id) {
          return NotFound(storage_->Describe(name_) +
                          ": deleted or replaced while open (data object " + op.oid + " gone)");
        }
        return Corruption(storage_->Describe(name_) + ": data object " + op.oid + " is missing");
      }
      if (op.rv < 0) {
        return storage_->Check("reading " + std::to_string(op.len) + " bytes at offset " +
                                   std::to_string(op.off) + " of data object " + op.oid + " of " +
                                   storage_->Describe(name_),
                               op);
      }
      // A chunk shorter than the range: the rest was never written (a sparse object).
      if (static_cast<size_t>(op.rv) < op.len) std::memset(op.rbuf + op.rv, 0, op.len - op.rv);
    }
    return Status::OK();
  }

 private:
  const RadosStorage* storage_;
  const std::string name_;
  const std::string head_oid_;
  const Head head_;
};

Result<std::unique_ptr<ReadableObject>> RadosStorage::Open(std::string_view name) {
  SP_RETURN_IF_ERROR(ValidateObjectName(name));
  SP_ASSIGN_OR_RETURN(Head head, ReadHead(name));
  return std::unique_ptr<ReadableObject>(
      std::make_unique<RadosReadableObject>(this, std::string(name), std::move(head)));
}

// ---- listing and cleanup ----------------------------------------------------------------------

// Object names of `io` that start with `start`, unsorted: one scan of the pool.
Result<std::vector<std::string>> ListOidsOnce(rados_ioctx_t io, const std::string& start,
                                              const std::string& what, int* rv_out) {
  rados_list_ctx_t ctx = nullptr;
  int rv = rados_nobjects_list_open(io, &ctx);
  *rv_out = rv;
  if (rv < 0) return Unavailable(what + ": listing objects: " + RadosError(rv));
  std::vector<std::string> out;
  while (true) {
    const char* entry = nullptr;
    rv = rados_nobjects_list_next(ctx, &entry, nullptr, nullptr);
    if (rv == -ENOENT) break;
    if (rv < 0) {
      rados_nobjects_list_close(ctx);
      *rv_out = rv;
      if (rv == -ETIMEDOUT) return Unavailable(what + ": listing objects: timed out");
      // Transient (a lost connection, a busy OSD): Unavailable, as for ops (OpStatus).
      if (Transient(rv)) return Unavailable(what + ": listing objects: " + RadosError(rv));
      return IOError(what + ": listing objects: " + RadosError(rv));
    }
    std::string_view oid(entry);
    if (oid.starts_with(start)) out.emplace_back(oid);
  }
  rados_nobjects_list_close(ctx);
  *rv_out = 0;
  return out;
}

// ListOidsOnce, with the retries of the aio ops: a transient failure is retried `retries` times
// with backoff, each retry after fetching the newest OSD map (the first attempt too when an
// earlier call's op ended with a transient error). A scan restarts from the beginning.
Result<std::vector<std::string>> ListOids(const std::shared_ptr<Cluster>& cluster, rados_ioctx_t io,
                                          const std::string& start, const std::string& what,
                                          int timeout_s, int retries,
                                          const std::atomic<bool>& cancelled) {
  RefreshMapIfSuspect(cluster, timeout_s, &cancelled);
  for (int attempt = 0;; ++attempt) {
    int rv = 0;
    Result<std::vector<std::string>> r = ListOidsOnce(io, start, what, &rv);
    if (r.ok() || !Transient(rv)) return r;
    if (attempt >= retries) {
      cluster->map_suspect.store(true, std::memory_order_release);
      return r;
    }
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(RetryBackoffSeconds(attempt + 1)));
    while (std::chrono::steady_clock::now() < until) {
      if (cancelled.load(std::memory_order_acquire)) {
        return Cancelled(what + ": listing objects: cancelled (" + r.status().message() + ")");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    RefreshMap(cluster, timeout_s, &cancelled);
  }
}

Result<std::vector<ObjectInfo>> RadosStorage::List(std::string_view prefix) {
  SP_RETURN_IF_ERROR(ValidateObjectPrefix(prefix));
  SP_ASSIGN_OR_RETURN(std::vector<std::string> oids,
                      ListOids(pool_->cluster, heads_io(), prefix_ + std::string(prefix), uri_,
                               options_.timeout_s, options_.retries, cancelled_));
  std::vector<std::string> names;
  for (const std::string& oid : oids) {
    std::string name = oid.substr(prefix_.size());
    if (ValidateObjectName(name).ok()) names.push_back(std::move(name));
  }
  std::vector<bool> foreign;
  std::vector<Result<Head>> heads = ReadHeads(names, &foreign);
  std::vector<ObjectInfo> out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (heads[i].ok()) {
      out.push_back(ObjectInfo{names[i], heads[i]->size, heads[i]->mtime_ns});
    } else if (heads[i].status().code() != StatusCode::kNotFound && !foreign[i]) {
      return heads[i].status();  // not: deleted since the scan, or someone else's object
    }
  }
  std::sort(out.begin(), out.end(),
            [](const ObjectInfo& a, const ObjectInfo& b) { return a.name < b.name; });
  return out;
}

Status RadosStorage::Delete(std::string_view name) {
  SP_RETURN_IF_ERROR(ValidateObjectName(name));
  Result<Head> head = ReadHead(name);
  if (!head.ok() && head.status().code() == StatusCode::kNotFound) return Status::OK();
  if (!head.ok() && head.status().code() != StatusCode::kCorruption) return head.status();
  std::vector<AioOp> ops{AioOp{.kind = AioOp::kRemove, .io = heads_io(), .oid = HeadOid(name)}};
  RunOps(ops);
  if (ops[0].rv < 0 && ops[0].rv != -ENOENT) {
    return Check("removing the head object of " + Describe(name), ops[0]);
  }
  if (!head.ok()) return Status::OK();  // a corrupt head: its data is left to RemoveLeftovers
  return RemoveData(HeadOid(name), head->data_id, head->chunks());
}

Result<size_t> RadosStorage::RemoveLeftovers(std::string_view prefix,
                                             const LeftoverFilter& remove_if) {
  SP_RETURN_IF_ERROR(ValidateObjectPrefix(prefix));
  SP_ASSIGN_OR_RETURN(std::vector<std::string> oids,
                      ListOids(pool_->cluster, data_io(), prefix_ + std::string(prefix), uri_,
                               options_.timeout_s, options_.retries, cancelled_));
  // Group the data objects by write: (object name, data id).
  std::map<std::pair<std::string, std::string>, std::vector<std::string>> writes;
  for (const std::string& oid : oids) {
    const size_t at = oid.rfind('@');
    if (at == std::string::npos || at < prefix_.size()) continue;
    const std::string_view suffix = std::string_view(oid).substr(at + 1);
    const size_t dot = suffix.find('.');
    if (dot != 16 || !IsHex16(suffix.substr(0, 16))) continue;
    std::string name = oid.substr(prefix_.size(), at - prefix_.size());
    if (!ValidateObjectName(name).ok()) continue;
    writes[{std::move(name), std::string(suffix.substr(0, 16))}].push_back(oid);
  }
  // The candidates: not refused by the filter, not of a live writer of this process (checked
  // before the head is read: a writer unregisters after publishing). Their heads in one batch.
  std::vector<decltype(writes)::iterator> candidates;
  std::vector<std::string> names;
  for (auto it = writes.begin(); it != writes.end(); ++it) {
    const auto& [name, id] = it->first;
    if ((remove_if && !remove_if(name)) || IsLive(id)) continue;
    candidates.push_back(it);
    names.push_back(name);
  }
  const std::vector<Result<Head>> heads = ReadHeads(names);
  size_t removed = 0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Result<Head>& head = heads[i];
    if (head.ok() && head->data_id == candidates[i]->first.second) continue;  // published
    if (!head.ok() && head.status().code() != StatusCode::kNotFound &&
        head.status().code() != StatusCode::kCorruption) {
      return head.status();
    }
    SP_RETURN_IF_ERROR(
        RemoveDataObjects(std::move(candidates[i]->second), "removing leftover data object"));
    ++removed;
  }
  return removed;
}

}  // namespace

// ---- options and the factory ------------------------------------------------------------------

Result<RadosOptions> ParseRadosOptions(std::string_view uri, std::string_view query) {
  RadosOptions o;
  // librados takes whole seconds: a fractional timeout is rounded up.
  SP_ASSIGN_OR_RETURN(const double default_timeout, StorageTimeoutFromEnv(o.timeout_s));
  o.timeout_s = static_cast<int>(std::ceil(std::min(default_timeout, double{kMaxTimeoutS})));
  for (const auto& [key, value] : SplitUriQuery(query)) {
    const std::string item = std::string(key) + "=" + std::string(value);
    if (key == "timeout") {
      const std::optional<double> v = ParseSeconds(value);
      if (!v) return BadStorageUri(uri, item + " is not a positive number of seconds");
      o.timeout_s = static_cast<int>(std::ceil(std::min(*v, double{kMaxTimeoutS})));
    } else if (key == "retries") {
      const std::optional<int64_t> v = ParseWholeNumber(value, 0, kMaxUriRetries);
      if (!v) {
        return BadStorageUri(uri,
                             item + " is not a number from 0 to " + std::to_string(kMaxUriRetries));
      }
      o.retries = static_cast<int>(*v);
    } else if (key == "chunk_size") {
      const std::optional<uint64_t> v = ParseByteSize(value);
      if (!v || *v < kMinChunkSize || *v > kMaxChunkSize) {
        return BadStorageUri(uri, item + " is not a size from 4K to 1G");
      }
      o.chunk_size = *v;
    } else {
      return BadStorageUri(
          uri, "unknown option \"" + std::string(key) + "\" (known: timeout, retries, chunk_size)");
    }
  }
  return o;
}

Result<std::unique_ptr<Storage>> OpenRadosStorage(std::string_view uri, std::string_view rest) {
  const size_t q = rest.find('?');
  const std::string_view query = q == std::string_view::npos ? "" : rest.substr(q + 1);
  rest = rest.substr(0, q);
  std::string clean_uri(uri.substr(0, uri.find('?')));
  while (clean_uri.ends_with('/') && !clean_uri.ends_with("://")) clean_uri.pop_back();
  SP_ASSIGN_OR_RETURN(RadosOptions options, ParseRadosOptions(uri, query));
  const size_t slash = rest.find('/');
  const std::string pool(rest.substr(0, slash));
  std::string prefix(slash == std::string_view::npos ? "" : rest.substr(slash + 1));
  while (prefix.ends_with('/')) prefix.pop_back();
  if (pool.empty()) {
    return BadStorageUri(uri, "no pool (rados://POOL/PREFIX)");
  }
  if (!prefix.empty()) {
    if (Status s = ValidateObjectName(prefix); !s.ok()) {
      return BadStorageUri(uri, "bad prefix: " + s.message());
    }
    prefix += '/';
  }
  SP_ASSIGN_OR_RETURN(std::shared_ptr<Cluster> cluster, ConnectCluster(options.timeout_s));
  auto p = std::make_shared<Pool>();
  p->cluster = cluster;
  p->name = pool;
  int rv = rados_ioctx_create(cluster->handle, pool.c_str(), &p->heads);
  if (rv == -ENOENT) {
    return NotFound("storage URI \"" + std::string(uri) + "\": pool \"" + pool +
                    "\" does not exist in the " + cluster->description +
                    " (create it: ceph osd pool create " + pool + ")");
  }
  if (rv < 0) {
    return Unavailable("storage URI \"" + std::string(uri) + "\": opening pool \"" + pool +
                       "\": " + RadosError(rv));
  }
  rv = rados_ioctx_create(cluster->handle, pool.c_str(), &p->data);
  if (rv < 0) {
    return Unavailable("storage URI \"" + std::string(uri) + "\": opening pool \"" + pool +
                       "\": " + RadosError(rv));
  }
  rados_ioctx_set_namespace(p->data, kDataNamespace);
  return std::unique_ptr<Storage>(std::make_unique<RadosStorage>(std::move(clean_uri), std::move(p),
                                                                 std::move(prefix), options));
}

}  // namespace safepoint::internal
