#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
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
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "services/common/job_spec.h"
#include "services/common/security.h"

ABSL_DECLARE_FLAG(std::string, token_file);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, tls_client_auth);
ABSL_DECLARE_FLAG(bool, allow_unauthenticated);

namespace offload {
namespace {

using google::protobuf::util::MessageDifferencer;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// A scratch directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "common_test.XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string Write(const std::string& name, const std::string& contents) const {
    const std::string file = path_ + "/" + name;
    std::ofstream(file, std::ios::binary) << contents;
    return file;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

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

// A self-signed P-256 certificate and its key, as PEM.
struct Pem {
  std::string cert;
  std::string key;
};

std::string BioToString(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return std::string(data, n);
}

Pem MakeSelfSigned(const std::string& common_name) {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  X509* cert = X509_new();
  X509_set_version(cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert), 0);
  X509_gmtime_adj(X509_getm_notAfter(cert), 3600);
  X509_set_pubkey(cert, key);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(common_name.c_str()), -1, -1,
                             0);
  X509_set_issuer_name(cert, name);
  X509_sign(cert, key, EVP_sha256());
  Pem pem;
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_X509(bio, cert);
  pem.cert = BioToString(bio);
  BIO_free(bio);
  bio = BIO_new(BIO_s_mem());
  PEM_write_bio_PrivateKey(bio, key, nullptr, nullptr, 0, nullptr, nullptr);
  pem.key = BioToString(bio);
  BIO_free(bio);
  X509_free(cert);
  EVP_PKEY_free(key);
  return pem;
}

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
  void SetUp() override { unsetenv("OFFLOAD_TOKEN"); }
  void TearDown() override { unsetenv("OFFLOAD_TOKEN"); }
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

// ---------------------------------------------------------------------------------------------
// Job files.

constexpr char kYamlSpec[] = R"(
# a comment
name: tiny run
model: {preset: demo, layers: 2}
data:
  path: /data/corpus.txt
  val_fraction: 0.05
  seed: 18446744073709551615
optimizer:
  algorithm: adamw
  lr: 3          # an integer where a float goes
  min_lr: 1e-4
  beta2: 0.95
training:
  steps: 100
  batch: 8
  microBatches: 2   # the JSON name works too
  dtype: bf16
parallel:
  ranks: 2
  dpu: true
  bucket_mb: 0.5
checkpoint:
  dir: /ckpt
  resume: false
max_restarts: 3
)";

constexpr char kJsonSpec[] = R"({
  "name": "tiny run",
  "model": {"preset": "demo", "layers": 2},
  "data": {"path": "/data/corpus.txt", "valFraction": 0.05, "seed": "18446744073709551615"},
  "optimizer": {"algorithm": "adamw", "lr": 3.0, "min_lr": 0.0001, "beta2": 0.95},
  "training": {"steps": "100", "batch": 8, "micro_batches": 2, "dtype": "bf16"},
  "parallel": {"ranks": 2, "dpu": true, "bucketMb": 0.5},
  "checkpoint": {"dir": "/ckpt", "resume": false},
  "maxRestarts": 3
})";

TEST(JobSpecParseTest, YamlAndJsonGiveTheSameSpec) {
  absl::StatusOr<v1::JobSpec> yaml = ParseJobSpec(kYamlSpec);
  ASSERT_TRUE(yaml.ok()) << yaml.status();
  absl::StatusOr<v1::JobSpec> json = ParseJobSpec(kJsonSpec);
  ASSERT_TRUE(json.ok()) << json.status();
  std::string diff;
  MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differencer.Compare(*yaml, *json)) << diff;

  EXPECT_EQ(yaml->name(), "tiny run");
  EXPECT_EQ(yaml->model().layers(), 2);
  EXPECT_EQ(yaml->data().seed(), 18446744073709551615ull);
  EXPECT_FLOAT_EQ(yaml->optimizer().lr(), 3.0f);
  EXPECT_FLOAT_EQ(yaml->optimizer().min_lr(), 1e-4f);
  EXPECT_EQ(yaml->training().micro_batches(), 2);
  EXPECT_TRUE(yaml->parallel().dpu());
  EXPECT_TRUE(yaml->checkpoint().has_resume());  // set, to false
  EXPECT_FALSE(yaml->checkpoint().resume());
  EXPECT_FALSE(yaml->training().has_seq_len());
  EXPECT_EQ(yaml->max_restarts(), 3u);
  EXPECT_TRUE(ValidateJobSpec(*yaml).ok()) << ValidateJobSpec(*yaml);
}

TEST(JobSpecParseTest, PrintedJsonParsesBack) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(kYamlSpec);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const std::string json = JobSpecToJson(*spec);
  EXPECT_THAT(json, HasSubstr("\"micro_batches\""));  // proto names, not JSON names
  absl::StatusOr<v1::JobSpec> back = ParseJobSpec(json);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << json;
  EXPECT_TRUE(MessageDifferencer::Equals(*spec, *back)) << json;
}

TEST(JobSpecParseTest, UnknownFieldNamesItsPathAndTheKnownOnes) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec("training:\n  steps: 3\n  batchh: 4\n");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(),
              AllOf(HasSubstr("training.batchh: unknown field"),
                    HasSubstr("JobSpec.training has: steps, batch, micro_batches")));

  spec = ParseJobSpec(R"({"nmae": "x"})");
  EXPECT_THAT(spec.status().message(),
              AllOf(HasSubstr("nmae: unknown field"), HasSubstr("JobSpec has: name, model")));
}

TEST(JobSpecParseTest, TypeErrorsNameThePathAndTheExpectedType) {
  struct Case {
    const char* text;
    const char* message;
  };
  const Case cases[] = {
      {"training: {batch: x}", "training.batch: expected an integer, got \"x\""},
      {"training: {batch: 1.5}", "training.batch: expected an integer, got \"1.5\""},
      {"training: {batch: 3000000000}", "training.batch: 3000000000 is out of range for int32"},
      {"parallel: {ranks: -1}", "parallel.ranks: -1 is out of range for uint32"},
      {"data: {seed: 18446744073709551616}", "data.seed: 18446744073709551616 is out of range"},
      {"parallel: {dpu: yes}", "parallel.dpu: expected true or false, got \"yes\""},
      {"optimizer: {lr: fast}", "optimizer.lr: expected a number, got \"fast\""},
      {"optimizer: {lr: 1e39}", "optimizer.lr: 1e39 is out of range for float"},
      {"optimizer: {lr: [1, 2]}", "optimizer.lr: expected a number, got a list"},
      {"training: {steps: }", "training.steps: expected an integer, got nothing (null)"},
      {"training: 5", "training: expected a map of fields, got \"5\""},
      {"max_restarts: 1\nmaxRestarts: 2", "max_restarts: given more than once"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(c.text);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(spec.status().message(), HasSubstr(c.message)) << c.text;
  }
}

TEST(JobSpecParseTest, DocumentsThatAreNoMapAreRefused) {
  for (const char* text : {"", "# nothing\n", "- a\n- b\n", "just text", "[1, 2]",
                           "a: 1\n---\nb: 2\n", "{\"name\": ", "name: [unclosed"}) {
    absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(text);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
  EXPECT_THAT(ParseJobSpec("- a\n").status().message(), HasSubstr("expected a map"));
  EXPECT_THAT(ParseJobSpec("name: [unclosed").status().message(), HasSubstr("line 1"));
}

TEST(JobSpecParseTest, NonFiniteFloatsParseAndFailValidation) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec("data: {path: /d}\noptimizer: {lr: .nan}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(std::isnan(spec->optimizer().lr()));
  absl::Status status = ValidateJobSpec(*spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("optimizer.lr: must be a finite number"));

  spec = ParseJobSpec(R"({"data": {"path": "/d", "valFraction": "-Infinity"}})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(ValidateJobSpec(*spec).message(), HasSubstr("data.val_fraction: must be a finite"));
}

TEST(JobSpecFileTest, DemoJobParsesAndValidates) {
  absl::StatusOr<v1::JobSpec> spec =
      ReadJobSpecFile(std::string(OFFLOAD_SOURCE_DIR) + "/services/common/testdata/demo_job.yaml");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().preset(), "demo");
  EXPECT_EQ(spec->data().path(), "/data/tinyshakespeare.txt");
  EXPECT_EQ(spec->training().steps(), 200);
  EXPECT_EQ(spec->training().batch(), 16);
  EXPECT_EQ(spec->parallel().ranks(), 1u);
  EXPECT_EQ(spec->parallel().optimizer_servers(), 1u);
  EXPECT_EQ(spec->checkpoint().dir(), "/tmp/offload-demo");
  EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << ValidateJobSpec(*spec);
}

TEST(JobSpecFileTest, MissingFileAndErrorsNameTheFile) {
  absl::StatusOr<v1::JobSpec> spec = ReadJobSpecFile("/nonexistent/job.yaml");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(spec.status().message(), HasSubstr("/nonexistent/job.yaml"));

  TempDir dir;
  const std::string file = dir.Write("job.yaml", "training: {stepz: 1}\n");
  spec = ReadJobSpecFile(file);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(), HasSubstr(file + ": training.stepz: unknown field"));
}

// ---------------------------------------------------------------------------------------------
// Validation.

v1::JobSpec ValidSpec() {
  v1::JobSpec spec;
  spec.set_name("ok-job_1.0");
  spec.mutable_data()->set_path("/data/corpus.txt");
  return spec;
}

TEST(ValidateJobSpecTest, MinimalSpecIsValidAndDataPathIsRequired) {
  EXPECT_TRUE(ValidateJobSpec(ValidSpec()).ok());
  v1::JobSpec spec;
  absl::Status status = ValidateJobSpec(spec);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("data.path: required"));
}

TEST(ValidateJobSpecTest, MessagesNameTheField) {
  struct Case {
    std::function<void(v1::JobSpec*)> edit;
    const char* message;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Case cases[] = {
      {[](v1::JobSpec* s) { s->mutable_data()->set_path("data/corpus.txt"); },
       "data.path: must be an absolute path"},
      {[nan](v1::JobSpec* s) { s->mutable_optimizer()->set_lr(nan); },
       "optimizer.lr: must be a finite number"},
      {[](v1::JobSpec* s) { s->mutable_optimizer()->set_lr(0); }, "optimizer.lr: must be > 0"},
      {[](v1::JobSpec* s) { s->mutable_optimizer()->set_beta2(1); },
       "optimizer.beta2: must be in [0, 1)"},
      {[](v1::JobSpec* s) { s->mutable_optimizer()->set_eps(0); }, "optimizer.eps: must be > 0"},
      {[](v1::JobSpec* s) { s->mutable_optimizer()->set_weight_decay(-1); },
       "optimizer.weight_decay: must be >= 0"},
      {[](v1::JobSpec* s) { s->mutable_optimizer()->set_algorithm("sgd"); },
       "optimizer.algorithm: must be one of adamw, adam, got \"sgd\""},
      {[](v1::JobSpec* s) { s->mutable_training()->set_steps(0); }, "training.steps: must be >= 1"},
      {[](v1::JobSpec* s) { s->mutable_training()->set_batch(0); }, "training.batch: must be >= 1"},
      {[](v1::JobSpec* s) { s->mutable_training()->set_micro_batches(0); },
       "training.micro_batches: must be >= 1"},
      {[](v1::JobSpec* s) {
         s->mutable_training()->set_batch(10);
         s->mutable_training()->set_micro_batches(2);
         s->mutable_parallel()->set_ranks(3);
       },
       "training.batch: 10 is not divisible by parallel.ranks x training.micro_batches = 3 x 2"},
      {[](v1::JobSpec* s) { s->mutable_training()->set_dtype("fp32"); },
       "training.dtype: must be one of fp16, bf16"},
      {[](v1::JobSpec* s) { s->mutable_training()->set_device("tpu"); },
       "training.device: must be one of cpu, cuda"},
      {[](v1::JobSpec* s) { s->mutable_training()->set_kernels("turbo"); },
       "training.kernels: must be one of fast, naive"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_transport("tcp"); },
       "parallel.transport: must be one of auto, grpc, shm, ucx"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_ranks(0); },
       "parallel.ranks: must be in [1, 1024]"},
      {[](v1::JobSpec* s) { s->mutable_parallel()->set_optimizer_servers(2000); },
       "parallel.optimizer_servers: must be in [1, 1024]"},
      {[](v1::JobSpec* s) { s->mutable_model()->set_preset("gpt3"); },
       "model.preset: must be one of demo, gpt2"},
      {[](v1::JobSpec* s) { s->mutable_model()->set_init_from("weights.safetensors"); },
       "model.init_from: must be an absolute path"},
      {[](v1::JobSpec* s) { s->mutable_checkpoint()->set_dir("ckpt"); },
       "checkpoint.dir: must be an absolute path"},
      {[](v1::JobSpec* s) { s->mutable_checkpoint()->set_keep(-1); },
       "checkpoint.keep: must be >= 0"},
      {[](v1::JobSpec* s) { s->mutable_checkpoint()->set_resume(true); },
       "checkpoint.resume: needs checkpoint.dir"},
      {[](v1::JobSpec* s) { s->mutable_data()->set_val_fraction(1); },
       "data.val_fraction: must be in (0, 1)"},
      {[](v1::JobSpec* s) { s->set_name(std::string(129, 'a')); }, "name: at most 128"},
      {[](v1::JobSpec* s) { s->set_name("a/b"); }, "name: character \"/\" at position 1"},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec = ValidSpec();
    c.edit(&spec);
    absl::Status status = ValidateJobSpec(spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(status.message(), HasSubstr(c.message));
  }
}

// ---------------------------------------------------------------------------------------------
// Flags.

TEST(JobSpecFlagsTest, FlagsInDescriptorOrder) {
  v1::JobSpec spec = ValidSpec();
  spec.mutable_model()->set_preset("demo");
  spec.mutable_optimizer()->set_lr(0.001f);
  spec.mutable_checkpoint()->set_resume(false);
  spec.mutable_parallel()->set_ranks(4);  // the controller's, not a trainer flag
  spec.set_max_restarts(2);
  EXPECT_THAT(JobSpecToFlags(spec), ElementsAre("--model=demo", "--data=/data/corpus.txt",
                                                "--lr=0.001", "--resume=false"));
}

TEST(JobSpecFlagsTest, RoundTripIsExact) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(kYamlSpec);
  ASSERT_TRUE(spec.ok()) << spec.status();
  // Values that need every digit to come back exactly.
  spec->mutable_optimizer()->set_beta1(0.1f + 0.2f);
  spec->mutable_optimizer()->set_eps(1.17549435e-38f);
  spec->mutable_data()->set_val_fraction(0.1 + 0.2);
  spec->mutable_eval()->set_sample_prompt("To be = or not");
  spec->mutable_model()->set_init_from("");
  // Leaves without a flag do not travel; leave them out of the comparison.
  spec->clear_name();
  spec->clear_max_restarts();
  spec->mutable_parallel()->clear_ranks();

  const std::vector<std::string> flags = JobSpecToFlags(*spec);
  absl::StatusOr<v1::JobSpec> back = JobSpecFromFlags(flags);
  ASSERT_TRUE(back.ok()) << back.status();
  std::string diff;
  MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differencer.Compare(*spec, *back)) << diff;
}

TEST(JobSpecFlagsTest, BoolSpellings) {
  absl::StatusOr<v1::JobSpec> spec = JobSpecFromFlags({"--dpu", "--noresume", "-steps=5"});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->parallel().dpu());
  EXPECT_TRUE(spec->checkpoint().has_resume());
  EXPECT_FALSE(spec->checkpoint().resume());
  EXPECT_EQ(spec->training().steps(), 5);
}

TEST(JobSpecFlagsTest, BadFlagsAreRefusedByName) {
  struct Case {
    std::vector<std::string> args;
    const char* message;
  };
  const Case cases[] = {
      {{"--foo=1"}, "unknown trainer flag --foo: not a job spec field"},
      {{"--nolr"}, "unknown trainer flag --nolr"},
      {{"--ranks=2"}, "unknown trainer flag --ranks"},  // a controller field, not a flag
      {{"lr=0.1"}, "unexpected argument \"lr=0.1\""},
      {{"--"}, "unexpected argument \"--\""},
      {{"--lr"}, "--lr: needs a value"},
      {{"--lr=abc"}, "--lr: expected a number, got \"abc\""},
      {{"--batch=1.5"}, "--batch: expected an integer"},
      {{"--dpu=maybe"}, "--dpu: expected true or false"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::JobSpec> spec = JobSpecFromFlags(c.args);
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(spec.status().message(), HasSubstr(c.message));
  }
}

TEST(JobSpecFlagsTest, IsJobSpecFlagAgreesWithJobSpecFromFlags) {
  struct Case {
    const char* arg;
    bool job_spec;
  };
  const Case cases[] = {
      {"--lr=0.1", true},
      {"-steps=5", true},
      {"--dpu", true},
      {"--noresume", true},
      {"--lr", true},
      {"--lr=abc", true},
      {"lr=0.1", true},
      {"--", true},
      {"--foo=1", false},
      {"--nolr", false},
      {"--nodpu=true", false},
      {"--ranks=2", false},
      {"--progress=false", false},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(IsJobSpecFlag(c.arg), c.job_spec) << c.arg;
    // The launcher sends the others to the trainer, so exactly these must be unknown here.
    const absl::StatusOr<v1::JobSpec> spec = JobSpecFromFlags({c.arg});
    EXPECT_EQ(absl::StartsWith(spec.status().message(), "unknown trainer flag"), !c.job_spec)
        << c.arg;
  }
}

}  // namespace
}  // namespace offload
