#include "services/job_controller/tenancy/identities.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kTokenA[] = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
constexpr char kTokenB[] = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
constexpr char kTokenOps[] = "cccccccccccccccccccccccccccccccc";
constexpr char kOperatorToken[] = "operator-token";

std::string TwoTenants() {
  return absl::StrCat(R"({"tenants": [
    {"name": "team-a", "weight": 2, "max_optimizer_servers": 1, "tokens": [")",
                      kTokenA, R"("]},
    {"name": "team-b", "tokens": [")",
                      kTokenB, R"("]},
    {"name": "ops", "admin": true, "tokens": [")",
                      kTokenOps, R"("]}]})");
}

class TenantsFile {
 public:
  TenantsFile() {
    const char* dir = std::getenv("TEST_TMPDIR");
    path_ = std::string(dir != nullptr ? dir : "/tmp") + "/identities_test_" +
            std::to_string(getpid()) + ".json";
  }
  ~TenantsFile() { std::remove(path_.c_str()); }
  void Write(const std::string& text) const {
    // Replaced whole, as a ConfigMap or Secret update is: a reader never sees half a file.
    const std::string tmp = path_ + ".tmp";
    std::ofstream(tmp) << text;
    std::rename(tmp.c_str(), path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

BearerTokens OperatorTokens() {
  BearerTokens tokens;
  tokens.Add(kOperatorToken);
  return tokens;
}

TEST(ParseTenantsTest, ReadsEveryField) {
  absl::StatusOr<TenantTable> table = ParseTenants(TwoTenants(), "t.json");
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_EQ(table->tenants.size(), 3u);
  const v1::TenantConfig* a = table->Find("team-a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->weight(), 2.0);
  EXPECT_EQ(a->max_optimizer_servers(), 1u);
  EXPECT_EQ(a->max_ranks(), 0u);
  EXPECT_FALSE(a->admin());
  // An absent weight is 1, not 0 (a tenant of weight 0 would be owed nothing).
  EXPECT_EQ(table->Find("team-b")->weight(), 1.0);
  EXPECT_TRUE(table->Find("ops")->admin());
  EXPECT_EQ(table->Find("nobody"), nullptr);
}

TEST(ParseTenantsTest, BadFilesAreRefusedNamingTheProblemButNoToken) {
  const std::string secret = "dddddddddddddddddddddddddddddddd";
  const struct {
    std::string text;
    std::string says;
  } cases[] = {
      {"not json", "not a TenantsFile"},
      {R"({"tenants": [{"name": "a", "color": 1}]})", "not a TenantsFile"},
      {R"({"tenants": [{"name": "Team A"}]})", "tenants[0].name"},
      {R"({"tenants": [{"name": ""}]})", "tenants[0].name"},
      {R"({"tenants": [{"name": "a"}, {"name": "a"}]})", "listed twice"},
      {R"({"tenants": [{"name": "a", "weight": -1}]})", "weight"},
      {R"({"tenants": [{"name": "a", "tokens": ["short"]}]})", "at least 16"},
      {R"({"tenants": [{"name": "a", "tokens": [")" + secret +
           R"("]}, {"name": "b", "tokens": [")" + secret + R"("]}]})",
       "tenants[1].tokens[0]: the same token is listed twice"},
      {R"({"tenants": [{"name": "a", "max_ranks": -2}]})", "not a TenantsFile"},
      {R"({"tenants": [{"name": "a", "tokens": [")" + secret + R"(" "x"]}]})", "not a TenantsFile"},
      {R"({"tenants": [{"name": "a", "tokens": [")" + secret, "not a TenantsFile"},
      {R"({"tenants": [{"name": "a", "certificate_names": ["ci"]},)"
       R"( {"name": "b", "certificate_names": ["ci"]}]})",
       "tenants[1].certificate_names[0]: 'ci' names two tenants"},
      {R"({"tenants": [{"name": "a", "certificate_names": [""]}]})", "empty"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<TenantTable> table = ParseTenants(c.text, "t.json");
    ASSERT_FALSE(table.ok()) << c.text;
    EXPECT_EQ(table.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(table.status().message(), HasSubstr("tenants file t.json"));
    EXPECT_THAT(table.status().message(), HasSubstr(c.says)) << c.text;
    EXPECT_THAT(table.status().message(), Not(HasSubstr(secret)));
  }
}

TEST(IdentitiesTest, TokensNameTheirTenantAndOnlyTheOperatorIsAWorker) {
  TenantsFile file;
  file.Write(TwoTenants());
  absl::StatusOr<std::unique_ptr<Identities>> ids =
      Identities::Create(OperatorTokens(), file.path());
  ASSERT_TRUE(ids.ok()) << ids.status();
  const Caller a = (*ids)->IdentifyAuthorization(absl::StrCat("Bearer ", kTokenA));
  EXPECT_TRUE(a.authenticated);
  EXPECT_EQ(a.tenant, "team-a");
  EXPECT_FALSE(a.admin);
  EXPECT_FALSE(a.worker);
  const Caller ops = (*ids)->IdentifyToken(kTokenOps);
  EXPECT_EQ(ops.tenant, "ops");
  EXPECT_TRUE(ops.admin);
  EXPECT_FALSE(ops.worker);
  const Caller op = (*ids)->IdentifyToken(kOperatorToken);
  EXPECT_EQ(op.tenant, kOperatorTenant);
  EXPECT_TRUE(op.admin);
  EXPECT_TRUE(op.worker);
  for (const std::string wrong : {"", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "Basic x", kTokenA}) {
    const Caller caller = (*ids)->IdentifyAuthorization(wrong);
    EXPECT_FALSE(caller.authenticated) << wrong;
    EXPECT_TRUE(caller.tenant.empty());
  }
}

TEST(IdentitiesTest, WithoutTokensEveryCallerIsTheOperator) {
  std::unique_ptr<Identities> ids = Identities::WithTable(BearerTokens(), TenantTable());
  const Caller caller = ids->IdentifyToken("");
  EXPECT_TRUE(caller.authenticated);
  EXPECT_TRUE(caller.admin);
  EXPECT_EQ(caller.tenant, kOperatorTenant);
}

TEST(IdentitiesTest, ARevokedTokenIsRefusedAfterOneReloadAndABadFileChangesNothing) {
  TenantsFile file;
  file.Write(TwoTenants());
  absl::StatusOr<std::unique_ptr<Identities>> created =
      Identities::Create(OperatorTokens(), file.path());
  ASSERT_TRUE(created.ok()) << created.status();
  Identities& ids = **created;
  EXPECT_EQ(ids.reloads(true), 1u);
  // Unchanged: nothing to do.
  EXPECT_EQ(ids.Reload().value(), false);
  EXPECT_TRUE(ids.IdentifyToken(kTokenB).authenticated);

  // team-b's token revoked.
  file.Write(absl::StrCat(R"({"tenants": [{"name": "team-a", "tokens": [")", kTokenA, R"("]}]})"));
  EXPECT_TRUE(ids.IdentifyToken(kTokenB).authenticated);  // until the reload
  EXPECT_EQ(ids.Reload().value(), true);
  EXPECT_FALSE(ids.IdentifyToken(kTokenB).authenticated);
  EXPECT_TRUE(ids.IdentifyToken(kTokenA).authenticated);
  EXPECT_EQ(ids.table()->Find("team-a")->max_optimizer_servers(), 0u);  // the quota went too

  // A broken file: the error once, and the last good table stays.
  file.Write("{\"tenants\": [");
  absl::StatusOr<bool> broken = ids.Reload();
  ASSERT_FALSE(broken.ok());
  EXPECT_THAT(broken.status().message(), HasSubstr(file.path()));
  EXPECT_EQ(ids.Reload().value(), false);  // said once
  EXPECT_EQ(ids.reloads(false), 1u);
  EXPECT_TRUE(ids.IdentifyToken(kTokenA).authenticated);
  // A tenant may not claim the operator's token (it would become a worker's).
  file.Write(absl::StrCat(R"({"tenants": [{"name": "x", "tokens": ["operator-token-0123"]}]})"));
  BearerTokens long_operator;
  long_operator.Add("operator-token-0123");
  absl::StatusOr<std::unique_ptr<Identities>> clash =
      Identities::Create(std::move(long_operator), file.path());
  ASSERT_FALSE(clash.ok());
  EXPECT_THAT(clash.status().message(), HasSubstr("operator's tokens"));
}

TEST(IdentitiesTest, AMissingFileListsNoTenantUntilItAppears) {
  TenantsFile file;  // not written yet: an optional Kubernetes Secret that is not there
  absl::StatusOr<std::unique_ptr<Identities>> created =
      Identities::Create(OperatorTokens(), file.path());
  ASSERT_TRUE(created.ok()) << created.status();
  Identities& ids = **created;
  EXPECT_FALSE(ids.IdentifyToken(kTokenA).authenticated);
  EXPECT_TRUE(ids.IdentifyToken(kOperatorToken).authenticated);  // and never everybody
  EXPECT_FALSE(ids.IdentifyToken("").authenticated);
  file.Write(TwoTenants());
  EXPECT_EQ(ids.Reload().value(), true);
  EXPECT_TRUE(ids.IdentifyToken(kTokenA).authenticated);
  // Deleted again: its tokens go with it.
  std::remove(file.path().c_str());
  EXPECT_EQ(ids.Reload().value(), true);
  EXPECT_FALSE(ids.IdentifyToken(kTokenA).authenticated);
}

}  // namespace
}  // namespace offload
