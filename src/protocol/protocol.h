// The control protocol between training processes (src/client) and the node agent (src/agent).
//
// The two meet only in src/protocol (this file, and the placement rules of peer replication in
// redundancy.h) and in shared memory (src/shm); neither includes the other. A connection carries
// versioned, length-prefixed frames over a Unix domain socket in the job directory:
//
//   u32 length of the rest | u16 protocol version | u16 message type | payload (a JSON object)
//
// Every request and reply has a typed struct below with an Encode (struct -> payload) and a
// Decode (payload -> struct) that checks every field's presence and type and returns
// InvalidArgument naming the field; nothing here throws. The status reply stays a free-form JSON
// document (what `safepoint status --json` prints). Bulk data never goes through the socket: a
// SnapshotNote names a slot, the bytes are in shared memory. docs/architecture.md, "Agent
// protocol", lists the exchanges.
//
// Also here: where a job directory keeps the agent's socket, lock and log, and the lock-based test
// for a live agent, which the client, the agent and the CLI share.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "safepoint/image.h"
#include "safepoint/replication.h"
#include "safepoint/status.h"
#include "safepoint/tiers.h"

namespace safepoint::protocol {

inline constexpr uint16_t kProtocolVersion = 1;
inline constexpr uint32_t kMaxMessageBytes = 1 << 20;
inline constexpr size_t kFrameHeaderBytes = 8;  // u32 length, u16 version, u16 type

enum class MessageType : uint16_t {
  kHello = 1,  // client -> agent: HelloRequest
  kHelloReply = 2,
  kSnapshot = 3,  // client -> agent: SnapshotNote (no reply)
  kStatus = 4,    // client or CLI -> agent: {}
  kStatusReply = 5,
  kWait = 6,  // client -> agent: WaitRequest; the reply comes once the step is committed or failed
  kWaitReply = 7,
  kClose = 8,  // client -> agent: clean close of a rank; CloseReply once its flush is done
  kCloseReply = 9,
  kError = 10,     // agent -> client: ErrorReply, the request was refused
  kShutdown = 11,  // CLI -> agent: flush and exit; CloseReply
  // Peer replication (docs/replication.md):
  kPeerSetup = 12,  // client -> agent: PeerSetupRequest; PeerSetupReply
  kPeerSetupReply = 13,
  kMembership = 14,  // client -> agent: Membership (safepoint/replication.h); AckReply
  kAck = 15,
  kPeerList = 16,  // client -> agent: PeerListRequest; PeerListReply
  kPeerListReply = 17,
  kPeerFetch = 18,  // client -> agent: PeerFetchRequest; PeerFetchReply once fetched or failed
  kPeerFetchReply = 19,
  kPause = 20,   // client -> agent: PauseNote (no reply)
  kReport = 21,  // client -> agent: ReportNote, what the client saw (no reply); a save that
                 // took a snapshot sends its report inside the SnapshotNote instead
};
inline constexpr MessageType kLastMessageType = MessageType::kReport;

struct Message {
  MessageType type = MessageType::kError;
  std::string payload;  // a JSON object
};

// --- typed messages ----------------------------------------------------------------------------

// Status, Close and Shutdown requests carry an empty object.
struct EmptyRequest {};

struct HelloRequest {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::string storage;  // the checkpoint directory / URI the job persists to
  uint32_t keep = 3;    // committed steps to keep
  uint32_t pid = 0;
  std::vector<TierSpec> tiers;  // the storage tiers below `storage`, in order
  std::string metrics;          // serve Prometheus metrics on "HOST:PORT" (empty: not asked)
  std::string event_log;        // the event log's path (empty: events.jsonl in the job directory)
  // How `storage` stores steps (TierSpec's fields of the same names).
  std::string compression = "none";
  bool incremental = false;
  // The process's run: its save attempt (ImageMeta::attempt; 0: none given). A younger process
  // of another attempt supersedes the rank's process that still runs (src/shm/rank_claim.h).
  uint64_t attempt = 0;
};

struct HelloReply {
  uint32_t agent_pid = 0;
  std::string job_dir;
  // The epoch of the rank's claim that this process owns (src/shm/rank_claim.h): its slot writes
  // hold only while the claim is at this epoch. 0: no claim (nothing is checked).
  uint64_t claim_epoch = 0;
};

// What a training process saw, for the agent's metrics, event log and the job's measurement
// history (docs/operations.md, src/advisor/history.h): event "save" (a snapshot taken; `saved`
// false: skipped, no slot free), "restore" (from `source`: memory, peer or storage),
// "checksum" (damaged bytes found in `source`) or "start" (a Checkpointer of run `step`, the
// save attempt, started; rank 0 sends it once).
struct ReportNote {
  std::string event;
  uint64_t step = 0;
  bool saved = true;
  uint64_t nanos = 0;  // the time it took (a save: the time it blocked training)
  uint64_t bytes = 0;
  std::string source;
  std::string error;
  // The history's name of where a restore came from ("memory", "peer", "path", "tier 1", ...);
  // empty: `source`.
  std::string level;
};

// Slot `slot` of the sender's rank holds a COMPLETE snapshot of `step` (at `generation`).
// One save is one message: the note carries the save's report (its blocking time and bytes)
// when the client sends it after the save returned (issue 21).
struct SnapshotNote {
  uint32_t slot = 0;
  uint64_t generation = 0;
  uint64_t step = 0;
  bool persist = false;              // persist it (else the agent only learns of it)
  bool leased = false;               // the client leased the slot for the persist
  SkipRanges skip;                   // tensors other ranks write (replicas); empty: every tensor
  std::optional<ReportNote> report;  // the save's report (event "save"); absent: none
};

struct WaitRequest {
  uint64_t step = 0;
  bool persisted = true;  // its persist was asked (else the wait is for replication only)
};

// The outcome of persisting `step`: OK once committed, else the error (its code is kept).
struct WaitReply {
  uint64_t step = 0;
  Status status;
};

// The outcome of a clean close or a shutdown request.
struct CloseReply {
  Status status;
};

struct ErrorReply {
  std::string error;
};

// --- peer replication ---

// Starts the agent's peer service (once per agent) listening on `bind_host`, the address of
// the interface the job uses, for node `node`.
struct PeerSetupRequest {
  std::string node;
  std::string bind_host;
  uint32_t timeout_ms = 30000;  // a peer that makes no progress this long is dropped
  // The port to listen on; 0: a free one. A client asks a new agent for the port the dead one
  // listened on, so that the address in the peers' membership stays right (issue 22).
  uint32_t port = 0;
  // The job's Checkpointer max_shm_bytes (0: none): bounds the replicas this node keeps for other
  // nodes to what the job's slots on the node leave of it (docs/operations.md, "Host memory").
  uint64_t max_shm_bytes = 0;
};
struct PeerSetupReply {
  std::string address;  // "host:port" peers connect to
};

struct AckReply {
  Status status;
};

struct PeerListRequest {
  uint32_t rank = 0;
};
struct PeerListReply {
  std::vector<PeerCopy> snapshots;  // of the rank, that the peers can rebuild
};

// Rebuild the rank's snapshot of `step` (of `attempt`) from peers into one of its slots.
struct PeerFetchRequest {
  uint32_t rank = 0;
  uint64_t step = 0;
  uint64_t attempt = 0;
  // A heal (torchft, docs/replication.md): with from_address, the rank's snapshot of `step` is
  // fetched instead straight from the agent of job `from_job` on node `from_node` that took it,
  // authenticated with that job's secret, waiting up to timeout_ms for it to be taken (`attempt`
  // is not used).
  std::string from_address, from_node, from_job, from_secret_hex;
  uint32_t timeout_ms = 0;
};
struct PeerFetchReply {
  Status status;
  uint32_t slot = 0;
  uint64_t generation = 0;
  uint64_t bytes = 0;
  std::string source;  // the nodes it came from
};

struct PauseNote {
  bool paused = false;
};

// Tiers as JSON (in the hello and in job.json): [{"uri", "every", "every_seconds", "keep"}].
nlohmann::json EncodeTiers(const std::vector<TierSpec>& tiers);
Status DecodeTiers(const nlohmann::json& j, std::vector<TierSpec>* out);

std::string Encode(const HelloRequest& m);
std::string Encode(const HelloReply& m);
std::string Encode(const SnapshotNote& m);
std::string Encode(const WaitRequest& m);
std::string Encode(const WaitReply& m);
std::string Encode(const CloseReply& m);
std::string Encode(const ErrorReply& m);
std::string Encode(const PeerSetupRequest& m);
std::string Encode(const PeerSetupReply& m);
std::string Encode(const Membership& m);
std::string Encode(const AckReply& m);
std::string Encode(const PeerListRequest& m);
std::string Encode(const PeerListReply& m);
std::string Encode(const PeerFetchRequest& m);
std::string Encode(const PeerFetchReply& m);
std::string Encode(const PauseNote& m);
std::string Encode(const ReportNote& m);

// Each returns InvalidArgument ("protocol error: ...") for a payload that is not a JSON object,
// lacks a field or has one of the wrong type. Unknown fields are ignored (newer peers).
Status Decode(std::string_view payload, EmptyRequest* out);
Status Decode(std::string_view payload, HelloRequest* out);
Status Decode(std::string_view payload, HelloReply* out);
Status Decode(std::string_view payload, SnapshotNote* out);
Status Decode(std::string_view payload, WaitRequest* out);
Status Decode(std::string_view payload, WaitReply* out);
Status Decode(std::string_view payload, CloseReply* out);
Status Decode(std::string_view payload, ErrorReply* out);
Status Decode(std::string_view payload, PeerSetupRequest* out);
Status Decode(std::string_view payload, PeerSetupReply* out);
Status Decode(std::string_view payload, Membership* out);
Status Decode(std::string_view payload, AckReply* out);
Status Decode(std::string_view payload, PeerListRequest* out);
Status Decode(std::string_view payload, PeerListReply* out);
Status Decode(std::string_view payload, PeerFetchRequest* out);
Status Decode(std::string_view payload, PeerFetchReply* out);
Status Decode(std::string_view payload, PauseNote* out);
Status Decode(std::string_view payload, ReportNote* out);

// --- framing -----------------------------------------------------------------------------------

// Encodes one frame: u32 length of the rest, u16 version, u16 type, payload.
std::string EncodeFrame(MessageType type, std::string_view payload);

// Splits a byte stream into messages; validates every frame header.
class FrameDecoder {
 public:
  void Feed(std::span<const std::byte> data);
  // The next complete message, nullopt when more bytes are needed, or an InvalidArgument error
  // for a malformed frame (wrong version, unknown type, oversized).
  Result<std::optional<Message>> Next();
  size_t buffered() const { return buf_.size() - pos_; }

 private:
  std::string buf_;
  size_t pos_ = 0;
};

// Blocking helpers for a connected socket. `timeout_s` < 0 waits forever. ReceiveMessage returns
// Cancelled on a timeout and Unavailable when the peer closed the connection.
Status SendMessage(int fd, MessageType type, std::string_view payload, double timeout_s = -1);
Result<Message> ReceiveMessage(int fd, FrameDecoder& decoder, double timeout_s);

// --- the job directory ---------------------------------------------------------------------------

std::string AgentSocketPath(const std::string& job_dir);
std::string AgentLockPath(const std::string& job_dir);
std::string AgentLogPath(const std::string& job_dir);
std::string JobConfigPath(const std::string& job_dir);
std::string EventLogPath(const std::string& job_dir);  // the default event log (events.jsonl)

// True when an agent holds the job directory's lock (a live agent); `pid` gets its pid.
bool AgentAlive(const std::string& job_dir, uint32_t* pid = nullptr);

}  // namespace safepoint::protocol
