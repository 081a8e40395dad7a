#include "cpu_optimizer_server/grpc/attach_client.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/grpc_status.h"
#include "base/watchdog.h"

namespace offload {

AttachClient::AttachClient(ShardClient* control, std::string what)
    : what_(std::move(what)),
      setup_timeout_(control->options().attach_setup_timeout),
      stream_(control->Attach(&context_)) {}

AttachClient::~AttachClient() {
  if (finished_) return;
  context_.TryCancel();
  if (watcher_.joinable()) {
    watcher_.join();  // it finishes the stream
  } else {
    stream_->Finish();
  }
}

absl::Status AttachClient::Ended(absl::string_view before) {
  finished_ = true;
  absl::Status s = FromGrpcStatus(stream_->Finish());
  if (!s.ok()) return s;
  return absl::UnavailableError(absl::StrCat("the shard ended ", what_, " before ", before));
}

absl::Status AttachClient::Send(const v1::AttachRequest& request, absl::string_view before) {
  if (finished_) return absl::FailedPreconditionError(absl::StrCat(what_, " has ended"));
  if (!stream_->Write(request)) return Ended(before);
  return absl::OkStatus();
}

absl::StatusOr<v1::AttachResponse> AttachClient::Receive(absl::string_view before) {
  if (finished_) return absl::FailedPreconditionError(absl::StrCat(what_, " has ended"));
  v1::AttachResponse response;
  Watchdog watchdog(setup_timeout_, [this] { context_.TryCancel(); });
  const bool received = stream_->Read(&response);
  if (!watchdog.Disarm()) {
    finished_ = true;
    stream_->Finish();
    return absl::DeadlineExceededError(absl::StrCat("the shard did not answer ", what_, " before ",
                                                    before, " within ",
                                                    absl::FormatDuration(setup_timeout_)));
  }
  if (!received) return Ended(before);
  return response;
}

void AttachClient::Cancel() {
  if (finished_) return;
  context_.TryCancel();
  stream_->Finish();
  finished_ = true;
}

absl::Status AttachClient::Close() {
  if (finished_) return absl::OkStatus();
  stream_->WritesDone();
  finished_ = true;
  return FromGrpcStatus(stream_->Finish());
}

void AttachClient::Watch(std::function<void(const grpc::Status&)> on_end) {
  watcher_ = std::thread([this, on_end = std::move(on_end)] {
    v1::AttachResponse ignored;
    while (stream_->Read(&ignored)) {
    }
    on_end(stream_->Finish());
  });
}

}  // namespace offload
