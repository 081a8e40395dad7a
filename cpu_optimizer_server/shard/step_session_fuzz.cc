// libFuzzer target: a stream of step-stream and load operations, decoded from the input, driven
// into StepSession and StateLoader against a real ShardStore. Every one of them arrives from a
// trainer over the wire (offload.v1.OptimizerShard), and the shard promises (step_session.h,
// state_loader.h) that a refused operation leaves the state exactly as it was: a trainer that
// sends a bad chunk retries from the same master weights, moments and step counters.
//
// After every operation the target reads the whole state back through ShardStore::ReadState and
// the ranges' counters, and hashes it per range: the fingerprint. It must be unchanged after any
// refused (non-OK) operation, and after every operation that is not allowed to touch the state
// even when it succeeds (open, gradient chunks, the parts of a load before Apply); abort()
// otherwise. An update during backward (UpdateEarly) does change its range before the commit:
// while a session holds one, its range may change only by another applied update, and once the
// session ends (closed, a second micro-batch, a commit) the range must be what it would be
// without any: the fingerprint from before the first, or the commit's (which may change it).
//
// Input: byte 0 configures the shard (memory headroom, SIMD path, 16-bit dtype, weight decay, two
// parameter groups cutting range 1 inside a tile, bf16 moments); then operations, each an opcode
// byte and its operands (missing bytes read as 0):
//   0 open        slot, range (0..2, 3: an index the job lacks), step delta (int8: 0 opens the
//                 range's next step, -1 its last one, a replay)
//   1 gradients   slot, flags (bit 0 accumulate, 1 view, 2-3 dtype, 4 a NaN/inf, 5 a ragged byte
//                 count, 6 offset from 0 instead of from the range), offset (int16), count (u16),
//                 seed
//   2 commit      slot, step delta (int8, from the opened step), lr choice, multiplier choice,
//                 flags (bit 0 skip, bits 1-2 the sink refusing after 0..2 sends or never, bits
//                 3-4 group lrs: none, one per group from the lr choices, one too many, a NaN,
//                 bit 5 range steps follow: count (u8 % 4 + 1), then per entry offset (int16,
//                 from the range's offset), length (u16 % 20000), t (u8 % 5)); an applied
//                 commit must leave every element of a t == 0 entry exactly as the step found
//                 it: as it was, or before the session's updates during backward
//   3 close       slot (the session ends without a commit)
//   4 load start  5 load chunk (tensor, flags: bits 0-1 the range the offset is from, the rest as
//                 for gradients; offset int16, count u16 % 512, seed)
//   6 load steps  (completed u8, adam u8)    7 load apply    8 load abandon
//   9 read        (tensor, dtype, offset int16, length u16, chunk u8): ReadState of any window
//  10 update      slot, offset (int16, from the range's offset), count (u16 % (length + 16)), t
//                 (u8 % 4: 0 the range's next), lr choice, multiplier choice, flags (bit 0 skip,
//                 bit 1 another step, bits 2-3 group lrs as a commit's): UpdateEarly
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "base/testing/fuzz_util.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/shard/state_loader.h"
#include "cpu_optimizer_server/shard/step_session.h"

namespace offload {
namespace {

constexpr char kJob[] = "fuzz-job";
// Range 1 spans two waves (a wave is at least one 16384-element tile); range 0 follows it
// directly, so chunks and reads can span both; range 2 sits after a gap of elements in no range.
const std::vector<RangeSpec> kRanges = {{16484, 300}, {0, 16484}, {17000, 100}};
constexpr int kMaxOps = 48;

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool done() const { return pos_ >= size_; }
  uint8_t U8() { return pos_ < size_ ? data_[pos_++] : 0; }
  int8_t I8() { return static_cast<int8_t>(U8()); }
  uint16_t U16() { return static_cast<uint16_t>(U8() | U8() << 8); }
  int16_t I16() { return static_cast<int16_t>(U16()); }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

void Fail(const std::string& what) { FuzzFail("step_session_fuzz", what); }

// FNV-1a over 8-byte words: fast enough to run after every operation.
struct Hasher {
  uint64_t h = 1469598103934665603ull;
  void Add(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, b + i, 8);
      h = (h ^ w) * 1099511628211ull;
    }
    for (; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  void Add(uint64_t v) { Add(&v, sizeof(v)); }
};

// The master weights, then both moments, of flat [offset, offset + length), in fp32.
std::string StateBytes(ShardStore& store, int64_t offset, int64_t length) {
  std::string bytes;
  for (StateTensor t :
       {StateTensor::kMasterWeights, StateTensor::kExpAvg, StateTensor::kExpAvgSq}) {
    absl::Status read = store.ReadState(kJob, t, DType::kFp32, offset, length, 0,
                                        [&](int64_t, int64_t, const std::string& b) {
                                          bytes += b;
                                          return true;
                                        });
    if (!read.ok()) Fail("cannot read the state back: " + read.ToString());
  }
  return bytes;
}

// Per range: master weights, both moments, step counters and loaded elements.
std::vector<uint64_t> Fingerprint(ShardStore& store) {
  std::vector<uint64_t> hashes;
  for (uint32_t i = 0; i < kRanges.size(); ++i) {
    Hasher hash;
    const std::string state = StateBytes(store, kRanges[i].offset, kRanges[i].length);
    hash.Add(state.data(), state.size());
    absl::StatusOr<ShardStore::JobRange> r = store.FindJobRange(kJob, i);
    if (!r.ok()) Fail("the job's range is gone: " + r.status().ToString());
    std::lock_guard<std::mutex> lock(r->range->mu);
    hash.Add(r->range->completed_step);
    hash.Add(r->range->adam_step);
    hash.Add(static_cast<uint64_t>(r->range->loaded.covered()));
    hashes.push_back(hash.h);
  }
  return hashes;
}

uint64_t CompletedStep(ShardStore& store, uint32_t range) {
  absl::StatusOr<ShardStore::JobRange> r = store.FindJobRange(kJob, range);
  if (!r.ok()) return 0;
  std::lock_guard<std::mutex> lock(r->range->mu);
  return r->range->completed_step;
}

// n values of `dtype` from a seed (small, varied, finite), one of them NaN or inf if `poison`,
// and a few stray bytes more if `ragged`.
std::string Values(int64_t n, DType dtype, uint8_t seed, bool poison, bool ragged) {
  std::vector<float> f(static_cast<size_t>(n));
  uint32_t x = seed * 2654435761u + 1;
  for (float& v : f) {
    x = x * 1664525u + 1013904223u;
    v = static_cast<float>(static_cast<int32_t>(x >> 8) - (1 << 23)) / (1 << 20);
  }
  if (poison && n > 0) {
    f[seed % n] = (seed & 1) != 0 ? std::numeric_limits<float>::quiet_NaN()
                                  : std::numeric_limits<float>::infinity();
  }
  std::string out(static_cast<size_t>(n) * DTypeSize(dtype), '\0');
  if (n > 0) ConvertFromFloat(f.data(), n, dtype, out.data());
  if (ragged) out.append(1 + seed % 3, '\x01');
  return out;
}

DType DTypeOf(uint8_t bits) {
  switch (bits & 3) {
    case 1:
      return DType::kFp16;
    case 2:
      return DType::kBf16;
    default:
      return DType::kFp32;
  }
}

float Choice(uint8_t b, std::initializer_list<float> choices) {
  return choices.begin()[b % choices.size()];
}

// Takes the streamed parameters and checks they stay inside the committed range.
class CheckingSink : public ParamSink {
 public:
  CheckingSink(RangeSpec range, int refuse_after) : range_(range), refuse_after_(refuse_after) {}
  void* Buffer(int slot, int64_t offset, int64_t n) override {
    if (slot < 0 || slot > 1 || n <= 0 || offset < range_.offset ||
        offset + n > range_.offset + range_.length) {
      Fail("the commit asked for a buffer outside its range");
    }
    buffers_[slot].assign(static_cast<size_t>(n), 0);
    return buffers_[slot].data();
  }
  bool Send(int slot) override { return refuse_after_ < 0 || sends_++ < refuse_after_; }

 private:
  const RangeSpec range_;
  const int refuse_after_;
  int sends_ = 0;
  std::vector<uint16_t> buffers_[2];
};

struct Slot {
  std::unique_ptr<StepSession> session;
  uint32_t range = 0;
  uint64_t step = 0;
  std::vector<std::unique_ptr<std::string>> views;  // AddGradientsView's bytes, until the end
  bool early = false;  // the session holds an applied update during backward
  // While `early`: the range's state from before the first of those updates (StateBytes), which
  // is what the commit starts from wherever it does not keep them.
  std::string unspeculated;
  void Close() {
    session.reset();  // first: the session may read the views until it ends
    views.clear();
    early = false;
    unspeculated.clear();
  }
};

// The lr choices of commits and updates.
float LrChoice(uint8_t b) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  return Choice(b, {1e-3f, 0.0f, 0.1f, -1e-3f, nan, inf, 1e30f});
}
float MultiplierChoice(uint8_t b) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  return Choice(b, {1.0f, 0.5f, 0.0f, -1.0f, nan, inf, 1e-30f});
}
// Group lrs as flags bits 0-1 say: none, one per group from the lr choices, one too many, a NaN.
std::vector<double> GroupLrChoice(uint8_t bits, uint8_t lr_choice, int groups) {
  std::vector<double> lrs;
  switch (bits & 3) {
    case 1:
      for (int g = 0; g < groups; ++g) {
        lrs.push_back(LrChoice(static_cast<uint8_t>(lr_choice >> (4 * g))));
      }
      break;
    case 2:
      lrs.assign(groups + 1, 1e-3f);
      break;
    case 3:
      lrs.assign(groups, 1e-3f);
      lrs.back() = std::numeric_limits<float>::quiet_NaN();
      break;
  }
  return lrs;
}

ThreadPool* Pool() {
  static ThreadPool* pool = new ThreadPool(ThreadPool::Options{2, false});
  return pool;
}

void Run(const uint8_t* data, size_t size) {
  Input in(data, size);
  const uint8_t config = in.U8();
  // The state, room for the initial load's chunks (held until it is applied), and headroom for
  // gradients in flight and accumulators: none, a little, one accumulator, plenty.
  const DType state_dtype = (config & 64) != 0 ? DType::kBf16 : DType::kFp32;
  int64_t state_bytes = 0, load_bytes = 0;
  for (const RangeSpec& r : kRanges) {
    state_bytes += StateBytesPerElement(state_dtype) * ((r.length + 15) / 16 * 16);
    load_bytes += r.length * 4;
  }
  ShardOptions options;
  const int64_t headroom[] = {0, 4096, 70000, int64_t{1} << 20};
  options.memory_limit_bytes = state_bytes + load_bytes + headroom[config & 3];
  options.wave_elements = kTileElements;
  const SimdPath path = (config & 4) != 0 ? BestSimdPath() : SimdPath::kScalar;
  ShardStore store(options, Pool(), path);

  JobConfig job;
  job.job_id = kJob;
  job.ranges = kRanges;
  job.param_dtype = (config & 8) != 0 ? DType::kBf16 : DType::kFp16;
  job.state_dtype = state_dtype;
  job.adam.lr = 1e-3f;
  job.adam.weight_decay = (config & 16) != 0 ? 0.1f : 0.0f;
  if ((config & 32) != 0) {
    // The second group starts inside range 1's first tile and runs past range 2.
    AdamHyperParams other = job.adam;
    other.beta1 = 0.8f;
    other.eps = 1e-6f;
    other.adamw = false;
    job.groups = {ParamGroupSpec{0, 9001, job.adam}, ParamGroupSpec{9001, 9000, other}};
  }
  if (absl::StatusOr<int64_t> created = store.CreateJob(job); !created.ok()) {
    Fail("cannot create the job: " + created.status().ToString());
  }
  // The initial master weights, as a trainer's first load sends them.
  {
    absl::StatusOr<std::unique_ptr<StateLoader>> loader = StateLoader::Start(&store, kJob);
    if (!loader.ok()) Fail(loader.status().ToString());
    for (const RangeSpec& r : kRanges) {
      absl::Status s = (*loader)->AddChunk(StateTensor::kMasterWeights, r.offset, DType::kFp32,
                                           Values(r.length, DType::kFp32, 7, false, false));
      if (!s.ok()) Fail("initial load: " + s.ToString());
    }
    if (absl::StatusOr<int64_t> applied = (*loader)->Apply(); !applied.ok()) {
      Fail("initial load: " + applied.status().ToString());
    }
  }

  Slot slots[2];
  std::unique_ptr<StateLoader> loader;
  // Per range: the state as it is without updates during backward, and as it is.
  std::vector<uint64_t> before = Fingerprint(store);
  std::vector<uint64_t> last = before;
  for (int op = 0; op < kMaxOps && !in.done(); ++op) {
    const uint8_t code = in.U8() % 11;
    absl::Status status;
    bool may_change = false;  // only a successful commit or load apply may change the state
    int updated_range = -1;   // the range an applied update during backward changed
    switch (code) {
      case 0: {  // open
        Slot& slot = slots[in.U8() & 1];
        const uint8_t range = in.U8() & 3;
        const int8_t delta = in.I8();
        const uint32_t index = range == 3 ? 0xffffffffu : range;
        const uint64_t step = CompletedStep(store, range == 3 ? 0 : range) + 1 + delta;
        absl::StatusOr<std::unique_ptr<StepSession>> session =
            StepSession::Open(&store, kJob, index, step);
        status = session.status();
        if (session.ok()) {
          slot.Close();
          slot.session = *std::move(session);
          slot.range = range;
          slot.step = step;
        }
        break;
      }
      case 1: {  // gradients
        Slot& slot = slots[in.U8() & 1];
        const uint8_t flags = in.U8();
        const int16_t rel = in.I16();
        const uint16_t count = in.U16();
        const uint8_t seed = in.U8();
        if (slot.session == nullptr) continue;
        const RangeSpec& r = kRanges[slot.range];
        const int64_t offset = ((flags & 64) != 0 ? 0 : r.offset) + rel;
        const int64_t n = count % (r.length + 16);
        const DType dtype = DTypeOf(flags >> 2);
        std::string bytes = Values(n, dtype, seed, (flags & 16) != 0, (flags & 32) != 0);
        if ((flags & 2) != 0) {
          slot.views.push_back(std::make_unique<std::string>(std::move(bytes)));
          status = slot.session->AddGradientsView(offset, dtype, slot.views.back()->data(), n);
        } else {
          status = slot.session->AddGradients(offset, dtype, (flags & 1) != 0, std::move(bytes));
          if ((flags & 1) != 0 && slot.early) {
            // A second micro-batch undoes the early updates. A refused one may or may not have
            // got that far, so the stream ends here, as a server ends it on a refused chunk.
            if (!status.ok()) slot.Close();
            slot.early = false;
          }
        }
        break;
      }
      case 2: {  // commit
        Slot& slot = slots[in.U8() & 1];
        StepCommitArgs args;
        args.step = slot.step + in.I8();
        const uint8_t lr_choice = in.U8();
        args.lr = LrChoice(lr_choice);
        args.grad_multiplier = MultiplierChoice(in.U8());
        const uint8_t flags = in.U8();
        args.skip = (flags & 1) != 0;
        const int groups = (config & 32) != 0 ? 2 : 1;
        args.group_lr = GroupLrChoice(flags >> 3, lr_choice, groups);
        struct RawRangeStep {
          int16_t offset;
          uint16_t length;
          uint8_t t;
        };
        std::vector<RawRangeStep> raw_steps;
        if ((flags & 32) != 0) {
          const int count = in.U8() % 4 + 1;
          for (int k = 0; k < count; ++k) {
            const int16_t offset = in.I16();
            const uint16_t length = in.U16();
            const uint8_t t = in.U8();
            raw_steps.push_back(RawRangeStep{offset, static_cast<uint16_t>(length % 20000),
                                             static_cast<uint8_t>(t % 5)});
          }
        }
        if (slot.session == nullptr) continue;
        const RangeSpec& range = kRanges[slot.range];
        for (const RawRangeStep& raw : raw_steps) {
          args.range_steps.push_back(RangeStep{range.offset + raw.offset, raw.length, raw.t});
        }
        // The state of the elements the range steps skip, inside the range: now, or (from_slot)
        // as the step found it, before any update during backward, which the commit undoes
        // where its steps skip.
        const std::vector<RangeStep> skipped =
            ClipRangeSteps(args.range_steps, range.offset, range.offset + range.length);
        auto skipped_state = [&](bool from_slot) {
          std::string bytes;
          for (const RangeStep& rs : skipped) {
            if (rs.t != 0) continue;
            if (!from_slot) {
              bytes += StateBytes(store, rs.offset, rs.length);
              continue;
            }
            for (int64_t t = 0; t < 3; ++t) {
              const int64_t at = t * range.length + (rs.offset - range.offset);
              bytes += slot.unspeculated.substr(static_cast<size_t>(at) * 4,
                                                static_cast<size_t>(rs.length) * 4);
            }
          }
          return bytes;
        };
        const std::string skipped_before = skipped_state(slot.early);
        CheckingSink sink(range, ((flags >> 1) & 3) == 3 ? -1 : (flags >> 1) & 3);
        absl::StatusOr<StepOutcome> outcome = slot.session->Commit(args, &sink);
        status = outcome.status();
        may_change = outcome.ok();
        if (outcome.ok() && skipped_state(false) != skipped_before) {
          Fail("an applied commit changed elements its range steps skip");
        }
        if (outcome.ok() && outcome->step != slot.step) Fail("the commit reports another step");
        if (outcome.ok()) slot.early = false;  // decided: kept or undone
        break;
      }
      case 3:  // close
        slots[in.U8() & 1].Close();
        break;
      case 4:  // load start
        if (loader == nullptr) {
          absl::StatusOr<std::unique_ptr<StateLoader>> started = StateLoader::Start(&store, kJob);
          status = started.status();
          if (started.ok()) loader = *std::move(started);
        }
        break;
      case 5: {  // load chunk
        const uint8_t tensor = in.U8() % 3;
        const uint8_t flags = in.U8();
        const int16_t offset = in.I16();
        const uint16_t count = in.U16();
        const uint8_t seed = in.U8();
        if (loader == nullptr) continue;
        const DType dtype = DTypeOf(flags >> 2);
        std::string bytes = Values(count % 512, dtype, seed, (flags & 16) != 0, (flags & 32) != 0);
        status =
            loader->AddChunk(static_cast<StateTensor>(tensor),
                             kRanges[(flags & 3) % 3].offset + offset, dtype, std::move(bytes));
        break;
      }
      case 6: {  // load steps
        const uint8_t completed = in.U8();
        const uint8_t adam = in.U8();
        if (loader == nullptr) continue;
        status = loader->SetSteps(completed, adam);
        break;
      }
      case 7:  // load apply
        if (loader != nullptr) {
          absl::StatusOr<int64_t> applied = loader->Apply();
          status = applied.status();
          may_change = applied.ok();
          loader.reset();
        }
        break;
      case 8:  // load abandon
        loader.reset();
        break;
      case 10: {  // update during backward
        Slot& slot = slots[in.U8() & 1];
        const int16_t rel = in.I16();
        const uint16_t count = in.U16();
        const uint8_t t = in.U8() % 4;
        const uint8_t lr_choice = in.U8();
        const uint8_t multiplier_choice = in.U8();
        const uint8_t flags = in.U8();
        if (slot.session == nullptr) continue;
        const RangeSpec& r = kRanges[slot.range];
        StepCommitArgs args;
        args.step = slot.step + ((flags & 2) != 0 ? 1 : 0);
        args.skip = (flags & 1) != 0;
        args.lr = LrChoice(lr_choice);
        args.grad_multiplier = MultiplierChoice(multiplier_choice);
        args.group_lr = GroupLrChoice(flags >> 2, lr_choice, (config & 32) != 0 ? 2 : 1);
        const int64_t offset = r.offset + rel;
        const int64_t n = count % (r.length + 16);
        if (t > 0) args.range_steps.push_back(RangeStep{offset, n, t});
        std::string unspeculated;
        if (!slot.early) unspeculated = StateBytes(store, r.offset, r.length);
        absl::StatusOr<bool> applied = slot.session->UpdateEarly(args, offset, n);
        status = applied.status();
        if (applied.ok() && *applied) {
          if (!slot.early) slot.unspeculated = std::move(unspeculated);
          slot.early = true;
          updated_range = static_cast<int>(slot.range);
        }
        break;
      }
      case 9: {  // read any window
        const uint8_t tensor = in.U8() % 3;
        const DType dtype = DTypeOf(in.U8());
        const int64_t offset = kRanges[0].offset + in.I16();
        const int64_t length = in.U16();
        const int64_t chunk = in.U8();
        status = store.ReadState(kJob, static_cast<StateTensor>(tensor), dtype, offset, length,
                                 chunk, [&](int64_t at, int64_t n, const std::string& bytes) {
                                   if (at < offset || n <= 0 || at + n > offset + length ||
                                       static_cast<int64_t>(bytes.size()) != n * DTypeSize(dtype)) {
                                     Fail("ReadState emitted outside the window it was asked for");
                                   }
                                   return true;
                                 });
        break;
      }
    }
    const std::vector<uint64_t> after = Fingerprint(store);
    for (size_t i = 0; i < kRanges.size(); ++i) {
      const bool speculating =
          (slots[0].session != nullptr && slots[0].early && slots[0].range == i) ||
          (slots[1].session != nullptr && slots[1].early && slots[1].range == i);
      if (speculating) {
        if (after[i] != last[i] && updated_range != static_cast<int>(i)) {
          Fail("operation " + std::to_string(op) + " (code " + std::to_string(code) +
               ") changed range " + std::to_string(i) + " while it was updated early");
        }
      } else {
        if (after[i] != before[i] && (!status.ok() || !may_change)) {
          Fail("operation " + std::to_string(op) + " (code " + std::to_string(code) +
               ") changed range " + std::to_string(i) + " though it " +
               (status.ok() ? std::string("may not") : "was refused: " + status.ToString()) +
               " (or an update during backward was not undone)");
        }
        before[i] = after[i];
      }
      last[i] = after[i];
    }
  }
  // Sessions end before the store, then loaders: what a closing connection does.
  slots[0].Close();
  slots[1].Close();
}

}  // namespace
}  // namespace offload

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  offload::Run(data, size);
  return 0;
}
