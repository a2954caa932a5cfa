// State trees <-> images, at C++ speed.
//
// FlattenState walks a Python state (dicts, lists, tuples; torch tensors, numpy arrays and
// scalars; None/bool/int/float/str/bytes) once, producing the skeleton (the tree with every
// tensor replaced by a TensorRef) as a C++ Value and the list of tensors to write, with no Python
// code per tensor: states with 10,000+ tensors are normal, and this runs on the save path.
// RebuildState is the reverse on load: tensors become views into the loaded image (one
// as_strided per tensor on a typed view of the whole buffer).
#pragma once

#include <nanobind/nanobind.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "safepoint/checkpoint.h"
#include "safepoint/extras.h"
#include "safepoint/image.h"

namespace safepoint::python {

namespace nb = nanobind;

struct FlatState {
  Value skeleton;
  std::vector<TensorSource> tensors;
  nb::list keepalive;  // tensors made contiguous / copied to the CPU; hold until written
  nb::list staged;     // (tensor index, tensor) of the TensorSource::staged tensors
};

// Which tensors the caller copies into place itself (TensorSource::staged) instead of the walker
// handing out CPU pointers: none (the streaming save path), GPU tensors (flash snapshots:
// asynchronous copies into pinned slot memory), or every tensor (tests of that path on CPUs).
enum class Stage { kNone = 0, kDevice = 1, kAll = 2 };

// Raises InvalidArgumentError (a Python exception) naming the key of an unsupported value, unless
// `pickler` is a callable (allow_pickle), which then turns such a value into bytes.
FlatState FlattenState(nb::handle state, nb::handle pickler, Stage stage = Stage::kNone);

// The save plan's check (issue 14): a walk of the state that records, instead of the skeleton,
// a signature (every key, every non-tensor value, every tensor's dtype and shape, which tensor
// positions are the same object) and each tensor's data pointer. Two states with equal
// signatures flatten to the same tensor specs and the same extras, so a save whose signature
// equals the previous save's reuses its image plan and only rebinds the data pointers. The walk
// makes no per-tensor allocation beyond the signature's bytes.
struct PlanWalk {
  std::string signature;
  std::vector<const void*> data;  // tensor i's bytes, in FlattenState's tensor order
  nb::list keepalive;             // every tensor written; hold until written
  // No container of the state is Stateful (a dict, list or tuple subclass with state_dict and
  // load_state_dict): restoring into such a state needs no call besides the tensors' copies
  // and the values' assignments, so a whole restore may hand back the targets themselves
  // (DTensors included: their local shards were filled; safepoint._stateful.filled_in_place).
  // Checked on every walk (the signature does not tell a dict from its subclasses).
  bool plain = true;
  // Optional: the signature expected (the plan's), and where each tensor's address goes as
  // soon as everything up to its shape matched it (a copy may then start on it).
  const std::string* expect = nullptr;
  std::function<void(size_t, const void*)> publish;
  // Set by the walk: the length of the signature's prefix found equal to *expect while it
  // published (0 when it stopped publishing: another structure); the caller compares the rest.
  size_t expect_checked = 0;
};

// False when the state holds something only FlattenState handles (GPU or meta tensors, tensor
// subclasses other than nn.Parameter, DTensors, numpy scalars, big ints, objects to pickle, ...):
// the caller then flattens it as before. `hint`: the tensor count expected (the previous save's).
bool WalkForPlan(nb::handle state, size_t hint, PlanWalk* out);

// Whether WalkForPlan reads tensors through safepoint._torchprobe (torch_probe.h): turns it on
// (when it loaded) or off, and returns whether it is now in use.
bool SetTorchProbe(bool enabled);

// The image dtype of a torch.dtype; nullopt for one images cannot hold.
std::optional<DType> TorchDType(nb::handle dtype);

// `buffer` is the image as a numpy uint8 array that owns (a reference to) the bytes. Pickled
// values are passed to `unpickler`; when it is None they are refused with an error.
// Tensors held by another rank's image (TensorSpec::elsewhere) come back as fresh tensors,
// listed in `elsewhere` as (name, tensor, global shape, global offset) for the caller to fill.
// `filled` (optional, one entry per image tensor): tensors already copied into their targets
// (a restore in place); a valid object is used as that tensor instead of a view.
nb::object RebuildState(const Value& skeleton, nb::handle buffer, const ImageReader& reader,
                        nb::handle unpickler, nb::list* elsewhere = nullptr,
                        const std::vector<nb::object>* filled = nullptr);

// The state tree of an image whose tensors were not read: each tensor reference becomes
// slot_factory(index of its index entry).
nb::object RebuildSkeleton(const Value& skeleton, size_t tensor_count, nb::handle unpickler,
                           nb::handle slot_factory);

}  // namespace safepoint::python
