#include "cpu_optimizer_server/shard/step_session.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/adam/adam_kernel_internal.h"
#include "cpu_optimizer_server/disk/state_pass.h"
#include "cpu_optimizer_server/shard/server_metrics.h"

namespace offload {

absl::StatusOr<std::unique_ptr<StepSession>> StepSession::Open(ShardStore* store,
                                                               const std::string& job_id,
                                                               uint32_t range_index,
                                                               uint64_t step) {
  OFFLOAD_ASSIGN_OR_RETURN(ShardStore::JobRange found, store->FindJobRange(job_id, range_index));
  std::shared_ptr<Job> job = std::move(found.job);
  RangeState* range = found.range;
  std::lock_guard<std::mutex> lock(range->mu);
  if (range->step_in_progress) {
    return absl::AbortedError(
        absl::StrCat("another step stream is open on range ", range_index, " of job ", job_id));
  }
  const bool replay = step != 0 && step == range->completed_step;
  if (step != range->completed_step + 1 && !replay) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is out of order: range ", range_index, " of job ", job_id,
                     " last committed step ", range->completed_step, ", so the next is ",
                     range->completed_step + 1));
  }
  if (range->loaded.covered() != range->spec.length) {
    return absl::FailedPreconditionError(absl::StrCat(
        "master weights of range ", range_index, " of job ", job_id, " are not loaded (",
        range->loaded.covered(), " of ", range->spec.length, " elements): call LoadState first"));
  }
  range->step_in_progress = true;
  return std::unique_ptr<StepSession>(new StepSession(store, std::move(job), range, step, replay));
}

StepSession::StepSession(ShardStore* store, std::shared_ptr<Job> job, RangeState* range,
                         uint64_t step, bool replay)
    : store_(store),
      job_(std::move(job)),
      range_(range),
      step_(step),
      replay_(replay),
      to_half_(internal::GetFloatToHalf(store->simd_path())) {}

StepSession::~StepSession() {
  std::lock_guard<std::mutex> lock(range_->mu);
  range_->step_in_progress = false;
}

absl::Status StepSession::ValidateChunk(int64_t offset, int64_t n, bool accumulate) const {
  const RangeSpec& spec = range_->spec;
  if (offset < spec.offset || offset >= spec.offset + spec.length ||
      n > spec.offset + spec.length - offset) {
    return absl::OutOfRangeError(absl::StrCat("gradient chunk [", offset, ", ", offset + n,
                                              ") is not inside range ", range_->index, " [",
                                              spec.offset, ", ", spec.offset + spec.length, ")"));
  }
  const int64_t begin = offset - spec.offset;
  if (!accumulate) {
    if (auto overlap = covered_.FindOverlap(begin, begin + n)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gradient chunk [", offset, ", ", offset + n,
          ") overlaps gradients already received for [", overlap->first + spec.offset, ", ",
          overlap->second + spec.offset, "); set accumulate to add micro-batches"));
    }
  }
  return absl::OkStatus();
}

absl::Status StepSession::AddGradients(int64_t offset, DType dtype, bool accumulate,
                                       std::string data) {
  if (committed_) return absl::FailedPreconditionError("gradient chunk after the commit");
  const int size = DTypeSize(dtype);
  if (data.empty()) return absl::InvalidArgumentError("gradient chunk has no data");
  if (data.size() % size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("gradient chunk has ", data.size(),
                                                   " bytes, not a multiple of ", size, " for ",
                                                   DTypeName(dtype)));
  }
  const int64_t n = static_cast<int64_t>(data.size()) / size;
  OFFLOAD_RETURN_IF_ERROR(ValidateChunk(offset, n, accumulate));
  const int64_t begin = offset - range_->spec.offset;
  if (replay_) return absl::OkStatus();  // validated; a replay applies nothing
  if (accumulate && !accumulating_) {
    OFFLOAD_RETURN_IF_ERROR(StartAccumulating());
  }
  Reservation held;
  if (!accumulating_) {
    absl::StatusOr<Reservation> taken =
        store_->budget()->Take(static_cast<int64_t>(data.size()), "gradients in flight");
    if (!taken.ok()) return taken.status();
    held = *std::move(taken);
  }
  // Nothing below can fail: only an accepted chunk counts as received.
  if (!non_finite_ && AnyNonFinite(data.data(), dtype, n)) {
    non_finite_ = true;
    first_non_finite_offset_ = offset;
  }
  covered_.Insert(begin, begin + n);
  if (accumulating_) {
    float* acc = range_->accumulator;
    const char* src = data.data();
    store_->ParallelTiles(begin, begin + n, [&](int64_t lo, int64_t hi) {
      AddAsFloat(src + (lo - begin) * size, dtype, hi - lo, acc + lo);
    });
    return absl::OkStatus();
  }
  held_bytes_.Absorb(std::move(held));
  pieces_.push_back(Piece{begin, n, dtype, std::move(data)});
  return absl::OkStatus();
}

bool StepSession::AnyNonFinite(const char* data, DType dtype, int64_t n) const {
  // On the store's pool: one thread scanning a 64 MiB chunk in place was a third of a step
  // through shared memory (bench_server), and the scan is bound by memory bandwidth, which one
  // core does not fill.
  std::atomic<bool> bad{false};
  const int size = DTypeSize(dtype);
  store_->ParallelTiles(0, n, [&](int64_t lo, int64_t hi) {
    if (!bad.load(std::memory_order_relaxed) && HasNonFinite(data + lo * size, dtype, hi - lo)) {
      bad.store(true, std::memory_order_relaxed);
    }
  });
  return bad.load(std::memory_order_relaxed);
}

absl::Status StepSession::AddGradientsView(int64_t offset, DType dtype, const void* data,
                                           int64_t n) {
  if (committed_) return absl::FailedPreconditionError("gradient chunk after the commit");
  if (n <= 0) return absl::InvalidArgumentError("gradient chunk has no data");
  OFFLOAD_RETURN_IF_ERROR(ValidateChunk(offset, n, /*accumulate=*/false));
  const int64_t begin = offset - range_->spec.offset;
  if (replay_) return absl::OkStatus();  // validated; a replay applies nothing
  // The caller holds the bytes (and accounts for them), so no reservation here.
  const char* src = static_cast<const char*>(data);
  if (!non_finite_ && AnyNonFinite(src, dtype, n)) {
    non_finite_ = true;
    first_non_finite_offset_ = offset;
  }
  covered_.Insert(begin, begin + n);
  if (accumulating_) {
    const int size = DTypeSize(dtype);
    float* acc = range_->accumulator;
    store_->ParallelTiles(begin, begin + n, [&](int64_t lo, int64_t hi) {
      AddAsFloat(src + (lo - begin) * size, dtype, hi - lo, acc + lo);
    });
    return absl::OkStatus();
  }
  Piece piece{begin, n, dtype, std::string()};
  piece.view = src;
  pieces_.push_back(std::move(piece));
  return absl::OkStatus();
}

// Switches this step to the fp32 accumulator: zero it, fold in the chunks held so far.
absl::Status StepSession::StartAccumulating() {
  RangeState* r = range_;
  const int64_t length = r->spec.length;
  // The early updates used the first micro-batch's gradients alone: the sum is another step.
  DropEarly();
  if (r->accumulator == nullptr) {
    const int64_t bytes = length * 4;
    absl::StatusOr<Reservation> reservation =
        store_->budget()->Take(bytes, absl::StrCat("the gradient accumulator of range ", r->index));
    if (!reservation.ok()) return reservation.status();
    OFFLOAD_ASSIGN_OR_RETURN(HostBuffer storage, HostBuffer::Allocate(bytes));
    std::lock_guard<std::mutex> tensors_lock(r->tensors_mu);
    std::lock_guard<std::mutex> lock(r->mu);  // DescribeShard reads these two under mu
    r->accumulator_storage = std::move(storage);
    r->accumulator = static_cast<float*>(r->accumulator_storage.data());
    r->accumulator_reservation = *std::move(reservation);
  }
  // The lease makes this stream the accumulator's only user until it ends.
  float* acc = r->accumulator;
  store_->ParallelTiles(0, length,
                        [acc](int64_t lo, int64_t hi) { std::memset(acc + lo, 0, (hi - lo) * 4); });
  for (const Piece& p : pieces_) AddAsFloat(p.bytes(), p.dtype, p.n, acc + p.begin);
  pieces_.clear();
  held_bytes_.Reset();
  accumulating_ = true;
  return absl::OkStatus();
}

void StepSession::Process(const std::vector<UpdateRun>& update, const int64_t base, int64_t hi,
                          uint16_t* out, const StateWave& state, const StateWave* staged) const {
  const RangeState* r = range_;
  const DType out_dtype = job_->config.param_dtype;
  const AdamKernelFn kernel = store_->adam_kernel();
  // Indexed by range element; the moments are fp32 or bf16 (JobConfig::state_dtype).
  const int msize = DTypeSize(r->state_dtype);
  auto at = [msize](void* moments, int64_t e) { return static_cast<char*>(moments) + e * msize; };
  float* const master = state.master - state.lo;
  void* const exp_avg = at(state.exp_avg, -state.lo);
  void* const exp_avg_sq = at(state.exp_avg_sq, -state.lo);
  // The 16-bit copy of master weights [b, e) of `from` only (a replay, a skipped range): the
  // SIMD conversion of the store's path, bit-identical to dtype.h's.
  auto convert_from = [&](const float* from, int64_t b, int64_t e) {
    if (out == nullptr) return;
    if (to_half_ != nullptr) {
      to_half_(from + b, out_dtype, out + (b - base), e - b);
    } else {
      ConvertFromFloat(from + b, e - b, out_dtype, out + (b - base));
    }
  };
  // Elements a range step leaves alone go into the staging copy as they are: it is swapped in.
  auto keep = [&](int64_t b, int64_t e) {
    if (staged != nullptr) {
      std::memcpy(staged->master + b, master + b, (e - b) * sizeof(float));
      std::memcpy(at(staged->exp_avg, b), at(exp_avg, b), (e - b) * msize);
      std::memcpy(at(staged->exp_avg_sq, b), at(exp_avg_sq, b), (e - b) * msize);
    }
    convert_from(master, b, e);
  };
  if (update.empty()) {
    convert_from(master, base, hi);
    return;
  }
  AdamSpan span;
  span.out_dtype = out_dtype;
  span.state_dtype = r->state_dtype;
  span.rounding = job_->config.state_rounding;
  // [b, e) is cut where a parameter group ends and where an update run (range_steps) ends:
  // each piece runs with its group's scalars for its run's t, or only converts where the run
  // is skipped. The update is elementwise, so the cuts change no bit (one group and no range
  // steps: one piece, as before either).
  auto run = [&](int64_t b, int64_t e, const void* grad, DType grad_dtype) {
    const int grad_size = DTypeSize(grad_dtype);
    auto g = std::upper_bound(r->group_pieces.begin(), r->group_pieces.end(), b,
                              [](int64_t pos, const RangeGroupPiece& p) { return pos < p.end; });
    auto u = std::upper_bound(update.begin(), update.end(), b,
                              [](int64_t pos, const UpdateRun& run) { return pos < run.end; });
    for (const int64_t first = b; b < e;) {
      const int64_t pe = std::min({e, g->end, u->end});
      if (u->staged) {
        convert_from(staged->master, b, pe);
      } else if (u->scalars == nullptr) {
        keep(b, pe);
      } else {
        span.grad = static_cast<const char*>(grad) + (b - first) * grad_size;
        span.grad_dtype = grad_dtype;
        if (staged == nullptr) {
          span.param = master + b;
          span.exp_avg = at(exp_avg, b);
          span.exp_avg_sq = at(exp_avg_sq, b);
        } else {
          span.param = staged->master + b;
          span.exp_avg = at(staged->exp_avg, b);
          span.exp_avg_sq = at(staged->exp_avg_sq, b);
          span.param_in = master + b;
          span.exp_avg_in = at(exp_avg, b);
          span.exp_avg_sq_in = at(exp_avg_sq, b);
        }
        // Rounding bits by step and flat element: an early update and a commit round alike.
        span.rounding_key = StochasticRoundingKey(u->t);
        span.first_element = r->spec.offset + b;
        span.out = out != nullptr ? out + (b - base) : nullptr;
        span.n = pe - b;
        kernel(u->scalars[g->group], span);
      }
      b = pe;
      if (b == g->end) ++g;
      if (b == u->end) ++u;
    }
  };
  if (accumulating_) {
    run(base, hi, r->accumulator + base, DType::kFp32);
    return;
  }
  // The pieces tile [base, hi) exactly (checked before the commit or the update gets here).
  int64_t lo = base;
  auto it = std::upper_bound(pieces_.begin(), pieces_.end(), lo,
                             [](int64_t pos, const Piece& p) { return pos < p.begin; });
  for (--it; lo < hi; ++it) {
    const int64_t e = std::min(hi, it->begin + it->n);
    run(lo, e, it->bytes() + (lo - it->begin) * DTypeSize(it->dtype), it->dtype);
    lo = e;
  }
}

absl::StatusOr<bool> StepSession::StreamWaves(const std::vector<UpdateRun>& update, ParamSink* sink,
                                              const StateWave* staged) {
  const RangeState* r = range_;
  const int64_t length = r->spec.length;
  const int64_t wave = store_->options().wave_elements;
  ThreadPool* pool = store_->pool();
  const int threads = pool->num_threads();
  std::sort(pieces_.begin(), pieces_.end(),
            [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  // Applies Adam (if asked) and writes the 16-bit copy for range elements [base, hi) into out,
  // with the state of those elements in `state` (the range's own views, or a disk wave's slot).
  auto process = [this, &update, staged](int64_t base, int64_t hi, uint16_t* out,
                                         const StateWave& state) {
    Process(update, base, hi, out, state, staged);
  };

  // A range on disk: each wave's state comes through the tier's ring (read ahead while the wave
  // before computes, written back while the wave after does).
  std::unique_ptr<StatePass> pass;
  if (r->file != nullptr) {
    pass = std::make_unique<StatePass>(store_->disk(), r->file.get(),
                                       /*write_back=*/!update.empty());
  }
  const StateWave in_memory{0, length, r->param, r->exp_avg, r->exp_avg_sq};

  bool sink_ok = true;
  absl::Status disk_status;
  const int64_t num_waves = (length + wave - 1) / wave;
  ThreadPool::Ticket pending;
  for (int64_t w = 0; w <= num_waves; ++w) {
    // Start wave w, then send wave w - 1 while it runs.
    ThreadPool::Ticket started;
    if (w < num_waves && disk_status.ok()) {
      const int64_t lo = w * wave, hi = std::min(length, lo + wave);
      StateWave state = in_memory;
      if (pass != nullptr) {
        absl::StatusOr<StateWave> acquired = pass->Acquire(w);
        if (acquired.ok()) {
          state = *acquired;
        } else {
          disk_status = acquired.status();
        }
      }
      if (disk_status.ok()) {
        auto* out = static_cast<uint16_t*>(sink->Buffer(w & 1, r->spec.offset + lo, hi - lo));
        started = pool->RunAsync([&process, lo, hi, out, threads, state](int t) {
          ForEachOwnedTile(lo, hi, t, threads,
                           [&](int64_t b, int64_t e) { process(b, e, out + (b - lo), state); });
        });
      }
    }
    if (w > 0) {
      pending.Wait();
      if (pass != nullptr && disk_status.ok()) disk_status = pass->Release(w - 1);
      // Nothing is sent once the disk failed: the receiver gets the error instead.
      if (sink_ok && disk_status.ok()) sink_ok = sink->Send((w - 1) & 1);
    }
    pending = std::move(started);
  }
  if (pass != nullptr) {
    absl::Status finished = pass->Finish();
    if (disk_status.ok()) disk_status = finished;
    ServerMetrics::Get().DiskPass(pass->stats().bytes_read, pass->stats().bytes_written,
                                  pass->stats().wait_seconds);
  }
  if (!disk_status.ok()) return disk_status;
  return sink_ok;
}

absl::Status StepSession::ValidateRangeSteps(const std::vector<RangeStep>& steps,
                                             const char* what) const {
  uint64_t adam_step;
  {
    std::lock_guard<std::mutex> lock(range_->mu);
    adam_step = range_->adam_step;
  }
  // A replay's update was counted already, so its bound is one looser; it applies nothing.
  const uint64_t max_t = adam_step + 1;
  int64_t prev_end = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const RangeStep& s = steps[i];
    if (s.offset < 0 || s.length <= 0 ||
        s.length > std::numeric_limits<int64_t>::max() - s.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ".range_steps[", i, "] has offset ", s.offset, " and length ",
                       s.length, "; a range step must be a non-empty range of the flat space"));
    }
    if (i > 0 && s.offset < prev_end) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ".range_steps[", i, "] starts at ", s.offset, ", before range_steps[", i - 1,
          "] ends at ", prev_end, ": range steps must be sorted by offset and not overlap"));
    }
    if (s.t > max_t) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ".range_steps[", i, "] [", s.offset, ", ", s.offset + s.length, ") has t ", s.t,
          " but range ", range_->index, " of job ", job_->config.job_id, " has applied ", adam_step,
          " updates, so no element's step can be past ", max_t));
    }
    prev_end = s.offset + s.length;
  }
  return absl::OkStatus();
}

absl::Status StepSession::ValidateArgs(const StepCommitArgs& args, const char* what) const {
  const std::vector<ParamGroupSpec>& groups = job_->config.groups;
  if (args.group_lr.empty()) {
    if (!std::isfinite(args.lr) || args.lr < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ".lr is ", args.lr, "; it must be finite and >= 0"));
    }
  } else {
    // With group_lr, `lr` is unused (StepCommit), so only these are checked.
    if (args.group_lr.size() != groups.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ".group_lr has ", args.group_lr.size(), " values but job ",
                       job_->config.job_id, " has ", groups.size(),
                       " parameter groups: send one per group, or none for ", what, ".lr"));
    }
    for (size_t i = 0; i < args.group_lr.size(); ++i) {
      if (!std::isfinite(args.group_lr[i]) || args.group_lr[i] < 0) {
        return absl::InvalidArgumentError(absl::StrCat(what, ".group_lr[", i, "] (parameter group ",
                                                       i, ") is ", args.group_lr[i],
                                                       "; it must be finite and >= 0"));
      }
    }
  }
  // 0 is refused too: it is what an omitted proto3 field reads as, and it would zero the
  // gradients while the moments and the step count still advance.
  if (!std::isfinite(args.grad_multiplier) || args.grad_multiplier <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ".grad_multiplier is ", args.grad_multiplier, "; it must be finite and > 0"));
  }
  return ValidateRangeSteps(args.range_steps, what);
}

std::vector<double> StepSession::GroupLrs(const StepCommitArgs& args) const {
  if (!args.group_lr.empty()) return args.group_lr;
  return std::vector<double>(job_->config.groups.size(), args.lr);
}

const AdamStepScalars* StepSession::ScalarSets::For(uint64_t t) {
  std::vector<AdamStepScalars>& scalars = by_t_[t];
  if (scalars.empty()) {
    scalars.reserve(groups_->size());
    for (size_t i = 0; i < groups_->size(); ++i) {
      scalars.push_back(ComputeAdamStepScalars((*groups_)[i].adam, group_lr_[i],
                                               static_cast<int64_t>(t), grad_multiplier_));
    }
  }
  return scalars.data();
}

// Neighbours with one t are one run: the commit and an early update then describe the same
// elements the same way, and a run's cut changes no bit (the update is elementwise).
void StepSession::AppendRun(std::vector<StepRun>* runs, int64_t end, uint64_t t) {
  if (!runs->empty() && runs->back().t == t) {
    runs->back().end = end;
  } else {
    runs->push_back(StepRun{end, t});
  }
}

std::vector<StepSession::StepRun> StepSession::ResolveSteps(
    const std::vector<RangeStep>& range_steps, uint64_t range_t) const {
  const RangeSpec& spec = range_->spec;
  std::vector<StepRun> runs;
  auto add = [&runs](int64_t end, uint64_t t) { AppendRun(&runs, end, t); };
  int64_t at = 0;
  for (const RangeStep& rs : ClipRangeSteps(range_steps, spec.offset, spec.offset + spec.length)) {
    const int64_t b = rs.offset - spec.offset;
    if (b > at) add(b, range_t);
    at = b + rs.length;
    add(at, rs.t);
  }
  if (at < spec.length) add(spec.length, range_t);
  return runs;
}

std::vector<StepSession::UpdateRun> StepSession::ToUpdateRuns(const std::vector<StepRun>& steps,
                                                              ScalarSets* scalars) {
  std::vector<UpdateRun> runs;
  runs.reserve(steps.size());
  for (const StepRun& s : steps) {
    const bool update = s.t != 0 && s.t != kStaged;
    runs.push_back(UpdateRun{s.end, update ? scalars->For(s.t) : nullptr, s.t == kStaged, s.t});
  }
  return runs;
}

bool StepSession::SameSteps(const EarlyUpdate& early, const std::vector<StepRun>& steps) {
  auto c = std::upper_bound(steps.begin(), steps.end(), early.begin,
                            [](int64_t pos, const StepRun& run) { return pos < run.end; });
  int64_t at = early.begin;
  for (const StepRun& mine : early.steps) {
    while (at < mine.end) {
      if (c == steps.end() || c->t != mine.t) return false;
      at = std::min(mine.end, c->end);
      if (at == c->end) ++c;
    }
  }
  return true;
}

std::vector<StepSession::StepRun> StepSession::ConvertOnly(
    const std::vector<StepRun>& steps, const std::vector<IntervalSet::Interval>& keep) {
  std::vector<StepRun> runs;
  auto add = [&runs](int64_t end, uint64_t t) { AppendRun(&runs, end, t); };
  auto step = steps.begin();
  int64_t at = 0;
  // Copies `steps` over [at, limit).
  auto copy_until = [&](int64_t limit) {
    while (at < limit) {
      while (step->end <= at) ++step;
      at = std::min(limit, step->end);
      add(at, step->t);
    }
  };
  for (const IntervalSet::Interval& k : keep) {
    copy_until(k.first);
    add(k.second, kStaged);
    at = k.second;
  }
  copy_until(steps.empty() ? 0 : steps.back().end);
  return runs;
}

void StepSession::DropEarly() {
  for (const EarlyUpdate& e : early_) rolled_back_ += e.n;
  early_.clear();
  early_covered_ = IntervalSet();
}

absl::StatusOr<bool> StepSession::UpdateEarly(const StepCommitArgs& args, int64_t offset,
                                              int64_t n) {
  if (committed_) {
    return absl::FailedPreconditionError("an update during backward after the commit");
  }
  if (args.step != step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("update.step is ", args.step, " but the stream opened step ", step_));
  }
  if (args.skip) {
    return absl::InvalidArgumentError(
        "an update during backward cannot skip: only the commit decides a skip");
  }
  OFFLOAD_RETURN_IF_ERROR(ValidateArgs(args, "update"));
  RangeState* r = range_;
  const RangeSpec& spec = r->spec;
  if (n <= 0 || offset < spec.offset || offset >= spec.offset + spec.length ||
      n > spec.offset + spec.length - offset) {
    return absl::OutOfRangeError(absl::StrCat("update during backward [", offset, ", ", offset + n,
                                              ") is not a non-empty part of range ", r->index, " [",
                                              spec.offset, ", ", spec.offset + spec.length, ")"));
  }
  // A replay applies nothing, so there is nothing to do early (and it keeps no gradients).
  if (replay_) return false;
  const int64_t begin = offset - spec.offset, end = begin + n;
  if (auto gap = covered_.FirstGap(begin, end)) {
    return absl::FailedPreconditionError(
        absl::StrCat("update during backward [", offset, ", ", offset + n, ") of range ", r->index,
                     ": no gradient for element ", *gap + spec.offset,
                     " yet; an update needs every gradient of its elements"));
  }
  if (auto overlap = early_covered_.FindOverlap(begin, end)) {
    return absl::InvalidArgumentError(
        absl::StrCat("update during backward [", offset, ", ", offset + n, ") overlaps [",
                     overlap->first + spec.offset, ", ", overlap->second + spec.offset,
                     "), updated during backward already in this step"));
  }
  // Declines: the commit updates these elements as usual. An accumulating step's sum is not
  // known before the commit; the disk tier streams the state wave by wave only at the commit; an
  // inf or NaN means the step is skipped.
  if (accumulating_ || non_finite_ || r->file != nullptr || job_->dropped) return false;
  std::vector<double> lrs = GroupLrs(args);
  // The commit keeps the early updates only if they all agree with it, so they share one set.
  if (!early_.empty() &&
      (lrs.size() != early_lr_.size() ||
       std::memcmp(lrs.data(), early_lr_.data(), lrs.size() * sizeof(double)) != 0 ||
       std::memcmp(&args.grad_multiplier, &early_multiplier_, sizeof(float)) != 0)) {
    return false;
  }
  if (r->staging_storage.data() == nullptr) {
    const int64_t bytes = r->storage_bytes();
    absl::StatusOr<Reservation> reservation = store_->budget()->Take(
        bytes, absl::StrCat("the staging copy of updates during backward of range ", r->index));
    if (!reservation.ok()) return false;
    absl::StatusOr<HostBuffer> storage = HostBuffer::Allocate(bytes);
    if (!storage.ok()) return false;
    std::lock_guard<std::mutex> tensors_lock(r->tensors_mu);
    std::lock_guard<std::mutex> lock(r->mu);  // DescribeShard reads the reservation under mu
    r->staging_storage = *std::move(storage);
    r->staging_reservation = *std::move(reservation);
  }

  std::lock_guard<std::mutex> tensors_lock(r->tensors_mu);
  if (!r->state_lost.empty()) return false;
  uint64_t range_t;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    range_t = r->adam_step + 1;
  }
  const std::vector<StepRun> steps = ResolveSteps(args.range_steps, range_t);
  EarlyUpdate early{begin, n, {}};
  // This update's part of the runs, cut at [begin, end).
  auto first = std::upper_bound(steps.begin(), steps.end(), begin,
                                [](int64_t pos, const StepRun& run) { return pos < run.end; });
  for (auto s = first; s != steps.end(); ++s) {
    early.steps.push_back(StepRun{std::min(s->end, end), s->t});
    if (s->end >= end) break;
  }
  ScalarSets scalars(&job_->config.groups, lrs, args.grad_multiplier);
  const std::vector<UpdateRun> runs = ToUpdateRuns(steps, &scalars);
  std::sort(pieces_.begin(), pieces_.end(),
            [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  // Into the staging copy, tile by tile as StreamWaves updates, without a 16-bit output: the
  // commit converts these elements from the same bits.
  const StateWave state{0, spec.length, r->param, r->exp_avg, r->exp_avg_sq};
  const StateWave staged{0, spec.length, r->staging_param(), r->staging_exp_avg(),
                         r->staging_exp_avg_sq()};
  store_->ParallelTiles(
      begin, end, [&](int64_t lo, int64_t hi) { Process(runs, lo, hi, nullptr, state, &staged); });
  if (early_.empty()) {
    early_lr_ = std::move(lrs);
    early_multiplier_ = args.grad_multiplier;
  }
  early_covered_.Insert(begin, end);
  early_.push_back(std::move(early));
  return true;
}

absl::StatusOr<StepOutcome> StepSession::Commit(const StepCommitArgs& args, ParamSink* sink) {
  if (committed_) return absl::FailedPreconditionError("the step was already committed");
  if (args.step != step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("commit.step is ", args.step, " but the stream opened step ", step_));
  }
  OFFLOAD_RETURN_IF_ERROR(ValidateArgs(args, "commit"));
  if (job_->dropped) {
    return absl::NotFoundError(absl::StrCat("job ", job_->config.job_id, " was dropped"));
  }
  RangeState* r = range_;
  const int64_t length = r->spec.length;
  StepOutcome outcome;
  outcome.step = step_;
  if (!replay_ && !args.skip) {
    if (auto gap = covered_.FirstGap(0, length)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no gradient for element ", *gap + r->spec.offset, " of range ", r->index, " [",
          r->spec.offset, ", ", r->spec.offset + length, "): a commit needs the whole range (",
          covered_.covered(), " of ", length, " elements received)"));
    }
    if (non_finite_) {
      return absl::InvalidArgumentError(
          absl::StrCat("the gradient chunk at element ", first_non_finite_offset_,
                       " holds inf or NaN: commit with skip set (overflow) instead"));
    }
  }
  committed_ = true;
  std::lock_guard<std::mutex> tensors_lock(r->tensors_mu);
  if (!r->state_lost.empty()) return absl::DataLossError(r->state_lost);
  if (replay_) {
    outcome.replayed = true;
    absl::StatusOr<bool> sent = StreamWaves({}, sink);
    if (!sent.ok()) return sent.status();  // a replay only reads: the state is unchanged
    outcome.receiver_gone = !*sent;
  } else if (args.skip) {
    DropEarly();
    outcome.skipped = true;
    ServerMetrics::Get().StepSkipped();
  } else {
    uint64_t t;
    {
      std::lock_guard<std::mutex> lock(r->mu);
      t = r->adam_step + 1;
    }
    // The range cut where range steps begin and end (validated, sorted; clipped to the range),
    // each run with the t it updates with.
    std::vector<StepRun> steps = ResolveSteps(args.range_steps, t);
    std::vector<double> lrs = GroupLrs(args);
    // An early update stands where this commit would compute what it computed (the same lrs,
    // multiplier and t): converted only, from the staging copy, into which every other element
    // is updated before the swap. One that does not stand never touched the state: dropped.
    const bool same_args =
        !early_.empty() &&
        std::memcmp(lrs.data(), early_lr_.data(), lrs.size() * sizeof(double)) == 0 &&
        std::memcmp(&args.grad_multiplier, &early_multiplier_, sizeof(float)) == 0;
    std::vector<IntervalSet::Interval> standing;
    for (const EarlyUpdate& e : early_) {
      if (same_args && SameSteps(e, steps)) {
        standing.emplace_back(e.begin, e.begin + e.n);
        outcome.early_updated += e.n;
      } else {
        rolled_back_ += e.n;
      }
    }
    early_.clear();
    early_covered_ = IntervalSet();
    std::optional<StateWave> staged;
    if (!standing.empty()) {
      std::sort(standing.begin(), standing.end());
      steps = ConvertOnly(steps, standing);
      staged =
          StateWave{0, length, r->staging_param(), r->staging_exp_avg(), r->staging_exp_avg_sq()};
    }
    ScalarSets scalars(&job_->config.groups, std::move(lrs), args.grad_multiplier);
    const std::vector<UpdateRun> runs = ToUpdateRuns(steps, &scalars);
    // Runs to the end even if the receiver leaves: a step is applied whole or not at all.
    const auto begin = std::chrono::steady_clock::now();
    absl::StatusOr<bool> sent = StreamWaves(runs, sink, staged ? &*staged : nullptr);
    // In memory (an early update declines on disk), so the pass cannot have failed part-way.
    if (staged && sent.ok()) r->SwapStaging();
    if (!sent.ok()) {
      // Some waves were written back and some not: the range is lost until a restore.
      r->state_lost =
          absl::StrCat("the optimizer state of range ", r->index, " of job ", job_->config.job_id,
                       " was lost when step ", step_, " failed part-way (", sent.status().message(),
                       "): restore it from a checkpoint");
      return absl::Status(sent.status().code(),
                          absl::StrCat("step ", step_, " of range ", r->index, " of job ",
                                       job_->config.job_id, " failed: ", sent.status().message(),
                                       "; the range's state is lost until restored from a "
                                       "checkpoint"));
    }
    outcome.receiver_gone = !*sent;
    outcome.applied = true;
    ServerMetrics::Get().StepApplied(
        length, std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  }
  outcome.early_rolled_back = rolled_back_;
  std::lock_guard<std::mutex> lock(r->mu);
  if (!replay_) {
    r->completed_step = step_;
    if (outcome.applied) ++r->adam_step;
  }
  outcome.adam_step = r->adam_step;
  outcome.skipped_steps = r->skipped_steps();
  pieces_.clear();
  held_bytes_.Reset();
  return outcome;
}

}  // namespace offload
