// Durations, the interval formulas and the controller (interval.h).
#include "advisor/interval.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace safepoint::advisor {
namespace {

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g", v);
  return buf;
}

}  // namespace

double YoungInterval(double save_seconds, double mtbf_seconds) {
  return std::sqrt(2 * save_seconds * mtbf_seconds);
}

double AvailabilityOptimalInterval(double save_seconds, double recovery_seconds,
                                   double mtbf_seconds) {
  const double ts = save_seconds;
  return ts + std::sqrt(2 * (mtbf_seconds + recovery_seconds) * ts + ts * ts);
}

std::string FormatDuration(double s) {
  if (!std::isfinite(s)) return "inf";
  if (s < 120) return Num(s) + " s";
  if (s < 7200) return Num(s / 60) + " min";
  if (s < 2 * 86400) return Num(s / 3600) + " h";
  return Num(s / 86400) + " d";
}

Result<double> ParseDuration(const std::string& text) {
  if (text.empty()) return InvalidArgument("empty duration");
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  double unit = 1;
  const std::string suffix(end);
  if (suffix.empty() || suffix == "s") {
    unit = 1;
  } else if (suffix == "m" || suffix == "min") {
    unit = 60;
  } else if (suffix == "h") {
    unit = 3600;
  } else if (suffix == "d") {
    unit = 86400;
  } else {
    return InvalidArgument("'" + text + "' is not a duration (a number with s, m, h or d)");
  }
  if (end == text.c_str() || !std::isfinite(v) || v < 0) {
    return InvalidArgument("'" + text + "' is not a duration (a number with s, m, h or d)");
  }
  return v * unit;
}

IntervalController::IntervalController(double initial_seconds, IntervalBounds bounds,
                                       double hysteresis)
    : bounds_(bounds), hysteresis_(hysteresis), current_(0) {
  current_ = Clamp(initial_seconds);
  reason_ = "initial interval, no measurements yet";
}

double IntervalController::Clamp(double s) const {
  if (!std::isfinite(s)) s = bounds_.max_seconds;
  return std::clamp(s, bounds_.min_seconds, bounds_.max_seconds);
}

bool IntervalController::Update(double recommended_seconds, const std::string& why) {
  const double next = Clamp(recommended_seconds);
  const double base = std::max(current_, 1e-9);
  if (std::abs(next - current_) / base <= hysteresis_) return false;
  current_ = next;
  reason_ = why;
  ++changes_;
  return true;
}

}  // namespace safepoint::advisor
