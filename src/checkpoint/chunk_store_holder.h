// Who holds the chunk store's GC lock or a save's intent, and whether that holder is provably
// dead: the records docs/format.md ("Packed steps") specifies, judged with the one process
// liveness scheme of src/base/process.h.
//
// Intent and lock records name their process exactly (boot id, pid namespace, pid, start time).
// A holder is provably dead when it ran on this boot in this process's pid namespace and its pid
// is gone or names a process that started at another time (or an exited zombie). Its lock or
// intent is removed at once, but only on storage where no request of a dead process still lands
// later (requests_end_with_process: POSIX, memory; on an object store a killed client's request
// may still be carried out, so only the age rules apply there). That keeps the GC's argument
// (chunk_gc.cc): a dead GC deletes nothing more, and a dead writer publishes nothing more (a
// manifest it published is read at G4). A holder on another host, boot or namespace, or a
// record without the identity (version 1), is judged by age only.
//
// Breaking a lock (stale or dead) races with other breakers: B1 and B2 both judge the record R
// dead, B1 deletes it, a GC C publishes its lock L, and B2's delete must not remove L. Storage
// has no conditional delete, so a breaker reads the lock again just before its Delete and
// deletes only if it still holds R (records are unique: time in ns, pid, start time); left is
// the window between that read and the Delete. Should B2 remove L in it, C finds its lock gone
// at G4b and defers before deleting anything (and G6 removes no lock but its own); the
// remaining hazard needs B2 to stall between two adjacent calls for all of C's G1-G4 and a
// writer to start in exactly that time.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "base/process.h"
#include "safepoint/status.h"
#include "safepoint/storage.h"

namespace safepoint {

// The GC's lock, and where saves in flight publish their intents (under kChunkPrefix).
inline constexpr std::string_view kGcLockName = "chunks/gc-lock";
inline constexpr std::string_view kIntentPrefix = "chunks/inflight/";

namespace internal {

// Who holds an intent or the GC lock: the record docs/format.md ("Packed steps") specifies.
struct ChunkStoreHolder {
  int64_t time_ns = 0;  // wall clock when published
  uint64_t step = 0;
  uint32_t rank = 0;
  int64_t pid = 0;
  std::string host;
  // Version 2 records name the process exactly; a version 1 record (written by safepoint
  // before them, or where /proc could not tell) leaves these empty: its holder is unknown.
  int version = 1;
  std::string boot_id;       // /proc/sys/kernel/random/boot_id
  uint64_t pid_ns = 0;       // the inode of the holder's pid namespace (/proc/<pid>/ns/pid)
  uint64_t start_ticks = 0;  // field 22 of /proc/<pid>/stat
};
// The record of the live process `pid` of this host (version 2), or a version 1 record where
// /proc cannot name it exactly.
ChunkStoreHolder ChunkStoreHolderOf(int64_t pid, uint64_t step, uint32_t rank, int64_t time_ns);
std::string EncodeChunkStoreHolder(const ChunkStoreHolder& holder);
// nullopt when `data` does not start with a time; a version 1 holder where the rest is not a
// valid version 2 record.
std::optional<ChunkStoreHolder> DecodeChunkStoreHolder(std::span<const std::byte> data);
// kDead only when provably dead: a version 2 record of this boot and this process's pid
// namespace whose process ProcessStateOf finds dead. kUnknown for any other record.
ProcessState HolderState(const ChunkStoreHolder& holder);

// The wall clock of holder records (ns since the epoch), against which their age is judged.
int64_t HolderClockNs();
// The leading decimal digits of a holder record: its time (0 where there are none).
int64_t HolderTimePrefix(std::span<const std::byte> data);
// The encoded record of this process, now, for a save of (step, rank) (0, 0 for a GC).
std::string HolderRecord(uint64_t step, uint32_t rank);

// Why the record `data` may be removed now ("" when it may not): its holder is provably dead,
// where the storage carries out no request of a dead process.
std::string DeadHolder(Storage& storage, std::span<const std::byte> data);

// Deletes `name` (the GC lock or an intent, whose record `data` the caller read and judged
// dead or stale) if it still holds exactly `data`: true when it is gone (deleted here or by
// another). Every record is unique (its time in ns, pid and host), so a record read again
// equal to `data` is the same lock, not a new one; the remaining window, between that read and
// the Delete, is argued at the top of this file ("Breaking a lock").
Result<bool> DeleteIfUnchanged(Storage& storage, std::string_view name,
                               std::span<const std::byte> data, const std::string& why);

}  // namespace internal
}  // namespace safepoint
