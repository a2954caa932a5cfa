// Flattening a state tree for a save (state.h): FlattenState, the tensors and the non-tensor
// skeleton; the dtype lookups. The plan walk is state_plan.cc, the rebuild state_rebuild.cc.
#include "state.h"

#include "state_types.h"

namespace safepoint::python {

namespace {

using state_detail::Dims;
using state_detail::DTensorType;
using state_detail::NumpyDTypeOk;
using state_detail::T;
using state_detail::Types;

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

}  // namespace

FlatState FlattenState(nb::handle state, nb::handle pickler, Stage stage) {
  return Flattener(pickler, stage).Run(state);
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

}  // namespace safepoint::python
