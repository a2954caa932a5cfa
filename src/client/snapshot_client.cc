// SnapshotClient (include/safepoint/client.h).
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

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

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
  for (StatusCode code : {StatusCode::kIOError, StatusCode::kResourceExhausted,
                          StatusCode::kNotFound, StatusCode::kSuperseded}) {
    const std::string prefix = std::string(StatusCodeName(code)) + ": ";
    if (text.starts_with(prefix)) {
      if (code == StatusCode::kSuperseded)
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
  const auto t0 = std::chrono::steady_clock::now();
  SP_ASSIGN_OR_RETURN(
      std::string payload,
      Request(MessageType::kPeerFetch,
              protocol::Encode(protocol::PeerFetchRequest{opt_.rank, step, attempt}),
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
    if (!alive && (seen_alive || Since(started) > kAgentRestartSeconds)) {
      SP_RETURN_IF_ERROR(StartAgent());
      started = Clock::now();
      seen_alive = false;
    }
    if (Since(t0) > opt_.agent_start_timeout_s) {
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

namespace {

// FNV-1a over every tensor's ReplicaKey (the structure two ranks compare; `elsewhere` is not
// part of it, so a plan keeps its hash whatever it leaves out).
uint64_t HashStructure(std::span<const TensorSource> tensors) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (const TensorSource& t : tensors) {
    const std::string key = ReplicaKey(t.spec);
    for (char c : key) hash = (hash ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
    hash = (hash ^ key.size()) * 0x100000001b3ull;  // where one key ends
  }
  return hash;
}

Status CheckSkipRanges(const SkipRanges& skip, size_t tensors) {
  uint32_t prev = 0;
  for (const auto& [first, last] : skip) {
    if (first >= last || last > tensors || first < prev) {
      return InvalidArgument("copy skip range [" + std::to_string(first) + ", " +
                             std::to_string(last) + ") is not ascending within the plan's " +
                             std::to_string(tensors) + " tensors");
    }
    prev = last;
  }
  return Status::OK();
}

}  // namespace

Result<SnapshotResult> SnapshotClient::Save(uint64_t step, std::vector<TensorSource> tensors,
                                            std::string extras, bool persist, bool notify,
                                            const StageFn& stage) {
  // A full save of the structure the copy skip was set for (GPU states take this path every
  // time: their plan is never reused) still leaves the other ranks' tensors out.
  if (!copy_skip_.empty()) {
    const bool same =
        copy_skip_.back().second <= tensors.size() && HashStructure(tensors) == copy_skip_hash_;
    if (same) {
      for (TensorSource& t : tensors) t.spec.elsewhere = false;
      for (const auto& [first, last] : copy_skip_) {
        for (uint32_t i = first; i < last; ++i) tensors[i].spec.elsewhere = true;
      }
    } else {
      copy_skip_.clear();
    }
  }
  plan_.reset();
  plan_hash_.reset();
  ImageMeta meta;
  meta.job = opt_.job;
  meta.attempt = opt_.attempt;
  meta.lineage = lineage_;
  meta.step = step;
  meta.rank = opt_.rank;
  meta.world_size = opt_.world_size;
  SP_ASSIGN_OR_RETURN(plan_,
                      ImageBuilder::Create(std::move(meta), std::move(tensors), std::move(extras)));
  return WriteSnapshot(step, persist, notify, stage);
}

Result<SnapshotResult> SnapshotClient::SaveLike(uint64_t step, std::span<const void* const> data,
                                                bool persist, bool notify) {
  if (!plan_ || data.size() != plan_->tensors().size()) {
    return InvalidArgument(job_dir_ + ": no save plan for " + std::to_string(data.size()) +
                           " tensors to reuse");
  }
  plan_->Rebind(step, data);
  return WriteSnapshot(step, persist, notify, {});
}

Status SnapshotClient::PrepareWrite(bool notify, SnapshotResult* result) {
  pending_note_.reset();
  if (!notify) {
    // The caller tells the agent later: after a collective of the ranks (they agree on who
    // writes which replica first), or once it measured the save, whose report travels with
    // the note (safepoint.Checkpointer: one message per save). A rank whose agent died restarts it
    // now: the ranks that wait for a step's commit wait for this node's images, which only an agent
    // writes, and would never reach the collective (the node-loss campaign's hang, seed
    // 1005935286). The new agent adopts the arena and persists what the dead one left. When no
    // agent can be started the save still goes on into memory (failing it here would leave the
    // other ranks in the collective): Notify tries again and returns the error.
    [[maybe_unused]] const Status revived = ReviveAgentIfGone();
  }
  result->image_bytes = plan_->size();
  return CheckShmCap(plan_->size());
}

// False: skipped (no slot may be overwritten and the client does not wait).
Result<bool> SnapshotClient::AcquireSlot(SnapshotResult* result, SlotWriteTicket* ticket) {
  const auto t_wait = Clock::now();
  for (int spins = 0;; ++spins) {
    SP_ASSIGN_OR_RETURN(auto acquired, arena_->BeginWrite(plan_->size()));
    if (acquired.first == Arena::Acquire::kAcquired) {
      *ticket = acquired.second;
      break;
    }
    if (!opt_.wait_when_busy) {
      result->wait_seconds = Since(t_wait);
      return false;  // every slot that could be overwritten is still being persisted
    }
    // The agent holds the slot while it persists it. If it died, a new one clears its leases.
    if (spins % 500 == 499 && !protocol::AgentAlive(job_dir_)) {
      Disconnect();
      SP_RETURN_IF_ERROR(EnsureAgent());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(spins < 100 ? 1 : 2));
  }
  result->wait_seconds = Since(t_wait);
  result->create_seconds = ticket->create_seconds;
  result->slot = ticket->slot;
  return true;
}

Status SnapshotClient::CompleteWrite(uint64_t step, bool persist, bool notify,
                                     const SlotWriteTicket& ticket, SnapshotResult* result) {
  SP_KILL_POINT("client.save.before_complete");
  if (!arena_->FinishWrite(ticket, step, plan_->size(), /*leased=*/persist)) {
    // Superseded by a newer run's process while copying (src/shm/rank_claim.h): nothing of this
    // save is ever read; the slot went back FREE.
    Status s = arena_->CheckClaim();
    if (s.ok()) s = Cancelled(SlotSource(SlotInfo{ticket.slot}) + " changed while it was written");
    return s;
  }
  saved_ = true;
  if (arena_->usable_slots() < arena_->slot_count()) arena_->DropUnusableSlots();
  SP_KILL_POINT("client.save.after_complete");
  result->saved = true;
  if (persist) last_persist_step_ = step;
  last_saved_step_ = step;
  // Tell the agent; the snapshot is safe in memory whatever happens here. A note sent here
  // carries the save's report as this client measured it (waiting for a slot, creating it,
  // the copy); a caller that notifies later reports its own blocking time.
  pending_note_ = std::make_unique<protocol::SnapshotNote>(
      protocol::SnapshotNote{ticket.slot, ticket.generation, step, persist, persist, {}, {}});
  if (notify) {
    const double blocking = result->wait_seconds + result->create_seconds + result->copy_seconds;
    result->agent_error = Notify({}, SaveReport{step, blocking, plan_->size()});
  }
  return Status::OK();
}

uint64_t SnapshotClient::StructureHash() {
  if (!plan_) return 0;
  if (!plan_hash_) plan_hash_ = HashStructure(plan_->tensors());
  return *plan_hash_;
}

Status SnapshotClient::SetCopySkip(SkipRanges skip) {
  if (!skip.empty()) {
    if (!plan_) return InvalidArgument(job_dir_ + ": no save plan to leave tensors out of");
    SP_RETURN_IF_ERROR(CheckSkipRanges(skip, plan_->tensors().size()));
    copy_skip_hash_ = StructureHash();
  }
  copy_skip_ = std::move(skip);
  return ApplyCopySkip();
}

Status SnapshotClient::ApplyCopySkip() {
  if (!plan_) return Status::OK();
  const size_t n = plan_->tensors().size();
  std::vector<bool> skip(n, false);
  for (const auto& [first, last] : copy_skip_) {
    for (uint32_t i = first; i < last; ++i) skip[i] = true;
  }
  bool same = true;
  for (size_t i = 0; i < n && same; ++i) same = plan_->tensors()[i].spec.elsewhere == skip[i];
  if (same) return Status::OK();  // the plan leaves these out already
  std::vector<TensorSource> tensors = plan_->tensors();
  // A tensor's address stays that of the last save's until the next Rebind (or Publish), which
  // comes before any fill reads it.
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].spec.elsewhere = skip[i];
  ImageMeta meta = plan_->meta();
  SP_ASSIGN_OR_RETURN(auto plan, ImageBuilder::Create(std::move(meta), std::move(tensors),
                                                      plan_->extras(), plan_->layout().chunk_size));
  plan_ = std::move(plan);
  return Status::OK();
}

SkipRanges SnapshotClient::LastCopySkip() const {
  SkipRanges out;
  if (!plan_) return out;
  const auto& tensors = plan_->tensors();
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].spec.elsewhere) continue;
    if (!out.empty() && out.back().second == i) {
      out.back().second = i + 1;
    } else {
      out.emplace_back(i, i + 1);
    }
  }
  return out;
}

std::vector<TensorSpec> SnapshotClient::last_specs() const {
  std::vector<TensorSpec> out;
  if (!plan_) return out;
  out.reserve(plan_->tensors().size());
  for (const TensorSource& t : plan_->tensors()) out.push_back(t.spec);
  return out;
}

Result<SnapshotResult> SnapshotClient::WriteSnapshot(uint64_t step, bool persist, bool notify,
                                                     const StageFn& stage) {
  SnapshotResult result;
  result.persist_requested = persist;
  SP_RETURN_IF_ERROR(PrepareWrite(notify, &result));
  SlotWriteTicket ticket;
  SP_ASSIGN_OR_RETURN(const bool acquired, AcquireSlot(&result, &ticket));
  if (!acquired) return result;

  const auto t_copy = Clock::now();
  const size_t threads = opt_.copy_threads ? opt_.copy_threads : internal::DefaultCpuThreads();
  if (stage) {
    Status staged = stage(ticket.data, *plan_);
    if (!staged.ok()) {
      arena_->AbortWrite(ticket);
      return staged;
    }
  }
  plan_->FillAll(ticket.data, threads);
  result.copy_seconds = Since(t_copy);
  SP_RETURN_IF_ERROR(CompleteWrite(step, persist, notify, ticket, &result));
  return result;
}

// BeginStreamed's copy: threads take chunks in order; a chunk is filled once every tensor that
// starts in it or before has been published.
class SnapshotClient::Streamed : public SnapshotClient::StreamedSave {
 public:
  Streamed(SnapshotClient* client, uint64_t step, bool persist, bool notify, SlotWriteTicket ticket,
           SnapshotResult result, size_t threads)
      : c_(client),
        step_(step),
        persist_(persist),
        notify_(notify),
        ticket_(ticket),
        result_(result),
        t0_(Clock::now()) {
    const ImageBuilder& b = *c_->plan_;
    const uint64_t chunks = b.chunk_count();
    const uint64_t chunk = b.layout().chunk_size;
    const size_t n = b.tensors().size();
    need_.resize(chunks);
    crcs_.resize(chunks);
    size_t t = 0;
    for (uint64_t i = 0; i < chunks; ++i) {
      const uint64_t end = std::min((i + 1) * chunk, b.layout().checksums_offset);
      while (t < n && b.tensor_offset(t) < end) ++t;
      need_[i] = t;  // tensors [0, t) must be known to fill chunk i
    }
    // The walking thread joins the copy once the walk is done (Finish): while it walks, one
    // worker fewer (none with one copy thread), so that the walk and the copy never
    // oversubscribe the cores and never use more than `threads` copying.
    threads = std::max<size_t>(1, std::min<size_t>(threads, chunks));
    for (size_t i = 0; i + 1 < threads; ++i) workers_.emplace_back([this] { Work(); });
  }
  ~Streamed() override {  // without Finish (the walk failed): nothing is saved
    if (finished_) return;
    abort_.store(true, std::memory_order_relaxed);
    Stop();
    c_->arena_->AbortWrite(ticket_);
  }

  void Publish(size_t i, const void* data) override {
    c_->plan_->SetTensorData(i, data);
    published_.store(i + 1, std::memory_order_release);
  }

  Result<SnapshotResult> Finish(bool matched) override {
    finished_ = true;
    if (matched) {
      Work();  // the walk is done: its thread copies the chunks left
    } else {
      abort_.store(true, std::memory_order_relaxed);
    }
    Stop();
    if (!matched) {
      c_->arena_->AbortWrite(ticket_);
      return SnapshotResult{};
    }
    auto section = c_->plan_->ChecksumSection(crcs_);
    std::memcpy(ticket_.data.data() + c_->plan_->layout().checksums_offset, section.data(),
                section.size());
    result_.copy_seconds = Since(t0_);
    SP_RETURN_IF_ERROR(c_->CompleteWrite(step_, persist_, notify_, ticket_, &result_));
    return result_;
  }

 private:
  void Stop() {
    for (std::thread& w : workers_) w.join();
    workers_.clear();
  }

  void Work() {
    const ImageBuilder& b = *c_->plan_;
    const uint64_t chunk = b.layout().chunk_size;
    for (;;) {
      const uint64_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= need_.size()) return;
      // Wait for the walk: the first chunks are ready early, later ones as it goes.
      for (int polls = 0; published_.load(std::memory_order_acquire) < need_[i]; ++polls) {
        if (abort_.load(std::memory_order_relaxed)) return;
        if (polls < 64) {
          std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
      }
      const uint64_t off = i * chunk;
      const uint64_t len = std::min(chunk, b.layout().checksums_offset - off);
      constexpr uint64_t kPiece = 256 << 10;  // as ImageBuilder::FillAll
      uint32_t crc = 0;
      for (uint64_t p = 0; p < len; p += kPiece) {
        auto piece = ticket_.data.subspan(off + p, std::min(kPiece, len - p));
        b.Fill(off + p, piece);
        crc = internal::Crc32c(crc, piece.data(), piece.size());
        SP_KILL_POINT("client.copy.piece");
      }
      crcs_[i] = crc;
    }
  }

  SnapshotClient* c_;
  uint64_t step_;
  bool persist_, notify_;
  SlotWriteTicket ticket_;
  SnapshotResult result_;
  Clock::time_point t0_;
  std::vector<size_t> need_;
  std::vector<uint32_t> crcs_;
  std::atomic<size_t> published_{0};
  std::atomic<uint64_t> next_{0};
  std::atomic<bool> abort_{false};
  bool finished_ = false;
  std::vector<std::thread> workers_;
};

Result<std::pair<std::unique_ptr<SnapshotClient::StreamedSave>, SnapshotResult>>
SnapshotClient::BeginStreamed(uint64_t step, bool persist, bool notify) {
  if (!plan_) return InvalidArgument(job_dir_ + ": no save plan to reuse");
  SnapshotResult result;
  result.persist_requested = persist;
  SP_RETURN_IF_ERROR(PrepareWrite(notify, &result));
  SlotWriteTicket ticket;
  SP_ASSIGN_OR_RETURN(const bool acquired, AcquireSlot(&result, &ticket));
  if (!acquired) return std::make_pair(std::unique_ptr<StreamedSave>(), result);
  plan_->Rebind(step);
  const size_t threads = opt_.copy_threads ? opt_.copy_threads : internal::DefaultCpuThreads();
  return std::make_pair(std::unique_ptr<StreamedSave>(std::make_unique<Streamed>(
                            this, step, persist, notify, ticket, result, threads)),
                        result);
}

Status SnapshotClient::CheckShmCap(uint64_t image_bytes) {
  if (opt_.max_shm_bytes == 0) return Status::OK();
  SP_RETURN_IF_ERROR(arena_->Refresh());
  SP_ASSIGN_OR_RETURN(const uint64_t others, JobShmBytes(job_dir_, opt_.rank));
  // What this rank's first n slots take once each can hold the image (those too small are laid
  // out again); the slots past them are dropped after the next save.
  const std::vector<SlotInfo> slots = arena_->Slots();
  auto need = [&](size_t n) {
    uint64_t bytes = 0;
    for (size_t i = 0; i < n && i < slots.size(); ++i) {
      const SlotInfo& s = slots[i];
      bytes += SlotKeptFor(s.capacity, image_bytes) ? kSlotHeaderBytes + s.capacity
                                                    : SlotFileBytes(image_bytes);
    }
    return bytes;
  };
  // Two slots or more keep the newest snapshot while the next one is copied; below that, one
  // slot that the next save overwrites (budget mode: never more than the cap, never an OOM).
  const uint32_t all = arena_->slot_count();
  if (others + need(all) <= opt_.max_shm_bytes) {
    arena_->set_usable_slots(all);
    return Status::OK();
  }
  // One slot: the others are dropped before the copy, except one the agent still reads.
  uint64_t held = 0;
  for (size_t i = 1; i < slots.size(); ++i) {
    if (slots[i].leased) held += kSlotHeaderBytes + slots[i].capacity;
  }
  if (others + need(1) + held <= opt_.max_shm_bytes) {
    arena_->set_usable_slots(1);
    arena_->DropUnusableSlots();
    return Status::OK();
  }
  return ResourceExhausted(job_dir_ + ": a snapshot of rank " + std::to_string(opt_.rank) + " (" +
                           std::to_string(image_bytes) + " bytes) needs " +
                           std::to_string(need(1)) +
                           " bytes of shared memory in one slot, and the job's other ranks on "
                           "this node hold " +
                           std::to_string(others) +
                           " bytes: more than max_shm_bytes=" + std::to_string(opt_.max_shm_bytes) +
                           "; raise the cap or save less per rank");
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

Result<SlotInfo> SnapshotClient::FindSlot(std::optional<uint64_t> step,
                                          std::optional<uint64_t> min_step) {
  SP_RETURN_IF_ERROR(arena_->Refresh());
  if (!step) {
    const std::optional<SlotInfo> newest = arena_->NewestComplete();
    if (!newest || (min_step && newest->step < *min_step)) {
      return NotFound(job_dir_ + ": no snapshot of rank " + std::to_string(opt_.rank) +
                      " in memory" +
                      (min_step ? " at step " + std::to_string(*min_step) + " or newer" : ""));
    }
    return *newest;
  }
  // Two slots may hold the step (saved again after the ranks resumed from an older one): the
  // snapshot completed last is the current run's.
  std::optional<SlotInfo> found;
  for (const SlotInfo& s : arena_->Slots()) {
    if (s.state == SlotState::kComplete && s.step == *step &&
        (!found || s.complete_time_ns > found->complete_time_ns)) {
      found = s;
    }
  }
  if (found) return *found;
  return NotFound(job_dir_ + ": no snapshot of step " + std::to_string(*step) + " of rank " +
                  std::to_string(opt_.rank) + " in memory");
}

Result<MemorySnapshot> SnapshotClient::LoadNewest(std::optional<uint64_t> min_step, bool in_place,
                                                  std::span<TensorFill> fills,
                                                  const std::string* known_extras) {
  SP_ASSIGN_OR_RETURN(SlotInfo slot, FindSlot(std::nullopt, min_step));
  return LoadSlot(slot, in_place, fills, known_extras);
}

Result<MemorySnapshot> SnapshotClient::LoadStep(uint64_t step, bool in_place,
                                                std::span<TensorFill> fills,
                                                const std::string* known_extras) {
  SP_ASSIGN_OR_RETURN(SlotInfo slot, FindSlot(step, std::nullopt));
  return LoadSlot(slot, in_place, fills, known_extras);
}

Status SnapshotClient::CheckSnapshotIdentity(const ImageReader& reader, const SlotInfo& slot,
                                             const std::string& source) const {
  if (reader.meta().step != slot.step || reader.meta().rank != opt_.rank ||
      reader.meta().world_size != opt_.world_size) {
    return Corruption(source + ": the image in the slot is of step " +
                      std::to_string(reader.meta().step) + ", rank " +
                      std::to_string(reader.meta().rank) + " of " +
                      std::to_string(reader.meta().world_size));
  }
  return Status::OK();
}

// The slot's image, checked, and the fills matched to its tensors (copies[k] fills
// fills[copy_fills[k]]; siblings[k], a tensor another rank's slot holds, fills
// fills[sibling_fills[k]]).
struct SnapshotClient::InPlaceLoad {
  SlotInfo slot;
  std::string source;
  std::span<std::byte> src;
  ImageReader reader;
  std::vector<ImageCopy> copies;
  std::vector<size_t> copy_fills, siblings, sibling_fills;
};

std::string SnapshotClient::SlotSource(const SlotInfo& slot) const {
  return job_dir_ + "/rank-" + std::to_string(opt_.rank) + ".slot-" + std::to_string(slot.index) +
         " (step " + std::to_string(slot.step) + ")";
}

Result<SnapshotClient::InPlaceLoad> SnapshotClient::BeginInPlace(const SlotInfo& slot,
                                                                 std::span<TensorFill> fills,
                                                                 bool dst_known) {
  InPlaceLoad l;
  l.slot = slot;
  l.source = SlotSource(slot);
  l.src = arena_->SlotDataForRead(slot.index, slot.image_size);
  for (TensorFill& f : fills) f.entry = -1;
  SP_ASSIGN_OR_RETURN(l.reader, ImageReader::Parse(l.src, l.source,
                                                   fills.empty() ? ImageReader::Verify::kAll
                                                                 : ImageReader::Verify::kStructure,
                                                   internal::DefaultCpuThreads(), &restore_index_));
  SP_RETURN_IF_ERROR(CheckSnapshotIdentity(l.reader, slot, l.source));
  // Each target is matched to the image's tensor of its name; a target's hint (its index in the
  // previous restore's image, same state structure) is checked first, and the name index is
  // built only when some hint does not match. `dst_known`: a target without a destination is
  // not filled (else the caller sets every destination before the copy: a streamed load).
  const std::vector<TensorEntry>& entries = l.reader.tensors();
  auto matches = [&](const TensorFill& f, size_t i) {
    const TensorEntry& e = entries[i];
    const TensorSpec& a = e.spec;
    return !a.elsewhere && a.name == f.spec.name && a.dtype == f.spec.dtype &&
           a.shape == f.spec.shape && a.global_shape == f.spec.global_shape &&
           a.global_offset == f.spec.global_offset && e.nbytes == f.nbytes &&
           (f.dst != nullptr || !dst_known);
  };
  std::unordered_map<std::string_view, size_t> by_name;
  l.copies.reserve(fills.size());
  l.copy_fills.reserve(fills.size());
  std::vector<bool> taken(entries.size());
  for (TensorFill& f : fills) {
    size_t i = entries.size();
    if (f.hint >= 0 && static_cast<size_t>(f.hint) < entries.size() &&
        entries[f.hint].spec.name == f.spec.name) {
      i = static_cast<size_t>(f.hint);
    } else {
      if (by_name.empty()) {
        for (size_t j = 0; j < entries.size(); ++j) by_name.emplace(entries[j].spec.name, j);
      }
      auto it = by_name.find(f.spec.name);
      if (it != by_name.end()) i = it->second;
    }
    // Otherwise the caller copies (or refuses) it with its own checks.
    if (i == entries.size() || taken[i]) continue;
    if (entries[i].spec.elsewhere) {
      // Another rank of this node keeps its bytes (replicated state copied once per node):
      // filled from that rank's slot in EndInPlace, or left to the caller.
      if ((f.dst != nullptr || !dst_known) && ReplicaKey(entries[i].spec) == ReplicaKey(f.spec) &&
          f.nbytes == entries[i].nbytes) {
        taken[i] = true;
        l.siblings.push_back(i);
        l.sibling_fills.push_back(&f - fills.data());
      }
      continue;
    }
    if (!matches(f, i)) continue;
    taken[i] = true;
    f.entry = static_cast<int64_t>(i);
    l.copies.push_back({entries[i].offset, entries[i].nbytes, f.dst});
    l.copy_fills.push_back(&f - fills.data());
  }
  return l;
}

Result<MemorySnapshot> SnapshotClient::EndInPlace(InPlaceLoad& l, std::span<TensorFill> fills,
                                                  const std::string* known_extras) {
  if (!l.siblings.empty()) {
    std::vector<TensorFill> wanted;
    wanted.reserve(l.siblings.size());
    for (size_t k : l.sibling_fills) wanted.push_back(fills[k]);
    const std::vector<bool> got =
        FillFromSiblings(l.reader.meta().step, l.reader.meta().attempt, wanted);
    for (size_t k = 0; k < got.size(); ++k) {
      if (got[k]) fills[l.sibling_fills[k]].entry = static_cast<int64_t>(l.siblings[k]);
    }
  }
  // Extras the caller knows (a restore plan's, checked by their checksum in Parse like any)
  // are not decoded again: a Value and a string per key of a large state.
  const std::span<const std::byte> raw_extras = l.reader.extras();
  const bool known = known_extras != nullptr && raw_extras.size() == known_extras->size() &&
                     std::memcmp(raw_extras.data(), known_extras->data(), raw_extras.size()) == 0;
  Value extras;
  if (!known) {
    SP_ASSIGN_OR_RETURN(extras, DecodeExtras(raw_extras, l.reader.tensors().size(), l.source));
  }
  NoteResumedFrom(l.slot);
  std::shared_ptr<std::byte> view(l.src.data(), [](std::byte*) {});  // the arena owns it
  MemorySnapshot out{LoadedImage{std::move(view), l.slot.image_size, l.source}, std::move(l.reader),
                     std::move(extras), l.slot.step};
  out.extras_known = known;
  return out;
}

// A load in place whose targets' addresses come as the caller walks them (BeginStreamedLoad):
// copy threads verify each chunk and copy out of it once every target it holds is published;
// the caller's thread joins them when its walk is done.
class SnapshotClient::LoadStream final : public SnapshotClient::StreamedLoad {
 public:
  LoadStream(SnapshotClient* c, InPlaceLoad l, ImageCopyOut out, std::span<TensorFill> fills,
             std::span<const size_t> walk_index)
      : c_(c), l_(std::move(l)), out_(std::move(out)), fills_(fills), walk_index_(walk_index) {
    // The copies are in fill order (BeginInPlace) and ImageCopyOut sorted them by offset: map
    // each fill to its copy by offset (distinct: copies do not overlap, none is empty). Most
    // often the fills are in the image's order already: copy k is then copy k.
    fill_copy_.assign(fills_.size(), kNone);
    const std::vector<ImageCopy>& copies = out_.copies();
    const bool in_order =
        std::is_sorted(l_.copies.begin(), l_.copies.end(),
                       [](const ImageCopy& a, const ImageCopy& b) { return a.offset < b.offset; });
    for (size_t k = 0; k < l_.copies.size(); ++k) {
      size_t at = k;
      if (!in_order) {
        at = static_cast<size_t>(
            std::lower_bound(copies.begin(), copies.end(), l_.copies[k].offset,
                             [](const ImageCopy& c, uint64_t off) { return c.offset < off; }) -
            copies.begin());
      }
      fill_copy_[l_.copy_fills[k]] = at;
    }
    std::vector<size_t> copy_need(copies.size(), 0);  // the walk position each copy needs
    for (size_t f = 0; f < fills_.size(); ++f) {
      if (fill_copy_[f] != kNone) copy_need[fill_copy_[f]] = walk_index_[f] + 1;
    }
    // Per chunk, the walk position its last copy needs (copies sorted by offset: one pass).
    need_.assign(out_.chunk_count(), 0);
    const uint64_t chunk = l_.reader.layout().chunk_size;
    for (size_t k = 0; k < copies.size(); ++k) {
      const ImageCopy& c = copies[k];
      if (c.length == 0) continue;
      const uint64_t last = (c.offset + c.length - 1) / chunk;
      for (uint64_t i = c.offset / chunk; i <= last && i < need_.size(); ++i) {
        need_[i] = std::max(need_[i], copy_need[k]);
      }
    }
    errors_.resize(out_.chunk_count());
    const size_t threads = std::min(internal::DefaultCpuThreads(), out_.chunk_count());
    try {
      for (size_t i = 0; i + 1 < threads; ++i) workers_.emplace_back([this] { Work(); });
    } catch (...) {
      Join(/*abort=*/true);  // no thread left joinable
      throw;
    }
  }
  ~LoadStream() override { Join(/*abort=*/true); }

  void Publish(size_t i, const void* data) override {
    while (cursor_ < walk_index_.size() && walk_index_[cursor_] < i) ++cursor_;
    if (cursor_ < walk_index_.size() && walk_index_[cursor_] == i) {
      auto* dst = static_cast<std::byte*>(const_cast<void*>(data));
      fills_[cursor_].dst = dst;
      if (fill_copy_[cursor_] != kNone) out_.set_dst(fill_copy_[cursor_], dst);
    }
    published_.store(i + 1, std::memory_order_release);
  }

  Result<MemorySnapshot> Finish(bool structure_matched, const std::string* known_extras) override {
    // Every target the copies write must have its address by now (the walk published it).
    for (size_t f = 0; structure_matched && f < fills_.size(); ++f) {
      structure_matched = fill_copy_[f] == kNone || fills_[f].dst != nullptr;
    }
    if (!structure_matched) {
      Join(/*abort=*/true);
      return Cancelled(l_.source + ": the state's structure is not the restore plan's");
    }
    published_.store(SIZE_MAX, std::memory_order_release);
    Work();                 // the walk is done: this thread copies the chunks left
    Join(/*abort=*/false);  // every chunk's targets are known: each worker finishes its own
    for (Status& s : errors_) SP_RETURN_IF_ERROR(s);  // the first damaged chunk
    return c_->EndInPlace(l_, fills_, known_extras);
  }

 private:
  static constexpr size_t kNone = SIZE_MAX;

  // `abort`: the workers waiting for targets stop (their chunks are left undone).
  void Join(bool abort) {
    if (abort) abort_.store(true, std::memory_order_relaxed);
    for (std::thread& w : workers_) w.join();
    workers_.clear();
  }

  void Work() {
    for (;;) {
      const size_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= need_.size()) return;
      // Wait for the walk: the first chunks' targets are known early, later ones as it goes.
      for (int polls = 0; published_.load(std::memory_order_acquire) < need_[i]; ++polls) {
        if (abort_.load(std::memory_order_relaxed)) {
          errors_[i] = Cancelled("stopped");
          return;
        }
        if (polls < 64) {
          std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
      }
      errors_[i] = out_.Chunk(i);
    }
  }

  SnapshotClient* c_;
  InPlaceLoad l_;
  ImageCopyOut out_;
  std::span<TensorFill> fills_;
  std::span<const size_t> walk_index_;
  std::vector<size_t> fill_copy_;  // copy index of each fill (kNone: none)
  std::vector<size_t> need_;       // per chunk: the published count its copies need
  std::vector<Status> errors_;
  size_t cursor_ = 0;  // the fill Publish looks at next
  std::atomic<size_t> published_{0};
  std::atomic<size_t> next_{0};
  std::atomic<bool> abort_{false};
  std::vector<std::thread> workers_;
};

Result<std::unique_ptr<SnapshotClient::StreamedLoad>> SnapshotClient::BeginStreamedLoad(
    std::optional<uint64_t> step, std::optional<uint64_t> min_step, std::span<TensorFill> fills,
    std::span<const size_t> walk_index) {
  if (fills.empty() || walk_index.size() != fills.size()) {
    return InvalidArgument("a streamed load needs fills with their walk positions");
  }
  for (size_t k = 1; k < walk_index.size(); ++k) {
    if (walk_index[k] <= walk_index[k - 1]) {
      return InvalidArgument("a streamed load's walk positions must increase");
    }
  }
  for (TensorFill& f : fills) f.dst = nullptr;
  SP_ASSIGN_OR_RETURN(SlotInfo slot, FindSlot(step, min_step));
  SP_ASSIGN_OR_RETURN(InPlaceLoad l, BeginInPlace(slot, fills, /*dst_known=*/false));
  SP_ASSIGN_OR_RETURN(ImageCopyOut out, ImageCopyOut::Make(l.src, l.copies, l.source));
  return std::unique_ptr<StreamedLoad>(
      new LoadStream(this, std::move(l), std::move(out), fills, walk_index));
}

Result<MemorySnapshot> SnapshotClient::LoadSlot(const SlotInfo& slot, bool in_place,
                                                std::span<TensorFill> fills,
                                                const std::string* known_extras) {
  if (in_place) {
    SP_ASSIGN_OR_RETURN(InPlaceLoad l, BeginInPlace(slot, fills, /*dst_known=*/true));
    // Restore in place: verify every chunk and copy the targets' tensors out in one pass.
    if (!fills.empty()) {
      SP_RETURN_IF_ERROR(
          VerifyAndCopyOut(l.src, l.copies, l.source, internal::DefaultCpuThreads()));
    }
    return EndInPlace(l, fills, known_extras);
  }
  const SlotInfo* newest = &slot;
  const std::string source = SlotSource(slot);
  const size_t size = newest->image_size;
  auto owner = std::make_shared<internal::AlignedBuffer>(size);
  if (!owner->ok()) {
    return ResourceExhausted(source + ": cannot allocate " + std::to_string(size) + " bytes");
  }
  std::byte* raw = owner->data();
  std::shared_ptr<std::byte> buffer(owner, raw);
  auto src = arena_->SlotData(newest->index).subspan(0, size);
  SP_RETURN_IF_ERROR(CopyVerifiedImage(src, {raw, size}, source, internal::DefaultCpuThreads()));
  // The copy is what we verify and hand out; the slot must not have changed meanwhile.
  for (const SlotInfo& s : arena_->Slots()) {
    if (s.index == newest->index &&
        (s.generation != newest->generation || s.state != SlotState::kComplete)) {
      return Corruption(source + ": the snapshot changed while it was read");
    }
  }
  std::span<const std::byte> bytes(raw, size);
  SP_ASSIGN_OR_RETURN(ImageReader reader,
                      ImageReader::Parse(bytes, source, ImageReader::Verify::kStructure));
  SP_RETURN_IF_ERROR(CheckSnapshotIdentity(reader, *newest, source));
  SP_ASSIGN_OR_RETURN(Value extras, DecodeExtras(reader.extras(), reader.tensors().size(), source));
  MemorySnapshot out{LoadedImage{std::move(buffer), size, source}, std::move(reader),
                     std::move(extras), newest->step};
  NoteResumedFrom(*newest);
  return out;
}

std::vector<bool> SnapshotClient::FillFromSiblings(uint64_t step, uint64_t attempt,
                                                   std::span<TensorFill> fills) {
  std::vector<bool> filled(fills.size(), false);
  size_t left = fills.size();
  auto ranks = ListArenaRanks(job_dir_);
  if (!ranks.ok()) return filled;
  // Ranks in order from this one on: with the share plan's greedy split, the neighbours hold
  // most, and ranks of a large node do not all read rank 0's slots first.
  std::vector<uint32_t> order;
  for (uint32_t r : *ranks) {
    if (r > opt_.rank) order.push_back(r);
  }
  for (uint32_t r : *ranks) {
    if (r < opt_.rank) order.push_back(r);
  }
  for (uint32_t r : order) {
    if (left == 0) break;
    Result<size_t> got = FillFromRank(r, step, attempt, fills, &filled);
    if (got.ok()) left -= *got;
  }
  return filled;
}

Result<size_t> SnapshotClient::FillFromRank(uint32_t rank, uint64_t step, uint64_t attempt,
                                            std::span<TensorFill> fills,
                                            std::vector<bool>* filled) {
  std::unique_ptr<Arena>& arena = sibling_arenas_[rank];
  if (!arena) {
    SP_ASSIGN_OR_RETURN(arena, Arena::Open(job_dir_, rank, arena_->slot_count()));
  } else {
    SP_RETURN_IF_ERROR(arena->Refresh());  // slot files the rank created or replaced since
  }
  std::optional<SlotInfo> found;  // the snapshot of the step completed last, as LoadStep
  for (const SlotInfo& s : arena->Slots()) {
    if (s.state == SlotState::kComplete && s.step == step && s.image_size >= kImageHeaderSize &&
        (!found || s.complete_time_ns > found->complete_time_ns)) {
      found = s;
    }
  }
  if (!found) return NotFound("no snapshot of the step");
  const std::string source = job_dir_ + "/rank-" + std::to_string(rank) + ".slot-" +
                             std::to_string(found->index) + " (step " + std::to_string(step) + ")";
  auto image = arena->SlotDataForRead(found->index, found->image_size);
  SP_ASSIGN_OR_RETURN(ImageReader reader,
                      ImageReader::Parse(image, source, ImageReader::Verify::kStructure));
  const ImageMeta& meta = reader.meta();
  if (meta.step != step || meta.rank != rank || meta.world_size != opt_.world_size ||
      meta.attempt != attempt || meta.job != opt_.job) {
    return NotFound(source + ": of another save");
  }
  const std::vector<TensorEntry>& entries = reader.tensors();
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t j = 0; j < entries.size(); ++j) {
    if (!entries[j].spec.elsewhere) by_name.emplace(entries[j].spec.name, j);
  }
  std::vector<ImageCopy> copies;
  std::vector<size_t> taken;
  for (size_t k = 0; k < fills.size(); ++k) {
    const TensorFill& f = fills[k];
    if ((*filled)[k] || f.dst == nullptr) continue;
    auto it = by_name.find(f.spec.name);
    if (it == by_name.end()) continue;
    const TensorEntry& e = entries[it->second];
    if (ReplicaKey(e.spec) != ReplicaKey(f.spec) || e.nbytes != f.nbytes) continue;
    copies.push_back({e.offset, e.nbytes, f.dst});
    taken.push_back(k);
  }
  if (copies.empty()) return 0;
  SP_RETURN_IF_ERROR(VerifyAndCopyOut(image, copies, source, internal::DefaultCpuThreads(),
                                      /*copied_chunks_only=*/true));
  // The rank's writer never takes its newest snapshot's slot while it has two, but with one
  // (budget mode) it may: what was copied counts only if the slot still holds that snapshot.
  for (const SlotInfo& s : arena->Slots()) {
    if (s.index == found->index &&
        (s.generation != found->generation || s.state != SlotState::kComplete)) {
      return Corruption(source + ": the snapshot changed while it was read");
    }
  }
  for (size_t k : taken) (*filled)[k] = true;
  return taken.size();
}

// A snapshot loaded before this client's first save is the one the run resumes from: the arena
// keeps it while the next save is written, rather than a snapshot that an abandoned run
// completed later (a kill during that save would otherwise leave this rank without the step
// the ranks agreed on; crash campaign, seed 866710947). Later loads change nothing.
void SnapshotClient::NoteResumedFrom(const SlotInfo& slot) {
  if (!saved_) arena_->MarkResumed(slot.index, slot.generation);
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
