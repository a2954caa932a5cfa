// Small objects of a checkpoint directory (COMMIT records, packed manifests, the chunk store's
// lock and intent records): written and published in one call, or read whole with a size cap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "safepoint/status.h"
#include "safepoint/storage.h"

namespace safepoint::internal {

// Publishes `data` as `name`: replacing what is there, or when `exclusive` only where nothing is
// (AlreadyExists otherwise).
Status WriteSmallObject(Storage& storage, std::string_view name, std::string_view data,
                        bool exclusive = false);

// The whole object `name`; Corruption naming it when it is larger than `max` bytes.
Result<std::vector<std::byte>> ReadSmallObject(Storage& storage, std::string_view name,
                                               uint64_t max);

}  // namespace safepoint::internal
