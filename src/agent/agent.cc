// The node agent (include/safepoint/agent.h; docs/architecture.md, "The agent").
//
// Threads: the main thread runs a poll() loop over the listening socket, the clients' sockets,
// the clients' pidfds (a client that dies is noticed even when a forked child still holds its
// socket), a signalfd (SIGTERM/SIGINT/SIGHUP) and an eventfd through which the persist worker
// reports. The persist worker takes tasks in order, writes each snapshot straight from shared
// memory to storage with the commit protocol (CheckpointStore::WriteImageBytes), commits the step
// once every rank's image is there, prunes by retention, and releases the slot's lease.
//
// Leases: a client that asks for a persist marks the COMPLETE slot leased itself (so that no
// later save can overwrite it before the agent gets to it); the worker releases the lease when
// the image is written or has failed. A new agent clears stale leases when it adopts a job.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <dirent.h>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "base/kill_point.h"
#include "safepoint/agent.h"
#include "safepoint/arena.h"
#include "safepoint/checkpoint.h"
#include "safepoint/image.h"
#include "base/parallel.h"

namespace safepoint {

namespace {

using json = nlohmann::json;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Log(const std::string& msg) {
  char ts[32];
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  std::strftime(ts, sizeof(ts), "%Y-%m-%d %H:%M:%S", &tm);
  std::fprintf(stderr, "%s safepointd[%d]: %s\n", ts, ::getpid(), msg.c_str());
  std::fflush(stderr);
}

struct JobConfig {
  std::string storage;
  uint32_t world_size = 1;
  uint32_t keep = 3;
  json ToJson() const { return {{"storage", storage}, {"world_size", world_size}, {"keep", keep}}; }
};

struct Task {
  uint32_t rank = 0;
  uint32_t slot = 0;
  uint64_t generation = 0;
  uint64_t step = 0;
  bool leased = false;  // the slot lease is already held for this task
  std::string reason;   // "requested", "emergency flush", "close", "adopted", "shutdown"
  SkipRanges skip;      // tensors other ranks write (replicas); empty: write every tensor
};

struct TaskResult {
  Task task;
  Status status;
  bool superseded = false;
  bool committed = false;
  uint64_t bytes = 0;
  double seconds = 0;
  std::vector<uint64_t> pruned;
};

struct RankState {
  std::unique_ptr<Arena> arena;
  uint32_t pid = 0;
  bool connected = false;
  bool closed = false;  // closed cleanly
  int close_client = -1;
  std::optional<uint64_t> last_persisted_step;
  double last_persist_seconds = 0;
  uint64_t last_persist_bytes = 0;
  uint64_t persists_ok = 0, persists_failed = 0, persists_superseded = 0;
  uint64_t emergency_flushes = 0;
  std::string last_error;
  std::map<uint64_t, Status> outcomes;  // step -> result of persisting this rank's image
  // step -> (slot, generation) of the snapshot persisted for it. Generations count per slot, so
  // the same step saved again into the other slot may carry an equal generation: match both.
  std::map<uint64_t, std::pair<uint32_t, uint64_t>> persisted_generation;
  std::multiset<uint64_t> pending;      // steps queued or in flight, once per task
};

struct Client {
  int fd = -1;
  int pidfd = -1;
  uint32_t pid = 0;
  FrameDecoder decoder;
  bool hello = false;
  uint32_t rank = 0;
  bool closing = false;
  bool broken = false;          // a reply could not be sent: drop the connection
  std::vector<uint64_t> waits;  // steps whose commit this client waits for
};

class Agent {
 public:
  explicit Agent(AgentOptions options) : opt_(std::move(options)) {}
  int Run();

 private:
  Status Setup();
  void Adopt();
  void Loop();
  void Accept();
  void HandleClientData(int idx);
  void HandleMessage(Client& c, const Message& m);
  void DropClient(int idx, bool died);
  void EmergencyFlush(uint32_t rank, const std::string& reason);
  Status EnsureRank(uint32_t rank);
  void Enqueue(Task t);
  bool Queued(uint32_t rank, uint32_t slot, uint64_t generation);
  void Worker();
  TaskResult Persist(const Task& t);
  Result<std::unique_ptr<ImageBuilder>> WithoutReplicas(std::span<const std::byte> image,
                                                        const std::string& source,
                                                        const SkipRanges& skip);
  void DrainResults();
  void AnswerWaits();
  bool StepCommitted(uint64_t step);
  json StatusJson();
  void Reply(Client& c, MessageType type, const json& j);
  void ReplyError(Client& c, const std::string& msg);
  bool Idle();
  bool AllClosed();
  void Shutdown();

  AgentOptions opt_;
  std::string job_dir_;
  int lock_fd_ = -1, listen_fd_ = -1, signal_fd_ = -1, event_fd_ = -1;
  std::optional<JobConfig> config_;
  std::shared_ptr<CheckpointStore> store_;
  std::map<uint32_t, RankState> ranks_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::set<uint64_t> committed_cache_;
  std::optional<uint64_t> newest_committed_;
  double last_commit_poll_ = 0;
  bool stopping_ = false;
  bool saw_client_ = false;
  double last_busy_ = Now();

  std::mutex mu_;  // guards queue_, results_, in_flight_, worker_stop_
  std::condition_variable cv_;
  std::deque<Task> queue_;
  std::optional<Task> in_flight_;
  std::vector<TaskResult> results_;
  bool worker_stop_ = false;
  std::thread worker_;
};

Status Agent::Setup() {
  SP_ASSIGN_OR_RETURN(job_dir_, JobDirectory(opt_.shm_dir, opt_.job, /*create=*/true));
  lock_fd_ = ::open(AgentLockPath(job_dir_).c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (lock_fd_ < 0) return ErrnoStatus("open", AgentLockPath(job_dir_), errno);
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) return AlreadyExists("another agent serves job " + opt_.job);
    return ErrnoStatus("flock", AgentLockPath(job_dir_), errno);
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, pid.data(), pid.size(), 0) < 0) {
    return ErrnoStatus("write", AgentLockPath(job_dir_), errno);
  }

  const std::string sock = AgentSocketPath(job_dir_);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (sock.size() >= sizeof(addr.sun_path)) {
    return InvalidArgument(sock + ": socket path too long (at most " +
                           std::to_string(sizeof(addr.sun_path) - 1) + " bytes); use a shorter shm_dir");
  }
  std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
  ::unlink(sock.c_str());  // stale: we hold the lock, so no agent is using it
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) return ErrnoStatus("socket", sock, errno);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus("bind", sock, errno);
  }
  ::chmod(sock.c_str(), 0600);
  if (::listen(listen_fd_, 128) != 0) return ErrnoStatus("listen", sock, errno);

  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGHUP);
  ::pthread_sigmask(SIG_BLOCK, &mask, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  signal_fd_ = ::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (signal_fd_ < 0) return ErrnoStatus("signalfd", job_dir_, errno);
  event_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (event_fd_ < 0) return ErrnoStatus("eventfd", job_dir_, errno);
  return Status::OK();
}

// A new agent takes over what a previous one left: stale leases are cleared, and snapshots newer
// than the newest committed step are persisted.
void Agent::Adopt() {
  std::FILE* f = std::fopen((job_dir_ + "/job.json").c_str(), "r");
  if (f == nullptr) return;
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  std::fclose(f);
  try {
    json j = json::parse(text);
    JobConfig c;
    c.storage = j.at("storage").get<std::string>();
    c.world_size = j.at("world_size").get<uint32_t>();
    c.keep = j.at("keep").get<uint32_t>();
    auto store = OpenCheckpointStore(c.storage);
    if (!store.ok()) {
      Log("cannot adopt job: " + store.status().ToString());
      return;
    }
    config_ = c;
    store_ = std::move(store).value();
  } catch (const std::exception& e) {
    Log(std::string("ignoring a damaged job.json: ") + e.what());
    return;
  }
  DIR* d = ::opendir(job_dir_.c_str());
  if (d == nullptr) return;
  std::set<uint32_t> found;
  while (dirent* e = ::readdir(d)) {
    unsigned rank, slot;
    char tail;
    if (std::sscanf(e->d_name, "rank-%u.slot-%u%c", &rank, &slot, &tail) == 2) found.insert(rank);
  }
  ::closedir(d);
  auto committed = store_->ListCommitted();
  std::optional<uint64_t> newest;
  if (committed.ok() && !committed->empty()) {
    newest = committed->back().step;
    newest_committed_ = newest;
    for (const auto& c : *committed) committed_cache_.insert(c.step);
  }
  for (uint32_t rank : found) {
    if (!EnsureRank(rank).ok()) continue;
    RankState& r = ranks_[rank];
    r.arena->ClearLeases();
    Log("adopted the snapshots of rank " + std::to_string(rank));
    if (!opt_.emergency_flush) continue;
    for (const SlotInfo& s : r.arena->Slots()) {
      if (s.state != SlotState::kComplete || (newest && s.step <= *newest)) continue;
      Enqueue({rank, s.index, s.generation, s.step, false, "adopted"});
    }
  }
}

Status Agent::EnsureRank(uint32_t rank) {
  RankState& r = ranks_[rank];
  if (r.arena) return r.arena->Refresh();
  SP_ASSIGN_OR_RETURN(r.arena, Arena::Open(job_dir_, rank));
  return Status::OK();
}

void Agent::Enqueue(Task t) {
  ranks_[t.rank].pending.insert(t.step);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(t));
  }
  cv_.notify_one();
}

bool Agent::Queued(uint32_t rank, uint32_t slot, uint64_t generation) {
  std::lock_guard<std::mutex> lock(mu_);
  auto same = [&](const Task& t) {
    return t.rank == rank && t.slot == slot && t.generation == generation;
  };
  if (in_flight_ && same(*in_flight_)) return true;
  // Finished but not drained yet: still counts as pending here.
  for (const TaskResult& r : results_) {
    if (same(r.task)) return true;
  }
  return std::any_of(queue_.begin(), queue_.end(), same);
}

void Agent::Worker() {
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return worker_stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      t = queue_.front();
      queue_.pop_front();
      in_flight_ = t;
    }
    TaskResult r = Persist(t);
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_.reset();
      results_.push_back(std::move(r));
    }
    const uint64_t one = 1;
    if (::write(event_fd_, &one, sizeof(one)) < 0) {
      // The main loop also polls periodically; a lost wake-up only delays it.
    }
  }
}

// The stored image of a snapshot whose replicas other ranks write: the same tensors, extras and
// identity, with the skipped tensors marked "elsewhere" (no bytes). Every chunk of the snapshot
// is verified first, so the checksums of the new layout cover bytes that were checked
// end to end; the builder's tensors point into shared memory (held under the slot's lease).
Result<std::unique_ptr<ImageBuilder>> Agent::WithoutReplicas(std::span<const std::byte> image,
                                                              const std::string& source,
                                                              const SkipRanges& skip) {
  SP_ASSIGN_OR_RETURN(ImageReader reader,
                      ImageReader::Parse(image, source, ImageReader::Verify::kAll,
                                         internal::DefaultCpuThreads()));
  std::vector<TensorSource> tensors;
  tensors.reserve(reader.tensors().size());
  for (size_t i = 0; i < reader.tensors().size(); ++i) {
    const TensorEntry& e = reader.tensors()[i];
    tensors.push_back({e.spec, reader.tensor_data(i).data(), e.nbytes});
  }
  for (const auto& [first, last] : skip) {
    if (first >= last || last > tensors.size()) {
      return InvalidArgument(source + ": skip range [" + std::to_string(first) + ", " +
                             std::to_string(last) + ") is outside the snapshot's " +
                             std::to_string(tensors.size()) + " tensors");
    }
    for (uint32_t i = first; i < last; ++i) tensors[i].spec.elsewhere = true;
  }
  auto extras = reader.extras();
  return ImageBuilder::Create(reader.meta(), std::move(tensors),
                              std::string(reinterpret_cast<const char*>(extras.data()),
                                          extras.size()),
                              reader.layout().chunk_size);
}

TaskResult Agent::Persist(const Task& t) {
  TaskResult r;
  r.task = t;
  // The worker maps the slot through its own Arena: the main thread may re-map its own.
  auto arena = Arena::Open(job_dir_, t.rank);
  if (!arena.ok()) {
    r.status = arena.status();
    return r;
  }
  if (!t.leased && !(*arena)->Lease(t.slot, t.generation)) {
    r.superseded = true;
    return r;
  }
  struct Releaser {
    Arena& a;
    const Task& t;
    ~Releaser() { a.Release(t.slot, t.generation); }
  } releaser{**arena, t};
  const auto slots = (*arena)->Slots();
  if (t.slot >= slots.size()) {
    r.status = InvalidArgument("slot " + std::to_string(t.slot) + " does not exist");
    return r;
  }
  const SlotInfo& s = slots[t.slot];
  if (s.state != SlotState::kComplete || s.generation != t.generation || s.step != t.step) {
    r.superseded = true;
    return r;
  }
  auto image = (*arena)->SlotData(t.slot).subspan(0, s.image_size);
  const std::string source = job_dir_ + " rank " + std::to_string(t.rank) + " slot " +
                             std::to_string(t.slot);
  auto header = ParseImageHeader(image, source);
  if (!header.ok()) {
    r.status = header.status();
    return r;
  }
  if (header->first.step != t.step || header->first.rank != t.rank ||
      header->first.world_size != config_->world_size || header->second.image_size != image.size()) {
    r.status = Corruption(source + ": the snapshot's header does not match its slot");
    return r;
  }
  SP_KILL_POINT("agent.persist.leased");
  // A committed step is never replaced. Either this very snapshot is committed already (persisted
  // twice: adopted, flushed), or an earlier run committed the step before the ranks resumed from
  // an older one and saved it again: that commit is a complete checkpoint of one attempt, and
  // replacing it would leave the step uncommitted until every rank's new image is there, so a
  // crash in between (or a stale snapshot of the step, adopted after a restart) would lose a step
  // already reported committed. Found by the crash campaign (seed 858721433).
  if (store_->ReadCommit(t.step).ok()) {
    r.committed = true;
    return r;
  }
  // With replicas left to other ranks the stored image is laid out anew.
  std::unique_ptr<ImageBuilder> relaid;
  if (!t.skip.empty()) {
    auto b = WithoutReplicas(image, source, t.skip);
    if (!b.ok()) {
      r.status = b.status();
      return r;
    }
    relaid = std::move(*b);
  }
  auto stats = relaid ? store_->WriteImage(*relaid) : store_->WriteImageBytes(image, t.step, t.rank);
  if (!stats.ok()) {
    r.status = stats.status();
    return r;
  }
  r.bytes = stats->bytes;
  r.seconds = stats->seconds;
  SP_KILL_POINT("agent.persist.before_commit");
  auto committed = store_->TryCommit(t.step, config_->world_size, opt_.job, header->first.attempt);
  if (!committed.ok()) {
    r.status = committed.status();
    return r;
  }
  r.committed = *committed;
  if (r.committed) {
    SP_KILL_POINT("agent.persist.before_prune");
    // Retention: keep the newest `keep` committed steps (never fewer than one).
    auto all = store_->ListCommitted();
    if (all.ok()) {
      const size_t keep = std::max<uint32_t>(config_->keep, 1);
      for (size_t i = 0; i + keep < all->size(); ++i) {
        if (store_->DeleteStep((*all)[i].step).ok()) r.pruned.push_back((*all)[i].step);
      }
    }
    store_->CleanUp().status().IgnoreError();
  }
  return r;
}

bool Agent::StepCommitted(uint64_t step) {
  if (committed_cache_.contains(step)) return true;
  if (!store_) return false;
  auto c = store_->ReadCommit(step);
  if (c.ok()) {
    committed_cache_.insert(step);
    return true;
  }
  return false;
}

void Agent::DrainResults() {
  std::vector<TaskResult> results;
  {
    std::lock_guard<std::mutex> lock(mu_);
    results.swap(results_);
  }
  for (TaskResult& r : results) {
    RankState& rs = ranks_[r.task.rank];
    if (auto it = rs.pending.find(r.task.step); it != rs.pending.end()) rs.pending.erase(it);
    auto prior = rs.outcomes.find(r.task.step);
    const bool already_ok = prior != rs.outcomes.end() && prior->second.ok();
    if (r.superseded) {
      ++rs.persists_superseded;
      if (!already_ok) rs.outcomes[r.task.step] = Cancelled("step " + std::to_string(r.task.step) +
                                           " was overwritten by a newer snapshot before it was persisted");
      Log("rank " + std::to_string(r.task.rank) + " step " + std::to_string(r.task.step) +
          ": superseded by a newer snapshot before it could be persisted");
    } else if (!r.status.ok()) {
      ++rs.persists_failed;
      rs.last_error = r.status.ToString();
      if (!already_ok) rs.outcomes[r.task.step] = r.status;
      Log("rank " + std::to_string(r.task.rank) + " step " + std::to_string(r.task.step) +
          ": persisting failed (" + r.task.reason + "): " + r.status.ToString());
    } else {
      ++rs.persists_ok;
      rs.last_persisted_step = std::max(rs.last_persisted_step.value_or(0), r.task.step);
      rs.last_persist_seconds = r.seconds;
      rs.last_persist_bytes = r.bytes;
      rs.outcomes[r.task.step] = Status::OK();
      rs.persisted_generation[r.task.step] = {r.task.slot, r.task.generation};
      if (r.committed) {
        committed_cache_.insert(r.task.step);
        newest_committed_ = std::max(newest_committed_.value_or(0), r.task.step);
      }
      for (uint64_t p : r.pruned) committed_cache_.erase(p);
      Log("rank " + std::to_string(r.task.rank) + " step " + std::to_string(r.task.step) +
          ": persisted " + std::to_string(r.bytes) + " bytes in " + std::to_string(r.seconds) +
          " s (" + r.task.reason + ")" + (r.committed ? ", committed" : ""));
    }
    // Keep the outcome table small.
    while (rs.outcomes.size() > 64) rs.outcomes.erase(rs.outcomes.begin());
    while (rs.persisted_generation.size() > 64) {
      rs.persisted_generation.erase(rs.persisted_generation.begin());
    }
  }
}

void Agent::AnswerWaits() {
  const double now = Now();
  bool poll_commits = now - last_commit_poll_ > 0.2;
  if (poll_commits) last_commit_poll_ = now;
  for (auto& c : clients_) {
    if (c->waits.empty()) continue;
    std::vector<uint64_t> still;
    for (uint64_t step : c->waits) {
      RankState& rs = ranks_[c->rank];
      auto it = rs.outcomes.find(step);
      if (it != rs.outcomes.end() && !it->second.ok()) {
        Reply(*c, MessageType::kWaitReply,
              {{"ok", false}, {"step", step}, {"code", static_cast<int>(it->second.code())},
               {"error", it->second.message()}});
        continue;
      }
      if (committed_cache_.contains(step) || (poll_commits && it != rs.outcomes.end() &&
                                              StepCommitted(step))) {
        Reply(*c, MessageType::kWaitReply, {{"ok", true}, {"step", step}});
        continue;
      }
      if (it == rs.outcomes.end() && !rs.pending.contains(step)) {
        if (StepCommitted(step)) {
          Reply(*c, MessageType::kWaitReply, {{"ok", true}, {"step", step}});
        } else {
          Reply(*c, MessageType::kWaitReply,
                {{"ok", false}, {"step", step}, {"code", static_cast<int>(StatusCode::kNotFound)},
                 {"error", "step " + std::to_string(step) + " of rank " + std::to_string(c->rank) +
                               " is not being persisted by this agent (was it restarted?)"}});
        }
        continue;
      }
      still.push_back(step);
    }
    c->waits.swap(still);
  }
  // Clean closes whose flush is done.
  for (auto& [rank, rs] : ranks_) {
    if (rs.close_client < 0 || !rs.pending.empty()) continue;
    for (auto& c : clients_) {
      if (c->fd != rs.close_client || !c->closing) continue;
      Status removed = rs.arena ? rs.arena->Remove() : Status::OK();
      rs.arena.reset();
      rs.closed = true;
      Reply(*c, MessageType::kCloseReply,
            {{"ok", removed.ok()}, {"error", removed.ok() ? "" : removed.ToString()}});
      Log("rank " + std::to_string(rank) + " closed cleanly; its snapshots were removed");
    }
    rs.close_client = -1;
  }
}

void Agent::Reply(Client& c, MessageType type, const json& j) {
  // A client that does not read its replies must not wedge the agent: give up after a second
  // and drop it (the loop removes broken clients).
  Status s = SendMessage(c.fd, type, j.dump(), /*timeout_s=*/1.0);
  if (!s.ok()) {
    Log("reply to pid " + std::to_string(c.pid) + " failed: " + s.ToString() + "; dropping it");
    c.broken = true;
  }
}

void Agent::ReplyError(Client& c, const std::string& msg) {
  Reply(c, MessageType::kError, {{"error", msg}});
}

void Agent::Accept() {
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != ::geteuid()) {
      Log("refused a connection from uid " + std::to_string(cred.uid) + " (pid " +
          std::to_string(cred.pid) + "): only the agent's own user may connect");
      ::close(fd);
      continue;
    }
    auto c = std::make_unique<Client>();
    c->fd = fd;
    c->pid = static_cast<uint32_t>(cred.pid);
    c->pidfd = static_cast<int>(::syscall(SYS_pidfd_open, cred.pid, 0));
    clients_.push_back(std::move(c));
  }
}

void Agent::HandleClientData(int idx) {
  Client& c = *clients_[idx];
  char buf[64 << 10];
  for (;;) {
    const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
    if (n == 0) {
      DropClient(idx, !c.closing);
      return;
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) break;
      DropClient(idx, !c.closing);
      return;
    }
    c.decoder.Feed({reinterpret_cast<const std::byte*>(buf), static_cast<size_t>(n)});
    if (c.decoder.buffered() > 2 * kMaxMessageBytes) break;
  }
  while (!c.broken) {
    auto m = c.decoder.Next();
    if (!m.ok()) {
      Log("pid " + std::to_string(c.pid) + ": " + m.status().message() + "; closing its connection");
      ReplyError(c, m.status().message());
      DropClient(idx, false);
      return;
    }
    if (!*m) break;
    try {
      HandleMessage(c, **m);
    } catch (const std::exception& e) {
      Log("pid " + std::to_string(c.pid) + ": malformed message: " + e.what());
      ReplyError(c, std::string("malformed message: ") + e.what());
      DropClient(idx, false);
      return;
    }
  }
}

void Agent::HandleMessage(Client& c, const Message& m) {
  const json j = m.payload.empty() ? json::object() : json::parse(m.payload);
  if (!j.is_object()) throw std::runtime_error("payload is not a JSON object");
  switch (m.type) {
    case MessageType::kHello: {
      JobConfig want;
      want.storage = j.at("storage").get<std::string>();
      want.world_size = j.at("world_size").get<uint32_t>();
      want.keep = j.at("keep").get<uint32_t>();
      const uint32_t rank = j.at("rank").get<uint32_t>();
      if (want.world_size == 0 || rank >= want.world_size || want.world_size > kMaxRank) {
        return ReplyError(c, "invalid rank " + std::to_string(rank) + " of world size " +
                                 std::to_string(want.world_size));
      }
      if (config_ && (config_->storage != want.storage || config_->world_size != want.world_size)) {
        return ReplyError(c, "job " + opt_.job + " already persists to " + config_->storage +
                                 " with world size " + std::to_string(config_->world_size) +
                                 "; this process asked for " + want.storage + " with world size " +
                                 std::to_string(want.world_size) + " (use another job name)");
      }
      if (!config_) {
        auto store = OpenCheckpointStore(want.storage);
        if (!store.ok()) return ReplyError(c, store.status().ToString());
        store_ = std::move(store).value();
        config_ = want;
        const std::string path = job_dir_ + "/job.json";
        const std::string tmp = path + ".tmp";
        if (std::FILE* f = std::fopen(tmp.c_str(), "w")) {
          const std::string text = config_->ToJson().dump();
          std::fwrite(text.data(), 1, text.size(), f);
          std::fclose(f);
          std::rename(tmp.c_str(), path.c_str());
        }
        auto committed = store_->ListCommitted();
        if (committed.ok() && !committed->empty()) newest_committed_ = committed->back().step;
      }
      Status s = EnsureRank(rank);
      if (!s.ok()) return ReplyError(c, s.ToString());
      RankState& rs = ranks_[rank];
      if (rs.connected && rs.pid != c.pid && ::kill(static_cast<pid_t>(rs.pid), 0) == 0) {
        return ReplyError(c, "rank " + std::to_string(rank) + " is already connected (pid " +
                                 std::to_string(rs.pid) + ")");
      }
      c.hello = true;
      c.rank = rank;
      rs.connected = true;
      rs.closed = false;
      rs.pid = c.pid;
      saw_client_ = true;
      Log("rank " + std::to_string(rank) + " connected (pid " + std::to_string(c.pid) + ")");
      return Reply(c, MessageType::kHelloReply,
                   {{"ok", true}, {"agent_pid", ::getpid()}, {"job_dir", job_dir_}});
    }
    case MessageType::kSnapshot: {
      if (!c.hello) throw std::runtime_error("snapshot before hello");
      Task t;
      t.rank = c.rank;
      t.slot = j.at("slot").get<uint32_t>();
      t.generation = j.at("generation").get<uint64_t>();
      t.step = j.at("step").get<uint64_t>();
      t.leased = j.at("leased").get<bool>();
      t.reason = "requested";
      if (j.contains("skip")) t.skip = j.at("skip").get<SkipRanges>();
      RankState& rs = ranks_[c.rank];
      if (!rs.arena || t.slot >= rs.arena->slot_count()) {
        throw std::runtime_error("slot " + std::to_string(t.slot) + " does not exist");
      }
      if (!j.at("persist").get<bool>()) return;
      // Already queued (e.g. adopted by this agent after a restart). Only this very snapshot
      // counts: the same step may sit in the other slot too (saved before a restart, and again
      // after the ranks resumed from an older step), and skipping this one would leak its lease.
      if (Queued(t.rank, t.slot, t.generation)) return;
      auto done = rs.persisted_generation.find(t.step);
      if (done != rs.persisted_generation.end() &&
          done->second == std::make_pair(t.slot, t.generation)) {
        if (t.leased) rs.arena->Release(t.slot, t.generation);
        return;
      }
      if (t.leased) {
        // Trust the client's lease only if it still holds: an agent that started after the
        // client leased the slot cleared every lease when it adopted the arena.
        t.leased = false;
        if (rs.arena->Refresh().ok()) {
          for (const SlotInfo& si : rs.arena->Slots()) {
            if (si.index == t.slot && si.state == SlotState::kComplete && si.leased &&
                si.generation == t.generation && si.step == t.step) {
              t.leased = true;
            }
          }
        }
      }
      Enqueue(t);
      return;
    }
    case MessageType::kStatus:
      return Reply(c, MessageType::kStatusReply, StatusJson());
    case MessageType::kWait: {
      if (!c.hello) throw std::runtime_error("wait before hello");
      c.waits.push_back(j.at("step").get<uint64_t>());
      AnswerWaits();
      return;
    }
    case MessageType::kClose: {
      if (!c.hello) throw std::runtime_error("close before hello");
      c.closing = true;
      RankState& rs = ranks_[c.rank];
      rs.close_client = c.fd;
      EmergencyFlush(c.rank, "close");
      AnswerWaits();
      return;
    }
    case MessageType::kShutdown:
      Log("shutdown requested by pid " + std::to_string(c.pid));
      stopping_ = true;
      return Reply(c, MessageType::kCloseReply, {{"ok", true}});
    default:
      return ReplyError(c, "unexpected message type");
  }
}

// Persists the COMPLETE snapshots of the rank that are not persisted or queued yet. After a death
// every such snapshot is flushed, oldest first, so that the newest step that every rank still
// holds can be committed even when ranks died at different steps; a clean close or a shutdown
// flushes only the newest one.
void Agent::EmergencyFlush(uint32_t rank, const std::string& reason) {
  if (!config_ || !store_) return;
  RankState& rs = ranks_[rank];
  if (!rs.arena || !rs.arena->Refresh().ok()) return;
  // A COMPLETE slot that is leased but not queued here carries the lease its writer took for a
  // persist it never got to request (it died between marking the slot COMPLETE and telling us).
  // Nobody else would release that lease, and with it held the rank could never save again:
  // the flush takes the lease over (and releases it when done), or releases it if there is
  // nothing to persist.
  std::vector<SlotInfo> todo;
  for (const SlotInfo& s : rs.arena->Slots()) {
    if (s.state != SlotState::kComplete) continue;
    if (Queued(rank, s.index, s.generation)) continue;
    auto it = rs.outcomes.find(s.step);
    const bool done = (it != rs.outcomes.end() && it->second.ok()) ||
                      (newest_committed_ && s.step <= *newest_committed_ && StepCommitted(s.step));
    if (done) {
      if (s.leased) rs.arena->Release(s.index, s.generation);
      continue;
    }
    todo.push_back(s);
  }
  std::sort(todo.begin(), todo.end(), [](auto& a, auto& b) { return a.step < b.step; });
  if (reason == "close" || reason == "shutdown") {
    std::optional<SlotInfo> newest = rs.arena->NewestComplete();
    if (!newest) return;
    const bool newest_todo = !todo.empty() && todo.back().index == newest->index;
    todo.clear();
    if (newest_todo) todo.push_back(*newest);
  }
  for (const SlotInfo& s : todo) {
    if (reason != "close") ++rs.emergency_flushes;
    Enqueue({rank, s.index, s.generation, s.step, /*leased=*/s.leased, reason});
  }
}

void Agent::DropClient(int idx, bool died) {
  Client& c = *clients_[idx];
  if (c.hello) {
    RankState& rs = ranks_[c.rank];
    if (rs.pid == c.pid) rs.connected = false;
    if (rs.close_client == c.fd) rs.close_client = -1;
    if (died && !rs.closed) {
      Log("rank " + std::to_string(c.rank) + " (pid " + std::to_string(c.pid) +
          ") is gone without closing" + (opt_.emergency_flush ? "; emergency flush" : ""));
      if (opt_.emergency_flush) EmergencyFlush(c.rank, "emergency flush");
    }
  }
  ::close(c.fd);
  if (c.pidfd >= 0) ::close(c.pidfd);
  clients_.erase(clients_.begin() + idx);
}

json Agent::StatusJson() {
  json ranks = json::array();
  for (auto& [rank, rs] : ranks_) {
    json slots = json::array();
    if (rs.arena && rs.arena->Refresh().ok()) {
      for (const SlotInfo& s : rs.arena->Slots()) {
        slots.push_back({{"slot", s.index}, {"state", SlotStateName(s.state)}, {"leased", s.leased},
                         {"step", s.step}, {"image_bytes", s.image_size}, {"capacity", s.capacity}});
      }
    }
    ranks.push_back({{"rank", rank},
                     {"pid", rs.pid},
                     {"connected", rs.connected},
                     {"closed", rs.closed},
                     {"slots", slots},
                     {"pending_persists", rs.pending.size()},
                     {"last_persisted_step", rs.last_persisted_step ? json(*rs.last_persisted_step) : json(nullptr)},
                     {"last_persist_seconds", rs.last_persist_seconds},
                     {"last_persist_bytes", rs.last_persist_bytes},
                     {"persists_ok", rs.persists_ok},
                     {"persists_failed", rs.persists_failed},
                     {"persists_superseded", rs.persists_superseded},
                     {"emergency_flushes", rs.emergency_flushes},
                     {"last_error", rs.last_error}});
  }
  size_t queued;
  json in_flight = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued = queue_.size();
    if (in_flight_) in_flight = {{"rank", in_flight_->rank}, {"step", in_flight_->step}};
  }
  return {{"agent_pid", ::getpid()},
          {"job", opt_.job},
          {"job_dir", job_dir_},
          {"storage", config_ ? json(config_->storage) : json(nullptr)},
          {"world_size", config_ ? json(config_->world_size) : json(nullptr)},
          {"keep", config_ ? json(config_->keep) : json(nullptr)},
          {"newest_committed", newest_committed_ ? json(*newest_committed_) : json(nullptr)},
          {"queued", queued},
          {"in_flight", in_flight},
          {"ranks", ranks}};
}

bool Agent::AllClosed() {
  if (!saw_client_) return false;
  for (auto& [rank, rs] : ranks_) {
    if (!rs.closed) return false;
  }
  return true;
}

bool Agent::Idle() {
  if (!opt_.exit_when_idle || !clients_.empty()) {
    last_busy_ = Now();
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!queue_.empty() || in_flight_) {
      last_busy_ = Now();
      return false;
    }
  }
  if (AllClosed()) return true;
  return opt_.idle_exit_seconds > 0 && Now() - last_busy_ > opt_.idle_exit_seconds;
}

void Agent::Loop() {
  while (true) {
    if (stopping_) return;
    if (Idle()) {
      Log(AllClosed() ? "every rank closed cleanly; exiting"
                      : "idle with no client; exiting (snapshots stay in shared memory)");
      return;
    }
    std::vector<pollfd> fds = {{listen_fd_, POLLIN, 0}, {signal_fd_, POLLIN, 0},
                               {event_fd_, POLLIN, 0}};
    for (auto& c : clients_) {
      fds.push_back({c->fd, POLLIN, 0});
      fds.push_back({c->pidfd, static_cast<short>(c->pidfd >= 0 ? POLLIN : 0), 0});
    }
    bool waiting = false;
    for (auto& c : clients_) waiting |= !c->waits.empty();
    const int rc = ::poll(fds.data(), fds.size(), waiting ? 200 : 1000);
    if (rc < 0 && errno != EINTR) {
      Log(std::string("poll failed: ") + std::strerror(errno));
      return;
    }
    if (fds[1].revents & POLLIN) {
      signalfd_siginfo si;
      while (::read(signal_fd_, &si, sizeof(si)) == sizeof(si)) {
        Log(std::string("received ") + strsignal(static_cast<int>(si.ssi_signo)) +
            "; flushing and exiting");
        stopping_ = true;
      }
    }
    if (fds[2].revents & POLLIN) {
      uint64_t v;
      while (::read(event_fd_, &v, sizeof(v)) == sizeof(v)) {
      }
    }
    DrainResults();
    // Clients, from the back so that dropping one keeps the indices of the rest.
    for (int i = static_cast<int>(clients_.size()) - 1; i >= 0; --i) {
      const pollfd& sock = fds[3 + 2 * i];
      const pollfd& pid = fds[4 + 2 * i];
      if (sock.revents & (POLLIN | POLLHUP | POLLERR)) {
        const size_t before = clients_.size();
        HandleClientData(i);
        if (clients_.size() != before) continue;
      }
      if (pid.revents & POLLIN) {
        DropClient(i, true);  // the process exited
        continue;
      }
      if (clients_[i]->broken) DropClient(i, false);
    }
    if (fds[0].revents & POLLIN) Accept();
    AnswerWaits();
    for (int i = static_cast<int>(clients_.size()) - 1; i >= 0; --i) {
      if (clients_[i]->broken) DropClient(i, false);
    }
  }
}

void Agent::Shutdown() {
  // Flush what is pending and the newest snapshot of every rank that is not on storage yet.
  if (opt_.emergency_flush) {
    for (auto& [rank, rs] : ranks_) {
      if (!rs.closed) EmergencyFlush(rank, "shutdown");
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    worker_stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  DrainResults();
  AnswerWaits();
  for (auto& [rank, rs] : ranks_) {
    if (rs.arena) rs.arena->ClearLeases();
  }
}

int Agent::Run() {
  Status s = Setup();
  if (!s.ok()) {
    if (s.code() == StatusCode::kAlreadyExists) {
      std::fprintf(stderr, "safepointd: %s\n", s.message().c_str());
      return 3;
    }
    std::fprintf(stderr, "safepointd: error: %s\n", s.ToString().c_str());
    return 1;
  }
  Log("serving job " + opt_.job + " in " + job_dir_);
  worker_ = std::thread([this] { Worker(); });
  Adopt();
  Loop();
  Shutdown();
  const bool all_closed = AllClosed();
  for (auto& c : clients_) {
    ::close(c->fd);
    if (c->pidfd >= 0) ::close(c->pidfd);
  }
  clients_.clear();
  ::unlink(AgentSocketPath(job_dir_).c_str());
  if (all_closed) {
    // The job finished: nothing is left to keep.
    ::unlink((job_dir_ + "/job.json").c_str());
    ::unlink(AgentLogPath(job_dir_).c_str());
    ::unlink(AgentLockPath(job_dir_).c_str());
    ::rmdir(job_dir_.c_str());
  }
  Log("exited");
  return 0;
}

}  // namespace

int RunAgent(const AgentOptions& options) {
  Status v = ValidateJobName(options.job);
  if (!v.ok()) {
    std::fprintf(stderr, "safepointd: error: %s\n", v.ToString().c_str());
    return 1;
  }
  Agent agent(options);
  return agent.Run();
}

}  // namespace safepoint
