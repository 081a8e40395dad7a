#include "base/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "base/placement/cpu_list.h"

namespace offload {

struct ThreadPool::Ticket::Region {
  std::function<void(int)> fn;
  int remaining = 0;  // workers yet to finish; guarded by mu
  std::mutex mu;
  std::condition_variable done_cv;
};

void ThreadPool::Ticket::Wait() {
  if (!region_) return;
  std::unique_lock<std::mutex> lock(region_->mu);
  region_->done_cv.wait(lock, [&] { return region_->remaining == 0; });
}

ThreadPool::ThreadPool(const Options& options) {
  const std::vector<int> cpus = options.cpus.empty() ? AllowedCpus() : options.cpus;
  int n = options.num_threads;
  if (n <= 0) n = std::max<int>(1, static_cast<int>(cpus.size()));
  workers_.reserve(n);
  for (int i = 0; i < n; ++i) {
    workers_.emplace_back([this, i] { WorkerLoop(i); });
    // Linux keeps 15 characters of a thread's name.
    const std::string name = absl::StrCat(options.name.substr(0, 10), "-", i).substr(0, 15);
    pthread_setname_np(workers_.back().native_handle(), name.c_str());
    if ((options.pin || !options.cpus.empty()) && !cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[i % cpus.size()], &set);
      // Pinning is a locality hint: if the kernel refuses it the pool still works.
      if (pthread_setaffinity_np(workers_.back().native_handle(), sizeof(set), &set) != 0) {
        LOG(WARNING) << absl::StrFormat("%s:%d: could not pin worker %d to cpu %d", __FILE__,
                                        __LINE__, i, cpus[i % cpus.size()]);
      }
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

ThreadPool::Ticket ThreadPool::RunAsync(std::function<void(int)> fn) {
  auto region = std::make_shared<Ticket::Region>();
  region->fn = std::move(fn);
  region->remaining = num_threads();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(region);
  }
  work_cv_.notify_all();
  return Ticket(std::move(region));
}

// Every worker runs every region, in queue order. Worker i has run `seen` regions; the region it
// runs next is queue_[seen - popped], where `popped` counts regions all workers have finished and
// that were removed from the front. A region leaves the queue when its last worker finishes it.
void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    std::shared_ptr<Ticket::Region> region;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stopping_ || seen < generation_ + queue_.size(); });
      if (seen >= generation_ + queue_.size()) return;  // stopping with nothing left
      region = queue_[seen - generation_];
    }
    region->fn(index);
    ++seen;
    bool last;
    {
      std::lock_guard<std::mutex> lock(region->mu);
      last = --region->remaining == 0;
    }
    if (last) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        // Regions finish in order (every worker runs them in order), so this is the front.
        queue_.pop_front();
        ++generation_;
      }
      region->done_cv.notify_all();
    }
  }
}

}  // namespace offload
