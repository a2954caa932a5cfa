// libFuzzer target: the image reader (header, index, extras, checksums) on arbitrary bytes.
// Any input must give a Corruption error or a valid image; never a crash or an out-of-bounds
// read (run under ASan+UBSan).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "safepoint/extras.h"
#include "safepoint/image.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::byte> image(size);
  if (size > 0) std::memcpy(image.data(), data, size);
  auto reader = safepoint::ImageReader::Parse(image, "fuzz");
  if (!reader.ok()) {
    if (reader.status().code() != safepoint::StatusCode::kCorruption) __builtin_trap();
    return 0;
  }
  for (size_t i = 0; i < reader->tensors().size(); ++i) {
    auto t = reader->tensor_data(i);
    if (t.data() < image.data() || t.data() + t.size() > image.data() + image.size()) {
      __builtin_trap();
    }
  }
  (void)safepoint::DecodeExtras(reader->extras(), reader->tensors().size(), "fuzz");
  return 0;
}
