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
