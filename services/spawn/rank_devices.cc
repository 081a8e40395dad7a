#include "services/spawn/rank_devices.h"

#include <dirent.h>

#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace offload {
namespace {

// The value of --name in args[i] (and args[i + 1] for "--name value"); false if args[i] is not it.
bool FlagValue(const std::vector<std::string>& args, size_t* i, absl::string_view name,
               std::string* value) {
  absl::string_view arg = args[*i];
  if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) return false;
  if (!absl::ConsumePrefix(&arg, name)) return false;
  if (absl::ConsumePrefix(&arg, "=")) {
    *value = std::string(arg);
    return true;
  }
  if (!arg.empty()) return false;  // --name_longer
  if (*i + 1 < args.size()) *value = args[++*i];
  return true;
}

// A CUDA_VISIBLE_DEVICES entry that names a device: an index >= 0, or a GPU or MIG UUID.
bool NamesDevice(absl::string_view entry) {
  entry = absl::StripAsciiWhitespace(entry);
  int index = 0;
  if (absl::SimpleAtoi(entry, &index)) return index >= 0;
  return absl::StartsWith(entry, "GPU-") || absl::StartsWith(entry, "MIG-");
}

std::string Count(int n, absl::string_view thing) {
  return absl::StrCat(n, " ", thing, n == 1 ? "" : "s");
}

}  // namespace

RankDeviceSettings ReadRankDeviceSettings(const std::vector<std::string>& trainer_args) {
  RankDeviceSettings s;
  for (size_t i = 0; i < trainer_args.size(); ++i) {
    std::string value;
    if (FlagValue(trainer_args, &i, "device", &value)) {
      s.cuda = value == "cuda";
    } else if (FlagValue(trainer_args, &i, "collectives", &value)) {
      s.nccl = value == "nccl";
    } else if (FlagValue(trainer_args, &i, "cuda_device", &value)) {
      s.cuda_device_given = true;
    }
  }
  return s;
}

absl::StatusOr<std::string> CudaDeviceFlag(const RankDeviceSettings& settings, int local_rank,
                                           int local_ranks, int gpus) {
  if (!settings.cuda || settings.cuda_device_given) return std::string();
  if (settings.nccl && local_ranks > gpus) {
    return absl::FailedPreconditionError(absl::StrCat(
        Count(local_ranks, "CUDA rank"), " on this host ", local_ranks == 1 ? "needs" : "need",
        " one GPU per rank with --collectives=nccl, but ", gpus == 0 ? "none" : absl::StrCat(gpus),
        gpus == 1 ? " is" : " are", " visible: run at most ", Count(gpus, "rank"),
        " here, or --collectives=gloo, whose ranks stage their gradients on the host and may "
        "share a GPU"));
  }
  return absl::StrCat("--cuda_device=", gpus > 0 ? local_rank % gpus : 0);
}

absl::StatusOr<std::vector<std::string>> CudaDeviceFlags(
    const std::vector<std::string>& trainer_args, int num_ranks) {
  const RankDeviceSettings settings = ReadRankDeviceSettings(trainer_args);
  const int gpus = settings.cuda ? VisibleGpuCount() : 0;
  std::vector<std::string> flags;
  for (int r = 0; r < num_ranks; ++r) {
    absl::StatusOr<std::string> flag = CudaDeviceFlag(settings, r, num_ranks, gpus);
    if (!flag.ok()) return flag.status();
    flags.push_back(*std::move(flag));
  }
  return flags;
}

int VisibleGpuCount(const char* cuda_visible_devices, const std::string& driver_gpus_dir) {
  if (cuda_visible_devices != nullptr) {
    int n = 0;
    for (absl::string_view entry : absl::StrSplit(cuda_visible_devices, ',')) {
      if (!NamesDevice(entry)) break;
      ++n;
    }
    return n;
  }
  int n = 0;
  if (DIR* dir = opendir(driver_gpus_dir.c_str())) {
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] != '.') ++n;
    }
    closedir(dir);
  }
  return n;
}

int VisibleGpuCount() {
  return VisibleGpuCount(std::getenv("CUDA_VISIBLE_DEVICES"), "/proc/driver/nvidia/gpus");
}

}  // namespace offload
