// safepoint._core: the measurement history, the goodput model's plan (the one computation that
// `safepoint simulate`, `safepoint advise` and persist_every="auto" share, src/advisor/plan.h)
// and the controller of persist_every="auto" (docs/guide.md, "Choosing the checkpoint
// interval"). Python passes values; the math is here.
#include "advisor_bindings.h"

#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <utility>

#include "advisor/goodput.h"
#include "advisor/history.h"
#include "advisor/interval.h"
#include "advisor/plan.h"
#include "errors.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace safepoint::python {

void BindAdvisor(nb::module_& m) {
  using namespace safepoint::advisor;
  m.def("history_path", &HistoryPath, "checkpoint_path"_a, "job"_a,
        "The history file of a local checkpoint path; else the deprecated "
        "$SAFEPOINT_HISTORY_DIR file, or '' (src/advisor/history.h)");
  m.def(
      "parse_duration", [](const std::string& s) { return Unwrap(ParseDuration(s)); }, "text"_a,
      "Seconds of '90', '5m', '3.1h', '2d'");

  m.def("format_duration", &FormatDuration, "seconds"_a,
        "'42 s', '3.5 min', '2.1 h': how every interval of the advisor is printed");

  nb::class_<JobShape>(m, "JobShape", "The job's shape as its history records it")
      .def_ro("world_size", &JobShape::world_size)
      .def_ro("node_ranks", &JobShape::node_ranks)
      .def_ro("peer_copies", &JobShape::peer_copies);
  nb::class_<Measured>(m, "Measured")
      .def_ro("seconds", &Measured::seconds)
      .def_ro("samples", &Measured::samples);
  nb::class_<HistorySummary>(m, "HistorySummary", "What a history file says (ReadHistory)")
      .def_ro("path", &HistorySummary::path)
      .def_ro("save", &HistorySummary::save)
      .def_ro("persist", &HistorySummary::persist)
      .def_ro("restore", &HistorySummary::restore)
      .def_ro("restart", &HistorySummary::restart)
      .def_ro("runs", &HistorySummary::runs)
      .def_ro("interruptions", &HistorySummary::interruptions)
      .def_ro("uptime_seconds", &HistorySummary::uptime_seconds)
      .def_ro("learned_mtbf_seconds", &HistorySummary::learned_mtbf_seconds)
      .def_ro("save_period_seconds", &HistorySummary::save_period_seconds)
      .def_ro("steps_per_save", &HistorySummary::steps_per_save)
      .def_ro("step_seconds", &HistorySummary::step_seconds)
      .def_ro("shape", &HistorySummary::shape);
  m.def(
      "read_history", [](const std::string& path) { return Unwrap(ReadHistory(path)); }, "path"_a);
  m.def(
      "read_job_history",
      [](const std::string& checkpoint_path, const std::string& job) {
        return Unwrap(ReadJobHistory(checkpoint_path, job));
      },
      "checkpoint_path"_a, "job"_a = "",
      "The history the job's agent keeps with its checkpoints, wherever they are "
      "(src/advisor/history.h); NotFoundError when there is none");

  nb::class_<SimulationInputs>(m, "SimulationInputs",
                               "The goodput model's inputs (src/advisor/goodput.h)")
      .def(nb::init<>())
      .def_rw("gpus", &SimulationInputs::gpus)
      .def_rw("gpus_per_node", &SimulationInputs::gpus_per_node)
      .def_rw("mtbf_seconds", &SimulationInputs::mtbf_seconds)
      .def_rw("node_loss_fraction", &SimulationInputs::node_loss_fraction)
      .def_rw("peer_copies", &SimulationInputs::peer_copies)
      .def_rw("step_seconds", &SimulationInputs::step_seconds)
      .def_rw("snapshot_seconds", &SimulationInputs::snapshot_seconds)
      .def_rw("persist_seconds", &SimulationInputs::persist_seconds)
      .def_rw("restart_seconds", &SimulationInputs::restart_seconds)
      .def_rw("restore_memory_seconds", &SimulationInputs::restore_memory_seconds)
      .def_rw("restore_peer_seconds", &SimulationInputs::restore_peer_seconds)
      .def_rw("restore_storage_seconds", &SimulationInputs::restore_storage_seconds)
      .def_rw("sync_save_seconds", &SimulationInputs::sync_save_seconds)
      .def_rw("dcp_blocking_seconds", &SimulationInputs::dcp_blocking_seconds);
  nb::class_<JobInputs>(m, "JobInputs", "The model's inputs of a job and where each came from")
      .def_ro("inputs", &JobInputs::in)
      .def_ro("sources", &JobInputs::sources)
      .def_ro("restore_memory_estimated", &JobInputs::restore_memory_estimated)
      .def_ro("restore_storage_estimated", &JobInputs::restore_storage_estimated)
      .def_ro("interruptions", &JobInputs::interruptions);
  m.def("inputs_from_history", &InputsFromHistory, "history"_a, "record_world_size"_a = 0,
        "The model's inputs from a job's history (src/advisor/plan.h)");
  nb::class_<StrategyResult>(m, "StrategyResult", "One strategy of a plan")
      .def_ro("name", &StrategyResult::name)
      .def_ro("interval_seconds", &StrategyResult::interval_seconds)
      .def_ro("blocking_seconds", &StrategyResult::blocking_seconds)
      .def_ro("goodput", &StrategyResult::goodput)
      .def_ro("persist_every_saves", &StrategyResult::persist_every_saves)
      .def_ro("interval_steps", &StrategyResult::interval_steps)
      .def_ro("persist_every_steps", &StrategyResult::persist_every_steps);
  nb::class_<Plan>(m, "Plan", "The goodput model's answer: each strategy at its interval")
      .def_ro("inputs", &Plan::inputs)
      .def_ro("optimal", &Plan::optimal)
      .def_ro("strategies", &Plan::strategies)
      .def_prop_ro("safepoint", [](const Plan& p) { return p.safepoint(); });
  m.def(
      "make_plan",
      [](const SimulationInputs& in, std::optional<double> interval) {
        return Unwrap(MakePlan(in, interval));
      },
      "inputs"_a, "interval"_a = nb::none(),
      "Each strategy at its goodput-optimal interval, or all at `interval` (src/advisor/plan.h)");
  nb::class_<LevelAdvice>(m, "LevelAdvice", "The plan's interval for one level, explained")
      .def_ro("level", &LevelAdvice::level)
      .def_ro("action", &LevelAdvice::action)
      .def_ro("interval_seconds", &LevelAdvice::interval_seconds)
      .def_ro("interval_steps", &LevelAdvice::interval_steps)
      .def_ro("every", &LevelAdvice::every)
      .def_ro("cost_seconds", &LevelAdvice::cost_seconds)
      .def_ro("explanation", &LevelAdvice::explanation);
  m.def("advise_levels", &AdviseLevels, "plan"_a,
        "tier_copy_seconds"_a = std::map<std::string, double>{},
        "memory, path and each tier at the plan's intervals (src/advisor/plan.h)");
  m.def("persist_every_saves", &PersistEverySaves, "persist_seconds"_a, "period_seconds"_a,
        "How many saves apart storage takes a step when it takes them as often as it can");
  m.def("interval_steps", &IntervalSteps, "interval_seconds"_a, "blocking_seconds"_a,
        "step_seconds"_a, "Whole steps in an interval (k x step + blocking nearest it)");

  nb::class_<IntervalController>(m, "IntervalController",
                                 "Follows the advice within bounds, with hysteresis")
      .def(
          "__init__",
          [](IntervalController* c, double initial, double min_seconds, double max_seconds,
             double hysteresis) {
            new (c)
                IntervalController(initial, IntervalBounds{min_seconds, max_seconds}, hysteresis);
          },
          "initial"_a, "min_seconds"_a, "max_seconds"_a, "hysteresis"_a = 0.25)
      .def("update", &IntervalController::Update, "recommended"_a, "why"_a)
      .def_prop_ro("interval_seconds", &IntervalController::interval_seconds)
      .def_prop_ro("reason", &IntervalController::reason)
      .def_prop_ro("changes", &IntervalController::changes);
}

}  // namespace safepoint::python
