#include "replica/erasure.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "testing/test_util.h"

namespace safepoint::replica::erasure_test {
namespace {

using Fragments = std::vector<std::vector<std::byte>>;

EcLayout Layout(uint32_t k, uint32_t p, uint64_t image_bytes, uint64_t piece_bytes) {
  return {.k = k, .p = p, .image_bytes = image_bytes, .piece_bytes = piece_bytes};
}

// Every fragment of `image`, encoded stripe by stripe.
Fragments EncodeAll(const EcCodec& codec, const EcLayout& layout,
                    std::span<const std::byte> image) {
  Fragments frags(layout.k + layout.p, std::vector<std::byte>(layout.fragment_bytes()));
  std::vector<std::byte*> out(frags.size());
  for (uint64_t s = 0; s < layout.stripes(); ++s) {
    for (size_t f = 0; f < frags.size(); ++f) out[f] = frags[f].data() + s * layout.piece_bytes;
    codec.EncodeStripe(layout, image, s, out);
  }
  return frags;
}

// Decodes from the fragments `which` (in that order) into a fresh image.
Status DecodeFrom(const EcCodec& codec, const EcLayout& layout, const Fragments& frags,
                  const std::vector<uint32_t>& which, std::vector<std::byte>* image) {
  std::vector<std::span<const std::byte>> spans;
  for (uint32_t f : which) spans.emplace_back(frags[f]);
  image->assign(layout.image_bytes, std::byte{0xee});
  return codec.Decode(layout, which, spans, *image);
}

// Every `k`-subset of [0, n), in lexicographic order.
std::vector<std::vector<uint32_t>> Subsets(uint32_t n, uint32_t k) {
  std::vector<std::vector<uint32_t>> out;
  std::vector<bool> pick(n, false);
  std::fill(pick.begin(), pick.begin() + k, true);
  do {
    std::vector<uint32_t> s;
    for (uint32_t i = 0; i < n; ++i) {
      if (pick[i]) s.push_back(i);
    }
    out.push_back(s);
  } while (std::prev_permutation(pick.begin(), pick.end()));
  return out;
}

TEST(EcLayoutTest, ValidateAcceptsCodesUpTo32FragmentsAndPiecesOf64Bytes) {
  EXPECT_OK(Layout(1, 1, 0, 64).Validate());
  EXPECT_OK(Layout(4, 2, 100, kDefaultPieceBytes).Validate());
  EXPECT_OK(Layout(16, 16, 100, 128).Validate());
  EXPECT_OK(Layout(31, 1, 100, 64).Validate());
}

TEST(EcLayoutTest, ValidateRejectsBadCodesAndPieceSizes) {
  for (const EcLayout& l : {Layout(0, 2, 100, 64), Layout(2, 0, 100, 64), Layout(16, 17, 100, 64),
                            Layout(30, 3, 100, 64), Layout(2, 2, 100, 0), Layout(2, 2, 100, 100),
                            Layout(2, 2, 100, 32), Layout(2, 2, 100, uint64_t{1} << 41)}) {
    const Status s = l.Validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument)
        << "k=" << l.k << " p=" << l.p << " piece=" << l.piece_bytes << ": " << s.ToString();
    EXPECT_NE(s.message().find("ec:" + std::to_string(l.k) + "+" + std::to_string(l.p)),
              std::string::npos)
        << s.ToString();
  }
}

TEST(EcLayoutTest, StripesRoundUpAndAnEmptyImageHasNone) {
  EXPECT_EQ(Layout(2, 2, 0, 64).stripes(), 0u);
  EXPECT_EQ(Layout(2, 2, 0, 64).fragment_bytes(), 0u);
  EXPECT_EQ(Layout(2, 2, 1, 64).stripes(), 1u);
  EXPECT_EQ(Layout(2, 2, 128, 64).stripes(), 1u);
  EXPECT_EQ(Layout(2, 2, 129, 64).stripes(), 2u);
  EXPECT_EQ(Layout(2, 2, 129, 64).fragment_bytes(), 128u);
  EXPECT_EQ(Layout(4, 2, 1000, 64).stripe_bytes(), 256u);
  EXPECT_EQ(Layout(4, 2, 1000, 64).stripes(), 4u);
}

TEST(EcCodecTest, CreateRejectsInvalidCodes) {
  EXPECT_EQ(EcCodec::Create(0, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(EcCodec::Create(1, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(EcCodec::Create(20, 13).status().code(), StatusCode::kInvalidArgument);
  EXPECT_OK(EcCodec::Create(20, 12));
}

TEST(EcCodecTest, DataFragmentsAreTheImagesPiecesZeroPadded) {
  ASSERT_OK_AND_ASSIGN(auto codec, EcCodec::Create(2, 1));
  const EcLayout l = Layout(2, 1, 300, 64);  // stripes of 128: 3 stripes, the last with 44 bytes
  const auto image = test::PatternBytes(l.image_bytes, 7);
  const Fragments frags = EncodeAll(*codec, l, image);
  ASSERT_EQ(frags[0].size(), 192u);
  for (uint64_t s = 0; s < l.stripes(); ++s) {
    for (uint32_t d = 0; d < 2; ++d) {
      for (uint64_t i = 0; i < l.piece_bytes; ++i) {
        const uint64_t pos = s * l.stripe_bytes() + d * l.piece_bytes + i;
        const std::byte want = pos < image.size() ? image[pos] : std::byte{0};
        ASSERT_EQ(frags[d][s * l.piece_bytes + i], want) << "stripe " << s << " piece " << d;
      }
    }
  }
  // The single parity of a code with P = 1 is not a copy of either data piece.
  EXPECT_NE(frags[2], frags[0]);
  EXPECT_NE(frags[2], frags[1]);
}

// Every K-subset of the fragments, in either order, rebuilds images of awkward sizes bit-exactly.
void ExpectEverySubsetRebuilds(uint32_t k, uint32_t p) {
  ASSERT_OK_AND_ASSIGN(auto codec, EcCodec::Create(k, p));
  std::mt19937_64 rng(k * 100 + p);
  for (uint64_t piece : {uint64_t{64}, uint64_t{192}}) {
    const uint64_t stripe = piece * k;
    std::vector<uint64_t> sizes = {
        0,          1,      63,         65,         piece - 1,      piece,
        stripe - 1, stripe, stripe + 1, 3 * stripe, 3 * stripe + 17};
    for (int i = 0; i < 4; ++i) sizes.push_back(rng() % (10 * stripe) + 1);
    for (uint64_t size : sizes) {
      SCOPED_TRACE("ec:" + std::to_string(k) + "+" + std::to_string(p) + " piece " +
                   std::to_string(piece) + " image " + std::to_string(size));
      const EcLayout l = Layout(k, p, size, piece);
      const uint64_t seed = rng();
      const auto image = test::PatternBytes(size, seed);
      const Fragments frags = EncodeAll(*codec, l, image);
      for (std::vector<uint32_t> which : Subsets(k + p, k)) {
        for (int order = 0; order < 2; ++order) {
          std::vector<std::byte> out;
          ASSERT_OK(DecodeFrom(*codec, l, frags, which, &out));
          ASSERT_EQ(test::FirstMismatch(out, seed), -1)
              << "fragments " << ::testing::PrintToString(which);
          std::reverse(which.begin(), which.end());
        }
      }
    }
  }
}

// Each of `picks` (fragment indices, in that order) rebuilds the image of pattern `seed`.
void ExpectRebuildsFrom(const EcCodec& codec, const EcLayout& layout, const Fragments& frags,
                        const std::vector<std::vector<uint32_t>>& picks, uint64_t seed) {
  for (const auto& which : picks) {
    std::vector<std::byte> out;
    ASSERT_OK(DecodeFrom(codec, layout, frags, which, &out));
    EXPECT_EQ(test::FirstMismatch(out, seed), -1) << ::testing::PrintToString(which);
  }
}

TEST(EcCodecTest, EveryTwoOfFourFragmentsRebuildTheImage) { ExpectEverySubsetRebuilds(2, 2); }
TEST(EcCodecTest, EveryFourOfSixFragmentsRebuildTheImage) { ExpectEverySubsetRebuilds(4, 2); }
TEST(EcCodecTest, EveryThreeOfFourFragmentsRebuildTheImage) { ExpectEverySubsetRebuilds(3, 1); }

TEST(EcCodecTest, WideCodeRebuildsFromParityOnlyAndFromMixes) {
  ASSERT_OK_AND_ASSIGN(auto codec, EcCodec::Create(16, 16));
  const EcLayout l = Layout(16, 16, 5 * 16 * 64 + 333, 64);
  const auto image = test::PatternBytes(l.image_bytes, 99);
  const Fragments frags = EncodeAll(*codec, l, image);
  std::vector<uint32_t> all(32);
  std::iota(all.begin(), all.end(), 0);
  std::mt19937_64 rng(5);
  std::vector<std::vector<uint32_t>> picks = {{all.begin() + 16, all.end()}};  // parity only
  for (int i = 0; i < 20; ++i) {
    std::shuffle(all.begin(), all.end(), rng);
    picks.emplace_back(all.begin(), all.begin() + 16);
  }
  ExpectRebuildsFrom(*codec, l, frags, picks, 99);
}

TEST(EcCodecTest, MoreThanKFragmentsAreAccepted) {
  ASSERT_OK_AND_ASSIGN(auto codec, EcCodec::Create(4, 2));
  const EcLayout l = Layout(4, 2, 5000, 64);
  const auto image = test::PatternBytes(l.image_bytes, 3);
  const Fragments frags = EncodeAll(*codec, l, image);
  ExpectRebuildsFrom(*codec, l, frags, {{5, 4, 3, 2, 1, 0}, {5, 0, 2, 4, 1}, {4, 5, 1, 3, 2}}, 3);
}

TEST(EcCodecTest, ADamagedParityFragmentChangesTheRebuiltImage) {
  // The decoder really reads the parity: with data fragment 0 missing, a flipped byte in parity
  // fragment 2 shows in the rebuilt image (the caller's CRC check catches it).
  ASSERT_OK_AND_ASSIGN(auto codec, EcCodec::Create(2, 2));
  const EcLayout l = Layout(2, 2, 1000, 64);
  const auto image = test::PatternBytes(l.image_bytes, 11);
  Fragments frags = EncodeAll(*codec, l, image);
  frags[2][70] ^= std::byte{1};
  std::vector<std::byte> out;
  ASSERT_OK(DecodeFrom(*codec, l, frags, {1, 2}, &out));
  EXPECT_NE(test::FirstMismatch(out, 11), -1);
}

TEST(EcCodecTest, DecodeRejectsBadIndicesSizesAndCodes) {
  ASSERT_OK_AND_ASSIGN(auto codec, EcCodec::Create(4, 2));
  const EcLayout l = Layout(4, 2, 3000, 64);
  const auto image = test::PatternBytes(l.image_bytes, 4);
  const Fragments frags = EncodeAll(*codec, l, image);
  std::vector<std::byte> out;
  auto expect_invalid = [&](const Status& s, std::string_view what) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(what), std::string::npos) << s.ToString();
  };
  expect_invalid(DecodeFrom(*codec, l, frags, {0, 1, 2}, &out), "at least 4");
  expect_invalid(DecodeFrom(*codec, l, frags, {}, &out), "at least 4");
  expect_invalid(DecodeFrom(*codec, l, frags, {0, 1, 2, 2}, &out), "fragment 2 given twice");
  expect_invalid(DecodeFrom(*codec, l, frags, {0, 5, 1, 2, 5}, &out), "fragment 5 given twice");
  {
    std::vector<std::span<const std::byte>> spans(4, std::span<const std::byte>(frags[0]));
    const std::vector<uint32_t> which = {0, 1, 2, 6};
    out.resize(l.image_bytes);
    expect_invalid(codec->Decode(l, which, spans, out), "index 6 is out of range");
  }
  {  // A fragment of the wrong size.
    std::vector<std::span<const std::byte>> spans;
    for (uint32_t f : {0, 1, 2, 3}) spans.emplace_back(frags[f]);
    spans[3] = spans[3].first(spans[3].size() - 1);
    const std::vector<uint32_t> which = {0, 1, 2, 3};
    expect_invalid(codec->Decode(l, which, spans, out), "fragment 3 has");
    // Indices and fragments that do not pair up.
    spans.pop_back();
    expect_invalid(codec->Decode(l, which, spans, out), "4 indices for 3 fragments");
  }
  {  // An image buffer of the wrong size.
    std::vector<std::span<const std::byte>> spans;
    for (uint32_t f : {0, 1, 2, 3}) spans.emplace_back(frags[f]);
    const std::vector<uint32_t> which = {0, 1, 2, 3};
    std::vector<std::byte> small(l.image_bytes - 1);
    expect_invalid(codec->Decode(l, which, spans, small), "image buffer");
  }
  {  // A layout of another code, or an invalid one.
    std::vector<std::span<const std::byte>> spans;
    for (uint32_t f : {0, 1, 2, 3}) spans.emplace_back(frags[f]);
    const std::vector<uint32_t> which = {0, 1, 2, 3};
    out.resize(l.image_bytes);
    expect_invalid(codec->Decode(Layout(4, 1, 3000, 64), which, spans, out), "ec:4+2 codec");
    expect_invalid(codec->Decode(Layout(4, 2, 3000, 100), which, spans, out), "piece size");
  }
}

}  // namespace
}  // namespace safepoint::replica::erasure_test
