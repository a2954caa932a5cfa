// The versioning and interchange commands of the `safepoint` CLI (apps/cli_versions.cc):
//
//   safepoint log PATH [--limit N] [--json]
//   safepoint tag PATH [STEP] NAME [--delete] [--replace] [--json]   (PATH alone: list tags)
//   safepoint diff PATH A B [--all] [--json]
//   safepoint export PATH (--step N | --tag T) --format safetensors|torch [--select PREFIX] OUT
//   safepoint import SRC DST --step N [--prefix P] [--overwrite]
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <optional>

namespace safepoint {

// Adds the commands to `app` (group "Commands"). The returned function runs the one that was
// parsed and returns its exit status, or nullopt when none of them was.
std::function<std::optional<int>()> AddVersionCommands(CLI::App& app);

}  // namespace safepoint
