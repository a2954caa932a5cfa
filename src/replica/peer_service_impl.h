// The UCX implementation of PeerService, shared by its three files (the contract is in
// peer_service.h, the messages in ucx_wire.h):
//   peer_service_hub.cc     the UCX hub (context, worker, progress thread), each service's
//                           listener, start and stop, and the connection plumbing both sides use
//                           (sends, closes, drops, dispatch of received messages and chunks);
//   peer_service_server.cc  the server side: accepting connections, authenticating clients,
//                           taking pushes into the ReplicaStore, answering lists and fetches;
//   peer_service_client.cc  the client side: connecting, authenticating, pushing (mirror or
//                           erasure coded), listing, fetching and rebuilding an image.
//
// One UCP context and worker per process (UcpHub), shared by every PeerService in it, and driven
// by one progress thread (UCS_THREAD_MODE_SINGLE: no other thread calls UCX). Each service has its
// own listener. Other threads hand the progress thread work through a task queue and wake it
// through an eventfd; it sleeps in poll() on that eventfd and the worker's event fd.
// Why one worker per process: UCX keys its async event handlers by file descriptor in one
// process-wide table, and UCX before 1.17 (Debian 12 ships 1.13) keeps a "missed" event of a
// handler that was removed meanwhile (openucx/ucx#9942). With two workers in one process, a socket
// that one closes and the other reuses the number of gets the stale event dispatched to the wrong
// worker, and UCX aborts (`handler->async == async`). With one worker there is one async context.
// Every connection is a
// Conn: one UCP endpoint (UCP_ERR_HANDLING_MODE_PEER, so that a dead peer fails its requests
// instead of hanging them). A client connection lives for one request (a push to one target, a
// list, a fetch of one replica): connect, authenticate, one exchange, close. The server side of a
// connection is driven entirely by the progress thread. All connection state is guarded by mu_
// (recursive: UCX may complete a request inside a call made under it); callers wait on cv_.
// Lock order: only the progress thread calls UCX (sometimes under mu_), and UCX calls back on that
// thread, sometimes under its own async lock; caller threads take mu_ but never call UCX, and UCX's
// async thread never calls back into us, so the two orders ThreadSanitizer notices (both on the
// progress thread) cannot deadlock.
//
// Private to src/replica: include only from the three files above.
#pragma once

#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/crc32c.h"
#include "base/json_fields.h"
#include "base/unique_fd.h"
#include "replica/auth.h"
#include "replica/peer_service.h"
#include "replica/ucx_wire.h"

namespace safepoint::replica::ucx {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using internal::Crc32c;
using internal::GetString;
using internal::GetU64;
using internal::StatusFromJson;
using internal::StatusToJson;

inline constexpr size_t kSendWindow = 4;    // chunks in flight per connection
inline constexpr size_t kMaxListed = 4096;  // replicas in one list reply

inline std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

inline bool GetHex(const json& j, const char* key, uint8_t* out, size_t n) {
  std::string s;
  return GetString(j, key, &s, 2 * n) && FromHex(s, out, n);
}

inline bool SameReplica(const ReplicaMeta& a, const ReplicaMeta& b) {
  return a.source_node == b.source_node && a.rank == b.rank && a.step == b.step &&
         a.complete_ns == b.complete_ns && a.kind == b.kind && a.index == b.index;
}

inline bool SameContent(const ReplicaMeta& a, const ReplicaMeta& b) {
  return SameReplica(a, b) && a.image_bytes == b.image_bytes && a.image_crc == b.image_crc &&
         a.k == b.k && a.p == b.p && a.piece_bytes == b.piece_bytes &&
         a.payload_bytes == b.payload_bytes && a.payload_crc == b.payload_crc;
}

inline std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

// The socket address of host:port (getaddrinfo; Unavailable naming the host when it fails).
Result<sockaddr_storage> ResolveAddress(const std::string& host, uint16_t port, socklen_t* len);
// "ip:port" or "[ip6]:port".
std::string FormatAddress(const sockaddr_storage& ss);

struct Message {
  MsgType type;
  json body;
};

// One UCP endpoint and what is going on over it. Guarded by PeerServiceImpl::mu_.
struct Conn {
  bool client = false;
  std::string name;  // "peer <node> (<address>)" for messages
  ucp_ep_h ep = nullptr;
  bool closing = false, closed = false;
  // Dropped: nothing more is accepted; closed when the peer closes after reading the error, or
  // after kDropGrace.
  bool dropping = false;
  Clock::time_point dropped_at;
  Status error;
  Clock::time_point last_progress = Clock::now();
  size_t outstanding = 0;     // sends in flight
  std::deque<Message> inbox;  // client: received control messages

  // Incoming bulk data: a push on the server side goes to `writer` (below; a rendezvous chunk
  // through a bounce buffer, written at its offset once its CRC matched), a fetch on the client
  // side lands straight in the memory of `sink`.
  std::span<std::byte> sink;
  std::shared_ptr<void> sink_owner;  // keeps sink valid while receives are in flight
  bool receiving_data() const { return !sink.empty() || writer != nullptr; }
  void EndSink() {
    sink = {};
    sink_owner.reset();
  }
  ChunkLayout layout;
  std::vector<uint8_t> got;          // per chunk: 0 missing, 1 arrived, 2 being received
  std::vector<uint32_t> chunk_crcs;  // per chunk that arrived: its CRC32C as it landed
  uint64_t received = 0;
  size_t receiving = 0;  // rendezvous receives in flight

  // Server side.
  enum class Auth { kHello, kAuth, kReady } auth = Auth::kHello;
  std::string client_node;
  Nonce client_nonce{}, server_nonce{};
  ReplicaMeta meta;
  std::shared_ptr<ReplicaWriter> writer;
  bool all_received = false;
  bool busy = false;  // a store operation for it runs on the store thread
  // Server side of a fetch: the replica being sent.
  std::shared_ptr<ReplicaView> view;
  // ... when it is one of this node's own snapshots (peer_service_snapshot.cc): its recorded
  // checksums and whether its slot still holds it.
  std::shared_ptr<const ServedSnapshot> served;
  ChunkLayout send_layout;
  uint64_t next_chunk = 0;
};
using ConnPtr = std::shared_ptr<Conn>;

class PeerServiceImpl;

struct SendCtx {
  PeerServiceImpl* svc;
  ConnPtr conn;
  WireHeader header;
  std::string body;
  std::shared_ptr<const void> keep;  // keeps the chunk's bytes alive
  const void* data = nullptr;
  size_t len = 0;
};

// A chunk-sized buffer that a rendezvous chunk of a push lands in before it is written to the
// replica file (PeerServiceImpl's pool reuses them).
struct Bounce {
  std::unique_ptr<std::byte[]> data;
  uint64_t bytes = 0;
};

struct RecvCtx {
  PeerServiceImpl* svc;
  ConnPtr conn;
  WireHeader header;
  std::shared_ptr<void> keep;
  Bounce bounce;  // a push's chunk: where it lands (none: a fetch's, in conn->sink)
};

// The process's UCP context, worker and progress thread (see the top of this file). Acquire()
// returns the one hub of the process, creating it on first use; the last service to release it
// (Release) tears it down.
//
// One address family per hub (`family`: AF_INET or AF_INET6, of the services' bind addresses).
// UCX's TCP transport listens for its data connections on one address per interface, chosen by
// UCX_TCP_AF_PRIO (default "inet,inet6": the IPv4 one), while the side that accepts a connection
// connects its data lane to the address the connection came from: with IPv6 peers that is an
// IPv6 address nobody listens on ("Connection refused", then "Destination is unreachable").
// An IPv6 hub therefore asks for "inet6" in its UCP configuration (unless $UCX_TCP_AF_PRIO is
// set), and a service of the other family is refused while the hub lives.
class UcpHub {
 public:
  static Result<std::shared_ptr<UcpHub>> Acquire(int family);
  static void Release(std::shared_ptr<UcpHub>& hub);
  ~UcpHub();

  ucp_worker_h worker() const { return worker_; }
  // Runs `task` on the progress thread; tasks of `owner` still queued when it unregisters are
  // dropped.
  void Submit(PeerServiceImpl* owner, std::function<void()> task);
  void Register(PeerServiceImpl* svc);
  // On the progress thread: no more callbacks or tasks for `svc` after this returns.
  void Unregister(PeerServiceImpl* svc);
  // Progress thread: an endpoint close request of `svc` to free once it completes.
  void AddClose(PeerServiceImpl* svc, void* request) { closing_.emplace_back(svc, request); }

  ucs_status_t OnAm(const void* header, size_t header_length, void* data, size_t length,
                    const ucp_am_recv_param_t* param);

 private:
  UcpHub() = default;
  Status Init();
  int family_ = AF_INET;
  void Run();
  void RunTasks();
  void ReapCloses();

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;
  internal::UniqueFd wake_fd_;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  std::mutex task_mu_;
  std::vector<std::pair<PeerServiceImpl*, std::function<void()>>> tasks_;

  std::mutex services_mu_;
  std::vector<PeerServiceImpl*> services_;                   // guarded by services_mu_
  std::vector<std::pair<PeerServiceImpl*, void*>> closing_;  // progress thread

  static std::mutex instance_mu_;
  static std::weak_ptr<UcpHub> instance_;  // guarded by instance_mu_
};

class PeerServiceImpl final : public PeerService {
 public:
  PeerServiceImpl(const PeerServiceOptions& options, ReplicaStore* store)
      : options_(options), store_(store), secret_(options.secret) {
    rate_ = options.bandwidth_bytes_per_s;
  }
  ~PeerServiceImpl() override { Stop(); }

  // Starts the service: at once (StartUcx), or, when the interface that carries bind_host is
  // down, once it is up (see bind_iface_).
  Status Init();
  Status CheckIpv6BindAddress(const sockaddr_storage& ss) const;
  // Refuses connection requests, closes every connection and stops the store thread (and a
  // deferred start that has not happened yet); the listener and the hub stay (Retire).
  // Idempotent.
  void Quiesce();
  // Quiesce, then destroys the listener and releases the hub.
  void Stop();

  std::string address() const override { return address_; }
  void SetSecret(const std::string& secret) override;
  void SetBandwidthLimit(double bytes_per_s) override {
    std::lock_guard lk(bucket_mu_);
    rate_ = bytes_per_s;
  }
  void SetPaused(bool paused) override {
    {
      std::lock_guard lk(pause_mu_);
      paused_ = paused;
    }
    pause_cv_.notify_all();
  }
  using PeerService::Push;
  Result<PushResult> Push(const SnapshotId& id, std::span<const std::byte> image,
                          const Redundancy& redundancy, const std::vector<Peer>& targets,
                          const std::function<bool()>& still_valid,
                          const RecordedCrcs& recorded) override;
  std::vector<Holding> List(const std::vector<Peer>& peers, std::optional<uint32_t> rank,
                            std::vector<Status>* errors) override;
  Status FetchImage(const std::vector<Holding>& holdings, const SnapshotId& id,
                    std::span<std::byte> image) override;
  void SetNoteHandler(NoteHandler handler) override {
    Lock lk(mu_);
    note_handler_ = std::move(handler);
  }
  std::vector<Status> Note(const std::vector<Peer>& peers, const std::string& kind,
                           const std::string& body) override;
  // peer_service_snapshot.cc
  void SetSnapshotSource(SnapshotSource source) override {
    Lock lk(mu_);
    snapshot_source_ = std::move(source);
  }
  Status FetchSnapshot(
      const SnapshotOrigin& origin, uint32_t rank, uint64_t step,
      const std::function<Result<FetchDestination>(const ReplicaMeta&)>& destination,
      ReplicaMeta* meta) override;
  PeerServiceStats stats() const override {
    PeerServiceStats s;
    s.notes_sent = notes_sent_;
    s.notes_received = notes_received_;
    s.note_connections = note_connections_;
    s.replicas_received = replicas_received_;
    s.bytes_received = bytes_received_;
    s.pushes = pushes_;
    s.bytes_sent = bytes_sent_;
    s.peers_rejected = peers_rejected_;
    s.transfers_failed = transfers_failed_;
    return s;
  }

  // UCX callbacks (progress thread; OnConnRequest in peer_service_server.cc, the rest in
  // peer_service_hub.cc).
  void OnConnRequest(ucp_conn_request_h request);
  void OnEpError(ucp_ep_h ep, ucs_status_t status);
  // Nothing when the message did not come over one of this service's endpoints.
  std::optional<ucs_status_t> OnAm(const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param);
  // Progress thread, from the hub.
  void CheckIdle();
  void CloseReaped();
  void OnSendDone(SendCtx* ctx, ucs_status_t status);
  void OnRecvDone(RecvCtx* ctx, ucs_status_t status);

 private:
  using Lock = std::unique_lock<std::recursive_mutex>;

  // Progress thread (peer_service_hub.cc; HandleServer, PumpFetch, Offload and RunStore in
  // peer_service_server.cc).
  void Submit(std::function<void()> task) { hub_->Submit(this, std::move(task)); }
  // Runs `task` on the progress thread and waits for it.
  void RunOnProgressThread(const std::function<void()>& task);
  void SendNow(const ConnPtr& c, const WireHeader& h, std::string body, const void* data,
               size_t len, std::shared_ptr<const void> keep);
  void SendCtxNow(SendCtx* ctx);
  void SendControlNow(const ConnPtr& c, MsgType type, const json& body);
  void CloseNow(const ConnPtr& c, const Status& why);
  void Drop(const ConnPtr& c, const Status& why, bool tell_peer);
  void HandleServer(const ConnPtr& c, MsgType type, const json& body);
  void HandleChunk(const ConnPtr& c, const WireHeader& h, void* data,
                   const ucp_am_recv_param_t* param);
  // A chunk landed at `landed` (in the sink, or a bounce buffer): its CRC is checked and, for a
  // push, it is written to the replica file. Both run on the progress thread under mu_ (a chunk
  // of 4 MiB into tmpfs: about a millisecond; a replica directory on a disk whose writeback
  // throttles would hold the other connections for that long).
  void ChunkArrived(const ConnPtr& c, const WireHeader& h, const std::byte* landed);
  Bounce TakeBounce(uint64_t bytes);  // under mu_
  void GiveBounce(Bounce b);          // locks mu_
  void PumpFetch(const ConnPtr& c);
  // peer_service_snapshot.cc, progress thread under mu_: a kFetchSnapshot request; and, for
  // PumpFetch of a served snapshot, whether its slot still holds it (else the connection is
  // dropped: superseded) and the CRC a chunk is sent with (the recorded one where there is one).
  void ServeSnapshot(const ConnPtr& c, const json& body);
  bool ServedStillValid(const ConnPtr& c);
  uint32_t ServedChunkCrc(const Conn& c, uint64_t offset, const std::byte* p, uint64_t len) const;
  // Runs `work` on the store thread (no lock held), then `then` on the progress thread under mu_
  // unless the connection was dropped meanwhile. The connection is busy until then.
  void Offload(const ConnPtr& c, std::function<void()> work, std::function<void()> then);
  void RunStore();

  // Acquires the hub, listens on bind_addr_ and starts the store thread; undoes what it did
  // when it fails (Init's caller, or the starter thread, which tries again).
  Status StartUcx();
  // The starter thread of a deferred start: waits until bind_iface_ is up, then StartUcx.
  void AwaitInterface();

  // Caller threads (peer_service_client.cc).
  // `as`: the job and secret to authenticate with (another job's peer); default: this service's.
  Result<ConnPtr> Connect(const Peer& peer, const SnapshotOrigin* as = nullptr);
  void SendControl(const ConnPtr& c, MsgType type, json body);
  void SendChunk(const ConnPtr& c, uint64_t offset, std::span<const std::byte> bytes, uint32_t crc,
                 std::shared_ptr<const void> keep);
  Status WaitUntil(const ConnPtr& c, const std::function<bool()>& done);
  Result<json> WaitMessage(const ConnPtr& c, MsgType expected);
  void Close(const ConnPtr& c);
  // The bytes of chunk i of one target's payload, and what keeps them alive.
  struct Chunk {
    std::span<const std::byte> bytes;
    std::shared_ptr<const void> keep;
    uint32_t crc = 0;  // CRC32C of bytes
  };
  using ChunkOf = std::function<Chunk(uint64_t chunk)>;
  // Sends meta's payload to `target`; the CRCs travel with the commit: the payload's folded from
  // its chunks', the image's from image_crc_of(payload CRC) once every chunk was sent.
  Status PushOne(const Peer& target, const ReplicaMeta& meta, uint64_t chunk_bytes,
                 const ChunkOf& chunk_of, const std::function<uint32_t(uint32_t)>& image_crc_of,
                 const std::function<bool()>& still_valid, double* paused_seconds);
  Status FetchOne(const Holding& holding, std::span<std::byte> dest,
                  std::shared_ptr<void> dest_owner);
  // peer_service_notes.cc: a note over the connection kept for its peer (NoteLink).
  struct NoteLink;
  std::shared_ptr<NoteLink> NoteLinkFor(const std::string& node);
  bool Reusable(const ConnPtr& c);
  Status NoteOne(const Peer& peer, const std::string& kind, const std::string& body);
  bool StillValid(const std::function<bool()>& still_valid) {
    std::lock_guard lk(valid_mu_);
    return !still_valid || still_valid();
  }
  // Blocks while paused and until the bandwidth cap allows `bytes`; returns the seconds waited.
  Result<double> Throttle(const ConnPtr& c, uint64_t bytes,
                          const std::function<bool()>& still_valid, const Status& cancelled);
  std::chrono::nanoseconds timeout() const {
    return std::chrono::nanoseconds(static_cast<int64_t>(options_.timeout_s * 1e9));
  }

  const PeerServiceOptions options_;
  ReplicaStore* const store_;
  std::string address_;  // set by Init, never changed after
  sockaddr_storage bind_addr_{};
  socklen_t bind_len_ = 0;

  // A deferred start (docs/reliability.md, OPEN-4). UCX's context knows the network interfaces
  // that were up when it was made (ucp_init), and refuses for good a connection request that
  // arrives on another one ("a device eth0 which was not present during UCP initialization"),
  // and cannot send over one either. An agent started while its node's link was down would
  // never reach its peers once the link is back. So when the interface that carries bind_host
  // is down (UCX's own test: ucs_netif_is_active), Init returns at once with the address
  // (bind_host and the port asked for, or a free one for port 0; port_reservation_ holds it
  // until the listener takes it) and UCX starts only once the interface is up (starter_; until
  // then a request fails with Unavailable). ucx_ready_: the hub, listener and store thread
  // exist.
  std::string bind_iface_;               // the interface awaited; set before starter_ starts
  internal::UniqueFd port_reservation_;  // a bound socket holding the deferred start's port
  std::thread starter_;
  std::mutex starter_mu_;
  std::condition_variable starter_cv_;
  bool starter_stop_ = false;  // guarded by starter_mu_
  std::atomic<bool> ucx_ready_{false};

  std::shared_ptr<UcpHub> hub_;
  ucp_listener_h listener_ = nullptr;  // progress thread
  std::atomic<bool> stop_{false};

  // Store operations that take long (reserve, commit, read) run on their own thread, in order.
  std::thread store_thread_;
  std::mutex store_mu_;
  std::condition_variable store_cv_;
  std::deque<std::function<void()>> store_tasks_;
  bool store_stop_ = false;

  std::recursive_mutex mu_;
  std::condition_variable_any cv_;
  std::string secret_;                         // guarded by mu_
  NoteHandler note_handler_;                   // guarded by mu_
  std::unordered_map<ucp_ep_h, ConnPtr> eps_;  // guarded by mu_
  size_t closes_pending_ = 0;                  // guarded by mu_: ep closes the hub still reaps
  size_t requests_pending_ = 0;                // guarded by mu_: SendCtx and RecvCtx alive
  // Bounce buffers free for the next rendezvous chunk of a push, all of one size; at most
  // kSendWindow per push being received are kept, and none once the service quiesced (guarded
  // by mu_).
  std::vector<Bounce> bounces_;
  // Where a kFetchSnapshot finds this node's own snapshots (SetSnapshotSource; guarded by mu_).
  SnapshotSource snapshot_source_;

  std::mutex valid_mu_;
  std::mutex pause_mu_;
  std::condition_variable pause_cv_;
  bool paused_ = false;
  std::mutex bucket_mu_;
  double rate_ = 0, tokens_ = 0;
  Clock::time_point bucket_time_ = Clock::now();

  // Notes' kept connections, by node (peer_service_notes.cc).
  std::mutex note_links_mu_;
  std::unordered_map<std::string, std::shared_ptr<NoteLink>> note_links_;

  std::atomic<uint64_t> replicas_received_{0}, bytes_received_{0}, pushes_{0}, bytes_sent_{0},
      peers_rejected_{0}, transfers_failed_{0}, notes_sent_{0}, notes_received_{0},
      note_connections_{0};
};

// The error handler of every endpoint (arg: the PeerServiceImpl).
void EpErrorCb(void* arg, ucp_ep_h ep, ucs_status_t status);

}  // namespace safepoint::replica::ucx
