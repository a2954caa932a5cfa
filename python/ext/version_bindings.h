// Versioning for the Python package (src/checkpoint/versions.h): step references, tags and the
// lineage recorded in a step's header.
#pragma once

#include <nanobind/nanobind.h>

namespace safepoint::python {

// Adds resolve_step, step_lineage, tags, set_tag and delete_tag to `m`.
void BindVersions(nanobind::module_& m);

}  // namespace safepoint::python
