// Replicator (src/agent/replicator.h).
#include "agent/replicator.h"

#include <openssl/rand.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <set>

#include "agent/persist_queue.h"
#include "base/bytes.h"
#include "base/crc32c.h"
#include "base/kill_point.h"
#include "base/log.h"
#include "replica/auth.h"
#include "safepoint/image.h"
#include "shm/arena.h"

namespace safepoint::agent {

using json = nlohmann::json;
using protocol::MessageType;
using replica::Holding;
using replica::Peer;
using replica::ReplicaMeta;

namespace {

// A secret nobody knows: peers cannot connect before the job's secret arrives.
Result<std::string> RandomSecret() {
  std::string s(32, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(s.data()), static_cast<int>(s.size())) != 1) {
    return Unavailable("no random bytes from OpenSSL for a secret");
  }
  return s;
}

// Snapshots of a rank that `holdings` can rebuild, keyed by (step, attempt, complete_ns).
struct Rebuildable {
  uint64_t image_bytes = 0;
  std::vector<const Holding*> parts;
};
using SnapshotKey = std::tuple<uint64_t, uint64_t, uint64_t>;

std::map<SnapshotKey, Rebuildable> RebuildableSnapshots(const std::vector<Holding>& holdings) {
  std::map<SnapshotKey, std::vector<const Holding*>> by_key;
  for (const Holding& h : holdings) {
    by_key[{h.meta.step, h.meta.attempt, h.meta.complete_ns}].push_back(&h);
  }
  std::map<SnapshotKey, Rebuildable> out;
  for (auto& [key, parts] : by_key) {
    bool copy = false;
    std::set<uint32_t> fragments;
    uint32_t k = 0;
    for (const Holding* h : parts) {
      if (h->meta.kind == ReplicaMeta::Kind::kCopy) copy = true;
      if (h->meta.kind == ReplicaMeta::Kind::kFragment) {
        fragments.insert(h->meta.index);
        k = h->meta.k;
      }
    }
    if (copy || (k > 0 && fragments.size() >= k)) {
      out[key] = Rebuildable{parts.front()->meta.image_bytes, std::move(parts)};
    }
  }
  return out;
}

}  // namespace

Replicator::Replicator(std::string job, std::function<void()> notify)
    : job_(std::move(job)), notify_(std::move(notify)) {}

Replicator::~Replicator() { Stop(); }

Result<std::string> Replicator::Setup(const std::string& job_dir,
                                      const protocol::PeerSetupRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
  // The smallest cap any rank of the job on this node gave (ranks of one job give the same).
  if (request.max_shm_bytes > 0) {
    const uint64_t had = max_shm_bytes_.load();
    if (had == 0 || request.max_shm_bytes < had) max_shm_bytes_.store(request.max_shm_bytes);
  }
  if (service_) {
    if (request.node != node_ || request.bind_host != bind_host_) {
      return InvalidArgument("this agent already serves node '" + node_ + "' on " + bind_host_ +
                             "; a rank asked for node '" + request.node + "' on " +
                             request.bind_host + " (one agent per node and job)");
    }
    return service_->address();
  }
  // The replicas' budget (docs/operations.md, "Host memory"): with max_shm_bytes, what the job's
  // slots on this node leave of it; without, none, and no spares are kept (the default footprint
  // is the slots, the replicas, and one file while a newer one is received).
  replica::ReplicaStoreOptions store_options;
  store_options.spares_without_budget = false;
  store_options.budget = [this, job_dir]() -> std::optional<uint64_t> {
    const uint64_t cap = max_shm_bytes_.load();
    if (cap == 0) return std::nullopt;
    Result<uint64_t> slots = JobShmBytes(job_dir);
    if (!slots.ok()) return 0;  // cannot tell: the least memory
    return *slots >= cap ? 0 : cap - *slots;
  };
  SP_ASSIGN_OR_RETURN(store_, replica::ReplicaStore::Open(job_dir, std::move(store_options)));
  replica::PeerServiceOptions o;
  o.job = job_;
  o.node = request.node;
  o.bind_host = request.bind_host;
  o.timeout_s = request.timeout_ms / 1000.0;
  SP_ASSIGN_OR_RETURN(o.secret, RandomSecret());
  if (request.port > UINT16_MAX) return InvalidArgument("peer setup: port out of range");
  o.port = static_cast<uint16_t>(request.port);
  auto service = replica::PeerService::Start(o, store_.get());
  if (!service.ok() && o.port != 0) {
    // The dead agent's port is taken meanwhile: any port (peers learn it at the next
    // Checkpointer start).
    spdlog::warn(
        "peer service of node '{}': cannot listen on port {} again ({}); taking a free one",
        request.node, o.port, service.status().ToString());
    o.port = 0;
    service = replica::PeerService::Start(o, store_.get());
  }
  if (!service.ok()) {
    store_.reset();
    return service.status();
  }
  service_ = std::move(*service);
  if (note_handler_) service_->SetNoteHandler(note_handler_);
  job_dir_ = job_dir;
  node_ = request.node;
  bind_host_ = request.bind_host;
  service_->SetSnapshotSource(
      [this](uint32_t rank, uint64_t step) { return ServeSnapshot(rank, step); });
  StartWorkers();
  spdlog::info("peer service of node '{}' listens on {}", node_, service_->address());
  return service_->address();
}

Status Replicator::Configure(const Membership& note) {
  SP_ASSIGN_OR_RETURN(replica::Redundancy r, replica::ParseRedundancy(note.redundancy));
  std::string secret(note.secret_hex.size() / 2, '\0');
  if (!replica::FromHex(note.secret_hex, reinterpret_cast<uint8_t*>(secret.data()),
                        secret.size())) {
    return InvalidArgument("the job secret is not lowercase hex");
  }
  if (secret.size() < 16) return InvalidArgument("the job secret is shorter than 16 bytes");
  std::lock_guard<std::mutex> lock(mu_);
  if (!service_) return InvalidArgument("membership before peer setup");
  if (note.epoch == epoch_) return Status::OK();  // another rank of this node sent it already
  if (note.node_index >= note.nodes.size() || note.nodes[note.node_index].node != node_) {
    return InvalidArgument("membership names this agent's node '" + node_ + "' wrongly");
  }
  SP_RETURN_IF_ERROR(replica::CheckPlacement(r, static_cast<uint32_t>(note.nodes.size())));
  std::set<std::string> names;
  for (const PeerNode& n : note.nodes) {
    if (!names.insert(n.node).second) {
      return InvalidArgument("node '" + n.node + "' appears twice in the membership");
    }
  }
  service_->SetSecret(secret);
  service_->SetBandwidthLimit(static_cast<double>(note.bandwidth));
  epoch_ = note.epoch;
  node_index_ = note.node_index;
  nodes_.clear();
  for (const PeerNode& n : note.nodes) nodes_.push_back(Peer{n.node, n.address});
  redundancy_ = r;
  spdlog::info("replication {} over {} nodes (this is node {} '{}'), epoch {}", r.ToString(),
               nodes_.size(), node_index_, node_, epoch_);
  return Status::OK();
}

Replicator::MembershipView Replicator::Nodes() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!service_) return {};
  return {nodes_, node_index_};
}

std::pair<size_t, uint32_t> Replicator::NodeCountAndIndex() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!service_) return {0, 0};
  return {nodes_.size(), node_index_};
}

std::vector<Status> Replicator::Note(const std::vector<Peer>& peers, const std::string& kind,
                                     const std::string& body) {
  std::shared_lock<std::shared_mutex> use(service_use_);
  replica::PeerService* service = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    service = service_.get();
  }
  if (!service) {
    return std::vector<Status>(peers.size(), Unavailable("this node's peer service is stopped"));
  }
  return service->Note(peers, kind, body);
}

void Replicator::SetNoteHandler(replica::PeerService::NoteHandler handler) {
  std::lock_guard<std::mutex> lock(mu_);
  note_handler_ = std::move(handler);
  if (service_) service_->SetNoteHandler(note_handler_);
}

bool Replicator::enabled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return service_ && redundancy_.enabled();
}

bool Replicator::configured() const {
  std::lock_guard<std::mutex> lock(mu_);
  return service_ != nullptr;
}

void Replicator::SetPaused(bool paused) {
  std::lock_guard<std::mutex> lock(mu_);
  paused_ = paused;
  if (service_) service_->SetPaused(paused);
}

void Replicator::SetStorage(std::shared_ptr<CheckpointStore> store, uint32_t world_size) {
  std::lock_guard<std::mutex> lock(mu_);
  storage_ = std::move(store);
  world_size_ = world_size;
}

void Replicator::EnqueueFlushHeld() {
  PeerRequest r;
  r.type = MessageType::kShutdown;
  EnqueueRequest(r);
}

void Replicator::EnqueuePush(PushTask task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Only a rank's newest snapshot is worth sending: drop its older queued pushes.
    std::erase_if(pushes_, [&](const PushTask& q) { return q.rank == task.rank; });
    pushes_.push_back(task);
  }
  push_worker_.Wake();
}

void Replicator::EnqueueRequest(PeerRequest request) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    requests_.push_back(request);
  }
  request_worker_.Wake();
}

bool Replicator::Busy(uint32_t rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto same = [&](const PushTask& t) { return t.rank == rank; };
  if (push_in_flight_ && same(*push_in_flight_)) return true;
  return std::any_of(pushes_.begin(), pushes_.end(), same);
}

bool Replicator::holds_replicas() const {
  std::lock_guard<std::mutex> lock(mu_);
  return store_ && store_->bytes() > 0;
}

void Replicator::ReleaseSparesWhenMemoryIsLow() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!store_) return;
  struct statvfs st;
  if (::statvfs(job_dir_.c_str(), &st) != 0) return;
  const uint64_t total = static_cast<uint64_t>(st.f_blocks) * st.f_frsize;
  const uint64_t free = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  if (free * 4 >= total) return;
  const uint64_t freed = store_->ReleaseSpares();
  if (freed > 0) {
    spdlog::info("shared memory is low ({} of {} free): released {} of spare replica files",
                 internal::HumanBytes(free), internal::HumanBytes(total),
                 internal::HumanBytes(freed));
  }
}

void Replicator::RemoveReplicas() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!store_) return;
  auto list = store_->List();
  if (!list.ok()) return;
  std::set<std::string> sources;
  for (const ReplicaMeta& m : *list) sources.insert(m.source_node);
  for (const std::string& source : sources) store_->RemoveSource(source).IgnoreError();
}

std::vector<PushOutcome> Replicator::TakeOutcomes() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PushOutcome> out;
  out.swap(outcomes_);
  return out;
}

std::vector<PeerAnswer> Replicator::TakeAnswers() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerAnswer> out;
  out.swap(answers_);
  return out;
}

void Replicator::Stop() {
  // Both stop before either is joined: no request runs while the push worker is joined.
  push_worker_.RequestStop();
  request_worker_.RequestStop();
  push_worker_.Join();
  request_worker_.Join();
  // No push leaves or lands from here on (RemoveReplicas may follow), and UCX is not torn down:
  // the service is retired, and RunAgent ends the process with _exit (PeerService::Retire). A
  // note being sent (the commit relay's) ends first.
  std::unique_lock<std::shared_mutex> use(service_use_);
  std::unique_ptr<replica::PeerService> service;
  {
    std::lock_guard<std::mutex> lock(mu_);
    service = std::move(service_);
  }
  if (service) {
    service->SetNoteHandler(nullptr);
    service->SetSnapshotSource(nullptr);
  }
  replica::PeerService::Retire(std::move(service));
}

std::vector<Peer> Replicator::OtherPeersLocked() const {
  std::vector<Peer> out;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (i != node_index_) out.push_back(nodes_[i]);
  }
  return out;
}

void Replicator::StartWorkers() {
  push_worker_.Start({.take = [this] { return PushLoop::TakeFront(pushes_, &push_in_flight_); },
                      .run = [this](PushTask& t) { RunPush(t); }});
  request_worker_.Start({.take = [this] { return RequestLoop::TakeFront(requests_); },
                         .run = [this](PeerRequest& r) { RunRequest(r); }});
}

void Replicator::RunPush(const PushTask& t) {
  PushOutcome o = Push(t);
  {
    std::lock_guard<std::mutex> lock(mu_);
    push_in_flight_.reset();
    if (o.superseded) {
      ++pushes_superseded_;
    } else if (o.status.ok()) {
      ++pushes_ok_;
    } else {
      ++pushes_failed_;
    }
    if (!o.superseded) {
      last_push_[t.rank] = o;
    } else if (max_shm_bytes_.load() > 0) {
      // Under a budget the receivers may have given up their previous replica of the rank for
      // this push (received in place), which the next save cut short: nothing protects it now.
      auto last = last_push_.find(t.rank);
      if (last != last_push_.end()) last->second.is_protected = false;
    }
    outcomes_.push_back(std::move(o));
  }
  notify_();
}

void Replicator::RunRequest(const PeerRequest& r) {
  if (r.type == MessageType::kShutdown) {
    FlushHeld();
    return;
  }
  PeerAnswer a = r.type != MessageType::kPeerFetch ? List(r) : r.origin ? HealFetch(r) : Fetch(r);
  a.client_fd = r.client_fd;
  a.client_pid = r.client_pid;
  {
    std::lock_guard<std::mutex> lock(mu_);
    answers_.push_back(std::move(a));
  }
  notify_();
}

PushOutcome Replicator::Push(const PushTask& t) {
  PushOutcome o;
  o.task = t;
  replica::Redundancy r;
  std::vector<Peer> targets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    r = redundancy_;
    for (uint32_t i : replica::PlacementTargets(r, node_index_, nodes_.size())) {
      targets.push_back(nodes_[i]);
    }
  }
  auto arena = Arena::Open(job_dir_, t.rank);
  if (!arena.ok()) {
    o.status = arena.status();
    return o;
  }
  const auto slots = (*arena)->Slots();
  if (t.slot >= slots.size() || slots[t.slot].state != SlotState::kComplete ||
      slots[t.slot].generation != t.generation || slots[t.slot].step != t.step) {
    o.superseded = true;
    return o;
  }
  const SlotInfo s = slots[t.slot];
  const std::span<const std::byte> image = (*arena)->SlotData(t.slot).subspan(0, s.image_size);
  const std::string source = "rank " + std::to_string(t.rank) + " step " + std::to_string(t.step);
  auto header = ParseImageHeader(image, source);
  if (!header.ok()) {
    o.status = header.status();
    return o;
  }
  // The checksums the client recorded for the image's chunks as it took the snapshot: a mirror
  // push sends them (whole chunks of the data they cover) instead of computing them again.
  const ImageLayout& layout = header->second;
  std::vector<uint32_t> recorded;
  if (layout.checksums_offset <= image.size() &&
      layout.checksums_size <= image.size() - layout.checksums_offset) {
    auto crcs = ParseChecksumSection(image.subspan(layout.checksums_offset), layout, source);
    if (!crcs.ok()) {
      o.status = crcs.status();
      return o;
    }
    recorded = std::move(*crcs);
    recorded.resize(std::min<size_t>(recorded.size(), layout.checksums_offset / layout.chunk_size));
  }
  Arena* a = arena->get();
  auto still_valid = [a, &t] {
    const auto now = a->Slots();
    return t.slot < now.size() && now[t.slot].state == SlotState::kComplete &&
           now[t.slot].generation == t.generation;
  };
  replica::SnapshotId id{t.rank, t.step, static_cast<uint64_t>(s.complete_time_ns),
                         header->first.attempt};
  auto pushed = service_->Push(id, image, r, targets, still_valid,
                               replica::RecordedCrcs{layout.chunk_size, recorded});
  if (!pushed.ok()) {
    o.superseded = pushed.status().code() == StatusCode::kCancelled && !still_valid();
    o.status = pushed.status();
    return o;
  }
  o.bytes = pushed->bytes_sent;
  o.seconds = pushed->seconds;
  o.paused_seconds = pushed->paused_seconds;
  uint32_t ok = 0;
  for (size_t i = 0; i < targets.size() && i < pushed->targets.size(); ++i) {
    o.targets.emplace_back(targets[i].node, pushed->targets[i]);
    if (pushed->targets[i].ok()) ++ok;
  }
  // Losses the snapshot survives now: mirror, one per copy held; ec, the fragments beyond K.
  const uint32_t survives =
      r.kind == replica::Redundancy::Kind::kErasure ? (ok >= r.k ? ok - r.k : 0) : ok;
  o.is_protected = ok == targets.size() && survives >= r.tolerated_losses();
  if (ok < targets.size()) {
    for (const auto& [node, st] : o.targets) {
      if (!st.ok()) {
        o.status = st.WithContext("replicating " + source + " to node '" + node + "'");
        break;
      }
    }
  }
  return o;
}

PeerAnswer Replicator::List(const PeerRequest& r) {
  PeerAnswer a;
  a.reply_type = MessageType::kPeerListReply;
  std::vector<Peer> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers = OtherPeersLocked();
  }
  protocol::PeerListReply reply;
  if (!peers.empty()) {
    std::vector<Status> errors;
    const std::vector<Holding> holdings = service_->List(peers, r.rank, &errors);
    for (const Status& e : errors) {
      if (!e.ok()) spdlog::warn("listing peer replicas: {}", e.message());
    }
    for (const auto& [key, rb] : RebuildableSnapshots(holdings)) {
      const auto& [step, attempt, complete_ns] = key;
      reply.snapshots.push_back(PeerCopy{step, attempt, complete_ns, rb.image_bytes});
    }
  }
  a.payload = Encode(reply);
  return a;
}

PeerAnswer Replicator::Fetch(const PeerRequest& r) {
  PeerAnswer a;
  a.reply_type = MessageType::kPeerFetchReply;
  protocol::PeerFetchReply reply;
  const auto t0 = std::chrono::steady_clock::now();
  auto fail = [&](Status s) {
    reply.status = std::move(s);
    a.payload = Encode(reply);
    spdlog::warn("rank {} step {}: rebuilding from peers failed: {}", r.rank, r.step,
                 reply.status.message());
    return a;
  };
  std::vector<Peer> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers = OtherPeersLocked();
  }
  if (peers.empty()) return fail(NotFound("no peers are known (replication is not configured)"));
  std::vector<Status> errors;
  const std::vector<Holding> holdings = service_->List(peers, r.rank, &errors);
  // The newest rebuildable snapshot of that step and attempt.
  const auto all = RebuildableSnapshots(holdings);
  const Rebuildable* best = nullptr;
  uint64_t best_ns = 0;
  for (const auto& [key, rb] : all) {
    const auto& [step, attempt, complete_ns] = key;
    if (step == r.step && attempt == r.attempt && (!best || complete_ns > best_ns)) {
      best = &rb;
      best_ns = complete_ns;
    }
  }
  if (!best) {
    return fail(NotFound("no peer holds a rebuildable copy of rank " + std::to_string(r.rank) +
                         " step " + std::to_string(r.step)));
  }
  std::vector<Holding> parts;
  std::set<std::string> from;
  for (const Holding* h : best->parts) {
    parts.push_back(*h);
    from.insert(h->holder.node);
  }
  auto arena = Arena::Open(job_dir_, r.rank);
  if (!arena.ok()) return fail(arena.status());
  auto begun = (*arena)->BeginWrite(best->image_bytes);
  if (!begun.ok()) return fail(begun.status());
  if (begun->first != Arena::Acquire::kAcquired) {
    return fail(Unavailable("no slot of rank " + std::to_string(r.rank) + " is free"));
  }
  const SlotWriteTicket ticket = begun->second;
  const replica::SnapshotId id{r.rank, r.step, best_ns, r.attempt};
  std::span<std::byte> image = ticket.data.subspan(0, best->image_bytes);
  Status s = service_->FetchImage(parts, id, image);
  if (s.ok()) {
    // The bytes passed their CRCs; they must also be this rank's image of this step.
    auto header = ParseImageHeader(image, "rank " + std::to_string(r.rank) + " from peers");
    if (!header.ok()) {
      s = header.status();
    } else if (header->first.rank != r.rank || header->first.step != r.step ||
               header->first.attempt != r.attempt) {
      s = Corruption("the image rebuilt from peers is not rank " + std::to_string(r.rank) +
                     "'s image of step " + std::to_string(r.step));
    }
  }
  if (!s.ok()) {
    (*arena)->AbortWrite(ticket);
    return fail(s);
  }
  SP_KILL_POINT("replica.rebuild.before_finish");
  (*arena)->FinishWrite(ticket, r.step, best->image_bytes);
  reply.slot = ticket.slot;
  reply.generation = ticket.generation;
  reply.bytes = best->image_bytes;
  for (const std::string& n : from) reply.source += (reply.source.empty() ? "" : ",") + n;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  spdlog::info("rank {} step {}: rebuilt {} bytes from peers {} in {:.3f} s", r.rank, r.step,
               reply.bytes, reply.source, seconds);
  a.payload = Encode(reply);
  return a;
}

void Replicator::FlushHeld() {
  std::vector<Peer> peers;
  std::shared_ptr<CheckpointStore> storage;
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers = OtherPeersLocked();
    storage = storage_;
  }
  if (!storage || !store_ || !service_) return;
  auto held = store_->List();
  if (!held.ok() || held->empty()) return;
  // The newest snapshot of each (source node, rank) this node keeps a part of.
  std::map<std::pair<std::string, uint32_t>, ReplicaMeta> newest;
  for (const ReplicaMeta& m : *held) {
    auto [it, fresh] = newest.try_emplace({m.source_node, m.rank}, m);
    if (!fresh &&
        std::tie(m.step, m.complete_ns) > std::tie(it->second.step, it->second.complete_ns)) {
      it->second = m;
    }
  }
  const Peer self{node_, service_->address()};
  for (const auto& [key, m] : newest) {
    if (storage->ReadCommit(m.step).ok()) continue;  // committed: nothing to help with
    // Every live holder's parts of this snapshot, this node's included.
    std::vector<Holding> parts;
    for (const ReplicaMeta& own : *held) {
      if (own.source_node == m.source_node && own.rank == m.rank && own.step == m.step &&
          own.complete_ns == m.complete_ns) {
        parts.push_back(Holding{self, own});
      }
    }
    for (Holding& h : service_->List(peers, m.rank)) {
      if (h.meta.source_node == m.source_node && h.meta.step == m.step &&
          h.meta.complete_ns == m.complete_ns) {
        parts.push_back(std::move(h));
      }
    }
    // One writer: the first holder of a copy by node name, else the first of a fragment.
    const Holding* elected = nullptr;
    for (const Holding& h : parts) {
      const bool copy = h.meta.kind == ReplicaMeta::Kind::kCopy;
      const bool elected_copy = elected && elected->meta.kind == ReplicaMeta::Kind::kCopy;
      if (!elected || (copy && !elected_copy) ||
          (copy == elected_copy && h.holder.node < elected->holder.node)) {
        elected = &h;
      }
    }
    if (!elected || elected->holder.node != node_) continue;
    Status s = FlushOne(m, parts);
    std::lock_guard<std::mutex> lock(mu_);
    if (s.ok()) {
      ++held_flushed_;
    } else {
      ++held_flush_failed_;
      spdlog::warn("persisting node '{}' rank {} step {} from its replica failed: {}",
                   m.source_node, m.rank, m.step, s.message());
    }
  }
}

Status Replicator::FlushOne(const ReplicaMeta& m, const std::vector<Holding>& parts) {
  std::shared_ptr<CheckpointStore> storage;
  uint32_t world = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    storage = storage_;
    world = world_size_;
  }
  // A whole, verified image: this node's copy, else rebuilt from fragments.
  std::vector<std::byte> rebuilt;
  std::span<const std::byte> image;
  replica::ReplicaView view;
  if (m.kind == ReplicaMeta::Kind::kCopy) {
    SP_ASSIGN_OR_RETURN(view, store_->Read(m));
    image = view.payload;
  } else {
    rebuilt.resize(m.image_bytes);
    SP_RETURN_IF_ERROR(service_->FetchImage(
        parts, replica::SnapshotId{m.rank, m.step, m.complete_ns, m.attempt}, rebuilt));
    image = rebuilt;
  }
  if (internal::Crc32c(image) != m.image_crc) {
    return Corruption("the replica's image does not match its CRC32C");
  }
  SP_ASSIGN_OR_RETURN(auto header,
                      ParseImageHeader(image, "replica of rank " + std::to_string(m.rank)));
  if (header.first.rank != m.rank || header.first.step != m.step ||
      header.first.world_size != world) {
    return Corruption("the replica's image header does not match its rank, step or world size");
  }
  SP_KILL_POINT("replica.flush.before_write");
  // Stored already (its node persisted it before it was lost): only the commit is left to try.
  SP_ASSIGN_OR_RETURN(bool stored,
                      storage->HoldsImageOfAttempt(m.step, m.rank, header.first.attempt));
  // Named by its attempt and published only where the name is free: the lost node's agent (if
  // it still runs) or another holder may have published it since the check, and a commit may
  // have counted theirs (AlreadyExists: only the commit is left to try).
  WriteStats written;
  if (!stored) {
    auto w = storage->WriteImageBytesOfAttempt(image, m.step, m.rank, PackOptions{});
    if (w.ok()) {
      written = *w;
    } else if (w.status().code() != StatusCode::kAlreadyExists) {
      return w.status();
    }
  }
  SP_KILL_POINT("replica.flush.before_commit");
  SP_ASSIGN_OR_RETURN(bool committed,
                      storage->TryCommitOfAttempt(m.step, world, job_, header.first.attempt));
  spdlog::info("persisted node '{}' rank {} step {} from its replica ({} bytes{})", m.source_node,
               m.rank, m.step, written.bytes, committed ? "; the step is committed" : "");
  return Status::OK();
}

json Replicator::StatusJson() const {
  std::lock_guard<std::mutex> lock(mu_);
  json j;
  j["redundancy"] = redundancy_.ToString();
  j["node"] = node_;
  j["address"] = service_ ? service_->address() : "";
  j["epoch"] = epoch_;
  j["node_index"] = node_index_;
  json nodes = json::array();
  for (const Peer& p : nodes_) nodes.push_back({{"node", p.node}, {"address", p.address}});
  j["nodes"] = nodes;
  j["tolerates_node_losses"] = redundancy_.tolerated_losses();
  j["paused"] = paused_;
  j["queued"] = pushes_.size();
  j["in_flight"] = push_in_flight_
                       ? json{{"rank", push_in_flight_->rank}, {"step", push_in_flight_->step}}
                       : json(nullptr);
  j["pushes_ok"] = pushes_ok_;
  j["pushes_failed"] = pushes_failed_;
  j["pushes_superseded"] = pushes_superseded_;
  j["held_flushed"] = held_flushed_;
  j["held_flush_failed"] = held_flush_failed_;
  json ranks = json::array();
  for (const auto& [rank, o] : last_push_) {
    json targets = json::array();
    for (const auto& [node, st] : o.targets) {
      json t = {{"node", node}, {"ok", st.ok()}};
      if (!st.ok()) t["error"] = st.message();
      targets.push_back(t);
    }
    json e = {{"rank", rank},
              {"step", o.task.step},
              {"protected", o.is_protected},
              {"targets", targets},
              {"bytes", o.bytes},
              {"seconds", o.seconds},
              {"paused_seconds", o.paused_seconds}};
    if (!o.status.ok()) e["error"] = o.status.message();
    ranks.push_back(e);
  }
  j["ranks"] = ranks;
  if (store_) {
    json held = json::array();
    auto list = store_->List();
    if (list.ok()) {
      for (const ReplicaMeta& m : *list) {
        held.push_back({{"source_node", m.source_node},
                        {"rank", m.rank},
                        {"step", m.step},
                        {"kind", m.kind == ReplicaMeta::Kind::kCopy ? "copy" : "fragment"},
                        {"index", m.index},
                        {"bytes", m.payload_bytes}});
      }
    }
    j["held"] = held;
    j["held_bytes"] = store_->bytes();
    j["spare_bytes"] = store_->spare_bytes();
    j["received_in_place"] = store_->received_in_place();
  }
  if (service_) {
    const replica::PeerServiceStats st = service_->stats();
    j["service"] = {{"replicas_received", st.replicas_received},
                    {"bytes_received", st.bytes_received},
                    {"pushes", st.pushes},
                    {"bytes_sent", st.bytes_sent},
                    {"peers_rejected", st.peers_rejected},
                    {"transfers_failed", st.transfers_failed}};
  }
  return j;
}

}  // namespace safepoint::agent
