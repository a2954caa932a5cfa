// WorkerLoop<Task>: one worker thread that takes work from its owner's state and runs it, sleeping
// on a condition variable while there is none, until it is told to stop.
//
// The owner keeps the work (a queue, a newest-only candidate, ...) under a mutex of its own and
// lends that mutex to the loop, so that taking a task, the loop's stop flag and the owner's
// bookkeeping change together. The worker repeats:
//   1. under the mutex: when stopping and the loop was made with OnStop::kDrop, the thread ends;
//      else `take` decides: Run(task) (the task leaves the owner's state; the owner may mark it in
//      flight there), or Wait(until). On Wait while stopping (OnStop::kDrain: nothing is left)
//      the thread ends; otherwise it sleeps until Wake(), RequestStop() or `until`, and asks
//      `take` again (also after a spurious wakeup).
//   2. without the mutex: `run(task)`. It records its result in the owner's state under the mutex
//      and tells whoever waits for it (an eventfd of the agent's poll loop) itself.
// An optional `prepare` runs once on the worker before the first `take`, without the mutex
// (opening a store, say); it returns false to end the thread, and may sleep with
// SleepUnlessStopping.
//
// Stopping: OnStop::kDrain runs every task `take` still hands out, then ends; OnStop::kDrop ends
// after the task in flight (what is queued stays queued). Neither interrupts a running task: an
// owner that must cut one short signals it itself (a cancel flag). Owners with several loops
// call RequestStop on all of them before Join on any, so that none keeps working while another
// is joined.
//
// No wakeup is lost: `take` reads the owner's state under the same mutex the owner changes it
// under, and the worker sleeps only after `take` said Wait, in the same critical section; the
// owner calls Wake() after its change (holding the mutex or not).
//
// Threads: Start, RequestStop, Join and Stop are called by the owner (not by the worker); Wake
// by any thread; stopping() and SleepUnlessStopping with the owner's mutex held, the latter on the
// worker only. `prepare`, `take` and `run` run on the worker thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

namespace safepoint::internal {

template <typename Task>
class WorkerLoop {
 public:
  using Clock = std::chrono::steady_clock;
  enum class OnStop { kDrain, kDrop };

  // What `take` decided.
  struct Next {
    std::optional<Task> task;                            // set: run it
    Clock::time_point until = Clock::time_point::max();  // else: sleep until then at the latest
  };
  static Next Run(Task task) { return Next{std::move(task)}; }
  static Next Wait(Clock::time_point until = Clock::time_point::max()) {
    return Next{std::nullopt, until};
  }
  // A FIFO's `take`: Run(the front task, popped) or, when `queue` is empty, Wait(). With
  // `in_flight`, a copy of the task handed out is kept there (the owner resets it when the task
  // is done, under the mutex, so that the task is always either queued, in flight or done).
  static Next TakeFront(std::deque<Task>& queue, std::optional<Task>* in_flight = nullptr) {
    if (queue.empty()) return Wait();
    Task task = std::move(queue.front());
    queue.pop_front();
    if (in_flight != nullptr) *in_flight = task;
    return Run(std::move(task));
  }

  struct Body {
    std::function<bool()> prepare = {};  // optional
    std::function<Next()> take = {};     // under the owner's mutex
    std::function<void(Task&)> run = {};
  };

  WorkerLoop(std::mutex& mu, OnStop on_stop) : mu_(mu), on_stop_(on_stop) {}
  ~WorkerLoop() { Stop(); }
  WorkerLoop(const WorkerLoop&) = delete;
  WorkerLoop& operator=(const WorkerLoop&) = delete;

  // Starts the worker. Called once. A loop asked to stop before it started still runs `prepare`
  // and, with kDrain, what `take` hands out.
  void Start(Body body) {
    body_ = std::move(body);
    thread_ = std::thread([this] { Work(); });
  }
  // True from Start until Join.
  bool started() const { return thread_.joinable(); }

  void Wake() { cv_.notify_all(); }

  // Under the owner's mutex.
  bool stopping() const { return stopping_; }

  // On the worker, with `lock` holding the owner's mutex: sleeps for `d` or until a stop is
  // requested (other wakeups do not end it). True when stopping.
  bool SleepUnlessStopping(std::unique_lock<std::mutex>& lock, Clock::duration d) {
    return cv_.wait_for(lock, d, [&] { return stopping_; });
  }

  // Tells the worker to stop (see OnStop); returns at once. Idempotent.
  void RequestStop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
  }
  // Waits for the worker to end (after RequestStop). Idempotent.
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  void Stop() {
    RequestStop();
    Join();
  }

 private:
  void Work() {
    if (body_.prepare && !body_.prepare()) return;
    for (;;) {
      std::optional<Task> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
          if (stopping_ && on_stop_ == OnStop::kDrop) return;
          Next next = body_.take();
          if (next.task) {
            task = std::move(next.task);
            break;
          }
          if (stopping_) return;  // kDrain: nothing is left
          // wait_until(max) overflows in some clocks' arithmetic: wait without a deadline.
          if (next.until == Clock::time_point::max()) {
            cv_.wait(lock);
          } else {
            cv_.wait_until(lock, next.until);
          }
        }
      }
      body_.run(*task);
    }
  }

  std::mutex& mu_;  // the owner's; guards stopping_
  const OnStop on_stop_;
  std::condition_variable cv_;
  bool stopping_ = false;
  Body body_;  // written by Start before the worker exists
  std::thread thread_;
};

}  // namespace safepoint::internal
