#include "codec/codec.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/bytes.h"
#include "base/crc32c.h"
#include "testing/test_util.h"

namespace safepoint::codec::codec_test {
namespace {

using Bytes = std::vector<std::byte>;

constexpr int kElementSizes[] = {1, 2, 4, 8};
constexpr Mode kModes[] = {Mode::kAuto, Mode::kNone, Mode::kZstd, Mode::kPlanes};

// Values of `n` bytes like a tensor of `e`-byte floats drawn from N(0, 0.02) (bf16 for e == 2:
// the top half of an fp32), the shape of trained weights.
Bytes GaussianFloats(size_t n, int e, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 0.02);
  Bytes out(n);
  for (size_t i = 0; i + e <= n; i += e) {
    const double v = normal(rng);
    if (e == 2) {
      uint16_t b = static_cast<uint16_t>(std::bit_cast<uint32_t>(static_cast<float>(v)) >> 16);
      std::memcpy(&out[i], &b, 2);
    } else if (e == 4) {
      float f = static_cast<float>(v);
      std::memcpy(&out[i], &f, 4);
    } else if (e == 8) {
      std::memcpy(&out[i], &v, 8);
    } else {
      out[i] = std::byte{static_cast<uint8_t>(std::lround(v * 1000))};
    }
  }
  for (size_t i = n / e * e; i < n; ++i) out[i] = std::byte{static_cast<uint8_t>(rng())};
  return out;
}

Bytes RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes out(n);
  for (auto& b : out) b = std::byte{static_cast<uint8_t>(rng())};
  return out;
}

// NaNs (quiet, signalling, with payloads, negative), infinities, signed zeros, the extremes and
// denormals of the element's float type, repeated in a shuffled order.
Bytes SpecialFloats(size_t n, int e, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> bits;
  if (e == 2) {
    bits = {0x7fc0, 0x7f81, 0xffc1, 0x7f80, 0xff80, 0x0000, 0x8000, 0x0001,
            0x807f, 0x7f7f, 0xff7f, 0x0080, 0x7e00, 0xfc00, 0x03ff, 0x8001};
  } else if (e == 4) {
    bits = {0x7fc00000, 0x7f800001, 0xffc00123, 0x7f800000, 0xff800000, 0x0,
            0x80000000, 0x1,        0x807fffff, 0x7f7fffff, 0xff7fffff, 0x00800000};
  } else {
    bits = {0x7ff8000000000000, 0x7ff0000000000001,
            0xfff8000000000abc, 0x7ff0000000000000,
            0xfff0000000000000, 0x0,
            0x8000000000000000, 0x1,
            0x800fffffffffffff, 0x7fefffffffffffff,
            0x0010000000000000, 0xab};
  }
  Bytes out(n);
  for (size_t i = 0; i + e <= n; i += e) {
    uint64_t v = bits[rng() % bits.size()];
    std::memcpy(&out[i], &v, e);
  }
  return out;
}

// Denormals only: exponent all zero, random mantissa and sign.
Bytes Denormals(size_t n, int e, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes out(n);
  const uint64_t mantissa = e == 2 ? 0x7f : e == 4 ? 0x7fffff : 0xfffffffffffff;
  for (size_t i = 0; i + e <= n; i += e) {
    uint64_t v = (rng() & mantissa) | (rng() & 1 ? uint64_t{1} << (8 * e - 1) : 0);
    std::memcpy(&out[i], &v, e);
  }
  return out;
}

Bytes Encode(std::span<const std::byte> raw, int e, Mode mode, Method* method = nullptr) {
  Bytes frame;
  auto m = EncodeChunk(raw, e, mode, &frame);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (method && m.ok()) *method = *m;
  return frame;
}

// Encodes and decodes `raw`; the decoded bytes must equal it and the frame must not be much
// larger than `raw`. Returns the method used.
Method RoundTrip(const Bytes& raw, int e, Mode mode) {
  Method method = Method::kRaw;
  Bytes frame = Encode(raw, e, mode, &method);
  EXPECT_LE(frame.size(), kFrameHeaderSize + raw.size());
  auto size = DecodedSize(frame);
  EXPECT_TRUE(size.ok()) << size.status().ToString();
  if (size.ok()) {
    EXPECT_EQ(*size, raw.size());
  }
  auto frame_size = FrameSize(std::span(frame).first(kFrameHeaderSize));
  EXPECT_TRUE(frame_size.ok());
  if (frame_size.ok()) {
    EXPECT_EQ(*frame_size, frame.size());
  }
  auto frame_method = FrameMethod(frame);
  EXPECT_TRUE(frame_method.ok());
  if (frame_method.ok()) {
    EXPECT_EQ(*frame_method, method);
  }
  Bytes back(raw.size(), std::byte{0xee});
  Status s = DecodeChunk(frame, back);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(back == raw) << "element size " << e << ", mode " << ModeName(mode) << ", "
                           << raw.size() << " bytes, method " << MethodName(method);
  if (mode == Mode::kNone) {
    EXPECT_EQ(method, Method::kRaw);
  }
  return method;
}

TEST(CodecTest, ModesParseAndName) {
  for (Mode m : kModes) {
    ASSERT_OK_AND_ASSIGN(Mode parsed, ParseMode(ModeName(m)));
    EXPECT_EQ(parsed, m);
  }
  auto bad = ParseMode("lz4");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("auto, none, zstd, planes"), std::string::npos);
  EXPECT_EQ(MethodName(Method::kPlanes), "planes");
}

TEST(CodecTest, RejectsElementSizesOtherThan1248) {
  Bytes raw(64), frame;
  for (int e : {0, 3, 5, 16, -1}) {
    auto m = EncodeChunk(raw, e, Mode::kAuto, &frame);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(frame.empty());
}

// Every element size, every mode, sizes around the element size and not multiples of it.
TEST(CodecTest, RoundTripsEveryElementSizeAndModeAndOddSizes) {
  for (int e : kElementSizes) {
    for (size_t n : {size_t{0}, size_t{1}, size_t(e - 1), size_t(e), size_t(e + 1),
                     size_t(7 * e + 3), size_t(4096 * e + 5), size_t(65536 * e)}) {
      const Bytes kinds[] = {GaussianFloats(n, e, n), RandomBytes(n, n + 1), Bytes(n),
                             SpecialFloats(n, e, n + 2), Denormals(n, e, n + 3)};
      for (const Bytes& raw : kinds)
        for (Mode m : kModes) RoundTrip(raw, e, m);
    }
  }
}

TEST(CodecTest, EmptyAndOneByteChunksAreRawFrames) {
  for (Mode m : kModes) {
    EXPECT_EQ(RoundTrip(Bytes{}, 4, m), Method::kRaw);
    EXPECT_EQ(RoundTrip(Bytes{std::byte{7}}, 2, m), Method::kRaw);
  }
  EXPECT_EQ(Encode(Bytes{}, 1, Mode::kZstd).size(), kFrameHeaderSize);
}

TEST(CodecTest, IncompressibleBytesAreStoredRaw) {
  const Bytes raw = RandomBytes(1 << 20, 42);
  for (int e : kElementSizes)
    for (Mode m : kModes) EXPECT_EQ(RoundTrip(raw, e, m), Method::kRaw) << ModeName(m);
}

TEST(CodecTest, ZerosShrinkToAlmostNothing) {
  const Bytes raw(1 << 20);
  for (int e : kElementSizes) {
    for (Mode m : {Mode::kAuto, Mode::kZstd, Mode::kPlanes}) {
      Method method;
      Bytes frame = Encode(raw, e, m, &method);
      EXPECT_NE(method, Method::kRaw);
      EXPECT_LT(frame.size(), 1024u) << "element size " << e << " mode " << ModeName(m);
      Bytes back(raw.size(), std::byte{1});
      ASSERT_OK(DecodeChunk(frame, back));
      EXPECT_TRUE(back == raw);
    }
  }
}

// The point of byte planes: Gaussian floats (trained weights' shape) shrink by about what their
// exponent's entropy allows, more than zstd over the interleaved bytes.
TEST(CodecTest, PlanesBeatZstdOnFloats) {
  for (int e : {2, 4}) {
    const Bytes raw = GaussianFloats(4 << 20, e, 7);
    Method planes_method, auto_method, zstd_method;
    const size_t planes = Encode(raw, e, Mode::kPlanes, &planes_method).size();
    Encode(raw, e, Mode::kAuto, &auto_method);
    const size_t zstd = Encode(raw, e, Mode::kZstd, &zstd_method).size();
    EXPECT_EQ(planes_method, Method::kPlanes);
    EXPECT_EQ(auto_method, Method::kPlanes);
    EXPECT_LT(planes, zstd) << "element size " << e;
    // N(0, 0.02): the exponent byte carries about 2.5 bits, the rest is mantissa noise.
    const double ratio = static_cast<double>(raw.size()) / planes;
    EXPECT_GT(ratio, e == 2 ? 1.4 : 1.15) << "element size " << e;
  }
}

TEST(CodecTest, AutoUsesZstdForBytes) {
  std::string text;
  while (text.size() < (1 << 16)) text += "the quick brown fox jumps over the lazy dog. ";
  Bytes raw(text.size());
  std::memcpy(raw.data(), text.data(), text.size());
  EXPECT_EQ(RoundTrip(raw, 1, Mode::kAuto), Method::kZstd);
}

TEST(CodecTest, AppendsAfterWhatOutHolds) {
  const Bytes a = GaussianFloats(10000, 2, 1), b = GaussianFloats(30000, 4, 2);
  Bytes out{std::byte{1}, std::byte{2}, std::byte{3}};
  ASSERT_OK(EncodeChunk(a, 2, Mode::kPlanes, &out));
  const size_t first_end = out.size();
  ASSERT_OK(EncodeChunk(b, 4, Mode::kZstd, &out));
  EXPECT_EQ(out[0], std::byte{1});
  std::span<const std::byte> all(out);
  ASSERT_OK_AND_ASSIGN(uint64_t first_size, FrameSize(all.subspan(3)));
  EXPECT_EQ(3 + first_size, first_end);
  Bytes a2(a.size()), b2(b.size());
  ASSERT_OK(DecodeChunk(all.subspan(3, first_size), a2));
  ASSERT_OK(DecodeChunk(all.subspan(first_end), b2));
  EXPECT_TRUE(a2 == a);
  EXPECT_TRUE(b2 == b);
}

TEST(CodecTest, ThreadsEncodeAndDecodeAtOnce) {
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &failures] {
      for (int i = 0; i < 20; ++i) {
        const int e = kElementSizes[(t + i) % 4];
        const Bytes raw = GaussianFloats(((i * 7919) % 100000) + 1000, e, t * 100 + i);
        Bytes frame;
        if (!EncodeChunk(raw, e, kModes[i % 4], &frame).ok()) ++failures[t];
        Bytes back(raw.size());
        if (!DecodeChunk(frame, back).ok() || back != raw) ++failures[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int f : failures) EXPECT_EQ(f, 0);
}

// What a reader must get for a frame that is not the one written: Corruption, never OK.
void ExpectCorruption(std::span<const std::byte> frame, size_t raw_size, const std::string& what) {
  Bytes back(raw_size);
  Status s = DecodeChunk(frame, back);
  EXPECT_FALSE(s.ok()) << what << " decoded";
  if (!s.ok()) {
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << what << ": " << s.ToString();
  }
}

// Small frames of every method, as the bit-flip and truncation tests use them.
std::vector<std::pair<Bytes, Bytes>> SmallFrames() {
  std::vector<std::pair<Bytes, Bytes>> out;
  auto add = [&](Bytes raw, int e, Mode m, Method want) {
    Method got;
    Bytes frame = Encode(raw, e, m, &got);
    EXPECT_EQ(got, want) << "element size " << e << " mode " << ModeName(m);
    out.emplace_back(std::move(raw), std::move(frame));
  };
  add(GaussianFloats(301, 2, 3), 2, Mode::kNone, Method::kRaw);
  add(Bytes(200), 1, Mode::kZstd, Method::kZstd);
  add(GaussianFloats(512, 1, 4), 1, Mode::kZstd, Method::kZstd);
  add(GaussianFloats(1202, 2, 5), 2, Mode::kPlanes, Method::kPlanes);
  add(GaussianFloats(2403, 4, 6), 4, Mode::kPlanes, Method::kPlanes);
  add(GaussianFloats(2400, 8, 7), 8, Mode::kPlanes, Method::kPlanes);
  return out;
}

TEST(CodecTest, EverySingleBitFlipIsCorruption) {
  for (const auto& [raw, frame] : SmallFrames()) {
    Bytes bad = frame;
    for (size_t bit = 0; bit < frame.size() * 8; ++bit) {
      bad[bit / 8] ^= std::byte{static_cast<uint8_t>(1u << (bit % 8))};
      ExpectCorruption(bad, raw.size(),
                       "frame of " + std::to_string(frame.size()) + " bytes with bit " +
                           std::to_string(bit) + " flipped");
      bad[bit / 8] = frame[bit / 8];
    }
  }
}

TEST(CodecTest, EveryTruncationAndExtensionIsCorruption) {
  for (const auto& [raw, frame] : SmallFrames()) {
    for (size_t len = 0; len < frame.size(); ++len)
      ExpectCorruption(std::span(frame).first(len), raw.size(),
                       "frame cut to " + std::to_string(len) + " bytes");
    Bytes longer = frame;
    longer.push_back(std::byte{0});
    ExpectCorruption(longer, raw.size(), "frame with a byte appended");
    // And the size a caller expects must be the frame's.
    ExpectCorruption(frame, raw.size() + 1, "frame decoded into one byte more");
    if (!raw.empty()) ExpectCorruption(frame, raw.size() - 1, "frame decoded into one byte less");
  }
}

// Frames that are malformed yet carry a valid header CRC (as a fuzzer or a buggy writer makes
// them): every field is checked, and decoding never runs past the output.
class MalformedFrameTest : public ::testing::Test {
 protected:
  void SetUp() override {
    raw_ = GaussianFloats(4000, 4, 11);
    Method m;
    frame_ = Encode(raw_, 4, Mode::kPlanes, &m);
    ASSERT_EQ(m, Method::kPlanes);
  }
  // Rewrites the payload and header CRCs after an edit.
  static void Reseal(Bytes& f) {
    internal::StoreLE<uint32_t>(f.data() + 28, internal::Crc32c(0, f.data() + kFrameHeaderSize,
                                                                f.size() - kFrameHeaderSize));
    internal::StoreLE<uint32_t>(f.data() + 32, internal::Crc32c(0, f.data(), 32));
  }
  void ExpectRejected(Bytes f, const std::string& what) {
    Reseal(f);
    ExpectCorruption(f, raw_.size(), what);
  }
  // The frame with byte `at` set to `value`.
  void ExpectRejectedWith(size_t at, uint8_t value, const std::string& what) {
    Bytes f = frame_;
    f[at] = std::byte{value};
    ExpectRejected(std::move(f), what);
  }
  Bytes raw_, frame_;
};

TEST_F(MalformedFrameTest, HeaderFields) {
  Bytes back(raw_.size());
  ASSERT_OK(DecodeChunk(frame_, back));  // sealed as written
  EXPECT_TRUE(back == raw_);
  ExpectRejectedWith(4, 3, "unknown method");
  ExpectRejectedWith(5, 3, "element size 3");
  ExpectRejectedWith(5, 2, "another element size");
  ExpectRejectedWith(6, 0, "planes without their transform");
  ExpectRejectedWith(7, 1, "reserved byte");
  ExpectRejectedWith(39, 1, "reserved header word");
  Bytes f = frame_;
  internal::StoreLE<uint64_t>(f.data() + 16, ~uint64_t{0});
  ExpectRejected(f, "payload size 2^64-1");
  ExpectRejectedWith(4, 0, "raw method with a coded payload");  // the payload is not the raw size
  ExpectRejectedWith(4, 1, "zstd method with a planes payload");
}

TEST_F(MalformedFrameTest, PlaneTable) {
  constexpr size_t kTable = kFrameHeaderSize;  // the plane table follows the header
  ExpectRejectedWith(kTable, 2, "unknown plane coding");
  ExpectRejectedWith(kTable + 3, 1, "plane entry reserved byte");
  Bytes f;
  for (uint64_t v :
       {uint64_t{0}, uint64_t{1}, ~uint64_t{0}, ~uint64_t{0} - 100, uint64_t{1} << 63}) {
    for (int k = 0; k < 4; ++k) {
      f = frame_;
      internal::StoreLE<uint64_t>(f.data() + kTable + 16 * k + 8, v);
      ExpectRejected(f, "plane " + std::to_string(k) + " size " + std::to_string(v));
    }
  }
  // A plane marked raw that is zstd-coded (and the other way round).
  for (int k = 0; k < 4; ++k) {
    f = frame_;
    f[kTable + 16 * k] ^= std::byte{1};
    ExpectRejected(f, "plane " + std::to_string(k) + " coding swapped");
  }
}

TEST_F(MalformedFrameTest, HeaderOnlyQueries) {
  ASSERT_OK_AND_ASSIGN(uint64_t size, DecodedSize(std::span(frame_).first(kFrameHeaderSize)));
  EXPECT_EQ(size, raw_.size());
  EXPECT_EQ(DecodedSize(std::span(frame_).first(kFrameHeaderSize - 1)).status().code(),
            StatusCode::kCorruption);
  Bytes f = frame_;
  f[9] ^= std::byte{0x10};  // raw size, not resealed
  EXPECT_EQ(DecodedSize(f).status().code(), StatusCode::kCorruption);
  EXPECT_EQ(FrameSize(f).status().code(), StatusCode::kCorruption);
  f = frame_;
  f[0] = std::byte{'X'};
  EXPECT_EQ(FrameMethod(f).status().code(), StatusCode::kCorruption);
}

}  // namespace
}  // namespace safepoint::codec::codec_test
