// Tags, step references, step headers and step diffs (versions.h; docs/format.md, "Tags").
#include "checkpoint/versions.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <thread>

#include "base/bytes.h"
#include "base/clock.h"
#include "base/crc32c.h"

namespace safepoint {

using internal::AppendLE;
using internal::Crc32c;
using internal::LoadLE;

namespace {

constexpr char kTagMagic[8] = {'S', 'P', 'T', 'A', 'G', '\0', '\0', '\0'};
constexpr uint32_t kTagVersion = 1;
constexpr size_t kTagFixed = 32;  // before the name
constexpr std::string_view kTagPrefix = "tags/";

bool AllDigits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::optional<uint64_t> ParseStepNumber(std::string_view s) {
  if (s.starts_with("step-")) s.remove_prefix(5);
  if (!AllDigits(s) || s.size() > 20) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (std::numeric_limits<uint64_t>::max() - d) / 10) return std::nullopt;
    v = v * 10 + d;
  }
  return v;
}

Result<std::string> ReadWholeObject(Storage& storage, std::string_view name, uint64_t limit) {
  SP_ASSIGN_OR_RETURN(auto object, storage.Open(name));
  const uint64_t size = object->size();
  if (size > limit) {
    return Corruption(storage.Describe(name) + ": " + std::to_string(size) +
                      " bytes, more than a tag can be");
  }
  std::string data(size, '\0');
  SP_RETURN_IF_ERROR(object->ReadAt(0, {reinterpret_cast<std::byte*>(data.data()), size}));
  return data;
}

std::string CommittedList(CheckpointStore& store) {
  auto committed = store.ListCommitted();
  if (!committed.ok()) return "";
  if (committed->empty()) return " (no committed steps)";
  std::string m = " (committed steps:";
  for (const auto& c : *committed) m += " " + std::to_string(c.step);
  return m + ")";
}

}  // namespace

Status ValidateTagName(std::string_view name) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument("tag name '" + std::string(name) + "' is invalid: " + why);
  };
  if (name.empty() || name.size() > kMaxTagNameLength) {
    return bad("use 1.." + std::to_string(kMaxTagNameLength) + " characters");
  }
  for (char c : name) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return bad("use only [A-Za-z0-9._-]");
  }
  if (name.front() == '.' || name.front() == '-') return bad("it must not start with '.' or '-'");
  if (ParseStepNumber(name)) return bad("a number or step-<number> is a step, not a tag");
  if (name.find(".tmp.") != std::string_view::npos) return bad("'.tmp.' is reserved");
  return Status::OK();
}

std::string TagObjectName(std::string_view name) {
  return std::string(kTagPrefix) + std::string(name);
}

std::string EncodeTag(const Tag& tag) {
  std::string out(kTagMagic, sizeof(kTagMagic));
  AppendLE<uint32_t>(out, kTagVersion);
  AppendLE<uint32_t>(out, static_cast<uint32_t>(tag.name.size()));
  AppendLE<uint64_t>(out, tag.step);
  AppendLE<int64_t>(out, tag.create_time_ns);
  out += tag.name;
  AppendLE<uint32_t>(out, Crc32c(0, out.data(), out.size()));
  return out;
}

Result<Tag> DecodeTag(std::span<const std::byte> d, std::string_view source) {
  auto bad = [&](const std::string& why) {
    return Corruption(std::string(source) + ": corrupt tag: " + why);
  };
  if (d.size() < kTagFixed + 4) return bad("truncated");
  if (std::memcmp(d.data(), kTagMagic, sizeof(kTagMagic)) != 0) return bad("bad magic");
  if (Crc32c(0, d.data(), d.size() - 4) != LoadLE<uint32_t>(&d[d.size() - 4])) {
    return bad("checksum mismatch");
  }
  if (LoadLE<uint32_t>(&d[8]) != kTagVersion) {
    return bad("unsupported version " + std::to_string(LoadLE<uint32_t>(&d[8])));
  }
  const uint32_t n = LoadLE<uint32_t>(&d[12]);
  if (d.size() != kTagFixed + n + 4) return bad("size does not match the name's length");
  Tag tag;
  tag.step = LoadLE<uint64_t>(&d[16]);
  tag.create_time_ns = LoadLE<int64_t>(&d[24]);
  tag.name.assign(reinterpret_cast<const char*>(&d[kTagFixed]), n);
  if (!ValidateTagName(tag.name).ok()) return bad("invalid name");
  return tag;
}

Result<Tag> ReadTag(CheckpointStore& store, std::string_view name) {
  SP_RETURN_IF_ERROR(ValidateTagName(name));
  Storage& storage = store.storage();
  const std::string object = TagObjectName(name);
  auto data = ReadWholeObject(storage, object, kTagFixed + kMaxTagNameLength + 4);
  if (!data.ok()) {
    if (data.status().code() != StatusCode::kNotFound) return data.status();
    std::string m = storage.uri() + ": no tag '" + std::string(name) + "'";
    auto tags = ListTags(store);
    if (tags.ok()) {
      if (tags->empty()) {
        m += " (no tags)";
      } else {
        m += " (tags:";
        for (const Tag& t : *tags) m += " " + t.name;
        m += ")";
      }
    }
    return NotFound(m);
  }
  SP_ASSIGN_OR_RETURN(Tag tag,
                      DecodeTag({reinterpret_cast<const std::byte*>(data->data()), data->size()},
                                storage.Describe(object)));
  if (tag.name != name) {
    return Corruption(storage.Describe(object) + ": the tag record names '" + tag.name + "'");
  }
  return tag;
}

Status WriteTag(CheckpointStore& store, Tag tag, bool replace) {
  SP_RETURN_IF_ERROR(ValidateTagName(tag.name));
  Storage& storage = store.storage();
  if (auto record = store.ReadCommit(tag.step); !record.ok()) {
    if (record.status().code() == StatusCode::kNotFound) {
      return NotFound(storage.uri() + ": cannot tag step " + std::to_string(tag.step) +
                      ": it is not committed" + CommittedList(store));
    }
    return record.status();
  }
  if (tag.create_time_ns == 0) {
    tag.create_time_ns = UnixNanos();
  }
  const std::string object = TagObjectName(tag.name);
  const std::string bytes = EncodeTag(tag);
  auto write = [&]() -> Status {
    SP_ASSIGN_OR_RETURN(auto w, storage.Create(object, bytes.size()));
    SP_RETURN_IF_ERROR(
        w->WriteAt(0, {reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()}));
    return replace ? w->Publish() : w->PublishIfAbsent();
  };
  Status s = write();
  if (s.code() != StatusCode::kAlreadyExists) return s;
  // PublishIfAbsent found a tag of that name: the same step is fine (idempotent).
  SP_ASSIGN_OR_RETURN(Tag existing, ReadTag(store, tag.name));
  if (existing.step == tag.step) return Status::OK();
  return AlreadyExists(storage.uri() + ": tag '" + tag.name + "' already names step " +
                       std::to_string(existing.step) + " (delete it first, or replace it)");
}

Result<std::vector<std::string>> MirrorTags(CheckpointStore& from, CheckpointStore& to) {
  std::vector<std::string> skipped;
  SP_ASSIGN_OR_RETURN(std::vector<Tag> tags, ListTags(from, &skipped));
  std::vector<std::string> written;
  if (tags.empty()) return written;
  std::vector<std::string> damaged;  // damaged tags of `to` are overwritten by `from`'s
  SP_ASSIGN_OR_RETURN(std::vector<Tag> there, ListTags(to, &damaged));
  for (const Tag& t : tags) {
    const bool same = std::any_of(there.begin(), there.end(), [&](const Tag& d) {
      return d.name == t.name && d.step == t.step;
    });
    if (same) continue;
    Status s = WriteTag(to, t, /*replace=*/true);
    if (s.code() == StatusCode::kNotFound) continue;  // its step is not committed in `to`
    SP_RETURN_IF_ERROR(s);
    written.push_back(t.name);
  }
  return written;
}

Status DeleteTag(CheckpointStore& store, std::string_view name) {
  SP_ASSIGN_OR_RETURN(Tag tag, ReadTag(store, name));  // NotFound naming the tags there are
  return store.storage().Delete(TagObjectName(tag.name));
}

Result<std::vector<Tag>> ListTags(CheckpointStore& store, std::vector<std::string>* problems) {
  Storage& storage = store.storage();
  SP_ASSIGN_OR_RETURN(auto objects, storage.List(kTagPrefix));
  std::vector<Tag> out;
  for (const ObjectInfo& o : objects) {
    const std::string_view name = std::string_view(o.name).substr(kTagPrefix.size());
    if (name.find('/') != std::string_view::npos || !ValidateTagName(name).ok()) continue;
    Result<Tag> tag = Status::OK();
    auto data = ReadWholeObject(storage, o.name, kTagFixed + kMaxTagNameLength + 4);
    if (data.ok()) {
      tag = DecodeTag({reinterpret_cast<const std::byte*>(data->data()), data->size()},
                      storage.Describe(o.name));
      if (tag.ok() && tag->name != name) {
        tag = Corruption(storage.Describe(o.name) + ": the tag record names '" + tag->name + "'");
      }
    } else {
      tag = data.status();
    }
    if (!tag.ok()) {
      if (tag.status().code() == StatusCode::kNotFound) continue;  // deleted meanwhile
      if (problems == nullptr) return tag.status();
      problems->push_back(tag.status().ToString());
      continue;
    }
    out.push_back(std::move(tag).value());
  }
  return out;
}

Result<std::set<uint64_t>> TaggedSteps(CheckpointStore& store) {
  SP_ASSIGN_OR_RETURN(auto tags, ListTags(store));
  std::set<uint64_t> steps;
  for (const Tag& t : tags) steps.insert(t.step);
  return steps;
}

Result<uint64_t> ResolveStep(CheckpointStore& store, std::string_view ref) {
  if (auto step = ParseStepNumber(ref)) {
    auto record = store.ReadCommit(*step);
    if (record.ok()) return *step;
    if (record.status().code() == StatusCode::kNotFound) {
      return NotFound(store.storage().uri() + ": step " + std::to_string(*step) +
                      " is not committed" + CommittedList(store));
    }
    return record.status();
  }
  if (Status s = ValidateTagName(ref); !s.ok()) {
    return InvalidArgument("'" + std::string(ref) +
                           "' is neither a step (N, step-N) nor a tag name: " + s.message());
  }
  SP_ASSIGN_OR_RETURN(Tag tag, ReadTag(store, ref));
  auto record = store.ReadCommit(tag.step);
  if (!record.ok() && record.status().code() == StatusCode::kNotFound) {
    return NotFound(store.storage().uri() + ": tag '" + tag.name + "' names step " +
                    std::to_string(tag.step) + ", which is no longer committed");
  }
  SP_RETURN_IF_ERROR(record.status());
  return tag.step;
}

Result<ImageMeta> ReadStepHeader(CheckpointStore& store, const CommitRecord& commit) {
  Storage& storage = store.storage();
  const std::string name = ImageObjectName(commit, 0);
  SP_ASSIGN_OR_RETURN(auto object, storage.Open(name));
  std::vector<std::byte> header(kImageHeaderSize);
  SP_RETURN_IF_ERROR(object->ReadAt(0, header));
  SP_ASSIGN_OR_RETURN(auto parsed, ParseImageHeader(header, storage.Describe(name)));
  if (commit.images.empty() || parsed.second.header_crc != commit.images[0].header_crc) {
    return Corruption(storage.Describe(name) + ": not the image the COMMIT record names");
  }
  return std::move(parsed.first);
}

// ---------------------------------------------------------------------------------------------
// Diff

std::string_view DiffKindName(TensorDiff::Kind kind) {
  switch (kind) {
    case TensorDiff::Kind::kSame:
      return "same";
    case TensorDiff::Kind::kChanged:
      return "changed";
    case TensorDiff::Kind::kAdded:
      return "added";
    case TensorDiff::Kind::kRemoved:
      return "removed";
    case TensorDiff::Kind::kReshaped:
      return "reshaped";
  }
  return "?";
}

namespace {

// One stored box of a tensor: which rank's image and entry hold it.
struct Piece {
  size_t image = 0;  // index into the step's metadata (rank)
  uint64_t data_offset = 0;
  std::vector<uint64_t> shape, offset;
};
struct StepTensor {
  DType dtype = DType::kFloat32;
  std::vector<uint64_t> global_shape;
  std::vector<Piece> pieces;  // one per distinct box (replicas once)
};
struct StepView {
  std::vector<CheckpointStore::Metadata> images;
  std::map<std::string, StepTensor> tensors;
};

Result<StepView> OpenStep(CheckpointStore& store, uint64_t step) {
  SP_ASSIGN_OR_RETURN(CommitRecord commit, store.ReadCommit(step));
  StepView view;
  std::set<std::string> seen_boxes;
  for (uint32_t r = 0; r < commit.world_size; ++r) {
    SP_ASSIGN_OR_RETURN(auto md, store.ReadMetadata(commit, r));
    view.images.push_back(std::move(md));
    const auto& entries = view.images.back().tensors;
    for (const TensorEntry& e : entries) {
      if (e.spec.elsewhere) continue;
      if (!seen_boxes.insert(ReplicaKey(e.spec)).second) continue;  // a replica
      StepTensor& t = view.tensors[e.spec.name];
      const bool whole = e.spec.global_shape.empty();
      std::vector<uint64_t> gshape = whole ? e.spec.shape : e.spec.global_shape;
      if (t.pieces.empty()) {
        t.dtype = e.spec.dtype;
        t.global_shape = gshape;
      } else if (t.dtype != e.spec.dtype || t.global_shape != gshape) {
        return Corruption(store.storage().uri() + ": step " + std::to_string(step) +
                          ": the shards of tensor '" + e.spec.name + "' disagree on its dtype " +
                          "or global shape");
      }
      Piece p;
      p.image = r;
      p.data_offset = e.offset;
      p.shape = e.spec.shape;
      p.offset = whole ? std::vector<uint64_t>(e.spec.shape.size(), 0) : e.spec.global_offset;
      t.pieces.push_back(std::move(p));
    }
  }
  return view;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

// Numeric value of component `k` of an element (complex: two components), for max_abs.
double ComponentValue(DType dtype, const std::byte* p, int k) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kComplex64:
      return std::bit_cast<float>(LoadLE<uint32_t>(p + 4 * k));
    case DType::kFloat64:
    case DType::kComplex128:
      return std::bit_cast<double>(LoadLE<uint64_t>(p + 8 * k));
    case DType::kFloat16:
      return HalfToFloat(LoadLE<uint16_t>(p));
    case DType::kBFloat16:
      return std::bit_cast<float>(static_cast<uint32_t>(LoadLE<uint16_t>(p)) << 16);
    case DType::kInt8:
      return static_cast<int8_t>(LoadLE<uint8_t>(p));
    case DType::kInt16:
      return static_cast<int16_t>(LoadLE<uint16_t>(p));
    case DType::kInt32:
      return static_cast<int32_t>(LoadLE<uint32_t>(p));
    case DType::kInt64:
      return static_cast<double>(static_cast<int64_t>(LoadLE<uint64_t>(p)));
    case DType::kUInt8:
    case DType::kBool:
      return LoadLE<uint8_t>(p);
    case DType::kUInt16:
      return LoadLE<uint16_t>(p);
    case DType::kUInt32:
      return LoadLE<uint32_t>(p);
    case DType::kUInt64:
      return static_cast<double>(LoadLE<uint64_t>(p));
    default:
      return 0;
  }
}

bool HasMaxAbs(DType d) {
  return d != DType::kFloat8E4M3FN && d != DType::kFloat8E5M2 && d != DType::kFloat8E4M3FNUZ &&
         d != DType::kFloat8E5M2FNUZ && d != DType::kFloat8E8M0FNU;
}

// Counts the elements whose bytes differ and the largest |b - a| of those, one dtype at a time
// (Bits: the element as an integer; value: its numeric value).
template <typename Bits, typename Value>
void CompareTyped(const std::byte* a, const std::byte* b, uint64_t n, Value value,
                  TensorDiff* out) {
  uint64_t changed = 0;
  double m = out->max_abs.value_or(0);
  for (uint64_t i = 0; i < n; ++i) {
    Bits x, y;
    std::memcpy(&x, a + i * sizeof(Bits), sizeof(Bits));
    std::memcpy(&y, b + i * sizeof(Bits), sizeof(Bits));
    if (x == y) continue;
    ++changed;
    double d = std::fabs(value(y) - value(x));
    if (!std::isfinite(d)) d = std::numeric_limits<double>::infinity();  // NaN/inf involved
    m = std::max(m, d);
  }
  out->changed += changed;
  if (changed > 0) out->max_abs = m;
}

void CompareElements(DType dtype, const std::byte* a, const std::byte* b, uint64_t n,
                     TensorDiff* out) {
  switch (dtype) {
    case DType::kFloat32:
      return CompareTyped<uint32_t>(
          a, b, n, [](uint32_t v) { return double(std::bit_cast<float>(v)); }, out);
    case DType::kBFloat16:
      return CompareTyped<uint16_t>(
          a, b, n, [](uint16_t v) { return double(std::bit_cast<float>(uint32_t(v) << 16)); }, out);
    case DType::kFloat16:
      return CompareTyped<uint16_t>(
          a, b, n, [](uint16_t v) { return double(HalfToFloat(v)); }, out);
    case DType::kFloat64:
      return CompareTyped<uint64_t>(
          a, b, n, [](uint64_t v) { return std::bit_cast<double>(v); }, out);
    default:
      break;
  }
  const size_t es = DTypeSize(dtype);
  const int components = (dtype == DType::kComplex64 || dtype == DType::kComplex128) ? 2 : 1;
  const bool numeric = HasMaxAbs(dtype);
  for (uint64_t i = 0; i < n; ++i) {
    const std::byte* pa = a + i * es;
    const std::byte* pb = b + i * es;
    if (std::memcmp(pa, pb, es) == 0) continue;
    ++out->changed;
    if (!numeric) continue;
    double m = out->max_abs.value_or(0);
    for (int k = 0; k < components; ++k) {
      const double va = ComponentValue(dtype, pa, k), vb = ComponentValue(dtype, pb, k);
      double d = std::fabs(vb - va);
      if (!std::isfinite(d)) d = std::numeric_limits<double>::infinity();  // NaN/inf involved
      m = std::max(m, d);
    }
    out->max_abs = m;
  }
}

// Runs of elements to compare, gathered across tensors into one window per step and read with
// one ReadRanges per step (a small tensor alone would cost the read of its whole chunk).
class DiffBatch {
 public:
  DiffBatch(CheckpointStore& sa, const StepView& va, CheckpointStore& sb, const StepView& vb,
            const DiffOptions& opt, uint64_t total)
      : sa_(sa), va_(va), sb_(sb), vb_(vb), opt_(opt), total_(total) {
    // Sized once: the ranges point into them until the window is read.
    buf_a_.resize(std::max<uint64_t>(std::min(opt.window_bytes, total), 16));
    buf_b_.resize(buf_a_.size());
  }

  // Compares `n` elements of `dtype` at byte `off_a` of image `ia` of A and `off_b` of image
  // `ib` of B, into `out` (once the window is read).
  Status Add(size_t ia, size_t ib, uint64_t off_a, uint64_t off_b, uint64_t n, DType dtype,
             TensorDiff* out) {
    const uint64_t es = DTypeSize(dtype);
    if (!segments_.empty() && (ia != ia_ || ib != ib_)) SP_RETURN_IF_ERROR(Flush());
    ia_ = ia, ib_ = ib;
    while (n > 0) {
      uint64_t room = (buf_a_.size() - pending_) / es;
      if (room == 0) {
        SP_RETURN_IF_ERROR(Flush());
        room = buf_a_.size() / es;
      }
      const uint64_t k = std::min(n, room);
      ra_.push_back({off_a, k * es, buf_a_.data() + pending_});
      rb_.push_back({off_b, k * es, buf_b_.data() + pending_});
      segments_.push_back({out, dtype, pending_, k});
      pending_ += k * es;
      off_a += k * es, off_b += k * es, n -= k;
    }
    return Status::OK();
  }

  Status Flush() {
    if (segments_.empty()) return Status::OK();
    // The two steps are read at once (each ReadRanges reads its chunks in parallel too).
    Status status_b;
    std::thread read_b([&] { status_b = sb_.ReadRanges(vb_.images[ib_], rb_); });
    Status status_a = sa_.ReadRanges(va_.images[ia_], ra_);
    read_b.join();
    SP_RETURN_IF_ERROR(status_a);
    SP_RETURN_IF_ERROR(status_b);
    for (const Segment& g : segments_) {
      CompareElements(g.dtype, buf_a_.data() + g.offset, buf_b_.data() + g.offset, g.n, g.out);
    }
    done_ += pending_;
    if (opt_.progress) opt_.progress(done_, total_);
    ra_.clear(), rb_.clear(), segments_.clear();
    pending_ = 0;
    return Status::OK();
  }

 private:
  struct Segment {
    TensorDiff* out;
    DType dtype;
    uint64_t offset, n;
  };
  CheckpointStore& sa_;
  const StepView& va_;
  CheckpointStore& sb_;
  const StepView& vb_;
  const DiffOptions& opt_;
  const uint64_t total_;
  uint64_t done_ = 0, pending_ = 0;  // bytes
  size_t ia_ = 0, ib_ = 0;
  std::vector<std::byte> buf_a_, buf_b_;
  std::vector<CheckpointStore::Range> ra_, rb_;
  std::vector<Segment> segments_;
};

// Adds the overlap of piece `pa` (of A) and `pb` (of B) to the batch, in runs that are
// contiguous in both.
Status CompareOverlap(DiffBatch& batch, const Piece& pa, const Piece& pb, DType dtype,
                      TensorDiff* out) {
  const size_t nd = pa.shape.size();
  const uint64_t es = DTypeSize(dtype);
  std::vector<uint64_t> lo(nd), len(nd);
  for (size_t d = 0; d < nd; ++d) {
    lo[d] = std::max(pa.offset[d], pb.offset[d]);
    const uint64_t hi = std::min(pa.offset[d] + pa.shape[d], pb.offset[d] + pb.shape[d]);
    if (hi <= lo[d]) return Status::OK();  // no overlap
    len[d] = hi - lo[d];
  }
  // Dimensions from `j` on form one contiguous run in both pieces: every dimension after j is
  // covered whole in both.
  size_t j = nd;
  uint64_t run = 1;
  while (j > 0) {
    const size_t d = j - 1;
    run *= len[d];
    j = d;
    if (!(len[d] == pa.shape[d] && len[d] == pb.shape[d])) break;
  }
  auto strides = [nd](const std::vector<uint64_t>& shape) {
    std::vector<uint64_t> s(nd, 1);
    for (size_t d = nd; d-- > 1;) s[d - 1] = s[d] * shape[d];
    return s;
  };
  const std::vector<uint64_t> st_a = strides(pa.shape), st_b = strides(pb.shape);
  std::vector<uint64_t> idx(j, 0);  // over the outer dimensions
  while (true) {
    uint64_t off_a = 0, off_b = 0;
    for (size_t d = 0; d < nd; ++d) {
      const uint64_t i = d < j ? idx[d] : 0;
      off_a += (lo[d] - pa.offset[d] + i) * st_a[d];
      off_b += (lo[d] - pb.offset[d] + i) * st_b[d];
    }
    SP_RETURN_IF_ERROR(batch.Add(pa.image, pb.image, pa.data_offset + off_a * es,
                                 pb.data_offset + off_b * es, run, dtype, out));
    // Next index over the outer dimensions (row-major).
    size_t d = j;
    while (d > 0) {
      --d;
      if (++idx[d] < len[d]) break;
      idx[d] = 0;
      if (d == 0) {
        d = SIZE_MAX;
        break;
      }
    }
    if (j == 0 || d == SIZE_MAX) break;
  }
  return Status::OK();
}

}  // namespace

Result<std::vector<TensorDiff>> DiffSteps(CheckpointStore& store_a, uint64_t a,
                                          CheckpointStore& store_b, uint64_t b,
                                          const DiffOptions& options) {
  SP_ASSIGN_OR_RETURN(StepView va, OpenStep(store_a, a));
  SP_ASSIGN_OR_RETURN(StepView vb, OpenStep(store_b, b));
  std::vector<TensorDiff> out;
  out.reserve(va.tensors.size() + vb.tensors.size());  // the batch keeps pointers into it
  uint64_t total = 0;
  for (const auto& [name, ta] : va.tensors) {
    auto it = vb.tensors.find(name);
    if (it == vb.tensors.end() || it->second.dtype != ta.dtype ||
        it->second.global_shape != ta.global_shape) {
      continue;
    }
    uint64_t n = DTypeSize(ta.dtype);
    for (uint64_t d : ta.global_shape) n *= d;
    total += n;
  }
  DiffBatch batch(store_a, va, store_b, vb, options, total);
  for (const auto& [name, ta] : va.tensors) {
    TensorDiff diff;
    diff.name = name;
    diff.dtype_a = ta.dtype;
    diff.shape_a = ta.global_shape;
    auto it = vb.tensors.find(name);
    if (it == vb.tensors.end()) {
      diff.kind = TensorDiff::Kind::kRemoved;
      out.push_back(std::move(diff));
      continue;
    }
    const StepTensor& tb = it->second;
    diff.dtype_b = tb.dtype;
    diff.shape_b = tb.global_shape;
    if (tb.dtype != ta.dtype || tb.global_shape != ta.global_shape) {
      diff.kind = TensorDiff::Kind::kReshaped;
      out.push_back(std::move(diff));
      continue;
    }
    diff.elements = 1;
    for (uint64_t d : ta.global_shape) diff.elements *= d;
    TensorDiff* compared = &out.emplace_back(std::move(diff));
    uint64_t covered = 0;
    for (const Piece& pa : ta.pieces) {
      for (const Piece& pb : tb.pieces) {
        uint64_t overlap = 1;
        for (size_t d = 0; d < pa.shape.size(); ++d) {
          const uint64_t lo = std::max(pa.offset[d], pb.offset[d]);
          const uint64_t hi = std::min(pa.offset[d] + pa.shape[d], pb.offset[d] + pb.shape[d]);
          overlap *= hi > lo ? hi - lo : 0;
        }
        if (overlap == 0) continue;
        covered += overlap;
        SP_RETURN_IF_ERROR(CompareOverlap(batch, pa, pb, ta.dtype, compared));
      }
    }
    if (covered != compared->elements) {
      return Corruption("tensor '" + name + "': the shards of the two steps cover " +
                        std::to_string(covered) + " of its " + std::to_string(compared->elements) +
                        " elements (overlapping or missing shards)");
    }
  }
  SP_RETURN_IF_ERROR(batch.Flush());
  for (TensorDiff& d : out) {
    if (d.kind == TensorDiff::Kind::kSame && d.changed > 0) d.kind = TensorDiff::Kind::kChanged;
  }
  for (const auto& [name, tb] : vb.tensors) {
    if (va.tensors.contains(name)) continue;
    TensorDiff diff;
    diff.name = name;
    diff.kind = TensorDiff::Kind::kAdded;
    diff.dtype_b = tb.dtype;
    diff.shape_b = tb.global_shape;
    out.push_back(std::move(diff));
  }
  std::sort(out.begin(), out.end(),
            [](const TensorDiff& x, const TensorDiff& y) { return x.name < y.name; });
  return out;
}

}  // namespace safepoint
