// `safepoint status --watch`: a refreshing view of the node's jobs (cli_watch.h).
#include "cli_watch.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <thread>

#include "advisor/history.h"
#include "advisor/interval.h"
#include "safepoint/checkpoint.h"

namespace safepoint::cli {
namespace {

std::atomic<bool> g_stop{false};
void Stop(int) { g_stop.store(true); }

std::string UtcNow() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

int Watch(const std::function<int()>& render, double interval_seconds) {
  g_stop.store(false);
  std::signal(SIGINT, Stop);
  std::signal(SIGTERM, Stop);
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  while (!g_stop.load()) {
    if (tty) {
      std::cout << "\033[H\033[2J"
                << "safepoint status, every " << interval_seconds << " s (Ctrl-C to quit)  "
                << UtcNow() << "\n\n";
    } else {
      std::cout << "--- " << UtcNow() << " ---\n";
    }
    const int rc = render();
    std::cout.flush();
    if (rc != 0) return rc;
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(interval_seconds));
    while (!g_stop.load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return 0;
}

std::optional<double> CommitAgeSeconds(const std::string& uri, uint64_t step) {
  auto store = OpenCheckpointStore(uri);
  if (!store.ok()) return std::nullopt;
  auto commit = (*store)->ReadCommit(step);
  if (!commit.ok()) return std::nullopt;
  return std::max(0.0, NowSeconds() - static_cast<double>(commit->commit_time_ns) / 1e9);
}

double NowSeconds() { return advisor::NowSeconds(); }

std::string Ago(double seconds) { return advisor::FormatDuration(seconds) + " ago"; }

}  // namespace safepoint::cli
