// SnapshotClient's saves (include/safepoint/client.h): a snapshot laid out and copied into a
// free slot of the rank's arena (whole, or streamed tensor by tensor), the shared-memory cap, the
// copy-skip ranges of replicas other ranks write.
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

using Clock = std::chrono::steady_clock;
using protocol::MessageType;

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
      result->wait_seconds = SecondsSince(t_wait);
      return false;  // every slot that could be overwritten is still being persisted
    }
    // The agent holds the slot while it persists it. If it died, a new one clears its leases.
    if (spins % 500 == 499 && !protocol::AgentAlive(job_dir_)) {
      Disconnect();
      SP_RETURN_IF_ERROR(EnsureAgent());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(spins < 100 ? 1 : 2));
  }
  result->wait_seconds = SecondsSince(t_wait);
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
  result.copy_seconds = SecondsSince(t_copy);
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
    result_.copy_seconds = SecondsSince(t0_);
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

}  // namespace safepoint
