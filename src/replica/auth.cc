#include "replica/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <string>

namespace safepoint::replica {
namespace {

void AppendField(std::string* out, std::string_view field) {
  const uint32_t n = static_cast<uint32_t>(field.size());
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out->append(field);
}

}  // namespace

Result<Nonce> NewNonce() {
  Nonce nonce;
  if (RAND_bytes(nonce.data(), static_cast<int>(nonce.size())) != 1)
    return Unavailable("peer authentication: OpenSSL RAND_bytes has no entropy");
  return nonce;
}

Mac AuthProof(std::string_view secret, AuthRole role, std::string_view job,
              std::string_view client_node, std::string_view server_node, const Nonce& client_nonce,
              const Nonce& server_nonce) {
  std::string msg;
  AppendField(&msg,
              role == AuthRole::kClient ? "safepoint-peer-client-v1" : "safepoint-peer-server-v1");
  AppendField(&msg, job);
  AppendField(&msg, client_node);
  AppendField(&msg, server_node);
  msg.append(reinterpret_cast<const char*>(client_nonce.data()), client_nonce.size());
  msg.append(reinterpret_cast<const char*>(server_nonce.data()), server_nonce.size());
  Mac mac{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), mac.data(), &len);
  return mac;
}

bool MacEqual(const Mac& a, const Mac& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string ToHex(const uint8_t* data, size_t n) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(kDigits[data[i] >> 4]);
    out.push_back(kDigits[data[i] & 15]);
  }
  return out;
}

bool FromHex(std::string_view hex, uint8_t* out, size_t n) {
  if (hex.size() != 2 * n) return false;
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < n; ++i) {
    const int hi = digit(hex[2 * i]), lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

}  // namespace safepoint::replica
