// The Ceph cluster connections of RadosStorage (rados_storage.cc's top comment, "Cluster"): one
// connected rados_t per process and configuration ($CEPH_CONF, $CEPH_ARGS, the timeout), found
// the way Ceph's tools find it, shared by every RadosStorage and shut down at the process's exit;
// and librados's return values as text. Private to storage/rados.
//
// Thread safety: ConnectCluster may be called from many threads.
#pragma once

#include <rados/librados.h>

#include <atomic>
#include <memory>
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
};

// Fetches the newest OSD map first when an earlier op of `cluster` ended with a transient error
// (bounded by rados_mon_op_timeout, the URI's timeout); otherwise returns at once.
void RefreshMapIfSuspect(Cluster& cluster);

// The connected cluster of this configuration and `timeout_s`, connected on the first call and
// kept for the life of the process. Unavailable when it cannot be reached or configured.
Result<std::shared_ptr<Cluster>> ConnectCluster(int timeout_s);

// The text of a librados return value (-errno).
std::string RadosError(int rv);

}  // namespace safepoint::internal::rados
