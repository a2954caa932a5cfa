// The agent protocol (src/protocol/protocol.h): typed messages, framing, the job directory's files.
#include "protocol/protocol.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <variant>

#include "base/bytes.h"
#include "base/unique_fd.h"

namespace safepoint::protocol {

using internal::AppendLE;
using internal::LoadLE;
using json = nlohmann::json;

namespace {

Status ProtocolError(const std::string& what) { return InvalidArgument("protocol error: " + what); }

Result<json> ParseObject(std::string_view payload) {
  json j = json::parse(payload.empty() ? std::string_view("{}") : payload, nullptr,
                       /*allow_exceptions=*/false);
  if (j.is_discarded()) return ProtocolError("the payload is not valid JSON");
  if (!j.is_object()) return ProtocolError("the payload is not a JSON object");
  return j;
}

// Reads field `key` of `j` into `out`, checking its presence and JSON type (and range).
template <typename T>
Status Field(const json& j, const char* key, T* out) {
  auto it = j.find(key);
  if (it == j.end()) return ProtocolError(std::string("field '") + key + "' is missing");
  bool ok;
  if constexpr (std::is_same_v<T, bool>) {
    ok = it->is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    ok = it->is_number_unsigned() && it->template get<uint64_t>() <= std::numeric_limits<T>::max();
  } else if constexpr (std::is_same_v<T, std::string>) {
    ok = it->is_string();
  } else {
    static_assert(std::is_same_v<T, SkipRanges>);
    ok = it->is_array();
    for (const json& r : *it) {
      ok = ok && r.is_array() && r.size() == 2 && r[0].is_number_unsigned() &&
           r[1].is_number_unsigned() && r[0].get<uint64_t>() <= UINT32_MAX &&
           r[1].get<uint64_t>() <= UINT32_MAX;
    }
  }
  if (!ok) return ProtocolError(std::string("field '") + key + "' has the wrong type");
  *out = it->template get<T>();
  return Status::OK();
}

// One field of a message: its key, where it goes, and whether it may be absent.
struct FieldRef {
  const char* key;
  std::variant<uint32_t*, uint64_t*, bool*, std::string*, SkipRanges*> out;
  bool optional = false;
};

// Parses a payload and reads every field into place; the object, for further fields.
Result<json> Parse(std::string_view payload, std::initializer_list<FieldRef> fields) {
  SP_ASSIGN_OR_RETURN(json j, ParseObject(payload));
  for (const FieldRef& f : fields) {
    if (f.optional && !j.contains(f.key)) continue;
    SP_RETURN_IF_ERROR(std::visit([&](auto* out) { return Field(j, f.key, out); }, f.out));
  }
  return j;
}

json ReportJson(const ReportNote& m) {
  json j = {{"event", m.event},
            {"step", m.step},
            {"saved", m.saved},
            {"nanos", m.nanos},
            {"bytes", m.bytes}};
  if (!m.source.empty()) j["source"] = m.source;
  if (!m.error.empty()) j["error"] = m.error;
  if (!m.level.empty()) j["level"] = m.level;
  return j;
}

json StatusFields(const Status& s) {
  if (s.ok()) return {{"ok", true}};
  return {{"ok", false}, {"code", static_cast<int>(s.code())}, {"error", s.message()}};
}

Status DecodeStatus(const json& j, Status* out) {
  bool ok = false;
  SP_RETURN_IF_ERROR(Field(j, "ok", &ok));
  if (ok) {
    *out = Status::OK();
    return Status::OK();
  }
  std::string error;
  SP_RETURN_IF_ERROR(Field(j, "error", &error));
  int code = static_cast<int>(StatusCode::kIOError);
  if (auto it = j.find("code"); it != j.end() && it->is_number_integer()) code = it->get<int>();
  if (code <= 0 || code > static_cast<int>(StatusCode::kSuperseded))
    code = static_cast<int>(StatusCode::kIOError);
  *out = Status(static_cast<StatusCode>(code), error);
  return Status::OK();
}

}  // namespace

json EncodeTiers(const std::vector<TierSpec>& tiers) {
  json out = json::array();
  for (const TierSpec& t : tiers) {
    json tier = {
        {"uri", t.uri}, {"every", t.every}, {"every_seconds", t.every_seconds}, {"keep", t.keep}};
    if (t.compression != "none") tier["compression"] = t.compression;
    if (t.incremental) tier["incremental"] = true;
    out.push_back(std::move(tier));
  }
  return out;
}

Status DecodeTiers(const json& j, std::vector<TierSpec>* out) {
  out->clear();
  if (!j.is_array()) return ProtocolError("'tiers' is not a list");
  for (const json& t : j) {
    TierSpec spec;
    if (!t.is_object()) return ProtocolError("a tier is not an object");
    SP_RETURN_IF_ERROR(Field(t, "uri", &spec.uri));
    SP_RETURN_IF_ERROR(Field(t, "every", &spec.every));
    SP_RETURN_IF_ERROR(Field(t, "keep", &spec.keep));
    auto it = t.find("every_seconds");
    if (it == t.end() || !it->is_number()) {
      return ProtocolError("field 'every_seconds' of a tier is missing or not a number");
    }
    spec.every_seconds = it->get<double>();
    if (t.contains("compression")) SP_RETURN_IF_ERROR(Field(t, "compression", &spec.compression));
    if (t.contains("incremental")) SP_RETURN_IF_ERROR(Field(t, "incremental", &spec.incremental));
    out->push_back(std::move(spec));
  }
  return Status::OK();
}

std::string Encode(const HelloRequest& m) {
  json j = {{"rank", m.rank},
            {"world_size", m.world_size},
            {"storage", m.storage},
            {"keep", m.keep},
            {"pid", m.pid}};
  if (!m.tiers.empty()) j["tiers"] = EncodeTiers(m.tiers);
  if (!m.metrics.empty()) j["metrics"] = m.metrics;
  if (!m.event_log.empty()) j["event_log"] = m.event_log;
  if (m.compression != "none") j["compression"] = m.compression;
  if (m.incremental) j["incremental"] = true;
  if (m.attempt != 0) j["attempt"] = m.attempt;
  return j.dump();
}
std::string Encode(const HelloReply& m) {
  json j = {{"ok", true}, {"agent_pid", m.agent_pid}, {"job_dir", m.job_dir}};
  if (m.claim_epoch != 0) j["claim_epoch"] = m.claim_epoch;
  return j.dump();
}
std::string Encode(const SnapshotNote& m) {
  json j = {{"slot", m.slot},
            {"generation", m.generation},
            {"step", m.step},
            {"persist", m.persist},
            {"leased", m.leased}};
  if (!m.skip.empty()) j["skip"] = m.skip;
  if (m.report) j["report"] = ReportJson(*m.report);
  return j.dump();
}
std::string Encode(const WaitRequest& m) {
  return json{{"step", m.step}, {"persisted", m.persisted}}.dump();
}
std::string Encode(const WaitReply& m) {
  json j = StatusFields(m.status);
  j["step"] = m.step;
  return j.dump();
}
std::string Encode(const CloseReply& m) { return StatusFields(m.status).dump(); }
std::string Encode(const ErrorReply& m) { return json{{"error", m.error}}.dump(); }

Status Decode(std::string_view payload, EmptyRequest*) { return Parse(payload, {}).status(); }
Status Decode(std::string_view payload, HelloRequest* out) {
  out->metrics.clear();
  out->event_log.clear();
  out->compression = "none";  // optional: a hello without them asks for the plain layout
  out->incremental = false;
  out->attempt = 0;
  SP_ASSIGN_OR_RETURN(json j, Parse(payload, {{"rank", &out->rank},
                                              {"world_size", &out->world_size},
                                              {"storage", &out->storage},
                                              {"keep", &out->keep},
                                              {"pid", &out->pid, /*optional=*/true},
                                              {"metrics", &out->metrics, /*optional=*/true},
                                              {"event_log", &out->event_log, /*optional=*/true},
                                              {"compression", &out->compression, true},
                                              {"incremental", &out->incremental, true},
                                              {"attempt", &out->attempt, true}}));
  out->tiers.clear();
  if (auto it = j.find("tiers"); it != j.end()) SP_RETURN_IF_ERROR(DecodeTiers(*it, &out->tiers));
  return Status::OK();
}
Status Decode(std::string_view payload, HelloReply* out) {
  out->claim_epoch = 0;
  return Parse(payload, {{"agent_pid", &out->agent_pid},
                         {"job_dir", &out->job_dir},
                         {"claim_epoch", &out->claim_epoch, /*optional=*/true}})
      .status();
}
Status Decode(std::string_view payload, SnapshotNote* out) {
  out->skip.clear();
  out->report.reset();
  SP_ASSIGN_OR_RETURN(json j, Parse(payload, {{"slot", &out->slot},
                                              {"generation", &out->generation},
                                              {"step", &out->step},
                                              {"persist", &out->persist},
                                              {"leased", &out->leased},
                                              {"skip", &out->skip, /*optional=*/true}}));
  auto it = j.find("report");
  if (it == j.end()) return Status::OK();
  if (!it->is_object()) return ProtocolError("field 'report' has the wrong type");
  out->report.emplace();
  return Decode(it->dump(), &*out->report);
}
Status Decode(std::string_view payload, WaitRequest* out) {
  out->persisted = true;
  return Parse(payload, {{"step", &out->step}, {"persisted", &out->persisted, /*optional=*/true}})
      .status();
}
Status Decode(std::string_view payload, WaitReply* out) {
  SP_ASSIGN_OR_RETURN(json j, Parse(payload, {{"step", &out->step}}));
  return DecodeStatus(j, &out->status);
}
Status Decode(std::string_view payload, CloseReply* out) {
  SP_ASSIGN_OR_RETURN(json j, Parse(payload, {}));
  return DecodeStatus(j, &out->status);
}
Status Decode(std::string_view payload, ErrorReply* out) {
  return Parse(payload, {{"error", &out->error}}).status();
}

std::string Encode(const PeerSetupRequest& m) {
  return json{{"node", m.node},
              {"bind_host", m.bind_host},
              {"timeout_ms", m.timeout_ms},
              {"port", m.port},
              {"max_shm_bytes", m.max_shm_bytes}}
      .dump();
}
std::string Encode(const PeerSetupReply& m) { return json{{"address", m.address}}.dump(); }
std::string Encode(const Membership& m) {
  json nodes = json::array();
  for (const PeerNode& n : m.nodes) nodes.push_back({{"node", n.node}, {"address", n.address}});
  return json{{"epoch", m.epoch},       {"node_index", m.node_index},
              {"nodes", nodes},         {"redundancy", m.redundancy},
              {"secret", m.secret_hex}, {"bandwidth", m.bandwidth}}
      .dump();
}
std::string Encode(const AckReply& m) { return StatusFields(m.status).dump(); }
std::string Encode(const PeerListRequest& m) { return json{{"rank", m.rank}}.dump(); }
std::string Encode(const PeerListReply& m) {
  json list = json::array();
  for (const PeerCopy& s : m.snapshots) {
    list.push_back({{"step", s.step},
                    {"attempt", s.attempt},
                    {"complete_ns", s.complete_ns},
                    {"image_bytes", s.image_bytes}});
  }
  return json{{"snapshots", list}}.dump();
}
std::string Encode(const PeerFetchRequest& m) {
  json j{{"rank", m.rank}, {"step", m.step}, {"attempt", m.attempt}};
  if (!m.from_address.empty()) {
    j["from_address"] = m.from_address;
    j["from_node"] = m.from_node;
    j["from_job"] = m.from_job;
    j["from_secret"] = m.from_secret_hex;
    j["timeout_ms"] = m.timeout_ms;
  }
  return j.dump();
}
std::string Encode(const PeerFetchReply& m) {
  json j = StatusFields(m.status);
  j["slot"] = m.slot;
  j["generation"] = m.generation;
  j["bytes"] = m.bytes;
  j["source"] = m.source;
  return j.dump();
}
std::string Encode(const PauseNote& m) { return json{{"paused", m.paused}}.dump(); }
std::string Encode(const ReportNote& m) { return ReportJson(m).dump(); }

Status Decode(std::string_view payload, PeerSetupRequest* out) {
  return Parse(payload, {{"node", &out->node},
                         {"bind_host", &out->bind_host},
                         {"timeout_ms", &out->timeout_ms, /*optional=*/true},
                         {"port", &out->port, /*optional=*/true},
                         {"max_shm_bytes", &out->max_shm_bytes, /*optional=*/true}})
      .status();
}
Status Decode(std::string_view payload, PeerSetupReply* out) {
  return Parse(payload, {{"address", &out->address}}).status();
}
Status Decode(std::string_view payload, Membership* out) {
  SP_ASSIGN_OR_RETURN(json j, Parse(payload, {{"epoch", &out->epoch},
                                              {"node_index", &out->node_index},
                                              {"redundancy", &out->redundancy},
                                              {"secret", &out->secret_hex},
                                              {"bandwidth", &out->bandwidth}}));
  auto it = j.find("nodes");
  if (it == j.end() || !it->is_array()) return ProtocolError("field 'nodes' is not a list");
  out->nodes.clear();
  for (const json& n : *it) {
    if (!n.is_object()) return ProtocolError("an element of 'nodes' is not an object");
    PeerNode a;
    SP_RETURN_IF_ERROR(Field(n, "node", &a.node));
    SP_RETURN_IF_ERROR(Field(n, "address", &a.address));
    out->nodes.push_back(std::move(a));
  }
  if (out->node_index >= out->nodes.size()) {
    return ProtocolError("node_index " + std::to_string(out->node_index) + " is not below " +
                         std::to_string(out->nodes.size()) + " nodes");
  }
  return Status::OK();
}
Status Decode(std::string_view payload, AckReply* out) {
  SP_ASSIGN_OR_RETURN(json j, Parse(payload, {}));
  return DecodeStatus(j, &out->status);
}
Status Decode(std::string_view payload, PeerListRequest* out) {
  return Parse(payload, {{"rank", &out->rank}}).status();
}
Status Decode(std::string_view payload, PeerListReply* out) {
  SP_ASSIGN_OR_RETURN(json j, Parse(payload, {}));
  auto it = j.find("snapshots");
  if (it == j.end() || !it->is_array()) return ProtocolError("field 'snapshots' is not a list");
  out->snapshots.clear();
  for (const json& e : *it) {
    if (!e.is_object()) return ProtocolError("an element of 'snapshots' is not an object");
    PeerCopy s;
    SP_RETURN_IF_ERROR(Field(e, "step", &s.step));
    SP_RETURN_IF_ERROR(Field(e, "attempt", &s.attempt));
    SP_RETURN_IF_ERROR(Field(e, "complete_ns", &s.complete_ns));
    SP_RETURN_IF_ERROR(Field(e, "image_bytes", &s.image_bytes));
    out->snapshots.push_back(s);
  }
  return Status::OK();
}
Status Decode(std::string_view payload, PeerFetchRequest* out) {
  return Parse(payload, {{"rank", &out->rank},
                         {"step", &out->step},
                         {"attempt", &out->attempt},
                         {"from_address", &out->from_address, /*optional=*/true},
                         {"from_node", &out->from_node, /*optional=*/true},
                         {"from_job", &out->from_job, /*optional=*/true},
                         {"from_secret", &out->from_secret_hex, /*optional=*/true},
                         {"timeout_ms", &out->timeout_ms, /*optional=*/true}})
      .status();
}
Status Decode(std::string_view payload, PeerFetchReply* out) {
  SP_ASSIGN_OR_RETURN(json j, Parse(payload, {{"slot", &out->slot},
                                              {"generation", &out->generation},
                                              {"bytes", &out->bytes},
                                              {"source", &out->source}}));
  return DecodeStatus(j, &out->status);
}
Status Decode(std::string_view payload, PauseNote* out) {
  return Parse(payload, {{"paused", &out->paused}}).status();
}
Status Decode(std::string_view payload, ReportNote* out) {
  out->source.clear();
  out->error.clear();
  out->level.clear();
  return Parse(payload, {{"event", &out->event},
                         {"step", &out->step},
                         {"saved", &out->saved},
                         {"nanos", &out->nanos},
                         {"bytes", &out->bytes},
                         {"source", &out->source, /*optional=*/true},
                         {"error", &out->error, /*optional=*/true},
                         {"level", &out->level, /*optional=*/true}})
      .status();
}

std::string EncodeFrame(MessageType type, std::string_view payload) {
  std::string out;
  out.reserve(kFrameHeaderBytes + payload.size());
  AppendLE<uint32_t>(out, static_cast<uint32_t>(4 + payload.size()));
  AppendLE<uint16_t>(out, kProtocolVersion);
  AppendLE<uint16_t>(out, static_cast<uint16_t>(type));
  out.append(payload);
  return out;
}

void FrameDecoder::Feed(std::span<const std::byte> data) {
  if (pos_ > 0 && pos_ == buf_.size()) {
    buf_.clear();
    pos_ = 0;
  }
  buf_.append(reinterpret_cast<const char*>(data.data()), data.size());
}

Result<std::optional<Message>> FrameDecoder::Next() {
  const size_t avail = buf_.size() - pos_;
  if (avail < 4) return std::optional<Message>();
  const auto* p = reinterpret_cast<const std::byte*>(buf_.data() + pos_);
  const uint32_t len = LoadLE<uint32_t>(p);
  if (len < 4 || len > kMaxMessageBytes) {
    return InvalidArgument("protocol error: frame length " + std::to_string(len) +
                           " is out of range (4.." + std::to_string(kMaxMessageBytes) + ")");
  }
  if (avail < 4 + static_cast<size_t>(len)) return std::optional<Message>();
  const uint16_t version = LoadLE<uint16_t>(p + 4);
  const uint16_t type = LoadLE<uint16_t>(p + 6);
  if (version != kProtocolVersion) {
    return InvalidArgument("protocol error: version " + std::to_string(version) +
                           ", this build speaks version " + std::to_string(kProtocolVersion));
  }
  if (type < static_cast<uint16_t>(MessageType::kHello) ||
      type > static_cast<uint16_t>(kLastMessageType)) {
    return InvalidArgument("protocol error: unknown message type " + std::to_string(type));
  }
  Message m;
  m.type = static_cast<MessageType>(type);
  m.payload.assign(buf_.data() + pos_ + kFrameHeaderBytes, len - 4);
  pos_ += 4 + len;
  if (pos_ > (1u << 20) && pos_ * 2 > buf_.size()) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  return std::optional<Message>(std::move(m));
}

Status SendMessage(int fd, MessageType type, std::string_view payload, double timeout_s) {
  if (payload.size() + 4 > kMaxMessageBytes) return InvalidArgument("message too large");
  const std::string frame = EncodeFrame(type, payload);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(timeout_s, 0.0));
  size_t off = 0;
  while (off < frame.size()) {
    const ssize_t n = ::send(fd, frame.data() + off, frame.size() - off, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        int wait_ms = 1000;
        if (timeout_s >= 0) {
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
              deadline - std::chrono::steady_clock::now());
          if (left.count() <= 0) return Unavailable("the peer does not read its messages");
          wait_ms = static_cast<int>(std::min<int64_t>(left.count(), 1000));
        }
        pollfd pfd{fd, POLLOUT, 0};
        ::poll(&pfd, 1, wait_ms);
        continue;
      }
      return Unavailable(std::string("the safepoint agent connection failed: ") +
                         std::strerror(errno));
    }
    off += static_cast<size_t>(n);
  }
  return Status::OK();
}

Result<Message> ReceiveMessage(int fd, FrameDecoder& decoder, double timeout_s) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(timeout_s, 0.0));
  for (;;) {
    SP_ASSIGN_OR_RETURN(auto m, decoder.Next());
    if (m) return std::move(*m);
    int wait_ms = -1;
    if (timeout_s >= 0) {
      const auto left = deadline - std::chrono::steady_clock::now();
      wait_ms =
          static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(left).count());
      if (wait_ms <= 0) return Cancelled("timed out waiting for the safepoint agent");
    }
    pollfd pfd{fd, POLLIN, 0};
    const int rc = ::poll(&pfd, 1, wait_ms);
    if (rc < 0 && errno != EINTR) return IOError(std::string("poll: ") + std::strerror(errno));
    if (rc <= 0) continue;
    char buf[64 << 10];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return Unavailable("the safepoint agent closed the connection (did it exit?)");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return Unavailable(std::string("the safepoint agent connection failed: ") +
                         std::strerror(errno));
    }
    decoder.Feed({reinterpret_cast<const std::byte*>(buf), static_cast<size_t>(n)});
  }
}

std::string AgentSocketPath(const std::string& job_dir) { return job_dir + "/agent.sock"; }
std::string AgentLockPath(const std::string& job_dir) { return job_dir + "/agent.lock"; }
std::string AgentLogPath(const std::string& job_dir) { return job_dir + "/agent.log"; }
std::string JobConfigPath(const std::string& job_dir) { return job_dir + "/job.json"; }
std::string EventLogPath(const std::string& job_dir) { return job_dir + "/events.jsonl"; }

bool AgentAlive(const std::string& job_dir, uint32_t* pid) {
  const std::string path = AgentLockPath(job_dir);
  internal::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) return false;
  bool alive = false;
  if (::flock(fd.get(), LOCK_SH | LOCK_NB) != 0) {
    alive = errno == EWOULDBLOCK;
  } else {
    ::flock(fd.get(), LOCK_UN);
  }
  if (alive && pid != nullptr) {
    char buf[32] = {0};
    const ssize_t n = ::pread(fd.get(), buf, sizeof(buf) - 1, 0);
    *pid = n > 0 ? static_cast<uint32_t>(std::strtoul(buf, nullptr, 10)) : 0;
  }
  return alive;
}

}  // namespace safepoint::protocol
