// The status document's pieces that the CLI shares with the agent (src/agent/status.cc).
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "safepoint/storage.h"
#include "shm/arena.h"

namespace safepoint::agent {

// One object per slot, keys in this order: slot, state, leased, step, image_bytes, capacity.
nlohmann::ordered_json SlotsJson(const std::vector<SlotInfo>& slots);

// One scheme's counts as the object StorageRequestsJson gives per scheme.
nlohmann::json StorageRequestCountsJson(const StorageRequestCounts& c);

// The storage requests this process made, by URI scheme: {"file": {"list": n, "head": n, "get":
// n, "create": n, "write": n, "put": n, "delete": n, "cleanup": n, "requests": n,
// "metadata_bytes": n, "data_bytes_read": n, "data_bytes_written": n}, ...}.
nlohmann::json StorageRequestsJson();

}  // namespace safepoint::agent
