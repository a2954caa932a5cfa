// For the peer service's tests: a "node" of one process, a PeerService on 127.0.0.1 with its own
// ReplicaStore in a temporary directory.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "replica/peer_service.h"
#include "replica/replica_store.h"
#include "testing/test_util.h"

namespace safepoint::replica {

struct PeerNodeForTest {
  std::string name;
  test::TempDir dir{"peer-service-test"};
  std::unique_ptr<ReplicaStore> store;
  std::unique_ptr<PeerService> svc;
  Peer peer() const { return {name, svc->address()}; }
};

// Options of a test node: job, node name, secret, 127.0.0.1, a 10 s peer timeout (never reached
// by a passing test), 256 KiB chunks.
inline PeerServiceOptions PeerOptionsForTest(const std::string& job, const std::string& name,
                                             const std::string& secret) {
  PeerServiceOptions o;
  o.job = job;
  o.node = name;
  o.bind_host = "127.0.0.1";
  o.secret = secret;
  o.timeout_s = 10;
  o.chunk_bytes = 256 << 10;
  return o;
}

// Starts a node with `options` (nullptr, the failure recorded, when it cannot). `wrap` stands in
// front of its store (e.g. to fail its writes).
using WrapStoreForTest =
    std::function<std::unique_ptr<ReplicaStore>(std::unique_ptr<ReplicaStore>)>;
inline std::unique_ptr<PeerNodeForTest> StartPeerNodeForTest(
    const PeerServiceOptions& options, ReplicaStoreOptions store_options = {},
    const WrapStoreForTest& wrap = nullptr) {
  auto n = std::make_unique<PeerNodeForTest>();
  n->name = options.node;
  EXPECT_FALSE(n->dir.path().empty());
  auto store = ReplicaStore::Open(n->dir.path(), std::move(store_options));
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  if (!store.ok()) return nullptr;
  n->store = wrap ? wrap(std::move(*store)) : std::move(*store);
  auto svc = PeerService::Start(options, n->store.get());
  EXPECT_TRUE(svc.ok()) << svc.status().ToString();
  if (!svc.ok()) return nullptr;
  n->svc = std::move(*svc);
  return n;
}

}  // namespace safepoint::replica
