// The commit record's fixed layout (docs/format.md, "COMMIT record"), shared by its codec
// (commit_record.cc) and the store that reads records (checkpoint_store.cc). Private to the
// library.
#pragma once

#include <cstddef>

namespace safepoint::internal {

inline constexpr char kCommitMagic[8] = {'S', 'P', 'C', 'O', 'M', 'M', 'I', 'T'};
// Bytes before the per-rank entries: magic, version, world size, step, time, job length, job.
inline constexpr size_t kCommitFixed = 100;

}  // namespace safepoint::internal
