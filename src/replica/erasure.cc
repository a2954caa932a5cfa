// Reed-Solomon over GF(2^8) with ISA-L: the encode matrix is ISA-L's Cauchy matrix, an identity
// on top of P Cauchy rows, so that every K x K submatrix is invertible and any K fragments
// rebuild the data. Decoding inverts the rows of the fragments at hand and multiplies the missing
// data pieces out of them, stripe by stripe; data fragments at hand are copied as they are.
#include "replica/erasure.h"

#include <isa-l/erasure_code.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace safepoint::replica {

namespace {

// ec_encode_data takes an int length: longer pieces are encoded in runs of this many bytes.
constexpr uint64_t kMaxRun = uint64_t{1} << 30;
constexpr uint64_t kMaxPieceBytes = uint64_t{1} << 40;

std::string CodeName(uint32_t k, uint32_t p) {
  return "ec:" + std::to_string(k) + "+" + std::to_string(p);
}

// out[r] = sum over i of rows[r][i] * in[i], for `len` bytes of each, in int-sized runs.
void Multiply(uint32_t k, uint32_t rows, uint8_t* tables, const std::vector<uint8_t*>& in,
              const std::vector<uint8_t*>& out, uint64_t len) {
  std::vector<uint8_t*> src(in.size()), dst(out.size());
  for (uint64_t off = 0; off < len; off += kMaxRun) {
    const uint64_t n = std::min(kMaxRun, len - off);
    for (size_t i = 0; i < in.size(); ++i) src[i] = in[i] + off;
    for (size_t i = 0; i < out.size(); ++i) dst[i] = out[i] + off;
    ec_encode_data(static_cast<int>(n), static_cast<int>(k), static_cast<int>(rows), tables,
                   src.data(), dst.data());
  }
}

}  // namespace

uint64_t EcLayout::stripes() const {
  const uint64_t sb = stripe_bytes();
  if (sb == 0) return 0;
  return image_bytes / sb + (image_bytes % sb != 0 ? 1 : 0);
}

Status EcLayout::Validate() const {
  if (k < 1 || p < 1 || k + p > 32) {
    return InvalidArgument("erasure code " + CodeName(k, p) +
                           " is not valid: K >= 1, P >= 1 and K+P <= 32 are required");
  }
  if (piece_bytes == 0 || piece_bytes % 64 != 0) {
    return InvalidArgument("erasure code " + CodeName(k, p) + ": piece size " +
                           std::to_string(piece_bytes) + " is not a positive multiple of 64");
  }
  if (piece_bytes > kMaxPieceBytes) {  // so that stripe_bytes() cannot overflow
    return InvalidArgument("erasure code " + CodeName(k, p) + ": piece size " +
                           std::to_string(piece_bytes) + " is larger than " +
                           std::to_string(kMaxPieceBytes));
  }
  return Status::OK();
}

Result<std::unique_ptr<EcCodec>> EcCodec::Create(uint32_t k, uint32_t p) {
  EcLayout layout;
  layout.k = k;
  layout.p = p;
  SP_RETURN_IF_ERROR(layout.Validate());
  auto codec = std::unique_ptr<EcCodec>(new EcCodec());
  codec->k_ = k;
  codec->p_ = p;
  codec->matrix_.resize(static_cast<size_t>(k + p) * k);
  gf_gen_cauchy1_matrix(codec->matrix_.data(), static_cast<int>(k + p), static_cast<int>(k));
  codec->tables_.resize(static_cast<size_t>(32) * k * p);
  ec_init_tables(static_cast<int>(k), static_cast<int>(p), codec->matrix_.data() + k * k,
                 codec->tables_.data());
  return codec;
}

EcCodec::~EcCodec() = default;

void EcCodec::EncodeStripe(const EcLayout& layout, std::span<const std::byte> image,
                           uint64_t stripe, std::span<std::byte* const> out) const {
  const uint64_t piece = layout.piece_bytes;
  const uint64_t base = stripe * layout.stripe_bytes();
  std::vector<uint8_t*> data(k_), parity(p_);
  for (uint32_t i = 0; i < k_; ++i) {
    const uint64_t start = std::min<uint64_t>(base + i * piece, image.size());
    const uint64_t n = std::min<uint64_t>(piece, image.size() - start);
    if (n > 0) std::memcpy(out[i], image.data() + start, n);
    if (n < piece) std::memset(out[i] + n, 0, piece - n);
    data[i] = reinterpret_cast<uint8_t*>(out[i]);
  }
  for (uint32_t j = 0; j < p_; ++j) parity[j] = reinterpret_cast<uint8_t*>(out[k_ + j]);
  Multiply(k_, p_, const_cast<uint8_t*>(tables_.data()), data, parity, piece);
}

Status EcCodec::Decode(const EcLayout& layout, std::span<const uint32_t> indices,
                       std::span<const std::span<const std::byte>> fragments,
                       std::span<std::byte> image) const {
  const std::string code = CodeName(k_, p_);
  SP_RETURN_IF_ERROR(layout.Validate());
  if (layout.k != k_ || layout.p != p_) {
    return InvalidArgument("decoding " + CodeName(layout.k, layout.p) + " fragments with an " +
                           code + " codec");
  }
  if (indices.size() != fragments.size()) {
    return InvalidArgument(code + " decode: " + std::to_string(indices.size()) + " indices for " +
                           std::to_string(fragments.size()) + " fragments");
  }
  if (indices.size() < k_) {
    return InvalidArgument(code + " decode: " + std::to_string(indices.size()) +
                           " fragments, at least " + std::to_string(k_) + " are needed");
  }
  if (image.size() != layout.image_bytes) {
    return InvalidArgument(code + " decode: the image buffer has " + std::to_string(image.size()) +
                           " bytes, the image " + std::to_string(layout.image_bytes));
  }
  const uint64_t frag_bytes = layout.fragment_bytes();
  std::vector<bool> seen(k_ + p_, false);
  for (size_t i = 0; i < indices.size(); ++i) {
    const uint32_t f = indices[i];
    if (f >= k_ + p_) {
      return InvalidArgument(code + " decode: fragment index " + std::to_string(f) +
                             " is out of range [0, " + std::to_string(k_ + p_) + ")");
    }
    if (seen[f]) {
      return InvalidArgument(code + " decode: fragment " + std::to_string(f) + " given twice");
    }
    seen[f] = true;
    if (fragments[i].size() != frag_bytes) {
      return InvalidArgument(code + " decode: fragment " + std::to_string(f) + " has " +
                             std::to_string(fragments[i].size()) + " bytes, expected " +
                             std::to_string(frag_bytes));
    }
  }
  // The K fragments used: every data fragment at hand, then parity ones in the order given.
  std::vector<size_t> use;  // positions in `indices`
  for (size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] < k_) use.push_back(i);
  }
  for (size_t i = 0; i < indices.size() && use.size() < k_; ++i) {
    if (indices[i] >= k_) use.push_back(i);
  }
  use.resize(k_);
  std::vector<uint32_t> missing;  // data fragments to recover
  for (uint32_t d = 0; d < k_; ++d) {
    if (!seen[d]) missing.push_back(d);
  }

  const uint64_t piece = layout.piece_bytes;
  const uint64_t stripes = layout.stripes();
  auto image_piece = [&](uint64_t s, uint32_t d, uint64_t* n) {
    const uint64_t start = std::min<uint64_t>(s * layout.stripe_bytes() + d * piece, image.size());
    *n = std::min<uint64_t>(piece, image.size() - start);
    return image.data() + start;
  };
  // Data fragments at hand: copied.
  for (size_t u : use) {
    const uint32_t d = indices[u];
    if (d >= k_) continue;
    for (uint64_t s = 0; s < stripes; ++s) {
      uint64_t n = 0;
      std::byte* dst = image_piece(s, d, &n);
      if (n > 0) std::memcpy(dst, fragments[u].data() + s * piece, n);
    }
  }
  if (missing.empty() || stripes == 0) return Status::OK();

  // Invert the rows of the fragments used; row d of the inverse recovers data piece d.
  std::vector<uint8_t> sub(static_cast<size_t>(k_) * k_), inv(static_cast<size_t>(k_) * k_);
  for (uint32_t r = 0; r < k_; ++r) {
    std::memcpy(sub.data() + r * k_, matrix_.data() + indices[use[r]] * k_, k_);
  }
  if (gf_invert_matrix(sub.data(), inv.data(), static_cast<int>(k_)) != 0) {
    return InvalidArgument(code + " decode: the fragments' rows are singular");  // not for Cauchy
  }
  std::vector<uint8_t> rows(missing.size() * k_);
  for (size_t m = 0; m < missing.size(); ++m) {
    std::memcpy(rows.data() + m * k_, inv.data() + missing[m] * k_, k_);
  }
  std::vector<uint8_t> tables(static_cast<size_t>(32) * k_ * missing.size());
  ec_init_tables(static_cast<int>(k_), static_cast<int>(missing.size()), rows.data(),
                 tables.data());
  // Pieces that lie wholly inside the image are recovered in place; the last stripe's
  // partial or padding pieces through a scratch piece.
  std::vector<std::byte> scratch;
  std::vector<uint8_t*> src(k_), dst(missing.size());
  for (uint64_t s = 0; s < stripes; ++s) {
    for (uint32_t r = 0; r < k_; ++r) {
      src[r] =
          reinterpret_cast<uint8_t*>(const_cast<std::byte*>(fragments[use[r]].data())) + s * piece;
    }
    bool partial = false;
    for (size_t m = 0; m < missing.size(); ++m) {
      uint64_t n = 0;
      std::byte* p = image_piece(s, missing[m], &n);
      if (n < piece) {
        partial = true;
        if (scratch.empty()) scratch.resize(missing.size() * piece);
        p = scratch.data() + m * piece;
      }
      dst[m] = reinterpret_cast<uint8_t*>(p);
    }
    Multiply(k_, static_cast<uint32_t>(missing.size()), tables.data(), src, dst, piece);
    if (!partial) continue;
    for (size_t m = 0; m < missing.size(); ++m) {
      uint64_t n = 0;
      std::byte* p = image_piece(s, missing[m], &n);
      if (n < piece && n > 0) std::memcpy(p, scratch.data() + m * piece, n);
    }
  }
  return Status::OK();
}

}  // namespace safepoint::replica
