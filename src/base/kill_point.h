// Named kill points for the crash campaign (tests/crash/, docs/reliability.md).
//
// SP_KILL_POINT("name") marks a moment at which a crash must be survivable. Every build has them
// (the pip package, `make build`, the sanitizer and fuzz builds: one build serves the tests and
// the crash campaign), disarmed unless the process was started with the environment variable
//     SAFEPOINT_KILL_AT=<name>[:<nth>]
// which makes the process raise(SIGKILL) on the nth hit (default 1) of that point, counted per
// process; a name that is not in kKillPoints aborts the process at its first hit. With
// SAFEPOINT_KILL_STAMP=<file> the kill is one-shot across processes: the process that is
// about to die creates <file> (O_EXCL) and writes "<name> <nth> <pid>"; a process that finds the
// file already there does not die. The agent inherits its environment from the training process
// that starts it, so the stamp keeps a restarted agent from dying at the same point again.
// Disarmed, a hit costs one relaxed load of a global and a branch that is never taken.
//
// kKillPoints is the one list of names: a name used anywhere else fails to compile, and the
// crash driver reads its campaign's points from this list.
#pragma once

#include <atomic>
#include <string_view>

namespace safepoint::internal {

// Every kill point, in the order a save reaches them. "(each)" points are hit once per piece or
// object, so that nth picks how far the operation got.
inline constexpr std::string_view kKillPoints[] = {
    // Training process, Checkpointer.save (src/client/snapshot_client.cc, src/image/image.cc)
    "client.copy.piece",            // (each) 256 KiB of the image copied into the slot (WRITING)
    "client.save.before_complete",  // image and checksums in the slot, slot still WRITING
    "client.save.after_complete",   // slot COMPLETE (leased for the agent), agent not told yet
    // Agent, persisting a snapshot (src/agent/agent.cc)
    "agent.persist.leased",         // slot leased and checked, nothing written to storage yet
    "agent.persist.before_commit",  // the rank's image is published, TryCommit not called yet
    "agent.persist.before_prune",   // the step is committed, retention not applied yet
    // Commit protocol (src/checkpoint/checkpoint_store.cc)
    "store.write.after_piece",      // (each) 8 MiB piece of an image written to the temporary
    "store.commit.before_write",    // every rank's image checked, COMMIT not written yet
    "store.commit.after_write",     // COMMIT published (durable), nothing after it done yet
    "store.delete.after_commit",    // DeleteStep: COMMIT removed, the images not yet
    "store.delete.after_object",    // (each) DeleteStep: one more object of the step removed
    "store.cleanup.before_remove",  // (each) CleanUp: about to remove a leftover or stray object
    // POSIX storage driver, Publish (src/storage/posix/posix_storage.cc)
    "posix.publish.before_fsync",      // temporary file written, not fsynced
    "posix.publish.before_rename",     // temporary file fsynced, not renamed
    "posix.publish.before_dir_fsync",  // renamed over the final name, directory not fsynced
    // Copying a committed step down the storage tiers (src/checkpoint/tier_copy.cc: the agent's
    // TierChain, and `safepoint cp`; src/agent/tier_copier.cc)
    "tier_copy.mid_image",             // (each) a verified chunk written to the temporary
    "tier_copy.before_image_publish",  // (each) an image and its checksums written, not published
    "tier_copy.before_commit",         // every image published on the lower tier, no COMMIT yet
    "tier_copy.after_commit",          // COMMIT published on the lower tier, nothing after it
    "agent.tier.before_prune",         // a step copied down, the lower tier not pruned yet
    "agent.tier.mid_prune",            // (each) pruning a lower tier: a step deleted, not the next
    // Packed images and the chunk store's GC (src/checkpoint/packed_writer.cc, chunk_gc.cc)
    "pack.write.after_intent",     // the save's intent published, no chunk written yet
    "pack.write.after_chunk",      // (each) one more new chunk object published
    "pack.write.before_manifest",  // every chunk stored, the manifest not published
    "pack.write.after_manifest",   // the manifest published, the intent not yet removed
    "pack.gc.after_lock",          // the GC's lock taken, nothing looked at yet
    "pack.gc.before_delete",       // (each) about to delete one unreferenced chunk
    "pack.gc.before_unlock",       // every unreferenced chunk deleted, the lock still held
    // Peer replication (docs/replication.md; armed by the node-loss rounds, tests/crash/
    // node_campaign.py): src/replica/peer_service_client.cc, replica_store.cc, src/agent/
    // replicator.cc
    "replica.push.after_chunk",        // (each) sender: one more chunk of a replica sent
    "replica.receive.before_visible",  // receiver: replica received and verified, not renamed
    "replica.rebuild.before_finish",   // a lost rank's snapshot rebuilt into its slot, not COMPLETE
    "replica.flush.before_write",      // teardown: a lost node's step read from its replica
    "replica.flush.before_commit",     // teardown: its image persisted, TryCommit not called yet
};

consteval bool IsKillPoint(std::string_view name) {
  for (std::string_view k : kKillPoints) {
    if (k == name) return true;
  }
  return false;
}

// What SAFEPOINT_KILL_AT said, read at the first hit: kUnread until then.
enum class KillPointsState : unsigned char { kUnread, kDisarmed, kArmed };
extern std::atomic<KillPointsState> g_kill_points_state;

// Reads SAFEPOINT_KILL_AT on the first call, counts a hit of `name` and dies if
// SAFEPOINT_KILL_AT names this hit.
void KillPointHit(std::string_view name);

}  // namespace safepoint::internal

#define SP_KILL_POINT(name)                                                              \
  do {                                                                                   \
    static_assert(::safepoint::internal::IsKillPoint(name), "unknown kill point " name); \
    if (::safepoint::internal::g_kill_points_state.load(std::memory_order_relaxed) !=    \
        ::safepoint::internal::KillPointsState::kDisarmed) [[unlikely]] {                \
      ::safepoint::internal::KillPointHit(name);                                         \
    }                                                                                    \
  } while (0)
