#include "gpu_trainer/cuda/gpt2_cuda.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/blas/attention.h"
#include "gpu_trainer/cuda/blas/gemm.h"
#include "gpu_trainer/cuda/blas/matmul.h"
#include "gpu_trainer/cuda/gpt2_cuda_attention.h"
#include "gpu_trainer/cuda/gpt2_cuda_buffers.h"
#include "gpu_trainer/cuda/kernels/convert.h"
#include "gpu_trainer/cuda/kernels/crossentropy.h"
#include "gpu_trainer/cuda/kernels/encoder.h"
#include "gpu_trainer/cuda/kernels/gelu.h"
#include "gpu_trainer/cuda/kernels/grad_norm.h"
#include "gpu_trainer/cuda/kernels/layernorm.h"
#include "gpu_trainer/cuda/kernels/residual.h"
#include "gpu_trainer/cuda/memory_planner.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"
#include "gpu_trainer/cuda/runtime/cuda_device.h"
#include "gpu_trainer/cuda/runtime/device_buffer.h"
#include "gpu_trainer/cuda/runtime/host_ranges.h"
#include "gpu_trainer/cuda/runtime/storage_type.h"
#include "gpu_trainer/cuda/runtime/transfer_schedule.h"
#include "gpu_trainer/cuda/zero/device_gradient_buckets.h"
#include "gpu_trainer/cuda/zero/device_param_window.h"
#include "model_spec/param_layout.h"

namespace offload {
namespace {

// As Gpt2Cpu: keeps B*T an int and every activation size far inside int64.
constexpr int64_t kMaxTokens = int64_t{1} << 24;

}  // namespace

class Gpt2Cuda::Impl {
 public:
  virtual ~Impl() = default;
  virtual absl::Status Init() = 0;
  virtual absl::Status SetParams(const float* params) = 0;
  virtual absl::Status UploadWeights16(const uint16_t* w16) = 0;
  virtual absl::Status SetHostWeights16(const uint16_t* w16) = 0;
  virtual absl::Status UploadPartition16(const uint16_t* partition16) = 0;
  virtual absl::Status DownloadWeights16(uint16_t* w16) = 0;
  virtual int64_t window_fills() const = 0;
  virtual int64_t buckets_sent() const = 0;
  virtual absl::StatusOr<float> Forward(const int32_t* inputs, const int32_t* targets, int B,
                                        int T) = 0;
  virtual absl::StatusOr<CudaGradStats> Backward(
      float loss_scale, uint16_t* host_grads16,
      const std::function<void(int64_t offset, int64_t n)>& on_ready,
      const std::function<uint16_t*(int64_t offset, int64_t n)>& place) = 0;
  virtual absl::Status RegisterHostMemory(void* p, int64_t bytes) = 0;
  virtual absl::Status UnregisterHostMemory(void* p) = 0;
  virtual bool IsRegistered(const void* p, int64_t bytes) const = 0;
  virtual void set_transfer_observer(TransferObserver observer) = 0;
  virtual void set_upload_delay_for_testing(std::chrono::milliseconds delay) = 0;
  virtual absl::Status CopyGradsToHost(float* grads) = 0;
  virtual absl::Status CopyLogitsToHost(int b, int t, float* logits) = 0;
  virtual int64_t device_bytes() const = 0;
  virtual void* params() const = 0;
  virtual void* grads() const = 0;
  virtual cudaStream_t stream() const = 0;
  virtual const char* attention_path() const = 0;
};

namespace {

template <typename T>
class Gpt2CudaImpl final : public Gpt2Cuda::Impl {
 public:
  Gpt2CudaImpl(const Gpt2Config& config, int max_batch, int max_seq,
               const CudaModelOptions& options)
      : c_(config), max_batch_(max_batch), max_seq_(max_seq), options_(options) {}
  ~Gpt2CudaImpl() override;

  absl::Status Init() override;
  absl::Status SetParams(const float* params) override;
  absl::Status UploadWeights16(const uint16_t* w16) override;
  absl::Status SetHostWeights16(const uint16_t* w16) override;
  absl::Status UploadPartition16(const uint16_t* partition16) override;
  absl::Status DownloadWeights16(uint16_t* w16) override;
  int64_t window_fills() const override { return window_ ? window_->fills() : 0; }
  int64_t buckets_sent() const override {
    return grad_buckets_ ? grad_buckets_->buckets_sent() : 0;
  }
  absl::StatusOr<float> Forward(const int32_t* inputs, const int32_t* targets, int B,
                                int Tn) override;
  absl::StatusOr<CudaGradStats> Backward(
      float loss_scale, uint16_t* host_grads16,
      const std::function<void(int64_t offset, int64_t n)>& on_ready,
      const std::function<uint16_t*(int64_t offset, int64_t n)>& place) override;
  absl::Status RegisterHostMemory(void* p, int64_t bytes) override;
  absl::Status UnregisterHostMemory(void* p) override;
  bool IsRegistered(const void* p, int64_t bytes) const override {
    return registered_.Contains(p, bytes);
  }
  void set_transfer_observer(TransferObserver observer) override {
    observer_ = std::move(observer);
  }
  void set_upload_delay_for_testing(std::chrono::milliseconds delay) override {
    upload_delay_ = delay;
  }
  absl::Status CopyGradsToHost(float* grads) override;
  absl::Status CopyLogitsToHost(int b, int t, float* logits) override;
  int64_t device_bytes() const override {
    return static_cast<int64_t>(params_mem_.size() + grads_mem_.size() + acts_mem_.size() +
                                scratch_mem_.size() + (lt_ ? lt_->workspace_bytes() : 0));
  }
  void* params() const override { return params_; }
  void* grads() const override { return grads_; }
  cudaStream_t stream() const override { return stream_; }
  const char* attention_path() const override { return attention_.path(); }

 private:
  // Tensor `index` of Gpt2ParamLayout through its unit's place on the device: the flat buffers,
  // or the window slot and gradient bucket slot the unit is in (zero/).
  const T* w(int index) const {
    const int unit = unit_of_index_[index];
    return weight_unit_[unit] + (offsets_[index] - unit_begin_[unit]);
  }
  T* dw(int index) const {
    const int unit = unit_of_index_[index];
    return grad_unit_[unit] + (offsets_[index] - unit_begin_[unit]);
  }
  // ZeRO-3: the window's use `use` of its unit begins (the compute stream waits for its fill) or
  // ends; no-ops without a window.
  absl::Status AcquireUse(int use);
  absl::Status ReleaseUse(int use);
  bool flat_weights() const { return window_ == nullptr; }
  // Block l's forward for the batch of the last Forward (B, Tn), queued on stream_: from its input
  // (the encoder's output or block l-1's residual3) to its residual3.
  absl::Status BlockForward(int l, int B, int Tn);
  // Where block l's saved activations live: l, or 0 under activation checkpointing.
  int64_t Slot(int l) const { return options_.activation_checkpointing ? 0 : l; }
  // Before the forward's first kernel that reads weight unit `unit` (transfer_schedule.h): the
  // compute stream waits for the unit's upload, if one is pending.
  absl::Status WaitForWeights(int unit);
  // With an observer, after a Forward that waited for a timed upload has synchronised: the
  // upload's span and the forward's own on the GPU, as "h2d_weights" and "forward_gpu".
  void ReportUpload();

  const Gpt2Config c_;
  const int max_batch_;
  const int max_seq_;
  const CudaModelOptions options_;
  int64_t n_ = 0;                 // parameters
  std::vector<int64_t> offsets_;  // Gpt2ParamLayout(c_)[i].offset

  DeviceBuffer params_mem_, grads_mem_, acts_mem_, scratch_mem_;
  T* params_ = nullptr;  // (n,) or (padded,) with NCCL ranks; the window (and partition) in ZeRO-3
  T* grads_ = nullptr;   // (n,), or the bucket slots
  std::vector<int> unit_of_index_;   // (tensors,) Gpt2ParamLayout index -> unit
  std::vector<int64_t> unit_begin_;  // (units,) flat first element
  std::vector<T*> weight_unit_;      // (units,) where each unit's weights are now
  std::vector<T*> grad_unit_;        // (units,) where each unit's gradient is written
  std::unique_ptr<DeviceGradientBuckets> grad_buckets_;  // gradient_bucket_elements >= 1
  std::unique_ptr<DeviceParamWindow> window_;            // param_window_layers >= 1
  std::unique_ptr<Collectives> window_collectives_;  // the window's fork of options_.collectives
  Gpt2CudaActivations<T> a_{};
  std::unique_ptr<CublasLt> lt_;
  // cuDNN's fused attention or the reference, chosen in Init.
  Gpt2CudaAttention<T> attention_;
  cudaStream_t stream_ = nullptr;  // compute
  // Transfers, 16-bit modes only: gradients out and weights in, each on a stream of its own.
  std::unique_ptr<DeviceToHostStaging> d2h_;
  std::unique_ptr<HostToDeviceStaging> h2d_;
  std::vector<FlatRange> weight_units_;     // (L + 2,) ForwardWeightUnits
  std::vector<FlatRange> gradient_ranges_;  // (L + 2,) BackwardGradientRanges
  std::vector<cudaEvent_t> unit_arrived_;   // (L + 2,) on the H2D stream after a unit's upload
  cudaEvent_t compute_idle_ = nullptr;      // on the compute stream before an upload
  bool weights_pending_ = false;            // the next Forward waits for unit_arrived_
  std::vector<cudaEvent_t> range_done_;     // (L + 2,) a gradient range is final on the GPU
  HostRanges registered_;                   // host memory page-locked by RegisterHostMemory
  TransferObserver observer_;               // may be empty
  // With an observer: timing events of the last upload on the H2D stream, and of the forward that
  // waits for it on the compute stream, read back once that forward has synchronised.
  cudaEvent_t upload_begin_ = nullptr, upload_end_ = nullptr;
  cudaEvent_t forward_begin_ = nullptr, forward_end_ = nullptr;
  bool upload_timed_ = false;  // the next Forward reports the upload's and its own GPU spans
  std::chrono::milliseconds upload_delay_{0};  // set_upload_delay_for_testing

  // The last Forward's batch, on the host: the encoder backward groups it by token.
  std::vector<int32_t> inputs_;  // (B, T)
  TokenBuckets buckets_;
  int B_ = 0;
  int T_ = 0;
  bool have_targets_ = false;
};

template <typename T>
Gpt2CudaImpl<T>::~Gpt2CudaImpl() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  // They use the rings: gone before them.
  grad_buckets_.reset();
  window_.reset();
  d2h_.reset();  // joins the copy thread before the events it may wait on go away
  h2d_.reset();
  for (cudaEvent_t e : range_done_) cudaEventDestroy(e);
  for (cudaEvent_t e : unit_arrived_) cudaEventDestroy(e);
  for (cudaEvent_t e : {upload_begin_, upload_end_, forward_begin_, forward_end_}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (const void* p : registered_.Starts()) cudaHostUnregister(const_cast<void*>(p));
  if (compute_idle_ != nullptr) cudaEventDestroy(compute_idle_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::Init() {
  for (const ParamTensor& t : Gpt2ParamLayout(c_)) offsets_.push_back(t.offset);
  n_ = Gpt2NumParams(c_);
  const int units = Gpt2NumUnits(c_);
  for (int u = 0; u < units; ++u) unit_begin_.push_back(Gpt2UnitRange(c_, u).begin);
  for (int64_t offset : offsets_) {
    int unit = units - 1;
    while (unit > 0 && unit_begin_[unit] > offset) --unit;
    unit_of_index_.push_back(unit);
  }
  const bool sixteen = !std::is_same_v<T, float>;
  const bool bucketed = options_.gradient_bucket_elements >= 1;
  const bool windowed = options_.param_window_layers >= 1;
  Collectives* ranks = options_.collectives;
  const int W = ranks != nullptr ? ranks->world_size() : 1;
  const int64_t padded = std::max(n_, options_.padded_length);
  if ((bucketed || windowed || ranks != nullptr) && !sixteen) {
    return absl::InvalidArgumentError(
        "Gpt2Cuda: gradient buckets, the parameter window and NCCL ranks need a 16-bit model");
  }
  if (ranks != nullptr && (!bucketed || padded % W != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gpt2Cuda: ", W, " NCCL ranks need gradient buckets and a padded_length (",
                     padded, ") that splits into ", W, " equal partitions"));
  }
  weight_units_ = ForwardWeightUnits(c_);
  gradient_ranges_ = BackwardGradientRanges(c_);
  // The attention decides what the activations hold (cuDNN's statistics and workspace, or the
  // reference's softmax), so it is chosen, and cuDNN's plans for (max_batch, max_seq) made and
  // their workspace known, before the plan and the carve.
  OFFLOAD_RETURN_IF_ERROR(attention_.Init(options_.attention, c_, max_batch_, max_seq_,
                                          options_.activation_checkpointing));
  // Check the whole plan against free memory first, so a model that cannot fit fails with the
  // full picture rather than at whichever allocation happens to run out.
  ParamPlacement placement;
  placement.zero_stage = windowed ? 3 : 2;
  placement.world_size = W;
  placement.window_layers = std::max(1, options_.param_window_layers);
  const CudaMemoryPlan plan = PlanGpt2CudaMemory(
      c_, max_batch_, max_seq_, StorageDType<T>(), /*gpu_optimizer=*/false, placement,
      options_.activation_checkpointing, options_.gradient_bucket_elements, attention_.memory());
  size_t free_bytes = 0, total_bytes = 0;
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  const int64_t need = plan.total_bytes() - plan.reserved_bytes;
  if (need > static_cast<int64_t>(free_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the model needs ", need >> 20, " MiB on the GPU (weights ", plan.params_bytes >> 20,
        ", gradients ", plan.grads_bytes >> 20, ", activations at batch ", max_batch_,
        " x sequence ", max_seq_, " ", plan.activation_bytes >> 20, ", workspace ",
        plan.workspace_bytes >> 20, ") but ", free_bytes >> 20,
        " MiB are free: lower --batch or "
        "--seq_len, or use offload with a smaller model"));
  }
  // The weights: every one (padded for NCCL ranks, whose partitions are gathered in place), or
  // the window's slots followed by this rank's partition.
  DeviceParamWindowOptions window_options;
  window_options.config = c_;
  window_options.window_layers = std::max(1, options_.param_window_layers);
  window_options.padded_length = padded;
  int64_t window_elements = 0, partition_elements = 0;
  if (windowed) {
    if (ranks != nullptr) {
      OFFLOAD_ASSIGN_OR_RETURN(window_collectives_, ranks->Fork("cuda-window"));
      window_options.collectives = window_collectives_.get();
    }
    window_elements = PlanParamWindow(c_, window_options.window_layers).total_elements;
    partition_elements = DevicePartitionElements(window_options);
  }
  const int64_t weight_elements = windowed           ? window_elements + partition_elements
                                  : ranks != nullptr ? padded
                                                     : n_;
  DeviceGradientBucketsOptions bucket_options;
  bucket_options.config = c_;
  bucket_options.dtype = StorageDType<T>();
  bucket_options.bucket_elements = options_.gradient_bucket_elements;
  bucket_options.padded_length = padded;
  bucket_options.collectives = ranks;
  bucket_options.device = options_.device;
  // With a window over NCCL ranks this thread gathers too: it reduces as well, in one order.
  bucket_options.reduce_on_caller = windowed && ranks != nullptr;
  // The bucket slots do not depend on the padding: what the planner counts.
  const int64_t grad_elements =
      bucketed ? DeviceGradientElements(c_, bucket_options.bucket_elements) : n_;
  OFFLOAD_RETURN_IF_ERROR(params_mem_.Allocate(weight_elements * sizeof(T), "parameters"));
  OFFLOAD_RETURN_IF_ERROR(grads_mem_.Allocate(grad_elements * sizeof(T), "gradients"));
  params_ = static_cast<T*>(params_mem_.data());
  grads_ = static_cast<T*>(grads_mem_.data());
  const int64_t scratch_bytes = bucketed ? DeviceReduceScratchBytes(bucket_options) : 0;
  if (scratch_bytes > 0) {
    OFFLOAD_RETURN_IF_ERROR(scratch_mem_.Allocate(scratch_bytes, "the reduce-scatter's scratch"));
  }
  for (int u = 0; u < units; ++u) {
    weight_unit_.push_back(params_ + unit_begin_[u]);  // a window moves them before each use
    grad_unit_.push_back(grads_ + unit_begin_[u]);     // buckets move them below
  }
  OFFLOAD_RETURN_IF_ERROR(acts_mem_.Allocate(plan.activation_bytes, "activations"));
  BufferCarver carver(acts_mem_.data());
  CarveGpt2CudaActivations(c_, max_batch_, max_seq_, carver, &a_, options_.activation_checkpointing,
                           attention_.memory());
  attention_.Bind(a_);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(params_, 0, weight_elements * sizeof(T), nullptr));

  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<CublasLt> lt, CublasLt::Create(kCublasWorkspaceBytes));
  lt_ = std::move(lt);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  range_done_.assign(c_.num_layers + 2, nullptr);
  for (cudaEvent_t& e : range_done_) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  unit_arrived_.assign(weight_units_.size(), nullptr);
  for (cudaEvent_t& e : unit_arrived_) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&compute_idle_, cudaEventDisableTiming));
  for (cudaEvent_t* e : {&upload_begin_, &upload_end_, &forward_begin_, &forward_end_}) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventCreate(e));  // timed: read back by ReportUpload
  }
  if constexpr (!std::is_same_v<T, float>) {
    absl::StatusOr<std::unique_ptr<DeviceToHostStaging>> d2h =
        DeviceToHostStaging::Create(options_.staging);
    if (!d2h.ok()) return d2h.status();
    d2h_ = std::move(*d2h);
    absl::StatusOr<std::unique_ptr<HostToDeviceStaging>> h2d =
        HostToDeviceStaging::Create(options_.staging);
    if (!h2d.ok()) return h2d.status();
    h2d_ = std::move(*h2d);
    auto registered = [this](const void* p, int64_t bytes) {
      return registered_.Contains(p, bytes);
    };
    if (bucketed) {
      OFFLOAD_ASSIGN_OR_RETURN(
          grad_buckets_, DeviceGradientBuckets::Create(bucket_options, grads_,
                                                       static_cast<float*>(scratch_mem_.data()),
                                                       d2h_.get(), stream_, registered));
      for (int u = 0; u < units; ++u) {
        grad_unit_[u] = static_cast<T*>(grad_buckets_->UnitGradient(u));
      }
    }
    if (windowed) {
      OFFLOAD_ASSIGN_OR_RETURN(
          window_,
          DeviceParamWindow::Create(window_options, params_,
                                    partition_elements > 0 ? params_ + window_elements : nullptr,
                                    h2d_.get(), stream_, registered));
    }
  }
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::SetParams(const float* params) {
  if (params == nullptr) return absl::InvalidArgumentError("Gpt2Cuda::SetParams: null params");
  if (!flat_weights()) {
    return absl::FailedPreconditionError(
        "Gpt2Cuda::SetParams: the model holds a window of its weights (ZeRO-3); use "
        "SetHostWeights16 or UploadPartition16");
  }
  // Nothing queued may still read the weights, nor an upload still be writing them.
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (h2d_ != nullptr) OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(h2d_->stream()));
  // The copies go on stream_ itself: a synchronous cudaMemcpy from pageable memory may return
  // before its DMA lands, and stream_ (non-blocking) is not ordered after the legacy stream.
  if constexpr (std::is_same_v<T, float>) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(params_, params, n_ * sizeof(float), cudaMemcpyHostToDevice, stream_));
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  } else {
    // Through an fp32 device copy, rounded on the GPU: a test and start-up path, not per step.
    DeviceBuffer staging;
    OFFLOAD_RETURN_IF_ERROR(staging.Allocate(n_ * sizeof(float), "fp32 parameters"));
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging.data(), params, n_ * sizeof(float),
                                                 cudaMemcpyHostToDevice, stream_));
    OFFLOAD_CUDA_RETURN_IF_ERROR(
        ConvertFromFloat<T>(params_, static_cast<const float*>(staging.data()), n_, stream_));
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  }
  weights_pending_ = false;
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::UploadWeights16(const uint16_t* w16) {
  if constexpr (std::is_same_v<T, float>) {
    return absl::FailedPreconditionError(
        "Gpt2Cuda::UploadWeights16: the model computes in fp32; use SetParams");
  } else {
    if (w16 == nullptr) return absl::InvalidArgumentError("Gpt2Cuda::UploadWeights16: null");
    if (!flat_weights() || options_.collectives != nullptr) {
      return absl::FailedPreconditionError(
          "Gpt2Cuda::UploadWeights16: this model takes its weights by SetHostWeights16 (ZeRO-3) "
          "or UploadPartition16 (NCCL ranks)");
    }
    // The copy may not overwrite weights that kernels already queued still read.
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(compute_idle_, stream_));
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(h2d_->stream(), compute_idle_, 0));
    weights_pending_ = true;  // a unit queued before an error below must still be waited for
    upload_timed_ = false;
    if (observer_) OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(upload_begin_, h2d_->stream()));
    for (size_t u = 0; u < weight_units_.size(); ++u) {
      const FlatRange& unit = weight_units_[u];
      const int64_t bytes = unit.n * static_cast<int64_t>(sizeof(T));
      const uint16_t* src = w16 + unit.offset;
      OFFLOAD_RETURN_IF_ERROR(h2d_->Copy(params_ + unit.offset, src, bytes, unit_arrived_[u],
                                         registered_.Contains(src, bytes)));
      if (u == 0 && upload_delay_.count() > 0) {
        // The tests' late units: the H2D stream sleeps on a host callback after the embeddings,
        // so a forward that did not wait for each unit would read the weights before them.
        auto* ms = new std::chrono::milliseconds(upload_delay_);
        const cudaError_t error = cudaLaunchHostFunc(
            h2d_->stream(),
            [](void* arg) {
              std::unique_ptr<std::chrono::milliseconds> delay(
                  static_cast<std::chrono::milliseconds*>(arg));
              std::this_thread::sleep_for(*delay);
            },
            ms);
        if (error != cudaSuccess) {
          delete ms;
          OFFLOAD_CUDA_RETURN_IF_ERROR(error);
        }
      }
    }
    if (observer_) {
      OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(upload_end_, h2d_->stream()));
      upload_timed_ = true;
    }
    return absl::OkStatus();
  }
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::SetHostWeights16(const uint16_t* w16) {
  if (w16 == nullptr) return absl::InvalidArgumentError("Gpt2Cuda::SetHostWeights16: null");
  if (window_ == nullptr || window_->gathers()) {
    return absl::FailedPreconditionError(
        "Gpt2Cuda::SetHostWeights16: only a ZeRO-3 model of one rank reads its weights from the "
        "host model");
  }
  // The fills queued so far read the old pointer: they must be done.
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(h2d_->stream()));
  window_->SetHostWeights(w16);
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::UploadPartition16(const uint16_t* partition16) {
  Collectives* ranks = options_.collectives;
  if (partition16 == nullptr) return absl::InvalidArgumentError("UploadPartition16: null");
  if (ranks == nullptr) {
    return absl::FailedPreconditionError(
        "Gpt2Cuda::UploadPartition16: the model has no NCCL ranks to gather from");
  }
  if (window_ != nullptr) return window_->SetPartition(partition16);
  // Stage 2: this rank's piece in place, then every rank's gathered around it on the device.
  const int64_t P = std::max(n_, options_.padded_length) / ranks->world_size();
  T* mine = params_ + ranks->rank() * P;
  // On the stream, synchronised: a plain copy from pageable memory may return before its DMA has
  // landed, and NCCL's stream would not wait for it.
  OFFLOAD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(mine, partition16, P * sizeof(T), cudaMemcpyHostToDevice, stream_));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  OFFLOAD_RETURN_IF_ERROR(ranks->AllGather16(reinterpret_cast<const uint16_t*>(mine),
                                             reinterpret_cast<uint16_t*>(params_), P));
  weights_pending_ = false;
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::DownloadWeights16(uint16_t* w16) {
  if (w16 == nullptr) return absl::InvalidArgumentError("Gpt2Cuda::DownloadWeights16: null");
  if (!flat_weights() || std::is_same_v<T, float>) {
    return absl::FailedPreconditionError(
        "Gpt2Cuda::DownloadWeights16: the device holds no whole 16-bit model (a ZeRO-3 window, or "
        "fp32)");
  }
  OFFLOAD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(w16, params_, n_ * sizeof(T), cudaMemcpyDeviceToHost, stream_));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::AcquireUse(int use) {
  if (window_ == nullptr) return absl::OkStatus();
  OFFLOAD_ASSIGN_OR_RETURN(void* at, window_->Acquire(use));
  weight_unit_[window_->plan().uses[use].unit] = static_cast<T*>(at);
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::ReleaseUse(int use) {
  return window_ == nullptr ? absl::OkStatus() : window_->Release(use);
}

template <typename T>
absl::StatusOr<float> Gpt2CudaImpl<T>::Forward(const int32_t* inputs, const int32_t* targets, int B,
                                               int Tn) {
  // Everything is checked before anything is queued, as in Gpt2Cpu::Forward.
  if (inputs == nullptr) return absl::InvalidArgumentError("Gpt2Cuda::Forward: null inputs");
  if (B <= 0 || B > max_batch_ || Tn <= 0 || Tn > max_seq_) {
    return absl::InvalidArgumentError(absl::StrCat("Gpt2Cuda::Forward: (B, T) = (", B, ", ", Tn,
                                                   ") outside [1, ", max_batch_, "] x [1, ",
                                                   max_seq_, "]"));
  }
  const int V = c_.vocab_size;
  const int64_t BT = int64_t{B} * Tn;
  for (const int32_t* tokens : {inputs, targets}) {
    if (tokens == nullptr) continue;
    for (int64_t i = 0; i < BT; i++) {
      if (tokens[i] < 0 || tokens[i] >= V) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Gpt2Cuda::Forward: ", tokens == inputs ? "inputs" : "targets", "[b=", i / Tn,
            ", t=", i % Tn, "] = ", tokens[i], " is outside the vocabulary [0, ", V, ")"));
      }
    }
  }
  inputs_.assign(inputs, inputs + BT);
  B_ = B;
  T_ = Tn;
  have_targets_ = false;  // until the loss is there

  const int L = c_.num_layers, C = c_.channels;
  const int N = static_cast<int>(BT);
  const int64_t BTC = BT * C, Vp = PaddedVocab(V);
  const Gpt2CudaActivations<T>& a = a_;
  cudaStream_t s = stream_;
  OFFLOAD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(a.inputs, inputs, BT * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  if (targets != nullptr) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(a.targets, targets, BT * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  }
  const bool timed = upload_timed_ && weights_pending_ && observer_;
  upload_timed_ = false;
  if (timed) OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(forward_begin_, s));
  OFFLOAD_RETURN_IF_ERROR(WaitForWeights(0));
  const ParamWindowPlan* window = window_ != nullptr ? &window_->plan() : nullptr;
  if (window != nullptr) {
    OFFLOAD_RETURN_IF_ERROR(window_->BeginStep());
    OFFLOAD_RETURN_IF_ERROR(AcquireUse(window->embeddings_use));  // held to the end of backward
  }
  OFFLOAD_CUDA_RETURN_IF_ERROR(
      EncoderForward<T>(a.encoded, a.inputs, w(kWte), w(kWpe), B, Tn, C, s));
  for (int l = 0; l < L; l++) {
    OFFLOAD_RETURN_IF_ERROR(WaitForWeights(WeightUnitBefore(l)));
    if (window != nullptr) OFFLOAD_RETURN_IF_ERROR(AcquireUse(window->forward_use_of_block[l]));
    OFFLOAD_RETURN_IF_ERROR(BlockForward(l, B, Tn));
    if (window != nullptr) OFFLOAD_RETURN_IF_ERROR(ReleaseUse(window->forward_use_of_block[l]));
  }
  OFFLOAD_RETURN_IF_ERROR(WaitForWeights(L + 1));
  if (window != nullptr) OFFLOAD_RETURN_IF_ERROR(AcquireUse(window->lnf_use));
  weights_pending_ = false;  // every unit waited for: a recompute in backward reads them freely
  OFFLOAD_CUDA_RETURN_IF_ERROR(
      LayerNormForward<T>(a.lnf, a.lnf_mean, a.lnf_rstd, a.residual3 + (L - 1) * BTC,
                          w(LnfWeightIndex(L)), w(LnfBiasIndex(L)), N, C, s));
  OFFLOAD_RETURN_IF_ERROR(TiedHeadForward<T>(*lt_, a.logits, Vp, a.lnf, w(kWte), N, C, V, s));
  if (targets == nullptr) {
    if (timed) OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(forward_end_, s));
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    if (timed) ReportUpload();
    return 0.0f;
  }
  OFFLOAD_CUDA_RETURN_IF_ERROR(
      CrossEntropyForward<T>(a.losses, a.lse, a.logits, Vp, a.targets, N, V, s));
  if (timed) OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(forward_end_, s));
  std::vector<float> losses(BT);  // (B, T)
  OFFLOAD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(losses.data(), a.losses, BT * sizeof(float), cudaMemcpyDeviceToHost, s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  if (timed) ReportUpload();
  double sum = 0.0;  // double, in a fixed order, as the CPU backend
  for (float x : losses) sum += x;
  have_targets_ = true;
  return static_cast<float>(sum / BT);
}

template <typename T>
void Gpt2CudaImpl<T>::ReportUpload() {
  // The GPU's clock, placed on the host's: forward_end_ fired just before the synchronisation
  // that returned now, so a GPU time x maps to now - (forward_end - x).
  const auto now = std::chrono::steady_clock::now();
  auto host = [&](cudaEvent_t x) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, x, forward_end_) != cudaSuccess) {
      cudaGetLastError();
      ms = 0;
    }
    return now - std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     std::chrono::duration<double, std::milli>(ms));
  };
  observer_("h2d_weights", -1, host(upload_begin_), host(upload_end_));
  observer_("forward_gpu", -1, host(forward_begin_), now);
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::WaitForWeights(int unit) {
  if (!weights_pending_) return absl::OkStatus();
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, unit_arrived_[unit], 0));
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::RegisterHostMemory(void* p, int64_t bytes) {
  if (p == nullptr || bytes <= 0) {
    return absl::InvalidArgumentError("Gpt2Cuda::RegisterHostMemory: an empty range");
  }
  if (!registered_.Add(p, bytes)) {
    return absl::AlreadyExistsError(
        "Gpt2Cuda::RegisterHostMemory: the range overlaps memory registered already");
  }
  const cudaError_t error =
      cudaHostRegister(p, static_cast<size_t>(bytes), cudaHostRegisterDefault);
  if (error != cudaSuccess) {
    cudaGetLastError();  // not sticky: the ring still works
    registered_.Remove(p);
    return CudaErrorStatus(error, "cudaHostRegister", __FILE__, __LINE__);
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::UnregisterHostMemory(void* p) {
  if (!registered_.Contains(p, 0)) {
    return absl::NotFoundError(
        "Gpt2Cuda::UnregisterHostMemory: not the start of a registered range");
  }
  // No transfer may still read or write it; only then is it forgotten and unlocked.
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (h2d_ != nullptr) OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(h2d_->stream()));
  if (d2h_ != nullptr) OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(d2h_->stream()));
  if (!registered_.Remove(p)) {
    return absl::NotFoundError(
        "Gpt2Cuda::UnregisterHostMemory: not the start of a registered range");
  }
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaHostUnregister(p));
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::BlockForward(int l, int B, int Tn) {
  const int C = c_.channels;
  const int N = B * Tn;
  const int64_t BT = N, BTC = BT * C;
  const Gpt2CudaActivations<T>& a = a_;
  cudaStream_t s = stream_;
  const int64_t i = Slot(l);
  auto bw = [&](BlockTensor t) { return w(BlockIndex(l, t)); };
  const T* residual = l == 0 ? a.encoded : a.residual3 + (l - 1) * BTC;  // (B, T, C)
  T* ln1 = a.ln1 + i * BTC;                                              // (B, T, C)
  float* ln1_mean = a.ln1_mean + i * BT;                                 // (B, T)
  float* ln1_rstd = a.ln1_rstd + i * BT;                                 // (B, T)
  T* qkv = a.qkv + i * 3 * BTC;                                          // (B, T, 3C)
  T* atty = a.atty + i * BTC;                                            // (B, T, C)
  T* residual2 = a.residual2 + i * BTC;                                  // (B, T, C)
  T* ln2 = a.ln2 + i * BTC;                                              // (B, T, C)
  float* ln2_mean = a.ln2_mean + i * BT;                                 // (B, T)
  float* ln2_rstd = a.ln2_rstd + i * BT;                                 // (B, T)
  T* fch = a.fch + i * 4 * BTC;                                          // (B, T, 4C)
  T* fch_gelu = a.fch_gelu + i * 4 * BTC;                                // (B, T, 4C)
  T* residual3 = a.residual3 + l * BTC;                                  // (B, T, C)

  OFFLOAD_CUDA_RETURN_IF_ERROR(LayerNormForward<T>(ln1, ln1_mean, ln1_rstd, residual,
                                                   bw(kLn1Weight), bw(kLn1Bias), N, C, s));
  OFFLOAD_RETURN_IF_ERROR(
      MatmulForward<T>(*lt_, qkv, ln1, bw(kAttnWeight), bw(kAttnBias), N, C, 3 * C, s));
  // Saves what its backward needs in slot i (gpt2_cuda_attention.h).
  OFFLOAD_RETURN_IF_ERROR(attention_.Forward(*lt_, i, atty, qkv, B, Tn, s));
  OFFLOAD_RETURN_IF_ERROR(
      MatmulForward<T>(*lt_, a.proj, atty, bw(kAttnProjWeight), bw(kAttnProjBias), N, C, C, s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(ResidualForward<T>(residual2, residual, a.proj, BTC, s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(LayerNormForward<T>(ln2, ln2_mean, ln2_rstd, residual2,
                                                   bw(kLn2Weight), bw(kLn2Bias), N, C, s));
  // fch = ln2 @ W + b and fch_gelu = gelu(fch): one product with the GELU epilogue (fch its aux
  // matrix) under fused_epilogues, else the product and the GELU kernel.
  OFFLOAD_RETURN_IF_ERROR(MatmulGeluForward<T>(*lt_, fch_gelu, fch, ln2, bw(kFcWeight), bw(kFcBias),
                                               N, C, 4 * C, options_.fused_epilogues, s));
  OFFLOAD_RETURN_IF_ERROR(
      MatmulForward<T>(*lt_, a.proj, fch_gelu, bw(kFcProjWeight), bw(kFcProjBias), N, 4 * C, C, s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(ResidualForward<T>(residual3, residual2, a.proj, BTC, s));
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<CudaGradStats> Gpt2CudaImpl<T>::Backward(
    float loss_scale, uint16_t* host_grads16,
    const std::function<void(int64_t offset, int64_t n)>& on_ready,
    const std::function<uint16_t*(int64_t offset, int64_t n)>& place) {
  if (!have_targets_) {
    return absl::FailedPreconditionError(
        "Gpt2Cuda::Backward: needs a preceding Forward with targets");
  }
  if (!std::isfinite(loss_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gpt2Cuda::Backward: loss_scale = ", loss_scale, " is not finite"));
  }
  if (host_grads16 != nullptr && d2h_ == nullptr) {
    return absl::FailedPreconditionError(
        "Gpt2Cuda::Backward: 16-bit host gradients need a 16-bit model");
  }
  if (grad_buckets_ != nullptr && host_grads16 == nullptr) {
    return absl::FailedPreconditionError(
        "Gpt2Cuda::Backward: gradient buckets leave the device as they complete; give "
        "host_grads16");
  }
  // The logits become their gradient below, so a second Backward needs a new Forward.
  have_targets_ = false;
  const int B = B_, Tn = T_;
  const int L = c_.num_layers, C = c_.channels, V = c_.vocab_size;
  const int N = B * Tn;
  const int64_t BT = N, BTC = BT * C, Vp = PaddedVocab(V);
  const Gpt2CudaActivations<T>& a = a_;
  cudaStream_t s = stream_;

  // Range i of the backward order (transfer_schedule.h) is final on the GPU: send it on, off the
  // compute stream, into its place or host_grads16; straight there where that is registered.
  int range = 0;
  // Buckets: a unit's gradient is final once its range is; its bucket leaves when complete.
  const ParamWindowPlan* window = window_ != nullptr ? &window_->plan() : nullptr;
  const auto begun = std::chrono::steady_clock::now();
  if (grad_buckets_ != nullptr) {
    grad_buckets_->Begin(
        host_grads16,
        [this, &on_ready, begun](int64_t offset, int64_t n) {
          if (observer_) observer_("d2h_gradients", -1, begun, std::chrono::steady_clock::now());
          if (on_ready) on_ready(offset, n);
        },
        place);
  }
  struct AbandonOnExit {
    DeviceGradientBuckets* buckets;
    ~AbandonOnExit() {
      if (buckets != nullptr) buckets->Abandon();
    }
  } abandon_on_exit{grad_buckets_.get()};
  auto acquire_gradient = [&](int unit) -> absl::Status {
    return grad_buckets_ != nullptr ? grad_buckets_->AcquireUnit(unit) : absl::OkStatus();
  };
  auto ready = [&]() -> absl::Status {
    const int index = range++;
    if (grad_buckets_ != nullptr) {
      // Ranges in backward order: ln_f (unit L + 1), blocks L-1..0 (unit l + 1), the embeddings.
      const int unit = index == 0 ? L + 1 : index <= L ? L - index + 1 : 0;
      return grad_buckets_->ReleaseUnit(unit);
    }
    const int64_t begin = gradient_ranges_[index].offset, end = gradient_ranges_[index].end();
    if (host_grads16 == nullptr) {
      if (on_ready) on_ready(begin, end - begin);
      return absl::OkStatus();
    }
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(range_done_[index], s));
    uint16_t* dst = place ? place(begin, end - begin) : nullptr;
    if (dst == nullptr) dst = host_grads16 + begin;
    const int64_t bytes = (end - begin) * static_cast<int64_t>(sizeof(T));
    std::function<void()> done;
    if (on_ready || observer_) {
      done = [this, &on_ready, begin, end, index, queued = std::chrono::steady_clock::now()] {
        if (observer_) {
          observer_("d2h_gradients", index, queued, std::chrono::steady_clock::now());
        }
        if (on_ready) on_ready(begin, end - begin);
      };
    }
    d2h_->Copy(dst, grads_ + begin, bytes, range_done_[index], std::move(done),
               registered_.Contains(dst, bytes));
    return absl::OkStatus();
  };
  // Whatever happens below, no copy may outlive this call: they write into host_grads16.
  struct DrainOnExit {
    DeviceToHostStaging* d2h;
    ~DrainOnExit() {
      if (d2h != nullptr) d2h->Drain().IgnoreError();
    }
  } drain_on_exit{host_grads16 != nullptr ? d2h_.get() : nullptr};

  // Every parameter gradient is overwritten by its producer (wte's embedding share is added
  // last); only the residual stream's gradient accumulates, so only it starts at zero.
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(a.dresidual, 0, BTC * sizeof(T), s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(CrossEntropyBackward<T>(
      a.logits, a.lse, a.targets, loss_scale / static_cast<float>(BT), Vp, N, V, s));
  OFFLOAD_RETURN_IF_ERROR(acquire_gradient(0));  // the tied head writes wte's first
  OFFLOAD_RETURN_IF_ERROR(acquire_gradient(L + 1));
  T* dlnf = a.dln;
  OFFLOAD_RETURN_IF_ERROR(
      TiedHeadBackward<T>(*lt_, dlnf, dw(kWte), a.logits, Vp, a.lnf, w(kWte), N, C, V, s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(LayerNormBackward<T>(
      a.dresidual, dw(LnfWeightIndex(L)), dw(LnfBiasIndex(L)), a.fscratch, dlnf,
      a.residual3 + (L - 1) * BTC, w(LnfWeightIndex(L)), a.lnf_mean, a.lnf_rstd, N, C, s));
  if (window != nullptr) OFFLOAD_RETURN_IF_ERROR(ReleaseUse(window->lnf_use));
  OFFLOAD_RETURN_IF_ERROR(ready());  // ln_f

  for (int l = L - 1; l >= 0; l--) {
    if (window != nullptr) OFFLOAD_RETURN_IF_ERROR(AcquireUse(window->backward_use_of_block[l]));
    OFFLOAD_RETURN_IF_ERROR(acquire_gradient(l + 1));
    // Checkpointing: the last block's activations are still those Forward left.
    if (options_.activation_checkpointing && l < L - 1) {
      OFFLOAD_RETURN_IF_ERROR(BlockForward(l, B, Tn));
    }
    auto bw = [&](BlockTensor t) { return w(BlockIndex(l, t)); };
    auto dbw = [&](BlockTensor t) { return dw(BlockIndex(l, t)); };
    const int64_t i = Slot(l);
    const T* residual = l == 0 ? a.encoded : a.residual3 + (l - 1) * BTC;  // (B, T, C)
    const T* ln1 = a.ln1 + i * BTC;                                        // (B, T, C)
    const float* ln1_mean = a.ln1_mean + i * BT;                           // (B, T)
    const float* ln1_rstd = a.ln1_rstd + i * BT;                           // (B, T)
    const T* qkv = a.qkv + i * 3 * BTC;                                    // (B, T, 3C)
    const T* atty = a.atty + i * BTC;                                      // (B, T, C)
    const T* residual2 = a.residual2 + i * BTC;                            // (B, T, C)
    const T* ln2 = a.ln2 + i * BTC;                                        // (B, T, C)
    const float* ln2_mean = a.ln2_mean + i * BT;                           // (B, T)
    const float* ln2_rstd = a.ln2_rstd + i * BT;                           // (B, T)
    const T* fch = a.fch + i * 4 * BTC;                                    // (B, T, 4C)
    const T* fch_gelu = a.fch_gelu + i * 4 * BTC;                          // (B, T, 4C)

    // a.dresidual holds d loss / d residual3; the two LayerNorm backwards add the branches'
    // shares into it in place, as in Gpt2Cpu::Backward.
    // c_proj's backward goes on through the GELU: a.dfch = d fch, and fc's bias gradient with it
    // (the DGELU_BGRAD epilogue under fused_epilogues, else GeluBackward and BiasGrad); fc's own
    // backward then has no bias gradient left to do.
    const bool fused = options_.fused_epilogues;
    OFFLOAD_RETURN_IF_ERROR(MatmulGeluBackward<T>(
        *lt_, a.dfch, dbw(kFcBias), dbw(kFcProjWeight), dbw(kFcProjBias), a.fscratch, a.dresidual,
        fch_gelu, fch, bw(kFcProjWeight), N, 4 * C, C, fused, s));
    OFFLOAD_RETURN_IF_ERROR(MatmulBackward<T>(*lt_, a.dln, dbw(kFcWeight), nullptr, a.fscratch,
                                              a.dfch, ln2, bw(kFcWeight), N, C, 4 * C, s));
    OFFLOAD_CUDA_RETURN_IF_ERROR(LayerNormBackward<T>(a.dresidual, dbw(kLn2Weight), dbw(kLn2Bias),
                                                      a.fscratch, a.dln, residual2, bw(kLn2Weight),
                                                      ln2_mean, ln2_rstd, N, C, s));
    OFFLOAD_RETURN_IF_ERROR(MatmulBackward<T>(*lt_, a.datty, dbw(kAttnProjWeight),
                                              dbw(kAttnProjBias), a.fscratch, a.dresidual, atty,
                                              bw(kAttnProjWeight), N, C, C, s, fused));
    OFFLOAD_RETURN_IF_ERROR(attention_.Backward(*lt_, i, a.dqkv, a.datty, qkv, atty, B, Tn, s));
    OFFLOAD_RETURN_IF_ERROR(MatmulBackward<T>(*lt_, a.dln, dbw(kAttnWeight), dbw(kAttnBias),
                                              a.fscratch, a.dqkv, ln1, bw(kAttnWeight), N, C, 3 * C,
                                              s, fused));
    OFFLOAD_CUDA_RETURN_IF_ERROR(LayerNormBackward<T>(a.dresidual, dbw(kLn1Weight), dbw(kLn1Bias),
                                                      a.fscratch, a.dln, residual, bw(kLn1Weight),
                                                      ln1_mean, ln1_rstd, N, C, s));
    if (window != nullptr) OFFLOAD_RETURN_IF_ERROR(ReleaseUse(window->backward_use_of_block[l]));
    OFFLOAD_RETURN_IF_ERROR(ready());  // block l
  }

  BuildTokenBuckets(inputs_.data(), BT, &buckets_);
  const int num_buckets = static_cast<int>(buckets_.tokens.size());
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.bucket_tokens, buckets_.tokens.data(),
                                               num_buckets * sizeof(int32_t),
                                               cudaMemcpyHostToDevice, s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.bucket_offsets, buckets_.offsets.data(),
                                               (num_buckets + 1) * sizeof(int32_t),
                                               cudaMemcpyHostToDevice, s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.bucket_positions, buckets_.positions.data(),
                                               BT * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(EncoderBackward<T>(dw(kWte), dw(kWpe), a.dresidual, a.bucket_tokens,
                                                  a.bucket_offsets, a.bucket_positions, num_buckets,
                                                  B, Tn, c_.context_length, C, s));
  if (window != nullptr) OFFLOAD_RETURN_IF_ERROR(ReleaseUse(window->embeddings_use));
  OFFLOAD_RETURN_IF_ERROR(ready());  // the embeddings

  if (grad_buckets_ != nullptr) {
    // Each bucket's statistics were added up as it left.
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    const auto computed = std::chrono::steady_clock::now();
    abandon_on_exit.buckets = nullptr;
    drain_on_exit.d2h = nullptr;
    absl::StatusOr<DeviceGradientBuckets::Stats> stats = grad_buckets_->Finish();
    if (!stats.ok()) {
      grad_buckets_->Abandon();
      return stats.status();
    }
    if (observer_) observer_("d2h_exposed", -1, computed, std::chrono::steady_clock::now());
    return CudaGradStats{stats->sum_squares, stats->nonfinite};
  }

  // The statistics of exactly the values that leave, over the whole partition.
  GradNormResult result{};
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(a.norm, 0, sizeof(GradNormResult), s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(GradNormAccumulate<T>(a.norm, a.norm_scratch, grads_, n_, s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&result, a.norm, sizeof(result), cudaMemcpyDeviceToHost, s));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  if (drain_on_exit.d2h != nullptr) {
    // From here the GPU has computed everything: what the gradients' copies still take is the
    // part of them backward did not hide ("d2h_exposed").
    const auto computed = std::chrono::steady_clock::now();
    drain_on_exit.d2h = nullptr;
    OFFLOAD_RETURN_IF_ERROR(d2h_->Drain());
    if (observer_) observer_("d2h_exposed", -1, computed, std::chrono::steady_clock::now());
  }
  return CudaGradStats{result.sum_squares, result.nonfinite != 0};
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::CopyGradsToHost(float* grads) {
  if (grads == nullptr) return absl::InvalidArgumentError("Gpt2Cuda::CopyGradsToHost: null");
  if (grad_buckets_ != nullptr) {
    return absl::FailedPreconditionError(
        "Gpt2Cuda::CopyGradsToHost: the gradients left the device bucket by bucket");
  }
  std::vector<T> host(n_);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  OFFLOAD_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(host.data(), grads_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
  for (int64_t i = 0; i < n_; ++i) grads[i] = HostToFloat<T>(host[i]);
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaImpl<T>::CopyLogitsToHost(int b, int t, float* logits) {
  if (logits == nullptr || b < 0 || b >= B_ || t < 0 || t >= T_) {
    return absl::InvalidArgumentError(absl::StrCat("Gpt2Cuda::CopyLogitsToHost: (b, t) = (", b,
                                                   ", ", t, ") outside the last Forward's (", B_,
                                                   ", ", T_, ")"));
  }
  const int V = c_.vocab_size;
  std::vector<T> row(V);  // (V,)
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  const T* src = a_.logits + (int64_t{b} * T_ + t) * PaddedVocab(V);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemcpy(row.data(), src, V * sizeof(T), cudaMemcpyDeviceToHost));
  for (int v = 0; v < V; ++v) logits[v] = HostToFloat<T>(row[v]);
  return absl::OkStatus();
}

}  // namespace

Gpt2Cuda::Gpt2Cuda(const Gpt2Config& config, const CudaModelOptions& options)
    : config_(config), options_(options) {}

Gpt2Cuda::~Gpt2Cuda() = default;

absl::StatusOr<std::unique_ptr<Gpt2Cuda>> Gpt2Cuda::Create(const Gpt2Config& config, int max_batch,
                                                           int max_seq,
                                                           const CudaModelOptions& options) {
  OFFLOAD_RETURN_IF_ERROR(ValidateGpt2Config(config));
  if (max_batch <= 0 || max_seq <= 0 || max_seq > config.context_length ||
      int64_t{max_batch} * max_seq > kMaxTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gpt2Cuda::Create: max_batch = ", max_batch, ", max_seq = ", max_seq,
        ": need max_batch >= 1, 1 <= max_seq <= context_length = ", config.context_length,
        " and max_batch * max_seq <= ", kMaxTokens));
  }
  if (config.channels % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gpt2Cuda::Create: channels = ", config.channels,
        " must be a multiple of 8 (cuBLASLt's bias epilogue needs 16-byte aligned tensors)"));
  }
  OFFLOAD_RETURN_IF_ERROR(UseCudaDevice(options.device).status());
  std::unique_ptr<Gpt2Cuda> model(new Gpt2Cuda(config, options));
  model->num_params_ = Gpt2NumParams(config);
  model->impl_ = DispatchStorageType(options.dtype, [&](auto zero) -> std::unique_ptr<Impl> {
    return std::make_unique<Gpt2CudaImpl<decltype(zero)>>(config, max_batch, max_seq, options);
  });
  OFFLOAD_RETURN_IF_ERROR(model->impl_->Init());
  return model;
}

int64_t Gpt2Cuda::device_bytes() const { return impl_->device_bytes(); }
absl::Status Gpt2Cuda::SetParams(const float* params) { return impl_->SetParams(params); }
absl::Status Gpt2Cuda::UploadWeights16(const uint16_t* w16) { return impl_->UploadWeights16(w16); }
absl::StatusOr<float> Gpt2Cuda::Forward(const int32_t* inputs, const int32_t* targets, int B,
                                        int T) {
  return impl_->Forward(inputs, targets, B, T);
}
absl::StatusOr<CudaGradStats> Gpt2Cuda::Backward(
    float loss_scale, uint16_t* host_grads16,
    const std::function<void(int64_t offset, int64_t n)>& on_ready,
    const std::function<uint16_t*(int64_t offset, int64_t n)>& place) {
  return impl_->Backward(loss_scale, host_grads16, on_ready, place);
}
absl::Status Gpt2Cuda::RegisterHostMemory(void* p, int64_t bytes) {
  return impl_->RegisterHostMemory(p, bytes);
}
absl::Status Gpt2Cuda::UnregisterHostMemory(void* p) { return impl_->UnregisterHostMemory(p); }
bool Gpt2Cuda::IsRegisteredHostMemory(const void* p, int64_t bytes) const {
  return impl_->IsRegistered(p, bytes);
}
void Gpt2Cuda::set_transfer_observer(TransferObserver observer) {
  impl_->set_transfer_observer(std::move(observer));
}
void Gpt2Cuda::set_upload_delay_for_testing(std::chrono::milliseconds delay) {
  impl_->set_upload_delay_for_testing(delay);
}
absl::Status Gpt2Cuda::CopyGradsToHost(float* grads) { return impl_->CopyGradsToHost(grads); }
absl::Status Gpt2Cuda::CopyLogitsToHost(int b, int t, float* logits) {
  return impl_->CopyLogitsToHost(b, t, logits);
}
void* Gpt2Cuda::device_params() const { return impl_->params(); }
void* Gpt2Cuda::device_grads() const { return impl_->grads(); }
cudaStream_t Gpt2Cuda::compute_stream() const { return impl_->stream(); }
const char* Gpt2Cuda::attention_path() const { return impl_->attention_path(); }
absl::Status Gpt2Cuda::SetHostWeights16(const uint16_t* w16) {
  return impl_->SetHostWeights16(w16);
}
absl::Status Gpt2Cuda::UploadPartition16(const uint16_t* partition16) {
  return impl_->UploadPartition16(partition16);
}
absl::Status Gpt2Cuda::DownloadWeights16(uint16_t* w16) { return impl_->DownloadWeights16(w16); }
int64_t Gpt2Cuda::window_fills() const { return impl_->window_fills(); }
int64_t Gpt2Cuda::buckets_sent() const { return impl_->buckets_sent(); }

}  // namespace offload
