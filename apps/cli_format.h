// Small helpers shared by the CLI's commands (apps/*.cc): exit codes, the error exit, formatting.
#pragma once

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <iostream>
#include <string>
#include <vector>

#include "safepoint/status.h"

namespace safepoint::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;  // the command failed (the error is logged)
inline constexpr int kExitUsage = 2;  // bad arguments

// Logs `s` and returns kExitError.
inline int Fail(const Status& s) {
  spdlog::error("{}", s.ToString());
  return kExitError;
}

// "2026-12-01T13:05:00Z" from Unix nanoseconds (UTC).
inline std::string FormatTime(int64_t ns) {
  const std::time_t t = static_cast<std::time_t>(ns / 1000000000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// "[3, 4]"
inline std::string Dims(const std::vector<uint64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Prints rows as left-aligned columns two spaces apart (the first row is the header).
inline void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  if (rows.empty()) return;
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
}

}  // namespace safepoint::cli
