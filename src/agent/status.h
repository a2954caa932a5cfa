// The status document's pieces that the CLI shares with the agent (src/agent/status.cc).
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "shm/arena.h"

namespace safepoint::agent {

// One object per slot, keys in this order: slot, state, leased, step, image_bytes, capacity.
nlohmann::ordered_json SlotsJson(const std::vector<SlotInfo>& slots);

}  // namespace safepoint::agent
