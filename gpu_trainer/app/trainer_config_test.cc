// gpu_trainer's flags into TrainerOptions: the job spec's rules check them (JobSpecFromTrainerFlags
// carries only the flags a command line changed), errors name the flag, and valid values arrive
// as given.
#include "gpu_trainer/app/trainer_config.h"

#include <functional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jobs/spec/job_spec.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(int, layers);
ABSL_DECLARE_FLAG(int, heads);
ABSL_DECLARE_FLAG(int64_t, steps);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(float, lr);
ABSL_DECLARE_FLAG(float, min_lr);
ABSL_DECLARE_FLAG(bool, resume);
ABSL_DECLARE_FLAG(std::string, checkpoint_dir);
ABSL_DECLARE_FLAG(int, keep_checkpoints);
ABSL_DECLARE_FLAG(std::string, data);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, collectives);

namespace offload {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(TrainerConfig, TheDefaultsAreValidAndLeaveTheSpecEmpty) {
  absl::FlagSaver saver;
  absl::StatusOr<TrainerOptions> o = TrainerOptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->model.num_layers, 4);  // the demo preset
  EXPECT_EQ(o->model.channels, 128);
  absl::StatusOr<v1::JobSpec> spec = JobSpecFromTrainerFlags();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->ByteSizeLong(), 0u) << spec->ShortDebugString();
}

TEST(TrainerConfig, ChangedFlagsArriveAsGiven) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_layers, 2);
  absl::SetFlag(&FLAGS_steps, 7);
  absl::SetFlag(&FLAGS_lr, 3e-3f);
  absl::SetFlag(&FLAGS_dtype, "bf16");
  absl::StatusOr<v1::JobSpec> spec = JobSpecFromTrainerFlags();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().layers(), 2);
  EXPECT_FALSE(spec->model().has_heads());  // left at its default: unset
  EXPECT_EQ(spec->training().steps(), 7);
  EXPECT_EQ(spec->optimizer().lr(), 3e-3f);
  absl::StatusOr<TrainerOptions> o = TrainerOptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->model.num_layers, 2);
  EXPECT_EQ(o->model.num_heads, 4);  // the preset's
  EXPECT_EQ(o->steps, 7u);
  EXPECT_EQ(o->schedule.total_steps(), 7u);
  EXPECT_EQ(o->adam.lr(), 3e-3f);
  EXPECT_EQ(o->schedule.max_lr(), 3e-3f);
  EXPECT_EQ(o->param_dtype, DType::kBf16);
}

TEST(TrainerConfig, BadValuesAreRefusedNamingTheFlag) {
  struct Case {
    std::function<void()> set;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[] { absl::SetFlag(&FLAGS_steps, 0); }, "--steps: must be >= 1, got 0"},
      {[] { absl::SetFlag(&FLAGS_model, "gpt5"); }, "--model: must be one of demo, gpt2"},
      {[] { absl::SetFlag(&FLAGS_dtype, "fp8"); }, "--dtype: must be one of fp16, bf16"},
      {[] { absl::SetFlag(&FLAGS_resume, true); }, "--resume: needs --checkpoint_dir"},
      {[] { absl::SetFlag(&FLAGS_keep_checkpoints, 0); },
       "--keep_checkpoints: must be >= 1, got 0"},
      {[] {
         absl::SetFlag(&FLAGS_lr, 0.01f);
         absl::SetFlag(&FLAGS_min_lr, 0.1f);
       },
       "--min_lr: must be <= --lr 0.01, got 0.1"},
      {[] { absl::SetFlag(&FLAGS_data, ""); }, "--data: required"},
      {[] { absl::SetFlag(&FLAGS_layers, -1); }, "--layers: must be > 0, got -1"},
  };
  for (const Case& c : cases) {
    absl::FlagSaver saver;
    c.set();
    absl::StatusOr<TrainerOptions> o = TrainerOptionsFromFlags();
    ASSERT_FALSE(o.ok()) << c.message;
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(o.status().message()), StartsWith(c.message));
  }
  // A shape the preset cannot take: the model's own check, through ResolveModel.
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_heads, 3);
  absl::StatusOr<TrainerOptions> o = TrainerOptionsFromFlags();
  ASSERT_FALSE(o.ok());
  EXPECT_THAT(std::string(o.status().message()), HasSubstr("divisible"));
}

// --collectives picks how ranks meet; nccl is refused where it cannot serve, each time saying
// what works instead.
TEST(TrainerConfig, CollectivesAreGlooOrNcclAndNcclNeedsCuda) {
  absl::FlagSaver saver;
  absl::StatusOr<TrainerOptions> o = TrainerOptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->collective_library, CollectiveLibrary::kGloo);
  absl::SetFlag(&FLAGS_collectives, "mpi");
  EXPECT_THAT(TrainerOptionsFromFlags().status().message(),
              HasSubstr("--collectives: must be one of gloo, nccl"));
  absl::SetFlag(&FLAGS_collectives, "nccl");
  EXPECT_THAT(TrainerOptionsFromFlags().status().message(), HasSubstr("--collectives: nccl needs"));
  absl::SetFlag(&FLAGS_device, "cuda");
  o = TrainerOptionsFromFlags();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->collective_library, CollectiveLibrary::kNccl);
  // NCCL reduces GPU buffers: CUDA ranks only, however many.
  EXPECT_TRUE(CheckCollectiveLibrary(ComputeDevice::kCuda, CollectiveLibrary::kNccl).ok());
  absl::Status cpu = CheckCollectiveLibrary(ComputeDevice::kCpu, CollectiveLibrary::kNccl);
  EXPECT_EQ(cpu.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cpu.message(), HasSubstr("--device=cuda"));
  EXPECT_TRUE(CheckCollectiveLibrary(ComputeDevice::kCuda, CollectiveLibrary::kGloo).ok());
}

}  // namespace
}  // namespace offload
