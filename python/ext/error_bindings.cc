// safepoint._core: every C++ Status becomes a Python exception here, in ThrowStatus() (errors.h),
// and nowhere else: one class of safepoint.errors per StatusCode.
#include <nanobind/nanobind.h>

#include "errors.h"

namespace nb = nanobind;

namespace safepoint::python {

// The Python exception class of each status code (python/safepoint/errors.py). No default: a
// new StatusCode fails to compile here (-Wswitch) until it has its exception.
const char* ExceptionName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "Error";  // a bug: ThrowStatus of an OK status
    case StatusCode::kNotFound:
      return "NotFoundError";
    case StatusCode::kCorruption:
      return "CorruptionError";
    case StatusCode::kIOError:
      return "StorageError";
    case StatusCode::kInvalidArgument:
      return "InvalidArgumentError";
    case StatusCode::kUnavailable:
      return "UnavailableError";
    case StatusCode::kResourceExhausted:
      return "ResourceExhaustedError";
    case StatusCode::kCancelled:
      return "CancelledError";
    case StatusCode::kAlreadyExists:
      return "AlreadyExistsError";
    case StatusCode::kSuperseded:
      return "SupersededError";
  }
  return "Error";  // a code outside the enum (a corrupted value)
}

[[noreturn]] void ThrowStatus(const Status& s) {
  nb::object cls = nb::module_::import_("safepoint.errors").attr(ExceptionName(s.code()));
  PyErr_SetString(cls.ptr(), s.message().c_str());
  throw nb::python_error();
}

}  // namespace safepoint::python
