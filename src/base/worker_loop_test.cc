#include "base/worker_loop.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <future>
#include <thread>
#include <vector>

namespace safepoint::internal::worker_loop_test {
namespace {

using namespace std::chrono_literals;
using Loop = WorkerLoop<int>;

// A FIFO owner, like the agent's queues: `run` records what ran and can be held at a gate.
struct Queue {
  explicit Queue(Loop::OnStop on_stop) : loop(mu, on_stop) {}

  void Start() {
    loop.Start({.take = [this] { return Loop::TakeFront(queue); },
                .run =
                    [this](int& t) {
                      if (t == gated) {
                        started.set_value();
                        gate.get_future().wait();
                      }
                      std::lock_guard<std::mutex> lock(mu);
                      ran.push_back(t);
                    }});
  }
  void Push(int t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(t);
    }
    loop.Wake();
  }
  std::vector<int> Ran() {
    std::lock_guard<std::mutex> lock(mu);
    return ran;
  }

  std::mutex mu;
  std::deque<int> queue;
  std::vector<int> ran;
  int gated = -1;              // the task whose run waits for `gate`
  std::promise<void> started;  // set when the gated task runs
  std::promise<void> gate;
  Loop loop;  // last: stopped before the rest goes
};

TEST(WorkerLoopTest, RunsTasksInTheOrderTaken) {
  Queue q(Loop::OnStop::kDrain);
  q.Start();
  for (int i = 0; i < 100; ++i) q.Push(i);
  q.loop.Stop();
  std::vector<int> want(100);
  for (int i = 0; i < 100; ++i) want[i] = i;
  EXPECT_EQ(q.Ran(), want);
}

TEST(WorkerLoopTest, StopWhileBusyDrainsWhatIsQueued) {
  Queue q(Loop::OnStop::kDrain);
  q.gated = 0;
  q.Start();
  q.Push(0);
  q.started.get_future().wait();  // task 0 is running
  q.Push(1);
  q.Push(2);
  q.loop.RequestStop();
  q.gate.set_value();
  q.loop.Join();
  EXPECT_EQ(q.Ran(), (std::vector<int>{0, 1, 2}));
  EXPECT_FALSE(q.loop.started());
}

TEST(WorkerLoopTest, StopWhileBusyWithDropFinishesOnlyTheTaskInFlight) {
  Queue q(Loop::OnStop::kDrop);
  q.gated = 0;
  q.Start();
  q.Push(0);
  q.started.get_future().wait();
  q.Push(1);
  q.Push(2);
  q.loop.RequestStop();
  q.gate.set_value();
  q.loop.Join();
  EXPECT_EQ(q.Ran(), (std::vector<int>{0}));
  std::lock_guard<std::mutex> lock(q.mu);
  EXPECT_EQ(q.queue.size(), 2u);  // left queued
}

TEST(WorkerLoopTest, StopBeforeStartStillDrainsWithDrainAndRunsNothingWithDrop) {
  Queue drain(Loop::OnStop::kDrain);
  drain.Push(7);
  drain.loop.RequestStop();
  drain.Start();
  drain.loop.Join();
  EXPECT_EQ(drain.Ran(), (std::vector<int>{7}));

  Queue drop(Loop::OnStop::kDrop);
  drop.Push(7);
  drop.loop.RequestStop();
  drop.Start();
  drop.loop.Join();
  EXPECT_TRUE(drop.Ran().empty());
}

// Ping-pong: each task is pushed only after the previous one ran, so the worker is asleep (or
// about to be) at every push. A lost wakeup leaves a task unrun and the wait below times out.
TEST(WorkerLoopTest, NoWakeupIsLost) {
  Queue q(Loop::OnStop::kDrop);
  q.Start();
  constexpr int kTasks = 20000;
  for (int i = 0; i < kTasks; ++i) {
    q.Push(i);
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(q.mu);
        if (q.ran.size() == static_cast<size_t>(i) + 1) break;
      }
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "task " << i << " never ran";
      std::this_thread::yield();
    }
  }
  q.loop.Stop();
  EXPECT_EQ(q.Ran().size(), static_cast<size_t>(kTasks));
}

// Many producers at once: every task runs exactly once.
TEST(WorkerLoopTest, ConcurrentProducersLoseNothing) {
  Queue q(Loop::OnStop::kDrain);
  q.Start();
  std::vector<std::thread> producers;
  for (int p = 0; p < 4; ++p) {
    producers.emplace_back([&q, p] {
      for (int i = 0; i < 1000; ++i) q.Push(p * 1000 + i);
    });
  }
  for (std::thread& t : producers) t.join();
  q.loop.Stop();
  std::vector<int> ran = q.Ran();
  std::sort(ran.begin(), ran.end());
  ASSERT_EQ(ran.size(), 4000u);
  for (int i = 0; i < 4000; ++i) EXPECT_EQ(ran[i], i);
}

// Wait(until) wakes the worker by then without a Wake().
TEST(WorkerLoopTest, WaitUntilWakesAtTheDeadline) {
  std::mutex mu;
  const auto due = std::chrono::steady_clock::now() + 50ms;
  std::promise<std::chrono::steady_clock::time_point> ran_at;
  bool done = false;
  Loop loop(mu, Loop::OnStop::kDrop);
  loop.Start({.take =
                  [&] {
                    if (done) return Loop::Wait();
                    if (std::chrono::steady_clock::now() < due) return Loop::Wait(due);
                    done = true;
                    return Loop::Run(1);
                  },
              .run = [&](int&) { ran_at.set_value(std::chrono::steady_clock::now()); }});
  auto f = ran_at.get_future();
  ASSERT_EQ(f.wait_for(10s), std::future_status::ready);
  EXPECT_GE(f.get(), due);
  loop.Stop();
}

// A worker sleeping in `prepare` (a backoff) ends at once on Stop; `run` never comes.
TEST(WorkerLoopTest, SleepUnlessStoppingEndsOnStop) {
  std::mutex mu;
  std::promise<void> sleeping;
  std::atomic<bool> stopped_early{false};
  std::atomic<bool> woke{false};
  std::atomic<bool> ran{false};
  Loop loop(mu, Loop::OnStop::kDrop);
  loop.Start({.prepare =
                  [&] {
                    std::unique_lock<std::mutex> lock(mu);
                    sleeping.set_value();
                    stopped_early = loop.SleepUnlessStopping(lock, std::chrono::hours(1));
                    woke = true;
                    return !stopped_early;
                  },
              .take = [&] { return Loop::Run(1); },
              .run = [&](int&) { ran = true; }});
  sleeping.get_future().wait();
  loop.Wake();  // a plain wakeup does not end the sleep...
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(woke);
  const auto t0 = std::chrono::steady_clock::now();
  loop.Stop();  // ...a stop does
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_TRUE(stopped_early);
  EXPECT_FALSE(ran);
}

TEST(WorkerLoopTest, StopIsIdempotentAndWorksWithoutStart) {
  std::mutex mu;
  Loop loop(mu, Loop::OnStop::kDrain);
  loop.Stop();
  loop.Stop();
  EXPECT_FALSE(loop.started());
}

}  // namespace
}  // namespace safepoint::internal::worker_loop_test
