#include "base/stream_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace safepoint::internal::stream_copy_test {
namespace {

// Lengths around the streaming threshold and the 64-byte rounds, from several alignments of
// source and destination: the bytes arrive as memcpy's would, and none outside the range moves.
TEST(StreamCopyTest, CopiesExactlyTheRangeAtAnyAlignmentAndLength) {
  constexpr size_t kMax = (130 << 10) + 200;
  std::vector<uint8_t> src(kMax + 64), dst(kMax + 128);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{63}, size_t{4096}, size_t{64 << 10} - 1, size_t{64 << 10},
        size_t{(64 << 10) + 1}, size_t{(64 << 10) + 63}, size_t{(128 << 10) + 64}, kMax}) {
    for (size_t so = 0; so < 17; so += 5) {
      for (size_t d0 = 0; d0 < 33; d0 += 3) {
        std::fill(dst.begin(), dst.end(), uint8_t{0xEE});
        StreamCopy(dst.data() + d0, src.data() + so, n);
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= d0 && i < d0 + n;
          const uint8_t want = inside ? src[so + (i - d0)] : uint8_t{0xEE};
          ASSERT_EQ(dst[i], want) << "n " << n << " src +" << so << " dst +" << d0 << " at " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace safepoint::internal::stream_copy_test
