// The CUDA backend as a ModelRunner: weights go up and gradients come down through the model's
// pinned staging rings; the gradient statistics are computed on the GPU over the 16-bit values
// that leave. In a build without the CUDA backend, CreateCudaModelRunner says so.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "gpu_trainer/train/model_runner.h"
#include "optimizer_client/sender/phase_trace.h"

#ifdef OFFLOAD_HAVE_CUDA
#include "base/status_macros.h"
#include "gpu_trainer/cuda/gpt2_cuda.h"
#include "gpu_trainer/cuda/runtime/cuda_device.h"
#endif

namespace offload {

#ifdef OFFLOAD_HAVE_CUDA
namespace {

class CudaModelRunner final : public ModelRunner {
 public:
  CudaModelRunner(std::unique_ptr<Gpt2Cuda> model, std::string device, int64_t total_bytes,
                  const CudaScaleOptions& scale)
      : model_(std::move(model)),
        device_(std::move(device)),
        total_bytes_(total_bytes),
        window_(scale.param_window_layers >= 1),
        ranks_(scale.collectives != nullptr) {}

  int64_t num_params() const override { return model_->num_params(); }

  DeviceMemory Memory() const override {
    return DeviceMemory{"cuda", model_->device_bytes(), total_bytes_};
  }

  std::string Describe() const override {
    return absl::StrCat("cuda backend, ", DTypeName(model_->dtype()), ", ", device_, ", ",
                        model_->device_bytes() >> 20, " MiB on the GPU");
  }

  absl::Status SetWeights(const uint16_t* w16) override { return model_->UploadWeights16(w16); }

  bool takes_partition_weights() const override { return window_ || ranks_; }
  absl::Status SetPartitionWeights(const uint16_t* partition16) override {
    return ranks_ ? model_->UploadPartition16(partition16) : model_->SetHostWeights16(partition16);
  }
  bool reduces_gradients() const override { return ranks_; }
  absl::Status CopyWeights16ToHost(uint16_t* w16) override {
    return model_->DownloadWeights16(w16);
  }

  absl::StatusOr<float> Forward(const int32_t* inputs, const int32_t* targets, int B,
                                int T) override {
    return model_->Forward(inputs, targets, B, T);
  }

  absl::StatusOr<GradStats> Backward(
      float loss_scale, uint16_t* grads16,
      const std::function<void(int64_t offset, int64_t n)>& on_ready,
      const std::function<uint16_t*(int64_t offset, int64_t n)>& place) override {
    OFFLOAD_ASSIGN_OR_RETURN(CudaGradStats stats,
                             model_->Backward(loss_scale, grads16, on_ready, place));
    GradStats out;
    out.sum_squares = stats.sum_squares;
    out.nonfinite = stats.nonfinite;
    return out;
  }

  bool writes_gradient_places() const override { return true; }

  absl::Status RegisterHostMemory(void* p, int64_t bytes) override {
    return model_->RegisterHostMemory(p, bytes);
  }
  absl::Status UnregisterHostMemory(void* p) override { return model_->UnregisterHostMemory(p); }

  void set_trace(PhaseTrace* trace, std::function<uint64_t()> step) override {
    if (trace == nullptr) {
      model_->set_transfer_observer(nullptr);
      return;
    }
    model_->set_transfer_observer(
        [trace, step = std::move(step)](const char* what, int /*index*/,
                                        std::chrono::steady_clock::time_point queued,
                                        std::chrono::steady_clock::time_point landed) {
          trace->Record(what, step(), queued, landed);
        });
  }

  absl::Status Logits(int t, float* logits) override {
    return model_->CopyLogitsToHost(0, t, logits);
  }

 private:
  std::unique_ptr<Gpt2Cuda> model_;
  const std::string device_;
  const int64_t total_bytes_;  // the GPU's memory
  const bool window_;          // ZeRO-3: a window of the weights on the device
  const bool ranks_;           // NCCL ranks: gathers and reduces on the device
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaModelRunner(
    const Gpt2Config& config, int max_batch, int max_seq, DType dtype, int device,
    int64_t pinned_staging_bytes, bool activation_checkpointing, bool reference_attention,
    const CudaScaleOptions& scale) {
  if (dtype != DType::kFp16 && dtype != DType::kBf16) {
    return absl::InvalidArgumentError("the trainer's weights must be fp16 or bf16");
  }
  OFFLOAD_ASSIGN_OR_RETURN(CudaDeviceInfo info, UseCudaDevice(device));
  CudaModelOptions options;
  options.dtype = dtype;
  options.device = device;
  options.staging.budget_bytes = pinned_staging_bytes;
  options.activation_checkpointing = activation_checkpointing;
  if (reference_attention) options.attention = AttentionKind::kReference;
  options.gradient_bucket_elements = scale.gradient_bucket_elements;
  options.param_window_layers = scale.param_window_layers;
  options.collectives = scale.collectives;
  options.padded_length = scale.padded_length;
  options.staging.chunk_bytes =
      std::min<int64_t>(options.staging.chunk_bytes, pinned_staging_bytes / 2);
  absl::StatusOr<std::unique_ptr<Gpt2Cuda>> model =
      Gpt2Cuda::Create(config, max_batch, max_seq, options);
  if (!model.ok()) return model.status();
  return std::make_unique<CudaModelRunner>(std::move(*model), DescribeCudaDevice(info),
                                           info.total_bytes, scale);
}

#else

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaModelRunner(const Gpt2Config&, int, int,
                                                                   DType, int, int64_t, bool, bool,
                                                                   const CudaScaleOptions&) {
  return absl::UnimplementedError(
      "this build has no CUDA backend (nvcc was not found when it was configured; see "
      "OFFLOAD_CUDA in the README)");
}

#endif

}  // namespace offload
