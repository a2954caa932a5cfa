// Ceph cluster connections of RadosStorage (rados_cluster.h).
#include "storage/rados/rados_cluster.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace safepoint::internal::rados {

namespace {

std::vector<std::string> SplitWords(const char* s) {
  std::vector<std::string> out;
  if (s == nullptr) return out;
  std::string cur;
  for (const char* p = s; *p; ++p) {
    if (*p == ' ' || *p == '\t' || *p == '\n') {
      if (!cur.empty()) out.push_back(std::move(cur));
      cur.clear();
    } else {
      cur += *p;
    }
  }
  if (!cur.empty()) out.push_back(std::move(cur));
  return out;
}

// The connected clusters, one per configuration, kept for the life of the process.
std::mutex& ClustersMu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::map<std::string, std::shared_ptr<Cluster>>& Clusters() {
  static auto* clusters = new std::map<std::string, std::shared_ptr<Cluster>>();
  return *clusters;
}
pid_t clusters_pid = 0;  // the process that connected them (a forked child must not shut down)

// Runs at exit: shuts every connected cluster down before libceph's own static objects are
// destroyed (it is registered after the first rados_connect, so it runs before their
// destructors). A process that exits with a connected cluster lets librados' threads run into
// destroyed globals: a segfault at exit, seen in `make test` (and by Ceph's own tools, which
// shut down before exit for the same reason). Open pools keep their client alive until they are
// destroyed, so a Pool destroyed later still releases cleanly.
void ShutdownClustersAtExit() {
  if (::getpid() != clusters_pid) return;
  std::lock_guard<std::mutex> lock(ClustersMu());
  for (auto& [key, cluster] : Clusters()) {
    std::lock_guard<std::mutex> refresh(cluster->refresh_mu);
    // A map fetch still blocked in librados (RefreshMap): shutting down under it is undefined.
    if (cluster->handle != nullptr && !cluster->refreshing) rados_shutdown(cluster->handle);
  }
}

}  // namespace

std::string RadosError(int rv) { return std::strerror(rv < 0 ? -rv : rv); }

namespace {

// Starts a map fetch on a detached thread that keeps the cluster alive; refresh_mu is held.
void StartFetchLocked(const std::shared_ptr<Cluster>& cluster) {
  cluster->refreshing = true;
  std::thread([cluster] {
    (void)rados_wait_for_latest_osdmap(cluster->handle);
    std::lock_guard<std::mutex> done(cluster->refresh_mu);
    cluster->refreshing = false;
    ++cluster->refreshes;
    cluster->refresh_cv.notify_all();
  }).detach();
}

}  // namespace

void RefreshMap(const std::shared_ptr<Cluster>& cluster, int timeout_s,
                const std::atomic<bool>* cancelled) {
  std::unique_lock<std::mutex> lock(cluster->refresh_mu);
  // A fetch in flight may have asked the monitor before what made this call want a newer map:
  // then the call waits for the fetch after it too.
  const uint64_t target = cluster->refreshes + (cluster->refreshing ? 2 : 1);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  while (cluster->refreshes < target) {
    if (!cluster->refreshing) StartFetchLocked(cluster);
    if ((cancelled != nullptr && cancelled->load(std::memory_order_acquire)) ||
        std::chrono::steady_clock::now() >= until) {
      return;
    }
    cluster->refresh_cv.wait_for(lock, std::chrono::milliseconds(100));
  }
}

void RefreshMapIfSuspect(const std::shared_ptr<Cluster>& cluster, int timeout_s,
                         const std::atomic<bool>* cancelled) {
  // Cleared before the fetch: an op failing meanwhile sets it again for the next call. A fetch
  // that does not end in time (the monitor does not answer either) leaves the op to fail on
  // its own.
  if (cluster->map_suspect.exchange(false, std::memory_order_acq_rel)) {
    RefreshMap(cluster, timeout_s, cancelled);
  }
}

Result<std::shared_ptr<Cluster>> ConnectCluster(int timeout_s) {
  const char* conf_env = std::getenv("CEPH_CONF");
  const char* args_env = std::getenv("CEPH_ARGS");
  const std::string key = std::string(conf_env ? conf_env : "") + '\0' +
                          (args_env ? args_env : "") + '\0' + std::to_string(timeout_s);
  std::lock_guard<std::mutex> lock(ClustersMu());
  auto* clusters = &Clusters();
  auto it = clusters->find(key);
  if (it != clusters->end()) return it->second;

  // The client name and the cluster name as Ceph's tools take them from $CEPH_ARGS.
  std::string name = "client.admin";
  std::string cluster_name = "ceph";
  const std::vector<std::string> words = SplitWords(args_env);
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    auto value = [&](std::string_view flag) -> std::string {
      if (w == flag && i + 1 < words.size()) return words[++i];
      if (w.starts_with(std::string(flag) + "=")) return w.substr(flag.size() + 1);
      return {};
    };
    std::string v;
    if (!(v = value("--id")).empty() || !(v = value("--user")).empty() ||
        !(v = value("-i")).empty()) {
      name = "client." + v;
    } else if (!(v = value("--name")).empty() || !(v = value("-n")).empty()) {
      name = v;
    } else if (!(v = value("--cluster")).empty()) {
      cluster_name = v;
    }
  }
  std::string desc = "Ceph cluster \"" + cluster_name + "\" as " + name + " (config " +
                     (conf_env ? std::string("$CEPH_CONF=") + conf_env
                               : std::string("/etc/ceph/" + cluster_name + ".conf")) +
                     ")";
  rados_t h = nullptr;
  int rv = rados_create2(&h, cluster_name.c_str(), name.c_str(), 0);
  if (rv < 0) return Unavailable(desc + ": rados_create2: " + RadosError(rv));
  auto fail = [&](std::string what, int r) -> Status {
    rados_shutdown(h);
    return Unavailable(desc + ": " + what + ": " + RadosError(r));
  };
  rv = rados_conf_read_file(h, nullptr);
  if (rv < 0 && rv != -ENOENT) return fail("reading the configuration", rv);
  rv = rados_conf_parse_env(h, "CEPH_ARGS");
  if (rv < 0) return fail("parsing $CEPH_ARGS", rv);
  const std::string t = std::to_string(timeout_s);
  for (const char* opt : {"rados_osd_op_timeout", "rados_mon_op_timeout", "client_mount_timeout"}) {
    rv = rados_conf_set(h, opt, t.c_str());
    if (rv < 0) return fail(std::string("setting ") + opt, rv);
  }
  rv = rados_connect(h);
  if (rv < 0) return fail("connecting (timeout " + t + " s)", rv);
  auto cluster = std::make_shared<Cluster>();
  cluster->handle = h;
  cluster->description = std::move(desc);
  (*clusters)[key] = cluster;  // kept for the life of the process, shut down at its exit
  if (clusters_pid == 0) {
    clusters_pid = ::getpid();
    std::atexit(ShutdownClustersAtExit);
  }
  return cluster;
}

}  // namespace safepoint::internal::rados
