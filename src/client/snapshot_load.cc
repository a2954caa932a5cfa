// SnapshotClient's loads from shared memory (include/safepoint/client.h): the newest or a given
// step's slot found and checked, its image read into new tensors or in place into the caller's
// (whole, or streamed as addresses arrive), and the tensors left to other ranks filled from
// their slots; and another job's snapshot on this node (ReadNodeSnapshot).
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
#include "base/log.h"
#include "base/parallel.h"
#include "base/unique_fd.h"
#include "protocol/protocol.h"
#include "safepoint/client.h"
#include "shm/arena.h"

namespace safepoint {

using Clock = std::chrono::steady_clock;
using protocol::MessageType;

namespace {
// The COMPLETE snapshot of `step` among `slots` that completed last: two slots may hold the step
// (saved again after the ranks resumed from an older one), and the later is the current run's.
std::optional<SlotInfo> CompleteSlotOf(const std::vector<SlotInfo>& slots, uint64_t step) {
  std::optional<SlotInfo> found;
  for (const SlotInfo& s : slots) {
    if (s.state == SlotState::kComplete && s.step == step &&
        (!found || s.complete_time_ns > found->complete_time_ns)) {
      found = s;
    }
  }
  return found;
}

// Names rank's slot in a job directory, for errors and a load's source.
std::string SlotName(const std::string& job_dir, uint32_t rank, const SlotInfo& slot) {
  return job_dir + "/rank-" + std::to_string(rank) + ".slot-" + std::to_string(slot.index) +
         " (step " + std::to_string(slot.step) + ")";
}

// A private, verified copy of the image of `slot` in `arena` (`src`: its bytes), parsed: the copy
// is what is verified and handed out, so the slot must still hold the same snapshot after it.
// The copy's pages are faulted in by the copying threads as they write them (populating them
// first in one call took 0.065 s of a 0.105 s read of 256 MiB, against 0.09 s for the read that
// faults them in). `huge_pages`: a process that loads again and again (a hot reload) gains from
// them, 0.16 s against 0.30 s a 1 GiB load once warm; a process that reads once (a torchft heal
// into a restarted replica) does not: on a guest whose free memory goes back to the hypervisor,
// a fresh huge page is often one it took back, and 256 MiB heals into fresh processes took
// 0.14-0.42 s into huge pages against 0.15-0.20 s into small ones.
Result<MemorySnapshot> CopySlotImage(Arena& arena, const SlotInfo& slot,
                                     std::span<const std::byte> src, const std::string& source,
                                     bool huge_pages) {
  const size_t size = slot.image_size;
  auto owner = std::make_shared<internal::AlignedBuffer>(size, huge_pages);
  if (!owner->ok()) {
    return ResourceExhausted(source + ": cannot allocate " + std::to_string(size) + " bytes");
  }
  std::byte* raw = owner->data();
  SP_RETURN_IF_ERROR(
      CopyVerifiedImage(src.subspan(0, size), {raw, size}, source, internal::DefaultCpuThreads()));
  for (const SlotInfo& s : arena.Slots()) {
    if (s.index == slot.index &&
        (s.generation != slot.generation || s.state != SlotState::kComplete)) {
      return Corruption(source + ": the snapshot changed while it was read");
    }
  }
  SP_ASSIGN_OR_RETURN(ImageReader reader,
                      ImageReader::Parse({raw, size}, source, ImageReader::Verify::kStructure));
  return MemorySnapshot{LoadedImage{std::shared_ptr<std::byte>(owner, raw), size, source},
                        std::move(reader), Value{}, slot.step};
}
}  // namespace

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
  if (std::optional<SlotInfo> found = CompleteSlotOf(arena_->Slots(), *step)) return *found;
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
  return SlotName(job_dir_, opt_.rank, slot);
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
  const std::string source = SlotSource(slot);
  SP_ASSIGN_OR_RETURN(MemorySnapshot out,
                      CopySlotImage(*arena_, slot, arena_->SlotData(slot.index), source,
                                    /*huge_pages=*/true));
  SP_RETURN_IF_ERROR(CheckSnapshotIdentity(out.reader, slot, source));
  SP_ASSIGN_OR_RETURN(out.extras,
                      DecodeExtras(out.reader.extras(), out.reader.tensors().size(), source));
  NoteResumedFrom(slot);
  return out;
}

Result<MemorySnapshot> ReadNodeSnapshot(const std::string& shm_dir, const std::string& job,
                                        uint32_t rank, uint64_t step, double wait_s) {
  SP_RETURN_IF_ERROR(ValidateJobName(job));
  const std::string what = "rank " + std::to_string(rank) + "'s snapshot of step " +
                           std::to_string(step) + " of job " + job + " on this node";
  // A job directory this process cannot open (another user's: the name would be the sender's
  // uid's) is memory it cannot read: Unavailable, for the caller to fetch over the network.
  Result<std::string> dir = JobDirectory(shm_dir, job, /*create=*/false);
  Result<std::unique_ptr<Arena>> opened =
      dir.ok() ? Arena::Open(*dir, rank) : Result<std::unique_ptr<Arena>>(dir.status());
  if (!opened.ok()) return Unavailable(what + ": " + opened.status().message());
  std::unique_ptr<Arena>& arena = *opened;
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(std::clamp(wait_s, 0.0, 86400.0)));
  // A look is a few loads from mapped control blocks (and a stat of each slot file): every
  // millisecond for the first second (a heal is asked for while the sender copies, and found
  // when its copy completes), then less often.
  const auto start = Clock::now();
  auto delay = std::chrono::milliseconds(1);
  while (true) {
    SP_RETURN_IF_ERROR(arena->Refresh());  // slot files the job's writer created since
    const std::optional<SlotInfo> s = CompleteSlotOf(arena->Slots(), step);
    if (s && s->image_size >= kImageHeaderSize) {
      const std::string source = SlotName(*dir, rank, *s);
      SP_ASSIGN_OR_RETURN(
          MemorySnapshot out,
          CopySlotImage(*arena, *s, arena->SlotDataForRead(s->index, s->image_size), source,
                        /*huge_pages=*/false));
      const ImageMeta& m = out.reader.meta();
      if (m.job != job || m.rank != rank || m.step != step) {
        return Corruption(source + ": the image in the slot is job " + m.job + "'s step " +
                          std::to_string(m.step) + " of rank " + std::to_string(m.rank));
      }
      SP_ASSIGN_OR_RETURN(out.extras,
                          DecodeExtras(out.reader.extras(), out.reader.tensors().size(), source));
      return out;
    }
    if (Clock::now() + delay > deadline) {
      return NotFound(fmt::format("{}: not taken within {:g} s", what, wait_s));
    }
    std::this_thread::sleep_for(delay);
    if (Clock::now() - start > std::chrono::seconds(1)) {
      delay = std::min(delay * 2, std::chrono::milliseconds(20));
    }
  }
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
  const std::optional<SlotInfo> found = CompleteSlotOf(arena->Slots(), step);
  if (!found || found->image_size < kImageHeaderSize) return NotFound("no snapshot of the step");
  const std::string source = SlotName(job_dir_, rank, *found);
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

}  // namespace safepoint
