// The Ceph cluster connections of RadosStorage (rados_storage.cc's top comment, "Cluster"): one
// connected rados_t per process and configuration ($CEPH_CONF, $CEPH_ARGS, the timeout), found
// the way Ceph's tools find it, shared by every RadosStorage and shut down at the process's exit;
// and librados's return values as text. Private to storage/rados.
//
// Thread safety: ConnectCluster may be called from many threads.
#pragma once

#include <rados/librados.h>

#include <memory>
#include <string>

#include "safepoint/status.h"

namespace safepoint::internal::rados {

struct Cluster {
  rados_t handle = nullptr;
  std::string description;  // "cluster ceph as client.admin (config /etc/ceph/ceph.conf)"
};

// The connected cluster of this configuration and `timeout_s`, connected on the first call and
// kept for the life of the process. Unavailable when it cannot be reached or configured.
Result<std::shared_ptr<Cluster>> ConnectCluster(int timeout_s);

// The text of a librados return value (-errno).
std::string RadosError(int rv);

}  // namespace safepoint::internal::rados
