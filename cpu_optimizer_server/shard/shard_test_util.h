// What the shard's tests share: a sink that collects a commit's streamed parameters.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_SHARD_TEST_UTIL_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_SHARD_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cpu_optimizer_server/shard/step_session.h"

namespace offload {

// Collects streamed parameters into one vector indexed by flat offset - base.
class VectorSink : public ParamSink {
 public:
  VectorSink(int64_t base, int64_t n) : base_(base), out_(n, 0xdead) {}
  void* Buffer(int slot, int64_t offset, int64_t n) override {
    slots_[slot] = {offset, n};
    buffers_[slot].assign(n, 0);
    return buffers_[slot].data();
  }
  bool Send(int slot) override {
    ++sends_;
    if (refuse_after_ >= 0 && sends_ > refuse_after_) return false;
    std::memcpy(&out_[slots_[slot].first - base_], buffers_[slot].data(), slots_[slot].second * 2);
    return true;
  }
  const std::vector<uint16_t>& out() const { return out_; }
  int sends() const { return sends_; }
  void RefuseAfter(int n) { refuse_after_ = n; }

 private:
  int64_t base_;
  std::vector<uint16_t> out_;
  std::vector<uint16_t> buffers_[2];
  std::pair<int64_t, int64_t> slots_[2];
  int sends_ = 0;
  int refuse_after_ = -1;
};

// A moment view of a job with fp32 state (RangeState::exp_avg and exp_avg_sq are untyped).
inline float* Fp32(void* moment) { return static_cast<float*>(moment); }

inline std::string Bytes(const void* p, size_t n) {
  return std::string(static_cast<const char*>(p), n);
}

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_SHARD_TEST_UTIL_H_
