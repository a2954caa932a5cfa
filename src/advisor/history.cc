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
#include <sstream>

#include "base/bytes.h"
#include "base/owned_file.h"
#include "safepoint/storage.h"

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

bool HistoryIsLocal(const std::string& checkpoint_path) {
  return LocalDirectory(checkpoint_path).has_value();
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

HistoryWriter::HistoryWriter(HistoryWriter&& o) noexcept { *this = std::move(o); }

HistoryWriter& HistoryWriter::operator=(HistoryWriter&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
    gap_ = o.gap_;
    last_save_line_ = o.last_save_line_;
    pending_saves_ = std::move(o.pending_saves_);
    first_step_ = o.first_step_;
    last_step_ = o.last_step_;
    first_save_t_ = o.first_save_t_;
    last_save_t_ = o.last_save_t_;
    shape_ = o.shape_;
    storage_ = std::move(o.storage_);
    segment_ = std::move(o.segment_);
    segment_index_ = o.segment_index_;
    lines_ = std::move(o.lines_);
    dirty_ = std::exchange(o.dirty_, false);
  }
  return *this;
}

HistoryWriter::~HistoryWriter() {
  if (fd_ >= 0) ::close(fd_);
}

HistoryWriter HistoryWriter::InStorage(std::shared_ptr<Storage> storage, std::string segment,
                                       double save_line_gap) {
  HistoryWriter w(-1, "", save_line_gap);
  w.storage_ = std::move(storage);
  w.segment_ = std::move(segment);
  w.path_ = w.storage_->Describe(w.SegmentName());
  return w;
}

std::string HistoryWriter::SegmentName() const {
  char n[16];
  std::snprintf(n, sizeof(n), "%04llu", static_cast<unsigned long long>(segment_index_));
  return std::string(kHistorySegmentPrefix) + segment_ + "-" + n + ".jsonl";
}

Status HistoryWriter::PublishSegment(Storage& storage, const Segment& segment) {
  SP_ASSIGN_OR_RETURN(auto object, storage.Create(segment.name, segment.data.size()));
  SP_RETURN_IF_ERROR(object->WriteAt(
      0, std::span(reinterpret_cast<const std::byte*>(segment.data.data()), segment.data.size())));
  return object->Publish();
}

std::optional<HistoryWriter::Segment> HistoryWriter::TakeSegment() {
  if (!storage_ || !dirty_) return std::nullopt;
  Segment segment{SegmentName(), lines_};
  dirty_ = false;
  if (lines_.size() >= kSegmentBytes) {  // the next lines go to a new segment
    ++segment_index_;
    lines_.clear();
    path_ = storage_->Describe(SegmentName());
  }
  return segment;
}

Status HistoryWriter::Sync() {
  if (!storage_ || !dirty_) return Status::OK();
  SP_RETURN_IF_ERROR(PublishSegment(*storage_, Segment{SegmentName(), lines_}));
  TakeSegment();  // published: moves on past a full segment
  return Status::OK();
}

Result<HistoryWriter> HistoryWriter::Open(const std::string& path, double save_line_gap) {
  if (path.empty()) return InvalidArgument("history: no path");
  // The checkpoint directory may not exist before the first save commits.
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  // The checkpoint directory may be shared with other users: a symlink or a file one of them
  // planted there is refused, never appended to (owned_file.h). Created 0644, as the
  // checkpoint's own objects beside it are (`safepoint advise` may run as another user).
  SP_ASSIGN_OR_RETURN(internal::UniqueFd fd, internal::OpenOwnedForAppend(path, 0644, "history"));
  return HistoryWriter(fd.Release(), path, save_line_gap);
}

Status HistoryWriter::Append(const std::string& line) {
  if (storage_) {
    lines_ += line;
    lines_ += '\n';
    dirty_ = true;
    return Status::OK();
  }
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

bool HistoryWriter::SaveLineDue() const { return NowSeconds() - last_save_line_ >= gap_; }

Status HistoryWriter::RecordSave(double blocking_seconds, std::optional<uint64_t> step) {
  const double now = NowSeconds();
  if (pending_saves_.empty()) {
    first_step_ = step;
    first_save_t_ = now;
  }
  pending_saves_.push_back(blocking_seconds);
  last_step_ = step;
  last_save_t_ = now;
  if (now - last_save_line_ < gap_) return Status::OK();
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
  if (first_step_ && last_step_) {
    j["steps"] = {*first_step_, *last_step_};
    j["span"] = last_save_t_ - first_save_t_;
  }
  if (shape_) {
    j["world_size"] = shape_->world_size;
    j["node_ranks"] = shape_->node_ranks;
    j["peers"] = shape_->peer_copies;
  }
  pending_saves_.clear();
  first_step_.reset();
  last_step_.reset();
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
  std::stringstream text;
  text << in.rdbuf();
  return SummarizeHistory(text.str(), path, skipped);
}

Result<HistorySummary> ReadJobHistory(const std::string& checkpoint_path, const std::string& job,
                                      uint64_t* skipped) {
  if (HistoryIsLocal(checkpoint_path))
    return ReadHistory(HistoryPath(checkpoint_path, job), skipped);
  std::string text;
  std::vector<std::string> where;
  SP_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, OpenStorage(checkpoint_path));
  SP_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, storage->List(kHistorySegmentPrefix));
  std::sort(objects.begin(), objects.end(),
            [](const ObjectInfo& a, const ObjectInfo& b) { return a.name < b.name; });
  for (const ObjectInfo& o : objects) {
    SP_ASSIGN_OR_RETURN(auto object, storage->Open(o.name));
    std::string data(object->size(), '\0');
    SP_RETURN_IF_ERROR(
        object->ReadAt(0, std::span(reinterpret_cast<std::byte*>(data.data()), data.size())));
    text += data;
    if (!data.empty() && data.back() != '\n') text += '\n';
  }
  if (!objects.empty()) {
    where.push_back(storage->Describe(std::string(kHistorySegmentPrefix)) + " (" +
                    std::to_string(objects.size()) + " segments)");
  }
  // Written by earlier versions for an object store; read, never written.
  if (const std::string legacy = HistoryPath(checkpoint_path, job); !legacy.empty()) {
    std::ifstream in(legacy);
    if (in) {
      std::stringstream s;
      s << in.rdbuf();
      text += s.str();
      where.push_back(legacy);
    }
  }
  if (where.empty()) {
    return NotFound(storage->Describe(std::string(kHistorySegmentPrefix)) +
                    ": no measurement history");
  }
  std::string name = where[0];
  if (where.size() > 1) name += " and " + where[1];
  return SummarizeHistory(text, name, skipped);
}

HistorySummary SummarizeHistory(const std::string& text, const std::string& name,
                                uint64_t* skipped) {
  HistorySummary h;
  h.path = name;
  uint64_t bad = 0;
  // Several writers' lines (segments, the legacy file) in the order of their time.
  std::vector<std::pair<double, json>> events;
  std::istringstream in(text);
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
    events.emplace_back(t, std::move(j));
  }
  std::stable_sort(events.begin(), events.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  // Save lines carry a median of n samples: the weighted median of medians is close enough.
  std::vector<std::pair<double, uint64_t>> saves;
  std::vector<double> periods, steps_per_save;  // from save lines of at least two saves
  std::map<std::string, std::vector<double>> persist, persist_bytes, restore;
  std::vector<double> restarts;
  bool in_run = false;
  bool clean = false;
  double run_start = 0;
  double last_t = 0;
  for (auto& event : events) {
    const double t = event.first;
    const json& j = event.second;
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
      const json* steps = j.contains("steps") ? &j["steps"] : nullptr;
      if (n >= 2 && steps && steps->is_array() && steps->size() == 2 &&
          (*steps)[0].is_number_unsigned() && (*steps)[1].is_number_unsigned() &&
          j.contains("span") && j["span"].is_number()) {
        const auto first = (*steps)[0].get<uint64_t>(), last = (*steps)[1].get<uint64_t>();
        const double span = j["span"].get<double>();
        if (last > first && span > 0) {  // a window that restored to an older step says nothing
          periods.push_back(span / static_cast<double>(n - 1));
          steps_per_save.push_back(static_cast<double>(last - first) / static_cast<double>(n - 1));
        }
      }
      if (j.contains("world_size") && j["world_size"].is_number_unsigned() &&
          j["world_size"].get<uint64_t>() > 0) {
        JobShape shape;
        shape.world_size = static_cast<uint32_t>(j["world_size"].get<uint64_t>());
        if (j.contains("node_ranks") && j["node_ranks"].is_number_unsigned()) {
          shape.node_ranks = static_cast<uint32_t>(j["node_ranks"].get<uint64_t>());
        }
        shape.peer_copies =
            j.contains("peers") && j["peers"].is_boolean() && j["peers"].get<bool>();
        h.shape = shape;
      }
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
  if (!periods.empty()) {
    h.save_period_seconds = Median(periods);
    h.steps_per_save = Median(steps_per_save);
    const double blocking = h.save ? h.save->seconds : 0;
    const double step = (*h.save_period_seconds - blocking) / *h.steps_per_save;
    if (step > 0) h.step_seconds = step;
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
