// Bearer tokens, CheckBearer in a real server, TLS credentials and the security flags.
#include "base/security/security.h"

#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/testing/test_util.h"
#include "base/testing/tls_test_util.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"

ABSL_DECLARE_FLAG(std::string, token_file);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, tls_client_auth);
ABSL_DECLARE_FLAG(bool, allow_unauthenticated);

namespace offload {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// ---------------------------------------------------------------------------------------------
// Bearer tokens.

TEST(BearerTokensTest, FileSkipsCommentsAndBlankLines) {
  TempDir dir;
  const std::string file =
      dir.Write("tokens", "# operators\n\n  alpha-token  \n\t\n# old: gamma\nbeta-token\r\n");
  absl::StatusOr<BearerTokens> tokens = BearerTokens::FromFile(file);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(tokens->first_token(), "alpha-token");
  EXPECT_TRUE(tokens->Accepts("Bearer alpha-token"));
  EXPECT_TRUE(tokens->Accepts("Bearer beta-token"));
  EXPECT_FALSE(tokens->Accepts("Bearer gamma"));
  EXPECT_FALSE(tokens->Accepts("Bearer # operators"));
}

TEST(BearerTokensTest, MissingFileIsNotFoundAndNamesIt) {
  absl::StatusOr<BearerTokens> tokens = BearerTokens::FromFile("/nonexistent/tokens.txt");
  EXPECT_EQ(tokens.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tokens.status().message(), HasSubstr("/nonexistent/tokens.txt"));
}

TEST(BearerTokensTest, FileWithoutTokensIsInvalid) {
  TempDir dir;
  for (const std::string& contents : {std::string(""), std::string("# only a comment\n\n  \n")}) {
    const std::string file = dir.Write("tokens", contents);
    absl::StatusOr<BearerTokens> tokens = BearerTokens::FromFile(file);
    EXPECT_EQ(tokens.status().code(), absl::StatusCode::kInvalidArgument) << contents;
    EXPECT_THAT(tokens.status().message(), HasSubstr(file));
  }
}

TEST(BearerTokensTest, AcceptsOnlyTheBearerSchemeWithAKnownToken) {
  BearerTokens tokens;
  tokens.Add("s3cret");
  tokens.Add("other");
  tokens.Add("");  // ignored: an empty token must not count
  EXPECT_TRUE(tokens.Accepts("Bearer s3cret"));
  EXPECT_TRUE(tokens.Accepts("bearer s3cret"));  // the scheme is case-insensitive
  EXPECT_TRUE(tokens.Accepts("BEARER other"));
  EXPECT_FALSE(tokens.Accepts("Bearer s3cre"));    // a prefix
  EXPECT_FALSE(tokens.Accepts("Bearer s3cret2"));  // an extension
  EXPECT_FALSE(tokens.Accepts("Bearer S3CRET"));   // tokens are case-sensitive
  EXPECT_FALSE(tokens.Accepts("Basic s3cret"));    // wrong scheme
  EXPECT_FALSE(tokens.Accepts("s3cret"));          // no scheme
  EXPECT_FALSE(tokens.Accepts("Bearers3cret"));    // no separator
  EXPECT_FALSE(tokens.Accepts("Bearer "));         // empty token
  EXPECT_FALSE(tokens.Accepts("Bearer"));
  EXPECT_FALSE(tokens.Accepts(""));
}

TEST(SecretsTest, RandomTokensAreFreshHex) {
  absl::StatusOr<std::string> a = RandomToken();
  absl::StatusOr<std::string> b = RandomToken();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), 32u);
  EXPECT_EQ(a->find_first_not_of("0123456789abcdef"), std::string::npos) << *a;
  EXPECT_NE(*a, *b);
  absl::StatusOr<std::string> key = RandomKey();
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(key->size(), 32u);
}

// HMAC-SHA256 as RFC 4231 defines it (its test case 2), so a secret is what any HMAC computes.
TEST(SecretsTest, DeriveSecretIsHmacSha256) {
  EXPECT_EQ(DeriveSecret("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(DeriveSecret("key", "job-1.1"), DeriveSecret("key", "job-1.1"));
  EXPECT_NE(DeriveSecret("key", "job-1.1"), DeriveSecret("key", "job-1.2"));
  EXPECT_NE(DeriveSecret("key", "job-1.1"), DeriveSecret("other key", "job-1.1"));
}

TEST(SecretsTest, ConstantTimeEqualsIsEquality) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "ab"));
  EXPECT_FALSE(ConstantTimeEquals("ab", "abc"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0", 2), "a"));
}

TEST(BearerTokensTest, EmptySetIsEmpty) {
  BearerTokens tokens;
  tokens.Add("");
  EXPECT_TRUE(tokens.empty());
  EXPECT_EQ(tokens.first_token(), "");
  EXPECT_FALSE(tokens.Accepts("Bearer x"));
}

// CheckBearer in a real server: the health service refuses calls without the token.
class GuardedHealth final : public grpc::health::v1::Health::Service {
 public:
  explicit GuardedHealth(BearerTokens tokens) : tokens_(std::move(tokens)) {}
  grpc::Status Check(grpc::ServerContext* context, const grpc::health::v1::HealthCheckRequest*,
                     grpc::health::v1::HealthCheckResponse* response) override {
    if (grpc::Status s = CheckBearer(tokens_, *context); !s.ok()) return s;
    response->set_status(grpc::health::v1::HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }

 private:
  BearerTokens tokens_;
};

grpc::Status CallHealth(grpc::Server* server, const std::string& token) {
  grpc::ChannelArguments args;
  auto stub = grpc::health::v1::Health::NewStub(server->InProcessChannel(args));
  grpc::ClientContext context;
  AttachBearer(&context, token);
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  return stub->Check(&context, request, &response);
}

TEST(CheckBearerTest, RefusesMissingAndWrongTokensWithoutDetail) {
  BearerTokens tokens;
  tokens.Add("right");
  GuardedHealth service(tokens);
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  EXPECT_TRUE(CallHealth(server.get(), "right").ok());
  for (const std::string& token : {std::string(""), std::string("wrong")}) {
    grpc::Status status = CallHealth(server.get(), token);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
    EXPECT_EQ(status.error_message(), "missing or invalid bearer token");
  }
  server->Shutdown();
}

TEST(CheckBearerTest, NoTokensMeansNoAuthentication) {
  GuardedHealth service{BearerTokens()};
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(CallHealth(server.get(), "").ok());
  server->Shutdown();
}

// ---------------------------------------------------------------------------------------------
// TLS credentials.

TEST(CredentialsTest, InsecureWithoutFiles) {
  TlsConfig tls;
  EXPECT_TRUE(MakeServerCredentials(tls).ok());
  EXPECT_TRUE(MakeChannelCredentials(tls).ok());
}

TEST(CredentialsTest, MissingFilesAreNamed) {
  TlsConfig tls;
  tls.cert_file = "/nonexistent/server.crt";
  tls.key_file = "/nonexistent/server.key";
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server = MakeServerCredentials(tls);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(server.status().message(), HasSubstr("/nonexistent/server.crt"));

  TlsConfig client;
  client.ca_file = "/nonexistent/ca.crt";
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> channel =
      MakeChannelCredentials(client);
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(channel.status().message(), HasSubstr("/nonexistent/ca.crt"));
}

TEST(CredentialsTest, ValidPairWorksAndBadFilesAreRefusedByName) {
  TempDir dir;
  const Pem server = MakeSelfSigned("server.test");
  const Pem other = MakeSelfSigned("other.test");
  const std::string cert = dir.Write("server.crt", server.cert);
  const std::string key = dir.Write("server.key", server.key);
  const std::string other_key = dir.Write("other.key", other.key);
  const std::string garbage = dir.Write("garbage.pem", "not a certificate\n");

  TlsConfig tls;
  tls.cert_file = cert;
  tls.key_file = key;
  EXPECT_TRUE(MakeServerCredentials(tls).ok());
  tls.ca_file = cert;
  tls.require_client_cert = true;
  EXPECT_TRUE(MakeServerCredentials(tls).ok());
  EXPECT_TRUE(MakeChannelCredentials(tls).ok());  // with a client certificate
  tls.server_name_override = "server.test";
  // One argument more than a default ChannelArguments (which carries the user agent).
  EXPECT_EQ(ChannelArgumentsFor(tls).c_channel_args().num_args,
            grpc::ChannelArguments().c_channel_args().num_args + 1);

  TlsConfig mismatched = tls;
  mismatched.key_file = other_key;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> s = MakeServerCredentials(mismatched);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), AllOf(HasSubstr(other_key), HasSubstr(cert)));

  TlsConfig bad_cert = tls;
  bad_cert.cert_file = garbage;
  s = MakeServerCredentials(bad_cert);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr(garbage));

  TlsConfig bad_key = tls;
  bad_key.key_file = garbage;
  s = MakeServerCredentials(bad_key);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr(garbage));
  // A key file's contents never end up in a message.
  EXPECT_THAT(MakeServerCredentials(mismatched).status().message(), Not(HasSubstr("PRIVATE KEY")));

  TlsConfig bad_ca;
  bad_ca.ca_file = garbage;
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> c = MakeChannelCredentials(bad_ca);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr(garbage));
}

TEST(CredentialsTest, InconsistentServerSettingsAreRefused) {
  TempDir dir;
  const Pem server = MakeSelfSigned("server.test");
  TlsConfig key_only;
  key_only.key_file = dir.Write("server.key", server.key);
  EXPECT_EQ(MakeServerCredentials(key_only).status().code(), absl::StatusCode::kInvalidArgument);

  TlsConfig mtls_without_ca;
  mtls_without_ca.cert_file = dir.Write("server.crt", server.cert);
  mtls_without_ca.key_file = key_only.key_file;
  mtls_without_ca.require_client_cert = true;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> s =
      MakeServerCredentials(mtls_without_ca);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("CA"));

  TlsConfig cert_without_key;
  cert_without_key.cert_file = mtls_without_ca.cert_file;
  EXPECT_EQ(MakeServerCredentials(cert_without_key).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Security flags.

class SecurityFlagsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("OFFLOAD_TOKEN");
    unsetenv(kShardTokenEnv);
  }
  void TearDown() override {
    unsetenv("OFFLOAD_TOKEN");
    unsetenv(kShardTokenEnv);
  }
  absl::FlagSaver saver_;
};

TEST_F(SecurityFlagsTest, RefusesToRunWithoutTokensUnlessAllowed) {
  absl::StatusOr<SecurityOptions> options = SecurityFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  absl::Status required = RequireTokens(*options);
  EXPECT_EQ(required.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(required.message(), HasSubstr("--allow_unauthenticated"));
  absl::SetFlag(&FLAGS_allow_unauthenticated, true);
  options = SecurityFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_TRUE(RequireTokens(*options).ok());
  EXPECT_TRUE(options->accepted.empty());
  EXPECT_TRUE(options->allow_unauthenticated);
  EXPECT_THAT(SecurityFlagsForChild(), ElementsAre("--allow_unauthenticated=true"));
}

TEST_F(SecurityFlagsTest, TokensFromFileAndEnvironment) {
  TempDir dir;
  const std::string file = dir.Write("tokens", "from-file\nsecond\n");
  absl::SetFlag(&FLAGS_token_file, file);
  absl::StatusOr<SecurityOptions> options = SecurityFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->client_token, "from-file");
  EXPECT_TRUE(options->accepted.Accepts("Bearer second"));

  setenv("OFFLOAD_TOKEN", "from-env", 1);
  options = SecurityFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->client_token, "from-env");
  EXPECT_TRUE(options->accepted.Accepts("Bearer from-env"));
  EXPECT_TRUE(options->accepted.Accepts("Bearer from-file"));
  // The child gets the file's path; the token itself stays in the environment.
  for (const std::string& arg : SecurityFlagsForChild()) {
    EXPECT_THAT(arg, Not(HasSubstr("from-env")));
  }
}

// A trainer presents its attempt's secret to its shards when its worker gave it one, and its
// controller token otherwise (a standalone run with one token for everything).
TEST_F(SecurityFlagsTest, ShardTokenIsTheAttemptSecretElseTheClientToken) {
  TempDir dir;
  absl::SetFlag(&FLAGS_token_file, dir.Write("tokens", "pool\n"));
  absl::StatusOr<SecurityOptions> options = SecurityFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->shard_token, "pool");
  setenv(kShardTokenEnv, "attempt-secret", 1);
  options = SecurityFromFlags();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->shard_token, "attempt-secret");
  EXPECT_EQ(options->client_token, "pool");
  EXPECT_FALSE(options->accepted.Accepts("Bearer attempt-secret"));  // never a server's token
}

TEST_F(SecurityFlagsTest, BadFlagsAreNamed) {
  absl::SetFlag(&FLAGS_token_file, "/nonexistent/tokens");
  absl::StatusOr<SecurityOptions> options = SecurityFromFlags();
  EXPECT_EQ(options.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(options.status().message(), HasSubstr("--token_file"));

  absl::SetFlag(&FLAGS_token_file, "");
  absl::SetFlag(&FLAGS_allow_unauthenticated, true);
  absl::SetFlag(&FLAGS_tls_client_auth, "optional");
  options = SecurityFromFlags();
  EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(options.status().message(), HasSubstr("--tls_client_auth"));

  absl::SetFlag(&FLAGS_tls_client_auth, "none");
  absl::SetFlag(&FLAGS_tls_cert, "/x/server.crt");
  options = SecurityFromFlags();
  EXPECT_THAT(options.status().message(), HasSubstr("--tls_key"));
}

TEST_F(SecurityFlagsTest, ChildGetsTheFlagsThatAreSet) {
  absl::SetFlag(&FLAGS_token_file, "/etc/offload/tokens");
  absl::SetFlag(&FLAGS_tls_ca, "/etc/offload/ca.crt");
  absl::SetFlag(&FLAGS_tls_client_auth, "require");
  EXPECT_THAT(SecurityFlagsForChild(),
              ElementsAre("--token_file=/etc/offload/tokens", "--tls_ca=/etc/offload/ca.crt",
                          "--tls_client_auth=require"));
}

}  // namespace
}  // namespace offload
