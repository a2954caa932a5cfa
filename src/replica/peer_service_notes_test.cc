// Notes between peer services (peer_service_notes.cc): the connection to a peer is kept for the
// next notes, and a note still arrives when the kept connection went away (the peer dropped it as
// idle, or the peer restarted at another address).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "replica/peer_node_for_test.h"
#include "testing/test_util.h"

namespace safepoint::replica::peer_service_notes_test {
namespace {

constexpr char kSecret[] = "peer-service-notes-secret-0123456789";

// A node whose note handler counts the notes of node "a" with a 5-byte body ("hello"), and
// refuses notes of kind "refuse".
struct Node {
  std::unique_ptr<PeerNodeForTest> node;
  std::atomic<int> notes{0};
  PeerService* svc() const { return node->svc.get(); }
};

std::unique_ptr<Node> StartNode(const std::string& name, double timeout_s = 10) {
  PeerServiceOptions o = PeerOptionsForTest("job-notes", name, kSecret);
  o.timeout_s = timeout_s;
  auto n = std::make_unique<Node>();
  n->node = StartPeerNodeForTest(o);
  if (!n->node) return nullptr;
  Node* raw = n.get();
  n->svc()->SetNoteHandler(
      [raw](const std::string& from, const std::string& kind, const std::string& body) {
        if (kind == "refuse") return Unavailable("refused by the handler");
        if (from == "a" && body.size() == 5) ++raw->notes;
        return Status::OK();
      });
  return n;
}

TEST(PeerServiceNotesTest, NotesToAPeerShareOneConnection) {
  auto a = StartNode("a"), b = StartNode("b"), c = StartNode("c");
  ASSERT_TRUE(a && b && c);
  const std::vector<Peer> peers = {{"b", b->svc()->address()}, {"c", c->svc()->address()}};
  for (int i = 0; i < 20; ++i) {
    for (const Status& s : a->svc()->Note(peers, "facts", "hello")) EXPECT_OK(s);
  }
  // The handler's refusal is the note's answer; the connection stays good.
  const std::vector<Status> refused = a->svc()->Note({peers[0]}, "refuse", "hello");
  EXPECT_EQ(refused[0].code(), StatusCode::kUnavailable) << refused[0].ToString();
  EXPECT_OK(a->svc()->Note({peers[0]}, "facts", "hello")[0]);
  EXPECT_EQ(b->notes.load(), 21);
  EXPECT_EQ(c->notes.load(), 20);
  EXPECT_EQ(a->svc()->stats().notes_sent, 41u);
  EXPECT_EQ(a->svc()->stats().note_connections, 2u);  // one a peer, not one a note
  EXPECT_EQ(b->svc()->stats().notes_received, 21u);
}

TEST(PeerServiceNotesTest, ANoteArrivesAfterThePeerDroppedTheKeptConnection) {
  // b drops connections idle for 0.3 s; a would reuse its connection for 5 s (half its own
  // timeout_s), so its next note meets the connection b dropped and goes over a new one.
  auto a = StartNode("a"), b = StartNode("b", 0.3);
  ASSERT_TRUE(a && b);
  const Peer pb{"b", b->svc()->address()};
  EXPECT_OK(a->svc()->Note({pb}, "facts", "hello")[0]);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_OK(a->svc()->Note({pb}, "facts", "hello")[0]);
  EXPECT_EQ(b->notes.load(), 2);
  EXPECT_EQ(a->svc()->stats().note_connections, 2u);
}

TEST(PeerServiceNotesTest, ANoteFollowsAPeerThatRestartedAtAnotherAddress) {
  auto a = StartNode("a"), b = StartNode("b");
  ASSERT_TRUE(a && b);
  EXPECT_OK(a->svc()->Note({{"b", b->svc()->address()}}, "facts", "hello")[0]);
  b.reset();  // b's agent dies; a new one listens elsewhere
  auto b2 = StartNode("b");
  ASSERT_TRUE(b2);
  EXPECT_OK(a->svc()->Note({{"b", b2->svc()->address()}}, "facts", "hello")[0]);
  EXPECT_EQ(b2->notes.load(), 1);
  EXPECT_EQ(a->svc()->stats().note_connections, 2u);
}

TEST(PeerServiceNotesTest, ANoteToAPeerThatIsGoneFailsAndTheNextPeerStillGetsIt) {
  auto a = StartNode("a", 2), b = StartNode("b"), c = StartNode("c");
  ASSERT_TRUE(a && b && c);
  const std::vector<Peer> peers = {{"b", b->svc()->address()}, {"c", c->svc()->address()}};
  for (const Status& s : a->svc()->Note(peers, "facts", "hello")) EXPECT_OK(s);
  b.reset();  // gone, its kept connection with it
  const std::vector<Status> got = a->svc()->Note(peers, "facts", "hello");
  EXPECT_EQ(got[0].code(), StatusCode::kUnavailable) << got[0].ToString();
  EXPECT_OK(got[1]);
  EXPECT_EQ(c->notes.load(), 2);
}

}  // namespace
}  // namespace safepoint::replica::peer_service_notes_test
