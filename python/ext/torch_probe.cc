// safepoint._torchprobe: the tensor facts _core needs, read from the C++ tensor (torch_probe.h).
#include "torch_probe.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <string>

namespace {

using safepoint::python::TorchTensorFacts;

int Probe(PyObject* o, TorchTensorFacts* facts) {
  if (!THPVariable_Check(o)) return 0;
  const at::Tensor& t = THPVariable_Unpack(o);
  if (!t.defined() || t.layout() != c10::kStrided || !t.is_cpu() || t.is_conj() || t.is_neg()) {
    return 0;
  }
  const c10::IntArrayRef sizes = t.sizes();
  if (sizes.size() > static_cast<size_t>(safepoint::python::kTorchProbeMaxDims)) return 0;
  facts->ndim = static_cast<int>(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) facts->sizes[i] = sizes[i];
  facts->dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  facts->contiguous = t.is_contiguous();
  facts->data = t.has_storage() ? t.const_data_ptr() : nullptr;
  return 1;
}

void Prefetch(PyObject* o, int stage) {
  if (stage == 0) {
    __builtin_prefetch(o);
    return;
  }
  PyTypeObject* type = Py_TYPE(o);
  if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) &&
      type != reinterpret_cast<PyTypeObject*>(ParameterClass)) {
    return;
  }
  const c10::TensorImpl* impl = THPVariable_Unpack(o).unsafeGetTensorImpl();
  if (stage == 1) {
    // The fields the probe reads span the impl's first few cache lines.
    for (size_t off = 0; off < sizeof(c10::TensorImpl); off += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(impl) + off);
    }
  } else if (impl->has_storage()) {
    __builtin_prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
  }
}

const safepoint::python::TorchProbeApi kApi = {&Probe, &Prefetch};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_torchprobe",
                       "The tensor facts safepoint._core needs, from the C++ tensor.", -1};

}  // namespace

PyMODINIT_FUNC PyInit__torchprobe() {
  // Built against one torch: refuse another (its tensor layout may differ), so that _core
  // takes the Python route instead.
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) return nullptr;
  PyObject* version = PyObject_GetAttrString(torch, "__version__");
  Py_DECREF(torch);
  if (version == nullptr) return nullptr;
  PyObject* text = PyObject_Str(version);
  Py_DECREF(version);
  if (text == nullptr) return nullptr;
  const char* have = PyUnicode_AsUTF8(text);
  const bool same = have != nullptr && std::string(have) == SAFEPOINT_TORCH_VERSION;
  Py_DECREF(text);
  if (!same) {
    PyErr_Format(PyExc_ImportError,
                 "safepoint._torchprobe was built for torch %s, this is torch %s",
                 SAFEPOINT_TORCH_VERSION, have ? have : "?");
    return nullptr;
  }
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  PyObject* capsule = PyCapsule_New(const_cast<safepoint::python::TorchProbeApi*>(&kApi),
                                    safepoint::python::kTorchProbeCapsule, nullptr);
  if (capsule == nullptr || PyModule_AddObject(m, "probe", capsule) != 0) {
    Py_XDECREF(capsule);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
