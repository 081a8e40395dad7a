// The trainer's end of a data plane's gRPC Attach stream (data_plane.h): the set-up exchange, then
// a watcher thread blocked in Read for as long as the attachment lives. The shard sends nothing
// after AttachReady, so the watcher returns only when the stream ends: that is how the trainer
// learns its shard went away, whatever the data plane.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_ATTACH_CLIENT_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_ATTACH_CLIENT_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/optimizer.grpc.pb.h"

namespace offload {

class AttachClient {
 public:
  // Opens the Attach stream to the shard behind `control`. `what` names the attachment in errors
  // ("the shm Attach stream").
  AttachClient(ShardClient* control, std::string what);
  // Cancels the stream if it is still open (the shard drops the attachment) and joins the
  // watcher.
  ~AttachClient();
  AttachClient(const AttachClient&) = delete;
  AttachClient& operator=(const AttachClient&) = delete;

  // One message of the set-up exchange each way. When the stream has ended, the status it ended
  // with, or UNAVAILABLE saying it ended `before` what was due. Receive waits at most the
  // client's attach_setup_timeout, then cancels the stream (DEADLINE_EXCEEDED).
  absl::Status Send(const v1::AttachRequest& request, absl::string_view before);
  absl::StatusOr<v1::AttachResponse> Receive(absl::string_view before);
  // Gives up during set-up: cancels and finishes the stream.
  void Cancel();
  // Ends the stream in order (a probe that is done); its final status.
  absl::Status Close();

  // After set-up: on_end runs once, on the watcher thread, with the status the stream ended with.
  void Watch(std::function<void(const grpc::Status&)> on_end);

 private:
  absl::Status Ended(absl::string_view before);

  const std::string what_;
  const absl::Duration setup_timeout_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>> stream_;
  std::thread watcher_;
  bool finished_ = false;  // Finish() was called (by this thread; the watcher's is joined)
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_ATTACH_CLIENT_H_
