// The `safepoint` command-line tool: list, inspect and verify checkpoints; look after this node's
// snapshots in shared memory.
//
//   safepoint ls PATH [--json]
//   safepoint inspect PATH [--step N] [--rank R] [--json]                (apps/cli_inspect.cc)
//   safepoint verify PATH [--step N | --all] [--json] [--progress]
//   safepoint cp SRC DST [--step N | --all] [--json] [--progress]
//   safepoint rm PATH --step N [--force] [--json]
//   safepoint agent --job JOB [--shm-dir DIR] [--no-emergency-flush] [--metrics HOST:PORT]
//                   [--event-log PATH]
//   safepoint status [--shm-dir DIR] [--json] [--watch [--interval S]]   (apps/cli_status.cc)
//   safepoint advise PATH ..., safepoint simulate ... (apps/cli_advisor.cc)
//   safepoint gc [--shm-dir DIR] [--dry-run] [--json]
//   safepoint --version
//   safepoint log | tag | diff | export | import ...   (apps/cli_versions.h)
//
// PATH, SRC and DST are checkpoint directories: plain paths or storage URIs (file://, and the
// other schemes OpenStorage knows). Arguments are parsed by CLI11 (`safepoint --help`, `safepoint
// COMMAND --help`). Readable tables on stdout by default, --json for scripts; errors on stderr.
// --shm-dir defaults to $SAFEPOINT_SHM_DIR, else /dev/shm (as a Checkpointer's shm_dir does).
// Exit status: 0 on success, 1 on an error or when verification finds damage, 2 on a usage error.
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "agent/agent.h"
#include "base/bytes.h"
#include "base/log.h"
#include "base/unique_fd.h"
#include "checkpoint/chunk_gc.h"
#include "checkpoint/versions.h"
#include "cli_advisor.h"
#include "cli_examples.h"
#include "cli_format.h"
#include "cli_inspect.h"
#include "cli_status.h"
#include "cli_store.h"
#include "cli_versions.h"
#include "cli_watch.h"
#include "progress_bar.h"
#include "protocol/protocol.h"
#include "safepoint/build_config.h"
#include "safepoint/checkpoint.h"
#include "safepoint/extras.h"
#include "safepoint/image.h"
#include "shm/arena.h"
#include "shm/stage_file.h"

namespace safepoint {
namespace {

using json = nlohmann::ordered_json;
using internal::HumanBytes;
using namespace safepoint::protocol;  // the protocol: status requests, the agent's lock

using cli::CheckDirectory;
using cli::Fail;
using cli::kExitError;
using cli::kExitOk;
using cli::kExitUsage;
using cli::OpenExistingStore;
using cli::PickStep;
using cli::ReportProblems;
using cli::TrainingProcesses;

struct Args {
  std::string path;
  std::string destination;           // cp
  std::string compression = "none";  // cp: how DST stores the steps
  bool incremental = false;          // cp
  bool force = false;                // rm
  std::string job;
  std::string shm_dir = "/dev/shm";
  bool dry_run = false;
  bool no_emergency_flush = false;
  std::optional<uint64_t> step;
  uint32_t rank = 0;
  bool all = false;
  bool json = false;
  bool progress = false;  // verify, cp: progress bars on stderr even when it is not a terminal
  std::string log_level;  // empty: $SAFEPOINT_LOG_LEVEL or info
  std::string metrics;    // agent: serve Prometheus metrics on HOST:PORT
  std::string event_log;  // agent: the event log's path
};

using cli::Dims;
using cli::FormatTime;
using cli::PrintTable;

int CmdVersion() {
  std::cout << "safepoint " << SAFEPOINT_VERSION << "\n"
            << "image format: " << kImageFormatVersion << "\n"
            << "build: " << SAFEPOINT_BUILD_TYPE << "\n"
            << "crc32c: isa-l\n"
            << "zstd: " << (SAFEPOINT_HAVE_ZSTD ? "yes" : "no") << "\n"
            << "io_uring: " << (SAFEPOINT_HAVE_URING ? "available (not used yet)" : "no") << "\n";
  return kExitOk;
}

int CmdLs(const Args& a) {
  auto store = OpenExistingStore(a.path);
  if (!store.ok()) return Fail(store.status());
  std::vector<std::string> problems;
  auto committed = (*store)->ListCommitted(&problems);
  if (!committed.ok()) return Fail(committed.status());
  ReportProblems(problems);
  if (a.json) {
    json out = json::array();
    for (const auto& c : *committed) {
      out.push_back({{"step", c.step},
                     {"world_size", c.world_size},
                     {"bytes", c.total_bytes()},
                     {"time", FormatTime(c.commit_time_ns)},
                     {"job", c.job}});
    }
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows = {{"STEP", "WORLD", "BYTES", "COMMITTED", "JOB"}};
  for (const auto& c : *committed) {
    rows.push_back({std::to_string(c.step), std::to_string(c.world_size),
                    HumanBytes(c.total_bytes()), FormatTime(c.commit_time_ns), c.job});
  }
  if (committed->empty()) {
    std::cout << "no committed steps in " << (*store)->storage().uri() << "\n";
  } else {
    PrintTable(rows);
  }
  return kExitOk;
}

int CmdVerify(const Args& a) {
  auto store = OpenExistingStore(a.path);
  if (!store.ok()) return Fail(store.status());
  std::vector<CommitRecord> targets;
  std::vector<std::string> problems;
  if (a.all) {
    auto committed = (*store)->ListCommitted(&problems);
    if (!committed.ok()) return Fail(committed.status());
    targets = std::move(committed).value();
  } else {
    auto c = PickStep(**store, a.step);
    if (!c.ok()) return Fail(c.status());
    targets.push_back(std::move(c).value());
  }
  json results = json::array();
  bool damaged = !problems.empty();
  // A progress bar over the images' bytes on stderr (a terminal, or --progress; never --json).
  const bool show_progress = (a.progress || ::isatty(STDERR_FILENO) == 1) && !a.json;
  CopyProgress done;
  for (const auto& c : targets) done.bytes_total += c.total_bytes();
  ProgressBar bar("verify");
  for (const auto& p : problems) {
    results.push_back({{"ok", false}, {"error", p}});
    if (!a.json) std::cout << "DAMAGED  " << p << "\n";
  }
  for (const auto& c : targets) {
    bool step_ok = true;
    for (uint32_t r = 0; r < c.world_size; ++r) {
      Status s;
      uint64_t bytes = 0;
      auto image = (*store)->ReadImage(c, r);
      if (image.ok()) {
        bytes = image->size;
        auto reader =
            ImageReader::Parse(image->bytes(), image->source, ImageReader::Verify::kStructure);
        s = reader.status();
        if (s.ok())
          s = DecodeExtras(reader->extras(), reader->tensors().size(), image->source).status();
      } else {
        s = image.status();
      }
      const std::string file = (*store)->storage().Describe(ImageObjectName(c, r));
      if (!s.ok()) {
        damaged = true;
        step_ok = false;
      }
      done.bytes_done = std::min(done.bytes_total, done.bytes_done + bytes);
      if (show_progress) bar.Update(done);
      if (show_progress) bar.Finish();
      if (a.json) {
        json j = {{"step", c.step}, {"rank", r}, {"file", file}, {"ok", s.ok()}, {"bytes", bytes}};
        if (!s.ok()) j["error"] = s.ToString();
        results.push_back(j);
      } else if (s.ok()) {
        std::cout << "OK       step " << c.step << " rank " << r << "  " << file << " ("
                  << HumanBytes(bytes) << ")\n";
      } else {
        std::cout << "DAMAGED  step " << c.step << " rank " << r << "  " << s.ToString() << "\n";
      }
    }
    // Every tensor an image leaves to another rank's image is held by one (issue 35).
    if (Status s = step_ok ? (*store)->CheckReplicasHeld(c) : Status::OK(); !s.ok()) {
      damaged = true;
      if (a.json) {
        results.push_back({{"step", c.step}, {"ok", false}, {"error", s.ToString()}});
      } else {
        std::cout << "DAMAGED  step " << c.step << "  " << s.ToString() << "\n";
      }
    }
  }
  if (a.json) std::cout << json{{"ok", !damaged}, {"results", results}}.dump(2) << "\n";
  if (damaged) {
    spdlog::error("verification failed: damaged checkpoint data in {}", a.path);
    return kExitError;
  }
  return kExitOk;
}

// Set by SIGINT/SIGTERM while `cp` runs: the copy in progress stops (Cancelled) and nothing of
// it becomes visible on the destination.
std::atomic<bool> g_cancel{false};
void CancelCopy(int) { g_cancel.store(true); }

std::string Rate(uint64_t bytes, double seconds) {
  return seconds > 0
             ? HumanBytes(static_cast<uint64_t>(static_cast<double>(bytes) / seconds)) + "/s"
             : "-";
}

// Copies committed steps from a.path to a.destination with CopyStep: --step N, --all (every
// committed step of the source that the destination has not committed), or the newest.
int CmdCp(const Args& a) {
  auto src = OpenExistingStore(a.path);
  if (!src.ok()) return Fail(src.status());
  auto dst = OpenCheckpointStore(a.destination);
  if (!dst.ok()) return Fail(dst.status());
  std::vector<uint64_t> steps;
  if (a.all) {
    std::vector<std::string> problems;
    auto committed = (*src)->ListCommitted(&problems);
    if (!committed.ok()) return Fail(committed.status());
    ReportProblems(problems);
    auto there = (*dst)->ListCommitted();
    if (!there.ok()) return Fail(there.status());
    for (const auto& c : *committed) {
      const bool present = std::any_of(there->begin(), there->end(),
                                       [&](const CommitRecord& d) { return d.step == c.step; });
      if (!present) steps.push_back(c.step);
    }
  } else {
    auto c = PickStep(**src, a.step);
    if (!c.ok()) return Fail(c.status());
    steps.push_back(c->step);
  }
  const bool tty = (a.progress || ::isatty(STDERR_FILENO) == 1) && !a.json;
  std::signal(SIGINT, CancelCopy);
  std::signal(SIGTERM, CancelCopy);
  json results = json::array();
  bool failed = false;
  for (size_t i = 0; i < steps.size(); ++i) {
    const uint64_t step = steps[i];
    std::string label = "step " + std::to_string(step);
    if (steps.size() > 1)
      label += " (" + std::to_string(i + 1) + "/" + std::to_string(steps.size()) + ")";
    ProgressBar bar(label);
    CopyOptions options;
    options.cancel = &g_cancel;
    options.layout = MakePackOptions(a.compression, a.incremental);
    if (tty) options.progress = [&bar](const CopyProgress& p) { bar.Update(p); };
    auto copied = CopyStep(**src, **dst, step, options);
    bar.Finish();
    json j = {{"step", step}, {"ok", copied.ok()}};
    if (copied.ok()) {
      j["bytes"] = copied->bytes;
      j["seconds"] = copied->seconds;
      j["already_there"] = copied->already_there;
      if (!a.json) {
        if (copied->already_there) {
          std::cout << "step " << step << " is already in " << (*dst)->storage().uri() << "\n";
        } else {
          char secs[32];
          std::snprintf(secs, sizeof(secs), "%.2f", copied->seconds);
          std::cout << "copied step " << step << " to " << (*dst)->storage().uri() << ": "
                    << HumanBytes(copied->bytes) << " in " << secs << " s ("
                    << Rate(copied->bytes, copied->seconds) << ")\n";
        }
        std::cout.flush();
      }
    } else {
      failed = true;
      j["error"] = copied.status().ToString();
      spdlog::error("{}", copied.status().ToString());
      if (copied.status().code() == StatusCode::kCancelled) {
        results.push_back(std::move(j));
        break;
      }
    }
    results.push_back(std::move(j));
  }
  // The source's tags that name steps the destination now holds travel with them.
  json tags_copied = json::array();
  if (auto tags = MirrorTags(**src, **dst); tags.ok()) {
    for (const std::string& name : *tags) {
      tags_copied.push_back(name);
      if (!a.json) std::cout << "copied tag '" << name << "'\n";
    }
  } else {
    failed = true;
    spdlog::error("copying the tags: {}", tags.status().ToString());
  }
  if (a.json) {
    std::cout << json{{"source", (*src)->storage().uri()},
                      {"destination", (*dst)->storage().uri()},
                      {"ok", !failed},
                      {"steps", results},
                      {"tags", tags_copied}}
                     .dump(2)
              << "\n";
  } else if (steps.empty()) {
    std::cout << "nothing to copy: " << (*dst)->storage().uri() << " has every committed step of "
              << (*src)->storage().uri() << "\n";
  }
  return failed ? kExitError : kExitOk;
}

// Deletes one step with CheckpointStore::DeleteStep (its COMMIT first, so it stops existing at
// once; then its images). The newest committed step only with --force: it is what a restart
// loads. A step whose COMMIT record is damaged (not a step for readers) may be deleted too.
int CmdRm(const Args& a) {
  auto store = OpenExistingStore(a.path);
  if (!store.ok()) return Fail(store.status());
  const std::string uri = (*store)->storage().uri();
  const uint64_t step = *a.step;
  auto committed = (*store)->ListCommitted();
  if (!committed.ok()) return Fail(committed.status());
  auto record = (*store)->ReadCommit(step);
  bool damaged = false;
  if (!record.ok()) {
    if (record.status().code() == StatusCode::kCorruption) {
      damaged = true;
      spdlog::warn("{} (deleting it)", record.status().ToString());
    } else if (record.status().code() == StatusCode::kNotFound) {
      std::string m = uri + ": step " + std::to_string(step) + " is not committed";
      if (committed->empty()) {
        m += " (no committed steps)";
      } else {
        m += " (committed steps:";
        for (const auto& c : *committed) m += " " + std::to_string(c.step);
        m += ")";
      }
      return Fail(NotFound(m));
    } else {
      return Fail(record.status());
    }
  }
  if (!damaged && !committed->empty() && committed->back().step == step && !a.force) {
    return Fail(InvalidArgument(uri + ": step " + std::to_string(step) +
                                " is the newest committed step (what a restart loads); pass "
                                "--force to delete it"));
  }
  // A tagged step is kept past retention: only --force deletes it, and its tags with it.
  auto tags = ListTags(**store);
  if (!tags.ok()) return Fail(tags.status());
  std::erase_if(*tags, [step](const Tag& t) { return t.step != step; });
  if (!tags->empty() && !a.force) {
    return Fail(InvalidArgument(uri + ": step " + std::to_string(step) + " is tagged '" +
                                tags->front().name +
                                "' (kept past retention); delete the tag (safepoint tag --delete) "
                                "or pass --force"));
  }
  if (Status s = (*store)->DeleteStep(step); !s.ok()) return Fail(s);
  for (const Tag& t : *tags) {
    if (Status s = DeleteTag(**store, t.name); !s.ok()) return Fail(s);
  }
  if (a.json) {
    std::cout << json{{"uri", uri}, {"step", step}, {"deleted", true}, {"damaged", damaged}}.dump(2)
              << "\n";
  } else {
    std::cout << "deleted step " << step << " from " << uri << "\n";
  }
  return kExitOk;
}

// Removes the chunk objects of packed steps that no manifest references any more
// (CollectChunkGarbage; docs/operations.md, "Chunk garbage collection").
int CmdChunkGc(const Args& a) {
  auto store = OpenExistingStore(a.path);
  if (!store.ok()) return Fail(store.status());
  auto gc = CollectChunkGarbage((*store)->storage());
  if (!gc.ok()) return Fail(gc.status());
  const std::string uri = (*store)->storage().uri();
  if (a.json) {
    std::cout << json{{"uri", uri},
                      {"deferred", gc->deferred},
                      {"reason", gc->reason},
                      {"manifests", gc->manifests},
                      {"chunks", gc->chunks},
                      {"referenced", gc->referenced},
                      {"removed", gc->removed},
                      {"removed_bytes", gc->removed_bytes},
                      {"stale_intents", gc->stale_intents}}
                     .dump(2)
              << "\n";
  } else if (gc->deferred) {
    std::cout << uri << ": nothing removed: " << gc->reason << " (run it again later)\n";
  } else {
    std::cout << uri << ": " << gc->chunks << " chunks, " << gc->referenced << " referenced by "
              << gc->manifests << " manifests; removed " << gc->removed << " (" << gc->removed_bytes
              << " bytes)\n";
  }
  return kExitOk;
}

int CmdAgent(const Args& a) {
  AgentOptions o;
  o.job = a.job;
  o.shm_dir = a.shm_dir;
  o.emergency_flush = !a.no_emergency_flush;
  o.exit_when_idle = false;  // a sidecar runs until it is told to stop
  o.log_level = a.log_level;
  o.metrics_address = a.metrics;
  o.event_log = a.event_log;
  return RunAgent(o);
}

// Removes the job directories that nothing uses any more: no agent holds the job's lock and no
// process that wrote its snapshot slots still runs (a training process whose agent died keeps its
// slots mapped and starts a new agent at its next call).
int CmdGc(const Args& a) {
  if (Status s = CheckDirectory(a.shm_dir, "shared-memory directory"); !s.ok()) return Fail(s);
  auto jobs = ListJobDirectories(a.shm_dir);
  if (!jobs.ok()) return Fail(jobs.status());
  json report = json::array();
  int failures = 0;
  for (const auto& [job, dir] : *jobs) {
    json j = {{"job", job}, {"job_dir", dir}};
    std::string line;
    // Slot files whose creator died before naming them: nobody can take them, live job or not.
    if (auto orphans = RemoveDeadSlotTemporaries(dir, a.dry_run); !orphans.ok()) {
      spdlog::error("{}", orphans.status().ToString());
      ++failures;
    } else if (orphans->files > 0) {
      j[a.dry_run ? "would_remove_slot_temporaries" : "removed_slot_temporaries"] = orphans->files;
      j["slot_temporary_bytes"] = orphans->bytes;
      if (!a.json) {
        std::cout << (a.dry_run ? "would remove " : "removed ") << orphans->files
                  << " slot file(s) of dead creators in " << dir << " ("
                  << HumanBytes(orphans->bytes) << ")\n";
      }
    }
    uint32_t agent_pid = 0;
    if (AgentAlive(dir, &agent_pid)) {
      j["action"] = "keep";
      j["reason"] = "agent alive";
      j["agent_pid"] = agent_pid;
      line = "keep    " + dir + " (agent " + std::to_string(agent_pid) + " alive)";
    } else if (auto writers = LiveSlotWriters(dir); writers.ok() && !writers->empty()) {
      j["action"] = "keep";
      j["reason"] = "training process alive";
      j["writers"] = *writers;
      line = "keep    " + dir + " (" + TrainingProcesses(*writers) +
             " alive; its next save starts a new agent)";
    } else if (writers.ok() && a.dry_run) {
      j["action"] = "would_remove";
      line = "would remove " + dir;
    } else {
      auto freed = writers.ok() ? RemoveJobDirectory(dir) : Result<uint64_t>(writers.status());
      if (freed.ok()) {
        j["action"] = "removed";
        j["bytes"] = *freed;
        line = "removed " + dir + " (" + HumanBytes(*freed) + ")";
      } else {
        j["action"] = "error";
        j["error"] = freed.status().ToString();
        spdlog::error("{}", freed.status().ToString());
        ++failures;
      }
    }
    if (!line.empty() && !a.json) std::cout << line << "\n";
    report.push_back(std::move(j));
  }
  // Entries named as this user's job directories that another user (or a mistake) put there:
  // each blocks its job's agent. Reported with the way out, never removed (issue 35).
  json blocked = json::array();
  if (auto entries = ListBlockedJobEntries(a.shm_dir); !entries.ok()) {
    spdlog::error("{}", entries.status().ToString());
    ++failures;
  } else {
    for (const BlockedJobEntry& b : *entries) {
      blocked.push_back({{"job", b.job},
                         {"path", b.path},
                         {"kind", b.kind},
                         {"owner_uid", b.owner_uid},
                         {"foreign", b.owner_uid != ::geteuid()},
                         {"problem", b.problem}});
      if (!a.json) std::cout << "blocked " << b.problem << "\n";
    }
  }
  // Staging files (safepoint.dcp.ShmStager) of processes that were killed before removing them.
  json staging = nullptr;
  auto staged = internal::RemoveDeadStageFiles(a.shm_dir, a.dry_run);
  if (!staged.ok()) {
    spdlog::error("{}", staged.status().ToString());
    ++failures;
  } else {
    staging = {{"directory", internal::StageDirectory(a.shm_dir)},
               {a.dry_run ? "would_remove_files" : "removed_files", staged->files},
               {"bytes", staged->bytes}};
    if (staged->files > 0 && !a.json) {
      std::cout << (a.dry_run ? "would remove " : "removed ") << staged->files << " staging file"
                << (staged->files == 1 ? "" : "s") << " of dead processes in "
                << internal::StageDirectory(a.shm_dir) << " (" << HumanBytes(staged->bytes)
                << ")\n";
    }
  }
  if (a.json) {
    std::cout << json{{"jobs", report}, {"blocked", blocked}, {"staging", staging}}.dump(2) << "\n";
  }
  return failures ? kExitError : kExitOk;
}

constexpr char kPathHelp[] = "checkpoint directory: a path or a storage URI (file://...)";
constexpr char kShmDirHelp[] = "the shared-memory directory of the snapshots";

// A non-negative integer of at most `max`, checked before CLI11 converts it (its conversion takes
// "-1" for 2^64-1 and saturates on overflow).
CLI::Validator UnsignedAtMost(uint64_t max) {
  return CLI::Validator(
      [max](std::string& v) -> std::string {
        uint64_t n = 0;
        const char* end = v.data() + v.size();
        const auto [ptr, ec] = std::from_chars(v.data(), end, n);
        if (v.empty() || ec == std::errc::invalid_argument || ptr != end) {
          return "'" + v + "' is not a non-negative integer";
        }
        if (ec == std::errc::result_out_of_range || n > max) {
          return v + " is larger than " + std::to_string(max);
        }
        return std::string();
      },
      "");
}

// A usage error: the message, where to find help, exit status 2.
int Usage(const CLI::App& app, const std::string& message) {
  const std::string name =
      app.get_parent() != nullptr ? "safepoint " + app.get_name() : "safepoint";
  std::cerr << "safepoint: " << message << "\n"
            << "Run '" << name << " --help' for usage.\n";
  return kExitUsage;
}

int Main(int argc, char** argv) {
  internal::InitLogging("safepoint");
  Args a;
  CLI::App app(
      "safepoint: list, inspect, verify, copy and delete checkpoints; look after this node's "
      "snapshots in shared memory.",
      "safepoint");
  app.get_formatter()->column_width(26);
  app.get_formatter()->label("Usage", "usage");
  app.get_formatter()->label("SUBCOMMAND", "COMMAND");
  const std::string exit_status =
      "Exit status: 0 on success; 1 on an error (the message names the path and the cause) or\n"
      "when verify finds damage; 2 on a usage error.";
  app.footer(exit_status);  // commands inherit it
  app.require_subcommand(0, 1);
  bool version = false;
  app.add_flag("--version", version, "the version and the optional features of this build");
  app.add_option("--log-level", a.log_level,
                 "diagnostics from this level on: trace, debug, info, warn, error, critical, off "
                 "(default: $SAFEPOINT_LOG_LEVEL, else info)")
      ->type_name("LEVEL")
      ->check(CLI::IsMember(internal::kLogLevels));
  // Also as commands, as the hand-written parser had them (not listed).
  CLI::App* version_cmd = app.add_subcommand("version", "the version of this build")->group("");
  app.add_subcommand("help", "this help")->group("")->silent();

  const CLI::Validator not_empty(
      [](std::string& v) { return v.empty() ? std::string("must not be empty") : std::string(); },
      "");

  auto add_path = [&](CLI::App* cmd) {
    cmd->add_option("PATH", a.path, kPathHelp)->type_name("")->required()->check(not_empty);
  };
  auto add_json = [&](CLI::App* cmd, const char* what) { cmd->add_flag("--json", a.json, what); };
  // $SAFEPOINT_SHM_DIR, as a Checkpointer takes it, when --shm-dir is not given.
  auto add_shm_dir = [&](CLI::App* cmd) {
    cmd->add_option("--shm-dir", a.shm_dir, kShmDirHelp)
        ->type_name("DIR")
        ->capture_default_str()
        ->envname("SAFEPOINT_SHM_DIR")
        ->check(not_empty);
  };
  uint64_t step = 0;
  auto add_step = [&](CLI::App* cmd) {
    return cmd->add_option("--step", step, "the step (default: the newest committed one)")
        ->type_name("N")
        ->check(UnsignedAtMost(std::numeric_limits<uint64_t>::max()));
  };

  CLI::App* ls = app.add_subcommand("ls", "committed steps: world size, bytes, time");
  add_path(ls);
  add_json(ls, "a JSON array of the steps instead of a table");

  CLI::App* inspect =
      app.add_subcommand("inspect", "one rank's image: tensors (dtype, shape, bytes), state");
  add_path(inspect);
  CLI::Option* inspect_step = add_step(inspect);
  inspect->add_option("--rank", a.rank, "the rank whose image to show")
      ->type_name("R")
      ->capture_default_str()
      ->check(UnsignedAtMost(kMaxRank - 1));
  add_json(inspect, "JSON instead of a table");

  CLI::App* verify =
      app.add_subcommand("verify", "read every byte, check every checksum; 1 on damage");
  add_path(verify);
  CLI::Option* verify_step = add_step(verify);
  verify->add_flag("--all", a.all, "every committed step")->excludes(verify_step);
  add_json(verify, "a JSON report: ok, and a result per image");
  verify->add_flag("--progress", a.progress, "a progress bar on stderr even when not a terminal");

  CLI::App* cp = app.add_subcommand(
      "cp", "copy committed steps to another checkpoint directory (verified, committed there)");
  cp->add_option("SRC", a.path, "the checkpoint to copy from: a path or a storage URI")
      ->type_name("")
      ->required()
      ->check(not_empty);
  cp->add_option("DST", a.destination,
                 "the checkpoint to copy to: a path or a storage URI (created if missing)")
      ->type_name("")
      ->required()
      ->check(not_empty);
  CLI::Option* cp_step = add_step(cp);
  cp->add_flag("--all", a.all, "every committed step that DST has not committed")
      ->excludes(cp_step);
  cp->add_option("--compression", a.compression,
                 "how DST stores the steps: none (default), auto, zstd, planes")
      ->type_name("MODE")
      ->check(CLI::IsMember({"none", "auto", "zstd", "planes"}));
  cp->add_flag("--incremental", a.incremental,
               "store steps in DST as content-addressed chunks that its steps share");
  add_json(cp, "a JSON report: ok, and a result per step");
  cp->add_flag("--progress", a.progress, "a progress bar on stderr even when not a terminal");

  CLI::App* rm = app.add_subcommand("rm", "delete one step (its COMMIT record first)");
  add_path(rm);
  CLI::Option* rm_step = rm->add_option("--step", step, "the step to delete")
                             ->type_name("N")
                             ->required()
                             ->check(UnsignedAtMost(std::numeric_limits<uint64_t>::max()));
  rm->add_flag("--force", a.force, "also the newest committed step, or a tagged one");
  add_json(rm, "JSON instead of a line");

  CLI::App* agent =
      app.add_subcommand("agent", "run a job's node agent in the foreground (sidecar)");
  agent->add_option("--job", a.job, "the job's name ([A-Za-z0-9._-], 1..64)")
      ->type_name("JOB")
      ->required();
  add_shm_dir(agent);
  agent->add_flag("--no-emergency-flush", a.no_emergency_flush,
                  "do not persist the snapshot of a process that dies");
  agent
      ->add_option("--metrics", a.metrics,
                   "serve Prometheus metrics on HOST:PORT (port 0: a free one; default: "
                   "$SAFEPOINT_METRICS_ADDR)")
      ->type_name("HOST:PORT")
      ->envname("SAFEPOINT_METRICS_ADDR");
  agent
      ->add_option("--event-log", a.event_log,
                   "the JSON-lines event log (default: $SAFEPOINT_EVENT_LOG, else events.jsonl "
                   "in the job directory)")
      ->type_name("PATH")
      ->envname("SAFEPOINT_EVENT_LOG");

  CLI::App* status = app.add_subcommand("status", "this node's jobs: agents, snapshots, work");
  add_shm_dir(status);
  add_json(status, "a JSON array of the jobs instead of a report");
  bool watch = false;
  double watch_interval = 2;
  status->add_flag("--watch", watch, "redraw the report every --interval seconds until Ctrl-C");
  status->add_option("--interval", watch_interval, "seconds between refreshes of --watch")
      ->type_name("S")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);

  CLI::App* gc = app.add_subcommand("gc", "remove snapshots of jobs whose processes are gone");
  add_shm_dir(gc);
  gc->add_flag("--dry-run", a.dry_run, "only say what would be removed");
  add_json(gc, "each job's action and why, as JSON");

  CLI::App* chunk_gc = app.add_subcommand(
      "chunk-gc", "remove chunks of packed steps that no step references any more");
  add_path(chunk_gc);
  add_json(chunk_gc, "a JSON report instead of a line");

  for (CLI::App* cmd : {ls, inspect, verify, cp, rm, agent, status, gc, chunk_gc}) {
    cmd->group("Commands");
  }
  auto run_version_command = AddVersionCommands(app);  // log, tag, diff, export, import
  const cli::AdvisorCommands advisor_commands(app);    // advise, simulate
  cli::AddExamples(app, exit_status);
  app.footer("Run 'safepoint COMMAND --help' for the options of a command.\n" + exit_status);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    const auto chosen = app.get_subcommands();
    if (chosen.empty() && argc > 1 && argv[1][0] != '-') {
      return Usage(app, std::string("unknown command '") + argv[1] + "'");
    }
    return Usage(chosen.empty() ? app : *chosen.front(), e.what());
  }
  if (inspect_step->count() > 0 || verify_step->count() > 0 || cp_step->count() > 0 ||
      rm_step->count() > 0) {
    a.step = step;
  }
  if (!a.log_level.empty()) internal::SetLogLevel(a.log_level);

  if (version || version_cmd->parsed()) return CmdVersion();
  if (app.got_subcommand("help")) {
    std::cout << app.help();
    return kExitOk;
  }
  if (ls->parsed()) return CmdLs(a);
  if (inspect->parsed()) return cli::CmdInspect(a.path, a.step, a.rank, a.json);
  if (verify->parsed()) return CmdVerify(a);
  if (cp->parsed()) return CmdCp(a);
  if (rm->parsed()) return CmdRm(a);
  if (agent->parsed()) return CmdAgent(a);
  if (status->parsed()) {
    auto render = [&] { return cli::CmdStatus(a.shm_dir, a.json); };
    return watch ? cli::Watch(render, watch_interval) : render();
  }
  if (gc->parsed()) return CmdGc(a);
  if (std::optional<int> rc = run_version_command()) return *rc;
  if (auto rc = advisor_commands.Run()) return *rc;
  if (chunk_gc->parsed()) return CmdChunkGc(a);
  std::cerr << app.help();  // no command
  return kExitUsage;
}

}  // namespace
}  // namespace safepoint

int main(int argc, char** argv) { return safepoint::Main(argc, argv); }
