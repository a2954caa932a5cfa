// Tier schedules and the checks on a job's tiers (include/safepoint/tiers.h).
#include "safepoint/tiers.h"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "testing/test_util.h"

namespace safepoint::tiers_test {
namespace {

TEST(TierDueTest, MultiplesOfEveryOrEveryStepsAfterTheLastOne) {
  const TierSpec t{"/t", 10, 0, 3};
  EXPECT_TRUE(TierDue(t, 7, std::nullopt, 0));  // an empty tier takes the first step
  EXPECT_TRUE(TierDue(t, 20, 10, 0));
  EXPECT_FALSE(TierDue(t, 15, 10, 0));
  EXPECT_TRUE(TierDue(t, 21, 11, 0));   // irregular steps: 10 after the last one
  EXPECT_FALSE(TierDue(t, 10, 10, 0));  // never the step it has, never an older one
  EXPECT_FALSE(TierDue(t, 9, 10, 1e9));
}

TEST(TierDueTest, EverySecondsAndNeither) {
  const TierSpec timed{"/t", 0, 60, 3};
  EXPECT_FALSE(TierDue(timed, 5, 4, 59));
  EXPECT_TRUE(TierDue(timed, 5, 4, 60));
  const TierSpec both{"/t", 100, 60, 3};
  EXPECT_TRUE(TierDue(both, 5, 4, 61));    // by time
  EXPECT_TRUE(TierDue(both, 100, 99, 0));  // by steps
  EXPECT_FALSE(TierDue(both, 5, 4, 1));
  const TierSpec every_step{"/t", 0, 0, 3};
  EXPECT_TRUE(TierDue(every_step, 5, 4, 0));
}

TEST(ValidateTiersTest, BadTiersAreInvalidArgumentNamingTheTier) {
  EXPECT_OK(ValidateTiers("/p", std::vector<TierSpec>{{"/a", 0, 0, 1}, {"s3://b/x", 5, 1, 9}}));
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<std::pair<std::vector<TierSpec>, std::string>> bad = {
      {{{"", 0, 0, 1}}, "no URI"},
      {{{"/p", 0, 0, 1}}, "repeats"},
      {{{"/a", 0, 0, 1}, {"/a", 0, 0, 1}}, "tier 2 (/a) repeats"},
      {{{"/a", 0, 0, 0}}, "keep"},
      {{{"/a", 0, -1, 1}}, "every_seconds"},
      {{{"/a", 0, nan, 1}}, "every_seconds"},
  };
  for (const auto& [tiers, what] : bad) {
    Status s = ValidateTiers("/p", tiers);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what;
    EXPECT_NE(s.message().find(what), std::string::npos) << s.ToString();
  }
}

}  // namespace
}  // namespace safepoint::tiers_test
