#include "cpu_optimizer_server/grpc/shard_access.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace offload {

void ShardAccess::Grant(const std::string& job_id, std::string secret) {
  absl::MutexLock lock(&mu_);
  secrets_[job_id] = std::move(secret);
}

void ShardAccess::Revoke(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  secrets_.erase(job_id);
}

bool ShardAccess::IsOperator(const std::string& presented) const {
  return operator_tokens_.AcceptsToken(presented);
}

std::string ShardAccess::JobOfSecret(const std::string& presented) const {
  // Every secret is compared, without stopping at a match, so the time says nothing about which
  // (or whether one) matched.
  const std::string* owner = nullptr;
  for (const auto& [job_id, secret] : secrets_) {
    if (ConstantTimeEquals(presented, secret)) owner = &job_id;
  }
  return owner != nullptr ? *owner : std::string();
}

grpc::Status ShardAccess::CheckJob(const grpc::ServerContextBase& context,
                                   const std::string& job_id) const {
  const std::string presented = PresentedBearer(context);
  if (mode_ == Mode::kStandalone) {
    if (operator_tokens_.empty() || IsOperator(presented)) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid bearer token");
  }
  std::string owner;
  if (!presented.empty()) {
    absl::ReaderMutexLock lock(&mu_);
    owner = JobOfSecret(presented);
  }
  if (!owner.empty() && owner == job_id) return grpc::Status::OK;
  if (!owner.empty()) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("job ", job_id,
                                     " is not the job of the attempt whose credential this call "
                                     "carries (or is not assigned to this server)"));
  }
  if (IsOperator(presented)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("job ", job_id,
                                     ": calls about a job on a pool server need the credential of "
                                     "its attempt, which the controller gives its ranks; an "
                                     "operator token only describes the shard"));
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "missing or invalid bearer token (a pool server takes the credential of an "
                      "attempt assigned to it)");
}

grpc::Status ShardAccess::CheckCaller(const grpc::ServerContextBase& context,
                                      Caller* caller) const {
  const std::string presented = PresentedBearer(context);
  *caller = Caller();
  if (operator_tokens_.empty() || IsOperator(presented)) {
    caller->all_jobs = true;
    return grpc::Status::OK;
  }
  if (mode_ == Mode::kPool && !presented.empty()) {
    absl::ReaderMutexLock lock(&mu_);
    caller->job_id = JobOfSecret(presented);
    if (!caller->job_id.empty()) return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid bearer token");
}

}  // namespace offload
