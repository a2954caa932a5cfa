// Extras: the safe, self-describing encoding of a shard's non-tensor state (docs/format.md).
//
// A Value is a tree of None, bool, int (arbitrary size), float, str, bytes, list, tuple, dict
// (keys are str or int, insertion order kept) and tensor references (an index into the image's
// tensor table; the whole state tree of a shard is stored this way, with its tensors replaced by
// references). Decoding never trusts its input: lengths, counts, nesting depth, UTF-8 and key
// types are checked, and any violation is a Corruption error.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "safepoint/status.h"

namespace safepoint {

inline constexpr size_t kMaxExtrasDepth = 256;

struct Value;
using ValueList = std::vector<Value>;
using ValueDict = std::vector<std::pair<Value, Value>>;

struct BigInt {
  // Two's complement, little-endian, minimal length (at least 1 byte).
  std::string bytes;
  bool operator==(const BigInt&) const = default;
};

struct TensorRef {
  uint64_t index = 0;  // into the image's tensor table
  uint8_t kind = 0;    // what the leaf was: 0 torch.Tensor, 1 numpy.ndarray, 2 numpy scalar
  bool operator==(const TensorRef&) const = default;
};

struct List {
  ValueList items;
  bool operator==(const List& o) const;  // defined below, once Value is complete
};
struct Tuple {
  ValueList items;
  bool operator==(const Tuple& o) const;  // defined below, once Value is complete
};
struct Dict {
  ValueDict items;
  bool operator==(const Dict& o) const;  // defined below, once Value is complete
};
struct Bytes {
  std::string data;
  bool operator==(const Bytes&) const = default;
};

// An arbitrary Python object, pickled; only written and read when the user allows pickle.
struct Pickled {
  std::string data;
  bool operator==(const Pickled&) const = default;
};

struct Value {
  using Variant = std::variant<std::monostate, bool, int64_t, BigInt, double, std::string, Bytes,
                               List, Tuple, Dict, TensorRef, Pickled>;
  Variant v;

  Value() = default;
  template <typename T>
  Value(T x) : v(std::move(x)) {}  // NOLINT
  bool operator==(const Value& o) const;
};

inline bool List::operator==(const List& o) const { return items == o.items; }
inline bool Tuple::operator==(const Tuple& o) const { return items == o.items; }
inline bool Dict::operator==(const Dict& o) const { return items == o.items; }

// Encodes `value` to bytes. Fails with InvalidArgument for a dict key that is not str or int,
// nesting deeper than kMaxExtrasDepth, or a string that is not valid UTF-8.
Result<std::string> EncodeExtras(const Value& value);

// Decodes bytes produced by EncodeExtras. `tensor_count` bounds tensor references.
Result<Value> DecodeExtras(std::span<const std::byte> data, uint64_t tensor_count,
                           std::string_view source);

// A readable, Python-like rendering for the CLI ("{'lr': 0.001, 'step': 10}").
std::string FormatValue(const Value& value, size_t max_chars = 4096);

}  // namespace safepoint
