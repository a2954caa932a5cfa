// Test seam of PosixStorage (posix_storage.cc); private to the library and its tests.
//
// The failures that matter most for durability (a failed fsync of the data or of the directory
// after the rename) cannot be provoked on a healthy filesystem. A PosixStorage opened here asks
// `hook` before each of the two fsyncs of Publish; a non-zero answer is taken as that fsync's
// errno and the call is not made. It is also asked before the renameat2(RENAME_NOREPLACE) of
// PublishIfAbsent, where EINVAL makes the object take the path of a filesystem that refuses the
// flag (link + unlink). NewPosixStorage() never installs a hook.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "safepoint/storage.h"

namespace safepoint::internal {

enum class PosixPublishSync {
  kFile,             // fsync of the temporary file, before the rename
  kDirectory,        // fsync of the object's directory, after the rename
  kRenameNoReplace,  // PublishIfAbsent's renameat2(RENAME_NOREPLACE), before it is made
};

// `object_path` is the final path of the object being published. Returns 0 or an errno.
using PosixPublishSyncHook =
    std::function<int(PosixPublishSync sync, std::string_view object_path)>;

Result<std::unique_ptr<Storage>> NewPosixStorageWithSyncHook(std::string root,
                                                             PosixStorageOptions options,
                                                             PosixPublishSyncHook hook);

}  // namespace safepoint::internal
