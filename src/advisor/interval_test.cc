// The interval formulas, durations and the controller (interval.h); the advice itself is the
// goodput model's (plan_test.cc).
#include "advisor/interval.h"

#include <gtest/gtest.h>

#include <cmath>

#include "testing/test_util.h"

namespace safepoint::advisor::interval_test {
namespace {

TEST(IntervalFormulaTest, ClosedFormValues) {
  // Young: sqrt(2 * 10 s * 5000 s) = sqrt(100000) = 316.2 s.
  EXPECT_NEAR(YoungInterval(10, 5000), 316.227766, 1e-6);
  // The paper: 10 + sqrt(2 (5000 + 100) 10 + 100) = 10 + sqrt(102100) = 329.53 s.
  EXPECT_NEAR(AvailabilityOptimalInterval(10, 100, 5000), 10 + std::sqrt(102100.0), 1e-9);
  // Ts << Tr << Tf: the two agree to first order.
  EXPECT_NEAR(AvailabilityOptimalInterval(0.01, 1, 1e6) / YoungInterval(0.01, 1e6), 1, 1e-3);
}

TEST(IntervalControllerTest, HysteresisAndBounds) {
  IntervalController c(100, IntervalBounds{10, 1000}, 0.25);
  EXPECT_DOUBLE_EQ(c.interval_seconds(), 100);
  EXPECT_FALSE(c.Update(120, "small change"));  // within 25%
  EXPECT_DOUBLE_EQ(c.interval_seconds(), 100);
  EXPECT_TRUE(c.Update(200, "saves got slower"));
  EXPECT_DOUBLE_EQ(c.interval_seconds(), 200);
  EXPECT_EQ(c.reason(), "saves got slower");
  EXPECT_TRUE(c.Update(1e9, "huge"));
  EXPECT_DOUBLE_EQ(c.interval_seconds(), 1000);
  EXPECT_FALSE(c.Update(2000, "still above the maximum"));
  EXPECT_TRUE(c.Update(0, "free saves"));
  EXPECT_DOUBLE_EQ(c.interval_seconds(), 10);
  EXPECT_EQ(c.changes(), 3u);
}

TEST(DurationTest, ParsesUnits) {
  ASSERT_OK_AND_ASSIGN(double s, ParseDuration("90"));
  EXPECT_DOUBLE_EQ(s, 90);
  ASSERT_OK_AND_ASSIGN(s, ParseDuration("5m"));
  EXPECT_DOUBLE_EQ(s, 300);
  ASSERT_OK_AND_ASSIGN(s, ParseDuration("3.1h"));
  EXPECT_DOUBLE_EQ(s, 3.1 * 3600);
  ASSERT_OK_AND_ASSIGN(s, ParseDuration("2d"));
  EXPECT_DOUBLE_EQ(s, 172800);
  EXPECT_FALSE(ParseDuration("").ok());
  EXPECT_FALSE(ParseDuration("h").ok());
  EXPECT_FALSE(ParseDuration("5 weeks").ok());
  EXPECT_FALSE(ParseDuration("-3s").ok());
}

}  // namespace
}  // namespace safepoint::advisor::interval_test
