// RadosStorage: Storage in a Ceph RADOS pool through librados ("rados://POOL/PREFIX").
//
// The object layout (a small head object per published object, data in chunk objects of their
// own namespace) is specified in docs/format.md, "RADOS object layout"; rados_storage.cc's top
// comment gives the write, publish, read and cleanup protocols. Private to the library and its
// tests: everything else reaches it through OpenStorage("rados://...").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "safepoint/storage.h"

namespace safepoint::internal {

// Options parsed from the URI's query string (`?timeout=60&retries=4&chunk_size=8M`) with the
// helpers of storage/uri_options.h, which every object-store backend shares.
struct RadosOptions {
  int timeout_s = 60;             // each request's bound: librados op timeouts and our own waits
  int retries = 4;                // retries of a transient failure, exponential backoff + jitter
  uint64_t chunk_size = 8 << 20;  // bytes per data object
};

// Opens `uri` (rados://POOL/PREFIX[?options]); `rest` is what follows "rados://". Connects to
// the cluster (once per process and configuration) the way Ceph's tools find it: $CEPH_CONF,
// then /etc/ceph/ceph.conf; the client name and further options from $CEPH_ARGS ("--id admin").
// NotFound when the pool does not exist, Unavailable when the cluster cannot be reached,
// InvalidArgument for a malformed URI or an unknown option.
Result<std::unique_ptr<Storage>> OpenRadosStorage(std::string_view uri, std::string_view rest);

// Parses the query string (without '?'); exposed for the unit test.
Result<RadosOptions> ParseRadosOptions(std::string_view uri, std::string_view query);

}  // namespace safepoint::internal
