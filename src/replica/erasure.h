// Reed-Solomon erasure coding of snapshot images (ISA-L's ec_encode_data), in stripes.
//
// An image of `image_bytes` is cut into stripes of K pieces of `piece_bytes` each (the last stripe
// zero-padded). Each stripe is encoded into P parity pieces. Fragment f (0 <= f < K+P) is the
// concatenation of piece f of every stripe: fragments 0..K-1 are data, K..K+P-1 parity, each of
// fragment_bytes(). Any K distinct fragments rebuild the image exactly. An empty image has no
// stripes: its fragments are empty and decode to the empty image. Stripes let a sender
// encode and send as it reads the slot, with memory for one stripe, and a receiver write its
// fragment sequentially.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "safepoint/status.h"

namespace safepoint::replica {

inline constexpr uint64_t kDefaultPieceBytes = 1 << 20;

struct EcLayout {
  uint32_t k = 1, p = 0;
  uint64_t image_bytes = 0;
  uint64_t piece_bytes = kDefaultPieceBytes;  // a multiple of 64

  uint64_t stripe_bytes() const { return piece_bytes * k; }  // image bytes per stripe
  uint64_t stripes() const;                                  // ceil(image_bytes / stripe_bytes)
  uint64_t fragment_bytes() const { return stripes() * piece_bytes; }
  // InvalidArgument unless 1 <= k, 1 <= p, k + p <= 32, piece_bytes a positive multiple of 64
  // (at most 2^40).
  Status Validate() const;
};

class EcCodec {
 public:
  static Result<std::unique_ptr<EcCodec>> Create(uint32_t k, uint32_t p);
  ~EcCodec();

  // Encodes stripe `stripe` of `image` (image.size() == layout.image_bytes): writes piece_bytes
  // into each of out[0..K+P) (data pieces are copies of the image's bytes, zero-padded past
  // its end; parity pieces computed).
  void EncodeStripe(const EcLayout& layout, std::span<const std::byte> image, uint64_t stripe,
                    std::span<std::byte* const> out) const;

  // Rebuilds the whole image from K distinct fragments: `indices[i]` is the fragment index of
  // `fragments[i]` (each fragment_bytes() long). `image` is image_bytes long. InvalidArgument
  // for fewer than K, repeated or out-of-range indices or wrong sizes. The caller verifies the
  // result (fragments carry CRCs, the image its own).
  Status Decode(const EcLayout& layout, std::span<const uint32_t> indices,
                std::span<const std::span<const std::byte>> fragments,
                std::span<std::byte> image) const;

 private:
  EcCodec() = default;
  uint32_t k_ = 0, p_ = 0;
  std::vector<uint8_t> matrix_;  // (k+p) x k encode matrix
  std::vector<uint8_t> tables_;  // ec_init_tables of the parity rows
};

}  // namespace safepoint::replica
