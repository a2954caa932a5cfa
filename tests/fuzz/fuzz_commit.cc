// libFuzzer target: the COMMIT record decoder; valid records must re-encode to the input.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "safepoint/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  auto r = safepoint::DecodeCommitRecord(in, "fuzz");
  if (!r.ok()) {
    if (r.status().code() != safepoint::StatusCode::kCorruption) __builtin_trap();
    return 0;
  }
  const std::string again = safepoint::EncodeCommitRecord(*r);
  if (again.size() != size || std::memcmp(again.data(), data, size) != 0) __builtin_trap();
  return 0;
}
