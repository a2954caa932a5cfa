#include "state.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "errors.h"
#include "torch_probe.h"

namespace safepoint::python {

namespace {

// Torch and numpy objects looked up once per process.
struct Types {
  nb::object torch, tensor_type, parameter_type, strided, as_strided, from_numpy;
  nb::object np, ndarray_type, generic_type, ascontiguousarray, asarray, np_ndarray;
  nb::object mapping_type;
  std::unordered_map<PyObject*, DType> torch_dtypes;  // torch.dtype singletons
  std::unordered_map<int, nb::object> torch_by_dtype;
  std::string supported;  // the torch dtypes above, for messages
  nb::str s_layout, s_dtype, s_is_cpu, s_cpu, s_is_contiguous, s_contiguous, s_data_ptr, s_shape,
      s_name, s_isnative, s_flags, s_c_contiguous, s_array_interface, s_view, s_is_meta, s_is_conj,
      s_is_neg, s_resolve_conj, s_resolve_neg;
  // safepoint._torchprobe's probe (torch_probe.h) when it loads and is not turned off
  // ($SAFEPOINT_TORCH_PROBE=0, or SetTorchProbe); `probe_loaded` whether it loaded at all.
  const TorchProbeApi* probe = nullptr;
  const TorchProbeApi* probe_loaded = nullptr;

  Types() {
    torch = nb::module_::import_("torch");
    tensor_type = torch.attr("Tensor");
    parameter_type = torch.attr("nn").attr("Parameter");
    strided = torch.attr("strided");
    as_strided = torch.attr("as_strided");
    from_numpy = torch.attr("from_numpy");
    np = nb::module_::import_("numpy");
    ndarray_type = np.attr("ndarray");
    generic_type = np.attr("generic");
    ascontiguousarray = np.attr("ascontiguousarray");
    asarray = np.attr("asarray");
    np_ndarray = np.attr("ndarray");
    mapping_type = nb::module_::import_("collections.abc").attr("Mapping");
    // Every dtype of the image format (src/image/image.cc) that this torch has.
    for (int code = 1; code < 256; ++code) {
      const auto d = static_cast<DType>(code);
      if (DTypeSize(d) == 0) continue;
      const std::string name(DTypeName(d));
      if (!nb::hasattr(torch, name.c_str())) continue;
      nb::object dt = torch.attr(name.c_str());
      torch_dtypes[dt.ptr()] = d;
      torch_by_dtype[code] = dt;
      dt.inc_ref();  // dtype singletons live for the process; keep the key valid
      supported += (supported.empty() ? "" : ", ") + name;
    }
    s_layout = nb::str("layout");
    s_dtype = nb::str("dtype");
    s_is_cpu = nb::str("is_cpu");
    s_cpu = nb::str("cpu");
    s_is_contiguous = nb::str("is_contiguous");
    s_contiguous = nb::str("contiguous");
    s_data_ptr = nb::str("data_ptr");
    s_shape = nb::str("shape");
    s_name = nb::str("name");
    s_isnative = nb::str("isnative");
    s_flags = nb::str("flags");
    s_c_contiguous = nb::str("c_contiguous");
    s_array_interface = nb::str("__array_interface__");
    s_view = nb::str("view");
    s_is_meta = nb::str("is_meta");
    s_is_conj = nb::str("is_conj");
    s_is_neg = nb::str("is_neg");
    s_resolve_conj = nb::str("resolve_conj");
    s_resolve_neg = nb::str("resolve_neg");
    if (PyObject* m = PyImport_ImportModule("safepoint._torchprobe")) {
      PyObject* capsule = PyObject_GetAttrString(m, "probe");
      if (capsule != nullptr) {
        probe_loaded =
            static_cast<const TorchProbeApi*>(PyCapsule_GetPointer(capsule, kTorchProbeCapsule));
        Py_DECREF(capsule);
      }
      Py_DECREF(m);
    }
    if (PyErr_Occurred()) PyErr_Clear();  // not built, or for another torch: the Python route
    const char* env = std::getenv("SAFEPOINT_TORCH_PROBE");
    probe = env != nullptr && std::string_view(env) == "0" ? nullptr : probe_loaded;
  }
};

Types& T() {
  static Types* t = new Types();  // never destroyed: Python objects outlive interpreter teardown
  return *t;
}

bool NumpyDTypeOk(const std::string& name, DType* out) {
  static const std::unordered_map<std::string, DType> kNames = {
      {"float32", DType::kFloat32},     {"float16", DType::kFloat16},
      {"float64", DType::kFloat64},     {"int8", DType::kInt8},
      {"int16", DType::kInt16},         {"int32", DType::kInt32},
      {"int64", DType::kInt64},         {"uint8", DType::kUInt8},
      {"bool", DType::kBool},           {"uint16", DType::kUInt16},
      {"uint32", DType::kUInt32},       {"uint64", DType::kUInt64},
      {"complex64", DType::kComplex64}, {"complex128", DType::kComplex128}};
  auto it = kNames.find(name);
  if (it == kNames.end()) return false;
  *out = it->second;
  return true;
}

std::vector<uint64_t> Dims(nb::handle shape) {
  std::vector<uint64_t> out;
  const Py_ssize_t n = PyTuple_Check(shape.ptr()) ? PyTuple_GET_SIZE(shape.ptr()) : -1;
  if (n >= 0) {
    out.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      out.push_back(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(shape.ptr(), i)));
    }
  } else {
    for (nb::handle d : shape) out.push_back(nb::cast<uint64_t>(d));
  }
  return out;
}

class Flattener {
 public:
  Flattener(nb::handle pickler, Stage stage) : pickler_(pickler), stage_(stage) {}
  FlatState Run(nb::handle state) {
    FlatState out;
    keepalive_ = &out.keepalive;
    staged_ = &out.staged;
    tensors_ = &out.tensors;
    out.skeleton = Walk(state, 0);
    return out;
  }

 private:
  [[noreturn]] void Fail(const std::string& what) {
    ThrowStatus(InvalidArgument((path_.empty() ? std::string("<root>") : path_) + ": " + what));
  }

  struct PathScope {
    std::string& path;
    size_t len;
    PathScope(std::string& p, std::string_view key) : path(p), len(p.size()) {
      if (!path.empty()) path += '.';
      path += key;
    }
    ~PathScope() { path.resize(len); }
  };

  std::string UniqueName() {
    std::string name = path_.empty() ? std::string("<root>") : path_;
    if (names_.insert(name).second) return name;
    for (int k = 1;; ++k) {
      std::string n = name + "#" + std::to_string(k);
      if (names_.insert(n).second) return n;
    }
  }

  size_t Add(DType dtype, std::vector<uint64_t> shape, uintptr_t ptr) {
    uint64_t nbytes = DTypeSize(dtype);
    for (uint64_t x : shape) nbytes *= x;
    TensorSource s;
    s.spec.name = UniqueName();
    s.spec.dtype = dtype;
    s.spec.shape = std::move(shape);
    s.data = reinterpret_cast<const void*>(ptr);
    s.nbytes = nbytes;
    tensors_->push_back(std::move(s));
    return tensors_->size() - 1;
  }

  // A contiguous CPU tensor of `obj`'s whose bytes are at `ptr` (those of `keep`: obj, or the
  // contiguous copy made of it). `keep` is held until the image is written: the write runs
  // with the GIL released, and another thread could drop the caller's last reference (e.g.
  // replace the tensor in the state dict).
  Value Plain(nb::handle obj, nb::handle keep, DType dtype, std::vector<uint64_t> shape,
              uintptr_t ptr) {
    const size_t idx = Add(dtype, std::move(shape), ptr);
    keepalive_->append(keep);
    TensorRef ref{idx, 0};
    seen_.emplace(obj.ptr(), ref);  // the caller's state keeps obj alive while we run
    return Value(ref);
  }

  // One tensor, through the raw C API: this runs 10,000+ times per save, so every call counts
  // (attribute loads and vectorcalls with interned names; no bound-method objects).
  Value Tensor(nb::handle obj) {
    Types& t = T();
    auto seen = seen_.find(obj.ptr());
    if (seen != seen_.end()) return Value(seen->second);
    PyTypeObject* type = Py_TYPE(obj.ptr());
    if (type != reinterpret_cast<PyTypeObject*>(t.tensor_type.ptr())) {
      nb::handle dtensor = DTensorType();
      if (dtensor.is_valid() &&
          PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(dtensor.ptr()))) {
        return ShardOf(obj);
      }
    }
    // The common case in one call (torch_probe.h): a plain contiguous CPU tensor of a dtype
    // the format has, not staged. Anything else takes the route below, which handles or
    // reports it.
    if (t.probe != nullptr && stage_ != Stage::kAll &&
        (type == reinterpret_cast<PyTypeObject*>(t.tensor_type.ptr()) ||
         type == reinterpret_cast<PyTypeObject*>(t.parameter_type.ptr()))) {
      TorchTensorFacts f;
      if (t.probe->probe(obj.ptr(), &f) == 1 && f.contiguous) {
        auto d = t.torch_dtypes.find(f.dtype);
        if (d != t.torch_dtypes.end()) {
          return Plain(obj, obj, d->second, std::vector<uint64_t>(f.sizes, f.sizes + f.ndim),
                       reinterpret_cast<uintptr_t>(f.data));
        }
      }
    }
    nb::object layout = nb::steal(PyObject_GetAttr(obj.ptr(), t.s_layout.ptr()));
    if (!layout.is_valid()) throw nb::python_error();
    if (!layout.is(t.strided)) {
      Fail("cannot save a " + nb::cast<std::string>(nb::str(layout)) +
           " tensor; use a dense tensor");
    }
    nb::object dt = nb::steal(PyObject_GetAttr(obj.ptr(), t.s_dtype.ptr()));
    if (!dt.is_valid()) throw nb::python_error();
    auto d = t.torch_dtypes.find(dt.ptr());
    if (d == t.torch_dtypes.end()) {
      Fail("tensor dtype " + nb::cast<std::string>(nb::str(dt)) +
           " is not supported (supported: " + t.supported + ")");
    }
    nb::object src = nb::borrow(obj);
    nb::object is_cpu = nb::steal(PyObject_GetAttr(src.ptr(), t.s_is_cpu.ptr()));
    if (!is_cpu.is_valid()) throw nb::python_error();
    const bool on_cpu = is_cpu.is(nb::handle(Py_True));
    if (!on_cpu) {
      nb::object is_meta = nb::steal(PyObject_GetAttr(src.ptr(), t.s_is_meta.ptr()));
      if (!is_meta.is_valid()) throw nb::python_error();
      if (is_meta.is(nb::handle(Py_True))) {
        Fail(
            "cannot save a meta tensor (it has a shape but no data); materialize it first "
            "(e.g. to_empty() and initialize, or load the real weights)");
      }
    }
    if (stage_ == Stage::kAll || (stage_ == Stage::kDevice && !on_cpu))
      return Staged(obj, d->second, on_cpu);
    if (!on_cpu) src = Call(src, t.s_cpu);
    // A conjugate or negative view (x.conj(), x.conj().imag) holds the values before the
    // conjugation or negation: its raw bytes are not its values. A snapshot copies it into the
    // slot (torch's copy resolves it); a save resolves it into a temporary.
    if (Call(src, t.s_is_conj).is(nb::handle(Py_True)) ||
        Call(src, t.s_is_neg).is(nb::handle(Py_True))) {
      if (stage_ == Stage::kDevice) return Staged(obj, d->second, on_cpu);
      src = Call(Call(src, t.s_resolve_conj), t.s_resolve_neg);
    }
    if (!Call(src, t.s_is_contiguous).is(nb::handle(Py_True))) {
      // A snapshot copies a strided CPU tensor straight into the slot (safepoint._staging):
      // no temporary contiguous copy of its size (issue 14, host memory).
      if (stage_ == Stage::kDevice) return Staged(obj, d->second, on_cpu);
      src = Call(src, t.s_contiguous);
    }
    nb::object ptr_obj = Call(src, t.s_data_ptr);
    const uintptr_t ptr = PyLong_AsUnsignedLongLong(ptr_obj.ptr());
    nb::object shape_obj = nb::steal(PyObject_GetAttr(src.ptr(), t.s_shape.ptr()));
    if (!shape_obj.is_valid()) throw nb::python_error();
    std::vector<uint64_t> shape = Dims(shape_obj);
    if (PyErr_Occurred()) throw nb::python_error();
    return Plain(obj, src, d->second, std::move(shape), ptr);
  }

  // torch.distributed.tensor.DTensor if that module is loaded (a DTensor cannot exist before
  // it is; importing it here would cost seconds), else an invalid handle. Looked up for tensor
  // subclasses only (nn.Parameter, DTensor, ...).
 public:
  static nb::handle DTensorType() {
    static nb::object* type = nullptr;
    if (type != nullptr) return *type;
    PyObject* modules = PyImport_GetModuleDict();
    PyObject* mod = PyDict_GetItemString(modules, "torch.distributed.tensor");  // borrowed
    if (mod == nullptr) return nb::handle();
    PyObject* cls = PyObject_GetAttrString(mod, "DTensor");
    if (cls == nullptr) {
      PyErr_Clear();
      return nb::handle();
    }
    type = new nb::object(nb::steal(cls));
    return *type;
  }

 private:
  // A DTensor: its local shard, with the box it covers in the global tensor
  // (safepoint._shards.dtensor_box computes it from the mesh and placements).
  Value ShardOf(nb::handle obj) {
    static nb::object* box_of =
        new nb::object(nb::module_::import_("safepoint._shards").attr("dtensor_box"));
    nb::tuple box;
    try {
      box = nb::borrow<nb::tuple>((*box_of)(obj));
    } catch (nb::python_error& e) {
      Fail(std::string("cannot save this DTensor: ") + e.what());
    }
    Value v = Tensor(box[0]);
    TensorSource& src = (*tensors_)[std::get<TensorRef>(v.v).index];
    src.spec.global_shape = Dims(box[1]);
    src.spec.global_offset = Dims(box[2]);
    keepalive_->append(box[0]);
    seen_.emplace(obj.ptr(), std::get<TensorRef>(v.v));
    return v;
  }

  // A tensor the caller copies into the slot itself (GPU: asynchronous device-to-host copies);
  // listed in `staged_` with its index.
  // A strided CPU tensor is copied as it is (into a typed view of its slot range); one on a
  // GPU is made contiguous there first.
  Value Staged(nb::handle obj, DType dtype, bool on_cpu) {
    Types& t = T();
    nb::object src = nb::borrow(obj);
    if (!on_cpu && !Call(src, t.s_is_contiguous).is(nb::handle(Py_True))) {
      src = Call(src, t.s_contiguous);
    }
    nb::object shape_obj = nb::steal(PyObject_GetAttr(src.ptr(), t.s_shape.ptr()));
    if (!shape_obj.is_valid()) throw nb::python_error();
    const size_t idx = Add(dtype, Dims(shape_obj), 0);
    (*tensors_)[idx].staged = true;
    staged_->append(nb::make_tuple(idx, src));
    TensorRef ref{idx, 0};
    seen_.emplace(obj.ptr(), ref);
    return Value(ref);
  }

  static nb::object Call(nb::handle self, const nb::str& method) {
    PyObject* args[1] = {self.ptr()};
    PyObject* r =
        PyObject_VectorcallMethod(method.ptr(), args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
    if (r == nullptr) throw nb::python_error();
    return nb::steal(r);
  }

  Value Numpy(nb::handle obj, uint8_t kind) {
    Types& t = T();
    nb::object arr = kind == 2 ? t.asarray(obj) : nb::borrow(obj);
    nb::object dt = arr.attr(t.s_dtype);
    const std::string name = nb::cast<std::string>(dt.attr(t.s_name));
    DType d;
    if (!NumpyDTypeOk(name, &d) || !PyObject_IsTrue(dt.attr(t.s_isnative).ptr())) {
      Fail("numpy dtype " + nb::cast<std::string>(nb::str(dt)) +
           " is not supported (supported: bool, complex64, complex128, float16, float32, float64, "
           "int16, int32, int64, int8, uint8, uint16, uint32, uint64)");
    }
    if (!PyObject_IsTrue(arr.attr(t.s_flags).attr(t.s_c_contiguous).ptr())) {
      arr = t.ascontiguousarray(arr);
    }
    nb::object iface = arr.attr(t.s_array_interface);
    nb::object data = iface["data"];
    const uintptr_t ptr = PyLong_AsUnsignedLongLong(nb::object(data[0]).ptr());
    if (PyErr_Occurred()) throw nb::python_error();
    const size_t idx = Add(d, Dims(arr.attr(t.s_shape)), ptr);
    keepalive_->append(arr);
    return Value(TensorRef{idx, kind});
  }

  ValueList Items(nb::handle seq, size_t depth) {
    ValueList items;
    PyObject* fast = seq.ptr();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    items.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PathScope scope(path_, std::to_string(i));
      items.push_back(Walk(PySequence_Fast_GET_ITEM(fast, i), depth + 1));
    }
    return items;
  }

  Value Key(nb::handle k) {
    PyObject* o = k.ptr();
    if (PyUnicode_CheckExact(o)) {
      Py_ssize_t n = 0;
      const char* s = PyUnicode_AsUTF8AndSize(o, &n);
      if (s == nullptr) throw nb::python_error();
      return Value(std::string(s, n));
    }
    if (PyLong_CheckExact(o)) return Walk(k, 0);
    Fail("dict key " + nb::cast<std::string>(nb::repr(k)) + " of type " +
         nb::cast<std::string>(nb::str(k.type().attr("__name__"))) +
         " is not supported (keys must be str or int)");
  }

  std::string KeyPath(const Value& key) {
    if (auto* s = std::get_if<std::string>(&key.v)) return *s;
    if (auto* i = std::get_if<int64_t>(&key.v)) return std::to_string(*i);
    return "<int>";
  }

  Value Dict(nb::handle obj, size_t depth) {
    safepoint::Dict d;
    if (PyDict_Check(obj.ptr())) {
      PyObject *k, *v;
      Py_ssize_t pos = 0;
      d.items.reserve(PyDict_Size(obj.ptr()));
      while (PyDict_Next(obj.ptr(), &pos, &k, &v)) {
        Value key = Key(k);
        PathScope scope(path_, KeyPath(key));
        d.items.emplace_back(std::move(key), Walk(v, depth + 1));
      }
    } else {
      for (nb::handle item : obj.attr("items")()) {
        nb::tuple kv = nb::borrow<nb::tuple>(item);
        Value key = Key(kv[0]);
        PathScope scope(path_, KeyPath(key));
        d.items.emplace_back(std::move(key), Walk(kv[1], depth + 1));
      }
    }
    return Value(std::move(d));
  }

  Value Walk(nb::handle obj, size_t depth) {
    if (depth > kMaxExtrasDepth) Fail("nested more than 256 levels deep");
    PyObject* o = obj.ptr();
    if (o == Py_None) return Value();
    if (PyBool_Check(o)) return Value(o == Py_True);
    if (PyLong_CheckExact(o)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (!overflow) return Value(static_cast<int64_t>(v));
      nb::int_ x = nb::borrow<nb::int_>(obj);
      const bool neg = PyObject_RichCompareBool(o, nb::int_(0).ptr(), Py_LT) == 1;
      nb::object mag = neg ? x.attr("__invert__")() : nb::object(x);
      const size_t bits = nb::cast<size_t>(mag.attr("bit_length")());
      nb::bytes b = nb::borrow<nb::bytes>(
          x.attr("to_bytes")((bits + 8) / 8, "little", nb::arg("signed") = true));
      return Value(BigInt{std::string(b.c_str(), b.size())});
    }
    if (PyFloat_CheckExact(o)) return Value(PyFloat_AS_DOUBLE(o));
    if (PyUnicode_CheckExact(o)) {
      Py_ssize_t n = 0;
      const char* s = PyUnicode_AsUTF8AndSize(o, &n);
      if (s == nullptr) throw nb::python_error();
      return Value(std::string(s, n));
    }
    if (PyBytes_CheckExact(o)) {
      return Value(Bytes{std::string(PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o))});
    }
    Types& t = T();
    if (PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(t.tensor_type.ptr()))) {
      return Tensor(obj);
    }
    if (PyDict_Check(o)) return Dict(obj, depth);
    if (PyList_Check(o)) return Value(List{Items(obj, depth)});
    if (PyTuple_Check(o)) return Value(Tuple{Items(obj, depth)});
    if (PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(t.ndarray_type.ptr()))) {
      return Numpy(obj, 1);
    }
    if (PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(t.generic_type.ptr()))) {
      return Numpy(obj, 2);
    }
    if (PyObject_IsInstance(o, t.mapping_type.ptr()) == 1) return Dict(obj, depth);
    if (pickler_.is_valid() && !pickler_.is_none()) {
      nb::object b;
      try {
        b = pickler_(obj);
      } catch (nb::python_error& e) {
        // A value that cannot be pickled (a lambda, a lock, an open file): the error names its
        // key, as every other refusal of the walk does. Anything but an Exception
        // (KeyboardInterrupt, SystemExit) goes on as it is.
        if (!e.matches(PyExc_Exception)) throw;
        nb::object refused = nb::module_::import_("safepoint.errors").attr("InvalidArgumentError");
        std::string what = nb::cast<std::string>(nb::str(e.value()));
        if (!e.matches(refused)) {  // a pickler of its own: say what it raised
          what = "cannot pickle a value of type " + TypeName(obj) + ": " +
                 nb::cast<std::string>(nb::str(e.type().attr("__name__"))) + ": " + what;
        }
        Fail(what);  // e is caught: Fail's InvalidArgumentError replaces it
      }
      if (!PyBytes_Check(b.ptr())) Fail("the pickler did not return bytes");
      return Value(Pickled{std::string(PyBytes_AS_STRING(b.ptr()), PyBytes_GET_SIZE(b.ptr()))});
    }
    Fail("cannot save a value of type " + TypeName(obj) +
         "; supported: tensors, numpy arrays, None, bool, int, float, str, bytes, and dicts, "
         "lists and tuples of these (or pass allow_pickle=True to pickle other objects)");
  }

  static std::string TypeName(nb::handle obj) {
    nb::handle type = obj.type();
    return nb::cast<std::string>(nb::str(type.attr("__module__"))) + "." +
           nb::cast<std::string>(nb::str(type.attr("__qualname__")));
  }

  nb::handle pickler_;
  Stage stage_ = Stage::kNone;
  nb::list* staged_ = nullptr;
  std::string path_;
  std::unordered_set<std::string> names_;
  std::unordered_map<PyObject*, TensorRef> seen_;
  nb::list* keepalive_ = nullptr;
  std::vector<TensorSource>* tensors_ = nullptr;
};

// PlanWalk (state.h): the same traversal as Flattener, in the same order, recording a signature
// instead of building the skeleton. Any value it does not handle, and any Python error, ends it
// with false (the error cleared): Flattener then handles the state and reports what is wrong.
class PlanWalker {
 public:
  explicit PlanWalker(size_t hint) {
    size_t cap = 64;
    shift_ = 58;
    while (cap < 2 * hint + 16) cap <<= 1, --shift_;
    keys_.assign(cap, nullptr);
    vals_.resize(cap);
  }

  bool Run(nb::handle state, PlanWalk* out) {
    out_ = out;
    streaming_ = out->expect != nullptr && out->publish;
    // The signature is written at pos_ into bytes grown ahead (its capacity, the caller's
    // reserve: the previous signature's size) and cut to length at the end: an inline copy per
    // piece instead of an out-of-line std::string::append (7% of a 100,000-tensor save's walk).
    std::string& sig = out->signature;
    pos_ = sig.size();
    sig.resize(std::max(sig.capacity(), pos_ + 256));
    // The walk allocates only short-lived objects (shapes, results), yet enough of them to
    // start the cyclic collector several times over a large state, each time traversing it all.
    const int gc_was_enabled = PyGC_Disable();
    const bool ok = Walk(state.ptr(), 0);
    if (gc_was_enabled) PyGC_Enable();
    sig.resize(pos_);
    out->expect_checked = streaming_ ? checked_ : 0;
    if (ok) return true;
    if (PyErr_Occurred()) PyErr_Clear();
    return false;
  }

 private:
  // Hands the newest tensor's address to out_->publish while the signature so far is a prefix
  // of the expected one (its dtype and shape included: the copy reads the plan's byte count).
  void Publish() {
    if (!streaming_) return;
    const std::string& sig = out_->signature;  // its first pos_ bytes so far
    const std::string& want = *out_->expect;
    if (pos_ > want.size() ||
        std::memcmp(sig.data() + checked_, want.data() + checked_, pos_ - checked_) != 0) {
      streaming_ = false;  // another structure: the caller gives the streamed save up
      return;
    }
    checked_ = pos_;
    out_->publish(out_->data.size() - 1, out_->data.back());
  }

  // Room for n more signature bytes at pos_ (grown by doubling; rare once the caller reserved).
  char* Room(size_t n) {
    std::string& sig = out_->signature;
    if (pos_ + n > sig.size()) [[unlikely]] {
      sig.resize(std::max(2 * sig.size(), pos_ + n));
    }
    char* at = sig.data() + pos_;
    pos_ += n;
    return at;
  }
  void Put(char tag) { *Room(1) = tag; }
  template <typename T>
  void PutRaw(T x) {
    std::memcpy(Room(sizeof(x)), &x, sizeof(x));
  }
  void PutText(char tag, const char* p, Py_ssize_t n) {
    const uint64_t len = static_cast<uint64_t>(n);
    char* at = Room(1 + sizeof(len) + len);
    *at = tag;
    std::memcpy(at + 1, &len, sizeof(len));
    std::memcpy(at + 1 + sizeof(len), p, len);
  }

  // The index of the tensor object `o` if an earlier position held it, else registers it as
  // tensor `next` and returns SIZE_MAX (open addressing; the state keeps `o` alive meanwhile).
  size_t Slot(PyObject* o) const {
    return (reinterpret_cast<uintptr_t>(o) * 0x9E3779B97F4A7C15ull) >> shift_;  // Fibonacci
  }
  // Seen()'s first probe for `o`, fetched ahead with the object (a large state's table misses
  // the cache on nearly every tensor: 6-9% of a 100,000-tensor save's walk).
  void PrefetchSeen(PyObject* o) const {
    const size_t i = Slot(o);
    __builtin_prefetch(&keys_[i], 1);
    __builtin_prefetch(&vals_[i], 1);
  }
  size_t Seen(PyObject* o, size_t next) {
    if (2 * (count_ + 1) > keys_.size()) Grow();
    const size_t mask = keys_.size() - 1;
    size_t i = Slot(o);
    while (keys_[i] != nullptr) {
      if (keys_[i] == o) return vals_[i];
      i = (i + 1) & mask;
    }
    keys_[i] = o;
    vals_[i] = next;
    ++count_;
    return SIZE_MAX;
  }
  void Grow() {
    std::vector<PyObject*> keys = std::move(keys_);
    std::vector<size_t> vals = std::move(vals_);
    keys_.assign(keys.size() * 2, nullptr);
    vals_.assign(keys.size() * 2, 0);
    --shift_;
    count_ = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] != nullptr) Seen(keys[i], vals[i]);
    }
  }

  static PyObject* Call(PyObject* self, PyObject* method) {
    PyObject* args[1] = {self};
    return PyObject_VectorcallMethod(method, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  }

  bool Dims(PyObject* shape) {
    if (shape == nullptr || !PyTuple_Check(shape)) return false;
    const Py_ssize_t n = PyTuple_GET_SIZE(shape);
    PutRaw<uint8_t>(static_cast<uint8_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PutRaw<uint64_t>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(shape, i)));
    }
    return !PyErr_Occurred();
  }

  bool Tensor(PyObject* o) {
    Types& t = T();
    PyTypeObject* type = Py_TYPE(o);
    if (type != reinterpret_cast<PyTypeObject*>(t.tensor_type.ptr()) &&
        type != reinterpret_cast<PyTypeObject*>(t.parameter_type.ptr())) {
      nb::handle dtensor = Flattener::DTensorType();
      if (dtensor.is_valid() &&
          PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(dtensor.ptr()))) {
        return DTensor(o);
      }
      return false;  // other subclasses: Flattener
    }
    const size_t seen = Seen(o, out_->data.size());
    if (seen != SIZE_MAX) {
      Put('R');
      PutRaw<uint64_t>(seen);
      return true;
    }
    if (t.probe != nullptr) return ProbedTensor(o);
    nb::object layout = nb::steal(PyObject_GetAttr(o, t.s_layout.ptr()));
    if (!layout.is(t.strided)) return false;
    nb::object is_cpu = nb::steal(PyObject_GetAttr(o, t.s_is_cpu.ptr()));
    if (!is_cpu.is(nb::handle(Py_True))) return false;  // staged or moved: Flattener
    nb::object dt = nb::steal(PyObject_GetAttr(o, t.s_dtype.ptr()));
    if (!dt.is_valid()) return false;
    DType d;
    if (!Code(dt.ptr(), &d)) return false;
    Put('X');
    PutRaw<uint8_t>(static_cast<uint8_t>(d));
    nb::object shape = nb::steal(PyObject_GetAttr(o, t.s_shape.ptr()));
    if (!Dims(shape.ptr())) return false;
    nb::object src = nb::borrow(o);
    nb::object contiguous = nb::steal(Call(o, t.s_is_contiguous.ptr()));
    // A strided tensor: Flattener stages it (copied into the slot as it is, no temporary).
    if (!contiguous.is(nb::handle(Py_True))) return false;
    // A conjugate or negative view: its bytes are not its values (Flattener resolves it).
    nb::object conj = nb::steal(Call(o, t.s_is_conj.ptr()));
    nb::object neg = nb::steal(Call(o, t.s_is_neg.ptr()));
    if (!conj.is(nb::handle(Py_False)) || !neg.is(nb::handle(Py_False))) return false;
    // Held until the image is written (as Flattener does): the copy runs without the GIL.
    nb::object ptr = nb::steal(Call(src.ptr(), t.s_data_ptr.ptr()));
    if (!ptr.is_valid()) return false;
    out_->data.push_back(reinterpret_cast<const void*>(PyLong_AsUnsignedLongLong(ptr.ptr())));
    if (PyList_Append(out_->keepalive.ptr(), src.ptr()) != 0 || PyErr_Occurred()) return false;
    Publish();
    return true;
  }

  // A DTensor (issue 21): its local shard as a tensor of its own, after what fixes the box that
  // shard covers in the global tensor (safepoint._shards.dtensor_box): the global shape, the
  // placements (each one's type and hash: Shard's dim, _StridedShard's split too) and the mesh
  // (its shape and this rank's coordinate in it). Equal signatures therefore give equal
  // specs, global box included, without calling dtensor_box again. The shard is the DTensor's
  // own local tensor (what to_local() returns outside autograd, as dtensor_box takes it).
  bool DTensor(PyObject* o) {
    const size_t seen = Seen(o, out_->data.size());
    if (seen != SIZE_MAX) {
      Put('R');
      PutRaw<uint64_t>(seen);
      return true;
    }
    DTensorNames& n = Names();
    nb::object spec = nb::steal(PyObject_GetAttr(o, n.spec.ptr()));
    if (!spec.is_valid()) return false;
    nb::object mesh = nb::steal(PyObject_GetAttr(spec.ptr(), n.mesh.ptr()));
    nb::object placements = nb::steal(PyObject_GetAttr(spec.ptr(), n.placements.ptr()));
    nb::object shape = nb::steal(PyObject_GetAttr(o, T().s_shape.ptr()));
    nb::object local = nb::steal(PyObject_GetAttr(o, n.local_tensor.ptr()));
    if (!mesh.is_valid() || !placements.is_valid() || !local.is_valid() ||
        !PyTuple_Check(placements.ptr())) {
      return false;
    }
    Put('Q');
    if (!Dims(shape.ptr()) || !Mesh(mesh.ptr())) return false;
    const Py_ssize_t np = PyTuple_GET_SIZE(placements.ptr());
    PutRaw<uint8_t>(static_cast<uint8_t>(np));
    for (Py_ssize_t i = 0; i < np; ++i) {
      PyObject* p = PyTuple_GET_ITEM(placements.ptr(), i);
      // Partial holds unreduced values: Flattener refuses it with the reason.
      if (!n.partial.is_valid() ||
          PyObject_TypeCheck(p, reinterpret_cast<PyTypeObject*>(n.partial.ptr()))) {
        return false;
      }
      const Py_hash_t h = PyObject_Hash(p);
      if (h == -1) return false;
      PutRaw<uintptr_t>(reinterpret_cast<uintptr_t>(Py_TYPE(p)));
      PutRaw<int64_t>(static_cast<int64_t>(h));
    }
    const size_t before = out_->data.size();
    // The shard must be a tensor of its own here (as in Flattener, where it is added anew).
    return Tensor(local.ptr()) && out_->data.size() == before + 1;
  }

  // A DeviceMesh: its shape and this rank's coordinate (none: -1), read once per mesh object a
  // walk meets in a row (the state keeps it alive meanwhile).
  bool Mesh(PyObject* mesh) {
    if (mesh != last_mesh_) {
      DTensorNames& n = Names();
      nb::object shape = nb::steal(PyObject_GetAttr(mesh, n.shape.ptr()));
      nb::object coord = nb::steal(Call(mesh, n.get_coordinate.ptr()));
      if (!shape.is_valid() || !coord.is_valid() || !PyTuple_Check(shape.ptr())) return false;
      std::string enc;
      for (nb::handle d : nb::borrow<nb::tuple>(shape)) {
        const int64_t v = PyLong_AsLongLong(d.ptr());
        enc.append(reinterpret_cast<const char*>(&v), sizeof(v));
      }
      enc.push_back('@');
      if (!coord.is_none()) {
        for (nb::handle d : coord) {
          const int64_t v = PyLong_AsLongLong(d.ptr());
          enc.append(reinterpret_cast<const char*>(&v), sizeof(v));
        }
      }
      if (PyErr_Occurred()) return false;
      last_mesh_ = mesh;
      last_mesh_enc_ = std::move(enc);
    }
    PutText('G', last_mesh_enc_.data(), static_cast<Py_ssize_t>(last_mesh_enc_.size()));
    return true;
  }

  // Names and types the DTensor walk reads (torch.distributed.tensor is loaded by then).
  struct DTensorNames {
    nb::str spec{"_spec"}, mesh{"mesh"}, placements{"placements"}, local_tensor{"_local_tensor"},
        shape{"shape"}, get_coordinate{"get_coordinate"};
    nb::object partial;
  };
  static DTensorNames& Names() {
    static DTensorNames* n = [] {
      auto* x = new DTensorNames();  // never destroyed, as Types
      PyObject* mod = PyImport_ImportModule("torch.distributed.tensor");
      if (mod != nullptr) {
        PyObject* p = PyObject_GetAttrString(mod, "Partial");
        if (p != nullptr) x->partial = nb::steal(p);
        Py_DECREF(mod);
      }
      if (PyErr_Occurred()) PyErr_Clear();
      return x;
    }();
    return *n;
  }

  // The image dtype of torch.dtype `dt` (a process-lifetime singleton: Types keeps a reference).
  bool Code(PyObject* dt, DType* d) {
    if (dt != last_dtype_) {
      auto it = T().torch_dtypes.find(dt);
      if (it == T().torch_dtypes.end()) return false;
      last_dtype_ = dt;
      last_code_ = it->second;
    }
    *d = last_code_;
    return true;
  }

  // Tensor() with safepoint._torchprobe: the same signature and checks from one call.
  bool ProbedTensor(PyObject* o) {
    // One record for the walk, not one per tensor: its value-initialized array (128 bytes)
    // was a `rep stos` a tensor, 5% of a 100,000-tensor save's walk. A probe that returns 1
    // sets every field read below.
    TorchTensorFacts& f = facts_;
    DType d;
    if (T().probe->probe(o, &f) == 0 || !Code(f.dtype, &d)) return false;  // Flattener
    Put('X');
    PutRaw<uint8_t>(static_cast<uint8_t>(d));
    PutRaw<uint8_t>(static_cast<uint8_t>(f.ndim));
    for (int i = 0; i < f.ndim; ++i) PutRaw<uint64_t>(static_cast<uint64_t>(f.sizes[i]));
    if (!f.contiguous) return false;  // Flattener stages it
    out_->data.push_back(f.data);
    if (PyList_Append(out_->keepalive.ptr(), o) != 0) return false;
    Publish();
    return true;
  }

  bool Array(PyObject* o) {
    Types& t = T();
    nb::handle arr(o);
    nb::object dt = nb::steal(PyObject_GetAttr(o, t.s_dtype.ptr()));
    if (!dt.is_valid()) return false;
    nb::object name = nb::steal(PyObject_GetAttr(dt.ptr(), t.s_name.ptr()));
    nb::object native = nb::steal(PyObject_GetAttr(dt.ptr(), t.s_isnative.ptr()));
    if (!name.is_valid() || !PyUnicode_Check(name.ptr()) || !native.is(nb::handle(Py_True))) {
      return false;
    }
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(name.ptr(), &n);
    DType d;
    if (s == nullptr || !NumpyDTypeOk(std::string(s, n), &d)) return false;
    Put('A');
    PutRaw<uint8_t>(static_cast<uint8_t>(d));
    nb::object shape = nb::steal(PyObject_GetAttr(o, t.s_shape.ptr()));
    if (!Dims(shape.ptr())) return false;
    nb::object src = nb::borrow(arr);
    try {
      if (!PyObject_IsTrue(src.attr(t.s_flags).attr(t.s_c_contiguous).ptr())) {
        src = t.ascontiguousarray(src);
      }
      nb::object iface = src.attr(t.s_array_interface);
      nb::object data = iface["data"];
      const uintptr_t ptr = PyLong_AsUnsignedLongLong(nb::object(data[0]).ptr());
      out_->data.push_back(reinterpret_cast<const void*>(ptr));
    } catch (nb::python_error&) {
      return false;  // the error is cleared when the python_error object goes
    }
    out_->keepalive.append(src);  // as Flattener: a copy made here must outlive the write
    if (PyErr_Occurred()) return false;
    Publish();
    return true;
  }

  bool Key(PyObject* k) {
    if (PyUnicode_CheckExact(k)) {
      Py_ssize_t n = 0;
      const char* s = PyUnicode_AsUTF8AndSize(k, &n);
      if (s == nullptr) return false;
      PutText('S', s, n);
      return true;
    }
    if (PyLong_CheckExact(k)) return Walk(k, 0);
    return false;
  }

  // A container subclass that is Stateful (safepoint._stateful.is_stateful: state_dict and
  // load_state_dict) needs its load_state_dict called on a restore: no whole restore. Looked up
  // on the type, so that no instance __getattr__ runs during the walk.
  void NoteSubclass(PyObject* o) {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(o));
    if (out_->plain && PyObject_HasAttrString(type, "load_state_dict") &&
        PyObject_HasAttrString(type, "state_dict")) {
      out_->plain = false;
    }
  }

  bool Items(PyObject* seq, size_t depth) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PutRaw<uint64_t>(static_cast<uint64_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!Walk(PySequence_Fast_GET_ITEM(seq, i), depth + 1)) return false;
    }
    return true;
  }

  bool Walk(PyObject* o, size_t depth) {
    if (depth > kMaxExtrasDepth) return false;
    if (o == Py_None) {
      Put('N');
      return true;
    }
    if (PyBool_Check(o)) {
      Put(o == Py_True ? 'T' : 'F');
      return true;
    }
    if (PyLong_CheckExact(o)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow || (v == -1 && PyErr_Occurred())) return false;
      Put('I');
      PutRaw<int64_t>(v);
      return true;
    }
    if (PyFloat_CheckExact(o)) {
      Put('D');
      PutRaw<double>(PyFloat_AS_DOUBLE(o));
      return true;
    }
    if (PyUnicode_CheckExact(o)) {
      Py_ssize_t n = 0;
      const char* s = PyUnicode_AsUTF8AndSize(o, &n);
      if (s == nullptr) return false;
      PutText('S', s, n);
      return true;
    }
    if (PyBytes_CheckExact(o)) {
      PutText('B', PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o));
      return true;
    }
    Types& t = T();
    if (PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(t.tensor_type.ptr()))) {
      return Tensor(o);
    }
    if (PyDict_Check(o)) {
      if (!PyDict_CheckExact(o)) NoteSubclass(o);
      Put('M');
      PutRaw<uint64_t>(static_cast<uint64_t>(PyDict_Size(o)));
      PyObject *k, *v;
      Py_ssize_t pos = 0;
      const TorchProbeApi* probe = t.probe;
      if (probe == nullptr || PyDict_Size(o) < 64) {
        while (PyDict_Next(o, &pos, &k, &v)) {
          if (!Key(k) || !Walk(v, depth + 1)) return false;
        }
        return true;
      }
      // Large dicts (a model's parameters): prefetch the values ahead of the walk, stage s
      // kAhead[s] values ahead (torch_probe.h).
      constexpr int kAhead[3] = {12, 8, 4};
      Py_ssize_t ahead[3] = {0, 0, 0};
      PyObject *ak, *av;
      for (int s = 0; s < 3; ++s) {
        for (int i = 0; i < kAhead[s] && PyDict_Next(o, &ahead[s], &ak, &av); ++i) {
          probe->prefetch(av, s);
        }
      }
      while (PyDict_Next(o, &pos, &k, &v)) {
        for (int s = 0; s < 3; ++s) {
          if (PyDict_Next(o, &ahead[s], &ak, &av)) {
            probe->prefetch(av, s);
            if (s == 0) PrefetchSeen(av);
          }
        }
        if (!Key(k) || !Walk(v, depth + 1)) return false;
      }
      return true;
    }
    if (PyList_Check(o)) {
      if (!PyList_CheckExact(o)) NoteSubclass(o);
      Put('L');
      return Items(o, depth);
    }
    if (PyTuple_Check(o)) {
      if (!PyTuple_CheckExact(o)) NoteSubclass(o);
      Put('U');
      return Items(o, depth);
    }
    if (PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(t.ndarray_type.ptr()))) {
      return Array(o);
    }
    return false;  // numpy scalars, other mappings, objects to pickle: Flattener
  }

  PlanWalk* out_ = nullptr;
  bool streaming_ = false;
  size_t checked_ = 0;      // signature bytes known to match out_->expect
  size_t pos_ = 0;          // the signature's length so far (its bytes beyond are scratch)
  TorchTensorFacts facts_;  // ProbedTensor's
  std::vector<PyObject*> keys_;
  std::vector<size_t> vals_;
  int shift_ = 58;  // 64 - log2(keys_.size())
  size_t count_ = 0;
  PyObject* last_dtype_ = nullptr;
  DType last_code_{};
  PyObject* last_mesh_ = nullptr;
  std::string last_mesh_enc_;
};

class Rebuilder {
 public:
  // With a reader, tensors become views into `buffer`; without, each tensor reference becomes
  // slot_factory(index of its index entry) (metadata only, nothing is read).
  Rebuilder(nb::handle buffer, const ImageReader* reader, size_t tensor_count, nb::handle unpickler,
            nb::handle slot_factory)
      : buffer_(buffer), reader_(reader), unpickler_(unpickler), slot_factory_(slot_factory) {
    made_.resize(tensor_count * 3);
  }

  // Tensor `index` (as a torch tensor) is `t` rather than a view into the buffer.
  void Preset(size_t index, nb::object t) { made_[index * 3] = std::move(t); }

  nb::object Build(const Value& v) {
    struct V {
      Rebuilder& r;
      nb::object operator()(const std::monostate&) { return nb::none(); }
      nb::object operator()(bool b) { return nb::bool_(b); }
      nb::object operator()(int64_t i) { return nb::int_(i); }
      nb::object operator()(const BigInt& b) {
        nb::bytes raw(b.bytes.data(), b.bytes.size());
        return nb::module_::import_("builtins")
            .attr("int")
            .attr("from_bytes")(raw, "little", nb::arg("signed") = true);
      }
      nb::object operator()(double d) { return nb::float_(d); }
      nb::object operator()(const std::string& s) { return nb::str(s.data(), s.size()); }
      nb::object operator()(const Bytes& b) { return nb::bytes(b.data.data(), b.data.size()); }
      nb::object operator()(const List& l) {
        nb::list out;
        for (const Value& x : l.items) out.append(r.Build(x));
        return out;
      }
      nb::object operator()(const Tuple& t) {
        PyObject* tup = PyTuple_New(static_cast<Py_ssize_t>(t.items.size()));
        if (tup == nullptr) throw nb::python_error();
        nb::object out = nb::steal(tup);
        for (size_t i = 0; i < t.items.size(); ++i) {
          PyTuple_SET_ITEM(tup, i, r.Build(t.items[i]).release().ptr());
        }
        return out;
      }
      nb::object operator()(const Dict& d) {
        nb::dict out;
        for (const auto& [k, x] : d.items) out[r.Build(k)] = r.Build(x);
        return out;
      }
      nb::object operator()(const TensorRef& t) { return r.Tensor(t); }
      nb::object operator()(const Pickled& p) {
        if (!r.unpickler_.is_valid() || r.unpickler_.is_none()) {
          ThrowStatus(InvalidArgument(
              "the checkpoint holds a pickled Python object; load it with allow_pickle=True "
              "(only if you trust where it came from)"));
        }
        return r.unpickler_(nb::bytes(p.data.data(), p.data.size()));
      }
    };
    return std::visit(V{*this}, v.v);
  }

 private:
  nb::object Tensor(const TensorRef& ref) {
    nb::object& slot = made_[ref.index * 3 + ref.kind];
    if (slot.is_valid()) return slot;
    if (reader_ == nullptr) return slot = slot_factory_(ref.index);
    Types& t = T();
    const TensorEntry& e = reader_->tensors()[ref.index];
    if (e.spec.elsewhere) return slot = Elsewhere(e, ref.kind);
    const size_t ndim = e.spec.shape.size();
    nb::object shape = nb::steal(PyTuple_New(static_cast<Py_ssize_t>(ndim)));
    for (size_t i = 0; i < ndim; ++i) {
      PyTuple_SET_ITEM(shape.ptr(), i, PyLong_FromUnsignedLongLong(e.spec.shape[i]));
    }
    if (ref.kind == 0) {
      const int key = static_cast<int>(e.spec.dtype);
      auto typed = typed_.find(key);
      if (typed == typed_.end()) {
        if (!torch_base_.is_valid()) torch_base_ = t.from_numpy(buffer_);
        typed = typed_.emplace(key, torch_base_.attr(t.s_view)(t.torch_by_dtype.at(key))).first;
      }
      nb::object stride = nb::steal(PyTuple_New(static_cast<Py_ssize_t>(ndim)));
      uint64_t s = 1;
      for (size_t i = ndim; i-- > 0;) {
        PyTuple_SET_ITEM(stride.ptr(), i, PyLong_FromUnsignedLongLong(s));
        s *= std::max<uint64_t>(e.spec.shape[i], 1);
      }
      nb::object offset =
          nb::steal(PyLong_FromUnsignedLongLong(e.offset / DTypeSize(e.spec.dtype)));
      PyObject* args[4] = {typed->second.ptr(), shape.ptr(), stride.ptr(), offset.ptr()};
      PyObject* r = PyObject_Vectorcall(t.as_strided.ptr(), args, 4, nullptr);
      if (r == nullptr) throw nb::python_error();
      slot = nb::steal(r);
    } else {
      nb::object arr = t.np_ndarray(shape, std::string(DTypeName(e.spec.dtype)),
                                    nb::arg("buffer") = buffer_, nb::arg("offset") = e.offset);
      slot = ref.kind == 1 ? arr : arr[nb::tuple()];
    }
    return slot;
  }

  // A tensor whose bytes another rank's image holds: a fresh tensor, listed in `elsewhere_` as
  // (name, tensor, global shape, global offset) for the caller to fill from that image.
  nb::object Elsewhere(const TensorEntry& e, uint8_t kind) {
    Types& t = T();
    nb::object shape = nb::cast(e.spec.shape);
    nb::object tensor = t.torch.attr("empty")(
        shape, nb::arg("dtype") = t.torch_by_dtype.at(static_cast<int>(e.spec.dtype)));
    const bool box = !e.spec.global_shape.empty();
    std::vector<uint64_t> zeros(e.spec.shape.size(), 0);
    elsewhere_.append(nb::make_tuple(e.spec.name, tensor,
                                     nb::cast(box ? e.spec.global_shape : e.spec.shape),
                                     nb::cast(box ? e.spec.global_offset : zeros)));
    if (kind == 0) return tensor;
    nb::object arr = tensor.attr("numpy")();  // shares the tensor's memory
    return kind == 1 ? arr : arr[nb::tuple()];
  }

 public:
  nb::list elsewhere_;

 private:
  nb::handle buffer_;
  const ImageReader* reader_;
  nb::handle unpickler_;
  nb::handle slot_factory_;
  nb::object torch_base_;
  std::unordered_map<int, nb::object> typed_;
  std::vector<nb::object> made_;
};

}  // namespace

FlatState FlattenState(nb::handle state, nb::handle pickler, Stage stage) {
  return Flattener(pickler, stage).Run(state);
}

bool WalkForPlan(nb::handle state, size_t hint, PlanWalk* out) {
  return PlanWalker(hint).Run(state, out);
}

std::optional<DType> TorchDType(nb::handle dtype) {
  auto it = T().torch_dtypes.find(dtype.ptr());
  if (it == T().torch_dtypes.end()) return std::nullopt;
  return it->second;
}

bool SetTorchProbe(bool enabled) {
  Types& t = T();
  t.probe = enabled ? t.probe_loaded : nullptr;
  return t.probe != nullptr;
}

nb::object RebuildState(const Value& skeleton, nb::handle buffer, const ImageReader& reader,
                        nb::handle unpickler, nb::list* elsewhere,
                        const std::vector<nb::object>* filled) {
  Rebuilder r(buffer, &reader, reader.tensors().size(), unpickler, nb::none());
  if (filled != nullptr) {
    for (size_t i = 0; i < filled->size() && i < reader.tensors().size(); ++i) {
      if ((*filled)[i].is_valid()) r.Preset(i, (*filled)[i]);
    }
  }
  nb::object out = r.Build(skeleton);
  if (elsewhere != nullptr) *elsewhere = r.elsewhere_;
  return out;
}

nb::object RebuildSkeleton(const Value& skeleton, size_t tensor_count, nb::handle unpickler,
                           nb::handle slot_factory) {
  return Rebuilder(nb::none(), nullptr, tensor_count, unpickler, slot_factory).Build(skeleton);
}

}  // namespace safepoint::python
