// The interval formulas, the advice and the controller (interval.h).
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

TEST(IntervalFormulaTest, AvailabilityOptimalMaximizesFirstOrderAvailability) {
  const double ts = 7, tr = 40, tf = 3600;
  const double best = AvailabilityOptimalInterval(ts, tr, tf);
  const double at = FirstOrderAvailability(best, ts, tr, tf);
  for (double f : {0.5, 0.8, 0.95, 1.05, 1.25, 2.0}) {
    EXPECT_LT(FirstOrderAvailability(best * f, ts, tr, tf), at) << f;
  }
  EXPECT_EQ(FirstOrderAvailability(ts, ts, tr, tf), 0);  // nothing but saving
}

TEST(AdviseIntervalTest, UsesMeasuredCostsAndExplainsThem) {
  LevelCosts c{"path", 2.0, 1.0, 30.0, 10.0, 12};
  ASSERT_OK_AND_ASSIGN(auto a, AdviseInterval(c, 7200));
  EXPECT_DOUBLE_EQ(a.recovery_seconds, 40);
  EXPECT_NEAR(a.interval_seconds, AvailabilityOptimalInterval(2, 40, 7200), 1e-9);
  EXPECT_EQ(a.bound, "");
  EXPECT_TRUE(a.warnings.empty());
  const std::string e = a.Explain();
  EXPECT_NE(e.find("path: checkpoint every"), std::string::npos) << e;
  EXPECT_NE(e.find("Young"), std::string::npos) << e;
}

TEST(AdviseIntervalTest, MissingMeasurementsNameTheLevelAndTheValue) {
  LevelCosts no_save{"tier 1", std::nullopt, 1.0, 3.0, 1.0, 0};
  auto a = AdviseInterval(no_save, 3600);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("tier 1: no save time"), std::string::npos);
  LevelCosts no_restore{"memory", 0.1, std::nullopt, std::nullopt, std::nullopt, 3};
  a = AdviseInterval(no_restore, 3600);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("memory: no restore time"), std::string::npos);
  LevelCosts ok{"memory", 0.1, std::nullopt, 1.0, std::nullopt, 3};
  EXPECT_FALSE(AdviseInterval(ok, 0).ok());
  EXPECT_FALSE(AdviseInterval(ok, NAN).ok());
  LevelCosts negative{"memory", -1.0, std::nullopt, 1.0, std::nullopt, 3};
  EXPECT_FALSE(AdviseInterval(negative, 100).ok());
}

TEST(AdviseIntervalTest, MtbfShorterThanASaveWarns) {
  LevelCosts c{"path", 100.0, std::nullopt, 10.0, 0.0, 1};
  ASSERT_OK_AND_ASSIGN(auto a, AdviseInterval(c, 50));
  ASSERT_EQ(a.warnings.size(), 1u);
  EXPECT_NE(a.warnings[0].find("not longer than one save"), std::string::npos);
  EXPECT_LT(a.expected_availability, 0.3);
  EXPECT_GT(a.interval_seconds, 100);  // still a period that holds the save
}

TEST(AdviseIntervalTest, ZeroSaveCostIsBoundedByThePersistTime) {
  LevelCosts c{"tier 1", 0.0, 25.0, 5.0, 5.0, 4};
  ASSERT_OK_AND_ASSIGN(auto a, AdviseInterval(c, 3600));
  EXPECT_DOUBLE_EQ(a.availability_seconds, 0);
  EXPECT_DOUBLE_EQ(a.interval_seconds, 25);
  EXPECT_EQ(a.bound, "persist time");
  EXPECT_FALSE(a.warnings.empty());
  LevelCosts zero{"memory", 0.0, 0.0, 0.0, 0.0, 1};
  ASSERT_OK_AND_ASSIGN(auto z, AdviseInterval(zero, 3600, IntervalBounds{1, 600}));
  EXPECT_DOUBLE_EQ(z.interval_seconds, 1);
  EXPECT_EQ(z.bound, "minimum");
}

TEST(AdviseIntervalTest, MaximumBound) {
  LevelCosts c{"path", 60.0, 0.0, 60.0, 60.0, 1};
  ASSERT_OK_AND_ASSIGN(auto a, AdviseInterval(c, 1e7, IntervalBounds{0, 3600}));
  EXPECT_DOUBLE_EQ(a.interval_seconds, 3600);
  EXPECT_EQ(a.bound, "maximum");
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
