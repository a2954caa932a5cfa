// safepoint._core: the nanobind binding of the C++ core. This file makes the module from the
// bindings of each part: checkpoints on storage (store_bindings.cc), the node agent's client
// (client_bindings.cc), the layout's names (format_bindings.cc), the codec, versions and the
// interval advisor. Every C++ Status becomes a Python exception in error_bindings.cc, and
// nowhere else.
#include <nanobind/nanobind.h>

#include "advisor_bindings.h"
#include "client_bindings.h"
#include "codec_bindings.h"
#include "format_bindings.h"
#include "safepoint/build_config.h"
#include "safepoint/image.h"
#include "state.h"
#include "store_bindings.h"
#include "version_bindings.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_core, m) {
  using namespace safepoint;
  m.doc() = "safepoint's C++ core (internal; use the safepoint package)";
  python::BindStore(m);
  m.def("set_torch_probe", &python::SetTorchProbe, "enabled"_a,
        "Whether saves and restores read tensors through safepoint._torchprobe (one C++ call "
        "a tensor) or through torch's Python API; returns whether the probe is now in use "
        "(False where it is not built or is for another torch).");
  python::BindClient(m);
  python::BindFormat(m);
  python::BindCodec(m);
  python::BindVersions(m);
  python::BindAdvisor(m);
  m.attr("__version__") = SAFEPOINT_VERSION;
  m.attr("VERSION") = SAFEPOINT_VERSION;  // __version__ for type checkers (stubs omit dunders)
  m.attr("FORMAT_VERSION") = kImageFormatVersion;
}
