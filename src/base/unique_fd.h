// UniqueFd and UniqueDir: owned file descriptors and directory streams.
//
// Every file descriptor and DIR* that safepoint opens is held by one of these, so that no early
// return can leak it. Both are move-only; the destructor closes and ignores the result (a close
// whose error matters, e.g. after writing data, calls Close() and checks it). Not thread-safe:
// one owner at a time, like the raw handle.
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

namespace safepoint::internal {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { Reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) Reset(other.Release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  bool valid() const { return fd_ >= 0; }
  explicit operator bool() const { return valid(); }
  int get() const { return fd_; }
  // Gives up ownership without closing.
  [[nodiscard]] int Release() { return std::exchange(fd_, -1); }
  // Closes the held descriptor (if any) and takes `fd`.
  void Reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  // Closes and returns 0 or the errno of close(2).
  int Close() {
    if (fd_ < 0) return 0;
    return ::close(std::exchange(fd_, -1)) == 0 ? 0 : errno;
  }

 private:
  int fd_ = -1;
};

// An open directory stream (opendir/fdopendir). Iterate with readdir(get()).
class UniqueDir {
 public:
  UniqueDir() = default;
  explicit UniqueDir(DIR* d) : d_(d) {}
  ~UniqueDir() { Reset(); }
  UniqueDir(UniqueDir&& other) noexcept : d_(std::exchange(other.d_, nullptr)) {}
  UniqueDir& operator=(UniqueDir&& other) noexcept {
    if (this != &other) {
      Reset();
      d_ = std::exchange(other.d_, nullptr);
    }
    return *this;
  }
  UniqueDir(const UniqueDir&) = delete;
  UniqueDir& operator=(const UniqueDir&) = delete;

  bool valid() const { return d_ != nullptr; }
  explicit operator bool() const { return valid(); }
  DIR* get() const { return d_; }
  void Reset() {
    if (d_ != nullptr) ::closedir(d_);
    d_ = nullptr;
  }

 private:
  DIR* d_ = nullptr;
};

}  // namespace safepoint::internal
