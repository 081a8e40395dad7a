// The fast layer kernels: OpenBLAS sgemm for every matrix product (linear layers, attention's
// Q.K^T and att.V per (batch, head), the tied LM head), OpenMP and vectorisable loops for the
// rest. Same contract as the naive reference (layer_kernels.h), which the tests hold them to.
#ifndef OFFLOAD_GPU_TRAINER_MODEL_LAYERS_FAST_H_
#define OFFLOAD_GPU_TRAINER_MODEL_LAYERS_FAST_H_

#include "gpu_trainer/model/layer_kernels.h"

namespace offload {

const CpuLayerKernels& FastKernels();

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_MODEL_LAYERS_FAST_H_
