// The attachments of one data plane's client (shm, UCX), one per (job, range), kept across steps.
//
// One rule for every plane: an attachment is made on first use, outside the lock, so other
// ranges' steps go on while one range attaches; when two threads race to attach the same range,
// the first to finish is kept and the other's attachment is dropped, so all of a range's streams
// share one. A cached attachment that is no longer usable (its shard went away) is replaced on the
// next use. Attachments are destroyed outside the lock: their teardown waits on the network.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_ATTACHMENT_CACHE_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_ATTACHMENT_CACHE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "base/status_macros.h"

namespace offload {

template <typename Attachment>
class AttachmentCache {
 public:
  ~AttachmentCache() { Clear(); }

  // The attachment of (job_id, range_index): the cached one while usable(const Attachment&) says
  // so, else the one attach() makes.
  template <typename Usable, typename Attach>
  absl::StatusOr<std::shared_ptr<Attachment>> Get(const std::string& job_id, uint32_t range_index,
                                                  Usable usable, Attach attach) {
    const Key key(job_id, range_index);
    std::shared_ptr<Attachment> stale;  // destroyed outside the lock
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = attachments_.find(key);
      if (it != attachments_.end()) {
        if (usable(*it->second)) return it->second;
        stale = std::move(it->second);
        attachments_.erase(it);
      }
    }
    stale.reset();
    OFFLOAD_ASSIGN_OR_RETURN(std::shared_ptr<Attachment> made, attach());
    std::shared_ptr<Attachment> kept;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto [it, inserted] = attachments_.emplace(key, made);
      kept = it->second;
      if (!inserted) stale = std::move(made);
    }
    return kept;  // `stale`, a race's loser, goes here, outside the lock
  }

  // Drops every attachment (before what they use, e.g. a UCX worker, goes away).
  void Clear() {
    std::map<Key, std::shared_ptr<Attachment>> attachments;
    {
      std::lock_guard<std::mutex> lock(mu_);
      attachments.swap(attachments_);
    }
  }

 private:
  using Key = std::pair<std::string, uint32_t>;
  std::mutex mu_;
  std::map<Key, std::shared_ptr<Attachment>> attachments_;  // guarded by mu_
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_ATTACHMENT_CACHE_H_
