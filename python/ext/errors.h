// Status to Python exception, for every binding file of _core (safepoint.errors: one exception
// class per StatusCode; ThrowStatus is defined in error_bindings.cc).
#pragma once

#include <utility>

#include "safepoint/status.h"

namespace safepoint::python {

// Raises the safepoint.errors exception of s's code with its message (never returns).
[[noreturn]] void ThrowStatus(const Status& s);

template <typename T>
T Unwrap(Result<T> r) {
  if (!r.ok()) ThrowStatus(r.status());
  return std::move(r).value();
}

inline void Check(const Status& s) {
  if (!s.ok()) ThrowStatus(s);
}

}  // namespace safepoint::python
