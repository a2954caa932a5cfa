// Storage tier schedules (include/safepoint/tiers.h).
#include "safepoint/tiers.h"

#include <cmath>
#include <set>

#include "safepoint/checkpoint.h"

namespace safepoint {

Status ValidateTiers(std::string_view primary, std::span<const TierSpec> tiers) {
  std::set<std::string_view> seen{primary};
  for (size_t i = 0; i < tiers.size(); ++i) {
    const TierSpec& t = tiers[i];
    const std::string which = "tier " + std::to_string(i + 1) + " (" + t.uri + ")";
    if (t.uri.empty()) return InvalidArgument("tier " + std::to_string(i + 1) + " has no URI");
    if (!seen.insert(t.uri).second) {
      return InvalidArgument(which + " repeats a storage the job already uses");
    }
    if (t.keep < 1) return InvalidArgument(which + ": keep must be at least 1");
    if (!std::isfinite(t.every_seconds) || t.every_seconds < 0) {
      return InvalidArgument(which + ": every_seconds must be a finite number >= 0");
    }
    if (Status s = ParseCompression(t.compression).status(); !s.ok()) return s.WithContext(which);
  }
  return Status::OK();
}

bool TierDue(const TierSpec& tier, uint64_t step, std::optional<uint64_t> last,
             double seconds_since_last) {
  if (!last) return true;
  if (step <= *last) return false;  // never an older step than the tier has
  if (tier.every == 0 && tier.every_seconds <= 0) return true;
  if (tier.every > 0 && (step % tier.every == 0 || step - *last >= tier.every)) return true;
  return tier.every_seconds > 0 && seconds_since_last >= tier.every_seconds;
}

}  // namespace safepoint
