// CRC-32C (Castagnoli), the checksum of every chunk, header, index and record safepoint writes.
// Backed by ISA-L's hardware-accelerated implementation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace safepoint::internal {

// CRC-32C of `data`, continuing from `crc` (the CRC of the preceding bytes; 0 to start).
// Crc32c(Crc32c(0, a), b) == Crc32c(0, a ++ b).
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);
inline uint32_t Crc32c(std::span<const std::byte> data) {
  return Crc32c(0, data.data(), data.size());
}

}  // namespace safepoint::internal
