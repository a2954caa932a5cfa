// safepoint._core: names and paths of the checkpoint layout, tensor identity, staging files
// (format_bindings.h). The GIL is released around storage calls.
#include "format_bindings.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "errors.h"
#include "safepoint/checkpoint.h"
#include "safepoint/image.h"
#include "shm/arena.h"
#include "shm/stage_file.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace safepoint::python {

namespace {

// Runs f(store) on the checkpoint directory at `path` with the GIL released.
template <typename F>
auto WithStore(const std::string& path, F&& f) -> decltype(f(std::declval<CheckpointStore&>())) {
  nb::gil_scoped_release release;
  auto store = OpenCheckpointStore(path);
  if (!store.ok()) return store.status();
  return f(**store);
}

// `name` (an object name) under the checkpoint directory `path` (a path or a URI), as a user
// names it. Pure string work: nothing is opened or created.
std::string Join(std::string path, std::string_view name) {
  while (path.size() > 1 && path.back() == '/' && !path.ends_with("//")) path.pop_back();
  if (!path.ends_with('/')) path += '/';
  return path + std::string(name);
}

// The step directory of `step`: `step-` and the step in 20 digits.
std::string StepPath(const std::string& path, uint64_t step) {
  std::string prefix = StepPrefix(step);
  prefix.pop_back();  // the trailing '/'
  return Join(path, prefix);
}

// "<root>/step-<N>" (any number of digits, as DCP's checkpoint_id may spell it, or the 20 of a
// step directory) -> (root, N); nullopt for any other path.
std::optional<std::pair<std::string, uint64_t>> SplitStepPath(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  const size_t slash = path.rfind('/');
  const std::string leaf = slash == std::string::npos ? path : path.substr(slash + 1);
  constexpr std::string_view kPrefix = "step-";
  const std::string digits = leaf.substr(std::min(leaf.size(), kPrefix.size()));
  if (!leaf.starts_with(kPrefix) || digits.empty() || digits.size() > 20 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;
  }
  const std::string padded = std::string(20 - digits.size(), '0') + digits;
  const std::optional<uint64_t> step = StepFromObjectName(std::string(kPrefix) + padded + "/");
  if (!step) return std::nullopt;  // does not fit 64 bits
  std::string root = slash == std::string::npos ? "." : path.substr(0, slash);
  if (root.empty() || root.ends_with("://")) root += '/';  // "/step-1", "file:///step-1"
  return std::make_pair(root, *step);
}

std::string ImagePath(const std::string& path, uint64_t step, uint32_t rank) {
  return Join(path, ImageObjectName(step, rank));
}

// Ranks whose image of `step` is published, committed or not, of any save attempt.
std::vector<uint32_t> ImageRanks(const std::string& path, uint64_t step) {
  return Unwrap(WithStore(path, [&](CheckpointStore& s) -> Result<std::vector<uint32_t>> {
    SP_ASSIGN_OR_RETURN(auto objects, s.storage().List(StepPrefix(step)));
    std::vector<uint32_t> ranks;
    for (const ObjectInfo& o : objects) {
      unsigned rank = 0;
      const std::string leaf = o.name.substr(StepPrefix(step).size());
      if (std::sscanf(leaf.c_str(), "rank-%u.img", &rank) == 1 &&
          o.name == ImageObjectName(step, rank)) {
        ranks.push_back(rank);
      }
    }
    return ranks;
  }));
}

void DeleteStep(const std::string& path, uint64_t step) {
  Unwrap(WithStore(path, [&](CheckpointStore& s) -> Result<bool> {
    SP_RETURN_IF_ERROR(s.DeleteStep(step));
    return true;
  }));
}

// (object path, offset of the tensor's data in it, bytes) of tensor `name` in rank's image of a
// committed step: where a test that damages an image on purpose finds its bytes.
nb::tuple TensorExtent(const std::string& path, uint64_t step, uint32_t rank,
                       const std::string& name) {
  using Extent = std::tuple<std::string, uint64_t, uint64_t>;
  auto r = WithStore(path, [&](CheckpointStore& s) -> Result<Extent> {
    SP_ASSIGN_OR_RETURN(auto commit, s.ReadCommit(step));
    SP_ASSIGN_OR_RETURN(auto md, s.ReadMetadata(commit, rank));
    for (const TensorEntry& e : md.tensors) {
      if (e.spec.name == name) return Extent{md.source, e.offset, e.nbytes};
    }
    return NotFound(md.source + ": no tensor named '" + name + "'");
  });
  auto [object, offset, nbytes] = Unwrap(std::move(r));
  return nb::make_tuple(object, offset, nbytes);
}

nb::bytes PyReplicaKey(const std::string& name, const std::string& dtype,
                       std::vector<uint64_t> shape,
                       std::optional<std::vector<uint64_t>> global_shape,
                       std::optional<std::vector<uint64_t>> global_offset) {
  TensorSpec spec;
  spec.name = name;
  spec.dtype = Unwrap(DTypeFromName(dtype));
  spec.shape = std::move(shape);
  spec.global_shape = global_shape.value_or(std::vector<uint64_t>{});
  spec.global_offset = global_offset.value_or(std::vector<uint64_t>{});
  const std::string key = ReplicaKey(spec);
  return nb::bytes(key.data(), key.size());
}

// The state of every slot file in a job directory ("FREE", "WRITING", "COMPLETE"), read from
// the control blocks as the agent reads them: for tests that watch a writer from outside.
std::vector<std::string> SlotStates(const std::string& job_dir) {
  auto states = [&]() -> Result<std::vector<std::string>> {
    nb::gil_scoped_release release;
    std::vector<std::string> out;
    auto ranks = ListArenaRanks(job_dir);
    if (!ranks.ok() && ranks.status().code() == StatusCode::kNotFound) return out;
    SP_RETURN_IF_ERROR(ranks.status());
    for (uint32_t rank : *ranks) {
      auto arena = Arena::Open(job_dir, rank);
      if (!arena.ok() && arena.status().code() == StatusCode::kNotFound) continue;  // removed
      SP_RETURN_IF_ERROR(arena.status());
      for (const SlotInfo& slot : (*arena)->Slots()) {
        if (slot.capacity > 0) out.emplace_back(SlotStateName(slot.state));  // the file exists
      }
    }
    return out;
  }();
  return Unwrap(std::move(states));
}

// A staging file held by Python: buffers handed out keep the mapping alive after close().
class PyStageFile {
 public:
  PyStageFile(const std::string& shm_dir, uint64_t nbytes) {
    Result<std::unique_ptr<internal::StageFile>> f = Status(StatusCode::kCancelled, "");
    {
      nb::gil_scoped_release release;  // reserving and pre-faulting takes a while
      f = internal::StageFile::Create(shm_dir, nbytes);
    }
    file_ = std::shared_ptr<internal::StageFile>(Unwrap(std::move(f)).release());
  }
  const std::string& path() const { return file_->path(); }
  uint64_t nbytes() const { return file_->data().size(); }

  // The file's bytes as a writable numpy uint8 array.
  nb::object Buffer() const {
    auto* keep = new std::shared_ptr<internal::StageFile>(file_);
    nb::capsule owner(keep, [](void* p) noexcept {
      delete static_cast<std::shared_ptr<internal::StageFile>*>(p);
    });
    size_t shape[1] = {file_->data().size()};
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(
               reinterpret_cast<uint8_t*>(file_->data().data()), 1, shape, owner)
        .cast();
  }

  void Remove() {
    Status s = file_->Remove();
    if (!s.ok()) ThrowStatus(s);
  }

 private:
  std::shared_ptr<internal::StageFile> file_;
};

std::pair<uint64_t, uint64_t> RemoveDeadStageFiles(const std::string& shm_dir, bool dry_run) {
  Result<internal::StageFilesRemoved> r = Status(StatusCode::kCancelled, "");
  {
    nb::gil_scoped_release release;
    r = internal::RemoveDeadStageFiles(shm_dir, dry_run);
  }
  const auto removed = Unwrap(std::move(r));
  return {removed.files, removed.bytes};
}

}  // namespace

void BindFormat(nb::module_& m) {
  nb::list dtypes;  // the dtype names images store natively, as torch names them
  for (int code = 1; code < 256; ++code) {
    if (IsValidDType(static_cast<uint8_t>(code))) {
      dtypes.append(std::string(DTypeName(static_cast<DType>(code))));
    }
  }
  m.attr("DTYPES") = nb::tuple(dtypes);
  m.attr("CHUNK_SIZE") = kDefaultChunkSize;        // an image's checksum chunk
  m.attr("SLOT_HEADER_BYTES") = kSlotHeaderBytes;  // a slot file's image starts here
  m.def("step_path", &StepPath, "path"_a, "step"_a);
  m.def("split_step_path", &SplitStepPath, "path"_a);
  m.def("image_path", &ImagePath, "path"_a, "step"_a, "rank"_a);
  m.def("image_ranks", &ImageRanks, "path"_a, "step"_a);
  m.def("delete_step", &DeleteStep, "path"_a, "step"_a);
  m.def("tensor_extent", &TensorExtent, "path"_a, "step"_a, "rank"_a, "name"_a);
  m.def("slot_states", &SlotStates, "job_dir"_a);
  m.def("replica_key", &PyReplicaKey, "name"_a, "dtype"_a, "shape"_a, "global_shape"_a.none(),
        "global_offset"_a.none());
  nb::class_<PyStageFile>(m, "StageFile")
      .def(nb::init<const std::string&, uint64_t>(), "shm_dir"_a, "nbytes"_a)
      .def_prop_ro("path", &PyStageFile::path)
      .def_prop_ro("nbytes", &PyStageFile::nbytes)
      .def("buffer", &PyStageFile::Buffer)
      .def("remove", &PyStageFile::Remove);
  m.def("remove_dead_stage_files", &RemoveDeadStageFiles, "shm_dir"_a, "dry_run"_a = false);
}

}  // namespace safepoint::python
