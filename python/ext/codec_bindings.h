// The chunk codec (src/codec/codec.h) for Python: the compression benchmark and tools that read
// packed steps' frames.
#pragma once

#include <nanobind/nanobind.h>

namespace safepoint::python {

// Adds compress_chunk, decompress_chunk, decompress_chunk_into and FRAME_HEADER_SIZE to `m`.
void BindCodec(nanobind::module_& m);

}  // namespace safepoint::python
