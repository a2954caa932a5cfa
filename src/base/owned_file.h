// OpenOwnedForAppend: opens a file that the agent appends to (its event log, the job's
// measurement history) where another local user may reach the directory (/tmp, a shared
// checkpoint directory), without letting that user choose what is written to, or read it.
//
// The file is opened with O_NOFOLLOW (a symlink at the path is refused, never followed) and
// O_NONBLOCK (a FIFO planted at the path cannot block the open; the flag is cleared after), and
// created with `create_mode` when absent. The open file is then refused unless it is a regular
// file owned by this process's effective uid, not writable by group or others, with a single
// link: else another user could have planted it (a file of theirs, 0666, that they then read),
// or could write lines into it. Every refusal is InvalidArgument naming the path, what is wrong
// and how to fix it; no byte is written. The directory must exist.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

#include "base/unique_fd.h"
#include "safepoint/status.h"

namespace safepoint::internal {

// `what` names the file in errors ("event log", "history").
Result<UniqueFd> OpenOwnedForAppend(const std::string& path, mode_t create_mode,
                                    std::string_view what);

}  // namespace safepoint::internal
