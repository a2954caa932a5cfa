// FaultyStorage: the fault-injecting Storage decorator declared in faulty_storage.h.
//
// All counters, armed faults, the seeded generator and the record of what is not yet durable
// live in one FaultState guarded by a mutex and shared with the wrapped objects, so that objects
// may outlive the FaultyStorage that made them. Injected errors are built with ErrnoStatus()
// from the errno they simulate, so they carry the same codes and the same message shape
// ("<path>: sync #1 (injected fault) failed: Input/output error") as real ones.
//
// Publish and PublishIfAbsent pass three fault points in the order of the POSIX protocol: kSync
// (data fsync), kPublish (rename) and kDirSync (directory fsync). A failure at the first two aborts
// the base object, so nothing is published. At kDirSync the base object is published first, and the
// name is recorded with what it named before (read from the base before publishing): a power loss
// restores that. A writer's own shared_mutex orders SimulatePowerLoss against its WriteAt
// (shared) and Publish/Abort (exclusive) calls, so the power may fail while threads write.
#include "storage/faulty/faulty_storage.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace safepoint {

std::string_view FaultOpName(FaultOp op) {
  static constexpr std::string_view kNames[] = {"create",  "write",        "sync", "publish",
                                                "dirsync", "open",         "read", "list",
                                                "delete",  "deletedirsync"};
  static_assert(std::size(kNames) == static_cast<size_t>(FaultOp::kCount_));
  const size_t i = static_cast<size_t>(op);
  return i < std::size(kNames) ? kNames[i] : "unknown";
}

std::string_view FaultKindName(FaultKind kind) {
  static constexpr std::string_view kNames[] = {"EIO",   "ENOSPC",  "ShortWrite",
                                                "Delay", "BitFlip", "Unsynced"};
  const size_t i = static_cast<size_t>(kind);
  return i < std::size(kNames) ? kNames[i] : "unknown";
}

namespace {

constexpr size_t kNumOps = static_cast<size_t>(FaultOp::kCount_);

// "a/b/c" -> "a/b", "c" -> "".
std::string_view DirectoryOf(std::string_view name) {
  const size_t slash = name.rfind('/');
  return slash == std::string_view::npos ? std::string_view() : name.substr(0, slash);
}

// A fault that fired on one operation. `error` is set for the kinds that fail the operation.
struct Injection {
  FaultKind kind = FaultKind::kEIO;
  Status error;
  uint64_t draw = 0;  // from the seeded generator: bit positions, tear offsets
};

// The part of a writer that SimulatePowerLoss reaches: the base object and its fate.
struct WriterCore {
  std::shared_mutex mu;  // WriteAt: shared; Publish, Abort, SimulatePowerLoss: exclusive
  std::unique_ptr<WritableObject> base;
  bool finished = false;  // published or aborted
  bool dropped = false;   // lost to a power loss
  // Set before the power loss waits for `mu`: new writes fail at once instead of keeping the
  // shared lock busy (glibc's rwlock prefers readers, so busy writers would starve it).
  std::atomic<bool> dropping{false};
};

// A published name that a power loss would change.
struct Undurable {
  // The name is not durable: what it named before (nullopt: nothing), and whether that data was
  // torn-pending itself (its draw).
  bool name_pending = false;
  std::string directory;
  std::optional<std::vector<std::byte>> previous;
  std::optional<uint64_t> previous_tear;
  // The data under the name is not durable: the draw that picks the tear.
  std::optional<uint64_t> tear;
};

// Everything FaultyStorage and its objects share. (FaultyStorage::State, which the header
// declares privately, is this type; the objects hold it through this name.)
struct FaultState {
  explicit FaultState(uint64_t seed) : rng(seed) {}

  mutable std::mutex mu;
  std::optional<FaultSpec> armed[kNumOps];
  uint64_t since_armed[kNumOps] = {};
  uint64_t total[kNumOps] = {};
  uint64_t fired = 0;
  uint64_t epoch = 0;
  std::mt19937_64 rng;
  // Writers created through this storage (pruned of destroyed ones on each Create).
  std::list<std::weak_ptr<WriterCore>> writers;
  std::map<std::string, Undurable, std::less<>> undurable;

  // Counts an operation of `op` on `subject` and returns the fault to inject, if one fires. A
  // latency spike is served here (outside the mutex) and injects nothing.
  std::optional<Injection> Check(FaultOp op, std::string_view subject) {
    const size_t i = static_cast<size_t>(op);
    uint64_t n;
    FaultSpec spec;
    Injection injection;
    {
      std::lock_guard<std::mutex> lock(mu);
      ++total[i];
      if (!armed[i]) return std::nullopt;
      n = ++since_armed[i];
      spec = *armed[i];
      const bool fire = spec.one_in > 0 ? rng() % spec.one_in == 0
                                        : n == spec.nth || (spec.sticky && n > spec.nth);
      if (!fire) return std::nullopt;
      ++fired;
      injection.draw = rng();
    }
    if (spec.kind == FaultKind::kDelay) {
      // Outside the mutex: other operations (and other delays) go on meanwhile.
      std::this_thread::sleep_for(spec.delay);
      return std::nullopt;
    }
    const bool applies =
        (spec.kind == FaultKind::kShortWrite && op == FaultOp::kWrite) ||
        (spec.kind == FaultKind::kBitFlip && (op == FaultOp::kRead || op == FaultOp::kWrite)) ||
        (spec.kind == FaultKind::kUnsynced &&
         (op == FaultOp::kSync || op == FaultOp::kDirSync || op == FaultOp::kDeleteDirSync)) ||
        spec.kind == FaultKind::kEIO || spec.kind == FaultKind::kENOSPC;
    injection.kind = applies ? spec.kind : FaultKind::kEIO;
    const std::string what =
        std::string(FaultOpName(op)) + " #" + std::to_string(n) + " (injected fault)";
    switch (injection.kind) {
      case FaultKind::kENOSPC:
        injection.error = ErrnoStatus(what, subject, ENOSPC);
        break;
      case FaultKind::kShortWrite:
        injection.error = IOError(std::string(subject) + ": short write: " + what);
        break;
      case FaultKind::kEIO:
        injection.error = ErrnoStatus(what, subject, EIO);
        break;
      case FaultKind::kDelay:
      case FaultKind::kBitFlip:
      case FaultKind::kUnsynced:
        break;
    }
    return injection;
  }

  // `name` was published. `name_durable`: its directory sync succeeded, which makes every name
  // in that directory durable. `previous`: what the name showed before (read only when the name
  // is not durable). `tear`: set when its data sync lied.
  void Published(std::string_view name, bool name_durable,
                 std::optional<std::vector<std::byte>> previous, std::optional<uint64_t> tear) {
    std::lock_guard<std::mutex> lock(mu);
    if (name_durable) DirectorySynced(DirectoryOf(name));
    auto it = undurable.try_emplace(std::string(name)).first;
    Undurable& u = it->second;
    if (!name_durable && !u.name_pending) {
      // The first publish since the name was last durable: a power loss restores what was there.
      // (Later ones keep that: the name has been durable only as it was then.)
      u.name_pending = true;
      u.directory = std::string(DirectoryOf(name));
      u.previous = std::move(previous);
      u.previous_tear = u.tear;
    }
    u.tear = tear;
    if (!u.name_pending && !u.tear) undurable.erase(it);
  }

  // A successful sync of `dir` (a Publish or Delete there): its names are durable now. The
  // caller holds `mu`.
  void DirectorySynced(std::string_view dir) {
    for (auto it = undurable.begin(); it != undurable.end();) {
      Undurable& u = it->second;
      if (u.name_pending && u.directory == dir) {
        u.name_pending = false;
        u.previous.reset();
        u.previous_tear.reset();
      }
      it = !u.name_pending && !u.tear ? undurable.erase(it) : std::next(it);
    }
  }

  void DirectorySyncedLocked(std::string_view dir) {
    std::lock_guard<std::mutex> lock(mu);
    DirectorySynced(dir);
  }

  void Deleted(std::string_view name) {
    std::lock_guard<std::mutex> lock(mu);
    DirectorySynced(DirectoryOf(name));
    undurable.erase(std::string(name));
  }

  // `name` was removed but its directory sync failed or lied: a power loss brings back what the
  // name showed when it was last durable (`previous`, the object just removed, unless the name
  // was not durable already).
  void DeletedUndurably(std::string_view name, std::vector<std::byte> previous) {
    std::lock_guard<std::mutex> lock(mu);
    Undurable& u = undurable.try_emplace(std::string(name)).first->second;
    if (!u.name_pending) {
      u.name_pending = true;
      u.directory = std::string(DirectoryOf(name));
      u.previous = std::move(previous);
      u.previous_tear = u.tear;
    }
    u.tear.reset();
  }
};

// Returns the object's data as a power cut leaves it when its data sync lied: cut off at a
// random offset, or (the file size was already durable, e.g. preallocated) zeros from there on.
void Tear(std::vector<std::byte>& data, uint64_t draw) {
  if (data.empty()) return;
  const size_t from = static_cast<size_t>(draw % data.size());
  if ((draw >> 63) != 0) {
    data.resize(from);
  } else {
    std::fill(data.begin() + static_cast<ptrdiff_t>(from), data.end(), std::byte{0});
  }
}

Status WriteBase(Storage& base, std::string_view name, std::span<const std::byte> data) {
  SP_ASSIGN_OR_RETURN(auto w, base.Create(name, data.size()));
  SP_RETURN_IF_ERROR(w->WriteAt(0, data));
  return w->Publish();
}

// The whole object `name` of `base`, or nullopt when there is none.
Result<std::optional<std::vector<std::byte>>> ReadBase(Storage& base, std::string_view name) {
  auto r = base.Open(name);
  if (!r.ok()) {
    if (r.status().code() == StatusCode::kNotFound) {
      return std::optional<std::vector<std::byte>>();
    }
    return r.status();
  }
  std::vector<std::byte> data((*r)->size());
  SP_RETURN_IF_ERROR((*r)->ReadAt(0, data));
  return std::optional<std::vector<std::byte>>(std::move(data));
}

void FlipBit(std::span<std::byte> data, uint64_t draw) {
  if (data.empty()) return;
  data[draw % data.size()] ^= static_cast<std::byte>(1u << ((draw >> 56) & 7));
}

class FaultyWritableObject final : public WritableObject {
 public:
  FaultyWritableObject(std::shared_ptr<FaultState> state, std::shared_ptr<Storage> base_storage,
                       std::string name, std::shared_ptr<WriterCore> core)
      : state_(std::move(state)),
        base_storage_(std::move(base_storage)),
        name_(std::move(name)),
        path_(base_storage_->Describe(name_)),
        core_(std::move(core)) {}

  ~FaultyWritableObject() override { Abort(); }

  Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
    if (core_->dropping.load(std::memory_order_acquire)) return Lost();
    std::shared_lock<std::shared_mutex> lock(core_->mu);
    if (core_->dropped) return Lost();
    if (core_->finished) return InvalidArgument(path_ + ": write after publish or abort");
    const std::optional<Injection> fault = state_->Check(FaultOp::kWrite, path_);
    if (!fault) return core_->base->WriteAt(offset, data);
    switch (fault->kind) {
      case FaultKind::kShortWrite:
        SP_RETURN_IF_ERROR(core_->base->WriteAt(offset, data.first(data.size() / 2)));
        return fault->error;
      case FaultKind::kBitFlip: {
        std::vector<std::byte> flipped(data.begin(), data.end());
        FlipBit(flipped, fault->draw);
        return core_->base->WriteAt(offset, flipped);
      }
      default:
        return fault->error;
    }
  }

  Status Publish() override { return PublishAs(/*exclusive=*/false); }
  Status PublishIfAbsent() override { return PublishAs(/*exclusive=*/true); }

  // Publish or PublishIfAbsent: the same fault points; the base decides whether the name exists.
  Status PublishAs(bool exclusive) {
    std::unique_lock<std::shared_mutex> lock(core_->mu);
    if (core_->dropped) return Lost();
    if (core_->finished) return InvalidArgument(path_ + ": already published or aborted");
    const std::optional<Injection> sync = state_->Check(FaultOp::kSync, path_);
    if (sync && !sync->error.ok()) return Fail(sync->error);
    if (auto rename = state_->Check(FaultOp::kPublish, path_)) return Fail(rename->error);
    const std::string dir_path = base_storage_->Describe(DirectoryOf(name_));
    const std::optional<Injection> dir_sync = state_->Check(FaultOp::kDirSync, dir_path);
    std::optional<std::vector<std::byte>> previous;
    if (dir_sync && !exclusive) {
      // The name will not be durable: keep what it names now, for a power loss to restore.
      // (An exclusive publish that succeeds named nothing before: a power loss removes it.)
      auto read = ReadBase(*base_storage_, name_);
      if (!read.ok()) return Fail(read.status());
      previous = std::move(read).value();
    }
    core_->finished = true;
    if (exclusive) {
      Status s = core_->base->PublishIfAbsent();
      if (s.code() == StatusCode::kAlreadyExists) {
        // As the POSIX driver does: the directory sync makes the existing name durable.
        if (dir_sync && !dir_sync->error.ok()) {
          return IOError(dir_sync->error.message())
              .WithContext(path_ +
                           " already exists (not replaced), but it may not survive a "
                           "power loss");
        }
        if (!dir_sync) state_->DirectorySyncedLocked(DirectoryOf(name_));
        return s;
      }
      SP_RETURN_IF_ERROR(s);
    } else {
      SP_RETURN_IF_ERROR(core_->base->Publish());
    }
    std::optional<uint64_t> tear;
    if (sync) tear = sync->draw;  // kUnsynced: the data sync lied
    state_->Published(name_, !dir_sync, std::move(previous), tear);
    if (!dir_sync || dir_sync->kind == FaultKind::kUnsynced) return Status::OK();
    // As the POSIX driver reports it: the object is visible, its name may not be durable.
    Status error = dir_sync->error;
    if (error.code() != StatusCode::kIOError) error = IOError(error.message());
    return error.WithContext("publishing " + path_ +
                             " (visible, but it may not survive a power loss)");
  }

  void Abort() override {
    std::unique_lock<std::shared_mutex> lock(core_->mu);
    if (core_->finished) return;
    core_->finished = true;
    core_->base->Abort();
  }

 private:
  // Publish failed before the base published: abort the base object. The caller holds the lock.
  Status Fail(Status s) {
    core_->base->Abort();
    core_->finished = true;
    return s;
  }

  Status Lost() const {
    return IOError(path_ + ": data lost to a simulated power loss before publish");
  }

  const std::shared_ptr<FaultState> state_;
  const std::shared_ptr<Storage> base_storage_;
  const std::string name_;
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
    const std::optional<Injection> fault = state_->Check(FaultOp::kRead, path_);
    if (fault && !fault->error.ok()) return fault->error;
    SP_RETURN_IF_ERROR(base_->ReadAt(offset, dst));
    if (fault) FlipBit(dst, fault->draw);  // kBitFlip
    return Status::OK();
  }

 private:
  const std::shared_ptr<FaultState> state_;
  const std::string path_;
  const std::unique_ptr<ReadableObject> base_;
};

}  // namespace

struct FaultyStorage::State : FaultState {
  using FaultState::FaultState;
};

FaultyStorage::FaultyStorage(std::shared_ptr<Storage> base, uint64_t seed)
    : base_(std::move(base)),
      state_(std::make_shared<State>(seed)),
      uri_("faulty+" + base_->uri()) {}

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

size_t FaultyStorage::undurable() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->undurable.size();
}

uint64_t FaultyStorage::epoch() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->epoch;
}

Status FaultyStorage::SimulatePowerLoss() {
  std::vector<std::shared_ptr<WriterCore>> victims;
  std::map<std::string, Undurable, std::less<>> undurable;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->epoch;
    for (auto& weak : state_->writers) {
      if (auto core = weak.lock()) victims.push_back(std::move(core));
    }
    state_->writers.clear();
    undurable.swap(state_->undurable);
  }
  // Outside the state mutex: a writer holds its own lock while it calls Check.
  for (auto& core : victims) core->dropping.store(true, std::memory_order_release);
  for (auto& core : victims) {
    std::unique_lock<std::shared_mutex> lock(core->mu);
    if (core->finished) continue;
    core->base->Abort();
    core->finished = true;
    core->dropped = true;
  }
  Status first;
  auto keep_first = [&first](Status s) {
    if (first.ok()) first = std::move(s);
  };
  for (auto& [name, u] : undurable) {
    std::optional<std::vector<std::byte>> data;
    std::optional<uint64_t> tear = u.tear;
    if (u.name_pending) {
      data = std::move(u.previous);
      tear = u.previous_tear;
    } else {
      auto read = ReadBase(*base_, name);
      if (!read.ok()) {
        keep_first(read.status());
        continue;
      }
      data = std::move(read).value();
    }
    if (!data) {
      keep_first(base_->Delete(name));
      continue;
    }
    if (tear) Tear(*data, *tear);
    keep_first(WriteBase(*base_, name, *data));
  }
  return first;
}

const std::string& FaultyStorage::uri() const { return uri_; }

StorageCapabilities FaultyStorage::capabilities() const { return base_->capabilities(); }

Result<std::unique_ptr<WritableObject>> FaultyStorage::Create(std::string_view name,
                                                              uint64_t size_hint) {
  SP_RETURN_IF_ERROR(ValidateObjectName(name));
  const std::string path = base_->Describe(name);
  if (auto fault = state_->Check(FaultOp::kCreate, path)) return fault->error;
  SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableObject> base, base_->Create(name, size_hint));
  auto core = std::make_shared<WriterCore>();
  core->base = std::move(base);
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->writers.remove_if([](const std::weak_ptr<WriterCore>& w) { return w.expired(); });
    state_->writers.push_back(core);
  }
  return std::unique_ptr<WritableObject>(
      std::make_unique<FaultyWritableObject>(state_, base_, std::string(name), std::move(core)));
}

Result<std::unique_ptr<ReadableObject>> FaultyStorage::Open(std::string_view name) {
  SP_RETURN_IF_ERROR(ValidateObjectName(name));
  const std::string path = base_->Describe(name);
  if (auto fault = state_->Check(FaultOp::kOpen, path)) return fault->error;
  SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableObject> base, base_->Open(name));
  return std::unique_ptr<ReadableObject>(
      std::make_unique<FaultyReadableObject>(state_, path, std::move(base)));
}

Result<std::vector<ObjectInfo>> FaultyStorage::List(std::string_view prefix) {
  SP_RETURN_IF_ERROR(ValidateObjectPrefix(prefix));
  if (auto fault = state_->Check(
          FaultOp::kList, base_->uri() + " (list of prefix \"" + std::string(prefix) + "\")")) {
    return fault->error;
  }
  return base_->List(prefix);
}

Status FaultyStorage::Delete(std::string_view name) {
  SP_RETURN_IF_ERROR(ValidateObjectName(name));
  if (auto fault = state_->Check(FaultOp::kDelete, base_->Describe(name))) return fault->error;
  // Only the removal of an object syncs its directory (as POSIX storage does).
  if (!base_->Open(name).ok()) return base_->Delete(name);
  const std::optional<Injection> dir_sync =
      state_->Check(FaultOp::kDeleteDirSync, base_->Describe(DirectoryOf(name)));
  if (!dir_sync) {
    SP_RETURN_IF_ERROR(base_->Delete(name));
    state_->Deleted(name);
    return Status::OK();
  }
  // The removal will not be durable: keep the object, for a power loss to bring back.
  SP_ASSIGN_OR_RETURN(std::optional<std::vector<std::byte>> previous, ReadBase(*base_, name));
  if (!previous) return Status::OK();  // removed meanwhile
  SP_RETURN_IF_ERROR(base_->Delete(name));
  state_->DeletedUndurably(name, std::move(*previous));
  if (dir_sync->kind == FaultKind::kUnsynced) return Status::OK();
  // As the POSIX driver reports it: the object is gone from view, its removal may not be durable.
  Status error = dir_sync->error;
  if (error.code() != StatusCode::kIOError) error = IOError(error.message());
  return error.WithContext("deleting " + base_->Describe(name) +
                           " (removed, but it may come back after a power loss)");
}

Result<size_t> FaultyStorage::RemoveLeftovers(std::string_view prefix,
                                              const LeftoverFilter& remove_if) {
  return base_->RemoveLeftovers(prefix, remove_if);
}

std::string FaultyStorage::Describe(std::string_view name) const { return base_->Describe(name); }

}  // namespace safepoint
