#include "services/job_controller/tenancy/fair_share.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

using ::testing::HasSubstr;

TEST(DominantShareTest, IsTheLargerFractionOfThePool) {
  const PoolSize pool{/*trainers=*/8, /*servers=*/2};
  EXPECT_DOUBLE_EQ(DominantShare({/*servers=*/1, /*ranks=*/2}, pool), 0.5);   // servers dominate
  EXPECT_DOUBLE_EQ(DominantShare({/*servers=*/0, /*ranks=*/6}, pool), 0.75);  // ranks dominate
  EXPECT_DOUBLE_EQ(DominantShare({}, pool), 0.0);
  // A kind the pool has none of (every worker gone) counts nothing rather than dividing by 0.
  EXPECT_DOUBLE_EQ(DominantShare({1, 1}, PoolSize{0, 0}), 0.0);
}

TEST(EntitledSharesTest, SplitsByWeightAmongTenantsWithWork) {
  std::map<std::string, TenantLoad> loads;
  loads["a"].running_jobs = 2;
  loads["b"].queued_jobs = 1;
  loads["idle"];  // neither running nor queued: owed nothing
  const std::map<std::string, double> weights = {{"a", 3.0}};  // b: 1 by default
  const std::map<std::string, double> entitled = EntitledShares(loads, weights);
  EXPECT_DOUBLE_EQ(entitled.at("a"), 0.75);
  EXPECT_DOUBLE_EQ(entitled.at("b"), 0.25);
  EXPECT_DOUBLE_EQ(entitled.at("idle"), 0.0);
}

TEST(QuotaTest, EachQuotaStopsAJobThatWouldPassIt) {
  v1::TenantConfig quota;
  quota.set_name("a");
  quota.set_max_optimizer_servers(2);
  quota.set_max_ranks(4);
  quota.set_max_running_jobs(2);
  EXPECT_EQ(QuotaBlock(quota, {}, 4, 2), "");
  EXPECT_EQ(QuotaBlock(quota, {/*servers=*/1, /*ranks=*/1, /*running_jobs=*/1}, 3, 1), "");
  EXPECT_THAT(QuotaBlock(quota, {1, 1, 1}, 1, 2), HasSubstr("optimizer server"));
  EXPECT_THAT(QuotaBlock(quota, {1, 1, 1}, 4, 1), HasSubstr("rank"));
  EXPECT_THAT(QuotaBlock(quota, {0, 0, 2}, 1, 1), HasSubstr("runs 2 job(s)"));
  // No limits: anything goes.
  v1::TenantConfig none;
  none.set_name("b");
  EXPECT_EQ(QuotaBlock(none, {1000, 1000, 1000}, 1000, 1000), "");
  EXPECT_EQ(QuotaNeverFits(none, 1000, 1000), "");
  EXPECT_THAT(QuotaNeverFits(quota, 1, 3), HasSubstr("parallel.optimizer_servers: 3"));
  EXPECT_THAT(QuotaNeverFits(quota, 5, 1), HasSubstr("parallel.ranks: 5"));
  EXPECT_EQ(QuotaNeverFits(quota, 4, 2), "");
}

}  // namespace
}  // namespace offload
