// The CPU backend as a ModelRunner: the 16-bit weights are upcast once per update into an fp32
// copy that Gpt2Cpu computes with (or, under ZeRO-3, come unit by unit from a Gpt2ParamSource),
// and each finished gradient range is rounded to 16 bits (with its statistics) on the backward
// thread before it is reported.
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu_trainer/model/cpu_runtime.h"
#include "gpu_trainer/train/model_runner.h"

namespace offload {
namespace {

class CpuModelRunner final : public ModelRunner {
 public:
  CpuModelRunner(std::unique_ptr<Gpt2Cpu> model, CpuKernelSet kernels, DType dtype)
      : model_(std::move(model)), kernels_(kernels), dtype_(dtype) {}

  int64_t num_params() const override { return model_->num_params(); }

  DeviceMemory Memory() const override {
    DeviceMemory m;
    m.device = "cpu";
    m.used_bytes = model_->activation_bytes() +
                   static_cast<int64_t>(params_.size() + grads_.size()) * sizeof(float);
    m.total_bytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
    return m;
  }

  std::string Describe() const override {
    return absl::StrCat("cpu backend, ", kernels_ == CpuKernelSet::kFast ? "fast" : "naive",
                        " kernels, blas=", BlasCoreName());
  }

  absl::Status SetParamSource(Gpt2ParamSource* source) override {
    source_ = source;
    std::vector<float>().swap(params_);
    return absl::OkStatus();
  }

  absl::Status SetWeights(const uint16_t* w16) override {
    if (source_ != nullptr) {
      return absl::FailedPreconditionError("SetWeights: the weights come from a parameter source");
    }
    const int64_t n = model_->num_params();
    if (params_.empty()) params_.assign(n, 0.0f);
    float* p = params_.data();  // (n,)
    if (dtype_ == DType::kFp16) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) p[i] = Fp16ToFloat(w16[i]);
    } else {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) p[i] = Bf16ToFloat(w16[i]);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<float> Forward(const int32_t* inputs, const int32_t* targets, int B,
                                int T) override {
    last_t_ = T;
    return model_->Forward(Params(), inputs, targets, B, T);
  }

  absl::StatusOr<GradStats> Backward(
      float loss_scale, uint16_t* grads16,
      const std::function<void(int64_t offset, int64_t n)>& on_ready,
      const std::function<uint16_t*(int64_t offset, int64_t n)>& /*place: grads16 only*/) override {
    // The trainer takes the fp32 path (BackwardFp32 into its own buffer), so this one is sized
    // only if the 16-bit path is used.
    if (grads_.empty()) grads_.assign(model_->num_params(), 0.0f);
    GradStats stats;
    FlatGpt2Grads sink(model_->config(), grads_.data(), [&](int64_t offset, int64_t n) {
      stats.Merge(RoundGradients(grads_.data() + offset, n, dtype_, grads16 + offset));
      if (on_ready) on_ready(offset, n);
    });
    absl::Status status = model_->Backward(Params(), loss_scale, sink);
    if (!status.ok()) return status;
    return stats;
  }

  absl::Status BackwardFp32(float loss_scale, Gpt2GradSink& grads) override {
    return model_->Backward(Params(), loss_scale, grads);
  }
  bool has_fp32_gradients() const override { return true; }

  absl::Status Logits(int t, float* logits) override {
    if (t < 0 || t >= last_t_) {
      return absl::InvalidArgumentError(
          absl::StrCat("Logits: position ", t, " outside [0, ", last_t_, ")"));
    }
    const int V = model_->config().vocab_size;
    const float* row = model_->logits() + static_cast<int64_t>(t) * V;  // (V,)
    std::copy(row, row + V, logits);
    return absl::OkStatus();
  }

 private:
  Gpt2ParamSource& Params() {
    if (source_ != nullptr) return *source_;
    if (params_.empty()) params_.assign(model_->num_params(), 0.0f);  // zeros before SetWeights
    flat_.emplace(model_->config(), params_.data());
    return *flat_;
  }

  std::unique_ptr<Gpt2Cpu> model_;
  const CpuKernelSet kernels_;
  const DType dtype_;
  std::vector<float> params_;  // (num_params,) the 16-bit weights upcast; empty under ZeRO-3
  std::optional<FlatGpt2Params> flat_;  // views params_
  Gpt2ParamSource* source_ = nullptr;   // ZeRO-3: where the weights come from instead
  std::vector<float> grads_;  // (num_params,) fp32 from the 16-bit Backward; empty until then
  int last_t_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCpuModelRunner(const Gpt2Config& config,
                                                                  int max_batch, int max_seq,
                                                                  CpuKernelSet kernels, DType dtype,
                                                                  bool activation_checkpointing) {
  if (dtype != DType::kFp16 && dtype != DType::kBf16) {
    return absl::InvalidArgumentError("the trainer's weights must be fp16 or bf16");
  }
  absl::StatusOr<std::unique_ptr<Gpt2Cpu>> model =
      Gpt2Cpu::Create(config, max_batch, max_seq, kernels, activation_checkpointing);
  if (!model.ok()) return model.status();
  return std::make_unique<CpuModelRunner>(std::move(*model), kernels, dtype);
}

}  // namespace offload
