// Reading typed fields out of a JSON object (nlohmann::json), and a Status as JSON.
//
// The Get* readers answer false when the field is missing, has another JSON type, or is out of
// the range the caller asked for; they never throw. StatusToJson/StatusFromJson are the peer
// service's form of a Status, {"code": N, "message": "..."} (the agent socket's own form is in
// its protocol: {"ok", "code", "error"}).
//
// Include only from code that links nlohmann_json (safepoint_core, safepoint_agent, the tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "safepoint/status.h"

namespace safepoint::internal {

// j[key] as a non-negative integer (never a float, a bool or a string).
bool GetU64(const nlohmann::json& j, const char* key, uint64_t* out);
// j[key] as a non-negative integer that fits 32 bits.
bool GetU32(const nlohmann::json& j, const char* key, uint32_t* out);
// j[key] as a string of at most `max` bytes (*out is set even when it is longer).
bool GetString(const nlohmann::json& j, const char* key, std::string* out, size_t max = 256);

// {"code": <StatusCode as a number>, "message": s.message()}; an OK status has code 0.
nlohmann::json StatusToJson(const Status& s);
// The error status StatusToJson wrote, its message prefixed with "<context>: ". Corruption
// naming `context` when `j` is not one (missing or mistyped field, a message over 4096 bytes,
// code 0 or unknown).
Status StatusFromJson(const nlohmann::json& j, std::string_view context);

}  // namespace safepoint::internal
