// SHA-256 and HMAC-SHA256 (OpenSSL's libcrypto) and lowercase hex, shared by the S3 backend's
// request signatures (src/storage/s3, AWS SigV4) and the peers' authentication proofs
// (src/replica/auth.cc).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace safepoint::internal {

using Sha256Digest = std::array<uint8_t, 32>;

Sha256Digest Sha256(std::span<const std::byte> data);
Sha256Digest HmacSha256(std::string_view key, std::string_view data);

inline std::string_view AsStringView(const Sha256Digest& d) {
  return {reinterpret_cast<const char*>(d.data()), d.size()};
}

// Lowercase hex and back; FromHex is false for anything else than 2*n lowercase hex digits.
std::string ToHex(const uint8_t* data, size_t n);
inline std::string ToHex(const Sha256Digest& d) { return ToHex(d.data(), d.size()); }
bool FromHex(std::string_view hex, uint8_t* out, size_t n);

}  // namespace safepoint::internal
