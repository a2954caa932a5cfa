// The peer service's wire format (docs/replication.md): what travels in one UCX active message.
//
// Every message is an active message whose user header is a WireHeader (fixed size, magic,
// version) and whose data is either a control message's JSON (at most kMaxControlBytes, always
// sent eagerly) or, for kChunk, one bulk chunk of a replica's payload: (offset, len, crc32c) in
// the header, the bytes as data. Anything else (another size, magic or version, a control message
// too long, a chunk outside what was declared) is a protocol error and the peer is dropped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "replica/replica_store.h"
#include "safepoint/status.h"

namespace safepoint::replica {

inline constexpr uint32_t kWireMagic = 0x31525053;  // "SPR1" little-endian
// 2: the CRCs of a push (image_crc, payload_crc) travel with kCommit, not kPutBegin.
inline constexpr uint16_t kWireVersion = 2;
inline constexpr size_t kMaxControlBytes = 1 << 20;
// Bounds on the chunk size a sender may declare, and on the chunks of one transfer.
inline constexpr uint64_t kMinChunkBytes = 4 << 10;
inline constexpr uint64_t kMaxChunkBytes = 64 << 20;
inline constexpr uint64_t kMaxChunks = 1 << 24;

enum class MsgType : uint16_t {
  kHello = 1,        // client: job, node, nonce
  kChallenge = 2,    // server: node, nonce, proof
  kAuth = 3,         // client: proof
  kAuthOk = 4,       // server
  kError = 5,        // either: code, message; the sender closes the connection after it
  kPutBegin = 6,     // client: meta (its CRCs 0: they come with kCommit), chunk_bytes
  kPutReady = 7,     // server: the replica file is reserved, send the chunks
  kChunk = 8,        // either: one chunk of the current transfer
  kPutDone = 9,      // server: every chunk arrived and passed its CRC; waiting for kCommit
  kCancel = 10,      // client: the snapshot is no longer valid; drop it
  kList = 11,        // client: rank (optional)
  kListReply = 12,   // server: metas
  kFetch = 13,       // client: meta (identity of one replica), chunk_bytes
  kFetchBegin = 14,  // server: meta as stored; chunks follow
  kCommit = 15,      // client: image_crc, payload_crc; the snapshot is still valid: commit it
  kCommitted = 16,   // server: committed (or an error)
  kPing = 17,        // client: paused or throttled, still there
  kNote = 18,        // client: kind, body (a short notice for the agent: PeerService::Note)
  kNoteReply = 19,   // server: the agent's answer (a status)
  // client: rank, step, chunk_bytes, image_bytes, complete_ns: one of the serving node's own
  // snapshots (peer_service_snapshot.cc). image_bytes 0: kFetchBegin with the newest one's meta,
  // no chunks; else that snapshot (its size and completion time) is sent: kFetchBegin, chunks.
  kFetchSnapshot = 20,
  kLast = kFetchSnapshot,
};
const char* MsgTypeName(MsgType type);

struct WireHeader {
  uint32_t magic = kWireMagic;
  uint16_t version = kWireVersion;
  uint16_t type = 0;
  uint64_t offset = 0;  // kChunk: where the chunk goes in the payload
  uint64_t len = 0;     // kChunk: its bytes; control: the JSON's bytes
  uint32_t crc = 0;     // kChunk: CRC32C of the chunk's bytes
  uint32_t reserved = 0;
};
static_assert(sizeof(WireHeader) == 32);

WireHeader ControlHeader(MsgType type, size_t json_bytes);
WireHeader ChunkHeader(uint64_t offset, uint64_t len, uint32_t crc);

// Checks the size, magic, version and type of a received header, and that `data_bytes` agrees
// with it. Corruption naming the cause otherwise.
Result<WireHeader> ParseHeader(const void* header, size_t header_bytes, size_t data_bytes);

// The CRC32C of a ++ b from crc_a = CRC32C(a), crc_b = CRC32C(b) and b's length (GF(2)
// arithmetic, O(log len_b)): a receiver or sender that checked every chunk gets the whole
// payload's CRC without reading it again.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// ReplicaMeta as a JSON object (string) and back (Corruption for a missing or mistyped field).
std::string MetaToJson(const ReplicaMeta& meta);
Result<ReplicaMeta> MetaFromJson(std::string_view json);

// Validates a meta a peer declared before anything is reserved for it: the source is the
// authenticated peer itself, the sizes agree (a copy is image_bytes long; a fragment is
// EcLayout{k, p, image_bytes, piece_bytes}.fragment_bytes() long) and the image is at most
// `max_image_bytes`. Corruption naming `peer` and the field otherwise.
Status ValidateDeclaredMeta(const ReplicaMeta& meta, std::string_view peer,
                            uint64_t max_image_bytes);

// The chunk layout of a transfer of `total` bytes in chunks of `chunk_bytes`.
struct ChunkLayout {
  uint64_t total = 0, chunk_bytes = 0;
  uint64_t chunks() const { return chunk_bytes == 0 ? 0 : (total + chunk_bytes - 1) / chunk_bytes; }
  // The chunk index of (offset, len) if it is exactly one chunk of the layout, else -1.
  int64_t IndexOf(uint64_t offset, uint64_t len) const;
  Status Validate() const;
};

}  // namespace safepoint::replica
