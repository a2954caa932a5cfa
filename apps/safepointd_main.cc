// safepointd: the node agent of one job (src/agent/agent.h).
//
//   safepointd --job JOB [--shm-dir DIR] [--no-emergency-flush] [--sidecar] [--idle-exit SECONDS]
//              [--log-level LEVEL] [--metrics HOST:PORT] [--event-log PATH]
//
// Training processes start it on demand; `safepoint agent` runs the same code in the
// foreground as a sidecar. Arguments are parsed by CLI11 (`safepointd --help`). Exit status: that
// of RunAgent (0 clean, 1 error, 3 another agent serves the job), 2 on a usage error (an unknown
// option, a missing or malformed value).
#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <iostream>
#include <string>

#include "agent/agent.h"
#include "base/log.h"

namespace {

constexpr int kExitUsage = 2;

// A finite number of seconds >= 0, checked before CLI11 converts it (it would take "nan" and
// "inf").
const CLI::Validator kSeconds(
    [](std::string& v) -> std::string {
      double seconds = 0;
      const char* end = v.data() + v.size();
      const auto [ptr, ec] = std::from_chars(v.data(), end, seconds);
      if (v.empty() || ec != std::errc() || ptr != end || !std::isfinite(seconds) || seconds < 0) {
        return "'" + v + "' is not a number of seconds >= 0";
      }
      return std::string();
    },
    "");

}  // namespace

int main(int argc, char** argv) {
  safepoint::AgentOptions o;
  CLI::App app(
      "safepointd: the node agent of one job. It persists the snapshots that the job's training "
      "processes leave in shared memory.\nTraining processes start it on demand; "
      "`safepoint agent` runs it in the foreground as a sidecar.",
      "safepointd");
  app.get_formatter()->column_width(26);
  app.get_formatter()->label("Usage", "usage");
  app.footer(
      "Exit status: 0 on a clean exit, 1 on an error, 2 on a usage error, 3 when another agent\n"
      "already serves the job.");
  bool no_emergency_flush = false;
  bool sidecar = false;
  app.add_option("--job", o.job, "the job's name ([A-Za-z0-9._-], 1..64)")
      ->type_name("JOB")
      ->required();
  app.add_option("--shm-dir", o.shm_dir, "the shared-memory directory of the snapshots")
      ->type_name("DIR")
      ->capture_default_str();
  app.add_flag("--no-emergency-flush", no_emergency_flush,
               "do not persist the snapshot of a process that dies");
  app.add_flag("--sidecar", sidecar, "run until SIGTERM, also when every rank has closed");
  app.add_option("--idle-exit", o.idle_exit_seconds,
                 "exit after this long with no client and no work (0: never)")
      ->type_name("SECONDS")
      ->capture_default_str()
      ->check(kSeconds);
  app.add_option("--log-level", o.log_level,
                 "log from this level on: trace, debug, info, warn, error, critical, off "
                 "(default: $SAFEPOINT_LOG_LEVEL, else info)")
      ->type_name("LEVEL")
      ->check(CLI::IsMember(safepoint::internal::kLogLevels));
  app.add_option("--metrics", o.metrics_address,
                 "serve Prometheus metrics on HOST:PORT from the start (port 0: a free one)")
      ->type_name("HOST:PORT");
  app.add_option("--event-log", o.event_log,
                 "the JSON-lines event log (default: events.jsonl in the job directory)")
      ->type_name("PATH");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    std::cerr << "safepointd: " << e.what() << "\nRun 'safepointd --help' for usage.\n";
    return kExitUsage;
  }
  o.emergency_flush = !no_emergency_flush;
  o.exit_when_idle = !sidecar;
  return safepoint::RunAgent(o);
}
