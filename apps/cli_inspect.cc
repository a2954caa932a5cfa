// `safepoint inspect` (cli_inspect.h).
#include "cli_inspect.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <variant>

#include "base/bytes.h"
#include "cli_format.h"
#include "cli_store.h"

namespace safepoint::cli {
namespace {

using json = nlohmann::ordered_json;
using internal::HumanBytes;

constexpr size_t kNoLimit = std::numeric_limits<size_t>::max();

bool IsContainer(const Value& v) {
  return std::holds_alternative<Dict>(v.v) || std::holds_alternative<List>(v.v) ||
         std::holds_alternative<Tuple>(v.v);
}

const ValueList* Items(const Value& v) {
  if (const auto* l = std::get_if<List>(&v.v)) return &l->items;
  if (const auto* t = std::get_if<Tuple>(&v.v)) return &t->items;
  return nullptr;
}

class StateFormatter {
 public:
  StateFormatter(const std::vector<TensorEntry>& tensors, size_t width)
      : tensors_(tensors), width_(width) {}

  void Block(const Value& v, size_t indent) {
    if (const auto* d = std::get_if<Dict>(&v.v)) {
      if (d->items.empty()) return Line(indent, "{}");
      for (const auto& [k, item] : d->items) Item(indent, Key(k) + ":", item);
      return;
    }
    if (const ValueList* items = Items(v)) {
      if (items->empty() || AllScalars(*items)) return Wrapped(indent, "", v);
      for (const Value& item : *items) Item(indent, "-", item);
      return;
    }
    Line(indent, Leaf(v));
  }

  std::string text() const { return out_; }

 private:
  static bool AllScalars(const ValueList& items) {
    for (const Value& i : items) {
      if (IsContainer(i)) return false;
    }
    return true;
  }

  // A string key bare when it reads unambiguously ("lr", "model.w"), else as Python writes it.
  static std::string Key(const Value& k) {
    if (const auto* s = std::get_if<std::string>(&k.v)) {
      bool bare = !s->empty() && !std::isdigit(static_cast<unsigned char>((*s)[0]));
      for (char c : *s) {
        bare = bare && (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' ||
                        c == '-' || c == '/');
      }
      if (bare) return *s;
    }
    return FormatValue(k, kNoLimit);
  }

  std::string Leaf(const Value& v) const {
    if (const auto* d = std::get_if<double>(&v.v); d && std::isfinite(*d)) {
      // The shortest form that reads back as the same float, as Python prints it ("0.1").
      char buf[64];
      const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), *d);
      std::string s(buf, ec == std::errc() ? end : buf);
      if (s.find_first_of(".e") == std::string::npos) s += ".0";
      return s;
    }
    if (const auto* t = std::get_if<TensorRef>(&v.v)) {
      std::string s = "<tensor #" + std::to_string(t->index);
      if (t->index < tensors_.size()) {
        const TensorSpec& spec = tensors_[t->index].spec;
        s += ": " + std::string(DTypeName(spec.dtype)) + " " + Dims(spec.shape);
      }
      return s + ">";
    }
    return FormatValue(v, kNoLimit);
  }

  void Line(size_t indent, const std::string& text) {
    out_ += std::string(indent, ' ') + text + "\n";
  }

  // "prefix value": a leaf, an empty container or a list of scalars on the prefix's line (a long
  // list wrapped below it, aligned); a dict or a list of containers as a block below the prefix
  // (a "- " item's dict starts on the dash's line).
  void Item(size_t indent, const std::string& prefix, const Value& item) {
    const size_t child = indent + 2;
    if (!IsContainer(item)) return Line(indent, prefix + " " + Leaf(item));
    if (const auto* d = std::get_if<Dict>(&item.v)) {
      if (d->items.empty()) return Line(indent, prefix + " {}");
      if (prefix == "-") {
        StateFormatter inner(tensors_, width_);
        inner.Block(item, child);
        std::string text = inner.text();
        text[indent] = '-';
        out_ += text;
        return;
      }
      Line(indent, prefix);
      return Block(item, child);
    }
    const ValueList& items = *Items(item);
    if (items.empty() || AllScalars(items)) return Wrapped(indent, prefix + " ", item);
    Line(indent, prefix);
    Block(item, child);
  }

  // A list or tuple of scalars after `prefix`, wrapped at the width below its opening bracket
  // (no element cut).
  void Wrapped(size_t indent, const std::string& prefix, const Value& v) {
    const ValueList& items = *Items(v);
    const bool tuple = std::holds_alternative<Tuple>(v.v);
    std::string line = std::string(indent, ' ') + prefix + (tuple ? "(" : "[");
    const size_t align = line.size();
    for (size_t i = 0; i < items.size(); ++i) {
      std::string part = Leaf(items[i]);
      if (i + 1 < items.size()) part += ",";
      if (i > 0 && line.size() + 1 + part.size() > width_) {
        out_ += line + "\n";
        line = std::string(align, ' ');
      } else if (i > 0) {
        line += " ";
      }
      line += part;
    }
    if (tuple && items.size() == 1) line += ",";
    out_ += line + (tuple ? ")" : "]") + "\n";
  }

  const std::vector<TensorEntry>& tensors_;
  size_t width_;
  std::string out_;
};

}  // namespace

std::string FormatState(const Value& state, const std::vector<TensorEntry>& tensors, size_t indent,
                        size_t width) {
  StateFormatter f(tensors, width);
  f.Block(state, indent);
  return f.text();
}

int CmdInspect(const std::string& path, std::optional<uint64_t> step, uint32_t rank, bool as_json) {
  auto store = OpenExistingStore(path);
  if (!store.ok()) return Fail(store.status());
  auto commit = PickStep(**store, step);
  if (!commit.ok()) return Fail(commit.status());
  auto md = (*store)->ReadMetadata(*commit, rank);
  if (!md.ok()) return Fail(md.status());
  uint64_t tensor_bytes = 0;
  for (const auto& t : md->tensors) tensor_bytes += t.nbytes;
  if (as_json) {
    json tensors = json::array();
    for (const auto& t : md->tensors) {
      json j = {{"name", t.spec.name},
                {"dtype", DTypeName(t.spec.dtype)},
                {"shape", t.spec.shape},
                {"bytes", t.nbytes},
                {"offset", t.offset}};
      if (!t.spec.global_shape.empty()) {
        j["global_shape"] = t.spec.global_shape;
        j["global_offset"] = t.spec.global_offset;
      }
      tensors.push_back(j);
    }
    json out = {{"step", commit->step},
                {"rank", rank},
                {"world_size", commit->world_size},
                {"job", commit->job},
                {"file", md->source},
                {"image_bytes", md->layout.image_size},
                {"tensor_bytes", tensor_bytes},
                {"chunk_size", md->layout.chunk_size},
                {"tensors", tensors},
                {"state", FormatValue(md->extras, 1 << 20)}};
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << "step " << commit->step << ", rank " << rank << " of " << commit->world_size
            << (commit->job.empty() ? "" : ", job " + commit->job) << "\n"
            << "file " << md->source << " (" << HumanBytes(md->layout.image_size) << ", "
            << md->tensors.size() << " tensors, " << HumanBytes(tensor_bytes)
            << " of tensor data)\n\n";
  std::vector<std::vector<std::string>> rows = {{"#", "NAME", "DTYPE", "SHAPE", "BYTES"}};
  for (size_t i = 0; i < md->tensors.size(); ++i) {
    const auto& t = md->tensors[i];
    std::string shape = Dims(t.spec.shape);
    if (!t.spec.global_shape.empty()) {
      shape += " of " + Dims(t.spec.global_shape) + " at " + Dims(t.spec.global_offset);
    }
    rows.push_back({std::to_string(i), t.spec.name, std::string(DTypeName(t.spec.dtype)), shape,
                    std::to_string(t.nbytes)});
  }
  PrintTable(rows);
  std::cout << "\nstate (tensors shown as <tensor #i: dtype [shape]>, the rows above):\n"
            << FormatState(md->extras, md->tensors);
  return kExitOk;
}

}  // namespace safepoint::cli
