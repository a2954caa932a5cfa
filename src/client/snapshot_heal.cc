// SnapshotClient::HealFrom (include/safepoint/client.h): a torchft heal through this rank's agent
// (src/agent/replicator_heal.cc does the fetch).
#include <algorithm>
#include <chrono>

#include "protocol/protocol.h"
#include "safepoint/client.h"
#include "shm/arena.h"

namespace safepoint {

using protocol::MessageType;

Result<PeerFetchResult> SnapshotClient::HealFrom(const HealOrigin& origin, uint64_t step,
                                                 double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
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
  SP_ASSIGN_OR_RETURN(std::string payload,
                      Request(MessageType::kPeerFetch, protocol::Encode(request),
                              MessageType::kPeerFetchReply, wait + 300));
  protocol::PeerFetchReply reply;
  SP_RETURN_IF_ERROR(protocol::Decode(payload, &reply));
  if (!reply.status.ok()) return reply.status;
  SP_RETURN_IF_ERROR(arena_->Refresh());  // the agent may have created the slot file
  return PeerFetchResult{
      reply.slot, reply.bytes, reply.source,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

}  // namespace safepoint
