// ReplicaStore: the copies and fragments of other nodes' snapshots that this node's agent keeps in
// its shared memory (docs/replication.md).
//
// Files live in "<job_dir>/replicas/" (0700): one file per copy or fragment,
//   "<source-node>.rank-<R>.step-<S>.<complete_ns>.<kind>-<index>"   (kind: copy | frag)
// Each file is a 4 KiB header (magic, version, ReplicaMeta as fixed fields, header CRC32C)
// followed by the payload. A file is received under a temporary name (".tmp-..." prefix),
// its space reserved up front (fallocate: a full /dev/shm is ResourceExhausted naming the bytes
// needed and free, never a SIGBUS), and renamed into place only after the payload's CRC32C
// matched the sender's: a visible replica file is always whole and verified. Readers verify the
// header CRC, and the payload CRC before they trust the bytes.
//
// Pruned replicas of 1 MiB or more may become spares (".spare-<random>", at most 16): never
// listed, removed when the store is opened, and reused by the next Begin, so that a node
// receiving snapshot after snapshot allocates (and the kernel zeroes) no fresh pages: a spare's
// pages are kept (the file is shrunk or grown to the new size; only what it lacked is reserved).
// When a Begin finds too little free memory, the spares are removed first. A replica that a
// reader has mapped (Read) is removed, never recycled.
//
// The budget (ReplicaStoreOptions::budget, docs/operations.md "Host memory"): the bytes the
// store's files (replicas, files being received, spares) may take. A spare is kept only while
// the files fit it (without a budget: only if spares_without_budget), and a Begin whose new file
// would not fit next to what the store holds receives in place of the previous replica of the
// same source node and rank: that replica is given up (renamed to the temporary name, so it is
// never listed or read again) and its pages take the new one. Until the new one commits, this
// node holds no replica of that rank; a transfer cut off leaves none (the temporary file is
// removed). A replica a reader has mapped is never given up. The budget never refuses the one
// replica per source rank (only a full /dev/shm does).
//
// Thread safety: one ReplicaStore per agent; its methods may be called from several threads
// (each writer owns its file until Commit).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "safepoint/status.h"

namespace safepoint::replica {

// What a replica file holds.
struct ReplicaMeta {
  // The node that took the snapshot: [A-Za-z0-9._-]{1,64}, not starting with '.'.
  std::string source_node;
  uint32_t rank = 0;  // the training rank whose image it is
  uint64_t step = 0;
  uint64_t complete_ns = 0;  // when the snapshot completed on its node (orders two of one step)
  uint64_t attempt = 0;      // the image's save attempt (ImageMeta::attempt)
  uint64_t image_bytes = 0;  // the whole image
  uint32_t image_crc = 0;    // CRC32C of the whole image's bytes
  enum class Kind : uint32_t { kCopy = 1, kFragment = 2 };
  Kind kind = Kind::kCopy;
  uint32_t index = 0;          // copy: 0; fragment: its index in [0, k+p)
  uint32_t k = 1, p = 0;       // fragment: the code (EcLayout)
  uint64_t piece_bytes = 0;    // fragment: EcLayout::piece_bytes
  uint64_t payload_bytes = 0;  // bytes in this file after the header
  uint32_t payload_crc = 0;    // CRC32C of the payload
};

// A replica file being received: Write the payload_bytes (in any order, each byte once), then
// Commit().
//
// Writes go through write(2), not a mapping: on tmpfs a write that fills whole pages takes fresh
// pages without the kernel zeroing them first and without page tables in the receiver, where a
// mapped file had every page zeroed, mapped and unmapped again per replica (a third of the
// agents' CPU time in a mirror push, docs/benchmarks.md "Interference").
class ReplicaWriter {
 public:
  virtual ~ReplicaWriter() = default;  // an uncommitted file is removed
  // Writes `bytes` at `offset` of the payload. InvalidArgument past the payload's end or once
  // committed.
  virtual Status Write(uint64_t offset, std::span<const std::byte> bytes) = 0;
  // Verifies the payload against meta.payload_crc (Corruption naming the replica otherwise),
  // writes the header and renames the file into place, replacing an equal replica.
  virtual Status Commit() = 0;
  // Commit for a receiver that learns the CRCs only at the end (meta's image_crc and payload_crc
  // are replaced by these). `received_crc`: the CRC32C of the payload as the caller computed it
  // from the bytes it wrote (e.g. chunk by chunk as they landed); then the payload is not read
  // again.
  virtual Status Commit(uint32_t image_crc, uint32_t payload_crc,
                        std::optional<uint32_t> received_crc) = 0;
};

// A verified, mapped replica file.
struct ReplicaView {
  ReplicaMeta meta;
  std::span<const std::byte> payload;
  std::shared_ptr<const void> mapping;  // keeps payload mapped
};

struct ReplicaStoreOptions {
  // The bytes the store's files may take, asked at each Begin and Prune; nullopt or no
  // function: no budget.
  std::function<std::optional<uint64_t>()> budget;
  // Whether pruned replicas become spares when there is no budget.
  bool spares_without_budget = true;
};

class ReplicaStore {
 public:
  // Opens (creating) "<job_dir>/replicas"; removes temporary files of earlier agents.
  static Result<std::unique_ptr<ReplicaStore>> Open(const std::string& job_dir,
                                                    ReplicaStoreOptions options = {});
  virtual ~ReplicaStore() = default;

  // Starts receiving a replica (validates meta: names, sizes, kind/index/k/p consistent).
  virtual Result<std::unique_ptr<ReplicaWriter>> Begin(const ReplicaMeta& meta) = 0;
  // Every committed replica whose header is valid (optionally of one rank), sorted by rank,
  // step, complete_ns, kind, index (then source node). Files with bad headers, a name other
  // than their header's or a size other than header + payload are skipped and logged.
  virtual Result<std::vector<ReplicaMeta>> List(std::optional<uint32_t> rank = std::nullopt) = 0;
  // Maps a replica and verifies its payload CRC (Corruption when it does not match, or when the
  // file's header is not `meta`; NotFound when there is no such file).
  virtual Result<ReplicaView> Read(const ReplicaMeta& meta) = 0;
  // Keeps, for each (source node, rank), the replicas of the newest `keep` snapshots (by step,
  // then complete_ns); removes the rest. Returns the bytes freed.
  virtual Result<uint64_t> Prune(uint32_t keep) = 0;
  // Removes every replica of a source node (e.g. a node that left the job for good).
  virtual Status RemoveSource(const std::string& source_node) = 0;
  // Removes the spares (see above); returns the bytes they held. For when shared memory is
  // needed elsewhere.
  virtual uint64_t ReleaseSpares() = 0;
  // Bytes of shared memory the replica files take (those being received and spares included).
  virtual uint64_t bytes() = 0;
  // Of bytes(): the spares'.
  virtual uint64_t spare_bytes() = 0;
  // Begins that received in place of the previous replica (the budget), since Open.
  virtual uint64_t received_in_place() = 0;
};

}  // namespace safepoint::replica
