// `safepoint inspect PATH [--step N] [--rank R] [--json]` (apps/cli_inspect.cc): one rank's
// image of a committed step: its tensors and its non-tensor state, readably.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "safepoint/extras.h"
#include "safepoint/image.h"

namespace safepoint::cli {

int CmdInspect(const std::string& path, std::optional<uint64_t> step, uint32_t rank, bool json);

// The non-tensor state as indented lines, one item a line, nothing cut off: dict items as
// "key: value" (a nested container below its key), lists of containers as "- " items, short
// containers and lists of scalars inline (wrapped at `width`), tensors as
// "<tensor #i: dtype [shape]>" from `tensors`. Each line starts with `indent` spaces.
std::string FormatState(const Value& state, const std::vector<TensorEntry>& tensors,
                        size_t indent = 2, size_t width = 100);

}  // namespace safepoint::cli
