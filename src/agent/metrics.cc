// The metrics registry and the text exposition format (src/agent/metrics.h).
#include "agent/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "base/log.h"

namespace safepoint::agent {

namespace {

bool NameChar(char c, bool first, bool colon) {
  const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (alpha || (colon && c == ':')) return true;
  return !first && c >= '0' && c <= '9';
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

void AppendLabels(std::string& out, const Labels& a, const Labels& b,
                  const std::pair<std::string, std::string>* extra = nullptr) {
  if (a.empty() && b.empty() && extra == nullptr) return;
  out += '{';
  bool first = true;
  auto one = [&](const std::pair<std::string, std::string>& l) {
    if (!first) out += ',';
    first = false;
    out += l.first;
    out += "=\"";
    out += EscapeLabelValue(l.second);
    out += '"';
  };
  for (const auto& l : a) one(l);
  for (const auto& l : b) one(l);
  if (extra != nullptr) one(*extra);
  out += '}';
}

const char* TypeName(MetricType t) {
  switch (t) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

}  // namespace

bool ValidMetricName(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!NameChar(name[i], i == 0, /*colon=*/true)) return false;
  }
  return true;
}

bool ValidLabelName(std::string_view name) {
  if (name.empty() || name.starts_with("__")) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!NameChar(name[i], i == 0, /*colon=*/false)) return false;
  }
  return true;
}

std::string EscapeLabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatMetricValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  if (ec != std::errc()) return "NaN";
  return std::string(buf, end);
}

MetricsRegistry::MetricsRegistry(Labels constant_labels)
    : constant_labels_(std::move(constant_labels)) {}

bool MetricsRegistry::Declare(const std::string& name, MetricType type, const std::string& help,
                              std::vector<double> buckets) {
  if (!ValidMetricName(name) || (type == MetricType::kCounter && !EndsWith(name, "_total")) ||
      !std::is_sorted(buckets.begin(), buckets.end()) ||
      (type != MetricType::kHistogram && !buckets.empty())) {
    spdlog::error("metrics: cannot declare '{}': not a valid Prometheus metric of its type", name);
    return false;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (families_.contains(name)) return false;
  Family& f = families_[name];
  f.type = type;
  f.help = help;
  f.bounds = std::move(buckets);
  return true;
}

MetricsRegistry::Series* MetricsRegistry::Find(const std::string& name, const Labels& labels,
                                               MetricType type) {
  auto it = families_.find(name);
  bool ok = it != families_.end() && it->second.type == type;
  for (const auto& l : labels) ok = ok && ValidLabelName(l.first);
  if (!ok) {
    if (misused_.insert(name).second) {
      spdlog::error("metrics: '{}' is not a declared {} with valid label names; update dropped",
                    name, TypeName(type));
    }
    return nullptr;
  }
  Series& s = it->second.series[labels];
  if (type == MetricType::kHistogram && s.buckets.empty()) {
    s.buckets.assign(it->second.bounds.size(), 0);
  }
  return &s;
}

void MetricsRegistry::Add(const std::string& name, const Labels& labels, double v) {
  std::lock_guard<std::mutex> lock(mu_);
  Series* s = Find(name, labels, MetricType::kCounter);
  if (s != nullptr && v >= 0) s->value += v;  // a counter never goes down
}

void MetricsRegistry::Set(const std::string& name, const Labels& labels, double v) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Series* s = Find(name, labels, MetricType::kGauge)) s->value = v;
}

void MetricsRegistry::Observe(const std::string& name, const Labels& labels, double v) {
  std::lock_guard<std::mutex> lock(mu_);
  Series* s = Find(name, labels, MetricType::kHistogram);
  if (s == nullptr || std::isnan(v)) return;
  const std::vector<double>& bounds = families_[name].bounds;
  const size_t i = std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin();
  if (i < bounds.size()) ++s->buckets[i];  // le: v <= bound
  s->sum += v;
  ++s->count;
}

void MetricsRegistry::Clear(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = families_.find(name); it != families_.end()) it->second.series.clear();
}

double MetricsRegistry::Value(const std::string& name, const Labels& labels) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = families_.find(name);
  if (it == families_.end()) return 0;
  auto s = it->second.series.find(labels);
  if (s == it->second.series.end()) return 0;
  return it->second.type == MetricType::kHistogram ? static_cast<double>(s->second.count)
                                                   : s->second.value;
}

std::string MetricsRegistry::Render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    out += "# HELP " + name + " " + EscapeHelp(f.help) + "\n";
    out += "# TYPE " + name + " " + TypeName(f.type) + "\n";
    for (const auto& [labels, s] : f.series) {
      if (f.type != MetricType::kHistogram) {
        out += name;
        AppendLabels(out, constant_labels_, labels);
        out += ' ' + FormatMetricValue(s.value) + '\n';
        continue;
      }
      uint64_t cumulative = 0;
      for (size_t i = 0; i <= f.bounds.size(); ++i) {
        cumulative += i < f.bounds.size() ? s.buckets[i] : 0;
        const std::pair<std::string, std::string> le{
            "le", i < f.bounds.size() ? FormatMetricValue(f.bounds[i]) : "+Inf"};
        out += name + "_bucket";
        AppendLabels(out, constant_labels_, labels, &le);
        out += ' ' + std::to_string(i < f.bounds.size() ? cumulative : s.count) + '\n';
      }
      out += name + "_sum";
      AppendLabels(out, constant_labels_, labels);
      out += ' ' + FormatMetricValue(s.sum) + '\n';
      out += name + "_count";
      AppendLabels(out, constant_labels_, labels);
      out += ' ' + std::to_string(s.count) + '\n';
    }
  }
  return out;
}

}  // namespace safepoint::agent
