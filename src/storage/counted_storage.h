// CountRequests: wraps a Storage so that every request it makes is counted under `scheme`
// (include/safepoint/storage.h, StorageRequestCounts). OpenStorage applies it to every backend;
// private to the library. The wrapper forwards CancelRequests (storage/cancellable.h) to the
// backend it wraps.
#pragma once

#include <memory>
#include <string_view>

#include "safepoint/storage.h"

namespace safepoint::internal {

std::unique_ptr<Storage> CountRequests(std::unique_ptr<Storage> inner, std::string_view scheme);

}  // namespace safepoint::internal
