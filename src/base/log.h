// Logging for safepoint's programs: one format for the agent and the CLI, through spdlog.
//
// Lines look like "2026-11-30 21:04:05.123 info safepointd[4242]: rank 0 connected (pid 4711)"
// and go to stderr (the agent's stderr is its agent.log in the job directory). The level comes
// from $SAFEPOINT_LOG_LEVEL (trace, debug, info, warn, error, critical, off; default info) unless
// a program sets one. Code logs with spdlog's functions (spdlog::info("...{}...", x)); the
// library itself logs nothing on a training process's behalf, but for two warnings: a packed save
// that removes the chunk-store lock or intent of a dead process (chunk_store_holder.cc), and a
// $SAFEPOINT_S3_TRACE file that cannot be opened (s3_client.cc).
#pragma once

#include <spdlog/spdlog.h>

#include <string>
#include <string_view>
#include <vector>

namespace safepoint::internal {

// The level names SetLogLevel accepts.
inline const std::vector<std::string> kLogLevels = {"trace", "debug",    "info", "warn",
                                                    "error", "critical", "off"};

// Installs the default logger for `program` (again: replaces it).
void InitLogging(std::string_view program);

// Sets the level by name; false (and nothing changes) for an unknown name.
bool SetLogLevel(std::string_view level);

}  // namespace safepoint::internal
