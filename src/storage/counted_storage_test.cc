// The storage request counts (include/safepoint/storage.h, StorageRequestCounts): every Storage
// that OpenStorage returns counts each request once, under its scheme, and tells metadata bytes
// from tensor data by object name.
#include "storage/counted_storage.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "safepoint/storage.h"
#include "testing/test_util.h"

namespace safepoint::counted_storage_test {
namespace {

StorageRequestCounts CountsOf(const std::string& scheme) {
  for (const auto& [s, c] : StorageRequestCountsByScheme()) {
    if (s == scheme) return c;
  }
  return {};
}

TEST(CountedStorage, CountsEveryRequestOnceUnderItsScheme) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> st, OpenStorage("mem://counted-storage-test"));
  const StorageRequestCounts before = CountsOf("mem");
  std::vector<std::byte> data(1000, std::byte{7});

  ASSERT_OK_AND_ASSIGN(auto image, st->Create("step-1/rank-00000.img", data.size()));
  ASSERT_OK(image->WriteAt(0, data));
  ASSERT_OK(image->WriteAt(500, std::span(data).first(500)));
  ASSERT_OK(image->Publish());
  ASSERT_OK_AND_ASSIGN(auto commit, st->Create("step-1/COMMIT", 64));
  ASSERT_OK(commit->WriteAt(0, std::span(data).first(64)));
  ASSERT_OK(commit->PublishIfAbsent());
  ASSERT_OK_AND_ASSIGN(auto listed, st->List("step-1/"));
  ASSERT_EQ(listed.size(), 2u);
  ASSERT_OK_AND_ASSIGN(auto r, st->Open("step-1/rank-00000.img"));
  std::vector<std::byte> back(100);
  ASSERT_OK(r->ReadAt(0, back));
  ASSERT_OK(r->ReadAt(100, back));
  ASSERT_OK_AND_ASSIGN(auto c, st->Open("step-1/COMMIT"));
  ASSERT_OK(c->ReadAt(0, std::span(back).first(64)));
  ASSERT_OK(st->Delete("step-1/COMMIT"));
  ASSERT_OK(st->RemoveLeftovers("step-1/"));

  const StorageRequestCounts now = CountsOf("mem");
  EXPECT_EQ(now.create - before.create, 2u);
  EXPECT_EQ(now.write - before.write, 3u);
  EXPECT_EQ(now.put - before.put, 2u);
  EXPECT_EQ(now.list - before.list, 1u);
  EXPECT_EQ(now.head - before.head, 2u);
  EXPECT_EQ(now.get - before.get, 3u);
  EXPECT_EQ(now.del - before.del, 1u);
  EXPECT_EQ(now.cleanup - before.cleanup, 1u);
  EXPECT_EQ(now.requests() - before.requests(), 15u);
  EXPECT_EQ(now.data_bytes_written - before.data_bytes_written, 1500u);
  EXPECT_EQ(now.data_bytes_read - before.data_bytes_read, 200u);
  // The COMMIT written and read (64 + 64) and the two listed names (plus 16 bytes each).
  const uint64_t listed_bytes =
      std::string("step-1/rank-00000.img").size() + std::string("step-1/COMMIT").size() + 2 * 16;
  EXPECT_EQ(now.metadata_bytes - before.metadata_bytes, 128u + listed_bytes);
}

TEST(CountedStorage, FailedRequestsAreCountedToo) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> st, OpenStorage("mem://counted-storage-miss"));
  const StorageRequestCounts before = CountsOf("mem");
  EXPECT_FALSE(st->Open("step-9/COMMIT").ok());  // a HEAD that finds nothing is still a request
  EXPECT_EQ(CountsOf("mem").head - before.head, 1u);
}

TEST(CountedStorage, PlainPathsCountAsFile) {
  const std::string dir = ::testing::TempDir() + "/counted-storage-plain";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> st, OpenStorage(dir));
  const StorageRequestCounts before = CountsOf("file");
  ASSERT_OK(st->List("").status());
  EXPECT_EQ(CountsOf("file").list - before.list, 1u);
}

TEST(CountedStorage, DataObjectsAreImagesAndChunks) {
  EXPECT_TRUE(IsDataObjectName("step-00000000000000000001/rank-00000.img"));
  EXPECT_TRUE(IsDataObjectName("step-00000000000000000001/rank-00003.g00f3a2c4b1d09e87.img"));
  EXPECT_TRUE(IsDataObjectName("chunks/3f/3f9a00"));
  EXPECT_FALSE(IsDataObjectName("chunks/inflight/00000000000000000001.r0.00f3a2c4b1d09e87"));
  EXPECT_FALSE(IsDataObjectName("chunks/gc-lock"));
  EXPECT_FALSE(IsDataObjectName("step-00000000000000000001/COMMIT"));
  EXPECT_FALSE(IsDataObjectName("step-00000000000000000001/rank-00000.pack"));
}

}  // namespace
}  // namespace safepoint::counted_storage_test
