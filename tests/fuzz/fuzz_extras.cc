// libFuzzer target: the non-tensor state decoder. Decoded values must re-encode to the input.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "safepoint/extras.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  auto v = safepoint::DecodeExtras(in, 16, "fuzz");
  if (!v.ok()) {
    if (v.status().code() != safepoint::StatusCode::kCorruption) __builtin_trap();
    return 0;
  }
  auto again = safepoint::EncodeExtras(*v);
  if (!again.ok() || again->size() != size || std::memcmp(again->data(), data, size) != 0) {
    __builtin_trap();  // the encoding is canonical: decode(x) must encode back to x
  }
  (void)safepoint::FormatValue(*v, 256);
  return 0;
}
