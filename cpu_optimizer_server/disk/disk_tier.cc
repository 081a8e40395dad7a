#include "cpu_optimizer_server/disk/disk_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/thread_pool.h"

namespace offload {

namespace {

constexpr char kServerDirPrefix[] = "server-";
constexpr char kLockName[] = "lock";
constexpr char kRootLockName[] = ".lock";
constexpr absl::Duration kRootLockWait = absl::Seconds(60);

// Removes the directories under `state_dir` of servers that are gone: whoever made one holds
// its lock until it exits, so a lock we can take belongs to nobody. Runs under the root's lock,
// as every claim does, so a directory without a lock file is one whose maker died making it.
void RemoveAbandonedDirs(const std::filesystem::path& state_dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(state_dir, ec)) {
    if (!entry.is_directory(ec) ||
        !absl::StartsWith(entry.path().filename().string(), kServerDirPrefix)) {
      continue;
    }
    const std::string lock = (entry.path() / kLockName).string();
    const int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) std::filesystem::remove_all(entry.path(), ec);
      continue;
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) std::filesystem::remove_all(entry.path(), ec);
    ::close(fd);
  }
}

// The lock on the state root, held while a server sweeps it and claims a directory of its own.
// Without it a sibling starting at the same moment could find the new directory between its
// creation and its owner's flock, take the free lock and remove a live server's state.
absl::StatusOr<int> LockRoot(const std::filesystem::path& root) {
  const std::string path = (root / kRootLockName).string();
  // Read-only is enough for flock, and lets servers of other users share the root.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  // Claims take milliseconds; a holder stuck for a minute is hung, and waiting on forever would
  // hang this server's start with it.
  const absl::Time deadline = absl::Now() + kRootLockWait;
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if ((err != EWOULDBLOCK && err != EINTR) || absl::Now() > deadline) {
      ::close(fd);
      return absl::FailedPreconditionError(
          absl::StrCat("cannot lock ", path, ": ",
                       err == EWOULDBLOCK ? absl::StrCat("another server has held it for over ",
                                                         absl::FormatDuration(kRootLockWait))
                                          : std::strerror(err)));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return fd;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Open(const DiskTierOptions& options) {
  if (options.state_dir.empty()) return absl::InvalidArgumentError("--state_dir is empty");
  const int64_t wave =
      std::max<int64_t>(kTileElements, options.wave_elements / kTileElements * kTileElements);
  const int64_t slot_bytes = kStateTensors * wave * 4;
  const int64_t slots = options.memory_bytes / slot_bytes;
  if (slots < kMinStateSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("--state_memory_mib=", options.memory_bytes >> 20, " holds ", slots,
                     " slots of one wave's state (", slot_bytes >> 20, " MiB each: ", wave,
                     " elements of master, exp_avg and exp_avg_sq); the disk tier needs at least ",
                     kMinStateSlots, ", so at least ",
                     (kMinStateSlots * slot_bytes + (1 << 20) - 1) >> 20, " MiB"));
  }
  std::error_code ec;
  const std::filesystem::path root(options.state_dir);
  std::filesystem::create_directories(root, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot make --state_dir ", options.state_dir, ": ", ec.message()));
  }
  absl::StatusOr<int> root_fd = LockRoot(root);
  if (!root_fd.ok()) return root_fd.status();
  RemoveAbandonedDirs(root);
  // mkdtemp: a name no sibling has, made atomically.
  std::string dir_name = (root / absl::StrCat(kServerDirPrefix, ::getpid(), "-XXXXXX")).string();
  if (::mkdtemp(dir_name.data()) == nullptr) {
    const int err = errno;
    ::close(*root_fd);
    return absl::FailedPreconditionError(
        absl::StrCat("cannot make ", dir_name, ": ", std::strerror(err)));
  }
  const std::filesystem::path dir(dir_name);
  const std::string lock = (dir / kLockName).string();
  const int lock_fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  const bool locked = lock_fd >= 0 && ::flock(lock_fd, LOCK_EX | LOCK_NB) == 0;
  const int lock_err = errno;
  ::close(*root_fd);  // the directory is claimed: a sweep now finds its lock taken
  if (!locked) {
    if (lock_fd >= 0) ::close(lock_fd);
    std::filesystem::remove_all(dir, ec);
    return absl::FailedPreconditionError(
        absl::StrCat("cannot lock ", lock, ": ", std::strerror(lock_err)));
  }
  auto fail = [&](absl::Status s) {
    ::close(lock_fd);
    std::filesystem::remove_all(dir, ec);
    return s;
  };
  // Memory for the ring is touched now, so the server's footprint is what it is from the start.
  absl::StatusOr<HostBuffer> ring = HostBuffer::Allocate(slots * slot_bytes);
  if (!ring.ok()) return fail(ring.status());
  std::memset(ring->data(), 0, static_cast<size_t>(ring->size()));
  // Each slot has at most its three tensors' transfers in flight.
  absl::StatusOr<std::unique_ptr<IoRing>> io = IoRing::Create(static_cast<int>(slots) * 3);
  if (!io.ok()) return fail(io.status());
  return std::unique_ptr<DiskTier>(new DiskTier(dir.string(), lock_fd, *std::move(ring),
                                                static_cast<int>(slots), wave, *std::move(io)));
}

DiskTier::~DiskTier() {
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
  ::close(lock_fd_);
}

int64_t DiskTier::FreeBytes() const {
  struct statvfs st;
  if (::statvfs(dir_.c_str(), &st) != 0) return -1;
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

absl::StatusOr<std::unique_ptr<StateFile>> DiskTier::CreateStateFile(const std::string& job_id,
                                                                     int range_index,
                                                                     int64_t length, bool staging,
                                                                     DType moments) {
  const std::string path =
      absl::StrCat(dir_, "/", job_id, ".range-", range_index,
                   staging ? absl::StrCat(".load-", next_file_.fetch_add(1)) : "", ".state");
  if (!staging) {
    const int64_t need = StateFileBytes(length, moments);
    const int64_t free_bytes = FreeBytes();
    if (free_bytes >= 0 && need > free_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "range ", range_index, " of job ", job_id, " needs ", need,
          " bytes of optimizer state on disk but ", dir_, " has ", free_bytes, " bytes free"));
    }
  }
  return StateFile::Create(path, length, /*sparse=*/staging, moments);
}

}  // namespace offload
