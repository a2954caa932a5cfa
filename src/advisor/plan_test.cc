// One model, one answer (issue 36): the plan's intervals, the curve the plot draws, the levels'
// advice and the job's inputs from its history agree.
#include "advisor/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "advisor/interval.h"
#include "testing/test_util.h"

namespace safepoint::advisor::plan_test {
namespace {

using test::TempDir;
using test::WriteStringToFile;

SimulationInputs Job() {
  SimulationInputs in;
  in.mtbf_seconds = 3 * 3600;
  in.snapshot_seconds = 0.5;
  in.persist_seconds = 60;
  in.restart_seconds = 120;
  in.restore_memory_seconds = 2;
  in.restore_storage_seconds = 60;
  return in;
}

// The disagreement of issue 36: the text printed one optimum, the plot labelled another (the
// highest point of a coarse CSV, written with 4 digits), advise a third (another formula). Now
// each curve's highest point is the plan's interval, and advise's memory level is the same.
TEST(PlanTest, TheCurvesHighestPointAndTheAdviceAreThePlansInterval) {
  for (const bool peers : {false, true}) {
    SimulationInputs in = Job();
    if (peers) {
      in.gpus = 16;
      in.gpus_per_node = 8;
      in.peer_copies = true;
      in.restore_peer_seconds = 10;
    }
    ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(in));
    ASSERT_EQ(plan.strategies.size(), 3u);
    const auto curve = GoodputCurve(plan);
    for (size_t i = 0; i < plan.strategies.size(); ++i) {
      const auto best = std::max_element(curve.begin(), curve.end(), [&](auto& a, auto& b) {
        return a.goodput[i] < b.goodput[i];
      });
      EXPECT_EQ(best->interval_seconds, plan.strategies[i].interval_seconds)
          << plan.strategies[i].name;
      EXPECT_EQ(best->goodput[i], plan.strategies[i].goodput);
    }
    const auto levels = AdviseLevels(plan);
    ASSERT_GE(levels.size(), 2u);
    EXPECT_EQ(levels[0].level, "memory");
    EXPECT_EQ(levels[0].interval_seconds, plan.safepoint().interval_seconds);
    EXPECT_NE(levels[0].explanation.find(FormatDuration(plan.safepoint().interval_seconds)),
              std::string::npos)
        << levels[0].explanation;
    // The path takes a step as often as it can: every m-th save, m = ceil(persist / P).
    EXPECT_EQ(levels[1].level, "path");
    EXPECT_EQ(levels[1].every,
              static_cast<uint64_t>(std::ceil(60 / plan.safepoint().interval_seconds)));
    EXPECT_DOUBLE_EQ(levels[1].interval_seconds,
                     plan.safepoint().interval_seconds * static_cast<double>(levels[1].every));
  }
}

TEST(PlanTest, AGivenIntervalEvaluatesEveryStrategyThere) {
  ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(Job(), 600.0));
  EXPECT_FALSE(plan.optimal);
  const auto at = Strategies(plan.inputs, 600);
  for (size_t i = 0; i < plan.strategies.size(); ++i) {
    EXPECT_EQ(plan.strategies[i].interval_seconds, 600);
    EXPECT_DOUBLE_EQ(plan.strategies[i].goodput, AnalyticGoodput(at[i]));
  }
  EXPECT_FALSE(MakePlan(Job(), -1.0).ok());
}

TEST(PlanTest, IntervalsInStepsWithAStepTime) {
  SimulationInputs in = Job();
  in.step_seconds = 2;
  ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(in));
  const StrategyResult& sp = plan.safepoint();
  ASSERT_TRUE(sp.interval_steps.has_value());
  // k steps last k x 2 s + the save's 0.5 s.
  EXPECT_EQ(*sp.interval_steps, static_cast<uint64_t>(std::round((sp.interval_seconds - 0.5) / 2)));
  ASSERT_TRUE(sp.persist_every_steps.has_value());
  EXPECT_EQ(*sp.persist_every_steps, *sp.interval_steps * sp.persist_every_saves);
  const auto levels = AdviseLevels(plan, {{"tier 1", 1e4}});
  ASSERT_EQ(levels.size(), 3u);
  EXPECT_NE(levels[1].explanation.find("persist_every=" + std::to_string(*sp.persist_every_steps)),
            std::string::npos)
      << levels[1].explanation;
  EXPECT_EQ(levels[2].level, "tier 1");
  EXPECT_GE(levels[2].interval_seconds, 1e4);
  EXPECT_EQ(*levels[2].interval_steps, *levels[1].interval_steps * levels[2].every);
  EXPECT_EQ(IntervalSteps(0.6, 0.5, 2), 1u);  // never fewer than one step
  EXPECT_FALSE(IntervalSteps(10, 0.5, 0).has_value());
  EXPECT_EQ(IntervalText(12, 3), "12 s (3 steps)");
}

TEST(PlanTest, PersistEverySaves) {
  EXPECT_EQ(PersistEverySaves(60, 600), 1u);
  EXPECT_EQ(PersistEverySaves(60, 30), 2u);
  EXPECT_EQ(PersistEverySaves(61, 30), 3u);
  EXPECT_EQ(PersistEverySaves(0, 30), 1u);
}

TEST(PlanTest, PeerCopiesNeedTwoNodes) {
  SimulationInputs in = Job();
  in.peer_copies = true;  // one GPU: no peer to hold a copy
  auto plan = MakePlan(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("peer copies need at least two nodes"), std::string::npos)
      << plan.status().ToString();
}

// A restore cost that is not known is never free: from storage it costs what the persist did,
// from memory what the snapshot did (the "free restores from peers" of issue 36).
TEST(PlanTest, UnknownRestoresAreEstimatedNotFree) {
  SimulationInputs in;
  in.mtbf_seconds = 3600;
  in.snapshot_seconds = 0.5;
  in.persist_seconds = 40;
  ASSERT_OK_AND_ASSIGN(SimulationInputs done, CompleteInputs(in));
  EXPECT_EQ(done.restore_memory_seconds, 0.5);
  EXPECT_EQ(done.restore_storage_seconds, 40);
  EXPECT_EQ(done.restore_peer_seconds, 40);
}

// A history whose save lines carry their steps and the job's shape: the step time and the
// shape come from it.
TEST(JobInputsTest, StepTimeAndShapeFromTheHistory) {
  TempDir dir;
  const std::string path = dir.path() + "/safepoint-history.jsonl";
  {
    ASSERT_OK_AND_ASSIGN(auto w, HistoryWriter::Open(path, /*save_line_gap=*/3600));
    ASSERT_OK(w.RecordStart(1));
    JobShape shape;
    shape.world_size = 16;
    shape.node_ranks = 8;
    shape.peer_copies = true;
    w.SetShape(shape);
    for (uint64_t step = 10; step <= 40; step += 10) ASSERT_OK(w.RecordSave(0.5, step));
    ASSERT_OK(w.RecordPersist("path", 60, 1000));
    ASSERT_OK(w.RecordClose());
  }
  ASSERT_OK_AND_ASSIGN(auto h, ReadHistory(path));
  ASSERT_TRUE(h.shape.has_value());
  EXPECT_EQ(h.shape->world_size, 16u);
  ASSERT_TRUE(h.steps_per_save.has_value());
  EXPECT_DOUBLE_EQ(*h.steps_per_save, 10);
  const JobInputs j = InputsFromHistory(h);
  EXPECT_EQ(j.in.gpus, 16u);
  EXPECT_EQ(j.in.gpus_per_node, 8u);
  EXPECT_TRUE(j.in.peer_copies);
  EXPECT_NE(j.sources.at("shape").find("recorded: 16 ranks, 8 on rank 0's node (2 nodes)"),
            std::string::npos)
      << j.sources.at("shape");
  EXPECT_EQ(j.in.snapshot_seconds, 0.5);
  EXPECT_EQ(j.in.persist_seconds, 60);
  // The four saves came microseconds apart here, less than their blocking time: no step time.
  EXPECT_EQ(j.in.step_seconds, 0);

  // Lines as the agent writes them over a longer run: 3 saves 20 steps apart, 5 s apart, each
  // blocking 0.5 s: a step trains (5 - 0.5) / 20 s.
  const std::string lines =
      "{\"t\":1000,\"ev\":\"start\",\"run\":1}\n"
      "{\"t\":1010,\"ev\":\"save\",\"n\":3,\"seconds\":0.5,\"steps\":[20,60],\"span\":10,"
      "\"world_size\":1,\"node_ranks\":1,\"peers\":false}\n";
  const HistorySummary one = SummarizeHistory(lines, "test");
  ASSERT_TRUE(one.step_seconds.has_value());
  EXPECT_DOUBLE_EQ(*one.step_seconds, (5 - 0.5) / 20);
  const JobInputs k = InputsFromHistory(one);
  EXPECT_EQ(k.in.gpus, 1u);
  EXPECT_FALSE(k.in.peer_copies);
  EXPECT_DOUBLE_EQ(k.in.step_seconds, (5 - 0.5) / 20);
}

// A history of an earlier version records no shape: the world size comes from the job's newest
// COMMIT record, on one node, without peers; with neither, one process. Never 8 GPUs with
// copies on peers.
TEST(JobInputsTest, WithoutARecordedShapeNoPeersAreAssumed) {
  const std::string lines =
      "{\"t\":1000,\"ev\":\"start\",\"run\":1}\n"
      "{\"t\":1010,\"ev\":\"save\",\"n\":3,\"seconds\":0.5}\n"
      "{\"t\":1011,\"ev\":\"persist\",\"level\":\"path\",\"seconds\":4,\"bytes\":1000}\n"
      "{\"t\":1020,\"ev\":\"start\",\"run\":2}\n"
      "{\"t\":1030,\"ev\":\"close\"}\n";
  const HistorySummary h = SummarizeHistory(lines, "test");
  JobInputs j = InputsFromHistory(h);
  EXPECT_EQ(j.in.gpus, 1u);
  EXPECT_FALSE(j.in.peer_copies);
  EXPECT_NE(j.sources.at("shape").find("one process"), std::string::npos);
  // One interruption: (11 + 10 s running + a 9 s restart) / 1.
  EXPECT_EQ(j.in.mtbf_seconds, 30);
  EXPECT_EQ(j.in.restart_seconds, 9);
  EXPECT_TRUE(j.restore_storage_estimated);
  EXPECT_GT(j.in.restore_storage_seconds, 0);
  j = InputsFromHistory(h, /*record_world_size=*/4);
  EXPECT_EQ(j.in.gpus, 4u);
  EXPECT_EQ(Nodes(j.in), 1u);
  EXPECT_FALSE(j.in.peer_copies);
  ASSERT_OK_AND_ASSIGN(Plan plan, MakePlan(j.in));
  // The node loss restores from storage, with the lag of the persisted step.
  EXPECT_GT(plan.safepoint().modes.at(1).recovery_seconds,
            j.in.restart_seconds + j.in.restore_storage_seconds);
}

}  // namespace
}  // namespace safepoint::advisor::plan_test
