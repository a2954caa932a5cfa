// The checkpoint-interval advisor: from a level's measured costs and a failure rate, the
// interval that maximizes goodput, and a controller that follows it with bounds and hysteresis.
//
// Definitions (arXiv 2410.18124, Saxena et al., "Optimal Checkpoint Interval with Availability as
// an Objective Function"; docs/guide.md, "The interval advisor"):
//   Ts  checkpoint save time: the seconds a save to this level costs training;
//   Tf  the paper's "average failure time": the mean time between failures (MTBF);
//   Tr  recovery time: detecting the failure, restarting, and restoring from this level;
//   Tc  the checkpoint interval, from the start of one save to the start of the next.
// Young (1974), lost-time optimal:      Tc = sqrt(2 Tf Ts)
// The paper, availability optimal:      Tc = Ts + sqrt(2 (Tf + Tr) Ts + Ts^2)
// (the text calls the restart time "Tf"; in the paper Tf is the MTBF and the restart is
// part of Tr, which is what is computed here).
//
// Pure functions and a small value class; no I/O, no threads. Every function checks its inputs
// and says which one is wrong.
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

// The paper's first-order availability at interval Tc: useful time over total time when a
// period of Tc holds Ts of saving and a failure (every Tf on average) costs Tr plus half a
// period of lost work: (1 - Ts/Tc) / (1 + (Tr + Tc/2) / Tf). Maximized by
// AvailabilityOptimalInterval.
double FirstOrderAvailability(double interval_seconds, double save_seconds, double recovery_seconds,
                              double mtbf_seconds);

// What the advisor knows about one level (memory snapshots, the checkpoint path, a tier).
// A missing value is not measured (and not configured).
struct LevelCosts {
  std::string name;                       // "memory", "path", "tier 1", ...
  std::optional<double> save_seconds;     // Ts
  std::optional<double> persist_seconds;  // the time the level takes to accept one step
  std::optional<double> restore_seconds;  // reading the state back from this level
  std::optional<double> restart_seconds;  // detection + restart before the restore
  uint64_t samples = 0;                   // how many measurements the values come from
};

struct IntervalBounds {
  double min_seconds = 0;      // never shorter (besides the persist time of the level)
  double max_seconds = 86400;  // never longer
};

struct IntervalAdvice {
  std::string level;
  double interval_seconds = 0;       // the recommendation (bounded)
  double young_seconds = 0;          // sqrt(2 Tf Ts)
  double availability_seconds = 0;   // the paper's optimum, before bounds
  double expected_availability = 0;  // FirstOrderAvailability at the recommendation
  double save_seconds = 0, recovery_seconds = 0, mtbf_seconds = 0;
  std::string bound;                  // "", "persist time", "minimum", "maximum"
  std::vector<std::string> warnings;  // e.g. MTBF shorter than a save
  std::string Explain() const;        // one paragraph in words and numbers
};

// The advice for one level. InvalidArgument naming the level and the missing value when a
// cost needed is neither measured nor configured, or a value is negative or not finite.
Result<IntervalAdvice> AdviseInterval(const LevelCosts& level, double mtbf_seconds,
                                      const IntervalBounds& bounds = {});

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
