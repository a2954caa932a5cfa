// Opening the checkpoint a command reads, and picking its step (apps/cli_store.cc): shared by
// the commands of the CLI (safepoint_main.cc, cli_inspect.cc, cli_versions.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "safepoint/checkpoint.h"
#include "safepoint/status.h"

namespace safepoint::cli {

// Logs each as "skipping ...".
void ReportProblems(const std::vector<std::string>& problems);

// A directory that a command reads must exist. Storage creates a missing checkpoint directory
// when it opens it (a Checkpointer saves into a fresh path) and lists nothing there, and
// ListJobDirectories takes a missing shm directory for one without jobs; but a path given to a
// command that reads is a typo or a missing mount: saying "no committed steps" (and creating the
// directory) would hide it. `what` names it in the error ("checkpoint directory").
Status CheckDirectory(const std::string& path, const std::string& what);

// The local directory of a checkpoint path that OpenStorage opens as POSIX storage (a plain path,
// file:///abs or file://localhost/abs), or nullopt for other storage (which has no directories).
std::optional<std::string> LocalDirectory(std::string_view path);

// The checkpoint at `path`, which must exist: checked before the store is opened, which would
// create it.
Result<std::unique_ptr<CheckpointStore>> OpenExistingStore(const std::string& path);

// " (committed steps: 3 8)", " (no committed steps)"; a long list shows its first and last
// steps and how many there are.
std::string CommittedStepsNote(const std::vector<CommitRecord>& committed);

// The committed step `step`, or the newest one. A step that is not committed is NotFound that
// lists the committed steps.
Result<CommitRecord> PickStep(CheckpointStore& store, std::optional<uint64_t> step);

}  // namespace safepoint::cli
