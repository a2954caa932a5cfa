#include "replica/ucx_wire.h"

#include <gtest/gtest.h>

#include <cstring>

#include "base/crc32c.h"
#include "testing/test_util.h"

namespace safepoint::replica::ucx_wire_test {
namespace {

ReplicaMeta Copy() {
  ReplicaMeta m;
  m.source_node = "node-1";
  m.rank = 3;
  m.step = 42;
  m.complete_ns = 123456789;
  m.image_bytes = 10 << 20;
  m.image_crc = 0xdeadbeef;
  m.payload_bytes = m.image_bytes;
  m.payload_crc = m.image_crc;
  return m;
}

ReplicaMeta Fragment() {
  ReplicaMeta m = Copy();
  m.kind = ReplicaMeta::Kind::kFragment;
  m.index = 3;
  m.k = 2;
  m.p = 2;
  m.piece_bytes = 1 << 20;
  m.payload_bytes = 5 << 20;  // 10 MiB in stripes of 2 MiB: 5 pieces of 1 MiB
  m.payload_crc = 7;
  return m;
}

TEST(UcxWireTest, Crc32cCombineGivesTheCrcOfTheConcatenation) {
  const std::vector<std::byte> bytes = test::PatternBytes((3 << 20) + 77, 5);
  const std::span<const std::byte> all(bytes);
  for (size_t split : {size_t{0}, size_t{1}, size_t{63}, size_t{4096}, size_t{1} << 20,
                       bytes.size() - 1, bytes.size()}) {
    const uint32_t a = internal::Crc32c(all.first(split));
    const uint32_t b = internal::Crc32c(all.subspan(split));
    EXPECT_EQ(Crc32cCombine(a, b, bytes.size() - split), internal::Crc32c(all)) << split;
  }
  // Chunk by chunk, as a receiver folds them.
  uint32_t folded = 0;
  for (size_t off = 0; off < bytes.size(); off += 100000) {
    const auto chunk = all.subspan(off, std::min<size_t>(100000, bytes.size() - off));
    folded = Crc32cCombine(folded, internal::Crc32c(chunk), chunk.size());
  }
  EXPECT_EQ(folded, internal::Crc32c(all));
}

TEST(UcxWireTest, HeaderChecksSizeMagicVersionTypeAndLength) {
  WireHeader h = ControlHeader(MsgType::kHello, 10);
  ASSERT_OK(ParseHeader(&h, sizeof h, 10));
  EXPECT_EQ(ParseHeader(&h, sizeof h - 1, 10).status().code(), StatusCode::kCorruption);
  EXPECT_EQ(ParseHeader(&h, sizeof h, 11).status().code(), StatusCode::kCorruption);
  WireHeader bad = h;
  bad.magic ^= 1;
  EXPECT_EQ(ParseHeader(&bad, sizeof bad, 10).status().code(), StatusCode::kCorruption);
  bad = h;
  bad.version = kWireVersion + 1;
  EXPECT_NE(ParseHeader(&bad, sizeof bad, 10).status().message().find("version"),
            std::string::npos);
  bad = h;
  bad.type = 0;
  EXPECT_FALSE(ParseHeader(&bad, sizeof bad, 10).ok());
  bad.type = static_cast<uint16_t>(MsgType::kLast) + 1;
  EXPECT_FALSE(ParseHeader(&bad, sizeof bad, 10).ok());
  WireHeader big = ControlHeader(MsgType::kList, kMaxControlBytes + 1);
  EXPECT_FALSE(ParseHeader(&big, sizeof big, kMaxControlBytes + 1).ok());
  WireHeader chunk = ChunkHeader(0, kMaxChunkBytes + 1, 0);
  EXPECT_FALSE(ParseHeader(&chunk, sizeof chunk, kMaxChunkBytes + 1).ok());
  chunk = ChunkHeader(0, 0, 0);
  EXPECT_FALSE(ParseHeader(&chunk, sizeof chunk, 0).ok());
  EXPECT_FALSE(ParseHeader(nullptr, 0, 0).ok());
}

TEST(UcxWireTest, MetaRoundTripsThroughJson) {
  for (const ReplicaMeta& m : {Copy(), Fragment()}) {
    ASSERT_OK_AND_ASSIGN(ReplicaMeta back, MetaFromJson(MetaToJson(m)));
    EXPECT_EQ(back.source_node, m.source_node);
    EXPECT_EQ(back.rank, m.rank);
    EXPECT_EQ(back.step, m.step);
    EXPECT_EQ(back.complete_ns, m.complete_ns);
    EXPECT_EQ(back.image_bytes, m.image_bytes);
    EXPECT_EQ(back.image_crc, m.image_crc);
    EXPECT_EQ(back.kind, m.kind);
    EXPECT_EQ(back.index, m.index);
    EXPECT_EQ(back.k, m.k);
    EXPECT_EQ(back.p, m.p);
    EXPECT_EQ(back.piece_bytes, m.piece_bytes);
    EXPECT_EQ(back.payload_bytes, m.payload_bytes);
    EXPECT_EQ(back.payload_crc, m.payload_crc);
  }
  EXPECT_FALSE(MetaFromJson("not json").ok());
  EXPECT_FALSE(MetaFromJson("[]").ok());
  EXPECT_FALSE(MetaFromJson(R"({"source_node":"a"})").ok());
  std::string negative = MetaToJson(Copy());
  negative.replace(negative.find("\"rank\":3"), 8, "\"rank\":-3");
  EXPECT_FALSE(MetaFromJson(negative).ok());
  std::string kind = MetaToJson(Copy());
  kind.replace(kind.find("\"kind\":1"), 8, "\"kind\":9");
  EXPECT_FALSE(MetaFromJson(kind).ok());
}

TEST(UcxWireTest, DeclaredMetaMustBeThePeersOwnAndConsistent) {
  EXPECT_OK(ValidateDeclaredMeta(Copy(), "node-1", 1 << 30));
  EXPECT_OK(ValidateDeclaredMeta(Fragment(), "node-1", 1 << 30));
  // Another node's snapshot, or a bad name.
  EXPECT_FALSE(ValidateDeclaredMeta(Copy(), "node-2", 1 << 30).ok());
  ReplicaMeta m = Copy();
  m.source_node = "../x";
  EXPECT_FALSE(ValidateDeclaredMeta(m, "../x", 1 << 30).ok());
  // Bigger than allowed.
  EXPECT_FALSE(ValidateDeclaredMeta(Copy(), "node-1", (10 << 20) - 1).ok());
  // A copy that is not the image.
  m = Copy();
  m.payload_bytes += 1;
  EXPECT_FALSE(ValidateDeclaredMeta(m, "node-1", 1 << 30).ok());
  m = Copy();
  m.index = 1;
  EXPECT_FALSE(ValidateDeclaredMeta(m, "node-1", 1 << 30).ok());
  // A fragment that lies about its size, index or code.
  m = Fragment();
  m.payload_bytes -= 64;
  EXPECT_FALSE(ValidateDeclaredMeta(m, "node-1", 1 << 30).ok());
  m = Fragment();
  m.index = 4;
  EXPECT_FALSE(ValidateDeclaredMeta(m, "node-1", 1 << 30).ok());
  m = Fragment();
  m.piece_bytes = 100;
  EXPECT_FALSE(ValidateDeclaredMeta(m, "node-1", 1 << 30).ok());
  m = Fragment();
  m.k = 20;
  m.p = 13;
  EXPECT_FALSE(ValidateDeclaredMeta(m, "node-1", 1 << 30).ok());
  m = Copy();
  m.image_bytes = m.payload_bytes = 0;
  EXPECT_FALSE(ValidateDeclaredMeta(m, "node-1", 1 << 30).ok());
}

TEST(UcxWireTest, ChunkLayoutAcceptsExactlyItsChunks) {
  ChunkLayout l{10000, 4096};
  ASSERT_OK(l.Validate());
  EXPECT_EQ(l.chunks(), 3u);
  EXPECT_EQ(l.IndexOf(0, 4096), 0);
  EXPECT_EQ(l.IndexOf(8192, 10000 - 8192), 2);
  EXPECT_EQ(l.IndexOf(8192, 4096), -1);  // past the end
  EXPECT_EQ(l.IndexOf(4095, 4096), -1);  // misaligned
  EXPECT_EQ(l.IndexOf(4096, 100), -1);   // short
  EXPECT_EQ(l.IndexOf(12288, 1), -1);
  EXPECT_FALSE((ChunkLayout{10000, 100}).Validate().ok());
  EXPECT_FALSE((ChunkLayout{0, 4096}).Validate().ok());
  EXPECT_FALSE((ChunkLayout{kMaxChunks * kMinChunkBytes + 1, kMinChunkBytes}).Validate().ok());
}

}  // namespace
}  // namespace safepoint::replica::ucx_wire_test
