// safepoint._core: the nanobind binding of the C++ core.
//
// The state tree is walked in C++ (state.cc: no Python code per tensor), the core runs with the
// GIL released, and every C++ Status becomes a Python exception here, in ThrowStatus(), and
// nowhere else.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "safepoint/build_config.h"
#include "safepoint/agent.h"
#include "safepoint/checkpoint.h"
#include "safepoint/client.h"
#include "safepoint/extras.h"
#include "safepoint/image.h"
#include "state.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace safepoint {
namespace python {

[[noreturn]] void ThrowStatus(const Status& s) {
  static const char* kNames[] = {"Error", "NotFoundError", "CorruptionError", "StorageError",
                                 "InvalidArgumentError", "UnavailableError",
                                 "ResourceExhaustedError", "CancelledError", "AlreadyExistsError"};
  const int code = static_cast<int>(s.code());
  const char* name = (code >= 0 && code < 9) ? kNames[code] : "Error";
  nb::object cls = nb::module_::import_("safepoint.errors").attr(name);
  PyErr_SetString(cls.ptr(), s.message().c_str());
  throw nb::python_error();
}

}  // namespace python

namespace {

using python::ThrowStatus;

template <typename T>
T Unwrap(Result<T> r) {
  if (!r.ok()) ThrowStatus(r.status());
  return std::move(r).value();
}

void Check(const Status& s) {
  if (!s.ok()) ThrowStatus(s);
}

// --- save / load -----------------------------------------------------------------------------

nb::dict Save(const std::string& path, uint64_t step, uint32_t rank, uint32_t world_size,
              const std::string& job, nb::handle state, nb::handle pickler) {
  ImageMeta meta;
  meta.job = job;
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
      auto r = SaveShard(**store, std::move(meta), std::move(sources), std::move(extras));
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
  nb::dict out;
  out["bytes"] = result.bytes;
  out["write_seconds"] = result.write_seconds;
  out["committed"] = result.committed;
  return out;
}

// What load() returns to Python: the step and the state, whose tensors are views into the loaded
// image (zero copy, zero parse), kept alive through a numpy array that owns the image.
nb::dict LoadedToPython(const LoadedImage& image, const ImageReader& reader, const Value& extras,
                        nb::handle unpickler) {
  auto* keep = new std::shared_ptr<std::byte>(image.buffer);
  nb::capsule owner(keep, [](void* p) noexcept {
    delete static_cast<std::shared_ptr<std::byte>*>(p);
  });
  size_t shape[1] = {image.size};
  nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> array(
      reinterpret_cast<uint8_t*>(image.buffer.get()), 1, shape, owner);
  nb::object buffer = array.cast();
  nb::dict out;
  out["step"] = reader.meta().step;
  out["world_size"] = reader.meta().world_size;
  out["job"] = reader.meta().job;
  out["state"] = python::RebuildState(extras, buffer, reader, unpickler);
  out["source"] = image.source;
  return out;
}

nb::dict Load(const std::string& path, std::optional<uint64_t> step, uint32_t rank,
              nb::handle unpickler) {
  Result<LoadedShard> shard = Status(StatusCode::kCancelled, "not loaded");
  {
    nb::gil_scoped_release release;
    auto store = OpenCheckpointStore(path);
    shard = store.ok() ? LoadShard(**store, step, rank) : Result<LoadedShard>(store.status());
  }
  LoadedShard s = Unwrap(std::move(shard));
  nb::dict out = LoadedToPython(s.image, s.reader, s.extras, unpickler);
  nb::list skipped;
  for (const auto& m : s.skipped) skipped.append(m);
  out["skipped"] = skipped;
  return out;
}

std::vector<uint64_t> Steps(const std::string& path) {
  Result<std::vector<CommitRecord>> committed = Status(StatusCode::kCancelled, "not listed");
  {
    nb::gil_scoped_release release;
    auto store = OpenCheckpointStore(path);
    committed = store.ok() ? (*store)->ListCommitted()
                           : Result<std::vector<CommitRecord>>(store.status());
  }
  std::vector<uint64_t> out;
  for (const auto& c : Unwrap(std::move(committed))) out.push_back(c.step);
  return out;
}

// --- flash checkpoints: the client of the node agent --------------------------------------------

// Runs f with the GIL released (the core never calls back into Python).
template <typename F>
auto WithoutGil(F&& f) {
  nb::gil_scoped_release release;
  return f();
}

class PyClient {
 public:
  PyClient(const std::string& storage, const std::string& job, const std::string& shm_dir,
           uint32_t rank, uint32_t world_size, uint32_t keep, bool wait_when_busy,
           const std::string& agent_binary) {
    ClientOptions o;
    o.storage = storage;
    o.job = job;
    o.shm_dir = shm_dir;
    o.rank = rank;
    o.world_size = world_size;
    o.keep = keep;
    o.wait_when_busy = wait_when_busy;
    o.agent_binary = agent_binary;
    Result<std::unique_ptr<SnapshotClient>> c = Status(StatusCode::kCancelled, "");
    {
      nb::gil_scoped_release release;
      c = SnapshotClient::Connect(std::move(o));
    }
    client_ = Unwrap(std::move(c));
  }

  nb::dict Save(uint64_t step, nb::handle state, bool persist, nb::handle pickler) {
    python::FlatState flat = python::FlattenState(state, pickler);
    std::string extras = Unwrap(EncodeExtras(flat.skeleton));
    std::vector<TensorSource> sources = std::move(flat.tensors);
    Result<SnapshotResult> r = Status(StatusCode::kCancelled, "");
    {
      nb::gil_scoped_release release;
      r = Get().Save(step, std::move(sources), std::move(extras), persist);
    }
    SnapshotResult s = Unwrap(std::move(r));
    nb::dict out;
    out["saved"] = s.saved;
    out["persist_requested"] = s.persist_requested;
    out["slot"] = s.slot;
    out["image_bytes"] = s.image_bytes;
    out["copy_seconds"] = s.copy_seconds;
    out["wait_seconds"] = s.wait_seconds;
    out["create_seconds"] = s.create_seconds;
    out["agent_error"] = s.agent_error;
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

  nb::object LoadNewest(std::optional<uint64_t> min_step, nb::handle unpickler) {
    return ToPython(WithoutGil([&] { return Get().LoadNewest(min_step); }), unpickler);
  }

  nb::object LoadStep(uint64_t step, nb::handle unpickler) {
    return ToPython(WithoutGil([&] { return Get().LoadStep(step); }), unpickler);
  }

  nb::list Slots() {
    nb::list out;
    Check(Get().arena().Refresh());
    for (const SlotInfo& s : Get().arena().Slots()) {
      nb::dict d;
      d["slot"] = s.index;
      d["state"] = std::string(SlotStateName(s.state));
      d["leased"] = s.leased;
      d["step"] = s.step;
      d["image_bytes"] = s.image_size;
      d["capacity"] = s.capacity;
      out.append(d);
    }
    return out;
  }

  std::optional<uint64_t> LastPersistStep() { return Get().last_persist_step(); }

  void Close(double timeout_s) {
    if (!client_) return;
    Status s;
    {
      nb::gil_scoped_release release;
      s = client_->Close(timeout_s);
    }
    client_.reset();
    Check(s);
  }

  void Abandon() { client_.reset(); }  // drop the connection without a clean close

 private:
  // A memory snapshot as load() returns it; None when there is none.
  static nb::object ToPython(Result<MemorySnapshot> r, nb::handle unpickler) {
    if (!r.ok() && r.status().code() == StatusCode::kNotFound) return nb::none();
    MemorySnapshot s = Unwrap(std::move(r));
    return LoadedToPython(s.image, s.reader, s.extras, unpickler);
  }

  SnapshotClient& Get() {
    if (!client_) Check(InvalidArgument("the checkpointer is closed"));
    return *client_;
  }
  std::unique_ptr<SnapshotClient> client_;
};

}  // namespace
}  // namespace safepoint

NB_MODULE(_core, m) {
  using namespace safepoint;
  m.doc() = "safepoint's C++ core (internal; use the safepoint package)";
  m.def("save", &Save, "path"_a, "step"_a, "rank"_a, "world_size"_a, "job"_a, "state"_a,
        "pickler"_a.none() = nb::none());
  m.def("load", &Load, "path"_a, "step"_a.none(), "rank"_a, "unpickler"_a.none() = nb::none());
  m.def("steps", &Steps, "path"_a);
  nb::class_<PyClient>(m, "Client")
      .def(nb::init<const std::string&, const std::string&, const std::string&, uint32_t, uint32_t,
                    uint32_t, bool, const std::string&>(),
           "storage"_a, "job"_a, "shm_dir"_a, "rank"_a, "world_size"_a, "keep"_a,
           "wait_when_busy"_a, "agent_binary"_a)
      .def("save", &PyClient::Save, "step"_a, "state"_a, "persist"_a,
           "pickler"_a.none() = nb::none())
      .def("wait", &PyClient::Wait, "timeout"_a)
      .def("agent_status", &PyClient::AgentStatus)
      .def("load_newest", &PyClient::LoadNewest, "min_step"_a.none(),
           "unpickler"_a.none() = nb::none())
      .def("load_step", &PyClient::LoadStep, "step"_a, "unpickler"_a.none() = nb::none())
      .def("slots", &PyClient::Slots)
      .def("last_persist_step", &PyClient::LastPersistStep)
      .def("close", &PyClient::Close, "timeout"_a)
      .def("abandon", &PyClient::Abandon);
  m.attr("__version__") = SAFEPOINT_VERSION;
  m.attr("FORMAT_VERSION") = kImageFormatVersion;
  m.attr("KILL_POINTS") = static_cast<bool>(SAFEPOINT_HAVE_KILL_POINTS);  // crash-test builds only
}
