// What tests anywhere in the tree share: a scratch directory per test, and where the
// repository's data is.
#ifndef OFFLOAD_BASE_TESTING_TEST_UTIL_H_
#define OFFLOAD_BASE_TESTING_TEST_UTIL_H_

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace offload {

// The repository's root, for the tests' data: $OFFLOAD_SOURCE_DIR when set (test programs run
// from a bundle on another machine: scripts/gpu-check --bundle sets it), else the tree the test
// was built from (the OFFLOAD_SOURCE_DIR its CMake target defines), else ".".
inline std::string SourceDir() {
  const char* env = getenv("OFFLOAD_SOURCE_DIR");
  if (env != nullptr && env[0] != '\0') return env;
#ifdef OFFLOAD_SOURCE_DIR
  return OFFLOAD_SOURCE_DIR;
#else
  return ".";
#endif
}

// A fresh directory under the system's temp directory, removed with everything in it when the
// object goes.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "offload_test.XXXXXX").string();
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    if (!path_.empty()) std::filesystem::remove_all(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // Writes `contents` to the file `name` in the directory; returns its path.
  std::string Write(const std::string& name, const std::string& contents) const {
    const std::string file = path_ + "/" + name;
    std::ofstream(file, std::ios::binary) << contents;
    return file;
  }

 private:
  std::string path_;
};

}  // namespace offload

#endif  // OFFLOAD_BASE_TESTING_TEST_UTIL_H_
