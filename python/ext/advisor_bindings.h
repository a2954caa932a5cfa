// The measurement history, the interval advisor and its controller for the Python layer
// (advisor_bindings.cc).
#pragma once

#include <nanobind/nanobind.h>

namespace safepoint::python {

// Adds history_path, parse_duration, read_history, read_job_history, advise_interval and
// IntervalController to `m`.
void BindAdvisor(nanobind::module_& m);

}  // namespace safepoint::python
