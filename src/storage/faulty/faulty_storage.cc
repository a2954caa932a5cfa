// FaultyStorage: the fault-injecting Storage decorator declared in safepoint/faulty_storage.h.
//
// All counters and armed faults live in one State guarded by a mutex and shared with the
// wrapped objects, so that objects may outlive the FaultyStorage that made them. Injected
// errors are built with ErrnoStatus() from the errno they simulate, so they carry the same codes
// and the same message shape ("<path>: fsync (injected fault) failed: Input/output error") as
// real ones.
//
// Publish is split in two fault points: kSync (the data fsync) and kPublish (rename + directory
// fsync, or the final PUT). Either fault aborts the base object, so nothing is published.
// DropUnsynced() simulates a power loss: it aborts the base object of every writer created
// through this storage that has not published yet; those writers then fail every WriteAt and
// Publish with IOError. A writer's own shared_mutex orders DropUnsynced against its WriteAt
// (shared) and Publish/Abort (exclusive) calls, so dropping may race with writing threads.
#include "safepoint/faulty_storage.h"

#include <atomic>
#include <cerrno>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace safepoint {

std::string_view FaultOpName(FaultOp op) {
  switch (op) {
    case FaultOp::kCreate: return "create";
    case FaultOp::kWrite: return "write";
    case FaultOp::kSync: return "sync";
    case FaultOp::kPublish: return "publish";
    case FaultOp::kOpen: return "open";
    case FaultOp::kRead: return "read";
    case FaultOp::kList: return "list";
    case FaultOp::kDelete: return "delete";
    case FaultOp::kCount_: break;
  }
  return "unknown";
}

namespace {

constexpr size_t kNumOps = static_cast<size_t>(FaultOp::kCount_);

// The part of a writer that DropUnsynced reaches: the base object and its fate.
struct WriterCore {
  std::shared_mutex mu;  // WriteAt: shared; Publish, Abort, DropUnsynced: exclusive
  std::unique_ptr<WritableObject> base;
  bool finished = false;  // published or aborted
  bool dropped = false;   // lost to DropUnsynced
  // Set by DropUnsynced before it waits for `mu`: new writes fail at once instead of keeping the
  // shared lock busy (glibc's rwlock prefers readers, so busy writers would starve the drop).
  std::atomic<bool> dropping{false};
};

// Everything FaultyStorage and its objects share. (FaultyStorage::State, which the header
// declares privately, is this type; the objects hold it through this name.)
struct FaultState {
  std::mutex mu;
  std::optional<FaultSpec> armed[kNumOps];
  uint64_t since_armed[kNumOps] = {};
  uint64_t total[kNumOps] = {};
  uint64_t fired = 0;
  uint64_t epoch = 0;
  // Writers created through this storage (pruned of destroyed ones on each Create).
  std::list<std::weak_ptr<WriterCore>> writers;

  Status MaybeFail(FaultOp op, std::string_view subject, bool* short_write) {
    if (short_write != nullptr) *short_write = false;
    const size_t i = static_cast<size_t>(op);
    uint64_t n;
    FaultSpec spec;
    {
      std::lock_guard<std::mutex> lock(mu);
      ++total[i];
      if (!armed[i]) return Status::OK();
      n = ++since_armed[i];
      spec = *armed[i];
      if (!(n == spec.nth || (spec.sticky && n > spec.nth))) return Status::OK();
      ++fired;
    }
    if (spec.kind == FaultKind::kDelay) {
      // Outside the mutex: other operations (and other delays) go on meanwhile.
      std::this_thread::sleep_for(spec.delay);
      return Status::OK();
    }
    const std::string what =
        std::string(FaultOpName(op)) + " #" + std::to_string(n) + " (injected fault)";
    switch (spec.kind) {
      case FaultKind::kENOSPC: return ErrnoStatus(what, subject, ENOSPC);
      case FaultKind::kShortWrite:
        if (short_write != nullptr) {
          *short_write = true;
          return IOError(std::string(subject) + ": short write: " + what);
        }
        [[fallthrough]];  // a short "create" or "read" is an I/O error
      case FaultKind::kEIO: return ErrnoStatus(what, subject, EIO);
      case FaultKind::kDelay: break;
    }
    return ErrnoStatus(what, subject, EIO);
  }
};

class FaultyWritableObject final : public WritableObject {
 public:
  FaultyWritableObject(std::shared_ptr<FaultState> state, std::string path,
                       std::shared_ptr<WriterCore> core)
      : state_(std::move(state)), path_(std::move(path)), core_(std::move(core)) {}

  ~FaultyWritableObject() override { Abort(); }

  Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    if (core_->dropping.load(std::memory_order_acquire)) return Lost();
    std::shared_lock<std::shared_mutex> lock(core_->mu);
    if (core_->dropped) return Lost();
    if (core_->finished) return InvalidArgument(path_ + ": write after publish or abort");
    bool short_write = false;
    Status fault = state_->MaybeFail(FaultOp::kWrite, path_, &short_write);
    if (!fault.ok()) {
      if (short_write) {
        Status s = core_->base->WriteAt(offset, data.first(data.size() / 2));
        if (!s.ok()) return s;
      }
      return fault;
    }
    return core_->base->WriteAt(offset, data);
  }

  Status Publish() override {
    std::unique_lock<std::shared_mutex> lock(core_->mu);
    if (core_->dropped) return Lost();
    if (core_->finished) return InvalidArgument(path_ + ": already published or aborted");
    Status fault = state_->MaybeFail(FaultOp::kSync, path_, nullptr);
    if (fault.ok()) fault = state_->MaybeFail(FaultOp::kPublish, path_, nullptr);
    if (!fault.ok()) {
      core_->base->Abort();
      core_->finished = true;
      return fault;
    }
    core_->finished = true;
    return core_->base->Publish();
  }

  void Abort() override {
    std::unique_lock<std::shared_mutex> lock(core_->mu);
    if (core_->finished) return;
    core_->finished = true;
    core_->base->Abort();
  }

 private:
  Status Lost() const {
    return IOError(path_ + ": data lost to a simulated power loss (DropUnsynced) before publish");
  }

  const std::shared_ptr<FaultState> state_;
  const std::string path_;
  const std::shared_ptr<WriterCore> core_;
};

class FaultyReadableObject final : public ReadableObject {
 public:
  FaultyReadableObject(std::shared_ptr<FaultState> state, std::string path,
                       std::unique_ptr<ReadableObject> base)
      : state_(std::move(state)), path_(std::move(path)), base_(std::move(base)) {}

  uint64_t size() const override { return base_->size(); }

  Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
    SP_RETURN_IF_ERROR(state_->MaybeFail(FaultOp::kRead, path_, nullptr));
    return base_->ReadAt(offset, dst);
  }

 private:
  const std::shared_ptr<FaultState> state_;
  const std::string path_;
  const std::unique_ptr<ReadableObject> base_;
};

}  // namespace

struct FaultyStorage::State : FaultState {};

FaultyStorage::FaultyStorage(std::shared_ptr<Storage> base)
    : base_(std::move(base)), state_(std::make_shared<State>()), uri_("faulty+" + base_->uri()) {}

FaultyStorage::~FaultyStorage() = default;

void FaultyStorage::Arm(FaultSpec spec) {
  const size_t i = static_cast<size_t>(spec.op);
  if (i >= kNumOps) return;
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->armed[i] = spec;
  state_->since_armed[i] = 0;
}

void FaultyStorage::Clear() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (size_t i = 0; i < kNumOps; ++i) {
    state_->armed[i].reset();
    state_->since_armed[i] = 0;
  }
}

uint64_t FaultyStorage::fired() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->fired;
}

uint64_t FaultyStorage::count(FaultOp op) const {
  const size_t i = static_cast<size_t>(op);
  if (i >= kNumOps) return 0;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->total[i];
}

uint64_t FaultyStorage::epoch() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->epoch;
}

Status FaultyStorage::MaybeFail(FaultOp op, std::string_view name, bool* short_write) {
  return state_->MaybeFail(op, base_->Describe(name), short_write);
}

void FaultyStorage::DropUnsynced() {
  std::vector<std::shared_ptr<WriterCore>> victims;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->epoch;
    for (auto& weak : state_->writers) {
      if (auto core = weak.lock()) victims.push_back(std::move(core));
    }
    state_->writers.clear();
  }
  // Outside the state mutex: a writer holds its own lock while it calls MaybeFail.
  for (auto& core : victims) core->dropping.store(true, std::memory_order_release);
  for (auto& core : victims) {
    std::unique_lock<std::shared_mutex> lock(core->mu);
    if (core->finished) continue;
    core->base->Abort();
    core->finished = true;
    core->dropped = true;
  }
}

const std::string& FaultyStorage::uri() const { return uri_; }

StorageCapabilities FaultyStorage::capabilities() const { return base_->capabilities(); }

Result<std::unique_ptr<WritableObject>> FaultyStorage::Create(std::string_view name,
                                                              uint64_t size_hint) {
  SP_RETURN_IF_ERROR(ValidateObjectName(name));
  const std::string path = base_->Describe(name);
  SP_RETURN_IF_ERROR(state_->MaybeFail(FaultOp::kCreate, path, nullptr));
  SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableObject> base, base_->Create(name, size_hint));
  auto core = std::make_shared<WriterCore>();
  core->base = std::move(base);
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->writers.remove_if([](const std::weak_ptr<WriterCore>& w) { return w.expired(); });
    state_->writers.push_back(core);
  }
  return std::unique_ptr<WritableObject>(
      std::make_unique<FaultyWritableObject>(state_, path, std::move(core)));
}

Result<std::unique_ptr<ReadableObject>> FaultyStorage::Open(std::string_view name) {
  SP_RETURN_IF_ERROR(ValidateObjectName(name));
  const std::string path = base_->Describe(name);
  SP_RETURN_IF_ERROR(state_->MaybeFail(FaultOp::kOpen, path, nullptr));
  SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableObject> base, base_->Open(name));
  return std::unique_ptr<ReadableObject>(
      std::make_unique<FaultyReadableObject>(state_, path, std::move(base)));
}

Result<std::vector<ObjectInfo>> FaultyStorage::List(std::string_view prefix) {
  SP_RETURN_IF_ERROR(ValidateObjectPrefix(prefix));
  SP_RETURN_IF_ERROR(state_->MaybeFail(
      FaultOp::kList, base_->uri() + " (list of prefix \"" + std::string(prefix) + "\")", nullptr));
  return base_->List(prefix);
}

Status FaultyStorage::Delete(std::string_view name) {
  SP_RETURN_IF_ERROR(ValidateObjectName(name));
  SP_RETURN_IF_ERROR(state_->MaybeFail(FaultOp::kDelete, base_->Describe(name), nullptr));
  return base_->Delete(name);
}

Result<size_t> FaultyStorage::RemoveLeftovers(std::string_view prefix,
                                              const LeftoverFilter& remove_if) {
  return base_->RemoveLeftovers(prefix, remove_if);
}

std::string FaultyStorage::Describe(std::string_view name) const { return base_->Describe(name); }

}  // namespace safepoint
