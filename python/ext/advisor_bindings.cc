// safepoint._core: the measurement history, the interval advisor and its controller
// (src/advisor; docs/guide.md, "The interval advisor"). Python passes values; the math is here.
#include "advisor_bindings.h"

#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <utility>

#include "advisor/history.h"
#include "advisor/interval.h"
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
      .def_ro("learned_mtbf_seconds", &HistorySummary::learned_mtbf_seconds);
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

  nb::class_<IntervalAdvice>(m, "IntervalAdvice", "The advisor's recommendation for one level")
      .def_ro("level", &IntervalAdvice::level)
      .def_ro("interval_seconds", &IntervalAdvice::interval_seconds)
      .def_ro("young_seconds", &IntervalAdvice::young_seconds)
      .def_ro("availability_seconds", &IntervalAdvice::availability_seconds)
      .def_ro("expected_goodput", &IntervalAdvice::expected_availability)
      .def_ro("save_seconds", &IntervalAdvice::save_seconds)
      .def_ro("recovery_seconds", &IntervalAdvice::recovery_seconds)
      .def_ro("mtbf_seconds", &IntervalAdvice::mtbf_seconds)
      .def_ro("bound", &IntervalAdvice::bound)
      .def_ro("warnings", &IntervalAdvice::warnings)
      .def("explain", &IntervalAdvice::Explain);
  m.def(
      "advise_interval",
      [](const std::string& level, std::optional<double> save, std::optional<double> persist,
         std::optional<double> restore, std::optional<double> restart, double mtbf,
         double min_seconds, double max_seconds) {
        LevelCosts c{level, save, persist, restore, restart, 0};
        return Unwrap(AdviseInterval(c, mtbf, IntervalBounds{min_seconds, max_seconds}));
      },
      "level"_a, "save"_a.none(), "persist"_a.none(), "restore"_a.none(), "restart"_a.none(),
      "mtbf"_a, "min_seconds"_a = 0.0, "max_seconds"_a = 86400.0,
      "The goodput-optimal interval of one level (src/advisor/interval.h)");

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
