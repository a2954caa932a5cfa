#include "base/random.h"

#include <sys/random.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace safepoint::internal {

std::string RandomHex16() {
  uint64_t v = 0;
  if (::getrandom(&v, sizeof(v), 0) != static_cast<ssize_t>(sizeof(v))) {
    static std::atomic<uint64_t> counter{0};
    v = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
        (static_cast<uint64_t>(::getpid()) << 32) ^ (counter.fetch_add(1) * 0x9e3779b97f4a7c15ull);
    v ^= v >> 31;
    v *= 0xbf58476d1ce4e5b9ull;
    v ^= v >> 29;
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(16, '0');
  for (size_t i = 0; i < 16; ++i) out[i] = kHex[(v >> (4 * i)) & 0xf];
  return out;
}

}  // namespace safepoint::internal
