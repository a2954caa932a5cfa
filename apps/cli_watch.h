// `safepoint status --watch` and the staleness it shows (apps/cli_watch.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace safepoint::cli {

// Calls `render` every `interval_seconds` until SIGINT or SIGTERM, then returns 0 (or the first
// non-zero status `render` returns). On a terminal each refresh clears the screen and redraws
// from the top under a title line; otherwise each refresh is a block that starts with a
// "--- <UTC time> ---" line, so a log or a pipe keeps every one.
int Watch(const std::function<int()>& render, double interval_seconds);

// Seconds since step `step` was committed on the storage at `uri`, or nullopt when its COMMIT
// record cannot be read.
std::optional<double> CommitAgeSeconds(const std::string& uri, uint64_t step);

// Unix time in seconds.
double NowSeconds();

// "12 s ago", "3.5 min ago", ...
std::string Ago(double seconds);

}  // namespace safepoint::cli
