// safepoint._core: checkpoints on storage (store_bindings.h): save and load of one rank's image,
// the committed steps, and partial reads of images (resharding, tensors other ranks wrote, DCP).
// The state tree is walked in C++ (state.cc); the core runs with the GIL released.
#include "store_bindings.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "errors.h"
#include "safepoint/client.h"
#include "safepoint/storage.h"
#include "state.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace safepoint::python {

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

Loaded LoadedToPython(const LoadedImage& image, const ImageReader& reader, const Value& extras,
                      nb::handle unpickler, const std::vector<nb::object>* filled) {
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
  out.attempt = reader.meta().attempt;
  nb::list elsewhere;
  out.state = python::RebuildState(extras, buffer, reader, unpickler, &elsewhere, filled);
  out.elsewhere = elsewhere;
  out.source = image.source;
  return out;
}

namespace {

// --- results: small bound classes (typed in the generated _core.pyi) ------------------------

// A tensor of an image's index.
struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::optional<std::vector<uint64_t>> global_shape;  // None: a whole tensor, not a shard
  std::optional<std::vector<uint64_t>> global_offset;
  uint64_t nbytes = 0;
  bool elsewhere = false;  // held by another rank's image
  // Where its data starts in the image (checksum chunks are the image's chunk_size-byte pieces
  // from byte 0): a reader aligns its buffers and splits its reads by it.
  uint64_t offset = 0;
};

// read_metadata(): one rank's image of a step without its tensor data.
struct ShardMetadata {
  uint64_t step = 0;
  uint32_t world_size = 0;
  std::vector<TensorInfo> tensors;
  nb::object extras;  // the state tree, each tensor a TensorSlot
};

// A step's COMMIT record: one that a ShardReader (or step_commit) read, handed to the readers of
// the step's other images (ShardReader.commit), so that a rank that opens several images of a
// step reads the record once and opens the checkpoint path once (the readers share its store);
// or the record the restore agreement's lister read, whose bytes it handed to every rank
// (commit_from_bytes), so that a rank reads no COMMIT record at all.
struct Commit {
  CommitRecord record;
  std::shared_ptr<CheckpointStore> store;
  std::string path;
};

// --- save / load -----------------------------------------------------------------------------

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

// `commit`: the step's record, already read (commit_from_bytes): only the image is read, and
// checked against it (used where it is of `step`).
Loaded Load(const std::string& path, std::optional<uint64_t> step, uint32_t rank,
            nb::handle unpickler, const Commit* commit) {
  Result<LoadedShard> shard = Status(StatusCode::kCancelled, "not loaded");
  {
    nb::gil_scoped_release release;
    auto store = OpenCheckpointStore(path);
    if (!store.ok()) {
      shard = store.status();
    } else if (commit != nullptr && step && commit->record.step == *step) {
      shard = LoadShard(**store, commit->record, rank);
    } else {
      shard = LoadShard(**store, step, rank);
    }
  }
  LoadedShard s = Unwrap(std::move(shard));
  Loaded out = LoadedToPython(s.image, s.reader, s.extras, unpickler);
  out.skipped = s.skipped;
  out.generation = s.commit.generation;
  return out;
}

// Another job's snapshot on this node, read from its slot files (ReadNodeSnapshot).
Loaded ReadNodeSnapshot(const std::string& shm_dir, const std::string& job, uint32_t rank,
                        uint64_t step, double timeout_s, nb::handle unpickler) {
  Result<MemorySnapshot> r = Status(StatusCode::kCancelled, "not read");
  {
    nb::gil_scoped_release release;
    r = safepoint::ReadNodeSnapshot(shm_dir, job, rank, step, timeout_s);
  }
  MemorySnapshot s = Unwrap(std::move(r));
  return LoadedToPython(s.image, s.reader, s.extras, unpickler);
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

// What the restore agreement's lister (one rank of the job) asks a storage: the steps with a
// COMMIT object (one List, no record read) and the newest valid record among them, read newest
// first (one read where the newest is intact); the damaged records passed over, one line each.
// Returns (steps, newest valid step or None, problems, that step's record as stored: its bytes,
// which the lister hands to the ranks, empty when none). Unlike steps(), the older steps'
// records are not read: a damaged one among them fails the read of that step, and the ranks fall
// back.
std::tuple<std::vector<uint64_t>, std::optional<uint64_t>, std::vector<std::string>, nb::bytes>
CommittedView(const std::string& path) {
  std::vector<uint64_t> steps;
  std::optional<uint64_t> newest;
  std::vector<std::string> problems;
  std::string record_bytes;
  Status s = WithoutGil([&]() -> Status {
    SP_ASSIGN_OR_RETURN(auto store, OpenCheckpointStore(path));
    SP_ASSIGN_OR_RETURN(steps, store->StepsWithCommit());
    SP_ASSIGN_OR_RETURN(std::optional<CommitRecord> record,
                        store->NewestCommitted(steps, &problems));
    if (record) {
      newest = record->step;
      record_bytes = EncodeCommitRecord(*record);
    }
    return Status::OK();
  });
  Check(s);
  return {std::move(steps), newest, std::move(problems),
          nb::bytes(record_bytes.data(), record_bytes.size())};
}

// A COMMIT record of the storage at `path` from its bytes as another rank read them
// (committed_view), checked by its CRC (CorruptionError otherwise): the readers of the step's
// images check each image against it as against a record they read themselves.
Commit CommitFromBytes(const std::string& path, nb::bytes data) {
  Commit c;
  c.path = path;
  const auto* p = static_cast<const std::byte*>(data.data());
  c.record = Unwrap(DecodeCommitRecord(std::span(p, data.size()), path + ": the handed COMMIT"));
  return c;
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
  // `commit`: the step's record another reader of it read (none: read it here).
  ShardReader(const std::string& path, uint64_t step, uint32_t rank, const Commit* commit)
      : path_(path) {
    Status s = WithoutGil([&]() -> Status {
      if (commit != nullptr && commit->store && commit->path == path) {
        store_ = commit->store;
      } else {
        SP_ASSIGN_OR_RETURN(store_, OpenCheckpointStore(path));
      }
      if (commit != nullptr && commit->record.step == step) {
        commit_ = commit->record;
      } else {
        SP_ASSIGN_OR_RETURN(commit_, store_->ReadCommit(step));
      }
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
  Commit commit() const { return Commit{commit_, store_, path_}; }
  // The bytes of one checksum chunk: a read of part of a chunk reads and verifies all of it.
  uint64_t chunk_size() const { return md_.layout.chunk_size; }

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
      t.offset = e.offset;
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
  std::string path_;
  std::shared_ptr<CheckpointStore> store_;
  CommitRecord commit_;
  CheckpointStore::Metadata md_;
  std::unordered_map<std::string, size_t> by_name_;
};

// A step's COMMIT record and the store to read its images through, for ShardReaders opened one
// by one as a restore finds it needs them (_shards.StepReader).
Commit StepCommit(const std::string& path, uint64_t step) {
  Commit c;
  c.path = path;
  Check(WithoutGil([&]() -> Status {
    SP_ASSIGN_OR_RETURN(c.store, OpenCheckpointStore(path));
    SP_ASSIGN_OR_RETURN(c.record, c.store->ReadCommit(step));
    return Status::OK();
  }));
  return c;
}

ShardMetadata ReadMetadata(const std::string& path, uint64_t step, uint32_t rank,
                           nb::handle unpickler) {
  ShardReader r(path, step, rank, nullptr);
  return ShardMetadata{r.step(), r.world_size(), r.Tensors(), r.State(unpickler)};
}

void ReadRanges(const std::string& path, uint64_t step, uint32_t rank, nb::list requests) {
  ShardReader(path, step, rank, nullptr).Read(requests);
}

}  // namespace

void BindStore(nb::module_& m) {
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
      .def_ro("attempt", &Loaded::attempt)
      .def_ro("skipped", &Loaded::skipped);
  nb::class_<TensorInfo>(m, "TensorInfo", "A tensor of an image's index (no data)")
      .def_ro("name", &TensorInfo::name)
      .def_ro("dtype", &TensorInfo::dtype)
      .def_ro("shape", &TensorInfo::shape)
      .def_ro("global_shape", &TensorInfo::global_shape)
      .def_ro("global_offset", &TensorInfo::global_offset)
      .def_ro("nbytes", &TensorInfo::nbytes)
      .def_ro("elsewhere", &TensorInfo::elsewhere)
      .def_ro("offset", &TensorInfo::offset);
  nb::class_<ShardMetadata>(m, "ShardMetadata", "One rank's image of a step, without tensor data")
      .def_ro("step", &ShardMetadata::step)
      .def_ro("world_size", &ShardMetadata::world_size)
      .def_ro("tensors", &ShardMetadata::tensors)
      .def_ro("extras", &ShardMetadata::extras);
  m.def("save", &Save, "path"_a, "step"_a, "rank"_a, "world_size"_a, "job"_a, "state"_a,
        "pickler"_a.none() = nb::none(), "attempt"_a = 0, "overwrite"_a = false,
        "parent_step"_a.none() = nb::none(), "parent_location"_a = "", "metadata"_a = "",
        "compression"_a = "none", "incremental"_a = false);
  m.def("load", &Load, "path"_a, "step"_a.none(), "rank"_a, "unpickler"_a.none() = nb::none(),
        "commit"_a.none() = nb::none());
  m.def("steps", &Steps, "path"_a);
  m.def("read_node_snapshot", &ReadNodeSnapshot, "shm_dir"_a, "job"_a, "rank"_a, "step"_a,
        "timeout"_a, "unpickler"_a.none() = nb::none(),
        "rank's snapshot of step of another job on this node, read from its slot files and "
        "verified, waiting up to timeout seconds for it to be taken (NotFoundError after)");
  m.def("committed_view", &CommittedView, "path"_a,
        "(steps with a COMMIT object, newest valid step or None, damaged records skipped): one "
        "List and the COMMIT records newest first down to the first valid one; and that record's "
        "bytes (empty when none), for commit_from_bytes on the other ranks");
  nb::class_<Commit>(m, "Commit", "A step's COMMIT record, as a ShardReader read it")
      .def_prop_ro("step", [](const Commit& c) { return c.record.step; })
      .def_prop_ro("generation", [](const Commit& c) { return c.record.generation; })
      .def_prop_ro("world_size", [](const Commit& c) { return c.record.world_size; });
  m.def("commit_from_bytes", &CommitFromBytes, "path"_a, "data"_a,
        "A COMMIT record of the storage at path from the bytes another rank read "
        "(committed_view), checked by its CRC: open the step's images against it");
  m.def("step_commit", &StepCommit, "path"_a, "step"_a,
        "The COMMIT record of a step (NotFoundError when it is not committed), to open its "
        "images' ShardReaders with one by one, sharing one open checkpoint path");
  nb::class_<TensorSlot>(m, "TensorSlot")
      .def(nb::init<size_t>(), "index"_a)
      .def_ro("index", &TensorSlot::index)
      .def("__repr__",
           [](const TensorSlot& t) { return "TensorSlot(" + std::to_string(t.index) + ")"; });
  nb::class_<ShardReader>(m, "ShardReader")
      .def(nb::init<const std::string&, uint64_t, uint32_t, const Commit*>(), "path"_a, "step"_a,
           "rank"_a, "commit"_a.none() = nb::none())
      .def_prop_ro("commit", &ShardReader::commit)
      .def_prop_ro("step", &ShardReader::step)
      .def_prop_ro("rank", &ShardReader::rank)
      .def_prop_ro("world_size", &ShardReader::world_size)
      .def_prop_ro("generation", &ShardReader::generation)
      .def_prop_ro("chunk_size", &ShardReader::chunk_size)
      .def("tensors", &ShardReader::Tensors)
      .def("state", &ShardReader::State, "unpickler"_a.none() = nb::none())
      .def("read", &ShardReader::Read, "requests"_a);
  m.def("read_metadata", &ReadMetadata, "path"_a, "step"_a, "rank"_a,
        "unpickler"_a.none() = nb::none());
  m.def("read_ranges", &ReadRanges, "path"_a, "step"_a, "rank"_a, "requests"_a);
  m.def(
      "storage_requests",
      []() {
        nb::dict out;
        for (const auto& [scheme, c] : StorageRequestCountsByScheme()) {
          nb::dict d;
          d["list"] = c.list;
          d["head"] = c.head;
          d["get"] = c.get;
          d["create"] = c.create;
          d["write"] = c.write;
          d["put"] = c.put;
          d["delete"] = c.del;
          d["cleanup"] = c.cleanup;
          d["requests"] = c.requests();
          d["metadata_bytes"] = c.metadata_bytes;
          d["data_bytes_read"] = c.data_bytes_read;
          d["data_bytes_written"] = c.data_bytes_written;
          out[nb::str(scheme.c_str())] = d;
        }
        return out;
      },
      "Storage requests this process made since it started, by URI scheme "
      "(docs/operations.md, \"Storage requests\").");
}

}  // namespace safepoint::python
