// Garbage collection of a checkpoint directory's chunk store (docs/operations.md, "Chunk
// garbage collection"): removes chunk objects that no packed image's manifest references.
#pragma once

#include <cstdint>
#include <string>

#include "safepoint/status.h"
#include "safepoint/storage.h"

namespace safepoint {

struct GcStats {
  bool deferred = false;  // a save was in flight or another GC held the lock: nothing removed
  std::string reason;     // why it deferred
  uint64_t manifests = 0;
  uint64_t chunks = 0;      // chunk objects listed
  uint64_t referenced = 0;  // of them, referenced by some manifest
  uint64_t removed = 0;     // removed (unreferenced)
  uint64_t removed_bytes = 0;
  uint64_t stale_intents = 0;  // records of crashed saves removed
};

// Removes the chunk objects of the checkpoint directory on `storage` that no manifest there
// references (committed or not, any job), unless a save is in flight (it defers:
// GcStats::deferred). Crash-safe at every moment (the protocol: chunk_gc.cc).
Result<GcStats> CollectChunkGarbage(Storage& storage);

}  // namespace safepoint
