// safepoint._core: flash checkpoints (client_bindings.h): Client wraps SnapshotClient, the
// client of the node agent. A save's walk needs the GIL, its copy into a shared-memory slot runs
// without it (on a background thread for save_begin); a state of the previous save's structure
// reuses its plan, on save and on a load in place.
#include "client_bindings.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "errors.h"
#include "protocol/redundancy.h"
#include "safepoint/checkpoint.h"
#include "safepoint/client.h"
#include "shm/arena.h"
#include "state.h"
#include "store_bindings.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace safepoint::python {

namespace {

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
  std::string Notify(const SkipRanges& skip, uint64_t step, std::optional<double> seconds,
                     uint64_t bytes) {
    std::optional<SaveReport> report;
    if (seconds) report = SaveReport{step, *seconds, bytes};
    return WithoutGil([&] { return Get().Notify(skip, report); });
  }

  uint64_t StructureHash() { return Get().StructureHash(); }

  void SetCopySkip(const SkipRanges& skip) { Check(Get().SetCopySkip(skip)); }
  SkipRanges LastCopySkip() { return Get().LastCopySkip(); }

  // Fills the tensors of `elsewhere` ((name, tensor, global shape, global offset), as a load
  // lists them) from the snapshots of `step` and `attempt` other ranks keep on this node;
  // returns the names of those it could not fill.
  std::vector<std::string> FillFromSiblings(uint64_t step, uint64_t attempt, nb::list elsewhere) {
    std::vector<TensorFill> fills;
    std::vector<std::string> left;
    std::vector<size_t> index;  // fills[k] is elsewhere[index[k]]
    for (size_t i = 0; i < elsewhere.size(); ++i) {
      nb::handle item = elsewhere[i];
      nb::handle t = item[1];
      std::optional<DType> dtype = python::TorchDType(t.attr("dtype"));
      const bool usable =
          dtype && nb::cast<bool>(t.attr("is_cpu")) && nb::cast<bool>(t.attr("is_contiguous")());
      if (!usable) {
        left.push_back(nb::cast<std::string>(item[0]));
        continue;
      }
      TensorFill f;
      f.spec.name = nb::cast<std::string>(item[0]);
      f.spec.dtype = *dtype;
      f.spec.shape = nb::cast<std::vector<uint64_t>>(nb::tuple(t.attr("shape")));
      auto gshape = nb::cast<std::vector<uint64_t>>(item[2]);
      auto goff = nb::cast<std::vector<uint64_t>>(item[3]);
      if (gshape != f.spec.shape ||
          std::any_of(goff.begin(), goff.end(), [](uint64_t x) { return x != 0; })) {
        f.spec.global_shape = std::move(gshape);  // a box of a larger tensor
        f.spec.global_offset = std::move(goff);
      }
      f.nbytes = DTypeSize(*dtype);
      for (uint64_t d : f.spec.shape) f.nbytes *= d;
      if (f.nbytes == 0) continue;  // nothing to fill (its data_ptr() is null)
      f.dst = reinterpret_cast<std::byte*>(nb::cast<uintptr_t>(t.attr("data_ptr")()));
      fills.push_back(std::move(f));
      index.push_back(i);
    }
    std::vector<bool> got =
        WithoutGil([&] { return Get().FillFromSiblings(step, attempt, fills); });
    for (size_t k = 0; k < got.size(); ++k) {
      if (!got[k]) left.push_back(fills[k].spec.name);
    }
    return left;
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

  PeerFetchResult HealFrom(const std::string& address, const std::string& node,
                           const std::string& job, const std::string& secret_hex, uint64_t step,
                           double timeout_s) {
    const HealOrigin origin{address, node, job, secret_hex};
    return Unwrap(WithoutGil([&] { return Get().HealFrom(origin, step, timeout_s); }));
  }

  void PauseReplication(bool paused) {
    Check(WithoutGil([&] { return Get().PauseReplication(paused); }));
  }

  void Report(const std::string& event, uint64_t step, bool saved, double seconds, uint64_t bytes,
              const std::string& source, const std::string& error, const std::string& level) {
    nb::gil_scoped_release release;
    Get().Report(event, step, saved, seconds, bytes, source, error, level);
  }

  std::optional<Loaded> LoadNewest(std::optional<uint64_t> min_step, nb::handle unpickler,
                                   bool in_place, nb::handle targets) {
    if (in_place) {
      if (auto out = LoadStreamed(std::nullopt, min_step, unpickler, targets)) return *out;
    }
    Fills f = MakeFills(in_place, targets);
    auto r =
        WithoutGil([&] { return Get().LoadNewest(min_step, in_place, f.fills, KnownExtras(f)); });
    std::optional<Loaded> out = ToPython(std::move(r), unpickler, &f);
    KeepRestorePlan(&f);
    return out;
  }

  std::optional<Loaded> LoadStep(uint64_t step, nb::handle unpickler, bool in_place,
                                 nb::handle targets) {
    if (in_place) {
      if (auto out = LoadStreamed(step, std::nullopt, unpickler, targets)) return *out;
    }
    Fills f = MakeFills(in_place, targets);
    auto r = WithoutGil([&] { return Get().LoadStep(step, in_place, f.fills, KnownExtras(f)); });
    std::optional<Loaded> out = ToPython(std::move(r), unpickler, &f);
    KeepRestorePlan(&f);
    return out;
  }

  // Whether the last load in place took its targets from the previous one's plan (the state's
  // structure was the same: no full flattening, each target tried at its previous image index).
  bool LastRestoreReusedPlan() const { return restore_reused_plan_; }

  // Whether the last load in place filled the whole state where it is: the plan was reused,
  // the snapshot's extras are byte for byte the ones the targets flatten to (same keys, same
  // non-tensor values, the same tensor at each place) and every tensor was filled from the
  // image entry at its own index. The load then returned the targets themselves as the state
  // (equal to the snapshot's, value for value): no decoding of the extras, no new tree.
  bool LastRestoreWhole() const { return restore_whole_; }

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

  // (step, seconds) of the agent's newest write of this rank's snapshot to storage, as it
  // recorded it in the rank's slot 0 (Arena::RecordPersist): shared memory, no message.
  std::optional<std::pair<uint64_t, double>> LastPersisted() { return Get().arena().LastPersist(); }

  // Shared memory of the snapshot slots: (this rank's mapped slot files, the job's slot files on
  // this node, every rank's), in bytes.
  std::pair<uint64_t, uint64_t> ShmBytes() {
    SnapshotClient& c = Get();
    Check(c.arena().Refresh());
    return {c.arena().mapped_bytes(), Unwrap(JobShmBytes(c.arena().job_dir()))};
  }

  // The snapshot slots this rank saves into: 1 in budget mode (max_shm_bytes below two
  // snapshots), else the arena's slot count.
  uint32_t UsableSlots() { return Get().arena().usable_slots(); }

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
    // With a reused plan that covers the whole state (RestorePlan::extras): the extras the
    // targets flatten to, and the targets, which the load returns when the snapshot's extras
    // are these bytes and every tensor was filled at its own index (LastRestoreWhole).
    std::string extras;
    bool whole_candidate = false;
    nb::object targets;
  };

  // The restore plan (issue 14): the previous restore's targets (specs, sizes, image indexes)
  // for a state of one structure (its plan walk's signature, as the save side's plan). A state
  // with the same signature flattens to the same specs, so only the data pointers are taken
  // from a new walk; the image indexes are hints the load checks (TensorFill::hint).
  struct RestorePlan {
    std::string signature;
    std::vector<TensorFill> fills;  // dst unset
    std::vector<size_t> walk_index;
    // EncodeExtras of the targets' skeleton when fills[i] is tensor i of the walk for every
    // tensor of it (fills in walk order, none left out); "" otherwise. Equal signatures give
    // equal extras, so it holds for every state the plan is reused for.
    std::string extras;
  };

  // The restore plan lent to a load (moved, not copied: a spec per tensor; KeepRestorePlan
  // takes it back) for targets whose walk matched its signature.
  Fills FillsFromPlan(python::PlanWalk& walk, nb::handle targets) {
    Fills out;
    out.planned = true;
    out.fills = std::move(restore_plan_->fills);
    out.walk_index = std::move(restore_plan_->walk_index);
    out.extras = std::move(restore_plan_->extras);
    restore_plan_.reset();
    // Stateful containers in the state (not in the signature): the full path.
    out.whole_candidate = !out.extras.empty() && walk.plain;
    if (out.whole_candidate) out.targets = nb::borrow(targets);
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

  // A load in place that reuses the restore plan with the walk of the targets overlapping the
  // copy (SnapshotClient::BeginStreamedLoad): the chunks whose targets the walk has passed are
  // verified and copied while it goes on. nullopt when it does not apply (no plan, no targets,
  // the snapshot not found or unreadable, the targets of another structure): the caller then
  // loads as before (which reports what is wrong, or walks the targets again for a new plan).
  std::optional<std::optional<Loaded>> LoadStreamed(std::optional<uint64_t> step,
                                                    std::optional<uint64_t> min_step,
                                                    nb::handle unpickler, nb::handle targets) {
    if (!restore_plan_ || !targets.is_valid() || targets.is_none()) return std::nullopt;
    restore_reused_plan_ = false;
    restore_whole_ = false;
    SnapshotClient& c = Get();
    RestorePlan& plan = *restore_plan_;
    // Before the stream: if the walk throws, the stream (destroyed first) joins its threads
    // while the walk's keepalive still holds the targets they write.
    python::PlanWalk walk;
    Result<std::unique_ptr<SnapshotClient::StreamedLoad>> begun =
        Status(StatusCode::kCancelled, "");
    {
      nb::gil_scoped_release release;
      begun = c.BeginStreamedLoad(step, min_step, plan.fills, plan.walk_index);
    }
    if (!begun.ok()) return std::nullopt;
    std::unique_ptr<SnapshotClient::StreamedLoad> stream = std::move(*begun);
    walk.signature.reserve(plan.signature.size());
    walk.expect = &plan.signature;
    walk.publish = [s = stream.get()](size_t i, const void* data) { s->Publish(i, data); };
    const bool walked = python::WalkForPlan(targets, plan.walk_index.size(), &walk);
    walk.expect = nullptr;
    walk.publish = nullptr;
    // The walk compared the signature up to its last tensor as it published: the rest here.
    const size_t done = walk.expect_checked;
    const bool same = walked && walk.signature.size() == plan.signature.size() &&
                      done <= plan.signature.size() &&
                      std::memcmp(walk.signature.data() + done, plan.signature.data() + done,
                                  plan.signature.size() - done) == 0;
    if (!same) {
      nb::gil_scoped_release release;
      (void)stream->Finish(false, nullptr);
      stream.reset();
      return std::nullopt;
    }
    // The plan's fills (their destinations published by the walk) go on in `f`: moving the
    // vectors keeps their buffers, which the stream holds.
    Fills f = FillsFromPlan(walk, targets);
    Result<MemorySnapshot> r = Status(StatusCode::kCancelled, "");
    {
      nb::gil_scoped_release release;
      r = stream->Finish(true, KnownExtras(f));
      stream.reset();
    }
    std::optional<Loaded> out = ToPython(std::move(r), unpickler, &f);
    KeepRestorePlan(&f);
    return out;
  }

  Fills MakeFills(bool in_place, nb::handle targets) {
    Fills out;
    restore_reused_plan_ = false;
    restore_whole_ = false;  // also when this load fails before ToPython
    if (!in_place || !targets.is_valid() || targets.is_none()) return out;
    out.planned = true;
    python::PlanWalk walk;
    if (restore_plan_) walk.signature.reserve(restore_plan_->signature.size());
    const bool walked =
        python::WalkForPlan(targets, restore_plan_ ? restore_plan_->walk_index.size() : 0, &walk);
    if (walked && restore_plan_ && walk.signature == restore_plan_->signature) {
      return FillsFromPlan(walk, targets);
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
      // A plan that covers every tensor of the walk, in its order, keeps the extras the targets
      // flatten to: a later load whose snapshot has the same may return the targets themselves.
      bool whole = out.fills.size() == walk.data.size();
      for (size_t i = 0; whole && i < out.walk_index.size(); ++i) whole = out.walk_index[i] == i;
      if (whole) {
        Result<std::string> extras = EncodeExtras(flat.skeleton);
        if (extras.ok()) out.extras = std::move(*extras);
      }
    } else {
      out.walk_index.clear();
    }
    return out;
  }

  // The extras a load in place may skip decoding: the reused plan's, when it covers the state.
  static const std::string* KnownExtras(const Fills& f) {
    return f.whole_candidate ? &f.extras : nullptr;
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
    plan.extras = std::move(f->extras);
    for (TensorFill& x : plan.fills) {
      x.hint = x.entry >= 0 ? x.entry : x.hint;
      x.entry = -1;
      x.dst = nullptr;
    }
    restore_plan_ = std::move(plan);
  }

  // A memory snapshot as load() returns it; None when there is none. Tensors the load filled in
  // place come back as their targets (restore then finds nothing to copy for them); when it
  // filled the whole state (LastRestoreWhole), the state is the targets themselves.
  std::optional<Loaded> ToPython(Result<MemorySnapshot> r, nb::handle unpickler,
                                 const Fills* fills = nullptr) {
    restore_whole_ = false;
    if (!r.ok() && r.status().code() == StatusCode::kNotFound) return std::nullopt;
    MemorySnapshot s = Unwrap(std::move(r));
    if (s.extras_known) {
      // The snapshot's skeleton is the targets' (same bytes): with every tensor filled from the
      // image entry of its own index, rebuilding it would give the targets' tree back, each
      // tensor being the target itself and each other value an equal one.
      const size_t n = s.reader.tensors().size();
      bool whole = fills != nullptr && fills->whole_candidate && fills->targets.is_valid() &&
                   fills->fills.size() == n && fills->walk_index.size() == n;
      for (size_t i = 0; whole && i < n; ++i) {
        whole = fills->fills[i].entry == static_cast<int64_t>(i) && fills->walk_index[i] == i;
      }
      if (whole) {
        Loaded out;
        out.step = s.reader.meta().step;
        out.world_size = s.reader.meta().world_size;
        out.job = s.reader.meta().job;
        out.state = fills->targets;
        out.source = s.image.source;
        restore_whole_ = true;
        return out;
      }
      s.extras = Unwrap(DecodeExtras(s.reader.extras(), n, s.image.source));
    }
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
            if (b.tensors()[idx].spec.elsewhere) continue;  // another rank's slot holds it
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
  bool restore_whole_ = false;  // LastRestoreWhole
  bool reused_plan_ = false;
  std::unique_ptr<Pending> pending_;  // a save begun by SaveBegin
};

}  // namespace

void BindClient(nb::module_& m) {
  nb::class_<SnapshotResult>(m, "SnapshotResult", "What Client.save() did")
      .def_ro("saved", &SnapshotResult::saved)
      .def_ro("persist_requested", &SnapshotResult::persist_requested)
      .def_ro("slot", &SnapshotResult::slot)
      .def_ro("image_bytes", &SnapshotResult::image_bytes)
      .def_ro("copy_seconds", &SnapshotResult::copy_seconds)
      .def_ro("wait_seconds", &SnapshotResult::wait_seconds)
      .def_ro("create_seconds", &SnapshotResult::create_seconds)
      .def_ro("agent_error", &SnapshotResult::agent_error);
  nb::class_<SlotView>(m, "SlotInfo", "A snapshot slot in shared memory")
      .def_ro("slot", &SlotView::slot)
      .def_ro("state", &SlotView::state)
      .def_ro("leased", &SlotView::leased)
      .def_ro("step", &SlotView::step)
      .def_ro("image_bytes", &SlotView::image_bytes)
      .def_ro("capacity", &SlotView::capacity)
      .def_ro("complete_time_ns", &SlotView::complete_time_ns)
      .def_ro("attempt", &SlotView::attempt);
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
      .def("last_restore_whole", &PyClient::LastRestoreWhole)
      .def("notify", &PyClient::Notify, "skip"_a, "step"_a = 0, "seconds"_a.none() = nb::none(),
           "bytes"_a = 0,
           "tells the agent of the last save made with notify=False, in one message that "
           "carries the save's report (`seconds` it blocked, its `bytes`) when given")
      .def("structure_hash", &PyClient::StructureHash)
      .def("set_copy_skip", &PyClient::SetCopySkip, "skip"_a,
           "tensors (index ranges of the last save's plan) that other ranks of this node keep: "
           "the next saves of the same structure leave them out of this rank's snapshot")
      .def("last_copy_skip", &PyClient::LastCopySkip)
      .def("fill_from_siblings", &PyClient::FillFromSiblings, "step"_a, "attempt"_a, "elsewhere"_a,
           "fills a load's elsewhere tensors from other ranks' snapshots on this node; returns "
           "the names left unfilled")
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
      .def("heal_from", &PyClient::HealFrom, "address"_a, "node"_a, "job"_a, "secret_hex"_a,
           "step"_a, "timeout"_a,
           "has the agent fetch this rank's snapshot of `step` from another job's agent (a "
           "torchft heal) into a slot of this rank; a load of the step then reads it")
      .def("pause_replication", &PyClient::PauseReplication, "paused"_a)
      .def("report", &PyClient::Report, "event"_a, "step"_a, "saved"_a, "seconds"_a, "bytes"_a,
           "source"_a = "", "error"_a = "", "level"_a = "",
           "tells the agent what this process saw (save, restore, checksum, start), for its "
           "metrics, event log and the job's measurement history")
      .def("last_persist_step", &PyClient::LastPersistStep)
      .def("last_persisted", &PyClient::LastPersisted,
           "(step, seconds) of the agent's newest write of this rank's snapshot to storage, read "
           "from shared memory; None when none is recorded")
      .def("shm_bytes", &PyClient::ShmBytes)
      .def("usable_slots", &PyClient::UsableSlots)
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
}

}  // namespace safepoint::python
