#include "base/json_fields.h"

#include <gtest/gtest.h>

namespace safepoint::internal::json_fields_test {
namespace {

using nlohmann::json;

TEST(JsonFieldsTest, ReadsFieldsOfTheirTypeAndRange) {
  const json j = json::parse(R"({"u": 5000000000, "small": 7, "neg": -1, "s": "abc", "f": 1.5,
                                 "b": true})");
  uint64_t u64 = 0;
  EXPECT_TRUE(GetU64(j, "u", &u64));
  EXPECT_EQ(u64, 5000000000ULL);
  EXPECT_FALSE(GetU64(j, "neg", &u64));
  EXPECT_FALSE(GetU64(j, "f", &u64));
  EXPECT_FALSE(GetU64(j, "b", &u64));
  EXPECT_FALSE(GetU64(j, "s", &u64));
  EXPECT_FALSE(GetU64(j, "missing", &u64));
  uint32_t u32 = 0;
  EXPECT_TRUE(GetU32(j, "small", &u32));
  EXPECT_EQ(u32, 7u);
  EXPECT_FALSE(GetU32(j, "u", &u32));  // over 32 bits
  std::string s;
  EXPECT_TRUE(GetString(j, "s", &s));
  EXPECT_EQ(s, "abc");
  EXPECT_FALSE(GetString(j, "s", &s, 2));  // longer than asked
  EXPECT_FALSE(GetString(j, "small", &s));
  // A json built in code holds a non-negative integer signed; it reads the same.
  EXPECT_TRUE(GetU32(json{{"small", 7}}, "small", &u32));
  EXPECT_EQ(u32, 7u);
  EXPECT_FALSE(GetU64(json{{"neg", -1}}, "neg", &u64));
}

TEST(JsonFieldsTest, StatusRoundTripsWithContext) {
  const Status s = NotFound("no replica here");
  const json j = StatusToJson(s);
  EXPECT_EQ(j.dump(), R"({"code":1,"message":"no replica here"})");
  const Status back = StatusFromJson(json::parse(j.dump()), "peer b");  // as on the wire
  EXPECT_EQ(back.code(), StatusCode::kNotFound);
  EXPECT_EQ(back.message(), "peer b: no replica here");
}

TEST(JsonFieldsTest, MalformedStatusIsCorruptionNamingTheContext) {
  for (const json& bad :
       {json::object(), StatusToJson(Status::OK()), json{{"code", 99}, {"message", "x"}},
        json{{"code", "1"}, {"message", "x"}}, json{{"code", 1}},
        json{{"code", 1}, {"message", std::string(4097, 'x')}}}) {
    const Status s = StatusFromJson(bad, "peer b");
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << bad.dump();
    EXPECT_EQ(s.message(), "peer b: malformed error message") << bad.dump();
  }
}

}  // namespace
}  // namespace safepoint::internal::json_fields_test
