// safepoint._core: the nanobind binding of the C++ core.
//
// The state tree is walked in C++ (state.cc: no Python code per tensor), the core runs with the
// GIL released, and every C++ Status becomes a Python exception here, in ThrowStatus(), and
// nowhere else.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>

#include "advisor_bindings.h"
#include "codec_bindings.h"
#include "errors.h"
#include "format_bindings.h"
#include "protocol/redundancy.h"
#include "safepoint/build_config.h"
#include "safepoint/checkpoint.h"
#include "safepoint/client.h"
#include "safepoint/extras.h"
#include "safepoint/image.h"
#include "shm/arena.h"
#include "state.h"
#include "version_bindings.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace safepoint {
namespace python {

// The Python exception class of each status code (python/safepoint/errors.py). No default: a
// new StatusCode fails to compile here (-Wswitch) until it has its exception.
const char* ExceptionName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "Error";  // a bug: ThrowStatus of an OK status
    case StatusCode::kNotFound:
      return "NotFoundError";
    case StatusCode::kCorruption:
      return "CorruptionError";
    case StatusCode::kIOError:
      return "StorageError";
    case StatusCode::kInvalidArgument:
      return "InvalidArgumentError";
    case StatusCode::kUnavailable:
      return "UnavailableError";
    case StatusCode::kResourceExhausted:
      return "ResourceExhaustedError";
    case StatusCode::kCancelled:
      return "CancelledError";
    case StatusCode::kAlreadyExists:
      return "AlreadyExistsError";
  }
  return "Error";  // a code outside the enum (a corrupted value)
}

[[noreturn]] void ThrowStatus(const Status& s) {
  nb::object cls = nb::module_::import_("safepoint.errors").attr(ExceptionName(s.code()));
  PyErr_SetString(cls.ptr(), s.message().c_str());
  throw nb::python_error();
}

}  // namespace python

namespace {

using python::Check;
using python::ThrowStatus;
using python::Unwrap;

// --- save / load -----------------------------------------------------------------------------

// --- results: small bound classes (typed in the generated _core.pyi) ------------------------

// load() and a memory snapshot's load: the state, whose tensors are views into the loaded image.
struct Loaded {
  uint64_t step = 0;
  uint32_t world_size = 0;
  std::string job;
  nb::object state;
  // (name, tensor, global shape, global offset) of tensors another rank's image holds, for the
  // caller to fill (replicas written once).
  nb::list elsewhere;
  std::string source;                // what it was read from
  uint64_t generation = 0;           // of the COMMIT record read (CommitRecord::generation)
  std::vector<std::string> skipped;  // newer steps skipped as damaged, one line each
};

// A tensor of an image's index.
struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::optional<std::vector<uint64_t>> global_shape;  // None: a whole tensor, not a shard
  std::optional<std::vector<uint64_t>> global_offset;
  uint64_t nbytes = 0;
  bool elsewhere = false;  // held by another rank's image
};

// read_metadata(): one rank's image of a step without its tensor data.
struct ShardMetadata {
  uint64_t step = 0;
  uint32_t world_size = 0;
  std::vector<TensorInfo> tensors;
  nb::object extras;  // the state tree, each tensor a TensorSlot
};

// A snapshot slot as Client.slots() reports it.
struct SlotView {
  uint32_t slot = 0;
  std::string state;
  bool leased = false;
  uint64_t step = 0;
  uint64_t image_bytes = 0;
  uint64_t capacity = 0;
  int64_t complete_time_ns = 0;
  std::optional<uint64_t> attempt;  // of a complete snapshot, from its image header
};

// The lineage of a save (ImageMeta::lineage) from its Python arguments.
Lineage MakeLineage(std::optional<uint64_t> parent_step, const std::string& parent_location,
                    const std::string& metadata) {
  Lineage l;
  l.has_parent = parent_step.has_value();
  l.parent_step = parent_step.value_or(0);
  l.parent_location = parent_location;
  l.metadata = metadata;
  Check(ValidateLineage(l));
  return l;
}

SaveResult Save(const std::string& path, uint64_t step, uint32_t rank, uint32_t world_size,
                const std::string& job, nb::handle state, nb::handle pickler, uint64_t attempt,
                bool overwrite, std::optional<uint64_t> parent_step,
                const std::string& parent_location, const std::string& metadata,
                const std::string& compression, bool incremental) {
  SaveOptions options;
  options.overwrite = overwrite;
  options.pack.compression = Unwrap(ParseCompression(compression));
  options.pack.incremental = incremental;
  ImageMeta meta;
  meta.job = job;
  meta.attempt = attempt;
  meta.lineage = MakeLineage(parent_step, parent_location, metadata);
  meta.step = step;
  meta.rank = rank;
  meta.world_size = world_size;
  python::FlatState flat = python::FlattenState(state, pickler);
  std::string extras = Unwrap(EncodeExtras(flat.skeleton));
  std::vector<TensorSource> sources = std::move(flat.tensors);
  SaveResult result;
  {
    nb::gil_scoped_release release;
    auto store = OpenCheckpointStore(path);
    if (store.ok()) {
      auto r = SaveShard(**store, std::move(meta), std::move(sources), std::move(extras), options);
      if (r.ok()) {
        result = *r;
      } else {
        nb::gil_scoped_acquire acquire;
        ThrowStatus(r.status());
      }
    } else {
      nb::gil_scoped_acquire acquire;
      ThrowStatus(store.status());
    }
  }
  return result;
}

// What load() returns to Python: the step and the state, whose tensors are views into the loaded
// image (zero copy, zero parse), kept alive through a numpy array that owns the image.
Loaded LoadedToPython(const LoadedImage& image, const ImageReader& reader, const Value& extras,
                      nb::handle unpickler, const std::vector<nb::object>* filled = nullptr) {
  auto* keep = new std::shared_ptr<std::byte>(image.buffer);
  nb::capsule owner(keep,
                    [](void* p) noexcept { delete static_cast<std::shared_ptr<std::byte>*>(p); });
  size_t shape[1] = {image.size};
  nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> array(reinterpret_cast<uint8_t*>(image.buffer.get()),
                                                     1, shape, owner);
  nb::object buffer = array.cast();
  Loaded out;
  out.step = reader.meta().step;
  out.world_size = reader.meta().world_size;
  out.job = reader.meta().job;
  nb::list elsewhere;
  out.state = python::RebuildState(extras, buffer, reader, unpickler, &elsewhere, filled);
  out.elsewhere = elsewhere;
  out.source = image.source;
  return out;
}

Loaded Load(const std::string& path, std::optional<uint64_t> step, uint32_t rank,
            nb::handle unpickler) {
  Result<LoadedShard> shard = Status(StatusCode::kCancelled, "not loaded");
  {
    nb::gil_scoped_release release;
    auto store = OpenCheckpointStore(path);
    shard = store.ok() ? LoadShard(**store, step, rank) : Result<LoadedShard>(store.status());
  }
  LoadedShard s = Unwrap(std::move(shard));
  Loaded out = LoadedToPython(s.image, s.reader, s.extras, unpickler);
  out.skipped = s.skipped;
  out.generation = s.commit.generation;
  return out;
}

std::vector<uint64_t> Steps(const std::string& path) {
  Result<std::vector<CommitRecord>> committed = Status(StatusCode::kCancelled, "not listed");
  {
    nb::gil_scoped_release release;
    auto store = OpenCheckpointStore(path);
    committed =
        store.ok() ? (*store)->ListCommitted() : Result<std::vector<CommitRecord>>(store.status());
  }
  std::vector<uint64_t> out;
  for (const auto& c : Unwrap(std::move(committed))) out.push_back(c.step);
  return out;
}

// Runs f with the GIL released (the core never calls back into Python).
template <typename F>
auto WithoutGil(F&& f) {
  nb::gil_scoped_release release;
  return f();
}

// --- reading parts of images (resharding, tensors other ranks wrote, DCP) ----------------------

// A tensor reference in a state tree read without its tensors (ShardReader.state()).
struct TensorSlot {
  size_t index;
};

// The writable destination memory of a read, held until the read has ended (the read runs with
// the GIL released, so other threads may run meanwhile): a contiguous CPU torch tensor, kept
// alive by a reference, or any writable buffer, held through its buffer export, which also keeps
// it from being resized (a bytearray raises BufferError). Torch has no export lock: resizing a
// destination tensor during the read (tensor.resize_) is the caller's error. Create and destroy
// with the GIL held.
class HeldDestination {
 public:
  HeldDestination(nb::handle dest, const std::string& what) : object_(nb::borrow(dest)) {
    if (nb::hasattr(dest, "data_ptr")) {
      if (!nb::cast<bool>(dest.attr("is_contiguous")()) || !nb::cast<bool>(dest.attr("is_cpu"))) {
        Check(InvalidArgument(what + ": the destination must be a contiguous CPU tensor"));
      }
      auto ptr = nb::cast<uintptr_t>(dest.attr("data_ptr")());
      auto n = nb::cast<size_t>(dest.attr("nbytes"));
      span_ = {reinterpret_cast<std::byte*>(ptr), n};
      return;
    }
    if (PyObject_GetBuffer(dest.ptr(), &view_, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      Check(InvalidArgument(what + ": the destination must be a contiguous CPU tensor or a "
                                   "writable buffer"));
    }
    exported_ = true;
    span_ = {static_cast<std::byte*>(view_.buf), static_cast<size_t>(view_.len)};
  }
  ~HeldDestination() {
    if (exported_) PyBuffer_Release(&view_);
  }
  HeldDestination(const HeldDestination&) = delete;
  HeldDestination& operator=(const HeldDestination&) = delete;

  std::span<std::byte> span() const { return span_; }

 private:
  nb::object object_;  // the requests list may change while the GIL is released
  Py_buffer view_{};
  bool exported_ = false;
  std::span<std::byte> span_;
};

// One rank's image of one committed step, opened for partial reads: its index, its state tree
// and byte ranges of its tensors, each covering checksum chunk verified. Nothing else is read.
class ShardReader {
 public:
  ShardReader(const std::string& path, uint64_t step, uint32_t rank) {
    Status s = WithoutGil([&]() -> Status {
      SP_ASSIGN_OR_RETURN(store_, OpenCheckpointStore(path));
      SP_ASSIGN_OR_RETURN(commit_, store_->ReadCommit(step));
      SP_ASSIGN_OR_RETURN(md_, store_->ReadMetadata(commit_, rank));
      return Status::OK();
    });
    Check(s);
    for (size_t i = 0; i < md_.tensors.size(); ++i) by_name_.emplace(md_.tensors[i].spec.name, i);
  }

  uint64_t step() const { return commit_.step; }
  uint32_t rank() const { return md_.meta.rank; }
  uint32_t world_size() const { return commit_.world_size; }
  // Which images the COMMIT record read names (CommitRecord::generation): readers of several
  // ranks of one step check that they read one version of a step that may be replaced.
  uint64_t generation() const { return commit_.generation; }

  std::vector<TensorInfo> Tensors() const {
    std::vector<TensorInfo> out;
    out.reserve(md_.tensors.size());
    for (const TensorEntry& e : md_.tensors) {
      TensorInfo t;
      t.name = e.spec.name;
      t.dtype = std::string(DTypeName(e.spec.dtype));
      t.shape = e.spec.shape;
      if (!e.spec.global_shape.empty()) t.global_shape = e.spec.global_shape;
      if (!e.spec.global_offset.empty()) t.global_offset = e.spec.global_offset;
      t.nbytes = e.nbytes;
      t.elsewhere = e.spec.elsewhere;
      out.push_back(std::move(t));
    }
    return out;
  }

  nb::object State(nb::handle unpickler) const {
    return python::RebuildSkeleton(md_.extras, md_.tensors.size(), unpickler,
                                   nb::type<TensorSlot>());
  }

  // requests: (tensor name, byte offset in its data, byte count, destination) tuples.
  void Read(nb::list requests) {
    std::vector<CheckpointStore::Range> ranges;
    ranges.reserve(requests.size());
    // Released (with the GIL held) only when this call returns or throws, after the read.
    std::vector<std::unique_ptr<HeldDestination>> held;
    held.reserve(requests.size());
    for (nb::handle item : requests) {
      auto [name, offset, length, dest] =
          nb::cast<std::tuple<std::string, uint64_t, uint64_t, nb::handle>>(item);
      auto it = by_name_.find(name);
      if (it == by_name_.end()) {
        Check(NotFound(md_.source + ": no tensor named '" + name + "'"));
      }
      const TensorEntry& e = md_.tensors[it->second];
      if (e.spec.elsewhere) {
        Check(NotFound(md_.source + ": tensor '" + name + "' is held by another rank's image"));
      }
      if (offset > e.nbytes || length > e.nbytes - offset) {
        Check(InvalidArgument(md_.source + ": tensor '" + name + "' has " +
                              std::to_string(e.nbytes) + " bytes; cannot read [" +
                              std::to_string(offset) + ", +" + std::to_string(length) + ")"));
      }
      held.push_back(
          std::make_unique<HeldDestination>(dest, md_.source + ": tensor '" + name + "'"));
      const std::span<std::byte> dst = held.back()->span();
      if (dst.size() < length) {
        Check(InvalidArgument(md_.source + ": tensor '" + name + "': destination holds " +
                              std::to_string(dst.size()) + " bytes, " + std::to_string(length) +
                              " requested"));
      }
      ranges.push_back({e.offset + offset, length, dst.data()});
    }
    Check(WithoutGil([&] { return store_->ReadRanges(md_, ranges); }));
  }

 private:
  std::unique_ptr<CheckpointStore> store_;
  CommitRecord commit_;
  CheckpointStore::Metadata md_;
  std::unordered_map<std::string, size_t> by_name_;
};

ShardMetadata ReadMetadata(const std::string& path, uint64_t step, uint32_t rank,
                           nb::handle unpickler) {
  ShardReader r(path, step, rank);
  return ShardMetadata{r.step(), r.world_size(), r.Tensors(), r.State(unpickler)};
}

void ReadRanges(const std::string& path, uint64_t step, uint32_t rank, nb::list requests) {
  ShardReader(path, step, rank).Read(requests);
}

// --- flash checkpoints: the client of the node agent --------------------------------------------

class PyClient {
 public:
  PyClient(
      const std::string& storage, const std::string& job, const std::string& shm_dir, uint32_t rank,
      uint32_t world_size, uint32_t keep, bool wait_when_busy, const std::string& agent_binary,
      uint64_t attempt,
      const std::vector<std::tuple<std::string, uint64_t, double, uint32_t, std::string, bool>>&
          tiers,
      uint64_t max_shm_bytes, const std::string& metrics, const std::string& event_log,
      const std::string& compression, bool incremental) {
    ClientOptions o;
    o.max_shm_bytes = max_shm_bytes;
    o.metrics = metrics;
    o.event_log = event_log;
    for (const auto& [uri, every, every_seconds, keep, compression, incremental] : tiers) {
      o.tiers.push_back(TierSpec{uri, every, every_seconds, keep, compression, incremental});
    }
    o.compression = compression;
    o.incremental = incremental;
    o.storage = storage;
    o.job = job;
    o.shm_dir = shm_dir;
    o.rank = rank;
    o.world_size = world_size;
    o.keep = keep;
    o.wait_when_busy = wait_when_busy;
    o.agent_binary = agent_binary;
    o.attempt = attempt;
    Result<std::unique_ptr<SnapshotClient>> c = Status(StatusCode::kCancelled, "");
    {
      nb::gil_scoped_release release;
      c = SnapshotClient::Connect(std::move(o));
    }
    client_ = Unwrap(std::move(c));
  }

  // stage: 1 = GPU tensors are copied into the slot by safepoint._staging (pinned memory,
  // asynchronous copies on a side stream), 2 = every tensor is (tests of that path on CPUs).
  SnapshotResult Save(uint64_t step, nb::handle state, bool persist, nb::handle pickler,
                      bool notify, int stage) {
    python::PlanWalk walked;
    bool have_walk = false;
    if (stage != 2 && !pending_ && !plan_signature_.empty() && Get().plan_tensors()) {
      std::optional<SnapshotResult> r =
          SaveStreamed(step, state, persist, notify, &walked, &have_walk);
      if (r) return *r;
    }
    std::unique_ptr<Pending> p =
        Prepare(step, state, persist, pickler, notify, stage, have_walk ? &walked : nullptr);
    Result<SnapshotResult> r = Status(StatusCode::kCancelled, "");
    {
      nb::gil_scoped_release release;
      r = Run(*p);
    }
    return Finish(std::move(p), std::move(r));
  }

  void SetLineage(std::optional<uint64_t> parent_step, const std::string& parent_location,
                  const std::string& metadata) {
    Check(Get().SetLineage(MakeLineage(parent_step, parent_location, metadata)));
  }

  // save(overlap=True): walks the state now and copies it into the slot on a background thread
  // while the caller goes on (forward and backward); save_finish() waits for the copy. Nothing
  // else may use the client in between (safepoint.Checkpointer sees to it).
  void SaveBegin(uint64_t step, nb::handle state, bool persist, nb::handle pickler, bool notify,
                 int stage) {
    std::unique_ptr<Pending> p = Prepare(step, state, persist, pickler, notify, stage);
    Pending* raw = p.get();
    pending_ = std::move(p);
    raw->thread = std::thread([this, raw] { raw->result = Run(*raw); });
  }

  // The result of the save begun by save_begin (None when none is running), once its copy is
  // done; raises its error.
  std::optional<SnapshotResult> SaveFinish() {
    if (!pending_) return std::nullopt;
    std::unique_ptr<Pending> p = std::move(pending_);
    {
      nb::gil_scoped_release release;
      p->thread.join();
    }
    Result<SnapshotResult> r = std::move(p->result);
    return Finish(std::move(p), std::move(r));
  }

  bool SavePending() const { return pending_ != nullptr; }

  // Whether the last save reused the previous save's plan (the state's structure was the same).
  bool LastSaveReusedPlan() const { return reused_plan_; }

  // skip: [(first, last), ...] tensor index ranges other ranks write. Returns the agent error
  // text ("" when told).
  std::string Notify(const SkipRanges& skip) {
    return WithoutGil([&] { return Get().Notify(skip); });
  }

  // "" when the agent lives (one poll) or was restarted; else why none could be started.
  std::string ReviveAgent() {
    return WithoutGil([&] {
      const Status s = Get().ReviveAgentIfGone();
      return s.ok() ? std::string() : s.ToString();
    });
  }

  // The tensors of the last snapshot: (name, dtype, shape, global_shape, global_offset, nbytes).
  nb::list LastEntries() {
    nb::list out;
    for (const TensorSpec& s : Get().last_specs()) {
      uint64_t n = DTypeSize(s.dtype);
      for (uint64_t d : s.shape) n *= d;
      out.append(nb::make_tuple(s.name, std::string(DTypeName(s.dtype)), s.shape, s.global_shape,
                                s.global_offset, n));
    }
    return out;
  }

  void Wait(double timeout_s) {
    Status s;
    {
      nb::gil_scoped_release release;
      s = Get().Wait(timeout_s);
    }
    Check(s);
  }

  std::string AgentStatus() {
    Result<std::string> r = Status(StatusCode::kCancelled, "");
    {
      nb::gil_scoped_release release;
      r = Get().AgentStatus();
    }
    return Unwrap(std::move(r));
  }

  // --- peer replication (docs/replication.md) ---
  std::string PeerSetup(const std::string& node, const std::string& bind_host, double timeout_s) {
    return Unwrap(WithoutGil([&] { return Get().PeerSetup(node, bind_host, timeout_s); }));
  }

  void SetMembership(const std::string& epoch, uint32_t node_index,
                     const std::vector<std::pair<std::string, std::string>>& nodes,
                     const std::string& redundancy, const std::string& secret_hex,
                     uint64_t bandwidth) {
    Membership m{epoch, node_index, {}, redundancy, secret_hex, bandwidth};
    for (const auto& [node, address] : nodes) m.nodes.push_back({node, address});
    Check(WithoutGil([&] { return Get().SetMembership(m); }));
  }

  std::vector<PeerCopy> PeerCopies() {
    return Unwrap(WithoutGil([&] { return Get().PeerCopies(); }));
  }

  PeerFetchResult FetchFromPeers(uint64_t step, uint64_t attempt, double timeout_s) {
    return Unwrap(WithoutGil([&] { return Get().FetchFromPeers(step, attempt, timeout_s); }));
  }

  void PauseReplication(bool paused) {
    Check(WithoutGil([&] { return Get().PauseReplication(paused); }));
  }

  void Report(const std::string& event, uint64_t step, bool saved, double seconds, uint64_t bytes,
              const std::string& source, const std::string& error) {
    nb::gil_scoped_release release;
    Get().Report(event, step, saved, seconds, bytes, source, error);
  }

  std::optional<Loaded> LoadNewest(std::optional<uint64_t> min_step, nb::handle unpickler,
                                   bool in_place, nb::handle targets) {
    Fills f = MakeFills(in_place, targets);
    auto r = WithoutGil([&] { return Get().LoadNewest(min_step, in_place, f.fills); });
    std::optional<Loaded> out = ToPython(std::move(r), unpickler, &f);
    KeepRestorePlan(&f);
    return out;
  }

  std::optional<Loaded> LoadStep(uint64_t step, nb::handle unpickler, bool in_place,
                                 nb::handle targets) {
    Fills f = MakeFills(in_place, targets);
    auto r = WithoutGil([&] { return Get().LoadStep(step, in_place, f.fills); });
    std::optional<Loaded> out = ToPython(std::move(r), unpickler, &f);
    KeepRestorePlan(&f);
    return out;
  }

  // Whether the last load in place took its targets from the previous one's plan (the state's
  // structure was the same: no full flattening, each target tried at its previous image index).
  bool LastRestoreReusedPlan() const { return restore_reused_plan_; }

  std::vector<SlotView> Slots() {
    std::vector<SlotView> out;
    Check(Get().arena().Refresh());
    for (const SlotInfo& s : Get().arena().Slots()) {
      SlotView v;
      v.slot = s.index;
      v.state = std::string(SlotStateName(s.state));
      v.leased = s.leased;
      v.step = s.step;
      v.image_bytes = s.image_size;
      v.capacity = s.capacity;
      v.complete_time_ns = s.complete_time_ns;
      // The save attempt of a complete snapshot, from its image header (None when unreadable:
      // a load verifies everything anyway).
      if (s.state == SlotState::kComplete && s.image_size >= kImageHeaderSize) {
        auto h =
            ParseImageHeader(Get().arena().SlotData(s.index).subspan(0, kImageHeaderSize), "slot");
        if (h.ok()) v.attempt = h->first.attempt;
      }
      out.push_back(std::move(v));
    }
    return out;
  }

  std::optional<uint64_t> LastPersistStep() { return Get().last_persist_step(); }

  // Shared memory of the snapshot slots: (this rank's mapped slot files, the job's slot files on
  // this node, every rank's), in bytes.
  std::pair<uint64_t, uint64_t> ShmBytes() {
    SnapshotClient& c = Get();
    Check(c.arena().Refresh());
    return {c.arena().mapped_bytes(), Unwrap(JobShmBytes(c.arena().job_dir()))};
  }

  void Close(double timeout_s) {
    if (!client_) return;
    Drain();
    Status s;
    {
      nb::gil_scoped_release release;
      s = client_->Close(timeout_s);
    }
    client_.reset();
    Check(s);
  }

  void Abandon() {  // drop the connection without a clean close
    Drain();
    client_.reset();
  }

  ~PyClient() {
    if (pending_ && pending_->thread.joinable()) {
      if (PyGILState_Check()) {
        nb::gil_scoped_release release;
        pending_->thread.join();
      } else {
        pending_->thread.join();
      }
    }
  }

 private:
  // A restore's targets (the state tree it loads into) for a load in place: its contiguous CPU
  // tensors, which the load fills straight from the slot (TensorFill). Others (GPU tensors,
  // values the walker refuses) are left to the caller's copy, as is everything without targets.
  struct Fills {
    std::vector<TensorFill> fills;
    std::vector<nb::object> tensors;  // fills[i]'s tensor, held until the load returned
    // The plan walk's signature and, per fill, its tensor's index in the walk; set when the
    // fills can be kept as the next restore's plan (every target is the walk's own object).
    std::string signature;
    std::vector<size_t> walk_index;
    bool planned = false;  // targets were given (a load in place)
  };

  // The restore plan (issue 14): the previous restore's targets (specs, sizes, image indexes)
  // for a state of one structure (its plan walk's signature, as the save side's plan). A state
  // with the same signature flattens to the same specs, so only the data pointers are taken
  // from a new walk; the image indexes are hints the load checks (TensorFill::hint).
  struct RestorePlan {
    std::string signature;
    std::vector<TensorFill> fills;  // dst unset
    std::vector<size_t> walk_index;
  };

  Fills MakeFills(bool in_place, nb::handle targets) {
    Fills out;
    restore_reused_plan_ = false;
    if (!in_place || !targets.is_valid() || targets.is_none()) return out;
    out.planned = true;
    python::PlanWalk walk;
    const bool walked =
        python::WalkForPlan(targets, restore_plan_ ? restore_plan_->walk_index.size() : 0, &walk);
    if (walked && restore_plan_ && walk.signature == restore_plan_->signature) {
      // The plan's fills are lent to this load (moved, not copied: a spec per tensor) and
      // taken back by KeepRestorePlan.
      out.fills = std::move(restore_plan_->fills);
      out.walk_index = std::move(restore_plan_->walk_index);
      restore_plan_.reset();
      out.tensors.reserve(out.fills.size());
      for (size_t i = 0; i < out.fills.size(); ++i) {
        const size_t w = out.walk_index[i];
        out.fills[i].dst = static_cast<std::byte*>(const_cast<void*>(walk.data[w]));
        out.tensors.push_back(nb::borrow(PyList_GET_ITEM(walk.keepalive.ptr(), w)));
      }
      out.signature = std::move(walk.signature);
      restore_reused_plan_ = true;
      return out;
    }
    python::FlatState flat;
    try {
      flat = python::FlattenState(targets, nb::none(), python::Stage::kAll);
    } catch (nb::python_error&) {
      return out;  // a value no snapshot could hold: the caller's copy reports what is wrong
    }
    // Kept as a plan only when each filled tensor is the walk's object at its index.
    bool keep = walked && walk.data.size() == flat.tensors.size();
    for (nb::handle item : flat.staged) {
      auto idx = nb::cast<size_t>(item[0]);
      nb::object t = nb::borrow(item[1]);
      if (!nb::cast<bool>(t.attr("is_cpu"))) continue;
      // The fill writes nbytes from data_ptr on: a strided view (a transpose, a slice with a
      // step) is left to the caller's copy_, which honours its strides.
      if (!nb::cast<bool>(t.attr("is_contiguous")())) {
        keep = false;
        continue;
      }
      TensorFill f;
      f.spec = flat.tensors[idx].spec;
      f.nbytes = flat.tensors[idx].nbytes;
      f.dst = reinterpret_cast<std::byte*>(nb::cast<uintptr_t>(t.attr("data_ptr")()));
      if (f.nbytes == 0) continue;
      keep = keep && idx < walk.data.size() &&
             PyList_GET_ITEM(walk.keepalive.ptr(), idx) == t.ptr() &&
             walk.data[idx] == static_cast<const void*>(f.dst);
      out.fills.push_back(std::move(f));
      out.tensors.push_back(std::move(t));
      out.walk_index.push_back(idx);
    }
    if (keep) {
      out.signature = std::move(walk.signature);
    } else {
      out.walk_index.clear();
    }
    return out;
  }

  // After a load in place: its fills (with the image index each took, the next one's hint;
  // a fill not filled keeps its hint) become the plan, when they can be one; else there is
  // none. Moves them out of `f`.
  void KeepRestorePlan(Fills* f) {
    if (!f->planned) return;  // a load without targets: the plan stays
    if (f->signature.empty()) {
      restore_plan_.reset();
      return;
    }
    RestorePlan plan;
    plan.signature = std::move(f->signature);
    plan.walk_index = std::move(f->walk_index);
    plan.fills = std::move(f->fills);
    for (TensorFill& x : plan.fills) {
      x.hint = x.entry >= 0 ? x.entry : x.hint;
      x.entry = -1;
      x.dst = nullptr;
    }
    restore_plan_ = std::move(plan);
  }

  // A memory snapshot as load() returns it; None when there is none. Tensors the load filled in
  // place come back as their targets (restore then finds nothing to copy for them).
  static std::optional<Loaded> ToPython(Result<MemorySnapshot> r, nb::handle unpickler,
                                        const Fills* fills = nullptr) {
    if (!r.ok() && r.status().code() == StatusCode::kNotFound) return std::nullopt;
    MemorySnapshot s = Unwrap(std::move(r));
    std::vector<nb::object> filled;
    if (fills != nullptr && !fills->fills.empty()) {
      filled.resize(s.reader.tensors().size());
      for (size_t i = 0; i < fills->fills.size(); ++i) {
        const int64_t e = fills->fills[i].entry;
        if (e >= 0 && static_cast<size_t>(e) < filled.size()) filled[e] = fills->tensors[i];
      }
    }
    return LoadedToPython(s.image, s.reader, s.extras, unpickler, &filled);
  }

  SnapshotClient& Get() {
    if (!client_) Check(InvalidArgument("the checkpointer is closed"));
    return *client_;
  }

  // Waits for a save begun by SaveBegin; its outcome is dropped (closing or abandoning: the
  // snapshot is in its slot when it completed, and the agent handles it like any other).
  void Drain() {
    if (!pending_) return;
    try {
      SaveFinish();
    } catch (nb::python_error&) {
    }
  }

  // A save between its walk (with the GIL) and the end of its copy (without).
  struct Pending {
    uint64_t step = 0;
    bool persist = false, notify = true;
    bool reuse = false;      // SaveLike with walk.data; else Save with sources/extras
    python::PlanWalk walk;   // the plan check's walk (its keepalive holds the tensors)
    python::FlatState flat;  // the full walk, when the plan could not be reused
    std::vector<TensorSource> sources;
    std::string extras;
    SnapshotClient::StageFn stage_fn;
    std::string signature;  // the plan signature to keep after a full save ("" : none)
    std::thread thread;
    Result<SnapshotResult> result = Status(StatusCode::kCancelled, "");
  };

  // A save that reuses the plan with the walk overlapping the copy: the copy threads start on
  // the first chunks while the walk goes on (SnapshotClient::BeginStreamed). nullopt: the state
  // has another structure, nothing was saved; `walked` then holds the walk when it completed
  // (*have_walk), for the full save to reuse its signature.
  std::optional<SnapshotResult> SaveStreamed(uint64_t step, nb::handle state, bool persist,
                                             bool notify, python::PlanWalk* walked,
                                             bool* have_walk) {
    SnapshotClient& c = Get();
    const size_t n = *c.plan_tensors();
    using Begun = std::pair<std::unique_ptr<SnapshotClient::StreamedSave>, SnapshotResult>;
    Result<Begun> begun = Status(StatusCode::kCancelled, "");
    {
      nb::gil_scoped_release release;
      begun = c.BeginStreamed(step, persist, notify);
    }
    Begun b = Unwrap(std::move(begun));
    if (!b.first) {  // skipped: no free slot
      reused_plan_ = true;
      return b.second;
    }
    SnapshotClient::StreamedSave* stream = b.first.get();
    walked->expect = &plan_signature_;
    walked->publish = [stream](size_t i, const void* data) { stream->Publish(i, data); };
    walked->signature.reserve(plan_signature_.size());
    *have_walk = python::WalkForPlan(state, n, walked);
    walked->expect = nullptr;
    walked->publish = nullptr;
    const bool matched =
        *have_walk && walked->data.size() == n && walked->signature == plan_signature_;
    Result<SnapshotResult> r = Status(StatusCode::kCancelled, "");
    {
      nb::gil_scoped_release release;
      r = stream->Finish(matched);
      b.first.reset();
    }
    if (!matched) {
      Check(r.status());
      return std::nullopt;
    }
    reused_plan_ = true;
    if (!r.ok()) plan_signature_.clear();
    return Unwrap(std::move(r));
  }

  // The part of a save that needs the GIL: the walk. A state with the previous save's structure
  // (equal plan signatures) reuses its plan: only the data pointers are new. `prewalked`: the
  // state's plan walk, already made.
  std::unique_ptr<Pending> Prepare(uint64_t step, nb::handle state, bool persist,
                                   nb::handle pickler, bool notify, int stage,
                                   python::PlanWalk* prewalked = nullptr) {
    if (stage < 0 || stage > 2) Check(InvalidArgument("stage must be 0, 1 or 2"));
    if (pending_) Check(InvalidArgument("a save is still copying; finish it first"));
    SnapshotClient& c = Get();
    auto p = std::make_unique<Pending>();
    p->step = step;
    p->persist = persist;
    p->notify = notify;
    bool walked = false;
    if (prewalked != nullptr) {
      p->walk = std::move(*prewalked);
      walked = true;
    } else if (stage != 2) {  // stage 2 tests the staged path: every tensor through Flattener
      p->walk.signature.reserve(plan_signature_.size());
      walked = python::WalkForPlan(state, c.plan_tensors().value_or(0), &p->walk);
    }
    if (walked && !plan_signature_.empty() && p->walk.signature == plan_signature_ &&
        c.plan_tensors() == p->walk.data.size()) {
      p->reuse = true;
      return p;
    }
    plan_signature_.clear();  // a full save replaces the plan
    if (walked) p->signature = std::move(p->walk.signature);
    p->walk.data.clear();
    p->flat = python::FlattenState(state, pickler, static_cast<python::Stage>(stage));
    p->extras = Unwrap(EncodeExtras(p->flat.skeleton));
    p->sources = std::move(p->flat.tensors);
    if (p->flat.staged.size() > 0) {
      p->signature.clear();  // never reused: the fast walk takes CPU tensors only
      python::FlatState* flat = &p->flat;
      p->stage_fn = [flat](std::span<std::byte> slot, const ImageBuilder& b) -> Status {
        nb::gil_scoped_acquire acquire;
        try {
          nb::list copies;
          for (nb::handle item : flat->staged) {
            auto idx = nb::cast<size_t>(item[0]);
            copies.append(nb::make_tuple(item[1], b.tensor_offset(idx)));
          }
          nb::module_::import_("safepoint._staging")
              .attr("stage")(reinterpret_cast<uintptr_t>(slot.data()), slot.size(), copies);
        } catch (nb::python_error& e) {
          return Status(StatusCode::kIOError,
                        std::string("copying tensors into the snapshot failed: ") + e.what());
        }
        return Status::OK();
      };
    }
    return p;
  }

  // The part without the GIL: the slot, the copy, the checksums (any thread).
  Result<SnapshotResult> Run(Pending& p) {
    if (p.reuse) return client_->SaveLike(p.step, p.walk.data, p.persist, p.notify);
    return client_->Save(p.step, std::move(p.sources), std::move(p.extras), p.persist, p.notify,
                         p.stage_fn);
  }

  // Back with the GIL: keeps the new plan's signature, drops the references, raises an error.
  SnapshotResult Finish(std::unique_ptr<Pending> p, Result<SnapshotResult> r) {
    reused_plan_ = p->reuse;
    if (!r.ok()) {
      plan_signature_.clear();
    } else if (!p->reuse) {
      plan_signature_ = std::move(p->signature);
    }
    p.reset();  // releases the tensors (with the GIL)
    return Unwrap(std::move(r));
  }

  std::unique_ptr<SnapshotClient> client_;
  std::string plan_signature_;               // of the state of the save whose plan the client keeps
  std::optional<RestorePlan> restore_plan_;  // of the last load in place (MakeFills)
  bool restore_reused_plan_ = false;
  bool reused_plan_ = false;
  std::unique_ptr<Pending> pending_;  // a save begun by SaveBegin
};

}  // namespace
}  // namespace safepoint

NB_MODULE(_core, m) {
  using namespace safepoint;
  m.doc() = "safepoint's C++ core (internal; use the safepoint package)";
  nb::class_<SaveResult>(m, "SaveResult", "What save() wrote; committed: the step is committed now")
      .def_ro("bytes", &SaveResult::bytes)
      .def_ro("write_seconds", &SaveResult::write_seconds)
      .def_ro("stored_bytes", &SaveResult::stored_bytes)
      .def_ro("committed", &SaveResult::committed);
  nb::class_<Loaded>(m, "Loaded", "A loaded shard: its state tree, whose tensors view the image")
      .def_ro("step", &Loaded::step)
      .def_ro("world_size", &Loaded::world_size)
      .def_ro("job", &Loaded::job)
      .def_ro("state", &Loaded::state)
      .def_ro("elsewhere", &Loaded::elsewhere)
      .def_ro("source", &Loaded::source)
      .def_ro("generation", &Loaded::generation)
      .def_ro("skipped", &Loaded::skipped);
  nb::class_<TensorInfo>(m, "TensorInfo", "A tensor of an image's index (no data)")
      .def_ro("name", &TensorInfo::name)
      .def_ro("dtype", &TensorInfo::dtype)
      .def_ro("shape", &TensorInfo::shape)
      .def_ro("global_shape", &TensorInfo::global_shape)
      .def_ro("global_offset", &TensorInfo::global_offset)
      .def_ro("nbytes", &TensorInfo::nbytes)
      .def_ro("elsewhere", &TensorInfo::elsewhere);
  nb::class_<ShardMetadata>(m, "ShardMetadata", "One rank's image of a step, without tensor data")
      .def_ro("step", &ShardMetadata::step)
      .def_ro("world_size", &ShardMetadata::world_size)
      .def_ro("tensors", &ShardMetadata::tensors)
      .def_ro("extras", &ShardMetadata::extras);
  nb::class_<SnapshotResult>(m, "SnapshotResult", "What Client.save() did")
      .def_ro("saved", &SnapshotResult::saved)
      .def_ro("persist_requested", &SnapshotResult::persist_requested)
      .def_ro("slot", &SnapshotResult::slot)
      .def_ro("image_bytes", &SnapshotResult::image_bytes)
      .def_ro("copy_seconds", &SnapshotResult::copy_seconds)
      .def_ro("wait_seconds", &SnapshotResult::wait_seconds)
      .def_ro("create_seconds", &SnapshotResult::create_seconds)
      .def_ro("agent_error", &SnapshotResult::agent_error)
      .def_ro("structure_hash", &SnapshotResult::structure_hash);
  nb::class_<SlotView>(m, "SlotInfo", "A snapshot slot in shared memory")
      .def_ro("slot", &SlotView::slot)
      .def_ro("state", &SlotView::state)
      .def_ro("leased", &SlotView::leased)
      .def_ro("step", &SlotView::step)
      .def_ro("image_bytes", &SlotView::image_bytes)
      .def_ro("capacity", &SlotView::capacity)
      .def_ro("complete_time_ns", &SlotView::complete_time_ns)
      .def_ro("attempt", &SlotView::attempt);
  m.def("save", &Save, "path"_a, "step"_a, "rank"_a, "world_size"_a, "job"_a, "state"_a,
        "pickler"_a.none() = nb::none(), "attempt"_a = 0, "overwrite"_a = false,
        "parent_step"_a.none() = nb::none(), "parent_location"_a = "", "metadata"_a = "",
        "compression"_a = "none", "incremental"_a = false);
  m.def("load", &Load, "path"_a, "step"_a.none(), "rank"_a, "unpickler"_a.none() = nb::none());
  m.def("steps", &Steps, "path"_a);
  m.def("set_torch_probe", &python::SetTorchProbe, "enabled"_a,
        "Whether saves and restores read tensors through safepoint._torchprobe (one C++ call "
        "a tensor) or through torch's Python API; returns whether the probe is now in use "
        "(False where it is not built or is for another torch).");
  nb::class_<TensorSlot>(m, "TensorSlot")
      .def(nb::init<size_t>(), "index"_a)
      .def_ro("index", &TensorSlot::index)
      .def("__repr__",
           [](const TensorSlot& t) { return "TensorSlot(" + std::to_string(t.index) + ")"; });
  nb::class_<ShardReader>(m, "ShardReader")
      .def(nb::init<const std::string&, uint64_t, uint32_t>(), "path"_a, "step"_a, "rank"_a)
      .def_prop_ro("step", &ShardReader::step)
      .def_prop_ro("rank", &ShardReader::rank)
      .def_prop_ro("world_size", &ShardReader::world_size)
      .def_prop_ro("generation", &ShardReader::generation)
      .def("tensors", &ShardReader::Tensors)
      .def("state", &ShardReader::State, "unpickler"_a.none() = nb::none())
      .def("read", &ShardReader::Read, "requests"_a);
  m.def("read_metadata", &ReadMetadata, "path"_a, "step"_a, "rank"_a,
        "unpickler"_a.none() = nb::none());
  m.def("read_ranges", &ReadRanges, "path"_a, "step"_a, "rank"_a, "requests"_a);
  nb::class_<PeerCopy>(m, "PeerCopy", "A snapshot of this rank that peers can rebuild")
      .def_ro("step", &PeerCopy::step)
      .def_ro("attempt", &PeerCopy::attempt)
      .def_ro("complete_ns", &PeerCopy::complete_ns)
      .def_ro("image_bytes", &PeerCopy::image_bytes);
  nb::class_<PeerFetchResult>(m, "PeerFetchResult", "A snapshot rebuilt from peers into a slot")
      .def_ro("slot", &PeerFetchResult::slot)
      .def_ro("bytes", &PeerFetchResult::bytes)
      .def_ro("source", &PeerFetchResult::source)
      .def_ro("seconds", &PeerFetchResult::seconds);
  nb::class_<PyClient>(m, "Client")
      .def(
          nb::init<const std::string&, const std::string&, const std::string&, uint32_t, uint32_t,
                   uint32_t, bool, const std::string&, uint64_t,
                   const std::vector<
                       std::tuple<std::string, uint64_t, double, uint32_t, std::string, bool>>&,
                   uint64_t, const std::string&, const std::string&, const std::string&, bool>(),
          "storage"_a, "job"_a, "shm_dir"_a, "rank"_a, "world_size"_a, "keep"_a, "wait_when_busy"_a,
          "agent_binary"_a, "attempt"_a = 0,
          "tiers"_a =
              std::vector<std::tuple<std::string, uint64_t, double, uint32_t, std::string, bool>>{},
          "max_shm_bytes"_a = 0, "metrics"_a = "", "event_log"_a = "", "compression"_a = "none",
          "incremental"_a = false,
          "tiers: (uri, every, every_seconds, keep, compression, incremental) of each storage "
          "tier below `storage`; max_shm_bytes: cap on the job's snapshot slots on this node (0: "
          "none); metrics: have the agent serve Prometheus metrics on HOST:PORT; event_log: the "
          "agent's event log path; compression, incremental: how `storage` stores steps")
      .def("save", &PyClient::Save, "step"_a, "state"_a, "persist"_a,
           "pickler"_a.none() = nb::none(), "notify"_a = true, "stage"_a = 1)
      .def("set_lineage", &PyClient::SetLineage, "parent_step"_a.none(), "parent_location"_a,
           "metadata"_a)
      .def("save_begin", &PyClient::SaveBegin, "step"_a, "state"_a, "persist"_a,
           "pickler"_a.none() = nb::none(), "notify"_a = true, "stage"_a = 1)
      .def("save_finish", &PyClient::SaveFinish)
      .def("save_pending", &PyClient::SavePending)
      .def("last_save_reused_plan", &PyClient::LastSaveReusedPlan)
      .def("last_restore_reused_plan", &PyClient::LastRestoreReusedPlan)
      .def("notify", &PyClient::Notify, "skip"_a)
      .def("revive_agent", &PyClient::ReviveAgent,
           "Restarts this node's agent if it died (one poll when it lives); returns '' or why "
           "none could be started.")
      .def("last_entries", &PyClient::LastEntries)
      .def("wait", &PyClient::Wait, "timeout"_a)
      .def("agent_status", &PyClient::AgentStatus)
      .def("load_newest", &PyClient::LoadNewest, "min_step"_a.none(),
           "unpickler"_a.none() = nb::none(), "in_place"_a = false, "targets"_a.none() = nb::none())
      .def("load_step", &PyClient::LoadStep, "step"_a, "unpickler"_a.none() = nb::none(),
           "in_place"_a = false, "targets"_a.none() = nb::none())
      .def("slots", &PyClient::Slots)
      .def("peer_setup", &PyClient::PeerSetup, "node"_a, "bind_host"_a, "timeout"_a)
      .def("set_membership", &PyClient::SetMembership, "epoch"_a, "node_index"_a, "nodes"_a,
           "redundancy"_a, "secret_hex"_a, "bandwidth"_a)
      .def("peer_copies", &PyClient::PeerCopies)
      .def("fetch_from_peers", &PyClient::FetchFromPeers, "step"_a, "attempt"_a, "timeout"_a)
      .def("pause_replication", &PyClient::PauseReplication, "paused"_a)
      .def("report", &PyClient::Report, "event"_a, "step"_a, "saved"_a, "seconds"_a, "bytes"_a,
           "source"_a = "", "error"_a = "",
           "tells the agent what this process saw (save, restore, checksum), for its metrics")
      .def("last_persist_step", &PyClient::LastPersistStep)
      .def("shm_bytes", &PyClient::ShmBytes)
      .def("close", &PyClient::Close, "timeout"_a)
      .def("abandon", &PyClient::Abandon);
  m.def(
      "check_redundancy",
      [](const std::string& spec, uint32_t nodes) {
        replica::Redundancy r = Unwrap(replica::ParseRedundancy(spec));
        if (r.enabled()) Check(replica::CheckPlacement(r, nodes));
        return std::make_tuple(r.ToString(), r.targets(), r.tolerated_losses(), r.memory_factor());
      },
      "spec"_a, "nodes"_a,
      "Validates a redundancy spec for a job of `nodes` nodes: (normalized spec, nodes holding "
      "parts of each snapshot, node losses survived, memory on other nodes per snapshot byte)");
  python::BindFormat(m);
  python::BindCodec(m);
  python::BindVersions(m);
  python::BindAdvisor(m);
  m.attr("__version__") = SAFEPOINT_VERSION;
  m.attr("VERSION") = SAFEPOINT_VERSION;  // __version__ for type checkers (stubs omit dunders)
  m.attr("FORMAT_VERSION") = kImageFormatVersion;
  m.attr("KILL_POINTS") = static_cast<bool>(SAFEPOINT_HAVE_KILL_POINTS);  // crash-test builds only
}
