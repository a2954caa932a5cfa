// One model, one answer (issue 36): the intervals `safepoint simulate` prints, writes to its CSV
// and marks on its plot, the ones `safepoint advise` recommends for each level, and the persist
// schedule of persist_every="auto" all come from MakePlan over the goodput model of goodput.h,
// with the job's inputs taken from its history and record by InputsFromHistory.
//
// The levels (AdviseLevels), at the safepoint strategy's optimal save interval P:
//   memory  save every P (the interval that maximizes the model's goodput);
//   path    persist every m-th save, m = PersistEverySaves(persist, P): a persist costs training
//           nothing, so as often as the storage takes steps is best (a node loss without peers
//           loses the work since the newest persisted step);
//   tier N  the newest step persisted on the level above whenever the previous copy is done:
//           every ceil(copy / that level's interval)-th of its steps.
// With a step time (measured, or given) each interval is also given in steps, which is what
// persist_every takes: a save interval of k steps lasts k x step + the save's blocking time.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "advisor/goodput.h"
#include "advisor/history.h"
#include "safepoint/status.h"

namespace safepoint::advisor {

struct StrategyResult {
  std::string name;             // "safepoint", "sync", "dcp-async"
  double interval_seconds = 0;  // P, from the start of one save to the start of the next
  double blocking_seconds = 0;  // C, what a save costs training
  double goodput = 0;           // AnalyticGoodput at P
  std::vector<FailureMode> modes;
  // How many saves apart storage takes a step (safepoint: PersistEverySaves; the others persist
  // every save).
  uint64_t persist_every_saves = 1;
  // With a step time: P in whole steps (at least 1), and the persist interval in steps.
  std::optional<uint64_t> interval_steps, persist_every_steps;
};

struct Plan {
  SimulationInputs inputs;  // completed
  bool optimal = true;      // each strategy at its own optimum; else all at the interval given
  std::vector<StrategyResult> strategies;  // safepoint, sync, dcp-async
  const StrategyResult& safepoint() const { return strategies.at(0); }
};

// Completes `in` (CompleteInputs) and evaluates the strategies, each at its optimal interval
// (OptimalPeriod in [0.01 s, max(100 MTBF, 10 s)]) or all at `interval_seconds`.
Result<Plan> MakePlan(const SimulationInputs& in,
                      std::optional<double> interval_seconds = std::nullopt);

// Goodput against the interval (the CSV and the plot of `simulate`): `points` intervals spaced
// logarithmically from just above the largest blocking time to 3 MTBF, with each strategy's
// interval of the plan among them, so that each curve's highest point is the plan's answer.
struct CurvePoint {
  double interval_seconds = 0;
  std::vector<double> goodput;  // by strategy, in the plan's order
};
std::vector<CurvePoint> GoodputCurve(const Plan& plan, int points = 200);

// The whole steps k >= 1 whose interval k x step + blocking is nearest `interval_seconds`;
// nullopt without a step time.
std::optional<uint64_t> IntervalSteps(double interval_seconds, double blocking_seconds,
                                      double step_seconds);

// "0.164 s", or "0.164 s (3 steps)" with a step count.
std::string IntervalText(double seconds, std::optional<uint64_t> steps);

// The model's inputs for a job, from its history (and its COMMIT record's world size), each with
// where it came from, in words: "median of 24 samples (save blocking time)", "estimated: ...",
// "not measured (no restart recorded): counted as 0". MTBF: learned from the interruptions, else
// 0 (not known). Keys: shape, step, snapshot, persist, restart, restore_memory, restore_peer,
// restore_storage, mtbf.
struct JobInputs {
  SimulationInputs in;
  std::map<std::string, std::string> sources;
  bool restore_memory_estimated = false;
  bool restore_storage_estimated = false;
  uint64_t interruptions = 0;
};
JobInputs InputsFromHistory(const HistorySummary& h, uint32_t record_world_size = 0);

// "median of 3 samples (restores) (few samples: low confidence)".
std::string SamplesNote(uint64_t samples, const std::string& what);

// The recommendation for one level (see above), explained.
struct LevelAdvice {
  std::string level;   // "memory", "path", "tier 1", ...
  std::string action;  // "save", "persist", "copy"
  double interval_seconds = 0;
  std::optional<uint64_t> interval_steps;
  uint64_t every = 1;       // saves (path) or steps of the level above (tiers) apart
  double cost_seconds = 0;  // the level's time for one step: blocking, persist, copy
  std::string explanation;
};
// Tier copy times: "tier N" -> seconds (the history's persists of "tier N").
std::vector<LevelAdvice> AdviseLevels(const Plan& plan,
                                      const std::map<std::string, double>& tier_copy_seconds = {});

}  // namespace safepoint::advisor
