#include "services/job_controller/job_state.h"

#include <set>
#include <utility>

#include "gtest/gtest.h"

namespace offload {
namespace {

using v1::JobState;

constexpr JobState kAll[] = {v1::JOB_STATE_PENDING,   v1::JOB_STATE_RUNNING,
                             v1::JOB_STATE_PAUSED,    v1::JOB_STATE_CHECKPOINTING,
                             v1::JOB_STATE_SUCCEEDED, v1::JOB_STATE_FAILED,
                             v1::JOB_STATE_CANCELLED};

// Every legal edge; every other pair of states must be refused.
const std::set<std::pair<JobState, JobState>>& Allowed() {
  static const auto* allowed = new std::set<std::pair<JobState, JobState>>{
      {v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING},
      {v1::JOB_STATE_PENDING, v1::JOB_STATE_CANCELLED},
      {v1::JOB_STATE_PENDING, v1::JOB_STATE_FAILED},
      {v1::JOB_STATE_PENDING, v1::JOB_STATE_PAUSED},
      {v1::JOB_STATE_RUNNING, v1::JOB_STATE_CHECKPOINTING},
      {v1::JOB_STATE_RUNNING, v1::JOB_STATE_PAUSED},
      {v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED},
      {v1::JOB_STATE_RUNNING, v1::JOB_STATE_FAILED},
      {v1::JOB_STATE_RUNNING, v1::JOB_STATE_CANCELLED},
      {v1::JOB_STATE_RUNNING, v1::JOB_STATE_PENDING},
      {v1::JOB_STATE_CHECKPOINTING, v1::JOB_STATE_RUNNING},
      {v1::JOB_STATE_CHECKPOINTING, v1::JOB_STATE_PAUSED},
      {v1::JOB_STATE_CHECKPOINTING, v1::JOB_STATE_SUCCEEDED},
      {v1::JOB_STATE_CHECKPOINTING, v1::JOB_STATE_FAILED},
      {v1::JOB_STATE_CHECKPOINTING, v1::JOB_STATE_CANCELLED},
      {v1::JOB_STATE_CHECKPOINTING, v1::JOB_STATE_PENDING},
      {v1::JOB_STATE_PAUSED, v1::JOB_STATE_PENDING},
      {v1::JOB_STATE_PAUSED, v1::JOB_STATE_CANCELLED},
  };
  return *allowed;
}

TEST(JobStateTest, TransitionTable) {
  for (JobState from : kAll) {
    for (JobState to : kAll) {
      const bool want = Allowed().count({from, to}) > 0;
      const absl::Status got = CheckTransition(from, to);
      EXPECT_EQ(got.ok(), want) << StateName(from) << " -> " << StateName(to) << ": " << got;
      if (!got.ok()) {
        EXPECT_EQ(got.code(), absl::StatusCode::kFailedPrecondition);
        EXPECT_EQ(got.message(), "a " + StateName(from) + " job cannot become " + StateName(to));
      }
    }
  }
}

TEST(JobStateTest, TerminalStatesGoNowhere) {
  for (JobState from : kAll) {
    bool any = false;
    for (JobState to : kAll) any |= CheckTransition(from, to).ok();
    EXPECT_EQ(IsTerminal(from), !any) << StateName(from);
  }
  EXPECT_FALSE(CheckTransition(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING).ok());
}

TEST(JobStateTest, ActiveAndNames) {
  EXPECT_TRUE(IsActive(v1::JOB_STATE_RUNNING));
  EXPECT_TRUE(IsActive(v1::JOB_STATE_CHECKPOINTING));
  EXPECT_FALSE(IsActive(v1::JOB_STATE_PAUSED));
  EXPECT_EQ(StateName(v1::JOB_STATE_RUNNING), "running");
  EXPECT_EQ(StateName(v1::JOB_STATE_CHECKPOINTING), "checkpointing");
  EXPECT_EQ(StateName(static_cast<JobState>(42)), "state 42");
}

}  // namespace
}  // namespace offload
