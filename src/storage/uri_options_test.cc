#include "storage/uri_options.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>

#include "testing/test_util.h"

namespace safepoint::internal::uri_options_test {
namespace {

TEST(UriOptionsTest, SplitsAtAmpersandsAndTheFirstEquals) {
  const auto items = SplitUriQuery("a=1&&b=x=y&flag&=v&");
  ASSERT_EQ(items.size(), 4u);
  EXPECT_EQ(items[0].key, "a");
  EXPECT_EQ(items[0].value, "1");
  EXPECT_EQ(items[1].key, "b");
  EXPECT_EQ(items[1].value, "x=y");
  EXPECT_EQ(items[2].key, "flag");
  EXPECT_EQ(items[2].value, "");
  EXPECT_EQ(items[3].key, "");
  EXPECT_EQ(items[3].value, "v");
  EXPECT_TRUE(SplitUriQuery("").empty());
}

TEST(UriOptionsTest, ByteSizesTakeBinarySuffixes) {
  EXPECT_EQ(ParseByteSize("0"), 0u);
  EXPECT_EQ(ParseByteSize("4096"), 4096u);
  EXPECT_EQ(ParseByteSize("100B"), 100u);
  EXPECT_EQ(ParseByteSize("64K"), 64u << 10);
  EXPECT_EQ(ParseByteSize("64k"), 64u << 10);
  EXPECT_EQ(ParseByteSize("16M"), 16u << 20);
  EXPECT_EQ(ParseByteSize("16MiB"), 16u << 20);
  EXPECT_EQ(ParseByteSize("16Mi"), 16u << 20);
  EXPECT_EQ(ParseByteSize("16MB"), 16u << 20);
  EXPECT_EQ(ParseByteSize("2G"), uint64_t{2} << 30);
  for (std::string_view bad : {"", "K", "-1", "+1", " 1", "1 ", "1.5M", "2T", "1Bi", "1KiBx",
                               "0x10", "18446744073709551616", "17179869184G"}) {
    EXPECT_FALSE(ParseByteSize(bad).has_value()) << bad;
  }
}

TEST(UriOptionsTest, SecondsArePositiveDecimals) {
  EXPECT_EQ(ParseSeconds("30"), 30.0);
  EXPECT_EQ(ParseSeconds("2.5"), 2.5);
  EXPECT_EQ(ParseSeconds(".5"), 0.5);
  for (std::string_view bad :
       {"", "0", "0.0", "-1", "+1", " 1", "1s", "x", ".", "1e3", "0x10", "inf", "nan"}) {
    EXPECT_FALSE(ParseSeconds(bad).has_value()) << bad;
  }
}

TEST(UriOptionsTest, WholeNumbersWithinBounds) {
  EXPECT_EQ(ParseWholeNumber("0", 0, 100), 0);
  EXPECT_EQ(ParseWholeNumber("100", 0, 100), 100);
  for (std::string_view bad : {"", "101", "-1", "+1", "1.0", "1x", " 1", "99999999999999999999"}) {
    EXPECT_FALSE(ParseWholeNumber(bad, 0, 100).has_value()) << bad;
  }
}

TEST(UriOptionsTest, TimeoutFromTheEnvironment) {
  const char* saved = std::getenv("SAFEPOINT_STORAGE_TIMEOUT");
  const std::string restore = saved ? saved : "";
  ::unsetenv("SAFEPOINT_STORAGE_TIMEOUT");
  EXPECT_EQ(*StorageTimeoutFromEnv(), 60.0);
  EXPECT_EQ(*StorageTimeoutFromEnv(9), 9.0);
  ::setenv("SAFEPOINT_STORAGE_TIMEOUT", "", 1);
  EXPECT_EQ(*StorageTimeoutFromEnv(), 60.0);
  ::setenv("SAFEPOINT_STORAGE_TIMEOUT", "7.5", 1);
  EXPECT_EQ(*StorageTimeoutFromEnv(), 7.5);
  for (const char* bad : {"0", "7x", "-3", "soon"}) {
    ::setenv("SAFEPOINT_STORAGE_TIMEOUT", bad, 1);
    auto r = StorageTimeoutFromEnv();
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status().ToString();
  }
  if (saved) {
    ::setenv("SAFEPOINT_STORAGE_TIMEOUT", restore.c_str(), 1);
  } else {
    ::unsetenv("SAFEPOINT_STORAGE_TIMEOUT");
  }
}

TEST(UriOptionsTest, RetryBackoffDoublesUpToTenSecondsWithJitter) {
  for (int i = 0; i < 100; ++i) {
    const double first = RetryBackoffSeconds(1);
    EXPECT_GE(first, 0.1);
    EXPECT_LE(first, 0.2);
    const double third = RetryBackoffSeconds(3);
    EXPECT_GE(third, 0.4);
    EXPECT_LE(third, 0.8);
    const double late = RetryBackoffSeconds(50);
    EXPECT_GE(late, 5.0);
    EXPECT_LE(late, 10.0);
  }
}

TEST(UriOptionsTest, BadStorageUriNamesTheUri) {
  const Status s = BadStorageUri("rados://p/x?y=1", "unknown option \"y\"");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "storage URI \"rados://p/x?y=1\": unknown option \"y\"");
}

}  // namespace
}  // namespace safepoint::internal::uri_options_test
