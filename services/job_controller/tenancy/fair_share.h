// Fair shares of the pool between tenants, and their quotas (ARCHITECTURE.md section 7,
// "Tenants"): the arithmetic the scheduler orders pending jobs by, apart from the controller so
// that it can be tested on its own.
//
// Dominant-resource fairness (Ghodsi et al., NSDI 2011) over the pool's two resources: a tenant's
// dominant share is the larger of its fractions of the pool's optimizer servers and of its trainer
// ranks. The next free workers go to the waiting job whose tenant has the smallest dominant share
// divided by its weight: the tenant furthest below its fair share.
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_TENANCY_FAIR_SHARE_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_TENANCY_FAIR_SHARE_H_

#include <cstdint>
#include <map>
#include <string>

#include "offload/v1/tenants.pb.h"

namespace offload {

// The pool's registered, live workers of each kind.
struct PoolSize {
  uint32_t trainers = 0;
  uint32_t servers = 0;
};

// What one tenant's jobs hold and wait for.
struct TenantLoad {
  uint32_t servers = 0;  // held by its running jobs
  uint32_t ranks = 0;
  uint32_t running_jobs = 0;
  uint32_t queued_jobs = 0;
};

// max(servers / pool.servers, ranks / pool.trainers); a kind the pool has none of counts 0.
double DominantShare(const TenantLoad& load, const PoolSize& pool);

// What each tenant with a job running or queued is entitled to: its weight over the sum of those
// tenants' weights. `weights` gives each tenant's weight (1 where it names none).
std::map<std::string, double> EntitledShares(const std::map<std::string, TenantLoad>& loads,
                                             const std::map<std::string, double>& weights);

// Empty when a job of `ranks` and `servers` may start under `quota` with the tenant's jobs already
// holding `load`; otherwise which quota stops it, for the job's reason.
std::string QuotaBlock(const v1::TenantConfig& quota, const TenantLoad& load, uint32_t ranks,
                       uint32_t servers);

// The same on an idle pool: a job that could never start under the quota (refused at submit).
std::string QuotaNeverFits(const v1::TenantConfig& quota, uint32_t ranks, uint32_t servers);

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_TENANCY_FAIR_SHARE_H_
