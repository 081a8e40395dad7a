// Tenants through both faces of the job API, over a real controller: the gRPC JobService and the
// REST gateway must refuse exactly the same things, and neither may tell one tenant anything about
// another's jobs.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/security/security.h"
#include "base/testing/test_util.h"
#include "base/testing/tls_test_util.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "offload/v1/job.grpc.pb.h"
#include "services/job_controller/grpc_services.h"
#include "services/job_controller/job_controller.h"
#include "services/job_controller/job_store.h"
#include "services/job_controller/rest_gateway.h"
#include "services/job_controller/tenancy/identities.h"

namespace offload {
namespace {

using ::testing::HasSubstr;

constexpr char kOperatorToken[] = "operator-token";
constexpr char kTokenA[] = "token-of-team-a-0123456789";
constexpr char kTokenB[] = "token-of-team-b-0123456789";
constexpr char kTokenOps[] = "token-of-ops-0123456789";

std::string Tenants(bool with_b) {
  std::string b =
      with_b ? absl::StrCat(R"({"name": "team-b", "tokens": [")", kTokenB, R"("]},)") : "";
  return absl::StrCat(R"({"tenants": [{"name": "team-a", "tokens": [")", kTokenA, R"("]},)", b,
                      R"({"name": "ops", "admin": true, "tokens": [")", kTokenOps, R"("]}]})");
}

// What either face answered: the canonical code and message, and the job when there is one.
struct Answer {
  absl::StatusCode code = absl::StatusCode::kUnknown;
  std::string message;
  std::string body;  // the JSON of the reply (REST) or its JSON mapping (gRPC)
};

std::string ToJson(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  EXPECT_TRUE(google::protobuf::util::MessageToJsonString(message, &json, options).ok());
  return json;
}

class TenantIsolationTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    const char* dir = std::getenv("TEST_TMPDIR");
    const std::string base = std::string(dir != nullptr ? dir : "/tmp") + "/tenant_isolation_" +
                             std::to_string(getpid());
    db_path_ = base + ".db";
    tenants_path_ = base + ".json";
    for (const char* suffix : {"", "-wal", "-shm"}) std::remove((db_path_ + suffix).c_str());
    WriteTenants(true);
    BearerTokens operator_tokens;
    operator_tokens.Add(kOperatorToken);
    identities_ = *Identities::Create(operator_tokens, tenants_path_);
    store_ = *JobStore::Open(db_path_);
    JobControllerOptions options;
    options.store = store_.get();
    options.identities = identities_.get();
    controller_ = *JobController::Create(options);

    job_service_ = std::make_unique<JobServiceImpl>(controller_.get(), identities_.get());
    worker_service_ = std::make_unique<WorkerServiceImpl>(controller_.get(), &operator_tokens_);
    operator_tokens_.Add(kOperatorToken);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(job_service_.get());
    builder.RegisterService(worker_service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    channel_ =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel_);
    workers_ = v1::WorkerService::NewStub(channel_);

    RestOptions rest;
    rest.host = "127.0.0.1";
    auto gateway = RestGateway::Start(controller_.get(), identities_.get(), rest);
    ASSERT_TRUE(gateway.ok()) << gateway.status();
    gateway_ = *std::move(gateway);
  }

  void TearDown() override {
    gateway_.reset();
    if (server_ != nullptr) server_->Shutdown();
    controller_.reset();
    store_.reset();
    for (const char* suffix : {"", "-wal", "-shm"}) std::remove((db_path_ + suffix).c_str());
    std::remove(tenants_path_.c_str());
  }

  void WriteTenants(bool with_b) {
    const std::string tmp = tenants_path_ + ".tmp";
    std::ofstream(tmp) << Tenants(with_b);
    std::rename(tmp.c_str(), tenants_path_.c_str());
  }

  bool rest() const { return GetParam(); }

  // One call of the job API through the face under test. `verb`: submit, get, list, events,
  // cancel, pause, resume, checkpoint, audit. `arg`: the spec JSON (submit) or the job id.
  Answer Call(const std::string& token, const std::string& verb, const std::string& arg = "") {
    return rest() ? Rest(token, verb, arg) : Grpc(token, verb, arg);
  }

  Answer Rest(const std::string& token, const std::string& verb, const std::string& arg) {
    httplib::Client client("127.0.0.1", gateway_->port());
    if (!token.empty()) client.set_bearer_token_auth(token);
    httplib::Result res = [&] {
      if (verb == "submit") return client.Post("/v1/jobs", arg, "application/json");
      if (verb == "get") return client.Get(absl::StrCat("/v1/jobs/", arg));
      if (verb == "list") return client.Get("/v1/jobs");
      if (verb == "events") return client.Get(absl::StrCat("/v1/jobs/", arg, "/events"));
      if (verb == "audit") return client.Get("/v1/audit?page_size=1000");
      return client.Post(absl::StrCat("/v1/jobs/", arg, ":", verb), "{}", "application/json");
    }();
    Answer answer;
    if (!res) {
      ADD_FAILURE() << "no REST answer to " << verb;
      return answer;
    }
    answer.body = res->body;
    if (res->status == 200) {
      answer.code = absl::StatusCode::kOk;
      return answer;
    }
    google::protobuf::Struct error;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(res->body, &error).ok()) << res->body;
    answer.code = static_cast<absl::StatusCode>(error.fields().at("code").number_value());
    answer.message = error.fields().at("message").string_value();
    EXPECT_EQ(res->status, HttpStatusFor(answer.code));
    return answer;
  }

  Answer Grpc(const std::string& token, const std::string& verb, const std::string& arg) {
    grpc::ClientContext context;
    AttachBearer(&context, token);
    grpc::Status status;
    std::string body;
    auto keep = [&body](const google::protobuf::Message& m) { body = ToJson(m); };
    if (verb == "submit") {
      v1::SubmitJobRequest request;
      EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(arg, request.mutable_spec()).ok());
      v1::Job job;
      status = jobs_->SubmitJob(&context, request, &job);
      keep(job);
    } else if (verb == "get") {
      v1::GetJobRequest request;
      request.set_id(arg);
      v1::Job job;
      status = jobs_->GetJob(&context, request, &job);
      keep(job);
    } else if (verb == "list") {
      v1::ListJobsResponse response;
      status = jobs_->ListJobs(&context, v1::ListJobsRequest(), &response);
      keep(response);
    } else if (verb == "events") {
      v1::ListJobEventsRequest request;
      request.set_id(arg);
      v1::ListJobEventsResponse response;
      status = jobs_->ListJobEvents(&context, request, &response);
      keep(response);
    } else if (verb == "audit") {
      v1::ListAuditRequest request;
      request.set_page_size(1000);
      v1::ListAuditResponse response;
      status = jobs_->ListAudit(&context, request, &response);
      keep(response);
    } else {
      v1::JobActionRequest request;
      request.set_id(arg);
      v1::Job job;
      if (verb == "cancel") status = jobs_->CancelJob(&context, request, &job);
      if (verb == "pause") status = jobs_->PauseJob(&context, request, &job);
      if (verb == "resume") status = jobs_->ResumeJob(&context, request, &job);
      if (verb == "checkpoint") status = jobs_->CheckpointJob(&context, request, &job);
      keep(job);
    }
    Answer answer;
    answer.code = static_cast<absl::StatusCode>(status.error_code());
    answer.message = status.error_message();
    if (status.ok()) answer.body = body;
    return answer;
  }

  std::string Submit(const std::string& token, const std::string& extra = "") {
    Answer answer = Call(token, "submit",
                         absl::StrCat(R"({"name": "x", "data": {"path": "/data/tiny.txt"},)",
                                      R"( "checkpoint": {"dir": "/ckpt"})", extra, "}"));
    EXPECT_EQ(answer.code, absl::StatusCode::kOk) << answer.message;
    v1::Job job;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(answer.body, &job).ok());
    return job.id();
  }

  v1::Job AsOperator(const std::string& id) {
    v1::GetJobRequest request;
    request.set_id(id);
    return *controller_->GetJob(Caller::Operator(), request);
  }

  std::vector<v1::AuditRecord> AuditLog() {
    v1::ListAuditRequest request;
    request.set_page_size(1000);
    absl::StatusOr<v1::ListAuditResponse> response =
        controller_->ListAudit(Caller::Operator(), request);
    EXPECT_TRUE(response.ok()) << response.status();
    return {response->records().begin(), response->records().end()};
  }

  std::string db_path_, tenants_path_;
  BearerTokens operator_tokens_;
  std::unique_ptr<Identities> identities_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<JobController> controller_;
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<WorkerServiceImpl> worker_service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::WorkerService::Stub> workers_;
  std::unique_ptr<RestGateway> gateway_;
};

TEST_P(TenantIsolationTest, AnotherTenantsJobIsNotFoundAndUnchanged) {
  const std::string b_job = Submit(kTokenB);
  const std::string a_job = Submit(kTokenA);
  ASSERT_EQ(AsOperator(b_job).tenant(), "team-b");
  ASSERT_EQ(AsOperator(a_job).tenant(), "team-a");
  const std::string b_before = AsOperator(b_job).SerializeAsString();
  const size_t audit_before = AuditLog().size();
  // What a job that does not exist gets, with its id put in: B's job must get exactly that.
  const std::string missing = "job-999";
  for (const std::string verb : {"get", "events", "cancel", "pause", "resume", "checkpoint"}) {
    const Answer nobody = Call(kTokenA, verb, missing);
    const Answer theirs = Call(kTokenA, verb, b_job);
    EXPECT_EQ(theirs.code, absl::StatusCode::kNotFound) << verb << ": " << theirs.message;
    EXPECT_EQ(theirs.code, nobody.code) << verb;
    std::string expected = nobody.message;
    expected.replace(expected.find(missing), missing.size(), b_job);
    EXPECT_EQ(theirs.message, expected) << verb;
    EXPECT_THAT(theirs.body, ::testing::Not(HasSubstr("team-b"))) << verb;
  }
  EXPECT_EQ(AsOperator(b_job).SerializeAsString(), b_before) << "B's job changed";
  // A's list holds A's job only; the admin's holds both.
  const Answer a_list = Call(kTokenA, "list");
  EXPECT_THAT(a_list.body, HasSubstr(a_job));
  EXPECT_THAT(a_list.body, ::testing::Not(HasSubstr(b_job)));
  const Answer ops_list = Call(kTokenOps, "list");
  EXPECT_THAT(ops_list.body, HasSubstr(a_job));
  EXPECT_THAT(ops_list.body, HasSubstr(b_job));
  // The admin acts on B's job; B still sees it.
  EXPECT_EQ(Call(kTokenOps, "pause", b_job).code, absl::StatusCode::kOk);
  EXPECT_EQ(AsOperator(b_job).state(), v1::JOB_STATE_PAUSED);
  EXPECT_EQ(Call(kTokenB, "resume", b_job).code, absl::StatusCode::kOk);
  // Every refused attempt on B's job was written down: who, what, which job, the outcome.
  std::vector<v1::AuditRecord> log = AuditLog();
  int refused = 0;
  for (size_t i = audit_before; i < log.size(); ++i) {
    const v1::AuditRecord& r = log[i];
    if (r.tenant() == "team-a" && r.job_id() == b_job) {
      EXPECT_EQ(r.code(), "NOT_FOUND") << r.action();
      ++refused;
    }
  }
  EXPECT_EQ(refused, 6);  // get, events and the four actions
  EXPECT_EQ(log.back().tenant(), "team-b");
  EXPECT_EQ(log.back().action(), "resume");
  EXPECT_EQ(log.back().code(), "OK");
  EXPECT_EQ(log[log.size() - 2].tenant(), "ops");
  EXPECT_TRUE(log[log.size() - 2].admin());
}

TEST_P(TenantIsolationTest, NoSubmittingForAnotherTenantAndBadSpecsChangeNothing) {
  const Answer other =
      Call(kTokenA, "submit", R"({"name": "x", "data": {"path": "/d.txt"}, "tenant": "team-b"})");
  EXPECT_EQ(other.code, absl::StatusCode::kPermissionDenied) << other.message;
  EXPECT_THAT(other.message, HasSubstr("tenant"));
  const struct {
    std::string extra;
    std::string says;
  } bad[] = {
      {R"(, "tenant": "nobody")", "unknown tenant 'nobody'"},
      {R"(, "tenant": "Team B")", "tenant"},
      {R"(, "priority": 1001)", "priority: must be in [0, 1000]"},
      {R"(, "priority": -1)", "priority"},
  };
  for (const auto& c : bad) {
    const Answer answer =
        Call(kTokenOps, "submit",
             absl::StrCat(R"({"name": "x", "data": {"path": "/d.txt"})", c.extra, "}"));
    EXPECT_EQ(answer.code, absl::StatusCode::kInvalidArgument) << c.extra;
    EXPECT_THAT(answer.message, HasSubstr(c.says)) << c.extra;
  }
  EXPECT_THAT(Call(kTokenOps, "list").body, ::testing::Not(HasSubstr("job-")));
  // An admin may submit in a tenant's name; the job is that tenant's.
  const std::string for_b = Submit(kTokenOps, R"(, "tenant": "team-b", "priority": 1000)");
  EXPECT_EQ(AsOperator(for_b).tenant(), "team-b");
  EXPECT_EQ(Call(kTokenB, "get", for_b).code, absl::StatusCode::kOk);
  // No token, or an unknown one: refused, and recorded without a tenant.
  EXPECT_EQ(Call("", "list").code, absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Call("not-a-token-at-all", "cancel", for_b).code, absl::StatusCode::kUnauthenticated);
  const std::vector<v1::AuditRecord> log = AuditLog();
  ASSERT_GE(log.size(), 8u);
  EXPECT_EQ(log.back().tenant(), "");
  EXPECT_EQ(log.back().action(), "cancel");
  EXPECT_EQ(log.back().code(), "UNAUTHENTICATED");
  EXPECT_EQ(log.front().action(), "submit");
  EXPECT_EQ(log.front().code(), "PERMISSION_DENIED");
  // Only admins read the audit log.
  EXPECT_EQ(Call(kTokenA, "audit").code, absl::StatusCode::kPermissionDenied);
  const Answer audit = Call(kTokenOps, "audit");
  EXPECT_EQ(audit.code, absl::StatusCode::kOk);
  EXPECT_THAT(audit.body, HasSubstr("PERMISSION_DENIED"));
}

TEST_P(TenantIsolationTest, ARevokedTokenIsRefusedAfterOneReload) {
  const std::string b_job = Submit(kTokenB);
  WriteTenants(false);
  ASSERT_TRUE(identities_->Reload().value());
  for (const std::string verb : {"get", "cancel"}) {
    EXPECT_EQ(Call(kTokenB, verb, b_job).code, absl::StatusCode::kUnauthenticated) << verb;
  }
  EXPECT_EQ(AsOperator(b_job).state(), v1::JOB_STATE_PENDING);
  // The pool's workers never take a tenant's token.
  grpc::ClientContext context;
  AttachBearer(&context, kTokenA);
  v1::RegisterWorkerRequest request;
  request.mutable_worker()->set_kind(v1::WORKER_KIND_TRAINER);
  v1::RegisterWorkerResponse response;
  EXPECT_EQ(workers_->RegisterWorker(&context, request, &response).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

// Under mutual TLS a client certificate names its tenant when the call carries no token.
TEST(TenantCertificateTest, AVerifiedClientCertificateActsAsItsTenant) {
  TempDir dir;
  const Pem server = MakeSelfSigned("server.test");
  const Pem bot = MakeSelfSigned("ci-bot");
  const Pem stranger = MakeSelfSigned("stranger");
  TlsConfig tls;
  tls.cert_file = dir.Write("server.crt", server.cert);
  tls.key_file = dir.Write("server.key", server.key);
  // Both client certificates verify (each is its own root); only one is a tenant's.
  tls.ca_file = dir.Write("clients.crt", bot.cert + stranger.cert);
  tls.require_client_cert = true;
  TenantTable table;
  v1::TenantConfig& a = table.tenants.emplace_back();
  a.set_name("team-a");
  a.add_certificate_names("ci-bot");
  BearerTokens operator_tokens;
  operator_tokens.Add(kOperatorToken);
  std::unique_ptr<Identities> identities = Identities::WithTable(operator_tokens, table);
  const std::string db = dir.path() + "/jobs.db";
  std::unique_ptr<JobStore> store = *JobStore::Open(db);
  JobControllerOptions options;
  options.store = store.get();
  options.identities = identities.get();
  std::unique_ptr<JobController> controller = *JobController::Create(options);
  v1::SubmitJobRequest submit;
  submit.mutable_spec()->mutable_data()->set_path("/data/tiny.txt");
  const std::string a_job = controller->SubmitJob(Caller::Tenant("team-a"), submit)->id();
  const std::string op_job = controller->SubmitJob(Caller::Operator(), submit)->id();

  JobServiceImpl service(controller.get(), identities.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", *MakeServerCredentials(tls), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> grpc_server = builder.BuildAndStart();
  ASSERT_NE(grpc_server, nullptr);
  RestOptions rest;
  rest.host = "127.0.0.1";
  rest.tls = tls;
  std::unique_ptr<RestGateway> gateway =
      *RestGateway::Start(controller.get(), identities.get(), rest);

  auto grpc_list = [&](const Pem& client, const std::string& token) {
    TlsConfig client_tls;
    client_tls.ca_file = dir.Write("server-ca.crt", server.cert);
    client_tls.cert_file = dir.Write("client.crt", client.cert);
    client_tls.key_file = dir.Write("client.key", client.key);
    client_tls.server_name_override = "server.test";
    auto stub = v1::JobService::NewStub(*MakeChannel(absl::StrCat("127.0.0.1:", port), client_tls));
    grpc::ClientContext context;
    AttachBearer(&context, token);
    v1::ListJobsResponse response;
    const grpc::Status status = stub->ListJobs(&context, v1::ListJobsRequest(), &response);
    return std::make_pair(status.error_code(), ToJson(response));
  };
  auto rest_list = [&](const Pem& client, const std::string& token) {
    const std::string cert = dir.Write("rest-client.crt", client.cert);
    const std::string key = dir.Write("rest-client.key", client.key);
    httplib::SSLClient http("127.0.0.1", gateway->port(), cert, key);
    http.enable_server_certificate_verification(false);  // the server's check is under test
    if (!token.empty()) http.set_bearer_token_auth(token);
    httplib::Result res = http.Get("/v1/jobs");
    EXPECT_TRUE(res) << httplib::to_string(res.error());
    return res ? std::make_pair(res->status, res->body) : std::make_pair(0, std::string());
  };

  // The bot's certificate is team-a: its jobs and no other.
  auto [code, body] = grpc_list(bot, "");
  EXPECT_EQ(code, grpc::StatusCode::OK);
  EXPECT_THAT(body, HasSubstr(a_job));
  EXPECT_THAT(body, ::testing::Not(HasSubstr(op_job)));
  auto [status, json] = rest_list(bot, "");
  EXPECT_EQ(status, 200);
  EXPECT_THAT(json, HasSubstr(a_job));
  EXPECT_THAT(json, ::testing::Not(HasSubstr(op_job)));
  // A certificate no tenant lists is no identity, though TLS accepted it.
  EXPECT_EQ(grpc_list(stranger, "").first, grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(rest_list(stranger, "").first, 401);
  // A token says who calls, whatever the certificate: the operator's sees every job, and a wrong
  // token is refused rather than read past to the certificate.
  EXPECT_THAT(grpc_list(bot, kOperatorToken).second, HasSubstr(op_job));
  EXPECT_THAT(rest_list(bot, kOperatorToken).second, HasSubstr(op_job));
  EXPECT_EQ(grpc_list(bot, "wrong-token").first, grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(rest_list(bot, "wrong-token").first, 401);
  gateway.reset();
  grpc_server->Shutdown();
}

INSTANTIATE_TEST_SUITE_P(RestAndGrpc, TenantIsolationTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Rest" : "Grpc";
                         });

}  // namespace
}  // namespace offload
