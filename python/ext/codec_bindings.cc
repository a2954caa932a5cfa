// safepoint._core: the chunk codec (codec_bindings.h). Inputs are any C-contiguous buffer (bytes,
// bytearray, memoryview, a numpy array), read in place; the GIL is released while coding.
#include "codec_bindings.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "errors.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace safepoint::python {

namespace {

// A Python buffer held for the duration of a call.
class Buffer {
 public:
  Buffer(nb::handle obj, bool writable) {
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw nb::python_error();
  }
  ~Buffer() { PyBuffer_Release(&view_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  std::span<std::byte> bytes() {
    return {static_cast<std::byte*>(view_.buf), static_cast<size_t>(view_.len)};
  }

 private:
  Py_buffer view_;
};

std::pair<nb::bytes, std::string> CompressChunk(nb::handle data, int element_size,
                                                const std::string& mode) {
  auto parsed = codec::ParseMode(mode);
  if (!parsed.ok()) ThrowStatus(parsed.status());
  Buffer in(data, false);
  // Reused per thread: a fresh 4 MiB vector per call costs page faults comparable to the coding.
  thread_local std::vector<std::byte> frame;
  frame.clear();
  Result<codec::Method> method = [&] {
    nb::gil_scoped_release release;
    return codec::EncodeChunk(in.bytes(), element_size, *parsed, &frame);
  }();
  if (!method.ok()) ThrowStatus(method.status());
  return {nb::bytes(frame.data(), frame.size()), std::string(codec::MethodName(*method))};
}

void DecompressInto(std::span<const std::byte> frame, std::span<std::byte> out) {
  Status s;
  {
    nb::gil_scoped_release release;
    s = codec::DecodeChunk(frame, out);
  }
  if (!s.ok()) ThrowStatus(s);
}

nb::bytes DecompressChunk(nb::handle frame, std::optional<uint64_t> size) {
  Buffer in(frame, false);
  auto declared = codec::DecodedSize(in.bytes());
  if (!declared.ok()) ThrowStatus(declared.status());
  if (size && *size != *declared)
    ThrowStatus(Corruption("compressed chunk: decodes to " + std::to_string(*declared) +
                           " bytes, expected " + std::to_string(*size)));
  if (*declared > static_cast<uint64_t>(PY_SSIZE_T_MAX))
    ThrowStatus(Corruption("compressed chunk: declares " + std::to_string(*declared) + " bytes"));
  // Decoded straight into the new bytes object, which nothing else sees yet.
  PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(*declared));
  if (!out) throw nb::python_error();
  nb::bytes result = nb::steal<nb::bytes>(out);
  DecompressInto(in.bytes(), {reinterpret_cast<std::byte*>(PyBytes_AS_STRING(out)),
                              static_cast<size_t>(*declared)});
  return result;
}

void DecompressChunkInto(nb::handle frame, nb::handle out) {
  Buffer in(frame, false), dst(out, true);
  DecompressInto(in.bytes(), dst.bytes());
}

}  // namespace

void BindCodec(nb::module_& m) {
  m.attr("FRAME_HEADER_SIZE") = codec::kFrameHeaderSize;
  // The compression names (codec::kModes), for the package to check arguments against.
  nb::list names;
  for (codec::Mode mode : codec::kModes)
    names.append(nb::str(codec::ModeName(mode).data(), codec::ModeName(mode).size()));
  m.attr("COMPRESSIONS") = nb::tuple(names);
  m.def("compress_chunk", &CompressChunk, "data"_a, "element_size"_a = 1, "mode"_a = "auto",
        "The frame of one chunk (any C-contiguous buffer) and the method used ('raw', 'zstd' or "
        "'planes'). element_size: the width of its values (1, 2, 4 or 8); mode: one of "
        "COMPRESSIONS.");
  m.def("decompress_chunk", &DecompressChunk, "frame"_a, "size"_a.none() = nb::none(),
        "The bytes of a frame; CorruptionError for a malformed frame, another size than `size`, "
        "or decoded bytes that fail the frame's CRC-32C.");
  m.def("decompress_chunk_into", &DecompressChunkInto, "frame"_a, "out"_a,
        "Decodes a frame into `out`, a writable C-contiguous buffer of exactly its decoded size.");
}

}  // namespace safepoint::python
