// Extras encoding (docs/format.md, "Extras").
#include "safepoint/extras.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <unordered_set>

#include "base/bytes.h"
#include "image/name_set.h"

namespace safepoint {

using internal::AppendLE;
using internal::LoadLE;

namespace {

enum Tag : uint8_t {
  kNone = 0x00,
  kFalse = 0x01,
  kTrue = 0x02,
  kInt64 = 0x03,
  kBigInt = 0x04,
  kFloat = 0x05,
  kStr = 0x06,
  kBytes = 0x07,
  kList = 0x08,
  kTuple = 0x09,
  kDict = 0x0A,
  kTensor = 0x0B,
  kPickled = 0x0C,
};

constexpr uint32_t kMaxBigIntBytes = 1 << 20;

bool IsCanonicalBigInt(const std::string& b) {
  if (b.size() < 9) return false;  // would fit in int64
  const auto top = static_cast<uint8_t>(b.back());
  const auto next = static_cast<uint8_t>(b[b.size() - 2]);
  if (top == 0x00 && !(next & 0x80)) return false;  // redundant sign byte
  if (top == 0xFF && (next & 0x80)) return false;
  return true;
}

class Encoder {
 public:
  Status Encode(const Value& v, size_t depth) {
    if (depth > kMaxExtrasDepth) {
      return InvalidArgument("state is nested more than " + std::to_string(kMaxExtrasDepth) +
                             " levels deep");
    }
    return std::visit([&](const auto& x) { return Put(x, depth); }, v.v);
  }
  std::string out;

 private:
  Status Put(const std::monostate&, size_t) {
    out.push_back(kNone);
    return Status::OK();
  }
  Status Put(bool b, size_t) {
    out.push_back(b ? kTrue : kFalse);
    return Status::OK();
  }
  Status Put(int64_t i, size_t) {
    out.push_back(kInt64);
    AppendLE<int64_t>(out, i);
    return Status::OK();
  }
  Status Put(const BigInt& b, size_t) {
    if (!IsCanonicalBigInt(b.bytes) || b.bytes.size() > kMaxBigIntBytes) {
      return InvalidArgument("integer is not in canonical big-integer form or too large");
    }
    out.push_back(kBigInt);
    AppendLE<uint32_t>(out, static_cast<uint32_t>(b.bytes.size()));
    out += b.bytes;
    return Status::OK();
  }
  Status Put(double d, size_t) {
    out.push_back(kFloat);
    AppendLE<double>(out, d);
    return Status::OK();
  }
  Status Put(const std::string& s, size_t) {
    if (s.size() > UINT32_MAX) return InvalidArgument("string longer than 4 GiB");
    if (!internal::IsValidUtf8(s)) return InvalidArgument("string is not valid UTF-8");
    out.push_back(kStr);
    AppendLE<uint32_t>(out, static_cast<uint32_t>(s.size()));
    out += s;
    return Status::OK();
  }
  // A tag, a u64 length and the bytes.
  Status PutBlob(Tag tag, const std::string& data) {
    out.push_back(tag);
    AppendLE<uint64_t>(out, data.size());
    out += data;
    return Status::OK();
  }
  Status Put(const Bytes& b, size_t) { return PutBlob(kBytes, b.data); }
  Status PutItems(Tag tag, const ValueList& items, size_t depth) {
    if (items.size() > UINT32_MAX) return InvalidArgument("sequence too long");
    out.push_back(tag);
    AppendLE<uint32_t>(out, static_cast<uint32_t>(items.size()));
    for (const Value& v : items) SP_RETURN_IF_ERROR(Encode(v, depth + 1));
    return Status::OK();
  }
  Status Put(const List& l, size_t depth) { return PutItems(kList, l.items, depth); }
  Status Put(const Tuple& t, size_t depth) { return PutItems(kTuple, t.items, depth); }
  Status Put(const Dict& d, size_t depth) {
    if (d.items.size() > UINT32_MAX) return InvalidArgument("dict too large");
    out.push_back(kDict);
    AppendLE<uint32_t>(out, static_cast<uint32_t>(d.items.size()));
    for (const auto& [k, v] : d.items) {
      if (!std::holds_alternative<std::string>(k.v) && !std::holds_alternative<int64_t>(k.v) &&
          !std::holds_alternative<BigInt>(k.v)) {
        return InvalidArgument("dict keys must be str or int");
      }
      SP_RETURN_IF_ERROR(Encode(k, depth + 1));
      SP_RETURN_IF_ERROR(Encode(v, depth + 1));
    }
    return Status::OK();
  }
  Status Put(const Pickled& p, size_t) { return PutBlob(kPickled, p.data); }
  Status Put(const TensorRef& t, size_t) {
    out.push_back(kTensor);
    AppendLE<uint64_t>(out, t.index);
    AppendLE<uint8_t>(out, t.kind);
    return Status::OK();
  }
};

class Decoder {
 public:
  Decoder(std::span<const std::byte> d, uint64_t tensors, std::string_view source)
      : d_(d), tensors_(tensors), source_(source) {}

  Result<Value> Decode(size_t depth) {
    if (depth > kMaxExtrasDepth) return Bad("nested too deeply");
    if (pos_ >= d_.size()) return Bad("truncated");
    const auto tag = static_cast<uint8_t>(d_[pos_++]);
    switch (tag) {
      case kNone:
        return Value();
      case kFalse:
        return Value(false);
      case kTrue:
        return Value(true);
      case kInt64: {
        SP_ASSIGN_OR_RETURN(auto p, Take(8));
        return Value(LoadLE<int64_t>(p));
      }
      case kBigInt: {
        SP_ASSIGN_OR_RETURN(auto p, Take(4));
        const uint32_t n = LoadLE<uint32_t>(p);
        if (n > kMaxBigIntBytes) return Bad("integer too large");
        SP_ASSIGN_OR_RETURN(auto q, Take(n));
        BigInt b{std::string(reinterpret_cast<const char*>(q), n)};
        if (!IsCanonicalBigInt(b.bytes)) return Bad("non-canonical big integer");
        return Value(std::move(b));
      }
      case kFloat: {
        SP_ASSIGN_OR_RETURN(auto p, Take(8));
        return Value(LoadLE<double>(p));
      }
      case kStr: {
        SP_ASSIGN_OR_RETURN(auto p, Take(4));
        const uint32_t n = LoadLE<uint32_t>(p);
        SP_ASSIGN_OR_RETURN(auto q, Take(n));
        std::string s(reinterpret_cast<const char*>(q), n);
        if (!internal::IsValidUtf8(s)) return Bad("string is not valid UTF-8");
        return Value(std::move(s));
      }
      case kBytes: {
        SP_ASSIGN_OR_RETURN(auto p, Take(8));
        const uint64_t n = LoadLE<uint64_t>(p);
        SP_ASSIGN_OR_RETURN(auto q, Take(n));
        return Value(Bytes{std::string(reinterpret_cast<const char*>(q), n)});
      }
      case kList:
      case kTuple: {
        SP_ASSIGN_OR_RETURN(auto items, Items(depth, 1));
        if (tag == kList) return Value(List{std::move(items)});
        return Value(Tuple{std::move(items)});
      }
      case kDict: {
        SP_ASSIGN_OR_RETURN(auto p, Take(4));
        const uint32_t n = LoadLE<uint32_t>(p);
        if (n > (d_.size() - pos_) / 2) return Bad("dict count exceeds the data");
        Dict d;
        d.items.reserve(n);
        // String keys are checked as views of the keys in d.items (reserved: they stay put).
        internal::NameSet str_keys(n);
        std::unordered_set<std::string> big_keys;
        std::unordered_set<int64_t> int_keys;
        for (uint32_t i = 0; i < n; ++i) {
          SP_ASSIGN_OR_RETURN(Value k, Decode(depth + 1));
          SP_ASSIGN_OR_RETURN(Value v, Decode(depth + 1));
          const Value& key = d.items.emplace_back(std::move(k), std::move(v)).first;
          bool fresh;
          if (auto* s = std::get_if<std::string>(&key.v)) {
            fresh = str_keys.Insert(*s);
          } else if (auto* x = std::get_if<int64_t>(&key.v)) {
            fresh = int_keys.insert(*x).second;
          } else if (auto* b = std::get_if<BigInt>(&key.v)) {
            fresh = big_keys.insert(b->bytes).second;
          } else {
            return Bad("dict key is not str or int");
          }
          if (!fresh) return Bad("duplicate dict key");
        }
        return Value(std::move(d));
      }
      case kPickled: {
        SP_ASSIGN_OR_RETURN(auto p, Take(8));
        const uint64_t n = LoadLE<uint64_t>(p);
        SP_ASSIGN_OR_RETURN(auto q, Take(n));
        return Value(Pickled{std::string(reinterpret_cast<const char*>(q), n)});
      }
      case kTensor: {
        SP_ASSIGN_OR_RETURN(auto p, Take(9));
        TensorRef t{LoadLE<uint64_t>(p), LoadLE<uint8_t>(p + 8)};
        if (t.index >= tensors_) return Bad("tensor reference out of range");
        if (t.kind > 2) return Bad("unknown tensor kind");
        return Value(t);
      }
      default: {
        char buf[48];
        std::snprintf(buf, sizeof(buf), "unknown tag 0x%02x at byte %zu", tag, pos_ - 1);
        return Bad(buf);
      }
    }
  }

  size_t pos() const { return pos_; }
  Status Bad(const std::string& what) const {
    return Corruption(std::string(source_) + ": corrupt extras: " + what);
  }

 private:
  Result<const std::byte*> Take(uint64_t n) {
    if (n > d_.size() - pos_) return Bad("truncated");
    const std::byte* p = d_.data() + pos_;
    pos_ += n;
    return p;
  }
  Result<ValueList> Items(size_t depth, size_t min_item) {
    SP_ASSIGN_OR_RETURN(auto p, Take(4));
    const uint32_t n = LoadLE<uint32_t>(p);
    if (n > (d_.size() - pos_) / min_item) return Bad("count exceeds the data");
    ValueList items;
    items.reserve(n);
    for (uint32_t i = 0; i < n; ++i) {
      SP_ASSIGN_OR_RETURN(Value v, Decode(depth + 1));
      items.push_back(std::move(v));
    }
    return items;
  }

  std::span<const std::byte> d_;
  uint64_t tensors_;
  std::string_view source_;
  size_t pos_ = 0;
};

void Repr(const Value& v, std::string& out, size_t max) {
  if (out.size() > max) return;
  struct V {
    std::string& out;
    size_t max;
    void operator()(const std::monostate&) { out += "None"; }
    void operator()(bool b) { out += b ? "True" : "False"; }
    void operator()(int64_t i) { out += std::to_string(i); }
    void operator()(const BigInt& b) {
      out += "<int of " + std::to_string(b.bytes.size() * 8) + " bits>";
    }
    void operator()(double d) {
      if (std::isnan(d)) {
        out += "nan";
      } else if (std::isinf(d)) {
        out += d > 0 ? "inf" : "-inf";
      } else {
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%.17g", d);
        std::string s = buf;
        if (s.find_first_of(".e") == std::string::npos) s += ".0";
        out += s;
      }
    }
    void operator()(const std::string& s) {
      out += '\'';
      for (char c : s) {
        if (c == '\'' || c == '\\') out += '\\';
        if (c == '\n') {
          out += "\\n";
          continue;
        }
        out += c;
      }
      out += '\'';
    }
    void operator()(const Bytes& b) {
      out += "<bytes of length " + std::to_string(b.data.size()) + ">";
    }
    void Seq(const ValueList& items, char open, char close, bool tuple) {
      out += open;
      for (size_t i = 0; i < items.size() && out.size() <= max; ++i) {
        if (i) out += ", ";
        Repr(items[i], out, max);
      }
      if (tuple && items.size() == 1) out += ',';
      out += close;
    }
    void operator()(const List& l) { Seq(l.items, '[', ']', false); }
    void operator()(const Tuple& t) { Seq(t.items, '(', ')', true); }
    void operator()(const Dict& d) {
      out += '{';
      for (size_t i = 0; i < d.items.size() && out.size() <= max; ++i) {
        if (i) out += ", ";
        Repr(d.items[i].first, out, max);
        out += ": ";
        Repr(d.items[i].second, out, max);
      }
      out += '}';
    }
    void operator()(const TensorRef& t) { out += "<tensor #" + std::to_string(t.index) + ">"; }
    void operator()(const Pickled& p) {
      out += "<pickled object of " + std::to_string(p.data.size()) + " bytes>";
    }
  };
  std::visit(V{out, max}, v.v);
}

}  // namespace

bool Value::operator==(const Value& o) const {
  if (v.index() != o.v.index()) return false;
  if (const double* a = std::get_if<double>(&v)) {
    const double b = std::get<double>(o.v);
    return std::memcmp(a, &b, sizeof(double)) == 0;  // bit-exact: nan == nan, -0.0 != 0.0
  }
  return v == o.v;
}

Result<std::string> EncodeExtras(const Value& value) {
  Encoder e;
  SP_RETURN_IF_ERROR(e.Encode(value, 0));
  return std::move(e.out);
}

Result<Value> DecodeExtras(std::span<const std::byte> data, uint64_t tensor_count,
                           std::string_view source) {
  Decoder d(data, tensor_count, source);
  SP_ASSIGN_OR_RETURN(Value v, d.Decode(0));
  if (d.pos() != data.size()) return d.Bad("trailing bytes after the value");
  return v;
}

std::string FormatValue(const Value& value, size_t max_chars) {
  std::string out;
  Repr(value, out, max_chars);
  if (out.size() > max_chars) {
    out.resize(max_chars);
    out += "...";
  }
  return out;
}

}  // namespace safepoint
