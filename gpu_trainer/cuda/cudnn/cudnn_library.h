// cuDNN, found at run time: dlopen("libcudnn.so.9") and the entry points this code calls, typed
// from the installed headers. Not linked, so every program starts on a machine without cuDNN
// (the model then runs its reference attention and says why); the GPU machines carry cuDNN
// inside their PyTorch install, which the dynamic loader finds through the LD_LIBRARY_PATH that
// scripts/gpu-bundle's env file sets. OFFLOAD_CUDNN_LIBRARY names another file to load (tests,
// or a cuDNN installed elsewhere).
//
// Only the backend (graph) API is used; it is in libcudnn_graph, which libcudnn.so.9 loads.
// Nothing here needs a GPU: loading, the version and building descriptors run anywhere.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_CUDNN_CUDNN_LIBRARY_H_
#define OFFLOAD_GPU_TRAINER_CUDA_CUDNN_CUDNN_LIBRARY_H_

#include <cudnn_graph.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace offload {

// The entry points, each with the type of its declaration in the headers this was built with,
// so a mismatch is a compile error here rather than a wrong call at run time.
struct CudnnApi {
  decltype(&::cudnnGetVersion) GetVersion = nullptr;
  decltype(&::cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&::cudnnGetLastErrorString) GetLastErrorString = nullptr;
  decltype(&::cudnnCreate) Create = nullptr;
  decltype(&::cudnnDestroy) Destroy = nullptr;
  decltype(&::cudnnSetStream) SetStream = nullptr;
  decltype(&::cudnnBackendCreateDescriptor) BackendCreateDescriptor = nullptr;
  decltype(&::cudnnBackendDestroyDescriptor) BackendDestroyDescriptor = nullptr;
  decltype(&::cudnnBackendSetAttribute) BackendSetAttribute = nullptr;
  decltype(&::cudnnBackendGetAttribute) BackendGetAttribute = nullptr;
  decltype(&::cudnnBackendFinalize) BackendFinalize = nullptr;
  decltype(&::cudnnBackendExecute) BackendExecute = nullptr;
};

class CudnnLibrary {
 public:
  static constexpr const char* kDefaultPath = "libcudnn.so.9";
  static constexpr const char* kPathVariable = "OFFLOAD_CUDNN_LIBRARY";
  // The oldest cuDNN whose graph API has what the fused attention graphs use (cudnnGetVersion's
  // form: major * 10000 + minor * 100 + patch).
  static constexpr int64_t kMinVersion = 90000;

  // $OFFLOAD_CUDNN_LIBRARY when set and not empty, else kDefaultPath (found by the dynamic
  // loader's search: LD_LIBRARY_PATH, then the ld.so cache).
  static std::string DefaultPath();

  // Loads `path`. Unavailable when it cannot be opened (with dlerror's reason) or is older than
  // kMinVersion, NotFound naming the first entry point it lacks. Never aborts.
  static absl::StatusOr<std::unique_ptr<CudnnLibrary>> Load(const std::string& path);

  // The process's cuDNN, loaded from DefaultPath() on the first call and kept until exit; every
  // later call returns the first one's outcome, error included.
  static absl::StatusOr<const CudnnLibrary*> Shared();

  ~CudnnLibrary();
  CudnnLibrary(const CudnnLibrary&) = delete;
  CudnnLibrary& operator=(const CudnnLibrary&) = delete;

  const CudnnApi& api() const { return api_; }
  int64_t version() const { return version_; }
  const std::string& path() const { return path_; }

  // A failed call as a Status naming it, the file and line, cuDNN's status name and its last
  // error message: NOT_SUPPORTED* -> Unimplemented (a graph or shape cuDNN declines), allocation
  // failures -> ResourceExhausted, the rest -> Internal.
  absl::Status Error(cudnnStatus_t status, const char* expr, const char* file, int line) const;

 private:
  CudnnLibrary() = default;

  void* handle_ = nullptr;  // dlopen's
  std::string path_;
  int64_t version_ = 0;
  CudnnApi api_;
};

}  // namespace offload

// Returns the Status of a failed cuDNN call; `lib` is the CudnnLibrary it was called through.
#define OFFLOAD_CUDNN_RETURN_IF_ERROR(lib, expr)                            \
  do {                                                                      \
    const cudnnStatus_t offload_cudnn_status_ = (expr);                     \
    if (offload_cudnn_status_ != CUDNN_STATUS_SUCCESS) {                    \
      return (lib).Error(offload_cudnn_status_, #expr, __FILE__, __LINE__); \
    }                                                                       \
  } while (0)

#endif  // OFFLOAD_GPU_TRAINER_CUDA_CUDNN_CUDNN_LIBRARY_H_
