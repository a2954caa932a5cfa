// Little-endian encoding helpers and UTF-8 validation shared by the format code.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

namespace safepoint::internal {

static_assert(std::endian::native == std::endian::little,
              "safepoint's formats are little-endian; a big-endian port must byte-swap here");

template <typename T>
inline void StoreLE(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
inline T LoadLE(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <typename T>
inline void AppendLE(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

constexpr uint64_t AlignUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Job names: at most 64 characters of [A-Za-z0-9._-] (an image may have an empty job; the
// snapshot and agent layers require one, see ValidateJobName).
inline bool IsJobNameText(std::string_view job) {
  if (job.size() > 64) return false;
  for (char c : job) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// "512 B", "1.5 KiB", "3.2 GiB": for messages and tables, never for parsing.
std::string HumanBytes(uint64_t n);

// True when `s` is well-formed UTF-8 (no overlongs, surrogates or code points above U+10FFFF).
bool IsValidUtf8(std::string_view s);

inline std::string_view AsStringView(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

// Overflow-checked arithmetic: returns false on overflow.
inline bool MulOverflow(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}
inline bool AddOverflow(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_add_overflow(a, b, out);
}

}  // namespace safepoint::internal
