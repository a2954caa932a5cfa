#include "checkpoint/versions.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include "base/bytes.h"
#include "safepoint/extras.h"
#include "testing/test_util.h"

namespace safepoint::versions_test {
namespace {

std::shared_ptr<CheckpointStore> MemoryStore() {
  return std::make_shared<CheckpointStore>(std::shared_ptr<Storage>(NewMemoryStorage()));
}

// Saves `step` of one rank with the given tensors (name, dtype, shape, bytes), whole.
struct Tensor {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  std::vector<std::byte> bytes;
  std::vector<uint64_t> global_shape = {}, global_offset = {};
};

Status SaveStep(CheckpointStore& store, uint64_t step, const std::vector<Tensor>& tensors,
                uint32_t rank = 0, uint32_t world = 1) {
  std::vector<TensorSource> sources;
  for (const Tensor& t : tensors) {
    sources.push_back({{t.name, t.dtype, t.shape, t.global_shape, t.global_offset},
                       t.bytes.data(),
                       t.bytes.size()});
  }
  return SaveShard(store, test::TestImageMeta("ver", step, rank, world), sources,
                   *EncodeExtras(Value()))
      .status();
}

std::vector<std::byte> Floats(const std::vector<float>& v) {
  std::vector<std::byte> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::vector<float> Iota(size_t n, float start = 0) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(TagTest, WriteReadListDeleteAndResolve) {
  auto store = MemoryStore();
  ASSERT_OK(SaveStep(*store, 10, {{"w", DType::kFloat32, {4}, Floats(Iota(4))}}));
  ASSERT_OK(SaveStep(*store, 20, {{"w", DType::kFloat32, {4}, Floats(Iota(4, 1))}}));
  ASSERT_OK(WriteTag(*store, {"pretrained", 10, 0}, false));
  ASSERT_OK(WriteTag(*store, {"v1.0_best-x", 20, 0}, false));
  ASSERT_OK(WriteTag(*store, {"pretrained", 10, 0}, false));  // the same again: fine
  ASSERT_OK_AND_ASSIGN(Tag t, ReadTag(*store, "pretrained"));
  EXPECT_EQ(t.step, 10u);
  EXPECT_GT(t.create_time_ns, 0);
  ASSERT_OK_AND_ASSIGN(auto tags, ListTags(*store));
  ASSERT_EQ(tags.size(), 2u);
  EXPECT_EQ(tags[0].name, "pretrained");
  EXPECT_EQ(tags[1].name, "v1.0_best-x");
  ASSERT_OK_AND_ASSIGN(auto tagged, TaggedSteps(*store));
  EXPECT_EQ(tagged, (std::set<uint64_t>{10, 20}));

  EXPECT_EQ(*ResolveStep(*store, "pretrained"), 10u);
  EXPECT_EQ(*ResolveStep(*store, "20"), 20u);
  EXPECT_EQ(*ResolveStep(*store, "step-10"), 10u);
  auto missing = ResolveStep(*store, "15");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("committed steps: 10 20"), std::string::npos)
      << missing.status().ToString();
  auto unknown = ResolveStep(*store, "nope");
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("no tag 'nope' (tags: pretrained v1.0_best-x)"),
            std::string::npos)
      << unknown.status().ToString();
  EXPECT_EQ(ResolveStep(*store, "bad/name").status().code(), StatusCode::kInvalidArgument);

  // Moving a tag needs `replace`.
  Status s = WriteTag(*store, {"pretrained", 20, 0}, false);
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists) << s.ToString();
  EXPECT_NE(s.message().find("already names step 10"), std::string::npos) << s.ToString();
  ASSERT_OK(WriteTag(*store, {"pretrained", 20, 0}, true));
  EXPECT_EQ(*ResolveStep(*store, "pretrained"), 20u);

  // Only committed steps can be tagged.
  s = WriteTag(*store, {"later", 30, 0}, false);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("step 30"), std::string::npos) << s.ToString();

  ASSERT_OK(DeleteTag(*store, "pretrained"));
  EXPECT_EQ(ReadTag(*store, "pretrained").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(DeleteTag(*store, "pretrained").code(), StatusCode::kNotFound);

  // A tag whose step was deleted names nothing.
  ASSERT_OK(store->DeleteStep(20));
  EXPECT_EQ(ResolveStep(*store, "v1.0_best-x").status().code(), StatusCode::kNotFound);
}

// Tags travel with copies of their steps (tier copies, safepoint cp), so that a tier keeps a
// tagged step also when the location above it is lost.
TEST(TagTest, MirrorCopiesTagsOfStepsTheDestinationHoldsAndDeletesNone) {
  auto from = MemoryStore();
  auto to = MemoryStore();
  for (uint64_t step : {1, 2, 3}) {
    ASSERT_OK(SaveStep(*from, step, {{"w", DType::kFloat32, {4}, Floats(Iota(4, step))}}));
  }
  for (uint64_t step : {1, 2}) {
    ASSERT_OK(SaveStep(*to, step, {{"w", DType::kFloat32, {4}, Floats(Iota(4, step))}}));
  }
  ASSERT_OK(WriteTag(*from, {"base", 1, 111}, false));
  ASSERT_OK(WriteTag(*from, {"best", 3, 0}, false));  // step 3 is not in `to` (yet)
  ASSERT_OK(WriteTag(*to, {"mine", 2, 0}, false));    // the destination's own
  ASSERT_OK_AND_ASSIGN(auto written, MirrorTags(*from, *to));
  EXPECT_EQ(written, (std::vector<std::string>{"base"}));
  ASSERT_OK_AND_ASSIGN(Tag base, ReadTag(*to, "base"));
  EXPECT_EQ(base.step, 1u);
  EXPECT_EQ(base.create_time_ns, 111);  // the tag as it was made, not a new one
  EXPECT_EQ(ReadTag(*to, "best").status().code(), StatusCode::kNotFound);

  // Step 3 arrives; "base" moved to step 2 above; "mine" and nothing else stays.
  ASSERT_OK(SaveStep(*to, 3, {{"w", DType::kFloat32, {4}, Floats(Iota(4, 3))}}));
  ASSERT_OK(WriteTag(*from, {"base", 2, 0}, true));
  ASSERT_OK_AND_ASSIGN(written, MirrorTags(*from, *to));
  EXPECT_EQ(written, (std::vector<std::string>{"base", "best"}));
  ASSERT_OK_AND_ASSIGN(auto tags, ListTags(*to));
  std::vector<std::pair<std::string, uint64_t>> got;
  for (const Tag& t : tags) got.emplace_back(t.name, t.step);
  EXPECT_EQ(got,
            (std::vector<std::pair<std::string, uint64_t>>{{"base", 2}, {"best", 3}, {"mine", 2}}));
  ASSERT_OK_AND_ASSIGN(written, MirrorTags(*from, *to));  // nothing left to do
  EXPECT_TRUE(written.empty());

  // The location above lost its tags (a replaced disk): the copies stay.
  ASSERT_OK(DeleteTag(*from, "base"));
  ASSERT_OK(DeleteTag(*from, "best"));
  ASSERT_OK(MirrorTags(*from, *to).status());
  ASSERT_OK_AND_ASSIGN(tags, ListTags(*to));
  EXPECT_EQ(tags.size(), 3u);
}

// A damaged tag of the source is skipped (the others still travel); a damaged tag of the
// destination that the source has is replaced by the source's, which protects the step again.
TEST(TagTest, MirrorSkipsDamagedSourceTagsAndRepairsDamagedCopies) {
  auto from = MemoryStore();
  auto to = MemoryStore();
  for (auto* store : {from.get(), to.get()}) {
    ASSERT_OK(SaveStep(*store, 1, {{"w", DType::kFloat32, {1}, Floats({1})}}));
  }
  const std::string junk = "abc";
  auto put = [&](CheckpointStore& store, const std::string& name) {
    return test::PutObject(store.storage(), name,
                           {reinterpret_cast<const std::byte*>(junk.data()), junk.size()});
  };
  ASSERT_OK(put(*from, "tags/broken"));
  ASSERT_OK(WriteTag(*from, {"base", 1, 5}, false));
  ASSERT_OK(put(*to, "tags/base"));
  EXPECT_EQ(TaggedSteps(*to).status().code(), StatusCode::kCorruption);
  ASSERT_OK_AND_ASSIGN(auto written, MirrorTags(*from, *to));
  EXPECT_EQ(written, (std::vector<std::string>{"base"}));
  ASSERT_OK_AND_ASSIGN(auto tagged, TaggedSteps(*to));
  EXPECT_EQ(tagged, (std::set<uint64_t>{1}));
  EXPECT_EQ(ReadTag(*to, "broken").status().code(), StatusCode::kNotFound);
}

TEST(TagTest, BadNamesAreRefused) {
  for (const char* bad :
       {"", ".hidden", "-x", "a/b", "a b", "123", "step-5", "x.tmp.y", "ü", "a@b"}) {
    EXPECT_EQ(ValidateTagName(bad).code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ValidateTagName(std::string(kMaxTagNameLength + 1, 'a')).code(),
            StatusCode::kInvalidArgument);
  for (const char* good : {"a", "step-x", "v1", "1a", "best_2026-12-01", "x.y"}) {
    EXPECT_OK(ValidateTagName(good));
  }
  auto store = MemoryStore();
  ASSERT_OK(SaveStep(*store, 1, {{"w", DType::kFloat32, {1}, Floats({1})}}));
  EXPECT_EQ(WriteTag(*store, {"../x", 1, 0}, false).code(), StatusCode::kInvalidArgument);
}

TEST(TagTest, CorruptTagsAreDetected) {
  const std::string good = EncodeTag({"t", 5, 7});
  auto bytes = [](const std::string& s) {
    return std::span<const std::byte>(reinterpret_cast<const std::byte*>(s.data()), s.size());
  };
  ASSERT_OK_AND_ASSIGN(Tag t, DecodeTag(bytes(good), "x"));
  EXPECT_EQ(t.step, 5u);
  for (size_t i = 0; i < good.size() * 8; ++i) {
    std::string bad = good;
    bad[i / 8] = static_cast<char>(bad[i / 8] ^ (1 << (i % 8)));
    EXPECT_FALSE(DecodeTag(bytes(bad), "x").ok()) << i;
  }
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_FALSE(DecodeTag(bytes(good.substr(0, n)), "x").ok()) << n;
  }
  // A damaged tag object stops retention (it might name any step) and is reported by a list.
  auto store = MemoryStore();
  ASSERT_OK(SaveStep(*store, 1, {{"w", DType::kFloat32, {1}, Floats({1})}}));
  ASSERT_OK_AND_ASSIGN(auto w, store->storage().Create("tags/broken", 3));
  ASSERT_OK(w->WriteAt(0, bytes("abc")));
  ASSERT_OK(w->Publish());
  EXPECT_EQ(TaggedSteps(*store).status().code(), StatusCode::kCorruption);
  std::vector<std::string> problems;
  ASSERT_OK_AND_ASSIGN(auto tags, ListTags(*store, &problems));
  EXPECT_TRUE(tags.empty());
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("tags/broken"), std::string::npos) << problems[0];
}

TEST(StepHeaderTest, ReadsTheLineageOfAStep) {
  auto store = MemoryStore();
  std::vector<std::byte> w = Floats({1, 2});
  std::vector<TensorSource> sources = {{{"w", DType::kFloat32, {2}, {}, {}}, w.data(), 8}};
  ImageMeta meta = test::TestImageMeta("ver", 3, 0, 1);
  meta.lineage = {true, 2, "file:///runs/base", R"({"git":"abc"})"};
  ASSERT_OK(SaveShard(*store, meta, sources, *EncodeExtras(Value())).status());
  ASSERT_OK_AND_ASSIGN(auto commit, store->ReadCommit(3));
  ASSERT_OK_AND_ASSIGN(ImageMeta got, ReadStepHeader(*store, commit));
  EXPECT_EQ(got.lineage, meta.lineage);
}

const TensorDiff& Find(const std::vector<TensorDiff>& diffs, const std::string& name) {
  for (const auto& d : diffs) {
    if (d.name == name) return d;
  }
  ADD_FAILURE() << "no diff for " << name;
  static TensorDiff none;
  return none;
}

TEST(DiffTest, SaysWhichTensorsChangedAndByHowMuch) {
  auto store = MemoryStore();
  std::vector<float> a = Iota(3000), b = a;
  b[7] += 0.5f;
  b[2999] -= 2.0f;
  std::vector<uint16_t> h = {0x3f80, 0x4000, 0x7fc0};   // bf16 1, 2, NaN
  std::vector<uint16_t> h2 = {0x3f80, 0x4040, 0x7fc0};  // 1, 3, the same NaN
  auto bf16 = [](const std::vector<uint16_t>& v) {
    std::vector<std::byte> out(v.size() * 2);
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  };
  std::vector<int64_t> i1 = {5, -3}, i2 = {5, 4};
  std::vector<std::byte> ib1(16), ib2(16);
  std::memcpy(ib1.data(), i1.data(), 16);
  std::memcpy(ib2.data(), i2.data(), 16);
  ASSERT_OK(SaveStep(*store, 1,
                     {{"f", DType::kFloat32, {30, 100}, Floats(a)},
                      {"h", DType::kBFloat16, {3}, bf16(h)},
                      {"i", DType::kInt64, {2}, ib1},
                      {"same", DType::kFloat32, {2}, Floats({1, 2})},
                      {"gone", DType::kFloat32, {1}, Floats({1})},
                      {"shape", DType::kFloat32, {2}, Floats({1, 2})},
                      {"nan", DType::kFloat32, {1}, Floats({1})}}));
  ASSERT_OK(SaveStep(*store, 2,
                     {{"f", DType::kFloat32, {30, 100}, Floats(b)},
                      {"h", DType::kBFloat16, {3}, bf16(h2)},
                      {"i", DType::kInt64, {2}, ib2},
                      {"same", DType::kFloat32, {2}, Floats({1, 2})},
                      {"new", DType::kFloat32, {1}, Floats({1})},
                      {"shape", DType::kFloat32, {1, 2}, Floats({1, 2})},
                      {"nan", DType::kFloat32, {1}, Floats({std::nanf("")})}}));
  DiffOptions opt;
  opt.window_bytes = 4096;  // many windows
  uint64_t last_done = 0, last_total = 0;
  opt.progress = [&](uint64_t done, uint64_t total) { last_done = done, last_total = total; };
  ASSERT_OK_AND_ASSIGN(auto diffs, DiffSteps(*store, 1, *store, 2, opt));
  ASSERT_EQ(diffs.size(), 8u);
  const TensorDiff& f = Find(diffs, "f");
  EXPECT_EQ(f.kind, TensorDiff::Kind::kChanged);
  EXPECT_EQ(f.elements, 3000u);
  EXPECT_EQ(f.changed, 2u);
  EXPECT_DOUBLE_EQ(*f.max_abs, 2.0);
  const TensorDiff& hd = Find(diffs, "h");
  EXPECT_EQ(hd.changed, 1u);
  EXPECT_DOUBLE_EQ(*hd.max_abs, 1.0);
  EXPECT_DOUBLE_EQ(*Find(diffs, "i").max_abs, 7.0);
  EXPECT_EQ(Find(diffs, "same").kind, TensorDiff::Kind::kSame);
  EXPECT_EQ(Find(diffs, "same").changed, 0u);
  EXPECT_EQ(Find(diffs, "gone").kind, TensorDiff::Kind::kRemoved);
  EXPECT_EQ(Find(diffs, "new").kind, TensorDiff::Kind::kAdded);
  EXPECT_EQ(Find(diffs, "shape").kind, TensorDiff::Kind::kReshaped);
  EXPECT_TRUE(std::isinf(*Find(diffs, "nan").max_abs));
  EXPECT_EQ(last_done, last_total);
  EXPECT_GT(last_total, 12000u);
}

// A step saved by two ranks (rows split) against one saved by three ranks (columns split): the
// shards are matched by their boxes in the global tensor.
TEST(DiffTest, ComparesStepsOfDifferentWorldSizes) {
  auto store = MemoryStore();
  constexpr uint64_t kRows = 6, kCols = 10;
  std::vector<float> full = Iota(kRows * kCols);
  auto box = [&](const std::vector<float>& src, uint64_t r0, uint64_t r1, uint64_t c0,
                 uint64_t c1) {
    std::vector<float> out;
    for (uint64_t r = r0; r < r1; ++r) {
      for (uint64_t c = c0; c < c1; ++c) out.push_back(src[r * kCols + c]);
    }
    return Floats(out);
  };
  for (uint32_t rank = 0; rank < 2; ++rank) {
    ASSERT_OK(SaveStep(*store, 1,
                       {{"w",
                         DType::kFloat32,
                         {3, kCols},
                         box(full, 3 * rank, 3 * rank + 3, 0, kCols),
                         {kRows, kCols},
                         {3 * rank, 0}}},
                       rank, 2));
  }
  std::vector<float> changed = full;
  changed[4 * kCols + 7] += 3;  // row 4, column 7
  const uint64_t cuts[] = {0, 3, 4, 10};
  for (uint32_t rank = 0; rank < 3; ++rank) {
    const uint64_t c0 = cuts[rank], c1 = cuts[rank + 1];
    ASSERT_OK(SaveStep(*store, 2,
                       {{"w",
                         DType::kFloat32,
                         {kRows, c1 - c0},
                         box(changed, 0, kRows, c0, c1),
                         {kRows, kCols},
                         {0, c0}}},
                       rank, 3));
  }
  ASSERT_OK_AND_ASSIGN(auto diffs, DiffSteps(*store, 1, *store, 2));
  ASSERT_EQ(diffs.size(), 1u);
  EXPECT_EQ(diffs[0].kind, TensorDiff::Kind::kChanged);
  EXPECT_EQ(diffs[0].elements, kRows * kCols);
  EXPECT_EQ(diffs[0].changed, 1u);
  EXPECT_DOUBLE_EQ(*diffs[0].max_abs, 3.0);
  ASSERT_OK_AND_ASSIGN(diffs, DiffSteps(*store, 2, *store, 2));
  EXPECT_EQ(diffs[0].kind, TensorDiff::Kind::kSame);
}

TEST(DiffTest, DamagedDataIsAnErrorNotADiff) {
  test::TempDir dir;
  ASSERT_OK_AND_ASSIGN(auto store, OpenCheckpointStore(dir.path()));
  ASSERT_OK(SaveStep(*store, 1, {{"w", DType::kFloat32, {1000}, Floats(Iota(1000))}}));
  ASSERT_OK(SaveStep(*store, 2, {{"w", DType::kFloat32, {1000}, Floats(Iota(1000, 1))}}));
  ASSERT_OK_AND_ASSIGN(auto md, store->ReadMetadata(*store->ReadCommit(2), 0));
  const std::string file = dir.path() + "/" + ImageObjectName(2, 0);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(md.tensors[0].offset + 100));
    f.put('\x55');
  }
  auto diffs = DiffSteps(*store, 1, *store, 2);
  EXPECT_EQ(diffs.status().code(), StatusCode::kCorruption) << diffs.status().ToString();
}

}  // namespace
}  // namespace safepoint::versions_test
