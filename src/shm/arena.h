// Arenas: snapshot slots in host shared memory (docs/architecture.md, "Snapshots").
//
// Each job has a directory "<shm_dir>/safepoint-<uid>-<job>" (0700, owned by the user, never a
// symlink). Each rank has `slots` slot files "rank-<R>.slot-<i>" (0600, created exclusively under
// a temporary name and renamed into place). A slot file is a 4 KiB control block followed by the
// slot's capacity: exactly the bytes of one image (docs/format.md), so persisting is one stream of
// aligned writes straight from shared memory.
//
// The control block's state word is the only synchronisation between the training process (the
// writer of its rank's slots) and the agent (which leases COMPLETE slots while it persists them):
//   FREE -> WRITING (writer, CAS) -> COMPLETE (writer, release store) -> WRITING (writer, CAS,
//   only if not leased) ...; COMPLETE <-> COMPLETE+leased (agent, CAS with the generation).
// A slot being written is never read; a leased slot is never overwritten; a writer killed mid-copy
// leaves a WRITING slot that is never read and is reused by the next writer of that rank.
// While a slot is written, the snapshot that became current last is kept: the one completed
// last, or the one the run resumed from (MarkResumed). Completion times are strictly increasing
// within an arena, whatever the wall clock does.
//
// A rank's writer is the process its rank's claim names (src/shm/rank_claim.h): a writer holds
// the claim epoch its hello was answered with, and begins (BeginWrite) and completes (FinishWrite)
// a write only while the claim is still at that epoch, each checked with a sequentially
// consistent load after the state word's CAS. The agent, after it moved the epoch on (a newer
// run's process took the rank over from a superseded one that still runs), removes every slot
// file that is WRITING (RemoveWritingSlots): either the superseded writer checked the epoch
// before the takeover, and then its CAS came before the agent's look at the word, which sees
// WRITING and removes the file (what it completes lands in a file nobody maps again), or it
// checks after and gives the slot back without writing a byte. So no snapshot completed after a
// takeover is ever visible, and the two processes never write one slot file.
//
// Thread safety: one writer process per rank (checked through the writer's pid and start time,
// which the control block records); any number of readers. Slot files are created pre-faulted
// with their space reserved, so writing never faults in fresh pages on the save path and a full
// /dev/shm is an error, never a SIGBUS.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "safepoint/status.h"

namespace safepoint {

namespace internal {
struct ProcessId;  // src/base/process.h
}  // namespace internal

inline constexpr uint32_t kDefaultSlots = 2;
// A slot file is a control block of this size followed by the image (docs/format.md).
inline constexpr uint64_t kSlotHeaderBytes = 4096;

enum class SlotState : uint8_t { kFree = 0, kWriting = 1, kComplete = 2 };
std::string_view SlotStateName(SlotState s);

// A snapshot of a slot's control block.
struct SlotInfo {
  uint32_t index = 0;
  SlotState state = SlotState::kFree;
  bool leased = false;
  uint64_t generation = 0;
  uint64_t step = 0;
  uint64_t image_size = 0;
  uint64_t capacity = 0;
  int64_t complete_time_ns = 0;
  // The process that last took the slot for writing (it keeps the slot mapped and writes it
  // again at its next save): pid and start time in clock ticks since boot (0: unknown).
  uint32_t writer_pid = 0;
  uint64_t writer_start_ticks = 0;
};

// The job directory for `job` under `shm_dir`, created (0700) when `create`. Fails when it exists
// but is a symlink, not a directory, owned by another user or accessible to others.
Result<std::string> JobDirectory(const std::string& shm_dir, const std::string& job, bool create);
// Job directories of this user under `shm_dir`: (job, path) pairs.
Result<std::vector<std::pair<std::string, std::string>>> ListJobDirectories(
    const std::string& shm_dir);
// Entries of `shm_dir` named as this user's job directories (safepoint-<euid>-<job>) that
// JobDirectory refuses: another user's directory (a local user who created the name first), a
// symlink, a file, or a directory open to others. Each blocks its job's agent until removed;
// `safepoint gc` reports them and leaves them alone. `problem` is JobDirectory's error: the
// owner, the path and the command that clears it.
struct BlockedJobEntry {
  std::string job;
  std::string path;
  uint32_t owner_uid = 0;
  std::string kind;  // "directory", "symlink", "file" or "other"
  std::string problem;
};
Result<std::vector<BlockedJobEntry>> ListBlockedJobEntries(const std::string& shm_dir);
// Ranks that have slot files in a job directory, ascending.
Result<std::vector<uint32_t>> ListArenaRanks(const std::string& job_dir);
// Processes that wrote snapshot slots of the job, or are creating a slot file, and still run (pid
// and start time compared, so a recycled pid does not count), ascending, each once. While one runs,
// the job is live even without an agent: the process keeps its slots mapped, saves into them again
// and starts a new agent at its next call.
Result<std::vector<uint32_t>> LiveSlotWriters(const std::string& job_dir);
// Slot files whose creator died before renaming them into place (their temporary names record
// the creator's pid and start time): removed, or with `dry_run` only counted. A temporary of a
// creator that still runs, or of a name that records none, is kept. Safe beside live writers,
// agents and other gcs.
struct SlotTemporariesRemoved {
  uint64_t files = 0;
  uint64_t bytes = 0;  // allocated
};
Result<SlotTemporariesRemoved> RemoveDeadSlotTemporaries(const std::string& job_dir,
                                                         bool dry_run = false);
// Removes a job directory and everything safepoint put in it (slot files, the agent's socket,
// lock, log and job.json); returns the bytes freed. Refuses a job with live slot writers and a
// directory with files it does not know (InvalidArgument). The caller checks that no agent runs.
Result<uint64_t> RemoveJobDirectory(const std::string& job_dir);
// Whether another COMPLETE slot in `slots` holds the same step as `s` and became current later
// (a rank saved the step again after resuming from an older one): loads, the restore agreement
// and persists take that other snapshot, never `s`.
bool HasLaterCopy(const std::vector<SlotInfo>& slots, const SlotInfo& s);
// Shared memory the slot files of a job directory take (allocated pages, every rank's; with
// `except_rank`, every rank's but that one's).
Result<uint64_t> JobShmBytes(const std::string& job_dir,
                             std::optional<uint32_t> except_rank = std::nullopt);
// The size of the slot file (control block and capacity) a slot laid out for images of
// `image_size` bytes gets.
uint64_t SlotFileBytes(uint64_t image_size);
// Whether a slot of `capacity` bytes is kept for an image of `image_size` bytes: it holds the
// image and takes at most twice what a slot laid out for it would. A larger one is laid out
// again at its next write, so that a state that shrank (a data-parallel rank that copies only
// its share of the replicated tensors after its first save) gives the memory back.
bool SlotKeptFor(uint64_t capacity, uint64_t image_size);
// Maps the pages of `bytes` (of a slot mapping) into this process's page tables in one call
// (MADV_POPULATE_READ) before they are read, instead of one fault per page: a hot reload reads
// slots that a new process (or another rank's slots that this one) never touched. Best effort:
// nothing on a kernel without it (before Linux 5.14).
void PopulateForRead(std::span<const std::byte> bytes);
// The same for pages about to be written (MADV_POPULATE_WRITE): a slot an agent receives an
// image into (a heal), one fault per page otherwise.
void PopulateForWrite(std::span<std::byte> bytes);
// Validates a job name: [A-Za-z0-9._-]{1,64}.
Status ValidateJobName(const std::string& job);

class SlotFile;   // a mapped slot file (src/shm/arena.cc)
class RankClaim;  // who owns the rank's slots (src/shm/rank_claim.h)

// A slot taken for writing (Arena::BeginWrite), until FinishWrite or AbortWrite.
struct SlotWriteTicket {
  uint32_t slot = 0;
  uint64_t generation = 0;
  std::span<std::byte> data;  // image_size bytes of the slot
  bool relaid_out = false;    // the slot file was (re)created for this size
  double create_seconds = 0;  // time spent creating and pre-faulting it
};

// One rank's slots.
class Arena {
 public:
  ~Arena();
  // Opens rank's arena in `job_dir`, mapping the slot files that exist. Creates none.
  static Result<std::unique_ptr<Arena>> Open(const std::string& job_dir, uint32_t rank,
                                             uint32_t slots = kDefaultSlots);

  uint32_t rank() const { return rank_; }
  uint32_t slot_count() const { return static_cast<uint32_t>(slots_.size()); }
  // The slots this writer saves into: the first `n` (1..slot_count()). With one (a host-memory
  // budget below two snapshots, ClientOptions::max_shm_bytes), the next save overwrites the
  // rank's only snapshot once nobody leases it (the agent persisted it): while that copy runs,
  // no snapshot of the rank is in memory and a restart reads the newest persisted step.
  void set_usable_slots(uint32_t n);
  uint32_t usable_slots() const { return usable_slots_; }
  // Removes the slot files past usable_slots() that nobody leases or writes (call it after a
  // FinishWrite: their snapshots are older than the one just completed); returns the bytes of
  // shared memory freed (once every process that maps them refreshed).
  uint64_t DropUnusableSlots();
  const std::string& job_dir() const { return job_dir_; }

  // Control blocks of the slots (a slot file that does not exist reads as FREE, capacity 0).
  std::vector<SlotInfo> Slots() const;
  // Re-maps slot files that another process created or replaced since, and the rank's claim.
  Status Refresh();
  // The bytes of a slot's image area (capacity bytes), valid until the slot is replaced.
  std::span<std::byte> SlotData(uint32_t slot);
  // The first `size` bytes of it (at most its capacity) to be read now: in this process's page
  // tables (PopulateForRead) the first time this mapping of the slot file is read that far.
  // A hot reload in the process that saved, or the next one of a restarted process, skips the
  // populate call (1.4 ms for 127 MiB even when every page is mapped already).
  std::span<std::byte> SlotDataForRead(uint32_t slot, uint64_t size);
  // Bytes of shared memory the mapped slot files take.
  uint64_t mapped_bytes() const;

  // --- writer side (the training process of this rank) ----------------------------------------
  enum class Acquire { kAcquired, kBusy };
  // Takes a slot that may be overwritten (never a leased one, and never the newest COMPLETE one
  // unless usable_slots() is 1) and marks it WRITING. Grows the slot file when it is smaller than
  // image_size (checking the free space first: ResourceExhausted with the bytes needed and free).
  // kBusy when no slot may be overwritten right now (the agent still reads it).
  Result<std::pair<Acquire, SlotWriteTicket>> BeginWrite(uint64_t image_size);
  // Marks the slot COMPLETE with the step; its bytes must be a whole, checksummed image.
  // `leased`: hand it over leased, for the agent to persist (it releases the lease when done).
  // False when this writer was superseded meanwhile (CheckClaim says by whom): the slot is given
  // back FREE, and nothing of the write is ever read.
  bool FinishWrite(const SlotWriteTicket& ticket, uint64_t step, uint64_t image_size,
                   bool leased = false);
  // Marks a slot FREE again after a failed write (only while it is still this ticket's).
  void AbortWrite(const SlotWriteTicket& ticket);
  // The run resumes from this COMPLETE snapshot (the writer loaded it before saving anything):
  // it becomes the newest, as if it had completed now, so that the next BeginWrite keeps it
  // and overwrites a snapshot that an abandoned run completed later. False when the slot no
  // longer holds that snapshot, or this writer was superseded.
  bool MarkResumed(uint32_t slot, uint64_t generation);

  // --- the rank's claim (src/shm/rank_claim.h) -------------------------------------------------
  // The claim epoch this writer's hello was answered with. From then on BeginWrite, FinishWrite,
  // MarkResumed and DropUnusableSlots act only while the rank's claim is still at it. 0 (the
  // default: the agent, readers, a client of an agent without claims): nothing is checked.
  void set_claim_epoch(uint64_t epoch) { claim_epoch_ = epoch; }
  uint64_t claim_epoch() const { return claim_epoch_; }
  // OK while this writer owns the rank; Superseded naming the rank's owner now otherwise.
  Status CheckClaim() const;

  // --- agent side -----------------------------------------------------------------------------
  // Leases a COMPLETE slot of `generation` so that it is not overwritten while it is read.
  // false when the slot changed since (it is no longer that snapshot).
  bool Lease(uint32_t slot, uint64_t generation);
  void Release(uint32_t slot, uint64_t generation);
  // Records that the agent's write of the rank's snapshot of `step` to storage took `seconds`
  // (in slot 0's control block; nothing while the rank has no slot 0): the writer's process
  // reads it (LastPersist) instead of asking the agent.
  void RecordPersist(uint64_t step, double seconds);
  // The newest RecordPersist: (step, seconds); nullopt when none is recorded (or slot 0 was
  // laid out anew since).
  std::optional<std::pair<uint64_t, double>> LastPersist() const;
  // Clears every lease (a new agent adopting the arena: the previous one is gone).
  void ClearLeases();
  // A takeover (the agent, right after it moved the rank's claim to a newer run's process):
  // removes the file of every slot that is being written (WRITING). Those are the superseded
  // process's writes in progress (or torn slots, or a rebuild from peers it asked for): nothing it
  // completes there is ever seen. Returns how many were removed.
  uint32_t RemoveWritingSlots();

  // --- readers --------------------------------------------------------------------------------
  // The COMPLETE slot with the highest step, if any.
  std::optional<SlotInfo> NewestComplete() const;

  // Removes the rank's slot files, and its claim unless a superseded process that still runs
  // must stay refused (RemoveClaimUnlessNeeded).
  Status Remove();

  // Preallocates and pre-faults the usable slot files for images up to `image_size` now, off the
  // save path (a no-op for slots that are large enough; never the slot of the newest snapshot).
  Status Reserve(uint64_t image_size);

 private:
  Arena() = default;
  Status EnsureCapacity(uint32_t slot, uint64_t image_size, double* seconds);
  // BeginWrite; `keep_newest`: never take the slot of the newest COMPLETE snapshot.
  Result<std::pair<Acquire, SlotWriteTicket>> Take(uint64_t image_size, bool keep_newest);
  int64_t NextCompletionNs() const;
  std::string SlotPath(uint32_t slot) const;
  // This process as the slot writer it records.
  internal::ProcessId Self();
  std::string job_dir_;
  uint32_t rank_ = 0;
  uint32_t self_pid_ = 0;
  uint64_t self_start_ticks_ = 0;
  // Whether this writer still owns the rank (claim_epoch_ 0, or no claim file: nothing to check).
  bool ClaimHeld() const;
  // Whether `writer` is a process the rank's claim records as superseded.
  bool SupersededWriter(const internal::ProcessId& writer) const;
  std::vector<std::unique_ptr<SlotFile>> slots_;
  uint32_t usable_slots_ = 0;         // set by Open to slot_count()
  std::unique_ptr<RankClaim> claim_;  // mapped by Refresh once the agent created it
  uint64_t claim_epoch_ = 0;
};

}  // namespace safepoint
