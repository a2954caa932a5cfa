// SnapshotClient::HealFrom (include/safepoint/client.h): a torchft heal through this rank's agent
// (src/agent/replicator_heal.cc does the fetch).
#include <algorithm>

#include "protocol/protocol.h"
#include "safepoint/client.h"

namespace safepoint {

Result<PeerFetchResult> SnapshotClient::HealFrom(const HealOrigin& origin, uint64_t step,
                                                 double timeout_s) {
  protocol::PeerFetchRequest request;
  request.rank = opt_.rank;
  request.step = step;
  request.from_address = origin.address;
  request.from_node = origin.node;
  request.from_job = origin.job;
  request.from_secret_hex = origin.secret_hex;
  const double wait = std::clamp(timeout_s, 0.0, 86400.0);
  request.timeout_ms = static_cast<uint32_t>(wait * 1000);
  // The agent answers within timeout_s plus one transfer (bounded by its peer timeout).
  return PeerFetch(protocol::Encode(request), wait + 300);
}

}  // namespace safepoint
