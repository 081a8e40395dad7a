#include "cpu_optimizer_server/tools/range_driver.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "base/status_macros.h"
#include "cpu_optimizer_server/shard/wire_convert.h"

namespace offload {

std::vector<RangeSpec> BalancedRanges(int64_t n, int k) {
  std::vector<RangeSpec> ranges;
  for (int r = 0; r < k; ++r) {
    const int64_t lo = n * r / k, hi = n * (r + 1) / k;
    ranges.push_back(RangeSpec{lo, hi - lo});
  }
  return ranges;
}

v1::CreateJobRequest MakeCreateJobRequest(const std::string& job_id,
                                          const std::vector<RangeSpec>& ranges,
                                          const AdamHyperParams& adam, DType param_dtype) {
  v1::CreateJobRequest request;
  request.set_job_id(job_id);
  for (const RangeSpec& r : ranges) {
    v1::ParamRange* pr = request.add_ranges();
    pr->set_offset(r.offset);
    pr->set_length(r.length);
  }
  *request.mutable_adam() = AdamConfigToProto(adam);
  request.set_param_dtype(DTypeToProto(param_dtype));
  return request;
}

absl::Status StepAllRanges(OptimizerClient* client, const std::string& job_id,
                           const std::vector<RangeSpec>& ranges, uint64_t step,
                           const uint16_t* grads, DType dtype, double lr, float grad_multiplier,
                           uint16_t* params) {
  if (ranges.empty()) return absl::InvalidArgumentError("no ranges to step");
  std::vector<absl::Status> errors(ranges.size());
  auto run = [&](size_t r) {
    const RangeSpec& range = ranges[r];
    auto stream =
        client->OpenStep(job_id, static_cast<uint32_t>(r), range.offset, range.length, step);
    if (!stream.ok()) {
      errors[r] = stream.status();
      return;
    }
    errors[r] = (*stream)->SendGradients(range.offset, grads + range.offset, dtype, range.length);
    if (!errors[r].ok()) return;
    errors[r] = (*stream)->Commit(lr, grad_multiplier, false, params + range.offset).status();
  };
  std::vector<std::thread> ranks;
  for (size_t r = 1; r < ranges.size(); ++r) ranks.emplace_back(run, r);
  run(0);
  for (std::thread& t : ranks) t.join();
  for (const absl::Status& e : errors) {
    if (!e.ok()) return e;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::StepResult> ExchangeInPlace(StepStream& stream, int64_t offset,
                                               const uint16_t* grads, DType dtype, int64_t n,
                                               bool send, double lr, bool skip, double* produce_s) {
  if (send) {
    void* area = stream.GradientArea();  // (n,)
    if (area == nullptr) return absl::UnimplementedError("the plane has no gradient area");
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(area, grads, n * 2);
    *produce_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    OFFLOAD_RETURN_IF_ERROR(stream.SendGradients(offset, area, dtype, n));
  }
  int64_t handed_over = 0;
  absl::StatusOr<v1::StepResult> r = stream.CommitInPlace(
      lr, 1.0f, skip, [&](int64_t, int64_t m, const void*) { handed_over += m; });
  if (r.ok() && !r->skipped() && handed_over != n) {
    return absl::InternalError("the zero-copy commit did not hand over the whole range");
  }
  return r;
}

}  // namespace offload
