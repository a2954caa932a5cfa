// PeerService over UCX: fetching one of a node's own snapshots straight from its slot (see
// peer_service_impl.h for how the files divide the work; the contract is in peer_service.h).
//
// What it is for: healing a torchft replica (python/safepoint/torchft.py, mode "peer"). The live
// replica's transport takes a flash snapshot into its slot and is free; the recovering replica's
// agent fetches that image from the live replica's agent over UCX, into a slot of its own, and
// the recovering process loads it from there, verified. Nothing waits for storage, and the
// sender never serves its live tensors.
//
// One connection, authenticated with the serving job's name and secret (SnapshotOrigin: the
// fetching agent belongs to another job), carries three kFetchSnapshot requests:
//   1. describe (image_bytes 0): the server answers kFetchBegin with the newest snapshot of
//      (rank, step) it holds, or with "missing" (not taken yet: the client asks again on the
//      same connection, every few milliseconds up to SnapshotOrigin::wait_s; a new connection
//      per question cost both agents a UCX connection setup and an authentication, and took
//      CPU from the sender's copy on a small host);
//   2. fetch (image_bytes and complete_ns of that snapshot): kFetchBegin again, then its chunks,
//      each sent with the CRC32C the snapshot recorded for it when it was taken (the last
//      chunk, which holds the checksum section, with one computed as it is sent); the server
//      checks before each chunk that the slot still holds the snapshot and drops the connection
//      with Cancelled when its writer began to overwrite it;
//   3. describe again, once every chunk arrived and passed its CRC: the same snapshot (step and
//      completion time) must still be there, so that no byte was read from a slot being
//      overwritten (a superseded snapshot is Cancelled, never delivered).
// The fetching side then verifies the image as any load from memory does (header, every chunk's
// checksum): no byte that failed a check is used.

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include "base/log.h"
#include "replica/peer_service_impl.h"
#include "shm/arena.h"

namespace safepoint::replica::ucx {
void PeerServiceImpl::ServeSnapshot(const ConnPtr& c, const json& body) {
  uint64_t rank = 0, step = 0, chunk = 0, image_bytes = 0, complete_ns = 0;
  if (!GetU64(body, "rank", &rank) || rank > UINT32_MAX || !GetU64(body, "step", &step) ||
      !GetU64(body, "chunk_bytes", &chunk) || !GetU64(body, "image_bytes", &image_bytes) ||
      !GetU64(body, "complete_ns", &complete_ns)) {
    ++peers_rejected_;
    return Drop(c, Corruption(c->name + ": malformed fetch-snapshot"), true);
  }
  const bool fetch = image_bytes > 0;
  if (fetch && c->view) {
    ++peers_rejected_;
    return Drop(c, Corruption(c->name + ": a second snapshot fetch on one connection"), true);
  }
  const std::string what = "rank " + std::to_string(rank) + "'s snapshot of step " +
                           std::to_string(step) + " on node " + options_.node;
  if (!snapshot_source_) {
    return Drop(c, NotFound("node " + options_.node + " serves no snapshots"), true);
  }
  // Finding the slot and parsing the image's header and checksums: off the progress thread.
  auto served = std::make_shared<Result<ServedSnapshot>>(Cancelled(""));
  Offload(
      c,
      [source = snapshot_source_, served, rank, step, fetch] {
        *served = source(static_cast<uint32_t>(rank), step);
        if (fetch && served->ok())
          PopulateForRead((*served)->image);  // a fault per page: a third of the time
      },
      [this, c, served, fetch, chunk, image_bytes, complete_ns, what] {
        if (!served->ok()) {
          if (!fetch && served->status().code() == StatusCode::kNotFound) {
            return SendControlNow(c, MsgType::kFetchBegin,
                                  {{"missing", served->status().message()}});
          }
          return Drop(c, served->status(), true);
        }
        ServedSnapshot& s = **served;
        ReplicaMeta m;
        m.source_node = options_.node;
        m.rank = s.id.rank;
        m.step = s.id.step;
        m.complete_ns = s.id.complete_ns;
        m.attempt = s.id.attempt;
        m.image_bytes = s.image.size();
        m.payload_bytes = s.image.size();
        const json begin = {{"meta", MetaToJson(m)}};
        if (!fetch) return SendControlNow(c, MsgType::kFetchBegin, begin);
        if (image_bytes != m.image_bytes || complete_ns != m.complete_ns) {
          return Drop(c, Cancelled(what + " was superseded by a newer one before it was sent"),
                      true);
        }
        const ChunkLayout layout{m.payload_bytes, chunk};
        if (Status st = layout.Validate(); !st.ok()) {
          ++peers_rejected_;
          return Drop(c, Corruption(c->name + ": " + st.message()), true);
        }
        auto owned = std::make_shared<const ServedSnapshot>(std::move(s));
        c->served = owned;
        c->view = std::make_shared<ReplicaView>(ReplicaView{m, owned->image, owned});
        c->send_layout = layout;
        c->next_chunk = 0;
        SendControlNow(c, MsgType::kFetchBegin, begin);
        PumpFetch(c);
      });
}

bool PeerServiceImpl::ServedStillValid(const ConnPtr& c) {
  const ServedSnapshot& s = *c->served;
  if (!s.still_valid || s.still_valid()) return true;
  ++transfers_failed_;
  Drop(c,
       Cancelled("rank " + std::to_string(s.id.rank) + "'s snapshot of step " +
                 std::to_string(s.id.step) + " on node " + options_.node +
                 " was superseded while it was sent (its slot is being overwritten)"),
       true);
  return false;
}

uint32_t PeerServiceImpl::ServedChunkCrc(const Conn& c, uint64_t offset, const std::byte* p,
                                         uint64_t len) const {
  const ServedSnapshot& s = *c.served;
  if (s.crc_chunk_bytes == c.send_layout.chunk_bytes && len == s.crc_chunk_bytes) {
    const uint64_t i = offset / s.crc_chunk_bytes;
    if (i < s.recorded_crcs.size()) return s.recorded_crcs[i];
  }
  return Crc32c(0, p, len);
}

Status PeerServiceImpl::FetchSnapshot(
    const SnapshotOrigin& origin, uint32_t rank, uint64_t step,
    const std::function<Result<FetchDestination>(const ReplicaMeta&)>& destination,
    ReplicaMeta* meta) {
  const std::string what = "rank " + std::to_string(rank) + "'s snapshot of step " +
                           std::to_string(step) + " on node " + origin.peer.node;
  if (origin.secret.size() < 16) {
    return InvalidArgument("fetching " + what + ": the secret is shorter than 16 bytes");
  }
  SP_ASSIGN_OR_RETURN(ConnPtr c, Connect(origin.peer, &origin));
  const uint64_t chunk = options_.chunk_bytes;
  // One request; the meta of the snapshot the server answers with, checked to be what was asked.
  // `missing`: the server has none yet (NotFound, the connection stays).
  bool missing = false;
  auto ask = [&](uint64_t image_bytes, uint64_t complete_ns) -> Result<ReplicaMeta> {
    missing = false;
    SendControl(c, MsgType::kFetchSnapshot,
                {{"rank", rank},
                 {"step", step},
                 {"chunk_bytes", chunk},
                 {"image_bytes", image_bytes},
                 {"complete_ns", complete_ns}});
    SP_ASSIGN_OR_RETURN(json begin, WaitMessage(c, MsgType::kFetchBegin));
    std::string text;
    if (GetString(begin, "missing", &text, 4096)) {
      missing = true;
      return NotFound(c->name + ": " + text);
    }
    if (!GetString(begin, "meta", &text, 4096)) {
      return Corruption(c->name + ": malformed fetch-begin");
    }
    SP_ASSIGN_OR_RETURN(ReplicaMeta m, MetaFromJson(text));
    if (m.source_node != origin.peer.node || m.rank != rank || m.step != step ||
        m.kind != ReplicaMeta::Kind::kCopy || m.image_bytes == 0 ||
        m.payload_bytes != m.image_bytes || m.image_bytes > options_.max_image_bytes) {
      return Corruption(c->name + ": described another snapshot than " + what + " (or one of " +
                        std::to_string(m.image_bytes) + " bytes)");
    }
    return m;
  };
  Status s = [&]() -> Status {
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(std::max(origin.wait_s, 0.0)));
    auto delay = std::chrono::milliseconds(1);
    Result<ReplicaMeta> described = ask(0, 0);
    while (!described.ok() && missing && Clock::now() + delay <= deadline) {
      std::this_thread::sleep_for(delay);
      delay = std::min(delay * 2, std::chrono::milliseconds(20));
      described = ask(0, 0);
    }
    SP_ASSIGN_OR_RETURN(ReplicaMeta m, std::move(described));
    SP_ASSIGN_OR_RETURN(FetchDestination dest, destination(m));
    if (dest.bytes.size() != m.image_bytes) {
      return InvalidArgument("fetching " + what + ": a buffer of " +
                             std::to_string(dest.bytes.size()) + " bytes for " +
                             std::to_string(m.image_bytes));
    }
    const ChunkLayout layout{m.image_bytes, chunk};
    {
      Lock lk(mu_);
      c->sink = dest.bytes;
      c->sink_owner = std::move(dest.owner);
      c->layout = layout;
      c->got.assign(layout.chunks(), 0);
      c->received = 0;
    }
    SP_ASSIGN_OR_RETURN(ReplicaMeta sent, ask(m.image_bytes, m.complete_ns));
    if (!SameContent(sent, m)) return Corruption(c->name + ": sent another snapshot of " + what);
    SP_RETURN_IF_ERROR(WaitUntil(c, [&] { return c->received == layout.total; }));
    // Every chunk arrived and passed its CRC; the slot must still hold the same snapshot, else
    // some chunk may have been read while its writer overwrote it.
    Result<ReplicaMeta> after = ask(0, 0);
    if ((!after.ok() && after.status().code() == StatusCode::kNotFound) ||
        (after.ok() && after->complete_ns != m.complete_ns)) {
      return Cancelled(what + " was superseded while it was sent");
    }
    SP_RETURN_IF_ERROR(after.status());
    *meta = m;
    return Status::OK();
  }();
  Close(c);
  {
    Lock lk(mu_);
    c->EndSink();
  }
  if (!s.ok()) spdlog::warn("peer service: fetching {}: {}", what, s.ToString());
  return s;
}

}  // namespace safepoint::replica::ucx
