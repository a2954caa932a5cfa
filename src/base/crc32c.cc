#include "base/crc32c.h"

#include <isa-l/crc.h>

#include <algorithm>

namespace safepoint::internal {

uint32_t Crc32c(uint32_t crc, const void* data, size_t n) {
  // ISA-L's crc32_iscsi works on the non-inverted register and takes an int length: invert on the
  // way in and out so the result is the standard CRC-32C and calls chain, and feed it in pieces.
  auto* p = const_cast<unsigned char*>(static_cast<const unsigned char*>(data));
  uint32_t reg = ~crc;
  while (n > 0) {
    const size_t piece = std::min<size_t>(n, size_t{1} << 30);
    reg = crc32_iscsi(p, static_cast<int>(piece), reg);
    p += piece;
    n -= piece;
  }
  return ~reg;
}

}  // namespace safepoint::internal
