// Tenants and their tokens (ARCHITECTURE.md section 7, "Tenants"): the tenants file, its reload
// without a restart, and which Caller a bearer token stands for.
//
// The tenants file is JSON (tenants.proto's TenantsFile):
//   {"tenants": [{"name": "vision", "weight": 2, "max_optimizer_servers": 4, "max_ranks": 8,
//                 "max_running_jobs": 3, "admin": false, "tokens": ["4f2c..."],
//                 "certificate_names": ["vision-ci"]}]}
// A caller is the tenant of its bearer token, or without one, under mutual TLS, the tenant that
// lists its client certificate's common name.
// The operator's tokens (--token_file, $OFFLOAD_TOKEN) are tenant "default", admin, and the only
// ones the WorkerService accepts; the file may list "default" too, for its weight and quotas.
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_TENANCY_IDENTITIES_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_TENANCY_IDENTITIES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "base/security/security.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/tenants.pb.h"
#include "services/job_controller/tenancy/caller.h"

namespace offload {

struct TenantTable {
  std::vector<v1::TenantConfig> tenants;  // weight 0 read as 1
  // nullptr when the table does not list `name`.
  const v1::TenantConfig* Find(absl::string_view name) const;
};

// Parses a tenants file's text. INVALID_ARGUMENT naming `source` and the entry for JSON that does
// not parse, an unknown key, a bad name or number, a tenant listed twice, a token listed twice or
// shorter than 16 characters. Messages never quote a token.
absl::StatusOr<TenantTable> ParseTenants(absl::string_view text, absl::string_view source);

class Identities {
 public:
  // `operator_tokens` empty and no tenants: authentication is off, every caller is the operator.
  // A tenants file that is missing (or empty) lists no tenant: only the operator's tokens work
  // until it appears. One that cannot be read or parsed is an error here; later, at Reload, it
  // only keeps the last good table.
  static absl::StatusOr<std::unique_ptr<Identities>> Create(BearerTokens operator_tokens,
                                                            std::string tenants_file);

  // The same with a table given here instead of a file (tests, the REST fuzzer); Reload does
  // nothing.
  static std::unique_ptr<Identities> WithTable(BearerTokens operator_tokens, TenantTable table);

  // The caller a token stands for; not authenticated when it is none of them. The time taken does
  // not depend on which token matched, or where a wrong one differs.
  Caller IdentifyToken(absl::string_view token) const ABSL_LOCKS_EXCLUDED(mu_);
  // The tenant whose certificate_names list `name` (a client certificate's verified common name).
  Caller IdentifyCertificate(absl::string_view name) const ABSL_LOCKS_EXCLUDED(mu_);
  // A REST request: its "authorization" value ("Bearer <token>"), else the verified client
  // certificate's name (VerifiedPeerName); a token, even a wrong one, takes precedence.
  Caller IdentifyAuthorization(absl::string_view authorization,
                               absl::string_view certificate_name = "") const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same for a gRPC call's "authorization" metadata and its peer's certificate.
  Caller Identify(const grpc::ServerContextBase& context) const ABSL_LOCKS_EXCLUDED(mu_);

  // Reads the tenants file again if its contents changed since the last read: true when a new
  // table took effect. A file that no longer reads or parses leaves the last good table in use and
  // returns the error, once per distinct error. OK (false) without a tenants file.
  absl::StatusOr<bool> Reload() ABSL_LOCKS_EXCLUDED(mu_);

  // The table in use (never null). Tenants it does not list have weight 1 and no quotas.
  std::shared_ptr<const TenantTable> table() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& tenants_file() const { return tenants_file_; }
  // Reloads since Create, by outcome; what the controller's metrics report.
  uint64_t reloads(bool ok) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Identities(BearerTokens operator_tokens, std::string tenants_file)
      : operator_tokens_(std::move(operator_tokens)), tenants_file_(std::move(tenants_file)) {}

  const BearerTokens operator_tokens_;
  const std::string tenants_file_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const TenantTable> table_ ABSL_GUARDED_BY(mu_);
  std::string last_text_ ABSL_GUARDED_BY(mu_);
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  uint64_t reloads_[2] ABSL_GUARDED_BY(mu_) = {};  // [failed, ok]
};

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_TENANCY_IDENTITIES_H_
