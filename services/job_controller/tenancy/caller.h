// Who makes a call to the job controller: what the API's adapters (gRPC, REST) learn from the
// bearer token (tenancy/identities.h) and the controller decides by (ARCHITECTURE.md section 7,
// "Tenants").
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_TENANCY_CALLER_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_TENANCY_CALLER_H_

#include <string>
#include <utility>

namespace offload {

// The tenant of the operator's tokens (--token_file, $OFFLOAD_TOKEN), of jobs stored before there
// were tenants, and of every call when authentication is off.
inline constexpr char kOperatorTenant[] = "default";

struct Caller {
  // False: the call carried no token this controller accepts. The controller refuses it
  // (UNAUTHENTICATED) and writes the attempt to the audit log.
  bool authenticated = false;
  std::string tenant;   // empty when not authenticated
  bool admin = false;   // sees and acts on every tenant's jobs, reads the audit log
  bool worker = false;  // may use the WorkerService (the operator's tokens only)

  // The operator: what every call is when authentication is off, and what tests act as.
  static Caller Operator() { return {true, kOperatorTenant, true, true}; }
  static Caller Tenant(std::string name) { return {true, std::move(name), false, false}; }
};

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_TENANCY_CALLER_H_
