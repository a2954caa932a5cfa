// CheckpointStore: the steps of one checkpoint directory on one storage tier, with the commit
// protocol that makes a step visible only once every rank's image is durable.
//
// Layout under the storage root (docs/format.md, "Checkpoint directory"):
//   step-<20-digit step>/rank-<rank, 5+ digits>.img   one image per rank
//   step-<20-digit step>/COMMIT                       the commit record, written last
//   step-<20-digit step>/rank-<rank>.g<16 hex>.img     images of a save that replaced the step
// A step exists for readers if and only if its COMMIT record exists and is valid. There is no
// separate "latest" file that could disagree: the newest step is the newest valid COMMIT.
// A committed step is immutable, except that a save with SaveOptions::overwrite replaces it
// whole: its images go to new names (its generation) and one rename of COMMIT switches readers
// from the old images to the new ones; only then are the old images removed.
//
// Thread safety: a CheckpointStore may be used from several threads; several processes (ranks)
// may write different images of the same step concurrently.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "safepoint/extras.h"
#include "safepoint/image.h"
#include "safepoint/status.h"
#include "safepoint/storage.h"

namespace safepoint {

inline constexpr uint32_t kCommitFormatVersion = 1;
// A record of a replaced step (CommitRecord::generation != 0); plain records stay version 1.
inline constexpr uint32_t kCommitFormatVersionReplaced = 2;
// A record with a packed image (Image::packed; docs/format.md "Packed steps"). Readers that
// predate it skip the step as one with a corrupt record, never misreading it.
inline constexpr uint32_t kCommitFormatVersionPacked = 3;

struct CommitRecord {
  uint64_t step = 0;
  uint32_t world_size = 0;
  int64_t commit_time_ns = 0;
  std::string job;
  struct Image {
    uint64_t size = 0;
    uint32_t header_crc = 0;  // identifies the exact image that was committed
    // The image is stored packed: a manifest (rank-R.pack) and shared content-addressed chunk
    // objects (chunks/..), not one image object. The image's bytes are the same either way.
    bool packed = false;
  };
  std::vector<Image> images;  // by rank
  // Which images: 0 for rank-R.img (every step that was never replaced); otherwise the attempt
  // of the save that replaced the step, whose images are rank-R.g<generation>.img.
  uint64_t generation = 0;

  uint64_t total_bytes() const;
};

std::string EncodeCommitRecord(const CommitRecord& record);
// The same step: equal records apart from how each image is stored (Image::packed). A step
// copied to a tier with another layout is the same step there.
bool SameStep(const CommitRecord& a, const CommitRecord& b);
Result<CommitRecord> DecodeCommitRecord(std::span<const std::byte> data, std::string_view source);

// Object names.
std::string StepPrefix(uint64_t step);  // "step-00000000000000000042/"
std::string ImageObjectName(uint64_t step, uint32_t rank, uint64_t generation = 0);
std::string ImageObjectName(const CommitRecord& commit, uint32_t rank);  // the one it names
std::string CommitObjectName(uint64_t step);
// The manifest of a packed image: "step-.../rank-00000.pack" (or rank-R.g<16 hex>.pack).
std::string PackedObjectName(uint64_t step, uint32_t rank, uint64_t generation = 0);
// Parses "step-<digits>/..." and returns the step; nullopt for other names.
std::optional<uint64_t> StepFromObjectName(std::string_view name);

struct WriteStats {
  uint64_t bytes = 0;  // the image's size
  double seconds = 0;
  // Packed writes (zero for a plain image): what went to storage, chunk frames and manifest;
  // the raw bytes of the chunks that were new (not stored before); chunks in all and written.
  bool packed = false;
  uint64_t stored_bytes = 0;
  uint64_t new_raw_bytes = 0;
  uint64_t chunks = 0;
  uint64_t new_chunks = 0;
  std::string compression;  // the codec mode the chunks were encoded with ("none", "zstd", ..)
};

// How a step is stored on a tier (docs/guide.md, "Compression and incremental checkpoints").
// Values are codec::Mode's.
enum class Compression : uint8_t { kAuto = 0, kNone = 1, kZstd = 2, kPlanes = 3 };
Result<Compression> ParseCompression(std::string_view text);  // "auto" | "none" | "zstd" | ..
std::string_view CompressionName(Compression c);

struct PackOptions {
  // Compress chunks on the way to storage. kAuto compresses where the encoder keeps up with the
  // tier's measured write bandwidth (and then per chunk only what shrinks).
  Compression compression = Compression::kNone;
  // Store chunks content-addressed and write only those no earlier step stored.
  bool incremental = false;
  // The default (none, not incremental) is the plain layout: one aligned image object per rank.
  bool packed() const { return incremental || compression != Compression::kNone; }
};
// The options for a compression name that was validated (ParseCompression; kNone otherwise).
PackOptions MakePackOptions(std::string_view compression, bool incremental);

// An image read from storage into memory owned by `buffer`, checksums verified.
struct LoadedImage {
  std::shared_ptr<std::byte> buffer;  // aligned, owns the bytes
  size_t size = 0;
  std::string source;  // what it was read from, for messages
  std::span<const std::byte> bytes() const { return {buffer.get(), size}; }
};

class CheckpointStore {
 public:
  explicit CheckpointStore(std::shared_ptr<Storage> storage);

  Storage& storage() { return *storage_; }

  // Writes one rank's image durably under its final name (temporary object, sync, publish).
  // The image is streamed from the builder through a few reusable chunk buffers: checksums are
  // computed on the way and tensor bytes are copied once. Any failure loses this copy only.
  // `generation` != 0 writes the image of a replacing save (CommitRecord::generation).
  Result<WriteStats> WriteImage(const ImageBuilder& image, uint64_t generation = 0);

  // Writes an image that is already complete in memory (a snapshot): one sequential stream of
  // large aligned writes straight from `image`.
  Result<WriteStats> WriteImageBytes(std::span<const std::byte> image, uint64_t step,
                                     uint32_t rank);

  // The same writes with a layout: options.packed() writes a packed image (manifest plus
  // content-addressed chunks, encoded in parallel), else the plain image as above; with
  // compression "auto" without incremental, packed only where compressing pays on this tier. A
  // packed write that finds the chunk store's GC running (after a short wait) writes the plain
  // image instead. The chunk store's garbage collector is private to the library (the agent
  // and the CLI run it).
  Result<WriteStats> WriteImage(const ImageBuilder& image, uint64_t generation,
                                const PackOptions& options);
  Result<WriteStats> WriteImageBytes(std::span<const std::byte> image, uint64_t step, uint32_t rank,
                                     const PackOptions& options);

  // The agent's writes of a snapshot's image (docs/reliability.md, "Two writers of one rank's
  // image"): named by the image's save attempt (ImageObjectName(step, rank, attempt); the plain
  // name for attempt 0) and published only where no object of that name exists
  // (PublishIfAbsent): AlreadyExists, nothing replaced, when another writer of the same attempt
  // published first. An image a commit counted is then never replaced: a writer of another
  // attempt writes another name, one of the same attempt keeps the first image.
  Result<WriteStats> WriteImageOfAttempt(const ImageBuilder& image, const PackOptions& options);
  Result<WriteStats> WriteImageBytesOfAttempt(std::span<const std::byte> image, uint64_t step,
                                              uint32_t rank, const PackOptions& options);

  // If every rank of `world_size` has a published, valid-header image for `step`, all of save
  // attempt `attempt` (ImageMeta::attempt), writes the COMMIT record (idempotent: any rank may
  // try; the record is published only where none exists, PublishIfAbsent, and a rank that finds
  // one reports the step committed). An image of another attempt (left by an
  // unfinished or replaced save) means not yet: its rank's new image will replace it. Returns
  // true when the step is committed (now or before).
  // With `generation` != 0 (a save that replaces the step; generation == attempt) the images
  // looked at are that generation's: once all are there the new COMMIT record replaces the old
  // one in one rename, and then the images no longer named (the old ones) are removed. A commit
  // of generation 0 never replaces a valid record (it returns true: the step is committed), so
  // a plain committer (the agent) cannot undo a replacement, even one that commits while it
  // checks; it replaces only a corrupt record (the step does not exist).
  Result<bool> TryCommit(uint64_t step, uint32_t world_size, std::string_view job,
                         uint64_t attempt = 0, uint64_t generation = 0);
  // The agent's commit, of the images its writes name by attempt (WriteImageOfAttempt): a
  // record of generation `attempt`, published only where no valid record exists (an existing
  // one means the step is committed: true). It never replaces a record nor removes an image.
  Result<bool> TryCommitOfAttempt(uint64_t step, uint32_t world_size, std::string_view job,
                                  uint64_t attempt);

  // Valid commit records, ascending by step. A corrupt COMMIT record is skipped (that step does
  // not exist) and reported through `problems` when given. One List; a record this store read
  // or published before is not read again while the listing shows it with the size and the
  // modification time it had (a backend that lists no time reads every record), and every
  // kReverifyListings-th listing reads every record: the agent's retention lists the committed
  // steps at each commit, and read KEEP + 1 records each time.
  // `listing`, when given, receives the List it made (when it returns OK).
  Result<std::vector<CommitRecord>> ListCommitted(std::vector<std::string>* problems = nullptr,
                                                  std::vector<ObjectInfo>* listing = nullptr);
  static constexpr uint64_t kReverifyListings = 16;
  // The steps that have a COMMIT object, ascending, from one List (no record is read: a step
  // whose record is damaged is among them).
  Result<std::vector<uint64_t>> StepsWithCommit();
  // The newest valid commit record among `steps` (ascending, as StepsWithCommit gives), read
  // newest first: one COMMIT read where the newest is intact, whatever the number of steps.
  // Damaged records passed over are reported through `problems`; nullopt when none is valid.
  Result<std::optional<CommitRecord>> NewestCommitted(const std::vector<uint64_t>& steps,
                                                      std::vector<std::string>* problems = nullptr);
  Result<CommitRecord> ReadCommit(uint64_t step);
  // The step's COMMIT record, made durable first: a record that can be read may not survive a
  // power loss yet (its writer's directory sync failed, or the writer died before it). Publishes
  // the same record again where none exists (PublishIfAbsent): finding the name taken makes it
  // durable (POSIX: the directory is synced; an object store's PUT is durable once visible).
  // NotFound when the step is not committed, IOError when its COMMIT cannot be made durable.
  Result<CommitRecord> ConfirmCommit(uint64_t step);

  // What a COMMIT record says of one rank's image (docs/format.md, "COMMIT record"), known to
  // the image's writer once it published it.
  struct ImageFact {
    uint64_t size = 0;        // the image's size (packed: of the image its manifest describes)
    uint32_t header_crc = 0;  // its header's CRC
    bool packed = false;      // stored as a manifest (rank-R[.g<attempt>].pack)
    bool elsewhere = false;   // it leaves tensors to other ranks' images (ImageLayout)
    bool operator==(const ImageFact&) const = default;
  };
  // The fact of rank's image of `step` named by `attempt` as stored, its header read and checked
  // (step, rank, attempt, size); nullopt when none is stored whole (also a torn or unreadable
  // one: it is written anew). One header read where the image is plain.
  Result<std::optional<ImageFact>> StoredImageOfAttempt(uint64_t step, uint32_t rank,
                                                        uint64_t attempt);
  // The agent's commit from what the images' writers reported (facts[r]: rank r's image of save
  // `attempt`, published), without listing the step or reading any image's header: the record
  // TryCommitOfAttempt would write, published only where none exists; an existing valid record
  // means the step is committed (true). Where an image leaves tensors to others
  // (ImageFact::elsewhere) the images' indexes are read first, as TryCommit does, to check that
  // every such tensor is held (Corruption otherwise).
  Result<bool> CommitFromFacts(uint64_t step, std::string_view job, uint64_t attempt,
                               const std::vector<ImageFact>& facts);

  // A node's report of the images its agent published of (step, attempt), `facts` by rank:
  // step-S/facts-<lowest rank>.g<attempt>. Written by the agent after its last image of the step
  // where other nodes' agents write the job's other ranks, so that the listing commit reads N
  // small reports instead of W image headers. A hint only: the commit reads the header of an
  // image no valid report describes, and a record built from a wrong fact fails the load's size
  // and header CRC check.
  Status WriteFactsReport(uint64_t step, uint64_t attempt,
                          const std::map<uint32_t, ImageFact>& facts);
  // A node's word that rank's image of (step, attempt) will never be written: the agent lost the
  // snapshot before it persisted it (overwritten by a newer one in memory) and no image of it is
  // stored: step-S/abandoned.g<attempt>, a small CRC'd record naming the rank and `why` (bounded).
  // The other nodes' agents, waiting for the step's commit, read it and end their ranks' waits
  // with CancelledError instead of waiting until their timeout (docs/architecture.md, "Waits
  // that can never be answered"). The step of that attempt can never commit: its images are one
  // attempt's and one is missing for good.
  Status ReportAbandoned(uint64_t step, uint64_t attempt, uint32_t rank, std::string_view why);
  struct AbandonedImage {
    uint32_t rank = 0;
    std::string why;
  };
  // (step, attempt)'s abandoned record; nullopt where none is stored, or the stored one is not
  // whole (a torn or foreign object is ignored).
  Result<std::optional<AbandonedImage>> ReadAbandoned(uint64_t step, uint64_t attempt);
  // The agent's listing commit (TryCommitOfAttempt's checks: every rank's image of `attempt`
  // published), each image's fact taken from `known` (this agent's own writes), else from a
  // facts report in the step, else from its header; then CommitFromFacts.
  Result<bool> TryCommitOfAttemptWithFacts(uint64_t step, uint32_t world_size, std::string_view job,
                                           uint64_t attempt,
                                           const std::map<uint32_t, ImageFact>& known);

  // Whether rank's image of `step` (plain or packed, named by `attempt` as WriteImageOfAttempt
  // names it) is stored whole and is of save `attempt`: a
  // persist of that snapshot then writes nothing, only tries the commit. The same snapshot is
  // laid out differently by who writes it (a requested persist leaves replicas to other ranks,
  // an adopted or flushed one writes every tensor), and a rewrite could replace the image that
  // another node's agent has just committed the step with (node-loss campaign seed 3141592653,
  // round 25). A torn or unreadable image counts as not stored.
  Result<bool> HoldsImageOfAttempt(uint64_t step, uint32_t rank, uint64_t attempt);

  // Reads rank's image of a committed step with parallel reads and verifies every checksum and
  // that it is the image the commit record names. A tensor the image leaves to another rank's
  // image ("elsewhere") larger than every image of the step is Corruption (as in ReadMetadata).
  Result<LoadedImage> ReadImage(const CommitRecord& commit, uint32_t rank);

  // Whether every tensor that rank's image of `commit` leaves to another rank's image
  // (TensorSpec::elsewhere; `entries`: that image's index) is held, same ReplicaKey, by some
  // image of the step, as the commit checked: Corruption naming the step and the tensor
  // otherwise (a forged or damaged step). Reads other images' headers and indexes until every
  // such tensor is found; nothing when `entries` leaves none elsewhere. LoadShard checks this
  // before handing out an image (its caller allocates those tensors, then fills them).
  Status CheckReplicasHeld(const CommitRecord& commit, uint32_t rank,
                           const std::vector<TensorEntry>& entries);
  // The same for every rank's image of the step (`safepoint verify`).
  Status CheckReplicasHeld(const CommitRecord& commit);

  // Reads only the header, index and extras of rank's image of a committed step (no tensor
  // data), each validated by its own CRC. For inspection and for resharding. An index entry left
  // to another rank's image ("elsewhere") is bounded by the largest image of the step (the image
  // that holds it is at least as large): Corruption otherwise, before a caller allocates it.
  struct Metadata {
    ImageMeta meta;
    ImageLayout layout;
    std::vector<TensorEntry> tensors;
    Value extras;
    std::vector<uint32_t> chunk_crcs;  // one per chunk, from the (validated) checksum section
    std::string name;                  // the image's object name (the commit's generation)
    std::string source;
  };
  Result<Metadata> ReadMetadata(const CommitRecord& commit, uint32_t rank);

  // Copies byte ranges of rank's image of a committed step (offsets from the start of the image,
  // e.g. a part of one tensor's data) into caller memory, reading only the checksum chunks that
  // cover them, each verified against `md` (from ReadMetadata of the same commit and rank).
  // Ranges may overlap and come in any order. For restores, resharding and tensors that another
  // rank wrote: a rank reads what it needs, not whole images. A chunk that lies wholly inside one
  // range is read straight into that range's memory and verified there (no staging copy) where
  // the storage has no direct I/O or that memory is aligned for it; other chunks go through a
  // reused staging buffer and are verified before any of their bytes is copied out. On an error the
  // contents of the destinations are unspecified (they may hold bytes of a chunk that failed its
  // checksum): the caller must not use them.
  struct Range {
    uint64_t offset = 0;
    uint64_t length = 0;
    std::byte* dst = nullptr;
  };
  Status ReadRanges(const Metadata& md, std::span<const Range> ranges);

  // Chunk by chunk, for streaming an image (ReadRanges and CopyStep use these): OpenImage opens
  // the object `md` describes, checked to still have the size its header gives; ReadChunk reads
  // checksum chunk `chunk` of it into `dst` (exactly the chunk's length: md.layout.chunk_size,
  // less for the last one) and verifies it against md.chunk_crcs (Corruption naming the image).
  Result<std::unique_ptr<ReadableObject>> OpenImage(const Metadata& md);
  static Status ReadChunk(const Metadata& md, const ReadableObject& image, uint64_t chunk,
                          std::span<std::byte> dst);

  // Deletes a step: COMMIT first (so it stops existing at once), then its images.
  Status DeleteStep(uint64_t step);

  // Removes what failed or interrupted writes left: temporary objects and the objects of
  // uncommitted steps older than the newest committed step. Returns the number of objects
  // removed. A published object of an uncommitted step is removed only once older than `grace`
  // (by its storage's modification time; one whose time the storage does not know counts as
  // old): a writer of an older step in another process or thread may have published its image
  // and be about to commit, and removing the image under it would leave a COMMIT record
  // without it. A temporary is removed at once (its writer's publish then fails: an error,
  // nothing lost).
  static constexpr std::chrono::seconds kAbandonedGrace{600};
  Result<size_t> CleanUp(std::chrono::seconds grace = kAbandonedGrace);
  // The same from a listing of "step-" that ListCommitted gave (`listing`) and the newest step
  // whose record it found valid (retention, right after its ListCommitted: no second List, no
  // COMMIT read). Objects listed and gone since are passed over.
  Result<size_t> CleanUpListed(const std::vector<ObjectInfo>& listing, uint64_t newest,
                               std::chrono::seconds grace = kAbandonedGrace);

 private:
  // The plain writes, named by `generation`; `exclusive` publishes only where the name is free.
  Result<WriteStats> WritePlain(const ImageBuilder& image, uint64_t generation, bool exclusive);
  Result<WriteStats> WritePlainBytes(std::span<const std::byte> image, uint64_t step, uint32_t rank,
                                     uint64_t generation, bool exclusive);
  // TryCommit (`replace`: a replacing save's commit) and TryCommitOfAttempt (not `replace`).
  Result<bool> Commit(uint64_t step, uint32_t world_size, std::string_view job, uint64_t attempt,
                      uint64_t generation, bool replace);
  Status CheckReplicasHeld(uint64_t step, const std::vector<std::string>& names);
  // Publishes `record` as its step's COMMIT where no valid record exists (false: one did).
  Result<bool> PublishCommitIfAbsent(const CommitRecord& record);
  // The index of rank's image of `commit`, its header checked against the record.
  Result<std::vector<TensorEntry>> ReadIndex(const CommitRecord& commit, uint32_t rank);
  // The image object of `name`: a plain image, or the image a manifest (.pack) describes.
  Result<std::unique_ptr<ReadableObject>> OpenImageObject(const std::string& name);
  // ListCommitted's records, by step (see there). `mtime_ns` 0: published by this store and not
  // listed since (the listing's time is taken where the size matches: the name was free).
  struct KnownCommit {
    CommitRecord record;
    uint64_t size = 0;
    int64_t mtime_ns = 0;
  };
  void RememberCommit(const CommitRecord& record, uint64_t size);
  // The steps that have a COMMIT object in `listing` (a List of "step-"), ascending.
  static std::vector<uint64_t> StepsWithCommitIn(const std::vector<ObjectInfo>& listing);
  // CleanUp's removals: what `objects` lists of uncommitted steps older than `newest`.
  Result<size_t> RemoveUncommitted(const std::vector<ObjectInfo>& objects,
                                   const std::vector<uint64_t>& committed_steps, uint64_t newest,
                                   std::chrono::seconds grace);
  std::shared_ptr<Storage> storage_;
  std::mutex known_mu_;
  std::map<uint64_t, KnownCommit> known_commits_;
  uint64_t listings_ = 0;
};

// Opens the checkpoint directory at `path` (a plain path or a URI).
Result<std::unique_ptr<CheckpointStore>> OpenCheckpointStore(std::string_view path);

// --- Copies between storage tiers (tier_copy.cc) ---------------------------------------------

struct CopyProgress {
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
};
struct CopyOptions {
  std::function<void(const CopyProgress&)> progress;  // optional; called serialized
  size_t parallelism = 4;                             // chunks in flight
  const std::atomic<bool>* cancel = nullptr;          // optional; Cancelled status when set
  PackOptions layout;  // how the destination stores the step (its images may differ in layout)
};
struct CopyResult {
  uint64_t bytes = 0;
  double seconds = 0;
  bool already_there = false;
};
// Copies committed step `step` from `src` to `dst` with dst's commit protocol: each rank's image
// the COMMIT record names is streamed chunk by chunk (bounded memory), every chunk verified
// against the source image's checksums (and the header against the record) before it is written,
// written under the same object name, published; then the same COMMIT record is published with
// PublishIfAbsent. A step already committed on dst with an equal record: already_there (nothing
// written). A different record there: AlreadyExists naming both. Any failure leaves dst's
// visible steps unchanged (an uncommitted step directory may stay; dst's CleanUp removes it).
Result<CopyResult> CopyStep(CheckpointStore& src, CheckpointStore& dst, uint64_t step,
                            const CopyOptions& options = {});

// --- Synchronous save and load of one rank's shard (what safepoint.save / load call) ---------

struct SaveOptions {
  // A committed step is immutable: saving it again is AlreadyExists, unless `overwrite`, which
  // replaces it atomically once every rank of this save (ImageMeta::attempt, non-zero, shared
  // by the ranks and not the one that committed the step) has saved: readers see the old step
  // or the new one, never a mix and never nothing.
  bool overwrite = false;
  PackOptions pack;  // the layout of the image (plain by default)
};

struct SaveResult {
  uint64_t bytes = 0;
  double write_seconds = 0;
  uint64_t stored_bytes = 0;  // packed: what was written (new chunk frames and the manifest)
  bool committed = false;     // this call committed the step (or found it committed)
};

// Builds rank's image of `meta.step` from the tensors and encoded extras, writes it with the
// commit protocol, commits the step if every rank's image is now there, and cleans up what
// failed writes left behind. Durable when it returns.
Result<SaveResult> SaveShard(CheckpointStore& store, ImageMeta meta,
                             std::vector<TensorSource> tensors, std::string extras,
                             SaveOptions options = {});

struct LoadedShard {
  CommitRecord commit;
  LoadedImage image;
  ImageReader reader;
  Value extras;
  // Newer copies that were skipped because they were corrupt or missing, one line each.
  std::vector<std::string> skipped;
};

// Loads rank's shard. With `step` the exact step (NotFound / Corruption when it cannot be read);
// without, the newest committed step that reads back intact, falling back to older steps and
// reporting the skipped ones. NotFound when nothing is committed. A step replaced while it is
// read (its old images removed) is read again from its new COMMIT record.
Result<LoadedShard> LoadShard(CheckpointStore& store, std::optional<uint64_t> step, uint32_t rank);
// Loads rank's shard of the step `commit` records, a COMMIT record the caller already has: one
// process of the job found the newest step (StepsWithCommit, NewestCommitted) and handed its
// record's bytes to the ranks, each of which decoded them (DecodeCommitRecord checks the
// record's CRC). The rank then reads only its image, verified against the record (size, header
// CRC, every checksum): a damaged or foreign image is Corruption as with LoadShard(step). The
// COMMIT object is read only where the image is missing or does not match the record; where the
// stored record then differs from the handed one (the step was replaced since the lookup), the
// images it names are loaded instead, as LoadShard(step) does.
Result<LoadedShard> LoadShard(CheckpointStore& store, const CommitRecord& commit, uint32_t rank);

}  // namespace safepoint
