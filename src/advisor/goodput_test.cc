// The goodput model: closed forms, analytic against Monte-Carlo, strategies in clear cases.
#include "advisor/goodput.h"

#include <gtest/gtest.h>

#include <cmath>

#include "advisor/interval.h"
#include "testing/test_util.h"

namespace safepoint::advisor::goodput_test {
namespace {

TEST(AnalyticGoodputTest, NoFailuresIsTheShareOfTrainingInAPeriod) {
  StrategyAtInterval s{"x", 100, 5, {}};
  EXPECT_DOUBLE_EQ(AnalyticGoodput(s), 0.95);
  s.blocking_seconds = 100;
  EXPECT_EQ(AnalyticGoodput(s), 0);  // nothing but saving
}

TEST(AnalyticGoodputTest, OneModeIsDalysFormula) {
  const double lambda = 1 / 600.0, p = 60, c = 2, d = 30;
  StrategyAtInterval s{"x", p, c, {{"crash", lambda, d}}};
  const double daly = std::exp(lambda * d) * std::expm1(lambda * p) / lambda;
  EXPECT_NEAR(AnalyticGoodput(s), (p - c) / daly, 1e-12);
}

TEST(AnalyticGoodputTest, TwoModesOfEqualRecoveryAreOneMode) {
  StrategyAtInterval one{"x", 50, 1, {{"a", 0.003, 20}}};
  StrategyAtInterval two{"x", 50, 1, {{"a", 0.001, 20}, {"b", 0.002, 20}}};
  EXPECT_NEAR(AnalyticGoodput(one), AnalyticGoodput(two), 1e-12);
}

// The Monte-Carlo run draws the model's own process: with a seed it must agree with the
// analytic value within 4 standard errors (a false alarm about once in 16000 seeds), and its
// error must be small enough for that to mean something.
TEST(MonteCarloGoodputTest, AgreesWithAnalyticWithinFourStandardErrors) {
  const std::vector<StrategyAtInterval> cases = {
      {"one mode", 60, 2, {{"crash", 1 / 600.0, 30}}},
      {"two modes", 120, 5, {{"crash", 1 / 1000.0, 10}, {"node", 1 / 4000.0, 300}}},
      {"failure-heavy", 30, 1, {{"crash", 1 / 40.0, 8}}},
  };
  uint64_t seed = 20261201;
  for (const auto& s : cases) {
    const double analytic = AnalyticGoodput(s);
    const auto mc = MonteCarloGoodput(s, 2e7, seed++);
    EXPECT_GT(mc.failures, 1000u) << s.name;
    EXPECT_LT(mc.standard_error, 0.005) << s.name;
    EXPECT_NEAR(mc.goodput, analytic, 4 * mc.standard_error) << s.name << " analytic " << analytic;
  }
}

TEST(MonteCarloGoodputTest, SeededRunsRepeat) {
  StrategyAtInterval s{"x", 60, 2, {{"crash", 1 / 600.0, 30}}};
  EXPECT_EQ(MonteCarloGoodput(s, 1e6, 7).goodput, MonteCarloGoodput(s, 1e6, 7).goodput);
  EXPECT_NE(MonteCarloGoodput(s, 1e6, 7).goodput, MonteCarloGoodput(s, 1e6, 8).goodput);
}

SimulationInputs ClearCase() {
  SimulationInputs in;
  in.gpus = 16;  // two nodes, each node's snapshots copied to the other
  in.gpus_per_node = 8;
  in.peer_copies = true;
  in.mtbf_seconds = 3 * 3600;
  in.node_loss_fraction = 0.2;
  in.snapshot_seconds = 0.5;  // memory is fast
  in.persist_seconds = 60;    // storage is slow
  in.restart_seconds = 120;
  in.restore_memory_seconds = 2;
  in.restore_peer_seconds = 10;
  in.restore_storage_seconds = 60;
  return in;
}

TEST(StrategiesTest, OrderedAsTheoryExpectsInAClearCase) {
  ASSERT_OK_AND_ASSIGN(auto in, CompleteInputs(ClearCase()));
  // Each strategy at its own optimum: snapshots in memory beat async uploads, which beat
  // blocking saves.
  double best[3];
  for (size_t i = 0; i < 3; ++i) {
    const double p = OptimalPeriod(in, i, 1, 86400);
    best[i] = AnalyticGoodput(Strategies(in, p)[i]);
  }
  EXPECT_GT(best[0], best[2]);
  EXPECT_GT(best[2], best[1]);
  // At one period, too: the same cost-free comparison.
  const auto at = Strategies(in, 600);
  EXPECT_GT(AnalyticGoodput(at[0]), AnalyticGoodput(at[2]));
  EXPECT_GT(AnalyticGoodput(at[2]), AnalyticGoodput(at[1]));
}

TEST(StrategiesTest, PeerCopiesHelpWhenNodesAreLost) {
  auto in = ClearCase();
  in.node_loss_fraction = 0.5;
  ASSERT_OK_AND_ASSIGN(auto with, CompleteInputs(in));
  in.peer_copies = false;
  ASSERT_OK_AND_ASSIGN(auto without, CompleteInputs(in));
  EXPECT_GT(AnalyticGoodput(Strategies(with, 300)[0]),
            AnalyticGoodput(Strategies(without, 300)[0]));
  in.node_loss_fraction = 0;  // only process crashes: peers change nothing
  ASSERT_OK_AND_ASSIGN(auto crashes_only, CompleteInputs(in));
  in.peer_copies = true;
  ASSERT_OK_AND_ASSIGN(auto crashes_only_peers, CompleteInputs(in));
  EXPECT_DOUBLE_EQ(AnalyticGoodput(Strategies(crashes_only, 300)[0]),
                   AnalyticGoodput(Strategies(crashes_only_peers, 300)[0]));
}

TEST(StrategiesTest, OptimalPeriodIsNearThePapersIntervalForRareFailures) {
  SimulationInputs in;
  in.mtbf_seconds = 1e5;
  in.node_loss_fraction = 0;
  in.snapshot_seconds = 4;
  in.restart_seconds = 30;
  in.restore_memory_seconds = 10;
  in.persist_seconds = 4;
  ASSERT_OK_AND_ASSIGN(in, CompleteInputs(in));
  const double p = OptimalPeriod(in, 0, 1, 1e6);
  const double paper = AvailabilityOptimalInterval(4, 40, 1e5);
  EXPECT_NEAR(p / paper, 1, 0.05) << p << " vs " << paper;
}

TEST(CompleteInputsTest, DefaultsAndChecks) {
  auto in = ClearCase();
  ASSERT_OK_AND_ASSIGN(auto done, CompleteInputs(in));
  EXPECT_EQ(done.sync_save_seconds, 60);
  EXPECT_EQ(done.dcp_blocking_seconds, 0.5);
  in.mtbf_seconds = 0;
  auto bad = CompleteInputs(in);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("MTBF"), std::string::npos);
  in = ClearCase();
  in.restart_seconds = -1;
  EXPECT_FALSE(CompleteInputs(in).ok());
  in = ClearCase();
  in.node_loss_fraction = 1.5;
  EXPECT_FALSE(CompleteInputs(in).ok());
}

TEST(DeriveCostsTest, SecondsFromSizesAndSpeeds) {
  SimulationInputs in;
  in.gpus = 16;
  in.gpus_per_node = 8;
  in.restart_seconds = 30;
  ClusterSpeeds sp;
  sp.state_bytes_per_gpu = 10e9;
  sp.memory_bytes_per_second = 20e9;
  sp.storage_write_bytes_per_second = 8e9;  // shared by 16 GPUs: 160 GB in 20 s
  sp.network_bytes_per_second = 40e9;       // a node's 80 GB from peers in 2 s
  DeriveCosts(sp, &in);
  EXPECT_DOUBLE_EQ(in.snapshot_seconds, 0.5);
  EXPECT_DOUBLE_EQ(in.restore_memory_seconds, 0.5);
  EXPECT_DOUBLE_EQ(in.persist_seconds, 20);
  EXPECT_DOUBLE_EQ(in.restore_storage_seconds, 20);  // read speed defaults to the write speed
  EXPECT_DOUBLE_EQ(in.restore_peer_seconds, 2);
  EXPECT_DOUBLE_EQ(in.restart_seconds, 30);  // not a matter of speeds
  // More GPUs on the same storage: saving to it takes longer, the snapshot does not.
  in.gpus = 64;
  DeriveCosts(sp, &in);
  EXPECT_DOUBLE_EQ(in.persist_seconds, 80);
  EXPECT_DOUBLE_EQ(in.snapshot_seconds, 0.5);
}

TEST(ParseBytesTest, DecimalAndBinaryUnits) {
  ASSERT_OK_AND_ASSIGN(double b, ParseBytes("16GiB"));
  EXPECT_DOUBLE_EQ(b, 16.0 * (1 << 30));
  ASSERT_OK_AND_ASSIGN(b, ParseBytes("25G"));
  EXPECT_DOUBLE_EQ(b, 25e9);
  ASSERT_OK_AND_ASSIGN(b, ParseBytes("1.5TB/s"));
  EXPECT_DOUBLE_EQ(b, 1.5e12);
  ASSERT_OK_AND_ASSIGN(b, ParseBytes("4096"));
  EXPECT_DOUBLE_EQ(b, 4096);
  EXPECT_FALSE(ParseBytes("").ok());
  EXPECT_FALSE(ParseBytes("12X").ok());
  EXPECT_FALSE(ParseBytes("3i").ok());
  EXPECT_FALSE(ParseBytes("-1G").ok());
}

}  // namespace
}  // namespace safepoint::advisor::goodput_test
