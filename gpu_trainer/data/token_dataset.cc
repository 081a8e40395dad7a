#include "gpu_trainer/data/token_dataset.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {

namespace {

constexpr int64_t kShardHeaderBytes = kTokenShardHeaderInts * 4;

// An open file that closes itself, so every early return below stays leak-free.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads exactly nbytes at offset, or says how many bytes were there.
absl::Status ReadExact(int fd, const std::string& path, int64_t offset, int64_t nbytes, void* out) {
  char* p = static_cast<char*>(out);
  for (int64_t done = 0; done < nbytes;) {
    const ssize_t n =
        pread(fd, p + done, static_cast<size_t>(std::min<int64_t>(nbytes - done, 1 << 30)),
              offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot read ", path));
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path, ": file ended after ", offset + done,
                                              " bytes, expected ", offset + nbytes));
    }
    done += n;
  }
  return absl::OkStatus();
}

// Opens path and returns its size.
absl::StatusOr<int64_t> OpenSized(const std::string& path, int* fd) {
  *fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (*fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open data file ", path));
  struct stat st;
  if (fstat(*fd, &st) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot stat ", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  return static_cast<int64_t>(st.st_size);
}

int32_t LoadLe32(const uint8_t* p) {
  return static_cast<int32_t>(uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 |
                              uint32_t{p[3]} << 24);
}

// Appends one shard's tokens to out after checking its header against its size.
absl::Status AppendShard(const std::string& path, std::vector<uint16_t>* out) {
  int raw_fd = -1;
  absl::StatusOr<int64_t> size = OpenSized(path, &raw_fd);
  Fd fd(raw_fd);
  if (!size.ok()) return size.status();
  if (*size < kShardHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": truncated header: expected a ", kShardHeaderBytes,
                     "-byte header (256 int32), found a file of ", *size, " bytes"));
  }
  uint8_t header[kShardHeaderBytes];
  OFFLOAD_RETURN_IF_ERROR(ReadExact(fd.get(), path, 0, kShardHeaderBytes, header));
  const int32_t magic = LoadLe32(header);
  const int32_t version = LoadLe32(header + 4);
  const int32_t count = LoadLe32(header + 8);
  if (magic != kTokenShardMagic) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": bad magic: expected ", kTokenShardMagic,
                                                   " (llm.c token shard), found ", magic));
  }
  if (version != kTokenShardVersion) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": unsupported version: expected ",
                                                   kTokenShardVersion, ", found ", version));
  }
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": bad token count: expected >= 0, found ", count));
  }
  const int64_t want = kShardHeaderBytes + 2 * int64_t{count};
  if (*size != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": bad size: the header says ", count, " tokens, so expected ", want,
                     " bytes (1024 + 2*", count, "), found ", *size, " bytes"));
  }
  const size_t at = out->size();
  out->resize(at + static_cast<size_t>(count));
  if (absl::Status s =
          ReadExact(fd.get(), path, kShardHeaderBytes, 2 * int64_t{count}, out->data() + at);
      !s.ok()) {
    return s;
  }
  // The format is little endian; so are the machines this runs on.
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token shards are little endian");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TokenDataset> TokenDataset::FromTextFile(const std::string& path) {
  int raw_fd = -1;
  absl::StatusOr<int64_t> size = OpenSized(path, &raw_fd);
  Fd fd(raw_fd);
  if (!size.ok()) return size.status();
  if (*size == 0) return absl::InvalidArgumentError(absl::StrCat("text file ", path, " is empty"));
  std::vector<uint8_t> bytes(static_cast<size_t>(*size));
  OFFLOAD_RETURN_IF_ERROR(ReadExact(fd.get(), path, 0, *size, bytes.data()));
  return TokenDataset(std::vector<uint16_t>(bytes.begin(), bytes.end()), 256);
}

absl::StatusOr<TokenDataset> TokenDataset::FromTokenShards(const std::vector<std::string>& paths) {
  if (paths.empty()) return absl::InvalidArgumentError("no token shards given");
  std::vector<uint16_t> tokens;
  for (const std::string& path : paths) {
    OFFLOAD_RETURN_IF_ERROR(AppendShard(path, &tokens));
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", paths.size(), " token shard(s) starting with ", paths[0], " hold no tokens"));
  }
  const uint16_t max_token = *std::max_element(tokens.begin(), tokens.end());
  return TokenDataset(std::move(tokens), std::max(kGpt2VocabSize, int{max_token} + 1));
}

absl::StatusOr<TokenDataset> TokenDataset::Open(const std::string& spec) {
  if (spec.find_first_of("*?[") != std::string::npos) {
    glob_t g;
    const int rc = glob(spec.c_str(), 0, nullptr, &g);  // glob sorts its matches
    if (rc == GLOB_NOMATCH) {
      return absl::NotFoundError(absl::StrCat("no file matches the data pattern ", spec));
    }
    if (rc != 0) {
      globfree(&g);
      return absl::InternalError(absl::StrCat("glob of ", spec, " failed (code ", rc, ")"));
    }
    std::vector<std::string> paths(g.gl_pathv, g.gl_pathv + g.gl_pathc);
    globfree(&g);
    return FromTokenShards(paths);
  }
  if (absl::EndsWith(spec, ".bin")) return FromTokenShards({spec});
  return FromTextFile(spec);
}

absl::StatusOr<std::pair<TokenSpan, TokenSpan>> SplitTrainVal(const TokenDataset& d,
                                                              double val_fraction, int seq_len) {
  if (!(val_fraction > 0 && val_fraction < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("val_fraction is ", val_fraction, "; expected a value in (0, 1)"));
  }
  if (seq_len < 1) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len is ", seq_len, "; expected >= 1"));
  }
  const int64_t val =
      static_cast<int64_t>(std::floor(static_cast<double>(d.size()) * val_fraction));
  const int64_t train = d.size() - val;
  const int64_t need = int64_t{seq_len} + 1;
  if (train < need || val < need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a ", val_fraction, " validation split of ", d.size(), " tokens leaves ", train,
        " train and ", val, " validation tokens; each side needs at least seq_len + 1 = ", need));
  }
  return std::make_pair(TokenSpan{d.tokens(), train}, TokenSpan{d.tokens() + train, val});
}

}  // namespace offload
