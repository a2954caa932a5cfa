// The agent's metrics and event log (src/agent/telemetry.h), and NodeAgent::RefreshTelemetry,
// which samples the agent's state into gauges.
#include "agent/telemetry.h"

#include <sys/statvfs.h>

#include <chrono>

#include "agent/node_agent.h"
#include "base/log.h"

namespace safepoint::agent {

namespace {

using json = nlohmann::json;

// Bounds of the histograms (seconds).
const std::vector<double> kBlockingBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                              0.5,   1,      2.5,   5,    10,    30,   60};
const std::vector<double> kPersistBuckets = {0.01, 0.05, 0.1, 0.25, 0.5, 1,   2.5,
                                             5,    10,   30,  60,   120, 300, 900};

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string Str(uint64_t v) { return std::to_string(v); }

// A flush reason as a label value and event field: FlushReasonName's first word ("emergency").
std::string ReasonToken(FlushReason reason) {
  std::string_view name = FlushReasonName(reason);
  return std::string(name.substr(0, name.find(' ')));
}

// A URI as a label value: without its query (options, possibly credentials) and user info.
std::string PublicUri(const std::string& uri) {
  std::string out = uri.substr(0, uri.find('?'));
  const size_t scheme = out.find("://");
  const size_t at = out.find('@');
  if (scheme != std::string::npos && at != std::string::npos && at > scheme &&
      out.find('/', scheme + 3) > at) {
    out.erase(scheme + 3, at + 1 - (scheme + 3));
  }
  return out;
}

}  // namespace

Telemetry::Telemetry(const std::string& job)
    : job_(job), registry_(Labels{{"safepoint_job", job}}) {
  using T = MetricType;
  MetricsRegistry& r = registry_;
  r.Declare("safepoint_saves_total", T::kCounter,
            "Snapshots a rank took into shared memory (reported by the training process).");
  r.Declare("safepoint_saves_skipped_total", T::kCounter,
            "Saves skipped because no snapshot slot was free (on_busy=\"skip\").");
  r.Declare("safepoint_snapshot_bytes_total", T::kCounter,
            "Bytes of the snapshots copied into shared memory.");
  r.Declare("safepoint_save_blocking_seconds", T::kHistogram,
            "Time a save blocked the training process (the copy into shared memory).",
            kBlockingBuckets);
  r.Declare("safepoint_persist_seconds", T::kHistogram,
            "Time to persist to a tier: tier 0 one rank's image, tier N >= 1 a step copied from "
            "tier N-1.",
            kPersistBuckets);
  r.Declare("safepoint_persisted_bytes_total", T::kCounter, "Bytes persisted to a tier.");
  r.Declare("safepoint_persists_total", T::kCounter,
            "Persists by tier and result (ok, failed, superseded); on tiers >= 1 these are the "
            "copies between tiers.");
  r.Declare("safepoint_commits_total", T::kCounter, "Steps seen committed on a tier.");
  r.Declare("safepoint_last_commit_timestamp_seconds", T::kGauge,
            "Unix time of the newest commit on a tier (staleness: time() minus this).");
  r.Declare("safepoint_commit_interval_seconds", T::kGauge,
            "Moving average of the time between commits on a tier (the expected interval).");
  r.Declare("safepoint_newest_committed_step", T::kGauge, "The newest step committed on a tier.");
  r.Declare("safepoint_tier_info", T::kGauge, "The storage URI of each tier (value 1).");
  r.Declare("safepoint_tier_up", T::kGauge, "1 when a lower tier's storage is reachable.");
  r.Declare("safepoint_tier_pending_steps", T::kGauge,
            "Steps waiting for or being copied to a lower tier (0 to 2).");
  r.Declare("safepoint_tier_lag_seconds", T::kGauge,
            "Time from a step's commit on tier 0 to its commit on this tier (the last copy).");
  r.Declare("safepoint_tier_skipped_total", T::kCounter,
            "Steps offered to a lower tier that its schedule did not take.");
  r.Declare("safepoint_pending_persists", T::kGauge,
            "Snapshots queued or being persisted to tier 0.");
  r.Declare("safepoint_failures_total", T::kCounter,
            "Failures by kind (persist, tier_copy, replication) and status code.");
  r.Declare("safepoint_checksum_failures_total", T::kCounter,
            "Bytes that failed their checksums, by where they were found.");
  r.Declare(
      "safepoint_emergency_flushes_total", T::kCounter,
      "Snapshots persisted because their writer died, the agent adopted them or was stopped.");
  r.Declare("safepoint_restores_total", T::kCounter, "Restores by source (memory, peer, storage).");
  r.Declare("safepoint_restore_seconds", T::kHistogram, "Time a restore took, by source.",
            kPersistBuckets);
  r.Declare("safepoint_replication_pushes_total", T::kCounter,
            "Snapshots pushed to peer nodes, by result (ok, failed, superseded).");
  r.Declare("safepoint_replication_protected", T::kGauge,
            "1 when a rank's newest replicated snapshot survives the tolerated node losses.");
  r.Declare("safepoint_replication_lag_seconds", T::kGauge,
            "Time the last push of a rank's snapshot to its peers took.");
  r.Declare("safepoint_shm_used_bytes", T::kGauge, "Shared memory held by this job's slots.");
  r.Declare("safepoint_shm_free_bytes", T::kGauge,
            "Free bytes of the shared-memory filesystem the slots are on.");
  r.Declare("safepoint_shm_size_bytes", T::kGauge,
            "Size of the shared-memory filesystem the slots are on.");
  r.Declare("safepoint_ranks_connected", T::kGauge, "Training processes connected to the agent.");
  r.Declare("safepoint_storage_requests_total", T::kCounter,
            "Storage requests the agent made, by URI scheme and operation (list, head, get, "
            "create, write, put, delete, cleanup).");
  r.Declare("safepoint_storage_metadata_bytes_total", T::kCounter,
            "Metadata bytes the agent listed, read or wrote (names, COMMIT records, manifests), "
            "by URI scheme.");
  r.Declare("safepoint_storage_data_bytes_total", T::kCounter,
            "Tensor data bytes (images, chunks) the agent read or wrote, by scheme and direction.");
  r.Declare("safepoint_agent_start_time_seconds", T::kGauge, "Unix time the agent started.");
  r.Set("safepoint_agent_start_time_seconds", {}, UnixNow());
  // Failure counters exist at 0 from the start: Prometheus' increase() sees the first failure
  // only if the series was there before it (the alerts in deploy/prometheus depend on it).
  for (const char* result : {"ok", "failed", "superseded"}) {
    r.Add("safepoint_persists_total", {{"tier", "0"}, {"result", result}}, 0);
  }
  for (const char* where : {"persist", "tier_copy", "replication", "memory", "storage"}) {
    r.Add("safepoint_checksum_failures_total", {{"where", where}}, 0);
  }
  r.Add("safepoint_replication_pushes_total", {{"result", "failed"}}, 0);
}

Status Telemetry::StartMetrics(const std::string& address) {
  if (server_.running()) {
    if (address != server_.address()) {
      spdlog::warn("metrics: already serving {} (asked for {}); keeping it", server_.url(),
                   address);
    }
    return Status::OK();
  }
  Status s = server_.Start(address, &registry_);
  metrics_error_ = s.ok() ? "" : s.ToString();
  if (s.ok()) {
    spdlog::info("metrics at {}", server_.url());
  } else {
    spdlog::error("metrics: {}", s.ToString());
  }
  return s;
}

Status Telemetry::OpenEventLog(const std::string& path) {
  if (events_.is_open() && events_.path() == path) return Status::OK();
  Status s = events_.Open(path, EventLogMaxBytes());
  event_log_error_ = s.ok() ? "" : s.ToString();
  if (!s.ok()) spdlog::error("event log: {}", s.ToString());
  return s;
}

void Telemetry::Failure(const std::string& kind, const Status& s, uint32_t rank, uint64_t step,
                        std::optional<size_t> tier) {
  const std::string code(StatusCodeName(s.code()));
  registry_.Add("safepoint_failures_total", {{"kind", kind}, {"code", code}});
  if (s.code() == StatusCode::kCorruption) {
    registry_.Add("safepoint_checksum_failures_total", {{"where", kind}});
  }
  json f = {{"kind", kind}, {"rank", rank}, {"step", step}, {"code", code}, {"error", s.message()}};
  if (tier) f["tier"] = *tier;
  events_.Write("failure", job_, f);
}

void Telemetry::Saved(uint32_t rank, uint64_t step, bool saved, double blocking_seconds,
                      uint64_t bytes) {
  const Labels r = {{"rank", Str(rank)}};
  if (!saved) {
    registry_.Add("safepoint_saves_skipped_total", r);
    events_.Write(
        "save", job_,
        {{"rank", rank}, {"step", step}, {"skipped", true}, {"seconds", blocking_seconds}});
    return;
  }
  registry_.Add("safepoint_saves_total", r);
  registry_.Add("safepoint_snapshot_bytes_total", r, static_cast<double>(bytes));
  registry_.Observe("safepoint_save_blocking_seconds", r, blocking_seconds);
  events_.Write("save", job_,
                {{"rank", rank}, {"step", step}, {"bytes", bytes}, {"seconds", blocking_seconds}});
}

void Telemetry::Restored(uint32_t rank, uint64_t step, const std::string& source, double seconds,
                         uint64_t bytes) {
  registry_.Add("safepoint_restores_total", {{"source", source}});
  registry_.Observe("safepoint_restore_seconds", {{"source", source}}, seconds);
  events_.Write(
      "restore", job_,
      {{"rank", rank}, {"step", step}, {"source", source}, {"bytes", bytes}, {"seconds", seconds}});
}

void Telemetry::ChecksumFailure(uint32_t rank, uint64_t step, const std::string& where,
                                const std::string& error) {
  registry_.Add("safepoint_checksum_failures_total", {{"where", where}});
  events_.Write("failure", job_,
                {{"kind", "checksum"},
                 {"where", where},
                 {"rank", rank},
                 {"step", step},
                 {"code", "Corruption"},
                 {"error", error}});
}

void Telemetry::Persisted(const PersistResult& r) {
  const uint32_t rank = r.task.rank;
  const uint64_t step = r.task.step;
  const std::string reason = ReasonToken(r.task.reason);
  if (r.superseded) {
    registry_.Add("safepoint_persists_total", {{"tier", "0"}, {"result", "superseded"}});
    events_.Write(
        "persist", job_,
        {{"rank", rank}, {"step", step}, {"tier", 0}, {"reason", reason}, {"superseded", true}});
    return;
  }
  if (!r.status.ok()) {
    registry_.Add("safepoint_persists_total", {{"tier", "0"}, {"result", "failed"}});
    Failure("persist", r.status, rank, step, 0);
    return;
  }
  registry_.Add("safepoint_persists_total", {{"tier", "0"}, {"result", "ok"}});
  registry_.Add("safepoint_persisted_bytes_total", {{"tier", "0"}}, static_cast<double>(r.bytes));
  registry_.Observe("safepoint_persist_seconds", {{"tier", "0"}}, r.seconds);
  events_.Write("persist", job_,
                {{"rank", rank},
                 {"step", step},
                 {"tier", 0},
                 {"bytes", r.bytes},
                 {"seconds", r.seconds},
                 {"reason", reason},
                 {"committed", r.committed}});
  if (r.committed) Committed(0, step, UnixNow());
}

void Telemetry::FlushQueued(uint32_t rank, uint64_t step, FlushReason reason) {
  const std::string why = ReasonToken(reason);
  registry_.Add("safepoint_emergency_flushes_total", {{"reason", why}});
  events_.Write("flush", job_, {{"rank", rank}, {"step", step}, {"reason", why}});
}

void Telemetry::Replicated(const PushOutcome& o) {
  const uint32_t rank = o.task.rank;
  const Labels r = {{"rank", Str(rank)}};
  if (o.superseded) {
    registry_.Add("safepoint_replication_pushes_total", {{"result", "superseded"}});
    return;
  }
  registry_.Set("safepoint_replication_protected", r, o.is_protected ? 1 : 0);
  if (!o.status.ok()) {
    registry_.Add("safepoint_replication_pushes_total", {{"result", "failed"}});
    Failure("replication", o.status, rank, o.task.step, std::nullopt);
    return;
  }
  registry_.Add("safepoint_replication_pushes_total", {{"result", "ok"}});
  registry_.Set("safepoint_replication_lag_seconds", r, o.seconds);
  events_.Write("replicate", job_,
                {{"rank", rank},
                 {"step", o.task.step},
                 {"bytes", o.bytes},
                 {"seconds", o.seconds},
                 {"protected", o.is_protected}});
}

void Telemetry::Committed(size_t tier, uint64_t step, double unix_seconds, uint64_t bytes,
                          double seconds) {
  Told& told = told_[tier];
  if ((told.floor && step <= *told.floor) || told.steps.contains(step) ||
      (!told.steps.empty() && step < *told.steps.begin() && told.steps.size() >= kMaxToldSteps)) {
    return;
  }
  const std::optional<uint64_t> newest = told.Newest();
  told.steps.insert(step);
  while (told.steps.size() > kMaxToldSteps) told.steps.erase(told.steps.begin());
  const Labels t = {{"tier", Str(tier)}};
  registry_.Add("safepoint_commits_total", t);
  json f = {{"tier", tier}, {"step", step}};
  if (tier > 0) f.update({{"bytes", bytes}, {"seconds", seconds}});
  if (newest && step < *newest) {
    // An older step's commit finished after a newer one's: its event and count, not the
    // gauges of the newest commit.
    f["after_newer"] = *newest;
    events_.Write("commit", job_, f);
    return;
  }
  registry_.Set("safepoint_last_commit_timestamp_seconds", t, unix_seconds);
  registry_.Set("safepoint_newest_committed_step", t, static_cast<double>(step));
  if (auto it = last_commit_.find(tier); it != last_commit_.end() && unix_seconds > it->second) {
    const double gap = unix_seconds - it->second;
    auto avg = interval_.find(tier);
    const double next = avg == interval_.end() ? gap : 0.7 * avg->second + 0.3 * gap;
    interval_[tier] = next;
    registry_.Set("safepoint_commit_interval_seconds", t, next);
  }
  last_commit_[tier] = unix_seconds;
  events_.Write("commit", job_, f);
}

void Telemetry::KnownCommit(size_t tier, uint64_t step, double unix_seconds) {
  const Labels t = {{"tier", Str(tier)}};
  registry_.Set("safepoint_last_commit_timestamp_seconds", t, unix_seconds);
  registry_.Set("safepoint_newest_committed_step", t, static_cast<double>(step));
  last_commit_[tier] = unix_seconds;
  told_[tier].floor = step;
}

void Telemetry::SetTierUris(const std::vector<std::string>& uris) {
  registry_.Clear("safepoint_tier_info");
  for (size_t i = 0; i < uris.size(); ++i) {
    registry_.Set("safepoint_tier_info", {{"tier", Str(i)}, {"uri", PublicUri(uris[i])}}, 1);
    if (i == 0) continue;
    for (const char* result : {"ok", "failed"}) {
      registry_.Add("safepoint_persists_total", {{"tier", Str(i)}, {"result", result}}, 0);
    }
  }
}

void Telemetry::TierStates(const std::vector<TierState>& states) {
  for (const TierState& st : states) {
    const Labels t = {{"tier", Str(st.index)}};
    registry_.Set("safepoint_tier_up", t, st.open ? 1 : 0);
    registry_.Set("safepoint_tier_pending_steps", t, (st.pending ? 1 : 0) + (st.in_flight ? 1 : 0));
    registry_.Set("safepoint_tier_lag_seconds", t, st.last_lag_seconds);
    const TierState before = last_states_.count(st.index) ? last_states_[st.index] : TierState{};
    if (st.skipped > before.skipped) {
      registry_.Add("safepoint_tier_skipped_total", t,
                    static_cast<double>(st.skipped - before.skipped));
    }
    if (st.copies > before.copies) {
      // Copies are whole steps on slow storage: more than one between two samples (a second
      // apart) is rare; each is counted, the last one's size and time are observed.
      const double n = static_cast<double>(st.copies - before.copies);
      registry_.Add("safepoint_persists_total", {{"tier", Str(st.index)}, {"result", "ok"}}, n);
      registry_.Add("safepoint_persisted_bytes_total", t,
                    static_cast<double>(st.last_copy_bytes) * n);
      registry_.Observe("safepoint_persist_seconds", t, st.last_copy_seconds);
      if (st.newest) {
        Committed(st.index, *st.newest, static_cast<double>(st.last_copy_unix_ns) / 1e9,
                  st.last_copy_bytes, st.last_copy_seconds);
      }
    }
    if (st.failures > before.failures) {
      registry_.Add("safepoint_persists_total", {{"tier", Str(st.index)}, {"result", "failed"}},
                    static_cast<double>(st.failures - before.failures));
      // The tier keeps only its last error; its code is not kept: count it as an I/O error
      // unless the text says the bytes were damaged.
      const bool corrupt = st.last_error.find("Corruption") != std::string::npos;
      const Status s(corrupt ? StatusCode::kCorruption : StatusCode::kIOError, st.last_error);
      Failure("tier_copy", s, 0, st.pending.value_or(st.in_flight.value_or(0)), st.index);
    }
    last_states_[st.index] = st;
  }
}

void Telemetry::SetPending(size_t persists_pending) {
  registry_.Set("safepoint_pending_persists", {}, static_cast<double>(persists_pending));
}

void Telemetry::SetSharedMemory(uint64_t used, uint64_t free, uint64_t size) {
  registry_.Set("safepoint_shm_used_bytes", {}, static_cast<double>(used));
  registry_.Set("safepoint_shm_free_bytes", {}, static_cast<double>(free));
  registry_.Set("safepoint_shm_size_bytes", {}, static_cast<double>(size));
}

void Telemetry::SetRanksConnected(size_t n) {
  registry_.Set("safepoint_ranks_connected", {}, static_cast<double>(n));
}

void Telemetry::SetStorageRequests(
    const std::vector<std::pair<std::string, StorageRequestCounts>>& now) {
  for (const auto& [scheme, c] : now) {
    StorageRequestCounts& told = storage_told_[scheme];
    const std::pair<const char*, uint64_t StorageRequestCounts::*> ops[] = {
        {"list", &StorageRequestCounts::list},   {"head", &StorageRequestCounts::head},
        {"get", &StorageRequestCounts::get},     {"create", &StorageRequestCounts::create},
        {"write", &StorageRequestCounts::write}, {"put", &StorageRequestCounts::put},
        {"delete", &StorageRequestCounts::del},  {"cleanup", &StorageRequestCounts::cleanup}};
    for (const auto& [op, field] : ops) {
      registry_.Add("safepoint_storage_requests_total", {{"scheme", scheme}, {"op", op}},
                    static_cast<double>(c.*field - told.*field));
    }
    registry_.Add("safepoint_storage_metadata_bytes_total", {{"scheme", scheme}},
                  static_cast<double>(c.metadata_bytes - told.metadata_bytes));
    registry_.Add("safepoint_storage_data_bytes_total", {{"scheme", scheme}, {"dir", "read"}},
                  static_cast<double>(c.data_bytes_read - told.data_bytes_read));
    registry_.Add("safepoint_storage_data_bytes_total", {{"scheme", scheme}, {"dir", "written"}},
                  static_cast<double>(c.data_bytes_written - told.data_bytes_written));
    told = c;
  }
}

void NodeAgent::StartTelemetry() {
  const std::string events =
      opt_.event_log.empty() ? protocol::EventLogPath(job_dir_) : opt_.event_log;
  (void)telemetry_.OpenEventLog(events);  // a failure is logged and shown in the status
  if (!opt_.metrics_address.empty()) (void)telemetry_.StartMetrics(opt_.metrics_address);
}

// A training process's hello may ask for metrics and name the event log. The first address
// asked for is served for the agent's lifetime; an event log named by the process replaces the
// default one (but not one given to the agent on its command line).
void NodeAgent::ConfigureTelemetry(const protocol::HelloRequest& hello) {
  if (!hello.metrics.empty()) (void)telemetry_.StartMetrics(hello.metrics);
  if (!hello.event_log.empty() && opt_.event_log.empty()) {
    (void)telemetry_.OpenEventLog(hello.event_log);
  }
}

void NodeAgent::HandleReport(Client& c, const protocol::ReportNote& note) {
  const double seconds = static_cast<double>(note.nanos) / 1e9;
  // Label values stay bounded whatever a client sends.
  const std::string source =
      note.source == "memory" || note.source == "peer" || note.source == "storage" ? note.source
                                                                                   : "other";
  // The job's measurement history is rank 0's (history_recorder.h).
  const bool history = c.rank == 0;
  if (note.event == "save") {
    telemetry_.Saved(c.rank, note.step, note.saved, seconds, note.bytes);
    if (history) {
      // The save's step (how long a step takes) and the job's shape (who restores from where)
      // go into the history with the save lines (src/advisor/history.h).
      history_.Saved(seconds, note.step, [this] {
        advisor::JobShape shape;
        shape.world_size = config_ ? config_->world_size : 0;
        shape.node_ranks = static_cast<uint32_t>(ranks_.size());
        shape.peer_copies = replicator_.enabled();
        return shape;
      });
    }
  } else if (note.event == "restore") {
    telemetry_.Restored(c.rank, note.step, source, seconds, note.bytes);
    if (history) history_.Restored(note.level.empty() ? note.source : note.level, seconds);
  } else if (note.event == "start") {
    if (history) history_.Started(note.step);
  } else if (note.event == "checksum") {
    telemetry_.ChecksumFailure(c.rank, note.step, source, note.error);
  } else {
    spdlog::debug("pid {}: report of an unknown event '{}' ignored", c.pid, note.event);
  }
}

// On every turn of the loop, turns what changed into events: a newer commit on tier 0, and the
// lower tiers' copies and failures (their workers wake the loop after each attempt, so each is
// seen on its own). Samples the rest of the state into gauges about once a second (and right
// away when `now`).
void NodeAgent::RefreshTelemetry(bool now) {
  // Every commit this agent learnt of, its own and another node's agent's (a commit note, a
  // poll): one event each, in step order.
  std::sort(commits_to_tell_.begin(), commits_to_tell_.end());
  for (uint64_t step : commits_to_tell_) telemetry_.Committed(0, step, UnixNow());
  commits_to_tell_.clear();
  if (tiers_.started()) telemetry_.TierStates(tiers_.States());
  const double t = MonotonicSeconds();
  if (!now && t - last_telemetry_ < 1.0) return;
  last_telemetry_ = t;
  const PersistQueue::Progress progress = queue_.progress();
  telemetry_.SetPending(progress.queued + (progress.in_flight ? 1 : 0));
  uint64_t used = 0;
  size_t connected = 0;
  for (auto& [rank, rs] : ranks_) {
    connected += rs.connected ? 1 : 0;
    if (!rs.arena || !rs.arena->Refresh().ok()) continue;
    for (const SlotInfo& s : rs.arena->Slots()) used += s.capacity;
  }
  struct statvfs vfs {};
  if (::statvfs(opt_.shm_dir.c_str(), &vfs) == 0) {
    telemetry_.SetSharedMemory(used, static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize,
                               static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize);
  }
  telemetry_.SetRanksConnected(connected);
  telemetry_.SetStorageRequests(StorageRequestCountsByScheme());
}

}  // namespace safepoint::agent
