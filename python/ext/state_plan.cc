// The plan walk of a state tree (state.h, WalkForPlan): the same traversal as the Flattener
// (state.cc), recording a signature and the tensors' addresses for a save that reuses its plan.
#include "state.h"
#include "state_types.h"

namespace safepoint::python {

namespace {

using state_detail::Dims;
using state_detail::DTensorType;
using state_detail::NumpyDTypeOk;
using state_detail::T;
using state_detail::Types;

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
      nb::handle dtensor = DTensorType();
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

}  // namespace

bool WalkForPlan(nb::handle state, size_t hint, PlanWalk* out) {
  return PlanWalker(hint).Run(state, out);
}

}  // namespace safepoint::python
