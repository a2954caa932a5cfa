// MetricsRegistry: the agent's Prometheus metrics and their text exposition format
// (docs/operations.md, "Metrics"; the format is Prometheus' text format 0.0.4).
//
// A registry holds metric families (a name, a help text, a type) and, per family, one series per
// set of label values. Counters only go up (Add), gauges are set (Set), histograms count
// observations into fixed cumulative buckets (Observe). Render() writes every family in the text
// format: `# HELP` and `# TYPE` lines, then one line per series (a histogram: `_bucket{le=...}`
// for each bound and +Inf, `_sum`, `_count`), label values escaped (backslash, double quote,
// newline), help texts escaped (backslash, newline). Constant labels (the job) are added to every
// series.
//
// Names follow Prometheus' conventions, and the registry checks them when a family is declared:
// [a-zA-Z_:][a-zA-Z0-9_:]* for metric names, [a-zA-Z_][a-zA-Z0-9_]* (not starting with __) for
// label names, counters end in `_total`. A misuse (an undeclared name, the wrong type, a bad
// name) is a programming error: it is logged once and the update dropped, never thrown.
//
// Threads: every method may be called from any thread (one mutex); the agent's loop updates,
// the HTTP server's threads render.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace safepoint::agent {

enum class MetricType { kCounter, kGauge, kHistogram };

// Label names and values, in the order they are rendered.
using Labels = std::vector<std::pair<std::string, std::string>>;

class MetricsRegistry {
 public:
  explicit MetricsRegistry(Labels constant_labels = {});

  // Declares a family; `buckets` (histograms only) are the upper bounds, ascending (+Inf is
  // implied). Returns false (and declares nothing) for a bad name, a counter not ending in
  // `_total`, or a name already declared.
  bool Declare(const std::string& name, MetricType type, const std::string& help,
               std::vector<double> buckets = {});

  void Add(const std::string& name, const Labels& labels, double v = 1);  // counters
  void Set(const std::string& name, const Labels& labels, double v);      // gauges
  void Observe(const std::string& name, const Labels& labels, double v);  // histograms
  // Drops every series of a family (a gauge whose set of label values changed).
  void Clear(const std::string& name);
  // The value of a counter or gauge series (0 when absent); for tests.
  double Value(const std::string& name, const Labels& labels) const;

  std::string Render() const;

 private:
  struct Series {
    double value = 0;               // counter, gauge
    std::vector<uint64_t> buckets;  // histogram: per bound, not cumulative
    double sum = 0;
    uint64_t count = 0;
  };
  struct Family {
    MetricType type = MetricType::kGauge;
    std::string help;
    std::vector<double> bounds;
    std::map<Labels, Series> series;
  };
  Series* Find(const std::string& name, const Labels& labels, MetricType type);

  const Labels constant_labels_;
  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
  std::set<std::string> misused_;  // names already logged as misused
};

// Text-format helpers (exposed for the tests).
std::string EscapeLabelValue(std::string_view v);  // \ -> \\, " -> \", newline -> \n
std::string EscapeHelp(std::string_view v);        // \ -> \\, newline -> \n
std::string FormatMetricValue(double v);           // shortest round-trip; +Inf, -Inf, NaN
bool ValidMetricName(std::string_view name);
bool ValidLabelName(std::string_view name);

}  // namespace safepoint::agent
