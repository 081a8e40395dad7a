// The REST mapping of the job API (ARCHITECTURE.md section 7) on cpp-httplib: the same messages as
// JSON through the protobuf JSON mapping, errors as {"code", "status", "message"} bodies with the
// HTTP status of the gRPC code (INVALID_ARGUMENT 400, UNAUTHENTICATED 401, NOT_FOUND 404, ...).
//   POST /v1/jobs                 body: a JobSpec          -> Job
//   GET  /v1/jobs[?state=RUNNING] -> ListJobsResponse
//   GET  /v1/jobs/{id}            -> Job
//   GET  /v1/jobs/{id}/events     -> ListJobEventsResponse
//   POST /v1/jobs/{id}:cancel|:pause|:resume|:checkpoint  body: {} or {"reason": "..."} -> Job
//   GET  /v1/audit[?after_sequence=N&page_size=M]          -> ListAuditResponse (admins)
//   GET  /healthz                 (no token needed: probes)
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_REST_GATEWAY_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_REST_GATEWAY_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/security/security.h"
#include "services/job_controller/job_api.h"
#include "services/job_controller/tenancy/identities.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace offload {

struct RestOptions {
  std::string host = "0.0.0.0";
  int port = 0;                     // 0: any free port (port() tells which)
  TlsConfig tls;                    // HTTPS when tls.cert_file is set
  size_t max_body_bytes = 1 << 20;  // larger request bodies get 413
};

class RestGateway {
 public:
  // Serves `api` on threads of its own until the gateway is destroyed. `identities` (nullptr: no
  // auth, every caller is the operator) and `api` must outlive it. Fails if the address cannot be
  // bound or the TLS files are bad.
  static absl::StatusOr<std::unique_ptr<RestGateway>> Start(JobApi* api,
                                                            const Identities* identities,
                                                            const RestOptions& options);
  virtual ~RestGateway() = default;
  virtual int port() const = 0;
};

// Installs the gateway on `server`: its routes, the body size limit and the JSON error bodies of
// what httplib answers itself. Start does this before it listens; the fuzzer
// (rest_gateway_fuzz.cc) does it to feed requests to the server without a socket. `api` and
// `identities` (nullptr: no auth) must outlive the server.
void ConfigureRestServer(httplib::Server& server, JobApi* api, const Identities* identities,
                         size_t max_body_bytes);

// The HTTP status a gRPC/absl code maps to (the mapping of google.rpc.Code).
int HttpStatusFor(absl::StatusCode code);

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_REST_GATEWAY_H_
