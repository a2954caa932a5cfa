#include "base/digest.h"

#include <gtest/gtest.h>

#include <string_view>

namespace safepoint::internal::digest_test {
namespace {

std::span<const std::byte> Bytes(std::string_view s) { return std::as_bytes(std::span(s)); }

TEST(DigestTest, Sha256MatchesFips180Examples) {
  EXPECT_EQ(ToHex(Sha256({})), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(ToHex(Sha256(Bytes("abc"))),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(DigestTest, HmacSha256MatchesRfc4231TestCase2) {
  EXPECT_EQ(ToHex(HmacSha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

}  // namespace
}  // namespace safepoint::internal::digest_test
