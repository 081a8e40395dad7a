// Who may call an optimizer shard, and for which jobs (ARCHITECTURE.md section 7). Every
// OptimizerShard RPC presents a bearer credential:
//   - a pool server (one that joined a controller) takes job calls only with the secret of the
//     attempt that owns the job: the controller derives one per attempt and hands it to that
//     attempt's ranks and shards, nobody else;
//   - a standalone server takes job calls with any of its operator tokens (--token_file,
//     $OFFLOAD_TOKEN), or from anyone when it runs with --allow_unauthenticated.
// Operator tokens are also what DescribeShard and probe attachments accept on a pool server; a
// caller holding only an attempt's secret sees that attempt's job and no other.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SHARD_ACCESS_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SHARD_ACCESS_H_

#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "base/security/security.h"
#include "grpcpp/grpcpp.h"

namespace offload {

class ShardAccess {
 public:
  enum class Mode {
    kStandalone,  // any job id, with an operator token (or none, when tokens are empty)
    kPool,        // only the jobs granted, each with its own secret
  };
  // Empty operator_tokens (the binary allows that only with --allow_unauthenticated): on a
  // standalone server every call is let in; on a pool server anyone may describe the shard, and
  // job calls still need their attempt's secret.
  ShardAccess(Mode mode, BearerTokens operator_tokens)
      : mode_(mode), operator_tokens_(std::move(operator_tokens)) {}

  // Pool servers: the attempt that owns shard job `job_id` may now call, presenting `secret`.
  void Grant(const std::string& job_id, std::string secret) ABSL_LOCKS_EXCLUDED(mu_);
  // Its calls are refused from now on (what is in flight finishes).
  void Revoke(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);

  // A call about `job_id`: OK; UNAUTHENTICATED without a credential this server knows;
  // PERMISSION_DENIED with another attempt's secret, or for a job not granted here (pool), or
  // with an operator token on a pool server. The messages never quote a credential.
  grpc::Status CheckJob(const grpc::ServerContextBase& context, const std::string& job_id) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // A call about no job (DescribeShard, a probe attachment): what the caller may see.
  struct Caller {
    bool all_jobs = false;  // an operator, or an open server
    std::string job_id;     // otherwise the one job whose secret it presented
    bool Sees(const std::string& id) const { return all_jobs || id == job_id; }
  };
  // UNAUTHENTICATED when the credential is neither an operator token nor a granted secret.
  grpc::Status CheckCaller(const grpc::ServerContextBase& context, Caller* caller) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  bool IsOperator(const std::string& presented) const;
  // The granted job whose secret equals `presented`, compared against every secret in constant
  // time; empty when none.
  std::string JobOfSecret(const std::string& presented) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const Mode mode_;
  const BearerTokens operator_tokens_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> secrets_ ABSL_GUARDED_BY(mu_);  // job id -> secret
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SHARD_ACCESS_H_
