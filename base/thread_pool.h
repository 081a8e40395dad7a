// A persistent pool of worker threads for the optimizer's data-parallel passes.
//
// Work is submitted as a "region": a function that every worker runs once with its own index.
// Regions from several callers queue and run one after another, so one pass never competes with
// another for the cores. Workers live as long as the pool: no thread start per step, and a
// worker may be pinned to a core so the memory it first touches stays on its NUMA node.
#ifndef OFFLOAD_BASE_THREAD_POOL_H_
#define OFFLOAD_BASE_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace offload {

class ThreadPool {
 public:
  struct Options {
    int num_threads = 0;  // 0: one per available core (per listed one with `cpus`)
    bool pin = false;     // pin worker i to the i-th CPU of the process's affinity mask
    // Non-empty: pin worker i to cpus[i % cpus.size()] instead (--optimizer_cores: the cores a
    // server keeps to itself beside a trainer on the same host).
    std::vector<int> cpus = {};
    // Workers are named "<name>-<i>" (the first 10 characters of name), as top -H and
    // /proc/<pid>/task/<tid>/comm show them.
    std::string name = "pool";
  };

  // A submitted region; Wait() returns once every worker has finished it.
  class Ticket {
   public:
    Ticket() = default;
    void Wait();
    bool valid() const { return region_ != nullptr; }

   private:
    friend class ThreadPool;
    struct Region;
    explicit Ticket(std::shared_ptr<Region> region) : region_(std::move(region)) {}
    std::shared_ptr<Region> region_;
  };

  explicit ThreadPool(const Options& options);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()); }

  // Queues fn(thread_index) for every worker and returns at once.
  Ticket RunAsync(std::function<void(int thread_index)> fn);
  // Queues and waits.
  void Run(std::function<void(int thread_index)> fn) { RunAsync(std::move(fn)).Wait(); }
  // Regions queued and not yet finished by every worker (for the queue depth metric).
  size_t queue_depth() const {
    std::lock_guard<std::mutex> lock(mu_);
    return queue_.size();
  }

 private:
  void WorkerLoop(int index);

  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::deque<std::shared_ptr<Ticket::Region>> queue_;  // guarded by mu_
  uint64_t generation_ = 0;                            // regions started so far; guarded by mu_
  bool stopping_ = false;                              // guarded by mu_
  std::vector<std::thread> workers_;
};

// Tiles: a range of a job is cut into fixed tiles of kTileElements counted from the range's first
// element; tile t belongs to worker t % num_threads. Every pass over the range, including the
// first touch of freshly allocated memory, uses this rule, so each worker always touches the same
// pages (NUMA locality) whatever sub-range a pass covers. 16384 elements is 64 KiB of fp32 per
// tensor: the 4 streams of the Adam pass for one tile sit in L2 together.
inline constexpr int64_t kTileElements = 16384;

// Calls fn(begin, end) for every piece of [begin, end) that lies in a tile owned by
// `thread_index`, in increasing order.
template <typename Fn>
void ForEachOwnedTile(int64_t begin, int64_t end, int thread_index, int num_threads, Fn&& fn) {
  if (begin >= end) return;
  int64_t tile = begin / kTileElements;
  // First tile at or after `tile` owned by this thread.
  tile += ((thread_index - tile % num_threads) + num_threads) % num_threads;
  for (; tile * kTileElements < end; tile += num_threads) {
    const int64_t lo = std::max(begin, tile * kTileElements);
    const int64_t hi = std::min(end, (tile + 1) * kTileElements);
    if (lo < hi) fn(lo, hi);
  }
}

}  // namespace offload

#endif  // OFFLOAD_BASE_THREAD_POOL_H_
