#include "base/log.h"

#include <spdlog/sinks/stdout_sinks.h>

#include <cstdlib>
#include <string>

namespace safepoint::internal {

void InitLogging(std::string_view program) {
  spdlog::drop(std::string(program));
  auto logger = spdlog::stderr_logger_mt(std::string(program));
  logger->set_pattern("%Y-%m-%d %H:%M:%S.%e %l %n[%P]: %v");
  logger->flush_on(spdlog::level::trace);  // the log is read after crashes: never buffer
  spdlog::set_default_logger(std::move(logger));
  const char* env = std::getenv("SAFEPOINT_LOG_LEVEL");
  if (env == nullptr || !SetLogLevel(env)) spdlog::set_level(spdlog::level::info);
}

bool SetLogLevel(std::string_view level) {
  const auto l = spdlog::level::from_str(std::string(level));
  // from_str answers "off" for any name it does not know.
  if (l == spdlog::level::off && level != "off") return false;
  spdlog::set_level(l);
  return true;
}

}  // namespace safepoint::internal
