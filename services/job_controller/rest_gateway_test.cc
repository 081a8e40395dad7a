#include "services/job_controller/rest_gateway.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "httplib.h"

namespace offload {
namespace {

constexpr char kToken[] = "s3cret-token";

// Stores submitted jobs and remembers the last request of each kind, so tests can check what the
// gateway made of the HTTP request.
class FakeJobApi : public JobApi {
 public:
  absl::StatusOr<v1::Job> SubmitJob(const Caller& caller,
                                    const v1::SubmitJobRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    std::lock_guard<std::mutex> lock(mu_);
    if (request.spec().name() == "reject") return absl::InvalidArgumentError("name: rejected");
    v1::Job job;
    job.set_id(absl::StrCat("job-", ++next_id_));
    *job.mutable_spec() = request.spec();
    job.set_state(v1::JOB_STATE_PENDING);
    job.mutable_progress()->set_total_steps(request.spec().training().steps());
    jobs_[job.id()] = job;
    return job;
  }
  absl::StatusOr<v1::Job> GetJob(const Caller& caller, const v1::GetJobRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    std::lock_guard<std::mutex> lock(mu_);
    return Find(request.id());
  }
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const Caller& caller,
                                                const v1::ListJobsRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    std::lock_guard<std::mutex> lock(mu_);
    last_list = request;
    v1::ListJobsResponse response;
    for (const auto& [id, job] : jobs_) *response.add_jobs() = job;
    response.set_next_page_token("next");
    return response;
  }
  absl::StatusOr<v1::Job> CancelJob(const Caller& caller,
                                    const v1::JobActionRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    return Act("cancel", request, v1::JOB_STATE_CANCELLED);
  }
  absl::StatusOr<v1::Job> PauseJob(const Caller& caller,
                                   const v1::JobActionRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    return Act("pause", request, v1::JOB_STATE_PAUSED);
  }
  absl::StatusOr<v1::Job> ResumeJob(const Caller& caller,
                                    const v1::JobActionRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    return Act("resume", request, v1::JOB_STATE_RUNNING);
  }
  absl::StatusOr<v1::Job> CheckpointJob(const Caller& caller,
                                        const v1::JobActionRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    return Act("checkpoint", request, v1::JOB_STATE_CHECKPOINTING);
  }
  absl::StatusOr<v1::ListAuditResponse> ListAudit(const Caller& caller,
                                                  const v1::ListAuditRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    std::lock_guard<std::mutex> lock(mu_);
    last_audit = request;
    return v1::ListAuditResponse();
  }
  absl::StatusOr<v1::ListJobEventsResponse> ListJobEvents(
      const Caller& caller, const v1::ListJobEventsRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    std::lock_guard<std::mutex> lock(mu_);
    last_events = request;
    OFFLOAD_ASSIGN_OR_RETURN(v1::Job job, Find(request.id()));
    v1::ListJobEventsResponse response;
    v1::JobEvent* event = response.add_events();
    event->set_sequence(request.after_sequence() + 1);
    event->set_job_id(request.id());
    event->set_state(job.state());
    event->set_message("submitted");
    return response;
  }

  std::string last_action;
  v1::JobActionRequest last_action_request;
  v1::ListJobsRequest last_list;
  v1::ListJobEventsRequest last_events;
  v1::ListAuditRequest last_audit;

 private:
  static absl::Status Unauthenticated() {
    return absl::UnauthenticatedError("missing or invalid bearer token");
  }
  absl::StatusOr<v1::Job> Find(const std::string& id) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
    return it->second;
  }
  absl::StatusOr<v1::Job> Act(std::string verb, const v1::JobActionRequest& request,
                              v1::JobState state) {
    std::lock_guard<std::mutex> lock(mu_);
    last_action = std::move(verb);
    last_action_request = request;
    auto it = jobs_.find(request.id());
    if (it == jobs_.end()) {
      return absl::NotFoundError(absl::StrCat("job '", request.id(), "' not found"));
    }
    if (it->second.state() == v1::JOB_STATE_CANCELLED) {
      return absl::FailedPreconditionError("job is cancelled");
    }
    it->second.set_state(state);
    it->second.set_reason(request.reason());
    return it->second;
  }

  std::mutex mu_;
  int next_id_ = 0;
  std::map<std::string, v1::Job> jobs_;
};

template <typename M>
M Parse(const std::string& json) {
  M message;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &message);
  EXPECT_TRUE(status.ok()) << status.ToString() << " in " << json;
  return message;
}

struct ErrorBody {
  int code = -1;
  std::string status;
  std::string message;
};

ErrorBody ParseError(const std::string& json) {
  const auto body = Parse<google::protobuf::Struct>(json);
  ErrorBody error;
  const auto& fields = body.fields();
  EXPECT_EQ(fields.size(), 3u) << json;
  if (fields.count("code")) error.code = static_cast<int>(fields.at("code").number_value());
  if (fields.count("status")) error.status = fields.at("status").string_value();
  if (fields.count("message")) error.message = fields.at("message").string_value();
  return error;
}

class RestGatewayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BearerTokens tokens;
    tokens.Add(kToken);
    identities_ = Identities::WithTable(std::move(tokens), TenantTable());
    RestOptions options;
    options.host = "127.0.0.1";
    options.max_body_bytes = 4096;
    auto gateway = RestGateway::Start(&api_, identities_.get(), options);
    ASSERT_TRUE(gateway.ok()) << gateway.status();
    gateway_ = *std::move(gateway);
    ASSERT_GT(gateway_->port(), 0);
  }

  // A client that sends the right token.
  std::unique_ptr<httplib::Client> Client(const std::string& token = kToken) {
    auto client = std::make_unique<httplib::Client>("127.0.0.1", gateway_->port());
    if (!token.empty()) client->set_bearer_token_auth(token);
    return client;
  }

  v1::Job SubmitOk(const std::string& spec_json) {
    auto res = Client()->Post("/v1/jobs", spec_json, "application/json");
    EXPECT_TRUE(res);
    if (!res) return {};
    EXPECT_EQ(res->status, 200) << res->body;
    EXPECT_EQ(res->get_header_value("Content-Type"), "application/json");
    return Parse<v1::Job>(res->body);
  }

  FakeJobApi api_;
  std::unique_ptr<Identities> identities_;
  std::unique_ptr<RestGateway> gateway_;
};

TEST_F(RestGatewayTest, SubmitGetAndList) {
  const v1::Job submitted =
      SubmitOk(R"({"name": "demo", "training": {"steps": 10}, "parallel": {"ranks": 2}})");
  EXPECT_EQ(submitted.id(), "job-1");
  EXPECT_EQ(submitted.spec().name(), "demo");
  EXPECT_EQ(submitted.spec().training().steps(), 10);
  EXPECT_EQ(submitted.spec().parallel().ranks(), 2u);
  EXPECT_EQ(submitted.state(), v1::JOB_STATE_PENDING);

  auto res = Client()->Get("/v1/jobs/job-1");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  // Field names as in the .proto, enums by name, and no default-valued fields.
  EXPECT_NE(res->body.find("\"total_steps\""), std::string::npos) << res->body;
  EXPECT_NE(res->body.find("\"JOB_STATE_PENDING\""), std::string::npos) << res->body;
  EXPECT_EQ(res->body.find("\"reason\""), std::string::npos) << res->body;
  EXPECT_EQ(Parse<v1::Job>(res->body).spec().name(), "demo");

  res = Client()->Get(
      "/v1/jobs?state=RUNNING&state=JOB_STATE_PAUSED&state=failed,cancelled&page_size=5"
      "&page_token=abc");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const auto list = Parse<v1::ListJobsResponse>(res->body);
  ASSERT_EQ(list.jobs_size(), 1);
  EXPECT_EQ(list.jobs(0).id(), "job-1");
  EXPECT_EQ(list.next_page_token(), "next");
  ASSERT_EQ(api_.last_list.states_size(), 4);
  EXPECT_EQ(api_.last_list.states(0), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(api_.last_list.states(1), v1::JOB_STATE_PAUSED);
  EXPECT_EQ(api_.last_list.states(2), v1::JOB_STATE_FAILED);
  EXPECT_EQ(api_.last_list.states(3), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(api_.last_list.page_size(), 5u);
  EXPECT_EQ(api_.last_list.page_token(), "abc");

  res = Client()->Get("/v1/jobs");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(api_.last_list.states_size(), 0);
}

TEST_F(RestGatewayTest, ListRejectsBadQueries) {
  for (const char* path : {"/v1/jobs?state=SLEEPING", "/v1/jobs?page_size=-1",
                           "/v1/jobs?page_size=many", "/v1/jobs?colour=red"}) {
    auto res = Client()->Get(path);
    ASSERT_TRUE(res) << path;
    EXPECT_EQ(res->status, 400) << path;
    const ErrorBody error = ParseError(res->body);
    EXPECT_EQ(error.code, 3) << path;
    EXPECT_EQ(error.status, "INVALID_ARGUMENT") << path;
  }
  auto res = Client()->Get("/v1/jobs?state=SLEEPING");
  ASSERT_TRUE(res);
  EXPECT_NE(ParseError(res->body).message.find("SLEEPING"), std::string::npos);
  res = Client()->Get("/v1/jobs?colour=red");
  ASSERT_TRUE(res);
  EXPECT_NE(ParseError(res->body).message.find("colour"), std::string::npos);
}

TEST_F(RestGatewayTest, Actions) {
  SubmitOk(R"({"name": "a"})");
  auto res =
      Client()->Post("/v1/jobs/job-1:pause", R"({"reason": "maintenance"})", "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(api_.last_action, "pause");
  EXPECT_EQ(api_.last_action_request.id(), "job-1");
  EXPECT_EQ(api_.last_action_request.reason(), "maintenance");
  EXPECT_EQ(Parse<v1::Job>(res->body).state(), v1::JOB_STATE_PAUSED);

  // No body at all is the same as {}.
  res = Client()->Post("/v1/jobs/job-1:resume");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(api_.last_action, "resume");
  EXPECT_EQ(api_.last_action_request.reason(), "");

  res = Client()->Post("/v1/jobs/job-1:checkpoint", "{}", "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(api_.last_action, "checkpoint");

  res = Client()->Post("/v1/jobs/job-1:cancel", "{}", "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(api_.last_action, "cancel");
  EXPECT_EQ(Parse<v1::Job>(res->body).state(), v1::JOB_STATE_CANCELLED);

  // The API's FAILED_PRECONDITION is a 400 with the message.
  res = Client()->Post("/v1/jobs/job-1:cancel", "{}", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  const ErrorBody error = ParseError(res->body);
  EXPECT_EQ(error.status, "FAILED_PRECONDITION");
  EXPECT_EQ(error.code, 9);
  EXPECT_EQ(error.message, "job is cancelled");

  // A body naming another job is refused rather than acting on either.
  res = Client()->Post("/v1/jobs/job-1:pause", R"({"id": "job-2"})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400) << res->body;

  res = Client()->Post("/v1/jobs/job-1:explode", "{}", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_EQ(ParseError(res->body).status, "NOT_FOUND");

  res = Client()->Get("/v1/jobs/job-1:cancel");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 405);
  EXPECT_EQ(res->get_header_value("Allow"), "POST");
}

// What `curl -X POST .../jobs/ID:pause` sends: no body and no Content-Length. HTTP/1.1 (RFC 9112
// 6.3) reads that as an empty body; httplib 0.11 instead read until the client closed, so the
// action waited out the read timeout and failed with 400.
TEST_F(RestGatewayTest, AnActionWithoutABodyOrContentLengthIsAnEmptyBody) {
  SubmitOk(R"({"name": "a"})");
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  struct timeval timeout {
    30, 0
  };  // a hang fails the test rather than the suite
  ASSERT_EQ(::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout)), 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(gateway_->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // Keep-alive, as curl sends it: the client waits for the answer before it would close.
  const std::string request = absl::StrCat("POST /v1/jobs/job-1:pause HTTP/1.1\r\nHost: x\r\n",
                                           "Authorization: Bearer ", kToken, "\r\n\r\n");
  ASSERT_EQ(::send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  const absl::Time start = absl::Now();
  std::string answer;
  char buf[4096];
  while (answer.find("\r\n\r\n") == std::string::npos) {
    const ssize_t got = ::recv(fd, buf, sizeof(buf), 0);
    if (got <= 0) break;
    answer.append(buf, static_cast<size_t>(got));
  }
  const absl::Duration took = absl::Now() - start;
  ::close(fd);
  EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 200")) << answer;
  EXPECT_EQ(api_.last_action, "pause");
  // httplib's read timeout is 5 s: an answer that waited for it did not read the empty body.
  EXPECT_LT(took, absl::Seconds(5)) << "the answer came after " << took;
}

TEST_F(RestGatewayTest, Events) {
  SubmitOk(R"({"name": "a"})");
  auto res = Client()->Get("/v1/jobs/job-1/events?after_sequence=3");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(api_.last_events.id(), "job-1");
  EXPECT_EQ(api_.last_events.after_sequence(), 3u);
  const auto events = Parse<v1::ListJobEventsResponse>(res->body);
  ASSERT_EQ(events.events_size(), 1);
  EXPECT_EQ(events.events(0).sequence(), 4u);
  EXPECT_EQ(events.events(0).message(), "submitted");

  res = Client()->Get("/v1/jobs/nope/events");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
}

TEST_F(RestGatewayTest, UnknownJobIsNotFound) {
  auto res = Client()->Get("/v1/jobs/job-42");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_EQ(res->get_header_value("Content-Type"), "application/json");
  const ErrorBody error = ParseError(res->body);
  EXPECT_EQ(error.code, 5);
  EXPECT_EQ(error.status, "NOT_FOUND");
  EXPECT_EQ(error.message, "job 'job-42' not found");
}

TEST_F(RestGatewayTest, MissingOrWrongTokenIsUnauthenticated) {
  for (const std::string token : {"", "wrong-token", "s3cret-toke", "s3cret-token2"}) {
    for (const char* path : {"/v1/jobs", "/v1/jobs/job-1", "/v1/nowhere"}) {
      auto res = Client(token)->Get(path);
      ASSERT_TRUE(res);
      EXPECT_EQ(res->status, 401) << token << " " << path;
      EXPECT_EQ(res->get_header_value("WWW-Authenticate"), "Bearer");
      EXPECT_EQ(res->body,
                "{\"code\":16,\"status\":\"UNAUTHENTICATED\",\"message\":\"missing or invalid "
                "bearer token\"}\n");
    }
    auto res = Client(token)->Post("/v1/jobs", R"({"name": "x"})", "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 401);
  }
  // Another scheme with the right secret is still refused.
  auto client = Client("");
  auto res = client->Get("/v1/jobs", {{"Authorization", std::string("Basic ") + kToken}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 401);
  res = Client()->Get("/v1/jobs");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

TEST_F(RestGatewayTest, HealthzNeedsNoToken) {
  auto res = Client("")->Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "application/json");
  const auto body = Parse<google::protobuf::Struct>(res->body);
  EXPECT_EQ(body.fields().at("status").string_value(), "SERVING");
}

TEST_F(RestGatewayTest, UnknownFieldIsBadRequestNamingIt) {
  auto res =
      Client()->Post("/v1/jobs", R"({"name": "x", "trainig": {"steps": 3}})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  const ErrorBody error = ParseError(res->body);
  EXPECT_EQ(error.code, 3);
  EXPECT_EQ(error.status, "INVALID_ARGUMENT");
  EXPECT_NE(error.message.find("trainig"), std::string::npos) << error.message;

  res = Client()->Post("/v1/jobs", "{not json", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_EQ(ParseError(res->body).status, "INVALID_ARGUMENT");

  // A spec the API refuses: its message comes back as it is.
  res = Client()->Post("/v1/jobs", R"({"name": "reject"})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_EQ(ParseError(res->body).message, "name: rejected");
}

TEST_F(RestGatewayTest, TooLargeBodyIs413) {
  const std::string body = absl::StrCat(R"({"name": ")", std::string(8000, 'x'), R"("})");
  auto res = Client()->Post("/v1/jobs", body, "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 413);
  const ErrorBody error = ParseError(res->body);
  EXPECT_EQ(error.status, "RESOURCE_EXHAUSTED");
  EXPECT_NE(error.message.find("4096"), std::string::npos) << error.message;
}

// Found by rest_gateway_fuzz: a UTF-16 surrogate's bytes (ED BF BF), an overlong form (E0 80 AF)
// or a code point above U+10FFFF (F4 90 80 80) in a path went into the error body as they were,
// and no strict JSON parser accepts that body.
TEST_F(RestGatewayTest, ErrorBodiesAreUtf8WhateverThePathHolds) {
  auto res = Client()->Get(
      "/v1/jobs/a\xed\xbf\xbf"
      "b\xe0\x80\xaf"
      "c\xf4\x90\x80\x80"
      "d\xc3\xa9");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  const std::string r = "\xef\xbf\xbd";  // U+FFFD for each byte that is not UTF-8
  EXPECT_EQ(ParseError(res->body).message,
            absl::StrCat("job 'a", r, r, r, "b", r, r, r, "c", r, r, r, r, "d\xc3\xa9' not found"));
}

// Found by rest_gateway_fuzz: httplib applied a Range header it could not parse to the JSON body
// of its own 416, so the client got the body cut short.
TEST_F(RestGatewayTest, BadRangeGetsAWholeErrorBody) {
  auto res = Client()->Get("/v1/jobs/job-1", {{"Range", "bytes=5-,57-9"}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 416);
  EXPECT_EQ(ParseError(res->body).status, "INVALID_ARGUMENT");
}

// Found by rest_gateway_fuzz: a valid Range cut the JSON body of a 200 to the range.
TEST_F(RestGatewayTest, RangeIsIgnoredAndTheBodyIsWhole) {
  SubmitOk(R"({"name": "demo", "training": {"steps": 10}})");
  auto whole = Client()->Get("/v1/jobs/job-1");
  ASSERT_TRUE(whole);
  ASSERT_EQ(whole->status, 200) << whole->body;
  for (const char* range : {"bytes=-9", "bytes=0-3", "bytes=0-1,5-6"}) {
    auto res = Client()->Get("/v1/jobs/job-1", {{"Range", range}});
    ASSERT_TRUE(res) << range;
    EXPECT_EQ(res->status, 200) << range;
    EXPECT_FALSE(res->has_header("Content-Range")) << range;
    EXPECT_EQ(res->body, whole->body) << range;
  }
}

TEST_F(RestGatewayTest, UnknownRouteAndWrongMethod) {
  for (const char* path : {"/", "/v2/jobs", "/v1/jobs/", "/v1/jobs/job-1/logs", "/v1/other"}) {
    auto res = Client()->Get(path);
    ASSERT_TRUE(res) << path;
    EXPECT_EQ(res->status, 404) << path;
    EXPECT_EQ(ParseError(res->body).status, "NOT_FOUND") << path;
  }
  auto res = Client()->Delete("/v1/jobs");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 405);
  EXPECT_EQ(res->get_header_value("Allow"), "GET, POST");
  EXPECT_EQ(ParseError(res->body).status, "UNIMPLEMENTED");
  res = Client()->Post("/v1/jobs/job-1", "{}", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 405);
  res = Client()->Put("/healthz", "{}", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 405);
}

TEST(RestGatewayStartTest, BusyPortFailsCleanly) {
  FakeJobApi api;
  RestOptions options;
  options.host = "127.0.0.1";
  auto first = RestGateway::Start(&api, nullptr, options);
  ASSERT_TRUE(first.ok()) << first.status();
  options.port = (*first)->port();
  auto second = RestGateway::Start(&api, nullptr, options);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find(std::to_string(options.port)), std::string::npos);
}

TEST(RestGatewayStartTest, NoTokensMeansNoAuth) {
  FakeJobApi api;
  RestOptions options;
  options.host = "127.0.0.1";
  auto gateway = RestGateway::Start(&api, nullptr, options);
  ASSERT_TRUE(gateway.ok()) << gateway.status();
  httplib::Client client("127.0.0.1", (*gateway)->port());
  auto res = client.Get("/v1/jobs");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

TEST(RestGatewayStartTest, MissingTlsFilesFail) {
  FakeJobApi api;
  RestOptions options;
  options.host = "127.0.0.1";
  options.tls.cert_file = "/nonexistent/cert.pem";
  options.tls.key_file = "/nonexistent/key.pem";
  auto gateway = RestGateway::Start(&api, nullptr, options);
  ASSERT_FALSE(gateway.ok());
  EXPECT_NE(gateway.status().message().find("/nonexistent/cert.pem"), std::string::npos);
  options.tls.key_file.clear();
  EXPECT_EQ(RestGateway::Start(&api, nullptr, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HttpStatusForTest, FollowsGoogleRpcCodeMapping) {
  const std::pair<absl::StatusCode, int> table[] = {
      {absl::StatusCode::kOk, 200},
      {absl::StatusCode::kCancelled, 499},
      {absl::StatusCode::kUnknown, 500},
      {absl::StatusCode::kInvalidArgument, 400},
      {absl::StatusCode::kDeadlineExceeded, 504},
      {absl::StatusCode::kNotFound, 404},
      {absl::StatusCode::kAlreadyExists, 409},
      {absl::StatusCode::kPermissionDenied, 403},
      {absl::StatusCode::kResourceExhausted, 429},
      {absl::StatusCode::kFailedPrecondition, 400},
      {absl::StatusCode::kAborted, 409},
      {absl::StatusCode::kOutOfRange, 400},
      {absl::StatusCode::kUnimplemented, 501},
      {absl::StatusCode::kInternal, 500},
      {absl::StatusCode::kUnavailable, 503},
      {absl::StatusCode::kDataLoss, 500},
      {absl::StatusCode::kUnauthenticated, 401},
  };
  for (const auto& [code, http] : table) {
    EXPECT_EQ(HttpStatusFor(code), http) << absl::StatusCodeToString(code);
  }
  EXPECT_EQ(HttpStatusFor(static_cast<absl::StatusCode>(99)), 500);
}

}  // namespace
}  // namespace offload
