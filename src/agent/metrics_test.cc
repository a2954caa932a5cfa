// The metrics registry's text exposition format (src/agent/metrics.h).
#include "agent/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace safepoint::agent::metrics_test {
namespace {

TEST(MetricsTextFormat, EscapesLabelValuesAndHelp) {
  EXPECT_EQ(EscapeLabelValue(R"(a\b"c)"
                             "\n"
                             "d"),
            R"(a\\b\"c\nd)");
  EXPECT_EQ(EscapeHelp("x \\ \"y\"\nz"), "x \\\\ \"y\"\\nz");  // quotes stay in help texts
}

TEST(MetricsTextFormat, FormatsSpecialAndPlainValues) {
  EXPECT_EQ(FormatMetricValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatMetricValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatMetricValue(std::nan("")), "NaN");
  EXPECT_EQ(FormatMetricValue(3), "3");
  EXPECT_EQ(FormatMetricValue(0.25), "0.25");
  EXPECT_EQ(FormatMetricValue(1764590000.5), "1764590000.5");
}

TEST(MetricsTextFormat, ChecksNamesByPrometheusRules) {
  EXPECT_TRUE(ValidMetricName("safepoint_saves_total"));
  EXPECT_TRUE(ValidMetricName("ns:metric_1"));
  EXPECT_FALSE(ValidMetricName("1abc"));
  EXPECT_FALSE(ValidMetricName("a-b"));
  EXPECT_FALSE(ValidMetricName(""));
  EXPECT_TRUE(ValidLabelName("tier"));
  EXPECT_FALSE(ValidLabelName("__name"));
  EXPECT_FALSE(ValidLabelName("a:b"));
  EXPECT_FALSE(ValidLabelName("0a"));
}

TEST(MetricsRegistry, RefusesCountersWithoutTotalSuffixAndDuplicates) {
  MetricsRegistry r;
  EXPECT_FALSE(r.Declare("safepoint_saves", MetricType::kCounter, "x"));
  EXPECT_TRUE(r.Declare("safepoint_saves_total", MetricType::kCounter, "x"));
  EXPECT_FALSE(r.Declare("safepoint_saves_total", MetricType::kCounter, "x"));
  EXPECT_FALSE(r.Declare("bad-name", MetricType::kGauge, "x"));
  EXPECT_FALSE(r.Declare("safepoint_g", MetricType::kGauge, "x", {1.0}));  // buckets: histograms
  EXPECT_FALSE(r.Declare("safepoint_h_seconds", MetricType::kHistogram, "x", {2.0, 1.0}));
}

TEST(MetricsRegistry, RendersCountersAndGaugesWithConstantAndOwnLabels) {
  MetricsRegistry r(Labels{{"safepoint_job", "run\"1"}});
  ASSERT_TRUE(r.Declare("safepoint_saves_total", MetricType::kCounter, "Saves.\nTwo lines."));
  ASSERT_TRUE(r.Declare("safepoint_shm_free_bytes", MetricType::kGauge, "Free bytes."));
  r.Add("safepoint_saves_total", {{"rank", "0"}});
  r.Add("safepoint_saves_total", {{"rank", "0"}}, 2);
  r.Add("safepoint_saves_total", {{"rank", "0"}}, -5);  // counters never go down
  r.Set("safepoint_shm_free_bytes", {}, 1024);
  EXPECT_EQ(r.Render(),
            "# HELP safepoint_saves_total Saves.\\nTwo lines.\n"
            "# TYPE safepoint_saves_total counter\n"
            "safepoint_saves_total{safepoint_job=\"run\\\"1\",rank=\"0\"} 3\n"
            "# HELP safepoint_shm_free_bytes Free bytes.\n"
            "# TYPE safepoint_shm_free_bytes gauge\n"
            "safepoint_shm_free_bytes{safepoint_job=\"run\\\"1\"} 1024\n");
  EXPECT_EQ(r.Value("safepoint_saves_total", {{"rank", "0"}}), 3);
}

TEST(MetricsRegistry, RendersHistogramsWithCumulativeBucketsSumAndCount) {
  MetricsRegistry r;
  ASSERT_TRUE(r.Declare("safepoint_persist_seconds", MetricType::kHistogram, "Persist time.",
                        {0.5, 1, 2.5}));
  for (double v : {0.1, 0.5, 0.7, 3.0}) r.Observe("safepoint_persist_seconds", {{"tier", "0"}}, v);
  EXPECT_EQ(r.Render(),
            "# HELP safepoint_persist_seconds Persist time.\n"
            "# TYPE safepoint_persist_seconds histogram\n"
            "safepoint_persist_seconds_bucket{tier=\"0\",le=\"0.5\"} 2\n"
            "safepoint_persist_seconds_bucket{tier=\"0\",le=\"1\"} 3\n"
            "safepoint_persist_seconds_bucket{tier=\"0\",le=\"2.5\"} 3\n"
            "safepoint_persist_seconds_bucket{tier=\"0\",le=\"+Inf\"} 4\n"
            "safepoint_persist_seconds_sum{tier=\"0\"} 4.3\n"
            "safepoint_persist_seconds_count{tier=\"0\"} 4\n");
}

TEST(MetricsRegistry, DropsUpdatesOfUndeclaredOrMistypedMetrics) {
  MetricsRegistry r;
  ASSERT_TRUE(r.Declare("safepoint_g", MetricType::kGauge, "g"));
  r.Add("safepoint_g", {}, 1);                    // a gauge is not a counter
  r.Set("safepoint_unknown", {}, 1);              // never declared
  r.Set("safepoint_g", {{"bad-label", "x"}}, 1);  // invalid label name
  EXPECT_EQ(r.Render(), "# HELP safepoint_g g\n# TYPE safepoint_g gauge\n");
  r.Set("safepoint_g", {{"tier", "1"}}, 2);
  r.Clear("safepoint_g");
  EXPECT_EQ(r.Render(), "# HELP safepoint_g g\n# TYPE safepoint_g gauge\n");
}

}  // namespace
}  // namespace safepoint::agent::metrics_test
