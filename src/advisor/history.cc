// The measurement history file: appending and summarizing (history.h).
#include "advisor/history.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/bytes.h"

namespace safepoint::advisor {
namespace {

using json = nlohmann::json;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The local directory of a plain path or a file:// URI, or nullopt for other storage.
std::optional<std::string> LocalDirectory(std::string path) {
  const std::string kFile = "file://";
  if (path.rfind(kFile, 0) == 0) {
    path.erase(0, kFile.size());
    if (path.rfind("localhost/", 0) == 0) path.erase(0, std::string("localhost").size());
    if (path.empty() || path[0] != '/') return std::nullopt;
    return path;
  }
  if (path.find("://") != std::string::npos) return std::nullopt;
  return path;
}

}  // namespace

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string HistoryPath(const std::string& checkpoint_path, const std::string& job) {
  if (auto dir = LocalDirectory(checkpoint_path)) {
    while (dir->size() > 1 && dir->back() == '/') dir->pop_back();
    return *dir + "/safepoint-history.jsonl";
  }
  const char* env = std::getenv("SAFEPOINT_HISTORY_DIR");
  if (env != nullptr && *env != '\0' && !job.empty()) {
    return std::string(env) + "/" + job + ".history.jsonl";
  }
  return "";
}

HistoryWriter::HistoryWriter(int fd, std::string path, double gap)
    : fd_(fd), path_(std::move(path)), gap_(gap), last_save_line_(NowSeconds()) {}

HistoryWriter::HistoryWriter(HistoryWriter&& o) noexcept
    : fd_(std::exchange(o.fd_, -1)),
      path_(std::move(o.path_)),
      gap_(o.gap_),
      last_save_line_(o.last_save_line_),
      pending_saves_(std::move(o.pending_saves_)) {}

HistoryWriter& HistoryWriter::operator=(HistoryWriter&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
    gap_ = o.gap_;
    last_save_line_ = o.last_save_line_;
    pending_saves_ = std::move(o.pending_saves_);
  }
  return *this;
}

HistoryWriter::~HistoryWriter() {
  if (fd_ >= 0) ::close(fd_);
}

Result<HistoryWriter> HistoryWriter::Open(const std::string& path, double save_line_gap) {
  if (path.empty()) return InvalidArgument("history: no path");
  // The checkpoint directory may not exist before the first save commits.
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("open history", path, errno);
  return HistoryWriter(fd, path, save_line_gap);
}

Status HistoryWriter::Append(const std::string& line) {
  if (fd_ < 0) return InvalidArgument(path_ + ": history writer is closed");
  const std::string data = line + "\n";
  const ssize_t n = ::write(fd_, data.data(), data.size());
  if (n < 0) return ErrnoStatus("append history", path_, errno);
  if (static_cast<size_t>(n) != data.size()) return IOError(path_ + ": short history append");
  return Status::OK();
}

Status HistoryWriter::RecordStart(uint64_t run) {
  return Append(json{{"t", NowSeconds()}, {"ev", "start"}, {"run", run}}.dump());
}

Status HistoryWriter::RecordSave(double blocking_seconds) {
  pending_saves_.push_back(blocking_seconds);
  if (NowSeconds() - last_save_line_ < gap_) return Status::OK();
  return Flush();
}

Status HistoryWriter::Flush() {
  if (pending_saves_.empty()) return Status::OK();
  const double max = *std::max_element(pending_saves_.begin(), pending_saves_.end());
  json j = {{"t", NowSeconds()},
            {"ev", "save"},
            {"n", pending_saves_.size()},
            {"seconds", Median(pending_saves_)},
            {"max", max}};
  pending_saves_.clear();
  last_save_line_ = NowSeconds();
  return Append(j.dump());
}

Status HistoryWriter::RecordPersist(const std::string& level, double seconds, uint64_t bytes) {
  return Append(json{
      {"t", NowSeconds()},
      {"ev", "persist"},
      {"level", level},
      {"seconds", seconds},
      {"bytes",
       bytes}}.dump());
}

Status HistoryWriter::RecordRestore(const std::string& source, double seconds) {
  return Append(
      json{{"t", NowSeconds()}, {"ev", "restore"}, {"source", source}, {"seconds", seconds}}
          .dump());
}

Status HistoryWriter::RecordClose() {
  SP_RETURN_IF_ERROR(Flush());
  return Append(json{{"t", NowSeconds()}, {"ev", "close"}}.dump());
}

Result<HistorySummary> ReadHistory(const std::string& path, uint64_t* skipped) {
  std::ifstream in(path);
  if (!in) {
    if (errno == ENOENT) return NotFound(path + ": no measurement history");
    return ErrnoStatus("open history", path, errno);
  }
  HistorySummary h;
  h.path = path;
  // Save lines carry a median of n samples: the weighted median of medians is close enough.
  std::vector<std::pair<double, uint64_t>> saves;
  std::map<std::string, std::vector<double>> persist, persist_bytes, restore;
  std::vector<double> restarts;
  bool in_run = false;
  bool clean = false;
  double run_start = 0;
  double last_t = 0;
  uint64_t bad = 0;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("t") || !j["t"].is_number() ||
        !j.contains("ev") || !j["ev"].is_string()) {
      ++bad;
      continue;
    }
    const double t = j["t"].get<double>();
    const std::string ev = j["ev"].get<std::string>();
    auto seconds = [&]() -> std::optional<double> {
      if (!j.contains("seconds") || !j["seconds"].is_number()) return std::nullopt;
      return j["seconds"].get<double>();
    };
    if (ev == "start") {
      if (in_run) {
        h.uptime_seconds += std::max(0.0, last_t - run_start);
        if (!clean) {
          ++h.interruptions;
          h.interruption_times.push_back(last_t);
          restarts.push_back(std::max(0.0, t - last_t));
        }
      }
      ++h.runs;
      in_run = true;
      clean = false;
      run_start = t;
    } else if (ev == "close") {
      clean = true;
    } else if (ev == "save") {
      auto s = seconds();
      const uint64_t n = j.value("n", uint64_t{1});
      if (s) saves.emplace_back(*s, n);
    } else if (ev == "persist") {
      auto s = seconds();
      if (s && j.contains("level") && j["level"].is_string()) {
        const std::string level = j["level"].get<std::string>();
        persist[level].push_back(*s);
        if (j.contains("bytes") && j["bytes"].is_number() && j["bytes"].get<double>() > 0) {
          persist_bytes[level].push_back(j["bytes"].get<double>());
        }
      }
    } else if (ev == "restore") {
      auto s = seconds();
      if (s && j.contains("source") && j["source"].is_string()) {
        restore[j["source"].get<std::string>()].push_back(*s);
      }
    }
    last_t = std::max(last_t, t);
  }
  if (in_run) h.uptime_seconds += std::max(0.0, last_t - run_start);
  if (!saves.empty()) {
    std::sort(saves.begin(), saves.end());
    uint64_t total = 0;
    for (const auto& [s, n] : saves) total += n;
    uint64_t acc = 0;
    double median = saves.back().first;
    for (const auto& [s, n] : saves) {
      acc += n;
      if (2 * acc >= total) {
        median = s;
        break;
      }
    }
    h.save = Measured{median, total};
  }
  for (auto& [level, v] : persist) {
    h.persist[level] = Measured{Median(v), v.size(), Median(persist_bytes[level])};
  }
  for (auto& [source, v] : restore) h.restore[source] = Measured{Median(v), v.size()};
  if (!restarts.empty()) h.restart = Measured{Median(restarts), restarts.size()};
  // Failures strike restarts too (the goodput model counts them over wall time): the time
  // covered is the running time plus the restarts.
  double restarting = 0;
  for (double r : restarts) restarting += r;
  if (h.interruptions > 0) {
    h.learned_mtbf_seconds = (h.uptime_seconds + restarting) / h.interruptions;
  }
  if (skipped) *skipped = bad;
  return h;
}

std::optional<RestoreEstimate> EstimateRestore(const HistorySummary& h, const std::string& level) {
  auto rate = [](double bytes, double seconds) {
    return internal::HumanBytes(static_cast<uint64_t>(bytes / seconds)) + "/s";
  };
  auto size = [](double bytes) { return internal::HumanBytes(static_cast<uint64_t>(bytes)); };
  const auto path = h.persist.find("path");
  const double state = path != h.persist.end() ? path->second.bytes : 0;
  if (level == "memory") {
    if (!h.save || h.save->seconds <= 0) return std::nullopt;
    if (state <= 0) {
      return RestoreEstimate{h.save->seconds,
                             "estimated: a save's blocking time (a reload copies the same bytes "
                             "back; not restored yet)"};
    }
    return RestoreEstimate{h.save->seconds,
                           "estimated: the state (" + size(state) +
                               ") copied back at the save's measured copy bandwidth (" +
                               rate(state, h.save->seconds) + "; not restored yet)"};
  }
  const auto p = h.persist.find(level);
  if (p == h.persist.end() || p->second.seconds <= 0) return std::nullopt;
  const Measured& m = p->second;
  const double written = m.bytes > 0 ? m.bytes : state;
  if (written <= 0 || state <= 0) {
    return RestoreEstimate{m.seconds,
                           "estimated: the persist time (reading back costs about what writing "
                           "did; not restored yet)"};
  }
  const double bandwidth = written / m.seconds;
  return RestoreEstimate{state / bandwidth, "estimated: the state (" + size(state) +
                                                ") read at the measured persist bandwidth (" +
                                                rate(written, m.seconds) + "; not restored yet)"};
}

}  // namespace safepoint::advisor
