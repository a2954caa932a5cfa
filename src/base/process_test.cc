#include "base/process.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "testing/test_util.h"

namespace safepoint::internal::process_test {
namespace {

using test::KillLeavingZombie;

// A child that runs until killed.
pid_t Sleeper() {
  const pid_t child = fork();
  if (child == 0) {
    for (;;) pause();
  }
  EXPECT_GT(child, 0);
  return child;
}

void Reap(pid_t child) {
  int status = 0;
  EXPECT_EQ(waitpid(child, &status, 0), child);
}

TEST(ProcessTest, ThisProcessIsAliveAndNamedByItsStartTime) {
  const ProcessId self = SelfProcessId();
  EXPECT_EQ(self.pid, static_cast<uint32_t>(getpid()));
  EXPECT_NE(self.start_ticks, 0u);
  EXPECT_EQ(ProcessStartTicks(self.pid), self.start_ticks);
  EXPECT_TRUE(ProcessAlive(self));
  EXPECT_EQ(ProcessStateOf(self), ProcessState::kAlive);
}

TEST(ProcessTest, AReusedPidIsAnotherProcess) {
  ProcessId other = SelfProcessId();
  other.start_ticks -= 1;  // the pid's holder started at another time
  EXPECT_FALSE(ProcessAlive(other));
  EXPECT_EQ(ProcessStateOf(other), ProcessState::kDead);
}

TEST(ProcessTest, AReapedProcessIsDead) {
  const pid_t child = Sleeper();
  const ProcessId id{static_cast<uint32_t>(child), ProcessStartTicks(child).value_or(0)};
  ASSERT_NE(id.start_ticks, 0u);
  EXPECT_TRUE(ProcessAlive(id));
  EXPECT_EQ(ProcessStateOf(id), ProcessState::kAlive);
  ASSERT_EQ(kill(child, SIGKILL), 0);
  Reap(child);
  EXPECT_FALSE(ProcessAlive(id));
  EXPECT_EQ(ProcessStateOf(id), ProcessState::kDead);
  EXPECT_FALSE(ProcessStartTicks(id.pid).has_value());
}

// A zombie still holds its pid but can act no more, and has unmapped its memory: dead once its
// every thread has exited, for ProcessAlive (gc, slot writers, staging files) as for
// ProcessStateOf (locks), with or without a recorded start time.
TEST(ProcessTest, AZombieWhoseThreadsHaveExitedIsDeadButStillHoldsItsPid) {
  const pid_t child = Sleeper();
  const ProcessId id{static_cast<uint32_t>(child), ProcessStartTicks(child).value_or(0)};
  ASSERT_NE(id.start_ticks, 0u);
  KillLeavingZombie(child);
  EXPECT_EQ(ProcessStartTicks(id.pid), id.start_ticks);  // the pid is still held
  EXPECT_FALSE(ProcessAlive(id));
  EXPECT_FALSE(ProcessAlive({id.pid, 0}));
  EXPECT_EQ(ProcessStateOf(id), ProcessState::kDead);
  Reap(child);
}

TEST(ProcessTest, WithoutAStartTimeAnExistingPidIsUnknownAndAMissingOneDead) {
  EXPECT_EQ(ProcessStateOf({static_cast<uint32_t>(getpid()), 0}), ProcessState::kUnknown);
  const pid_t child = Sleeper();
  ASSERT_EQ(kill(child, SIGKILL), 0);
  Reap(child);
  EXPECT_EQ(ProcessStateOf({static_cast<uint32_t>(child), 0}), ProcessState::kDead);
  EXPECT_EQ(ProcessStateOf({0, 0}), ProcessState::kUnknown);
}

TEST(ProcessTest, BootAndPidNamespaceNameWhereAPidMeansSomething) {
  const std::string boot = BootId();
  EXPECT_TRUE(ValidBootId(boot)) << boot;
  EXPECT_FALSE(ValidBootId("not-a-boot-id"));
  EXPECT_NE(PidNamespaceOf(getpid()), 0u);
  EXPECT_TRUE(ProcIsOwnNamespace());
}

}  // namespace
}  // namespace safepoint::internal::process_test
