// `safepoint advise PATH` and `safepoint simulate` (docs/guide.md, "The interval advisor" and
// "The goodput simulator").
//
//   safepoint advise PATH [--job JOB] [--mtbf D] [--save-seconds S] [--restore-seconds S]
//                         [--restart-seconds S] [--json]
//   safepoint simulate [--from PATH] [--mtbf D | --node-mtbf D] [cluster and cost flags]
//                      [--state-per-gpu SIZE --memory-bandwidth R --storage-bandwidth R ...]
//                      [--interval D] [--monte-carlo] [--seed N] [--csv FILE] [--plot FILE.png]
//                      [--json]
//
// advise reads the job's measurement history (src/advisor/history.h) and prints, for each level
// (memory snapshots, the checkpoint path, each tier), the goodput-optimal interval and the costs
// it used, where they were measured and from how many samples. A restore never measured is
// estimated from the state's size and the measured copy or persist bandwidth (EstimateRestore),
// and says so; with no failure rate (no interruption recorded, no --mtbf) it shows the intervals
// for typical MTBFs (kTypicalMtbfSeconds) and says so. simulate reports the expected
// goodput of safepoint's strategy, periodic synchronous saves and DCP async saves; --plot
// writes goodput against the checkpoint interval as a PNG through the package's plotting module
// (`python -m safepoint.goodput_plot CSV PNG`; the Python next to this binary, or
// $SAFEPOINT_PYTHON).
#include "cli_advisor.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "advisor/goodput.h"
#include "advisor/history.h"
#include "advisor/interval.h"
#include "base/log.h"
#include "cli_format.h"

extern char** environ;

namespace safepoint::cli {

using json = nlohmann::ordered_json;
using namespace safepoint::advisor;

namespace {

std::string Pct(double g) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f%%", 100 * g);
  return buf;
}

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g", v);
  return buf;
}

json Opt(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }

// A CLI11 validator for durations ("90", "5m", "3.1h").
CLI::Validator DurationCheck() {
  return CLI::Validator(
      [](std::string& v) {
        auto d = ParseDuration(v);
        return d.ok() ? std::string() : d.status().message();
      },
      "DURATION");
}

}  // namespace

struct AdvisorCommands::Options {
  std::string path;
  std::string job;
  std::string mtbf, node_mtbf, interval;
  std::optional<double> save_seconds, restore_seconds, restart_seconds;
  bool json = false;
  // simulate
  std::string from;
  uint32_t gpus = 8, gpus_per_node = 8;
  double node_loss_fraction = 0.2;
  bool no_peers = false;
  std::optional<double> snapshot, persist, restore_memory, restore_peer, restore_storage, sync_save,
      dcp_blocking;
  bool monte_carlo = false;
  uint64_t seed = 1;
  double horizon_hours = 0;
  std::string csv, plot;
  std::string state_per_gpu, memory_bw, storage_bw, storage_read_bw, network_bw;
};

AdvisorCommands::AdvisorCommands(CLI::App& app) : o_(std::make_unique<Options>()) {
  Options& o = *o_;
  advise_ = app.add_subcommand(
      "advise", "the goodput-optimal checkpoint interval of each level, from measured costs");
  advise_->add_option("PATH", o.path, "checkpoint directory: a path or a storage URI")
      ->type_name("")
      ->required();
  advise_->add_option("--job", o.job, "the job (only to read a deprecated $SAFEPOINT_HISTORY_DIR)")
      ->type_name("JOB");
  advise_
      ->add_option("--mtbf", o.mtbf,
                   "mean time between failures of the job (default: learned from its restarts)")
      ->type_name("DURATION")
      ->check(DurationCheck());
  advise_->add_option("--save-seconds", o.save_seconds, "override: what a save costs training")
      ->type_name("S")
      ->check(CLI::NonNegativeNumber);
  advise_->add_option("--restore-seconds", o.restore_seconds, "override: restore time")
      ->type_name("S")
      ->check(CLI::NonNegativeNumber);
  advise_
      ->add_option("--restart-seconds", o.restart_seconds,
                   "override: failure detection and restart time")
      ->type_name("S")
      ->check(CLI::NonNegativeNumber);
  advise_->add_flag("--json", o.json, "the advice as JSON");

  simulate_ = app.add_subcommand(
      "simulate", "expected goodput of safepoint vs synchronous vs DCP async checkpoints");
  auto& s = *simulate_;
  s.add_option("--from", o.from, "read the measured costs and MTBF from this job's history")
      ->type_name("PATH");
  s.add_option("--job", o.job, "the job (only to read a deprecated $SAFEPOINT_HISTORY_DIR)")
      ->type_name("JOB");
  s.add_option("--gpus", o.gpus, "GPUs of the job")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  s.add_option("--gpus-per-node", o.gpus_per_node, "GPUs per node")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  s.add_option("--mtbf", o.mtbf, "mean time between failures of the whole job")
      ->type_name("DURATION")
      ->check(DurationCheck());
  s.add_option("--node-mtbf", o.node_mtbf, "mean time between failures of one node")
      ->type_name("DURATION")
      ->check(DurationCheck());
  s.add_option("--node-loss-fraction", o.node_loss_fraction,
               "share of failures that lose a node's memory (the rest are process crashes)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  s.add_flag("--no-peers", o.no_peers, "no peer copies: a lost node restores from storage");
  auto size = [&](const char* name, std::string& v, const char* help) {
    s.add_option(name, v, help)
        ->type_name("SIZE")
        ->check(CLI::Validator(
            [](std::string& x) {
              auto b = ParseBytes(x);
              return b.ok() ? std::string() : b.status().message();
            },
            "SIZE"));
  };
  size("--state-per-gpu", o.state_per_gpu,
       "checkpointed state per GPU (16GiB, 25G); with the speeds below, sets the costs");
  size("--memory-bandwidth", o.memory_bw, "per GPU: snapshot copy and hot reload (B/s)");
  size("--storage-bandwidth", o.storage_bw, "aggregate storage write speed (B/s)");
  size("--storage-read-bandwidth", o.storage_read_bw,
       "aggregate storage read speed (B/s; default: the write speed)");
  size("--network-bandwidth", o.network_bw, "per node: restoring a lost node from peers (B/s)");
  auto secs = [&](const char* name, std::optional<double>& v, const char* help) {
    s.add_option(name, v, help)->type_name("S")->check(CLI::NonNegativeNumber);
  };
  secs("--snapshot-seconds", o.snapshot, "blocking time of a snapshot into memory");
  secs("--persist-seconds", o.persist, "writing one step to storage in the background");
  secs("--restart-seconds", o.restart_seconds, "failure detection and restart");
  secs("--restore-memory-seconds", o.restore_memory, "restore from this node's memory");
  secs("--restore-peer-seconds", o.restore_peer, "restore from a peer's copy");
  secs("--restore-storage-seconds", o.restore_storage, "restore from storage");
  secs("--sync-save-seconds", o.sync_save, "a synchronous save (default: the persist time)");
  secs("--dcp-blocking-seconds", o.dcp_blocking, "DCP async staging (default: the snapshot time)");
  s.add_option("--interval", o.interval,
               "evaluate at this checkpoint interval (default: each strategy's optimum)")
      ->type_name("DURATION")
      ->check(DurationCheck());
  s.add_flag("--monte-carlo", o.monte_carlo, "also a seeded Monte-Carlo run of the same model");
  s.add_option("--seed", o.seed, "Monte-Carlo seed")->capture_default_str();
  s.add_option("--horizon-hours", o.horizon_hours,
               "Monte-Carlo wall time to simulate (default: 20000 MTBFs, at most 10^7 periods)")
      ->check(CLI::NonNegativeNumber);
  s.add_option("--csv", o.csv, "write goodput against interval as CSV")->type_name("FILE");
  s.add_option("--plot", o.plot, "write goodput against interval as a PNG (matplotlib)")
      ->type_name("FILE");
  s.add_flag("--json", o.json, "the report as JSON");
  for (CLI::App* cmd : {advise_, simulate_}) cmd->group("Commands");
}

AdvisorCommands::~AdvisorCommands() = default;

namespace {

struct Mtbf {
  double seconds = 0;
  std::string source;  // "configured", "learned from N interruptions over ..."
};

// The configured or learned MTBF; nullopt when there is neither (the advice then shows the
// intervals for kTypicalMtbfSeconds).
Result<std::optional<Mtbf>> PickMtbf(const std::string& flag,
                                     const std::optional<HistorySummary>& h) {
  if (!flag.empty()) {
    SP_ASSIGN_OR_RETURN(double s, ParseDuration(flag));
    if (s <= 0) return InvalidArgument("--mtbf must be positive");
    return std::optional<Mtbf>(Mtbf{s, "configured (--mtbf)"});
  }
  if (h && h->learned_mtbf_seconds) {
    const double rel = 1 / std::sqrt(static_cast<double>(h->interruptions));
    return std::optional<Mtbf>(
        Mtbf{*h->learned_mtbf_seconds,
             "learned from " + std::to_string(h->interruptions) + " interruption" +
                 (h->interruptions == 1 ? "" : "s") + " in " + FormatDuration(h->uptime_seconds) +
                 " of running (about +-" + std::to_string(static_cast<int>(std::round(100 * rel))) +
                 "%)"});
  }
  return std::optional<Mtbf>();
}

std::string TypicalMtbfs() {
  std::string s;
  for (double m : kTypicalMtbfSeconds) s += (s.empty() ? "" : ", ") + FormatDuration(m);
  return s;
}

// The advice's fields in advise's JSON.
void AdviceJson(const IntervalAdvice& a, json& j) {
  j["interval_seconds"] = a.interval_seconds;
  j["young_seconds"] = a.young_seconds;
  j["availability_optimal_seconds"] = a.availability_seconds;
  j["expected_goodput"] = a.expected_availability;
  j["bound"] = a.bound.empty() ? json(nullptr) : json(a.bound);
  j["warnings"] = a.warnings;
}

// The job's history wherever the agent keeps it (src/advisor/history.h); `where` names it, or
// where it was looked for.
std::optional<HistorySummary> LoadHistory(const std::string& path, const std::string& job,
                                          std::string* where) {
  *where = HistoryIsLocal(path) ? HistoryPath(path, job)
                                : path + "/" + std::string(kHistorySegmentPrefix);
  if (!HistoryIsLocal(path) && !HistoryPath(path, job).empty()) {
    spdlog::warn(
        "$SAFEPOINT_HISTORY_DIR is deprecated: the agent keeps the history of {} in {} now; "
        "{} is still read, never written",
        path, *where, HistoryPath(path, job));
  }
  uint64_t skipped = 0;
  auto h = ReadJobHistory(path, job, &skipped);
  if (!h.ok()) {
    if (h.status().code() != StatusCode::kNotFound) spdlog::warn("{}", h.status().ToString());
    return std::nullopt;
  }
  *where = h->path;
  if (skipped) spdlog::warn("{}: skipped {} unreadable lines", h->path, skipped);
  return std::move(h).value();
}

std::string SamplesNote(uint64_t n, const char* what) {
  if (n == 0) return "given on the command line";
  std::string s =
      "median of " + std::to_string(n) + (n == 1 ? " sample (" : " samples (") + what + ")";
  if (n < 5) s += " (few samples: low confidence)";
  return s;
}

int RunAdvise(const AdvisorCommands::Options& o);
int RunSimulate(const AdvisorCommands::Options& o);

}  // namespace

std::optional<int> AdvisorCommands::Run() const {
  if (advise_->parsed()) return RunAdvise(*o_);
  if (simulate_->parsed()) return RunSimulate(*o_);
  return std::nullopt;
}

namespace {

int RunAdvise(const AdvisorCommands::Options& o) {
  std::string where;
  const auto h = LoadHistory(o.path, o.job, &where);
  if (!h && !(o.save_seconds && o.restore_seconds)) {
    return Fail(NotFound(where + ": no measurement history (run the job with a Checkpointer first)"
                                 "; or give --save-seconds and --restore-seconds"));
  }
  auto picked = PickMtbf(o.mtbf, h);
  if (!picked.ok()) return Fail(picked.status());
  const std::optional<Mtbf>& mtbf = *picked;
  const std::string no_mtbf =
      "not known yet: the job's history records no interruption and no --mtbf was given; "
      "intervals shown for typical MTBFs (" +
      TypicalMtbfs() + "): give --mtbf (e.g. --mtbf 3h) for yours";

  // The levels: memory snapshots, the checkpoint path, and every tier seen in the history.
  std::vector<LevelCosts> levels;
  std::vector<json> notes;
  auto measured = [&](const std::map<std::string, Measured>& m,
                      const std::string& key) -> std::optional<Measured> {
    if (!h) return std::nullopt;
    auto it = m.find(key);
    if (it == m.end()) return std::nullopt;
    return it->second;
  };
  const std::optional<Measured> save = h ? h->save : std::nullopt;
  const std::optional<Measured> restart = h ? h->restart : std::nullopt;
  std::vector<std::string> names = {"memory", "path"};
  if (h) {
    for (const auto& [level, m] : h->persist) {
      if (level != "path") names.push_back(level);
    }
  }
  for (const std::string& name : names) {
    LevelCosts c;
    c.name = name;
    json note = json::object();
    if (o.save_seconds) {
      c.save_seconds = *o.save_seconds;
      note["save"] = "given (--save-seconds)";
    } else if (name == "memory" || name == "path") {
      if (save) {
        c.save_seconds = save->seconds;
        c.samples = save->samples;
        note["save"] = SamplesNote(save->samples, "save blocking time");
      }
    } else {
      c.save_seconds = 0;  // tiers are filled by the agent, off the training path
      note["save"] = "0: the agent copies to this tier in the background";
    }
    if (name != "memory") {
      if (auto p = measured(h ? h->persist : std::map<std::string, Measured>{}, name)) {
        c.persist_seconds = p->seconds;
        note["persist"] = SamplesNote(p->samples, "writes of a step");
      }
    }
    if (o.restore_seconds) {
      c.restore_seconds = *o.restore_seconds;
      note["restore"] = "given (--restore-seconds)";
    } else if (auto r = measured(h ? h->restore : std::map<std::string, Measured>{}, name)) {
      c.restore_seconds = r->seconds;
      note["restore"] = SamplesNote(r->samples, "restores");
    } else if (auto e = h ? EstimateRestore(*h, name) : std::nullopt) {
      c.restore_seconds = e->seconds;
      note["restore"] = e->how;
    } else if (c.save_seconds && name == "memory") {
      c.restore_seconds = c.save_seconds;  // a reload copies back what a save copied in
      note["restore"] = "estimated: the save time (a reload copies the same bytes back)";
    }
    if (o.restart_seconds) {
      c.restart_seconds = *o.restart_seconds;
      note["restart"] = "given (--restart-seconds)";
    } else if (restart) {
      c.restart_seconds = restart->seconds;
      note["restart"] = SamplesNote(restart->samples, "restarts: interruption to next start");
    } else {
      note["restart"] = "not measured (no restart recorded): counted as 0";
    }
    levels.push_back(c);
    notes.push_back(note);
  }

  json out = json::array();
  bool any = false;
  for (size_t i = 0; i < levels.size(); ++i) {
    const LevelCosts& c = levels[i];
    json j = {{"level", c.name},
              {"save_seconds", Opt(c.save_seconds)},
              {"persist_seconds", Opt(c.persist_seconds)},
              {"restore_seconds", Opt(c.restore_seconds)},
              {"restore_estimated",
               notes[i].contains("restore") &&
                   notes[i]["restore"].get<std::string>().rfind("estimated", 0) == 0},
              {"restart_seconds", Opt(c.restart_seconds)},
              {"mtbf_seconds", mtbf ? json(mtbf->seconds) : json(nullptr)},
              {"mtbf_source", mtbf ? mtbf->source : no_mtbf},
              {"measured", notes[i]}};
    if (mtbf) {
      auto a = AdviseInterval(c, mtbf->seconds);
      if (a.ok()) {
        any = true;
        AdviceJson(*a, j);
        j["explanation"] = a->Explain();
      } else {
        j["error"] = a.status().message();
      }
    } else {
      json by = json::array();
      for (double m : kTypicalMtbfSeconds) {
        auto a = AdviseInterval(c, m);
        if (!a.ok()) {
          j["error"] = a.status().message();
          break;
        }
        json t = {{"mtbf_seconds", m}};
        AdviceJson(*a, t);
        by.push_back(t);
      }
      if (!j.contains("error")) {
        any = true;
        j["interval_seconds"] = nullptr;
        j["typical_mtbf"] = by;
      }
    }
    out.push_back(j);
  }
  if (o.json) {
    std::cout << json{{"path", o.path}, {"history", where}, {"levels", out}}.dump(2) << "\n";
    return any ? kExitOk : kExitError;
  }
  std::cout << "Checkpoint intervals for " << o.path
            << " (history: " << (h ? where : std::string("none")) << ")\n";
  if (mtbf) {
    std::cout << "Failures: every " << FormatDuration(mtbf->seconds) << " on average, "
              << mtbf->source << ".\n\n";
  } else {
    std::cout << "Failures: the failure rate is " << no_mtbf << ".\n\n";
  }
  for (const json& j : out) {
    const std::string level = j["level"].get<std::string>();
    if (j.contains("error")) {
      std::cout << level << ": no advice: " << j["error"].get<std::string>() << "\n\n";
      continue;
    }
    if (j.contains("explanation")) {
      std::cout << j["explanation"].get<std::string>();
    } else {
      std::cout << level << ": Ts = " << FormatDuration(j["save_seconds"].get<double>())
                << " per save, Tr = "
                << FormatDuration(
                       j["restore_seconds"].get<double>() +
                       (j["restart_seconds"].is_null() ? 0 : j["restart_seconds"].get<double>()))
                << " per recovery (restart + restore)";
      for (const json& t : j["typical_mtbf"]) {
        std::cout << "\n  if failures came every "
                  << FormatDuration(t["mtbf_seconds"].get<double>()) << ": checkpoint every "
                  << FormatDuration(t["interval_seconds"].get<double>()) << " (expected goodput "
                  << Pct(t["expected_goodput"].get<double>()) << ")";
      }
    }
    std::cout << "\n  measured:";
    for (const auto& [k, v] : j["measured"].items()) {
      std::cout << " " << k << " " << v.get<std::string>() << ";";
    }
    std::cout << "\n\n";
  }
  if (!any) spdlog::error("no level has the measurements the advisor needs");
  return any ? kExitOk : kExitError;
}

// The Python that has the safepoint package: $SAFEPOINT_PYTHON, else the one next to this
// binary (a virtual environment's bin/), else python3 on PATH.
std::string PythonForPlots() {
  if (const char* env = std::getenv("SAFEPOINT_PYTHON"); env && *env) return env;
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (const char* name : {"python", "python3"}) {
      const auto p = self.parent_path() / name;
      if (::access(p.c_str(), X_OK) == 0) return p.string();
    }
  }
  return "python3";
}

Status RunPlot(const std::string& csv, const std::string& png) {
  const std::string python = PythonForPlots();
  std::vector<std::string> args = {python, "-m", "safepoint.goodput_plot", csv, png};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, python.c_str(), nullptr, nullptr, argv.data(), environ);
  if (rc != 0) return ErrnoStatus("run the plotting module with", python, rc);
  int status = 0;
  if (::waitpid(pid, &status, 0) < 0) return ErrnoStatus("wait for", python, errno);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return IOError(png + ": plotting failed (" + python +
                   " -m safepoint.goodput_plot; matplotlib installed?)");
  }
  return Status::OK();
}

int RunSimulate(const AdvisorCommands::Options& o) {
  SimulationInputs in;
  in.gpus = o.gpus;
  in.gpus_per_node = o.gpus_per_node;
  in.node_loss_fraction = o.node_loss_fraction;
  in.peer_copies = !o.no_peers;
  std::optional<HistorySummary> h;
  std::string where;
  if (!o.from.empty()) {
    h = LoadHistory(o.from, o.job, &where);
    if (!h) {
      return Fail(NotFound(where + ": no measurement history"));
    }
    if (h->save) in.snapshot_seconds = h->save->seconds;
    if (auto it = h->persist.find("path"); it != h->persist.end()) {
      in.persist_seconds = it->second.seconds;
    }
    if (auto it = h->restore.find("memory"); it != h->restore.end()) {
      in.restore_memory_seconds = it->second.seconds;
    }
    if (auto it = h->restore.find("peer"); it != h->restore.end()) {
      in.restore_peer_seconds = it->second.seconds;
    }
    if (auto it = h->restore.find("path"); it != h->restore.end()) {
      in.restore_storage_seconds = it->second.seconds;
    }
    if (h->restart) in.restart_seconds = h->restart->seconds;
    if (h->learned_mtbf_seconds) in.mtbf_seconds = *h->learned_mtbf_seconds;
  }
  if (!o.state_per_gpu.empty()) {
    auto bytes = [](const std::string& v) { return v.empty() ? 0.0 : *ParseBytes(v); };
    ClusterSpeeds sp;
    sp.state_bytes_per_gpu = bytes(o.state_per_gpu);
    sp.memory_bytes_per_second = bytes(o.memory_bw);
    sp.storage_write_bytes_per_second = bytes(o.storage_bw);
    sp.storage_read_bytes_per_second = bytes(o.storage_read_bw);
    sp.network_bytes_per_second = bytes(o.network_bw);
    DeriveCosts(sp, &in);
  }
  if (!o.mtbf.empty()) in.mtbf_seconds = *ParseDuration(o.mtbf);
  if (!o.node_mtbf.empty()) {
    const double nodes = std::ceil(static_cast<double>(o.gpus) / o.gpus_per_node);
    in.mtbf_seconds = *ParseDuration(o.node_mtbf) / nodes;
  }
  auto set = [](double& field, const std::optional<double>& flag) {
    if (flag) field = *flag;
  };
  set(in.snapshot_seconds, o.snapshot);
  set(in.persist_seconds, o.persist);
  set(in.restart_seconds, o.restart_seconds);
  set(in.restore_memory_seconds, o.restore_memory);
  set(in.restore_peer_seconds, o.restore_peer);
  set(in.restore_storage_seconds, o.restore_storage);
  set(in.sync_save_seconds, o.sync_save);
  set(in.dcp_blocking_seconds, o.dcp_blocking);
  auto done = CompleteInputs(in);
  if (!done.ok()) return Fail(done.status());
  in = *done;

  const double lo = 0.01;
  const double hi = std::max(100 * in.mtbf_seconds, 10.0);
  const auto names = Strategies(in, 1);
  const double horizon = o.horizon_hours > 0 ? o.horizon_hours * 3600 : 20000 * in.mtbf_seconds;
  json results = json::array();
  for (size_t i = 0; i < names.size(); ++i) {
    const double period =
        o.interval.empty() ? OptimalPeriod(in, i, lo, hi) : *ParseDuration(o.interval);
    const StrategyAtInterval s = Strategies(in, period)[i];
    json j = {{"strategy", s.name},
              {"interval_seconds", period},
              {"blocking_seconds", s.blocking_seconds},
              {"goodput", AnalyticGoodput(s)}};
    json modes = json::array();
    for (const auto& m : s.modes) {
      modes.push_back({{"mode", m.name},
                       {"mtbf_seconds", m.rate_per_second > 0 ? 1 / m.rate_per_second : 0},
                       {"recovery_seconds", m.recovery_seconds}});
    }
    j["failure_modes"] = modes;
    if (o.monte_carlo) {
      // By default about 20000 failures, but at most 10^7 periods (short periods, rare failures).
      const double h = o.horizon_hours > 0 ? horizon : std::min(horizon, 1e7 * period);
      const auto mc = MonteCarloGoodput(s, h, o.seed + i);
      j["monte_carlo"] = {{"goodput", mc.goodput},
                          {"standard_error", mc.standard_error},
                          {"failures", mc.failures},
                          {"seed", o.seed + i},
                          {"wall_seconds", mc.wall_seconds}};
    }
    results.push_back(j);
  }

  if (!o.csv.empty() || !o.plot.empty()) {
    const std::string csv = !o.csv.empty() ? o.csv : o.plot + ".csv";
    std::ofstream f(csv);
    if (!f) return Fail(ErrnoStatus("create", csv, errno));
    f << "interval_seconds";
    for (const auto& s : names) f << "," << s.name;
    f << "\n";
    double min_period = 1e-3;
    for (const auto& s : names) min_period = std::max(min_period, s.blocking_seconds * 1.02);
    const double start = std::log(min_period);
    const double end = std::log(std::max(min_period * 10, 3 * in.mtbf_seconds));
    constexpr int kPoints = 200;
    for (int k = 0; k <= kPoints; ++k) {
      const double p = std::exp(start + (end - start) * k / kPoints);
      f << Num(p);
      for (const auto& s : Strategies(in, p)) f << "," << Num(AnalyticGoodput(s));
      f << "\n";
    }
    f.close();
    if (!f) return Fail(IOError(csv + ": write failed"));
    if (!o.plot.empty()) {
      if (Status s = RunPlot(csv, o.plot); !s.ok()) return Fail(s);
      if (o.csv.empty()) std::filesystem::remove(csv);
    }
  }

  json inputs = {{"gpus", in.gpus},
                 {"gpus_per_node", in.gpus_per_node},
                 {"mtbf_seconds", in.mtbf_seconds},
                 {"node_loss_fraction", in.node_loss_fraction},
                 {"peer_copies", in.peer_copies},
                 {"snapshot_seconds", in.snapshot_seconds},
                 {"persist_seconds", in.persist_seconds},
                 {"restart_seconds", in.restart_seconds},
                 {"restore_memory_seconds", in.restore_memory_seconds},
                 {"restore_peer_seconds", in.restore_peer_seconds},
                 {"restore_storage_seconds", in.restore_storage_seconds},
                 {"sync_save_seconds", in.sync_save_seconds},
                 {"dcp_blocking_seconds", in.dcp_blocking_seconds},
                 {"history", h ? json(where) : json(nullptr)}};
  if (o.json) {
    json out = {{"inputs", inputs}, {"reported", "analytic"}, {"strategies", results}};
    if (!o.plot.empty()) out["plot"] = o.plot;
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << "Goodput (analytic" << (o.monte_carlo ? "; Monte-Carlo beside it" : "")
            << "), failures every " << FormatDuration(in.mtbf_seconds) << " ("
            << Pct(1 - in.node_loss_fraction) << " process crashes, " << Pct(in.node_loss_fraction)
            << " node losses)" << (h ? ", costs from " + where : std::string()) << ":\n";
  for (const json& j : results) {
    std::cout << "  " << j["strategy"].get<std::string>() << ": " << Pct(j["goodput"].get<double>())
              << " at an interval of " << FormatDuration(j["interval_seconds"].get<double>())
              << (o.interval.empty() ? " (its optimum)" : "") << ", blocking "
              << FormatDuration(j["blocking_seconds"].get<double>()) << " per save";
    if (j.contains("monte_carlo")) {
      const json& mc = j["monte_carlo"];
      std::cout << "; Monte-Carlo " << Pct(mc["goodput"].get<double>()) << " +- "
                << Pct(mc["standard_error"].get<double>()) << " (seed " << mc["seed"] << ", "
                << mc["failures"] << " failures)";
    }
    std::cout << "\n";
  }
  if (!o.plot.empty()) std::cout << "plot: " << o.plot << "\n";
  return kExitOk;
}

}  // namespace
}  // namespace safepoint::cli
