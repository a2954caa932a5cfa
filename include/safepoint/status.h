// Status and Result<T>: how every fallible safepoint call reports failure.
//
// A Status is either OK or carries a code and a message. Messages always name the object the
// failure is about (a path, a peer, a key) and the cause, so that they can be shown to a user
// as they are. safepoint never throws across its C++ API; the Python layer maps codes to
// exception classes in one place (python/ext/module.cc).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace safepoint {

enum class StatusCode : int {
  kOk = 0,
  kNotFound = 1,           // the step, file or object does not exist
  kCorruption = 2,         // bytes that do not pass validation: checksums, bounds, magic, ...
  kIOError = 3,            // the storage failed (EIO, a failed fsync, a short write)
  kInvalidArgument = 4,    // the caller passed something that cannot work
  kUnavailable = 5,        // a service (agent, peer) cannot be reached
  kResourceExhausted = 6,  // no space (ENOSPC, EDQUOT), too little shared memory
  kCancelled = 7,
  kAlreadyExists = 8,
  kSuperseded = 9,  // this process was superseded by a newer run of the job (a stale process)
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status OK() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "Corruption: <message>"
  std::string ToString() const;

  // Returns a copy whose message is prefixed with `context` and ": ".
  Status WithContext(std::string_view context) const;

  void IgnoreError() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

Status NotFound(std::string message);
Status Corruption(std::string message);
Status IOError(std::string message);
Status InvalidArgument(std::string message);
Status Unavailable(std::string message);
Status ResourceExhausted(std::string message);
Status Cancelled(std::string message);
Status AlreadyExists(std::string message);
Status Superseded(std::string message);

// The one place where an errno becomes a Status. `op` is the failed call ("open", "fsync"),
// `path` what it was applied to. ENOENT -> NotFound, ENOSPC/EDQUOT -> ResourceExhausted,
// EEXIST -> AlreadyExists, everything else -> IOError.
Status ErrnoStatus(std::string_view op, std::string_view path, int err);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    if (std::get<Status>(v_).ok())
      v_ = Status(StatusCode::kInvalidArgument, "Result from OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace safepoint

#define SP_CONCAT_INNER_(a, b) a##b
#define SP_CONCAT_(a, b) SP_CONCAT_INNER_(a, b)

#define SP_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::safepoint::Status sp_status_ = (expr); \
    if (!sp_status_.ok()) return sp_status_; \
  } while (0)

#define SP_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

#define SP_ASSIGN_OR_RETURN(lhs, expr) \
  SP_ASSIGN_OR_RETURN_IMPL_(SP_CONCAT_(sp_result_, __LINE__), lhs, expr)
