// Chunk-store holder records and whether their holder is provably dead (chunk_store_holder.h).
#include "checkpoint/chunk_store_holder.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "base/clock.h"
#include "base/crc32c.h"
#include "checkpoint/small_object.h"

namespace safepoint::internal {

namespace {

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

// Parses unsigned decimal `text` (no sign, no spaces) into `out`.
bool ParseU64(std::string_view text, uint64_t* out) {
  if (text.empty() || text.size() > 19) return false;
  uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  *out = v;
  return true;
}

// "pid 4711 on host (started at tick 123, boot 0f3e...)" for messages.
std::string DescribeHolder(const ChunkStoreHolder& h) {
  std::string out = "pid " + std::to_string(h.pid) + " on " + h.host;
  if (h.version >= 2) {
    out += " (started at tick " + std::to_string(h.start_ticks) + ", boot " + h.boot_id +
           ", pid namespace " + std::to_string(h.pid_ns) + ")";
  }
  return out;
}

}  // namespace

ChunkStoreHolder ChunkStoreHolderOf(int64_t pid, uint64_t step, uint32_t rank, int64_t time_ns) {
  ChunkStoreHolder h;
  h.time_ns = time_ns;
  h.step = step;
  h.rank = rank;
  h.pid = pid;
  h.host = HostName();
  const std::string boot = BootId();
  const uint64_t ns = PidNamespaceOf(pid);
  const uint64_t start = pid > 0 && pid <= INT32_MAX && ProcIsOwnNamespace()
                             ? ProcessStartTicks(static_cast<uint32_t>(pid)).value_or(0)
                             : 0;
  if (!boot.empty() && ns != 0 && start != 0) {
    h.version = 2;
    h.boot_id = boot;
    h.pid_ns = ns;
    h.start_ticks = start;
  }
  return h;
}

std::string EncodeChunkStoreHolder(const ChunkStoreHolder& h) {
  std::string host = h.host.empty() ? "?" : h.host;
  std::replace_if(
      host.begin(), host.end(), [](char c) { return c <= ' ' || c > '~'; }, '?');
  std::string out = std::to_string(h.time_ns) + " " + std::to_string(h.step) + " " +
                    std::to_string(h.rank) + " " + std::to_string(h.pid) + " " + host;
  if (h.version >= 2) {
    out += " 2 " + h.boot_id + " " + std::to_string(h.pid_ns) + " " + std::to_string(h.start_ticks);
    char crc[16];
    std::snprintf(crc, sizeof(crc), " %08x", Crc32c(0, out.data(), out.size()));
    out += crc;
  }
  return out + "\n";
}

std::optional<ChunkStoreHolder> DecodeChunkStoreHolder(std::span<const std::byte> data) {
  std::string_view text(reinterpret_cast<const char*>(data.data()), data.size());
  if (text.ends_with('\n')) text.remove_suffix(1);
  std::vector<std::string_view> f;
  for (size_t at = 0; at <= text.size() && f.size() < 16;) {
    const size_t end = std::min(text.find(' ', at), text.size());
    f.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  // The time as readers before version 2 take it: the leading digits (none: no record).
  const int64_t t = HolderTimePrefix(data);
  if (t == 0) return std::nullopt;
  ChunkStoreHolder h;
  h.time_ns = t;
  uint64_t step = 0, rank = 0, pid = 0;
  if (f.size() >= 5 && ParseU64(f[1], &step) && ParseU64(f[2], &rank) && ParseU64(f[3], &pid) &&
      rank <= UINT32_MAX && pid <= INT32_MAX) {
    h.step = step;
    h.rank = static_cast<uint32_t>(rank);
    h.pid = static_cast<int64_t>(pid);
    h.host = std::string(f[4]);
  }
  // Version 2: ten fields, the last the CRC-32C (8 hex digits) of the bytes before its space.
  uint64_t ns = 0, start = 0;
  if (f.size() == 10 && f[5] == "2" && ValidBootId(f[6]) && ParseU64(f[7], &ns) &&
      ParseU64(f[8], &start) && f[9].size() == 8 && h.pid != 0 && ns != 0 && start != 0) {
    const size_t body = text.size() - 9;
    char want[9];
    std::snprintf(want, sizeof(want), "%08x", Crc32c(0, text.data(), body));
    if (f[9] == want) {
      h.version = 2;
      h.boot_id = std::string(f[6]);
      h.pid_ns = ns;
      h.start_ticks = start;
    }
  }
  return h;
}

ProcessState HolderState(const ChunkStoreHolder& h) {
  if (h.version < 2 || h.pid <= 0 || h.pid > INT32_MAX) return ProcessState::kUnknown;
  if (!ProcIsOwnNamespace() || BootId() != h.boot_id || PidNamespaceOf(getpid()) != h.pid_ns) {
    return ProcessState::kUnknown;  // another host, boot or namespace: its pids are not ours
  }
  return ProcessStateOf({static_cast<uint32_t>(h.pid), h.start_ticks});
}

int64_t HolderClockNs() { return UnixNanos(); }

int64_t HolderTimePrefix(std::span<const std::byte> data) {
  int64_t t = 0;
  for (std::byte b : data) {
    const char c = static_cast<char>(b);
    if (c < '0' || c > '9') break;
    if (t > (INT64_MAX - 9) / 10) return 0;
    t = t * 10 + (c - '0');
  }
  return t;
}

std::string HolderRecord(uint64_t step, uint32_t rank) {
  return EncodeChunkStoreHolder(ChunkStoreHolderOf(getpid(), step, rank, HolderClockNs()));
}

Result<bool> DeleteIfUnchanged(Storage& storage, std::string_view name,
                               std::span<const std::byte> data, const std::string& why) {
  auto again = ReadSmallObject(storage, name, 4096);
  if (!again.ok()) {
    if (again.status().code() == StatusCode::kNotFound) return true;
    return again.status();
  }
  if (!std::equal(again->begin(), again->end(), data.begin(), data.end())) return false;
  SP_RETURN_IF_ERROR(storage.Delete(name));
  spdlog::warn("{}: removed ({})", storage.Describe(name), why);
  return true;
}

std::string DeadHolder(Storage& storage, std::span<const std::byte> data) {
  if (!storage.capabilities().requests_end_with_process) return "";
  auto h = DecodeChunkStoreHolder(data);
  if (!h || HolderState(*h) != ProcessState::kDead) return "";
  return "its holder, " + DescribeHolder(*h) + ", is dead";
}

}  // namespace safepoint::internal
