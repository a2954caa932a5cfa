// Rebuilding a state tree from a loaded image or a skeleton (state.h): RebuildState and
// RebuildSkeleton.
#include "state.h"
#include "state_types.h"

namespace safepoint::python {

namespace {

using state_detail::T;
using state_detail::Types;

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
