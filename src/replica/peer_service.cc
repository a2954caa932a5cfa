// PeerService over UCX (UCP active messages). See peer_service.h for the contract and ucx_wire.h
// for the messages.
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
#include "replica/peer_service.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <unordered_map>

#include "base/crc32c.h"
#include "base/log.h"
#include "base/unique_fd.h"
#include "replica/auth.h"
#include "replica/erasure.h"
#include "replica/ucx_wire.h"

namespace safepoint::replica {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using internal::Crc32c;

constexpr uint16_t kAmId = 17;
constexpr size_t kSendWindow = 4;                     // chunks in flight per connection
constexpr size_t kMaxServerConns = 256;               // accepted connections at once
constexpr size_t kMaxListed = 4096;                   // replicas in one list reply
constexpr auto kDropGrace = std::chrono::seconds(1);  // for the error message of a dropped peer
// No shared-memory transport ("sm": posix, sysv, cma, knem, xpmem): peers are other hosts (in
// tests, other network namespaces, which shared memory would cross). $UCX_TLS overrides.
constexpr const char* kDefaultTls = "^sm";

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

bool GetString(const json& j, const char* key, std::string* out, size_t max = 256) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return false;
  *out = it->get<std::string>();
  return out->size() <= max;
}

bool GetU64(const json& j, const char* key, uint64_t* out) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned()) return false;
  *out = it->get<uint64_t>();
  return true;
}

bool GetHex(const json& j, const char* key, uint8_t* out, size_t n) {
  std::string s;
  return GetString(j, key, &s, 2 * n) && FromHex(s, out, n);
}

bool SameReplica(const ReplicaMeta& a, const ReplicaMeta& b) {
  return a.source_node == b.source_node && a.rank == b.rank && a.step == b.step &&
         a.complete_ns == b.complete_ns && a.kind == b.kind && a.index == b.index;
}

bool SameContent(const ReplicaMeta& a, const ReplicaMeta& b) {
  return SameReplica(a, b) && a.image_bytes == b.image_bytes && a.image_crc == b.image_crc &&
         a.k == b.k && a.p == b.p && a.piece_bytes == b.piece_bytes &&
         a.payload_bytes == b.payload_bytes && a.payload_crc == b.payload_crc;
}

Status StatusFromJson(const json& j, const std::string& peer) {
  uint64_t code = 0;
  std::string message;
  if (!GetU64(j, "code", &code) || !GetString(j, "message", &message, 4096) || code == 0 ||
      code > static_cast<uint64_t>(StatusCode::kAlreadyExists))
    return Corruption(peer + ": malformed error message");
  return Status(static_cast<StatusCode>(code), peer + ": " + message);
}

json StatusToJson(const Status& s) {
  return {{"code", static_cast<int>(s.code())}, {"message", s.message()}};
}

Result<sockaddr_storage> ResolveAddress(const std::string& host, uint16_t port, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0 || !res)
    return Unavailable("cannot resolve " + host + ": " + gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return ss;
}

// "host:port" or "[v6]:port".
bool SplitAddress(const std::string& address, std::string* host, uint16_t* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  std::string h = address.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  char* end = nullptr;
  const std::string p = address.substr(colon + 1);
  const unsigned long v = std::strtoul(p.c_str(), &end, 10);
  if (p.empty() || *end != '\0' || v == 0 || v > 65535) return false;
  *host = h;
  *port = static_cast<uint16_t>(v);
  return true;
}

std::string FormatAddress(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN + 16] = {};
  if (ss.ss_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
    char ip[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &in->sin_addr, ip, sizeof ip);
    std::snprintf(buf, sizeof buf, "%s:%u", ip, static_cast<unsigned>(ntohs(in->sin_port)));
  } else {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
    char ip[INET6_ADDRSTRLEN] = {};
    inet_ntop(AF_INET6, &in6->sin6_addr, ip, sizeof ip);
    std::snprintf(buf, sizeof buf, "[%s]:%u", ip, static_cast<unsigned>(ntohs(in6->sin6_port)));
  }
  return buf;
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

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

  // Incoming bulk data (push on the server side, fetch on the client side).
  std::span<std::byte> sink;
  std::shared_ptr<void> sink_owner;  // keeps sink valid while receives are in flight
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
  ChunkLayout send_layout;
  uint64_t next_chunk = 0;
};
using ConnPtr = std::shared_ptr<Conn>;

// The encoded stripes of an image being pushed with ec:K+P: stripe s holds piece f of every
// fragment at f * piece_bytes. Targets progress at their own pace; the newest few stripes are
// cached, an older one a slow target still needs is encoded again (memory stays bounded).
class StripeSource {
 public:
  StripeSource(const EcLayout& layout, const EcCodec* codec, std::span<const std::byte> image)
      : layout_(layout), codec_(codec), image_(image) {}

  struct Stripe {
    std::vector<std::byte> bytes;  // piece f at f * piece_bytes
    std::vector<uint32_t> crcs;    // CRC32C of each piece
  };

  std::shared_ptr<const Stripe> Get(uint64_t stripe) {
    std::lock_guard lk(mu_);
    if (auto it = cache_.find(stripe); it != cache_.end()) return it->second;
    auto buf = Encode(stripe);
    if (!image_crcs_[stripe]) {
      // The stripe's share of the image CRC: its data pieces' CRCs, unless the image ends in it
      // (then the bytes themselves: the pieces are zero-padded).
      const uint64_t begin = stripe * layout_.stripe_bytes();
      const uint64_t len = std::min(layout_.stripe_bytes(), layout_.image_bytes - begin);
      uint32_t crc = 0;
      if (len == layout_.stripe_bytes()) {
        for (uint32_t f = 0; f < layout_.k; ++f)
          crc = Crc32cCombine(crc, buf->crcs[f], layout_.piece_bytes);
      } else {
        crc = Crc32c(0, image_.data() + begin, len);
      }
      image_crcs_[stripe] = crc;
    }
    while (cache_.size() >= kCachedStripes) cache_.erase(cache_.begin());
    cache_[stripe] = buf;
    return buf;
  }

  // The image's CRC32C, once every stripe was encoded (a target has been sent all of its
  // chunks).
  uint32_t ImageCrc() {
    std::lock_guard lk(mu_);
    uint32_t crc = 0;
    for (uint64_t s = 0; s < layout_.stripes(); ++s) {
      const uint64_t begin = s * layout_.stripe_bytes();
      const uint64_t len = std::min(layout_.stripe_bytes(), layout_.image_bytes - begin);
      const uint32_t part =
          image_crcs_[s] ? *image_crcs_[s] : Crc32c(0, image_.data() + begin, len);
      crc = Crc32cCombine(crc, part, len);
    }
    return crc;
  }

 private:
  static constexpr size_t kCachedStripes = 2 * 4;  // 2 * kSendWindow

  std::shared_ptr<Stripe> Encode(uint64_t stripe) const {
    const uint32_t n = layout_.k + layout_.p;
    auto buf = std::make_shared<Stripe>();
    buf->bytes.resize(n * layout_.piece_bytes);
    std::vector<std::byte*> out(n);
    for (uint32_t f = 0; f < n; ++f) out[f] = buf->bytes.data() + f * layout_.piece_bytes;
    codec_->EncodeStripe(layout_, image_, stripe, out);
    for (uint32_t f = 0; f < n; ++f) buf->crcs.push_back(Crc32c(0, out[f], layout_.piece_bytes));
    return buf;
  }

  const EcLayout layout_;
  const EcCodec* const codec_;
  const std::span<const std::byte> image_;
  std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<const Stripe>> cache_;
  std::vector<std::optional<uint32_t>> image_crcs_ =
      std::vector<std::optional<uint32_t>>(layout_.stripes());  // per stripe, once encoded
};

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

struct RecvCtx {
  PeerServiceImpl* svc;
  ConnPtr conn;
  WireHeader header;
  std::shared_ptr<void> keep;
};

// The process's UCP context, worker and progress thread (see the top of this file). Acquire()
// returns the one hub of the process, creating it on first use; the last service to release it
// (Release) tears it down.
class UcpHub {
 public:
  static Result<std::shared_ptr<UcpHub>> Acquire();
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

  Status Init();
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
  Result<PushResult> Push(const SnapshotId& id, std::span<const std::byte> image,
                          const Redundancy& redundancy, const std::vector<Peer>& targets,
                          const std::function<bool()>& still_valid) override;
  std::vector<Holding> List(const std::vector<Peer>& peers, std::optional<uint32_t> rank,
                            std::vector<Status>* errors) override;
  Status FetchImage(const std::vector<Holding>& holdings, const SnapshotId& id,
                    std::span<std::byte> image) override;
  PeerServiceStats stats() const override {
    PeerServiceStats s;
    s.replicas_received = replicas_received_;
    s.bytes_received = bytes_received_;
    s.pushes = pushes_;
    s.bytes_sent = bytes_sent_;
    s.peers_rejected = peers_rejected_;
    s.transfers_failed = transfers_failed_;
    return s;
  }

  // UCX callbacks (progress thread).
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

  // Progress thread.
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
  void ChunkArrived(const ConnPtr& c, const WireHeader& h);
  void PumpFetch(const ConnPtr& c);
  // Runs `work` on the store thread (no lock held), then `then` on the progress thread under mu_
  // unless the connection was dropped meanwhile. The connection is busy until then.
  void Offload(const ConnPtr& c, std::function<void()> work, std::function<void()> then);
  void RunStore();

  // Caller threads.
  Result<ConnPtr> Connect(const Peer& peer);
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
  std::string address_;

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
  std::unordered_map<ucp_ep_h, ConnPtr> eps_;  // guarded by mu_
  size_t closes_pending_ = 0;                  // guarded by mu_: ep closes the hub still reaps
  size_t requests_pending_ = 0;                // guarded by mu_: SendCtx and RecvCtx alive

  std::mutex valid_mu_;
  std::mutex pause_mu_;
  std::condition_variable pause_cv_;
  bool paused_ = false;
  std::mutex bucket_mu_;
  double rate_ = 0, tokens_ = 0;
  Clock::time_point bucket_time_ = Clock::now();

  std::atomic<uint64_t> replicas_received_{0}, bytes_received_{0}, pushes_{0}, bytes_sent_{0},
      peers_rejected_{0}, transfers_failed_{0};
};

// ---- UCX trampolines ----

void ConnRequestCb(ucp_conn_request_h request, void* arg) {
  static_cast<PeerServiceImpl*>(arg)->OnConnRequest(request);
}
void EpErrorCb(void* arg, ucp_ep_h ep, ucs_status_t status) {
  static_cast<PeerServiceImpl*>(arg)->OnEpError(ep, status);
}
ucs_status_t AmCb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                  const ucp_am_recv_param_t* param) {
  return static_cast<UcpHub*>(arg)->OnAm(header, header_length, data, length, param);
}
void SendCb(void* request, ucs_status_t status, void* user_data) {
  auto* ctx = static_cast<SendCtx*>(user_data);
  ctx->svc->OnSendDone(ctx, status);
  ucp_request_free(request);
}
void RecvCb(void* request, ucs_status_t status, size_t length, void* user_data) {
  auto* ctx = static_cast<RecvCtx*>(user_data);
  ctx->svc->OnRecvDone(ctx, status);
  ucp_request_free(request);
}

// ---- The hub ----

std::mutex UcpHub::instance_mu_;
std::weak_ptr<UcpHub> UcpHub::instance_;

Result<std::shared_ptr<UcpHub>> UcpHub::Acquire() {
  std::lock_guard lk(instance_mu_);
  if (auto hub = instance_.lock()) return hub;
  std::shared_ptr<UcpHub> hub(new UcpHub());
  SP_RETURN_IF_ERROR(hub->Init());
  instance_ = hub;
  return hub;
}

// Under instance_mu_: a hub being torn down and a new one never exist at once.
void UcpHub::Release(std::shared_ptr<UcpHub>& hub) {
  std::lock_guard lk(instance_mu_);
  hub.reset();
}

Status UcpHub::Init() {
  int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (efd < 0) return ErrnoStatus("eventfd", "peer service", errno);
  wake_fd_ = internal::UniqueFd(efd);

  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK)
    return Unavailable("UCX: ucp_config_read: " + UcsError(s));
  if (std::getenv("UCX_TLS") == nullptr) ucp_config_modify(config, "TLS", kDefaultTls);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = "safepoint-peer";
  ucs_status_t s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) return Unavailable("UCX: ucp_init: " + UcsError(s));

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (s = ucp_worker_create(context_, &wp, &worker_); s != UCS_OK)
    return Unavailable("UCX: ucp_worker_create: " + UcsError(s));
  if (s = ucp_worker_get_efd(worker_, &worker_fd_); s != UCS_OK)
    return Unavailable("UCX: ucp_worker_get_efd: " + UcsError(s));

  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  hp.id = kAmId;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  hp.cb = AmCb;
  hp.arg = this;
  if (s = ucp_worker_set_am_recv_handler(worker_, &hp); s != UCS_OK)
    return Unavailable("UCX: ucp_worker_set_am_recv_handler: " + UcsError(s));
  thread_ = std::thread([this] { Run(); });
  return Status::OK();
}

UcpHub::~UcpHub() {
  if (thread_.joinable()) {
    stop_ = true;
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof one);
    thread_.join();
  }
  // Every service waited for its closes before it unregistered: nothing is left to reap.
  if (worker_) ucp_worker_destroy(worker_);
  if (context_) ucp_cleanup(context_);
}

void UcpHub::Submit(PeerServiceImpl* owner, std::function<void()> task) {
  {
    std::lock_guard lk(task_mu_);
    tasks_.emplace_back(owner, std::move(task));
  }
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof one);
}

void UcpHub::Register(PeerServiceImpl* svc) {
  std::lock_guard lk(services_mu_);
  services_.push_back(svc);
}

void UcpHub::Unregister(PeerServiceImpl* svc) {
  {
    std::lock_guard lk(services_mu_);
    std::erase(services_, svc);
  }
  std::lock_guard lk(task_mu_);
  std::erase_if(tasks_, [svc](const auto& t) { return t.first == svc; });
}

ucs_status_t UcpHub::OnAm(const void* header, size_t header_length, void* data, size_t length,
                          const ucp_am_recv_param_t* param) {
  const bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
  // Not one of ours (a reply endpoint is always sent), or for an endpoint closed meanwhile.
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || param->reply_ep == nullptr)
    return rndv ? UCS_ERR_CANCELED : UCS_OK;
  std::lock_guard lk(services_mu_);
  for (PeerServiceImpl* svc : services_) {
    if (auto handled = svc->OnAm(header, header_length, data, length, param)) return *handled;
  }
  return rndv ? UCS_ERR_CANCELED : UCS_OK;
}

void UcpHub::RunTasks() {
  std::vector<std::pair<PeerServiceImpl*, std::function<void()>>> tasks;
  {
    std::lock_guard lk(task_mu_);
    tasks.swap(tasks_);
  }
  for (auto& [owner, task] : tasks) task();
}

void UcpHub::Run() {
  auto last_check = Clock::now();
  while (!stop_) {
    RunTasks();
    while (ucp_worker_progress(worker_) != 0) {
    }
    ReapCloses();
    if (Clock::now() - last_check > std::chrono::milliseconds(100)) {
      std::vector<PeerServiceImpl*> services;
      {
        std::lock_guard lk(services_mu_);
        services = services_;
      }
      // Only this thread unregisters a service, so none of these goes away meanwhile.
      for (PeerServiceImpl* svc : services) svc->CheckIdle();
      last_check = Clock::now();
    }
    {
      std::lock_guard lk(task_mu_);
      if (!tasks_.empty()) continue;
    }
    const ucs_status_t s = ucp_worker_arm(worker_);
    if (s == UCS_ERR_BUSY) continue;
    pollfd fds[2] = {{wake_fd_.get(), POLLIN, 0}, {worker_fd_, POLLIN, 0}};
    ::poll(fds, 2, closing_.empty() ? 100 : 1);
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] ssize_t n = ::read(wake_fd_.get(), &v, sizeof v);
    }
  }
}

void UcpHub::ReapCloses() {
  for (size_t i = 0; i < closing_.size();) {
    if (ucp_request_check_status(closing_[i].second) != UCS_INPROGRESS) {
      ucp_request_free(closing_[i].second);
      closing_[i].first->CloseReaped();
      closing_[i] = closing_.back();
      closing_.pop_back();
    } else {
      ++i;
    }
  }
}

// ---- Start and stop ----

Status PeerServiceImpl::Init() {
  if (options_.secret.size() < kMinSecretBytes)
    return InvalidArgument("peer service: the job's secret must be at least " +
                           std::to_string(kMinSecretBytes) + " bytes");
  if (options_.chunk_bytes < kMinChunkBytes || options_.chunk_bytes > kMaxChunkBytes)
    return InvalidArgument("peer service: chunk_bytes " + std::to_string(options_.chunk_bytes) +
                           " outside [" + std::to_string(kMinChunkBytes) + ", " +
                           std::to_string(kMaxChunkBytes) + "]");
  if (options_.chunk_bytes % 64 != 0)
    return InvalidArgument(
        "peer service: chunk_bytes must be a multiple of 64 (it is also the "
        "erasure code's piece size)");
  if (!(options_.timeout_s > 0)) return InvalidArgument("peer service: timeout_s must be > 0");
  socklen_t len = 0;
  SP_ASSIGN_OR_RETURN(sockaddr_storage bind_addr,
                      ResolveAddress(options_.bind_host, options_.port, &len));
  Result<std::shared_ptr<UcpHub>> hub = UcpHub::Acquire();
  if (!hub.ok()) {
    const char* tls = std::getenv("UCX_TLS");
    return Status(
        hub.status().code(),
        "peer service of node " + options_.node + ": " + hub.status().message() +
            " (UCX_TLS=" + (tls ? tls : std::string("unset, safepoint asks for ") + kDefaultTls) +
            "; UCX_NET_DEVICES chooses the interfaces)");
  }
  hub_ = std::move(*hub);
  hub_->Register(this);

  Status listening;
  RunOnProgressThread([&] {
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&bind_addr);
    lp.sockaddr.addrlen = len;
    lp.conn_handler.cb = ConnRequestCb;
    lp.conn_handler.arg = this;
    if (ucs_status_t s = ucp_listener_create(hub_->worker(), &lp, &listener_); s != UCS_OK) {
      listener_ = nullptr;
      listening = Unavailable("UCX: cannot listen on " + options_.bind_host + ":" +
                              std::to_string(options_.port) + ": " + UcsError(s));
      return;
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucs_status_t s = ucp_listener_query(listener_, &la); s != UCS_OK) {
      listening = Unavailable("UCX: ucp_listener_query: " + UcsError(s));
      return;
    }
    address_ = FormatAddress(la.sockaddr);
  });
  SP_RETURN_IF_ERROR(listening);  // Stop (from the destructor) destroys a listener made
  store_thread_ = std::thread([this] { RunStore(); });
  spdlog::info("peer service of node {} listening on {}", options_.node, address_);
  return Status::OK();
}

void PeerServiceImpl::RunOnProgressThread(const std::function<void()>& task) {
  std::promise<void> done;
  hub_->Submit(this, [&] {
    task();
    done.set_value();
  });
  done.get_future().wait();
}

void PeerServiceImpl::Stop() {
  if (store_thread_.joinable()) {
    {
      std::lock_guard lk(store_mu_);
      store_stop_ = true;
    }
    store_cv_.notify_all();
    store_thread_.join();
  }
  if (!hub_) return;
  stop_ = true;
  pause_cv_.notify_all();
  // Stop listening and force-close what is left, then wait until UCX no longer holds a request
  // or an endpoint that calls back into this service (force closes are local: quick).
  RunOnProgressThread([this] {
    if (listener_) ucp_listener_destroy(listener_);
    listener_ = nullptr;
    std::vector<ConnPtr> conns;
    {
      Lock lk(mu_);
      for (auto& [ep, c] : eps_) conns.push_back(c);
    }
    for (auto& c : conns) CloseNow(c, Cancelled("peer service stopped"));
  });
  {
    Lock lk(mu_);
    while (!cv_.wait_for(lk, std::chrono::seconds(10),
                         [&] { return closes_pending_ == 0 && requests_pending_ == 0; })) {
      spdlog::warn("peer service of node {}: still waiting for {} closes and {} requests of UCX",
                   options_.node, closes_pending_, requests_pending_);
    }
  }
  RunOnProgressThread([this] { hub_->Unregister(this); });
  UcpHub::Release(hub_);
}

void PeerServiceImpl::CloseReaped() {
  Lock lk(mu_);
  --closes_pending_;
  cv_.notify_all();
}

// Server connections that made no progress for timeout_s are dropped (a client that stalls or
// never authenticates cannot hold a connection or a reserved replica file).
void PeerServiceImpl::CheckIdle() {
  Lock lk(mu_);
  std::vector<ConnPtr> idle;
  const auto now = Clock::now();
  std::vector<ConnPtr> late;
  for (auto& [ep, c] : eps_) {
    if (c->dropping && now - c->dropped_at > kDropGrace)
      late.push_back(c);
    else if (!c->client && !c->dropping && !c->busy && now - c->last_progress > timeout())
      idle.push_back(c);
  }
  for (auto& c : late) CloseNow(c, c->error);
  for (auto& c : idle) {
    if (c->writer) ++transfers_failed_;
    Drop(c, Unavailable(c->name + ": no progress for " + Seconds(options_.timeout_s) + " s"),
         /*tell_peer=*/false);
  }
}

void PeerServiceImpl::SendNow(const ConnPtr& c, const WireHeader& h, std::string body,
                              const void* data, size_t len, std::shared_ptr<const void> keep) {
  auto* ctx = new SendCtx{this, c, h, std::move(body), std::move(keep)};
  {
    Lock lk(mu_);
    ++requests_pending_;
  }
  if (static_cast<MsgType>(h.type) == MsgType::kChunk) {
    ctx->data = data;
    ctx->len = len;
  }
  SendCtxNow(ctx);
}

void PeerServiceImpl::SendCtxNow(SendCtx* ctx) {
  Lock lk(mu_);
  Conn& c = *ctx->conn;
  if (c.ep == nullptr || c.closing) {
    lk.unlock();
    OnSendDone(ctx, UCS_ERR_CANCELED);
    return;
  }
  const bool control = static_cast<MsgType>(ctx->header.type) != MsgType::kChunk;
  if (control) {
    ctx->data = ctx->body.data();
    ctx->len = ctx->body.size();
  }
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY | (control ? UCP_AM_SEND_FLAG_EAGER : 0);
  p.cb.send = SendCb;
  p.user_data = ctx;
  ucs_status_ptr_t r =
      ucp_am_send_nbx(c.ep, kAmId, &ctx->header, sizeof ctx->header, ctx->data, ctx->len, &p);
  if (r == nullptr) {
    OnSendDone(ctx, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    OnSendDone(ctx, UCS_PTR_STATUS(r));
  }  // else the callback frees the request (freeing it now would cancel the callback)
}

void PeerServiceImpl::SendControlNow(const ConnPtr& c, MsgType type, const json& body) {
  std::string text = body.dump();
  {
    Lock lk(mu_);
    ++c->outstanding;
  }
  const WireHeader h = ControlHeader(type, text.size());
  SendNow(c, h, std::move(text), nullptr, 0, nullptr);
}

void PeerServiceImpl::OnSendDone(SendCtx* ctx, ucs_status_t status) {
  std::unique_ptr<SendCtx> owned(ctx);
  Lock lk(mu_);
  --requests_pending_;
  Conn& c = *ctx->conn;
  if (c.outstanding > 0) --c.outstanding;
  if (status == UCS_OK) {
    c.last_progress = Clock::now();
    if (!c.client && c.view) PumpFetch(ctx->conn);
  } else if (c.error.ok()) {
    c.error = Unavailable(c.name + ": send failed: " + UcsError(status));
  }
  cv_.notify_all();
}

void PeerServiceImpl::CloseNow(const ConnPtr& c, const Status& why) {
  Lock lk(mu_);
  if (c->error.ok()) c->error = why;
  if (c->closing) return;
  c->closing = true;
  c->writer.reset();  // an uncommitted replica file is removed
  c->view.reset();
  ucp_ep_h ep = c->ep;
  if (ep != nullptr) {
    eps_.erase(ep);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
      hub_->AddClose(this, r);
      ++closes_pending_;
    }
    c->ep = nullptr;
  }
  c->closed = true;
  cv_.notify_all();
}

void PeerServiceImpl::Drop(const ConnPtr& c, const Status& why, bool tell_peer) {
  Lock lk(mu_);
  if (c->dropping || c->closing) return;
  spdlog::warn("peer service: dropping {}: {}", c->name, why.ToString());
  c->dropping = true;
  c->dropped_at = Clock::now();
  if (c->error.ok()) c->error = why;
  c->writer.reset();  // an unfinished replica file is removed
  c->view.reset();
  c->sink = {};
  cv_.notify_all();
  if (tell_peer && c->ep != nullptr) {
    // Not closed yet: closing could overtake the error (UCX signals the disconnect on another
    // channel than the data). The peer closes when it has read it, or CheckIdle after kDropGrace.
    std::string text = StatusToJson(why).dump();
    const WireHeader h = ControlHeader(MsgType::kError, text.size());
    ++c->outstanding;
    ++requests_pending_;
    SendCtxNow(new SendCtx{this, c, h, std::move(text), nullptr});
  } else {
    Submit([this, c, why] { CloseNow(c, why); });
  }
}

// ---- Server side ----

void PeerServiceImpl::OnConnRequest(ucp_conn_request_h request) {
  Lock lk(mu_);
  size_t servers = 0;
  for (auto& [ep, c] : eps_) servers += !c->client;
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string from = "peer at ?";
  if (ucp_conn_request_query(request, &attr) == UCS_OK)
    from = "peer at " + FormatAddress(attr.client_address);
  if (stop_ || servers >= kMaxServerConns) {
    spdlog::warn("peer service: refusing {}: {} connections open", from, servers);
    ucp_listener_reject(listener_, request);
    return;
  }
  auto c = std::make_shared<Conn>();
  c->name = from;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = request;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = EpErrorCb;
  ep.err_handler.arg = this;
  if (ucs_status_t s = ucp_ep_create(hub_->worker(), &ep, &c->ep); s != UCS_OK) {
    spdlog::warn("peer service: cannot accept {}: {}", from, UcsError(s));
    return;
  }
  eps_[c->ep] = c;
}

void PeerServiceImpl::OnEpError(ucp_ep_h ep, ucs_status_t status) {
  Lock lk(mu_);
  auto it = eps_.find(ep);
  if (it == eps_.end()) return;
  ConnPtr c = it->second;
  if (!c->client && c->writer) ++transfers_failed_;
  Status why = Unavailable(c->name + ": connection failed: " + UcsError(status));
  if (c->error.ok()) c->error = why;
  c->writer.reset();
  c->view.reset();
  cv_.notify_all();
  Submit([this, c, why] { CloseNow(c, why); });
}

std::optional<ucs_status_t> PeerServiceImpl::OnAm(const void* header, size_t header_length,
                                                  void* data, size_t length,
                                                  const ucp_am_recv_param_t* param) {
  Lock lk(mu_);
  auto it = eps_.find(param->reply_ep);
  if (it == eps_.end()) return std::nullopt;  // another service's, or closed meanwhile
  if (it->second->closing || it->second->dropping)
    return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? UCS_ERR_CANCELED : UCS_OK;
  ConnPtr c = it->second;
  const bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
  Result<WireHeader> h = ParseHeader(header, header_length, length);
  if (!h.ok()) {
    ++peers_rejected_;
    Drop(c, h.status().WithContext(c->name), /*tell_peer=*/true);
    return rndv ? UCS_ERR_CANCELED : UCS_OK;
  }
  const MsgType type = static_cast<MsgType>(h->type);
  if (type == MsgType::kChunk) {
    HandleChunk(c, *h, data, param);
    return UCS_OK;
  }
  if (rndv) {
    ++peers_rejected_;
    Drop(c, Corruption(c->name + ": control message not sent eagerly"), true);
    return UCS_ERR_CANCELED;
  }
  json body = json::parse(static_cast<const char*>(data), static_cast<const char*>(data) + length,
                          nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object()) {
    ++peers_rejected_;
    Drop(c, Corruption(c->name + ": " + MsgTypeName(type) + " message is not a JSON object"), true);
    return UCS_OK;
  }
  c->last_progress = Clock::now();
  if (c->client) {
    c->inbox.push_back({type, std::move(body)});
    cv_.notify_all();
  } else {
    HandleServer(c, type, body);
  }
  return UCS_OK;
}

void PeerServiceImpl::HandleServer(const ConnPtr& c, MsgType type, const json& body) {
  auto protocol_error = [&](const std::string& what) {
    ++peers_rejected_;
    Drop(c, Corruption(c->name + ": " + what), /*tell_peer=*/true);
  };
  if (type == MsgType::kError) {
    Drop(c, StatusFromJson(body, c->name), false);
    return;
  }
  switch (c->auth) {
    case Conn::Auth::kHello: {
      std::string job, node;
      if (type != MsgType::kHello || !GetString(body, "job", &job) ||
          !GetString(body, "node", &node, 64) ||
          !GetHex(body, "nonce", c->client_nonce.data(), kNonceBytes))
        return protocol_error(std::string("expected hello, got a malformed ") + MsgTypeName(type));
      if (job != options_.job) {
        ++peers_rejected_;
        return Drop(
            c, Unavailable(c->name + ": is of job '" + job + "', this is '" + options_.job + "'"),
            true);
      }
      Result<Nonce> nonce = NewNonce();
      if (!nonce.ok()) return Drop(c, nonce.status(), true);
      c->server_nonce = *nonce;
      c->client_node = node;
      c->name = "peer " + node + " (" + c->name.substr(std::string("peer at ").size()) + ")";
      c->auth = Conn::Auth::kAuth;
      const Mac proof = AuthProof(secret_, AuthRole::kServer, options_.job, node, options_.node,
                                  c->client_nonce, c->server_nonce);
      SendControlNow(c, MsgType::kChallenge,
                     {{"node", options_.node},
                      {"nonce", ToHex(c->server_nonce.data(), kNonceBytes)},
                      {"proof", ToHex(proof.data(), kMacBytes)}});
      return;
    }
    case Conn::Auth::kAuth: {
      Mac got{};
      if (type != MsgType::kAuth || !GetHex(body, "proof", got.data(), kMacBytes))
        return protocol_error(std::string("expected auth, got a malformed ") + MsgTypeName(type));
      const Mac want = AuthProof(secret_, AuthRole::kClient, options_.job, c->client_node,
                                 options_.node, c->client_nonce, c->server_nonce);
      if (!MacEqual(got, want)) {
        ++peers_rejected_;
        return Drop(c, Unavailable(c->name + ": authentication failed (not the job's secret)"),
                    true);
      }
      c->auth = Conn::Auth::kReady;
      SendControlNow(c, MsgType::kAuthOk, json::object());
      return;
    }
    case Conn::Auth::kReady:
      break;
  }
  if (c->busy) return protocol_error(std::string(MsgTypeName(type)) + " before the last reply");
  switch (type) {
    case MsgType::kPutBegin: {
      uint64_t chunk = 0;
      std::string meta_text;
      if (c->writer || c->view || !GetU64(body, "chunk_bytes", &chunk) ||
          !GetString(body, "meta", &meta_text, 4096))
        return protocol_error("malformed or unexpected put-begin");
      Result<ReplicaMeta> meta = MetaFromJson(meta_text);
      if (!meta.ok()) return protocol_error(meta.status().message());
      if (Status s = ValidateDeclaredMeta(*meta, c->client_node, options_.max_image_bytes);
          !s.ok()) {
        ++peers_rejected_;
        return Drop(c, s, true);
      }
      ChunkLayout layout{meta->payload_bytes, chunk};
      if (Status s = layout.Validate(); !s.ok()) return protocol_error(s.message());
      // Reserving the file (fallocate zeroes every page) is slow for big images: off the
      // progress thread.
      auto writer = std::make_shared<Result<std::unique_ptr<ReplicaWriter>>>(Cancelled(""));
      Offload(
          c, [this, writer, m = *meta] { *writer = store_->Begin(m); },
          [this, c, writer, m = *meta, layout] {
            if (!writer->ok()) return Drop(c, writer->status(), true);
            std::shared_ptr<ReplicaWriter> w = std::move(**writer);
            if (w->data().size() != m.payload_bytes)
              return Drop(c, IOError("replica store gave a buffer of the wrong size"), true);
            c->meta = m;
            c->writer = w;
            c->sink = w->data();
            c->sink_owner = w;
            c->layout = layout;
            c->got.assign(layout.chunks(), 0);
            c->chunk_crcs.assign(layout.chunks(), 0);
            c->received = 0;
            c->all_received = false;
            SendControlNow(c, MsgType::kPutReady, json::object());
          });
      return;
    }
    case MsgType::kCommit: {
      if (!c->writer || !c->all_received) return protocol_error("commit before every chunk");
      uint64_t image_crc = 0, payload_crc = 0;
      if (!GetU64(body, "image_crc", &image_crc) || !GetU64(body, "payload_crc", &payload_crc) ||
          image_crc > UINT32_MAX || payload_crc > UINT32_MAX)
        return protocol_error("malformed commit");
      c->meta.image_crc = static_cast<uint32_t>(image_crc);
      c->meta.payload_crc = static_cast<uint32_t>(payload_crc);
      // What landed, chunk by chunk (each checked as it arrived), folded into the payload's CRC:
      // the commit compares it with the sender's without reading the payload again.
      uint32_t received_crc = 0;
      for (uint64_t i = 0; i < c->layout.chunks(); ++i)
        received_crc = Crc32cCombine(
            received_crc, c->chunk_crcs[i],
            std::min(c->layout.chunk_bytes, c->layout.total - i * c->layout.chunk_bytes));
      std::shared_ptr<ReplicaWriter> writer = std::move(c->writer);
      c->sink = {};
      auto status = std::make_shared<Status>();
      Offload(
          c,
          [this, writer, status, m = c->meta, received_crc] {
            *status = writer->Commit(m.image_crc, m.payload_crc, received_crc);
            if (status->ok())
              if (Result<uint64_t> freed = store_->Prune(options_.keep); !freed.ok())
                spdlog::warn("peer service: pruning replicas: {}", freed.status().ToString());
          },
          [this, c, status] {
            if (status->ok()) {
              ++replicas_received_;
              bytes_received_ += c->meta.payload_bytes;
            } else {
              ++transfers_failed_;
            }
            SendControlNow(c, MsgType::kCommitted, StatusToJson(*status));
          });
      return;
    }
    case MsgType::kPing:  // a paused or throttled sender; OnAm noted the progress
      return;
    case MsgType::kCancel:
      c->writer.reset();
      c->sink = {};
      return Drop(c, Cancelled(c->name + ": cancelled the transfer"), false);
    case MsgType::kList: {
      std::optional<uint32_t> rank;
      uint64_t r = 0;
      if (GetU64(body, "rank", &r)) {
        if (r > UINT32_MAX) return protocol_error("rank out of range");
        rank = static_cast<uint32_t>(r);
      }
      Result<std::vector<ReplicaMeta>> list = store_->List(rank);
      if (!list.ok()) return Drop(c, list.status(), true);
      json metas = json::array();
      for (const ReplicaMeta& m : *list) {
        if (metas.size() >= kMaxListed) break;
        metas.push_back(MetaToJson(m));
      }
      json reply = {{"metas", std::move(metas)}};
      if (reply.dump().size() > kMaxControlBytes)
        return Drop(c, ResourceExhausted("list reply too long"), true);
      SendControlNow(c, MsgType::kListReply, reply);
      return;
    }
    case MsgType::kFetch: {
      uint64_t chunk = 0;
      std::string meta_text;
      if (c->writer || c->view || !GetU64(body, "chunk_bytes", &chunk) ||
          !GetString(body, "meta", &meta_text, 4096))
        return protocol_error("malformed or unexpected fetch");
      Result<ReplicaMeta> want = MetaFromJson(meta_text);
      if (!want.ok()) return protocol_error(want.status().message());
      Result<std::vector<ReplicaMeta>> list = store_->List(want->rank);
      if (!list.ok()) return Drop(c, list.status(), true);
      auto it = std::find_if(list->begin(), list->end(),
                             [&](const ReplicaMeta& m) { return SameReplica(m, *want); });
      if (it == list->end())
        return Drop(
            c,
            NotFound("no replica " + want->source_node + " rank " + std::to_string(want->rank) +
                     " step " + std::to_string(want->step) + " here"),
            true);
      ChunkLayout layout{it->payload_bytes, chunk};
      if (Status s = layout.Validate(); !s.ok()) return protocol_error(s.message());
      // Read verifies the payload's CRC: off the progress thread.
      auto view = std::make_shared<Result<ReplicaView>>(Cancelled(""));
      Offload(
          c, [this, view, m = *it] { *view = store_->Read(m); },
          [this, c, view, layout] {
            if (!view->ok()) return Drop(c, view->status(), true);
            c->view = std::make_shared<ReplicaView>(std::move(**view));
            c->send_layout = layout;
            c->next_chunk = 0;
            SendControlNow(c, MsgType::kFetchBegin, {{"meta", MetaToJson(c->view->meta)}});
            PumpFetch(c);
          });
      return;
    }
    default:
      return protocol_error(std::string("unexpected ") + MsgTypeName(type) + " message");
  }
}

void PeerServiceImpl::Offload(const ConnPtr& c, std::function<void()> work,
                              std::function<void()> then) {
  c->busy = true;
  std::lock_guard lk(store_mu_);
  store_tasks_.push_back([this, c, work = std::move(work), then = std::move(then)] {
    work();
    Submit([this, c, then] {
      Lock lk(mu_);
      c->busy = false;
      c->last_progress = Clock::now();
      if (!c->closing && !c->dropping) then();
    });
  });
  store_cv_.notify_one();
}

void PeerServiceImpl::RunStore() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock lk(store_mu_);
      store_cv_.wait(lk, [&] { return store_stop_ || !store_tasks_.empty(); });
      if (store_stop_) return;  // what is left is dropped (uncommitted files are removed)
      task = std::move(store_tasks_.front());
      store_tasks_.pop_front();
    }
    task();
  }
}

void PeerServiceImpl::PumpFetch(const ConnPtr& c) {
  Lock lk(mu_);
  while (c->view && !c->closing && !c->dropping && c->outstanding < kSendWindow &&
         c->next_chunk < c->send_layout.chunks()) {
    const uint64_t offset = c->next_chunk * c->send_layout.chunk_bytes;
    const uint64_t len = std::min(c->send_layout.chunk_bytes, c->send_layout.total - offset);
    const std::byte* p = c->view->payload.data() + offset;
    ++c->next_chunk;
    ++c->outstanding;
    SendNow(c, ChunkHeader(offset, len, Crc32c(0, p, len)), {}, p, len, c->view);
  }
}

void PeerServiceImpl::HandleChunk(const ConnPtr& c, const WireHeader& h, void* data,
                                  const ucp_am_recv_param_t* param) {
  const bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
  if ((!c->client && c->auth != Conn::Auth::kReady) || c->sink.empty()) {
    ++peers_rejected_;
    return Drop(c, Corruption(c->name + ": chunk without a transfer"), true);
  }
  const int64_t idx = c->layout.IndexOf(h.offset, h.len);
  if (idx < 0 || c->got[idx] != 0) {
    ++peers_rejected_;
    ++transfers_failed_;
    return Drop(c,
                Corruption(c->name + ": chunk at offset " + std::to_string(h.offset) + " of " +
                           std::to_string(h.len) + " bytes is not one the transfer of " +
                           std::to_string(c->layout.total) + " bytes still expects"),
                true);
  }
  c->got[idx] = 2;
  c->last_progress = Clock::now();
  std::byte* dest = c->sink.data() + h.offset;
  if (!rndv) {
    std::memcpy(dest, data, h.len);
    ChunkArrived(c, h);
    return;
  }
  auto* ctx = new RecvCtx{this, c, h, c->sink_owner};
  ++requests_pending_;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = RecvCb;
  p.user_data = ctx;
  ++c->receiving;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(hub_->worker(), data, dest, h.len, &p);
  if (r == nullptr) {
    OnRecvDone(ctx, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    OnRecvDone(ctx, UCS_PTR_STATUS(r));
  }  // else the callback frees the request
}

void PeerServiceImpl::OnRecvDone(RecvCtx* ctx, ucs_status_t status) {
  std::unique_ptr<RecvCtx> owned(ctx);
  Lock lk(mu_);
  --requests_pending_;
  ConnPtr c = ctx->conn;
  if (c->receiving > 0) --c->receiving;
  cv_.notify_all();
  if (c->closing || c->sink.empty()) return;
  if (status != UCS_OK) {
    ++transfers_failed_;
    return Drop(c, Unavailable(c->name + ": receiving a chunk failed: " + UcsError(status)), false);
  }
  ChunkArrived(c, ctx->header);
}

void PeerServiceImpl::ChunkArrived(const ConnPtr& c, const WireHeader& h) {
  const uint32_t crc = Crc32c(0, c->sink.data() + h.offset, h.len);
  if (crc != h.crc) {
    ++transfers_failed_;
    return Drop(c,
                Corruption(c->name + ": chunk at offset " + std::to_string(h.offset) + " (" +
                           std::to_string(h.len) + " bytes) fails its CRC32C"),
                true);
  }
  c->got[h.offset / c->layout.chunk_bytes] = 1;
  if (!c->chunk_crcs.empty()) c->chunk_crcs[h.offset / c->layout.chunk_bytes] = crc;
  c->received += h.len;
  c->last_progress = Clock::now();
  cv_.notify_all();
  if (c->received == c->layout.total && !c->client && c->writer) {
    c->all_received = true;
    SendControlNow(c, MsgType::kPutDone, json::object());
  }
}

// ---- Client side ----

void PeerServiceImpl::SetSecret(const std::string& secret) {
  Lock lk(mu_);
  secret_ = secret;
  std::vector<ConnPtr> conns;
  for (auto& [ep, c] : eps_) conns.push_back(c);
  for (auto& c : conns) {
    if (c->error.ok()) c->error = Unavailable(c->name + ": connection dropped: the secret changed");
    Submit([this, c] { CloseNow(c, Unavailable("the secret changed")); });
  }
  cv_.notify_all();
}

Result<ConnPtr> PeerServiceImpl::Connect(const Peer& peer) {
  auto c = std::make_shared<Conn>();
  c->client = true;
  c->name = "peer " + peer.node + " (" + peer.address + ")";
  std::string host;
  uint16_t port = 0;
  if (!SplitAddress(peer.address, &host, &port))
    return InvalidArgument(c->name + ": not a host:port address");
  socklen_t len = 0;
  Result<sockaddr_storage> addr = ResolveAddress(host, port, &len);
  if (!addr.ok()) return addr.status().WithContext(c->name);
  Result<Nonce> nonce = NewNonce();
  if (!nonce.ok()) return nonce.status();
  const Nonce client_nonce = *nonce;
  {
    Lock lk(mu_);
    c->last_progress = Clock::now();
    ++c->outstanding;  // the hello
  }
  const sockaddr_storage ss = *addr;
  Submit([this, c, ss, len, client_nonce] {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    ep.sockaddr.addrlen = len;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = EpErrorCb;
    ep.err_handler.arg = this;
    Lock lk(mu_);
    if (ucs_status_t s = ucp_ep_create(hub_->worker(), &ep, &c->ep); s != UCS_OK) {
      c->ep = nullptr;
      c->error = Unavailable(c->name + ": cannot connect: " + UcsError(s));
      c->outstanding = 0;
      cv_.notify_all();
      return;
    }
    eps_[c->ep] = c;
    std::string text = json{{"job", options_.job},
                            {"node", options_.node},
                            {"nonce", ToHex(client_nonce.data(), kNonceBytes)}}
                           .dump();
    const WireHeader h = ControlHeader(MsgType::kHello, text.size());
    SendNow(c, h, std::move(text), nullptr, 0, nullptr);
  });
  auto fail = [&](Status s) -> Result<ConnPtr> {
    Close(c);
    return s;
  };
  Result<json> challenge = WaitMessage(c, MsgType::kChallenge);
  if (!challenge.ok()) return fail(challenge.status());
  std::string node;
  Nonce server_nonce{};
  Mac proof{};
  if (!GetString(*challenge, "node", &node, 64) ||
      !GetHex(*challenge, "nonce", server_nonce.data(), kNonceBytes) ||
      !GetHex(*challenge, "proof", proof.data(), kMacBytes))
    return fail(Corruption(c->name + ": malformed challenge"));
  std::string secret;
  {
    Lock lk(mu_);
    secret = secret_;
  }
  if (node != peer.node) return fail(Unavailable(c->name + ": answers as node '" + node + "'"));
  if (!MacEqual(proof, AuthProof(secret, AuthRole::kServer, options_.job, options_.node, node,
                                 client_nonce, server_nonce)))
    return fail(Unavailable(c->name + ": authentication failed (not the job's secret)"));
  const Mac mine = AuthProof(secret, AuthRole::kClient, options_.job, options_.node, node,
                             client_nonce, server_nonce);
  SendControl(c, MsgType::kAuth, {{"proof", ToHex(mine.data(), kMacBytes)}});
  Result<json> ok = WaitMessage(c, MsgType::kAuthOk);
  if (!ok.ok()) return fail(ok.status());
  return c;
}

void PeerServiceImpl::SendControl(const ConnPtr& c, MsgType type, json body) {
  {
    Lock lk(mu_);
    ++c->outstanding;
  }
  Submit([this, c, type, body = std::move(body)] {
    std::string text = body.dump();
    const WireHeader h = ControlHeader(type, text.size());
    SendNow(c, h, std::move(text), nullptr, 0, nullptr);
  });
}

void PeerServiceImpl::SendChunk(const ConnPtr& c, uint64_t offset, std::span<const std::byte> bytes,
                                uint32_t crc, std::shared_ptr<const void> keep) {
  {
    Lock lk(mu_);
    ++c->outstanding;
  }
  Submit([this, c, offset, bytes, crc, keep = std::move(keep)] {
    SendNow(c, ChunkHeader(offset, bytes.size(), crc), {}, bytes.data(), bytes.size(), keep);
  });
}

Status PeerServiceImpl::WaitUntil(const ConnPtr& c, const std::function<bool()>& done) {
  Lock lk(mu_);
  while (true) {
    if (!c->inbox.empty() && c->inbox.front().type == MsgType::kError)
      return StatusFromJson(c->inbox.front().body, c->name);
    if (done()) return Status::OK();
    if (!c->error.ok()) return c->error;
    const auto deadline = c->last_progress + timeout();
    const auto now = Clock::now();
    if (now >= deadline) {
      ++transfers_failed_;
      return Unavailable(c->name + ": no progress for " + Seconds(options_.timeout_s) + " s");
    }
    cv_.wait_until(lk, std::min(deadline, now + std::chrono::milliseconds(200)));
  }
}

Result<json> PeerServiceImpl::WaitMessage(const ConnPtr& c, MsgType expected) {
  SP_RETURN_IF_ERROR(WaitUntil(c, [&] { return !c->inbox.empty(); }));
  Lock lk(mu_);
  Message m = std::move(c->inbox.front());
  c->inbox.pop_front();
  if (m.type != expected)
    return Corruption(c->name + ": sent " + MsgTypeName(m.type) + " where " +
                      MsgTypeName(expected) + " was due");
  return std::move(m.body);
}

// Force-closes and waits until no request of ours still points into the caller's buffers.
void PeerServiceImpl::Close(const ConnPtr& c) {
  Submit([this, c] { CloseNow(c, Cancelled(c->name + ": closed")); });
  Lock lk(mu_);
  const auto deadline = Clock::now() + std::max(timeout(), std::chrono::nanoseconds(1000000000));
  while (!(c->closed && c->outstanding == 0 && c->receiving == 0)) {
    if (cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
      spdlog::error("peer service: {} still has {} sends and {} receives after closing", c->name,
                    c->outstanding, c->receiving);
      break;
    }
  }
}

Result<double> PeerServiceImpl::Throttle(const ConnPtr& c, uint64_t bytes,
                                         const std::function<bool()>& still_valid,
                                         const Status& cancelled) {
  const auto start = Clock::now();
  // Waits in slices, pinging the receiver so that it does not drop a connection that is only
  // paused, and polling still_valid and the connection.
  const auto slice =
      std::max<std::chrono::nanoseconds>(timeout() / 3, std::chrono::milliseconds(1));
  auto ping = [&]() -> Status {
    {
      Lock lk(mu_);
      if (!c->error.ok()) return c->error;
      c->last_progress = Clock::now();
    }
    SendControl(c, MsgType::kPing, json::object());
    return StillValid(still_valid) ? Status::OK() : cancelled;
  };
  bool waited = false;
  while (true) {
    std::unique_lock lk(pause_mu_);
    if (!paused_ || stop_) break;
    waited = true;
    if (pause_cv_.wait_for(lk, slice, [&] { return !paused_ || stop_; })) break;
    lk.unlock();
    SP_RETURN_IF_ERROR(ping());
  }
  double wait_s = 0;
  {
    std::lock_guard lk(bucket_mu_);
    const auto now = Clock::now();
    if (rate_ > 0) {
      const double burst = std::max<double>(static_cast<double>(options_.chunk_bytes), rate_ / 10);
      tokens_ = std::min(
          burst, tokens_ + std::chrono::duration<double>(now - bucket_time_).count() * rate_);
      tokens_ -= static_cast<double>(bytes);
      if (tokens_ < 0) wait_s = -tokens_ / rate_;
    }
    bucket_time_ = now;
  }
  if (wait_s > 0) waited = true;
  const auto until = Clock::now() + std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::duration<double>(wait_s));
  while (Clock::now() < until) {
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(slice, until - Clock::now()));
    if (Clock::now() < until) SP_RETURN_IF_ERROR(ping());
  }
  {
    Lock lk(mu_);
    c->last_progress = Clock::now();
  }
  return waited ? std::chrono::duration<double>(Clock::now() - start).count() : 0.0;
}

Status PeerServiceImpl::PushOne(const Peer& target, const ReplicaMeta& meta, uint64_t chunk_bytes,
                                const ChunkOf& chunk_of,
                                const std::function<uint32_t(uint32_t)>& image_crc_of,
                                const std::function<bool()>& still_valid, double* paused_seconds) {
  SP_ASSIGN_OR_RETURN(ConnPtr c, Connect(target));
  auto finish = [&](Status s) {
    if (s.code() == StatusCode::kCancelled) {
      SendControl(c, MsgType::kCancel, json::object());
      // Let the cancel leave before the force close (best effort; the receiver also drops an
      // unfinished replica when the connection goes).
      WaitUntil(c, [&] { return c->outstanding == 0; }).IgnoreError();
    }
    Close(c);
    if (!s.ok()) spdlog::warn("peer service: push to {} failed: {}", c->name, s.ToString());
    return s;
  };
  SendControl(c, MsgType::kPutBegin, {{"meta", MetaToJson(meta)}, {"chunk_bytes", chunk_bytes}});
  if (Result<json> r = WaitMessage(c, MsgType::kPutReady); !r.ok()) return finish(r.status());
  const ChunkLayout layout{meta.payload_bytes, chunk_bytes};
  const Status cancelled = Cancelled("snapshot rank " + std::to_string(meta.rank) + " step " +
                                     std::to_string(meta.step) + " is no longer valid");
  uint32_t payload_crc = 0;
  for (uint64_t i = 0; i < layout.chunks(); ++i) {
    if (!StillValid(still_valid)) return finish(cancelled);
    const uint64_t offset = i * layout.chunk_bytes;
    const uint64_t len = std::min(layout.chunk_bytes, layout.total - offset);
    Result<double> waited = Throttle(c, len, still_valid, cancelled);
    if (!waited.ok()) return finish(waited.status());
    *paused_seconds += *waited;
    if (Status s = WaitUntil(c, [&] { return c->outstanding < kSendWindow; }); !s.ok())
      return finish(s);
    auto [bytes, keep, crc] = chunk_of(i);
    if (bytes.size() != len) return finish(InvalidArgument("push: chunk of the wrong size"));
    payload_crc = Crc32cCombine(payload_crc, crc, len);
    if (options_.test_mangle_chunk) {
      auto copy = std::make_shared<std::vector<std::byte>>(bytes.begin(), bytes.end());
      options_.test_mangle_chunk(offset, *copy);
      bytes = *copy;
      keep = copy;
    }
    SendChunk(c, offset, bytes, crc, keep);
    bytes_sent_ += len;
  }
  if (Result<json> r = WaitMessage(c, MsgType::kPutDone); !r.ok()) return finish(r.status());
  if (!StillValid(still_valid)) return finish(cancelled);
  SendControl(c, MsgType::kCommit,
              {{"image_crc", image_crc_of(payload_crc)}, {"payload_crc", payload_crc}});
  Result<json> committed = WaitMessage(c, MsgType::kCommitted);
  if (!committed.ok()) return finish(committed.status());
  uint64_t code = 0;
  if (GetU64(*committed, "code", &code) && code == 0) return finish(Status::OK());
  return finish(StatusFromJson(*committed, c->name));
}

}  // namespace

Result<std::unique_ptr<PeerService>> PeerService::Start(const PeerServiceOptions& options,
                                                        ReplicaStore* store) {
  auto svc = std::make_unique<PeerServiceImpl>(options, store);
  SP_RETURN_IF_ERROR(svc->Init());
  return std::unique_ptr<PeerService>(std::move(svc));
}

namespace {

Result<PushResult> PeerServiceImpl::Push(const SnapshotId& id, std::span<const std::byte> image,
                                         const Redundancy& redundancy,
                                         const std::vector<Peer>& targets,
                                         const std::function<bool()>& still_valid) {
  if (!redundancy.enabled()) return InvalidArgument("push: redundancy is none");
  if (targets.size() != redundancy.targets())
    return InvalidArgument("push: " + redundancy.ToString() + " needs " +
                           std::to_string(redundancy.targets()) + " targets, got " +
                           std::to_string(targets.size()));
  if (image.empty()) return InvalidArgument("push: empty image");
  const auto start = Clock::now();
  ++pushes_;
  ReplicaMeta base;
  base.source_node = options_.node;
  base.rank = id.rank;
  base.step = id.step;
  base.complete_ns = id.complete_ns;
  base.attempt = id.attempt;
  base.image_bytes = image.size();
  const uint64_t chunk_bytes = options_.chunk_bytes;
  // No pass over the image ahead of the sends: each chunk's CRC is computed as it is first sent
  // (shared by all targets), the payload's and image's are folded from them and go with the
  // commit.
  std::vector<ReplicaMeta> metas(targets.size(), base);
  std::vector<ChunkOf> chunk_of(targets.size());
  std::function<uint32_t(uint32_t)> image_crc_of;
  std::unique_ptr<EcCodec> codec;
  std::unique_ptr<StripeSource> stripes;
  struct ChunkCrcs {
    explicit ChunkCrcs(size_t n) : once(n), crc(n) {}
    std::vector<std::once_flag> once;
    std::vector<uint32_t> crc;
  };
  std::unique_ptr<ChunkCrcs> chunk_crcs;
  if (redundancy.kind == Redundancy::Kind::kMirror) {
    chunk_crcs = std::make_unique<ChunkCrcs>(ChunkLayout{image.size(), chunk_bytes}.chunks());
    image_crc_of = [](uint32_t payload_crc) { return payload_crc; };  // a copy is the image
    for (size_t t = 0; t < targets.size(); ++t) {
      metas[t].payload_bytes = image.size();
      chunk_of[t] = [image, chunk_bytes, crcs = chunk_crcs.get()](uint64_t i) {
        const uint64_t offset = i * chunk_bytes;
        const auto bytes = image.subspan(offset, std::min(chunk_bytes, image.size() - offset));
        std::call_once(crcs->once[i], [&] { crcs->crc[i] = Crc32c(bytes); });
        return Chunk{bytes, nullptr, crcs->crc[i]};
      };
    }
  } else {
    // One chunk of fragment f is piece f of one stripe, encoded as it is sent (StripeSource),
    // once for all targets unless one falls behind the cache.
    EcLayout layout{redundancy.k, redundancy.p, image.size(), chunk_bytes};
    SP_RETURN_IF_ERROR(layout.Validate());
    SP_ASSIGN_OR_RETURN(codec, EcCodec::Create(layout.k, layout.p));
    stripes = std::make_unique<StripeSource>(layout, codec.get(), image);
    image_crc_of = [src = stripes.get()](uint32_t) { return src->ImageCrc(); };
    for (uint32_t f = 0; f < layout.k + layout.p; ++f) {
      metas[f].kind = ReplicaMeta::Kind::kFragment;
      metas[f].index = f;
      metas[f].k = layout.k;
      metas[f].p = layout.p;
      metas[f].piece_bytes = layout.piece_bytes;
      metas[f].payload_bytes = layout.fragment_bytes();
      chunk_of[f] = [src = stripes.get(), f, piece = layout.piece_bytes](uint64_t i) {
        std::shared_ptr<const StripeSource::Stripe> stripe = src->Get(i);
        return Chunk{std::span<const std::byte>(stripe->bytes.data() + f * piece, piece), stripe,
                     stripe->crcs[f]};
      };
    }
  }

  PushResult result;
  result.targets.assign(targets.size(), Status::OK());
  std::vector<double> paused(targets.size(), 0);
  const uint64_t sent_before = bytes_sent_;
  std::vector<std::thread> threads;
  for (size_t t = 0; t < targets.size(); ++t)
    threads.emplace_back([&, t] {
      result.targets[t] = PushOne(targets[t], metas[t], chunk_bytes, chunk_of[t], image_crc_of,
                                  still_valid, &paused[t]);
    });
  for (auto& th : threads) th.join();
  result.bytes_sent = bytes_sent_ - sent_before;
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (double p : paused) result.paused_seconds = std::max(result.paused_seconds, p);
  for (const Status& s : result.targets)
    if (s.code() == StatusCode::kCancelled) return s;
  return result;
}

std::vector<Holding> PeerServiceImpl::List(const std::vector<Peer>& peers,
                                           std::optional<uint32_t> rank,
                                           std::vector<Status>* errors) {
  std::vector<std::vector<Holding>> found(peers.size());
  std::vector<Status> status(peers.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < peers.size(); ++i)
    threads.emplace_back([&, i] {
      status[i] = [&]() -> Status {
        SP_ASSIGN_OR_RETURN(ConnPtr c, Connect(peers[i]));
        json req = json::object();
        if (rank) req["rank"] = *rank;
        SendControl(c, MsgType::kList, req);
        Result<json> reply = WaitMessage(c, MsgType::kListReply);
        Close(c);
        if (!reply.ok()) return reply.status();
        auto it = reply->find("metas");
        if (it == reply->end() || !it->is_array() || it->size() > kMaxListed)
          return Corruption(c->name + ": malformed list reply");
        for (const json& m : *it) {
          if (!m.is_string()) return Corruption(c->name + ": malformed list reply");
          Result<ReplicaMeta> meta = MetaFromJson(m.get<std::string>());
          if (!meta.ok()) return meta.status().WithContext(c->name);
          if (rank && meta->rank != *rank) continue;
          found[i].push_back({peers[i], *meta});
        }
        return Status::OK();
      }();
    });
  for (auto& th : threads) th.join();
  std::vector<Holding> out;
  for (size_t i = 0; i < peers.size(); ++i) {
    if (!status[i].ok()) spdlog::warn("peer service: list: {}", status[i].ToString());
    for (auto& h : found[i]) out.push_back(std::move(h));
  }
  if (errors) *errors = std::move(status);
  return out;
}

Status PeerServiceImpl::FetchOne(const Holding& holding, std::span<std::byte> dest,
                                 std::shared_ptr<void> dest_owner) {
  const ReplicaMeta& meta = holding.meta;
  if (dest.size() != meta.payload_bytes)
    return InvalidArgument("fetch: buffer of " + std::to_string(dest.size()) + " bytes for " +
                           std::to_string(meta.payload_bytes));
  SP_ASSIGN_OR_RETURN(ConnPtr c, Connect(holding.holder));
  const ChunkLayout layout{meta.payload_bytes, options_.chunk_bytes};
  {
    Lock lk(mu_);
    c->sink = dest;
    c->sink_owner = std::move(dest_owner);
    c->layout = layout;
    c->got.assign(layout.chunks(), 0);
  }
  SendControl(c, MsgType::kFetch,
              {{"meta", MetaToJson(meta)}, {"chunk_bytes", layout.chunk_bytes}});
  Status s = [&]() -> Status {
    SP_ASSIGN_OR_RETURN(json begin, WaitMessage(c, MsgType::kFetchBegin));
    std::string text;
    if (!GetString(begin, "meta", &text, 4096))
      return Corruption(c->name + ": malformed fetch-begin");
    SP_ASSIGN_OR_RETURN(ReplicaMeta got, MetaFromJson(text));
    if (!SameContent(got, meta))
      return Corruption(c->name + ": holds a different replica than it listed");
    SP_RETURN_IF_ERROR(WaitUntil(c, [&] { return c->received == layout.total; }));
    return Status::OK();
  }();
  Close(c);
  {
    Lock lk(mu_);
    c->sink = {};
  }
  if (!s.ok()) {
    spdlog::warn("peer service: fetch from {} failed: {}", c->name, s.ToString());
    return s;
  }
  if (Crc32c(dest) != meta.payload_crc)
    return Corruption(c->name + ": replica payload fails its CRC32C");
  return Status::OK();
}

Status PeerServiceImpl::FetchImage(const std::vector<Holding>& holdings, const SnapshotId& id,
                                   std::span<std::byte> image) {
  const std::string what = "rank " + std::to_string(id.rank) + " step " + std::to_string(id.step);
  Status last = NotFound("no peer holds enough of " + what + " to rebuild it");
  std::vector<Holding> copies, frags;
  for (const Holding& h : holdings) {
    const ReplicaMeta& m = h.meta;
    if (m.rank != id.rank || m.step != id.step || m.complete_ns != id.complete_ns ||
        m.attempt != id.attempt) {
      continue;
    }
    if (m.image_bytes != image.size()) continue;
    // What a peer listed is checked like what a peer declares before anything is sized by it.
    if (Status v = ValidateDeclaredMeta(m, m.source_node, image.size()); !v.ok()) {
      last = v.WithContext(h.holder.node);
      continue;
    }
    (m.kind == ReplicaMeta::Kind::kCopy ? copies : frags).push_back(h);
  }
  for (const Holding& h : copies) {
    if (Status s = FetchOne(h, image, nullptr); !s.ok()) {
      last = s;
      continue;
    }
    if (Crc32c(std::span<const std::byte>(image)) != h.meta.image_crc) {
      last = Corruption("copy of " + what + " from " + h.holder.node + " fails the image CRC32C");
      continue;
    }
    return Status::OK();
  }
  // Fragments of one code (the first one listed), candidates in order of index.
  if (frags.empty()) return last;
  const ReplicaMeta& first = frags.front().meta;
  EcLayout layout{first.k, first.p, first.image_bytes, first.piece_bytes};
  std::vector<Holding> cands;
  for (const Holding& h : frags)
    if (h.meta.k == layout.k && h.meta.p == layout.p && h.meta.piece_bytes == layout.piece_bytes &&
        h.meta.image_crc == first.image_crc && h.meta.source_node == first.source_node)
      cands.push_back(h);
  std::stable_sort(cands.begin(), cands.end(),
                   [](const Holding& a, const Holding& b) { return a.meta.index < b.meta.index; });
  {
    std::vector<uint32_t> distinct;
    for (const Holding& h : cands)
      if (distinct.empty() || distinct.back() != h.meta.index) distinct.push_back(h.meta.index);
    if (distinct.size() < layout.k) return last;
  }
  SP_RETURN_IF_ERROR(layout.Validate());
  SP_ASSIGN_OR_RETURN(std::unique_ptr<EcCodec> codec, EcCodec::Create(layout.k, layout.p));

  // K workers; each takes the first untried candidate whose index is neither fetched nor being
  // fetched, so a failed holder's index passes to another holder of it.
  std::mutex m;
  std::vector<bool> tried(cands.size(), false);
  std::vector<bool> busy(layout.k + layout.p, false);  // index fetched or being fetched
  std::vector<uint32_t> indices;
  std::vector<std::shared_ptr<std::vector<std::byte>>> buffers;
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < layout.k; ++w)
    threads.emplace_back([&] {
      while (true) {
        Holding h;
        {
          std::lock_guard lk(m);
          if (indices.size() >= layout.k) return;
          size_t i = 0;
          while (i < cands.size() && (tried[i] || busy[cands[i].meta.index])) ++i;
          if (i == cands.size()) return;
          tried[i] = true;
          h = cands[i];
          busy[h.meta.index] = true;
        }
        auto buf = std::make_shared<std::vector<std::byte>>(h.meta.payload_bytes);
        Status s = FetchOne(h, *buf, buf);
        std::lock_guard lk(m);
        if (s.ok() && indices.size() < layout.k) {
          indices.push_back(h.meta.index);
          buffers.push_back(buf);
        } else if (!s.ok()) {
          last = s;
          busy[h.meta.index] = false;
        }
      }
    });
  for (auto& th : threads) th.join();
  if (indices.size() < layout.k) return last;
  std::vector<std::span<const std::byte>> spans;
  for (auto& b : buffers) spans.emplace_back(*b);
  SP_RETURN_IF_ERROR(codec->Decode(layout, indices, spans, image));
  if (Crc32c(std::span<const std::byte>(image)) != first.image_crc)
    return Corruption(what + " rebuilt from fragments fails the image CRC32C");
  return Status::OK();
}

}  // namespace

}  // namespace safepoint::replica
