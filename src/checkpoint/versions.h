// Versioning of a checkpoint directory: tags, step references, lineage and diffs between steps
// (docs/format.md, "Tags" and "Lineage"; docs/guide.md, "Versions").
//
// A tag names a committed step and keeps it past retention. It is one small object
// `tags/<name>` in the checkpoint directory, written with the storage's atomic publish (POSIX:
// temporary file, fsync, rename, directory fsync; S3: one PUT; RADOS: one head write), so a
// reader sees the old tag or the new one, never a torn one. A tag's record carries its own CRC.
// Tags of a step that was deleted (rm --force) name no step: they resolve to NotFound.
//
// Lineage lives in every image's header (ImageMeta::lineage), so it goes wherever the image
// goes; these functions only read it.
//
// Thread safety: stateless functions over a CheckpointStore (which is thread safe).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "safepoint/checkpoint.h"
#include "safepoint/image.h"
#include "safepoint/status.h"

namespace safepoint {

inline constexpr size_t kMaxTagNameLength = 128;

// 1..128 characters of [A-Za-z0-9._-], not starting with '.' or '-', not all digits and not
// "step-<digits>" (those are step numbers in a step reference). InvalidArgument saying why.
Status ValidateTagName(std::string_view name);
std::string TagObjectName(std::string_view name);  // "tags/<name>"

struct Tag {
  std::string name;
  uint64_t step = 0;
  int64_t create_time_ns = 0;
};

std::string EncodeTag(const Tag& tag);
Result<Tag> DecodeTag(std::span<const std::byte> data, std::string_view source);

// Names committed step `tag.step` (NotFound, listing the committed steps, when it is not).
// An existing tag of another step is AlreadyExists unless `replace`; of the same step, OK.
Status WriteTag(CheckpointStore& store, Tag tag, bool replace);
// NotFound naming the tags there are when the tag does not exist.
Result<Tag> ReadTag(CheckpointStore& store, std::string_view name);
Status DeleteTag(CheckpointStore& store, std::string_view name);
// Every tag, by name. A tag object that does not decode is reported through `problems` (and
// left out) when given, else it is an error.
Result<std::vector<Tag>> ListTags(CheckpointStore& store,
                                  std::vector<std::string>* problems = nullptr);
// Copies the tags of `from` that name steps committed in `to`: tags `to` lacks, and tags that
// name another step there (`from`'s win). Never deletes a tag of `to`: a location that lost its
// tags (a replaced disk) must not take the copies' protection from retention with it. Tags of
// `from` that cannot be read are skipped. Returns the names written.
Result<std::vector<std::string>> MirrorTags(CheckpointStore& from, CheckpointStore& to);
// The steps tags name. An error when a tag cannot be read: retention then deletes nothing
// rather than a step that a damaged tag might name.
Result<std::set<uint64_t>> TaggedSteps(CheckpointStore& store);

// A step reference: "123" or "step-123" (a committed step), or a tag's name. Returns the
// committed step; NotFound naming what exists otherwise.
Result<uint64_t> ResolveStep(CheckpointStore& store, std::string_view ref);

// The header of rank 0's image of a committed step (4 KiB read), checked against the record.
Result<ImageMeta> ReadStepHeader(CheckpointStore& store, const CommitRecord& commit);

// What changed in one tensor between two steps.
struct TensorDiff {
  enum class Kind { kSame, kChanged, kAdded, kRemoved, kReshaped };
  std::string name;
  Kind kind = Kind::kSame;
  DType dtype_a = DType::kFloat32, dtype_b = DType::kFloat32;
  std::vector<uint64_t> shape_a, shape_b;  // global shapes
  uint64_t elements = 0;                   // of the tensor (kSame, kChanged)
  uint64_t changed = 0;                    // elements whose bytes differ
  // Largest |b - a| over the changed elements of a real or integer dtype (complex: of either
  // part); +inf where a value became or stopped being NaN or infinite. Not set for float8.
  std::optional<double> max_abs;
};
std::string_view DiffKindName(TensorDiff::Kind kind);

struct DiffOptions {
  uint64_t window_bytes = 32 << 20;  // read from each step at a time (bounded memory)
  std::function<void(uint64_t done, uint64_t total)> progress;  // bytes compared
};

// Compares step `a` of `store_a` with step `b` of `store_b`, tensor by tensor (by name; shards
// assembled by their boxes in the global tensor, so steps saved by different world sizes
// compare). Every byte read is verified against its chunk's checksum; memory is bounded by
// two windows (read at once, one thread per step). Results sorted by name.
Result<std::vector<TensorDiff>> DiffSteps(CheckpointStore& store_a, uint64_t a,
                                          CheckpointStore& store_b, uint64_t b,
                                          const DiffOptions& options = {});

}  // namespace safepoint
