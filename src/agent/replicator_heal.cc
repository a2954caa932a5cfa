// Replicator (src/agent/replicator.h): healing from another job's agent (torchft, mode "peer":
// python/safepoint/torchft.py; docs/replication.md, "Healing a torchft replica").
//
// Serving side: the peer service asks ServeSnapshot for this node's own snapshot of a rank at a
// step; it is served straight from the rank's slot, read in place without a lease (the sender
// never waits), with the checksums the client recorded when it took it; the service checks
// between chunks that the slot still holds it.
//
// Fetching side: HealFetch (a rank's kPeerFetch naming an origin) takes one of the rank's slots
// as its writer, as a rebuild from this job's peers does (the rank waits for the reply and writes
// nothing meanwhile), fetches the origin's snapshot into it (PeerService::FetchSnapshot: every
// chunk checked on arrival), checks that it is an image of that rank and step, and marks the slot
// COMPLETE; the rank then loads it like any snapshot in memory, every chunk verified again.

#include <algorithm>
#include <chrono>
#include <thread>

#include "agent/replicator.h"
#include "base/log.h"
#include "replica/auth.h"
#include "safepoint/image.h"
#include "shm/arena.h"

namespace safepoint::agent {

using protocol::MessageType;
using replica::ReplicaMeta;

Result<replica::SnapshotOrigin> HealOrigin(const protocol::PeerFetchRequest& request) {
  replica::SnapshotOrigin o;
  o.peer = replica::Peer{request.from_node, request.from_address};
  o.job = request.from_job;
  o.secret.assign(request.from_secret_hex.size() / 2, '\0');
  if (request.from_node.empty() || request.from_job.empty()) {
    return InvalidArgument("a heal names no node or job to fetch from");
  }
  if (request.from_secret_hex.size() % 2 != 0 ||
      !replica::FromHex(request.from_secret_hex, reinterpret_cast<uint8_t*>(o.secret.data()),
                        o.secret.size())) {
    return InvalidArgument("a heal's secret is not lowercase hex");
  }
  if (o.secret.size() < 16) return InvalidArgument("a heal's secret is shorter than 16 bytes");
  return o;
}

Result<replica::ServedSnapshot> Replicator::ServeSnapshot(uint32_t rank, uint64_t step) {
  const std::string what = "rank " + std::to_string(rank) + "'s snapshot of step " +
                           std::to_string(step) + " on node " + node_;
  SP_ASSIGN_OR_RETURN(std::unique_ptr<Arena> opened, Arena::Open(job_dir_, rank));
  std::shared_ptr<Arena> arena = std::move(opened);
  std::optional<SlotInfo> found;
  for (const SlotInfo& s : arena->Slots()) {
    if (s.state == SlotState::kComplete && s.step == step &&
        (!found || s.complete_time_ns > found->complete_time_ns)) {
      found = s;
    }
  }
  if (!found) return NotFound(what + ": none in memory (not taken yet, or overwritten)");
  const std::span<const std::byte> image =
      arena->SlotData(found->index).subspan(0, found->image_size);
  SP_ASSIGN_OR_RETURN(auto header, ParseImageHeader(image, what));
  const ImageLayout& layout = header.second;
  replica::ServedSnapshot served;
  served.id = replica::SnapshotId{rank, step, static_cast<uint64_t>(found->complete_time_ns),
                                  header.first.attempt};
  served.image = image;
  // The checksums the client recorded for the image's chunks as it took the snapshot (the whole
  // chunks before the checksum section), sent with them instead of computed again.
  if (layout.checksums_offset <= image.size() &&
      layout.checksums_size <= image.size() - layout.checksums_offset) {
    SP_ASSIGN_OR_RETURN(served.recorded_crcs,
                        ParseChecksumSection(image.subspan(layout.checksums_offset), layout, what));
    served.recorded_crcs.resize(
        std::min<size_t>(served.recorded_crcs.size(), layout.checksums_offset / layout.chunk_size));
    served.crc_chunk_bytes = layout.chunk_size;
  }
  const uint32_t slot = found->index;
  const uint64_t generation = found->generation;
  served.still_valid = [arena, slot, generation] {
    const auto now = arena->Slots();
    return slot < now.size() && now[slot].state == SlotState::kComplete &&
           now[slot].generation == generation;
  };
  served.keep = arena;
  return served;
}

PeerAnswer Replicator::HealFetch(const PeerRequest& r) {
  PeerAnswer a;
  a.reply_type = MessageType::kPeerFetchReply;
  protocol::PeerFetchReply reply;
  const replica::SnapshotOrigin& origin = *r.origin;
  const std::string what = "rank " + std::to_string(r.rank) + "'s snapshot of step " +
                           std::to_string(r.step) + " from node " + origin.peer.node + " (" +
                           origin.peer.address + ", job " + origin.job + ")";
  auto fail = [&](Status s) {
    reply.status = std::move(s);
    a.payload = Encode(reply);
    spdlog::warn("healing {}: {}", what, reply.status.message());
    return a;
  };
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline = t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(std::max(r.timeout_s, 0.0)));
  auto opened = Arena::Open(job_dir_, r.rank);
  if (!opened.ok()) return fail(opened.status());
  std::shared_ptr<Arena> arena = std::move(*opened);
  std::optional<SlotWriteTicket> ticket;
  auto destination = [&](const ReplicaMeta& m) -> Result<replica::FetchDestination> {
    SP_ASSIGN_OR_RETURN(auto begun, arena->BeginWrite(m.image_bytes));
    if (begun.first != Arena::Acquire::kAcquired) {
      return Unavailable("no slot of rank " + std::to_string(r.rank) + " is free");
    }
    ticket = begun.second;
    PopulateForWrite(ticket->data.subspan(0, m.image_bytes));
    return replica::FetchDestination{ticket->data.subspan(0, m.image_bytes), arena};
  };
  ReplicaMeta meta;
  auto delay = std::chrono::milliseconds(1);
  while (true) {
    // The peer service waits on one connection while the origin has not taken the snapshot; a
    // new one follows a NotFound that ended it (the snapshot gone between describe and fetch).
    replica::SnapshotOrigin from = origin;
    from.wait_s =
        std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    Status s = service_->FetchSnapshot(from, r.rank, r.step, destination, &meta);
    if (s.ok()) break;
    if (ticket) {
      arena->AbortWrite(*ticket);
      ticket.reset();
    }
    // Not taken yet: the sender's transport snapshots while the receiver already asks.
    if (s.code() != StatusCode::kNotFound) return fail(s);
    if (std::chrono::steady_clock::now() + delay > deadline) {
      return fail(
          NotFound("timed out after " + std::to_string(r.timeout_s) + " s: " + s.message()));
    }
    std::this_thread::sleep_for(delay);
    delay = std::min(delay * 2, std::chrono::milliseconds(20));
  }
  std::span<std::byte> image = ticket->data.subspan(0, meta.image_bytes);
  // The bytes passed their CRCs; they must also be an image of this rank and step.
  auto header = ParseImageHeader(image, what);
  Status s = header.status();
  if (s.ok() && (header->first.rank != r.rank || header->first.step != r.step)) {
    s = Corruption(what + ": the image is rank " + std::to_string(header->first.rank) +
                   "'s of step " + std::to_string(header->first.step));
  }
  if (!s.ok()) {
    arena->AbortWrite(*ticket);
    return fail(s);
  }
  if (!arena->FinishWrite(*ticket, r.step, meta.image_bytes)) {
    return fail(Unavailable(what + ": the rank's slot was taken over meanwhile"));
  }
  reply.slot = ticket->slot;
  reply.generation = ticket->generation;
  reply.bytes = meta.image_bytes;
  reply.source = origin.peer.node;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  spdlog::info("healed {}: {} bytes in {:.3f} s", what, reply.bytes, seconds);
  a.payload = Encode(reply);
  return a;
}

}  // namespace safepoint::agent
