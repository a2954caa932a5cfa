// Object names of a checkpoint directory and the COMMIT record's codec (docs/format.md,
// "Checkpoint directory" and "COMMIT record"); the commit protocol that writes and reads them is
// in checkpoint_store.cc.
#include "checkpoint/commit_record.h"

#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "base/bytes.h"
#include "base/crc32c.h"
#include "safepoint/checkpoint.h"

namespace safepoint {

using internal::AppendLE;
using internal::Crc32c;
using internal::kCommitFixed;
using internal::kCommitMagic;
using internal::LoadLE;

// ---------------------------------------------------------------------------------------------
// Names and the commit record

std::string StepPrefix(uint64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%020llu/", static_cast<unsigned long long>(step));
  return buf;
}

std::string ImageObjectName(uint64_t step, uint32_t rank, uint64_t generation) {
  char buf[48];
  if (generation == 0) {
    std::snprintf(buf, sizeof(buf), "rank-%05u.img", rank);
  } else {
    std::snprintf(buf, sizeof(buf), "rank-%05u.g%016llx.img", rank,
                  static_cast<unsigned long long>(generation));
  }
  return StepPrefix(step) + buf;
}

std::string ImageObjectName(const CommitRecord& commit, uint32_t rank) {
  if (rank < commit.images.size() && commit.images[rank].packed) {
    return PackedObjectName(commit.step, rank, commit.generation);
  }
  return ImageObjectName(commit.step, rank, commit.generation);
}

std::string PackedObjectName(uint64_t step, uint32_t rank, uint64_t generation) {
  std::string name = ImageObjectName(step, rank, generation);
  name.replace(name.size() - 4, 4, ".pack");
  return name;
}

std::string CommitObjectName(uint64_t step) { return StepPrefix(step) + "COMMIT"; }

std::optional<uint64_t> StepFromObjectName(std::string_view name) {
  constexpr std::string_view kPrefix = "step-";
  if (name.size() < kPrefix.size() + 21 || name.substr(0, kPrefix.size()) != kPrefix) {
    return std::nullopt;
  }
  uint64_t step = 0;
  for (size_t i = 0; i < 20; ++i) {
    const char c = name[kPrefix.size() + i];
    if (c < '0' || c > '9') return std::nullopt;
    if (internal::MulOverflow(step, 10, &step) ||
        internal::AddOverflow(step, static_cast<uint64_t>(c - '0'), &step)) {
      return std::nullopt;
    }
  }
  if (name[kPrefix.size() + 20] != '/') return std::nullopt;
  return step;
}

uint64_t CommitRecord::total_bytes() const {
  uint64_t n = 0;
  for (const auto& i : images) n += i.size;
  return n;
}

namespace {
bool AnyPacked(const CommitRecord& r) {
  for (const auto& i : r.images) {
    if (i.packed) return true;
  }
  return false;
}
}  // namespace

std::string EncodeCommitRecord(const CommitRecord& r) {
  const bool packed = AnyPacked(r);
  std::string out(kCommitMagic, 8);
  AppendLE<uint32_t>(out, packed              ? kCommitFormatVersionPacked
                          : r.generation == 0 ? kCommitFormatVersion
                                              : kCommitFormatVersionReplaced);
  AppendLE<uint32_t>(out, r.world_size);
  AppendLE<uint64_t>(out, r.step);
  AppendLE<int64_t>(out, r.commit_time_ns);
  AppendLE<uint32_t>(out, static_cast<uint32_t>(r.job.size()));
  std::string job = r.job;
  job.resize(kMaxJobLength, '\0');
  out += job;
  for (const auto& i : r.images) {
    AppendLE<uint64_t>(out, i.size);
    AppendLE<uint32_t>(out, i.header_crc);
    if (packed) AppendLE<uint32_t>(out, i.packed ? 1u : 0u);  // flags
  }
  if (packed || r.generation != 0) AppendLE<uint64_t>(out, r.generation);
  AppendLE<uint32_t>(out, Crc32c(0, out.data(), out.size()));
  return out;
}

bool SameStep(const CommitRecord& a, const CommitRecord& b) {
  if (a.step != b.step || a.world_size != b.world_size || a.commit_time_ns != b.commit_time_ns ||
      a.job != b.job || a.generation != b.generation || a.images.size() != b.images.size()) {
    return false;
  }
  for (size_t i = 0; i < a.images.size(); ++i) {
    if (a.images[i].size != b.images[i].size || a.images[i].header_crc != b.images[i].header_crc) {
      return false;
    }
  }
  return true;
}

Result<CommitRecord> DecodeCommitRecord(std::span<const std::byte> d, std::string_view source) {
  auto bad = [&](const std::string& what) {
    return Corruption(std::string(source) + ": corrupt COMMIT record: " + what);
  };
  if (d.size() < kCommitFixed + 4) return bad("truncated");
  if (std::memcmp(d.data(), kCommitMagic, 8) != 0) return bad("bad magic");
  const uint32_t version = LoadLE<uint32_t>(&d[8]);
  if (version != kCommitFormatVersion && version != kCommitFormatVersionReplaced &&
      version != kCommitFormatVersionPacked) {
    return bad("unsupported format version " + std::to_string(version));
  }
  const bool packed = version == kCommitFormatVersionPacked;
  const uint64_t generation_size = version == kCommitFormatVersion ? 0 : 8;
  const uint64_t per_rank = packed ? 16 : 12;
  CommitRecord r;
  r.world_size = LoadLE<uint32_t>(&d[12]);
  if (r.world_size == 0 || r.world_size > kMaxRank) return bad("invalid world size");
  if (d.size() != kCommitFixed + per_rank * r.world_size + generation_size + 4) {
    return bad("size " + std::to_string(d.size()) + " does not match world size " +
               std::to_string(r.world_size));
  }
  if (Crc32c(0, d.data(), d.size() - 4) != LoadLE<uint32_t>(&d[d.size() - 4])) {
    return bad("checksum mismatch");
  }
  r.step = LoadLE<uint64_t>(&d[16]);
  r.commit_time_ns = LoadLE<int64_t>(&d[24]);
  const uint32_t job_len = LoadLE<uint32_t>(&d[32]);
  if (job_len > kMaxJobLength) return bad("job name too long");
  r.job.assign(reinterpret_cast<const char*>(&d[36]), job_len);
  r.images.resize(r.world_size);
  bool any_packed = false;
  for (uint32_t i = 0; i < r.world_size; ++i) {
    const std::byte* p = &d[kCommitFixed + per_rank * i];
    r.images[i].size = LoadLE<uint64_t>(p);
    r.images[i].header_crc = LoadLE<uint32_t>(p + 8);
    if (packed) {
      const uint32_t flags = LoadLE<uint32_t>(p + 12);
      if (flags > 1) return bad("unknown image flags " + std::to_string(flags));
      r.images[i].packed = flags == 1;
      any_packed |= r.images[i].packed;
    }
  }
  if (generation_size != 0) {
    r.generation = LoadLE<uint64_t>(&d[kCommitFixed + per_rank * r.world_size]);
    if (r.generation == 0 && !packed) return bad("a version 2 record with generation 0");
  }
  if (packed && !any_packed) return bad("a version 3 record without a packed image");
  return r;
}

}  // namespace safepoint
