#include "replica/auth.h"

#include <openssl/crypto.h>
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
  return internal::HmacSha256(secret, msg);
}

bool MacEqual(const Mac& a, const Mac& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace safepoint::replica
