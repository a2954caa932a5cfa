#include "storage/uri_options.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

namespace safepoint::internal {

std::vector<UriOption> SplitUriQuery(std::string_view query) {
  std::vector<UriOption> out;
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    out.push_back(UriOption{item.substr(0, eq),
                            eq == std::string_view::npos ? std::string_view() : item.substr(eq + 1)});
  }
  return out;
}

std::optional<uint64_t> ParseByteSize(std::string_view s) {
  uint64_t v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p == s.data()) return std::nullopt;
  std::string_view suffix(p, s.data() + s.size() - p);
  uint64_t mult = 1;
  if (!suffix.empty()) {
    switch (suffix[0]) {
      case 'k':
      case 'K':
        mult = uint64_t{1} << 10;
        break;
      case 'm':
      case 'M':
        mult = uint64_t{1} << 20;
        break;
      case 'g':
      case 'G':
        mult = uint64_t{1} << 30;
        break;
      case 'b':
      case 'B':
        break;
      default:
        return std::nullopt;
    }
    suffix.remove_prefix(1);
    if (mult == 1 ? !suffix.empty()
                  : !(suffix.empty() || suffix == "i" || suffix == "iB" || suffix == "B")) {
      return std::nullopt;
    }
  }
  if (v > UINT64_MAX / mult) return std::nullopt;
  return v * mult;
}

std::optional<double> ParseSeconds(std::string_view s) {
  // Plain decimals only: strtod alone would also take blanks, signs, exponents, hex and "inf".
  if (s.empty() || !std::all_of(s.begin(), s.end(), [](char c) {
        return (c >= '0' && c <= '9') || c == '.';
      })) {
    return std::nullopt;
  }
  const std::string text(s);
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !(v > 0) || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::optional<int64_t> ParseWholeNumber(std::string_view s, int64_t lo, int64_t hi) {
  if (s.empty() || !(s[0] >= '0' && s[0] <= '9')) return std::nullopt;
  int64_t v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v < lo || v > hi) return std::nullopt;
  return v;
}

Result<double> StorageTimeoutFromEnv(double fallback) {
  const char* env = std::getenv("SAFEPOINT_STORAGE_TIMEOUT");
  if (env == nullptr || *env == '\0') return fallback;
  const std::optional<double> v = ParseSeconds(env);
  if (!v) {
    return InvalidArgument(std::string("SAFEPOINT_STORAGE_TIMEOUT=\"") + env +
                           "\" is not a positive number of seconds");
  }
  return *v;
}

Status BadStorageUri(std::string_view uri, std::string_view why) {
  return InvalidArgument("storage URI \"" + std::string(uri) + "\": " + std::string(why));
}

}  // namespace safepoint::internal
