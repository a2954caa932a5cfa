// Mutual authentication of peer agents (docs/replication.md): HMAC-SHA256 (OpenSSL) with the job's
// secret over both sides' nonces, the job's name and both nodes' ids.
//
// The client sends a nonce; the server answers with its own nonce and its proof; the client checks
// it and answers with its proof. The two proofs differ by a role label, so that neither side can
// reflect the other's proof back, and every field is length-prefixed, so that no two different
// (job, client, server) triples hash the same bytes.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/digest.h"
#include "safepoint/status.h"

namespace safepoint::replica {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;
// Shorter secrets are refused: the secret is the only thing that keeps a stranger out.
inline constexpr size_t kMinSecretBytes = 16;

using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac = std::array<uint8_t, kMacBytes>;

enum class AuthRole { kClient, kServer };

// A fresh nonce from OpenSSL's CSPRNG (Unavailable when it has no entropy).
Result<Nonce> NewNonce();

// The proof `role` sends: HMAC-SHA256(secret, label(role) | job | client | server | nc | ns).
Mac AuthProof(std::string_view secret, AuthRole role, std::string_view job,
              std::string_view client_node, std::string_view server_node, const Nonce& client_nonce,
              const Nonce& server_nonce);

// Constant-time comparison.
bool MacEqual(const Mac& a, const Mac& b);

// Hex for the wire (lowercase) and back; false for anything else than 2*N hex digits.
using internal::FromHex;
using internal::ToHex;

}  // namespace safepoint::replica
