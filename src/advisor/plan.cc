// The plan of the goodput model: each strategy's interval, the curve, the levels' advice, and the
// job's inputs from its history (plan.h).
#include "advisor/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "advisor/interval.h"

namespace safepoint::advisor {
namespace {

std::string PlanPct(double g) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f%%", 100 * g);
  return buf;
}

std::string PlanNum(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g", v);
  return buf;
}

std::string PlanOrdinal(uint64_t n) {
  if (n == 1) return "";
  const uint64_t tens = n % 100;
  const char* suffix = "th";
  if (tens < 11 || tens > 13) {
    if (n % 10 == 1) suffix = "st";
    if (n % 10 == 2) suffix = "nd";
    if (n % 10 == 3) suffix = "rd";
  }
  return std::to_string(n) + suffix + " ";
}

std::string PlanPlural(uint64_t n, const std::string& word) {
  return std::to_string(n) + " " + word + (n == 1 ? "" : "s");
}

}  // namespace

std::optional<uint64_t> IntervalSteps(double interval_seconds, double blocking_seconds,
                                      double step_seconds) {
  if (!(step_seconds > 0) || !std::isfinite(interval_seconds)) return std::nullopt;
  const double k = std::round((interval_seconds - blocking_seconds) / step_seconds);
  if (!(k >= 1)) return 1;
  if (k >= 1e15) return std::nullopt;
  return static_cast<uint64_t>(k);
}

std::string IntervalText(double seconds, std::optional<uint64_t> steps) {
  std::string s = FormatDuration(seconds);
  if (steps) s += " (" + PlanPlural(*steps, "step") + ")";
  return s;
}

Result<Plan> MakePlan(const SimulationInputs& raw, std::optional<double> interval_seconds) {
  SP_ASSIGN_OR_RETURN(SimulationInputs in, CompleteInputs(raw));
  if (interval_seconds && !(std::isfinite(*interval_seconds) && *interval_seconds > 0)) {
    return InvalidArgument("the interval must be a positive number of seconds");
  }
  Plan plan;
  plan.inputs = in;
  plan.optimal = !interval_seconds;
  const double lo = 1e-3;
  const double hi = std::max(100 * in.mtbf_seconds, 10.0);
  const size_t n = Strategies(in, 1).size();
  for (size_t i = 0; i < n; ++i) {
    const double period = interval_seconds ? *interval_seconds : OptimalPeriod(in, i, lo, hi);
    StrategyAtInterval s = Strategies(in, period)[i];
    StrategyResult r;
    r.name = s.name;
    r.interval_seconds = period;
    r.blocking_seconds = s.blocking_seconds;
    r.goodput = AnalyticGoodput(s);
    r.modes = std::move(s.modes);
    r.persist_every_saves = i == 0 ? PersistEverySaves(in.persist_seconds, period) : 1;
    r.interval_steps = IntervalSteps(period, r.blocking_seconds, in.step_seconds);
    if (r.interval_steps) r.persist_every_steps = *r.interval_steps * r.persist_every_saves;
    plan.strategies.push_back(std::move(r));
  }
  return plan;
}

std::vector<CurvePoint> GoodputCurve(const Plan& plan, int points) {
  const SimulationInputs& in = plan.inputs;
  double min_period = 1e-3;
  for (const auto& s : plan.strategies)
    min_period = std::max(min_period, s.blocking_seconds * 1.02);
  const double start = std::log(min_period);
  const double end = std::log(std::max(min_period * 10, 3 * in.mtbf_seconds));
  std::vector<double> xs;
  for (int k = 0; k <= points; ++k) xs.push_back(std::exp(start + (end - start) * k / points));
  for (const auto& s : plan.strategies) xs.push_back(s.interval_seconds);
  std::sort(xs.begin(), xs.end());
  xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
  std::vector<CurvePoint> curve;
  for (double p : xs) {
    CurvePoint c;
    c.interval_seconds = p;
    for (const auto& s : Strategies(in, p)) c.goodput.push_back(AnalyticGoodput(s));
    curve.push_back(std::move(c));
  }
  return curve;
}

std::string SamplesNote(uint64_t n, const std::string& what) {
  if (n == 0) return "given on the command line";
  std::string s =
      "median of " + std::to_string(n) + (n == 1 ? " sample (" : " samples (") + what + ")";
  if (n < 5) s += " (few samples: low confidence)";
  return s;
}

JobInputs InputsFromHistory(const HistorySummary& h, uint32_t record_world_size) {
  JobInputs j;
  SimulationInputs& in = j.in;
  auto& src = j.sources;
  const bool peer_restored = h.restore.contains("peer");
  if (h.shape && h.shape->world_size > 0) {
    in.gpus = h.shape->world_size;
    in.gpus_per_node = h.shape->node_ranks > 0 ? h.shape->node_ranks : in.gpus;
    in.peer_copies = h.shape->peer_copies && Nodes(in) >= 2;
    src["shape"] = "recorded: " + PlanPlural(in.gpus, "rank") + ", " +
                   std::to_string(in.gpus_per_node) + " on rank 0's node (" +
                   PlanPlural(Nodes(in), "node") + "), " +
                   (in.peer_copies ? "copies of each node's snapshots on other nodes"
                                   : "no copies on other nodes");
  } else if (record_world_size > 0) {
    in.gpus = record_world_size;
    in.gpus_per_node = record_world_size;
    src["shape"] = "world size " + std::to_string(record_world_size) +
                   " from the newest committed step; its nodes were not recorded: taken as one "
                   "node without copies on other nodes (--gpus-per-node, --peers)";
  } else {
    in.gpus = 1;
    in.gpus_per_node = 1;
    src["shape"] = "not recorded: taken as one process (--gpus, --gpus-per-node, --peers)";
  }
  if (peer_restored && !in.peer_copies) {
    src["shape"] += "; a restore from a peer was recorded: give --gpus-per-node and --peers";
  }
  if (h.step_seconds) {
    in.step_seconds = *h.step_seconds;
    const double per_save = h.steps_per_save.value_or(1);
    src["step"] = "measured (a save every " +
                  (per_save == 1 ? std::string("step") : PlanNum(per_save) + " steps") +
                  ", every " + FormatDuration(h.save_period_seconds.value_or(0)) + ")";
  } else {
    src["step"] = "not recorded (--step-seconds gives it): intervals in seconds only";
  }
  if (h.save) {
    in.snapshot_seconds = h.save->seconds;
    src["snapshot"] = SamplesNote(h.save->samples, "save blocking time");
  } else {
    src["snapshot"] = "not measured (no save recorded)";
  }
  if (auto it = h.persist.find("path"); it != h.persist.end()) {
    in.persist_seconds = it->second.seconds;
    src["persist"] = SamplesNote(it->second.samples, "writes of a step");
  } else {
    src["persist"] = "not measured (no persist recorded)";
  }
  if (h.restart) {
    in.restart_seconds = h.restart->seconds;
    src["restart"] = SamplesNote(h.restart->samples, "restarts: interruption to next start");
  } else {
    src["restart"] = "not measured (no restart recorded): counted as 0";
  }
  auto restore = [&](const std::string& level, const std::string& key, double* field,
                     bool* estimated) {
    if (auto it = h.restore.find(level); it != h.restore.end()) {
      *field = it->second.seconds;
      src[key] = SamplesNote(it->second.samples, "restores");
    } else if (auto e = EstimateRestore(h, level)) {
      *field = e->seconds;
      src[key] = e->how;
      if (estimated) *estimated = true;
    } else {
      src[key] = level == "memory" ? "estimated: the save's blocking time (not restored yet)"
                                   : "estimated: the persist time (not restored yet)";
      if (estimated) *estimated = true;
    }
  };
  restore("memory", "restore_memory", &in.restore_memory_seconds, &j.restore_memory_estimated);
  restore("path", "restore_storage", &in.restore_storage_seconds, &j.restore_storage_estimated);
  if (auto it = h.restore.find("peer"); it != h.restore.end()) {
    in.restore_peer_seconds = it->second.seconds;
    src["restore_peer"] = SamplesNote(it->second.samples, "restores");
  } else {
    src["restore_peer"] = "not measured: taken as a restore from storage";
  }
  j.interruptions = h.interruptions;
  if (h.learned_mtbf_seconds) {
    in.mtbf_seconds = *h.learned_mtbf_seconds;
    const double rel = 1 / std::sqrt(static_cast<double>(std::max<uint64_t>(1, h.interruptions)));
    src["mtbf"] = "learned from " + PlanPlural(h.interruptions, "interruption") + " in " +
                  FormatDuration(h.uptime_seconds) + " of running (about +-" +
                  std::to_string(static_cast<int>(std::round(100 * rel))) + "%)";
  }
  return j;
}

std::vector<LevelAdvice> AdviseLevels(const Plan& plan,
                                      const std::map<std::string, double>& tier_copy_seconds) {
  const SimulationInputs& in = plan.inputs;
  const StrategyResult& sp = plan.safepoint();
  std::vector<LevelAdvice> out;

  LevelAdvice memory;
  memory.level = "memory";
  memory.action = "save";
  memory.interval_seconds = sp.interval_seconds;
  memory.interval_steps = sp.interval_steps;
  memory.cost_seconds = sp.blocking_seconds;
  {
    std::string e = "memory: save every " + IntervalText(sp.interval_seconds, sp.interval_steps) +
                    ". A save blocks training " + FormatDuration(sp.blocking_seconds) + ";";
    for (size_t i = 0; i < sp.modes.size(); ++i) {
      const FailureMode& m = sp.modes[i];
      const double share = in.mtbf_seconds * m.rate_per_second;
      if (share <= 0) continue;
      std::string how;
      if (m.name == "process crash") {
        how = "restart + restore from memory";
      } else if (in.peer_copies) {
        how = "restart + restore from a peer's copy";
      } else {
        how = "restart + restore from storage + the work since the newest persisted step";
      }
      e += std::string(i ? " and" : "") + " a " + m.name + " (" + PlanPct(share) +
           " of failures) costs " + FormatDuration(m.recovery_seconds) + " (" + how + ")";
    }
    e += ", besides the work since the newest save; failures come every " +
         FormatDuration(in.mtbf_seconds) +
         " on average. This interval maximizes the expected "
         "goodput: " +
         PlanPct(sp.goodput) + " (the goodput model; `safepoint simulate` shows the same).";
    if (in.mtbf_seconds <= sp.blocking_seconds) {
      e += " Warning: the MTBF is not longer than a save: hardly any interval makes progress; "
           "make saves cheaper first.";
    } else if (sp.goodput < 0.5) {
      e += " Warning: the job spends most of its time saving and recovering.";
    }
    memory.explanation = e;
  }
  out.push_back(memory);

  LevelAdvice path;
  path.level = "path";
  path.action = "persist";
  path.every = sp.persist_every_saves;
  path.interval_seconds = sp.interval_seconds * static_cast<double>(sp.persist_every_saves);
  path.interval_steps = sp.persist_every_steps;
  path.cost_seconds = in.persist_seconds;
  {
    std::string e = "path: persist every " +
                    (path.every == 1 ? std::string("save") : PlanOrdinal(path.every) + "save") +
                    " (" + FormatDuration(path.interval_seconds);
    if (path.interval_steps) {
      e += ", " + PlanPlural(*path.interval_steps, "step") +
           ": persist_every=" + std::to_string(*path.interval_steps);
    }
    e += ").";
    if (in.persist_seconds > 0) {
      e += " A persist takes " + FormatDuration(in.persist_seconds) +
           " in the background and costs training nothing, so as often as the storage takes "
           "steps is best";
    } else {
      e += " No persist time was measured: every save";
    }
    e += in.peer_copies ? " (a lost node's snapshots come back from a peer's copy; storage is the "
                          "fallback)."
                        : " (a node loss restores from here and loses the work since the newest "
                          "persisted step).";
    path.explanation = e;
  }
  out.push_back(path);

  // Each tier takes the newest step of the level above whenever its previous copy is done.
  double above_seconds = path.interval_seconds;
  std::optional<uint64_t> above_steps = path.interval_steps;
  for (const auto& [level, copy] : tier_copy_seconds) {
    LevelAdvice t;
    t.level = level;
    t.action = "copy";
    t.cost_seconds = copy;
    t.every = PersistEverySaves(copy, above_seconds);
    t.interval_seconds = above_seconds * static_cast<double>(t.every);
    if (above_steps) t.interval_steps = *above_steps * t.every;
    t.explanation = level + ": every " +
                    (t.every == 1 ? std::string("step") : PlanOrdinal(t.every) + "step") +
                    " of the level above (" + IntervalText(t.interval_seconds, t.interval_steps) +
                    "). A copy takes " + FormatDuration(copy) +
                    " and costs training nothing (the agent copies in the background), so as "
                    "often as the tier takes steps: every=\"auto\" does that.";
    above_seconds = t.interval_seconds;
    above_steps = t.interval_steps;
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace safepoint::advisor
