// The agent's status document (src/agent/node_agent.h): what `safepoint status --json` prints and
// ckpt.status() returns under "agent". One JSON object: the job, its configuration, the newest
// committed step, the persist queue, the lower storage tiers (newest step, copies, failures, last
// error), and per rank its slots, pending persists, counters and last
// error and the messages received from it; `metrics_url` (null unless metrics are served),
// `event_log` (its path) and `history` (where this agent records the job's measurement
// history and its last write error; null unless it serves rank 0).
// `job_config_error` is set while job.json could not be written (a later agent could not
// adopt the job).
#include "agent/status.h"

#include "agent/node_agent.h"
#include "checkpoint/compression_policy.h"

namespace safepoint::agent {

namespace {
using json = nlohmann::json;
// How a storage stores steps and, once it wrote some, what compression chose and achieved.
json PackJson(const std::string& compression, bool incremental, const std::string& uri) {
  const PackReport r = PackReportFor(uri.find("://") == std::string::npos ? "file://" + uri : uri);
  return {{"compression", compression},
          {"incremental", incremental},
          {"compression_in_use", r.mode.empty() ? json(nullptr) : json(r.mode)},
          {"compression_ratio", r.stored_bytes > 0 ? json(r.ratio) : json(nullptr)}};
}
}  // namespace

nlohmann::ordered_json SlotsJson(const std::vector<SlotInfo>& slots) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const SlotInfo& s : slots) {
    out.push_back({{"slot", s.index},
                   {"state", SlotStateName(s.state)},
                   {"leased", s.leased},
                   {"step", s.step},
                   {"image_bytes", s.image_size},
                   {"capacity", s.capacity}});
  }
  return out;
}

nlohmann::json NodeAgent::StatusJson() {
  json ranks = json::array();
  for (auto& [rank, rs] : ranks_) {
    json slots = json::array();
    if (rs.arena && rs.arena->Refresh().ok()) slots = SlotsJson(rs.arena->Slots());
    auto optional = [](const std::optional<uint64_t>& v) { return v ? json(*v) : json(nullptr); };
    ranks.push_back({{"rank", rank},
                     {"pid", rs.pid},
                     {"connected", rs.connected},
                     {"closed", rs.closed},
                     {"slots", slots},
                     {"pending_persists", rs.pending.size()},
                     {"last_persisted_step", optional(rs.last_persisted_step)},
                     {"last_persist_seconds", rs.last_persist_seconds},
                     {"last_persist_bytes", rs.last_persist_bytes},
                     {"persists_ok", rs.persists_ok},
                     {"persists_failed", rs.persists_failed},
                     {"persists_superseded", rs.persists_superseded},
                     {"emergency_flushes", rs.emergency_flushes},
                     {"messages_received", rs.messages_received},
                     {"last_error", rs.last_error}});
  }
  const PersistQueue::Progress progress = queue_.progress();
  json in_flight = nullptr;
  if (progress.in_flight) {
    in_flight = {{"rank", progress.in_flight->rank}, {"step", progress.in_flight->step}};
  }
  // The lower storage tiers (only the agent of rank 0's node fills them; elsewhere they are
  // listed from the configuration, with "filled_here": false).
  json tiers = json::array();
  auto optional = [](const std::optional<uint64_t>& v) { return v ? json(*v) : json(nullptr); };
  const std::vector<TierState> states = tiers_.States();
  for (size_t i = 0; config_ && i < config_->tiers.size(); ++i) {
    const TierSpec& spec = config_->tiers[i];
    json t = {{"tier", i + 1},       {"uri", spec.uri},
              {"every", spec.every}, {"every_seconds", spec.every_seconds},
              {"keep", spec.keep},   {"filled_here", i < states.size()}};
    t.update(PackJson(spec.compression, spec.incremental, spec.uri));
    if (i < states.size()) {
      const TierState& st = states[i];
      t.update({{"open", st.open},
                {"newest_step", optional(st.newest)},
                {"last_copy_time", st.last_copy_unix_ns
                                       ? json(static_cast<double>(st.last_copy_unix_ns) / 1e9)
                                       : json(nullptr)},
                {"pending_step", optional(st.pending)},
                {"in_flight_step", optional(st.in_flight)},
                {"copies", st.copies},
                {"failures", st.failures},
                {"skipped", st.skipped},
                {"last_copy_bytes", st.last_copy_bytes},
                {"last_copy_seconds", st.last_copy_seconds},
                {"last_lag_seconds", st.last_lag_seconds},
                {"last_error", st.last_error}});
    }
    tiers.push_back(std::move(t));
  }
  return {{"agent_pid", ::getpid()},
          {"job", opt_.job},
          {"job_dir", job_dir_},
          {"storage", config_ ? json(config_->storage) : json(nullptr)},
          {"world_size", config_ ? json(config_->world_size) : json(nullptr)},
          // A world change under way (world_change.cc): the world size the job changes to.
          {"world_size_changing_to", world_change_ ? json(*world_change_) : json(nullptr)},
          {"keep", config_ ? json(config_->keep) : json(nullptr)},
          {"job_config_error", config_saved_.ok() ? json(nullptr) : json(config_saved_.ToString())},
          {"newest_committed", newest_committed_ ? json(*newest_committed_) : json(nullptr)},
          {"queued", progress.queued},
          {"in_flight", in_flight},
          {"ranks", ranks},
          {"tiers", tiers},
          {"metrics_url",
           telemetry_.metrics_url().empty() ? json(nullptr) : json(telemetry_.metrics_url())},
          {"metrics_error",
           telemetry_.metrics_error().empty() ? json(nullptr) : json(telemetry_.metrics_error())},
          {"event_log",
           telemetry_.event_log_path().empty() ? json(nullptr) : json(telemetry_.event_log_path())},
          // Why there is none: e.g. a file another user planted at its path (event_log.h).
          {"event_log_error",
           telemetry_.event_log_error().empty() ? json() : json(telemetry_.event_log_error())},
          {"storage_layout", config_ ? PackJson(config_->compression, config_->incremental,
                                                store_ ? store_->storage().uri() : config_->storage)
                                     : json(nullptr)},
          // Not for a membership given only for the commit relay (no redundancy).
          {"replication", replicator_.configured() && (replicator_.enabled() || !relay_.Active())
                              ? replicator_.StatusJson()
                              : json(nullptr)},
          {"commit_relay", RelayStatusJson()},
          {"history",
           history_.open()
               ? json{{"where", history_.where()},
                      {"error", history_.error().empty() ? json(nullptr) : json(history_.error())}}
               : json(nullptr)},
          {"storage_requests", StorageRequestsJson()}};
}

nlohmann::json StorageRequestCountsJson(const StorageRequestCounts& c) {
  return {{"list", c.list},
          {"head", c.head},
          {"get", c.get},
          {"create", c.create},
          {"write", c.write},
          {"put", c.put},
          {"delete", c.del},
          {"cleanup", c.cleanup},
          {"requests", c.requests()},
          {"metadata_bytes", c.metadata_bytes},
          {"data_bytes_read", c.data_bytes_read},
          {"data_bytes_written", c.data_bytes_written}};
}

// The agent process's storage requests by scheme (include/safepoint/storage.h).
nlohmann::json StorageRequestsJson() {
  json out = json::object();
  for (const auto& [scheme, c] : StorageRequestCountsByScheme()) {
    out[scheme] = StorageRequestCountsJson(c);
  }
  return out;
}

}  // namespace safepoint::agent
