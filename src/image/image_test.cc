#include "safepoint/image.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <numeric>
#include <random>

#include "base/bytes.h"
#include "base/crc32c.h"
#include "testing/test_util.h"

namespace safepoint::image_test {
namespace {

using internal::Crc32c;

std::vector<std::byte> Build(const ImageBuilder& b, size_t threads = 2) {
  std::vector<std::byte> out(b.size());
  b.FillAll(out, threads);
  return out;
}

struct Owned {
  std::vector<std::vector<std::byte>> data;
  std::vector<TensorSource> sources;
  void Add(std::string name, DType dtype, std::vector<uint64_t> shape, uint8_t seed,
           std::vector<uint64_t> gshape = {}, std::vector<uint64_t> goff = {}) {
    uint64_t n = DTypeSize(dtype);
    for (auto d : shape) n *= d;
    data.push_back(test::PatternBytes(n, seed));
    TensorSource s;
    s.spec = {std::move(name), dtype, std::move(shape), std::move(gshape), std::move(goff)};
    s.data = data.back().empty() ? nullptr : data.back().data();
    s.nbytes = n;
    sources.push_back(std::move(s));
  }
};

ImageMeta Meta(uint64_t step = 7, uint32_t rank = 1, uint32_t world = 4) {
  return test::TestImageMeta("job-1", step, rank, world);
}

TEST(Crc32cTest, KnownVectorAndChaining) {
  const char* s = "123456789";
  EXPECT_EQ(Crc32c(0, s, 9), 0xE3069283u);
  EXPECT_EQ(Crc32c(Crc32c(0, s, 4), s + 4, 5), 0xE3069283u);
  EXPECT_EQ(Crc32c(0, s, 0), 0u);
}

TEST(ImageTest, RoundTripEveryDtypeScalarEmptyLongNames) {
  Owned o;
  const DType all[] = {
      DType::kFloat32,   DType::kFloat16,        DType::kBFloat16,       DType::kFloat64,
      DType::kInt8,      DType::kInt16,          DType::kInt32,          DType::kInt64,
      DType::kUInt8,     DType::kBool,           DType::kFloat8E4M3FN,   DType::kFloat8E5M2,
      DType::kComplex64, DType::kComplex128,     DType::kUInt16,         DType::kUInt32,
      DType::kUInt64,    DType::kFloat8E4M3FNUZ, DType::kFloat8E5M2FNUZ, DType::kFloat8E8M0FNU};
  uint8_t seed = 1;
  for (DType d : all) o.Add(std::string("t.") + std::string(DTypeName(d)), d, {3, 5}, seed++);
  o.Add("scalar", DType::kFloat64, {}, 9);
  o.Add("empty", DType::kFloat32, {0, 7}, 0);
  o.Add("big", DType::kFloat32, {300, 1000}, 3);  // > 64 KiB: page aligned
  o.Add(std::string(5000, 'x') + "\xc3\xa9", DType::kInt8, {2}, 4);
  o.Add("shard", DType::kBFloat16, {2, 3}, 5, {8, 3}, {4, 0});
  auto b = ImageBuilder::Create(Meta(), o.sources, "extras-bytes", 64 << 10);
  ASSERT_OK(b);
  auto img = Build(**b);
  EXPECT_EQ(img.size() % 4096, 0u);
  auto r = ImageReader::Parse(img, "mem");
  ASSERT_OK(r);
  EXPECT_EQ(r->meta().step, 7u);
  EXPECT_EQ(r->meta().rank, 1u);
  EXPECT_EQ(r->meta().world_size, 4u);
  EXPECT_EQ(r->meta().job, "job-1");
  ASSERT_EQ(r->tensors().size(), o.sources.size());
  for (size_t i = 0; i < o.sources.size(); ++i) {
    const auto& e = r->tensors()[i];
    const auto& s = o.sources[i];
    EXPECT_EQ(e.spec.name, s.spec.name);
    EXPECT_EQ(e.spec.dtype, s.spec.dtype);
    EXPECT_EQ(e.spec.shape, s.spec.shape);
    EXPECT_EQ(e.spec.global_shape, s.spec.global_shape);
    EXPECT_EQ(e.spec.global_offset, s.spec.global_offset);
    ASSERT_EQ(e.nbytes, s.nbytes);
    EXPECT_EQ(e.offset % 64, 0u);
    if (e.nbytes >= (64 << 10)) EXPECT_EQ(e.offset % 4096, 0u);
    if (s.nbytes > 0)
      EXPECT_EQ(std::memcmp(r->tensor_data(i).data(), s.data, s.nbytes), 0) << s.spec.name;
  }
  EXPECT_EQ(internal::AsStringView(r->extras()), "extras-bytes");
}

TEST(ImageTest, FillOfAnyRangeMatchesFillAll) {
  Owned o;
  for (int i = 0; i < 50; ++i)
    o.Add("t" + std::to_string(i), DType::kFloat32, {uint64_t(i * 37)}, i);
  auto b = ImageBuilder::Create(Meta(), o.sources, "x", 4096);
  ASSERT_OK(b);
  auto full = Build(**b);
  std::mt19937_64 rng(1);
  const uint64_t limit = (*b)->layout().checksums_offset;
  for (int i = 0; i < 200; ++i) {
    uint64_t a = rng() % limit, len = rng() % (limit - a) + 1;
    std::vector<std::byte> part(len, std::byte{0x5A});
    (*b)->Fill(a, part);
    ASSERT_EQ(std::memcmp(part.data(), full.data() + a, len), 0) << a << "+" << len;
  }
}

// SourceBytes: the caller's own bytes of a range inside one tensor, which equal the image's bytes
// there; nothing for a range that touches anything else (a writer then fills a copy).
TEST(ImageTest, SourceBytesAreTheImagesBytesInsideOneTensorAndNothingElsewhere) {
  Owned o;
  for (int i = 0; i < 20; ++i)
    o.Add("t" + std::to_string(i), DType::kFloat32, {uint64_t(i * 1000 + 3)}, i);
  o.sources[5].spec.elsewhere = true;
  o.sources[6].staged = true;
  auto b = ImageBuilder::Create(Meta(), o.sources, "x", 4096);
  ASSERT_OK(b);
  const ImageBuilder& img = **b;
  auto full = Build(img);
  std::mt19937_64 rng(2);
  const uint64_t limit = img.layout().checksums_offset;
  int inside = 0;
  for (int i = 0; i < 2000; ++i) {
    const uint64_t a = rng() % limit, len = rng() % std::min<uint64_t>(limit - a, 40000) + 1;
    const auto got = img.SourceBytes(a, len);
    bool in_one = false;
    for (size_t t = 0; t < img.tensors().size(); ++t) {
      const TensorSource& src = img.tensors()[t];
      const uint64_t at = img.tensor_offset(t);
      if (!src.staged && !src.spec.elsewhere && a >= at && a + len <= at + src.nbytes)
        in_one = true;
    }
    ASSERT_EQ(!got.empty(), in_one) << a << "+" << len;
    if (got.empty()) continue;
    ++inside;
    ASSERT_EQ(got.size(), len);
    ASSERT_EQ(std::memcmp(got.data(), full.data() + a, len), 0) << a << "+" << len;
  }
  EXPECT_GT(inside, 100);
  EXPECT_TRUE(img.SourceBytes(0, 64).empty());                    // the header
  EXPECT_TRUE(img.SourceBytes(img.tensor_offset(5), 4).empty());  // held elsewhere
  EXPECT_TRUE(img.SourceBytes(img.tensor_offset(6), 4).empty());  // staged by the caller
  EXPECT_TRUE(img.SourceBytes(img.tensor_offset(7), 0).empty());
}

// A reused plan (issue 14): Rebind gives the image a new step, creation time and tensor data,
// and the result is the image Create would have built from the same inputs.
TEST(ImageTest, RebindIsCreateWithANewStepAndNewData) {
  Owned first, second;
  for (int i = 0; i < 20; ++i) {
    first.Add("t" + std::to_string(i), DType::kFloat32, {uint64_t(i * 13 + 1)}, i);
    second.Add("t" + std::to_string(i), DType::kFloat32, {uint64_t(i * 13 + 1)}, i + 100);
  }
  auto b = ImageBuilder::Create(Meta(3), first.sources, "extras", 4096);
  ASSERT_OK(b);
  std::vector<const void*> data;
  for (const auto& s : second.sources) data.push_back(s.data);
  (*b)->Rebind(9, data);
  auto rebound = Build(**b);
  auto r = ImageReader::Parse(rebound, "rebound", ImageReader::Verify::kAll, 2);
  ASSERT_OK(r);
  EXPECT_EQ(r->meta().step, 9u);
  for (size_t i = 0; i < second.sources.size(); ++i) {
    ASSERT_EQ(
        std::memcmp(r->tensor_data(i).data(), second.sources[i].data, second.sources[i].nbytes), 0)
        << i;
  }
  ImageMeta meta = Meta(9);
  meta.create_time_ns = r->meta().create_time_ns;
  auto fresh = ImageBuilder::Create(meta, second.sources, "extras", 4096);
  ASSERT_OK(fresh);
  EXPECT_EQ(Build(**fresh), rebound);
  // The two-part form, address by address.
  (*b)->Rebind(9);
  for (size_t i = 0; i < first.sources.size(); ++i) (*b)->SetTensorData(i, first.sources[i].data);
  auto again = Build(**b);
  auto back = ImageReader::Parse(again, "back", ImageReader::Verify::kAll, 2);
  ASSERT_OK(back);
  EXPECT_EQ(
      std::memcmp(back->tensor_data(5).data(), first.sources[5].data, first.sources[5].nbytes), 0);
}

// Issue 21: a caller's ParsedIndex lets an image whose index is that of the last parse (a
// snapshot saved with a reused plan) share its entries; any other index is parsed and replaces
// it, and the index checksum is checked either way.
TEST(ImageTest, ParsedIndexIsReusedOnlyForTheSameIndex) {
  Owned first, second, renamed;
  for (int i = 0; i < 20; ++i) {
    first.Add("t" + std::to_string(i), DType::kFloat32, {uint64_t(i * 13 + 1)}, i);
    second.Add("t" + std::to_string(i), DType::kFloat32, {uint64_t(i * 13 + 1)}, i + 100);
    renamed.Add("u" + std::to_string(i), DType::kFloat32, {uint64_t(i * 13 + 1)}, i);
  }
  auto a = ImageBuilder::Create(Meta(3), first.sources, "extras", 4096);
  auto b = ImageBuilder::Create(Meta(4), second.sources, "extras", 4096);
  auto c = ImageBuilder::Create(Meta(5), renamed.sources, "extras", 4096);
  ASSERT_OK(a);
  ASSERT_OK(b);
  ASSERT_OK(c);
  const auto img_a = Build(**a), img_b = Build(**b), img_c = Build(**c);
  ParsedIndex cache;
  ASSERT_OK_AND_ASSIGN(auto ra,
                       ImageReader::Parse(img_a, "a", ImageReader::Verify::kAll, 2, &cache));
  ASSERT_OK_AND_ASSIGN(auto rb,
                       ImageReader::Parse(img_b, "b", ImageReader::Verify::kAll, 2, &cache));
  EXPECT_EQ(&ra.tensors(), &rb.tensors());  // the same entries, parsed once
  EXPECT_EQ(rb.meta().step, 4u);
  EXPECT_EQ(std::memcmp(rb.tensor_data(7).data(), second.sources[7].data, second.sources[7].nbytes),
            0);
  ASSERT_OK_AND_ASSIGN(auto rc,
                       ImageReader::Parse(img_c, "c", ImageReader::Verify::kAll, 2, &cache));
  EXPECT_NE(&rc.tensors(), &ra.tensors());
  EXPECT_EQ(rc.tensors()[3].spec.name, "u3");
  EXPECT_EQ(ra.tensors()[3].spec.name, "t3");  // a reader keeps the entries it was given
  // The same index bytes under a header whose index checksum disagrees: refused.
  auto bad = img_c;
  const uint64_t crc_at = 4092 - 64;  // any header byte: the header CRC catches it first
  bad[crc_at] ^= std::byte{1};
  EXPECT_FALSE(ImageReader::Parse(bad, "bad", ImageReader::Verify::kAll, 2, &cache).ok());
}

// Restore in place from memory: one pass verifies every chunk and copies tensors out, with
// pieces and chunks that cut through tensors; every flipped byte is detected, inside a copied
// tensor or elsewhere.
TEST(ImageTest, VerifyAndCopyOutCopiesTensorsAndDetectsEveryFlip) {
  Owned o;
  o.Add("big", DType::kFloat32, {(1u << 20) + 333}, 1);  // not a multiple of a chunk or piece
  for (int i = 0; i < 20; ++i) o.Add("s" + std::to_string(i), DType::kBFloat16, {77u + i}, i);
  o.Add("tail", DType::kUInt8, {100'001}, 9);
  auto b = ImageBuilder::Create(Meta(), o.sources, "x", 64 << 10);  // 64 KiB chunks
  ASSERT_OK(b);
  auto image = Build(**b);
  auto reader = ImageReader::Parse(image, "img", ImageReader::Verify::kAll);
  ASSERT_OK(reader);
  std::vector<std::vector<std::byte>> out;
  std::vector<ImageCopy> copies;
  for (size_t i : {size_t{0}, size_t{3}, size_t{21}, size_t{7}}) {  // any order, not all
    const TensorEntry& e = reader->tensors()[i];
    out.emplace_back(e.nbytes);
    copies.push_back({e.offset, e.nbytes, out.back().data()});
  }
  ASSERT_OK(VerifyAndCopyOut(image, copies, "img", 3));
  for (size_t k = 0; k < copies.size(); ++k) {
    EXPECT_EQ(std::memcmp(out[k].data(), image.data() + copies[k].offset, copies[k].length), 0);
  }
  const uint64_t chunk = reader->layout().chunk_size;
  for (uint64_t pos : {uint64_t{4099}, copies[0].offset + 3 * chunk + 17, copies[2].offset + 1,
                       reader->layout().checksums_offset - 1}) {
    auto bad = image;
    bad[pos] ^= std::byte{0x08};
    Status s = VerifyAndCopyOut(bad, copies, "img", 2);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << pos;
    EXPECT_NE(s.message().find("chunk " + std::to_string(pos / chunk)), std::string::npos)
        << s.message();
  }
  // A copy outside the image's data is refused.
  std::vector<ImageCopy> outside = {{reader->layout().checksums_offset, 1, out[0].data()}};
  EXPECT_EQ(VerifyAndCopyOut(image, outside, "img", 1).code(), StatusCode::kInvalidArgument);
}

TEST(ImageTest, TensorsHeldElsewhereTakeNoSpaceAndRoundTrip) {
  Owned all, some;
  for (auto* o : {&all, &some}) {
    o->Add("a", DType::kFloat32, {1000, 64}, 1);
    o->Add("b", DType::kBFloat16, {3, 5}, 2, {6, 5}, {3, 0});
    o->Add("c", DType::kInt64, {70000}, 3);
  }
  some.sources[0].spec.elsewhere = true;  // another rank's image holds "a" and "c"
  some.sources[0].data = nullptr;
  some.sources[2].spec.elsewhere = true;
  auto full = ImageBuilder::Create(Meta(), all.sources, "x");
  auto part = ImageBuilder::Create(Meta(), some.sources, "x");
  ASSERT_TRUE(full.ok() && part.ok()) << part.status().ToString();
  EXPECT_LT((*part)->layout().data_size, 4096u);  // only "b"
  auto bytes = Build(**part);
  auto r = ImageReader::Parse(bytes, "part");
  ASSERT_OK(r);
  ASSERT_EQ(r->tensors().size(), 3u);
  EXPECT_TRUE(r->tensors()[0].spec.elsewhere);
  EXPECT_EQ(r->tensors()[0].nbytes, 1000u * 64 * 4);  // still says what the tensor is
  EXPECT_TRUE(r->tensor_data(0).empty());
  EXPECT_FALSE(r->tensors()[1].spec.elsewhere);
  EXPECT_EQ(r->tensors()[1].spec.global_offset, (std::vector<uint64_t>{3, 0}));
  EXPECT_EQ(std::memcmp(r->tensor_data(1).data(), some.data[1].data(), 30), 0);
  EXPECT_TRUE(r->tensors()[2].spec.elsewhere);
}

TEST(ImageTest, BuilderRejectsBadInput) {
  auto make = [](auto mutate) {
    Owned o;
    o.Add("a", DType::kFloat32, {2}, 1);
    o.Add("b", DType::kFloat32, {2}, 1);
    ImageMeta m = Meta();
    mutate(o, m);
    return ImageBuilder::Create(m, o.sources, "").status();
  };
  EXPECT_EQ(make([](Owned& o, ImageMeta&) { o.sources[1].spec.name = "a"; }).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(make([](Owned& o, ImageMeta&) { o.sources[0].spec.name = ""; }).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(make([](Owned& o, ImageMeta&) { o.sources[0].spec.name = "\xff"; }).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(make([](Owned& o, ImageMeta&) { o.sources[0].nbytes = 4; }).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(make([](Owned& o, ImageMeta&) {
              o.sources[0].spec.global_shape = {2};
              o.sources[0].spec.global_offset = {1};
            }).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(make([](Owned&, ImageMeta& m) { m.rank = 4; }).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(make([](Owned&, ImageMeta& m) { m.job = "a/b"; }).code(), StatusCode::kInvalidArgument);
  auto s = make([](Owned& o, ImageMeta&) { o.sources[1].spec.name = "a"; });
  EXPECT_NE(s.message().find("'a'"), std::string::npos) << s.message();
}

class CorruptImageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    o.Add("weight", DType::kFloat32, {64, 64}, 1);
    o.Add("bias", DType::kFloat32, {64}, 2);
    o.Add("step", DType::kInt64, {}, 3);
    auto b = ImageBuilder::Create(Meta(), o.sources, "extras", 4096);
    ASSERT_OK(b);
    builder = std::move(b).value();
    image = Build(*builder);
  }
  Status Parse(const std::vector<std::byte>& img) {
    return ImageReader::Parse(img, "/ckpt/x.img").status();
  }
  // Rewrites the header CRC so that a header change reaches the deeper checks.
  void FixHeaderCrc(std::vector<std::byte>& img) {
    internal::StoreLE<uint32_t>(&img[4092], Crc32c(0, img.data(), 4092));
  }
  Owned o;
  std::unique_ptr<ImageBuilder> builder;
  std::vector<std::byte> image;
};

TEST_F(CorruptImageTest, EveryBitFlipIsDetected) {
  // Flip one bit in every 97th byte of the image (covers header, index, data, extras, padding,
  // checksums): never accepted, always a Corruption naming the file.
  for (size_t i = 0; i < image.size(); i += 97) {
    auto img = image;
    img[i] ^= std::byte{0x10};
    Status s = Parse(img);
    ASSERT_EQ(s.code(), StatusCode::kCorruption) << "byte " << i;
    ASSERT_NE(s.message().find("/ckpt/x.img"), std::string::npos);
  }
}

TEST_F(CorruptImageTest, TruncationsAreDetected) {
  for (size_t n : {size_t{0}, size_t{100}, size_t{4095}, size_t{4096}, image.size() - 4096,
                   image.size() - 1}) {
    std::vector<std::byte> img(image.begin(), image.begin() + n);
    EXPECT_EQ(Parse(img).code(), StatusCode::kCorruption) << n;
  }
  auto longer = image;
  longer.resize(image.size() + 4096);
  EXPECT_EQ(Parse(longer).code(), StatusCode::kCorruption);
}

TEST_F(CorruptImageTest, NamedFailures) {
  auto img = image;
  img[0] = std::byte{'X'};
  EXPECT_NE(Parse(img).message().find("bad magic"), std::string::npos);
  img = image;
  internal::StoreLE<uint32_t>(&img[8], 99);
  FixHeaderCrc(img);
  EXPECT_NE(Parse(img).message().find("unsupported format version 99"), std::string::npos);
  img = image;
  internal::StoreLE<uint64_t>(&img[56], uint64_t{1} << 40);  // absurd tensor count
  FixHeaderCrc(img);
  EXPECT_EQ(Parse(img).code(), StatusCode::kCorruption);
  img = image;
  internal::StoreLE<uint64_t>(&img[80], 0);  // data offset overlapping the header
  FixHeaderCrc(img);
  EXPECT_NE(Parse(img).message().find("inconsistent"), std::string::npos);
  img = image;
  internal::StoreLE<uint64_t>(&img[72], ~uint64_t{0} - 100);  // overflowing size
  FixHeaderCrc(img);
  EXPECT_EQ(Parse(img).code(), StatusCode::kCorruption);
  img = image;
  img[builder->layout().data_offset + 5] ^= std::byte{1};
  Status s = Parse(img);
  EXPECT_NE(s.message().find("chunk"), std::string::npos) << s.message();
}

TEST_F(CorruptImageTest, IndexWithValidCrcButBadContentIsRejected) {
  // Forge index entries with a correct index CRC and header CRC: the structural checks must
  // still reject out-of-bounds and overlapping tensors.
  const auto& l = builder->layout();
  auto forge = [&](auto mutate) {
    auto img = image;
    std::byte* idx = &img[l.index_offset];
    mutate(idx);
    internal::StoreLE<uint32_t>(&img[128], Crc32c(0, idx, l.index_size));
    FixHeaderCrc(img);
    return ImageReader::Parse(img, "forged", ImageReader::Verify::kStructure).status();
  };
  EXPECT_EQ(forge([](std::byte* p) { internal::StoreLE<uint64_t>(p + 16, 1ull << 45); }).code(),
            StatusCode::kCorruption);
  EXPECT_EQ(forge([&](std::byte* p) {
              // Second entry pointing into the first tensor.
              const uint32_t first = internal::LoadLE<uint32_t>(p);
              internal::StoreLE<uint64_t>(p + first + 16, l.data_offset + 64);
            }).code(),
            StatusCode::kCorruption);
  EXPECT_EQ(forge([](std::byte* p) { internal::StoreLE<uint8_t>(p + 4, 200); }).code(),
            StatusCode::kCorruption);
  EXPECT_EQ(forge([](std::byte* p) { internal::StoreLE<uint32_t>(p, 1u << 30); }).code(),
            StatusCode::kCorruption);
  EXPECT_EQ(forge([](std::byte* p) { internal::StoreLE<uint64_t>(p + 32, 1ull << 62); }).code(),
            StatusCode::kCorruption);
  // An entry flagged "elsewhere" (bit 1) that still has a data offset.
  EXPECT_EQ(forge([](std::byte* p) { internal::StoreLE<uint8_t>(p + 6, 2); }).code(),
            StatusCode::kCorruption);
  EXPECT_EQ(forge([](std::byte* p) { internal::StoreLE<uint8_t>(p + 6, 4); }).code(),
            StatusCode::kCorruption);
}

TEST_F(CorruptImageTest, RandomGarbageNeverCrashes) {
  std::mt19937_64 rng(42);
  for (int i = 0; i < 2000; ++i) {
    auto img = image;
    const int flips = 1 + rng() % 8;
    for (int f = 0; f < flips; ++f) img[rng() % img.size()] = std::byte(rng());
    if (rng() % 4 == 0) img.resize(rng() % img.size());
    Status s = Parse(img);
    if (s.ok()) {
      ASSERT_EQ(img, image);  // only an unchanged image may pass
    } else {
      ASSERT_EQ(s.code(), StatusCode::kCorruption);
    }
  }
}

// Lineage (docs/format.md, "Lineage"): in the header, so it travels with the image.
TEST(ImageLineageTest, RoundTripsThroughTheHeader) {
  Owned o;
  o.Add("w", DType::kFloat32, {16}, 3);
  ImageMeta meta = Meta();
  meta.lineage.has_parent = true;
  meta.lineage.parent_step = 0;  // step 0 is a parent like any other
  meta.lineage.parent_location = "s3://bucket/runs/base?region=x";
  meta.lineage.metadata = R"({"git":"0123abc","config_hash":"ü"})";
  ASSERT_OK_AND_ASSIGN(auto b, ImageBuilder::Create(meta, o.sources, ""));
  auto image = Build(*b);
  ASSERT_OK_AND_ASSIGN(auto r, ImageReader::Parse(image, "img"));
  EXPECT_EQ(r.meta().lineage, meta.lineage);
  EXPECT_EQ(r.meta().attempt, meta.attempt);

  // Only metadata, no parent (a fresh run with metadata); and the largest sizes.
  meta.lineage = {};
  meta.lineage.metadata = "{\"k\":\"" + std::string(kMaxLineageMetadataLength - 8, 'x') + "\"}";
  meta.lineage.has_parent = true;
  meta.lineage.parent_step = ~uint64_t{0};
  meta.lineage.parent_location = std::string(kMaxParentLocationLength, 'p');
  ASSERT_OK_AND_ASSIGN(b, ImageBuilder::Create(meta, o.sources, ""));
  image = Build(*b);
  ASSERT_OK_AND_ASSIGN(r, ImageReader::Parse(image, "img"));
  EXPECT_EQ(r.meta().lineage, meta.lineage);
}

// A fresh run without metadata writes the header that builds before lineage wrote (every byte
// after the attempt zero), so readers that predate lineage read it; with a lineage those readers
// reject the image (unknown flag, non-zero reserved bytes) rather than misread it.
TEST(ImageLineageTest, AFreshRunsHeaderIsTheOldHeader) {
  Owned o;
  o.Add("w", DType::kFloat32, {16}, 3);
  ASSERT_OK_AND_ASSIGN(auto b, ImageBuilder::Create(Meta(), o.sources, ""));
  auto image = Build(*b);
  EXPECT_EQ(internal::LoadLE<uint32_t>(&image[140]), 0u);
  for (size_t i = 224; i < kImageHeaderSize - 4; ++i) ASSERT_EQ(image[i], std::byte{0}) << i;
  ASSERT_OK_AND_ASSIGN(auto r, ImageReader::Parse(image, "img"));
  EXPECT_EQ(r.meta().lineage, Lineage{});
}

TEST(ImageLineageTest, BadLineageIsRefusedAndCorruptLineageDetected) {
  Owned o;
  o.Add("w", DType::kFloat32, {16}, 3);
  auto create = [&](Lineage l) {
    ImageMeta m = Meta();
    m.lineage = std::move(l);
    return ImageBuilder::Create(m, o.sources, "").status();
  };
  EXPECT_EQ(create({true, 1, std::string(kMaxParentLocationLength + 1, 'p'), ""}).code(),
            StatusCode::kInvalidArgument);
  Status s =
      create({false, 0, "", "{\"k\":\"" + std::string(kMaxLineageMetadataLength, 'x') + "\"}"});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("metadata"), std::string::npos) << s.ToString();
  EXPECT_EQ(create({false, 0, "", "[1, 2]"}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(create({false, 0, "", "{\"k\":\"\xff\"}"}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(create({false, 5, "", ""}).code(), StatusCode::kInvalidArgument);

  ImageMeta m = Meta();
  m.lineage = {true, 9, "/runs/base", R"({"a":"b"})"};
  ASSERT_OK_AND_ASSIGN(auto b, ImageBuilder::Create(m, o.sources, ""));
  const auto good = Build(*b);
  auto reseal = [](std::vector<std::byte>& img) {
    internal::StoreLE<uint32_t>(&img[kImageHeaderSize - 4],
                                Crc32c(0, img.data(), kImageHeaderSize - 4));
  };
  auto expect_corrupt = [&](const std::function<void(std::vector<std::byte>&)>& edit) {
    auto img = good;
    edit(img);
    reseal(img);
    auto r = ImageReader::Parse(img, "img");
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
  };
  expect_corrupt([](auto& img) { internal::StoreLE<uint16_t>(&img[512], 1025); });
  expect_corrupt([](auto& img) { internal::StoreLE<uint16_t>(&img[514], 2049); });
  expect_corrupt([](auto& img) { internal::StoreLE<uint16_t>(&img[512], 3); });  // cut short
  expect_corrupt([](auto& img) { img[528 + 1000] = std::byte{1}; });  // past the location
  expect_corrupt([](auto& img) { img[3600] = std::byte{1}; });        // after the lineage
  expect_corrupt([](auto& img) { img[300] = std::byte{1}; });         // reserved
  expect_corrupt([](auto& img) {  // a parent step without the flag
    internal::StoreLE<uint32_t>(&img[140], 0);
    internal::StoreLE<uint16_t>(&img[512], 0);
    std::memset(&img[528], 0, 10);
  });
  expect_corrupt([](auto& img) { internal::StoreLE<uint32_t>(&img[140], 4); });  // unknown flag
}

}  // namespace
}  // namespace safepoint::image_test
