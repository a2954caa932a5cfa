// The `safepoint` command-line tool: list, inspect and verify checkpoints.
//
//   safepoint ls PATH [--json]
//   safepoint inspect PATH [--step N] [--rank R] [--json]
//   safepoint verify PATH [--step N | --all] [--json]
//   safepoint agent --job JOB [--shm-dir DIR] [--no-emergency-flush]
//   safepoint status [--shm-dir DIR] [--json]
//   safepoint gc [--shm-dir DIR] [--dry-run]
//   safepoint --version
//
// Readable tables on stdout by default, --json for scripts; errors on stderr. Exit status: 0 on
// success, 1 on an error or when verification finds damage, 2 on a usage error.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <ctime>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/bytes.h"
#include "safepoint/agent.h"
#include "safepoint/arena.h"
#include "safepoint/build_config.h"
#include "safepoint/checkpoint.h"
#include "safepoint/extras.h"
#include "safepoint/image.h"

namespace safepoint {
namespace {

using json = nlohmann::ordered_json;
using internal::HumanBytes;

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

const char kUsage[] =
    "usage: safepoint <command> [options]\n"
    "\n"
    "commands:\n"
    "  ls PATH [--json]                         committed steps: world size, bytes, time\n"
    "  inspect PATH [--step N] [--rank R] [--json]\n"
    "                                           tensors (dtype, shape, bytes) and non-tensor state\n"
    "  verify PATH [--step N | --all] [--json]  read every byte and check every checksum\n"
    "  agent --job JOB [--shm-dir DIR] [--no-emergency-flush]\n"
    "                                           run the node agent in the foreground (sidecar)\n"
    "  status [--shm-dir DIR] [--json]          this node's agents, snapshots and pending work\n"
    "  gc [--shm-dir DIR] [--dry-run]           remove snapshots of jobs whose agent is gone\n"
    "  --version                                version and optional features of this build\n"
    "\n"
    "PATH is a checkpoint directory (a path or file:// URI). Without --step, the newest step.\n";

struct Args {
  std::string command;
  std::string path;
  std::string job;
  std::string shm_dir = "/dev/shm";
  bool dry_run = false;
  bool emergency_flush = true;
  std::optional<uint64_t> step;
  uint32_t rank = 0;
  bool all = false;
  bool json = false;
};

int Usage(const std::string& error) {
  if (!error.empty()) std::cerr << "safepoint: " << error << "\n\n";
  std::cerr << kUsage;
  return kExitUsage;
}

int Fail(const Status& s) {
  std::cerr << "safepoint: error: " << s.ToString() << "\n";
  return kExitError;
}

bool ParseU64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, c - '0', &v)) return false;
  }
  *out = v;
  return true;
}

std::string FormatTime(int64_t ns) {
  const std::time_t t = static_cast<std::time_t>(ns / 1000000000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string Dims(const std::vector<uint64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  if (rows.empty()) return;
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
}

void ReportProblems(const std::vector<std::string>& problems) {
  for (const auto& p : problems) std::cerr << "safepoint: warning: skipping " << p << "\n";
}

Result<CommitRecord> PickStep(CheckpointStore& store, std::optional<uint64_t> step) {
  if (step) return store.ReadCommit(*step);
  std::vector<std::string> problems;
  SP_ASSIGN_OR_RETURN(auto committed, store.ListCommitted(&problems));
  ReportProblems(problems);
  if (committed.empty()) return NotFound(store.storage().uri() + ": no committed checkpoint");
  return committed.back();
}

int CmdVersion() {
  std::cout << "safepoint " << SAFEPOINT_VERSION << "\n"
            << "image format: " << kImageFormatVersion << "\n"
            << "build: " << SAFEPOINT_BUILD_TYPE << "\n"
            << "crc32c: isa-l\n"
            << "zstd: " << (SAFEPOINT_HAVE_ZSTD ? "yes" : "no") << "\n"
            << "io_uring: " << (SAFEPOINT_HAVE_URING ? "available (not used yet)" : "no") << "\n";
  // Only test builds for the crash campaign have them (src/base/kill_point.h).
  if (SAFEPOINT_HAVE_KILL_POINTS) std::cout << "kill points: yes (test build, not for use)\n";
  return kExitOk;
}

int CmdLs(const Args& a) {
  auto store = OpenCheckpointStore(a.path);
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

int CmdInspect(const Args& a) {
  auto store = OpenCheckpointStore(a.path);
  if (!store.ok()) return Fail(store.status());
  auto commit = PickStep(**store, a.step);
  if (!commit.ok()) return Fail(commit.status());
  auto md = (*store)->ReadMetadata(*commit, a.rank);
  if (!md.ok()) return Fail(md.status());
  uint64_t tensor_bytes = 0;
  for (const auto& t : md->tensors) tensor_bytes += t.nbytes;
  if (a.json) {
    json tensors = json::array();
    for (const auto& t : md->tensors) {
      json j = {{"name", t.spec.name},
                {"dtype", DTypeName(t.spec.dtype)},
                {"shape", t.spec.shape},
                {"bytes", t.nbytes},
                {"offset", t.offset}};
      if (!t.spec.global_shape.empty()) {
        j["global_shape"] = t.spec.global_shape;
        j["global_offset"] = t.spec.global_offset;
      }
      tensors.push_back(j);
    }
    json out = {{"step", commit->step},      {"rank", a.rank},
                {"world_size", commit->world_size}, {"job", commit->job},
                {"file", md->source},        {"image_bytes", md->layout.image_size},
                {"tensor_bytes", tensor_bytes}, {"chunk_size", md->layout.chunk_size},
                {"tensors", tensors},        {"state", FormatValue(md->extras, 1 << 20)}};
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << "step " << commit->step << ", rank " << a.rank << " of " << commit->world_size
            << (commit->job.empty() ? "" : ", job " + commit->job) << "\n"
            << "file " << md->source << " (" << HumanBytes(md->layout.image_size) << ", "
            << md->tensors.size() << " tensors, " << HumanBytes(tensor_bytes) << " of tensor data)\n\n";
  std::vector<std::vector<std::string>> rows = {{"#", "NAME", "DTYPE", "SHAPE", "BYTES"}};
  for (size_t i = 0; i < md->tensors.size(); ++i) {
    const auto& t = md->tensors[i];
    std::string shape = Dims(t.spec.shape);
    if (!t.spec.global_shape.empty()) {
      shape += " of " + Dims(t.spec.global_shape) + " at " + Dims(t.spec.global_offset);
    }
    rows.push_back({std::to_string(i), t.spec.name, std::string(DTypeName(t.spec.dtype)), shape,
                    std::to_string(t.nbytes)});
  }
  PrintTable(rows);
  std::cout << "\nstate (tensors shown as <tensor #i>):\n" << FormatValue(md->extras) << "\n";
  return kExitOk;
}

int CmdVerify(const Args& a) {
  auto store = OpenCheckpointStore(a.path);
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
  for (const auto& p : problems) {
    results.push_back({{"ok", false}, {"error", p}});
    if (!a.json) std::cout << "DAMAGED  " << p << "\n";
  }
  for (const auto& c : targets) {
    for (uint32_t r = 0; r < c.world_size; ++r) {
      Status s;
      uint64_t bytes = 0;
      auto image = (*store)->ReadImage(c, r);
      if (image.ok()) {
        bytes = image->size;
        auto reader = ImageReader::Parse(image->bytes(), image->source,
                                         ImageReader::Verify::kStructure);
        s = reader.status();
        if (s.ok()) s = DecodeExtras(reader->extras(), reader->tensors().size(), image->source).status();
      } else {
        s = image.status();
      }
      const std::string file = (*store)->storage().Describe(ImageObjectName(c, r));
      if (!s.ok()) damaged = true;
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
  }
  if (a.json) std::cout << json{{"ok", !damaged}, {"results", results}}.dump(2) << "\n";
  if (damaged) {
    std::cerr << "safepoint: verification failed: damaged checkpoint data in " << a.path << "\n";
    return kExitError;
  }
  return kExitOk;
}

// Asks a live agent for its status (JSON), or nullopt.
std::optional<json> QueryAgent(const std::string& job_dir) {
  const std::string path = AgentSocketPath(job_dir);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return std::nullopt;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  std::optional<json> out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      SendMessage(fd, MessageType::kStatus, "{}").ok()) {
    FrameDecoder decoder;
    auto reply = ReceiveMessage(fd, decoder, 10);
    if (reply.ok() && reply->type == MessageType::kStatusReply) {
      out = json::parse(reply->payload, nullptr, false);
      if (out->is_discarded()) out.reset();
    }
  }
  ::close(fd);
  return out;
}

json ArenaJson(const std::string& job_dir) {
  json ranks = json::array();
  auto list = ListArenaRanks(job_dir);
  if (!list.ok()) return ranks;
  for (uint32_t r : *list) {
    auto arena = Arena::Open(job_dir, r);
    if (!arena.ok()) continue;
    json slots = json::array();
    for (const SlotInfo& s : (*arena)->Slots()) {
      slots.push_back({{"slot", s.index}, {"state", SlotStateName(s.state)}, {"leased", s.leased},
                       {"step", s.step}, {"image_bytes", s.image_size}, {"capacity", s.capacity}});
    }
    ranks.push_back({{"rank", r}, {"slots", slots}, {"bytes", (*arena)->mapped_bytes()}});
  }
  return ranks;
}

int CmdAgent(const Args& a) {
  AgentOptions o;
  o.job = a.job;
  o.shm_dir = a.shm_dir;
  o.emergency_flush = a.emergency_flush;
  o.exit_when_idle = false;  // a sidecar runs until it is told to stop
  return RunAgent(o);
}

int CmdStatus(const Args& a) {
  auto jobs = ListJobDirectories(a.shm_dir);
  if (!jobs.ok()) return Fail(jobs.status());
  json out = json::array();
  for (const auto& [job, dir] : *jobs) {
    uint32_t pid = 0;
    const bool alive = AgentAlive(dir, &pid);
    json j = {{"job", job}, {"job_dir", dir}, {"agent_alive", alive}, {"agent_pid", alive ? json(pid) : json(nullptr)},
              {"arenas", ArenaJson(dir)}};
    if (alive) {
      if (auto st = QueryAgent(dir)) {
        j["storage"] = (*st)["storage"];
        j["world_size"] = (*st)["world_size"];
        j["newest_committed"] = (*st)["newest_committed"];
        j["queued"] = (*st)["queued"];
        j["in_flight"] = (*st)["in_flight"];
        j["ranks"] = (*st)["ranks"];
      }
    }
    out.push_back(j);
  }
  if (a.json) {
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  if (out.empty()) {
    std::cout << "no safepoint jobs in " << a.shm_dir << "\n";
    return kExitOk;
  }
  for (const json& j : out) {
    std::cout << "job " << j["job"].get<std::string>() << "  (" << j["job_dir"].get<std::string>() << ")\n";
    if (j["agent_alive"].get<bool>()) {
      std::cout << "  agent pid " << j["agent_pid"] << ", storage "
                << (j.contains("storage") ? j["storage"].dump() : "?") << ", newest committed step "
                << (j.contains("newest_committed") ? j["newest_committed"].dump() : "?")
                << ", queued persists " << (j.contains("queued") ? j["queued"].dump() : "?") << "\n";
    } else {
      std::cout << "  no live agent (snapshots kept for hot reload; `safepoint gc` removes them)\n";
    }
    std::vector<std::vector<std::string>> rows = {{"  RANK", "SLOT", "STATE", "STEP", "BYTES"}};
    for (const json& r : j["arenas"]) {
      for (const json& s : r["slots"]) {
        std::string state = s["state"].get<std::string>();
        if (s["leased"].get<bool>()) state += " (persisting)";
        rows.push_back({"  " + std::to_string(r["rank"].get<uint32_t>()), s["slot"].dump(), state,
                        s["state"] == "COMPLETE" ? s["step"].dump() : "-",
                        HumanBytes(s["capacity"].get<uint64_t>())});
      }
    }
    if (rows.size() > 1) PrintTable(rows);
  }
  return kExitOk;
}

int CmdGc(const Args& a) {
  auto jobs = ListJobDirectories(a.shm_dir);
  if (!jobs.ok()) return Fail(jobs.status());
  int failures = 0;
  for (const auto& [job, dir] : *jobs) {
    if (AgentAlive(dir)) {
      std::cout << "keep    " << dir << " (agent alive)\n";
      continue;
    }
    if (a.dry_run) {
      std::cout << "would remove " << dir << "\n";
      continue;
    }
    auto freed = RemoveJobDirectory(dir);
    if (freed.ok()) {
      std::cout << "removed " << dir << " (" << HumanBytes(*freed) << ")\n";
    } else {
      std::cerr << "safepoint: error: " << freed.status().ToString() << "\n";
      ++failures;
    }
  }
  return failures ? kExitError : kExitOk;
}

int Main(int argc, char** argv) {
  std::vector<std::string> argv_s(argv + 1, argv + argc);
  if (argv_s.empty()) return Usage("");
  Args a;
  a.command = argv_s[0];
  if (a.command == "--version" || a.command == "version") return CmdVersion();
  if (a.command == "-h" || a.command == "--help" || a.command == "help") {
    std::cout << kUsage;
    return kExitOk;
  }
  if (a.command != "ls" && a.command != "inspect" && a.command != "verify" &&
      a.command != "agent" && a.command != "status" && a.command != "gc") {
    return Usage("unknown command '" + a.command + "'");
  }
  const bool node_command = a.command == "agent" || a.command == "status" || a.command == "gc";
  for (size_t i = 1; i < argv_s.size(); ++i) {
    const std::string& s = argv_s[i];
    auto value = [&](const char* flag) -> std::optional<std::string> {
      if (i + 1 >= argv_s.size()) return std::nullopt;
      (void)flag;
      return argv_s[++i];
    };
    if (s == "--json" && a.command != "agent" && a.command != "gc") {
      a.json = true;
    } else if (s == "--shm-dir" && node_command) {
      auto v = value("--shm-dir");
      if (!v || v->empty()) return Usage("--shm-dir needs a directory");
      a.shm_dir = *v;
    } else if (s == "--job" && a.command == "agent") {
      auto v = value("--job");
      if (!v) return Usage("--job needs a job name");
      a.job = *v;
    } else if (s == "--no-emergency-flush" && a.command == "agent") {
      a.emergency_flush = false;
    } else if (s == "--dry-run" && a.command == "gc") {
      a.dry_run = true;
    } else if (s == "--all" && a.command == "verify") {
      a.all = true;
    } else if (s == "--step" && a.command != "ls") {
      auto v = value("--step");
      uint64_t n;
      if (!v || !ParseU64(*v, &n)) return Usage("--step needs a non-negative integer");
      a.step = n;
    } else if (s == "--rank" && a.command == "inspect") {
      auto v = value("--rank");
      uint64_t n;
      if (!v || !ParseU64(*v, &n) || n >= kMaxRank) return Usage("--rank needs a rank number");
      a.rank = static_cast<uint32_t>(n);
    } else if (!s.empty() && s[0] == '-') {
      return Usage("unknown option '" + s + "' for " + a.command);
    } else if (a.path.empty() && !node_command) {
      a.path = s;
    } else {
      return Usage("unexpected argument '" + s + "'");
    }
  }
  if (a.command == "agent") {
    if (a.job.empty()) return Usage("agent needs --job JOB");
    return CmdAgent(a);
  }
  if (a.command == "status") return CmdStatus(a);
  if (a.command == "gc") return CmdGc(a);
  if (a.path.empty()) return Usage(a.command + " needs a checkpoint PATH");
  if (a.all && a.step) return Usage("use either --step or --all");
  if (a.command == "ls") return CmdLs(a);
  if (a.command == "inspect") return CmdInspect(a);
  return CmdVerify(a);
}

}  // namespace
}  // namespace safepoint

int main(int argc, char** argv) { return safepoint::Main(argc, argv); }
