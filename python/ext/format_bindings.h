// What the Python adapters need to know about the on-storage layout and about shared memory
// outside the snapshot arenas, so that no Python code rebuilds a name or a path (docs/format.md).
#pragma once

#include <nanobind/nanobind.h>

namespace safepoint::python {

// Adds DTYPES, CHUNK_SIZE, step_path, split_step_path, image_path, image_ranks, delete_step,
// tensor_extent, slot_states, replica_key, StageFile and remove_dead_stage_files to `m`.
void BindFormat(nanobind::module_& m);

}  // namespace safepoint::python
