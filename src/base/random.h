// Unpredictable names for temporary files (slot files, temporary objects).
#pragma once

#include <string>

namespace safepoint::internal {

// 16 lowercase hex digits from getrandom(2); without entropy, a mix of time, pid and a counter
// (callers create with O_EXCL, so a collision is detected, not trusted).
std::string RandomHex16();

}  // namespace safepoint::internal
