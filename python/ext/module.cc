// safepoint._core: the nanobind binding of the C++ core.
//
// Thin by design: Python flattens a state tree into a skeleton (non-tensor values with TensorRef
// placeholders) plus a list of contiguous tensors; this module converts the skeleton to the C++
// Value tree, and calls the core with the GIL released. Every C++ Status becomes a Python
// exception here, in ThrowStatus(), and nowhere else.
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

namespace nb = nanobind;
using namespace nb::literals;

namespace safepoint {
namespace {

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

template <typename T>
T Unwrap(Result<T> r) {
  if (!r.ok()) ThrowStatus(r.status());
  return std::move(r).value();
}

void Check(const Status& s) {
  if (!s.ok()) ThrowStatus(s);
}

// --- Python <-> Value ------------------------------------------------------------------------

Value ToValue(nb::handle obj, size_t depth);

ValueList ToItems(nb::handle seq, size_t depth) {
  ValueList items;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  items.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    items.push_back(ToValue(PySequence_Fast_GET_ITEM(seq.ptr(), i), depth + 1));
  }
  return items;
}

Value ToValue(nb::handle obj, size_t depth) {
  if (depth > kMaxExtrasDepth) {
    Check(InvalidArgument("state is nested more than " + std::to_string(kMaxExtrasDepth) +
                          " levels deep"));
  }
  PyObject* o = obj.ptr();
  if (o == Py_None) return Value();
  if (PyBool_Check(o)) return Value(o == Py_True);
  if (PyLong_Check(o)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (!overflow) return Value(static_cast<int64_t>(v));
    nb::int_ x = nb::borrow<nb::int_>(obj);
    nb::object mag = (nb::cast<bool>(x.attr("__lt__")(0))) ? x.attr("__invert__")() : nb::object(x);
    const size_t bits = nb::cast<size_t>(mag.attr("bit_length")());
    const size_t n = (bits + 8) / 8;
    nb::bytes b = nb::borrow<nb::bytes>(x.attr("to_bytes")(n, "little", "signed"_a = true));
    return Value(BigInt{std::string(b.c_str(), b.size())});
  }
  if (PyFloat_Check(o)) return Value(PyFloat_AsDouble(o));
  if (PyUnicode_Check(o)) {
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(o, &n);
    if (s == nullptr) throw nb::python_error();
    return Value(std::string(s, n));
  }
  if (PyBytes_Check(o)) {
    return Value(Bytes{std::string(PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o))});
  }
  if (PyTuple_Check(o)) return Value(Tuple{ToItems(obj, depth)});
  if (PyList_Check(o)) return Value(List{ToItems(obj, depth)});
  if (PyDict_Check(o)) {
    Dict d;
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &k, &v)) {
      if (!(PyUnicode_Check(k) || (PyLong_Check(k) && !PyBool_Check(k)))) {
        Check(InvalidArgument("dict key " + nb::cast<std::string>(nb::repr(k)) +
                              " is not a str or an int"));
      }
      d.items.emplace_back(ToValue(k, depth + 1), ToValue(v, depth + 1));
    }
    return Value(std::move(d));
  }
  if (nb::isinstance<TensorRef>(obj)) return Value(nb::cast<TensorRef>(obj));
  Check(InvalidArgument("cannot store a value of type " +
                        nb::cast<std::string>(nb::str(obj.type().attr("__qualname__")))));
  return Value();
}

nb::object FromValue(const Value& v) {
  struct V {
    nb::object operator()(const std::monostate&) { return nb::none(); }
    nb::object operator()(bool b) { return nb::bool_(b); }
    nb::object operator()(int64_t i) { return nb::int_(i); }
    nb::object operator()(const BigInt& b) {
      nb::bytes raw(b.bytes.data(), b.bytes.size());
      return nb::module_::import_("builtins")
          .attr("int")
          .attr("from_bytes")(raw, "little", "signed"_a = true);
    }
    nb::object operator()(double d) { return nb::float_(d); }
    nb::object operator()(const std::string& s) { return nb::str(s.data(), s.size()); }
    nb::object operator()(const Bytes& b) { return nb::bytes(b.data.data(), b.data.size()); }
    nb::object operator()(const List& l) {
      nb::list out;
      for (const Value& x : l.items) out.append(FromValue(x));
      return out;
    }
    nb::object operator()(const Tuple& t) {
      nb::list out;
      for (const Value& x : t.items) out.append(FromValue(x));
      return nb::tuple(out);
    }
    nb::object operator()(const Dict& d) {
      nb::dict out;
      for (const auto& [k, x] : d.items) out[FromValue(k)] = FromValue(x);
      return out;
    }
    nb::object operator()(const TensorRef& t) { return nb::cast(t); }
  };
  return std::visit(V{}, v.v);
}

std::vector<uint64_t> ToDims(nb::handle seq) {
  std::vector<uint64_t> out;
  for (nb::handle d : seq) {
    const long long x = nb::cast<long long>(d);
    if (x < 0) Check(InvalidArgument("negative dimension"));
    out.push_back(static_cast<uint64_t>(x));
  }
  return out;
}

nb::tuple DimsToTuple(const std::vector<uint64_t>& dims) {
  nb::list l;
  for (uint64_t d : dims) l.append(d);
  return nb::tuple(l);
}

// --- save / load -----------------------------------------------------------------------------

// tensors: list of (name, dtype, shape, data_ptr, nbytes, global_shape|None, global_offset|None)
std::vector<TensorSource> ToSources(nb::list tensors) {
  std::vector<TensorSource> sources;
  sources.reserve(tensors.size());
  for (nb::handle t : tensors) {
    nb::tuple tup = nb::borrow<nb::tuple>(t);
    TensorSource s;
    s.spec.name = nb::cast<std::string>(tup[0]);
    s.spec.dtype = Unwrap(DTypeFromName(nb::cast<std::string>(tup[1])));
    s.spec.shape = ToDims(tup[2]);
    s.data = reinterpret_cast<const void*>(nb::cast<uintptr_t>(tup[3]));
    s.nbytes = nb::cast<uint64_t>(tup[4]);
    if (!tup[5].is_none()) s.spec.global_shape = ToDims(tup[5]);
    if (!tup[6].is_none()) s.spec.global_offset = ToDims(tup[6]);
    sources.push_back(std::move(s));
  }
  return sources;
}

nb::dict Save(const std::string& path, uint64_t step, uint32_t rank, uint32_t world_size,
              const std::string& job, nb::handle skeleton, nb::list tensors) {
  ImageMeta meta;
  meta.job = job;
  meta.step = step;
  meta.rank = rank;
  meta.world_size = world_size;
  std::vector<TensorSource> sources = ToSources(tensors);
  std::string extras = Unwrap(EncodeExtras(ToValue(skeleton, 0)));
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

// What load() returns to Python: the skeleton, the image as one uint8 array and the index; the
// tensors become views into the array (zero copy, zero parse).
nb::dict LoadedToPython(const LoadedImage& image, const ImageReader& reader, const Value& extras) {
  auto* keep = new std::shared_ptr<std::byte>(image.buffer);
  nb::capsule owner(keep, [](void* p) noexcept {
    delete static_cast<std::shared_ptr<std::byte>*>(p);
  });
  size_t shape[1] = {image.size};
  nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> buffer(
      reinterpret_cast<uint8_t*>(image.buffer.get()), 1, shape, owner);

  nb::list entries;
  for (const TensorEntry& e : reader.tensors()) {
    const bool shard_box = !e.spec.global_shape.empty();
    entries.append(nb::make_tuple(
        e.spec.name, std::string(DTypeName(e.spec.dtype)), DimsToTuple(e.spec.shape), e.offset,
        e.nbytes, shard_box ? nb::object(DimsToTuple(e.spec.global_shape)) : nb::none(),
        shard_box ? nb::object(DimsToTuple(e.spec.global_offset)) : nb::none()));
  }
  nb::dict out;
  out["step"] = reader.meta().step;
  out["world_size"] = reader.meta().world_size;
  out["job"] = reader.meta().job;
  out["skeleton"] = FromValue(extras);
  out["buffer"] = buffer.cast();
  out["tensors"] = entries;
  out["source"] = image.source;
  return out;
}

nb::dict Load(const std::string& path, std::optional<uint64_t> step, uint32_t rank) {
  Result<LoadedShard> shard = Status(StatusCode::kCancelled, "not loaded");
  {
    nb::gil_scoped_release release;
    auto store = OpenCheckpointStore(path);
    shard = store.ok() ? LoadShard(**store, step, rank) : Result<LoadedShard>(store.status());
  }
  LoadedShard s = Unwrap(std::move(shard));
  nb::dict out = LoadedToPython(s.image, s.reader, s.extras);
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

  nb::dict Save(uint64_t step, nb::handle skeleton, nb::list tensors, bool persist) {
    std::vector<TensorSource> sources = ToSources(tensors);
    std::string extras = Unwrap(EncodeExtras(ToValue(skeleton, 0)));
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

  nb::object LoadNewest(std::optional<uint64_t> min_step) {
    Result<MemorySnapshot> r = Status(StatusCode::kCancelled, "");
    {
      nb::gil_scoped_release release;
      r = Get().LoadNewest(min_step);
    }
    if (!r.ok() && r.status().code() == StatusCode::kNotFound) return nb::none();
    MemorySnapshot s = Unwrap(std::move(r));
    return LoadedToPython(s.image, s.reader, s.extras);
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
  nb::class_<TensorRef>(m, "TensorRef")
      .def(nb::init<>())
      .def(
          "__init__",
          [](TensorRef* t, uint64_t index, uint8_t kind) { new (t) TensorRef{index, kind}; },
          "index"_a, "kind"_a = 0)
      .def_rw("index", &TensorRef::index)
      .def_rw("kind", &TensorRef::kind)
      .def("__repr__", [](const TensorRef& t) {
        return "TensorRef(" + std::to_string(t.index) + ", " + std::to_string(t.kind) + ")";
      });
  m.def("save", &Save, "path"_a, "step"_a, "rank"_a, "world_size"_a, "job"_a, "skeleton"_a,
        "tensors"_a);
  m.def("load", &Load, "path"_a, "step"_a.none(), "rank"_a);
  m.def("steps", &Steps, "path"_a);
  nb::class_<PyClient>(m, "Client")
      .def(nb::init<const std::string&, const std::string&, const std::string&, uint32_t, uint32_t,
                    uint32_t, bool, const std::string&>(),
           "storage"_a, "job"_a, "shm_dir"_a, "rank"_a, "world_size"_a, "keep"_a,
           "wait_when_busy"_a, "agent_binary"_a)
      .def("save", &PyClient::Save, "step"_a, "skeleton"_a, "tensors"_a, "persist"_a)
      .def("wait", &PyClient::Wait, "timeout"_a)
      .def("agent_status", &PyClient::AgentStatus)
      .def("load_newest", &PyClient::LoadNewest, "min_step"_a.none())
      .def("slots", &PyClient::Slots)
      .def("last_persist_step", &PyClient::LastPersistStep)
      .def("close", &PyClient::Close, "timeout"_a)
      .def("abandon", &PyClient::Abandon);
  m.attr("__version__") = SAFEPOINT_VERSION;
  m.attr("FORMAT_VERSION") = kImageFormatVersion;
}
