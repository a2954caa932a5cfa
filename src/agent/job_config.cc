// JobConfig's file (src/agent/job_config.h).
#include "agent/job_config.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <nlohmann/json.hpp>

#include "base/json_fields.h"
#include "base/unique_fd.h"
#include "protocol/protocol.h"

namespace safepoint::agent {

using json = nlohmann::json;

Result<std::optional<JobConfig>> ReadJobConfig(const std::string& job_dir) {
  const std::string path = protocol::JobConfigPath(job_dir);
  internal::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) {
    if (errno == ENOENT) return std::optional<JobConfig>();
    return ErrnoStatus("open", path, errno);
  }
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus("read", path, errno);
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > (1 << 20)) return Corruption(path + ": larger than 1 MiB");
  }
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  JobConfig c;
  if (!j.is_object() || !internal::GetString(j, "storage", &c.storage, text.size()) ||
      !internal::GetU32(j, "world_size", &c.world_size) || c.world_size == 0 ||
      !internal::GetU32(j, "keep", &c.keep)) {
    return Corruption(path + ": not a job configuration (storage, world_size, keep)");
  }
  // Optional: a missing or mistyped compression leaves the default.
  (void)internal::GetString(j, "compression", &c.compression, text.size());
  if (auto it = j.find("incremental"); it != j.end() && it->is_boolean()) {
    c.incremental = it->get<bool>();
  }
  if (auto it = j.find("tiers"); it != j.end()) {
    if (Status s = protocol::DecodeTiers(*it, &c.tiers); !s.ok()) {
      return Corruption(path + ": its storage tiers do not parse: " + s.message());
    }
  }
  return std::optional<JobConfig>(std::move(c));
}

Status WriteJobConfig(const std::string& job_dir, const JobConfig& config) {
  const std::string path = protocol::JobConfigPath(job_dir);
  const std::string tmp = path + ".tmp";
  json doc = {
      {"storage", config.storage}, {"world_size", config.world_size}, {"keep", config.keep}};
  if (!config.tiers.empty()) doc["tiers"] = protocol::EncodeTiers(config.tiers);
  if (config.compression != "none") doc["compression"] = config.compression;
  if (config.incremental) doc["incremental"] = true;
  const std::string text = doc.dump();
  ::unlink(tmp.c_str());  // a leftover of an agent that died while writing
  internal::UniqueFd fd(
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd) return ErrnoStatus("create", tmp, errno);
  Status s;
  for (size_t off = 0; off < text.size() && s.ok();) {
    const ssize_t n = ::write(fd.get(), text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      s = ErrnoStatus("write", tmp, errno);
    else
      off += static_cast<size_t>(n);
  }
  if (s.ok() && ::fsync(fd.get()) != 0) s = ErrnoStatus("fsync", tmp, errno);
  if (const int err = fd.Close(); s.ok() && err != 0) s = ErrnoStatus("close", tmp, err);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) s = ErrnoStatus("rename", path, errno);
  if (!s.ok()) ::unlink(tmp.c_str());
  return s;
}

}  // namespace safepoint::agent
