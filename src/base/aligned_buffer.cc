#include "base/aligned_buffer.h"

#include <sys/mman.h>

#include <utility>

namespace safepoint::internal {

namespace {
constexpr size_t kHugePage = size_t{2} << 20;
}

AlignedBuffer::AlignedBuffer(size_t size, bool huge_pages) : size_(size) {
  if (size == 0) return;
  // Round up to whole huge pages so that the tail is huge-page backed too.
  mapped_ = (size + kHugePage - 1) / kHugePage * kHugePage;
  void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    mapped_ = 0;
    return;
  }
  if (size >= kHugePage) madvise(p, mapped_, huge_pages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  data_ = static_cast<std::byte*>(p);
}

AlignedBuffer::~AlignedBuffer() { Release(); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      mapped_(std::exchange(o.mapped_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    Release();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    mapped_ = std::exchange(o.mapped_, 0);
  }
  return *this;
}

void AlignedBuffer::Release() {
  if (data_ != nullptr) munmap(data_, mapped_);
  data_ = nullptr;
  size_ = 0;
  mapped_ = 0;
}

}  // namespace safepoint::internal
