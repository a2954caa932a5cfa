// Garbage collection of the chunk store (chunk_gc.h; docs/operations.md, "Chunk garbage
// collection"): mark and sweep, every manifest is a root.
//   G1. Publish "chunks/gc-lock" with PublishIfAbsent (a lock older than kGcLockStale, or one
//       whose holder is provably dead, is broken first: its GC crashed or overran; a GC stops
//       deleting after kGcBudget).
//   G2. List the intents: those of crashed saves (older than kIntentStale, or of a provably
//       dead holder) are removed; any other means a save is in flight: release the lock and
//       defer (nothing removed).
//   G3. List the chunk objects; G4. read every manifest (committed or not, any job) and mark the
//       chunks they reference; G4b. check that the lock still holds this GC's record (else
//       defer); G5. delete the unmarked chunks; G6. delete the lock if it is still this one's.
// Why no save can lose a chunk: a writer (W1-W5, packed_writer.cc) whose intent (W1) precedes
// G2 makes the GC defer; one whose intent follows G2 also follows G1, so its W2 finds the lock
// and it writes no manifest that references existing chunks. A manifest published before G4 is
// read at G4. The storage must be linearizable for single objects and List (POSIX, RADOS, S3
// since 2020 are).
// Kills: a killed GC leaves its lock (writers write plain images until it is broken) and chunks
// that it had not yet deleted. Committed steps only ever reference chunks of manifests, which G4
// marks. Dead holders and breaking a lock: chunk_store_holder.h.
#include "checkpoint/chunk_gc.h"

#include <spdlog/spdlog.h>

#include <functional>
#include <unordered_set>
#include <vector>

#include "base/digest.h"
#include "base/kill_point.h"
#include "checkpoint/chunk_store_holder.h"
#include "checkpoint/pack_manifest.h"
#include "checkpoint/small_object.h"
#include "safepoint/checkpoint.h"

namespace safepoint {

using internal::DeadHolder;
using internal::DeleteIfUnchanged;
using internal::HolderTimePrefix;
using internal::ReadSmallObject;
using internal::WriteSmallObject;

namespace {
constexpr int64_t kIntentStaleNs = 3600LL * 1000000000;  // a save's intent outlives no save
constexpr int64_t kGcLockStaleNs = 600LL * 1000000000;   // a GC's lock, twice its budget
constexpr int64_t kGcBudgetNs = 300LL * 1000000000;      // a GC stops deleting after this
}  // namespace

Result<GcStats> CollectChunkGarbage(Storage& storage) {
  const int64_t start = internal::HolderClockNs();
  GcStats stats;
  // A directory without a chunk store (plain steps only) has nothing to collect.
  SP_ASSIGN_OR_RETURN(auto any, storage.List(kChunkPrefix));
  if (any.empty()) return stats;
  // G1: the lock; a stale one (its GC crashed or overran) or a dead holder's is broken.
  const std::string mine = internal::HolderRecord(0, 0);
  Status locked = WriteSmallObject(storage, kGcLockName, mine, /*exclusive=*/true);
  for (int attempt = 0; locked.code() == StatusCode::kAlreadyExists && attempt < 4; ++attempt) {
    auto held = ReadSmallObject(storage, kGcLockName, 4096);
    if (!held.ok() && held.status().code() != StatusCode::kNotFound) break;
    if (held.ok()) {
      std::string why = DeadHolder(storage, *held);
      if (why.empty() && start - HolderTimePrefix(*held) > kGcLockStaleNs) {
        why = "older than 10 minutes: its garbage collection crashed or overran";
      }
      if (why.empty()) break;
      SP_ASSIGN_OR_RETURN(
          bool gone, DeleteIfUnchanged(storage, kGcLockName, *held, "a chunk GC's lock: " + why));
      if (!gone) continue;  // another took it meanwhile: judge that one
    }
    locked = WriteSmallObject(storage, kGcLockName, mine, /*exclusive=*/true);
  }
  if (locked.code() == StatusCode::kAlreadyExists) {
    stats.deferred = true;
    stats.reason = "another garbage collection holds " + storage.Describe(kGcLockName);
    return stats;
  }
  SP_RETURN_IF_ERROR(locked);
  // Removes the lock at the end (G6) if it is still this one's.
  auto still_mine = [&] {
    auto held = ReadSmallObject(storage, kGcLockName, 4096);
    return held.ok() &&
           std::string_view(reinterpret_cast<const char*>(held->data()), held->size()) == mine;
  };
  struct LockGuard {
    Storage& s;
    const std::function<bool()> mine;
    ~LockGuard() {
      if (mine()) s.Delete(kGcLockName).IgnoreError();
    }
  } guard{storage, still_mine};
  SP_KILL_POINT("pack.gc.after_lock");

  // G2: saves in flight; those of crashed saves (dead or stale) are removed.
  SP_ASSIGN_OR_RETURN(auto intents, storage.List(kIntentPrefix));
  size_t live = 0;
  for (const auto& o : intents) {
    auto data = ReadSmallObject(storage, o.name, 4096);
    if (!data.ok()) {
      if (data.status().code() == StatusCode::kNotFound) continue;  // that save finished
      return data.status();
    }
    const int64_t t = HolderTimePrefix(*data);
    std::string why = DeadHolder(storage, *data);
    if (why.empty() && t != 0 && start - t > kIntentStaleNs) why = "older than an hour";
    if (why.empty()) {
      ++live;
      continue;
    }
    // An intent's name is never reused (a random part), so deleting it removes no other.
    SP_RETURN_IF_ERROR(storage.Delete(o.name));
    spdlog::warn("{}: removed (a killed save's intent: {})", storage.Describe(o.name), why);
    ++stats.stale_intents;
  }
  if (live > 0) {
    stats.deferred = true;
    stats.reason = std::to_string(live) + " save(s) in flight";
    return stats;
  }
  // G3: the chunks there are.
  SP_ASSIGN_OR_RETURN(auto objects, storage.List(kChunkPrefix));
  std::vector<ObjectInfo> chunks;
  for (auto& o : objects) {
    // chunks/<hh>/<64 hex>
    const std::string_view rest = std::string_view(o.name).substr(kChunkPrefix.size());
    uint8_t digest[32];
    if (rest.size() == 67 && rest[2] == '/' && rest.substr(0, 2) == rest.substr(3, 2) &&
        internal::FromHex(rest.substr(3), digest, 32)) {
      chunks.push_back(std::move(o));
    }
  }
  stats.chunks = chunks.size();
  // G4: every manifest is a root.
  SP_ASSIGN_OR_RETURN(auto steps, storage.List("step-"));
  std::unordered_set<std::string> referenced;
  for (const auto& o : steps) {
    if (!o.name.ends_with(".pack") || !StepFromObjectName(o.name)) continue;
    auto m = ReadPackedManifest(storage, o.name);
    if (!m.ok()) {
      if (m.status().code() == StatusCode::kNotFound) continue;  // deleted meanwhile
      // A manifest that does not read back may still name chunks a reader needs: keep all.
      stats.deferred = true;
      stats.reason = m.status().message();
      return stats;
    }
    ++stats.manifests;
    for (const auto& c : m->chunks) referenced.insert(ChunkObjectName(c.sha256));
  }
  // The lock must still be this one's before anything goes (see "Breaking a lock" above).
  if (!still_mine()) {
    stats.deferred = true;
    stats.reason = storage.Describe(kGcLockName) + " was removed by another process meanwhile";
    return stats;
  }
  // G5: the rest goes.
  for (const auto& o : chunks) {
    if (referenced.contains(o.name)) {
      ++stats.referenced;
      continue;
    }
    if (internal::HolderClockNs() - start > kGcBudgetNs)
      break;  // the lock must not go stale while deleting
    SP_KILL_POINT("pack.gc.before_delete");
    SP_RETURN_IF_ERROR(storage.Delete(o.name));
    ++stats.removed;
    stats.removed_bytes += o.size;
  }
  // Temporaries of chunk writes that crashed: no chunk writer is live now (none has an intent,
  // and new ones find the lock and write no chunks).
  SP_ASSIGN_OR_RETURN(size_t leftovers,
                      storage.RemoveLeftovers(kChunkPrefix, [](std::string_view name) {
                        return !name.starts_with(kIntentPrefix) && name != kGcLockName;
                      }));
  stats.removed += leftovers;
  SP_KILL_POINT("pack.gc.before_unlock");
  return stats;
}

}  // namespace safepoint
