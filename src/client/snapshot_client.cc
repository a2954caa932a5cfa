// SnapshotClient (include/safepoint/client.h): the connection to the node's agent (hello,
// requests, starting and watching the agent), notes, waits, the peer calls and close. Saving into
// a slot is snapshot_save.cc; loading from shared memory is snapshot_load.cc.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "base/aligned_buffer.h"
#include "base/clock.h"
#include "base/crc32c.h"
#include "base/kill_point.h"
#include "base/parallel.h"
#include "base/unique_fd.h"
#include "protocol/protocol.h"
#include "safepoint/client.h"
#include "shm/arena.h"

namespace safepoint {

namespace {

using protocol::MessageType;
using Clock = std::chrono::steady_clock;

// An agent that has not taken its job's lock this long after it was started is presumed dead.
constexpr double kAgentRestartSeconds = 2.0;

}  // namespace

// The thread behind SnapshotClient::watch_: every kWatchSeconds it looks whether an agent holds
// the job's lock, and starts one when none does. A start that finds another agent serving the
// job exits at once (the lock lets one in), so racing a request's own restart is harmless. The
// new agent adopts the slots and persists what the dead one left; the client's next request
// connects to it. After a fork, the child (which has no such thread) only forgets it.
class SnapshotClient::AgentWatch {
 public:
  static constexpr auto kWatchSeconds = std::chrono::seconds(1);

  AgentWatch(std::string job_dir, std::function<Status()> start)
      : job_dir_(std::move(job_dir)), start_(std::move(start)), owner_(::getpid()) {
    thread_ = std::thread([this] { Run(); });
  }
  ~AgentWatch() {
    if (::getpid() != owner_) {
      thread_.detach();  // forked: the thread is the parent's
      return;
    }
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void Run() {
    std::unique_lock lk(mu_);
    while (!cv_.wait_for(lk, kWatchSeconds, [&] { return stop_; })) {
      lk.unlock();
      if (!protocol::AgentAlive(job_dir_)) start_().IgnoreError();  // tried again next time
      lk.lock();
    }
  }

  const std::string job_dir_;
  const std::function<Status()> start_;
  const pid_t owner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

SnapshotClient::~SnapshotClient() {
  watch_.reset();
  Disconnect();
}

namespace {

// The text of an error reply (or the raw payload if even that does not decode).
std::string ErrorText(const std::string& payload) {
  protocol::ErrorReply e;
  return protocol::Decode(payload, &e).ok() ? e.error : payload;
}

}  // namespace

namespace internal {

Status HelloRefusal(std::string_view text) {
  for (StatusCode code :
       {StatusCode::kIOError, StatusCode::kResourceExhausted, StatusCode::kNotFound,
        StatusCode::kSuperseded, StatusCode::kUnavailable}) {
    const std::string prefix = std::string(StatusCodeName(code)) + ": ";
    if (text.starts_with(prefix)) {
      // Unavailable: the agent is exiting (EnsureAgent waits for it and starts the next one).
      if (code == StatusCode::kSuperseded || code == StatusCode::kUnavailable)
        return Status(code, std::string(text.substr(prefix.size())));
      return Status(code, std::string(text.substr(prefix.size())) +
                              " (the safepoint agent cannot use the checkpoint path)");
    }
  }
  return InvalidArgument("the safepoint agent refused this process: " + std::string(text));
}

}  // namespace internal

Result<std::unique_ptr<SnapshotClient>> SnapshotClient::Connect(ClientOptions options) {
  SP_RETURN_IF_ERROR(ValidateJobName(options.job));
  if (options.world_size == 0 || options.rank >= options.world_size) {
    return InvalidArgument("rank " + std::to_string(options.rank) + " is not in [0, " +
                           std::to_string(options.world_size) + ")");
  }
  SP_RETURN_IF_ERROR(ValidateTiers(options.storage, options.tiers));
  auto c = std::unique_ptr<SnapshotClient>(new SnapshotClient());
  c->opt_ = std::move(options);
  SP_ASSIGN_OR_RETURN(c->job_dir_, JobDirectory(c->opt_.shm_dir, c->opt_.job, /*create=*/true));
  SP_ASSIGN_OR_RETURN(c->arena_, Arena::Open(c->job_dir_, c->opt_.rank));
  SP_RETURN_IF_ERROR(c->EnsureAgent());
  if (!c->opt_.agent_binary.empty()) {
    // StartAgent reads only what Connect set: safe on the watch's thread.
    c->watch_ = std::make_unique<AgentWatch>(c->job_dir_,
                                             [client = c.get()] { return client->StartAgent(); });
  }
  return c;
}

void SnapshotClient::Disconnect() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Status SnapshotClient::ConnectOnce() {
  Disconnect();
  const std::string path = protocol::AgentSocketPath(job_dir_);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return InvalidArgument(path + ": socket path too long; use a shorter shm_dir");
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  internal::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return ErrnoStatus("socket", path, errno);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Unavailable(path + ": no safepoint agent is listening (" + std::strerror(errno) + ")");
  }
  fd_ = fd.Release();
  return Hello();
}

Status SnapshotClient::Hello() {
  const protocol::HelloRequest hello{opt_.rank,
                                     opt_.world_size,
                                     opt_.storage,
                                     opt_.keep,
                                     static_cast<uint32_t>(::getpid()),
                                     opt_.tiers,
                                     opt_.metrics,
                                     opt_.event_log,
                                     opt_.compression,
                                     opt_.incremental,
                                     opt_.attempt};
  protocol::FrameDecoder decoder;
  SP_RETURN_IF_ERROR(protocol::SendMessage(fd_, MessageType::kHello, protocol::Encode(hello)));
  // A hello of another world size than the job's waits while the agent persists and drops the
  // previous world's snapshots (src/agent/world_change.cc); a kAck every few seconds says the
  // agent is at it, and each restarts the 30 s the client waits for a message.
  protocol::Message reply;
  do {
    SP_ASSIGN_OR_RETURN(reply, protocol::ReceiveMessage(fd_, decoder, 30));
  } while (reply.type == MessageType::kAck);
  if (reply.type == MessageType::kError) {
    Disconnect();
    return internal::HelloRefusal(ErrorText(reply.payload));
  }
  protocol::HelloReply hello_reply;
  if (reply.type != MessageType::kHelloReply ||
      !protocol::Decode(reply.payload, &hello_reply).ok()) {
    Disconnect();
    return Unavailable("the safepoint agent answered hello with an unexpected message");
  }
  // The agent removes slot files of a job whose world size changed before it answers: map the
  // rank's slots as they are now, never a removed file's, and the rank's claim (src/shm/
  // rank_claim.h), which the agent wrote before it answered: this process writes the rank's slots
  // only while the claim stays at the epoch it was given.
  if (arena_) {
    SP_RETURN_IF_ERROR(arena_->Refresh());
    arena_->set_claim_epoch(hello_reply.claim_epoch);
  }
  return SendPeerState();
}

// A new agent (the previous one died) learns the peer setup and membership again. Failures are
// not fatal to the connection: replication is a cache, saves and loads go on without it.
Status SnapshotClient::SendPeerState() {
  protocol::FrameDecoder decoder;
  auto exchange = [&](MessageType type, const std::string& payload) -> Status {
    SP_RETURN_IF_ERROR(protocol::SendMessage(fd_, type, payload));
    SP_ASSIGN_OR_RETURN(protocol::Message reply, protocol::ReceiveMessage(fd_, decoder, 30));
    if (reply.type == MessageType::kError) return InvalidArgument(ErrorText(reply.payload));
    return Status::OK();
  };
  if (peer_setup_) {
    const auto& [node, host, timeout] = *peer_setup_;
    Status s = exchange(
        MessageType::kPeerSetup,
        protocol::Encode(protocol::PeerSetupRequest{
            node, host, static_cast<uint32_t>(timeout * 1000), peer_port_, opt_.max_shm_bytes}));
    if (!s.ok()) return Status::OK();
  }
  if (membership_) {
    exchange(MessageType::kMembership, protocol::Encode(*membership_)).IgnoreError();
  }
  return Status::OK();
}

Result<std::string> SnapshotClient::PeerSetup(const std::string& node, const std::string& bind_host,
                                              double timeout_s) {
  SP_ASSIGN_OR_RETURN(std::string payload,
                      Request(MessageType::kPeerSetup,
                              protocol::Encode(protocol::PeerSetupRequest{
                                  node, bind_host, static_cast<uint32_t>(timeout_s * 1000),
                                  peer_port_, opt_.max_shm_bytes}),
                              MessageType::kPeerSetupReply, 60));
  protocol::PeerSetupReply reply;
  SP_RETURN_IF_ERROR(protocol::Decode(payload, &reply));
  peer_setup_.emplace(node, bind_host, timeout_s);
  // "host:port" or "[ip6]:port": a new agent listens on this port again.
  const size_t colon = reply.address.rfind(':');
  if (colon != std::string::npos) {
    peer_port_ =
        static_cast<uint32_t>(std::strtoul(reply.address.c_str() + colon + 1, nullptr, 10));
  }
  return reply.address;
}

Status SnapshotClient::SetMembership(const Membership& m) {
  SP_ASSIGN_OR_RETURN(std::string payload, Request(MessageType::kMembership, protocol::Encode(m),
                                                   MessageType::kAck, 60));
  protocol::AckReply reply;
  SP_RETURN_IF_ERROR(protocol::Decode(payload, &reply));
  if (!reply.status.ok()) return reply.status;
  membership_ = m;
  return Status::OK();
}

Result<std::vector<PeerCopy>> SnapshotClient::PeerCopies() {
  SP_ASSIGN_OR_RETURN(
      std::string payload,
      Request(MessageType::kPeerList, protocol::Encode(protocol::PeerListRequest{opt_.rank}),
              MessageType::kPeerListReply, 120));
  protocol::PeerListReply reply;
  SP_RETURN_IF_ERROR(protocol::Decode(payload, &reply));
  return std::move(reply.snapshots);
}

Result<PeerFetchResult> SnapshotClient::FetchFromPeers(uint64_t step, uint64_t attempt,
                                                       double timeout_s) {
  protocol::PeerFetchRequest request;
  request.rank = opt_.rank;
  request.step = step;
  request.attempt = attempt;
  return PeerFetch(protocol::Encode(request), timeout_s);
}

Result<PeerFetchResult> SnapshotClient::PeerFetch(const std::string& request, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  SP_ASSIGN_OR_RETURN(std::string payload, Request(MessageType::kPeerFetch, request,
                                                   MessageType::kPeerFetchReply, timeout_s));
  protocol::PeerFetchReply reply;
  SP_RETURN_IF_ERROR(protocol::Decode(payload, &reply));
  if (!reply.status.ok()) return reply.status;
  SP_RETURN_IF_ERROR(arena_->Refresh());  // the agent may have created the slot file
  return PeerFetchResult{
      reply.slot, reply.bytes, reply.source,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

Status SnapshotClient::PauseReplication(bool paused) {
  if (fd_ < 0) SP_RETURN_IF_ERROR(EnsureAgent());
  return protocol::SendMessage(fd_, MessageType::kPause,
                               protocol::Encode(protocol::PauseNote{paused}));
}

void SnapshotClient::Report(std::string_view event, uint64_t step, bool saved, double seconds,
                            uint64_t bytes, std::string_view source, std::string_view error,
                            std::string_view level) {
  if (fd_ < 0) return;
  const protocol::ReportNote note{std::string(event),
                                  step,
                                  saved,
                                  static_cast<uint64_t>(std::max(0.0, seconds) * 1e9),
                                  bytes,
                                  std::string(source),
                                  std::string(error),
                                  std::string(level)};
  if (!protocol::SendMessage(fd_, MessageType::kReport, protocol::Encode(note), /*timeout_s=*/0.5)
           .ok()) {
    Disconnect();  // the next request reconnects (and starts an agent if none is left)
  }
}

Status SnapshotClient::StartAgent() {
  if (opt_.agent_binary.empty()) {
    return Unavailable(job_dir_ + ": no safepoint agent serves job " + opt_.job +
                       " and none may be started here; run `safepoint agent --job " + opt_.job +
                       "`");
  }
  if (::access(opt_.agent_binary.c_str(), X_OK) != 0) {
    return ErrnoStatus("exec", opt_.agent_binary, errno);
  }
  const std::string log = protocol::AgentLogPath(job_dir_);
  std::vector<std::string> args = {opt_.agent_binary, "--job", opt_.job, "--shm-dir", opt_.shm_dir};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // Double fork with setsid: the agent is in its own session (signals for the training job's
  // process group do not reach it) and is reparented to init, so nobody has to reap it.
  const pid_t child = ::fork();
  if (child < 0) return ErrnoStatus("fork", opt_.agent_binary, errno);
  if (child == 0) {
    ::setsid();
    const pid_t grandchild = ::fork();
    if (grandchild != 0) ::_exit(grandchild < 0 ? 1 : 0);
    // In the job directory (private: JobDirectory checked it); never through a symlink.
    const int out =
        ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
    const int in = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (out >= 0) {
      ::dup2(out, 1);
      ::dup2(out, 2);
    }
    if (in >= 0) ::dup2(in, 0);
    ::syscall(SYS_close_range, 3, ~0U, 0);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  return Status::OK();
}

Status SnapshotClient::EnsureAgent() {
  Status s = ConnectOnce();
  if (s.ok() || s.code() != StatusCode::kUnavailable) return s;
  SP_RETURN_IF_ERROR(StartAgent());
  const auto t0 = Clock::now();
  auto started = t0;
  bool seen_alive = false;
  for (;;) {
    s = ConnectOnce();
    if (s.ok() || s.code() != StatusCode::kUnavailable) return s;
    // An agent that died while starting (after taking the job's lock, or before: it holds the
    // lock within milliseconds when it lives) is started again, instead of waiting out the
    // timeout for one that is gone. A redundant start is harmless: the lock lets one agent in.
    const bool alive = protocol::AgentAlive(job_dir_);
    seen_alive |= alive;
    if (!alive && (seen_alive || SecondsSince(started) > kAgentRestartSeconds)) {
      SP_RETURN_IF_ERROR(StartAgent());
      started = Clock::now();
      seen_alive = false;
    }
    if (SecondsSince(t0) > opt_.agent_start_timeout_s) {
      return Unavailable(job_dir_ + ": the safepoint agent did not start within " +
                         std::to_string(static_cast<int>(opt_.agent_start_timeout_s)) + " s; see " +
                         protocol::AgentLogPath(job_dir_) + " (" + s.message() + ")");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

Status SnapshotClient::ReviveAgentIfGone() {
  if (fd_ >= 0) {
    pollfd p{fd_, POLLRDHUP, 0};
    const int n = ::poll(&p, 1, 0);
    if (n == 0 || (n > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) == 0)) {
      return Status::OK();  // connected, or only data to read (a reply the next request reads)
    }
    if (n < 0 && errno == EINTR) return Status::OK();  // the next request finds out
    Disconnect();
  }
  return EnsureAgent();
}

Result<std::string> SnapshotClient::Request(MessageType type, const std::string& payload,
                                            MessageType reply_type, double timeout_s) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (fd_ < 0) SP_RETURN_IF_ERROR(EnsureAgent());
    Status s = protocol::SendMessage(fd_, type, payload);
    if (s.ok()) {
      protocol::FrameDecoder decoder;
      auto reply = protocol::ReceiveMessage(fd_, decoder, timeout_s);
      if (reply.ok()) {
        if (reply->type == MessageType::kError) {
          return InvalidArgument("the safepoint agent refused the request: " +
                                 ErrorText(reply->payload));
        }
        if (reply->type != reply_type) {
          return Unavailable("the safepoint agent sent an unexpected reply");
        }
        return std::move(reply->payload);
      }
      s = reply.status();
      if (s.code() == StatusCode::kCancelled) {
        Disconnect();  // a late reply must not be taken for the next request's
        return s;
      }
    }
    if (s.code() != StatusCode::kUnavailable) return s;
    Disconnect();  // the agent died: reconnect (starting a new one) and try once more
  }
  return Unavailable(job_dir_ + ": the safepoint agent is not reachable");
}

Status SnapshotClient::SetLineage(Lineage lineage) {
  SP_RETURN_IF_ERROR(ValidateLineage(lineage));
  lineage_ = std::move(lineage);
  return Status::OK();
}

std::string SnapshotClient::Notify(const SkipRanges& skip, std::optional<SaveReport> report) {
  if (!pending_note_) {
    // A skipped save (no slot was free): its report is the one message.
    if (report) Report("save", report->step, false, report->blocking_seconds, 0);
    return "";
  }
  pending_note_->skip = skip;
  if (report) {
    protocol::ReportNote& r = pending_note_->report.emplace();
    r.event = "save";
    r.step = pending_note_->step;
    r.nanos = static_cast<uint64_t>(std::max(0.0, report->blocking_seconds) * 1e9);
    r.bytes = report->bytes;
  }
  const std::string note = protocol::Encode(*pending_note_);
  pending_note_.reset();
  Status s = fd_ >= 0 ? protocol::SendMessage(fd_, MessageType::kSnapshot, note)
                      : Unavailable("not connected");
  if (!s.ok()) {
    Disconnect();
    s = EnsureAgent();  // a new agent adopts the arena and persists what is not yet committed
    if (s.ok()) s = protocol::SendMessage(fd_, MessageType::kSnapshot, note);
  }
  return s.ok() ? "" : s.ToString();
}

Status SnapshotClient::Wait(double timeout_s) {
  // With replication, also wait until the newest snapshot reached its peers.
  const bool replication_only = !last_persist_step_ && membership_ && last_saved_step_;
  if (!last_persist_step_ && !replication_only) return Status::OK();
  const uint64_t step = replication_only ? *last_saved_step_ : *last_persist_step_;
  SP_ASSIGN_OR_RETURN(
      std::string payload,
      Request(MessageType::kWait, protocol::Encode(protocol::WaitRequest{step, !replication_only}),
              MessageType::kWaitReply, timeout_s));
  protocol::WaitReply reply;
  if (Status s = protocol::Decode(payload, &reply); !s.ok()) {
    return Unavailable("the safepoint agent sent a malformed reply: " + s.message());
  }
  if (reply.status.ok()) return Status::OK();
  return Status(reply.status.code(), "persisting step " + std::to_string(step) + " of " +
                                         opt_.storage + " failed: " + reply.status.message());
}

Result<std::string> SnapshotClient::AgentStatus() {
  return Request(MessageType::kStatus, "{}", MessageType::kStatusReply, 30);
}

Status SnapshotClient::Close(double timeout_s) {
  watch_.reset();  // the agent exits once every rank closed: no restart from here on
  auto payload = Request(MessageType::kClose, "{}", MessageType::kCloseReply, timeout_s);
  Disconnect();
  if (!payload.ok()) return payload.status();
  protocol::CloseReply reply;
  if (Status s = protocol::Decode(*payload, &reply); !s.ok()) {
    return IOError(job_dir_ + ": closing failed: the agent sent a malformed reply: " + s.message());
  }
  if (!reply.status.ok()) return IOError(job_dir_ + ": closing failed: " + reply.status.message());
  return Status::OK();
}

}  // namespace safepoint
