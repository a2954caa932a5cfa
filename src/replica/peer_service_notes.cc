// PeerService over UCX, notes (see peer_service_impl.h for how the files divide the work): the
// client side of a note, over a connection kept per peer.
//
// Why kept: the commit relay sends a few notes a step to the same nodes (each node's facts to the
// committer, the committer's commit to each node). A connection each cost a UCX connection setup,
// the three messages of the authentication and a forced close, which the receiving side meets
// as a failed endpoint; a kept connection costs the note and its reply.
//
// When a kept connection is not reused: it failed or was closed (its peer went away, or dropped
// it as idle after timeout_s without a message), its peer's address changed (a restarted agent),
// or it has been idle for half of timeout_s (the peer's idle drop could cross the note). A note
// whose kept connection turns out to have failed is sent once more over a new one (a note is
// idempotent: the relay's facts and commits are); a peer that does not answer within timeout_s,
// or a failure over a new connection, fails the note.
//
// Kept connections count against the receiver's limit of accepted connections (256 at once):
// a committer of more nodes than that refuses some of them while steps come faster than its
// idle drop, and those nodes commit through storage (docs/architecture.md, "Committing at
// scale").
#include <mutex>
#include <string>
#include <thread>

#include "replica/peer_service_impl.h"

namespace safepoint::replica::ucx {

struct PeerServiceImpl::NoteLink {
  std::mutex mu;  // one note at a time over the connection
  ConnPtr conn;
  std::string address;
  Clock::time_point last_used;
};

std::shared_ptr<PeerServiceImpl::NoteLink> PeerServiceImpl::NoteLinkFor(const std::string& node) {
  std::lock_guard lk(note_links_mu_);
  std::shared_ptr<NoteLink>& link = note_links_[node];
  if (!link) link = std::make_shared<NoteLink>();
  return link;
}

bool PeerServiceImpl::Reusable(const ConnPtr& c) {
  Lock lk(mu_);
  return !c->closing && !c->closed && !c->dropping && c->error.ok() && c->ep != nullptr &&
         c->inbox.empty() && c->outstanding == 0;
}

Status PeerServiceImpl::NoteOne(const Peer& peer, const std::string& kind,
                                const std::string& body) {
  if (body.size() > kMaxNoteBytes)
    return InvalidArgument("note '" + kind + "' of " + std::to_string(body.size()) +
                           " bytes: at most " + std::to_string(kMaxNoteBytes));
  std::shared_ptr<NoteLink> link = NoteLinkFor(peer.node);
  std::lock_guard link_lock(link->mu);
  for (int attempt = 0;; ++attempt) {
    bool fresh = false;
    if (link->conn && (link->address != peer.address ||
                       Clock::now() - link->last_used > timeout() / 2 || !Reusable(link->conn))) {
      Close(link->conn);
      link->conn.reset();
    }
    if (!link->conn) {
      SP_ASSIGN_OR_RETURN(link->conn, Connect(peer));
      link->address = peer.address;
      fresh = true;
      ++note_connections_;
    }
    const ConnPtr c = link->conn;
    {
      Lock lk(mu_);
      c->last_progress = Clock::now();  // the reply is due within timeout_s from now
    }
    SendControl(c, MsgType::kNote, {{"kind", kind}, {"body", body}});
    Result<json> reply = WaitMessage(c, MsgType::kNoteReply);
    link->last_used = Clock::now();
    if (!reply.ok()) {
      bool broken;  // the connection failed or was closed (a peer without answer is not)
      {
        Lock lk(mu_);
        broken = !c->error.ok() || c->closing || c->closed || c->dropping;
      }
      Close(c);
      link->conn.reset();
      if (fresh || attempt > 0 || !broken) return reply.status();
      continue;  // the kept connection had failed: once more over a new one
    }
    uint64_t code = 0;
    if (!GetU64(*reply, "code", &code) || code != 0) return StatusFromJson(*reply, c->name);
    ++notes_sent_;
    return Status::OK();
  }
}

std::vector<Status> PeerServiceImpl::Note(const std::vector<Peer>& peers, const std::string& kind,
                                          const std::string& body) {
  std::vector<Status> status(peers.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < peers.size();)
      status[i] = NoteOne(peers[i], kind, body);
  };
  const size_t n = std::min(peers.size(), kNoteFanout);
  if (n == 1) {
    work();
    return status;
  }
  std::vector<std::thread> threads;
  for (size_t t = 0; t < n; ++t) threads.emplace_back(work);
  for (auto& th : threads) th.join();
  return status;
}

}  // namespace safepoint::replica::ucx
