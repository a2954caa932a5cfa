// Redundancy of snapshots in other nodes' memory, and where the copies go (docs/replication.md).
//
// Both sides of the agent protocol apply these rules: the training process checks a redundancy
// against the job's nodes before it sends the membership (python/ext), the agent's replicator
// and peer service place copies with them. Namespace replica: the rules are peer replication's
// (src/replica), kept here so that the client needs nothing of the agent's.
//
// A node is a failure domain (a host). Each node's snapshots (every rank's image of the node) are
// kept either as N full copies on N other nodes ("mirror:N") or as K data + P parity fragments
// (Reed-Solomon) on K+P other nodes ("ec:K+P"), any K of which rebuild the image.
//
// Placement is a ring over the job's nodes ordered by node index: node i's copies or fragments go
// to nodes i+1, i+2, ... (mod n). Every target is a different node and never the source, so the
// loss of any N nodes (mirror) or any P nodes (ec) leaves every node's snapshot recoverable from
// the survivors: a node whose own memory is lost still has its N copies (or K+P fragments, of which
// at most P are lost) elsewhere, as the lost nodes other than it hold at most N-1 (P-1) of them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "safepoint/status.h"

namespace safepoint::replica {

struct Redundancy {
  enum class Kind { kNone, kMirror, kErasure };
  Kind kind = Kind::kNone;
  uint32_t copies = 0;    // mirror: full copies on other nodes
  uint32_t k = 0, p = 0;  // ec: data and parity fragments

  bool enabled() const { return kind != Kind::kNone; }
  // Nodes besides the source that hold a part of each snapshot.
  uint32_t targets() const;
  // Node losses every snapshot survives (N for mirror:N, P for ec:K+P).
  uint32_t tolerated_losses() const;
  // Memory held on other nodes per byte of snapshot (N, or (K+P)/K).
  double memory_factor() const;
  std::string ToString() const;  // "none", "mirror:2", "ec:2+2"
};

// Parses "none" (or ""), "mirror", "mirror:N" (N >= 1), "ec:K+P" (K >= 1, P >= 1, K+P <= 32).
// InvalidArgument naming the spec and the accepted forms otherwise.
Result<Redundancy> ParseRedundancy(std::string_view spec);

// OK when `nodes` nodes can place `r` so that every snapshot survives its tolerated losses;
// else InvalidArgument saying how many nodes it needs ("mirror:2 needs at least 3 nodes, the
// job has 2").
Status CheckPlacement(const Redundancy& r, uint32_t nodes);

// The node indices that hold node `source`'s copies (mirror: copy c on element c) or fragments
// (ec: fragment f on element f, data fragments first), in a job of `nodes` nodes.
// Requires CheckPlacement(r, nodes).ok() and source < nodes.
std::vector<uint32_t> PlacementTargets(const Redundancy& r, uint32_t source, uint32_t nodes);

}  // namespace safepoint::replica
