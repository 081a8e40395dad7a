#include "cpu_optimizer_server/tools/range_driver.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
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

absl::Status StepAllRanges(ShardClient* client, const std::string& job_id,
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

absl::StatusOr<ExchangeResult> ExchangeRange(StepStream& stream, int64_t offset,
                                             const uint16_t* grads, DType dtype, int64_t n,
                                             uint16_t* params, const ExchangeOptions& options) {
  ExchangeResult out;
  const ExchangeMode mode = options.mode;
  if (mode != ExchangeMode::kOut) {
    const void* src = grads;
    if (options.grad_area) {
      void* area = stream.GradientArea();  // (n,)
      if (area == nullptr) return absl::UnimplementedError("the plane has no gradient area");
      const auto t0 = std::chrono::steady_clock::now();
      std::memcpy(area, grads, n * 2);
      out.produce_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      src = area;
    }
    const int64_t call = options.call_elements > 0 ? options.call_elements : n;
    for (int64_t done = 0; done < n; done += call) {
      const int64_t m = std::min(call, n - done);
      OFFLOAD_RETURN_IF_ERROR(
          stream.SendGradients(offset + done, static_cast<const char*>(src) + done * 2, dtype, m));
      if (mode == ExchangeMode::kEarly) {
        OFFLOAD_RETURN_IF_ERROR(stream.UpdateEarly(offset + done, m, 0, options.lr, 1.0f, {}));
      }
    }
  }
  const bool skip = mode == ExchangeMode::kIn;
  int64_t received = 0;
  absl::StatusOr<v1::StepResult> r;
  if (options.params_in_place) {
    r = stream.CommitInPlace(options.lr, 1.0f, skip,
                             [&](int64_t, int64_t m, const void*) { received += m; });
  } else {
    r = stream.Commit(options.lr, 1.0f, skip, params);
    received = r.ok() && !r->skipped() ? n : 0;  // Commit checks the whole range came back
  }
  if (!r.ok()) return r.status();
  const bool as_asked = mode == ExchangeMode::kIn    ? r->skipped()
                        : mode == ExchangeMode::kOut ? r->replayed()
                                                     : r->applied();
  if (!as_asked) {
    return absl::InternalError(absl::StrCat("the shard did not ",
                                            mode == ExchangeMode::kIn    ? "skip"
                                            : mode == ExchangeMode::kOut ? "replay"
                                                                         : "apply",
                                            " the step"));
  }
  if (!r->skipped() && received != n) {
    return absl::InternalError("the commit did not return the whole range");
  }
  out.result = *std::move(r);
  return out;
}

}  // namespace offload
