#include "protocol/redundancy.h"

#include <charconv>

namespace safepoint::replica {

namespace {

bool ParseUint(std::string_view s, uint32_t* out) {
  if (s.empty()) return false;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && ptr == s.data() + s.size();
}

}  // namespace

// A parsed Redundancy holds copies == 0 unless kMirror, and k == p == 0 unless kErasure.
uint32_t Redundancy::targets() const { return kind == Kind::kErasure ? k + p : copies; }

uint32_t Redundancy::tolerated_losses() const { return kind == Kind::kErasure ? p : copies; }

double Redundancy::memory_factor() const {
  return kind == Kind::kErasure ? static_cast<double>(k + p) / k : copies;
}

std::string Redundancy::ToString() const {
  switch (kind) {
    case Kind::kNone:
      return "none";
    case Kind::kMirror:
      return "mirror:" + std::to_string(copies);
    case Kind::kErasure:
      return "ec:" + std::to_string(k) + "+" + std::to_string(p);
  }
  return "none";
}

Result<Redundancy> ParseRedundancy(std::string_view spec) {
  Redundancy r;
  auto bad = [&] {
    return InvalidArgument("redundancy '" + std::string(spec) +
                           "' is not one of none, mirror, mirror:N (N >= 1), ec:K+P "
                           "(K >= 1, P >= 1, K+P <= 32)");
  };
  if (spec.empty() || spec == "none") return r;
  if (spec == "mirror") {
    r.kind = Redundancy::Kind::kMirror;
    r.copies = 1;
    return r;
  }
  if (spec.starts_with("mirror:")) {
    if (!ParseUint(spec.substr(7), &r.copies) || r.copies < 1 || r.copies > 32) return bad();
    r.kind = Redundancy::Kind::kMirror;
    return r;
  }
  if (spec.starts_with("ec:")) {
    std::string_view rest = spec.substr(3);
    size_t plus = rest.find('+');
    if (plus == std::string_view::npos) return bad();
    if (!ParseUint(rest.substr(0, plus), &r.k) || !ParseUint(rest.substr(plus + 1), &r.p)) {
      return bad();
    }
    if (r.k < 1 || r.p < 1 || r.k > 32 || r.p > 32 || r.k + r.p > 32) return bad();  // no wrap
    r.kind = Redundancy::Kind::kErasure;
    return r;
  }
  return bad();
}

Status CheckPlacement(const Redundancy& r, uint32_t nodes) {
  if (!r.enabled()) return Status::OK();
  uint32_t need = r.targets() + 1;
  if (nodes >= need) return Status::OK();
  return InvalidArgument("redundancy " + r.ToString() + " needs at least " + std::to_string(need) +
                         " nodes (each node's snapshot on " + std::to_string(r.targets()) +
                         " other nodes), the job has " + std::to_string(nodes));
}

std::vector<uint32_t> PlacementTargets(const Redundancy& r, uint32_t source, uint32_t nodes) {
  std::vector<uint32_t> out;
  for (uint32_t i = 1; i <= r.targets(); ++i) out.push_back((source + i) % nodes);
  return out;
}

}  // namespace safepoint::replica
