// NodeAgent's server: the poll loop and rank bookkeeping (src/agent/node_agent.h;
// docs/architecture.md, "The agent"); its connections and the dispatch of their messages are in
// agent_clients.cc, its answers to waits in waits.cc.
//
// The main thread runs a poll() loop over the listening socket, the clients' sockets, the clients'
// pidfds (a client that dies is noticed even when a forked child still holds its socket), a
// signalfd (SIGTERM/SIGINT/SIGHUP) and an eventfd through which the persist worker reports.
//
// Leases: a client that asks for a persist marks the COMPLETE slot leased itself (so that no
// later save can overwrite it before the agent gets to it); the worker releases the lease when
// the image is written or has failed. A new agent clears stale leases when it adopts a job.
//
// Protocol errors (a malformed frame or payload, a request before hello, a slot that does not
// exist) are answered with an error and close that connection; refusals (a rank already
// connected, another job configuration) are answered with an error and keep it.
#include "agent/node_agent.h"

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

#if defined(__SANITIZE_ADDRESS__)
#define SAFEPOINT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SAFEPOINT_ASAN 1
#endif
#endif
#ifdef SAFEPOINT_ASAN
#include <sanitizer/lsan_interface.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "base/log.h"
#include "base/process.h"
#include "replica/peer_service.h"

namespace safepoint::agent {

using protocol::MessageType;

// How long after a teardown the agent waits before it persists other nodes' snapshots from
// their replicas: the source nodes' own emergency flushes, if they are alive, come first.
constexpr double kHeldFlushDelaySeconds = 3;

double MonotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

NodeAgent::NodeAgent(AgentOptions options)
    : opt_(std::move(options)),
      telemetry_(opt_.job),
      last_busy_(MonotonicSeconds()),
      queue_([this] { Wake(); }),
      replicator_(opt_.job, [this] { Wake(); }),
      relay_(&replicator_, [this] { Wake(); }),
      tiers_([this] { Wake(); }, TierRetrySeconds()) {
  replicator_.SetNoteHandler(
      [this](const std::string& from, const std::string& kind, const std::string& body) {
        return relay_.OnNote(from, kind, body);
      });
}

// The first retry delay of a failed tier copy ($SAFEPOINT_TIER_RETRY_SECONDS, default 1 s; each
// next retry doubles it, up to 60 s).
double TierRetrySeconds() {
  const char* v = std::getenv("SAFEPOINT_TIER_RETRY_SECONDS");
  if (v == nullptr || *v == '\0') return 1.0;
  char* end = nullptr;
  const double d = std::strtod(v, &end);
  return (end != nullptr && *end == '\0' && d > 0 && d <= 60) ? d : 1.0;
}

// How long a stopping agent lets its persists and then its tier copies run before it cancels
// them ($SAFEPOINT_SHUTDOWN_GRACE_SECONDS, default kShutdownGraceSeconds).
double ShutdownGraceSeconds() {
  const char* v = std::getenv("SAFEPOINT_SHUTDOWN_GRACE_SECONDS");
  if (v == nullptr || *v == '\0') return kShutdownGraceSeconds;
  char* end = nullptr;
  const double d = std::strtod(v, &end);
  return (end != nullptr && *end == '\0' && d >= 0 && d <= 3600) ? d : kShutdownGraceSeconds;
}

void NodeAgent::Wake() {
  const uint64_t one = 1;
  if (::write(event_fd_.get(), &one, sizeof(one)) < 0) {
    // The main loop also polls periodically; a lost wake-up only delays it.
  }
}

Status NodeAgent::Setup() {
  SP_ASSIGN_OR_RETURN(job_dir_, JobDirectory(opt_.shm_dir, opt_.job, /*create=*/true));
  const std::string lock = protocol::AgentLockPath(job_dir_);
  lock_fd_.Reset(::open(lock.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!lock_fd_) return ErrnoStatus("open", lock, errno);
  if (::flock(lock_fd_.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) return AlreadyExists("another agent serves job " + opt_.job);
    return ErrnoStatus("flock", lock, errno);
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(lock_fd_.get(), 0) != 0 ||
      ::pwrite(lock_fd_.get(), pid.data(), pid.size(), 0) < 0) {
    return ErrnoStatus("write", lock, errno);
  }

  const std::string sock = protocol::AgentSocketPath(job_dir_);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (sock.size() >= sizeof(addr.sun_path)) {
    return InvalidArgument(sock + ": socket path too long (at most " +
                           std::to_string(sizeof(addr.sun_path) - 1) +
                           " bytes); use a shorter shm_dir");
  }
  std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
  ::unlink(sock.c_str());  // stale: we hold the lock, so no agent is using it
  listen_fd_.Reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listen_fd_) return ErrnoStatus("socket", sock, errno);
  if (::bind(listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus("bind", sock, errno);
  }
  ::chmod(sock.c_str(), 0600);
  if (::listen(listen_fd_.get(), 128) != 0) return ErrnoStatus("listen", sock, errno);

  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGHUP);
  ::pthread_sigmask(SIG_BLOCK, &mask, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  signal_fd_.Reset(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK));
  if (!signal_fd_) return ErrnoStatus("signalfd", job_dir_, errno);
  event_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!event_fd_) return ErrnoStatus("eventfd", job_dir_, errno);
  return Status::OK();
}

Status NodeAgent::EnsureRank(uint32_t rank) {
  RankState& r = ranks_[rank];
  if (r.arena) return r.arena->Refresh();
  SP_ASSIGN_OR_RETURN(r.arena, Arena::Open(job_dir_, rank));
  // The node that runs rank 0 fills the lower tiers (src/agent/tier_copier.h).
  if (rank == 0 && config_ && !tiers_.started()) {
    tiers_.Start(opt_.job, store_, config_->tiers, pins_);
  }
  return Status::OK();
}

// Fixes the job's configuration and starts persisting to `store`.
Status NodeAgent::Configure(const JobConfig& config, std::shared_ptr<CheckpointStore> store) {
  config_ = config;
  store_ = std::move(store);
  queue_.Start(job_dir_,
               {opt_.job, store_, config.world_size, config.keep, pins_,
                MakePackOptions(config.compression, config.incremental), ledger_, &relay_});
  replicator_.SetStorage(store_, config.world_size);
  auto committed = store_->ListCommitted();
  if (committed.ok()) {
    for (const auto& c : *committed) committed_cache_.insert(c.step);
    if (!committed->empty()) {
      newest_committed_ = committed->back().step;
      telemetry_.KnownCommit(0, committed->back().step,
                             static_cast<double>(committed->back().commit_time_ns) / 1e9);
    }
  }
  std::vector<std::string> uris = {config.storage};
  for (const TierSpec& t : config.tiers) uris.push_back(t.uri);
  telemetry_.SetTierUris(uris);
  return Status::OK();
}

// Writes job.json so that a later agent can adopt the job. A failure does not stop this agent
// from serving, but it is logged and reported in the status (`job_config_error`), and retried
// at the next hello.
void NodeAgent::SaveJobConfig() {
  config_saved_ = WriteJobConfig(job_dir_, *config_);
  config_written_ = config_saved_.ok();
  if (!config_written_) {
    spdlog::error(
        "cannot write the job configuration; a later agent will not be able to adopt "
        "this job's snapshots: {}",
        config_saved_.ToString());
  }
}

void NodeAgent::Enqueue(PersistTask t) {
  std::erase(pruned_, t.step);
  commit_polls_.erase(t.step);  // persisted again here: its commit is asked anew at 0.2 s
  ranks_[t.rank].pending.insert(t.step);
  // Every rank of the world is this agent's (a job on one node): its commits need no listing.
  const bool every = HostsEveryRank();
  queue_.SetHostsEveryRank(every);
  if (!every && t.attempt == 0) t.attempt = SnapshotAttempt(t);
  if (!every && t.reason == FlushReason::kRequested) t.ranks_here = ConnectedRanks(t.attempt);
  queue_.Enqueue(std::move(t));
}

bool NodeAgent::HostsEveryRank() const {
  const uint32_t world = config_ ? config_->world_size : 0;
  const auto hosted =
      std::count_if(ranks_.begin(), ranks_.end(), [&](const auto& kv) { return kv.first < world; });
  return world > 0 && static_cast<uint32_t>(hosted) == world;
}

uint32_t NodeAgent::ConnectedRanks(uint64_t attempt) const {
  const uint32_t world = config_ ? config_->world_size : 0;
  std::set<uint32_t> ranks;
  for (const auto& c : clients_) {
    if (!c->hello || c->refused || c->closing || c->rank >= world || c->attempt != attempt) {
      continue;
    }
    // A rank whose snapshots this agent adopted (it reconnected to a restarted agent) counts once
    // it asked this agent for a persist: the agent before may have persisted its image of the
    // step in progress, and it will not ask for that step again.
    const auto rs = ranks_.find(c->rank);
    if (rs != ranks_.end() && (!rs->second.adopted || rs->second.newest_asked)) {
      ranks.insert(c->rank);
    }
  }
  return static_cast<uint32_t>(ranks.size());
}

uint64_t NodeAgent::SnapshotAttempt(const PersistTask& t) {
  auto found = ranks_.find(t.rank);
  if (found == ranks_.end() || !found->second.arena) return 0;
  Arena& arena = *found->second.arena;
  if (!arena.Refresh().ok()) return 0;
  for (const SlotInfo& s : arena.Slots()) {
    if (s.index != t.slot || s.state != SlotState::kComplete || s.generation != t.generation ||
        s.step != t.step || s.image_size < kImageHeaderSize) {
      continue;
    }
    auto header = ParseImageHeader(arena.SlotData(t.slot).subspan(0, kImageHeaderSize), job_dir_);
    if (header.ok() && header->first.step == t.step && header->first.rank == t.rank) {
      return header->first.attempt;
    }
  }
  return 0;
}

void NodeAgent::DrainResults() {
  for (PersistResult& r : queue_.TakeResults()) {
    if (r.task.commit_only != PersistTask::CommitOnly::kNo) {
      RelayCommitDone(r);
      continue;
    }
    const uint32_t rank = r.task.rank;
    const uint64_t step = r.task.step;
    telemetry_.Persisted(r);
    RankState& rs = ranks_[rank];
    if (auto it = rs.pending.find(step); it != rs.pending.end()) rs.pending.erase(it);
    auto prior = rs.outcomes.find(step);
    const bool already_ok = prior != rs.outcomes.end() && prior->second.ok();
    if (r.superseded) {
      ++rs.persists_superseded;
      if (!already_ok) {
        rs.outcomes[step] =
            Cancelled("step " + std::to_string(step) +
                      " was overwritten by a newer snapshot before it was persisted");
      }
      spdlog::warn("rank {} step {}: superseded by a newer snapshot before it could be persisted",
                   rank, step);
    } else if (!r.status.ok()) {
      ++rs.persists_failed;
      rs.last_error = r.status.ToString();
      if (!already_ok) rs.outcomes[step] = r.status;
      spdlog::error("rank {} step {}: persisting failed ({}): {}", rank, step,
                    FlushReasonName(r.task.reason), r.status.ToString());
    } else {
      ++rs.persists_ok;
      rs.last_persisted_step = std::max(rs.last_persisted_step.value_or(0), step);
      rs.last_persist_seconds = r.seconds;
      rs.last_persist_bytes = r.bytes;
      if (rank == 0) history_.Persisted("path", r.seconds, r.bytes);
      rs.outcomes[step] = Status::OK();
      rs.persisted_generation[step] = {r.task.slot, r.task.generation};
      rs.persisted_attempt[step] = r.attempt;
      if (r.committed) {
        MarkCommitted(step);
        EndHandOvers(step);
        if (relay_.Active()) relay_.Announce(step, r.attempt, r.pruned);
      }
      spdlog::info("rank {} step {}: persisted {} bytes in {:.3f} s ({}){}", rank, step, r.bytes,
                   r.seconds, FlushReasonName(r.task.reason), r.committed ? ", committed" : "");
      for (uint64_t p : r.pruned) {
        committed_cache_.erase(p);
        pruned_.push_back(p);
        if (p == step) {
          // Not a failure of the save: the checkpoint path holds `keep` newer committed steps
          // (e.g. of an earlier run), which retention keeps instead. Its waits are answered OK.
          spdlog::warn(
              "step {} was committed and then removed at once by retention (keep {}): the "
              "storage holds newer committed steps, the newest is {} (left by an earlier run?); "
              "a restore loads that one",
              step, config_ ? config_->keep : 0, newest_committed_.value_or(step));
        }
      }
      while (pruned_.size() > 256) pruned_.pop_front();
    }
    // Keep the outcome table small.
    while (rs.outcomes.size() > 64) rs.outcomes.erase(rs.outcomes.begin());
    while (rs.persisted_generation.size() > 64) {
      rs.persisted_generation.erase(rs.persisted_generation.begin());
    }
    while (rs.persisted_attempt.size() > 64) {
      rs.persisted_attempt.erase(rs.persisted_attempt.begin());
    }
  }
}

bool NodeAgent::AllClosed() {
  if (!saw_client_) return false;
  for (auto& [rank, rs] : ranks_) {
    if (!rs.closed) return false;
  }
  return true;
}

bool NodeAgent::Idle() {
  // A refused client keeps nothing alive; one whose hello is not read yet (or parked) does.
  const bool clients =
      std::any_of(clients_.begin(), clients_.end(), [](const auto& c) { return !c->refused; });
  if (!opt_.exit_when_idle || clients || queue_.Busy() || tiers_.Busy()) {
    last_busy_ = MonotonicSeconds();
    return false;
  }
  if (AllClosed()) return true;
  // A process was refused and no rank is connected: exit now rather than after the idle time
  // (the snapshots stay in shared memory; the job's next agent adopts them).
  if (refused_ && !replicator_.holds_replicas()) return true;
  // An agent that holds other nodes' replicas stays longer: a replacement node may need them.
  const double idle = replicator_.holds_replicas() ? std::max(opt_.idle_exit_seconds, 3600.0)
                                                   : opt_.idle_exit_seconds;
  return idle > 0 && MonotonicSeconds() - last_busy_ > idle;
}

void NodeAgent::Loop() {
  while (!stopping_) {
    if (Idle()) {
      spdlog::info(AllClosed() ? "every rank closed cleanly; exiting"
                   : refused_
                       ? "a process was refused and no rank is connected; exiting (snapshots "
                         "stay in shared memory for the job's next agent)"
                       : "idle with no client; exiting (snapshots stay in shared memory)");
      return;
    }
    std::vector<pollfd> fds = {
        {listen_fd_.get(), POLLIN, 0}, {signal_fd_.get(), POLLIN, 0}, {event_fd_.get(), POLLIN, 0}};
    bool waiting = false;
    for (auto& c : clients_) {
      fds.push_back({c->fd.get(), POLLIN, 0});
      fds.push_back({c->pidfd.get(), static_cast<short>(c->pidfd ? POLLIN : 0), 0});
      waiting |= !c->waits.empty() || c->parked_hello.has_value();
    }
    const int rc = ::poll(fds.data(), fds.size(), waiting ? 200 : 1000);
    if (rc < 0 && errno != EINTR) {
      spdlog::critical("poll failed: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents & POLLIN) {
      signalfd_siginfo si;
      while (::read(signal_fd_.get(), &si, sizeof(si)) == sizeof(si)) {
        spdlog::info("received {}; flushing and exiting",
                     strsignal(static_cast<int>(si.ssi_signo)));
        stopping_ = true;
      }
    }
    if (fds[2].revents & POLLIN) {
      uint64_t v;
      while (::read(event_fd_.get(), &v, sizeof(v)) == sizeof(v)) {
      }
    }
    DrainResults();
    DrainRelay();
    AdvanceWorldChange();
    DrainReplication();
    PollCommitsForTiers();
    RefreshTelemetry();
    if (tiers_.started() && history_.open()) history_.TierStates(tiers_.States());
    history_.Sync();
    replicator_.ReleaseSparesWhenMemoryIsLow();
    // Torn down here (every local rank died): after the ranks' own emergency flushes had a
    // moment, persist what this node keeps of other nodes' snapshots whose step did not commit.
    if (!clients_.empty() || AllClosed() || !replicator_.enabled()) {
      torn_down_since_.reset();
      held_flushed_ = false;
    } else if (saw_client_ && !torn_down_since_) {
      torn_down_since_ = MonotonicSeconds();
    } else if (torn_down_since_ && !held_flushed_ && !queue_.Busy() &&
               MonotonicSeconds() - *torn_down_since_ > kHeldFlushDelaySeconds) {
      replicator_.EnqueueFlushHeld();
      held_flushed_ = true;  // once per teardown
    }
    // Clients, from the back so that dropping one keeps the indices of the rest.
    for (size_t i = clients_.size(); i-- > 0;) {
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
    for (size_t i = clients_.size(); i-- > 0;) {
      if (clients_[i]->broken) DropClient(i, false);
    }
  }
}

void NodeAgent::Shutdown() {
  // Flush what is pending and the newest snapshot of every rank that is not on storage yet.
  if (opt_.emergency_flush) {
    for (auto& [rank, rs] : ranks_) {
      if (!rs.closed) EmergencyFlush(rank, FlushReason::kShutdown);
    }
  }
  // The commits this agent announced reach the other nodes before its peer service stops (their
  // ranks' last waits are answered by these notes): at a clean exit the committer's ranks close
  // right after their own waits, before its notes of the last steps went out.
  if (!relay_.Flush(kRelayFlushSeconds)) {
    spdlog::warn(
        "the commit notes to other nodes were not all sent within {:g} s; those nodes "
        "learn the commits from storage",
        kRelayFlushSeconds);
  }
  replicator_.Stop();
  // The persists run for up to the grace; a tier 0 that stalls (an S3 gateway or OSD that stopped
  // answering) is then cancelled instead of holding the agent for its requests' timeout times
  // their attempts per snapshot. What was not persisted stays in shared memory: the ranks' hot
  // reload and the next agent of the job (which adopts and persists it) still have it.
  const double grace = ShutdownGraceSeconds();
  const double deadline = MonotonicSeconds() + grace;
  if (!queue_.Stop(grace)) {
    spdlog::error(
        "persisting to {} did not finish within the shutdown grace of {:g} s "
        "($SAFEPOINT_SHUTDOWN_GRACE_SECONDS): cancelled; the snapshots not persisted stay in "
        "shared memory for the next agent of this job",
        config_ ? config_->storage : std::string("the storage"), grace);
  }
  DrainResults();
  AnswerWaits();
  // The steps just committed go down the tiers too, for what is left of the grace: a stalled
  // tier must not keep the agent from exiting (its copy resumes when the next agent adopts the
  // job).
  PollCommitsForTiers();
  tiers_.Stop(std::max(0.0, deadline - MonotonicSeconds()));
  if (tiers_.started()) history_.TierStates(tiers_.States());
  history_.Ended();
  history_.Stop(std::max(0.0, deadline - MonotonicSeconds()));
  for (auto& [rank, rs] : ranks_) {
    if (rs.arena) rs.arena->ClearLeases();
  }
}

int NodeAgent::Run() {
  Status s = Setup();
  if (!s.ok()) {
    if (s.code() == StatusCode::kAlreadyExists) {
      spdlog::warn("{}", s.message());
      return 3;
    }
    spdlog::error("{}", s.ToString());
    return 1;
  }
  spdlog::info("serving job {} in {}", opt_.job, job_dir_);
  StartTelemetry();
  Adopt();
  Loop();
  Shutdown();
  RefreshTelemetry(/*now=*/true);
  telemetry_.StopMetrics();
  const bool all_closed = AllClosed();
  clients_.clear();
  ::unlink(protocol::AgentSocketPath(job_dir_).c_str());
  if (all_closed) {
    // The job finished: nothing is left to keep (an event log the user placed elsewhere stays).
    ::unlink(protocol::JobConfigPath(job_dir_).c_str());
    ::unlink(protocol::AgentLogPath(job_dir_).c_str());
    ::unlink(protocol::EventLogPath(job_dir_).c_str());
    ::unlink((protocol::EventLogPath(job_dir_) + ".1").c_str());
    ::unlink(protocol::AgentLockPath(job_dir_).c_str());
    replicator_.RemoveReplicas();
    ::rmdir(job_dir_.c_str());
  }
  spdlog::info("exited");
  return 0;
}

}  // namespace safepoint::agent

namespace safepoint {
namespace {

// Ends the process after the agent retired its peer service (Replicator::Stop): UCX stays alive
// to the end, so no exit handler or static destructor may run (UCX's own library destructors
// would tear it down under its async thread). The logs are flushed first; a sanitized build
// checks for leaks first, everything but the retired service having been destroyed (that one is
// reachable from a global, so not counted), and dies on one as it would at exit.
[[noreturn]] void ExitKeepingUcx(int rc) {
  spdlog::apply_all([](const std::shared_ptr<spdlog::logger>& l) { l->flush(); });
  std::fflush(nullptr);
#ifdef SAFEPOINT_ASAN
  __lsan_do_leak_check();
#endif
  ::_exit(rc);
}

}  // namespace

int RunAgent(const AgentOptions& options) {
  // The peer listener may take its port again while connections of a dead agent on it linger
  // in TIME_WAIT (a restarted agent keeps its predecessor's port). Before any thread starts.
  ::setenv("UCX_TCP_CM_REUSEADDR", "y", /*overwrite=*/0);
  internal::InitLogging("safepointd");
  if (!options.log_level.empty() && !internal::SetLogLevel(options.log_level)) {
    spdlog::error("unknown log level '{}'", options.log_level);
    return 1;
  }
  Status v = ValidateJobName(options.job);
  if (!v.ok()) {
    spdlog::error("{}", v.ToString());
    return 1;
  }
  int rc = 0;
  {
    agent::NodeAgent agent(options);
    rc = agent.Run();
  }
  if (replica::PeerService::AnyRetired()) ExitKeepingUcx(rc);
  return rc;
}

}  // namespace safepoint
