// Loading cuDNN at run time, and building the fused attention graphs, on any machine: a path
// that is not there and a library that is not cuDNN both come back as a Status (never a crash),
// OFFLOAD_CUDNN_LIBRARY picks the file, and where cuDNN itself is installed (a GPU is not
// needed) every descriptor of both graphs, in both storage types, is accepted and finalized by
// it, which checks each attribute's name, type and count against the real library. Building
// plans and running them needs a GPU: cudnn_attention_test.cc.
#include "gpu_trainer/cuda/cudnn/cudnn_library.h"

#include <stdlib.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_trainer/cuda/cudnn/sdpa_backend_graph.h"
#include "gpu_trainer/cuda/cudnn/sdpa_graph.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(CudnnLibrary, AMissingFileIsUnavailableAndNamesIt) {
  const std::string path = "/nonexistent/libcudnn.so.9";
  absl::StatusOr<std::unique_ptr<CudnnLibrary>> lib = CudnnLibrary::Load(path);
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), absl::StatusCode::kUnavailable) << lib.status();
  EXPECT_NE(lib.status().message().find(path), std::string::npos) << lib.status();
  EXPECT_NE(lib.status().message().find("cuDNN not found"), std::string::npos) << lib.status();
}

TEST(CudnnLibrary, ALibraryThatIsNotCudnnIsNotFoundNamingTheSymbol) {
  // The C math library loads everywhere and has none of cuDNN's entry points.
  absl::StatusOr<std::unique_ptr<CudnnLibrary>> lib = CudnnLibrary::Load("libm.so.6");
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), absl::StatusCode::kNotFound) << lib.status();
  EXPECT_NE(lib.status().message().find("cudnnGetVersion"), std::string::npos) << lib.status();
}

TEST(CudnnLibrary, TheEnvironmentVariableChoosesTheFile) {
  const char* old = getenv(CudnnLibrary::kPathVariable);
  const std::string saved = old != nullptr ? old : "";
  ASSERT_EQ(setenv(CudnnLibrary::kPathVariable, "/elsewhere/libcudnn.so", 1), 0);
  EXPECT_EQ(CudnnLibrary::DefaultPath(), "/elsewhere/libcudnn.so");
  ASSERT_EQ(setenv(CudnnLibrary::kPathVariable, "", 1), 0);
  EXPECT_EQ(CudnnLibrary::DefaultPath(), CudnnLibrary::kDefaultPath);
  if (old != nullptr) {
    setenv(CudnnLibrary::kPathVariable, saved.c_str(), 1);
  } else {
    unsetenv(CudnnLibrary::kPathVariable);
  }
}

// The installed cuDNN, or a skip saying why there is none.
std::unique_ptr<CudnnLibrary> LoadInstalledOrSkip(std::string* why) {
  absl::StatusOr<std::unique_ptr<CudnnLibrary>> lib =
      CudnnLibrary::Load(CudnnLibrary::kDefaultPath);
  if (!lib.ok()) {
    *why = std::string(lib.status().message());
    return nullptr;
  }
  return std::move(*lib);
}

TEST(CudnnLibrary, TheInstalledLibraryIsVersionNineOrLater) {
  std::string why;
  std::unique_ptr<CudnnLibrary> lib = LoadInstalledOrSkip(&why);
  if (lib == nullptr) GTEST_SKIP() << why;
  EXPECT_GE(lib->version(), CudnnLibrary::kMinVersion);
  std::printf("cuDNN %lld from %s\n", static_cast<long long>(lib->version()), lib->path().c_str());
  // A failed call reads as a Status naming the call and cuDNN's reason.
  const absl::Status error = lib->Error(CUDNN_STATUS_NOT_SUPPORTED_SHAPE, "f(x)", __FILE__, 7);
  EXPECT_EQ(error.code(), absl::StatusCode::kUnimplemented) << error;
  EXPECT_NE(error.message().find("f(x) at cudnn_library_test.cc:7"), std::string::npos) << error;
  EXPECT_EQ(lib->Error(CUDNN_STATUS_BAD_PARAM, "f", __FILE__, 1).code(),
            absl::StatusCode::kInternal);
}

struct GraphCase {
  int B, T, C, NH;
};

// Every descriptor of both graphs is finalized by the real library without a GPU: cuDNN checks
// each tensor's dims against its strides, each operation's operands against each other
// (a product's inner dims, a reduction's output dims, a pointwise operation's broadcast and
// ports), and the graph's connectivity. What it cannot check here is whether an engine takes the
// graph: that needs a device (cudnn_attention_test.cc).
TEST(CudnnLibrary, BothAttentionGraphsBuildInBothStorageTypes) {
  std::string why;
  std::unique_ptr<CudnnLibrary> lib = LoadInstalledOrSkip(&why);
  if (lib == nullptr) GTEST_SKIP() << why;
  for (const GraphCase& c : {GraphCase{3, 17, 48, 3}, GraphCase{4, 1024, 768, 12}}) {
    for (const SdpaDType dtype : {SdpaDType::kBfloat16, SdpaDType::kHalf}) {
      for (const SdpaDirection direction : {SdpaDirection::kForward, SdpaDirection::kBackward}) {
        SCOPED_TRACE(::testing::Message()
                     << "B=" << c.B << " T=" << c.T << " C=" << c.C << " NH=" << c.NH
                     << (dtype == SdpaDType::kHalf ? " fp16" : " bf16")
                     << (direction == SdpaDirection::kForward ? " forward" : " backward"));
        const SdpaKey key{c.B, c.T, c.C, c.NH, dtype, direction};
        absl::StatusOr<SdpaOperationGraph> graph =
            BuildSdpaOperationGraph(*lib, /*handle=*/nullptr, key);
        ASSERT_TRUE(graph.ok()) << graph.status();
        // Forward: 2 products, the scale, 4 for the mask, 7 for the softmax: 14. Backward: 3
        // for Dsum; Q KT, scale, stats, 4 for the mask, exp; P^T and dV; dO VT, 3 for dS; dS^T
        // and dK; K and dQ's product and identity: 22.
        EXPECT_EQ(graph->num_operations, direction == SdpaDirection::kForward ? 14 : 22);
      }
    }
  }
}

}  // namespace
}  // namespace offload
