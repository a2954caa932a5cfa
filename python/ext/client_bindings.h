// Flash checkpoints for Python (client_bindings.cc): the client of the node agent
// (safepoint.Checkpointer's _core.Client), its results, and the redundancy check of peer
// replication.
#pragma once

#include <nanobind/nanobind.h>

namespace safepoint::python {

// Adds SnapshotResult, SlotInfo, PeerCopy, PeerFetchResult, Client and check_redundancy to `m`.
void BindClient(nanobind::module_& m);

}  // namespace safepoint::python
