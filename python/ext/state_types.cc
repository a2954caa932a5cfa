// The state walkers' shared lookups (state_types.h).
#include "state_types.h"

namespace safepoint::python::state_detail {

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

nb::handle DTensorType() {
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

}  // namespace safepoint::python::state_detail
