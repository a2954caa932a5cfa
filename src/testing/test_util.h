// Helpers shared by the C++ unit tests (never linked into the library).
//
// - ASSERT_OK(expr) / EXPECT_OK(expr): expr is a Status or a Result<T>; on failure the message
//   shows the code and the message of the status.
// - ASSERT_OK_AND_ASSIGN(lhs, expr): expr is a Result<T>; asserts it is OK and moves its value
//   into lhs (a declaration like `auto w` or an existing variable).
// - TempDir: a fresh directory, removed with everything below it when destroyed.
// - Files: ReadFileToString, WriteStringToFile, FillFileSystem (write until ENOSPC),
//   ReadJsonLines (a JSON-lines file, one object a line).
// - RunInChild: runs a function in a forked child process and returns its exit code;
//   KillLeavingZombie: kills a child and waits until it has exited, without reaping it.
// - Byte patterns: every position of every seed has its own value, so that misplaced, duplicated
//   or lost blocks show up (PatternBytes, FillPattern, FirstMismatch).
// - AlignedTestBuffer: a zeroed buffer aligned for O_DIRECT, optionally misaligned on purpose.
// - PutObject / ReadWholeObject: one object written and published, or read back, in one call;
//   TestImageMeta: image metadata; TwoTensorShard: a small shard to save (two float32 tensors);
//   CommittedSteps: the steps a checkpoint store lists as committed.
// - ForwardingStorage: a Storage that passes every call to another one; test wrappers derive
//   from it and override only what they observe or change.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "base/unique_fd.h"
#include "safepoint/checkpoint.h"
#include "safepoint/extras.h"
#include "safepoint/image.h"
#include "safepoint/status.h"
#include "safepoint/storage.h"

namespace safepoint::test {

inline const Status& StatusOf(const Status& s) { return s; }
template <typename T>
const Status& StatusOf(const Result<T>& r) {
  return r.status();
}

}  // namespace safepoint::test

// The statement form of gtest's own assertions: a failure message may be streamed after it.
#define SP_TEST_OK_(expr, on_failure)                                                  \
  switch (0)                                                                           \
  case 0:                                                                              \
  default:                                                                             \
    if (const ::safepoint::Status sp_test_status_ = ::safepoint::test::StatusOf(expr); \
        sp_test_status_.ok()) {                                                        \
    } else                                                                             \
      on_failure << #expr << " is not OK: " << sp_test_status_.ToString() << "\n"
#define ASSERT_OK(expr) SP_TEST_OK_(expr, GTEST_FAIL())
#define EXPECT_OK(expr) SP_TEST_OK_(expr, ADD_FAILURE())

#define SP_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr)                          \
  auto tmp = (expr);                                                           \
  ASSERT_TRUE(tmp.ok()) << #expr << " is not OK: " << tmp.status().ToString(); \
  lhs = std::move(tmp).value()
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  SP_ASSERT_OK_AND_ASSIGN_IMPL_(SP_CONCAT_(sp_assign_, __LINE__), lhs, expr)

namespace safepoint::test {

// A fresh, empty directory "<parent>/<prefix>-XXXXXX" (parent: $TMPDIR or /tmp). path() is empty
// when it could not be made; tests assert ok() first.
class TempDir {
 public:
  explicit TempDir(std::string_view prefix = "safepoint-test", std::string parent = "") {
    if (parent.empty()) {
      std::error_code ec;
      parent = std::filesystem::temp_directory_path(ec).string();
      if (ec) parent = "/tmp";
    }
    std::string tmpl = parent + "/" + std::string(prefix) + "-XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = std::move(tmpl);
  }
  ~TempDir() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  // "<path>/<name>"
  std::string Join(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  std::string path_;
};

// The whole content of the file at `path`, or nullopt when it cannot be opened.
inline std::optional<std::string> ReadFileToString(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// Each line of the JSON-lines file at `path` parsed (none when it cannot be read).
inline std::vector<nlohmann::json> ReadJsonLines(const std::string& path) {
  std::vector<nlohmann::json> out;
  const auto text = ReadFileToString(path);
  if (!text) return out;
  std::istringstream in(*text);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Creates or replaces the file at `path` with `content`; false when that failed.
[[nodiscard]] inline bool WriteStringToFile(const std::string& path, std::string_view content) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(content.data(), static_cast<std::streamsize>(content.size()));
  f.close();
  return f.good();
}

// Creates the file `path` and writes to it until its file system is full (ENOSPC); false when
// the file could not be created or a write failed for another reason.
[[nodiscard]] inline bool FillFileSystem(const std::string& path) {
  const internal::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd) return false;
  const std::string block(64 << 10, 'f');
  ssize_t n;
  while ((n = ::write(fd.get(), block.data(), block.size())) > 0 || (n < 0 && errno == EINTR)) {
  }
  return n < 0 && errno == ENOSPC;
}

// Forks; the child runs `body` and exits with its result at once (no destructors, no atexit
// handlers: the parent's gtest state is left alone). Returns the child's exit code after it
// exited, or -1 when fork failed or the child died of a signal (reported as a test failure).
// `child_pid`, if given, receives the child's pid.
inline int RunInChild(const std::function<int()>& body, pid_t* child_pid = nullptr) {
  const pid_t child = ::fork();
  if (child_pid != nullptr) *child_pid = child;
  if (child < 0) {
    ADD_FAILURE() << "fork: " << std::strerror(errno);
    return -1;
  }
  if (child == 0) ::_exit(body());
  int status = 0;
  while (::waitpid(child, &status, 0) < 0) {
    if (errno != EINTR) {
      ADD_FAILURE() << "waitpid: " << std::strerror(errno);
      return -1;
    }
  }
  if (!WIFEXITED(status)) {
    ADD_FAILURE() << "the child process did not exit normally (wait status " << status << ")";
    return -1;
  }
  return WEXITSTATUS(status);
}

// Kills `child` and waits until it is a zombie (exited, not yet reaped).
inline void KillLeavingZombie(pid_t child) {
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, child, &info, WEXITED | WNOWAIT), 0);
}

// The byte at `position` of the pattern `seed` (a 64-bit mix, so patterns do not repeat).
inline std::byte PatternByte(uint64_t position, uint64_t seed) {
  uint64_t x = position + seed * 0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return static_cast<std::byte>(x & 0xff);
}

inline void FillPattern(std::span<std::byte> dst, uint64_t seed, uint64_t position = 0) {
  for (size_t i = 0; i < dst.size(); ++i) dst[i] = PatternByte(position + i, seed);
}

// `n` bytes of pattern `seed`, starting at `position`.
inline std::vector<std::byte> PatternBytes(size_t n, uint64_t seed, uint64_t position = 0) {
  std::vector<std::byte> v(n);
  FillPattern(v, seed, position);
  return v;
}

// Index of the first byte of `data` that differs from the pattern, or -1.
inline int64_t FirstMismatch(std::span<const std::byte> data, uint64_t seed,
                             uint64_t position = 0) {
  for (size_t i = 0; i < data.size(); ++i) {
    if (data[i] != PatternByte(position + i, seed)) return static_cast<int64_t>(i);
  }
  return -1;
}

// The bytes of a string, for APIs that take bytes.
inline std::span<const std::byte> AsBytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

// A zeroed buffer whose data() is `misalign` bytes past a kDirectIOAlignment boundary.
class AlignedTestBuffer {
 public:
  explicit AlignedTestBuffer(size_t size, size_t misalign = 0) : size_(size), misalign_(misalign) {
    const size_t bytes =
        (size + misalign + kDirectIOAlignment - 1) / kDirectIOAlignment * kDirectIOAlignment +
        kDirectIOAlignment;
    base_.reset(static_cast<std::byte*>(std::aligned_alloc(kDirectIOAlignment, bytes)));
    std::memset(base_.get(), 0, bytes);
  }
  std::byte* data() { return base_.get() + misalign_; }
  std::span<std::byte> span() { return {data(), size_}; }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> base_;
  size_t size_;
  size_t misalign_;
};

// Reads the whole object `name` (empty on failure, which is reported as a test failure).
inline std::vector<std::byte> ReadWholeObject(Storage& storage, std::string_view name) {
  auto r = storage.Open(name);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return {};
  std::vector<std::byte> out((*r)->size());
  const Status s = (*r)->ReadAt(0, out);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

// Writes `data` as object `name` in one WriteAt and publishes it; the first error.
inline Status PutObject(Storage& storage, std::string_view name, std::span<const std::byte> data) {
  SP_ASSIGN_OR_RETURN(auto w, storage.Create(name, data.size()));
  SP_RETURN_IF_ERROR(w->WriteAt(0, data));
  return w->Publish();
}

// A shard as the checkpoint tests save it: "big" (big_elems float32 values from `seed` and the
// rank), "small" (17 float32 values from the step), and extras {"step": step, "big": tensor 0}.
struct TwoTensorShard {
  std::vector<float> big, small;
  std::vector<TensorSource> sources;
  std::string extras;

  TwoTensorShard(uint64_t step, uint32_t rank, uint64_t seed, size_t big_elems = 3 << 20)
      : big(big_elems), small(17) {
    for (size_t i = 0; i < big.size(); ++i) big[i] = float(seed * 1000 + rank + i);
    for (size_t i = 0; i < small.size(); ++i) small[i] = float(step - i);
    sources.push_back({{"big", DType::kFloat32, {big.size()}, {}, {}}, big.data(), big.size() * 4});
    sources.push_back({{"small", DType::kFloat32, {small.size()}, {}, {}}, small.data(), 68});
    Dict d;
    d.items.emplace_back(Value(std::string("step")), Value(int64_t(step)));
    d.items.emplace_back(Value(std::string("big")), Value(TensorRef{0, 0}));
    extras = *EncodeExtras(Value(std::move(d)));
  }
};

// Image metadata for tests: job `job`, rank `rank` of `world_size`, at `step`.
inline ImageMeta TestImageMeta(std::string job, uint64_t step, uint32_t rank, uint32_t world_size) {
  ImageMeta m;
  m.job = std::move(job);
  m.step = step;
  m.rank = rank;
  m.world_size = world_size;
  return m;
}

// The steps `store` lists as committed, in its order (none, reported as a test failure, when
// listing fails).
inline std::vector<uint64_t> CommittedSteps(CheckpointStore& store) {
  std::vector<uint64_t> out;
  auto committed = store.ListCommitted();
  EXPECT_TRUE(committed.ok()) << committed.status().ToString();
  if (!committed.ok()) return out;
  for (const auto& c : *committed) out.push_back(c.step);
  return out;
}

// A Storage that passes every call to `inner`.
class ForwardingStorage : public Storage {
 public:
  explicit ForwardingStorage(std::shared_ptr<Storage> inner) : inner_(std::move(inner)) {}
  const std::string& uri() const override { return inner_->uri(); }
  StorageCapabilities capabilities() const override { return inner_->capabilities(); }
  Result<std::unique_ptr<WritableObject>> Create(std::string_view name, uint64_t size) override {
    return inner_->Create(name, size);
  }
  Result<std::unique_ptr<ReadableObject>> Open(std::string_view name) override {
    return inner_->Open(name);
  }
  Result<std::vector<ObjectInfo>> List(std::string_view prefix) override {
    return inner_->List(prefix);
  }
  Status Delete(std::string_view name) override { return inner_->Delete(name); }
  Result<size_t> RemoveLeftovers(std::string_view prefix, const LeftoverFilter& f) override {
    return inner_->RemoveLeftovers(prefix, f);
  }
  using Storage::RemoveLeftovers;
  std::string Describe(std::string_view name) const override { return inner_->Describe(name); }

 protected:
  std::shared_ptr<Storage> inner_;
};

}  // namespace safepoint::test
