// The Ceph cluster connections of RadosStorage (rados_storage.cc's top comment, "Cluster"): one
// connected rados_t per process and configuration ($CEPH_CONF, $CEPH_ARGS, the timeout), found
// the way Ceph's tools find it, shared by every RadosStorage and shut down at the process's exit;
// and librados's return values as text. Private to storage/rados.
//
// Thread safety: ConnectCluster may be called from many threads.
#pragma once

#include <rados/librados.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "safepoint/status.h"

namespace safepoint::internal::rados {

struct Cluster {
  rados_t handle = nullptr;
  std::string description;  // "cluster ceph as client.admin (config /etc/ceph/ceph.conf)"
  // Set when an op of this cluster ended with a transient error (a timeout, a lost connection):
  // its OSD may have died and come back at another address, which librados learns only from a
  // newer OSD map, and a lone OSD restarted is not always one it asks for on its own. Until a
  // call fetches the newest map (RefreshMapIfSuspect), every later op, whatever its retries,
  // would go to the dead address and time out (issue 35's OPEN-2: a rados:// tier with
  // retries=0 that never caught up after an OSD restart).
  std::atomic<bool> map_suspect{false};
  // RefreshMap's state: one fetch at a time, on a thread of its own.
  std::mutex refresh_mu;
  std::condition_variable refresh_cv;
  bool refreshing = false;
  uint64_t refreshes = 0;  // fetches finished
};

// Fetches the newest OSD map, waiting at most `timeout_s` seconds and no longer once
// `*cancelled` (if given) is true. librados's rados_wait_for_latest_osdmap can wait without end
// when the monitor does not answer, whatever rados_mon_op_timeout says (ceph PR 70971), so it
// runs on a detached thread that keeps the cluster alive; a caller that stops waiting goes on
// with the map it has, and a later call waits for the same fetch. A cluster whose fetch still
// runs at the process's exit is not shut down.
void RefreshMap(const std::shared_ptr<Cluster>& cluster, int timeout_s,
                const std::atomic<bool>* cancelled);

// RefreshMap when an earlier op of `cluster` ended with a transient error; otherwise returns at
// once.
void RefreshMapIfSuspect(const std::shared_ptr<Cluster>& cluster, int timeout_s,
                         const std::atomic<bool>* cancelled);

// The connected cluster of this configuration and `timeout_s`, connected on the first call and
// kept for the life of the process. Unavailable when it cannot be reached or configured.
Result<std::shared_ptr<Cluster>> ConnectCluster(int timeout_s);

// The text of a librados return value (-errno).
std::string RadosError(int rv);

}  // namespace safepoint::internal::rados
