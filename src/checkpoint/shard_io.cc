// SaveShard and LoadShard: the synchronous API's save and load of one rank's image over a
// CheckpointStore (include/safepoint/checkpoint.h), with its rules: a committed step is
// immutable unless replaced by a save with overwrite and its own attempt, and a load of the
// newest step reads COMMIT records newest first and falls back past damaged steps; a load with
// a record already read (the job's one lookup handed it over) reads no COMMIT record.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "safepoint/checkpoint.h"

namespace safepoint {

Result<SaveResult> SaveShard(CheckpointStore& store, ImageMeta meta,
                             std::vector<TensorSource> tensors, std::string extras,
                             SaveOptions options) {
  const uint64_t step = meta.step;
  const uint32_t world_size = meta.world_size;
  const std::string job = meta.job;
  const uint64_t attempt = meta.attempt;
  const std::string what = store.storage().uri() + ": step " + std::to_string(step);
  // A committed step is immutable; a corrupt COMMIT record means the step does not exist.
  auto existing = store.ReadCommit(step);
  if (!existing.ok() && existing.status().code() != StatusCode::kNotFound &&
      existing.status().code() != StatusCode::kCorruption) {
    return existing.status();
  }
  if (existing.ok() && !options.overwrite) {
    return AlreadyExists(what +
                         " is already committed (a committed step is immutable; pass "
                         "overwrite=True to replace it)");
  }
  // A replacing save names its images by its attempt (every rank of it must share one), so
  // they never touch the committed images until its COMMIT record replaces the old one.
  uint64_t generation = 0;
  if (options.overwrite) {
    if (attempt == 0) {
      return InvalidArgument(what +
                             ": overwrite needs a non-zero attempt that every rank of "
                             "this save shares");
    }
    if (existing.ok() && existing->generation == attempt) {
      return InvalidArgument(what + " was committed by a save with attempt " +
                             std::to_string(attempt) + "; replacing it needs another attempt");
    }
    generation = attempt;
  }
  SP_ASSIGN_OR_RETURN(auto builder,
                      ImageBuilder::Create(std::move(meta), std::move(tensors), std::move(extras)));
  SP_ASSIGN_OR_RETURN(WriteStats stats, store.WriteImage(*builder, generation, options.pack));
  SaveResult result{stats.bytes, stats.seconds, stats.stored_bytes, false};
  SP_ASSIGN_OR_RETURN(result.committed,
                      store.TryCommit(step, world_size, job, attempt, generation));
  if (result.committed) {
    // Leftovers of older failed writes; a failure here loses nothing and is not the save's.
    store.CleanUp().status().IgnoreError();
  }
  return result;
}

namespace {
Result<LoadedShard> LoadCommitted(CheckpointStore& store, const CommitRecord& commit,
                                  uint32_t rank) {
  SP_ASSIGN_OR_RETURN(LoadedImage image, store.ReadImage(commit, rank));
  SP_ASSIGN_OR_RETURN(ImageReader reader, ImageReader::Parse(image.bytes(), image.source,
                                                             ImageReader::Verify::kStructure));
  // The caller allocates the tensors this image leaves to other ranks' images, then fills them
  // from those: some image must hold each (a forged or damaged step falls back to an older one).
  SP_RETURN_IF_ERROR(store.CheckReplicasHeld(commit, rank, reader.tensors()));
  SP_ASSIGN_OR_RETURN(Value extras,
                      DecodeExtras(reader.extras(), reader.tensors().size(), image.source));
  return LoadedShard{commit, std::move(image), std::move(reader), std::move(extras), {}};
}

// Loads `commit`; if its image is gone or changed because the step was replaced meanwhile (its
// COMMIT record changed), loads the new record instead.
Result<LoadedShard> LoadCommittedOrReplacement(CheckpointStore& store, CommitRecord commit,
                                               uint32_t rank) {
  for (int tries = 0;; ++tries) {
    auto shard = LoadCommitted(store, commit, rank);
    const StatusCode code = shard.ok() ? StatusCode::kOk : shard.status().code();
    if (shard.ok() || tries == 3 ||
        (code != StatusCode::kNotFound && code != StatusCode::kCorruption)) {
      return shard;
    }
    auto now = store.ReadCommit(commit.step);
    if (!now.ok() || EncodeCommitRecord(*now) == EncodeCommitRecord(commit)) return shard;
    commit = std::move(now).value();
  }
}
}  // namespace

Result<LoadedShard> LoadShard(CheckpointStore& store, const CommitRecord& commit, uint32_t rank) {
  return LoadCommittedOrReplacement(store, commit, rank);
}

Result<LoadedShard> LoadShard(CheckpointStore& store, std::optional<uint64_t> step, uint32_t rank) {
  if (step) {
    SP_ASSIGN_OR_RETURN(CommitRecord commit, store.ReadCommit(*step));
    return LoadCommittedOrReplacement(store, std::move(commit), rank);
  }
  // Newest first: one List, then the COMMIT records only down to the step that loads (not one
  // read per step kept).
  std::vector<std::string> skipped;
  SP_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, store.StepsWithCommit());
  while (!steps.empty()) {
    SP_ASSIGN_OR_RETURN(std::optional<CommitRecord> commit, store.NewestCommitted(steps, &skipped));
    if (!commit) break;
    while (!steps.empty() && steps.back() >= commit->step) steps.pop_back();
    const uint64_t at = commit->step;
    auto shard = LoadCommittedOrReplacement(store, std::move(*commit), rank);
    if (shard.ok()) {
      shard->skipped = std::move(skipped);
      return shard;
    }
    const StatusCode code = shard.status().code();
    if (code != StatusCode::kCorruption && code != StatusCode::kNotFound) return shard.status();
    skipped.push_back("step " + std::to_string(at) + ": " + shard.status().message());
  }
  std::string m = store.storage().uri() + ": no committed checkpoint";
  if (!skipped.empty()) {
    m += " that can be read (";
    for (size_t i = 0; i < skipped.size(); ++i) m += (i ? "; " : "") + skipped[i];
    m += ")";
    return Corruption(m);
  }
  return NotFound(m);
}

}  // namespace safepoint
