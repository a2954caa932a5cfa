// What the state walkers (state.cc, state_plan.cc, state_rebuild.cc) share: the torch and numpy
// objects looked up once per process, and small conversions. Internal to the extension.
#pragma once

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
#include "state.h"
#include "torch_probe.h"

namespace safepoint::python::state_detail {

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

// The process's Types (created on first use, never destroyed).
Types& T();
// The format's dtype of a numpy dtype name; false for one the format does not have.
bool NumpyDTypeOk(const std::string& name, DType* out);
// A shape (a tuple, or any iterable of ints) as dims.
std::vector<uint64_t> Dims(nb::handle shape);
// torch.distributed.tensor.DTensor where that module is imported, else an invalid handle.
nb::handle DTensorType();

}  // namespace safepoint::python::state_detail
