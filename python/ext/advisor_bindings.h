// The measurement history, the goodput model's plan and the controller of persist_every="auto"
// for the Python layer (advisor_bindings.cc).
#pragma once

#include <nanobind/nanobind.h>

namespace safepoint::python {

// Adds history_path, parse_duration, format_duration, read_history, read_job_history,
// inputs_from_history, make_plan, advise_levels, persist_every_saves, interval_steps and
// IntervalController to `m`.
void BindAdvisor(nanobind::module_& m);

}  // namespace safepoint::python
