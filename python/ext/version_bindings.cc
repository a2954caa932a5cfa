// safepoint._core: step references, tags and lineage (version_bindings.h). The GIL is released
// around storage calls.
#include "version_bindings.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checkpoint/versions.h"
#include "errors.h"
#include "safepoint/checkpoint.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace safepoint::python {

namespace {

// Runs f(store) on the checkpoint at `path` with the GIL released; raises on an error.
template <typename T, typename F>
T OnStore(const std::string& path, F&& f) {
  Result<T> r = Status(StatusCode::kCancelled, "not run");
  {
    nb::gil_scoped_release release;
    auto store = OpenCheckpointStore(path);
    r = store.ok() ? f(**store) : Result<T>(store.status());
  }
  if (!r.ok()) ThrowStatus(r.status());
  return std::move(r).value();
}

using LineageTuple = std::tuple<uint64_t, std::optional<uint64_t>, std::string, std::string>;

}  // namespace

void BindVersions(nb::module_& m) {
  m.def(
      "resolve_step",
      [](const std::string& path, const std::string& ref) {
        return OnStore<uint64_t>(path, [&](CheckpointStore& s) { return ResolveStep(s, ref); });
      },
      "path"_a, "ref"_a, "The committed step a reference names: N, step-N or a tag");
  m.def(
      "step_lineage",
      [](const std::string& path, uint64_t step) {
        return OnStore<LineageTuple>(path, [&](CheckpointStore& s) -> Result<LineageTuple> {
          SP_ASSIGN_OR_RETURN(CommitRecord c, s.ReadCommit(step));
          SP_ASSIGN_OR_RETURN(ImageMeta meta, ReadStepHeader(s, c));
          const Lineage& l = meta.lineage;
          return LineageTuple{meta.attempt,
                              l.has_parent ? std::optional<uint64_t>(l.parent_step) : std::nullopt,
                              l.parent_location, l.metadata};
        });
      },
      "path"_a, "step"_a,
      "(attempt, parent step or None, parent location ('' for this checkpoint), metadata JSON) "
      "of a committed step");
  m.def(
      "tags",
      [](const std::string& path) {
        using Out = std::vector<std::tuple<std::string, uint64_t>>;
        return OnStore<Out>(path, [&](CheckpointStore& s) -> Result<Out> {
          SP_ASSIGN_OR_RETURN(auto tags, ListTags(s));
          Out out;
          for (const Tag& t : tags) out.emplace_back(t.name, t.step);
          return out;
        });
      },
      "path"_a, "(name, step) of every tag");
  m.def(
      "set_tag",
      [](const std::string& path, uint64_t step, const std::string& name, bool replace) {
        OnStore<bool>(path, [&](CheckpointStore& s) -> Result<bool> {
          SP_RETURN_IF_ERROR(WriteTag(s, Tag{name, step, 0}, replace));
          return true;
        });
      },
      "path"_a, "step"_a, "name"_a, "replace"_a = false, "Names a committed step");
  m.def(
      "delete_tag",
      [](const std::string& path, const std::string& name) {
        OnStore<bool>(path, [&](CheckpointStore& s) -> Result<bool> {
          SP_RETURN_IF_ERROR(DeleteTag(s, name));
          return true;
        });
      },
      "path"_a, "name"_a, "Deletes a tag");
}

}  // namespace safepoint::python
