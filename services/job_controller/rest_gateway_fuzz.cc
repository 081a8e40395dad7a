// libFuzzer target: raw HTTP requests into the REST gateway (rest_gateway.h). The gateway faces
// the network, so anyone who can reach the port can send it any bytes: request lines, query
// strings, headers, bearer tokens and JSON bodies must all be answered, never crash it.
//
// The input is what a client writes on the connection: one or more pipelined HTTP/1.1 requests.
// It goes through httplib's own request parser (Server::process_request, reached by subclassing,
// with an in-memory stream instead of a socket) into the server as ConfigureRestServer sets it up
// for RestGateway::Start, with bearer tokens required (the operator's and three tenants') and a
// fake JobApi that echoes what it is given into its replies and errors. Every response must carry a
// JSON body that parses, and every error body must be the {"code", "status", "message"} object the
// REST mapping promises.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/testing/fuzz_util.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "httplib.h"
#include "jobs/spec/job_spec.h"
#include "services/job_controller/rest_gateway.h"
#include "services/job_controller/tenancy/identities.h"

namespace offload {
namespace {

constexpr char kToken[] = "fuzz-token";
// Tenant tokens: "a" owns job-1, "b" owns nothing, "ops" is an admin.
constexpr char kTokenA[] = "tenant-a-token-0123456789";
constexpr char kTokenB[] = "tenant-b-token-0123456789";
constexpr char kTokenOps[] = "tenant-ops-token-0123456789";
constexpr size_t kMaxBody = 4096;

// Answers like the controller does: the known job "job-1" of tenant "a", NOT_FOUND or
// FAILED_PRECONDITION naming the others (and job-1 to other tenants), the spec's checks
// (ValidateJobSpec: tenant, priority, ...), and the client's own strings (ids, reasons, page
// tokens, the spec) echoed back, so that whatever bytes a client sends are also printed into JSON.
class FakeJobApi : public JobApi {
 public:
  absl::StatusOr<v1::ListAuditResponse> ListAudit(const Caller& caller,
                                                  const v1::ListAuditRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    if (!caller.admin) return absl::PermissionDeniedError("not an admin");
    v1::ListAuditResponse response;
    v1::AuditRecord* record = response.add_records();
    record->set_sequence(request.after_sequence() + 1);
    record->set_tenant(caller.tenant);
    record->set_action("audit");
    return response;
  }

  absl::StatusOr<v1::Job> SubmitJob(const Caller& caller,
                                    const v1::SubmitJobRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    if (request.spec().name().empty()) return absl::InvalidArgumentError("name: is empty");
    if (absl::Status s = ValidateJobSpec(request.spec()); !s.ok()) return s;
    if (!request.spec().tenant().empty() && request.spec().tenant() != caller.tenant &&
        !caller.admin) {
      return absl::PermissionDeniedError(absl::StrCat("tenant: not ", request.spec().tenant()));
    }
    v1::Job job = Known();
    *job.mutable_spec() = request.spec();
    return job;
  }
  absl::StatusOr<v1::Job> GetJob(const Caller& caller, const v1::GetJobRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    if (!Sees(caller, request.id())) {
      return absl::NotFoundError(absl::StrCat("no job ", request.id()));
    }
    return Known();
  }
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const Caller& caller,
                                                const v1::ListJobsRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    if (request.page_size() > 1000) return absl::InvalidArgumentError("page_size: too large");
    v1::ListJobsResponse response;
    for (int state : request.states()) {
      v1::Job* job = response.add_jobs();
      *job = Known();
      job->set_state(static_cast<v1::JobState>(state));
    }
    response.set_next_page_token(request.page_token());
    return response;
  }
  absl::StatusOr<v1::Job> CancelJob(const Caller& caller,
                                    const v1::JobActionRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    return Act(caller, request);
  }
  absl::StatusOr<v1::Job> PauseJob(const Caller& caller,
                                   const v1::JobActionRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    return Act(caller, request);
  }
  absl::StatusOr<v1::Job> ResumeJob(const Caller& caller,
                                    const v1::JobActionRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    return Act(caller, request);
  }
  absl::StatusOr<v1::Job> CheckpointJob(const Caller& caller,
                                        const v1::JobActionRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    return Act(caller, request);
  }
  absl::StatusOr<v1::ListJobEventsResponse> ListJobEvents(
      const Caller& caller, const v1::ListJobEventsRequest& request) override {
    if (!caller.authenticated) return Unauthenticated();
    if (!Sees(caller, request.id())) {
      return absl::NotFoundError(absl::StrCat("no job ", request.id()));
    }
    v1::ListJobEventsResponse response;
    v1::JobEvent* event = response.add_events();
    event->set_sequence(request.after_sequence() + 1);
    event->set_job_id(request.id());
    event->set_message("submitted");
    return response;
  }

 private:
  static absl::Status Unauthenticated() {
    return absl::UnauthenticatedError("missing or invalid bearer token");
  }
  static bool Sees(const Caller& caller, const std::string& id) {
    return id == "job-1" && (caller.admin || caller.tenant == "a");
  }
  static v1::Job Known() {
    v1::Job job;
    job.set_id("job-1");
    job.set_tenant("a");
    job.set_state(v1::JobState::JOB_STATE_RUNNING);
    return job;
  }
  static absl::StatusOr<v1::Job> Act(const Caller& caller, const v1::JobActionRequest& request) {
    if (!Sees(caller, request.id())) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", request.id(), " cannot do that: ", request.reason()));
    }
    v1::Job job = Known();
    job.set_reason(request.reason());
    return job;
  }
};

// The connection: reads come from the input, writes are collected.
class MemoryStream : public httplib::Stream {
 public:
  MemoryStream(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool is_readable() const override { return pos_ < size_; }
  bool is_writable() const override { return true; }
  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, size_ - pos_);
    std::memcpy(ptr, data_ + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    written_.append(ptr, size);
    return static_cast<ssize_t>(size);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = "127.0.0.1";
    port = 40000;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip = "127.0.0.1";
    port = 8080;
  }
  socket_t socket() const override { return INVALID_SOCKET; }

  bool exhausted() const { return pos_ >= size_; }
  std::string TakeWritten() { return std::move(written_); }

 private:
  const uint8_t* data_;
  const size_t size_;
  size_t pos_ = 0;
  std::string written_;
};

// httplib's request loop without its socket: process_request is protected.
class InMemoryServer : public httplib::Server {
 public:
  bool Process(MemoryStream& stream, bool& connection_closed) {
    return process_request(stream, /*close_connection=*/false, connection_closed, nullptr);
  }
};

void Fail(const char* what, const std::string& detail) {
  FuzzFail("rest_gateway_fuzz", what, detail);
}

// One response as written on the wire: its status line, and a body that is a JSON object (and an
// error object for every status >= 400), never cut to a byte range. Not checked: a body httplib
// compressed on the client's request (Accept-Encoding).
void CheckResponse(std::string response) {
  if (response.empty()) return;  // nothing parsed: the client sent no request line
  // "Expect: 100-continue" gets an interim response first.
  constexpr absl::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
  if (absl::StartsWith(response, kContinue)) response.erase(0, kContinue.size());
  int status = 0;
  if (!absl::StartsWith(response, "HTTP/1.1 ") || response.size() < 12 ||
      !absl::SimpleAtoi(response.substr(9, 3), &status) || status < 200 || status > 599) {
    Fail("bad status line", response);
  }
  const size_t end = response.find("\r\n\r\n");
  if (end == std::string::npos) Fail("no end of headers", response);
  const std::string headers = absl::AsciiStrToLower(response.substr(0, end));
  // A Range header is ignored: every answer is whole.
  if (status == 206 || absl::StrContains(headers, "\r\ncontent-range:")) {
    Fail("a byte range of a JSON answer", response);
  }
  if (absl::StrContains(headers, "\r\ncontent-encoding:")) return;
  const std::string body = response.substr(end + 4);
  if (body.empty()) return;  // HEAD
  google::protobuf::Struct json;
  if (!google::protobuf::util::JsonStringToMessage(body, &json).ok()) {
    Fail("the body is not a JSON object", response);
  }
  if (status >= 400) {
    const auto& f = json.fields();
    if (f.count("code") == 0 || !f.at("code").has_number_value() || f.count("status") == 0 ||
        !f.at("status").has_string_value() || f.count("message") == 0 ||
        !f.at("message").has_string_value()) {
      Fail("an error without code, status and message", response);
    }
  }
}

InMemoryServer& Server() {
  static InMemoryServer* server = [] {
    static FakeJobApi api;
    BearerTokens tokens;
    tokens.Add(kToken);
    TenantTable table;
    for (const auto& [name, token, admin] :
         {std::tuple{"a", kTokenA, false}, {"b", kTokenB, false}, {"ops", kTokenOps, true}}) {
      v1::TenantConfig& tenant = table.tenants.emplace_back();
      tenant.set_name(name);
      tenant.set_admin(admin);
      tenant.add_tokens(token);
    }
    static Identities* identities = Identities::WithTable(tokens, std::move(table)).release();
    auto* s = new InMemoryServer;
    ConfigureRestServer(*s, &api, identities, kMaxBody);
    return s;
  }();
  return *server;
}

void Run(const uint8_t* data, size_t size) {
  InMemoryServer& server = Server();
  MemoryStream stream(data, size);
  // As httplib's keep-alive loop: requests until the input ends or one closes the connection.
  for (int i = 0; i < 4 && !stream.exhausted(); ++i) {
    bool connection_closed = false;
    const bool ok = server.Process(stream, connection_closed);
    CheckResponse(stream.TakeWritten());
    if (!ok || connection_closed) break;
  }
}

}  // namespace
}  // namespace offload

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  offload::Run(data, size);
  return 0;
}
