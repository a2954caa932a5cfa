// The interval formulas, the advice for one level and the controller (interval.h).
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

Status CheckValue(const std::string& level, const char* what, double v) {
  if (!std::isfinite(v) || v < 0) {
    return InvalidArgument(level + ": " + what + " must be a finite number >= 0, got " + Num(v));
  }
  return Status::OK();
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

double FirstOrderAvailability(double interval_seconds, double save_seconds, double recovery_seconds,
                              double mtbf_seconds) {
  if (interval_seconds <= save_seconds) return 0;
  if (mtbf_seconds <= 0) return 0;
  const double useful = 1 - save_seconds / interval_seconds;
  return useful / (1 + (recovery_seconds + interval_seconds / 2) / mtbf_seconds);
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

Result<IntervalAdvice> AdviseInterval(const LevelCosts& level, double mtbf_seconds,
                                      const IntervalBounds& bounds) {
  const std::string& name = level.name;
  if (!level.save_seconds) {
    return InvalidArgument(name +
                           ": no save time measured or configured (save a few steps, or give "
                           "it, e.g. --save-seconds)");
  }
  if (!level.restore_seconds) {
    return InvalidArgument(name +
                           ": no restore time measured or configured (restore once, or give "
                           "it, e.g. --restore-seconds)");
  }
  if (!std::isfinite(mtbf_seconds) || mtbf_seconds <= 0) {
    return InvalidArgument(name + ": the MTBF must be a positive number of seconds, got " +
                           Num(mtbf_seconds));
  }
  SP_RETURN_IF_ERROR(CheckValue(name, "the save time", *level.save_seconds));
  SP_RETURN_IF_ERROR(CheckValue(name, "the restore time", *level.restore_seconds));
  const double restart = level.restart_seconds.value_or(0);
  SP_RETURN_IF_ERROR(CheckValue(name, "the restart time", restart));
  const double persist = level.persist_seconds.value_or(0);
  SP_RETURN_IF_ERROR(CheckValue(name, "the persist time", persist));
  if (!(bounds.min_seconds >= 0 && bounds.max_seconds >= bounds.min_seconds)) {
    return InvalidArgument(name + ": interval bounds must satisfy 0 <= min <= max");
  }

  IntervalAdvice a;
  a.level = name;
  a.save_seconds = *level.save_seconds;
  a.recovery_seconds = restart + *level.restore_seconds;
  a.mtbf_seconds = mtbf_seconds;
  a.young_seconds = YoungInterval(a.save_seconds, mtbf_seconds);
  a.availability_seconds =
      AvailabilityOptimalInterval(a.save_seconds, a.recovery_seconds, mtbf_seconds);
  double interval = a.availability_seconds;
  // A level cannot take steps faster than it writes them; the bounds come last.
  if (interval < persist) {
    interval = persist;
    a.bound = "persist time";
  }
  if (interval < bounds.min_seconds) {
    interval = bounds.min_seconds;
    a.bound = "minimum";
  }
  if (interval > bounds.max_seconds) {
    interval = bounds.max_seconds;
    a.bound = "maximum";
  }
  a.interval_seconds = interval;
  a.expected_availability =
      FirstOrderAvailability(interval, a.save_seconds, a.recovery_seconds, mtbf_seconds);
  if (mtbf_seconds <= a.save_seconds) {
    a.warnings.push_back("the MTBF (" + FormatDuration(mtbf_seconds) +
                         ") is not longer than one save (" + FormatDuration(a.save_seconds) +
                         "): hardly any interval makes progress; make saves cheaper first");
  } else if (mtbf_seconds <= a.recovery_seconds + a.save_seconds) {
    a.warnings.push_back("the MTBF (" + FormatDuration(mtbf_seconds) +
                         ") is not longer than a save plus a recovery (" +
                         FormatDuration(a.save_seconds + a.recovery_seconds) +
                         "): the job spends most of its time recovering");
  }
  if (a.save_seconds == 0) {
    a.warnings.push_back("a save costs training no measurable time: save as often as the level " +
                         std::string("accepts steps"));
  }
  return a;
}

std::string IntervalAdvice::Explain() const {
  std::string s = level + ": checkpoint every " + FormatDuration(interval_seconds) + ".";
  s += " A save costs training Ts = " + FormatDuration(save_seconds) +
       ", a recovery Tr = " + FormatDuration(recovery_seconds) +
       " (restart + restore), and failures come every Tf = " + FormatDuration(mtbf_seconds) +
       " on average.";
  s += " The availability-optimal interval Ts + sqrt(2 (Tf + Tr) Ts + Ts^2) is " +
       FormatDuration(availability_seconds) +
       " (Young's sqrt(2 Tf Ts): " + FormatDuration(young_seconds) + ")";
  if (bound == "persist time") {
    s += "; the level needs longer than that to write one step, so every " +
         FormatDuration(interval_seconds) + " is as often as it can take them";
  } else if (bound == "minimum" || bound == "maximum") {
    s += "; bounded to the " + bound + " allowed, " + FormatDuration(interval_seconds);
  }
  char pct[32];
  std::snprintf(pct, sizeof(pct), "%.1f%%", 100 * expected_availability);
  s += ". Expected goodput at that interval: " + std::string(pct) + ".";
  for (const auto& w : warnings) s += " Warning: " + w + ".";
  return s;
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
