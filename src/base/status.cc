#include "safepoint/status.h"

#include <cerrno>
#include <cstring>

namespace safepoint {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kCorruption:
      return "Corruption";
    case StatusCode::kIOError:
      return "IOError";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kResourceExhausted:
      return "ResourceExhausted";
    case StatusCode::kCancelled:
      return "Cancelled";
    case StatusCode::kAlreadyExists:
      return "AlreadyExists";
    case StatusCode::kSuperseded:
      return "Superseded";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(StatusCodeName(code_));
  s += ": ";
  s += message_;
  return s;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return Status(code_, std::move(m));
}

Status NotFound(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
Status Corruption(std::string m) { return Status(StatusCode::kCorruption, std::move(m)); }
Status IOError(std::string m) { return Status(StatusCode::kIOError, std::move(m)); }
Status InvalidArgument(std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); }
Status Unavailable(std::string m) { return Status(StatusCode::kUnavailable, std::move(m)); }
Status ResourceExhausted(std::string m) {
  return Status(StatusCode::kResourceExhausted, std::move(m));
}
Status Cancelled(std::string m) { return Status(StatusCode::kCancelled, std::move(m)); }
Status AlreadyExists(std::string m) { return Status(StatusCode::kAlreadyExists, std::move(m)); }
Status Superseded(std::string m) { return Status(StatusCode::kSuperseded, std::move(m)); }

Status ErrnoStatus(std::string_view op, std::string_view path, int err) {
  std::string m(path);
  m += ": ";
  m += op;
  m += " failed: ";
  m += std::strerror(err);
  switch (err) {
    case ENOENT:
      return NotFound(std::move(m));
    case ENOSPC:
    case EDQUOT:
      return ResourceExhausted(std::move(m));
    case EEXIST:
      return AlreadyExists(std::move(m));
    default:
      return IOError(std::move(m));
  }
}

}  // namespace safepoint
