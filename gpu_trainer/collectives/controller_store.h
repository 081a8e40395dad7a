// A Gloo rendezvous store kept by the job controller (WorkerService.RendezvousSet/Get,
// ARCHITECTURE.md section 7): trainer ranks of one job attempt meet through the controller they
// already talk to, so a pool needs no shared directory between machines. Pass it to ConnectGloo.
//
// Gloo's Store interface reports failures by throwing; so does this one, with gloo::IoException
// (ConnectGloo turns Gloo's exceptions into a Status). A timeout's message says "timed out", so
// ConnectGloo reports it as DEADLINE_EXCEEDED.
#ifndef OFFLOAD_GPU_TRAINER_COLLECTIVES_CONTROLLER_STORE_H_
#define OFFLOAD_GPU_TRAINER_COLLECTIVES_CONTROLLER_STORE_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gloo/rendezvous/store.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/worker.grpc.pb.h"

namespace offload {

class ControllerStore final : public gloo::rendezvous::Store {
 public:
  // channel: to the job controller. token: the bearer token sent with every call (none when
  // empty). attempt: the job attempt whose keys this store reads and writes. timeout: how long
  // get() and wait(keys) wait for missing keys, and how long set() may take.
  ControllerStore(std::shared_ptr<grpc::Channel> channel, std::string token, v1::AttemptRef attempt,
                  std::chrono::milliseconds timeout = gloo::rendezvous::Store::kDefaultTimeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  // Waits up to the store's timeout for the key.
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  // The values of keys, in order, once all are set; throws gloo::IoException otherwise.
  std::vector<std::string> Get(const std::vector<std::string>& keys,
                               std::chrono::milliseconds timeout);

  const std::unique_ptr<v1::WorkerService::Stub> stub_;
  const std::string token_;
  const v1::AttemptRef attempt_;
  const std::chrono::milliseconds timeout_;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_COLLECTIVES_CONTROLLER_STORE_H_
