// PeerService: how one node's agent sends its snapshots to other nodes' agents and fetches them
// back (docs/replication.md). Transport: UCX (UCP active messages over whatever the fabric offers:
// RDMA verbs on a cluster, TCP elsewhere; shared-memory transports are excluded, peers are always
// on other hosts).
//
// Wire: every message is a versioned, bounded header (type, version, JSON fields) plus an optional
// bulk payload. A connection is usable only after mutual HMAC-SHA256 challenge-response with the
// job's secret (OpenSSL), bound to the job name and both nodes' ids; anything else is dropped.
// Every payload chunk carries its CRC32C and the receiver checks offsets and sizes against what
// was declared. A peer that sends garbage, lies about sizes, fails authentication or makes no
// progress for `timeout_s` is dropped; a replica is committed only when whole and verified
// (ReplicaStore), so no wrong byte is ever kept.
//
// Protocol (ucx_wire.h): each request is one connection: hello/challenge/auth (mutual proofs),
// then one of: a push (put-begin with the replica's meta -> put-ready -> chunks -> put-done when
// every chunk arrived and passed its CRC -> commit with the image's and payload's CRCs, folded
// from the chunks' as they were sent, sent only if still_valid() still holds -> committed), a list,
// a fetch of one replica (its chunks stream back), a fetch of one of the node's own snapshots
// (peer_service_snapshot.cc: describe, fetch, describe again), or a note (kind and a short JSON
// body for the receiving agent, src/agent/commit_relay.h -> its handler's status). A paused or
// throttled sender pings, so a pause is not a stall. Shared-memory transports are excluded unless
// $UCX_TLS is set (other UCX_* variables apply as usual).
//
// Threads: the service runs one progress thread that owns the UCX worker; the public methods are
// thread-safe, block their caller and are meant for the agent's replication worker (never its
// poll loop). Destroy the service only when none of its calls is in flight.
//
// Implementation: peer_service_impl.h says how peer_service_hub.cc (UCX), peer_service_server.cc
// and peer_service_client.cc share the work.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "protocol/redundancy.h"
#include "replica/replica_store.h"
#include "safepoint/status.h"

namespace safepoint::replica {

struct PeerServiceOptions {
  std::string job;        // the job's name; part of the authentication
  std::string node;       // this node's id
  std::string bind_host;  // listen only on this address (the interface the job uses)
  uint16_t port = 0;      // 0: a free port
  std::string secret;     // the job's secret (>= 16 bytes); SetSecret replaces it
  double timeout_s = 30;  // a request or a transfer that makes no progress this long fails
  double bandwidth_bytes_per_s = 0;  // cap on what Push sends (all targets together); 0: none
  uint32_t keep = 1;                 // snapshots kept per (source node, rank) on the receiving side
  uint64_t chunk_bytes = 4 << 20;    // bulk transfers are sent in chunks of this size
  // Receiving side: a peer that declares a larger image is refused before anything is reserved.
  uint64_t max_image_bytes = uint64_t{64} << 30;
  // Tests only: called on a copy of every chunk Push sends, after its CRC32C was computed (a test
  // flips a byte to play a corrupting link).
  std::function<void(uint64_t offset, std::span<std::byte> chunk)> test_mangle_chunk;
};

struct Peer {
  std::string node;
  std::string address;  // "host:port" as returned by address()
};

// The identity of one snapshot being pushed.
struct SnapshotId {
  uint32_t rank = 0;
  uint64_t step = 0;
  uint64_t complete_ns = 0;
  uint64_t attempt = 0;  // ImageMeta::attempt (the restore agreement never mixes two attempts)
};

struct PushResult {
  std::vector<Status> targets;  // one per target, in the order given
  uint64_t bytes_sent = 0;
  double seconds = 0;
  double paused_seconds = 0;  // time spent paused (SetPaused) or throttled
};

// A replica that a peer holds.
struct Holding {
  Peer holder;
  ReplicaMeta meta;
};

// One of this node's own snapshots (not a replica) as the service serves it to a peer that
// fetches it (FetchSnapshot): the image read in place from the rank's slot, without a copy or a
// lease.
struct ServedSnapshot {
  SnapshotId id;
  std::span<const std::byte> image;
  std::shared_ptr<const void> keep;  // keeps `image` mapped
  // The checksums the snapshot recorded when it was taken: CRC32C of each crc_chunk_bytes piece
  // from byte 0, whole pieces only (the chunks of the image's data; the last piece, which holds
  // the checksum section, is checksummed as it is sent).
  uint64_t crc_chunk_bytes = 0;
  std::vector<uint32_t> recorded_crcs;
  // Whether the slot still holds the snapshot (its writer has not begun to overwrite it). Called
  // on the progress thread: it must not block.
  std::function<bool()> still_valid;
};

// A node to fetch one of its own snapshots from, and the credentials of its job (a peer of
// another job: a torchft replica healing from another replica's agent).
struct SnapshotOrigin {
  Peer peer;
  std::string job;
  std::string secret;  // that job's secret (>= 16 bytes)
  // How long FetchSnapshot keeps asking, on its one connection, while the origin has not taken
  // the snapshot (0: NotFound at once).
  double wait_s = 0;
};

// Where FetchSnapshot receives an image: `bytes` (the image's size), kept alive by `owner`.
struct FetchDestination {
  std::span<std::byte> bytes;
  std::shared_ptr<void> owner;
};

struct PeerServiceStats {
  uint64_t replicas_received = 0, bytes_received = 0;
  uint64_t pushes = 0, bytes_sent = 0;
  uint64_t peers_rejected = 0;    // failed authentication or protocol errors
  uint64_t transfers_failed = 0;  // timeouts, dead peers, CRC mismatches
  uint64_t notes_sent = 0, notes_received = 0;
  uint64_t note_connections = 0;  // connections opened to send notes (one is kept per peer)
};

// Checksums a snapshot recorded for its image when it was taken (the image's checksum
// section): CRC32C of each `chunk_bytes` piece from byte 0, for the first crcs.size() pieces
// (whole pieces only).
struct RecordedCrcs {
  uint64_t chunk_bytes = 0;
  std::span<const uint32_t> crcs;
};

class PeerService {
 public:
  // Starts listening; `store` (owned by the caller, outliving the service) keeps what peers send.
  // When the interface that carries bind_host is down, the service starts (UCX and the listener,
  // on the address returned) only once it is up; until then its requests fail with Unavailable
  // and peers cannot reach it (UCX would leave the interface out for good: OPEN-4 in
  // docs/reliability.md).
  static Result<std::unique_ptr<PeerService>> Start(const PeerServiceOptions& options,
                                                    ReplicaStore* store);
  virtual ~PeerService() = default;

  // "host:port" peers connect to.
  virtual std::string address() const = 0;
  virtual void SetSecret(const std::string& secret) = 0;
  virtual void SetBandwidthLimit(double bytes_per_s) = 0;
  // While paused, Push sends nothing (between chunks); the training calls this around its own
  // collectives.
  virtual void SetPaused(bool paused) = 0;

  // Sends one snapshot image (readable for the whole call) to `targets` per `redundancy`:
  // mirror: a whole copy to every target; ec:K+P: fragment f to targets[f]
  // (targets.size() == redundancy.targets()). `still_valid` is polled between chunks and at the
  // end; when it turns false the push stops with Cancelled and receivers drop what they got.
  // A target that fails does not stop the others.
  //
  // `recorded`: the checksums the snapshot recorded for its chunks when it was taken. A mirror
  // push whose chunks are the image's (same size) sends them with those chunks instead of
  // computing them again: one pass over the image less, and a byte that changed in memory
  // since the snapshot fails the receiver's check instead of being replicated under a fresh
  // checksum. Other chunks (the checksum section itself) are checksummed as they are sent;
  // fragments (ec) always are.
  virtual Result<PushResult> Push(const SnapshotId& id, std::span<const std::byte> image,
                                  const Redundancy& redundancy, const std::vector<Peer>& targets,
                                  const std::function<bool()>& still_valid,
                                  const RecordedCrcs& recorded) = 0;
  Result<PushResult> Push(const SnapshotId& id, std::span<const std::byte> image,
                          const Redundancy& redundancy, const std::vector<Peer>& targets,
                          const std::function<bool()>& still_valid) {
    return Push(id, image, redundancy, targets, still_valid, RecordedCrcs{});
  }

  // What `peers` hold (of `rank` if given), asked in parallel. Peers that cannot be asked are
  // skipped. `errors`, when given, gets one status per peer (OK for those that answered).
  virtual std::vector<Holding> List(const std::vector<Peer>& peers, std::optional<uint32_t> rank,
                                    std::vector<Status>* errors = nullptr) = 0;

  // Rebuilds snapshot (rank, step, complete_ns) into `image` (its image_bytes long) from
  // `holdings` (a List result): a whole copy from a reachable holder if there is one, else K
  // distinct fragments fetched in parallel and decoded. Verifies every payload's CRC and the
  // image's CRC; tries other holders when one fails. NotFound when the holdings cannot rebuild
  // it, Corruption/Unavailable when every attempt failed (the last error).
  virtual Status FetchImage(const std::vector<Holding>& holdings, const SnapshotId& id,
                            std::span<std::byte> image) = 0;

  // Notes: short notices between the agents of a job (the commit relay, src/agent/commit_relay.h).
  // The connection to a peer is kept for its next notes (a relayed commit sends a few a step to
  // the same nodes; peer_service_notes.cc says when one is not reused). The receiving service
  // hands each to its handler, on its progress thread: the handler must not block (the agent
  // queues the note and wakes its loop); its status is the sender's answer. A service without a
  // handler answers Unavailable.
  using NoteHandler = std::function<Status(const std::string& from_node, const std::string& kind,
                                           const std::string& body)>;
  virtual void SetNoteHandler(NoteHandler handler) = 0;
  // Sends `body` (at most kMaxNoteBytes) as a note of `kind` to every peer, up to kNoteFanout at
  // a time; one status per peer, in order: OK once its handler accepted the note.
  static constexpr size_t kMaxNoteBytes = 256 << 10;
  static constexpr size_t kNoteFanout = 32;
  virtual std::vector<Status> Note(const std::vector<Peer>& peers, const std::string& kind,
                                   const std::string& body) = 0;

  // Snapshots served straight from this node's slots (peer_service_snapshot.cc). `source`
  // returns this node's newest snapshot of `rank` at `step` (NotFound when there is none: not
  // taken yet, or overwritten); it runs on the service's store thread. Without a source a fetch
  // is answered NotFound.
  using SnapshotSource = std::function<Result<ServedSnapshot>(uint32_t rank, uint64_t step)>;
  virtual void SetSnapshotSource(SnapshotSource source) = 0;
  // Fetches `origin`'s own snapshot of `rank` at `step`, over one connection authenticated with
  // origin's job and secret: asks for its meta (*meta; again every few milliseconds, up to
  // origin.wait_s, while the origin has not taken it), receives the image into the buffer
  // `destination` gives for that meta, every chunk checked on arrival against the checksum the
  // snapshot recorded when it was taken (so a byte that changed in the origin's memory since
  // fails), then asks again and requires the same snapshot (so nothing began to overwrite it
  // while it was read). NotFound: origin holds no such snapshot; Cancelled: it was superseded
  // during the transfer; Corruption: a chunk failed its checksum or the peer lied about sizes;
  // Unavailable: unreachable, authentication failed, or no progress for timeout_s. The image
  // itself is then verified by whoever loads it (its header and chunk checksums).
  virtual Status FetchSnapshot(
      const SnapshotOrigin& origin, uint32_t rank, uint64_t step,
      const std::function<Result<FetchDestination>(const ReplicaMeta&)>& destination,
      ReplicaMeta* meta) = 0;

  virtual PeerServiceStats stats() const = 0;

  // Ends `service` for a process about to end with _exit (internal::ExitProcess), without
  // tearing UCX down: it refuses every connection request from then on, closes its
  // connections, waits until UCX holds no request of theirs and no longer uses its store, and
  // is then kept alive, listener and UCX worker included, until the process ends. Its store may
  // be destroyed once this returns. Why: UCX 1.13 (Debian 12) delivers a connection request
  // that was being received when its listener was destroyed to the freed listener (a
  // segmentation fault in UCX's async thread, `ucp_cm_server_conn_request_cb`); no order of
  // teardown on our side closes that window, since a peer may connect at any moment.
  static void Retire(std::unique_ptr<PeerService> service);
  // Whether Retire kept a service alive in this process (which must then end with _exit).
  static bool AnyRetired();
};

}  // namespace safepoint::replica
