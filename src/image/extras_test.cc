#include "safepoint/extras.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "testing/test_util.h"

namespace safepoint::extras_test {
namespace {

using test::AsBytes;

Value Sample() {
  Dict d;
  d.items.emplace_back(Value(std::string("lr")), Value(1e-3));
  d.items.emplace_back(Value(int64_t{7}), Value(List{{Value(), Value(true), Value(false)}}));
  d.items.emplace_back(Value(std::string("nan")), Value(std::nan("")));
  d.items.emplace_back(Value(std::string("inf")), Value(-std::numeric_limits<double>::infinity()));
  d.items.emplace_back(Value(std::string("negzero")), Value(-0.0));
  d.items.emplace_back(Value(std::string("big")),
                       Value(BigInt{std::string("\x01\x00\x00\x00\x00\x00\x00\x00\x00\x01", 10)}));
  d.items.emplace_back(Value(std::string("bytes")), Value(Bytes{std::string("\x00\xff", 2)}));
  d.items.emplace_back(Value(std::string("t")),
                       Value(Tuple{{Value(TensorRef{1, 0}), Value(std::string("\xe2\x82\xac"))}}));
  d.items.emplace_back(Value(std::string("min")), Value(std::numeric_limits<int64_t>::min()));
  return Value(std::move(d));
}

TEST(ExtrasTest, RoundTripKeepsTypesAndBits) {
  Value v = Sample();
  auto enc = EncodeExtras(v);
  ASSERT_OK(enc);
  auto dec = DecodeExtras(AsBytes(*enc), 2, "x");
  ASSERT_OK(dec);
  EXPECT_TRUE(*dec == v);
  // -0.0 and 0.0 are different values bit-wise.
  EXPECT_FALSE(Value(-0.0) == Value(0.0));
}

TEST(ExtrasTest, EncoderRejects) {
  Dict d;
  d.items.emplace_back(Value(1.5), Value());
  EXPECT_EQ(EncodeExtras(Value(std::move(d))).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodeExtras(Value(std::string("\xc0\x80"))).status().code(),
            StatusCode::kInvalidArgument);
  Value deep;
  for (int i = 0; i < 300; ++i) deep = Value(List{{std::move(deep)}});
  EXPECT_EQ(EncodeExtras(deep).status().code(), StatusCode::kInvalidArgument);
}

TEST(ExtrasTest, DecoderRejectsMalformedInput) {
  auto bad = [](const std::string& s, uint64_t tensors = 0) {
    auto r = DecodeExtras(AsBytes(s), tensors, "src");
    return r.ok() ? Status::OK() : r.status();
  };
  EXPECT_EQ(bad("").code(), StatusCode::kCorruption);
  EXPECT_EQ(bad("\x99").code(), StatusCode::kCorruption);
  EXPECT_EQ(bad(std::string("\x00\x00", 2)).code(), StatusCode::kCorruption);  // trailing
  EXPECT_EQ(bad(std::string("\x06\xff\xff\xff\x7f", 5)).code(), StatusCode::kCorruption);
  EXPECT_EQ(bad(std::string("\x08\xff\xff\xff\xff", 5)).code(), StatusCode::kCorruption);
  EXPECT_EQ(bad(std::string("\x0b\x05\0\0\0\0\0\0\0\0", 10), 2).code(), StatusCode::kCorruption);
  // Dict with a float key, and with a duplicate key.
  EXPECT_EQ(bad(std::string("\x0a\x01\0\0\0\x05\0\0\0\0\0\0\0\0\x00", 15)).code(),
            StatusCode::kCorruption);
  EXPECT_EQ(bad(std::string("\x0a\x02\0\0\0\x06\1\0\0\0a\x00\x06\1\0\0\0a\x00", 19)).code(),
            StatusCode::kCorruption);
  // Non-canonical big integer (fits in int64).
  EXPECT_EQ(bad(std::string("\x04\x02\0\0\0\x01\x00", 7)).code(), StatusCode::kCorruption);
  // Nesting bomb: 100000 nested lists.
  std::string bomb;
  for (int i = 0; i < 100000; ++i) bomb += std::string("\x08\x01\0\0\0", 5);
  bomb += '\0';
  EXPECT_NE(bad(bomb).message().find("nested"), std::string::npos);
  EXPECT_NE(bad("\x99").message().find("src"), std::string::npos);
}

TEST(ExtrasTest, RandomMutationsNeverCrash) {
  auto enc = EncodeExtras(Sample());
  ASSERT_OK(enc);
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20000; ++i) {
    std::string s = *enc;
    for (int f = 0; f < 1 + int(rng() % 4); ++f) s[rng() % s.size()] = char(rng());
    if (rng() % 5 == 0) s.resize(rng() % s.size());
    auto r = DecodeExtras(AsBytes(s), 2, "fuzz");
    if (!r.ok()) ASSERT_EQ(r.status().code(), StatusCode::kCorruption);
  }
}

TEST(ExtrasTest, FormatValueIsPythonLike) {
  Dict d;
  d.items.emplace_back(Value(std::string("a")), Value(Tuple{{Value(int64_t{1})}}));
  d.items.emplace_back(Value(int64_t{2}), Value(List{{Value(0.5), Value(), Value(true)}}));
  EXPECT_EQ(FormatValue(Value(std::move(d))), "{'a': (1,), 2: [0.5, None, True]}");
}

}  // namespace
}  // namespace safepoint::extras_test
