#include "cpu_optimizer_server/shard/wire_convert.h"

#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

namespace offload {

absl::StatusOr<StateTensor> StateTensorFromProto(v1::StateTensor tensor, const char* field) {
  switch (tensor) {
    case v1::STATE_TENSOR_MASTER_WEIGHTS:
      return StateTensor::kMasterWeights;
    case v1::STATE_TENSOR_EXP_AVG:
      return StateTensor::kExpAvg;
    case v1::STATE_TENSOR_EXP_AVG_SQ:
      return StateTensor::kExpAvgSq;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, " is ", static_cast<int>(tensor), "; use MASTER_WEIGHTS, EXP_AVG or EXP_AVG_SQ"));
  }
}

namespace {

// `field` names the message in errors: "adam" or "groups[i].adam".
absl::StatusOr<AdamHyperParams> AdamFromProto(const v1::AdamConfig& a, const std::string& field) {
  AdamHyperParams adam;
  switch (a.kind()) {
    case v1::OPTIMIZER_KIND_ADAM:
      adam.adamw = false;
      break;
    case v1::OPTIMIZER_KIND_ADAMW:
      adam.adamw = true;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(field, ".kind must be ADAM or ADAMW"));
  }
  adam.lr = a.lr();
  adam.beta1 = a.beta1();
  adam.beta2 = a.beta2();
  adam.eps = a.eps();
  adam.weight_decay = a.weight_decay();
  adam.bias_correction = !a.disable_bias_correction();
  switch (a.form()) {
    case v1::ADAM_FORM_TORCH_1_13:
      adam.form = AdamForm::kTorch113;
      break;
    case v1::ADAM_FORM_LERP:
      adam.form = AdamForm::kLerp;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".form ", static_cast<int>(a.form()),
                       " is unknown; use ADAM_FORM_TORCH_1_13 or ADAM_FORM_LERP"));
  }
  return adam;
}

}  // namespace

absl::StatusOr<JobConfig> JobConfigFromProto(const v1::CreateJobRequest& request) {
  JobConfig config;
  config.job_id = request.job_id();
  constexpr uint64_t kMax = std::numeric_limits<int64_t>::max() / 4;
  for (int i = 0; i < request.ranges_size(); ++i) {
    const v1::ParamRange& r = request.ranges(i);
    if (r.offset() > kMax || r.length() > kMax) {
      return absl::InvalidArgumentError(absl::StrCat("ranges[", i, "] is out of bounds"));
    }
    config.ranges.push_back(
        RangeSpec{static_cast<int64_t>(r.offset()), static_cast<int64_t>(r.length())});
  }
  if (request.groups_size() == 0) {
    absl::StatusOr<AdamHyperParams> adam = AdamFromProto(request.adam(), "adam");
    if (!adam.ok()) return adam.status();
    config.adam = *adam;
    config.groups.push_back(DefaultParamGroup(config.ranges, config.adam));
  } else {
    // `adam` is unused with groups, so it is not read (it may be left unset). The count is
    // checked by the store, which names the first group too many.
    for (int i = 0; i < request.groups_size(); ++i) {
      const v1::ParamGroup& g = request.groups(i);
      if (g.offset() > kMax || g.length() > kMax) {
        return absl::InvalidArgumentError(absl::StrCat("groups[", i, "] is out of bounds"));
      }
      absl::StatusOr<AdamHyperParams> adam =
          AdamFromProto(g.adam(), absl::StrCat("groups[", i, "].adam"));
      if (!adam.ok()) return adam.status();
      config.groups.push_back(ParamGroupSpec{static_cast<int64_t>(g.offset()),
                                             static_cast<int64_t>(g.length()), *adam});
    }
    config.adam = config.groups[0].adam;
  }
  absl::StatusOr<DType> dtype = DTypeFromProto(request.param_dtype(), "param_dtype");
  if (!dtype.ok()) return dtype.status();
  config.param_dtype = *dtype;
  switch (request.state_tier()) {
    case v1::STATE_TIER_AUTO:
      config.state_tier = StateTier::kAuto;
      break;
    case v1::STATE_TIER_MEMORY:
      config.state_tier = StateTier::kMemory;
      break;
    case v1::STATE_TIER_DISK:
      config.state_tier = StateTier::kDisk;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("state_tier ", static_cast<int>(request.state_tier()), " is not a tier"));
  }
  switch (request.state_dtype()) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::DTYPE_FP32:
      config.state_dtype = DType::kFp32;
      break;
    case v1::DTYPE_BF16:
      config.state_dtype = DType::kBf16;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "state_dtype ", v1::DType_Name(request.state_dtype()), " is neither FP32 nor BF16"));
  }
  switch (request.state_rounding()) {
    case v1::STATE_ROUNDING_STOCHASTIC:
      config.state_rounding = StateRounding::kStochastic;
      break;
    case v1::STATE_ROUNDING_NEAREST:
      config.state_rounding = StateRounding::kNearest;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "state_rounding ", static_cast<int>(request.state_rounding()), " is not a rounding"));
  }
  return config;
}

v1::AdamConfig AdamConfigToProto(const AdamHyperParams& adam) {
  v1::AdamConfig a;
  a.set_kind(adam.adamw ? v1::OPTIMIZER_KIND_ADAMW : v1::OPTIMIZER_KIND_ADAM);
  a.set_lr(adam.lr);
  a.set_beta1(adam.beta1);
  a.set_beta2(adam.beta2);
  a.set_eps(adam.eps);
  a.set_weight_decay(adam.weight_decay);
  a.set_disable_bias_correction(!adam.bias_correction);
  a.set_form(adam.form == AdamForm::kLerp ? v1::ADAM_FORM_LERP : v1::ADAM_FORM_TORCH_1_13);
  return a;
}

}  // namespace offload
