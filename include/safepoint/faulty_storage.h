// FaultyStorage: a Storage decorator that injects failures, for tests of every failure path.
//
// It forwards to a base Storage and, according to the armed faults, fails the Nth operation of a
// kind with EIO (IOError) or ENOSPC (ResourceExhausted), performs short writes (writes a prefix
// of the data, then fails), delays it (a latency spike: the operation then proceeds normally),
// and simulates a power loss: every object that was created but not
// yet published loses its data and can never be published.
//
// Thread-safe. Operation counters are per kind and count from 1 since the fault was armed.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "safepoint/storage.h"

namespace safepoint {

enum class FaultOp : int {
  kCreate = 0,
  kWrite,    // WritableObject::WriteAt
  kSync,     // the durability part of Publish (fsync of the data)
  kPublish,  // the naming part of Publish (rename + directory fsync, or the final PUT)
  kOpen,
  kRead,     // ReadableObject::ReadAt
  kList,
  kDelete,
  kCount_,
};
std::string_view FaultOpName(FaultOp op);

enum class FaultKind : int {
  kEIO = 0,     // IOError
  kENOSPC,      // ResourceExhausted
  kShortWrite,  // only for kWrite: half of the data is written, then IOError
  kDelay,       // a latency spike: the operation waits `delay`, then proceeds without error
};

struct FaultSpec {
  FaultOp op = FaultOp::kWrite;
  uint64_t nth = 1;         // fail the nth operation of `op` counted from arming (1-based)
  FaultKind kind = FaultKind::kEIO;
  bool sticky = false;      // also fail every later operation of `op` until cleared
  std::chrono::microseconds delay{0};  // for kDelay
};

class FaultyStorage final : public Storage {
 public:
  explicit FaultyStorage(std::shared_ptr<Storage> base);
  ~FaultyStorage() override;

  // Arms a fault (replacing any armed fault for the same op) and resets that op's counter.
  void Arm(FaultSpec spec);
  // Disarms every fault.
  void Clear();
  // Number of faults that fired since construction.
  uint64_t fired() const;
  // Number of operations of `op` seen since construction.
  uint64_t count(FaultOp op) const;

  // Simulated power loss: every object created through this storage and not yet published
  // loses its data; later WriteAt/Publish on those objects fail with IOError.
  void DropUnsynced();

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

  // Internal: used by the wrapped objects. Returns the fault to inject for this operation
  // (OK when none) and counts it.
  Status MaybeFail(FaultOp op, std::string_view name, bool* short_write = nullptr);
  uint64_t epoch() const;  // bumped by DropUnsynced

 private:
  struct State;
  std::shared_ptr<Storage> base_;
  std::shared_ptr<State> state_;
  std::string uri_;
};

}  // namespace safepoint
