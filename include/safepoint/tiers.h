// Storage tiers: the levels below a job's first storage (its `path`), each with its own URI,
// schedule and retention (docs/guide.md, "Storage tiers").
//
// The agent fills a tier by copying committed, verified steps from the tier above it (the first
// tier copies from `path`); it never takes a new snapshot for a tier and never goes through the
// training process. A tier receives a step that is committed on the tier above when its
// schedule says the step is due (TierDue), keeps its newest `keep` committed steps, and is
// written with the same commit protocol as `path` (the COMMIT record last).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "safepoint/status.h"

namespace safepoint {

struct TierSpec {
  std::string uri;
  // A step is due when it is a multiple of `every`, or when at least `every` steps passed since
  // the step the tier received last (irregular step numbers); 0: not by steps.
  uint64_t every = 0;
  // A step is due when at least this many seconds passed since the tier's last copy started;
  // 0: not by time. With neither `every` nor `every_seconds`, every step committed above is due.
  double every_seconds = 0;
  uint32_t keep = 3;  // committed steps kept on the tier (at least 1)
  // How the tier stores steps (PackOptions, include/safepoint/checkpoint.h): "auto" | "none" |
  // "zstd" | "planes", and content-addressed chunks shared between steps.
  std::string compression = "none";
  bool incremental = false;
  bool operator==(const TierSpec&) const = default;
};

// Checks a job's tiers: URIs non-empty, distinct from each other and from `primary`, keep >= 1,
// every_seconds finite and >= 0, compression a known mode. InvalidArgument naming the tier
// otherwise.
Status ValidateTiers(std::string_view primary, std::span<const TierSpec> tiers);

// Whether `step` (committed on the tier above) is due for `tier`, which received `last` last
// (nullopt: nothing yet, then every step is due) `seconds_since_last` seconds ago.
bool TierDue(const TierSpec& tier, uint64_t step, std::optional<uint64_t> last,
             double seconds_since_last);

}  // namespace safepoint
