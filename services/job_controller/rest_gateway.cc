#include "services/job_controller/rest_gateway.h"

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "base/metrics/metrics.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "google/protobuf/util/json_util.h"
#include "httplib.h"
#include "jobs/spec/job_state_names.h"

namespace offload {
namespace {

constexpr char kJsonType[] = "application/json";

// JSON string literal for `text`. Bytes that are not valid UTF-8 become U+FFFD so an error
// message quoting a client's bad input still yields a body every JSON parser accepts.
std::string JsonQuote(absl::string_view text) {
  std::string out = "\"";
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
      ++i;
    } else if (c == '\n') {
      out += "\\n";
      ++i;
    } else if (c == '\r') {
      out += "\\r";
      ++i;
    } else if (c == '\t') {
      out += "\\t";
      ++i;
    } else if (c < 0x20 || c == 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
      ++i;
    } else if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
    } else {
      // Well-formed sequences pass as they are; any other byte becomes U+FFFD, so the body is
      // valid JSON whatever the client sent.
      const size_t length = Utf8SequenceLength(text, i);
      const bool valid = length > 0;
      if (valid) {
        out.append(text.data() + i, length);
        i += length;
      } else {
        out += "\\ufffd";
        ++i;
      }
    }
  }
  out += '"';
  return out;
}

std::string ErrorBody(absl::StatusCode code, absl::string_view message) {
  return absl::StrCat("{\"code\":", static_cast<int>(code),
                      ",\"status\":", JsonQuote(absl::StatusCodeToString(code)),
                      ",\"message\":", JsonQuote(message), "}\n");
}

void SetError(httplib::Response& res, int http_status, absl::StatusCode code,
              absl::string_view message) {
  res.status = http_status;
  res.set_content(ErrorBody(code, message), kJsonType);
}

void SetStatus(httplib::Response& res, const absl::Status& status) {
  SetError(res, HttpStatusFor(status.code()), status.code(), status.message());
}

void SetMessage(httplib::Response& res, const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = false;
  std::string json;
  const auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    SetError(res, 500, absl::StatusCode::kInternal,
             absl::StrCat("cannot encode the response: ", status.message().ToString()));
    return;
  }
  res.status = 200;
  json += '\n';
  res.set_content(json, kJsonType);
}

template <typename T>
void Reply(httplib::Response& res, const absl::StatusOr<T>& result) {
  if (result.ok()) {
    SetMessage(res, *result);
  } else {
    SetStatus(res, result.status());
  }
}

// Unknown fields are errors here as in job files: a misspelt field must not be silently dropped.
absl::Status ParseBody(const std::string& body, google::protobuf::Message* message) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status = google::protobuf::util::JsonStringToMessage(body, message, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid request body: ", status.message().ToString()));
  }
  return absl::OkStatus();
}

template <typename Int>
absl::StatusOr<Int> ParseUnsigned(absl::string_view name, absl::string_view text) {
  Int value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": '", text, "' is not a non-negative integer"));
  }
  return value;
}

absl::Status CheckQueryNames(const httplib::Request& req,
                             std::initializer_list<absl::string_view> allowed) {
  for (const auto& [name, value] : req.params) {
    bool known = false;
    for (absl::string_view a : allowed) known = known || name == a;
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat("unknown query parameter '", name, "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ListJobsRequest> ListRequestFromQuery(const httplib::Request& req) {
  OFFLOAD_RETURN_IF_ERROR(CheckQueryNames(req, {"state", "page_size", "page_token"}));
  v1::ListJobsRequest request;
  const auto states = req.params.equal_range("state");
  for (auto it = states.first; it != states.second; ++it) {
    // state=RUNNING,PAUSED is the same as state=RUNNING&state=PAUSED.
    for (absl::string_view one : absl::StrSplit(it->second, ',', absl::SkipWhitespace())) {
      absl::StatusOr<v1::JobState> state = ParseStateName(one);
      if (!state.ok()) {
        // Errors name the query parameter they are about, as ParseUnsigned's do.
        return absl::InvalidArgumentError(absl::StrCat("state: ", state.status().message()));
      }
      request.add_states(*state);
    }
  }
  if (req.has_param("page_size")) {
    absl::StatusOr<uint32_t> size =
        ParseUnsigned<uint32_t>("page_size", req.get_param_value("page_size"));
    if (!size.ok()) return size.status();
    request.set_page_size(*size);
  }
  request.set_page_token(req.get_param_value("page_token"));
  return request;
}

// What the gateway answers to one request: who calls, routing, the JSON body, the JobApi call and
// its JSON reply or error. Made per request.
//
// A call without a valid token learns nothing, not even which routes exist: every answer is 401.
// One that names a job API call still goes to the API, which refuses it and writes the attempt to
// the audit log.
class RestRoutes {
 public:
  RestRoutes(JobApi* api, const Identities* identities, const httplib::Request& req)
      : api_(api),
        caller_(identities == nullptr
                    ? Caller::Operator()
                    : identities->IdentifyAuthorization(req.get_header_value("Authorization"),
                                                        VerifiedPeerName(req.ssl))) {}

  // An error found before the API is called.
  void Fail(httplib::Response& res, const absl::Status& status) const {
    if (!caller_.authenticated) return Unauthenticated(res);
    SetStatus(res, status);
  }

  static void Unauthenticated(httplib::Response& res) {
    SetError(res, 401, absl::StatusCode::kUnauthenticated, "missing or invalid bearer token");
  }

  void MethodNotAllowed(const httplib::Request& req, httplib::Response& res,
                        absl::string_view allowed) const {
    if (!caller_.authenticated) return Unauthenticated(res);
    res.set_header("Allow", std::string(allowed));
    SetError(res, 405, absl::StatusCode::kUnimplemented,
             absl::StrCat("method ", req.method, " is not allowed on ", req.path,
                          " (allowed: ", allowed, ")"));
  }

  void NoRoute(const httplib::Request& req, httplib::Response& res) const {
    if (!caller_.authenticated && absl::StartsWith(req.path, "/v1")) return Unauthenticated(res);
    SetError(res, 404, absl::StatusCode::kNotFound,
             absl::StrCat("no route for ", req.method, " ", req.path));
  }

  static bool IsGet(const httplib::Request& req) {
    return req.method == "GET" || req.method == "HEAD";
  }

  void Route(const httplib::Request& req, httplib::Response& res) const {
    RouteCall(req, res);
    if (res.status == 401) res.set_header("WWW-Authenticate", "Bearer");
  }

  void RouteCall(const httplib::Request& req, httplib::Response& res) const {
    absl::string_view path = req.path;
    if (path == "/healthz") {
      if (!IsGet(req)) return MethodNotAllowed(req, res, "GET");
      res.status = 200;
      res.set_content("{\"status\":\"SERVING\"}\n", kJsonType);
      return;
    }
    if (path != "/v1" && !absl::StartsWith(path, "/v1/")) return NoRoute(req, res);
    if (path == "/v1/audit") {
      if (!IsGet(req)) return MethodNotAllowed(req, res, "GET");
      return ListAudit(req, res);
    }
    if (path == "/v1/jobs") {
      if (IsGet(req)) return List(req, res);
      if (req.method == "POST") return Submit(req, res);
      return MethodNotAllowed(req, res, "GET, POST");
    }
    if (!absl::ConsumePrefix(&path, "/v1/jobs/")) return NoRoute(req, res);
    // What is left: "{id}", "{id}/events" or "{id}:{verb}".
    const size_t slash = path.find('/');
    const size_t colon = path.find(':');
    if (slash != absl::string_view::npos) {
      const absl::string_view id = path.substr(0, slash);
      if (id.empty() || colon < slash || path.substr(slash) != "/events") {
        return NoRoute(req, res);
      }
      if (!IsGet(req)) return MethodNotAllowed(req, res, "GET");
      return Events(std::string(id), req, res);
    }
    if (colon != absl::string_view::npos) {
      const absl::string_view id = path.substr(0, colon);
      const absl::string_view verb = path.substr(colon + 1);
      using Action =
          absl::StatusOr<v1::Job> (JobApi::*)(const Caller&, const v1::JobActionRequest&);
      Action action = nullptr;
      if (verb == "cancel") {
        action = &JobApi::CancelJob;
      } else if (verb == "pause") {
        action = &JobApi::PauseJob;
      } else if (verb == "resume") {
        action = &JobApi::ResumeJob;
      } else if (verb == "checkpoint") {
        action = &JobApi::CheckpointJob;
      }
      if (id.empty() || action == nullptr) return NoRoute(req, res);
      if (req.method != "POST") return MethodNotAllowed(req, res, "POST");
      return Act(std::string(id), action, req, res);
    }
    if (path.empty()) return NoRoute(req, res);
    if (!IsGet(req)) return MethodNotAllowed(req, res, "GET");
    v1::GetJobRequest request;
    request.set_id(std::string(path));
    Reply(res, api_->GetJob(caller_, request));
  }

  void Submit(const httplib::Request& req, httplib::Response& res) const {
    v1::SubmitJobRequest request;
    if (absl::Status s = ParseBody(req.body, request.mutable_spec()); !s.ok()) {
      return Fail(res, s);
    }
    Reply(res, api_->SubmitJob(caller_, request));
  }

  void List(const httplib::Request& req, httplib::Response& res) const {
    absl::StatusOr<v1::ListJobsRequest> request = ListRequestFromQuery(req);
    if (!request.ok()) return Fail(res, request.status());
    Reply(res, api_->ListJobs(caller_, *request));
  }

  void ListAudit(const httplib::Request& req, httplib::Response& res) const {
    if (absl::Status s = CheckQueryNames(req, {"after_sequence", "page_size"}); !s.ok()) {
      return Fail(res, s);
    }
    v1::ListAuditRequest request;
    if (req.has_param("after_sequence")) {
      absl::StatusOr<uint64_t> after =
          ParseUnsigned<uint64_t>("after_sequence", req.get_param_value("after_sequence"));
      if (!after.ok()) return Fail(res, after.status());
      request.set_after_sequence(*after);
    }
    if (req.has_param("page_size")) {
      absl::StatusOr<uint32_t> size =
          ParseUnsigned<uint32_t>("page_size", req.get_param_value("page_size"));
      if (!size.ok()) return Fail(res, size.status());
      request.set_page_size(*size);
    }
    Reply(res, api_->ListAudit(caller_, request));
  }

  void Events(std::string id, const httplib::Request& req, httplib::Response& res) const {
    if (absl::Status s = CheckQueryNames(req, {"after_sequence"}); !s.ok()) {
      return Fail(res, s);
    }
    v1::ListJobEventsRequest request;
    request.set_id(std::move(id));
    if (req.has_param("after_sequence")) {
      absl::StatusOr<uint64_t> after =
          ParseUnsigned<uint64_t>("after_sequence", req.get_param_value("after_sequence"));
      if (!after.ok()) return Fail(res, after.status());
      request.set_after_sequence(*after);
    }
    Reply(res, api_->ListJobEvents(caller_, request));
  }

  void Act(std::string id,
           absl::StatusOr<v1::Job> (JobApi::*action)(const Caller&, const v1::JobActionRequest&),
           const httplib::Request& req, httplib::Response& res) const {
    v1::JobActionRequest request;
    // An empty body is the same as {}: `curl -X POST .../jobs/ID:cancel` should just work.
    if (!absl::StripAsciiWhitespace(req.body).empty()) {
      if (absl::Status s = ParseBody(req.body, &request); !s.ok()) return Fail(res, s);
    }
    if (!request.id().empty() && request.id() != id) {
      return Fail(res, absl::InvalidArgumentError(absl::StrCat(
                           "id: the body names job '", request.id(), "' but the path '", id, "'")));
    }
    request.set_id(std::move(id));
    Reply(res, (api_->*action)(caller_, request));
  }

 private:
  JobApi* const api_;
  const Caller caller_;
};

class RestGatewayImpl final : public RestGateway {
 public:
  RestGatewayImpl(JobApi* api, const Identities* identities,
                  std::unique_ptr<httplib::Server> server)
      : api_(api), identities_(identities), server_(std::move(server)) {}

  ~RestGatewayImpl() override {
    if (thread_.joinable()) {
      // stop() only acts once the accept loop has started; Listen waited for that.
      server_->stop();
      thread_.join();
    }
  }

  int port() const override { return port_; }

  absl::Status Listen(const RestOptions& options) {
    ConfigureRestServer(*server_, api_, identities_, options.max_body_bytes);
    server_->set_socket_options(ExclusiveListenSocketOptions);
    if (options.port == 0) {
      port_ = server_->bind_to_any_port(options.host);
      if (port_ < 0) {
        return absl::UnavailableError(
            absl::StrCat("REST gateway: cannot bind ", options.host, " to a free port"));
      }
    } else {
      if (!server_->bind_to_port(options.host, options.port)) {
        return absl::UnavailableError(absl::StrCat("REST gateway: cannot bind ", options.host, ":",
                                                   options.port, " (in use?)"));
      }
      port_ = options.port;
    }
    thread_ = std::thread([this] {
      server_->listen_after_bind();
      loop_ended_ = true;
    });
    // Until the accept loop runs, stop() is a no-op and the destructor would wait forever.
    while (!server_->is_running() && !loop_ended_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (loop_ended_) {
      return absl::UnavailableError(
          absl::StrCat("REST gateway: listening on ", options.host, ":", port_, " failed"));
    }
    return absl::OkStatus();
  }

 private:
  JobApi* const api_;
  const Identities* const identities_;
  std::unique_ptr<httplib::Server> server_;
  int port_ = -1;
  std::atomic<bool> loop_ended_{false};
  std::thread thread_;
};

}  // namespace

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kCancelled:
      return 499;
    case absl::StatusCode::kUnknown:
      return 500;
    case absl::StatusCode::kInvalidArgument:
      return 400;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAlreadyExists:
      return 409;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kFailedPrecondition:
      return 400;
    case absl::StatusCode::kAborted:
      return 409;
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kInternal:
      return 500;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDataLoss:
      return 500;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    default:
      return 500;
  }
}

void ConfigureRestServer(httplib::Server& server, JobApi* api, const Identities* identities,
                         size_t max_body_bytes) {
  server.set_payload_max_length(max_body_bytes);
  // One catch-all handler per method: the routes are matched in Route so that a known path
  // with the wrong method can answer 405 instead of httplib's 404.
  const auto handler = [api, identities](const httplib::Request& req, httplib::Response& res) {
    // Every answer is one JSON document, sent whole: a Range header is ignored (RFC 9110 14.2
    // lets a server do so). httplib (0.11) would otherwise cut the body to the range yet keep our
    // 200, and a client would get a truncated JSON body as if it were complete. The request is
    // httplib's own non-const object, handed to handlers as const.
    const_cast<httplib::Request&>(req).ranges.clear();
    RestRoutes(api, identities, req).Route(req, res);
  };
  // A request with neither Content-Length nor Transfer-Encoding has an empty body (RFC 9112
  // 6.3), which is what `curl -X POST .../jobs/ID:cancel` sends. httplib (0.11) reads such a
  // body until the client closes, so the action waited out the read timeout and answered 400.
  // The pre-routing handler runs before the body is read, on httplib's own non-const request.
  server.set_pre_routing_handler([](const httplib::Request& req, httplib::Response&) {
    if (!req.has_header("Content-Length") && !req.has_header("Transfer-Encoding")) {
      const_cast<httplib::Request&>(req).headers.emplace("Content-Length", "0");
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  server.Get(".*", handler);
  server.Post(".*", handler);
  server.Put(".*", handler);
  server.Patch(".*", handler);
  server.Delete(".*", handler);
  server.Options(".*", handler);
  // httplib answers some requests itself (413 for a large body, 400 for a bad request line);
  // they get the same JSON error bodies as ours. Responses that already have a body are ours.
  server.set_error_handler(httplib::Server::HandlerWithResponse(
      [max_body_bytes](const httplib::Request&, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        switch (res.status) {
          case 413:
            res.set_content(
                ErrorBody(absl::StatusCode::kResourceExhausted,
                          absl::StrCat("request body is larger than ", max_body_bytes, " bytes")),
                kJsonType);
            break;
          case 404:
            res.set_content(ErrorBody(absl::StatusCode::kNotFound, "no such route"), kJsonType);
            break;
          case 400:
          case 414:
          case 416:
            res.set_content(ErrorBody(absl::StatusCode::kInvalidArgument,
                                      absl::StrCat("malformed HTTP request (", res.status, ")")),
                            kJsonType);
            break;
          default:
            res.set_content(ErrorBody(absl::StatusCode::kInternal,
                                      absl::StrCat("request failed (HTTP ", res.status, ")")),
                            kJsonType);
        }
        // Unhandled, though the body is set: httplib (0.11) applies the request's Range header to
        // a Handled error response, even to the 416 of a Range it could not parse, and that cut
        // the JSON body short. An error body is always sent whole.
        return httplib::Server::HandlerResponse::Unhandled;
      }));
  server.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
        // The exception's text may carry internals; the log of the controller is the place.
        SetError(res, 500, absl::StatusCode::kInternal, "internal error");
      });
}

absl::StatusOr<std::unique_ptr<RestGateway>> RestGateway::Start(JobApi* api,
                                                                const Identities* identities,
                                                                const RestOptions& options) {
  std::unique_ptr<httplib::Server> server;
  const TlsConfig& tls = options.tls;
  if (!tls.cert_file.empty()) {
    // The gRPC server's checks: httplib's own failure below does not say which file is bad.
    if (absl::Status s = CheckServerTls(tls); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("REST gateway: ", s.message()));
    }
    // httplib verifies client certificates exactly when it is given a CA for them.
    auto ssl = std::make_unique<httplib::SSLServer>(
        tls.cert_file.c_str(), tls.key_file.c_str(),
        tls.require_client_cert ? tls.ca_file.c_str() : nullptr);
    if (!ssl->is_valid()) {
      return absl::InvalidArgumentError(absl::StrCat("REST gateway: the TLS certificate '",
                                                     tls.cert_file, "', key '", tls.key_file,
                                                     "' or CA file cannot be loaded"));
    }
    server = std::move(ssl);
  } else {
    server = std::make_unique<httplib::Server>();
  }
  auto gateway = std::make_unique<RestGatewayImpl>(api, identities, std::move(server));
  OFFLOAD_RETURN_IF_ERROR(gateway->Listen(options));
  return std::unique_ptr<RestGateway>(std::move(gateway));
}

}  // namespace offload
