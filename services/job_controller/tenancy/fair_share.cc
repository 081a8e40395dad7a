#include "services/job_controller/tenancy/fair_share.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace offload {

double DominantShare(const TenantLoad& load, const PoolSize& pool) {
  const double servers =
      pool.servers == 0 ? 0.0
                        : static_cast<double>(load.servers) / static_cast<double>(pool.servers);
  const double ranks = pool.trainers == 0
                           ? 0.0
                           : static_cast<double>(load.ranks) / static_cast<double>(pool.trainers);
  return std::max(servers, ranks);
}

std::map<std::string, double> EntitledShares(const std::map<std::string, TenantLoad>& loads,
                                             const std::map<std::string, double>& weights) {
  auto weight = [&weights](const std::string& tenant) {
    auto it = weights.find(tenant);
    return it == weights.end() || it->second <= 0 ? 1.0 : it->second;
  };
  double total = 0;
  for (const auto& [tenant, load] : loads) {
    if (load.running_jobs + load.queued_jobs > 0) total += weight(tenant);
  }
  std::map<std::string, double> entitled;
  for (const auto& [tenant, load] : loads) {
    entitled[tenant] = load.running_jobs + load.queued_jobs > 0 ? weight(tenant) / total : 0.0;
  }
  return entitled;
}

std::string QuotaBlock(const v1::TenantConfig& quota, const TenantLoad& load, uint32_t ranks,
                       uint32_t servers) {
  const std::string& name = quota.name();
  if (quota.max_running_jobs() > 0 && load.running_jobs + 1 > quota.max_running_jobs()) {
    return absl::StrCat("tenant ", name, " runs ", load.running_jobs, " job(s), its quota");
  }
  if (quota.max_optimizer_servers() > 0 &&
      uint64_t{load.servers} + servers > quota.max_optimizer_servers()) {
    return absl::StrCat("tenant ", name, " holds ", load.servers, " of its quota of ",
                        quota.max_optimizer_servers(), " optimizer server(s); this job needs ",
                        servers);
  }
  if (quota.max_ranks() > 0 && uint64_t{load.ranks} + ranks > quota.max_ranks()) {
    return absl::StrCat("tenant ", name, " holds ", load.ranks, " of its quota of ",
                        quota.max_ranks(), " rank(s); this job needs ", ranks);
  }
  return "";
}

std::string QuotaNeverFits(const v1::TenantConfig& quota, uint32_t ranks, uint32_t servers) {
  if (quota.max_optimizer_servers() > 0 && servers > quota.max_optimizer_servers()) {
    return absl::StrCat("parallel.optimizer_servers: ", servers, " is more than tenant ",
                        quota.name(), "'s quota of ", quota.max_optimizer_servers());
  }
  if (quota.max_ranks() > 0 && ranks > quota.max_ranks()) {
    return absl::StrCat("parallel.ranks: ", ranks, " is more than tenant ", quota.name(),
                        "'s quota of ", quota.max_ranks());
  }
  return "";
}

}  // namespace offload
