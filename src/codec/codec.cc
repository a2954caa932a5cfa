// The chunk codec: raw, zstd and byte-plane frames (docs/format.md, "Compressed chunks").
//
// Byte planes: a chunk of n values of E bytes (E = 2, 4, 8) is first rotated value by value one
// bit to the left, which moves the IEEE sign bit from the top of the value to its bottom, so the
// top byte of a bf16, fp32 or fp64 value holds exponent bits only (as ZipNN does). The rotated
// values are then split into E planes, plane k holding byte k of every value; the planes of the
// exponent compress well, those of the low mantissa hardly at all. Each plane is zstd-coded
// unless a sampled order-0 entropy says coding cannot pay, and kept raw when the coded plane is
// not smaller. Bytes past the last whole value (size % E) follow the planes raw.
//
// zstd contexts and plane buffers are per thread (thread_local) and reused: EncodeChunk and
// DecodeChunk are called from many threads at once, and creating a context costs more than
// coding a small chunk. A thread's plane buffers keep the size of the largest chunk it coded.
#include "codec/codec.h"

// For ZSTD_c_literalCompressionMode (an experimental parameter of libzstd >= 1.4.9, set by name
// at run time: a library without it returns an error, which leaves the default).
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "base/bytes.h"
#include "base/crc32c.h"

namespace safepoint::codec {
namespace {

using internal::Crc32c;
using internal::LoadLE;
using internal::StoreLE;

constexpr char kMagic[4] = {'S', 'P', 'Z', '1'};
// Header fields (docs/format.md).
constexpr size_t kOffMethod = 4, kOffElement = 5, kOffTransform = 6, kOffReserved = 7,
                 kOffRawSize = 8, kOffPayloadSize = 16, kOffRawCrc = 24, kOffPayloadCrc = 28,
                 kOffHeaderCrc = 32, kOffReserved2 = 36;
static_assert(kOffReserved2 + 4 == kFrameHeaderSize);
// Plane transforms (header byte 6).
constexpr uint8_t kTransformNone = 0, kTransformRotate1 = 1;
// Plane codings (first byte of a plane table entry).
constexpr uint8_t kPlaneRaw = 0, kPlaneZstd = 1;
constexpr size_t kPlaneEntry = 16;  // coding u8, 7 reserved, coded size u64

// zstd as kZstd uses it: level 1 (higher levels gain little on weights and cost 2-3x the time).
constexpr int kZstdLevel = 1;
// zstd as byte planes use it: a plane of exponents is a stream of low-entropy symbols with no
// long repeats, where zstd's match search costs most of the time and finds nothing that a
// Huffman code of the literals does not already get (on Gaussian bf16, the shape of trained
// weights: level 1 codes the exponent plane 2.8x at ~160 MB/s, this 3.1x at ~1.3 GB/s). So: match
// search all but off (a very negative level) and Huffman-coded literals forced on, in effect
// ZipNN's Huffman coder per 128 KiB block, still a standard zstd frame.
constexpr int kPlaneZstdLevel = -500;
// kAuto keeps a chunk raw unless coding saves at least 1/32 of it: a smaller gain does not pay
// for the decode on restore.
constexpr size_t kAutoMinSavingShift = 5;
// A plane whose sampled order-0 entropy is above this many bits per byte is kept raw without
// trying zstd (coding could save < 3%).
constexpr double kRawPlaneBits = 7.75;

bool ValidElementSize(int e) { return e == 1 || e == 2 || e == 4 || e == 8; }

Status Malformed(const std::string& what) {
  return Corruption("compressed chunk: malformed frame: " + what);
}

struct CctxDeleter {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
};
struct DctxDeleter {
  void operator()(ZSTD_DCtx* d) const { ZSTD_freeDCtx(d); }
};

ZSTD_CCtx* NewCctx(int level, bool force_literals) {
  ZSTD_CCtx* c = ZSTD_createCCtx();
  if (!c) return nullptr;
  ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, level);
  // The frame carries its own CRCs; no zstd checksum, but the content size, which the decoder
  // checks against the size it expects before decoding.
  ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, 0);
  ZSTD_CCtx_setParameter(c, ZSTD_c_contentSizeFlag, 1);
  if (force_literals) ZSTD_CCtx_setParameter(c, ZSTD_c_literalCompressionMode, ZSTD_ps_enable);
  return c;
}

// The calling thread's compression context for whole chunks (kZstd) or for planes.
ZSTD_CCtx* ThreadCctx(bool plane) {
  thread_local std::unique_ptr<ZSTD_CCtx, CctxDeleter> chunk(NewCctx(kZstdLevel, false));
  thread_local std::unique_ptr<ZSTD_CCtx, CctxDeleter> planes(NewCctx(kPlaneZstdLevel, true));
  return plane ? planes.get() : chunk.get();
}

ZSTD_DCtx* ThreadDctx() {
  thread_local std::unique_ptr<ZSTD_DCtx, DctxDeleter> dctx(ZSTD_createDCtx());
  return dctx.get();
}

// zstd of `in` into `out` (capacity ZSTD_compressBound(in.size())); returns the coded size, or 0
// when zstd failed or the result is not smaller than `in` (the caller keeps the bytes raw).
size_t ZstdInto(const std::byte* in, size_t n, std::byte* out, size_t capacity, bool plane) {
  ZSTD_CCtx* c = ThreadCctx(plane);
  if (!c) return 0;
  size_t r = ZSTD_compress2(c, out, capacity, in, n);
  if (ZSTD_isError(r) || r >= n) return 0;
  return r;
}

// Order-0 entropy in bits per byte of up to 64 KiB sampled evenly from `p` (256-byte runs).
double SampledEntropyBits(const uint8_t* p, size_t n) {
  std::array<uint32_t, 256> h0{}, h1{};
  size_t counted = 0;
  auto count = [&](const uint8_t* q, size_t len) {
    size_t i = 0;
    for (; i + 2 <= len; i += 2) {
      ++h0[q[i]];
      ++h1[q[i + 1]];
    }
    if (i < len) ++h0[q[i]];
    counted += len;
  };
  constexpr size_t kRun = 256, kRuns = 256;
  if (n <= kRun * kRuns) {
    count(p, n);
  } else {
    const size_t stride = n / kRuns;
    for (size_t r = 0; r < kRuns; ++r) count(p + r * stride, kRun);
  }
  if (counted == 0) return 0;
  double bits = 0;
  const double inv = 1.0 / static_cast<double>(counted);
  for (int s = 0; s < 256; ++s) {
    uint32_t c = h0[s] + h1[s];
    if (c) {
      double q = c * inv;
      bits -= q * std::log2(q);
    }
  }
  return bits;
}

// Splits n values of E bytes (rotated left one bit) into E planes of n bytes at `planes`.
template <typename T>
void SplitPlanes(const std::byte* in, size_t n, uint8_t* planes) {
  constexpr size_t E = sizeof(T);
  uint8_t* p[E];
  for (size_t k = 0; k < E; ++k) p[k] = planes + k * n;
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, in + i * E, E);
    v = std::rotl(v, 1);
    for (size_t k = 0; k < E; ++k) p[k][i] = static_cast<uint8_t>(v >> (8 * k));
  }
}

// The inverse of SplitPlanes: E planes of n bytes (plane k at planes[k]) into n values.
template <typename T>
void JoinPlanes(const uint8_t* const* planes, size_t n, std::byte* out) {
  constexpr size_t E = sizeof(T);
  const uint8_t* p[E];
  for (size_t k = 0; k < E; ++k) p[k] = planes[k];
  for (size_t i = 0; i < n; ++i) {
    T v = 0;
    for (size_t k = 0; k < E; ++k) v |= static_cast<T>(p[k][i]) << (8 * k);
    v = std::rotr(v, 1);
    std::memcpy(out + i * E, &v, E);
  }
}

void SplitAny(int e, const std::byte* in, size_t n, uint8_t* planes) {
  switch (e) {
    case 2:
      return SplitPlanes<uint16_t>(in, n, planes);
    case 4:
      return SplitPlanes<uint32_t>(in, n, planes);
    case 8:
      return SplitPlanes<uint64_t>(in, n, planes);
    default:
      std::memcpy(planes, in, n);
  }
}

void JoinAny(int e, const uint8_t* const* planes, size_t n, std::byte* out) {
  switch (e) {
    case 2:
      return JoinPlanes<uint16_t>(planes, n, out);
    case 4:
      return JoinPlanes<uint32_t>(planes, n, out);
    case 8:
      return JoinPlanes<uint64_t>(planes, n, out);
    default:
      std::memcpy(out, planes[0], n);
  }
}

// Writes the header of the frame at `h`, whose payload (payload_size bytes) follows it already.
void WriteHeader(std::byte* h, Method method, int element_size, uint8_t transform,
                 uint64_t raw_size, uint64_t payload_size, uint32_t raw_crc) {
  std::memset(h, 0, kFrameHeaderSize);
  std::memcpy(h, kMagic, 4);
  h[kOffMethod] = std::byte{static_cast<uint8_t>(method)};
  h[kOffElement] = std::byte{static_cast<uint8_t>(element_size)};
  h[kOffTransform] = std::byte{transform};
  StoreLE<uint64_t>(h + kOffRawSize, raw_size);
  StoreLE<uint64_t>(h + kOffPayloadSize, payload_size);
  StoreLE<uint32_t>(h + kOffRawCrc, raw_crc);
  StoreLE<uint32_t>(h + kOffPayloadCrc, Crc32c(0, h + kFrameHeaderSize, payload_size));
  StoreLE<uint32_t>(h + kOffHeaderCrc, Crc32c(0, h, kOffHeaderCrc));
}

// Appends a kRaw frame (out has the header's room at `at` already).
Method FinishRaw(std::span<const std::byte> raw, int e, uint32_t crc, size_t at,
                 std::vector<std::byte>* out) {
  out->resize(at + kFrameHeaderSize + raw.size());
  if (!raw.empty()) std::memcpy(out->data() + at + kFrameHeaderSize, raw.data(), raw.size());
  WriteHeader(out->data() + at, Method::kRaw, e, kTransformNone, raw.size(), raw.size(), crc);
  return Method::kRaw;
}

// Payload of a kZstd frame at out[at + header...]; false when it does not shrink.
bool EncodeZstd(std::span<const std::byte> raw, size_t at, std::vector<std::byte>* out,
                size_t* payload) {
  const size_t bound = ZSTD_compressBound(raw.size());
  out->resize(at + kFrameHeaderSize + bound);
  *payload = ZstdInto(raw.data(), raw.size(), out->data() + at + kFrameHeaderSize, bound, false);
  return *payload != 0;
}

// Payload of a kPlanes frame; false when no plane shrinks.
bool EncodePlanes(std::span<const std::byte> raw, int e, size_t at, std::vector<std::byte>* out,
                  size_t* payload) {
  const size_t n = raw.size() / e, tail = raw.size() % e;
  thread_local std::vector<uint8_t> scratch;
  if (scratch.size() < n * e) scratch.resize(n * e);
  SplitAny(e, raw.data(), n, scratch.data());
  const size_t table = kPlaneEntry * e;
  // Room for the worst case: every plane coded at its bound (a plane that does not shrink is
  // stored raw, so the final payload is at most table + raw size).
  const size_t bound = ZSTD_compressBound(n);
  out->resize(at + kFrameHeaderSize + table + static_cast<size_t>(e) * bound + tail);
  std::byte* base = out->data() + at + kFrameHeaderSize;
  size_t pos = table;
  bool any = false;
  for (int k = 0; k < e; ++k) {
    const uint8_t* plane = scratch.data() + static_cast<size_t>(k) * n;
    std::byte* entry = base + kPlaneEntry * k;
    std::memset(entry, 0, kPlaneEntry);
    size_t coded = 0;
    if (n > 0 && SampledEntropyBits(plane, n) <= kRawPlaneBits)
      coded = ZstdInto(reinterpret_cast<const std::byte*>(plane), n, base + pos, bound, true);
    if (coded) {
      entry[0] = std::byte{kPlaneZstd};
      any = true;
    } else {
      entry[0] = std::byte{kPlaneRaw};
      coded = n;
      if (n) std::memcpy(base + pos, plane, n);
    }
    StoreLE<uint64_t>(entry + 8, coded);
    pos += coded;
  }
  if (tail) std::memcpy(base + pos, raw.data() + n * e, tail);
  *payload = pos + tail;
  return any && *payload < raw.size();
}

struct Header {
  Method method;
  int element_size;
  uint8_t transform;
  uint64_t raw_size;
  uint64_t payload_size;
  uint32_t raw_crc;
  uint32_t payload_crc;
};

Result<Header> ParseHeader(std::span<const std::byte> frame) {
  if (frame.size() < kFrameHeaderSize)
    return Corruption("compressed chunk: " + std::to_string(frame.size()) +
                      " bytes, shorter than a frame header (" + std::to_string(kFrameHeaderSize) +
                      ")");
  const std::byte* h = frame.data();
  if (std::memcmp(h, kMagic, 4) != 0) return Corruption("compressed chunk: not a frame (magic)");
  if (Crc32c(0, h, kOffHeaderCrc) != LoadLE<uint32_t>(h + kOffHeaderCrc))
    return Corruption("compressed chunk: frame header fails its CRC-32C");
  Header r;
  const uint8_t method = std::to_integer<uint8_t>(h[kOffMethod]);
  if (method > static_cast<uint8_t>(Method::kPlanes))
    return Malformed("unknown method " + std::to_string(method));
  r.method = static_cast<Method>(method);
  r.element_size = std::to_integer<uint8_t>(h[kOffElement]);
  if (!ValidElementSize(r.element_size))
    return Malformed("element size " + std::to_string(r.element_size));
  r.transform = std::to_integer<uint8_t>(h[kOffTransform]);
  const uint8_t want_transform =
      r.method == Method::kPlanes && r.element_size > 1 ? kTransformRotate1 : kTransformNone;
  if (r.transform != want_transform) return Malformed("transform " + std::to_string(r.transform));
  if (h[kOffReserved] != std::byte{0} || LoadLE<uint32_t>(h + kOffReserved2) != 0)
    return Malformed("reserved bytes set");
  r.raw_size = LoadLE<uint64_t>(h + kOffRawSize);
  r.payload_size = LoadLE<uint64_t>(h + kOffPayloadSize);
  r.raw_crc = LoadLE<uint32_t>(h + kOffRawCrc);
  r.payload_crc = LoadLE<uint32_t>(h + kOffPayloadCrc);
  if (r.method == Method::kRaw && r.payload_size != r.raw_size)
    return Malformed("raw payload of " + std::to_string(r.payload_size) + " bytes for " +
                     std::to_string(r.raw_size));
  if (r.payload_size > UINT64_MAX - kFrameHeaderSize) return Malformed("payload size");
  return r;
}

Status DecodeZstd(const std::byte* in, size_t n, std::byte* out, size_t size, const char* what) {
  // The content size zstd declares must be exactly the size expected (a frame that declares
  // none, or another, is malformed); decoding stops at `size` either way.
  const unsigned long long declared = ZSTD_getFrameContentSize(in, n);
  if (declared != size)
    return Malformed(
        std::string(what) + ": zstd frame declares " +
        (declared >= ZSTD_CONTENTSIZE_ERROR ? std::string("no size") : std::to_string(declared)) +
        ", expected " + std::to_string(size));
  ZSTD_DCtx* d = ThreadDctx();
  if (!d) return ResourceExhausted("compressed chunk: cannot create a zstd context");
  size_t r = ZSTD_decompressDCtx(d, out, size, in, n);
  if (ZSTD_isError(r))
    return Corruption(std::string("compressed chunk: ") + what + ": " + ZSTD_getErrorName(r));
  if (r != size)
    return Corruption(std::string("compressed chunk: ") + what + " decodes to " +
                      std::to_string(r) + " bytes, expected " + std::to_string(size));
  return Status::OK();
}

Status DecodePlanes(const Header& hd, std::span<const std::byte> payload,
                    std::span<std::byte> raw) {
  const size_t e = hd.element_size, n = raw.size() / e, tail = raw.size() % e;
  const size_t table = kPlaneEntry * e;
  if (payload.size() < table + tail) return Malformed("planes payload shorter than its table");
  // Check the whole table before decoding anything.
  uint64_t sum = table + tail;
  for (size_t k = 0; k < e; ++k) {
    const std::byte* entry = payload.data() + kPlaneEntry * k;
    const uint8_t coding = std::to_integer<uint8_t>(entry[0]);
    for (int b = 1; b < 8; ++b)
      if (entry[b] != std::byte{0}) return Malformed("plane " + std::to_string(k) + " reserved");
    const uint64_t coded = LoadLE<uint64_t>(entry + 8);
    if (coding == kPlaneRaw) {
      if (coded != n) return Malformed("raw plane " + std::to_string(k) + " size");
    } else if (coding != kPlaneZstd) {
      return Malformed("plane " + std::to_string(k) + " coding " + std::to_string(coding));
    }
    if (coded > payload.size() || sum > payload.size() - coded)
      return Malformed("plane sizes exceed the payload");
    sum += coded;
  }
  if (sum != payload.size()) return Malformed("plane sizes do not add up to the payload");

  thread_local std::vector<uint8_t> scratch;
  const uint8_t* planes[8];
  size_t pos = table;
  size_t scratch_used = 0;
  for (size_t k = 0; k < e; ++k)
    if (std::to_integer<uint8_t>(payload[kPlaneEntry * k]) == kPlaneZstd) ++scratch_used;
  if (scratch.size() < scratch_used * n) scratch.resize(scratch_used * n);
  size_t next = 0;
  for (size_t k = 0; k < e; ++k) {
    const std::byte* entry = payload.data() + kPlaneEntry * k;
    const uint64_t coded = LoadLE<uint64_t>(entry + 8);
    const std::byte* src = payload.data() + pos;
    if (std::to_integer<uint8_t>(entry[0]) == kPlaneRaw) {
      planes[k] = reinterpret_cast<const uint8_t*>(src);
    } else {
      uint8_t* dst = scratch.data() + next * n;
      ++next;
      const std::string what = "plane " + std::to_string(k);
      SP_RETURN_IF_ERROR(
          DecodeZstd(src, coded, reinterpret_cast<std::byte*>(dst), n, what.c_str()));
      planes[k] = dst;
    }
    pos += coded;
  }
  JoinAny(static_cast<int>(e), planes, n, raw.data());
  if (tail) std::memcpy(raw.data() + n * e, payload.data() + pos, tail);
  return Status::OK();
}

}  // namespace

Result<Mode> ParseMode(std::string_view text) {
  std::string names;
  for (Mode m : kModes) {
    if (text == ModeName(m)) return m;
    names += (names.empty() ? "" : ", ") + std::string(ModeName(m));
  }
  return InvalidArgument("compression '" + std::string(text) + "' is not one of " + names);
}

std::string_view ModeName(Mode mode) {
  switch (mode) {
    case Mode::kAuto:
      return "auto";
    case Mode::kNone:
      return "none";
    case Mode::kZstd:
      return "zstd";
    case Mode::kPlanes:
      return "planes";
  }
  return "?";
}

std::string_view MethodName(Method method) {
  switch (method) {
    case Method::kRaw:
      return "raw";
    case Method::kZstd:
      return "zstd";
    case Method::kPlanes:
      return "planes";
  }
  return "?";
}

Result<Method> EncodeChunk(std::span<const std::byte> raw, int element_size, Mode mode,
                           std::vector<std::byte>* out) {
  if (!ValidElementSize(element_size))
    return InvalidArgument("element size " + std::to_string(element_size) + " is not 1, 2, 4 or 8");
  if (static_cast<uint8_t>(mode) > static_cast<uint8_t>(Mode::kPlanes))
    return InvalidArgument("compression mode " + std::to_string(static_cast<int>(mode)));
  const size_t at = out->size();
  const uint32_t crc = Crc32c(raw);
  // kAuto: byte planes for values of 2, 4 or 8 bytes (floating point and integers alike gain
  // from grouping their bytes by significance), zstd for bytes.
  Method method = Method::kRaw;
  if (mode == Mode::kZstd || (mode == Mode::kAuto && element_size == 1)) {
    method = Method::kZstd;
  } else if (mode == Mode::kPlanes || mode == Mode::kAuto) {
    method = Method::kPlanes;
  }
  if (method == Method::kRaw || raw.empty()) return FinishRaw(raw, element_size, crc, at, out);

  size_t payload = 0;
  const bool shrank = method == Method::kZstd ? EncodeZstd(raw, at, out, &payload)
                                              : EncodePlanes(raw, element_size, at, out, &payload);
  const size_t min_saving = mode == Mode::kAuto ? (raw.size() >> kAutoMinSavingShift) : 1;
  if (!shrank || payload + min_saving > raw.size())
    return FinishRaw(raw, element_size, crc, at, out);
  out->resize(at + kFrameHeaderSize + payload);
  WriteHeader(out->data() + at, method, element_size,
              method == Method::kPlanes && element_size > 1 ? kTransformRotate1 : kTransformNone,
              raw.size(), payload, crc);
  return method;
}

Result<uint64_t> DecodedSize(std::span<const std::byte> frame) {
  SP_ASSIGN_OR_RETURN(Header h, ParseHeader(frame));
  return h.raw_size;
}

Result<uint64_t> FrameSize(std::span<const std::byte> header) {
  SP_ASSIGN_OR_RETURN(Header h, ParseHeader(header));
  return kFrameHeaderSize + h.payload_size;
}

Result<Method> FrameMethod(std::span<const std::byte> header) {
  SP_ASSIGN_OR_RETURN(Header h, ParseHeader(header));
  return h.method;
}

Status DecodeChunk(std::span<const std::byte> frame, std::span<std::byte> raw) {
  SP_ASSIGN_OR_RETURN(Header h, ParseHeader(frame));
  if (h.raw_size != raw.size())
    return Corruption("compressed chunk: decodes to " + std::to_string(h.raw_size) +
                      " bytes, expected " + std::to_string(raw.size()));
  if (frame.size() - kFrameHeaderSize != h.payload_size)
    return Corruption("compressed chunk: frame of " + std::to_string(frame.size()) +
                      " bytes, its header declares " +
                      std::to_string(kFrameHeaderSize + h.payload_size));
  std::span<const std::byte> payload = frame.subspan(kFrameHeaderSize);
  // Every bit of a frame is covered: the header by its CRC, the payload by this one (a flip in
  // bytes a zstd decoder ignores would otherwise pass), the decoder's output by the raw CRC.
  if (Crc32c(payload) != h.payload_crc)
    return Corruption("compressed chunk: payload fails its CRC-32C");
  switch (h.method) {
    case Method::kRaw:
      if (!raw.empty()) std::memcpy(raw.data(), payload.data(), raw.size());
      break;
    case Method::kZstd:
      SP_RETURN_IF_ERROR(
          DecodeZstd(payload.data(), payload.size(), raw.data(), raw.size(), "zstd"));
      break;
    case Method::kPlanes:
      SP_RETURN_IF_ERROR(DecodePlanes(h, payload, raw));
      break;
  }
  if (Crc32c(raw) != h.raw_crc)
    return Corruption("compressed chunk: decoded bytes fail their CRC-32C");
  return Status::OK();
}

}  // namespace safepoint::codec
