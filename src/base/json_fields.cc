// Typed JSON field readers and a Status as JSON (src/base/json_fields.h).
#include "base/json_fields.h"

namespace safepoint::internal {

using nlohmann::json;

bool GetU64(const json& j, const char* key, uint64_t* out) {
  auto it = j.find(key);
  // Parsed text holds a non-negative integer as unsigned; a json built in code may hold it signed.
  if (it == j.end() || !it->is_number_integer()) return false;
  if (!it->is_number_unsigned() && it->get<int64_t>() < 0) return false;
  *out = it->get<uint64_t>();
  return true;
}

bool GetU32(const json& j, const char* key, uint32_t* out) {
  uint64_t v = 0;
  if (!GetU64(j, key, &v) || v > UINT32_MAX) return false;
  *out = static_cast<uint32_t>(v);
  return true;
}

bool GetString(const json& j, const char* key, std::string* out, size_t max) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return false;
  *out = it->get<std::string>();
  return out->size() <= max;
}

json StatusToJson(const Status& s) {
  return {{"code", static_cast<int>(s.code())}, {"message", s.message()}};
}

Status StatusFromJson(const json& j, std::string_view context) {
  const std::string prefix = std::string(context) + ": ";
  uint64_t code = 0;
  std::string message;
  if (!GetU64(j, "code", &code) || !GetString(j, "message", &message, 4096) || code == 0 ||
      code > static_cast<uint64_t>(StatusCode::kSuperseded))
    return Corruption(prefix + "malformed error message");
  return Status(static_cast<StatusCode>(code), prefix + message);
}

}  // namespace safepoint::internal
