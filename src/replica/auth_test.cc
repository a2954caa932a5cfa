#include "replica/auth.h"

#include <gtest/gtest.h>

#include "testing/test_util.h"

namespace safepoint::replica::auth_test {
namespace {

constexpr char kSecret[] = "0123456789abcdef0123";

TEST(AuthTest, ProofsBindSecretRoleJobNodesAndNonces) {
  ASSERT_OK_AND_ASSIGN(Nonce nc, NewNonce());
  ASSERT_OK_AND_ASSIGN(Nonce ns, NewNonce());
  EXPECT_NE(nc, ns);
  const Mac client = AuthProof(kSecret, AuthRole::kClient, "job", "a", "b", nc, ns);
  EXPECT_TRUE(MacEqual(client, AuthProof(kSecret, AuthRole::kClient, "job", "a", "b", nc, ns)));
  // Every input changes the proof.
  EXPECT_FALSE(MacEqual(client, AuthProof(kSecret, AuthRole::kServer, "job", "a", "b", nc, ns)));
  EXPECT_FALSE(MacEqual(
      client, AuthProof("0123456789abcdef0124", AuthRole::kClient, "job", "a", "b", nc, ns)));
  EXPECT_FALSE(MacEqual(client, AuthProof(kSecret, AuthRole::kClient, "jo", "a", "b", nc, ns)));
  EXPECT_FALSE(MacEqual(client, AuthProof(kSecret, AuthRole::kClient, "job", "b", "a", nc, ns)));
  EXPECT_FALSE(MacEqual(client, AuthProof(kSecret, AuthRole::kClient, "job", "a", "b", ns, nc)));
  // Fields are length-prefixed: moving a character between job and node changes the proof.
  EXPECT_FALSE(MacEqual(AuthProof(kSecret, AuthRole::kClient, "jobx", "a", "b", nc, ns),
                        AuthProof(kSecret, AuthRole::kClient, "job", "xa", "b", nc, ns)));
}

TEST(AuthTest, HexRoundTripsAndRefusesOtherText) {
  const uint8_t bytes[3] = {0x00, 0xab, 0xff};
  EXPECT_EQ(ToHex(bytes, 3), "00abff");
  uint8_t back[3] = {};
  ASSERT_TRUE(FromHex("00abff", back, 3));
  EXPECT_EQ(0, std::memcmp(back, bytes, 3));
  EXPECT_FALSE(FromHex("00abf", back, 3));
  EXPECT_FALSE(FromHex("00abfff0", back, 3));
  EXPECT_FALSE(FromHex("00ABFF", back, 3));
  EXPECT_FALSE(FromHex("00abfg", back, 3));
}

}  // namespace
}  // namespace safepoint::replica::auth_test
