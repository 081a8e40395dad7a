#include "optimizer_client/checkpoint/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "optimizer_client/checkpoint/atomic_file.h"

namespace offload {

namespace {

// A header bigger than this is a corrupt length field, not a real checkpoint (GPT-2 XL's header
// is ~50 KB). The official implementation caps at 100 MB too.
constexpr int64_t kMaxHeaderBytes = 100'000'000;
// Producers fill at most this much at a time, bounding the writer's extra memory.
constexpr int64_t kFillChunkBytes = int64_t{16} << 20;
// Shapes and offsets arrive as JSON numbers (doubles): integers beyond 2^53 are not exact.
constexpr double kMaxExactInteger = 9007199254740992.0;

constexpr TensorDType kAllDTypes[] = {TensorDType::kF32, TensorDType::kF16, TensorDType::kBF16,
                                      TensorDType::kI32, TensorDType::kI64, TensorDType::kU16,
                                      TensorDType::kU8};

bool ParseDType(absl::string_view s, TensorDType* out) {
  for (TensorDType d : kAllDTypes) {
    if (TensorDTypeName(d) == s) {
      *out = d;
      return true;
    }
  }
  return false;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// numel * element size, or -1 when it exceeds `limit` (also guards against overflow).
int64_t ByteSize(absl::Span<const int64_t> shape, int elem_size, int64_t limit) {
  int64_t bytes = elem_size;
  for (int64_t d : shape) {
    if (d == 0) return 0;
    if (bytes > limit / d) return -1;
    bytes *= d;
  }
  return bytes <= limit ? bytes : -1;
}

absl::StatusOr<int64_t> JsonInteger(const google::protobuf::Value& v, absl::string_view what) {
  if (v.kind_case() != google::protobuf::Value::kNumberValue) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not a number"));
  }
  const double x = v.number_value();
  if (!(x >= 0) || x > kMaxExactInteger || std::floor(x) != x) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is ", x, "; expected a non-negative integer"));
  }
  return static_cast<int64_t>(x);
}

absl::StatusOr<std::vector<int64_t>> JsonIntegerList(const google::protobuf::Value& v,
                                                     absl::string_view what) {
  if (v.kind_case() != google::protobuf::Value::kListValue) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not a list"));
  }
  std::vector<int64_t> out;
  for (int i = 0; i < v.list_value().values_size(); ++i) {
    absl::StatusOr<int64_t> x =
        JsonInteger(v.list_value().values(i), absl::StrCat(what, "[", i, "]"));
    if (!x.ok()) return x.status();
    out.push_back(*x);
  }
  return out;
}

absl::StatusOr<SafetensorsEntry> ParseEntry(const std::string& name,
                                            const google::protobuf::Value& v, int64_t data_size) {
  if (v.kind_case() != google::protobuf::Value::kStructValue) {
    return absl::InvalidArgumentError("is not a JSON object");
  }
  const auto& fields = v.struct_value().fields();
  for (const auto& [key, unused] : fields) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return absl::InvalidArgumentError(
          absl::StrCat("has unknown key '", key, "' (expected dtype, shape, data_offsets)"));
    }
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!fields.count(key)) return absl::InvalidArgumentError(absl::StrCat("has no ", key));
  }
  SafetensorsEntry e;
  e.name = name;
  const google::protobuf::Value& dtype = fields.at("dtype");
  if (dtype.kind_case() != google::protobuf::Value::kStringValue) {
    return absl::InvalidArgumentError("dtype is not a string");
  }
  if (!ParseDType(dtype.string_value(), &e.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("has unsupported dtype '", dtype.string_value(),
                                                   "' (known: F32 F16 BF16 I32 I64 U16 U8)"));
  }
  absl::StatusOr<std::vector<int64_t>> shape = JsonIntegerList(fields.at("shape"), "shape");
  if (!shape.ok()) return shape.status();
  e.shape = *std::move(shape);
  absl::StatusOr<std::vector<int64_t>> offsets =
      JsonIntegerList(fields.at("data_offsets"), "data_offsets");
  if (!offsets.ok()) return offsets.status();
  if (offsets->size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_offsets has ", offsets->size(), " values; expected [begin, end]"));
  }
  e.begin = (*offsets)[0];
  e.end = (*offsets)[1];
  if (e.begin > e.end || e.end > data_size) {
    return absl::InvalidArgumentError(absl::StrCat("data_offsets [", e.begin, ", ", e.end,
                                                   "] are not inside the data section of ",
                                                   data_size, " bytes"));
  }
  const int64_t want =
      ByteSize(e.shape, TensorDTypeSize(e.dtype), std::numeric_limits<int64_t>::max());
  if (want < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", ShapeString(e.shape), " overflows a 64-bit byte count"));
  }
  if (want != e.end - e.begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data_offsets [", e.begin, ", ", e.end, "] span ", e.end - e.begin, " bytes but ",
        TensorDTypeName(e.dtype), " ", ShapeString(e.shape), " needs ", want));
  }
  return e;
}

void AppendJsonString(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned char>(c));
      out->append(buf);
    } else {
      out->push_back(c);  // UTF-8 passes through as the JSON spec allows
    }
  }
  out->push_back('"');
}

}  // namespace

int TensorDTypeSize(TensorDType d) {
  switch (d) {
    case TensorDType::kF32:
    case TensorDType::kI32:
      return 4;
    case TensorDType::kF16:
    case TensorDType::kBF16:
    case TensorDType::kU16:
      return 2;
    case TensorDType::kI64:
      return 8;
    case TensorDType::kU8:
      return 1;
  }
  return 0;
}

absl::string_view TensorDTypeName(TensorDType d) {
  switch (d) {
    case TensorDType::kF32:
      return "F32";
    case TensorDType::kF16:
      return "F16";
    case TensorDType::kBF16:
      return "BF16";
    case TensorDType::kI32:
      return "I32";
    case TensorDType::kI64:
      return "I64";
    case TensorDType::kU16:
      return "U16";
    case TensorDType::kU8:
      return "U8";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Reader

SafetensorsReader::~SafetensorsReader() {
  if (map_ != nullptr) munmap(const_cast<uint8_t*>(map_), static_cast<size_t>(map_size_));
}

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(
    const std::string& path) {
  std::unique_ptr<SafetensorsReader> r(new SafetensorsReader());
  r->path_ = path;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("cannot stat ", path));
  }
  const int64_t file_size = st.st_size;
  if (file_size < 8) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a safetensors file: ", file_size,
                     " bytes, shorter than the 8-byte header length"));
  }
  void* map = mmap(nullptr, static_cast<size_t>(file_size), PROT_READ, MAP_SHARED, fd, 0);
  const int map_err = errno;
  close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) return absl::ErrnoToStatus(map_err, absl::StrCat("cannot mmap ", path));
  r->map_ = static_cast<const uint8_t*>(map);
  r->map_size_ = file_size;

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | r->map_[i];  // little endian
  if (header_len > static_cast<uint64_t>(kMaxHeaderBytes) ||
      header_len > static_cast<uint64_t>(file_size - 8)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": header length ", header_len, " is not sane: the file has ", file_size - 8,
        " bytes after the length field and headers are capped at ", kMaxHeaderBytes));
  }
  const absl::string_view header(reinterpret_cast<const char*>(r->map_ + 8), header_len);
  r->data_ = r->map_ + 8 + header_len;
  const int64_t data_size = file_size - 8 - static_cast<int64_t>(header_len);

  // Struct only accepts a JSON object at the top, which is exactly the format's rule.
  google::protobuf::Struct root;
  google::protobuf::util::Status parsed = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(header.data(), header.size()), &root);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header is not a JSON object: ", std::string(parsed.message())));
  }
  for (const auto& [name, value] : root.fields()) {
    if (name == "__metadata__") {
      if (value.kind_case() != google::protobuf::Value::kStructValue) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": __metadata__ is not a JSON object"));
      }
      for (const auto& [key, v] : value.struct_value().fields()) {
        if (v.kind_case() != google::protobuf::Value::kStringValue) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": __metadata__ value of '", key,
                           "' is not a string (it must map strings to strings)"));
        }
        r->metadata_[key] = v.string_value();
      }
      continue;
    }
    absl::StatusOr<SafetensorsEntry> e = ParseEntry(name, value, data_size);
    if (!e.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", name, "' ", e.status().message()));
    }
    r->entries_.push_back(*std::move(e));
  }
  // The format requires the entries to tile the data section: no overlaps (two tensors sharing
  // bytes) and no holes (room for hidden content, a polyglot file).
  std::sort(r->entries_.begin(), r->entries_.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              // Name breaks ties between empty tensors, so the order never depends on hashing.
              return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
            });
  int64_t covered = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry& e : r->entries_) {
    if (e.begin < covered) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", e.name, "' data_offsets [", e.begin, ", ", e.end,
                       "] overlap tensor '", prev->name, "' [", prev->begin, ", ", prev->end, "]"));
    }
    if (e.begin > covered) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", e.name, "' starts at data byte ", e.begin,
                       " leaving a hole after byte ", covered, " that no tensor describes"));
    }
    covered = e.end;
    prev = &e;
  }
  if (covered != data_size) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": the tensors describe ", covered,
                                                   " bytes of data but the data section has ",
                                                   data_size));
  }
  for (size_t i = 0; i < r->entries_.size(); ++i) r->index_[r->entries_[i].name] = i;
  return r;
}

const SafetensorsEntry* SafetensorsReader::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

const void* SafetensorsReader::Data(const SafetensorsEntry& e) const { return data_ + e.begin; }

absl::Status SafetensorsReader::ReadAsFloat(absl::string_view name, absl::Span<const int64_t> shape,
                                            float* out) const {
  const SafetensorsEntry* e = Find(name);
  if (e == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", name, "'"));
  }
  if (!std::equal(e->shape.begin(), e->shape.end(), shape.begin(), shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '", name, "' has shape ",
                                                   ShapeString(e->shape), ", expected ",
                                                   ShapeString(shape)));
  }
  const uint8_t* src = static_cast<const uint8_t*>(Data(*e));
  const int64_t n = (e->end - e->begin) / TensorDTypeSize(e->dtype);
  switch (e->dtype) {
    case TensorDType::kF32:
      // An empty tensor's buffer may be null (an empty vector's data()), which memcpy may not get.
      if (n > 0) std::memcpy(out, src, static_cast<size_t>(n) * sizeof(float));
      return absl::OkStatus();
    case TensorDType::kF16:
    case TensorDType::kBF16: {
      const bool fp16 = e->dtype == TensorDType::kF16;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);  // a foreign file may leave the tensor unaligned
        out[i] = fp16 ? Fp16ToFloat(h) : Bf16ToFloat(h);
      }
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '", name, "' is ",
                                                     TensorDTypeName(e->dtype),
                                                     "; ReadAsFloat reads F32, F16 or BF16"));
  }
}

// ---------------------------------------------------------------------------------------------
// Writer

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensor>& tensors,
                              const std::map<std::string, std::string>& metadata,
                              FileChecksum* checksum) {
  // Validate everything and build the header before creating any file.
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) header += ",";
      first = false;
      AppendJsonString(key, &header);
      header += ":";
      AppendJsonString(value, &header);
    }
    header += "}";
  }
  std::set<absl::string_view> names;
  std::vector<int64_t> sizes;
  int64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": '", t.name, "' cannot name a tensor"));
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", t.name, "' is given twice"));
    }
    if ((t.data != nullptr) == static_cast<bool>(t.fill)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", t.name, "' needs exactly one of data and fill"));
    }
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": tensor '", t.name, "' has a negative dimension in ", ShapeString(t.shape)));
      }
    }
    const int64_t bytes =
        ByteSize(t.shape, TensorDTypeSize(t.dtype), std::numeric_limits<int64_t>::max() / 2);
    if (bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", t.name, "' of shape ",
                                                     ShapeString(t.shape), " is too large"));
    }
    if (header.size() > 1) header += ",";
    AppendJsonString(t.name, &header);
    absl::StrAppend(&header, ":{\"dtype\":\"", TensorDTypeName(t.dtype),
                    "\",\"shape\":", ShapeString(t.shape), ",\"data_offsets\":[", offset, ",",
                    offset + bytes, "]}");
    sizes.push_back(bytes);
    offset += bytes;
  }
  header += "}";
  // Padding to 8 bytes aligns the data section, so tensors whose offsets are multiples of their
  // element size (the usual case: whole 64-element blocks) can be used in place from an mmap.
  header.append((8 - header.size() % 8) % 8, ' ');

  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> w, AtomicFileWriter::Open(path));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t{header.size()} >> (8 * i));
  OFFLOAD_RETURN_IF_ERROR(w->Append(len, 8));
  OFFLOAD_RETURN_IF_ERROR(w->Append(header));
  std::vector<uint8_t> chunk;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsTensor& t = tensors[i];
    if (t.data != nullptr) {
      OFFLOAD_RETURN_IF_ERROR(w->Append(t.data, sizes[i]));
      continue;
    }
    chunk.resize(static_cast<size_t>(std::min(sizes[i], kFillChunkBytes)));
    for (int64_t done = 0; done < sizes[i];) {
      const int64_t n = std::min(sizes[i] - done, kFillChunkBytes);
      if (absl::Status s = t.fill(done, n, chunk.data()); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat(path, ": filling tensor '", t.name, "' bytes [",
                                                   done, ", ", done + n, "): ", s.message()));
      }
      OFFLOAD_RETURN_IF_ERROR(w->Append(chunk.data(), n));
      done += n;
    }
  }
  OFFLOAD_RETURN_IF_ERROR(w->Commit());
  if (checksum != nullptr) *checksum = FileChecksum{w->bytes_written(), w->crc32()};
  return absl::OkStatus();
}

}  // namespace offload
