// libFuzzer target: the manifest decoder of packed images (src/checkpoint/pack_manifest.h); a
// manifest that decodes must re-encode to the input, and nothing but Corruption may come out
// otherwise.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "checkpoint/pack_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  auto m = safepoint::DecodePackedManifest(in, "fuzz");
  if (!m.ok()) {
    if (m.status().code() != safepoint::StatusCode::kCorruption) __builtin_trap();
    return 0;
  }
  const std::string again = safepoint::EncodePackedManifest(*m);
  if (again.size() != size || std::memcmp(again.data(), data, size) != 0) __builtin_trap();
  return 0;
}
