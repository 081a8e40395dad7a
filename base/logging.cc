#include "base/logging.h"

namespace offload {

void InitLogging(const char* argv0) {
  FLAGS_logtostderr = true;
  FLAGS_colorlogtostderr = false;
  google::InitGoogleLogging(argv0);
}

}  // namespace offload
