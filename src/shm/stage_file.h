// Staging files: shared-memory buffers of one process that belong to no job
// (safepoint.dcp.ShmStager copies a state dict into one before dcp.async_save writes it).
//
// Every staging file of a user lies in one directory, "<shm_dir>/safepoint-stage-<uid>" (0700),
// beside the job directories "<shm_dir>/safepoint-<uid>-<job>" (docs/format.md): "stage" is not
// a uid, so the two never collide. A file is named after the process that created it,
// "<pid>-<start ticks>-<16 hex digits>.buf" (base/process.h), and has mode 0600. Its owner removes
// it when done; a process killed before it could (SIGKILL, the OOM killer) leaves it behind, and
// RemoveDeadStageFiles (`safepoint gc`) removes exactly those whose owner no longer runs.
//
// Thread safety: a StageFile is used by one thread at a time; distinct files and
// RemoveDeadStageFiles may be used concurrently, also from several processes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "safepoint/status.h"

namespace safepoint::internal {

// "<shm_dir>/safepoint-stage-<uid>".
std::string StageDirectory(const std::string& shm_dir);

class StageFile {
 public:
  // Creates a staging file of `size` bytes (at least one page is mapped) in this user's staging
  // directory (created when missing; refused when it is not a private directory of this user),
  // reserves its space and writes every page once, so that copies into it never take first-touch
  // faults and a full shm_dir fails here (ResourceExhausted naming the bytes), never with SIGBUS
  // later. On failure nothing is left behind.
  static Result<std::unique_ptr<StageFile>> Create(const std::string& shm_dir, uint64_t size);

  // Unmaps. The file stays until Remove(): a file is removed deliberately, not by a destructor
  // that runs at an unknown time.
  ~StageFile();
  StageFile(const StageFile&) = delete;
  StageFile& operator=(const StageFile&) = delete;

  const std::string& path() const { return path_; }
  std::span<std::byte> data() const { return {map_, size_}; }

  // Removes the file's name; the mapping stays valid until destruction. Idempotent.
  Status Remove();

 private:
  StageFile() = default;
  std::string path_;
  std::byte* map_ = nullptr;
  uint64_t size_ = 0;
  uint64_t map_size_ = 0;
  bool removed_ = false;
};

struct StageFilesRemoved {
  uint64_t files = 0;
  uint64_t bytes = 0;  // the space they held
};

// Removes this user's staging files under `shm_dir` whose owner no longer runs (with `dry_run`
// only counts them). Files of live processes and names that are not staging files are kept.
// No staging directory: nothing to remove.
Result<StageFilesRemoved> RemoveDeadStageFiles(const std::string& shm_dir, bool dry_run = false);

}  // namespace safepoint::internal
