// The reference layer kernels: plain loops in the style of llm.c's train_gpt2.c, parallel over
// independent rows with OpenMP. They define what the fast kernels must compute, and they are the
// "plain, well-written fp32 CPU implementation" the fast set is benchmarked against
// (ARCHITECTURE.md section 9), so they are written to be honest, not slow.
#ifndef OFFLOAD_GPU_TRAINER_MODEL_LAYERS_NAIVE_H_
#define OFFLOAD_GPU_TRAINER_MODEL_LAYERS_NAIVE_H_

#include "gpu_trainer/model/layer_kernels.h"

namespace offload {

const CpuLayerKernels& NaiveKernels();

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_MODEL_LAYERS_NAIVE_H_
