// Both kernel sets against PyTorch (ARCHITECTURE.md section 5): the fixture written by
// testdata/make_gpt2_fixture.py holds a torch GPT-2's weights, batch, loss and gradients.
// Loading the weights by name through Gpt2ParamLayout also proves the layout maps one to one
// onto GPT-2's names and shapes. Error measure: MaxRelError per tensor (max |ours - torch| /
// max |torch|), at most 1e-4; the worst seen is printed.
//
// OFFLOAD_GPT2_FIXTURE overrides the fixture path (the gpt2_torch_live ctest regenerates it).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_trainer/model/gpt2.h"
#include "gpu_trainer/model/model_test_util.h"
#include "gtest/gtest.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"
#include "optimizer_client/checkpoint/safetensors.h"

namespace offload {
namespace {

using testing_util::MaxRelError;

std::string FixturePath() {
  if (const char* path = std::getenv("OFFLOAD_GPT2_FIXTURE")) return path;
  return std::string(OFFLOAD_SOURCE_DIR) +
         "/gpu_trainer/model/testdata/gpt2_torch_fixture.safetensors";
}

// An I32 tensor of the fixture, checked for dtype and shape.
std::vector<int32_t> ReadInt32(const SafetensorsReader& reader, const std::string& name,
                               const std::vector<int64_t>& shape) {
  const SafetensorsEntry* e = reader.Find(name);
  EXPECT_NE(e, nullptr) << name;
  if (e == nullptr) return {};
  EXPECT_EQ(e->dtype, TensorDType::kI32) << name;
  EXPECT_EQ(e->shape, shape) << name;
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  std::vector<int32_t> out(numel);
  if (e->dtype == TensorDType::kI32 && e->end - e->begin == numel * 4) {
    std::memcpy(out.data(), reader.Data(*e), numel * 4);  // may be unaligned in the mapping
  }
  return out;
}

TEST(Gpt2TorchParity, LossAndEveryGradient) {
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> opened =
      SafetensorsReader::Open(FixturePath());
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SafetensorsReader& reader = **opened;

  const SafetensorsEntry* inputs_entry = reader.Find("inputs");
  ASSERT_NE(inputs_entry, nullptr);
  ASSERT_EQ(inputs_entry->shape.size(), 2u);
  const int B = static_cast<int>(inputs_entry->shape[0]),
            T = static_cast<int>(inputs_entry->shape[1]);
  const std::vector<int32_t> config_values = ReadInt32(reader, "config", {5});
  ASSERT_EQ(config_values.size(), 5u);
  const Gpt2Config c{config_values[0], config_values[1], config_values[2], config_values[3],
                     config_values[4]};
  ASSERT_TRUE(ValidateGpt2Config(c).ok());
  const std::vector<int32_t> inputs = ReadInt32(reader, "inputs", {B, T});
  const std::vector<int32_t> targets = ReadInt32(reader, "targets", {B, T});
  float torch_loss = 0.0f;
  ASSERT_TRUE(reader.ReadAsFloat("loss", {1}, &torch_loss).ok());

  // Parameters and torch's gradients by name; the fixture must hold nothing else.
  const std::vector<ParamTensor> layout = Gpt2ParamLayout(c);
  std::vector<float> params(Gpt2NumParams(c)), torch_grads(Gpt2NumParams(c));
  std::set<std::string> expected_names = {"config", "inputs", "targets", "loss"};
  for (const ParamTensor& t : layout) {
    ASSERT_TRUE(reader.ReadAsFloat(t.name, t.shape, params.data() + t.offset).ok()) << t.name;
    ASSERT_TRUE(reader.ReadAsFloat("grad." + t.name, t.shape, torch_grads.data() + t.offset).ok())
        << t.name;
    expected_names.insert(t.name);
    expected_names.insert("grad." + t.name);
  }
  std::set<std::string> names;
  for (const SafetensorsEntry& e : reader.entries()) names.insert(e.name);
  EXPECT_EQ(names, expected_names);

  for (const CpuKernelSet set : {CpuKernelSet::kNaive, CpuKernelSet::kFast}) {
    const char* set_name = set == CpuKernelSet::kFast ? "fast" : "naive";
    SCOPED_TRACE(set_name);
    absl::StatusOr<std::unique_ptr<Gpt2Cpu>> model = Gpt2Cpu::Create(c, B, T, set);
    ASSERT_TRUE(model.ok()) << model.status();
    absl::StatusOr<float> loss =
        (*model)->Forward(params.data(), inputs.data(), targets.data(), B, T);
    ASSERT_TRUE(loss.ok()) << loss.status();
    std::vector<float> grads(params.size());
    ASSERT_TRUE((*model)->Backward(params.data(), 1.0f, grads.data(), nullptr).ok());

    const double loss_err = std::fabs(double{*loss} - torch_loss) / std::fabs(torch_loss);
    EXPECT_LE(loss_err, 1e-4) << "loss " << *loss << " vs torch " << torch_loss;
    double worst = 0.0;
    std::string worst_name;
    for (const ParamTensor& t : layout) {
      const double err =
          MaxRelError(grads.data() + t.offset, torch_grads.data() + t.offset, t.numel);
      EXPECT_LE(err, 1e-4) << t.name;
      if (err >= worst) {
        worst = err;
        worst_name = t.name;
      }
    }
    std::printf("[%s] loss %.7f (torch %.7f, rel err %.2e); max grad rel err %.2e (%s)\n", set_name,
                *loss, torch_loss, loss_err, worst, worst_name.c_str());
    RecordProperty(std::string(set_name) + "_max_grad_rel_err", testing_util::Sci(worst));
  }
}

}  // namespace
}  // namespace offload
