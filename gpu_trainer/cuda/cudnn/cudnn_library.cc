#include "gpu_trainer/cuda/cudnn/cudnn_library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace offload {
namespace {

absl::string_view BaseName(absl::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == absl::string_view::npos ? path : path.substr(slash + 1);
}

// Resolves `name` into `*fn`, typed as the header declares it.
template <typename Fn>
absl::Status Resolve(void* handle, const std::string& path, const char* name, Fn* fn) {
  dlerror();  // clears an older error, so the one read below is this lookup's
  void* symbol = dlsym(handle, name);
  if (symbol == nullptr) {
    const char* why = dlerror();
    return absl::NotFoundError(absl::StrCat("cuDNN library ", path, " has no ", name, " (",
                                            why != nullptr ? why : "null symbol",
                                            "): not a cuDNN 9 library"));
  }
  *fn = reinterpret_cast<Fn>(symbol);
  return absl::OkStatus();
}

}  // namespace

std::string CudnnLibrary::DefaultPath() {
  const char* env = std::getenv(kPathVariable);
  return env != nullptr && env[0] != '\0' ? std::string(env) : std::string(kDefaultPath);
}

absl::StatusOr<std::unique_ptr<CudnnLibrary>> CudnnLibrary::Load(const std::string& path) {
  // RTLD_NODELETE: cuDNN loads sublibraries and registers CUDA state of its own; unloading it
  // while anything may still hold a descriptor is never wanted, so dlclose only drops a count.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::UnavailableError(
        absl::StrCat("cuDNN not found: dlopen(\"", path,
                     "\") failed: ", why != nullptr ? why : "no reason given",
                     " (set LD_LIBRARY_PATH, or ", kPathVariable, " to the library's path)"));
  }
  std::unique_ptr<CudnnLibrary> lib(new CudnnLibrary());
  lib->handle_ = handle;
  lib->path_ = path;
  CudnnApi& a = lib->api_;
  // Every entry point is looked up now, so a library that lacks one fails here, not mid-run.
  absl::Status status = Resolve(handle, path, "cudnnGetVersion", &a.GetVersion);
  if (status.ok()) status = Resolve(handle, path, "cudnnGetErrorString", &a.GetErrorString);
  if (status.ok()) status = Resolve(handle, path, "cudnnGetLastErrorString", &a.GetLastErrorString);
  if (status.ok()) status = Resolve(handle, path, "cudnnCreate", &a.Create);
  if (status.ok()) status = Resolve(handle, path, "cudnnDestroy", &a.Destroy);
  if (status.ok()) status = Resolve(handle, path, "cudnnSetStream", &a.SetStream);
  if (status.ok()) {
    status = Resolve(handle, path, "cudnnBackendCreateDescriptor", &a.BackendCreateDescriptor);
  }
  if (status.ok()) {
    status = Resolve(handle, path, "cudnnBackendDestroyDescriptor", &a.BackendDestroyDescriptor);
  }
  if (status.ok()) {
    status = Resolve(handle, path, "cudnnBackendSetAttribute", &a.BackendSetAttribute);
  }
  if (status.ok()) {
    status = Resolve(handle, path, "cudnnBackendGetAttribute", &a.BackendGetAttribute);
  }
  if (status.ok()) status = Resolve(handle, path, "cudnnBackendFinalize", &a.BackendFinalize);
  if (status.ok()) status = Resolve(handle, path, "cudnnBackendExecute", &a.BackendExecute);
  if (!status.ok()) return status;  // lib's destructor closes the handle
  lib->version_ = static_cast<int64_t>(a.GetVersion());
  if (lib->version_ < kMinVersion) {
    return absl::UnavailableError(absl::StrCat("cuDNN ", lib->version_, " at ", path,
                                               " is older than ", kMinVersion,
                                               ", the first with the graph API this code uses"));
  }
  return lib;
}

absl::StatusOr<const CudnnLibrary*> CudnnLibrary::Shared() {
  // Loaded once, thread-safely (a function-local static), never freed: descriptors and handles
  // made through it may live until exit.
  static const absl::StatusOr<std::unique_ptr<CudnnLibrary>>* const loaded =
      new absl::StatusOr<std::unique_ptr<CudnnLibrary>>(Load(DefaultPath()));
  if (!loaded->ok()) return loaded->status();
  return loaded->value().get();
}

CudnnLibrary::~CudnnLibrary() {
  if (handle_ != nullptr) dlclose(handle_);
}

absl::Status CudnnLibrary::Error(cudnnStatus_t status, const char* expr, const char* file,
                                 int line) const {
  // cuDNN keeps a per-thread message about the last failure, more specific than the status
  // ("Tensor 'x' has no strides", which attribute a finalize rejected, ...).
  char last[1024] = {0};
  if (api_.GetLastErrorString != nullptr) api_.GetLastErrorString(last, sizeof(last));
  const char* name = api_.GetErrorString != nullptr ? api_.GetErrorString(status) : "?";
  std::string message = absl::StrCat(expr, " at ", BaseName(file), ":", line, ": ", name, " (",
                                     static_cast<int>(status), ")");
  if (last[0] != '\0') absl::StrAppend(&message, ": ", last);
  const int category = static_cast<int>(status) / 1000 * 1000;
  if (category == CUDNN_STATUS_NOT_SUPPORTED) return absl::UnimplementedError(message);
  if (status == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED ||
      status == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

}  // namespace offload
