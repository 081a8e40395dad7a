#include "optimizer_client/param_state/param_checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/dtype_proto.h"
#include "base/status_macros.h"
#include "optimizer_client/backends/state_load.h"
#include "optimizer_client/checkpoint/atomic_file.h"
#include "optimizer_client/checkpoint/checkpoint_dir.h"
#include "optimizer_client/checkpoint/manifest.h"
#include "optimizer_client/checkpoint/safetensors.h"
#include "optimizer_client/checkpoint/state_tensor_names.h"

namespace offload {
namespace {

// Bytes read from a checkpoint file per read(): what a load holds of the state at a time.
constexpr int64_t kLoadChunkBytes = int64_t{4} << 20;

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::vector<int64_t> ShapeOf(const v1::StateParam& p) {
  return std::vector<int64_t>(p.shape().begin(), p.shape().end());
}

// The checkpoint's parameters against this run's: the first of `params` (in their order) that
// the checkpoint lacks or holds with another shape, else the first of the checkpoint's that
// `params` lacks.
absl::Status MatchParams(const std::string& dir, const v1::ParamStateManifest& m,
                         const std::vector<NamedParam>& params) {
  std::map<std::string, const v1::StateParam*> saved;
  for (const v1::StateParam& p : m.params()) saved[p.name()] = &p;
  std::set<std::string> ours;
  for (size_t i = 0; i < params.size(); ++i) {
    const NamedParam& p = params[i];
    ours.insert(p.name);
    auto it = saved.find(p.name);
    if (it == saved.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint ", dir, " is not of this model: it has no parameter '", p.name,
                       "' (parameter ", i, " here, of shape ", Shape(p.shape), ")"));
    }
    if (ShapeOf(*it->second) != p.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint ", dir, " is not of this model: parameter '", p.name, "' has shape ",
          Shape(ShapeOf(*it->second)), " there but ", Shape(p.shape), " here"));
    }
  }
  for (const v1::StateParam& p : m.params()) {
    if (ours.count(p.name()) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint ", dir, " is not of this model: it has a parameter '", p.name(),
                       "' of shape ", Shape(ShapeOf(p)), " that this model lacks"));
    }
  }
  return absl::OkStatus();
}

// Streams one state file into `add`: each tensor's bytes at its parameter's flat offset, the
// file's CRC-32 computed over every byte on the way. DataLoss naming the file when its size or
// CRC is not the manifest's, or its tensors are not the manifest's parameters.
using AddValues = std::function<absl::Status(int64_t offset, const float* values, int64_t n)>;

absl::Status StreamStateFile(const std::string& path, const v1::FileDigest& digest,
                             const std::vector<NamedParam>& params, const AddValues& add) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::DataLossError(absl::StrCat("cannot stat ", path, ": ", strerror(errno)));
  }
  if (static_cast<uint64_t>(st.st_size) != digest.bytes()) {
    return absl::DataLossError(absl::StrCat(path, " has ", st.st_size,
                                            " bytes but the manifest recorded ", digest.bytes(),
                                            ": the file was cut short or replaced"));
  }
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> opened = SafetensorsReader::Open(path);
  if (!opened.ok()) return absl::DataLossError(opened.status().message());
  std::unique_ptr<SafetensorsReader> reader = std::move(*opened);
  std::map<std::string, const NamedParam*> by_name;
  for (const NamedParam& p : params) by_name[p.name] = &p;
  if (reader->entries().size() != params.size()) {
    return absl::DataLossError(absl::StrCat(path, " holds ", reader->entries().size(),
                                            " tensors but the manifest names ", params.size()));
  }
  for (const SafetensorsEntry& e : reader->entries()) {
    auto it = by_name.find(e.name);
    if (it == by_name.end() || e.dtype != TensorDType::kF32 || e.shape != it->second->shape) {
      return absl::DataLossError(absl::StrCat(path, ": tensor '", e.name, "' (",
                                              TensorDTypeName(e.dtype), " ", Shape(e.shape),
                                              ") is not a parameter of its manifest as F32"));
    }
  }
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  std::vector<char> buffer(static_cast<size_t>(kLoadChunkBytes));  // (4 MiB,) bytes
  uint32_t crc = 0;
  int64_t at = 0;  // file offset read so far
  // Reads file bytes [at, at + n) into buffer, continuing the CRC.
  auto read_next = [&](int64_t n) -> absl::Status {
    for (int64_t done = 0; done < n;) {
      const ssize_t got = pread(fd, buffer.data() + done, static_cast<size_t>(n - done), at + done);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot read ", path));
      if (got == 0) {
        return absl::DataLossError(absl::StrCat(path, " ended at byte ", at + done,
                                                " while being read (it changed under the load)"));
      }
      done += got;
    }
    crc = Crc32Update(crc, buffer.data(), n);
    at += n;
    return absl::OkStatus();
  };
  absl::Status status;
  // The header, for the CRC.
  for (int64_t left = reader->data_offset(); status.ok() && left > 0;) {
    const int64_t n = std::min(left, kLoadChunkBytes);
    status = read_next(n);
    left -= n;
  }
  // The entries tile the data section in offset order (the reader checked), so this reads the
  // rest of the file front to back.
  for (const SafetensorsEntry& e : reader->entries()) {
    const NamedParam& p = *by_name.at(e.name);
    for (int64_t done = 0; status.ok() && done < e.end - e.begin;) {
      const int64_t n = std::min(e.end - e.begin - done, kLoadChunkBytes);
      status = read_next(n);
      if (status.ok()) {
        status = add(p.offset + done / 4, reinterpret_cast<const float*>(buffer.data()), n / 4);
        if (!status.ok()) {
          status = absl::Status(
              status.code(), absl::StrCat(path, ": parameter '", p.name, "': ", status.message()));
        }
      }
      done += n;
    }
    if (!status.ok()) break;
  }
  close(fd);
  OFFLOAD_RETURN_IF_ERROR(status);
  if (crc != digest.crc32()) {
    return absl::DataLossError(absl::StrCat(
        path, " has CRC-32 ", absl::Hex(crc, absl::kZeroPad8), " but the manifest recorded ",
        absl::Hex(digest.crc32(), absl::kZeroPad8), ": the file was altered; nothing was loaded"));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t NamedParam::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status CheckNamedParams(const std::vector<NamedParam>& params, int64_t num_params) {
  std::set<std::string> names;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // (offset, end)
  for (size_t i = 0; i < params.size(); ++i) {
    const NamedParam& p = params[i];
    if (p.name.empty() || !names.insert(p.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", i, " has ", p.name.empty() ? "no name" : "a name given twice: ", p.name));
    }
    for (int64_t d : p.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter '", p.name, "' has shape ", Shape(p.shape)));
      }
    }
    const int64_t n = p.numel();
    if (p.offset < 0 || p.offset > num_params || n > num_params - p.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "' at [", p.offset, ", ", p.offset + n,
                       ") is outside the flat space of ", num_params, " parameters"));
    }
    ranges.push_back({p.offset, p.offset + n});
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameters overlap at flat element ", ranges[i].first));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SaveParamState(const std::string& root,
                                           const std::vector<NamedParam>& params,
                                           const ParamStateInfo& info, OptimizerBackend* backend,
                                           int keep) {
  OFFLOAD_RETURN_IF_ERROR(
      CheckNamedParams(params, static_cast<int64_t>(backend->partition().num_params())));
  if (keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("keep is ", keep, "; at least 1 checkpoint must stay"));
  }
  std::vector<const NamedParam*> order;  // the files' tensors in flat order
  for (const NamedParam& p : params) order.push_back(&p);
  std::sort(order.begin(), order.end(),
            [](const NamedParam* a, const NamedParam* b) { return a->offset < b->offset; });

  v1::ParamStateManifest m;
  m.set_format_version(kParamStateFormatVersion);
  m.set_step(info.counters.completed_step);
  m.set_adam_step(info.counters.adam_step);
  m.set_param_dtype(DTypeToProto(info.param_dtype));
  m.set_state_dtype(info.state_dtype);
  *m.mutable_loss_scale() = info.loss_scale;
  m.set_front_end(info.front_end);
  for (const NamedParam& p : params) {
    v1::StateParam* s = m.add_params();
    s->set_name(p.name);
    for (int64_t d : p.shape) s->add_shape(d);
  }
  OFFLOAD_ASSIGN_OR_RETURN(CheckpointStaging staging,
                           CheckpointStaging::Begin(root, info.counters.completed_step));
  std::vector<std::string> files;
  for (const StateTensorName& spec : kStateTensorNames) {
    const std::string file = absl::StrCat(spec.name, ".safetensors");
    std::vector<SafetensorsTensor> tensors;
    for (const NamedParam* p : order) {
      SafetensorsTensor t;
      t.name = p->name;
      t.dtype = TensorDType::kF32;
      t.shape = p->shape;
      // Straight from the servers into the file's buffer, a fill (16 MiB) at a time.
      t.fill = [backend, tensor = spec.tensor, first = p->offset](int64_t byte_offset,
                                                                  int64_t nbytes, void* out) {
        return backend->ReadRange(tensor, first + byte_offset / 4, nbytes / 4,
                                  static_cast<float*>(out));
      };
      tensors.push_back(std::move(t));
    }
    FileChecksum checksum;
    // "format": "pt" tells safetensors' readers these are torch tensors.
    OFFLOAD_RETURN_IF_ERROR(
        WriteSafetensors(staging.PathOf(file), tensors, {{"format", "pt"}}, &checksum));
    v1::StateFile* f = m.add_files();
    f->set_tensor(spec.tensor);
    f->set_file(file);
    f->mutable_digest()->set_bytes(static_cast<uint64_t>(checksum.bytes));
    f->mutable_digest()->set_crc32(checksum.crc32);
    files.push_back(file);
  }
  if (info.grad_sum != nullptr) {
    const std::string file = "grad_sum.safetensors";
    std::vector<SafetensorsTensor> tensors;
    for (const NamedParam* p : order) {
      SafetensorsTensor t;
      t.name = p->name;
      t.dtype = TensorDType::kF32;
      t.shape = p->shape;
      t.fill = [sum = info.grad_sum + p->offset](int64_t byte_offset, int64_t nbytes, void* out) {
        std::memcpy(out, reinterpret_cast<const char*>(sum) + byte_offset,
                    static_cast<size_t>(nbytes));
        return absl::OkStatus();
      };
      tensors.push_back(std::move(t));
    }
    FileChecksum checksum;
    OFFLOAD_RETURN_IF_ERROR(
        WriteSafetensors(staging.PathOf(file), tensors, {{"format", "pt"}}, &checksum));
    v1::StateFile* f = m.mutable_grad_sum();
    f->set_file(file);
    f->mutable_digest()->set_bytes(static_cast<uint64_t>(checksum.bytes));
    f->mutable_digest()->set_crc32(checksum.crc32);
    files.push_back(file);
  }
  return staging.Commit(MessageToJson(m), files, keep);
}

absl::StatusOr<std::string> FindParamState(const std::string& path) {
  struct stat st;
  if (stat(absl::StrCat(path, "/", kManifestFileName).c_str(), &st) == 0) return path;
  absl::StatusOr<std::string> latest = LatestCheckpointDir(path);
  if (absl::IsNotFound(latest.status())) {
    return absl::NotFoundError(absl::StrCat("no checkpoint at ", path, " (neither a ",
                                            kManifestFileName, " nor a ", kLatestFileName,
                                            " file)"));
  }
  return latest;
}

absl::StatusOr<v1::ParamStateManifest> ReadParamStateManifest(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kManifestFileName);
  OFFLOAD_ASSIGN_OR_RETURN(std::string json, ReadWholeFile(path));
  return ParseParamStateManifest(json, path);
}

absl::StatusOr<v1::ParamStateManifest> ParseParamStateManifest(absl::string_view json,
                                                               const std::string& path) {
  v1::ParamStateManifest m;
  if (absl::Status s = ParseJsonMessage(json, &m); !s.ok()) {
    return absl::DataLossError(absl::StrCat(path, ": ", s.message()));
  }
  if (m.format_version() != kParamStateFormatVersion) {
    return absl::DataLossError(absl::StrCat(path, ": format_version is ", m.format_version(),
                                            "; this build reads version ",
                                            kParamStateFormatVersion));
  }
  if (m.param_dtype() != v1::DTYPE_FP16 && m.param_dtype() != v1::DTYPE_BF16) {
    return absl::DataLossError(
        absl::StrCat(path, ": param_dtype is ", v1::DType_Name(m.param_dtype())));
  }
  if (m.adam_step() > m.step()) {
    return absl::DataLossError(
        absl::StrCat(path, ": adam_step ", m.adam_step(), " > step ", m.step()));
  }
  std::set<int> tensors;
  for (const v1::StateFile& f : m.files()) {
    if (absl::Status s = CheckFileName("files[].file", f.file()); !s.ok()) {
      return absl::DataLossError(absl::StrCat(path, ": ", s.message()));
    }
    if (!f.has_digest()) {
      return absl::DataLossError(absl::StrCat(path, ": ", f.file(), " has no digest"));
    }
    tensors.insert(f.tensor());
  }
  if (m.has_grad_sum()) {
    if (absl::Status s = CheckFileName("grad_sum.file", m.grad_sum().file()); !s.ok()) {
      return absl::DataLossError(absl::StrCat(path, ": ", s.message()));
    }
    if (!m.grad_sum().has_digest()) {
      return absl::DataLossError(absl::StrCat(path, ": ", m.grad_sum().file(), " has no digest"));
    }
  }
  if (m.files_size() != 3 ||
      tensors != std::set<int>{v1::STATE_TENSOR_MASTER_WEIGHTS, v1::STATE_TENSOR_EXP_AVG,
                               v1::STATE_TENSOR_EXP_AVG_SQ}) {
    return absl::DataLossError(
        absl::StrCat(path, ": files must name one file each of master, exp_avg and exp_avg_sq"));
  }
  return m;
}

absl::Status ReadParamGradSum(const std::string& dir, const std::vector<NamedParam>& params,
                              int64_t num_params, float* out) {
  OFFLOAD_RETURN_IF_ERROR(CheckNamedParams(params, num_params));
  OFFLOAD_ASSIGN_OR_RETURN(v1::ParamStateManifest m, ReadParamStateManifest(dir));
  OFFLOAD_RETURN_IF_ERROR(MatchParams(dir, m, params));
  if (!m.has_grad_sum()) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", dir, " holds no gradient sum: it was saved between steps"));
  }
  std::fill(out, out + num_params, 0.0f);
  return StreamStateFile(absl::StrCat(dir, "/", m.grad_sum().file()), m.grad_sum().digest(), params,
                         [out](int64_t offset, const float* values, int64_t n) {
                           std::memcpy(out + offset, values, static_cast<size_t>(n) * 4);
                           return absl::OkStatus();
                         });
}

absl::Status CheckParamState(const std::string& dir, const std::vector<NamedParam>& params) {
  OFFLOAD_ASSIGN_OR_RETURN(v1::ParamStateManifest m, ReadParamStateManifest(dir));
  return MatchParams(dir, m, params);
}

absl::StatusOr<v1::ParamStateManifest> LoadParamState(const std::string& dir,
                                                      const std::vector<NamedParam>& params,
                                                      DType param_dtype,
                                                      OptimizerBackend* backend) {
  const int64_t num_params = static_cast<int64_t>(backend->partition().num_params());
  OFFLOAD_RETURN_IF_ERROR(CheckNamedParams(params, num_params));
  OFFLOAD_ASSIGN_OR_RETURN(v1::ParamStateManifest m, ReadParamStateManifest(dir));
  OFFLOAD_RETURN_IF_ERROR(MatchParams(dir, m, params));
  if (m.param_dtype() != DTypeToProto(param_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint ", dir, " is of ", v1::DType_Name(m.param_dtype()),
                     " weights, this job's are ", DTypeName(param_dtype)));
  }

  const StepCounters counters{m.step(), m.adam_step()};
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<JobStateLoad> load,
                           JobStateLoad::Begin(backend, &counters));
  for (const v1::StateFile& f : m.files()) {
    OFFLOAD_RETURN_IF_ERROR(StreamStateFile(
        absl::StrCat(dir, "/", f.file()), f.digest(), params,
        [&load, tensor = f.tensor()](int64_t offset, const float* values, int64_t n) {
          return load->Add(tensor, offset, values, n);
        }));
  }
  // What no parameter covers starts from zero in every tensor (the padding: Finish's).
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const NamedParam& p : params) ranges.push_back({p.offset, p.offset + p.numel()});
  std::sort(ranges.begin(), ranges.end());
  int64_t next = 0;
  ranges.push_back({num_params, num_params});
  for (const auto& [lo, hi] : ranges) {
    if (lo > next) {
      for (const StateTensorName& spec : kStateTensorNames) {
        OFFLOAD_RETURN_IF_ERROR(load->AddZeros(spec.tensor, next, lo - next));
      }
    }
    next = std::max(next, hi);
  }
  OFFLOAD_RETURN_IF_ERROR(load->Finish());
  return m;
}

}  // namespace offload
