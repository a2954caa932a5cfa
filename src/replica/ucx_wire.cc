// The peer service's wire format (src/replica/ucx_wire.h): message headers, replica metas as
// JSON and their validation, chunk layouts, and folding chunk CRCs into a payload's CRC.
#include "replica/ucx_wire.h"

#include <array>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "base/json_fields.h"

namespace safepoint::replica {
namespace {

using internal::GetU32;
using internal::GetU64;
using nlohmann::json;

bool ValidNodeName(std::string_view s) {
  if (s.empty() || s.size() > 64 || s.front() == '.') return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-'))
      return false;
  return true;
}

}  // namespace

const char* MsgTypeName(MsgType type) {
  switch (type) {
    case MsgType::kHello:
      return "hello";
    case MsgType::kChallenge:
      return "challenge";
    case MsgType::kAuth:
      return "auth";
    case MsgType::kAuthOk:
      return "auth-ok";
    case MsgType::kError:
      return "error";
    case MsgType::kPutBegin:
      return "put-begin";
    case MsgType::kPutReady:
      return "put-ready";
    case MsgType::kChunk:
      return "chunk";
    case MsgType::kPutDone:
      return "put-done";
    case MsgType::kCancel:
      return "cancel";
    case MsgType::kList:
      return "list";
    case MsgType::kListReply:
      return "list-reply";
    case MsgType::kFetch:
      return "fetch";
    case MsgType::kFetchBegin:
      return "fetch-begin";
    case MsgType::kCommit:
      return "commit";
    case MsgType::kCommitted:
      return "committed";
    case MsgType::kPing:
      return "ping";
    case MsgType::kNote:
      return "note";
    case MsgType::kNoteReply:
      return "note-reply";
    case MsgType::kFetchSnapshot:
      return "fetch-snapshot";
  }
  return "unknown";
}

WireHeader ControlHeader(MsgType type, size_t json_bytes) {
  WireHeader h;
  h.type = static_cast<uint16_t>(type);
  h.len = json_bytes;
  return h;
}

WireHeader ChunkHeader(uint64_t offset, uint64_t len, uint32_t crc) {
  WireHeader h;
  h.type = static_cast<uint16_t>(MsgType::kChunk);
  h.offset = offset;
  h.len = len;
  h.crc = crc;
  return h;
}

Result<WireHeader> ParseHeader(const void* header, size_t header_bytes, size_t data_bytes) {
  if (header == nullptr || header_bytes != sizeof(WireHeader))
    return Corruption("message header of " + std::to_string(header_bytes) + " bytes, expected " +
                      std::to_string(sizeof(WireHeader)));
  WireHeader h;
  std::memcpy(&h, header, sizeof h);
  if (h.magic != kWireMagic) return Corruption("message header with a bad magic");
  if (h.version != kWireVersion)
    return Corruption("message version " + std::to_string(h.version) + ", this agent speaks " +
                      std::to_string(kWireVersion));
  if (h.type < static_cast<uint16_t>(MsgType::kHello) ||
      h.type > static_cast<uint16_t>(MsgType::kLast))
    return Corruption("unknown message type " + std::to_string(h.type));
  if (h.len != data_bytes)
    return Corruption(std::string(MsgTypeName(static_cast<MsgType>(h.type))) +
                      " message declares " + std::to_string(h.len) + " bytes and carries " +
                      std::to_string(data_bytes));
  if (static_cast<MsgType>(h.type) == MsgType::kChunk) {
    if (h.len == 0 || h.len > kMaxChunkBytes)
      return Corruption("chunk of " + std::to_string(h.len) + " bytes");
  } else if (h.len > kMaxControlBytes) {
    return Corruption("control message of " + std::to_string(h.len) + " bytes (at most " +
                      std::to_string(kMaxControlBytes) + ")");
  }
  return h;
}

std::string MetaToJson(const ReplicaMeta& m) {
  json j = {{"source_node", m.source_node},
            {"rank", m.rank},
            {"step", m.step},
            {"complete_ns", m.complete_ns},
            {"attempt", m.attempt},
            {"image_bytes", m.image_bytes},
            {"image_crc", m.image_crc},
            {"kind", static_cast<uint32_t>(m.kind)},
            {"index", m.index},
            {"k", m.k},
            {"p", m.p},
            {"piece_bytes", m.piece_bytes},
            {"payload_bytes", m.payload_bytes},
            {"payload_crc", m.payload_crc}};
  return j.dump();
}

Result<ReplicaMeta> MetaFromJson(std::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Corruption("replica meta is not a JSON object");
  ReplicaMeta m;
  auto src = j.find("source_node");
  if (src == j.end() || !src->is_string()) return Corruption("replica meta without source_node");
  m.source_node = src->get<std::string>();
  uint32_t kind = 0;
  if (!GetU32(j, "rank", &m.rank) || !GetU64(j, "step", &m.step) ||
      !GetU64(j, "complete_ns", &m.complete_ns) || !GetU64(j, "attempt", &m.attempt) ||
      !GetU64(j, "image_bytes", &m.image_bytes) || !GetU32(j, "image_crc", &m.image_crc) ||
      !GetU32(j, "kind", &kind) || !GetU32(j, "index", &m.index) || !GetU32(j, "k", &m.k) ||
      !GetU32(j, "p", &m.p) || !GetU64(j, "piece_bytes", &m.piece_bytes) ||
      !GetU64(j, "payload_bytes", &m.payload_bytes) || !GetU32(j, "payload_crc", &m.payload_crc))
    return Corruption("replica meta with a missing or mistyped field");
  if (kind != static_cast<uint32_t>(ReplicaMeta::Kind::kCopy) &&
      kind != static_cast<uint32_t>(ReplicaMeta::Kind::kFragment))
    return Corruption("replica meta of unknown kind " + std::to_string(kind));
  m.kind = static_cast<ReplicaMeta::Kind>(kind);
  return m;
}

Status ValidateDeclaredMeta(const ReplicaMeta& m, std::string_view peer, uint64_t max_image_bytes) {
  const std::string who = "replica declared by peer " + std::string(peer);
  if (!ValidNodeName(m.source_node)) return Corruption(who + ": bad source node name");
  if (m.source_node != peer)
    return Corruption(who + ": source node " + m.source_node + " is not the peer itself");
  if (m.image_bytes == 0 || m.image_bytes > max_image_bytes)
    return Corruption(who + ": image of " + std::to_string(m.image_bytes) + " bytes (at most " +
                      std::to_string(max_image_bytes) + ")");
  if (m.kind == ReplicaMeta::Kind::kCopy) {
    if (m.index != 0 || m.k != 1 || m.p != 0 || m.payload_bytes != m.image_bytes ||
        m.payload_crc != m.image_crc)
      return Corruption(who + ": a copy must be index 0, k=1, p=0 and exactly the image");
    return Status::OK();
  }
  if (m.k < 1 || m.p < 1 || m.k + m.p > 32 || m.index >= m.k + m.p)
    return Corruption(who + ": fragment " + std::to_string(m.index) +
                      " of ec:" + std::to_string(m.k) + "+" + std::to_string(m.p));
  if (m.piece_bytes == 0 || m.piece_bytes % 64 != 0 || m.piece_bytes > kMaxChunkBytes)
    return Corruption(who + ": piece of " + std::to_string(m.piece_bytes) + " bytes");
  const uint64_t stripe = m.piece_bytes * m.k;
  const uint64_t stripes = (m.image_bytes + stripe - 1) / stripe;
  if (m.payload_bytes != stripes * m.piece_bytes)
    return Corruption(who + ": fragment of " + std::to_string(m.payload_bytes) +
                      " bytes, the layout gives " + std::to_string(stripes * m.piece_bytes));
  return Status::OK();
}

namespace {

// CRC32C's polynomial, bit-reversed (bit 31 is x^0, as the CRC's bits are).
constexpr uint32_t kCrc32cPoly = 0x82f63b78;

// a * b modulo the polynomial.
uint32_t MulModPoly(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = uint32_t{1} << 31; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kCrc32cPoly : b >> 1;
  }
  return product;
}

// x^(2^i) modulo the polynomial, i in [0, 64).
const std::array<uint32_t, 64>& PowersOfX() {
  static const std::array<uint32_t, 64> table = [] {
    std::array<uint32_t, 64> t{};
    t[0] = uint32_t{1} << 30;  // x^1
    for (size_t i = 1; i < t.size(); ++i) t[i] = MulModPoly(t[i - 1], t[i - 1]);
    return t;
  }();
  return table;
}

}  // namespace

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // Appending len_b bytes multiplies a's CRC register by x^(8 len_b); b's CRC adds on (the
  // initial and final inversions cancel out).
  uint32_t shift = uint32_t{1} << 31;  // x^0
  const auto& powers = PowersOfX();
  for (size_t i = 3; len_b != 0 && i < powers.size(); ++i, len_b >>= 1)
    if (len_b & 1) shift = MulModPoly(powers[i], shift);
  return MulModPoly(shift, crc_a) ^ crc_b;
}

int64_t ChunkLayout::IndexOf(uint64_t offset, uint64_t len) const {
  if (chunk_bytes == 0 || offset % chunk_bytes != 0 || offset >= total) return -1;
  const uint64_t expect = std::min(chunk_bytes, total - offset);
  if (len != expect) return -1;
  return static_cast<int64_t>(offset / chunk_bytes);
}

Status ChunkLayout::Validate() const {
  if (chunk_bytes < kMinChunkBytes || chunk_bytes > kMaxChunkBytes)
    return Corruption("chunk size " + std::to_string(chunk_bytes) + " outside [" +
                      std::to_string(kMinChunkBytes) + ", " + std::to_string(kMaxChunkBytes) + "]");
  if (total == 0 || chunks() > kMaxChunks)
    return Corruption("transfer of " + std::to_string(total) + " bytes in " +
                      std::to_string(chunks()) + " chunks");
  return Status::OK();
}

}  // namespace safepoint::replica
