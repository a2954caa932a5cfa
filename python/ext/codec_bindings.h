// The chunk codec (src/codec/codec.h) for Python: the compression benchmark and tools that read
// packed steps' frames.
#pragma once

#include <nanobind/nanobind.h>

namespace safepoint::python {

// Adds compress_chunk, decompress_chunk, decompress_chunk_into, FRAME_HEADER_SIZE and
// COMPRESSIONS (the compression names, codec::kModes) to `m`.
void BindCodec(nanobind::module_& m);

}  // namespace safepoint::python
