// FaultyStorage: a Storage decorator for tests that injects the failures real storage has,
// including what a power cut loses (like RocksDB's FaultInjectionTestFS). Test-only: it lives
// in src/, outside the public headers, and is built into safepoint_testing, the library that
// only the tests link (never into safepoint_core, the binaries or the Python module).
//
// Faults. Arm(FaultSpec) makes operations of one kind (FaultOp) misbehave: the nth one counted
// from arming (and, when sticky, every later one), or, with one_in = N, each one with
// probability 1/N drawn from the storage's seeded generator (one seed and one sequence of
// operations fire the same faults; threads that race change the sequence). A fired fault does
// what its FaultKind says: fail with EIO (IOError) or ENOSPC (ResourceExhausted), write half of
// the data and fail, stall and then proceed, flip one bit of the data read or written, or report
// success for a sync that made nothing durable. Injected errors have the code and the message
// shape of real ones and name the object (or its directory).
//
// Power loss. The decorator remembers what a power cut would lose, as a POSIX filesystem would,
// and SimulatePowerLoss() loses it:
//   - writers not yet published lose their data; their WriteAt and Publish fail afterwards;
//   - a name whose directory sync failed (kDirSync with EIO or ENOSPC: Publish fails after the
//     object became visible; kDeleteDirSync: Delete fails after the object was removed) or lied
//     (kDirSync or kDeleteDirSync with kUnsynced) reverts to what it named before, the previous
//     object or nothing, unless a later successful directory sync of the same directory
//     (another Publish or a Delete there) made it durable first;
//   - an object whose data sync lied (kSync with kUnsynced) is torn: from a seeded random offset
//     on, its data is lost (cut off, or zeros in place), unless it was replaced or deleted.
// Everything else that was published is durable, as the Storage contract promises.
//
// Thread-safe. Objects may outlive the FaultyStorage that made them. Operation counters are per
// kind and count from 1 since the fault was armed.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "safepoint/storage.h"

namespace safepoint {

// Publish and PublishIfAbsent pass kSync, kPublish and kDirSync alike.
enum class FaultOp : int {
  kCreate = 0,  // Storage::Create
  kWrite,       // WritableObject::WriteAt
  kSync,        // Publish: the data sync (fsync of the temporary); on failure nothing is published
  kPublish,     // Publish: the rename (or the final PUT); on failure nothing is published
  kDirSync,     // Publish: the directory sync after the rename; on failure the object is visible
  kOpen,        // Storage::Open
  kRead,        // ReadableObject::ReadAt
  kList,        // Storage::List
  kDelete,      // Storage::Delete: on failure nothing is removed
  kDeleteDirSync,  // Delete: the directory sync after the removal; on failure the object is gone
                   // from view but a power loss brings it back (POSIX storage reports it)
  kCount_,
};
std::string_view FaultOpName(FaultOp op);

enum class FaultKind : int {
  kEIO = 0,     // IOError
  kENOSPC,      // ResourceExhausted (a failed kDirSync is an IOError: the object is visible)
  kShortWrite,  // kWrite: half of the data is written, then IOError (elsewhere: EIO)
  kDelay,       // a latency spike: the operation waits `delay`, then proceeds without error
  kBitFlip,     // kRead, kWrite: succeeds, with one bit of the data flipped (elsewhere: EIO)
  kUnsynced,    // kSync, kDirSync, kDeleteDirSync: reports success, durable nothing (see power
                // loss; else EIO)
};
std::string_view FaultKindName(FaultKind kind);

struct FaultSpec {
  FaultOp op = FaultOp::kWrite;
  // Fire on the nth operation of `op` counted from arming (1-based) and, when sticky, on every
  // later one until cleared; or, when one_in > 0, on each operation with probability 1/one_in.
  uint64_t nth = 1;
  FaultKind kind = FaultKind::kEIO;
  bool sticky = false;
  std::chrono::microseconds delay{0};  // for kDelay
  uint64_t one_in = 0;
};

class FaultyStorage final : public Storage {
 public:
  // `seed` drives one_in faults, bit positions and tear offsets.
  explicit FaultyStorage(std::shared_ptr<Storage> base, uint64_t seed = 0);
  ~FaultyStorage() override;

  // Arms a fault (replacing any armed fault for the same op) and resets that op's counter.
  void Arm(FaultSpec spec);
  // Disarms every fault. What is not yet durable stays so (SimulatePowerLoss still loses it).
  void Clear();
  // Number of faults that fired since construction.
  uint64_t fired() const;
  // Number of operations of `op` seen since construction.
  uint64_t count(FaultOp op) const;
  // Number of published names and objects that a power loss would change now.
  size_t undurable() const;

  // Simulated power loss (see the top of this file), carried out on the base storage. Returns
  // the first error of the base while it rewrites or removes objects.
  Status SimulatePowerLoss();
  uint64_t epoch() const;  // bumped by SimulatePowerLoss

  const std::string& uri() const override;
  StorageCapabilities capabilities() const override;
  Result<std::unique_ptr<WritableObject>> Create(std::string_view name,
                                                 uint64_t size_hint) override;
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override;
  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override;
  Status Delete(std::string_view name) override;
  using Storage::RemoveLeftovers;
  Result<size_t> RemoveLeftovers(std::string_view prefix, const LeftoverFilter& remove_if) override;
  std::string Describe(std::string_view name) const override;

 private:
  struct State;
  std::shared_ptr<Storage> base_;
  std::shared_ptr<State> state_;
  std::string uri_;
};

}  // namespace safepoint
