// 128-bit loads and stores for the memory-bound kernels (layernorm, residual, GELU, the
// classifier): each thread moves 16 bytes at a time (8 elements of a 16-bit type, 4 of fp32)
// where every pointer involved is 16-byte aligned, and one element at a time for the tail that
// does not fill a vector, or for the whole range when a pointer is not aligned (checked at run
// time: a row of an odd width, a view at an odd offset).
//
// The index arithmetic, including the loops that hand a thread its share, is host-and-device code
// with no CUDA header, so the CPU test (vector_access_test.cc) runs the very loops the kernels
// run and checks that every element is visited exactly once. Packed128, the 16-byte register
// image of a vector, is device code (nvcc only).
#ifndef OFFLOAD_GPU_TRAINER_CUDA_KERNELS_VECTOR_ACCESS_H_
#define OFFLOAD_GPU_TRAINER_CUDA_KERNELS_VECTOR_ACCESS_H_

#include <cstdint>

#if defined(__CUDACC__)
#define OFFLOAD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define OFFLOAD_HOST_DEVICE inline
#endif

namespace offload {
namespace vector_access {

constexpr int kVectorBytes = 16;

// Elements in one 16-byte vector of elem_bytes-byte elements (8 for 16-bit types, 4 for fp32).
OFFLOAD_HOST_DEVICE constexpr int VectorWidth(int elem_bytes) { return kVectorBytes / elem_bytes; }

// Whether p may be read or written as 16-byte vectors. nullptr counts as aligned, so an absent
// optional pointer never turns the vector path off.
OFFLOAD_HOST_DEVICE bool IsAligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0;
}

// How n consecutive elements starting at aligned-or-not pointers are cut: elements
// [0, vectors * width) as whole vectors, [tail_begin, n) one at a time. Not aligned: no vectors,
// everything is tail. Element offsets are relative to each pointer's own start, so all the
// pointers of one access must be aligned for the cut to hold for each of them.
struct VectorSplit {
  int width = 1;
  int64_t vectors = 0;
  int64_t tail_begin = 0;
};

// n >= 0, width >= 1.
OFFLOAD_HOST_DEVICE VectorSplit SplitVectors(int64_t n, int width, bool aligned) {
  VectorSplit s;
  s.width = width;
  s.vectors = aligned ? n / width : 0;
  s.tail_begin = s.vectors * width;
  return s;
}

// The indices one thread takes from a shared range: first, first + step, first + 2 step, ...
struct Stride {
  int64_t first = 0;
  int64_t step = 1;
};

// A grid-stride loop's: thread `thread` of block `block`, blocks of block_dim threads, grid_dim
// blocks.
OFFLOAD_HOST_DEVICE Stride GridStride(int block, int block_dim, int grid_dim, int thread) {
  Stride s;
  s.first = int64_t{block} * block_dim + thread;
  s.step = int64_t{grid_dim} * block_dim;
  return s;
}

// A row shared by `lanes` threads (a warp's 32, a block's blockDim.x): lane `lane`'s.
OFFLOAD_HOST_DEVICE Stride LaneStride(int lane, int lanes) {
  Stride s;
  s.first = lane;
  s.step = lanes;
  return s;
}

// Threads worth launching for n elements split as `split`: each thread runs the vector loop,
// then the tail loop, so the longer of the two decides (at least 1).
OFFLOAD_HOST_DEVICE int64_t ThreadsWanted(const VectorSplit& split, int64_t n) {
  const int64_t tail = n - split.tail_begin;
  const int64_t wanted = split.vectors > tail ? split.vectors : tail;
  return wanted > 0 ? wanted : 1;
}

// This thread's share of [0, n): vector(offset) for each of its whole vectors, offset the index
// of the vector's first element (a multiple of split.width), then scalar(i) for each of its tail
// elements. The kernels pass lambdas that load, compute and store; the CPU test passes ones
// that count.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename VectorFn, typename ScalarFn>
OFFLOAD_HOST_DEVICE void ForEachShare(const VectorSplit& split, int64_t n, const Stride& stride,
                                      VectorFn&& vector, ScalarFn&& scalar) {
  for (int64_t v = stride.first; v < split.vectors; v += stride.step) vector(v * split.width);
  for (int64_t i = split.tail_begin + stride.first; i < n; i += stride.step) scalar(i);
}

}  // namespace vector_access

#if defined(__CUDACC__)
// One 16-byte vector of T in registers: Load and Store move it whole (one 128-bit instruction);
// the pointer must be 16-byte aligned (IsAligned16).
template <typename T>
struct alignas(16) Packed128 {
  static constexpr int kSize = vector_access::kVectorBytes / static_cast<int>(sizeof(T));
  T elems[kSize];

  __device__ __forceinline__ static Packed128 Load(const T* p) {
    Packed128 r;
    *reinterpret_cast<int4*>(r.elems) = *reinterpret_cast<const int4*>(p);
    return r;
  }
  __device__ __forceinline__ void Store(T* p) const {
    *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(elems);
  }
  __device__ __forceinline__ T& operator[](int j) { return elems[j]; }
  __device__ __forceinline__ const T& operator[](int j) const { return elems[j]; }
};
#endif

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_KERNELS_VECTOR_ACCESS_H_
