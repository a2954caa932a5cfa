// NameSet: the duplicate check of an image's tensor names and of a dict's keys (issue 21). An
// open-addressing table of string_views sized once for the count it will hold: one allocation
// for the whole set, where std::unordered_set allocates a node per name (at 100,000 tensors the
// index parse and the extras decode spent more time in malloc than in reading). The views must
// outlive the set; not thread-safe.
#pragma once

#include <cstddef>
#include <functional>
#include <string_view>
#include <utility>
#include <vector>

namespace safepoint::internal {

class NameSet {
 public:
  explicit NameSet(size_t expected) {
    size_t cap = 16;
    while (cap < 2 * expected) cap <<= 1;
    slots_.resize(cap);
  }

  // False when `name` is already in the set (the empty name included, which is kept apart).
  bool Insert(std::string_view name) {
    if (name.empty()) return !std::exchange(has_empty_, true);
    if (2 * (count_ + 1) > slots_.size()) Grow();
    return Place(name);
  }

 private:
  bool Place(std::string_view name) {
    const size_t mask = slots_.size() - 1;
    for (size_t i = std::hash<std::string_view>{}(name)&mask;; i = (i + 1) & mask) {
      if (slots_[i].data() == nullptr) {
        slots_[i] = name;
        ++count_;
        return true;
      }
      if (slots_[i] == name) return false;
    }
  }
  void Grow() {
    std::vector<std::string_view> old = std::move(slots_);
    slots_.assign(old.size() * 2, std::string_view());
    count_ = 0;
    for (std::string_view s : old) {
      if (s.data() != nullptr) Place(s);
    }
  }

  std::vector<std::string_view> slots_;  // a null data() marks a free slot
  size_t count_ = 0;
  bool has_empty_ = false;
};

}  // namespace safepoint::internal
