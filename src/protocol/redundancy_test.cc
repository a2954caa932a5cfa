#include "protocol/redundancy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "testing/test_util.h"

namespace safepoint::replica::redundancy_test {
namespace {

Redundancy Parse(std::string_view spec) {
  auto r = ParseRedundancy(spec);
  EXPECT_TRUE(r.ok()) << spec << ": " << r.status().ToString();
  return r.ok() ? *r : Redundancy{};
}

TEST(RedundancyTest, ParsesNoneMirrorAndErasureSpecs) {
  for (std::string_view spec : {"", "none"}) {
    const Redundancy r = Parse(spec);
    EXPECT_EQ(r.kind, Redundancy::Kind::kNone) << spec;
    EXPECT_FALSE(r.enabled());
    EXPECT_EQ(r.targets(), 0u);
    EXPECT_EQ(r.tolerated_losses(), 0u);
    EXPECT_EQ(r.memory_factor(), 0.0);
    EXPECT_EQ(r.ToString(), "none");
  }
  const Redundancy mirror = Parse("mirror");
  EXPECT_EQ(mirror.kind, Redundancy::Kind::kMirror);
  EXPECT_EQ(mirror.copies, 1u);
  EXPECT_EQ(mirror.ToString(), "mirror:1");

  const Redundancy m3 = Parse("mirror:3");
  EXPECT_TRUE(m3.enabled());
  EXPECT_EQ(m3.copies, 3u);
  EXPECT_EQ(m3.targets(), 3u);
  EXPECT_EQ(m3.tolerated_losses(), 3u);
  EXPECT_EQ(m3.memory_factor(), 3.0);

  const Redundancy ec = Parse("ec:4+2");
  EXPECT_EQ(ec.kind, Redundancy::Kind::kErasure);
  EXPECT_EQ(ec.k, 4u);
  EXPECT_EQ(ec.p, 2u);
  EXPECT_EQ(ec.targets(), 6u);
  EXPECT_EQ(ec.tolerated_losses(), 2u);
  EXPECT_DOUBLE_EQ(ec.memory_factor(), 1.5);
  EXPECT_EQ(ec.ToString(), "ec:4+2");

  for (std::string_view spec : {"mirror:1", "mirror:2", "mirror:32", "ec:1+1", "ec:2+2", "ec:31+1",
                                "ec:1+31", "ec:16+16"}) {
    EXPECT_EQ(Parse(spec).ToString(), spec);  // ToString gives back what was parsed
  }
}

TEST(RedundancyTest, RejectsMalformedAndOutOfRangeSpecsNamingThem) {
  for (std::string_view spec : {"mirror:0",
                                "mirror:",
                                "mirror:x",
                                "mirror:-1",
                                "mirror:+1",
                                "mirror:1x",
                                "mirror: 1",
                                "mirror:33",
                                "mirror:99999999999",
                                "Mirror",
                                "mirrors",
                                "ec",
                                "ec:",
                                "ec:2",
                                "ec:2+",
                                "ec:+2",
                                "ec:0+2",
                                "ec:2+0",
                                "ec:16+17",
                                "ec:32+1",
                                "ec:2+2+2",
                                "ec: 2+2",
                                "ec:2+2 ",
                                "ec:2-2",
                                "ec:4294967295+2",
                                "ec:2+4294967295",
                                "ec:4294967296+1",
                                "raid5",
                                "none ",
                                " none"}) {
    auto r = ParseRedundancy(spec);
    ASSERT_FALSE(r.ok()) << "'" << spec << "' was accepted as " << r->ToString();
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("'" + std::string(spec) + "'"), std::string::npos)
        << r.status().ToString();
    EXPECT_NE(r.status().message().find("mirror:N"), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().message().find("ec:K+P"), std::string::npos) << r.status().ToString();
  }
}

TEST(RedundancyTest, CheckPlacementSaysHowManyNodesAreNeeded) {
  EXPECT_OK(CheckPlacement(Parse("none"), 0));
  EXPECT_OK(CheckPlacement(Parse("none"), 1));
  EXPECT_OK(CheckPlacement(Parse("mirror"), 2));
  EXPECT_OK(CheckPlacement(Parse("mirror:2"), 3));
  EXPECT_OK(CheckPlacement(Parse("ec:4+2"), 7));
  EXPECT_OK(CheckPlacement(Parse("ec:4+2"), 100));

  struct Case {
    std::string spec;
    uint32_t nodes;
    std::string need;
  };
  for (const Case& c : {Case{"mirror", 1, "mirror:1 needs at least 2 nodes"},
                        Case{"mirror:2", 2, "mirror:2 needs at least 3 nodes"},
                        Case{"mirror:2", 0, "mirror:2 needs at least 3 nodes"},
                        Case{"ec:2+2", 4, "ec:2+2 needs at least 5 nodes"},
                        Case{"ec:4+2", 6, "ec:4+2 needs at least 7 nodes"}}) {
    const Status s = CheckPlacement(Parse(c.spec), c.nodes);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.spec << " on " << c.nodes;
    EXPECT_NE(s.message().find(c.need), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("the job has " + std::to_string(c.nodes)), std::string::npos)
        << s.ToString();
  }
}

const std::vector<std::string> kSpecs = {"mirror:1", "mirror:2", "mirror:3", "ec:1+1", "ec:2+1",
                                         "ec:2+2",   "ec:4+2",   "ec:3+3",   "ec:5+1"};

TEST(RedundancyTest, PlacementTargetsAreDistinctOtherNodesOnARing) {
  for (const std::string& spec : kSpecs) {
    const Redundancy r = Parse(spec);
    for (uint32_t n = r.targets() + 1; n <= r.targets() + 6; ++n) {
      ASSERT_OK(CheckPlacement(r, n));
      for (uint32_t source = 0; source < n; ++source) {
        const std::vector<uint32_t> t = PlacementTargets(r, source, n);
        SCOPED_TRACE(spec + " source " + std::to_string(source) + " of " + std::to_string(n) +
                     ": " + ::testing::PrintToString(t));
        ASSERT_EQ(t.size(), r.targets());
        EXPECT_EQ(std::set<uint32_t>(t.begin(), t.end()).size(), t.size());
        for (size_t i = 0; i < t.size(); ++i) {
          EXPECT_NE(t[i], source);
          EXPECT_LT(t[i], n);
          EXPECT_EQ(t[i], (source + 1 + i) % n);  // the ring: the next nodes in index order
        }
      }
    }
  }
}

// Whether node `source`'s snapshot survives the loss of the nodes in `lost`.
bool Recoverable(const Redundancy& r, uint32_t source, uint32_t nodes,
                 const std::vector<bool>& lost) {
  const std::vector<uint32_t> targets = PlacementTargets(r, source, nodes);
  uint32_t live = 0;
  for (uint32_t t : targets) live += lost[t] ? 0 : 1;
  if (r.kind == Redundancy::Kind::kMirror) return !lost[source] || live >= 1;
  return live >= r.k;  // the source's own memory is not needed
}

// Calls f(lost) for every set of `losses` nodes out of `nodes`.
template <typename F>
void ForEachLoss(uint32_t nodes, uint32_t losses, F f) {
  std::vector<bool> lost(nodes, false);
  std::fill(lost.begin(), lost.begin() + std::min(losses, nodes), true);
  do {
    f(lost);
  } while (std::prev_permutation(lost.begin(), lost.end()));
}

std::string LostNodes(const std::vector<bool>& lost) {
  std::string s;
  for (size_t i = 0; i < lost.size(); ++i) {
    if (lost[i]) s += (s.empty() ? "" : ",") + std::to_string(i);
  }
  return "{" + s + "}";
}

TEST(RedundancyTest, EverySnapshotSurvivesAnyToleratedLossOfNodes) {
  for (const std::string& spec : kSpecs) {
    const Redundancy r = Parse(spec);
    for (uint32_t n = r.targets() + 1; n <= r.targets() + 5; ++n) {
      uint64_t cases = 0;
      for (uint32_t losses = 0; losses <= r.tolerated_losses(); ++losses) {
        ForEachLoss(n, losses, [&](const std::vector<bool>& lost) {
          ++cases;
          for (uint32_t s = 0; s < n; ++s) {
            EXPECT_TRUE(Recoverable(r, s, n, lost))
                << spec << " on " << n << " nodes: node " << s << "'s snapshot is lost with nodes "
                << LostNodes(lost);
          }
        });
      }
      EXPECT_GT(cases, 0u);
    }
  }
}

TEST(RedundancyTest, ToleratedLossesIsTight) {
  // One loss more than tolerated loses some node's snapshot (the check above is not vacuous).
  for (const std::string& spec : kSpecs) {
    const Redundancy r = Parse(spec);
    for (uint32_t n = r.targets() + 1; n <= r.targets() + 3; ++n) {
      bool some_lost = false;
      ForEachLoss(n, r.tolerated_losses() + 1, [&](const std::vector<bool>& lost) {
        for (uint32_t s = 0; s < n; ++s) some_lost |= !Recoverable(r, s, n, lost);
      });
      EXPECT_TRUE(some_lost) << spec << " on " << n << " nodes";
    }
  }
}

}  // namespace
}  // namespace safepoint::replica::redundancy_test
