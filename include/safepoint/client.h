// SnapshotClient: what a training process links to take flash checkpoints.
//
// Save() builds the image of this rank's state straight into a free slot of the rank's arena in
// shared memory (a parallel copy; checksums computed on the way while the bytes are in cache),
// marks it COMPLETE and tells the node agent, which persists it in the background. Training
// blocks only for the copy. LoadNewest() reads the newest valid snapshot back from memory (hot
// reload), verifying every checksum.
//
// The agent is started on demand (detached, so that it outlives the training process) when none
// serves the job. If the agent dies, the next call reconnects, starting a new agent, which
// adopts the snapshots it finds.
//
// Thread safety: one thread at a time.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "safepoint/checkpoint.h"
#include "safepoint/image.h"
#include "safepoint/replication.h"
#include "safepoint/status.h"
#include "safepoint/tiers.h"

namespace safepoint {

// Private to the library, named here only by SnapshotClient's members.
class Arena;  // a rank's snapshot slots (src/shm/arena.h)
struct SlotInfo;
struct SlotWriteTicket;
namespace protocol {  // what the client and the agent say to each other (src/protocol/protocol.h)
enum class MessageType : uint16_t;
struct SnapshotNote;
}  // namespace protocol

struct ClientOptions {
  std::string storage;  // the checkpoint directory (path or URI)
  std::string job;
  std::string shm_dir = "/dev/shm";
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint32_t keep = 3;
  bool wait_when_busy = true;  // on_busy: wait for a slot, or skip the memory snapshot
  std::string agent_binary;    // safepointd; empty: do not start one (fail if none serves)
  double agent_start_timeout_s = 30;
  uint32_t copy_threads = 0;  // 0: all cores
  uint64_t attempt = 0;       // ImageMeta::attempt of every snapshot: shared by all ranks of a run
  std::vector<TierSpec> tiers;  // storage tiers below `storage` that the agent fills
  // The most shared memory the job's slot files on this node may take (every rank's); 0: no
  // cap beyond the free space of shm_dir. Where two slots of the rank would exceed it but one
  // fits, the rank saves into one slot (Arena::set_usable_slots); a save that could exceed it
  // even so fails (ResourceExhausted) before it takes or grows a slot.
  uint64_t max_shm_bytes = 0;
  std::string metrics;               // ask the agent to serve Prometheus metrics on "HOST:PORT"
  std::string event_log;             // the agent's event log path (empty: in the job directory)
  std::string compression = "none";  // how the agent stores steps in `storage` (TierSpec's)
  bool incremental = false;
};

// What a save cost training, sent with its snapshot note (Notify) for the agent's metrics,
// event log and the job's measurement history.
struct SaveReport {
  uint64_t step = 0;
  double blocking_seconds = 0;  // the time the save blocked training
  uint64_t bytes = 0;           // the snapshot's image bytes
};

struct SnapshotResult {
  bool saved = false;  // false: skipped because no slot was free (on_busy="skip")
  bool persist_requested = false;
  uint32_t slot = 0;
  uint64_t image_bytes = 0;
  double copy_seconds = 0;    // filling the slot (the blocking part of a save)
  double wait_seconds = 0;    // waiting for a free slot (on_busy="wait")
  double create_seconds = 0;  // creating and pre-faulting a slot (first save, or a new layout)
  std::string agent_error;    // the agent could not be told (the snapshot is safe in memory)
};

// A restore's target for one tensor of a memory snapshot (LoadNewest/LoadStep in place): when
// the snapshot has a tensor with this spec (name, dtype, shape, box), its bytes are copied from
// the slot straight into `dst` (nbytes) in the pass that verifies the slot, and `entry` is set
// to that tensor's index in the image (-1: not filled; the caller copies it itself). `hint`:
// the index it had in the previous restore's image (-1: none); it is tried first and used only
// when that entry matches as a lookup by name would (name, dtype, shape, box, size).
struct TensorFill {
  TensorSpec spec;
  std::byte* dst = nullptr;
  uint64_t nbytes = 0;
  int64_t entry = -1;
  int64_t hint = -1;
};

struct MemorySnapshot {
  LoadedImage image;  // a private, verified copy of the slot's image (or the slot: in_place)
  ImageReader reader;
  Value extras;  // empty when extras_known
  uint64_t step = 0;
  // The image's extras are byte for byte the `known_extras` the load was given (verified by
  // their checksum like any extras): they were not decoded, `extras` is empty.
  bool extras_known = false;
};

class SnapshotClient {
 public:
  ~SnapshotClient();
  static Result<std::unique_ptr<SnapshotClient>> Connect(ClientOptions options);

  // Snapshots one rank's shard of `step`. `persist`: ask the agent to persist it.
  // With notify=false the agent is told only by the next Notify() (after the ranks agreed on
  // which replicas each writes); a process that dies before is flushed without skipping.
  // `stage`, when given, is called once the slot is reserved and before it is filled, to put
  // the bytes of the TensorSource::staged tensors in place (GPU copies); it returns when they
  // are there. The slot's image is `slot`; tensor i starts at builder.tensor_offset(i).
  using StageFn = std::function<Status(std::span<std::byte> slot, const ImageBuilder& builder)>;
  Result<SnapshotResult> Save(uint64_t step, std::vector<TensorSource> tensors, std::string extras,
                              bool persist, bool notify = true, const StageFn& stage = {});
  // Snapshots `step` of a state whose structure is that of the previous Save (the same tensor
  // specs, the same extras: the caller checked), tensor i's bytes now at data[i]: the previous
  // save's image plan (index, layout, extras) is reused, so the per-tensor cost of a save is
  // one pointer (issue 14). InvalidArgument when there is no plan for that many tensors.
  Result<SnapshotResult> SaveLike(uint64_t step, std::span<const void* const> data, bool persist,
                                  bool notify = true);
  // SaveLike with the walk overlapping the copy (issue 14): BeginStreamed reserves a slot for
  // the plan's image and starts copy threads that fill and checksum each chunk as soon as the
  // addresses of its tensors are published (StreamedSave::Publish, in tensor order, by the
  // caller while it walks the state). StreamedSave::Finish(true) completes the snapshot like
  // SaveLike; Finish(false) (the state turned out not to have the plan's structure) gives the
  // slot back and saves nothing. Nothing else may use the client in between.
  class StreamedSave {
   public:
    virtual ~StreamedSave() = default;
    virtual void Publish(size_t i, const void* data) = 0;
    virtual Result<SnapshotResult> Finish(bool structure_matched) = 0;
  };
  // InvalidArgument when there is no plan; a result with saved=false (no StreamedSave) when
  // no slot is free and the client does not wait.
  Result<std::pair<std::unique_ptr<StreamedSave>, SnapshotResult>> BeginStreamed(
      uint64_t step, bool persist, bool notify = true);
  // Whether SaveLike can reuse a plan, and for how many tensors.
  std::optional<size_t> plan_tensors() const {
    return plan_ ? std::optional<size_t>(plan_->tensors().size()) : std::nullopt;
  }
  // Tells the agent about the last snapshot saved with notify=false, in one message; `skip`:
  // the tensors its persisted image leaves to other ranks; `report`: what the save cost (sent
  // with the note; for a save that was skipped, alone). Returns the error text when the agent
  // could not be told (the snapshot is safe in memory either way).
  std::string Notify(const SkipRanges& skip, std::optional<SaveReport> report = std::nullopt);
  // The structure hash of the last save's tensors (names, dtypes, shapes and boxes), computed
  // once per plan: the ranks compare it before agreeing on replicas (notify=false). 0: no plan.
  uint64_t StructureHash();
  // Replicated state copied once per node (issue 21): the tensors of this rank's state, by index
  // in the last save's plan, whose bytes other ranks of this node keep in their snapshots of the
  // same steps. From the next save on they are not copied: the image marks them "elsewhere" (no
  // bytes), and a load fills them from those ranks' slots (FillFromSiblings). It holds while the
  // state keeps the structure (StructureHash) it was set for: a save of another structure
  // copies every tensor again and forgets it. Empty: copy every tensor. InvalidArgument for a
  // range outside the plan (nothing changes then).
  Status SetCopySkip(SkipRanges skip);
  // The tensors the save plan leaves out (its "elsewhere" ranges): what the last save left out,
  // until SetCopySkip changes it for the next ones. Empty when every tensor is copied.
  SkipRanges LastCopySkip() const;
  // Fills `fills` (tensors this rank's snapshot of `step` marks elsewhere) from the snapshots of
  // `step` and `attempt` that the other ranks of the job keep on this node, verifying every
  // chunk of each image read, and checking that no slot read was written meanwhile. Returns
  // which fills were filled; a rank without such a snapshot, or whose copy fails its checks, is
  // skipped (the caller falls back to another copy for what is left).
  std::vector<bool> FillFromSiblings(uint64_t step, uint64_t attempt, std::span<TensorFill> fills);
  // Restarts the agent when the connection shows it gone (hung up); one poll otherwise. A save
  // with notify=false calls it, and a caller calls it again right before the collective that
  // precedes Notify: a rank must not wait in a collective while its node has no agent to
  // persist what other ranks' commits need. The new agent adopts the slots and persists them.
  Status ReviveAgentIfGone();
  // The tensors of the last snapshot (specs only).
  std::vector<TensorSpec> last_specs() const;
  // Waits until the newest step whose persist was asked is committed (or its persist failed);
  // `timeout_s` < 0 waits forever. OK right away when no persist was asked.
  Status Wait(double timeout_s);
  // The agent's status (JSON text).
  Result<std::string> AgentStatus();
  // Reads the newest COMPLETE snapshot of this rank that is at least `min_step`, verified.
  // NotFound when there is none; Corruption when the newest one fails its checksums.
  //
  // in_place: verify the slot's bytes where they are and hand out the slot's memory itself
  // instead of a private copy (restore copies from it once, straight into its targets). The
  // bytes stay valid until this client's next Save (only that writes this rank's slots; the
  // agent only reads them). Not for results a caller keeps. With `fills`, the tensors they match
  // are copied into their targets in the same parallel pass that verifies every chunk (one read
  // of the slot, no intermediate buffer); on Corruption the targets may hold damaged bytes.
  // `known_extras` (in place only): extras the caller has already (a restore plan's); when the
  // snapshot's are these bytes they are not decoded again (MemorySnapshot::extras_known), and
  // `extras` is left empty: a caller passing them reads extras_known, not extras.
  Result<MemorySnapshot> LoadNewest(std::optional<uint64_t> min_step, bool in_place = false,
                                    std::span<TensorFill> fills = {},
                                    const std::string* known_extras = nullptr);
  // Reads the COMPLETE snapshot of exactly `step`, verified. NotFound when no slot holds it.
  // Either load, before this client's first Save, marks the snapshot it read as the one the run
  // resumes from (Arena::MarkResumed): the next Save keeps it.
  Result<MemorySnapshot> LoadStep(uint64_t step, bool in_place = false,
                                  std::span<TensorFill> fills = {},
                                  const std::string* known_extras = nullptr);
  // A load in place with the caller's walk of its targets overlapping the copy (issue 21, item
  // 3; the restore's counterpart of BeginStreamed): BeginStreamedLoad finds the snapshot
  // (LoadStep's with `step`, else LoadNewest's with `min_step`), matches `fills` (a restore
  // plan's targets, their destinations unknown yet) to its tensors and starts copy threads that
  // verify each chunk and copy out of it once the destinations of the targets it holds are
  // published (StreamedLoad::Publish(i, data): the walk's tensor i is at `data`; `walk_index[k]`
  // is fill k's position in the walk, increasing). Finish(true) completes the load like
  // LoadNewest in place (the rest of the chunks, tensors held by other ranks, the extras);
  // Finish(false) (the walk found another structure) stops and returns Cancelled, with some
  // targets already written from the snapshot. `fills` and `walk_index` must outlive the
  // StreamedLoad; nothing else may use the client in between. Errors of Begin are LoadNewest's.
  class StreamedLoad {
   public:
    virtual ~StreamedLoad() = default;
    virtual void Publish(size_t i, const void* data) = 0;
    virtual Result<MemorySnapshot> Finish(bool structure_matched,
                                          const std::string* known_extras) = 0;
  };
  Result<std::unique_ptr<StreamedLoad>> BeginStreamedLoad(std::optional<uint64_t> step,
                                                          std::optional<uint64_t> min_step,
                                                          std::span<TensorFill> fills,
                                                          std::span<const size_t> walk_index);
  // --- peer replication ---
  // Starts the agent's peer service for node `node` on `bind_host` (once per agent; every rank
  // of the node may call it) and returns the address peers reach it at.
  Result<std::string> PeerSetup(const std::string& node, const std::string& bind_host,
                                double timeout_s);
  // Tells the agent the job's nodes and redundancy. Both are sent again to an agent that
  // replaces a dead one.
  Status SetMembership(const Membership& membership);
  // Snapshots of this rank that peers can rebuild (empty without replication).
  Result<std::vector<PeerCopy>> PeerCopies();
  // Has the agent rebuild this rank's snapshot of `step` (of `attempt`) from peers into one of
  // this rank's slots, verified; a load of the step then reads it from memory.
  Result<PeerFetchResult> FetchFromPeers(uint64_t step, uint64_t attempt, double timeout_s);
  // Has the agent (its peer service set up: PeerSetup) fetch this rank's snapshot of `step`
  // straight from the agent of another job that took it (src/client/snapshot_heal.cc), into one
  // of this rank's slots, waiting up to `timeout_s` for it to be taken there; a load of the step
  // then reads it from memory, verified. NotFound when it was not taken within timeout_s.
  Result<PeerFetchResult> HealFrom(const HealOrigin& origin, uint64_t step, double timeout_s);
  // Pauses (or resumes) the agent's replication sends, e.g. around the training's collectives.
  Status PauseReplication(bool paused);

  // The lineage every following snapshot records (ImageMeta::lineage): the step the run was
  // restored from, and the user's metadata. InvalidArgument (ValidateLineage) leaves it as it was.
  Status SetLineage(Lineage lineage);
  const Lineage& lineage() const { return lineage_; }
  // Tells the agent what this process saw, for its metrics, event log and the job's history
  // (docs/operations.md): `event` "save" (`saved` false: skipped), "restore" (from `source`;
  // `level`: the history's name of it, "path", "tier 1", ...), "checksum" (damaged bytes in
  // `source`, `error` says which) or "start" (run `step` began). Best effort: nothing is sent
  // while no agent is connected, and a failure to send is ignored (the next request reconnects).
  void Report(std::string_view event, uint64_t step, bool saved, double seconds, uint64_t bytes,
              std::string_view source = {}, std::string_view error = {},
              std::string_view level = {});

  // Clean close: the agent persists the newest snapshot if needed and removes the arena.
  Status Close(double timeout_s);

  // The rank's slots (src/shm/arena.h, inside the library: the Python binding and tests read them).
  Arena& arena() { return *arena_; }
  const ClientOptions& options() const { return opt_; }
  std::optional<uint64_t> last_persist_step() const { return last_persist_step_; }

 private:
  SnapshotClient() = default;
  Status EnsureAgent();
  Status ConnectOnce();
  Status StartAgent();
  Status Hello();
  // A kPeerFetch round trip (`request`: the encoded PeerFetchRequest) of FetchFromPeers and
  // HealFrom: the agent wrote the rank's slot, which this client's arena then maps.
  Result<PeerFetchResult> PeerFetch(const std::string& request, double timeout_s);
  // Writes plan_ into a slot: the common part of Save and SaveLike.
  Result<SnapshotResult> WriteSnapshot(uint64_t step, bool persist, bool notify,
                                       const StageFn& stage);
  // The parts of WriteSnapshot before and after the copy.
  Status PrepareWrite(bool notify, SnapshotResult* result);
  Result<bool> AcquireSlot(SnapshotResult* result, SlotWriteTicket* ticket);
  // Superseded (this process lost the rank to a newer run's: src/shm/rank_claim.h) when the
  // slot could not be marked COMPLETE.
  Status CompleteWrite(uint64_t step, bool persist, bool notify, const SlotWriteTicket& ticket,
                       SnapshotResult* result);
  class Streamed;
  // ResourceExhausted when a snapshot of `image_bytes` could take the job's shared memory on
  // this node beyond ClientOptions::max_shm_bytes.
  Status CheckShmCap(uint64_t image_bytes);
  Result<MemorySnapshot> LoadSlot(const SlotInfo& slot, bool in_place,
                                  std::span<TensorFill> fills = {},
                                  const std::string* known_extras = nullptr);
  // LoadStep's slot with `step`, else LoadNewest's (at least `min_step`); NotFound as theirs.
  Result<SlotInfo> FindSlot(std::optional<uint64_t> step, std::optional<uint64_t> min_step);
  std::string SlotSource(const SlotInfo& slot) const;  // names the slot in errors
  // A load in place between its parse and its end (src/client/snapshot_client.cc).
  struct InPlaceLoad;
  // `dst_known`: fills without a destination are left out (else they get one before the copy).
  Result<InPlaceLoad> BeginInPlace(const SlotInfo& slot, std::span<TensorFill> fills,
                                   bool dst_known);
  // After the copy: the tensors other ranks hold, the extras, the snapshot.
  Result<MemorySnapshot> EndInPlace(InPlaceLoad& l, std::span<TensorFill> fills,
                                    const std::string* known_extras);
  class LoadStream;
  void NoteResumedFrom(const SlotInfo& slot);
  Status CheckSnapshotIdentity(const ImageReader& reader, const SlotInfo& slot,
                               const std::string& source) const;
  void Disconnect();
  // Sends a request and returns the payload of its reply of type `reply_type`; reconnects (and
  // starts a new agent) once when the agent is gone.
  Result<std::string> Request(protocol::MessageType type, const std::string& payload,
                              protocol::MessageType reply_type, double timeout_s);

  ClientOptions opt_;
  std::string job_dir_;
  std::unique_ptr<Arena> arena_;
  int fd_ = -1;
  std::optional<uint64_t> last_persist_step_;
  std::optional<uint64_t> last_saved_step_;
  // Peer replication set up by this client, sent again to a new agent.
  std::optional<std::tuple<std::string, std::string, double>> peer_setup_;
  uint32_t peer_port_ = 0;  // the peer service's port, asked of an agent that replaces it
  std::optional<Membership> membership_;
  Status SendPeerState();
  bool saved_ = false;  // a save completed (before that, a load marks the snapshot resumed from)
  Lineage lineage_;
  std::unique_ptr<ImageBuilder> plan_;  // the last save's image plan, reused by SaveLike
  std::optional<uint64_t> plan_hash_;   // its structure hash, once a caller asked for it
  // SetCopySkip's ranges, and the structure hash they were set for.
  SkipRanges copy_skip_;
  uint64_t copy_skip_hash_ = 0;
  // Rebuilds plan_ with the tensors in copy_skip_ (and only those) marked elsewhere.
  Status ApplyCopySkip();
  // FillFromSiblings from one rank's slots; `filled` as there. Returns how many it filled.
  // Other ranks' arenas FillFromRank opened, kept mapped: a restore maps (and faults in the
  // page tables of) a sibling's slots once, not at every load.
  std::unordered_map<uint32_t, std::unique_ptr<Arena>> sibling_arenas_;
  Result<size_t> FillFromRank(uint32_t rank, uint64_t step, uint64_t attempt,
                              std::span<TensorFill> fills, std::vector<bool>* filled);
  ParsedIndex restore_index_;  // the index of the last load in place (ImageReader::Parse)
  std::unique_ptr<protocol::SnapshotNote> pending_note_;  // a Snapshot message not yet sent
  // Restarts the agent when it dies, from a thread of its own, while this client is open and
  // may start one (issue 22): a rank that waits in a collective (or anywhere outside this
  // client) for another rank, which waits for this node's images in wait(), talks to no agent;
  // nothing else would restart it. Stopped by Close, before the agent is told.
  class AgentWatch;
  std::unique_ptr<AgentWatch> watch_;
};

// Another job's snapshot on this node, read straight from that job's slot files (a torchft heal
// from a replica whose agent shares this node's shared memory: no agent, no network; issue 34
// item 6): `rank`'s COMPLETE snapshot of `step` in the job directory of `job` under `shm_dir`
// (JobDirectory: this user's, 0700; Unavailable when this process cannot open it). Waits up to
// `wait_s` for the snapshot to be taken (NotFound after). As a hot reload of the job's own: a
// private copy, every chunk verified against the image's checksums, the slot checked to still hold
// the same snapshot after the copy (else Corruption: overwritten while it was read), and the
// image's job, rank and step checked.
Result<MemorySnapshot> ReadNodeSnapshot(const std::string& shm_dir, const std::string& job,
                                        uint32_t rank, uint64_t step, double wait_s);

namespace internal {
// The Status a client returns for the agent's refusal of its hello, whose text is `text`: a
// refusal because of storage (the agent sends that Status's ToString(): "IOError: ...",
// "ResourceExhausted: ...", "NotFound: ...") keeps its code, so that the caller sees a storage
// error naming the path; every other refusal (another job under the name, a rank already
// connected) is InvalidArgument "the safepoint agent refused this process: ...".
Status HelloRefusal(std::string_view text);
}  // namespace internal

}  // namespace safepoint
