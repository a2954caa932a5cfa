// The contract between _core and the optional module safepoint._torchprobe (torch_probe.cc).
//
// _core reads tensors through the Python C API, about 1 us a tensor in calls into torch (layout,
// device, dtype, shape, contiguity, data pointer). _torchprobe, built against the torch the
// package was built with, reads the same facts from the C++ tensor in one call; it exports
// `probe` as a capsule named kTorchProbeCapsule holding a TorchProbeApi. _core uses it when the
// module imports (it is not built where torch's headers are missing, and it refuses to load
// into another torch version), and otherwise the Python C API, with the same results.
#pragma once

#include <Python.h>

#include <cstdint>

namespace safepoint::python {

inline constexpr const char* kTorchProbeCapsule = "safepoint._torchprobe.probe";
inline constexpr int kTorchProbeMaxDims = 16;

struct TorchTensorFacts {
  const void* data = nullptr;  // the first element (storage offset included)
  PyObject* dtype = nullptr;   // the torch.dtype object (borrowed: process lifetime)
  int64_t sizes[kTorchProbeMaxDims] = {};
  int ndim = 0;
  bool contiguous = false;
};

// 1: `o` is a plain tensor (strided, on the CPU, no conjugate or negative bit, at most
// kTorchProbeMaxDims dimensions) and `facts` holds what it is; 0: it is something else (the
// caller takes the Python route, which handles or reports it). Never sets a Python error.
using TorchProbeFn = int (*)(PyObject* o, TorchTensorFacts* facts);

// Memory prefetch for an object the walk reaches soon: a state's tensors are scattered over the
// heap, and reading each one's C++ tensor and storage misses the cache twice. Stage 0 fetches
// the Python object, stage 1 (the object fetched) its C++ tensor, stage 2 (that fetched) its
// storage; the walk issues them a few objects ahead. Never touches memory of an object that is
// not a plain tensor beyond its type; never sets a Python error.
using TorchPrefetchFn = void (*)(PyObject* o, int stage);

// What the capsule holds.
struct TorchProbeApi {
  TorchProbeFn probe;
  TorchPrefetchFn prefetch;
};

}  // namespace safepoint::python
