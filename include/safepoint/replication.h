// Peer replication as a training process sees it (docs/replication.md): the job's nodes and
// redundancy it tells the agent, and the snapshots of its rank that other nodes can rebuild.
// SnapshotClient (safepoint/client.h) takes and returns these; the agent protocol
// (src/protocol/protocol.h) carries PeerNode, Membership and PeerCopy as they are.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace safepoint {

// One node of the job.
struct PeerNode {
  std::string node;
  std::string address;  // "host:port" of its agent's peer service
};
// The job's nodes and redundancy, as the ranks all-gathered them at a Checkpointer start. Every
// rank of that start sends the same membership; the agent applies a new epoch once.
struct Membership {
  std::string epoch;            // names one Checkpointer start of the job; the same on every rank
  uint32_t node_index = 0;      // this node's place in `nodes`
  std::vector<PeerNode> nodes;  // every node of the job, by node index
  std::string redundancy;       // "mirror", "mirror:N", "ec:K+P" (src/protocol/redundancy.h)
  std::string secret_hex;  // the job's secret for this epoch, lowercase hex; authenticates peers
  uint64_t bandwidth = 0;  // bytes/s cap on replication sends; 0: none
};
// A snapshot of a rank that the peers can rebuild (a whole copy, or K fragments).
struct PeerCopy {
  uint64_t step = 0;
  uint64_t attempt = 0;
  uint64_t complete_ns = 0;
  uint64_t image_bytes = 0;
};
// The agent of another job whose snapshot heals this rank (SnapshotClient::HealFrom): a torchft
// replica's transport (docs/replication.md, "Healing a torchft replica").
struct HealOrigin {
  std::string address;     // "host:port" of its agent's peer service
  std::string node;        // the node name it serves as
  std::string job;         // its job
  std::string secret_hex;  // its job's secret, lowercase hex
};
// A snapshot rebuilt from peers into one of the rank's slots (SnapshotClient::FetchFromPeers).
struct PeerFetchResult {
  uint32_t slot = 0;
  uint64_t bytes = 0;
  std::string source;  // the nodes it came from
  double seconds = 0;
};

}  // namespace safepoint
