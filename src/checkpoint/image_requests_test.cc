// How an image's bytes move between memory and storage: requests of the storage's preferred
// shape, range reads that land in their destination, writes sent from the tensors' own bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/store_test_shard.h"
#include "safepoint/checkpoint.h"
#include "testing/test_util.h"

namespace safepoint::image_requests_test {
namespace {

using namespace store_test;  // NOLINT(build/namespaces)

// A counting wrapper: how many bytes were read, to show that range reads read only what they need.
class CountingStorage : public test::ForwardingStorage {
 public:
  using ForwardingStorage::ForwardingStorage;
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    SP_ASSIGN_OR_RETURN(auto obj, inner_->Open(name));
    return std::unique_ptr<ReadableObject>(new Counted(std::move(obj), &bytes_read));
  }
  std::atomic<uint64_t> bytes_read{0};

 private:
  struct Counted : ReadableObject {
    Counted(std::unique_ptr<ReadableObject> o, std::atomic<uint64_t>* n)
        : obj(std::move(o)), count(n) {}
    uint64_t size() const override { return obj->size(); }
    Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
      *count += dst.size();
      return obj->ReadAt(offset, dst);
    }
    std::unique_ptr<ReadableObject> obj;
    std::atomic<uint64_t>* count;
  };
};

// Records where each read of an object landed in memory.
class LandingStorage : public test::ForwardingStorage {
 public:
  using ForwardingStorage::ForwardingStorage;
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    SP_ASSIGN_OR_RETURN(auto obj, inner_->Open(name));
    return std::unique_ptr<ReadableObject>(new Recorded(std::move(obj), this));
  }
  std::vector<std::pair<uint64_t, const std::byte*>> Landings() {
    std::lock_guard<std::mutex> lock(mu_);
    return landings_;
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    landings_.clear();
  }

 private:
  struct Recorded : ReadableObject {
    Recorded(std::unique_ptr<ReadableObject> o, LandingStorage* s) : obj(std::move(o)), owner(s) {}
    uint64_t size() const override { return obj->size(); }
    Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
      {
        std::lock_guard<std::mutex> lock(owner->mu_);
        owner->landings_.emplace_back(offset, dst.data());
      }
      return obj->ReadAt(offset, dst);
    }
    std::unique_ptr<ReadableObject> obj;
    LandingStorage* owner;
  };
  std::mutex mu_;
  std::vector<std::pair<uint64_t, const std::byte*>> landings_;
};

// A restore reads whole chunks of a tensor straight into the target (memory already faulted
// in), with no staging copy, and still verifies each of them; partial chunks at the ends are
// staged. A flipped byte in a chunk read in place is an error naming the chunk.
TEST(CheckpointStoreTest, RangeReadsLandWholeChunksInTheirDestination) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  auto landing = std::make_shared<LandingStorage>(mem);
  CheckpointStore store(landing);
  // "big" has 3 Mi + 1234 floats: it starts inside chunk 0 and ends inside chunk 3, so chunks
  // 1 and 2 lie wholly inside it and the ends are partial.
  const size_t elems = (3 << 20) + 1234;
  {
    Shard s(5, 0, elems);
    ASSERT_OK(SaveShard(store, Meta(5, 0, 1), s.sources, s.extras).status());
  }
  Shard want(5, 0, elems);
  auto commit = store.ReadCommit(5);
  ASSERT_OK(commit);
  auto md = store.ReadMetadata(*commit, 0);
  ASSERT_OK(md);
  const TensorEntry& big = md->tensors[0];
  const uint64_t chunk = md->layout.chunk_size;
  ASSERT_LT(big.offset, chunk);
  ASSERT_GT(big.offset + big.nbytes, 3 * chunk);
  std::vector<float> dst(elems);
  auto* d = reinterpret_cast<std::byte*>(dst.data());
  std::vector<CheckpointStore::Range> ranges = {{big.offset, big.nbytes, d}};
  landing->Clear();
  ASSERT_OK(store.ReadRanges(*md, ranges));
  EXPECT_EQ(std::memcmp(dst.data(), want.big.data(), big.nbytes), 0);
  std::set<uint64_t> in_place;
  for (auto [offset, where] : landing->Landings()) {
    if (where >= d && where < d + big.nbytes) {
      EXPECT_EQ(where, d + (offset - big.offset));
      in_place.insert(offset);
    }
  }
  EXPECT_EQ(in_place, (std::set<uint64_t>{chunk, 2 * chunk}));

  // Corrupt chunk 2 (read in place): the read fails and names it.
  auto obj = mem->Open(ImageObjectName(5, 0));
  std::vector<std::byte> bytes((*obj)->size());
  ASSERT_OK((*obj)->ReadAt(0, bytes));
  bytes[2 * chunk + 4096] ^= std::byte{0x10};
  auto w = mem->Create(ImageObjectName(5, 0), bytes.size());
  ASSERT_OK((*w)->WriteAt(0, bytes));
  ASSERT_OK((*w)->Publish());
  Status s = store.ReadRanges(*md, ranges);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("chunk 2"), std::string::npos) << s.message();
}

TEST(CheckpointStoreTest, RangeReadsReadOnlyTheirChunksAndVerifyThem) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  auto counting = std::make_shared<CountingStorage>(mem);
  CheckpointStore store(counting);
  ASSERT_OK(Save(store, 3));  // "big": 12 MiB of float32, three 4 MiB chunks and more
  auto commit = store.ReadCommit(3);
  ASSERT_OK(commit);
  auto md = store.ReadMetadata(*commit, 0);
  ASSERT_OK(md);
  ASSERT_EQ(md->chunk_crcs.size(), md->layout.chunk_count());
  const TensorEntry& big = md->tensors[0];
  Shard want(3, 0);

  // Elements [1'000'000, 1'100'000) straddle the boundary of two chunks; one more range sits in
  // the same chunk; a third is the small tensor.
  std::vector<float> a(100'000), b(10), c(17);
  std::vector<CheckpointStore::Range> ranges = {
      {big.offset + 4'000'000, a.size() * 4, reinterpret_cast<std::byte*>(a.data())},
      {big.offset + 4'000'000 + 40, b.size() * 4, reinterpret_cast<std::byte*>(b.data())},
      {md->tensors[1].offset, 68, reinterpret_cast<std::byte*>(c.data())}};
  counting->bytes_read = 0;
  ASSERT_OK(store.ReadRanges(*md, ranges));
  EXPECT_EQ(std::memcmp(a.data(), want.big.data() + 1'000'000, a.size() * 4), 0);
  EXPECT_EQ(std::memcmp(b.data(), want.big.data() + 1'000'010, b.size() * 4), 0);
  EXPECT_EQ(std::memcmp(c.data(), want.small.data(), 68), 0);
  // At most the chunks that cover the ranges were read: 2 for the big ranges, 1 for the small.
  EXPECT_LE(counting->bytes_read.load(), 3 * md->layout.chunk_size);
  // Chunk 2 (inside "big", touched by no range) was not read.
  EXPECT_LE(counting->bytes_read.load(), md->layout.image_size - md->layout.chunk_size);

  // A range outside the image's data is refused.
  std::vector<CheckpointStore::Range> bad = {
      {md->layout.checksums_offset - 4, 8, reinterpret_cast<std::byte*>(c.data())}};
  EXPECT_EQ(store.ReadRanges(*md, bad).code(), StatusCode::kInvalidArgument);

  // One flipped byte in the second chunk: ranges touching that chunk fail, naming it; a range
  // elsewhere still reads.
  auto obj = mem->Open(ImageObjectName(3, 0));
  std::vector<std::byte> bytes((*obj)->size());
  ASSERT_OK((*obj)->ReadAt(0, bytes));
  bytes[md->layout.chunk_size + 100] ^= std::byte{0x01};
  auto w = mem->Create(ImageObjectName(3, 0), bytes.size());
  ASSERT_OK((*w)->WriteAt(0, bytes));
  ASSERT_OK((*w)->Publish());
  Status s = store.ReadRanges(*md, ranges);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_NE(s.message().find("chunk 1"), std::string::npos) << s.message();
  std::vector<CheckpointStore::Range> small_only = {ranges[2]};
  EXPECT_OK(store.ReadRanges(*md, small_only));
}

// Announces a preferred request shape (as object stores do) and records the requests it gets.
class ShapedStorage : public test::ForwardingStorage {
 public:
  struct Request {
    std::string name;
    uint64_t offset, size;
    const std::byte* data = nullptr;  // where a write's bytes came from
    bool operator<(const Request& o) const { return offset < o.offset; }
  };
  // `direct_io`: what capabilities() says of O_DIRECT (the inner storage's when unset).
  ShapedStorage(std::shared_ptr<Storage> inner, uint64_t io_size, size_t parallelism,
                std::optional<bool> direct_io = std::nullopt)
      : ForwardingStorage(std::move(inner)),
        io_size_(io_size),
        parallelism_(parallelism),
        direct_io_(direct_io) {}
  StorageCapabilities capabilities() const override {
    StorageCapabilities caps = inner_->capabilities();
    caps.preferred_io_size = io_size_;
    caps.io_parallelism = parallelism_;
    if (direct_io_) caps.direct_io = *direct_io_;
    return caps;
  }
  Result<std::unique_ptr<WritableObject>> Create(std::string_view n, uint64_t size) override {
    SP_ASSIGN_OR_RETURN(auto obj, inner_->Create(n, size));
    return std::unique_ptr<WritableObject>(new Writer(std::move(obj), this, std::string(n)));
  }
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    SP_ASSIGN_OR_RETURN(auto obj, inner_->Open(name));
    return std::unique_ptr<ReadableObject>(new Reader(std::move(obj), this, std::string(name)));
  }

  // The requests to object `name` since the last call (of any object), sorted by offset.
  std::vector<Request> TakeReads(const std::string& name) { return Take(reads_, name); }
  std::vector<Request> TakeWrites(const std::string& name) { return Take(writes_, name); }

 private:
  std::vector<Request> Take(std::vector<Request>& v, const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Request> out;
    for (auto& r : v) {
      if (r.name == name) out.push_back(std::move(r));
    }
    v.clear();
    std::sort(out.begin(), out.end());
    return out;
  }
  void Record(std::vector<Request>& v, const std::string& name, uint64_t offset, uint64_t size,
              const std::byte* data = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    v.push_back({name, offset, size, data});
  }
  struct Reader : ReadableObject {
    Reader(std::unique_ptr<ReadableObject> o, ShapedStorage* s, std::string n)
        : obj(std::move(o)), st(s), name(std::move(n)) {}
    uint64_t size() const override { return obj->size(); }
    Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override {
      st->Record(st->reads_, name, offset, dst.size());
      return obj->ReadAt(offset, dst);
    }
    std::unique_ptr<ReadableObject> obj;
    ShapedStorage* st;
    std::string name;
  };
  struct Writer : WritableObject {
    Writer(std::unique_ptr<WritableObject> o, ShapedStorage* s, std::string n)
        : obj(std::move(o)), st(s), name(std::move(n)) {}
    Status WriteAt(uint64_t offset, std::span<const std::byte> data) override {
      st->Record(st->writes_, name, offset, data.size(), data.data());
      return obj->WriteAt(offset, data);
    }
    Status Publish() override { return obj->Publish(); }
    Status PublishIfAbsent() override { return obj->PublishIfAbsent(); }
    void Abort() override { obj->Abort(); }
    std::unique_ptr<WritableObject> obj;
    ShapedStorage* st;
    std::string name;
  };
  const uint64_t io_size_;
  const size_t parallelism_;
  const std::optional<bool> direct_io_;
  std::mutex mu_;
  std::vector<Request> reads_, writes_;
};

TEST(CheckpointStoreTest, ImagesMoveInTheStoragesPreferredRequestsAndEveryChunkIsVerified) {
  auto mem = std::shared_ptr<Storage>(NewMemoryStorage());
  // Three chunks per request; the image (four chunks, the last one short) does not end on a
  // request boundary.
  auto shaped = std::make_shared<ShapedStorage>(mem, 3 * kDefaultChunkSize, 2);
  CheckpointStore store(shaped);
  ASSERT_OK(Save(store, 1));
  auto commit = store.ReadCommit(1);
  ASSERT_OK(commit);
  auto md = store.ReadMetadata(*commit, 0);
  ASSERT_OK(md);
  const ImageLayout& l = md->layout;
  ASSERT_EQ(l.chunk_size, kDefaultChunkSize);
  ASSERT_EQ(l.chunk_count(), 4u);
  const uint64_t span = 3 * l.chunk_size;
  ASSERT_NE(l.checksums_offset % span, 0u);

  // Written as two data requests (three chunks, then the short rest) and the checksum section.
  const std::string image = ImageObjectName(1, 0);
  std::vector<ShapedStorage::Request> writes = shaped->TakeWrites(image);
  ASSERT_EQ(writes.size(), 3u);
  EXPECT_EQ(writes[0].offset, 0u);
  EXPECT_EQ(writes[0].size, span);
  EXPECT_EQ(writes[1].offset, span);
  EXPECT_EQ(writes[1].size, l.checksums_offset - span);
  EXPECT_EQ(writes[2].offset, l.checksums_offset);

  // Read back the same way, bit-exact to the last byte.
  shaped->TakeReads(image);
  auto loaded = LoadShard(store, 1, 0);
  ASSERT_OK(loaded);
  ExpectShard(*loaded, 0);
  std::vector<ShapedStorage::Request> data_reads;
  for (const auto& r : shaped->TakeReads(image)) {
    // Besides the data: the header and the checksum section.
    const bool header = r.offset == 0 && r.size == kImageHeaderSize;
    if (!header && r.offset < l.checksums_offset) data_reads.push_back(r);
  }
  ASSERT_EQ(data_reads.size(), 2u);
  EXPECT_EQ(data_reads[0].offset, 0u);
  EXPECT_EQ(data_reads[0].size, span);
  EXPECT_EQ(data_reads[1].offset, span);
  EXPECT_EQ(data_reads[1].size, l.checksums_offset - span);

  // One flipped byte in the middle chunk of the first request: the load fails naming chunk 1.
  auto obj = mem->Open(ImageObjectName(1, 0));
  ASSERT_OK(obj);
  std::vector<std::byte> bytes((*obj)->size());
  ASSERT_OK((*obj)->ReadAt(0, bytes));
  bytes[l.chunk_size + l.chunk_size / 2] ^= std::byte{0x10};
  auto w = mem->Create(ImageObjectName(1, 0), bytes.size());
  ASSERT_OK(w);
  ASSERT_OK((*w)->WriteAt(0, bytes));
  ASSERT_OK((*w)->Publish());
  auto bad = LoadShard(store, 1, 0);
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("chunk 1"), std::string::npos) << bad.status().message();

  // A preferred size that is not a multiple of the chunk size: one chunk per request.
  auto odd = std::make_shared<ShapedStorage>(mem, l.chunk_size + 4096, 3);
  CheckpointStore odd_store(odd);
  ASSERT_OK(Save(odd_store, 2));
  const std::vector<ShapedStorage::Request> odd_writes = odd->TakeWrites(ImageObjectName(2, 0));
  EXPECT_EQ(odd_writes.size(), l.chunk_count() + 1);  // the chunks and the checksum section
  for (const auto& r : odd_writes) EXPECT_LE(r.size, l.chunk_size);
  ASSERT_OK(LoadShard(odd_store, 2, 0));
  for (const auto& r : odd->TakeReads(ImageObjectName(2, 0))) EXPECT_LE(r.size, l.chunk_size);
}

// A write request inside one tensor is sent from the tensor's own bytes (no staging copy) where
// the storage takes any buffer, and on storage written with O_DIRECT only when those bytes are
// page-aligned (else from an aligned staging buffer, as before); the image is the same each way.
TEST(CheckpointStoreTest, WritesInsideATensorAreSentFromItsOwnBytesWhereTheStorageAllows) {
  for (const bool direct_io : {false, true}) {
    for (const size_t misalign : {size_t{0}, size_t{64}}) {
      SCOPED_TRACE(testing::Message() << "direct_io " << direct_io << ", misalign " << misalign);
      auto shaped = std::make_shared<ShapedStorage>(std::shared_ptr<Storage>(NewMemoryStorage()), 0,
                                                    2, direct_io);
      CheckpointStore store(shaped);
      Shard s(1, 0);  // "big": 12 MiB of float32, the first tensor of the data section
      const size_t nbytes = s.big.size() * sizeof(float);
      test::AlignedTestBuffer big(nbytes, misalign);
      std::memcpy(big.data(), s.big.data(), nbytes);
      s.sources[0].data = big.data();
      ASSERT_OK(SaveShard(store, Meta(1, 0, 1), s.sources, s.extras).status());
      auto commit = store.ReadCommit(1);
      ASSERT_OK(commit);
      auto md = store.ReadMetadata(*commit, 0);
      ASSERT_OK(md);
      const uint64_t at = md->layout.data_offset;  // where "big" begins in the image
      size_t from_tensor = 0;
      for (const auto& w : shaped->TakeWrites(ImageObjectName(1, 0))) {
        if (w.data < big.data() || w.data >= big.data() + nbytes) continue;
        ++from_tensor;
        EXPECT_EQ(w.data, big.data() + (w.offset - at)) << w.offset;
        EXPECT_LE(w.offset + w.size, at + nbytes) << w.offset;
      }
      // Chunks 1 and 2 (4 MiB each) lie inside "big"; chunk 0 holds the header and index, chunk
      // 3 the end of "big" and the rest.
      EXPECT_EQ(from_tensor, direct_io && misalign != 0 ? 0u : 2u);
      auto loaded = LoadShard(store, 1, 0);
      ASSERT_OK(loaded);
      ExpectShard(*loaded, 0);
    }
  }
}

}  // namespace
}  // namespace safepoint::image_requests_test
