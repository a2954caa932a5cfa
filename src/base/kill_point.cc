// Kill points (src/base/kill_point.h): compiled into every build, armed by SAFEPOINT_KILL_AT.
#include "base/kill_point.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/unique_fd.h"

namespace safepoint::internal {

// Constant-initialized: kUnread before any constructor runs, so a hit from another static's
// constructor reads the environment too.
constinit std::atomic<KillPointsState> g_kill_points_state{KillPointsState::kUnread};

namespace {

struct KillSpec {
  std::string name;  // empty: no kill point armed in this process
  uint64_t nth = 1;
  std::string stamp;
  std::atomic<uint64_t> hits{0};
};

// Read once, at the first hit: the environment of the process as it is then.
KillSpec& Spec() {
  static KillSpec* spec = [] {
    auto* s = new KillSpec();  // never destroyed: hits may come from threads at exit
    const char* at = std::getenv("SAFEPOINT_KILL_AT");
    if (at == nullptr || *at == '\0') return s;
    std::string v(at);
    const size_t colon = v.rfind(':');
    if (colon != std::string::npos) {
      s->nth = std::strtoull(v.c_str() + colon + 1, nullptr, 10);
      v.resize(colon);
    }
    if (s->nth == 0) s->nth = 1;
    bool known = false;
    for (std::string_view k : kKillPoints) known |= (k == v);
    if (!known) {
      std::fprintf(stderr, "safepoint: SAFEPOINT_KILL_AT names no kill point: %s\n", v.c_str());
      std::abort();  // a typo must not make a campaign silently kill nothing
    }
    s->name = std::move(v);
    if (const char* stamp = std::getenv("SAFEPOINT_KILL_STAMP")) s->stamp = stamp;
    return s;
  }();
  return *spec;
}

}  // namespace

void KillPointHit(std::string_view name) {
  KillSpec& s = Spec();
  if (s.name.empty()) {
    // Later hits stop at the caller's check of the state.
    g_kill_points_state.store(KillPointsState::kDisarmed, std::memory_order_relaxed);
    return;
  }
  g_kill_points_state.store(KillPointsState::kArmed, std::memory_order_relaxed);
  if (name != s.name) return;
  const uint64_t n = s.hits.fetch_add(1, std::memory_order_relaxed) + 1;
  if (n != s.nth) return;
  if (!s.stamp.empty()) {
    UniqueFd fd(::open(s.stamp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!fd) return;  // another process already died here (or the stamp cannot be made)
    const std::string line =
        s.name + " " + std::to_string(n) + " " + std::to_string(::getpid()) + "\n";
    if (::write(fd.get(), line.data(), line.size()) < 0) {
      // The stamp exists; its text is only for people.
    }
  }
  ::raise(SIGKILL);
}

}  // namespace safepoint::internal
