// A Gloo rendezvous store over the job controller's WorkerService (see controller_store.h).
#include "gpu_trainer/collectives/controller_store.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/security/security.h"
#include "gloo/common/error.h"

namespace offload {
namespace {

using Millis = std::chrono::milliseconds;

// Beyond the wait the controller is asked for: the controller answers DEADLINE_EXCEEDED itself
// when a key stays missing, and this deadline only ends a call to a controller that never answers.
constexpr Millis kCallSlack = std::chrono::seconds(5);

void SetDeadline(grpc::ClientContext* context, Millis after) {
  context->set_deadline(std::chrono::system_clock::now() + after);
  // A controller that is restarting (or not yet listening) is waited for within the deadline
  // instead of failing the rendezvous at once.
  context->set_wait_for_ready(true);
}

// Throws the failure of a rendezvous call the way Gloo's own stores do. A timeout says "timed
// out", which ConnectGloo reports as DEADLINE_EXCEEDED.
[[noreturn]] void Throw(const std::string& what, const grpc::Status& status) {
  const std::string code =
      absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()));
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    throw gloo::IoException(absl::StrCat(what, " timed out: ", code, ": ", status.error_message()));
  }
  throw gloo::IoException(absl::StrCat(what, " failed: ", code, ": ", status.error_message()));
}

}  // namespace

ControllerStore::ControllerStore(std::shared_ptr<grpc::Channel> channel, std::string token,
                                 v1::AttemptRef attempt, Millis timeout)
    : stub_(v1::WorkerService::NewStub(std::move(channel))),
      token_(std::move(token)),
      attempt_(std::move(attempt)),
      timeout_(timeout > Millis::zero() ? timeout : gloo::rendezvous::Store::kDefaultTimeout) {}

void ControllerStore::set(const std::string& key, const std::vector<char>& data) {
  v1::RendezvousSetRequest request;
  *request.mutable_attempt() = attempt_;
  request.set_key(key);
  request.set_value(data.data(), data.size());
  v1::RendezvousSetResponse response;
  grpc::ClientContext context;
  SetDeadline(&context, timeout_);
  AttachBearer(&context, token_);
  grpc::Status status = stub_->RendezvousSet(&context, request, &response);
  if (!status.ok()) Throw(absl::StrCat("controller rendezvous set of key ", key), status);
}

std::vector<char> ControllerStore::get(const std::string& key) {
  std::vector<std::string> values = Get({key}, timeout_);
  return std::vector<char>(values[0].begin(), values[0].end());
}

void ControllerStore::wait(const std::vector<std::string>& keys) { Get(keys, timeout_); }

void ControllerStore::wait(const std::vector<std::string>& keys, const Millis& timeout) {
  // Gloo's zero means "no timeout"; a rendezvous that waits forever would hang a trainer whose
  // peer died before it arrived, so it waits the store's timeout instead.
  Get(keys, timeout > Millis::zero() ? timeout : timeout_);
}

std::vector<std::string> ControllerStore::Get(const std::vector<std::string>& keys,
                                              Millis timeout) {
  const std::string what =
      absl::StrCat("controller rendezvous wait for key(s) ", absl::StrJoin(keys, ", "));
  v1::RendezvousGetRequest request;
  *request.mutable_attempt() = attempt_;
  for (const std::string& key : keys) request.add_keys(key);
  const int64_t timeout_ms = std::clamp<int64_t>(
      timeout.count(), 1, std::numeric_limits<uint32_t>::max() - kCallSlack.count());
  request.set_timeout_ms(static_cast<uint32_t>(timeout_ms));
  v1::RendezvousGetResponse response;
  grpc::ClientContext context;
  SetDeadline(&context, Millis(timeout_ms) + kCallSlack);
  AttachBearer(&context, token_);
  grpc::Status status = stub_->RendezvousGet(&context, request, &response);
  if (!status.ok()) Throw(absl::StrCat(what, " (", timeout_ms, " ms)"), status);
  if (response.values_size() != static_cast<int>(keys.size())) {
    throw gloo::IoException(absl::StrCat(what, ": the controller answered ", response.values_size(),
                                         " values for ", keys.size(), " keys"));
  }
  return std::vector<std::string>(std::make_move_iterator(response.mutable_values()->begin()),
                                  std::make_move_iterator(response.mutable_values()->end()));
}

}  // namespace offload
