// The commit protocol (docs/format.md, "Commit protocol"), exactly as implemented here and in
// the POSIX storage driver (src/storage/posix/):
//
// Rank r writing its image of step s (WriteImage / WriteImageBytes):
//   1. Create "step-S/rank-R.img.tmp.<random>" with O_CREAT|O_EXCL (plus an O_DIRECT descriptor
//      where the filesystem allows it). If "step-S/" had to be created, fsync the root directory.
//   2. Stream the image: chunks are filled from the tensors, CRC'd, and written with pwrite by
//      several threads (aligned chunks through O_DIRECT).
//   3. fsync the temporary file. On failure the copy is lost: unlink it and report. A failed
//      fsync is never retried (the kernel may have dropped the dirty pages); the caller rewrites
//      the image from its source.
//   4. rename it to "step-S/rank-R.img" (atomic replace).
//   5. fsync the directory "step-S/".
// Committing step s (TryCommit; any rank may try, after its own step 5):
//   6. List "step-S/". If rank-0 .. rank-(W-1) all exist, read each one's 4 KiB header and check
//      magic, header CRC, step, rank, world size and that the object size equals image_size.
//   7. Write "step-S/COMMIT" with steps 1, 3, 4, 5, where step 4 is an exclusive publish
//      (renameat2 RENAME_NOREPLACE): of concurrent committers one publishes the record; the
//      others find it (after an fsync of "step-S/", so that it is durable for them too) and
//      report the step committed. A record is never replaced by a plain commit, so a plain
//      committer cannot undo a replacement that committed after it checked (below).
// A failed directory fsync (step 5 of an image or of the COMMIT) comes after the rename: the
//   object is visible but may not survive a power loss. The write returns that IOError, so that
//   the save is not reported committed on its account, and deletes nothing: another rank may
//   have found the COMMIT under the name and reported the step committed. Images and COMMIT
//   share "step-S/", so the successful fsync of a COMMIT written after every image makes them
//   all durable; committing again (which finds the record and fsyncs "step-S/") makes a visible
//   COMMIT durable.
// Reading: list "step-*/COMMIT", decode each (CRC, size, version); only those steps exist. Open
//   a rank's image, compare its size and header CRC with the record, verify every chunk CRC.
// Replacing a committed step (SaveShard with overwrite; the agent never does): each rank writes
//   its image as "step-S/rank-R.g<attempt, 16 hex>.img" (1-5), beside the committed images; the
//   step stays as it was. 6-7 with those names write a record naming that generation over the
//   old COMMIT: the rename switches readers from every old image to every new one at once.
//   8. Remove the images the new record does not name. A reader that read the old record and
//   then misses an old image reads the record again (LoadShard).
// The agent's images (WriteImageOfAttempt / WriteImageBytesOfAttempt) are named by their attempt
//   as a replacing save's are, with step 4 exclusive (RENAME_NOREPLACE) like step 7; its commit
//   (TryCommitOfAttempt) is 6-7 with those names, exclusive, and removes nothing. Two writers of
//   one rank's image (docs/reliability.md) then never replace an image that a commit counted.
// Deleting: unlink COMMIT first (the step stops existing), then the images.
// Clean-up: temporaries and uncommitted images only in step directories older than the newest
//   committed step, whose writers have all finished.

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <unordered_set>

#include "base/aligned_buffer.h"
#include "base/clock.h"
#include "base/crc32c.h"
#include "base/kill_point.h"
#include "base/log.h"
#include "checkpoint/commit_record.h"
#include "checkpoint/small_object.h"
#include "safepoint/checkpoint.h"

namespace safepoint {

using internal::AlignedBuffer;
using internal::Crc32c;
using internal::kCommitFixed;
using internal::ReadSmallObject;
using internal::WriteSmallObject;

Result<std::optional<CheckpointStore::ImageFact>> CheckpointStore::StoredImageOfAttempt(
    uint64_t step, uint32_t rank, uint64_t attempt) {
  for (const std::string& name :
       {ImageObjectName(step, rank, attempt), PackedObjectName(step, rank, attempt)}) {
    auto obj = OpenImageObject(name);
    if (!obj.ok()) {
      if (obj.status().code() == StatusCode::kNotFound) continue;
      return obj.status();
    }
    std::vector<std::byte> header(kImageHeaderSize);
    if (!(*obj)->ReadAt(0, header).ok()) continue;  // torn or unreadable: write it anew
    auto parsed = ParseImageHeader(header, storage_->Describe(name));
    if (parsed.ok() && parsed->first.step == step && parsed->first.rank == rank &&
        parsed->first.attempt == attempt && parsed->second.image_size == (*obj)->size()) {
      const ImageLayout& l = parsed->second;
      return std::optional<ImageFact>(
          ImageFact{l.image_size, l.header_crc, name.ends_with(".pack"), l.has_elsewhere});
    }
  }
  return std::optional<ImageFact>();
}

Result<bool> CheckpointStore::HoldsImageOfAttempt(uint64_t step, uint32_t rank, uint64_t attempt) {
  SP_ASSIGN_OR_RETURN(auto fact, StoredImageOfAttempt(step, rank, attempt));
  return fact.has_value();
}

// Every tensor an image leaves to another rank (TensorSpec::elsewhere) must be held, same
// ReplicaKey, by some image of the step: else the step would commit with a tensor nobody wrote.
Status CheckpointStore::CheckReplicasHeld(uint64_t step, const std::vector<std::string>& names) {
  std::unordered_set<std::string> held;
  std::vector<std::pair<uint32_t, TensorSpec>> wanted;
  for (uint32_t r = 0; r < names.size(); ++r) {
    const std::string& name = names[r];
    SP_ASSIGN_OR_RETURN(auto obj, OpenImageObject(name));
    std::vector<std::byte> header(kImageHeaderSize);
    SP_RETURN_IF_ERROR(obj->ReadAt(0, header));
    SP_ASSIGN_OR_RETURN(auto parsed, ParseImageHeader(header, storage_->Describe(name)));
    std::vector<std::byte> index(parsed.second.index_size);
    SP_RETURN_IF_ERROR(obj->ReadAt(parsed.second.index_offset, index));
    SP_ASSIGN_OR_RETURN(auto entries, ParseIndex(index, parsed.second, storage_->Describe(name)));
    for (auto& e : entries) {
      if (e.spec.elsewhere) {
        wanted.emplace_back(r, std::move(e.spec));
      } else {
        held.insert(ReplicaKey(e.spec));
      }
    }
  }
  for (const auto& [r, spec] : wanted) {
    if (!held.contains(ReplicaKey(spec))) {
      return Corruption(storage_->uri() + ": step " + std::to_string(step) + ": rank " +
                        std::to_string(r) + " left tensor '" + spec.name +
                        "' to another rank, but no image of the step holds it");
    }
  }
  return Status::OK();
}

Result<bool> CheckpointStore::TryCommit(uint64_t step, uint32_t world_size, std::string_view job,
                                        uint64_t attempt, uint64_t generation) {
  return Commit(step, world_size, job, attempt, generation, /*replace=*/generation != 0);
}

Result<bool> CheckpointStore::TryCommitOfAttempt(uint64_t step, uint32_t world_size,
                                                 std::string_view job, uint64_t attempt) {
  return Commit(step, world_size, job, attempt, /*generation=*/attempt, /*replace=*/false);
}

Result<bool> CheckpointStore::Commit(uint64_t step, uint32_t world_size, std::string_view job,
                                     uint64_t attempt, uint64_t generation, bool replace) {
  if (world_size == 0 || world_size > kMaxRank) {
    return InvalidArgument("world size " + std::to_string(world_size) + " is invalid");
  }
  if (generation != 0 && generation != attempt) {
    return InvalidArgument("the images of a replacing save are named by its attempt");
  }
  if (!replace) {  // a plain commit never undoes a replacement (nor another plain commit)
    auto existing = ReadCommit(step);
    if (existing.ok() && (existing->generation != 0 || generation != 0)) {
      // Committed by another writer, who may have died before syncing its COMMIT's directory:
      // made durable before this commit says so (as the exclusive publish below does when it
      // finds the name taken). NotFound: the step was deleted since (retention).
      auto confirmed = ConfirmCommit(step);
      if (confirmed.ok()) return true;
      if (confirmed.status().code() == StatusCode::kNotFound) return false;
      return confirmed.status();
    }
  }
  SP_ASSIGN_OR_RETURN(auto objects, storage_->List(StepPrefix(step)));
  std::map<std::string, uint64_t> sizes;
  for (auto& o : objects) sizes[o.name] = o.size;

  CommitRecord record;
  record.step = step;
  record.world_size = world_size;
  record.job = std::string(job);
  record.images.resize(world_size);
  record.generation = generation;
  // Each rank's image is its plain image or its manifest (a packed image), whichever is of this
  // attempt (a leftover of another attempt in the other layout may lie beside it).
  std::vector<std::string> names(world_size);
  bool any_elsewhere = false;  // some image leaves tensors to other ranks' images
  for (uint32_t r = 0; r < world_size; ++r) {
    const std::string plain = ImageObjectName(step, r, generation);
    const std::string packed = PackedObjectName(step, r, generation);
    if (!sizes.contains(plain) && !sizes.contains(packed)) return false;
  }
  for (uint32_t r = 0; r < world_size; ++r) {
    for (const std::string& name :
         {ImageObjectName(step, r, generation), PackedObjectName(step, r, generation)}) {
      if (!sizes.contains(name)) continue;
      const std::string source = storage_->Describe(name);
      SP_ASSIGN_OR_RETURN(auto obj, OpenImageObject(name));
      AlignedBuffer header(kImageHeaderSize);
      if (!header.ok()) return ResourceExhausted("out of memory");
      SP_RETURN_IF_ERROR(obj->ReadAt(0, header.span()));
      SP_ASSIGN_OR_RETURN(auto parsed, ParseImageHeader(header.span(), source));
      const auto& [meta, layout] = parsed;
      if (meta.step != step || meta.rank != r || meta.world_size != world_size) {
        return Corruption(source + ": image is of step " + std::to_string(meta.step) + ", rank " +
                          std::to_string(meta.rank) + " of " + std::to_string(meta.world_size) +
                          ", expected step " + std::to_string(step) + ", rank " +
                          std::to_string(r) + " of " + std::to_string(world_size));
      }
      if (layout.image_size != obj->size()) {
        return Corruption(source + ": object has " + std::to_string(obj->size()) +
                          " bytes, its header says " + std::to_string(layout.image_size));
      }
      if (meta.attempt != attempt) continue;  // a leftover of another attempt, to be replaced
      record.images[r] = {layout.image_size, layout.header_crc, name.ends_with(".pack")};
      names[r] = name;
      any_elsewhere |= layout.has_elsewhere;
      break;
    }
    if (names[r].empty()) return false;
  }
  if (any_elsewhere) SP_RETURN_IF_ERROR(CheckReplicasHeld(step, names));
  record.commit_time_ns = UnixNanos();
  SP_KILL_POINT("store.commit.before_write");
  const std::string commit_name = CommitObjectName(step);
  if (replace) {
    SP_RETURN_IF_ERROR(WriteSmallObject(*storage_, commit_name, EncodeCommitRecord(record)));
  } else {
    SP_ASSIGN_OR_RETURN(bool published, PublishCommitIfAbsent(record));
    if (!published) return true;  // the step's record was there
  }
  SP_KILL_POINT("store.commit.after_write");
  if (replace) {
    // Step 8: the images the record no longer names. A failure leaves unused objects only
    // (DeleteStep removes them with the step).
    std::unordered_set<std::string> named(names.begin(), names.end());
    for (const auto& o : objects) {
      if ((o.name.ends_with(".img") || o.name.ends_with(".pack")) && !named.contains(o.name)) {
        storage_->Delete(o.name).IgnoreError();
      }
    }
  }
  return true;
}

// Published only where no record exists: a replacement may have committed since the committer
// looked, and this record must not replace its record (it would name the images the replacement
// removes). An existing record is the step's: another committer's equal one, or a replacement's
// (finding the name taken made it durable). A corrupt record (the step does not exist) is
// replaced. False: a valid record was there.
Result<bool> CheckpointStore::PublishCommitIfAbsent(const CommitRecord& record) {
  const std::string name = CommitObjectName(record.step);
  const std::string encoded = EncodeCommitRecord(record);
  Status s = WriteSmallObject(*storage_, name, encoded, /*exclusive=*/true);
  if (s.code() == StatusCode::kAlreadyExists) {
    auto existing = ReadCommit(record.step);
    if (existing.ok()) return false;
    if (existing.status().code() != StatusCode::kCorruption) return existing.status();
    s = WriteSmallObject(*storage_, name, encoded);
  }
  SP_RETURN_IF_ERROR(s);
  RememberCommit(record, encoded.size());
  return true;
}

void CheckpointStore::RememberCommit(const CommitRecord& record, uint64_t size) {
  std::lock_guard<std::mutex> lock(known_mu_);
  known_commits_[record.step] = KnownCommit{record, size, 0};
}

Result<bool> CheckpointStore::CommitFromFacts(uint64_t step, std::string_view job, uint64_t attempt,
                                              const std::vector<ImageFact>& facts) {
  const size_t world_size = facts.size();
  if (world_size == 0 || world_size > kMaxRank) {
    return InvalidArgument("world size " + std::to_string(world_size) + " is invalid");
  }
  CommitRecord record;
  record.step = step;
  record.world_size = static_cast<uint32_t>(world_size);
  record.job = std::string(job);
  record.generation = attempt;
  record.images.resize(world_size);
  bool any_elsewhere = false;
  for (size_t r = 0; r < world_size; ++r) {
    record.images[r] = {facts[r].size, facts[r].header_crc, facts[r].packed};
    any_elsewhere |= facts[r].elsewhere;
  }
  if (any_elsewhere) {
    std::vector<std::string> names(world_size);
    for (uint32_t r = 0; r < world_size; ++r) {
      names[r] =
          facts[r].packed ? PackedObjectName(step, r, attempt) : ImageObjectName(step, r, attempt);
    }
    SP_RETURN_IF_ERROR(CheckReplicasHeld(step, names));
  }
  record.commit_time_ns = UnixNanos();
  SP_KILL_POINT("store.commit.before_write");
  SP_ASSIGN_OR_RETURN(bool published, PublishCommitIfAbsent(record));
  (void)published;  // either way the step is committed
  SP_KILL_POINT("store.commit.after_write");
  return true;
}

namespace {

constexpr std::string_view kFactsMagic = "SPFACTS 1\n";
constexpr uint64_t kMaxFactsBytes = 64ull << 20;

std::string FactsReportName(uint64_t step, uint32_t lowest_rank, uint64_t attempt) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "facts-%05u.g%016llx", lowest_rank,
                static_cast<unsigned long long>(attempt));
  return StepPrefix(step) + buf;
}

std::string EncodeFacts(uint64_t step, uint64_t attempt,
                        const std::map<uint32_t, CheckpointStore::ImageFact>& facts) {
  std::string out(kFactsMagic);
  out += std::to_string(step) + " " + std::to_string(attempt) + " " + std::to_string(facts.size()) +
         "\n";
  for (const auto& [rank, f] : facts) {
    out += std::to_string(rank) + " " + std::to_string(f.size) + " " +
           std::to_string(f.header_crc) + " " +
           std::to_string((f.packed ? 1 : 0) | (f.elsewhere ? 2 : 0)) + "\n";
  }
  out += "crc " + std::to_string(Crc32c(0, out.data(), out.size())) + "\n";
  return out;
}

// Nullopt for anything but a whole, intact report of (step, attempt).
std::optional<std::map<uint32_t, CheckpointStore::ImageFact>> DecodeFacts(std::string_view text,
                                                                          uint64_t step,
                                                                          uint64_t attempt) {
  const size_t crc_at = text.rfind("crc ");
  if (!text.starts_with(kFactsMagic) || crc_at == std::string_view::npos) return std::nullopt;
  std::istringstream crc_in{std::string(text.substr(crc_at + 4))};
  uint64_t crc = 0;
  if (!(crc_in >> crc) || crc != Crc32c(0, text.data(), crc_at)) return std::nullopt;
  std::istringstream in{std::string(text.substr(kFactsMagic.size(), crc_at - kFactsMagic.size()))};
  uint64_t s = 0, a = 0, n = 0;
  if (!(in >> s >> a >> n) || s != step || a != attempt || n > kMaxRank) return std::nullopt;
  std::map<uint32_t, CheckpointStore::ImageFact> out;
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t rank = 0, size = 0, header_crc = 0, flags = 0;
    if (!(in >> rank >> size >> header_crc >> flags) || rank >= kMaxRank ||
        header_crc > UINT32_MAX || flags > 3) {
      return std::nullopt;
    }
    out[static_cast<uint32_t>(rank)] = {size, static_cast<uint32_t>(header_crc), (flags & 1) != 0,
                                        (flags & 2) != 0};
  }
  return out;
}

}  // namespace

Status CheckpointStore::WriteFactsReport(uint64_t step, uint64_t attempt,
                                         const std::map<uint32_t, ImageFact>& facts) {
  if (facts.empty()) return Status::OK();
  return WriteSmallObject(*storage_, FactsReportName(step, facts.begin()->first, attempt),
                          EncodeFacts(step, attempt, facts));
}

namespace {

constexpr std::string_view kAbandonedMagic = "SPABANDONED 1\n";
constexpr size_t kMaxAbandonedWhy = 1024;

std::string AbandonedName(uint64_t step, uint64_t attempt) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "abandoned.g%016llx", static_cast<unsigned long long>(attempt));
  return StepPrefix(step) + buf;
}

}  // namespace

Status CheckpointStore::ReportAbandoned(uint64_t step, uint64_t attempt, uint32_t rank,
                                        std::string_view why) {
  std::string reason(why.substr(0, std::min(why.size(), kMaxAbandonedWhy)));
  std::replace(reason.begin(), reason.end(), '\n', ' ');
  if (reason.empty()) reason = "no reason given";
  std::string out(kAbandonedMagic);
  out += std::to_string(step) + " " + std::to_string(attempt) + " " + std::to_string(rank) + "\n" +
         reason + "\n";
  out += "crc " + std::to_string(Crc32c(0, out.data(), out.size())) + "\n";
  return WriteSmallObject(*storage_, AbandonedName(step, attempt), out);
}

Result<std::optional<CheckpointStore::AbandonedImage>> CheckpointStore::ReadAbandoned(
    uint64_t step, uint64_t attempt) {
  using Out = std::optional<AbandonedImage>;
  auto data = ReadSmallObject(*storage_, AbandonedName(step, attempt), 4096);
  if (!data.ok()) {
    if (data.status().code() == StatusCode::kNotFound) return Out();
    return data.status();
  }
  const std::string_view text(reinterpret_cast<const char*>(data->data()), data->size());
  const size_t crc_at = text.rfind("crc ");
  if (!text.starts_with(kAbandonedMagic) || crc_at == std::string_view::npos) return Out();
  std::istringstream crc_in{std::string(text.substr(crc_at + 4))};
  uint64_t crc = 0;
  if (!(crc_in >> crc) || crc != Crc32c(0, text.data(), crc_at)) return Out();
  std::istringstream in{
      std::string(text.substr(kAbandonedMagic.size(), crc_at - kAbandonedMagic.size()))};
  uint64_t s = 0, a = 0, rank = 0;
  AbandonedImage record;
  if (!(in >> s >> a >> rank) || s != step || a != attempt || rank >= kMaxRank) return Out();
  in.ignore(1);
  if (!std::getline(in, record.why) || record.why.empty()) return Out();
  record.rank = static_cast<uint32_t>(rank);
  return Out(std::move(record));
}

Result<bool> CheckpointStore::TryCommitOfAttemptWithFacts(
    uint64_t step, uint32_t world_size, std::string_view job, uint64_t attempt,
    const std::map<uint32_t, ImageFact>& known) {
  if (world_size == 0 || world_size > kMaxRank) {
    return InvalidArgument("world size " + std::to_string(world_size) + " is invalid");
  }
  SP_ASSIGN_OR_RETURN(auto objects, storage_->List(StepPrefix(step)));
  std::map<std::string, uint64_t> sizes;
  for (auto& o : objects) sizes[o.name] = o.size;
  // A step committed already (by this attempt or an earlier run's) is committed: its record is
  // made durable before that is said (ConfirmCommit), as TryCommitOfAttempt does.
  if (sizes.contains(CommitObjectName(step))) {
    auto confirmed = ConfirmCommit(step);
    if (confirmed.ok()) return true;
    if (confirmed.status().code() == StatusCode::kNotFound) return false;
    if (confirmed.status().code() != StatusCode::kCorruption) return confirmed.status();
  }
  for (uint32_t r = 0; r < world_size; ++r) {
    if (!sizes.contains(ImageObjectName(step, r, attempt)) &&
        !sizes.contains(PackedObjectName(step, r, attempt))) {
      return false;  // not every rank's image of this attempt is published yet
    }
  }
  // A fact counts only for an image the listing shows under the name it gives (a plain image's
  // object is exactly its size).
  std::vector<std::optional<ImageFact>> facts(world_size);
  auto take = [&](uint32_t r, const ImageFact& f) {
    if (r >= world_size || facts[r]) return;
    const std::string name =
        f.packed ? PackedObjectName(step, r, attempt) : ImageObjectName(step, r, attempt);
    auto it = sizes.find(name);
    if (it != sizes.end() && (f.packed || it->second == f.size)) facts[r] = f;
  };
  for (const auto& [r, f] : known) take(r, f);
  size_t missing = std::count(facts.begin(), facts.end(), std::nullopt);
  char suffix[32];
  std::snprintf(suffix, sizeof(suffix), ".g%016llx", static_cast<unsigned long long>(attempt));
  const std::string reports = StepPrefix(step) + "facts-";
  for (const auto& [name, size] : sizes) {
    if (missing == 0) break;
    if (!name.starts_with(reports) || !name.ends_with(suffix)) continue;
    auto data = ReadSmallObject(*storage_, name, kMaxFactsBytes);
    if (!data.ok()) continue;  // a hint: the headers are read instead
    auto decoded = DecodeFacts(
        std::string_view(reinterpret_cast<const char*>(data->data()), data->size()), step, attempt);
    if (!decoded) {
      spdlog::warn("{}: not a valid facts report; reading the images' headers instead",
                   storage_->Describe(name));
      continue;
    }
    for (const auto& [r, f] : *decoded) take(r, f);
    missing = std::count(facts.begin(), facts.end(), std::nullopt);
  }
  std::vector<ImageFact> all(world_size);
  for (uint32_t r = 0; r < world_size; ++r) {
    if (!facts[r]) {
      SP_ASSIGN_OR_RETURN(facts[r], StoredImageOfAttempt(step, r, attempt));
      if (!facts[r]) return false;  // torn or of another attempt: its writer writes it again
    }
    all[r] = *facts[r];
  }
  return CommitFromFacts(step, job, attempt, all);
}

Result<CommitRecord> CheckpointStore::ReadCommit(uint64_t step) {
  const std::string name = CommitObjectName(step);
  auto data = ReadSmallObject(*storage_, name, kCommitFixed + 16ull * kMaxRank + 12);
  if (!data.ok()) {
    if (data.status().code() == StatusCode::kNotFound) {
      return NotFound(storage_->uri() + ": step " + std::to_string(step) + " is not committed");
    }
    return data.status();
  }
  SP_ASSIGN_OR_RETURN(auto record, DecodeCommitRecord(*data, storage_->Describe(name)));
  if (record.step != step) {
    return Corruption(storage_->Describe(name) + ": COMMIT record names step " +
                      std::to_string(record.step));
  }
  return record;
}

Result<CommitRecord> CheckpointStore::ConfirmCommit(uint64_t step) {
  SP_ASSIGN_OR_RETURN(CommitRecord record, ReadCommit(step));
  const std::string name = CommitObjectName(step);
  Status s = WriteSmallObject(*storage_, name, EncodeCommitRecord(record), /*exclusive=*/true);
  if (s.code() == StatusCode::kAlreadyExists) return record;  // the name is durable now
  if (s.ok()) {
    // The step was deleted (retention) since the read: take the record back out.
    SP_RETURN_IF_ERROR(storage_->Delete(name));
    return NotFound(storage_->uri() + ": step " + std::to_string(step) + " is not committed");
  }
  return s.WithContext("making the COMMIT of step " + std::to_string(step) + " durable");
}

Result<std::vector<CommitRecord>> CheckpointStore::ListCommitted(std::vector<std::string>* problems,
                                                                 std::vector<ObjectInfo>* listing) {
  SP_ASSIGN_OR_RETURN(auto objects, storage_->List("step-"));
  std::vector<CommitRecord> out;
  std::map<uint64_t, KnownCommit> known;  // what the next listing may take without a read
  bool reverify;
  {
    std::lock_guard<std::mutex> lock(known_mu_);
    reverify = ++listings_ % kReverifyListings == 0;
    known.swap(known_commits_);
  }
  uint64_t newest_listed = 0;
  std::map<uint64_t, KnownCommit> keep;
  for (const auto& o : objects) {
    auto step = StepFromObjectName(o.name);
    if (!step || o.name != CommitObjectName(*step)) continue;
    newest_listed = std::max(newest_listed, *step);
    if (auto k = known.find(*step); !reverify && k != known.end() && o.mtime_ns != 0 &&
                                    k->second.size == o.size &&
                                    (k->second.mtime_ns == 0 || k->second.mtime_ns == o.mtime_ns)) {
      k->second.mtime_ns = o.mtime_ns;
      out.push_back(k->second.record);
      keep.insert(known.extract(k));
      continue;
    }
    auto record = ReadCommit(*step);
    if (record.ok()) {
      if (o.mtime_ns != 0) keep[*step] = KnownCommit{*record, o.size, o.mtime_ns};
      out.push_back(std::move(record).value());
    } else if (record.status().code() == StatusCode::kCorruption ||
               record.status().code() == StatusCode::kNotFound) {
      // NotFound: deleted between List and Open (concurrent pruning).
      if (problems && record.status().code() == StatusCode::kCorruption) {
        problems->push_back(record.status().message());
      }
    } else {
      return record.status();
    }
  }
  {
    // Records published after the List started stay known (newer than every listed step); the
    // rest this listing did not show are gone; those remembered meanwhile are kept too.
    std::lock_guard<std::mutex> lock(known_mu_);
    for (auto& [step, k] : known) {
      if (k.mtime_ns == 0 && step > newest_listed) keep.emplace(step, std::move(k));
    }
    keep.merge(known_commits_);
    known_commits_.swap(keep);
  }
  if (listing) *listing = std::move(objects);
  return out;
}

std::vector<uint64_t> CheckpointStore::StepsWithCommitIn(const std::vector<ObjectInfo>& listing) {
  std::vector<uint64_t> steps;
  for (const auto& o : listing) {
    auto step = StepFromObjectName(o.name);
    if (step && o.name == CommitObjectName(*step)) steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

Result<std::vector<uint64_t>> CheckpointStore::StepsWithCommit() {
  SP_ASSIGN_OR_RETURN(auto objects, storage_->List("step-"));
  return StepsWithCommitIn(objects);
}

Result<std::optional<CommitRecord>> CheckpointStore::NewestCommitted(
    const std::vector<uint64_t>& steps, std::vector<std::string>* problems) {
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    auto record = ReadCommit(*it);
    if (record.ok()) return std::optional<CommitRecord>(std::move(record).value());
    const StatusCode code = record.status().code();
    if (code != StatusCode::kCorruption && code != StatusCode::kNotFound) return record.status();
    // NotFound: deleted between List and Open (concurrent pruning).
    if (problems && code == StatusCode::kCorruption) problems->push_back(record.status().message());
  }
  return std::optional<CommitRecord>();
}

}  // namespace safepoint
