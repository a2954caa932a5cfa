// JobConfig: what a job persists to, kept in the job directory as job.json.
//
// The first client's hello fixes a job's configuration; the agent writes it to
// <job_dir>/job.json so that a later agent (after this one died or exited idle) can adopt the
// snapshots left in shared memory and persist them to the same place. Writing goes through a
// temporary file and a rename, so a reader sees the old file, the new one or none; every error
// (a full tmpfs, a read-only directory) is returned with the path, never ignored: without
// job.json a later agent cannot adopt the job.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "safepoint/status.h"
#include "safepoint/tiers.h"

namespace safepoint::agent {

struct JobConfig {
  std::string storage;
  uint32_t world_size = 1;
  uint32_t keep = 3;
  std::vector<TierSpec> tiers;       // the storage tiers below `storage`, in order
  std::string compression = "none";  // how `storage` stores steps (TierSpec's fields)
  bool incremental = false;
  bool operator==(const JobConfig&) const = default;
};

// The job's configuration; nullopt when the job directory has no job.json (a new job). A file that
// does not parse is Corruption naming it.
Result<std::optional<JobConfig>> ReadJobConfig(const std::string& job_dir);

// Writes job.json atomically (temporary file, full write, rename). On failure nothing is left
// behind but the previous job.json, if any.
Status WriteJobConfig(const std::string& job_dir, const JobConfig& config);

}  // namespace safepoint::agent
