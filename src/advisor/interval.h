// Durations, the controller that follows the advice of persist_every="auto" with bounds and
// hysteresis, and two closed forms the goodput model is checked against.
//
// The intervals themselves come from the goodput model (goodput.h) through plan.h: one model,
// one answer for `safepoint simulate`, `safepoint advise` and persist_every="auto" (issue 36).
// The closed forms here are first-order references only (goodput_test.cc compares the model's
// optimum with them): with Ts the time a save costs training, Tf the mean time between
// failures and Tr the recovery time,
//   Young (1974), lost-time optimal:                       Tc = sqrt(2 Tf Ts)
//   Saxena et al., arXiv 2410.18124, availability optimal: Tc = Ts + sqrt(2 (Tf + Tr) Ts + Ts^2)
//
// Pure functions and a small value class; no I/O, no threads.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "safepoint/status.h"

namespace safepoint::advisor {

// Young's lost-time-optimal interval sqrt(2 Tf Ts). Both in seconds, finite, >= 0.
double YoungInterval(double save_seconds, double mtbf_seconds);

// The availability-optimal interval of arXiv 2410.18124: Ts + sqrt(2 (Tf + Tr) Ts + Ts^2).
double AvailabilityOptimalInterval(double save_seconds, double recovery_seconds,
                                   double mtbf_seconds);

struct IntervalBounds {
  double min_seconds = 0;      // never shorter (besides the persist time of the level)
  double max_seconds = 86400;  // never longer
};

// Follows the advice for `persist_every="auto"`: keeps the current interval until a new
// recommendation differs from it by more than `hysteresis` (relative), and never leaves
// [min_seconds, max_seconds]. Not thread-safe; one per schedule.
class IntervalController {
 public:
  IntervalController(double initial_seconds, IntervalBounds bounds, double hysteresis = 0.25);

  // Feeds a new recommendation and why; returns true when the current interval changed.
  bool Update(double recommended_seconds, const std::string& why);

  double interval_seconds() const { return current_; }
  const std::string& reason() const { return reason_; }
  uint64_t changes() const { return changes_; }

 private:
  double Clamp(double s) const;
  IntervalBounds bounds_;
  double hysteresis_;
  double current_;
  std::string reason_;
  uint64_t changes_ = 0;
};

// The MTBFs `safepoint advise` shows intervals for when the job's failure rate is not known yet
// (no interruption recorded, no --mtbf): 1 h, 3 h and 12 h.
inline constexpr double kTypicalMtbfSeconds[] = {3600, 3 * 3600, 12 * 3600};

// Parses a duration: a number of seconds, or a number with s, m, h or d ("90", "5m", "3.1h").
Result<double> ParseDuration(const std::string& text);

// "42 s", "3.5 min", "2.1 h", "4.0 d".
std::string FormatDuration(double seconds);

}  // namespace safepoint::advisor
