// Job files (YAML and JSON), their validation and the JobSpec <-> gpu_trainer flags table.
#include "jobs/spec/job_spec.h"

#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/testing/test_util.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

using google::protobuf::util::MessageDifferencer;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// ---------------------------------------------------------------------------------------------
// Job files.

constexpr char kYamlSpec[] = R"(
# a comment
name: tiny run
model: {preset: demo, layers: 2}
data:
  path: /data/corpus.txt
  val_fraction: 0.05
  seed: 18446744073709551615
optimizer:
  algorithm: adamw
  lr: 3          # an integer where a float goes
  min_lr: 1e-4
  beta2: 0.95
training:
  steps: 100
  batch: 8
  microBatches: 2   # the JSON name works too
  dtype: bf16
parallel:
  ranks: 2
  dpu: true
  bucket_mb: 0.5
checkpoint:
  dir: /ckpt
  resume: false
max_restarts: 3
)";

constexpr char kJsonSpec[] = R"({
  "name": "tiny run",
  "model": {"preset": "demo", "layers": 2},
  "data": {"path": "/data/corpus.txt", "valFraction": 0.05, "seed": "18446744073709551615"},
  "optimizer": {"algorithm": "adamw", "lr": 3.0, "min_lr": 0.0001, "beta2": 0.95},
  "training": {"steps": "100", "batch": 8, "micro_batches": 2, "dtype": "bf16"},
  "parallel": {"ranks": 2, "dpu": true, "bucketMb": 0.5},
  "checkpoint": {"dir": "/ckpt", "resume": false},
  "maxRestarts": 3
})";

TEST(JobSpecParseTest, YamlAndJsonGiveTheSameSpec) {
  absl::StatusOr<v1::JobSpec> yaml = ParseJobSpec(kYamlSpec);
  ASSERT_TRUE(yaml.ok()) << yaml.status();
  absl::StatusOr<v1::JobSpec> json = ParseJobSpec(kJsonSpec);
  ASSERT_TRUE(json.ok()) << json.status();
  std::string diff;
  MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differencer.Compare(*yaml, *json)) << diff;

  EXPECT_EQ(yaml->name(), "tiny run");
  EXPECT_EQ(yaml->model().layers(), 2);
  EXPECT_EQ(yaml->data().seed(), 18446744073709551615ull);
  EXPECT_FLOAT_EQ(yaml->optimizer().lr(), 3.0f);
  EXPECT_FLOAT_EQ(yaml->optimizer().min_lr(), 1e-4f);
  EXPECT_EQ(yaml->training().micro_batches(), 2);
  EXPECT_TRUE(yaml->parallel().dpu());
  EXPECT_TRUE(yaml->checkpoint().has_resume());  // set, to false
  EXPECT_FALSE(yaml->checkpoint().resume());
  EXPECT_FALSE(yaml->training().has_seq_len());
  EXPECT_EQ(yaml->max_restarts(), 3u);
  EXPECT_TRUE(ValidateJobSpec(*yaml).ok()) << ValidateJobSpec(*yaml);
}

TEST(JobSpecParseTest, PrintedJsonParsesBack) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(kYamlSpec);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const std::string json = JobSpecToJson(*spec);
  EXPECT_THAT(json, HasSubstr("\"micro_batches\""));  // proto names, not JSON names
  absl::StatusOr<v1::JobSpec> back = ParseJobSpec(json);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << json;
  EXPECT_TRUE(MessageDifferencer::Equals(*spec, *back)) << json;
}

TEST(JobSpecParseTest, UnknownFieldNamesItsPathAndTheKnownOnes) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec("training:\n  steps: 3\n  batchh: 4\n");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(),
              AllOf(HasSubstr("training.batchh: unknown field"),
                    HasSubstr("JobSpec.training has: steps, batch, micro_batches")));

  spec = ParseJobSpec(R"({"nmae": "x"})");
  EXPECT_THAT(spec.status().message(),
              AllOf(HasSubstr("nmae: unknown field"), HasSubstr("JobSpec has: name, model")));
}

TEST(JobSpecParseTest, TypeErrorsNameThePathAndTheExpectedType) {
  struct Case {
    const char* text;
    const char* message;
  };
  const Case cases[] = {
      {"training: {batch: x}", "training.batch: expected an integer, got \"x\""},
      {"training: {batch: 1.5}", "training.batch: expected an integer, got \"1.5\""},
      {"training: {batch: 3000000000}", "training.batch: 3000000000 is out of range for int32"},
      {"parallel: {ranks: -1}", "parallel.ranks: -1 is out of range for uint32"},
      {"data: {seed: 18446744073709551616}", "data.seed: 18446744073709551616 is out of range"},
      {"parallel: {dpu: yes}", "parallel.dpu: expected true or false, got \"yes\""},
      {"optimizer: {lr: fast}", "optimizer.lr: expected a number, got \"fast\""},
      {"optimizer: {lr: 1e39}", "optimizer.lr: 1e39 is out of range for float"},
      {"optimizer: {lr: [1, 2]}", "optimizer.lr: expected a number, got a list"},
      {"training: {steps: }", "training.steps: expected an integer, got nothing (null)"},
      {"training: 5", "training: expected a map of fields, got \"5\""},
      {"max_restarts: 1\nmaxRestarts: 2", "max_restarts: given more than once"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(c.text);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(spec.status().message(), HasSubstr(c.message)) << c.text;
  }
}

TEST(JobSpecParseTest, DocumentsThatAreNoMapAreRefused) {
  for (const char* text : {"", "# nothing\n", "- a\n- b\n", "just text", "[1, 2]",
                           "a: 1\n---\nb: 2\n", "{\"name\": ", "name: [unclosed"}) {
    absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(text);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
  EXPECT_THAT(ParseJobSpec("- a\n").status().message(), HasSubstr("expected a map"));
  EXPECT_THAT(ParseJobSpec("name: [unclosed").status().message(), HasSubstr("line 1"));
  EXPECT_THAT(ParseJobSpec("a: 1\n---\nb: 2\n").status().message(),
              HasSubstr("more than one YAML document"));
}

// Found by job_spec_fuzz: YAML takes any bytes in a scalar, and a name that is not UTF-8 made a
// spec that protobuf cannot parse back (its JSON dropped the bytes).
TEST(JobSpecParseTest, StringsMustBeUtf8) {
  EXPECT_TRUE(ParseJobSpec("name: caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\n").ok());
  for (const char* text : {"name: caf\xe9\n", "name: a\xc3\n", "data: {path: /d\xed\xa0\x80}\n",
                           "name: \xc0\xaf\n", "name: \xf4\x90\x80\x80\n"}) {
    absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(text);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(spec.status().message(), HasSubstr("is not valid UTF-8")) << text;
  }
  EXPECT_THAT(ParseJobSpec("name: caf\xe9\n").status().message(),
              HasSubstr("name: is not valid UTF-8 (byte 3 of \"caf\\351\")"));
}

// Found by job_spec_fuzz: yaml-cpp's LoadAll never returned on a ',' outside any flow collection
// (empty documents forever, until memory ran out).
TEST(JobSpecParseTest, StrayCommaIsRefusedNotLoopedOn) {
  for (const char* text : {"\n,", ",", "name: x\n---\n,\n", " , ,"}) {
    absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(text);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
  EXPECT_THAT(ParseJobSpec("\n,").status().message(),
              HasSubstr("line 2, column 1: unexpected \",\""));
}

TEST(JobSpecParseTest, NonFiniteFloatsParseAndFailValidation) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec("data: {path: /d}\noptimizer: {lr: .nan}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(std::isnan(spec->optimizer().lr()));
  absl::Status status = ValidateJobSpec(*spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("optimizer.lr: must be a finite number"));

  spec = ParseJobSpec(R"({"data": {"path": "/d", "valFraction": "-Infinity"}})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(ValidateJobSpec(*spec).message(), HasSubstr("data.val_fraction: must be a finite"));
}

TEST(JobSpecFileTest, DemoJobParsesAndValidates) {
  absl::StatusOr<v1::JobSpec> spec =
      ReadJobSpecFile(std::string(OFFLOAD_SOURCE_DIR) + "/jobs/spec/testdata/demo_job.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().preset(), "demo");
  EXPECT_EQ(spec->data().path(), "/data/tinyshakespeare.txt");
  EXPECT_EQ(spec->training().steps(), 200);
  EXPECT_EQ(spec->training().batch(), 16);
  EXPECT_EQ(spec->parallel().ranks(), 1u);
  EXPECT_EQ(spec->parallel().optimizer_servers(), 1u);
  EXPECT_EQ(spec->checkpoint().dir(), "/tmp/offload-demo");
  EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << ValidateJobSpec(*spec);
}

TEST(JobSpecFileTest, MissingFileAndErrorsNameTheFile) {
  absl::StatusOr<v1::JobSpec> spec = ReadJobSpecFile("/nonexistent/job.yaml");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(spec.status().message(), HasSubstr("/nonexistent/job.yaml"));

  TempDir dir;
  const std::string file = dir.Write("job.yaml", "training: {stepz: 1}\n");
  spec = ReadJobSpecFile(file);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(), HasSubstr(file + ": training.stepz: unknown field"));
}

// ---------------------------------------------------------------------------------------------
// Validation.

v1::JobSpec ValidSpec() {
  v1::JobSpec spec;
  spec.set_name("ok-job_1.0");
  spec.mutable_data()->set_path("/data/corpus.txt");
  return spec;
}

TEST(ValidateJobSpecTest, MinimalSpecIsValidAndDataPathIsRequired) {
  EXPECT_TRUE(ValidateJobSpec(ValidSpec()).ok());
  v1::JobSpec spec;
  absl::Status status = ValidateJobSpec(spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("data.path: required"));
}

TEST(ValidateJobSpecTest, TenantPriorityAndPreemptibleParseAndAreChecked) {
  absl::StatusOr<v1::JobSpec> spec =
      ParseJobSpec("data: {path: /d.txt}\ntenant: team-a\npriority: 1000\npreemptible: false\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->tenant(), "team-a");
  EXPECT_EQ(spec->priority(), 1000);
  ASSERT_TRUE(spec->has_preemptible());
  EXPECT_FALSE(spec->preemptible());
  EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << ValidateJobSpec(*spec);
  // The controller reads these itself: no trainer flag carries them.
  for (const std::string& flag : JobSpecToFlags(*spec)) {
    EXPECT_THAT(flag, Not(HasSubstr("priority"))) << flag;
    EXPECT_THAT(flag, Not(HasSubstr("tenant"))) << flag;
  }
  const struct {
    std::string yaml;
    std::string says;
  } bad[] = {
      {"priority: 1001", "priority: must be in [0, 1000], got 1001"},
      {"priority: -1", "priority: must be in [0, 1000], got -1"},
      {"tenant: Team-A", "tenant: character \"T\" at position 0"},
      {"tenant: a_b", "tenant: character \"_\""},
      {absl::StrCat("tenant: ", std::string(64, 'a')), "tenant: 1 to 63 characters, got 64"},
  };
  for (const auto& c : bad) {
    absl::StatusOr<v1::JobSpec> parsed =
        ParseJobSpec(absl::StrCat("data: {path: /d.txt}\n", c.yaml, "\n"));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    const absl::Status status = ValidateJobSpec(*parsed);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.yaml;
    EXPECT_THAT(status.message(), HasSubstr(c.says)) << c.yaml;
  }
  EXPECT_THAT(ParseJobSpec("preemptible: maybe\n").status().message(), HasSubstr("preemptible"));
}

TEST(ValidateJobSpecTest, MessagesNameTheField) {
  struct Case {
    std::function<void(v1::JobSpec*)> edit;
    const char* message;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Case cases[] = {
      {[](v1::JobSpec* s) { s->mutable_data()->set_path("data/corpus.txt"); },
       "data.path: must be an absolute path"},
      {[nan](v1::JobSpec* s) { s->mutable_optimizer()->set_lr(nan); },
       "optimizer.lr: must be a finite number"},
      {[](v1::JobSpec* s) { s->mutable_optimizer()->set_lr(0); }, "optimizer.lr: must be > 0"},
      {[](v1::JobSpec* s) { s->mutable_optimizer()->set_beta2(1); },
       "optimizer.beta2: must be in [0, 1)"},
      {[](v1::JobSpec* s) { s->mutable_optimizer()->set_eps(0); }, "optimizer.eps: must be > 0"},
      {[](v1::JobSpec* s) { s->mutable_optimizer()->set_weight_decay(-1); },
       "optimizer.weight_decay: must be >= 0"},
      {[](v1::JobSpec* s) { s->mutable_optimizer()->set_algorithm("sgd"); },
       "optimizer.algorithm: must be one of adamw, adam, got \"sgd\""},
      {[](v1::JobSpec* s) { s->mutable_training()->set_steps(0); }, "training.steps: must be >= 1"},
      {[](v1::JobSpec* s) { s->mutable_training()->set_batch(0); }, "training.batch: must be >= 1"},
      {[](v1::JobSpec* s) { s->mutable_training()->set_micro_batches(0); },
       "training.micro_batches: must be >= 1"},
      {[](v1::JobSpec* s) {
         s->mutable_training()->set_batch(10);
         s->mutable_training()->set_micro_batches(2);
         s->mutable_parallel()->set_ranks(3);
       },
       "training.batch: 10 is not divisible by parallel.ranks x training.micro_batches = 3 x 2"},
      {[](v1::JobSpec* s) { s->mutable_training()->set_dtype("fp32"); },
       "training.dtype: must be one of fp16, bf16"},
      {[](v1::JobSpec* s) { s->mutable_training()->set_device("tpu"); },
       "training.device: must be one of cpu, cuda"},
      {[](v1::JobSpec* s) { s->mutable_training()->set_kernels("turbo"); },
       "training.kernels: must be one of fast, naive"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_transport("tcp"); },
       "parallel.transport: must be one of auto, grpc, shm, ucx"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_collectives("mpi"); },
       "parallel.collectives: must be one of gloo, nccl"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_optimizer_state("nvme"); },
       "parallel.optimizer_state: must be one of auto, memory, disk"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_shard_step_timeout_floor("30"); },
       "parallel.shard_step_timeout_floor: must be a duration in (0, 1h] such as 30s or 2m, got "
       "\"30\""},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_shard_step_timeout_floor("0s"); },
       "parallel.shard_step_timeout_floor: must be a duration in (0, 1h]"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_shard_step_timeout_floor("2h"); },
       "parallel.shard_step_timeout_floor: must be a duration in (0, 1h]"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_collectives("nccl"); },
       "parallel.collectives: nccl needs training.device cuda"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_ranks(0); },
       "parallel.ranks: must be in [1, 1024]"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_optimizer_servers(2000); },
       "parallel.optimizer_servers: must be in [1, 1024]"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_zero_stage(1); },
       "parallel.zero_stage: must be in {2, 3}"},
      {[](v1::JobSpec* s) {
         s->mutable_parallel()->set_zero_stage(3);
         s->mutable_parallel()->set_param_window_layers(0);
       },
       "parallel.param_window_layers: must be >= 1"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_param_window_layers(4); },
       "parallel.param_window_layers: needs parallel.zero_stage 3"},
      {[](v1::JobSpec* s) {
         s->mutable_parallel()->set_zero_stage(3);
         s->mutable_parallel()->set_dpu(true);
       },
       "parallel.dpu: does not work with parallel.zero_stage 3"},
      {[](v1::JobSpec* s) { s->mutable_model()->set_preset("gpt3"); },
       "model.preset: must be one of demo, gpt2"},
      {[](v1::JobSpec* s) { s->mutable_model()->set_init_from("weights.safetensors"); },
       "model.init_from: must be an absolute path"},
      {[](v1::JobSpec* s) { s->mutable_checkpoint()->set_dir("ckpt"); },
       "checkpoint.dir: must be an absolute path"},
      {[](v1::JobSpec* s) { s->mutable_checkpoint()->set_keep(-1); },
       "checkpoint.keep: must be >= 1, got -1"},
      {[](v1::JobSpec* s) { s->mutable_checkpoint()->set_keep(0); },
       "checkpoint.keep: must be >= 1, got 0"},
      {[](v1::JobSpec* s) { s->mutable_checkpoint()->set_resume(true); },
       "checkpoint.resume: needs checkpoint.dir"},
      {[](v1::JobSpec* s) { s->mutable_data()->set_val_fraction(1); },
       "data.val_fraction: must be in (0, 1)"},
      {[](v1::JobSpec* s) { s->set_name(std::string(129, 'a')); }, "name: at most 128"},
      {[](v1::JobSpec* s) { s->set_name("a/b"); }, "name: character \"/\" at position 1"},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec = ValidSpec();
    c.edit(&spec);
    absl::Status status = ValidateJobSpec(spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(status.message(), HasSubstr(c.message));
  }
}

TEST(TorchJobSpecTest, ParsesFromYamlAndJson) {
  const char* yaml = R"(
name: torch-demo
torch:
  command: [python3, /data/train.py, "--steps=300"]
  working_dir: /data
  env:
    - HF_HOME=/data/hf
parallel: {ranks: 2, optimizer_servers: 1}
checkpoint: {dir: /ckpt/torch-demo}
max_restarts: 3
)";
  absl::StatusOr<v1::JobSpec> from_yaml = ParseJobSpec(yaml);
  ASSERT_TRUE(from_yaml.ok()) << from_yaml.status();
  EXPECT_THAT(from_yaml->torch().command(),
              ElementsAre("python3", "/data/train.py", "--steps=300"));
  EXPECT_THAT(from_yaml->torch().env(), ElementsAre("HF_HOME=/data/hf"));
  EXPECT_TRUE(ValidateJobSpec(*from_yaml).ok()) << ValidateJobSpec(*from_yaml);
  absl::StatusOr<v1::JobSpec> from_json = ParseJobSpec(JobSpecToJson(*from_yaml));
  ASSERT_TRUE(from_json.ok()) << from_json.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*from_yaml, *from_json));
  // No gpu_trainer flag comes of TorchSpec's fields.
  EXPECT_THAT(JobSpecToFlags(*from_yaml), ElementsAre("--checkpoint_dir=/ckpt/torch-demo"));

  absl::StatusOr<v1::JobSpec> bad = ParseJobSpec("torch: {command: python3}");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("torch.command: expected a list of strings"));
  bad = ParseJobSpec("torch: {command: [python3, caf\xe9]}");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("torch.command[1]: is not valid UTF-8"));
  bad = ParseJobSpec("torch: {command: [python3, [nested]]}");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("torch.command[1]: expected a string, got a list"));
}

TEST(TorchJobSpecTest, MistakesNameTheField) {
  struct Case {
    std::function<void(v1::JobSpec*)> edit;
    const char* message;
  };
  const Case cases[] = {
      {[](v1::JobSpec* s) { s->mutable_torch()->clear_command(); }, "torch.command: required"},
      {[](v1::JobSpec* s) { s->mutable_torch()->set_command(0, ""); }, "torch.command: required"},
      {[](v1::JobSpec* s) { s->mutable_torch()->add_command(std::string("a\0b", 3)); },
       "torch.command[1]: holds a NUL character"},
      {[](v1::JobSpec* s) { s->mutable_torch()->set_working_dir("data"); },
       "torch.working_dir: must be an absolute path"},
      {[](v1::JobSpec* s) { s->mutable_torch()->add_env("NOVALUE"); },
       "torch.env[0]: must be NAME=value"},
      {[](v1::JobSpec* s) { s->mutable_torch()->add_env("1X=y"); },
       "torch.env[0]: must be NAME=value"},
      {[](v1::JobSpec* s) { s->mutable_torch()->add_env("OFFLOAD_TOKEN=mine"); },
       "torch.env[0]: OFFLOAD_TOKEN is the job's own"},
      {[](v1::JobSpec* s) { s->mutable_torch()->add_env("RANK=3"); },
       "torch.env[0]: RANK is the job's own"},
      {[](v1::JobSpec* s) { s->mutable_model()->set_layers(4); },
       "model.layers: a torch job's script sets its own model"},
      {[](v1::JobSpec* s) { s->mutable_data()->set_path("/data/x"); },
       "data.path: a torch job's script sets its own"},
      {[](v1::JobSpec* s) { s->mutable_training()->set_steps(10); },
       "training.steps: a torch job's script sets its own"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_zero_stage(3); },
       "parallel.zero_stage: a torch job takes parallel.ranks, optimizer_servers, transport and "
       "shard_step_timeout_floor only"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_shard_step_timeout_floor("soon"); },
       "parallel.shard_step_timeout_floor: must be a duration"},
      {[](v1::JobSpec* s) { s->mutable_checkpoint()->set_every(5); },
       "checkpoint.every: a torch job takes checkpoint.dir only"},
      {[](v1::JobSpec* s) { s->mutable_checkpoint()->set_dir("ckpt"); },
       "checkpoint.dir: must be an absolute path"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_ranks(0); },
       "parallel.ranks: must be in [1, 1024]"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_transport("pigeon"); },
       "parallel.transport: must be one of"},
      {[](v1::JobSpec* s) { s->set_name("a/b"); }, "name: character"},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec;
    spec.mutable_torch()->add_command("python3");
    c.edit(&spec);
    absl::Status status = ValidateJobSpec(spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(status.message(), HasSubstr(c.message));
  }
  v1::JobSpec minimal;
  minimal.mutable_torch()->add_command("python3");
  EXPECT_TRUE(ValidateJobSpec(minimal).ok()) << ValidateJobSpec(minimal);
  minimal.mutable_parallel()->set_shard_step_timeout_floor("20s");
  EXPECT_TRUE(ValidateJobSpec(minimal).ok()) << ValidateJobSpec(minimal);
}

// ---------------------------------------------------------------------------------------------
// Flags.

TEST(JobSpecFlagsTest, FlagsInDescriptorOrder) {
  v1::JobSpec spec = ValidSpec();
  spec.mutable_model()->set_preset("demo");
  spec.mutable_optimizer()->set_lr(0.001f);
  spec.mutable_checkpoint()->set_resume(false);
  spec.mutable_parallel()->set_ranks(4);  // the controller's, not a trainer flag
  spec.set_max_restarts(2);
  EXPECT_THAT(JobSpecToFlags(spec), ElementsAre("--model=demo", "--data=/data/corpus.txt",
                                                "--lr=0.001", "--resume=false"));
}

TEST(JobSpecFlagsTest, RoundTripIsExact) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(kYamlSpec);
  ASSERT_TRUE(spec.ok()) << spec.status();
  // Values that need every digit to come back exactly.
  spec->mutable_optimizer()->set_beta1(0.1f + 0.2f);
  spec->mutable_optimizer()->set_eps(1.17549435e-38f);
  spec->mutable_data()->set_val_fraction(0.1 + 0.2);
  spec->mutable_eval()->set_sample_prompt("To be = or not");
  spec->mutable_model()->set_init_from("");
  // Leaves without a flag do not travel; leave them out of the comparison.
  spec->clear_name();
  spec->clear_max_restarts();
  spec->mutable_parallel()->clear_ranks();

  const std::vector<std::string> flags = JobSpecToFlags(*spec);
  absl::StatusOr<v1::JobSpec> back = JobSpecFromFlags(flags);
  ASSERT_TRUE(back.ok()) << back.status();
  std::string diff;
  MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differencer.Compare(*spec, *back)) << diff;
}

TEST(JobSpecFlagsTest, ZeroStageTravelsAsFlags) {
  absl::StatusOr<v1::JobSpec> spec =
      JobSpecFromFlags({"--zero_stage=3", "--param_window_layers=1", "--data=/d.txt"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->parallel().zero_stage(), 3);
  EXPECT_EQ(spec->parallel().param_window_layers(), 1);
  EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << ValidateJobSpec(*spec);
  EXPECT_THAT(JobSpecToFlags(*spec),
              ElementsAre("--data=/d.txt", "--zero_stage=3", "--param_window_layers=1"));
}

TEST(JobSpecFlagsTest, CollectivesTravelAsAFlag) {
  absl::StatusOr<v1::JobSpec> spec =
      JobSpecFromFlags({"--device=cuda", "--collectives=nccl", "--data=/d.txt"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->parallel().collectives(), "nccl");
  EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << ValidateJobSpec(*spec);
  EXPECT_THAT(JobSpecToFlags(*spec),
              ElementsAre("--data=/d.txt", "--device=cuda", "--collectives=nccl"));
}

// A pool job's ranks get the floor of their step timeout as gpu_trainer's own flag.
TEST(JobSpecFlagsTest, ShardStepTimeoutFloorTravelsAsAFlag) {
  absl::StatusOr<v1::JobSpec> spec =
      ParseJobSpec("data: {path: /d.txt}\nparallel: {shard_step_timeout_floor: 20s}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << ValidateJobSpec(*spec);
  EXPECT_EQ(*ShardStepTimeoutFloor(spec->parallel()), absl::Seconds(20));
  EXPECT_THAT(JobSpecToFlags(*spec),
              ElementsAre("--data=/d.txt", "--shard_step_timeout_floor=20s"));
  EXPECT_EQ(*ShardStepTimeoutFloor(v1::ParallelSpec()), absl::Seconds(60));
}

TEST(JobSpecFlagsTest, ActivationCheckpointingTravelsAsAFlag) {
  absl::StatusOr<v1::JobSpec> spec = JobSpecFromFlags({"--activation_checkpointing"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->training().activation_checkpointing());
  EXPECT_THAT(JobSpecToFlags(*spec), ElementsAre("--activation_checkpointing=true"));
}

TEST(JobSpecFlagsTest, BoolSpellings) {
  absl::StatusOr<v1::JobSpec> spec = JobSpecFromFlags({"--dpu", "--noresume", "-steps=5"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->parallel().dpu());
  EXPECT_TRUE(spec->checkpoint().has_resume());
  EXPECT_FALSE(spec->checkpoint().resume());
  EXPECT_EQ(spec->training().steps(), 5);
}

TEST(JobSpecFlagsTest, BadFlagsAreRefusedByName) {
  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  const Case cases[] = {
      {{"--foo=1"}, "unknown trainer flag --foo: not a job spec field"},
      {{"--nolr"}, "unknown trainer flag --nolr"},
      {{"--ranks=2"}, "unknown trainer flag --ranks"},  // a controller field, not a flag
      {{"lr=0.1"}, "unexpected argument \"lr=0.1\""},
      {{"--"}, "unexpected argument \"--\""},
      {{"--lr"}, "--lr: needs a value"},
      {{"--lr=abc"}, "--lr: expected a number, got \"abc\""},
      {{"--batch=1.5"}, "--batch: expected an integer"},
      {{"--dpu=maybe"}, "--dpu: expected true or false"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::JobSpec> spec = JobSpecFromFlags(c.args);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(spec.status().message(), HasSubstr(c.message));
  }
}

TEST(JobSpecFlagsTest, IsJobSpecFlagAgreesWithJobSpecFromFlags) {
  struct Case {
    const char* arg;
    bool job_spec;
  };
  const Case cases[] = {
      {"--lr=0.1", true},
      {"-steps=5", true},
      {"--dpu", true},
      {"--noresume", true},
      {"--lr", true},
      {"--lr=abc", true},
      {"lr=0.1", true},
      {"--", true},
      {"--foo=1", false},
      {"--nolr", false},
      {"--nodpu=true", false},
      {"--ranks=2", false},
      {"--progress=false", false},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(IsJobSpecFlag(c.arg), c.job_spec) << c.arg;
    // The launcher sends the others to the trainer, so exactly these must be unknown here.
    const absl::StatusOr<v1::JobSpec> spec = JobSpecFromFlags({c.arg});
    EXPECT_EQ(absl::StartsWith(spec.status().message(), "unknown trainer flag"), !c.job_spec)
        << c.arg;
  }
}

// Errors about gpu_trainer's command line name its flags, wherever a field path with a flag stands
// in the message, and nothing else.
TEST(JobSpecFlagsTest, NameTheFlagSaysFieldsAsFlags) {
  struct Case {
    std::string message, want;
  };
  const std::vector<Case> cases = {
      {"training.steps: must be >= 1, got 0", "--steps: must be >= 1, got 0"},
      {"checkpoint.resume: needs checkpoint.dir (where to resume from)",
       "--resume: needs --checkpoint_dir (where to resume from)"},
      {"optimizer.min_lr: must be <= optimizer.lr 0.01, got 0.1",
       "--min_lr: must be <= --lr 0.01, got 0.1"},
      // No flag: the field stays; a path inside a longer word is no path.
      {"parallel.ranks: must be in [1, 1024]", "parallel.ranks: must be in [1, 1024]"},
      {"xtraining.steps and training.steps_y", "xtraining.steps and training.steps_y"},
  };
  for (const Case& c : cases) {
    const absl::Status named = NameTheFlag(absl::InvalidArgumentError(c.message));
    EXPECT_EQ(named.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(named.message(), c.want);
  }
  EXPECT_TRUE(NameTheFlag(absl::OkStatus()).ok());
}

}  // namespace
}  // namespace offload
