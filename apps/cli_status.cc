// `safepoint status` (cli_status.h): for each job directory in the shm directory, the job's
// checkpoint path (from its live agent, else from the job.json its agent left), its agent, its
// persists and their failures, its tiers and replication, and its snapshot slots.
#include "cli_status.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "agent/job_config.h"
#include "agent/status.h"
#include "base/bytes.h"
#include "base/unique_fd.h"
#include "cli_format.h"
#include "cli_store.h"
#include "cli_watch.h"
#include "protocol/protocol.h"
#include "shm/arena.h"

namespace safepoint::cli {
namespace {

using json = nlohmann::ordered_json;
using internal::HumanBytes;
using namespace safepoint::protocol;

// ", compression auto (in use: auto:none, ratio 1.41), incremental" for a storage's status
// fields (PackJson in src/agent/status.cc); "" for the default plain layout.
std::string LayoutText(const json& j) {
  if (!j.is_object()) return "";
  const std::string compression = j.value("compression", "none");
  const bool incremental = j.value("incremental", false);
  if (compression == "none" && !incremental) return "";
  std::string out = ", compression " + compression;
  if (j.contains("compression_in_use") && j["compression_in_use"].is_string()) {
    out += " (in use: " + j["compression_in_use"].get<std::string>();
    if (j.contains("compression_ratio") && j["compression_ratio"].is_number()) {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.2f", j["compression_ratio"].get<double>());
      out += std::string(", ratio ") + buf;
    }
    out += ")";
  }
  if (incremental) out += ", incremental";
  return out;
}

// Asks a live agent for its status (JSON), or nullopt.
std::optional<json> QueryAgent(const std::string& job_dir) {
  const std::string path = AgentSocketPath(job_dir);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return std::nullopt;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const internal::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return std::nullopt;
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      !SendMessage(fd.get(), MessageType::kStatus, "{}").ok()) {
    return std::nullopt;
  }
  FrameDecoder decoder;
  auto reply = ReceiveMessage(fd.get(), decoder, 10);
  if (!reply.ok() || reply->type != MessageType::kStatusReply) return std::nullopt;
  json out = json::parse(reply->payload, nullptr, false);
  if (out.is_discarded()) return std::nullopt;
  return out;
}

json ArenaJson(const std::string& job_dir) {
  json ranks = json::array();
  auto list = ListArenaRanks(job_dir);
  if (!list.ok()) return ranks;
  for (uint32_t r : *list) {
    auto arena = Arena::Open(job_dir, r);
    if (!arena.ok()) continue;
    ranks.push_back({{"rank", r},
                     {"slots", agent::SlotsJson((*arena)->Slots())},
                     {"bytes", (*arena)->mapped_bytes()}});
  }
  return ranks;
}

// A value of the agent's status for text: a string without quotes, a number, or `none` for
// null and a missing key.
std::string Text(const json& j, const char* key, const std::string& none = "none") {
  if (!j.is_object() || !j.contains(key) || j[key].is_null()) return none;
  const json& v = j[key];
  return v.is_string() ? v.get<std::string>() : v.dump();
}

// The persists of the agent's ranks, summed, and the newest error of a rank.
void AddPersistCounts(json& j, const json& ranks) {
  uint64_t ok = 0, failed = 0;
  std::string last_error;
  if (ranks.is_array()) {
    for (const json& r : ranks) {
      ok += r.value("persists_ok", uint64_t{0});
      failed += r.value("persists_failed", uint64_t{0});
      if (r.contains("last_error") && r["last_error"].is_string() &&
          !r["last_error"].get<std::string>().empty()) {
        last_error = "rank " + std::to_string(r.value("rank", 0u)) + ": " +
                     r["last_error"].get<std::string>();
      }
    }
  }
  j["persists_ok"] = ok;
  j["persists_failed"] = failed;
  j["last_persist_error"] = last_error.empty() ? json(nullptr) : json(last_error);
}

json JobJson(const std::string& job, const std::string& dir) {
  uint32_t pid = 0;
  const bool alive = AgentAlive(dir, &pid);
  auto writers = LiveSlotWriters(dir);
  json j = {{"job", job},
            {"job_dir", dir},
            {"agent_alive", alive},
            {"agent_pid", alive ? json(pid) : json(nullptr)},
            {"live_writers", writers.ok() ? json(*writers) : json(nullptr)},
            {"arenas", ArenaJson(dir)}};
  // What the job persists to, from the job.json its agent wrote: also for a job whose agent is
  // gone (its snapshots wait for a restart or for `safepoint gc`).
  if (auto config = agent::ReadJobConfig(dir); config.ok() && config->has_value()) {
    j["storage"] = (*config)->storage;
    j["world_size"] = (*config)->world_size;
  } else {
    j["storage"] = nullptr;
  }
  if (alive) {
    if (auto st = QueryAgent(dir)) {
      if ((*st)["storage"].is_string()) j["storage"] = (*st)["storage"];
      j["world_size"] = (*st)["world_size"];
      j["newest_committed"] = (*st)["newest_committed"];
      if (j["newest_committed"].is_number_unsigned() && j["storage"].is_string()) {
        if (auto age = CommitAgeSeconds(j["storage"], j["newest_committed"]))
          j["newest_committed_age_seconds"] = *age;  // staleness of the newest durable step
      }
      j["queued"] = (*st)["queued"];
      j["in_flight"] = (*st)["in_flight"];
      j["ranks"] = (*st)["ranks"];
      AddPersistCounts(j, (*st)["ranks"]);
      for (const char* key : {"replication", "tiers", "metrics_url", "metrics_error", "event_log",
                              "event_log_error", "storage_layout", "job_config_error", "history"}) {
        if (st->contains(key)) j[key] = (*st)[key];
      }
    }
  }
  const std::string framework = j["storage"].is_string() ? FrameworkOf(j["storage"]) : "";
  j["framework"] = framework.empty() ? json(nullptr) : json(framework);
  return j;
}

void PrintAgent(const json& j) {
  std::cout << "  agent pid " << Text(j, "agent_pid") << "; newest committed step "
            << Text(j, "newest_committed", "none yet")
            << (j.contains("newest_committed_age_seconds")
                    ? " (" + Ago(j["newest_committed_age_seconds"].get<double>()) + ")"
                    : std::string())
            << "; queued persists " << Text(j, "queued", "?");
  if (j.contains("in_flight") && j["in_flight"].is_object()) {
    std::cout << ", persisting step " << Text(j["in_flight"], "step") << " of rank "
              << Text(j["in_flight"], "rank");
  }
  std::cout << LayoutText(j.value("storage_layout", json())) << "\n";
  if (j.contains("persists_failed")) {
    std::cout << "  persists " << j["persists_ok"] << " ok, " << j["persists_failed"] << " failed";
    if (j["last_persist_error"].is_string()) {
      std::cout << "; last error: " << j["last_persist_error"].get<std::string>();
    }
    std::cout << "\n";
  }
  if (j.contains("job_config_error") && j["job_config_error"].is_string()) {
    std::cout << "  job.json not written (a later agent cannot adopt the snapshots): "
              << j["job_config_error"].get<std::string>() << "\n";
  }
  if (j.contains("history") && j["history"].is_object() && j["history"]["error"].is_string()) {
    std::cout << "  measurement history not written: " << j["history"]["error"].get<std::string>()
              << "\n";
  }
  if (j.contains("metrics_url") && j["metrics_url"].is_string()) {
    std::cout << "  metrics " << j["metrics_url"].get<std::string>() << "\n";
  } else if (j.contains("metrics_error") && j["metrics_error"].is_string()) {
    std::cout << "  metrics not served: " << j["metrics_error"].get<std::string>() << "\n";
  }
  if (j.contains("replication") && j["replication"].is_object()) {
    const json& r = j["replication"];
    std::cout << "  replication " << r.value("redundancy", "?") << ": node " << r.value("node", "?")
              << " (" << r["nodes"].size() << " nodes), listening on " << r.value("address", "?")
              << "; keeps " << r["held"].size() << " replicas of other nodes ("
              << HumanBytes(r.value("held_bytes", uint64_t{0})) << ")\n";
    for (const json& rank : r["ranks"]) {
      std::cout << "    rank " << rank["rank"] << " step " << Text(rank, "step", "none yet")
                << (rank.value("protected", false) ? " protected" : " NOT protected");
      if (rank.contains("error")) std::cout << ": " << Text(rank, "error");
      std::cout << "\n";
    }
  }
  if (j.contains("tiers") && j["tiers"].is_array()) {
    for (const json& t : j["tiers"]) {
      const uint64_t every = t.value("every", uint64_t{0});
      const double every_seconds = t.value("every_seconds", 0.0);
      std::cout << "  tier " << Text(t, "tier") << " " << Text(t, "uri") << ": every "
                << (every ? std::to_string(every) + " steps" : std::string("step"))
                << (every_seconds > 0 ? " or " + Text(t, "every_seconds") + " s" : std::string())
                << ", keeps " << Text(t, "keep") << LayoutText(t);
      if (!t.value("filled_here", false)) {
        std::cout << " (filled by the agent of rank 0's node)\n";
        continue;
      }
      std::cout << "; newest step " << Text(t, "newest_step", "none yet") << ", "
                << Text(t, "copies", "0") << " copies, " << Text(t, "failures", "0") << " failures";
      if (t.contains("last_copy_time") && t["last_copy_time"].is_number())
        std::cout << " (copied " << Ago(NowSeconds() - t["last_copy_time"].get<double>()) << ")";
      if (t.contains("in_flight_step") && !t["in_flight_step"].is_null())
        std::cout << ", copying " << Text(t, "in_flight_step");
      if (t.contains("pending_step") && !t["pending_step"].is_null())
        std::cout << ", next " << Text(t, "pending_step");
      const std::string error = t.contains("last_error") && t["last_error"].is_string()
                                    ? t["last_error"].get<std::string>()
                                    : "";
      if (!error.empty()) std::cout << "; last error: " << error;
      std::cout << "\n";
    }
  }
}

}  // namespace

std::string TrainingProcesses(const std::vector<uint32_t>& pids) {
  std::string out = pids.size() > 1 ? "training processes " : "training process ";
  for (size_t i = 0; i < pids.size(); ++i) out += (i ? ", " : "") + std::to_string(pids[i]);
  return out;
}

std::string FrameworkOf(const std::string& checkpoint_path) {
  namespace fs = std::filesystem;
  const auto dir = LocalDirectory(checkpoint_path);
  if (!dir) return "";
  const fs::path path = fs::path(*dir).lexically_normal();
  const fs::path self = path.has_filename() ? path : path.parent_path();
  if (self.filename() != "safepoint") return "";
  std::error_code ec;
  fs::directory_iterator it(self.parent_path(), ec);
  size_t seen = 0;
  for (; !ec && it != fs::directory_iterator() && seen < 10000; it.increment(ec), ++seen) {
    const std::string name = it->path().filename().string();
    if (name.size() > 5 && name.ends_with(".ckpt")) return "Lightning";
    if (name == "latest" || name.starts_with("global_step")) return "DeepSpeed";
  }
  return "";
}

int CmdStatus(const std::string& shm_dir, bool as_json) {
  if (Status s = CheckDirectory(shm_dir, "shared-memory directory"); !s.ok()) return Fail(s);
  auto jobs = ListJobDirectories(shm_dir);
  if (!jobs.ok()) return Fail(jobs.status());
  json out = json::array();
  for (const auto& [job, dir] : *jobs) out.push_back(JobJson(job, dir));
  if (as_json) {
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  if (out.empty()) {
    std::cout << "no safepoint jobs in " << shm_dir << "\n";
    return kExitOk;
  }
  for (const json& j : out) {
    // The job by what the user knows it by: its checkpoint path (an integration's default job
    // name is "safepoint-<hash>" for every run), and the framework whose checkpoints it keeps.
    std::cout << "job " << j["job"].get<std::string>();
    if (j["storage"].is_string()) {
      std::cout << ": checkpoints in " << j["storage"].get<std::string>();
      if (j["framework"].is_string()) {
        std::cout << " (" << j["framework"].get<std::string>() << "'s, beside its checkpoints in "
                  << std::filesystem::path(j["storage"].get<std::string>())
                         .lexically_normal()
                         .parent_path()
                         .string()
                  << ")";
      }
    } else {
      std::cout << ": checkpoint path not known (no job.json)";
    }
    std::cout << "\n  shared memory " << j["job_dir"].get<std::string>() << "\n";
    if (j["agent_alive"].get<bool>()) {
      PrintAgent(j);
    } else if (j["live_writers"].is_array() && !j["live_writers"].empty()) {
      std::cout << "  no live agent; "
                << TrainingProcesses(j["live_writers"].get<std::vector<uint32_t>>())
                << " alive (its next save starts one; `safepoint gc` keeps the job)\n";
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

}  // namespace safepoint::cli
