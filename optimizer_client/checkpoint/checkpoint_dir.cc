#include "optimizer_client/checkpoint/checkpoint_dir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "optimizer_client/checkpoint/atomic_file.h"
#include "optimizer_client/checkpoint/manifest.h"

namespace offload {

namespace {

constexpr char kStagingSuffix[] = ".tmp";

// "step-<digits>" exactly: staging dirs (".tmp") and anything else in root are not checkpoints.
bool ParseStepDirName(absl::string_view name, uint64_t* step) {
  if (!absl::ConsumePrefix(&name, "step-") || name.empty()) return false;
  for (char c : name) {
    if (c < '0' || c > '9') return false;
  }
  return absl::SimpleAtoi(name, step);
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

absl::Status MakeDirs(const std::string& path) {
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    const std::string prefix = path.substr(0, pos);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::ErrnoToStatus(errno, absl::StrCat("cannot create directory ", prefix));
    }
  }
  if (!IsDirectory(path)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " exists and is not a directory"));
  }
  return absl::OkStatus();
}

// Calls fn(name) for each entry of dir except "." and "..".
absl::Status ForEachEntry(const std::string& dir,
                          const std::function<absl::Status(const std::string&)>& fn) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return absl::ErrnoToStatus(errno, absl::StrCat("cannot list ", dir));
  std::vector<std::string> names;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  // Collected first: fn may remove entries, which readdir does not promise to tolerate.
  for (const std::string& name : names) {
    OFFLOAD_RETURN_IF_ERROR(fn(name));
  }
  return absl::OkStatus();
}

absl::Status RemoveTree(const std::string& path) {
  if (IsDirectory(path)) {
    absl::Status s = ForEachEntry(
        path, [&](const std::string& name) { return RemoveTree(absl::StrCat(path, "/", name)); });
    if (!s.ok()) return s;
    if (rmdir(path.c_str()) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("rmdir ", path));
    return absl::OkStatus();
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot remove ", path));
  }
  return absl::OkStatus();
}

// The step dir `latest` names ("" when there is no latest file).
absl::StatusOr<std::string> LatestName(const std::string& root) {
  const std::string latest = absl::StrCat(root, "/", kLatestFileName);
  absl::StatusOr<std::string> text = ReadWholeFile(latest);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) return std::string();
    return text.status();
  }
  const std::string name(absl::StripAsciiWhitespace(*text));
  uint64_t step;
  if (!ParseStepDirName(name, &step)) {
    return absl::DataLossError(
        absl::StrCat(latest, " holds '", name, "', not a step directory name like step-00000100"));
  }
  return name;
}

}  // namespace

std::string StepDirName(uint64_t step) { return absl::StrFormat("step-%08d", step); }

absl::StatusOr<CheckpointStaging> CheckpointStaging::Begin(const std::string& root, uint64_t step) {
  if (root.empty()) return absl::InvalidArgumentError("checkpoint root is empty");
  OFFLOAD_RETURN_IF_ERROR(MakeDirs(root));
  // A staging dir only exists while a writer runs or after it crashed, and there is one writer
  // per root, so every one found now is debris.
  absl::Status cleaned = ForEachEntry(root, [&](const std::string& name) {
    uint64_t unused;
    absl::string_view stem = name;
    if (!absl::ConsumeSuffix(&stem, kStagingSuffix) || !ParseStepDirName(stem, &unused)) {
      return absl::OkStatus();
    }
    return RemoveTree(absl::StrCat(root, "/", name));
  });
  if (!cleaned.ok()) return cleaned;
  std::string staging = absl::StrCat(root, "/", StepDirName(step), kStagingSuffix);
  if (mkdir(staging.c_str(), 0755) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot create staging dir ", staging));
  }
  return CheckpointStaging(root, step, std::move(staging));
}

std::string CheckpointStaging::PathOf(absl::string_view file) const {
  return absl::StrCat(staging_dir_, "/", file);
}

absl::StatusOr<std::string> CheckpointStaging::Commit(const v1::CheckpointManifest& manifest,
                                                      int keep) {
  OFFLOAD_RETURN_IF_ERROR(ValidateManifest(manifest));
  if (manifest.step() != step_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "manifest says step ", manifest.step(), " but this checkpoint was begun for step ", step_));
  }
  std::vector<std::string> named = {manifest.model_file()};
  for (const v1::ShardFile& f : manifest.shard_files()) named.push_back(f.file());
  return Commit(ManifestToJson(manifest), named, keep);
}

absl::StatusOr<std::string> CheckpointStaging::Commit(const std::string& manifest_json,
                                                      const std::vector<std::string>& files,
                                                      int keep) {
  if (committed_) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint of step ", step_, " in ", root_, " is already committed"));
  }
  if (keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("keep is ", keep, "; at least 1 checkpoint must stay"));
  }
  for (const std::string& file : files) {
    struct stat st;
    if (stat(PathOf(file).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the manifest names ", file, " but ", PathOf(file), " was not written"));
    }
  }
  OFFLOAD_RETURN_IF_ERROR(WriteFileAtomic(PathOf(kManifestFileName), manifest_json));
  // Writers may not have fsynced their files; the rename below must not become durable before
  // the data it publishes.
  absl::Status synced =
      ForEachEntry(staging_dir_, [&](const std::string& name) { return FsyncPath(PathOf(name)); });
  if (!synced.ok()) return synced;
  OFFLOAD_RETURN_IF_ERROR(FsyncPath(staging_dir_));

  const std::string name = StepDirName(step_);
  const std::string final_dir = absl::StrCat(root_, "/", name);
  if (IsDirectory(final_dir)) {
    // The same step checkpointed again (e.g. a run rewound to it). If it is the current
    // checkpoint, swap the two dirs in one atomic step so `latest` never names a missing dir;
    // otherwise nothing reads it and it can simply go.
    OFFLOAD_ASSIGN_OR_RETURN(std::string current, LatestName(root_));
    if (current == name) {
      if (renameat2(AT_FDCWD, staging_dir_.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) !=
          0) {
        return absl::ErrnoToStatus(errno,
                                   absl::StrCat("cannot atomically replace ", final_dir,
                                                ", the current checkpoint, with ", staging_dir_));
      }
      OFFLOAD_RETURN_IF_ERROR(FsyncPath(root_));
      OFFLOAD_RETURN_IF_ERROR(RemoveTree(staging_dir_));  // now the old contents
    } else {
      OFFLOAD_RETURN_IF_ERROR(RemoveTree(final_dir));
    }
  }
  if (IsDirectory(staging_dir_) && rename(staging_dir_.c_str(), final_dir.c_str()) != 0) {
    return absl::ErrnoToStatus(errno,
                               absl::StrCat("cannot rename ", staging_dir_, " to ", final_dir));
  }
  OFFLOAD_RETURN_IF_ERROR(FsyncPath(root_));
  OFFLOAD_RETURN_IF_ERROR(WriteFileAtomic(absl::StrCat(root_, "/", kLatestFileName), name + "\n"));
  committed_ = true;

  // Pruning last: until `latest` moved on, the older checkpoints were still the current one.
  std::vector<std::pair<uint64_t, std::string>> older;
  absl::Status pruned = ForEachEntry(root_, [&](const std::string& entry) {
    uint64_t s;
    if (ParseStepDirName(entry, &s) && s < step_ && IsDirectory(absl::StrCat(root_, "/", entry))) {
      older.push_back({s, entry});
    }
    return absl::OkStatus();
  });
  std::sort(older.begin(), older.end(), std::greater<>());
  for (size_t i = static_cast<size_t>(keep - 1); pruned.ok() && i < older.size(); ++i) {
    pruned = RemoveTree(absl::StrCat(root_, "/", older[i].second));
  }
  if (!pruned.ok()) {
    // Say so: the caller must not mistake this for a checkpoint that failed to save.
    return absl::Status(
        pruned.code(),
        absl::StrCat("checkpoint ", final_dir,
                     " is committed, but removing older ones failed: ", pruned.message()));
  }
  return final_dir;
}

absl::StatusOr<std::string> LatestCheckpointDir(const std::string& root) {
  OFFLOAD_ASSIGN_OR_RETURN(std::string name, LatestName(root));
  if (name.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no checkpoint in ", root, " yet (no ", kLatestFileName, " file)"));
  }
  std::string dir = absl::StrCat(root, "/", name);
  if (!IsDirectory(dir)) {
    return absl::DataLossError(
        absl::StrCat(root, "/", kLatestFileName, " names ", name, " but ", dir, " is missing"));
  }
  return dir;
}

absl::Status VerifyFileDigest(const std::string& path, const v1::FileDigest& digest) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("cannot stat ", path));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size != digest.bytes()) {
    close(fd);
    return absl::DataLossError(absl::StrCat(
        "checkpoint file ", path, " is ", size, " bytes but the manifest records ", digest.bytes(),
        ": it was ", size < digest.bytes() ? "truncated" : "extended", " after it was written"));
  }
  posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // a hint: failure changes nothing
  std::vector<char> buf(size_t{4} << 20);          // bounded: shard files can be many GB
  uint32_t crc = 0;                                // zlib's CRC-32 of nothing
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n = read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      close(fd);
      if (n < 0) return absl::ErrnoToStatus(err, absl::StrCat("cannot read ", path));
      return absl::DataLossError(absl::StrCat("checkpoint file ", path, " ended after ", done,
                                              " of its ", size, " bytes while it was verified"));
    }
    crc = Crc32Update(crc, buf.data(), n);
    done += static_cast<uint64_t>(n);
  }
  close(fd);
  if (crc != digest.crc32()) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint file %s has CRC-32 %08x but the manifest records %08x: its contents changed "
        "after it was written",
        path, crc, digest.crc32()));
  }
  return absl::OkStatus();
}

absl::Status VerifyCheckpointFiles(const std::string& checkpoint_dir,
                                   const v1::CheckpointManifest& manifest) {
  if (manifest.has_model_file_digest()) {
    OFFLOAD_RETURN_IF_ERROR(VerifyFileDigest(
        absl::StrCat(checkpoint_dir, "/", manifest.model_file()), manifest.model_file_digest()));
  }
  for (const v1::ShardFile& file : manifest.shard_files()) {
    if (!file.has_digest()) continue;
    OFFLOAD_RETURN_IF_ERROR(
        VerifyFileDigest(absl::StrCat(checkpoint_dir, "/", file.file()), file.digest()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CheckpointManifest> ReadManifest(const std::string& checkpoint_dir) {
  const std::string path = absl::StrCat(checkpoint_dir, "/", kManifestFileName);
  OFFLOAD_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path));
  absl::StatusOr<v1::CheckpointManifest> m = ParseManifestJson(text);
  if (!m.ok()) {
    return absl::Status(m.status().code(), absl::StrCat(path, ": ", m.status().message()));
  }
  return m;
}

}  // namespace offload
