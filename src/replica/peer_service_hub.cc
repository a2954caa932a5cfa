// PeerService over UCX, the hub (see peer_service_impl.h for how the three files divide the
// work): the process's one UCP context, worker and progress thread; each service's listener, its
// start and stop; and the connection plumbing both sides use: sending control messages and
// chunks, closing and dropping connections, dispatching what arrives (control messages to the
// server side or a waiting client, chunks into the transfer's buffer) and timing out idle ones.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <ucs/sys/sock.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <future>
#include <new>

#include "base/host_port.h"
#include "base/log.h"
#include "replica/peer_service_impl.h"

namespace safepoint::replica {
namespace ucx {
namespace {

constexpr uint16_t kAmId = 17;
constexpr auto kDropGrace = std::chrono::seconds(1);  // for the error message of a dropped peer
// No shared-memory transport ("sm": posix, sysv, cma, knem, xpmem): peers are other hosts (in
// tests, other network namespaces, which shared memory would cross). $UCX_TLS overrides.
constexpr const char* kDefaultTls = "^sm";
// A deferred start (PeerServiceImpl::bind_iface_): how often the interface is looked at, and how
// long after a start that failed the next one is tried.
constexpr auto kInterfacePoll = std::chrono::milliseconds(200);
constexpr auto kStartRetry = std::chrono::seconds(1);  // doubled after each, up to:
constexpr auto kStartRetryMax = std::chrono::seconds(30);

uint16_t GetPort(const sockaddr_storage& ss) {
  return ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port
                                        : reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
}

void SetPort(sockaddr_storage* ss, uint16_t port) {
  if (ss->ss_family == AF_INET6)
    reinterpret_cast<sockaddr_in6*>(ss)->sin6_port = htons(port);
  else
    reinterpret_cast<sockaddr_in*>(ss)->sin_port = htons(port);
}

// The interface that carries `addr` when UCX would leave it out of a context made now (down, or
// without a carrier: ucs_netif_is_active, what UCX's TCP transport asks of each interface);
// empty when it is up, for a wildcard address and for an address no interface has (the
// listener then fails as before).
std::string DownInterfaceOf(const sockaddr_storage& addr) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string name;
  for (const ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_name == nullptr ||
        i->ifa_addr->sa_family != addr.ss_family)
      continue;
    bool same = false;
    if (addr.ss_family == AF_INET) {
      same = reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr ==
             reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr.s_addr;
    } else {
      same = std::memcmp(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr,
                         &reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_addr,
                         sizeof(in6_addr)) == 0;
    }
    if (same) {
      name = i->ifa_name;
      break;
    }
  }
  ::freeifaddrs(list);
  if (name.empty() || ucs_netif_is_active(name.c_str(), addr.ss_family)) return {};
  return name;
}

}  // namespace

Result<sockaddr_storage> ResolveAddress(const std::string& host, uint16_t port, socklen_t* len) {
  // An IPv6 address may come in brackets ("[::1]", as in "[::1]:PORT"); a link-local one keeps
  // its interface ("fe80::1%eth0"), which getaddrinfo turns into the scope id.
  std::string name = host;
  if (name.size() >= 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(name.c_str(), service.c_str(), &hints, &res); rc != 0 || !res)
    return Unavailable("cannot resolve " + host + ": " + gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return ss;
}

std::string FormatAddress(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
    char ip[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &in->sin_addr, ip, sizeof ip);
    return internal::FormatHostPort(ip, ntohs(in->sin_port));
  }
  auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
  char ip[INET6_ADDRSTRLEN] = {};
  inet_ntop(AF_INET6, &in6->sin6_addr, ip, sizeof ip);
  std::string host = ip;
  // A link-local address is reachable only through its interface: peers need "%IFACE" too.
  char ifname[IF_NAMESIZE] = {};
  if (in6->sin6_scope_id != 0 && if_indextoname(in6->sin6_scope_id, ifname) != nullptr) {
    host += std::string("%") + ifname;
  }
  return internal::FormatHostPort(host, ntohs(in6->sin6_port));
}

// The IPv6 addresses UCX's TCP transport cannot carry data over, refused with the way out
// (found with UCX 1.13.1: docs/replication.md).
Status PeerServiceImpl::CheckIpv6BindAddress(const sockaddr_storage& ss) const {
  if (ss.ss_family != AF_INET6) return Status::OK();
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
  const std::string what = "peer service of node " + options_.node + ": " + options_.bind_host;
  // A $UCX_TCP_AF_PRIO that puts IPv4 first makes the data lanes IPv4 endpoints, which UCX
  // 1.13.1 sizes for an IPv4 peer address: the accepting side then copies the IPv6 address the
  // connection came from into 16 bytes and connects with 28, reading past the endpoint (ASan:
  // heap-buffer-overflow in ucs_socket_connect), and the process later aborts in glibc ("double
  // free or corruption"): docs/reliability.md.
  if (const char* prio = std::getenv("UCX_TCP_AF_PRIO"); prio != nullptr) {
    std::string first = prio;
    first = first.substr(0, first.find(','));
    first.erase(0, first.find_first_not_of(" \t"));
    first.erase(first.find_last_not_of(" \t") + 1);
    if (first != "inet6") {
      return InvalidArgument(what + " is an IPv6 address, and $UCX_TCP_AF_PRIO='" + prio +
                             "' does not put inet6 first: UCX's TCP transport would carry the "
                             "data over IPv4 endpoints that cannot hold an IPv6 peer's address "
                             "(memory corruption with UCX 1.13); unset UCX_TCP_AF_PRIO (safepoint "
                             "then sets inet6), set it to inet6, or use an IPv4 address");
    }
  }
  if (IN6_IS_ADDR_LINKLOCAL(&in6->sin6_addr)) {
    return InvalidArgument(
        what +
        " is a link-local IPv6 address, which UCX's TCP transport cannot connect to (it drops "
        "the interface when it connects its data lane: EINVAL); set $SAFEPOINT_PEER_HOST to a "
        "global or unique-local IPv6 address of the interface, or to an IPv4 one");
  }
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  if (IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr) && (major < 1 || (major == 1 && minor < 14))) {
    return InvalidArgument(
        what + " is the IPv6 loopback, which UCX " + std::to_string(major) + "." +
        std::to_string(minor) + "." + std::to_string(release) +
        "'s TCP transport has no device for (UCX 1.14 added it), so no data could follow a "
        "connection; use 127.0.0.1, or a global IPv6 address of an interface "
        "($SAFEPOINT_PEER_HOST)");
  }
  return Status::OK();
}

// ---- UCX trampolines ----

void EpErrorCb(void* arg, ucp_ep_h ep, ucs_status_t status) {
  static_cast<PeerServiceImpl*>(arg)->OnEpError(ep, status);
}

namespace {

void ConnRequestCb(ucp_conn_request_h request, void* arg) {
  static_cast<PeerServiceImpl*>(arg)->OnConnRequest(request);
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

}  // namespace

// ---- The hub ----

std::mutex UcpHub::instance_mu_;
std::weak_ptr<UcpHub> UcpHub::instance_;

Result<std::shared_ptr<UcpHub>> UcpHub::Acquire(int family) {
  std::lock_guard lk(instance_mu_);
  if (auto hub = instance_.lock()) {
    if (hub->family_ == family) return hub;
    auto name = [](int f) { return f == AF_INET6 ? "IPv6" : "IPv4"; };
    return InvalidArgument(
        std::string("the peer services of this process listen on ") + name(hub->family_) +
        " addresses; one on an " + name(family) +
        " address cannot run beside them (UCX's TCP transport carries one address family per "
        "process, UCX_TCP_AF_PRIO)");
  }
  std::shared_ptr<UcpHub> hub(new UcpHub());
  hub->family_ = family;
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
  // IPv6 peers: the data connections listen on the interfaces' IPv6 addresses (UcpHub). The key
  // names the TCP option without its "TCP_" prefix, as PUT_ENABLE below (UCX 1.13 takes
  // "TCP_AF_PRIO" too, then logs "invalid configuration: TCP_AF_PRIO=inet6" when the worker opens
  // its interfaces and ignores it). UCX applies the key to the transports' options after reading
  // the environment, so it would override $UCX_TCP_AF_PRIO: a value the user set is kept
  // (CheckIpv6BindAddress refused one that does not put inet6 first). This context's
  // configuration only: the environment is left alone (a setenv is undefined behaviour beside
  // threads that may read it), and a later IPv4 hub gets UCX's default.
  if (family_ == AF_INET6 && std::getenv("UCX_TCP_AF_PRIO") == nullptr) {
    if (ucs_status_t s = ucp_config_modify(config, "AF_PRIO", "inet6"); s != UCS_OK) {
      ucp_config_release(config);
      return Unavailable("UCX: ucp_config_modify(AF_PRIO=inet6): " + UcsError(s));
    }
  }
  // No peer may write into our memory by itself. UCX's TCP transport carries a rendezvous chunk
  // as a PUT aimed at the address the receiver announced, and the receiving side copies what
  // arrives there checking nothing else: TCP's memory keys are bare addresses, and a closed
  // endpoint's connection stays open for receiving (uct_tcp_ep_destroy keeps its RX side). A
  // receiver that drops or closes a connection mid-transfer (its receive cancelled, its replica
  // file unmapped) then had the rest of a PUT under way copied into freed memory: SIGSEGV in
  // uct_tcp_iface_progress, or another mapping overwritten (docs/reliability.md). Without PUT a
  // rendezvous sends its data as active messages into UCX's buffers, and UCX copies them into
  // ours only for a receive still posted. The key names the TCP option without its "TCP_"
  // prefix (UCX 1.13 applies it to every transport that has it); it overrides
  // $UCX_TCP_PUT_ENABLE, whose "y" would bring the corruption back.
  if (ucs_status_t s = ucp_config_modify(config, "PUT_ENABLE", "n"); s != UCS_OK) {
    ucp_config_release(config);
    return Unavailable("UCX: ucp_config_modify(PUT_ENABLE=n): " + UcsError(s));
  }
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
  SP_ASSIGN_OR_RETURN(bind_addr_, ResolveAddress(options_.bind_host, options_.port, &bind_len_));
  SP_RETURN_IF_ERROR(CheckIpv6BindAddress(bind_addr_));
  bind_iface_ = DownInterfaceOf(bind_addr_);
  if (bind_iface_.empty()) return StartUcx();
  {
    // The address is returned now, its port too: a bound socket holds the port (port 0: a free
    // one) until the listener takes it. Bound as UCX binds its listener (SO_REUSEADDR): a port
    // it could not take fails here, and the caller may take another (src/agent/replicator.cc).
    internal::UniqueFd fd(::socket(bind_addr_.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) return ErrnoStatus("socket", "peer service", errno);
    const int one = 1;
    sockaddr_storage got{};
    socklen_t got_len = sizeof got;
    if (::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&bind_addr_), bind_len_) != 0 ||
        ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&got), &got_len) != 0) {
      return Unavailable("peer service of node " + options_.node + ": cannot listen on " +
                         options_.bind_host + " port " + std::to_string(options_.port) + ": " +
                         std::strerror(errno));
    }
    SetPort(&bind_addr_, GetPort(got));
    port_reservation_ = std::move(fd);
  }
  address_ = FormatAddress(bind_addr_);
  spdlog::warn(
      "peer service of node {}: the interface {} of {} is down; the service starts (UCX, and "
      "the listener on {}) once it is up, and until then peers cannot reach this node nor it "
      "them (docs/reliability.md, OPEN-4)",
      options_.node, bind_iface_, options_.bind_host, address_);
  starter_ = std::thread([this] { AwaitInterface(); });
  return Status::OK();
}

Status PeerServiceImpl::StartUcx() {
  Result<std::shared_ptr<UcpHub>> hub = UcpHub::Acquire(bind_addr_.ss_family);
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
  std::string address;
  RunOnProgressThread([&] {
    port_reservation_.Reset();  // the listener takes the port now
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&bind_addr_);
    lp.sockaddr.addrlen = bind_len_;
    lp.conn_handler.cb = ConnRequestCb;
    lp.conn_handler.arg = this;
    if (ucs_status_t s = ucp_listener_create(hub_->worker(), &lp, &listener_); s != UCS_OK) {
      listener_ = nullptr;
      listening = Unavailable("UCX: cannot listen on " + options_.bind_host + " port " +
                              std::to_string(GetPort(bind_addr_)) + ": " + UcsError(s));
      return;
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucs_status_t s = ucp_listener_query(listener_, &la); s != UCS_OK) {
      listening = Unavailable("UCX: ucp_listener_query: " + UcsError(s));
      return;
    }
    address = FormatAddress(la.sockaddr);
  });
  if (!listening.ok()) {
    RunOnProgressThread([this] {
      if (listener_) ucp_listener_destroy(listener_);
      listener_ = nullptr;
      hub_->Unregister(this);
    });
    UcpHub::Release(hub_);
    return listening;
  }
  if (address_.empty()) address_ = address;  // a deferred start returned it already
  store_thread_ = std::thread([this] { RunStore(); });
  ucx_ready_.store(true, std::memory_order_release);
  spdlog::info("peer service of node {} listening on {}", options_.node, address);
  return Status::OK();
}

void PeerServiceImpl::AwaitInterface() {
  const int family = bind_addr_.ss_family;
  std::chrono::milliseconds retry = kStartRetry;
  std::unique_lock lk(starter_mu_);
  while (!starter_cv_.wait_for(lk, kInterfacePoll, [this] { return starter_stop_; })) {
    if (!ucs_netif_is_active(bind_iface_.c_str(), static_cast<sa_family_t>(family))) continue;
    lk.unlock();
    // Quiesce waits for this (it joins the thread first).
    Status s = StartUcx();
    lk.lock();
    if (s.ok()) {
      spdlog::info("peer service of node {}: the interface {} is up, the service started",
                   options_.node, bind_iface_);
      return;
    }
    spdlog::warn(
        "peer service of node {}: the interface {} is up, yet the service cannot start "
        "({}); trying again in {} s",
        options_.node, bind_iface_, s.ToString(), std::chrono::duration<double>(retry).count());
    if (starter_cv_.wait_for(lk, retry, [this] { return starter_stop_; })) return;
    retry = std::min<std::chrono::milliseconds>(2 * retry, kStartRetryMax);
  }
}

void PeerServiceImpl::RunOnProgressThread(const std::function<void()>& task) {
  std::promise<void> done;
  hub_->Submit(this, [&] {
    task();
    done.set_value();
  });
  done.get_future().wait();
}

void PeerServiceImpl::Quiesce() {
  if (starter_.joinable()) {
    {
      std::lock_guard lk(starter_mu_);
      starter_stop_ = true;
    }
    starter_cv_.notify_all();
    starter_.join();  // hub_ and the store thread stay as they are from here on
  }
  port_reservation_.Reset();
  if (store_thread_.joinable()) {
    {
      std::lock_guard lk(store_mu_);
      store_stop_ = true;
    }
    store_cv_.notify_all();
    store_thread_.join();
  }
  if (!hub_ || stop_.exchange(true)) return;
  pause_cv_.notify_all();
  // From here on OnConnRequest rejects (it runs on the progress thread and reads stop_). Force
  // close what is left, then wait until UCX no longer holds a request or an endpoint that calls
  // back into this service (force closes are local: quick). Only the progress thread touches the
  // store outside the store thread, for connections, and none is left.
  RunOnProgressThread([this] {
    std::vector<ConnPtr> conns;
    {
      Lock lk(mu_);
      for (auto& [ep, c] : eps_) conns.push_back(c);
    }
    for (auto& c : conns) CloseNow(c, Cancelled("peer service stopped"));
  });
  Lock lk(mu_);
  while (!cv_.wait_for(lk, std::chrono::seconds(10),
                       [&] { return closes_pending_ == 0 && requests_pending_ == 0; })) {
    spdlog::warn("peer service of node {}: still waiting for {} closes and {} requests of UCX",
                 options_.node, closes_pending_, requests_pending_);
  }
  bounces_.clear();  // no receive is left to land in one
}

void PeerServiceImpl::Stop() {
  Quiesce();
  if (!hub_) return;
  RunOnProgressThread([this] {
    if (listener_) ucp_listener_destroy(listener_);
    listener_ = nullptr;
    hub_->Unregister(this);
  });
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
  c->EndSink();
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
  c->EndSink();
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

// ---- What arrives ----

void PeerServiceImpl::OnEpError(ucp_ep_h ep, ucs_status_t status) {
  Lock lk(mu_);
  auto it = eps_.find(ep);
  if (it == eps_.end()) return;
  ConnPtr c = it->second;
  if (!c->client && c->writer) ++transfers_failed_;
  Status why = Unavailable(c->name + ": connection failed: " + UcsError(status));
  if (c->error.ok()) c->error = why;
  // The writer stays until CloseNow (queued next): chunks UCX still delivers land as before
  // instead of being refused as chunks without a transfer.
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

void PeerServiceImpl::HandleChunk(const ConnPtr& c, const WireHeader& h, void* data,
                                  const ucp_am_recv_param_t* param) {
  const bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
  if ((!c->client && c->auth != Conn::Auth::kReady) || !c->receiving_data()) {
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
  if (!rndv) {
    if (!c->writer) std::memcpy(c->sink.data() + h.offset, data, h.len);
    ChunkArrived(c, h, c->writer ? static_cast<const std::byte*>(data) : c->sink.data() + h.offset);
    return;
  }
  Bounce bounce;
  std::byte* dest = nullptr;
  if (c->writer) {
    // The sender keeps kSendWindow chunks in flight; a few more may overlap as receives finish.
    if (c->receiving >= 2 * kSendWindow) {
      ++peers_rejected_;
      ++transfers_failed_;
      return Drop(c,
                  Corruption(c->name + ": more than " + std::to_string(2 * kSendWindow) +
                             " chunks in flight"),
                  true);
    }
    const uint64_t bytes = std::min(c->layout.chunk_bytes, c->layout.total);
    bounce = TakeBounce(bytes);
    if (!bounce.data) {
      ++transfers_failed_;
      return Drop(c,
                  ResourceExhausted(c->name + ": no memory for a receive buffer of " +
                                    std::to_string(bytes) + " bytes"),
                  true);
    }
    dest = bounce.data.get();
  } else {
    dest = c->sink.data() + h.offset;
  }
  // A fetch's receive keeps its destination alive; a push's lands in its own bounce buffer.
  auto* ctx = new RecvCtx{this, c, h, c->writer ? nullptr : c->sink_owner, std::move(bounce)};
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
  // The bounce buffer goes back to the pool whatever happens to the chunk.
  struct Return {
    PeerServiceImpl* svc;
    Bounce& b;
    ~Return() {
      if (b.data) svc->GiveBounce(std::move(b));
    }
  } give_back{this, ctx->bounce};
  if (c->closing || !c->receiving_data()) return;
  if (status != UCS_OK) {
    ++transfers_failed_;
    return Drop(c, Unavailable(c->name + ": receiving a chunk failed: " + UcsError(status)), false);
  }
  ChunkArrived(c, ctx->header,
               ctx->bounce.data ? ctx->bounce.data.get() : c->sink.data() + ctx->header.offset);
}

Bounce PeerServiceImpl::TakeBounce(uint64_t bytes) {
  while (!bounces_.empty()) {
    Bounce b = std::move(bounces_.back());
    bounces_.pop_back();
    if (b.bytes == bytes) return b;  // another size (another sender's chunks) is let go
  }
  // Not std::make_unique: a failed allocation is a dropped transfer, not an exception thrown
  // through UCX's callback.
  return Bounce{std::unique_ptr<std::byte[]>(new (std::nothrow) std::byte[bytes]), bytes};
}

void PeerServiceImpl::GiveBounce(Bounce b) {
  Lock lk(mu_);
  if (stop_.load()) return;
  size_t pushes = 0;
  for (const auto& [ep, c] : eps_) pushes += c->writer ? 1 : 0;
  if (bounces_.size() < kSendWindow * std::max<size_t>(1, pushes)) bounces_.push_back(std::move(b));
}

void PeerServiceImpl::ChunkArrived(const ConnPtr& c, const WireHeader& h, const std::byte* landed) {
  const uint32_t crc = Crc32c(0, landed, h.len);
  if (crc != h.crc) {
    ++transfers_failed_;
    return Drop(c,
                Corruption(c->name + ": chunk at offset " + std::to_string(h.offset) + " (" +
                           std::to_string(h.len) + " bytes) fails its CRC32C"),
                true);
  }
  if (c->writer) {
    if (Status s = c->writer->Write(h.offset, {landed, h.len}); !s.ok()) {
      ++transfers_failed_;
      return Drop(c, s.WithContext(c->name + ": storing a chunk of the replica"), true);
    }
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

}  // namespace ucx

namespace {

// The services Retire keeps, reachable from here until the process ends (so that a leak check
// before _exit does not count them).
std::mutex retired_mu;
std::vector<std::unique_ptr<PeerService>>* retired = nullptr;  // guarded by retired_mu

}  // namespace

void PeerService::Retire(std::unique_ptr<PeerService> service) {
  if (!service) return;
  static_cast<ucx::PeerServiceImpl*>(service.get())->Quiesce();
  std::lock_guard lk(retired_mu);
  if (retired == nullptr) retired = new std::vector<std::unique_ptr<PeerService>>();
  retired->push_back(std::move(service));
}

bool PeerService::AnyRetired() {
  std::lock_guard lk(retired_mu);
  return retired != nullptr && !retired->empty();
}

Result<std::unique_ptr<PeerService>> PeerService::Start(const PeerServiceOptions& options,
                                                        ReplicaStore* store) {
  auto svc = std::make_unique<ucx::PeerServiceImpl>(options, store);
  SP_RETURN_IF_ERROR(svc->Init());
  return std::unique_ptr<PeerService>(std::move(svc));
}

}  // namespace safepoint::replica
