// `safepoint advise PATH` and `safepoint simulate` (docs/guide.md, "Choosing the checkpoint
// interval").
//
//   safepoint advise PATH [--job JOB] [--mtbf D] [--save-seconds S] [--restore-seconds S]
//                         [--restart-seconds S] [--persist-seconds S] [shape flags] [--json]
//   safepoint simulate [--from PATH] [--mtbf D | --node-mtbf D] [shape and cost flags]
//                      [--state-per-gpu SIZE --memory-bandwidth R --storage-bandwidth R ...]
//                      [--interval D] [--monte-carlo] [--seed N] [--csv FILE] [--plot FILE.png]
//                      [--json]
//   shape flags: [--gpus N] [--gpus-per-node N] [--peers | --no-peers] [--step-seconds S]
//                [--node-loss-fraction F]
//
// One model, one answer (src/advisor/plan.h): both commands build the model's inputs the same
// way (the job's history and the world size of its newest COMMIT record, InputsFromHistory; then
// sizes and speeds; then the flags) and take every interval from MakePlan. simulate prints each
// strategy's optimum (or its goodput at --interval), writes the same curve as CSV (the optima
// among its points, full precision) and plots it through the package's plotting module
// (`python -m safepoint.goodput_plot CSV PNG`; the Python next to this binary, or
// $SAFEPOINT_PYTHON), whose marks are the curve's highest points: the same intervals. advise
// prints the levels of the same plan (AdviseLevels): save every P, persist every m-th save, each
// tier as often as it copies; in steps too where the step time is known. With no failure rate
// (no interruption recorded, no --mtbf) advise shows the plans for typical MTBFs
// (kTypicalMtbfSeconds) and says so.
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
#include <sstream>
#include <string>
#include <vector>

#include "advisor/goodput.h"
#include "advisor/history.h"
#include "advisor/interval.h"
#include "advisor/plan.h"
#include "base/log.h"
#include "cli_format.h"
#include "safepoint/checkpoint.h"

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

// Full precision: the plot's marks are the CSV's highest points, which must be the plan's.
std::string Exact(double v) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

json Opt(const std::optional<uint64_t>& v) { return v ? json(*v) : json(nullptr); }

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
  // The job's shape (both commands).
  std::optional<uint32_t> gpus, gpus_per_node;
  std::optional<double> node_loss_fraction, step_seconds;
  bool peers = false, no_peers = false;
  // simulate
  std::string from;
  std::optional<double> snapshot, persist, restore_memory, restore_peer, restore_storage, sync_save,
      dcp_blocking;
  bool monte_carlo = false;
  uint64_t seed = 1;
  double horizon_hours = 0;
  std::string csv, plot;
  std::string state_per_gpu, memory_bw, storage_bw, storage_read_bw, network_bw;
};

namespace {

// The flags of the job's shape, on both commands.
void AddShapeFlags(CLI::App& s, AdvisorCommands::Options& o) {
  s.add_option("--gpus", o.gpus,
               "ranks (GPUs) of the job (default: recorded in its history, else the world size "
               "of its newest step, else 1)")
      ->type_name("N")
      ->check(CLI::PositiveNumber);
  s.add_option("--gpus-per-node", o.gpus_per_node,
               "ranks per node (default: recorded in the history, else all on one node; "
               "simulate without --from: 8)")
      ->type_name("N")
      ->check(CLI::PositiveNumber);
  auto* peers = s.add_flag("--peers", o.peers,
                           "copies of each node's snapshots on other nodes (redundancy): a lost "
                           "node restores from a peer (needs two nodes or more)");
  s.add_flag("--no-peers", o.no_peers,
             "no copies on other nodes: a lost node restores from storage")
      ->excludes(peers);
  s.add_option("--node-loss-fraction", o.node_loss_fraction,
               "share of failures that lose a node's memory (the rest are process crashes; "
               "default 0.2)")
      ->type_name("F")
      ->check(CLI::Range(0.0, 1.0));
  s.add_option("--step-seconds", o.step_seconds,
               "training time of one step without a save (default: measured in the history): "
               "intervals in steps too")
      ->type_name("S")
      ->check(CLI::NonNegativeNumber);
}

}  // namespace

AdvisorCommands::AdvisorCommands(CLI::App& app) : o_(std::make_unique<Options>()) {
  Options& o = *o_;
  advise_ = app.add_subcommand(
      "advise", "the goodput-optimal save and persist intervals of a job, from measured costs");
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
  advise_
      ->add_option("--save-seconds", o.save_seconds,
                   "override: what a save (a snapshot into memory) costs training")
      ->type_name("S")
      ->check(CLI::NonNegativeNumber);
  advise_
      ->add_option("--persist-seconds", o.persist,
                   "override: writing one step to the checkpoint path")
      ->type_name("S")
      ->check(CLI::NonNegativeNumber);
  advise_
      ->add_option("--restore-seconds", o.restore_seconds,
                   "override: a restore (from memory, a peer or storage alike)")
      ->type_name("S")
      ->check(CLI::NonNegativeNumber);
  advise_
      ->add_option("--restart-seconds", o.restart_seconds,
                   "override: failure detection and restart time")
      ->type_name("S")
      ->check(CLI::NonNegativeNumber);
  AddShapeFlags(*advise_, o);
  advise_->add_flag("--json", o.json, "the advice as JSON");

  simulate_ = app.add_subcommand(
      "simulate", "expected goodput of safepoint vs synchronous vs DCP async checkpoints");
  auto& s = *simulate_;
  s.add_option("--from", o.from, "read the measured costs, shape and MTBF from this job's history")
      ->type_name("PATH");
  s.add_option("--job", o.job, "the job (only to read a deprecated $SAFEPOINT_HISTORY_DIR)")
      ->type_name("JOB");
  AddShapeFlags(s, o);
  s.add_option("--mtbf", o.mtbf, "mean time between failures of the whole job")
      ->type_name("DURATION")
      ->check(DurationCheck());
  s.add_option("--node-mtbf", o.node_mtbf, "mean time between failures of one node")
      ->type_name("DURATION")
      ->check(DurationCheck());
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
  secs("--restore-memory-seconds", o.restore_memory,
       "restore from this node's memory (default: the snapshot time)");
  secs("--restore-peer-seconds", o.restore_peer,
       "restore from a peer's copy (default: the storage restore)");
  secs("--restore-storage-seconds", o.restore_storage,
       "restore from storage (default: the persist time)");
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

// The world size of the job's newest committed step, or 0 (only asked where a history was
// found: the directory exists, and opening it creates nothing).
uint32_t RecordWorldSize(const std::string& path) {
  auto store = OpenCheckpointStore(path);
  if (!store.ok()) return 0;
  auto committed = (*store)->ListCommitted();
  if (!committed.ok() || committed->empty()) return 0;
  return committed->back().world_size;
}

// The model's inputs, built the same way for both commands: the history (and the record's world
// size), then sizes and speeds (simulate), then the flags.
struct Model {
  SimulationInputs in;
  std::map<std::string, std::string> sources;
  std::optional<HistorySummary> history;
  std::string where;                    // the history, or where it was looked for
  std::map<std::string, double> tiers;  // "tier N" -> measured copy seconds
  bool restore_memory_estimated = false;
  bool restore_storage_estimated = false;
  bool mtbf_known = false;
};

Result<Model> BuildModel(const AdvisorCommands::Options& o, const std::string& path) {
  Model m;
  const bool what_if = path.empty();
  if (!what_if) {
    m.history = LoadHistory(path, o.job, &m.where);
    if (m.history) {
      const uint32_t record = m.history->shape ? 0 : RecordWorldSize(path);
      JobInputs j = InputsFromHistory(*m.history, record);
      m.in = j.in;
      m.sources = std::move(j.sources);
      m.restore_memory_estimated = j.restore_memory_estimated;
      m.restore_storage_estimated = j.restore_storage_estimated;
      for (const auto& [level, measured] : m.history->persist) {
        if (level.rfind("tier ", 0) == 0) m.tiers[level] = measured.seconds;
      }
    }
  }
  if (m.history && !m.history->save && !o.save_seconds && !o.snapshot) {
    return InvalidArgument(m.where +
                           ": no save recorded yet (run the job until it saves, or give "
                           "--save-seconds to advise, --snapshot-seconds to simulate)");
  }
  // The shape given on the command line.
  auto& src = m.sources;
  if (o.gpus) m.in.gpus = *o.gpus;
  if (o.gpus_per_node) m.in.gpus_per_node = *o.gpus_per_node;
  if (o.peers) {
    m.in.peer_copies = true;
  } else if (o.no_peers) {
    m.in.peer_copies = false;
  } else if (!m.history) {
    m.in.peer_copies = Nodes(m.in) >= 2;  // a what-if run of several nodes: with redundancy
  }
  if (o.gpus || o.gpus_per_node || o.peers || o.no_peers || !m.history) {
    src["shape"] = std::string(o.gpus || o.gpus_per_node ? "given" : "not given: one GPU") +
                   " (--gpus, --gpus-per-node); " +
                   (m.in.peer_copies ? "copies of each node's snapshots on other nodes"
                                     : "no copies on other nodes") +
                   (o.peers || o.no_peers ? " (--peers, --no-peers)" : "");
  }
  if (o.node_loss_fraction) m.in.node_loss_fraction = *o.node_loss_fraction;
  if (o.step_seconds) {
    m.in.step_seconds = *o.step_seconds;
    src["step"] = "given (--step-seconds)";
  }
  if (!o.state_per_gpu.empty()) {
    auto bytes = [](const std::string& v) { return v.empty() ? 0.0 : *ParseBytes(v); };
    ClusterSpeeds sp;
    sp.state_bytes_per_gpu = bytes(o.state_per_gpu);
    sp.memory_bytes_per_second = bytes(o.memory_bw);
    sp.storage_write_bytes_per_second = bytes(o.storage_bw);
    sp.storage_read_bytes_per_second = bytes(o.storage_read_bw);
    sp.network_bytes_per_second = bytes(o.network_bw);
    DeriveCosts(sp, &m.in);
  }
  auto set = [&](double& field, const std::optional<double>& flag, const char* key,
                 const char* name) {
    if (!flag) return;
    field = *flag;
    src[key] = std::string("given (") + name + ")";
  };
  set(m.in.snapshot_seconds, o.snapshot, "snapshot", "--snapshot-seconds");
  set(m.in.snapshot_seconds, o.save_seconds, "snapshot", "--save-seconds");
  set(m.in.persist_seconds, o.persist, "persist", "--persist-seconds");
  set(m.in.restart_seconds, o.restart_seconds, "restart", "--restart-seconds");
  set(m.in.restore_memory_seconds, o.restore_memory, "restore_memory", "--restore-memory-seconds");
  set(m.in.restore_peer_seconds, o.restore_peer, "restore_peer", "--restore-peer-seconds");
  set(m.in.restore_storage_seconds, o.restore_storage, "restore_storage",
      "--restore-storage-seconds");
  if (o.restore_seconds) {
    for (const char* key : {"restore_memory", "restore_peer", "restore_storage"}) {
      src[key] = "given (--restore-seconds)";
    }
    m.in.restore_memory_seconds = m.in.restore_peer_seconds = m.in.restore_storage_seconds =
        *o.restore_seconds;
    m.restore_memory_estimated = m.restore_storage_estimated = false;
  }
  if (o.restore_memory) m.restore_memory_estimated = false;
  if (o.restore_storage) m.restore_storage_estimated = false;
  set(m.in.sync_save_seconds, o.sync_save, "sync_save", "--sync-save-seconds");
  set(m.in.dcp_blocking_seconds, o.dcp_blocking, "dcp_blocking", "--dcp-blocking-seconds");
  if (!o.mtbf.empty()) {
    m.in.mtbf_seconds = *ParseDuration(o.mtbf);
    src["mtbf"] = "configured (--mtbf)";
    if (!(m.in.mtbf_seconds > 0)) return InvalidArgument("--mtbf must be positive");
  } else if (!o.node_mtbf.empty()) {
    m.in.mtbf_seconds = *ParseDuration(o.node_mtbf) / Nodes(m.in);
    src["mtbf"] = "a node's MTBF (--node-mtbf) over " + std::to_string(Nodes(m.in)) + " node" +
                  (Nodes(m.in) == 1 ? "" : "s");
    if (!(m.in.mtbf_seconds > 0)) return InvalidArgument("--node-mtbf must be positive");
  }
  m.mtbf_known = m.in.mtbf_seconds > 0;
  return m;
}

json ShapeJson(const Model& m, const SimulationInputs& in) {
  return {{"gpus", in.gpus},
          {"gpus_per_node", in.gpus_per_node},
          {"nodes", Nodes(in)},
          {"peer_copies", in.peer_copies},
          {"step_seconds", in.step_seconds > 0 ? json(in.step_seconds) : json(nullptr)},
          {"source", m.sources.contains("shape") ? m.sources.at("shape") : ""}};
}

json InputsJson(const SimulationInputs& in) {
  return {{"gpus", in.gpus},
          {"gpus_per_node", in.gpus_per_node},
          {"nodes", Nodes(in)},
          {"peer_copies", in.peer_copies},
          {"step_seconds", in.step_seconds > 0 ? json(in.step_seconds) : json(nullptr)},
          {"mtbf_seconds", in.mtbf_seconds},
          {"node_loss_fraction", in.node_loss_fraction},
          {"snapshot_seconds", in.snapshot_seconds},
          {"persist_seconds", in.persist_seconds},
          {"restart_seconds", in.restart_seconds},
          {"restore_memory_seconds", in.restore_memory_seconds},
          {"restore_peer_seconds", in.restore_peer_seconds},
          {"restore_storage_seconds", in.restore_storage_seconds},
          {"sync_save_seconds", in.sync_save_seconds},
          {"dcp_blocking_seconds", in.dcp_blocking_seconds}};
}

// What advise says about one level, as JSON: the interval (seconds, steps), why, and the costs
// the level's answer rests on with where they came from.
json LevelJson(const LevelAdvice& a, const Plan& plan, const Model& m) {
  const SimulationInputs& in = plan.inputs;
  auto note = [&](const char* key) {
    return m.sources.contains(key) ? json(m.sources.at(key)) : json(nullptr);
  };
  json j = {{"level", a.level},
            {"action", a.action},
            {"interval_seconds", a.interval_seconds},
            {"interval_steps", Opt(a.interval_steps)},
            {"every", a.every},
            {"expected_goodput", plan.safepoint().goodput}};
  json measured = json::object();
  if (a.level == "memory") {
    j["save_seconds"] = in.snapshot_seconds;
    j["persist_seconds"] = nullptr;
    j["restore_seconds"] = in.restore_memory_seconds;
    j["restore_estimated"] = m.restore_memory_estimated;
    measured = {{"save", note("snapshot")}, {"restore", note("restore_memory")}};
  } else if (a.level == "path") {
    j["save_seconds"] = in.snapshot_seconds;
    j["persist_seconds"] = in.persist_seconds;
    j["restore_seconds"] = in.restore_storage_seconds;
    j["restore_estimated"] = m.restore_storage_estimated;
    measured = {{"save", note("snapshot")},
                {"persist", note("persist")},
                {"restore", note("restore_storage")}};
  } else {
    j["save_seconds"] = 0;
    j["persist_seconds"] = a.cost_seconds;
    j["restore_seconds"] = nullptr;
    j["restore_estimated"] = false;
    measured = {{"persist", "the tier's copies in the history"}};
  }
  j["restart_seconds"] = in.restart_seconds;
  measured["restart"] = note("restart");
  j["measured"] = measured;
  j["explanation"] = a.explanation;
  return j;
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

std::string TypicalMtbfs() {
  std::string s;
  for (double m : kTypicalMtbfSeconds) s += (s.empty() ? "" : ", ") + FormatDuration(m);
  return s;
}

// The `safepoint simulate` command line that models what advise just did: the history (--from)
// when there is one, and advise's own flags in simulate's words (without a history simulate is a
// what-if of 8 GPUs a node, so the job's shape is spelled out).
std::string SimulateCommand(const AdvisorCommands::Options& o, const Model& m) {
  std::ostringstream c;
  auto num = [](double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  };
  c << "safepoint simulate";
  if (m.history) {
    c << " --from " << o.path;
    if (!o.job.empty()) c << " --job " << o.job;
    if (o.gpus) c << " --gpus " << *o.gpus;
    if (o.gpus_per_node) c << " --gpus-per-node " << *o.gpus_per_node;
    if (o.peers) c << " --peers";
    if (o.no_peers) c << " --no-peers";
  } else {
    c << " --gpus " << m.in.gpus << " --gpus-per-node " << m.in.gpus_per_node
      << (m.in.peer_copies ? " --peers" : " --no-peers");
  }
  if (o.node_loss_fraction) c << " --node-loss-fraction " << num(*o.node_loss_fraction);
  if (o.step_seconds) c << " --step-seconds " << num(*o.step_seconds);
  if (!o.mtbf.empty()) c << " --mtbf " << o.mtbf;
  if (o.save_seconds) c << " --snapshot-seconds " << num(*o.save_seconds);
  if (o.persist) c << " --persist-seconds " << num(*o.persist);
  if (o.restart_seconds) c << " --restart-seconds " << num(*o.restart_seconds);
  if (o.restore_seconds) {
    for (const char* f :
         {"--restore-memory-seconds", "--restore-peer-seconds", "--restore-storage-seconds"}) {
      c << " " << f << " " << num(*o.restore_seconds);
    }
  }
  return c.str();
}

int RunAdvise(const AdvisorCommands::Options& o) {
  auto built = BuildModel(o, o.path);
  if (!built.ok()) return Fail(built.status());
  Model& m = *built;
  if (!m.history && !o.save_seconds) {
    return Fail(NotFound(m.where + ": no measurement history (run the job with a Checkpointer "
                                   "first); or give --save-seconds (and --restore-seconds, ...)"));
  }
  const std::string no_mtbf =
      "not known yet: the job's history records no interruption and no --mtbf was given; "
      "intervals shown for typical MTBFs (" +
      TypicalMtbfs() + "): give --mtbf (e.g. --mtbf 3h) for yours";
  const std::string mtbf_source = m.mtbf_known ? m.sources.at("mtbf") : no_mtbf;

  // One plan at the job's MTBF, or one per typical MTBF.
  std::vector<double> mtbfs;
  if (m.mtbf_known) {
    mtbfs.push_back(m.in.mtbf_seconds);
  } else {
    mtbfs.assign(std::begin(kTypicalMtbfSeconds), std::end(kTypicalMtbfSeconds));
  }
  std::vector<Plan> plans;
  std::vector<std::vector<LevelAdvice>> advice;
  for (double mtbf : mtbfs) {
    SimulationInputs in = m.in;
    in.mtbf_seconds = mtbf;
    auto plan = MakePlan(in);
    if (!plan.ok()) return Fail(plan.status());
    advice.push_back(AdviseLevels(*plan, m.tiers));
    plans.push_back(std::move(plan).value());
  }
  const Plan& first = plans.front();
  json levels = json::array();
  for (size_t i = 0; i < advice.front().size(); ++i) {
    json j = LevelJson(advice.front()[i], first, m);
    j["mtbf_seconds"] = m.mtbf_known ? json(m.in.mtbf_seconds) : json(nullptr);
    j["mtbf_source"] = mtbf_source;
    if (!m.mtbf_known) {
      json by = json::array();
      for (size_t k = 0; k < plans.size(); ++k) {
        const LevelAdvice& a = advice[k][i];
        by.push_back({{"mtbf_seconds", mtbfs[k]},
                      {"interval_seconds", a.interval_seconds},
                      {"interval_steps", Opt(a.interval_steps)},
                      {"every", a.every},
                      {"expected_goodput", plans[k].safepoint().goodput}});
      }
      j["interval_seconds"] = nullptr;
      j["interval_steps"] = nullptr;
      j["expected_goodput"] = nullptr;
      j["explanation"] = nullptr;
      j["typical_mtbf"] = by;
    }
    levels.push_back(j);
  }
  json inputs = InputsJson(first.inputs);
  if (!m.mtbf_known) inputs["mtbf_seconds"] = nullptr;
  if (o.json) {
    json out = {{"path", o.path},
                {"history", m.history ? json(m.where) : json(nullptr)},
                {"shape", ShapeJson(m, first.inputs)},
                {"mtbf_seconds", m.mtbf_known ? json(m.in.mtbf_seconds) : json(nullptr)},
                {"mtbf_source", mtbf_source},
                {"inputs", inputs},
                {"sources", m.sources},
                {"levels", levels}};
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  const SimulationInputs& in = first.inputs;
  std::cout << "Checkpoint intervals for " << o.path
            << " (history: " << (m.history ? m.where : std::string("none")) << ")\n";
  std::cout << "The job: " << in.gpus << (in.gpus == 1 ? " rank" : " ranks") << " on " << Nodes(in)
            << (Nodes(in) == 1 ? " node" : " nodes") << " (" << m.sources["shape"] << ").\n";
  std::cout << "A step: "
            << (in.step_seconds > 0 ? FormatDuration(in.step_seconds) + " of training, " : "")
            << (m.sources.contains("step") ? m.sources["step"] : std::string("not known")) << ".\n";
  if (m.mtbf_known) {
    std::cout << "Failures: every " << FormatDuration(m.in.mtbf_seconds) << " on average, "
              << mtbf_source << ".\n\n";
  } else {
    std::cout << "Failures: the failure rate is " << no_mtbf << ".\n\n";
  }
  for (size_t i = 0; i < advice.front().size(); ++i) {
    const LevelAdvice& a = advice.front()[i];
    if (m.mtbf_known) {
      std::cout << a.explanation;
    } else {
      std::cout << a.level << ": " << (a.action == "save" ? "a save blocks training " : "")
                << (a.action == "persist" ? "a persist takes " : "")
                << (a.action == "copy" ? "a copy takes " : "") << FormatDuration(a.cost_seconds);
      for (size_t k = 0; k < plans.size(); ++k) {
        const LevelAdvice& t = advice[k][i];
        std::cout << "\n  if failures came every " << FormatDuration(mtbfs[k]) << ": " << t.action
                  << " every " << IntervalText(t.interval_seconds, t.interval_steps)
                  << " (expected goodput " << Pct(plans[k].safepoint().goodput) << ")";
      }
    }
    std::cout << "\n  measured:";
    for (const auto& [k, v] : levels[i]["measured"].items()) {
      if (v.is_string()) std::cout << " " << k << " " << v.get<std::string>() << ";";
    }
    std::cout << "\n\n";
  }
  std::cout << "The same model compares safepoint with synchronous and DCP async saves: "
            << SimulateCommand(o, m) << "\n";
  return kExitOk;
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

// The curve of the plan as CSV: interval_seconds, then one column of goodput per strategy.
Status WriteCurve(const Plan& plan, const std::string& path) {
  std::ofstream f(path);
  if (!f) return ErrnoStatus("create", path, errno);
  f << "interval_seconds";
  for (const auto& s : plan.strategies) f << "," << s.name;
  f << "\n";
  for (const CurvePoint& p : GoodputCurve(plan)) {
    f << Exact(p.interval_seconds);
    for (double g : p.goodput) f << "," << Exact(g);
    f << "\n";
  }
  f.close();
  if (!f) return IOError(path + ": write failed");
  return Status::OK();
}

int RunSimulate(const AdvisorCommands::Options& o) {
  auto built = BuildModel(o, o.from);
  if (!built.ok()) return Fail(built.status());
  Model& m = *built;
  if (!o.from.empty() && !m.history) return Fail(NotFound(m.where + ": no measurement history"));
  std::optional<double> interval;
  if (!o.interval.empty()) interval = *ParseDuration(o.interval);
  auto made = MakePlan(m.in, interval);
  if (!made.ok()) return Fail(made.status());
  const Plan& plan = *made;
  const SimulationInputs& in = plan.inputs;

  const double horizon = o.horizon_hours > 0 ? o.horizon_hours * 3600 : 20000 * in.mtbf_seconds;
  json results = json::array();
  for (size_t i = 0; i < plan.strategies.size(); ++i) {
    const StrategyResult& r = plan.strategies[i];
    json j = {{"strategy", r.name},
              {"interval_seconds", r.interval_seconds},
              {"interval_steps", Opt(r.interval_steps)},
              {"blocking_seconds", r.blocking_seconds},
              {"goodput", r.goodput},
              {"persist_every_saves", r.persist_every_saves},
              {"persist_every_steps", Opt(r.persist_every_steps)}};
    json modes = json::array();
    for (const auto& md : r.modes) {
      modes.push_back({{"mode", md.name},
                       {"mtbf_seconds", md.rate_per_second > 0 ? 1 / md.rate_per_second : 0},
                       {"recovery_seconds", md.recovery_seconds}});
    }
    j["failure_modes"] = modes;
    if (o.monte_carlo) {
      // By default about 20000 failures, but at most 10^7 periods (short periods, rare failures).
      const double h = o.horizon_hours > 0 ? horizon : std::min(horizon, 1e7 * r.interval_seconds);
      const auto mc = MonteCarloGoodput(Strategies(in, r.interval_seconds)[i], h, o.seed + i);
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
    if (Status s = WriteCurve(plan, csv); !s.ok()) return Fail(s);
    if (!o.plot.empty()) {
      if (Status s = RunPlot(csv, o.plot); !s.ok()) return Fail(s);
      if (o.csv.empty()) std::filesystem::remove(csv);
    }
  }

  json inputs = InputsJson(in);
  inputs["history"] = m.history ? json(m.where) : json(nullptr);
  if (o.json) {
    json out = {{"inputs", inputs},
                {"sources", m.sources},
                {"reported", "analytic"},
                {"strategies", results}};
    if (!o.plot.empty()) out["plot"] = o.plot;
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << "Goodput (analytic" << (o.monte_carlo ? "; Monte-Carlo beside it" : "")
            << "), failures every " << FormatDuration(in.mtbf_seconds) << " ("
            << Pct(1 - in.node_loss_fraction) << " process crashes, " << Pct(in.node_loss_fraction)
            << " node losses), " << in.gpus << (in.gpus == 1 ? " GPU" : " GPUs") << " on "
            << Nodes(in) << (Nodes(in) == 1 ? " node" : " nodes")
            << (in.peer_copies ? " with copies on peers" : ", no copies on peers")
            << (m.history ? ", costs from " + m.where : std::string()) << ":\n";
  for (size_t i = 0; i < plan.strategies.size(); ++i) {
    const StrategyResult& r = plan.strategies[i];
    const json& j = results[i];
    std::cout << "  " << r.name << ": " << Pct(r.goodput) << " at an interval of "
              << IntervalText(r.interval_seconds, r.interval_steps)
              << (plan.optimal ? " (its optimum)" : "") << ", blocking "
              << FormatDuration(r.blocking_seconds) << " per save";
    if (r.name == "safepoint") {
      const double every = r.interval_seconds * static_cast<double>(r.persist_every_saves);
      std::cout << "; persisting every "
                << (r.persist_every_saves == 1 ? std::string("save")
                                               : std::to_string(r.persist_every_saves) + " saves")
                << (r.persist_every_saves == 1
                        ? std::string()
                        : " (" + IntervalText(every, r.persist_every_steps) + ")");
    }
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
