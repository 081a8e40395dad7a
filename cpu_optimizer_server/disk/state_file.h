// One range's optimizer state on disk: the fp32 master weights, exp_avg and exp_avg_sq (fp32, or
// bf16 with JobConfig::state_dtype) of its `length` elements, one region each, every region
// starting on a kStateBlockBytes boundary so a wave of whole tiles moves with O_DIRECT. The file
// is scratch, not a format: it lives only as long as the job on this server (checkpoints stay
// safetensors, optimizer_client/checkpoint/), so it has no header and is unlinked when the job
// goes.
//
//   file: [ master (length,) fp32 | pad ][ exp_avg (length,) | pad ][ exp_avg_sq (length,) | pad ]
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_STATE_FILE_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_STATE_FILE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"

namespace offload {

// O_DIRECT needs buffer addresses, offsets and sizes in multiples of the device's logical block;
// 4 KiB covers every disk and file system in use.
inline constexpr int64_t kStateBlockBytes = 4096;
inline constexpr int kStateTensors = 3;  // master, exp_avg, exp_avg_sq (StateTensor's order)

// One tensor's region: `length` elements of `element_bytes`, padded to whole blocks.
inline int64_t StateRegionBytes(int64_t length, int element_bytes = 4) {
  return (length * element_bytes + kStateBlockBytes - 1) / kStateBlockBytes * kStateBlockBytes;
}
// What a range of `length` elements takes on disk, its moments in `moments` (fp32 or bf16).
inline int64_t StateFileBytes(int64_t length, DType moments = DType::kFp32) {
  return StateRegionBytes(length) + 2 * StateRegionBytes(length, DTypeSize(moments));
}

class StateFile {
 public:
  // Creates `path` with every block allocated (fallocate), so a step never meets a full disk:
  // a disk too small fails here, naming the file and both sizes, and leaves no file behind.
  // Allocated blocks read as zeros, the state of a new job. `sparse` allocates nothing (a load's
  // staging file, which holds only what the load sends).
  static absl::StatusOr<std::unique_ptr<StateFile>> Create(const std::string& path, int64_t length,
                                                           bool sparse = false,
                                                           DType moments = DType::kFp32);
  ~StateFile();  // closes and unlinks
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t length() const { return length_; }
  // The O_DIRECT descriptor, for the streaming passes (state_pass.h); a plain one where the file
  // system refuses O_DIRECT.
  int direct_fd() const { return direct_fd_; }
  DType moments() const { return moments_; }
  // Bytes of one element of `tensor`: 4 for the master, 4 or 2 for the moments.
  int ElementBytes(int tensor) const { return tensor == 0 ? 4 : DTypeSize(moments_); }
  int64_t TensorOffset(int tensor) const {
    return tensor == 0 ? 0
                       : StateRegionBytes(length_) +
                             (tensor - 1) * StateRegionBytes(length_, ElementBytes(tensor));
  }

  // Elements [begin, begin + n) of `tensor` as fp32, through the page cache: for reads of the
  // state (ReadState) and loads, which come in chunks of any alignment. bf16 moments are widened
  // exactly on the way in and rounded to nearest even on the way out. Errors name the file.
  absl::Status Read(int tensor, int64_t begin, int64_t n, float* out) const;
  absl::Status Write(int tensor, int64_t begin, int64_t n, const float* in);
  // Flushes the page cache's dirty pages of the file to disk, so a pass's O_DIRECT reads and a
  // full disk meet here and not later.
  absl::Status Sync();

 private:
  StateFile(std::string path, int64_t length, DType moments, int direct_fd, int buffered_fd)
      : path_(std::move(path)),
        length_(length),
        moments_(moments),
        direct_fd_(direct_fd),
        buffered_fd_(buffered_fd) {}

  // The raw bytes of elements [begin, begin + n) of `tensor`, in its own type.
  absl::Status ReadBytes(int tensor, int64_t begin, int64_t n, void* out) const;
  absl::Status WriteBytes(int tensor, int64_t begin, int64_t n, const void* in);

  const std::string path_;
  const int64_t length_;
  const DType moments_;
  const int direct_fd_;
  const int buffered_fd_;
};

// "master weights", "exp_avg", "exp_avg_sq": for messages.
const char* StateTensorName(int tensor);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_STATE_FILE_H_
