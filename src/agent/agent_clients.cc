// NodeAgent's connections (src/agent/node_agent.h): accepting clients, reading their frames,
// dispatching each message (hello, snapshot notes, waits, reports, the peer service's calls),
// replying, and dropping a client that closed or died (with the emergency flush of its
// snapshots). The poll loop that calls these is in node_agent.cc.
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "agent/node_agent.h"
#include "base/clock.h"
#include "base/log.h"
#include "base/process.h"
#include "shm/rank_claim.h"

namespace safepoint::agent {

using protocol::MessageType;

void NodeAgent::Reply(Client& c, MessageType type, const std::string& payload) {
  // A client that does not read its replies must not wedge the agent: give up after a second
  // and drop it (the loop removes broken clients).
  Status s = protocol::SendMessage(c.fd.get(), type, payload, /*timeout_s=*/1.0);
  if (!s.ok()) {
    spdlog::warn("reply to pid {} failed: {}; dropping it", c.pid, s.ToString());
    c.broken = true;
  }
}

void NodeAgent::ReplyError(Client& c, const std::string& msg) {
  Reply(c, MessageType::kError, Encode(protocol::ErrorReply{msg}));
}

void NodeAgent::RefuseHello(Client& c, const std::string& msg) {
  c.refused = true;
  // With no rank connected, nothing keeps the agent once its work is done (Idle): a process
  // refused (and its retries) must not keep the job's agent, and so the job, alive.
  if (std::none_of(clients_.begin(), clients_.end(), [](const auto& o) { return o->hello; })) {
    refused_ = true;
  }
  spdlog::warn("refused pid {}: {}", c.pid, msg);
  ReplyError(c, msg);
}

void NodeAgent::Accept() {
  for (;;) {
    internal::UniqueFd fd(
        ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd) return;
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
        cred.uid != ::geteuid()) {
      spdlog::warn(
          "refused a connection from uid {} (pid {}): only the agent's own user may "
          "connect",
          cred.uid, cred.pid);
      continue;
    }
    auto c = std::make_unique<Client>();
    c->fd = std::move(fd);
    c->pid = static_cast<uint32_t>(cred.pid);
    c->pidfd.Reset(static_cast<int>(::syscall(SYS_pidfd_open, cred.pid, 0)));
    clients_.push_back(std::move(c));
  }
}

// Reads what the client sent and handles every complete frame. A client's last frames (a
// snapshot note, a close, a report sent just before it exited) often arrive together with the
// end of its connection: they are handled first, and only then is the disconnect processed.
void NodeAgent::HandleClientData(size_t idx) {
  Client& c = *clients_[idx];
  char buf[64 << 10];
  bool gone = false;  // EOF or a broken connection
  for (;;) {
    const ssize_t n = ::recv(c.fd.get(), buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) break;
    if (n <= 0) {
      gone = true;
      break;
    }
    c.decoder.Feed({reinterpret_cast<const std::byte*>(buf), static_cast<size_t>(n)});
    if (c.decoder.buffered() > 2 * protocol::kMaxMessageBytes) break;
  }
  // A reply to a client that is gone fails (and marks it broken); its notes still count.
  while (!c.broken || gone) {
    auto m = c.decoder.Next();
    Status s = m.ok() ? Status::OK() : m.status();
    if (s.ok()) {
      if (!*m) break;
      s = HandleMessage(c, **m);
    }
    if (!s.ok()) {
      spdlog::warn("pid {}: {}; closing its connection", c.pid, s.message());
      if (!c.broken) ReplyError(c, s.message());
      return DropClient(idx, gone && !c.closing);
    }
  }
  if (gone) DropClient(idx, !c.closing);
}

Status NodeAgent::HandleMessage(Client& c, const protocol::Message& m) {
  if (m.type == MessageType::kStatus || m.type == MessageType::kClose ||
      m.type == MessageType::kShutdown) {
    protocol::EmptyRequest empty;
    SP_RETURN_IF_ERROR(Decode(m.payload, &empty));
  }
  if (c.hello && m.type != MessageType::kStatus) ++ranks_[c.rank].messages_received;
  auto require_hello = [&](const char* what) {
    return c.hello ? Status::OK()
                   : InvalidArgument(std::string("protocol error: ") + what + " before hello");
  };
  switch (m.type) {
    case MessageType::kHello: {
      protocol::HelloRequest hello;
      SP_RETURN_IF_ERROR(Decode(m.payload, &hello));
      return HandleHello(c, hello);
    }
    case MessageType::kSnapshot: {
      SP_RETURN_IF_ERROR(require_hello("snapshot"));
      protocol::SnapshotNote note;
      SP_RETURN_IF_ERROR(protocol::Decode(m.payload, &note));
      return HandleSnapshot(c, std::move(note));
    }
    case MessageType::kStatus:
      Reply(c, MessageType::kStatusReply, StatusJson().dump());
      return Status::OK();
    case MessageType::kWait: {
      SP_RETURN_IF_ERROR(require_hello("wait"));
      protocol::WaitRequest wait;
      SP_RETURN_IF_ERROR(Decode(m.payload, &wait));
      c.waits.emplace_back(wait.step, wait.persisted);
      AnswerWaits();
      return Status::OK();
    }
    case MessageType::kClose: {
      SP_RETURN_IF_ERROR(require_hello("close"));
      c.closing = true;
      ranks_[c.rank].close_client = c.fd.get();
      if (c.rank == 0) history_.Closed();
      EmergencyFlush(c.rank, FlushReason::kClose);
      AnswerWaits();
      return Status::OK();
    }
    case MessageType::kReport: {
      SP_RETURN_IF_ERROR(require_hello("report"));
      protocol::ReportNote note;
      SP_RETURN_IF_ERROR(protocol::Decode(m.payload, &note));
      HandleReport(c, note);
      return Status::OK();
    }
    case MessageType::kShutdown:
      spdlog::info("shutdown requested by pid {}", c.pid);
      stopping_ = true;
      Reply(c, MessageType::kCloseReply, Encode(protocol::CloseReply{Status::OK()}));
      return Status::OK();
    case MessageType::kPeerSetup:
    case MessageType::kMembership:
    case MessageType::kPeerList:
    case MessageType::kPeerFetch:
    case MessageType::kPause:
      SP_RETURN_IF_ERROR(require_hello("a peer replication request"));
      return HandlePeerMessage(c, m);
    case MessageType::kPeerSetupReply:
    case MessageType::kAck:
    case MessageType::kPeerListReply:
    case MessageType::kPeerFetchReply:
    case MessageType::kHelloReply:
    case MessageType::kStatusReply:
    case MessageType::kWaitReply:
    case MessageType::kCloseReply:
    case MessageType::kError:
      break;
  }
  return InvalidArgument("protocol error: a client sent message type " +
                         std::to_string(static_cast<int>(m.type)) + ", which only the agent sends");
}

Status NodeAgent::HandlePeerMessage(Client& c, const protocol::Message& m) {
  switch (m.type) {
    case MessageType::kPeerSetup: {
      protocol::PeerSetupRequest req;
      SP_RETURN_IF_ERROR(Decode(m.payload, &req));
      auto address = replicator_.Setup(job_dir_, req);
      if (!address.ok()) {
        ReplyError(c, address.status().message());
      } else {
        Reply(c, MessageType::kPeerSetupReply, Encode(protocol::PeerSetupReply{*address}));
      }
      return Status::OK();
    }
    case MessageType::kMembership: {
      Membership note;
      SP_RETURN_IF_ERROR(protocol::Decode(m.payload, &note));
      Reply(c, MessageType::kAck, Encode(protocol::AckReply{replicator_.Configure(note)}));
      return Status::OK();
    }
    case MessageType::kPeerList:
    case MessageType::kPeerFetch: {
      PeerRequest r{c.fd.get(), c.pid, m.type};
      if (m.type == MessageType::kPeerList) {
        protocol::PeerListRequest req;
        SP_RETURN_IF_ERROR(Decode(m.payload, &req));
        r.rank = req.rank;
      } else {
        protocol::PeerFetchRequest req;
        SP_RETURN_IF_ERROR(Decode(m.payload, &req));
        r.rank = req.rank;
        r.step = req.step;
        r.attempt = req.attempt;
        if (!req.from_address.empty()) {
          Result<replica::SnapshotOrigin> origin = HealOrigin(req);
          if (!origin.ok()) {
            protocol::PeerFetchReply refused;
            refused.status = origin.status();
            Reply(c, MessageType::kPeerFetchReply, Encode(refused));
            return Status::OK();
          }
          r.origin = std::move(*origin);
          r.timeout_s = req.timeout_ms / 1000.0;
        }
      }
      // A rank rebuilds only its own snapshots: the agent writes that rank's slot for it.
      if (r.rank != c.rank) {
        return InvalidArgument("protocol error: rank " + std::to_string(c.rank) +
                               " asked for rank " + std::to_string(r.rank) + "'s snapshots");
      }
      // A heal needs only this agent's peer service; a rebuild, the job's replication.
      if (r.origin ? !replicator_.configured() : !replicator_.enabled()) {
        if (m.type == MessageType::kPeerList) {
          Reply(c, MessageType::kPeerListReply, Encode(protocol::PeerListReply{}));
        } else {
          protocol::PeerFetchReply none;
          none.status = r.origin ? InvalidArgument("a heal before this agent's peer setup")
                                 : NotFound("peer replication is not configured");
          Reply(c, MessageType::kPeerFetchReply, Encode(none));
        }
        return Status::OK();
      }
      replicator_.EnqueueRequest(r);
      return Status::OK();
    }
    case MessageType::kPause: {
      protocol::PauseNote note;
      SP_RETURN_IF_ERROR(protocol::Decode(m.payload, &note));
      replicator_.SetPaused(note.paused);
      return Status::OK();
    }
    default:
      return InvalidArgument("protocol error: not a peer replication request");
  }
}

void NodeAgent::DrainReplication() {
  for (PushOutcome& o : replicator_.TakeOutcomes()) {
    telemetry_.Replicated(o);
    if (o.superseded) {
      spdlog::info("rank {} step {}: replication superseded by a newer snapshot", o.task.rank,
                   o.task.step);
    } else if (!o.status.ok()) {
      spdlog::warn("rank {} step {}: replication failed: {}", o.task.rank, o.task.step,
                   o.status.message());
    } else {
      spdlog::debug("rank {} step {}: replicated {} bytes in {:.3f} s", o.task.rank, o.task.step,
                    o.bytes, o.seconds);
    }
  }
  for (PeerAnswer& a : replicator_.TakeAnswers()) {
    for (auto& c : clients_) {
      if (c->fd.get() == a.client_fd && c->pid == a.client_pid) {
        Reply(*c, a.reply_type, a.payload);
        break;
      }
    }
  }
}

Status NodeAgent::HandleHello(Client& c, const protocol::HelloRequest& hello) {
  const JobConfig want{hello.storage, hello.world_size,  hello.keep,
                       hello.tiers,   hello.compression, hello.incremental};
  if (want.world_size == 0 || hello.rank >= want.world_size || want.world_size > kMaxRank) {
    RefuseHello(c, "invalid rank " + std::to_string(hello.rank) + " of world size " +
                       std::to_string(want.world_size));
    return Status::OK();
  }
  // Another path or other tiers under the job's name: a conflict while the job's run lives
  // here. Once every rank of the run closed cleanly and this agent is about to exit, it is the
  // job's next run, which met this agent in the moment before it exits: Unavailable, and the
  // client waits for the exit and starts the job's next agent (refused as a conflict before,
  // whenever the next run started that soon: make test, 2026-12-06).
  std::string conflict;
  if (config_ && config_->storage != want.storage) {
    conflict = "job " + opt_.job + " already persists to " + config_->storage +
               "; this process asked for " + want.storage + " (use another job name)";
  } else if (config_ && config_->tiers != want.tiers) {
    conflict = "job " + opt_.job + " already fills the storage tiers " +
               protocol::EncodeTiers(config_->tiers).dump() + "; this process asked for " +
               protocol::EncodeTiers(want.tiers).dump() +
               " (use another job name, or let the job's agent exit first)";
  }
  if (!conflict.empty()) {
    if (opt_.exit_when_idle && AllClosed()) {
      conflict = Unavailable("job " + opt_.job + "'s agent, which persisted to " +
                             config_->storage + ", is exiting (every rank of its run closed)")
                     .ToString();
    }
    RefuseHello(c, conflict);
    return Status::OK();
  }
  if (Status s = ValidateTiers(want.storage, want.tiers);
      !s.ok() || !(s = ParseCompression(want.compression).status()).ok()) {
    RefuseHello(c, s.ToString());
    return Status::OK();
  }
  // Another world size than the job's: the job restarted with more or fewer ranks
  // (world_change.cc). Accepted once no process of the previous world runs; the hello is
  // answered after the previous world's snapshots are persisted and dropped.
  if (world_change_ && want.world_size != *world_change_) {
    RefuseHello(c, "job " + opt_.job + " is changing its world size from " +
                       std::to_string(config_->world_size) + " to " +
                       std::to_string(*world_change_) + "; this process asked for world size " +
                       std::to_string(want.world_size) + " (use another job name)");
    return Status::OK();
  }
  if (config_ && (world_change_ || config_->world_size != want.world_size)) {
    if (!world_change_) {
      if (auto live = LivePreviousRank()) {
        RefuseHello(c, "job " + opt_.job + " runs with world size " +
                           std::to_string(config_->world_size) + " (its rank " +
                           std::to_string(live->first) + ", pid " + std::to_string(live->second) +
                           ", is alive); this process asked for world size " +
                           std::to_string(want.world_size) +
                           ": stop the job's processes first, or use another job name");
        return Status::OK();
      }
    }
    BeginWorldChange(c, hello);
    return Status::OK();
  }
  if (!config_) {
    auto store = OpenCheckpointStore(want.storage);
    if (!store.ok()) {
      RefuseHello(c, store.status().ToString());
      return Status::OK();
    }
    SP_RETURN_IF_ERROR(Configure(want, std::move(store).value()));
  }
  if (!config_written_) SaveJobConfig();
  if (Status s = EnsureRank(hello.rank); !s.ok()) {
    RefuseHello(c, s.ToString());
    return Status::OK();
  }
  RankState& rs = ranks_[hello.rank];
  // Who may write the rank's slots (src/shm/rank_claim.h; docs/reliability.md, "Superseded
  // processes"): a process of another save attempt that started after the rank's process, which
  // still runs, is a newer run of the job (the old one is stale: left hung in a collective by a
  // partition, say). It supersedes that one. Anything else that finds the rank taken is refused.
  const internal::ProcessId me{c.pid, internal::ProcessStartTicks(c.pid).value_or(0)};
  auto claim = RankClaim::OpenOrCreate(job_dir_, hello.rank);
  if (!claim.ok()) {
    // Without a claim nothing is fenced (the writers check nothing): the rank works as before.
    spdlog::warn("rank {}: no claim ({}); a superseded process could not be fenced", hello.rank,
                 claim.status().ToString());
  }
  RankClaim* rc = claim.ok() ? claim->get() : nullptr;
  if (rc != nullptr && rc->FindSuperseded(me)) {
    RefuseHello(c, Superseded(SupersededMessage(job_dir_, hello.rank, me, rc->Owner())).ToString());
    return Status::OK();
  }
  // The rank's process now: the connected one, else the claim's owner while it runs (the
  // agent was restarted while it was blocked elsewhere, or it lost its connection).
  struct Holder {
    internal::ProcessId process;
    uint64_t attempt = 0;
  };
  std::optional<Holder> holder;
  const ClaimOwner owner = rc != nullptr ? rc->Owner() : ClaimOwner{};
  if (rs.connected && rs.pid != c.pid && internal::ProcessAlive({rs.pid, 0})) {
    holder = Holder{{rs.pid, internal::ProcessStartTicks(rs.pid).value_or(0)}, 0};
    if (holder->process == owner.process) holder->attempt = owner.attempt;
  } else if (owner.process.pid != 0 && owner.process.pid != c.pid &&
             internal::ProcessAlive(owner.process)) {
    holder = Holder{owner.process, owner.attempt};
  }
  if (holder) {
    const uint64_t ticks = holder->process.start_ticks;
    const bool other_run =
        hello.attempt != 0 && holder->attempt != 0 && hello.attempt != holder->attempt;
    if (other_run && ticks != 0 && me.start_ticks > ticks) {
      // A newer run takes the rank from the process that still runs. In this order: the claim
      // records that process as superseded and this one as the owner (the epoch moves on: the
      // old process's writes fail from now on), then every slot being written is removed (what
      // it was copying is never seen: src/shm/arena.h), then its connections are answered
      // (waits: SupersededError) and closed, and what it completed before is persisted as for
      // a process that died (its leases released).
      const internal::ProcessId old = holder->process;
      if (rc != nullptr) {
        rc->AddSuperseded({old, holder->attempt, me, hello.attempt, UnixNanos()});
        rc->SetOwner(me, hello.attempt);
      }
      const uint32_t removed = rs.arena ? rs.arena->RemoveWritingSlots() : 0;
      const Status why = Superseded(SupersededMessage(
          job_dir_, hello.rank, old, rc != nullptr ? rc->Owner() : ClaimOwner{me, hello.attempt}));
      uint32_t connections = 0;
      for (auto& other : clients_) {
        if (!other->hello || other->rank != hello.rank || other->pid != old.pid || other->broken) {
          continue;
        }
        for (const auto& [step, persisted] : other->waits) {
          Reply(*other, MessageType::kWaitReply, Encode(protocol::WaitReply{step, why}));
        }
        other->waits.clear();
        if (rs.close_client == other->fd.get()) rs.close_client = -1;
        other->broken = true;  // the loop drops it (no emergency flush: the one below is it)
        ++connections;
      }
      rs.connected = false;
      spdlog::warn(
          "rank {}: process {} (save attempt {}) supersedes process {} (save attempt {}), which "
          "still runs: a newer run of the job took the rank; the old process's {} "
          "connection(s) are closed, its saves fail (SupersededError), {} slot(s) it was "
          "writing are removed",
          hello.rank, me.pid, hello.attempt, old.pid, holder->attempt, connections, removed);
      if (opt_.emergency_flush) EmergencyFlush(hello.rank, FlushReason::kEmergency);
    } else if (other_run && ticks != 0 && me.start_ticks != 0 && me.start_ticks < ticks) {
      RefuseHello(
          c,
          Superseded("rank " + std::to_string(hello.rank) + " belongs to process " +
                     std::to_string(holder->process.pid) + " (save attempt " +
                     std::to_string(holder->attempt) + "), which started after this process (pid " +
                     std::to_string(c.pid) + ", save attempt " + std::to_string(hello.attempt) +
                     "): this process is of an earlier run of the job; end it")
              .ToString());
      return Status::OK();
    } else {
      std::string why;
      if (hello.attempt == 0 || holder->attempt == 0) {
        why = "; with no save attempt to tell the runs apart, the newer cannot supersede it";
      } else if (hello.attempt == holder->attempt) {
        why = "; both are of save attempt " + std::to_string(hello.attempt) +
              " (one run cannot have two processes for a rank; a restarted run needs a new "
              "attempt: see $SAFEPOINT_ATTEMPT)";
      }
      RefuseHello(c, "rank " + std::to_string(hello.rank) + " is already connected (pid " +
                         std::to_string(holder->process.pid) + ")" + why);
      return Status::OK();
    }
  }
  const uint64_t epoch = rc != nullptr ? rc->SetOwner(me, hello.attempt) : 0;
  c.hello = true;
  refused_ = false;
  c.rank = hello.rank;
  c.attempt = hello.attempt;
  if (hello.rank == 0) history_.Open(config_->storage, opt_.job, [this] { Wake(); });
  rs.connected = true;
  rs.closed = false;
  rs.pid = c.pid;
  rs.newest_asked.reset();
  saw_client_ = true;
  ConfigureTelemetry(hello);
  spdlog::info("rank {} connected (pid {})", hello.rank, c.pid);
  Reply(c, MessageType::kHelloReply,
        Encode(protocol::HelloReply{static_cast<uint32_t>(::getpid()), job_dir_, epoch}));
  return Status::OK();
}

Status NodeAgent::HandleSnapshot(Client& c, protocol::SnapshotNote note) {
  if (note.report) HandleReport(c, *note.report);  // one message per save: its report is here
  RankState& rs = ranks_[c.rank];
  if (!rs.arena || note.slot >= rs.arena->slot_count()) {
    return InvalidArgument("protocol error: slot " + std::to_string(note.slot) + " does not exist");
  }
  if (replicator_.enabled()) {
    replicator_.EnqueuePush(PushTask{c.rank, note.slot, note.generation, note.step});
  }
  if (!note.persist) return Status::OK();
  rs.newest_asked = std::max(rs.newest_asked.value_or(0), note.step);
  // Already queued (e.g. adopted by this agent after a restart). Only this very snapshot counts:
  // the same step may sit in the other slot too (saved before a restart, and again after the
  // ranks resumed from an older step), and skipping this one would leak its lease.
  if (queue_.Contains(c.rank, note.slot, note.generation)) return Status::OK();
  auto done = rs.persisted_generation.find(note.step);
  if (done != rs.persisted_generation.end() &&
      done->second == std::make_pair(note.slot, note.generation)) {
    if (note.leased) rs.arena->Release(note.slot, note.generation);
    return Status::OK();
  }
  bool leased = false;
  if (note.leased) {
    // Trust the client's lease only if it still holds: an agent that started after the client
    // leased the slot cleared every lease when it adopted the arena.
    if (rs.arena->Refresh().ok()) {
      for (const SlotInfo& si : rs.arena->Slots()) {
        leased |= si.index == note.slot && si.state == SlotState::kComplete && si.leased &&
                  si.generation == note.generation && si.step == note.step;
      }
    }
  }
  PersistTask task{c.rank,
                   note.slot,
                   note.generation,
                   note.step,
                   leased,
                   FlushReason::kRequested,
                   std::move(note.skip)};
  task.attempt = c.attempt;
  Enqueue(std::move(task));
  return Status::OK();
}

// Persists the COMPLETE snapshots of the rank that are not persisted or queued yet. After a death
// every such snapshot is flushed, oldest first, so that the newest step that every rank still
// holds can be committed even when ranks died at different steps; a clean close or a shutdown
// flushes only the newest one.
void NodeAgent::EmergencyFlush(uint32_t rank, FlushReason reason) {
  if (!config_ || !store_) return;
  RankState& rs = ranks_[rank];
  if (!rs.arena || !rs.arena->Refresh().ok()) return;
  // A COMPLETE slot that is leased but not queued here carries the lease its writer took for a
  // persist it never got to request (it died between marking the slot COMPLETE and telling us).
  // Nobody else would release that lease, and with it held the rank could never save again:
  // the flush takes the lease over (and releases it when done), or releases it if there is
  // nothing to persist.
  // Of two snapshots of one step only the current one is persisted (as in Adopt).
  std::vector<SlotInfo> todo;
  const std::vector<SlotInfo> slots = rs.arena->Slots();
  for (const SlotInfo& s : slots) {
    if (s.state != SlotState::kComplete) continue;
    if (queue_.Contains(rank, s.index, s.generation)) continue;
    auto it = rs.outcomes.find(s.step);
    const bool committed =
        newest_committed_ && s.step <= *newest_committed_ && StepCommitted(s.step);
    const bool done =
        (it != rs.outcomes.end() && it->second.ok()) || committed || HasLaterCopy(slots, s);
    if (done) {
      if (s.leased) rs.arena->Release(s.index, s.generation);
      continue;
    }
    todo.push_back(s);
  }
  std::sort(todo.begin(), todo.end(), [](auto& a, auto& b) { return a.step < b.step; });
  if (reason == FlushReason::kClose || reason == FlushReason::kShutdown) {
    std::optional<SlotInfo> newest = rs.arena->NewestComplete();
    if (!newest) return;
    const bool newest_todo = !todo.empty() && todo.back().index == newest->index;
    todo.clear();
    if (newest_todo) todo.push_back(*newest);
  }
  for (const SlotInfo& s : todo) {
    if (reason != FlushReason::kClose) {
      ++rs.emergency_flushes;
      telemetry_.FlushQueued(rank, s.step, reason);
    }
    Enqueue({rank, s.index, s.generation, s.step, /*leased=*/s.leased, reason, {}});
  }
}

void NodeAgent::DropClient(size_t idx, bool died) {
  Client& c = *clients_[idx];
  if (c.hello) {
    RankState& rs = ranks_[c.rank];
    if (rs.pid == c.pid) rs.connected = false;
    if (rs.close_client == c.fd.get()) rs.close_client = -1;
    if (died && !rs.closed) {
      if (c.rank == 0) history_.Ended();
      spdlog::warn("rank {} (pid {}) is gone without closing{}", c.rank, c.pid,
                   opt_.emergency_flush ? "; emergency flush" : "");
      if (opt_.emergency_flush) EmergencyFlush(c.rank, FlushReason::kEmergency);
    }
  }
  clients_.erase(clients_.begin() + static_cast<std::ptrdiff_t>(idx));
}

}  // namespace safepoint::agent
