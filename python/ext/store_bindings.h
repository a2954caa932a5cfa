// Checkpoints on storage for Python (store_bindings.cc): save, load, steps and partial reads of
// committed steps, and what the client's bindings (client_bindings.cc) share with them: the
// loaded state, a save's lineage, core calls without the GIL.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "safepoint/checkpoint.h"
#include "safepoint/extras.h"
#include "safepoint/image.h"

namespace safepoint::python {

namespace nb = nanobind;

// load() and a memory snapshot's load: the state, whose tensors are views into the loaded image.
struct Loaded {
  uint64_t step = 0;
  uint32_t world_size = 0;
  std::string job;
  nb::object state;
  // (name, tensor, global shape, global offset) of tensors another rank's image holds, for the
  // caller to fill (replicas written once).
  nb::list elsewhere;
  std::string source;                // what it was read from
  uint64_t generation = 0;           // of the COMMIT record read (CommitRecord::generation)
  uint64_t attempt = 0;              // the save attempt of the image (ImageMeta::attempt)
  std::vector<std::string> skipped;  // newer steps skipped as damaged, one line each
};

// The lineage of a save (ImageMeta::lineage) from its Python arguments.
Lineage MakeLineage(std::optional<uint64_t> parent_step, const std::string& parent_location,
                    const std::string& metadata);

// What load() returns to Python: the step and the state, whose tensors are views into the loaded
// image (zero copy, zero parse), kept alive through a numpy array that owns the image. `filled`:
// per image entry, the tensor a load in place filled (returned instead of a view), or null.
Loaded LoadedToPython(const LoadedImage& image, const ImageReader& reader, const Value& extras,
                      nb::handle unpickler, const std::vector<nb::object>* filled = nullptr);

// Runs f with the GIL released (the core never calls back into Python).
template <typename F>
auto WithoutGil(F&& f) {
  nb::gil_scoped_release release;
  return f();
}

// Adds SaveResult, Loaded, TensorInfo, ShardMetadata, save, load, steps, TensorSlot, ShardReader,
// read_metadata and read_ranges to `m`.
void BindStore(nb::module_& m);

}  // namespace safepoint::python
