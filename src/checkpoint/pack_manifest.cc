// The manifest format of packed images (pack_manifest.h; bytes in docs/format.md, "Packed
// steps"): encoding, decoding with every field validated, and the content chunks' plan.
#include "checkpoint/pack_manifest.h"

#include <algorithm>
#include <cstring>

#include "base/bytes.h"
#include "base/crc32c.h"
#include "base/digest.h"
#include "checkpoint/small_object.h"
#include "codec/codec.h"

namespace safepoint {

using internal::AppendLE;
using internal::Crc32c;
using internal::LoadLE;

namespace {
constexpr char kManifestMagic[8] = {'S', 'P', 'P', 'A', 'C', 'K', '\0', '\1'};
}  // namespace

std::string ChunkObjectName(std::span<const uint8_t, 32> sha256) {
  const std::string hex = internal::ToHex(sha256.data(), sha256.size());
  return std::string(kChunkPrefix) + hex.substr(0, 2) + "/" + hex;
}

std::vector<std::pair<uint64_t, uint64_t>> PlanContentChunks(
    const ImageLayout& l, const std::vector<TensorEntry>& tensors) {
  // Where a content chunk may end: checksum-chunk boundaries and the start of the data and the
  // extras sections (always: the header, index and extras change with every step), tensors.
  std::vector<uint64_t> cuts = {l.data_offset, l.extras_offset};
  for (const auto& t : tensors) {
    if (!t.spec.elsewhere && t.nbytes > 0) cuts.push_back(t.offset);
  }
  for (uint64_t b = l.chunk_size; b < l.checksums_offset; b += l.chunk_size) cuts.push_back(b);
  cuts.push_back(l.checksums_offset);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  while (!cuts.empty() && cuts.back() > l.checksums_offset) cuts.pop_back();
  auto hard = [&](uint64_t cut) {
    return cut % l.chunk_size == 0 || cut == l.checksums_offset || cut == l.data_offset ||
           cut == l.extras_offset;
  };
  std::vector<std::pair<uint64_t, uint64_t>> out;
  uint64_t start = 0;
  for (size_t i = 0; i < cuts.size(); ++i) {
    const uint64_t cut = cuts[i];
    if (cut <= start) continue;
    // Small tensors next to each other share a content chunk (never with a large one).
    if (!hard(cut) && i + 1 < cuts.size() && cut - start < PackedManifest::kMinPiece &&
        cuts[i + 1] - cut < PackedManifest::kMinPiece) {
      continue;
    }
    out.emplace_back(start, cut - start);
    start = cut;
  }
  return out;
}

bool IndexContentChunks(const ImageLayout& l, std::vector<PackedManifest::Chunk>& chunks,
                        std::vector<size_t>* first) {
  first->assign(l.chunk_count() + 1, chunks.size());
  uint64_t at = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    chunks[i].offset = at;
    const uint64_t size = chunks[i].raw_size;
    if (size == 0 || at >= l.checksums_offset || size > l.checksums_offset - at) return false;
    const uint64_t c = at / l.chunk_size;
    if ((at + size - 1) / l.chunk_size != c) return false;  // crosses a checksum chunk
    if (at % l.chunk_size == 0) (*first)[c] = i;
    at += size;
  }
  return at == l.checksums_offset;
}

std::string EncodePackedManifest(const PackedManifest& m) {
  std::string out(kManifestMagic, 8);
  AppendLE<uint32_t>(out, PackedManifest::kVersion);
  AppendLE<uint32_t>(out, PackedManifest::kEntrySize);
  AppendLE<uint64_t>(out, m.layout.image_size);
  AppendLE<uint64_t>(out, m.layout.chunk_size);
  AppendLE<uint64_t>(out, m.chunks.size());
  AppendLE<uint32_t>(out, m.layout.header_crc);
  out.append(20, '\0');  // reserved
  auto append = [&](const std::vector<std::byte>& b) {
    out.append(reinterpret_cast<const char*>(b.data()), b.size());
  };
  append(m.header);
  append(m.index);
  append(m.extras);
  append(m.checksums);
  for (const auto& c : m.chunks) {
    out.append(reinterpret_cast<const char*>(c.sha256.data()), 32);
    AppendLE<uint64_t>(out, c.stored_size);
    AppendLE<uint32_t>(out, c.raw_size);
    out.push_back(static_cast<char>(c.method));
    out.append(3, '\0');
  }
  AppendLE<uint32_t>(out, Crc32c(0, out.data(), out.size()));
  return out;
}

Result<PackedManifest> DecodePackedManifest(std::span<const std::byte> d, std::string_view source) {
  auto bad = [&](const std::string& what) {
    return Corruption(std::string(source) + ": corrupt manifest: " + what);
  };
  constexpr size_t kFixed = PackedManifest::kFixedSize;
  if (d.size() < kFixed + kImageHeaderSize + 4) return bad("truncated");
  if (std::memcmp(d.data(), kManifestMagic, 8) != 0) return bad("bad magic");
  if (Crc32c(0, d.data(), d.size() - 4) != LoadLE<uint32_t>(&d[d.size() - 4])) {
    return bad("checksum mismatch");
  }
  if (LoadLE<uint32_t>(&d[8]) != PackedManifest::kVersion) {
    return bad("unsupported version " + std::to_string(LoadLE<uint32_t>(&d[8])));
  }
  if (LoadLE<uint32_t>(&d[12]) != PackedManifest::kEntrySize) return bad("bad entry size");
  for (size_t i = 44; i < kFixed; ++i) {
    if (d[i] != std::byte{0}) return bad("reserved bytes are not zero");
  }
  PackedManifest m;
  m.header.assign(d.begin() + kFixed, d.begin() + kFixed + kImageHeaderSize);
  SP_ASSIGN_OR_RETURN(auto parsed, ParseImageHeader(m.header, source));
  m.meta = std::move(parsed.first);
  m.layout = parsed.second;
  const ImageLayout& l = m.layout;
  const uint64_t chunks = LoadLE<uint64_t>(&d[32]);
  if (LoadLE<uint64_t>(&d[16]) != l.image_size || LoadLE<uint64_t>(&d[24]) != l.chunk_size ||
      LoadLE<uint32_t>(&d[40]) != l.header_crc || chunks < l.chunk_count() ||
      chunks > l.checksums_offset / 64 + l.chunk_count()) {
    return bad("fields disagree with the image header");
  }
  const uint64_t tail = l.image_size - l.checksums_offset;
  // Sizes come from a validated header (canonical layout), so these sums do not overflow.
  const uint64_t want = kFixed + kImageHeaderSize + l.index_size + l.extras_size + tail +
                        PackedManifest::kEntrySize * chunks + 4;
  if (d.size() != want) {
    return bad("size " + std::to_string(d.size()) + ", expected " + std::to_string(want));
  }
  size_t at = kFixed + kImageHeaderSize;
  auto take = [&](uint64_t n) {
    std::vector<std::byte> v(d.begin() + at, d.begin() + at + n);
    at += n;
    return v;
  };
  m.index = take(l.index_size);
  m.extras = take(l.extras_size);
  m.checksums = take(tail);
  if (Crc32c(m.index) != l.index_crc) return bad("index checksum mismatch");
  if (Crc32c(m.extras) != l.extras_crc) return bad("extras checksum mismatch");
  SP_ASSIGN_OR_RETURN(m.chunk_crcs, ParseChecksumSection(m.checksums, l, source));
  m.chunks.resize(chunks);
  for (uint64_t i = 0; i < chunks; ++i, at += PackedManifest::kEntrySize) {
    PackedManifest::Chunk& c = m.chunks[i];
    std::memcpy(c.sha256.data(), &d[at], 32);
    c.stored_size = LoadLE<uint64_t>(&d[at + 32]);
    c.raw_size = LoadLE<uint32_t>(&d[at + 40]);
    c.method = static_cast<uint8_t>(d[at + 44]);
    if (d[at + 45] != std::byte{0} || d[at + 46] != std::byte{0} || d[at + 47] != std::byte{0}) {
      return bad("reserved bytes of chunk " + std::to_string(i) + " are not zero");
    }
    if (c.method > static_cast<uint8_t>(codec::Method::kPlanes) &&
        c.method != PackedManifest::kMethodStoredBefore) {
      return bad("chunk " + std::to_string(i) + " has unknown method " + std::to_string(c.method));
    }
  }
  if (!IndexContentChunks(l, m.chunks, &m.first_chunk)) {
    return bad("its chunks do not partition the image within its checksum chunks");
  }
  return m;
}

Result<PackedManifest> ReadPackedManifest(Storage& storage, const std::string& name) {
  SP_ASSIGN_OR_RETURN(auto data, internal::ReadSmallObject(storage, name, uint64_t{1} << 34));
  return DecodePackedManifest(data, storage.Describe(name));
}

}  // namespace safepoint
