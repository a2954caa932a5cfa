// Image layout, builder and reader (docs/format.md, "Image").
#include "safepoint/image.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <unordered_set>

#include "base/bytes.h"
#include "base/clock.h"
#include "base/crc32c.h"
#include "base/kill_point.h"
#include "base/parallel.h"
#include "base/stream_copy.h"
#include "image/name_set.h"

namespace safepoint {

using internal::AddOverflow;
using internal::AlignUp;
using internal::Crc32c;
using internal::LoadLE;
using internal::MulOverflow;
using internal::StoreLE;

namespace {

constexpr char kMagic[8] = {'S', 'P', 'I', 'M', 'A', 'G', 'E', '\0'};
constexpr size_t kHeaderCrcOffset = kImageHeaderSize - 4;
constexpr size_t kJobOffset = 145;
constexpr size_t kReservedOffset = kJobOffset + kMaxJobLength;  // 209
constexpr size_t kAttemptOffset = 216;  // u64; 209..215 and 224..511 stay reserved
// Lineage block (docs/format.md, "Lineage"): u16 parent location length, u16 metadata length,
// u32 reserved, u64 parent step (valid with header flag 2), then the two texts in fixed areas.
constexpr size_t kLineageOffset = 512;
constexpr size_t kParentLocationOffset = kLineageOffset + 16;                         // 528
constexpr size_t kMetadataOffset = kParentLocationOffset + kMaxParentLocationLength;  // 1552
constexpr size_t kLineageEnd = kMetadataOffset + kMaxLineageMetadataLength;           // 3600
constexpr uint32_t kFlagElsewhere = 1;
constexpr uint32_t kFlagParent = 2;
constexpr size_t kEntryFixedSize = 32;
constexpr uint64_t kMaxImageSize = uint64_t{1} << 50;  // 1 PiB: keeps offset arithmetic exact
constexpr uint64_t kLargeTensor = 64 << 10;

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kFloat32, "float32", 4},
    {DType::kFloat16, "float16", 2},
    {DType::kBFloat16, "bfloat16", 2},
    {DType::kFloat64, "float64", 8},
    {DType::kInt8, "int8", 1},
    {DType::kInt16, "int16", 2},
    {DType::kInt32, "int32", 4},
    {DType::kInt64, "int64", 8},
    {DType::kUInt8, "uint8", 1},
    {DType::kBool, "bool", 1},
    {DType::kFloat8E4M3FN, "float8_e4m3fn", 1},
    {DType::kFloat8E5M2, "float8_e5m2", 1},
    {DType::kComplex64, "complex64", 8},
    {DType::kComplex128, "complex128", 16},
    {DType::kUInt16, "uint16", 2},
    {DType::kUInt32, "uint32", 4},
    {DType::kUInt64, "uint64", 8},
    {DType::kFloat8E4M3FNUZ, "float8_e4m3fnuz", 1},
    {DType::kFloat8E5M2FNUZ, "float8_e5m2fnuz", 1},
    {DType::kFloat8E8M0FNU, "float8_e8m0fnu", 1},
};

uint64_t TensorAlignment(uint64_t nbytes) { return nbytes >= kLargeTensor ? 4096 : 64; }

Status Bad(std::string_view source, const std::string& what) {
  std::string m(source);
  m += ": corrupt image: ";
  m += what;
  return Corruption(std::move(m));
}

Status ChunkMismatch(std::string_view source, uint64_t index, uint32_t expected, uint32_t got) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "checksum mismatch in chunk %llu (expected %08x, got %08x)",
                static_cast<unsigned long long>(index), expected, got);
  return Bad(source, buf);
}

// Computes the canonical layout from the section sizes; false on overflow or absurd sizes.
bool CanonicalLayout(ImageLayout* l) {
  l->index_offset = kImageHeaderSize;
  uint64_t end;
  if (AddOverflow(l->index_offset, l->index_size, &end) || end > kMaxImageSize) return false;
  l->data_offset = AlignUp(end, kImageAlignment);
  if (AddOverflow(l->data_offset, l->data_size, &end) || end > kMaxImageSize) return false;
  l->extras_offset = AlignUp(end, kImageAlignment);
  if (AddOverflow(l->extras_offset, l->extras_size, &end) || end > kMaxImageSize) return false;
  l->checksums_offset = AlignUp(end, kImageAlignment);
  l->checksums_size = 4 * l->chunk_count() + 4;
  l->image_size = AlignUp(l->checksums_offset + l->checksums_size, kImageAlignment);
  return l->image_size <= kMaxImageSize;
}

bool ValidChunkSize(uint64_t c) {
  return c >= 4096 && c <= (uint64_t{1} << 30) && (c & (c - 1)) == 0;
}

}  // namespace

size_t DTypeSize(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 0;
}

std::string ReplicaKey(const TensorSpec& spec) {
  std::string key = spec.name;
  key += '\0';
  key += static_cast<char>(spec.dtype);
  auto append = [&key](uint64_t x) { key.append(reinterpret_cast<const char*>(&x), sizeof(x)); };
  auto at = [](const std::vector<uint64_t>& v, size_t d) { return d < v.size() ? v[d] : 0; };
  const bool whole = spec.global_shape.empty();  // the box of its own shape at offset 0
  append(spec.shape.size());
  for (size_t d = 0; d < spec.shape.size(); ++d) {
    append(spec.shape[d]);
    append(whole ? spec.shape[d] : at(spec.global_shape, d));
    append(whole ? 0 : at(spec.global_offset, d));
  }
  return key;
}

std::string_view DTypeName(DType dtype) {
  for (const auto& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "unknown";
}

Result<DType> DTypeFromName(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (d.name == name) return d.dtype;
  }
  return InvalidArgument("unsupported dtype '" + std::string(name) + "'");
}

bool IsValidDType(uint8_t code) { return DTypeSize(static_cast<DType>(code)) != 0; }

// ---------------------------------------------------------------------------------------------
// Builder

Status ValidateLineage(const Lineage& l) {
  if (l.parent_location.size() > kMaxParentLocationLength) {
    return InvalidArgument("lineage: the parent's location is " +
                           std::to_string(l.parent_location.size()) + " bytes, more than " +
                           std::to_string(kMaxParentLocationLength));
  }
  if (!internal::IsValidUtf8(l.parent_location) ||
      l.parent_location.find('\0') != std::string::npos) {
    return InvalidArgument("lineage: the parent's location is not valid UTF-8 text");
  }
  if (l.metadata.size() > kMaxLineageMetadataLength) {
    return InvalidArgument("lineage: metadata is " + std::to_string(l.metadata.size()) +
                           " bytes of JSON, more than " +
                           std::to_string(kMaxLineageMetadataLength));
  }
  if (!l.metadata.empty()) {
    if (!internal::IsValidUtf8(l.metadata) || l.metadata.front() != '{' ||
        l.metadata.back() != '}' || l.metadata.find('\0') != std::string::npos) {
      return InvalidArgument("lineage: metadata must be the UTF-8 text of a JSON object");
    }
  }
  if (!l.has_parent && (l.parent_step != 0 || !l.parent_location.empty())) {
    return InvalidArgument("lineage: a parent location or step without a parent");
  }
  return Status::OK();
}

Result<std::unique_ptr<ImageBuilder>> ImageBuilder::Create(ImageMeta meta,
                                                           std::vector<TensorSource> tensors,
                                                           std::string extras,
                                                           uint64_t chunk_size) {
  SP_RETURN_IF_ERROR(ValidateLineage(meta.lineage));
  if (!internal::IsJobNameText(meta.job)) {
    return InvalidArgument("job name '" + meta.job +
                           "' is invalid: use 0..64 characters of [A-Za-z0-9._-]");
  }
  if (meta.world_size == 0 || meta.world_size > kMaxRank || meta.rank >= meta.world_size) {
    return InvalidArgument("rank " + std::to_string(meta.rank) + " / world size " +
                           std::to_string(meta.world_size) + " is invalid");
  }
  if (!ValidChunkSize(chunk_size)) {
    return InvalidArgument("chunk size " + std::to_string(chunk_size) +
                           " must be a power of two between 4 KiB and 1 GiB");
  }
  if (meta.create_time_ns == 0) {
    meta.create_time_ns = UnixNanos();
  }

  std::unique_ptr<ImageBuilder> b(new ImageBuilder());
  b->meta_ = std::move(meta);
  b->extras_ = std::move(extras);
  ImageLayout& l = b->layout_;
  l.chunk_size = chunk_size;
  l.tensor_count = tensors.size();

  // Index entries; validation of every tensor.
  internal::NameSet names(tensors.size());
  std::string index;
  uint64_t data_cursor = 0;  // relative to data_offset, fixed up below
  std::vector<uint64_t> rel_offsets;
  rel_offsets.reserve(tensors.size());
  for (const TensorSource& t : tensors) {
    const TensorSpec& s = t.spec;
    auto fail = [&](const std::string& why) {
      return InvalidArgument("tensor '" + s.name + "': " + why);
    };
    if (s.name.empty() || s.name.size() > kMaxNameLength) {
      return fail("name must be 1.." + std::to_string(kMaxNameLength) + " bytes");
    }
    if (!internal::IsValidUtf8(s.name)) return fail("name is not valid UTF-8");
    if (!names.Insert(s.name)) return fail("duplicate tensor name");
    const size_t esize = DTypeSize(s.dtype);
    if (esize == 0) return fail("unknown dtype");
    if (s.shape.size() > kMaxNdim) return fail("more than 32 dimensions");
    uint64_t n = esize;
    for (uint64_t d : s.shape) {
      if (MulOverflow(n, d, &n) || n > kMaxImageSize) return fail("shape is too large");
    }
    if (n != t.nbytes) {
      return fail("nbytes " + std::to_string(t.nbytes) + " does not match shape and dtype (" +
                  std::to_string(n) + ")");
    }
    if (n > 0 && t.data == nullptr && !s.elsewhere && !t.staged) return fail("no data");
    const bool shard = !s.global_shape.empty() || !s.global_offset.empty();
    if (shard) {
      if (s.global_shape.size() != s.shape.size() || s.global_offset.size() != s.shape.size()) {
        return fail("global shape and offset must have as many dimensions as the shape");
      }
      for (size_t i = 0; i < s.shape.size(); ++i) {
        uint64_t end;
        if (AddOverflow(s.global_offset[i], s.shape[i], &end) || end > s.global_shape[i]) {
          return fail("shard box exceeds the global shape in dimension " + std::to_string(i));
        }
      }
    }
    const uint64_t ndim = s.shape.size();
    const uint64_t raw = kEntryFixedSize + 8 * ndim * (shard ? 3 : 1) + s.name.size();
    const uint64_t entry_size = AlignUp(raw, 8);
    if (!s.elsewhere) data_cursor = AlignUp(data_cursor, TensorAlignment(n));
    rel_offsets.push_back(data_cursor);  // elsewhere: a zero-length placeholder for Fill

    const size_t start = index.size();
    index.resize(start + entry_size, '\0');
    auto* p = reinterpret_cast<std::byte*>(index.data() + start);
    StoreLE<uint32_t>(p + 0, static_cast<uint32_t>(entry_size));
    StoreLE<uint8_t>(p + 4, static_cast<uint8_t>(s.dtype));
    StoreLE<uint8_t>(p + 5, static_cast<uint8_t>(ndim));
    StoreLE<uint8_t>(p + 6, (shard ? 1 : 0) | (s.elsewhere ? 2 : 0));
    StoreLE<uint32_t>(p + 8, static_cast<uint32_t>(s.name.size()));
    // Offset (p + 16) is written once data_offset is known.
    StoreLE<uint64_t>(p + 24, n);
    std::byte* q = p + kEntryFixedSize;
    for (uint64_t d : s.shape) StoreLE<uint64_t>(q, d), q += 8;
    if (shard) {
      for (uint64_t d : s.global_shape) StoreLE<uint64_t>(q, d), q += 8;
      for (uint64_t d : s.global_offset) StoreLE<uint64_t>(q, d), q += 8;
    }
    std::memcpy(q, s.name.data(), s.name.size());
    if (!s.elsewhere) data_cursor += n;
  }
  l.index_size = index.size();
  l.data_size = data_cursor;
  l.extras_size = b->extras_.size();
  if (!CanonicalLayout(&l)) return InvalidArgument("image would exceed 1 PiB");

  b->offsets_.resize(tensors.size());
  {
    size_t pos = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      auto* p = reinterpret_cast<std::byte*>(index.data() + pos);
      b->offsets_[i] = l.data_offset + rel_offsets[i];
      StoreLE<uint64_t>(p + 16, tensors[i].spec.elsewhere ? 0 : b->offsets_[i]);
      pos += LoadLE<uint32_t>(p);
    }
  }
  l.index_crc = Crc32c(0, index.data(), index.size());
  l.has_elsewhere = std::any_of(tensors.begin(), tensors.end(),
                                [](const TensorSource& t) { return t.spec.elsewhere; });
  l.extras_crc = Crc32c(0, b->extras_.data(), b->extras_.size());
  b->index_.assign(reinterpret_cast<const std::byte*>(index.data()),
                   reinterpret_cast<const std::byte*>(index.data()) + index.size());
  b->tensors_ = std::move(tensors);

  // Header.
  std::vector<std::byte>& h = b->header_;
  h.assign(kImageHeaderSize, std::byte{0});
  std::memcpy(h.data(), kMagic, 8);
  StoreLE<uint32_t>(&h[8], kImageFormatVersion);
  StoreLE<uint32_t>(&h[12], kImageHeaderSize);
  StoreLE<uint64_t>(&h[16], b->meta_.step);
  StoreLE<uint32_t>(&h[24], b->meta_.rank);
  StoreLE<uint32_t>(&h[28], b->meta_.world_size);
  StoreLE<int64_t>(&h[32], b->meta_.create_time_ns);
  StoreLE<uint64_t>(&h[kAttemptOffset], b->meta_.attempt);
  {
    const Lineage& lin = b->meta_.lineage;
    StoreLE<uint16_t>(&h[kLineageOffset], static_cast<uint16_t>(lin.parent_location.size()));
    StoreLE<uint16_t>(&h[kLineageOffset + 2], static_cast<uint16_t>(lin.metadata.size()));
    StoreLE<uint64_t>(&h[kLineageOffset + 8], lin.parent_step);
    std::memcpy(&h[kParentLocationOffset], lin.parent_location.data(), lin.parent_location.size());
    std::memcpy(&h[kMetadataOffset], lin.metadata.data(), lin.metadata.size());
  }
  StoreLE<uint64_t>(&h[40], l.image_size);
  StoreLE<uint64_t>(&h[48], l.chunk_size);
  StoreLE<uint64_t>(&h[56], l.tensor_count);
  StoreLE<uint64_t>(&h[64], l.index_offset);
  StoreLE<uint64_t>(&h[72], l.index_size);
  StoreLE<uint64_t>(&h[80], l.data_offset);
  StoreLE<uint64_t>(&h[88], l.data_size);
  StoreLE<uint64_t>(&h[96], l.extras_offset);
  StoreLE<uint64_t>(&h[104], l.extras_size);
  StoreLE<uint64_t>(&h[112], l.checksums_offset);
  StoreLE<uint64_t>(&h[120], l.checksums_size);
  StoreLE<uint32_t>(&h[128], l.index_crc);
  StoreLE<uint32_t>(&h[132], l.extras_crc);
  StoreLE<uint32_t>(&h[140], (l.has_elsewhere ? kFlagElsewhere : 0) |
                                 (b->meta_.lineage.has_parent ? kFlagParent : 0));
  StoreLE<uint8_t>(&h[144], static_cast<uint8_t>(b->meta_.job.size()));
  std::memcpy(&h[kJobOffset], b->meta_.job.data(), b->meta_.job.size());
  l.header_crc = Crc32c(0, h.data(), kHeaderCrcOffset);
  StoreLE<uint32_t>(&h[kHeaderCrcOffset], l.header_crc);
  return b;
}

void ImageBuilder::Rebind(uint64_t step, std::span<const void* const> data) {
  Rebind(step);
  const size_t n = std::min(data.size(), tensors_.size());
  for (size_t i = 0; i < n; ++i) tensors_[i].data = data[i];
}

void ImageBuilder::Rebind(uint64_t step) {
  meta_.step = step;
  meta_.create_time_ns = UnixNanos();
  std::vector<std::byte>& h = header_;
  StoreLE<uint64_t>(&h[16], meta_.step);
  StoreLE<int64_t>(&h[32], meta_.create_time_ns);
  layout_.header_crc = Crc32c(0, h.data(), kHeaderCrcOffset);
  StoreLE<uint32_t>(&h[kHeaderCrcOffset], layout_.header_crc);
}

void ImageBuilder::Fill(uint64_t offset, std::span<std::byte> dst) const {
  // The image below checksums_offset is a sequence of segments (header, index, tensors, extras)
  // separated by zero padding. Copy the overlapping part of each segment, zero the gaps.
  const uint64_t end = offset + dst.size();
  uint64_t cursor = offset;  // everything before cursor is filled
  auto emit = [&](uint64_t seg_off, const void* src, uint64_t len) {
    const uint64_t seg_end = seg_off + len;
    if (seg_end <= cursor || seg_off >= end || len == 0) return;
    const uint64_t from = std::max(seg_off, cursor);
    const uint64_t to = std::min(seg_end, end);
    if (from > cursor) std::memset(dst.data() + (cursor - offset), 0, from - cursor);
    std::memcpy(dst.data() + (from - offset), static_cast<const std::byte*>(src) + (from - seg_off),
                to - from);
    cursor = to;
  };
  auto keep = [&](uint64_t seg_off, uint64_t len) {  // bytes the caller staged: leave them
    const uint64_t seg_end = seg_off + len;
    if (seg_end <= cursor || seg_off >= end || len == 0) return;
    const uint64_t from = std::max(seg_off, cursor);
    if (from > cursor) std::memset(dst.data() + (cursor - offset), 0, from - cursor);
    cursor = std::min(seg_end, end);
  };
  emit(0, header_.data(), header_.size());
  emit(layout_.index_offset, index_.data(), index_.size());
  if (cursor < end && !tensors_.empty()) {
    // First tensor that ends after the cursor (offsets increase with the index).
    size_t i = std::upper_bound(offsets_.begin(), offsets_.end(), cursor) - offsets_.begin();
    if (i > 0) --i;
    for (; i < tensors_.size() && offsets_[i] < end; ++i) {
      if (tensors_[i].spec.elsewhere) continue;
      if (tensors_[i].staged) {
        keep(offsets_[i], tensors_[i].nbytes);
      } else {
        emit(offsets_[i], tensors_[i].data, tensors_[i].nbytes);
      }
    }
  }
  emit(layout_.extras_offset, extras_.data(), extras_.size());
  if (cursor < end) std::memset(dst.data() + (cursor - offset), 0, end - cursor);
}

std::span<const std::byte> ImageBuilder::SourceBytes(uint64_t offset, uint64_t len) const {
  if (len == 0 || tensors_.empty() || offset < offsets_.front()) return {};
  const size_t i =
      std::upper_bound(offsets_.begin(), offsets_.end(), offset) - offsets_.begin() - 1;
  const TensorSource& t = tensors_[i];
  if (t.staged || t.spec.elsewhere || t.data == nullptr || offset + len > offsets_[i] + t.nbytes) {
    return {};
  }
  return {static_cast<const std::byte*>(t.data) + (offset - offsets_[i]), len};
}

std::vector<std::byte> ImageBuilder::ChecksumSection(std::span<const uint32_t> crcs) const {
  std::vector<std::byte> out(layout_.image_size - layout_.checksums_offset, std::byte{0});
  for (size_t i = 0; i < crcs.size(); ++i) StoreLE<uint32_t>(&out[4 * i], crcs[i]);
  StoreLE<uint32_t>(&out[4 * crcs.size()], Crc32c(0, out.data(), 4 * crcs.size()));
  return out;
}

void ImageBuilder::FillAll(std::span<std::byte> dst, size_t threads) const {
  const uint64_t n = chunk_count();
  std::vector<uint32_t> crcs(n);
  internal::ParallelFor(n, threads, [&](size_t i) {
    const uint64_t off = i * layout_.chunk_size;
    const uint64_t len = std::min(layout_.chunk_size, layout_.checksums_offset - off);
    // Fill and checksum in pieces that stay in the core's cache between the two passes.
    constexpr uint64_t kPiece = 256 << 10;
    uint32_t crc = 0;
    for (uint64_t p = 0; p < len; p += kPiece) {
      auto piece = dst.subspan(off + p, std::min(kPiece, len - p));
      Fill(off + p, piece);
      crc = Crc32c(crc, piece.data(), piece.size());
      SP_KILL_POINT("client.copy.piece");
    }
    crcs[i] = crc;
  });
  auto section = ChecksumSection(crcs);
  std::memcpy(dst.data() + layout_.checksums_offset, section.data(), section.size());
}

// ---------------------------------------------------------------------------------------------
// Reader

Result<std::pair<ImageMeta, ImageLayout>> ParseImageHeader(std::span<const std::byte> h,
                                                           std::string_view source) {
  if (h.size() < kImageHeaderSize) {
    return Bad(source, "truncated: " + std::to_string(h.size()) +
                           " bytes, smaller than the 4096-byte header");
  }
  if (std::memcmp(h.data(), kMagic, 8) != 0) return Bad(source, "bad magic (not an image)");
  const uint32_t version = LoadLE<uint32_t>(&h[8]);
  if (version != kImageFormatVersion) {
    return Bad(source, "unsupported format version " + std::to_string(version) +
                           " (this build reads version " + std::to_string(kImageFormatVersion) +
                           ")");
  }
  const uint32_t stored_crc = LoadLE<uint32_t>(&h[kHeaderCrcOffset]);
  const uint32_t crc = Crc32c(0, h.data(), kHeaderCrcOffset);
  if (crc != stored_crc) return Bad(source, "header checksum mismatch");
  if (LoadLE<uint32_t>(&h[12]) != kImageHeaderSize) return Bad(source, "bad header size");
  const uint32_t flags = LoadLE<uint32_t>(&h[140]);
  if (LoadLE<uint32_t>(&h[136]) != 0 || (flags & ~(kFlagElsewhere | kFlagParent)) != 0) {
    return Bad(source, "unknown header flags");
  }
  const size_t location_len = LoadLE<uint16_t>(&h[kLineageOffset]);
  const size_t metadata_len = LoadLE<uint16_t>(&h[kLineageOffset + 2]);
  if (location_len > kMaxParentLocationLength || metadata_len > kMaxLineageMetadataLength) {
    return Bad(source, "lineage lengths out of range");
  }
  // Every byte that no field uses (reserved bytes, unused parts of the lineage areas) is zero.
  const std::pair<size_t, size_t> unused[] = {
      {kReservedOffset, kAttemptOffset},
      {kAttemptOffset + 8, kLineageOffset},
      {kLineageOffset + 4, kLineageOffset + 8},
      {kParentLocationOffset + location_len, kMetadataOffset},
      {kMetadataOffset + metadata_len, kLineageEnd},
      {kLineageEnd, kHeaderCrcOffset},
  };
  for (const auto& [first, last] : unused) {
    for (size_t i = first; i < last; ++i) {
      if (h[i] != std::byte{0}) return Bad(source, "non-zero reserved header bytes");
    }
  }
  if (!(flags & kFlagParent) && LoadLE<uint64_t>(&h[kLineageOffset + 8]) != 0) {
    return Bad(source, "a parent step without the parent flag");
  }
  ImageMeta m;
  ImageLayout l;
  m.step = LoadLE<uint64_t>(&h[16]);
  m.rank = LoadLE<uint32_t>(&h[24]);
  m.world_size = LoadLE<uint32_t>(&h[28]);
  m.create_time_ns = LoadLE<int64_t>(&h[32]);
  m.attempt = LoadLE<uint64_t>(&h[kAttemptOffset]);
  {
    Lineage& lin = m.lineage;
    lin.has_parent = flags & kFlagParent;
    lin.parent_step = LoadLE<uint64_t>(&h[kLineageOffset + 8]);
    lin.parent_location.assign(reinterpret_cast<const char*>(&h[kParentLocationOffset]),
                               location_len);
    lin.metadata.assign(reinterpret_cast<const char*>(&h[kMetadataOffset]), metadata_len);
    if (Status s = ValidateLineage(lin); !s.ok()) return Bad(source, s.message());
  }
  if (m.world_size == 0 || m.world_size > kMaxRank || m.rank >= m.world_size) {
    return Bad(source, "invalid rank " + std::to_string(m.rank) + " of world size " +
                           std::to_string(m.world_size));
  }
  const uint8_t job_len = LoadLE<uint8_t>(&h[144]);
  if (job_len > kMaxJobLength) return Bad(source, "job name too long");
  m.job.assign(reinterpret_cast<const char*>(&h[kJobOffset]), job_len);
  if (!internal::IsJobNameText(m.job)) return Bad(source, "invalid job name");
  for (size_t i = kJobOffset + job_len; i < kReservedOffset; ++i) {
    if (h[i] != std::byte{0}) return Bad(source, "non-zero job padding");
  }
  l.image_size = LoadLE<uint64_t>(&h[40]);
  l.chunk_size = LoadLE<uint64_t>(&h[48]);
  l.tensor_count = LoadLE<uint64_t>(&h[56]);
  l.index_offset = LoadLE<uint64_t>(&h[64]);
  l.index_size = LoadLE<uint64_t>(&h[72]);
  l.data_offset = LoadLE<uint64_t>(&h[80]);
  l.data_size = LoadLE<uint64_t>(&h[88]);
  l.extras_offset = LoadLE<uint64_t>(&h[96]);
  l.extras_size = LoadLE<uint64_t>(&h[104]);
  l.checksums_offset = LoadLE<uint64_t>(&h[112]);
  l.checksums_size = LoadLE<uint64_t>(&h[120]);
  l.index_crc = LoadLE<uint32_t>(&h[128]);
  l.has_elsewhere = flags & kFlagElsewhere;
  l.extras_crc = LoadLE<uint32_t>(&h[132]);
  l.header_crc = crc;
  if (!ValidChunkSize(l.chunk_size)) {
    return Bad(source, "invalid chunk size " + std::to_string(l.chunk_size));
  }
  ImageLayout canon = l;
  if (!CanonicalLayout(&canon)) return Bad(source, "section sizes out of range");
  if (canon.index_offset != l.index_offset || canon.data_offset != l.data_offset ||
      canon.extras_offset != l.extras_offset || canon.checksums_offset != l.checksums_offset ||
      canon.checksums_size != l.checksums_size || canon.image_size != l.image_size) {
    return Bad(source, "section offsets are inconsistent (overlapping or out of bounds)");
  }
  if (l.tensor_count > l.index_size / kEntryFixedSize) {
    return Bad(source,
               "tensor count " + std::to_string(l.tensor_count) + " does not fit the index");
  }
  return std::make_pair(std::move(m), l);
}

Result<std::vector<uint32_t>> ParseChecksumSection(std::span<const std::byte> section,
                                                   const ImageLayout& l, std::string_view source) {
  if (section.size() < l.checksums_size) return Bad(source, "truncated checksum section");
  const uint64_t n = l.chunk_count();
  const uint32_t stored = LoadLE<uint32_t>(&section[4 * n]);
  if (Crc32c(0, section.data(), 4 * n) != stored) {
    return Bad(source, "checksum section checksum mismatch");
  }
  // Padding after the array up to the end of the image carries no checksum: it must be zero.
  const uint64_t padded = std::min<uint64_t>(section.size(), l.image_size - l.checksums_offset);
  for (uint64_t i = l.checksums_size; i < padded; ++i) {
    if (section[i] != std::byte{0}) return Bad(source, "non-zero padding after the checksums");
  }
  std::vector<uint32_t> crcs(n);
  for (uint64_t i = 0; i < n; ++i) crcs[i] = LoadLE<uint32_t>(&section[4 * i]);
  return crcs;
}

Status VerifyChunk(std::span<const std::byte> chunk, uint64_t index, uint32_t expected,
                   std::string_view source) {
  const uint32_t got = Crc32c(0, chunk.data(), chunk.size());
  if (got == expected) return Status::OK();
  return ChunkMismatch(source, index, expected, got);
}

Result<std::vector<TensorEntry>> ParseIndex(std::span<const std::byte> index, const ImageLayout& l,
                                            std::string_view source) {
  if (index.size() != l.index_size) return Bad(source, "index size mismatch");
  if (Crc32c(0, index.data(), index.size()) != l.index_crc) {
    return Bad(source, "index checksum mismatch");
  }
  std::vector<TensorEntry> out;
  out.reserve(l.tensor_count);
  internal::NameSet names(l.tensor_count);
  uint64_t pos = 0;
  uint64_t prev_end = l.data_offset;
  const uint64_t data_end = l.data_offset + l.data_size;
  for (uint64_t t = 0; t < l.tensor_count; ++t) {
    auto bad = [&](const std::string& what) {
      return Bad(source, "index entry " + std::to_string(t) + ": " + what);
    };
    if (index.size() - pos < kEntryFixedSize) return bad("truncated");
    const std::byte* p = &index[pos];
    const uint32_t entry_size = LoadLE<uint32_t>(p);
    const uint8_t dtype = LoadLE<uint8_t>(p + 4);
    const uint8_t ndim = LoadLE<uint8_t>(p + 5);
    const uint8_t flags = LoadLE<uint8_t>(p + 6);
    const uint32_t name_len = LoadLE<uint32_t>(p + 8);
    if (LoadLE<uint8_t>(p + 7) != 0 || LoadLE<uint32_t>(p + 12) != 0) {
      return bad("non-zero reserved bytes");
    }
    if (!IsValidDType(dtype)) return bad("unknown dtype code " + std::to_string(dtype));
    if (ndim > kMaxNdim) return bad("too many dimensions");
    if (flags & ~3u) return bad("unknown flags");
    if (name_len == 0 || name_len > kMaxNameLength) return bad("invalid name length");
    const bool shard = flags & 1;
    const uint64_t raw = kEntryFixedSize + 8ull * ndim * (shard ? 3 : 1) + name_len;
    if (entry_size != AlignUp(raw, 8) || entry_size > index.size() - pos) {
      return bad("entry size " + std::to_string(entry_size) + " is inconsistent");
    }
    for (uint64_t i = raw; i < entry_size; ++i) {
      if (p[i] != std::byte{0}) return bad("non-zero padding");
    }
    TensorEntry e;
    e.spec.dtype = static_cast<DType>(dtype);
    e.offset = LoadLE<uint64_t>(p + 16);
    e.nbytes = LoadLE<uint64_t>(p + 24);
    const std::byte* q = p + kEntryFixedSize;
    uint64_t n = DTypeSize(e.spec.dtype);
    e.spec.shape.resize(ndim);
    for (int i = 0; i < ndim; ++i, q += 8) {
      e.spec.shape[i] = LoadLE<uint64_t>(q);
      if (MulOverflow(n, e.spec.shape[i], &n) || n > kMaxImageSize) return bad("shape too large");
    }
    if (n != e.nbytes) return bad("byte size does not match shape and dtype");
    if (shard) {
      e.spec.global_shape.resize(ndim);
      e.spec.global_offset.resize(ndim);
      for (int i = 0; i < ndim; ++i, q += 8) e.spec.global_shape[i] = LoadLE<uint64_t>(q);
      for (int i = 0; i < ndim; ++i, q += 8) e.spec.global_offset[i] = LoadLE<uint64_t>(q);
      for (int i = 0; i < ndim; ++i) {
        uint64_t end;
        if (AddOverflow(e.spec.global_offset[i], e.spec.shape[i], &end) ||
            end > e.spec.global_shape[i]) {
          return bad("shard box exceeds its global shape");
        }
      }
    }
    std::string_view name(reinterpret_cast<const char*>(q), name_len);
    if (!internal::IsValidUtf8(name)) return bad("name is not valid UTF-8");
    if (!names.Insert(name)) return bad("duplicate name '" + std::string(name) + "'");
    e.spec.name.assign(name);
    e.spec.elsewhere = flags & 2;
    if (e.spec.elsewhere) {  // no bytes here
      if (e.offset != 0) return bad("a tensor held elsewhere has a data offset");
      if (!l.has_elsewhere) return bad("a tensor held elsewhere, but the header says none");
      out.push_back(std::move(e));
      pos += entry_size;
      continue;
    }
    // Placement: aligned, increasing, inside the data section.
    if (e.offset % TensorAlignment(e.nbytes) != 0) return bad("misaligned data offset");
    uint64_t end;
    if (e.offset < prev_end || AddOverflow(e.offset, e.nbytes, &end) || end > data_end) {
      return bad("data offset " + std::to_string(e.offset) +
                 " is out of bounds or overlaps the previous tensor");
    }
    prev_end = end;
    out.push_back(std::move(e));
    pos += entry_size;
  }
  if (pos != index.size()) return Bad(source, "trailing bytes after the index entries");
  if (prev_end != data_end) return Bad(source, "data size does not match the last tensor");
  return out;
}

namespace {

// Checksums the chunks of [0, covered) of an image in parallel, in pieces of 256 KiB that stay in
// cache: `copier(off)` makes the piece function of the chunk at `off`, called with each piece's
// [lo, hi) before that piece is summed from `summed`. An error names the first chunk whose sum is
// not `crcs`'.
template <typename MakeCopier>
Status SumChunksCopying(std::span<const uint32_t> crcs, const ImageLayout& l, uint64_t covered,
                        const std::byte* summed, std::string_view source, size_t threads,
                        MakeCopier copier) {
  std::vector<uint32_t> got(crcs.size());
  internal::ParallelFor(crcs.size(), threads, [&](size_t i) {
    const uint64_t off = i * l.chunk_size;
    const uint64_t len = std::min(l.chunk_size, covered - off);
    constexpr uint64_t kPiece = 256 << 10;
    auto copy_piece = copier(off);
    uint32_t crc = 0;
    for (uint64_t p = off; p < off + len; p += kPiece) {
      const uint64_t end = std::min(p + kPiece, off + len);
      copy_piece(p, end);
      crc = Crc32c(crc, summed + p, end - p);
    }
    got[i] = crc;
  });
  for (size_t i = 0; i < crcs.size(); ++i) {
    if (got[i] != crcs[i]) return ChunkMismatch(source, i, crcs[i], got[i]);
  }
  return Status::OK();
}

}  // namespace

Status CopyVerifiedImage(std::span<const std::byte> src, std::span<std::byte> dst,
                         std::string_view source, size_t threads) {
  if (dst.size() != src.size()) return InvalidArgument("CopyVerifiedImage: size mismatch");
  if (src.size() < kImageHeaderSize) return Bad(source, "truncated");
  std::memcpy(dst.data(), src.data(), kImageHeaderSize);
  SP_ASSIGN_OR_RETURN(auto hdr, ParseImageHeader(dst.subspan(0, kImageHeaderSize), source));
  const ImageLayout& l = hdr.second;
  if (l.image_size != src.size()) return Bad(source, "size does not match the header");
  const uint64_t tail = l.checksums_offset;
  std::memcpy(dst.data() + tail, src.data() + tail, src.size() - tail);
  SP_ASSIGN_OR_RETURN(auto crcs, ParseChecksumSection(dst.subspan(tail), l, source));
  // The header is in `dst` already: copy what lies past it.
  return SumChunksCopying(crcs, l, tail, dst.data(), source, threads, [&](uint64_t) {
    return [&](uint64_t lo, uint64_t hi) {
      lo = std::max<uint64_t>(lo, kImageHeaderSize);
      if (lo < hi) std::memcpy(dst.data() + lo, src.data() + lo, hi - lo);
    };
  });
}

Result<ImageCopyOut> ImageCopyOut::Make(std::span<const std::byte> image,
                                        std::vector<ImageCopy> copies, std::string_view source,
                                        bool copied_chunks_only) {
  SP_ASSIGN_OR_RETURN(auto hdr, ParseImageHeader(image, source));
  const ImageLayout& l = hdr.second;
  if (l.image_size != image.size()) return Bad(source, "size does not match the header");
  ImageCopyOut out;
  out.image_ = image;
  out.chunk_size_ = l.chunk_size;
  out.covered_ = l.checksums_offset;
  out.source_.assign(source);
  for (const ImageCopy& c : copies) {
    if (c.offset > out.covered_ || c.length > out.covered_ - c.offset) {
      return InvalidArgument(std::string(source) + ": copy out of [" + std::to_string(c.offset) +
                             ", +" + std::to_string(c.length) + ") lies outside the image data");
    }
  }
  std::sort(copies.begin(), copies.end(),
            [](const ImageCopy& a, const ImageCopy& b) { return a.offset < b.offset; });
  uint64_t total = 0;
  for (const ImageCopy& c : copies) total += c.length;
  // A state past the caches: its bytes are not read again soon, and the chunk's checksum reads
  // the image, which the copy's loads leave in the cache.
  out.stream_ = total >= internal::kStreamCopyMinTotal;
  out.copies_ = std::move(copies);
  SP_ASSIGN_OR_RETURN(out.crcs_, ParseChecksumSection(image.subspan(out.covered_), l, source));
  if (copied_chunks_only) {
    out.wanted_.assign(out.crcs_.size(), false);
    for (const ImageCopy& c : out.copies_) {
      if (c.length == 0) continue;
      const uint64_t last = (c.offset + c.length - 1) / l.chunk_size;
      for (uint64_t i = c.offset / l.chunk_size; i <= last && i < out.wanted_.size(); ++i) {
        out.wanted_[i] = true;
      }
    }
  }
  return out;
}

std::pair<size_t, size_t> ImageCopyOut::ChunkCopies(size_t i) const {
  const uint64_t off = i * chunk_size_;
  const uint64_t end = std::min(off + chunk_size_, covered_);
  // Copies do not overlap: sorted by offset, their ends are sorted too.
  auto first = std::partition_point(copies_.begin(), copies_.end(),
                                    [&](const ImageCopy& c) { return c.offset + c.length <= off; });
  auto last = std::partition_point(first, copies_.end(),
                                   [&](const ImageCopy& c) { return c.offset < end; });
  return {static_cast<size_t>(first - copies_.begin()),
          static_cast<size_t>(last - copies_.begin())};
}

Status ImageCopyOut::Chunk(size_t i) const {
  if (!wanted_.empty() && !wanted_[i]) return Status::OK();  // neither read nor copied
  const uint64_t off = i * chunk_size_;
  const uint64_t len = std::min(chunk_size_, covered_ - off);
  auto [next, last] = ChunkCopies(i);
  // In pieces of 256 KiB that stay in the cache: each is copied out, then summed from the image.
  constexpr uint64_t kPiece = 256 << 10;
  uint32_t crc = 0;
  for (uint64_t p = off; p < off + len; p += kPiece) {
    const uint64_t end = std::min(p + kPiece, off + len);
    while (next < last && copies_[next].offset + copies_[next].length <= p) ++next;
    for (size_t k = next; k < last && copies_[k].offset < end; ++k) {
      const ImageCopy& c = copies_[k];
      const uint64_t lo = std::max(c.offset, p), hi = std::min(c.offset + c.length, end);
      if (lo >= hi) continue;
      if (stream_) {
        internal::StreamCopy(c.dst + (lo - c.offset), image_.data() + lo, hi - lo);
      } else {
        std::memcpy(c.dst + (lo - c.offset), image_.data() + lo, hi - lo);
      }
    }
    crc = Crc32c(crc, image_.data() + p, end - p);
  }
  if (crc != crcs_[i]) return ChunkMismatch(source_, i, crcs_[i], crc);
  return Status::OK();
}

Status VerifyAndCopyOut(std::span<const std::byte> image, std::span<const ImageCopy> copies,
                        std::string_view source, size_t threads, bool copied_chunks_only) {
  SP_ASSIGN_OR_RETURN(ImageCopyOut out, ImageCopyOut::Make(image, {copies.begin(), copies.end()},
                                                           source, copied_chunks_only));
  std::vector<Status> errors(out.chunk_count());
  internal::ParallelFor(out.chunk_count(), threads, [&](size_t i) { errors[i] = out.Chunk(i); });
  for (Status& s : errors) SP_RETURN_IF_ERROR(s);  // the first damaged chunk
  return Status::OK();
}

Result<ImageReader> ImageReader::Parse(std::span<const std::byte> image, std::string_view source,
                                       Verify verify, size_t threads, ParsedIndex* cache) {
  SP_ASSIGN_OR_RETURN(auto hdr, ParseImageHeader(image, source));
  ImageReader r;
  r.meta_ = std::move(hdr.first);
  r.layout_ = hdr.second;
  const ImageLayout& l = r.layout_;
  if (image.size() != l.image_size) {
    return Bad(source, "size is " + std::to_string(image.size()) + " bytes, header says " +
                           std::to_string(l.image_size) + " (truncated or extended)");
  }
  SP_ASSIGN_OR_RETURN(auto crcs,
                      ParseChecksumSection(image.subspan(l.checksums_offset), l, source));
  if (verify == Verify::kAll) {
    std::vector<Status> errors(crcs.size());
    internal::ParallelFor(crcs.size(), threads, [&](size_t i) {
      const uint64_t off = i * l.chunk_size;
      const uint64_t len = std::min(l.chunk_size, l.checksums_offset - off);
      errors[i] = VerifyChunk(image.subspan(off, len), i, crcs[i], source);
    });
    for (auto& s : errors) SP_RETURN_IF_ERROR(s);
  }
  const auto index = image.subspan(l.index_offset, l.index_size);
  const std::string_view index_bytes(reinterpret_cast<const char*>(index.data()), index.size());
  if (cache != nullptr && cache->entries != nullptr && cache->bytes == index_bytes &&
      cache->data_offset == l.data_offset && cache->data_size == l.data_size &&
      cache->tensor_count == l.tensor_count && cache->has_elsewhere == l.has_elsewhere) {
    // The entries ParseIndex made of these very bytes against these layout fields; what it
    // checks besides is the index checksum in the header.
    if (Crc32c(0, index.data(), index.size()) != l.index_crc) {
      return Bad(source, "index checksum mismatch");
    }
    r.tensors_ = cache->entries;
  } else {
    SP_ASSIGN_OR_RETURN(auto entries, ParseIndex(index, l, source));
    r.tensors_ = std::make_shared<const std::vector<TensorEntry>>(std::move(entries));
    if (cache != nullptr) {
      cache->bytes.assign(index_bytes);
      cache->data_offset = l.data_offset;
      cache->data_size = l.data_size;
      cache->tensor_count = l.tensor_count;
      cache->has_elsewhere = l.has_elsewhere;
      cache->entries = r.tensors_;
    }
  }
  if (Crc32c(0, image.data() + l.extras_offset, l.extras_size) != l.extras_crc) {
    return Bad(source, "extras checksum mismatch");
  }
  r.image_ = image;
  return r;
}

}  // namespace safepoint
