// Test helpers shared by the checkpoint store's tests: a shard whose bytes are a function of its
// step and rank, saved and checked.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <optional>

#include "safepoint/checkpoint.h"
#include "testing/test_util.h"

namespace safepoint::store_test {

// A shard whose bytes are a pure function of (step, rank).
// "big" depends on the step (and the rank).
struct Shard : test::TwoTensorShard {
  Shard(uint64_t step, uint32_t rank, size_t big_elems = 3 << 20)
      : TwoTensorShard(step, rank, /*seed=*/step, big_elems) {}
};

inline ImageMeta Meta(uint64_t step, uint32_t rank, uint32_t world) {
  return test::TestImageMeta("test", step, rank, world);
}

inline Status Save(CheckpointStore& store, uint64_t step, uint32_t rank = 0, uint32_t world = 1) {
  Shard s(step, rank);
  return SaveShard(store, Meta(step, rank, world), s.sources, s.extras).status();
}

// Checks that `shard` is exactly what Shard(step, rank, big_elems) wrote, for its step.
inline void ExpectShard(const LoadedShard& shard, uint32_t rank, size_t big_elems = 3 << 20) {
  Shard want(shard.commit.step, rank, big_elems);
  ASSERT_EQ(shard.reader.tensors().size(), 2u);
  auto big = shard.reader.tensor_data(0);
  ASSERT_EQ(big.size(), want.big.size() * 4);
  EXPECT_EQ(std::memcmp(big.data(), want.big.data(), big.size()), 0)
      << "step " << shard.commit.step << ", rank " << rank;
  auto enc = EncodeExtras(shard.extras);
  EXPECT_EQ(*enc, want.extras);
}

// Loads and checks that the content is exactly what Shard(step, rank) wrote.
inline void ExpectLoads(CheckpointStore& store, std::optional<uint64_t> step, uint64_t expect_step,
                        uint32_t rank = 0) {
  auto shard = LoadShard(store, step, rank);
  ASSERT_OK(shard);
  EXPECT_EQ(shard->commit.step, expect_step);
  ExpectShard(*shard, rank);
}

}  // namespace safepoint::store_test
