// AlignedBuffer: an owned, page-aligned, zero-initialised byte buffer for direct I/O.
//
// Large buffers are mapped anonymously, by default with MADV_HUGEPAGE: staging buffers, reused
// for the life of the process, fault their pages in once. With huge_pages = false they get
// MADV_NOHUGEPAGE instead: a load's destination, faulted in once per load, where on a guest that
// reports its free memory to the hypervisor a fresh huge page is one the host took back and
// costs several times more to fault in than small pages (checkpoint_store.cc, ReadImage).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace safepoint::internal {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Allocates `size` bytes aligned to at least 4096. Aborts on allocation failure is avoided:
  // check ok() (false when the memory could not be mapped).
  explicit AlignedBuffer(size_t size, bool huge_pages = true);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  bool ok() const { return data_ != nullptr || size_ == 0; }
  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<std::byte> span() { return {data_, size_}; }
  std::span<const std::byte> span() const { return {data_, size_}; }

 private:
  void Release();
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;
};

}  // namespace safepoint::internal
