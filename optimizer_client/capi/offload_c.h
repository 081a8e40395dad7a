/* The optimizer side of a trainer rank as plain C (ARCHITECTURE.md section 16): a job on optimizer
 * shards (or the same shard engine in this process), the steps of one rank's partition, the step
 * policy (loss scale, overflow skip, clipping: precision/step_policy.h) and the state for
 * checkpoints. Front ends in any language load `liboffload_c.so` and call only these functions:
 * there is no C++, Python or torch type in this header, so any Python and any torch build load the
 * same library (python/offload/native.py is the ctypes binding).
 *
 * Errors: every function that can fail returns 0 or an absl::StatusCode (3 INVALID_ARGUMENT, 5
 * NOT_FOUND, 9 FAILED_PRECONDITION, 14 UNAVAILABLE, 16 UNAUTHENTICATED, ...), and
 * offload_last_error() then holds the message on the calling thread. Nothing throws or aborts
 * across this boundary. A call that fails validation changes nothing.
 *
 * Threads: one optimizer is driven from one thread at a time, except offload_gradients_ready,
 * which may be called from any thread (autograd's) while a step is open.
 *
 * Flat space: the front end lays its parameters out back to back in one flat space of num_params
 * elements, padded to a multiple of 64 * world_size (ARCHITECTURE.md section 3), partitioned over
 * ranks and shards as the C++ trainer partitions it. Offsets and lengths count elements. */
#ifndef OFFLOAD_OPTIMIZER_CLIENT_CAPI_OFFLOAD_C_H_
#define OFFLOAD_OPTIMIZER_CLIENT_CAPI_OFFLOAD_C_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on any change of a struct below or of a function's meaning. */
#define OFFLOAD_C_ABI_VERSION 6

typedef struct OffloadOptimizer OffloadOptimizer;

enum { OFFLOAD_FP32 = 1, OFFLOAD_FP16 = 2, OFFLOAD_BF16 = 3 }; /* offload.v1.DType */
enum { OFFLOAD_ADAM = 1, OFFLOAD_ADAMW = 2 };                  /* offload.v1.OptimizerKind */
enum { OFFLOAD_FORM_TORCH_1_13 = 0, OFFLOAD_FORM_LERP = 1 };   /* offload.v1.AdamForm */
enum {
  OFFLOAD_MASTER = 1,
  OFFLOAD_EXP_AVG = 2,
  OFFLOAD_EXP_AVG_SQ = 3
}; /* offload.v1.StateTensor */
enum {
  OFFLOAD_TIER_AUTO = 0,
  OFFLOAD_TIER_MEMORY = 1,
  OFFLOAD_TIER_DISK = 2
};                                                                /* offload.v1.StateTier */
enum { OFFLOAD_ROUND_STOCHASTIC = 0, OFFLOAD_ROUND_NEAREST = 1 }; /* offload.v1.StateRounding */

/* A contiguous run [offset, offset + length) of the flat space with its own Adam
 * hyper-parameters (a torch parameter group). Groups are in offset order and cover
 * [0, num_params); the padding belongs to the last. */
typedef struct {
  uint64_t offset;
  uint64_t length;
  int32_t kind; /* OFFLOAD_ADAM or OFFLOAD_ADAMW */
  /* Doubles, as torch's Python floats: the update rounds its scalars from them as torch does. */
  double lr; /* the default; every step passes each group's lr */
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
} OffloadGroup;

typedef struct {
  int32_t abi_version; /* OFFLOAD_C_ABI_VERSION */
  const char* job_id;  /* [A-Za-z0-9._-]+ */
  uint64_t num_params;
  int32_t world_size; /* ranks; 1 without torch.distributed */
  int32_t rank;
  /* 1: this rank creates the job on every shard (rank 0), replacing one of the same id; 0: it
   * steps a job rank 0 created. */
  int32_t create_job;
  int32_t dtype; /* OFFLOAD_FP16 or OFFLOAD_BF16: the gradients sent and the weights returned */
  int32_t num_groups;
  const OffloadGroup* groups;
  /* Shards: host:port of each, in shard order. num_shards == 0: the shard engine in this process
   * (no server), with `threads` Adam threads (0: one per core). */
  int32_t num_shards;
  const char* const* shard_addresses;
  int32_t threads;
  const char* transport; /* "auto" (shm if the shard shares /dev/shm, else ucx, else grpc), "grpc",
                            "shm" or "ucx"; null: "auto" */
  const char* token;     /* bearer token for the shards; null or "": none */
  const char* tls_ca;    /* TLS to the shards when set; cert/key for mutual TLS */
  const char* tls_cert;
  const char* tls_key;
  const char* tls_server_name;
  double call_timeout_seconds; /* bound of every call to a shard; <= 0: 600 */
  /* Step policy (ARCHITECTURE.md section 1). Dynamic loss scaling applies to fp16 only. */
  float loss_scale_init;     /* <= 0: 65536 */
  int32_t loss_scale_window; /* clean steps before the scale doubles; <= 0: 2000 */
  float grad_clip;           /* max global norm; <= 0: off */
  /* A Chrome trace of every step's phases (the sender's spans, and what the front end records
   * with offload_trace_phase) written there by offload_write_trace and offload_destroy; null or
   * "": none. */
  const char* trace_file;
  /* Where the shards keep the job's fp32 state (CreateJobRequest.state_tier): OFFLOAD_TIER_AUTO
   * (in memory when it fits the server's --memory_limit_mib, else on its disk tier),
   * OFFLOAD_TIER_MEMORY or OFFLOAD_TIER_DISK (the server needs --state_dir). The in-process engine
   * has memory only. */
  int32_t state_tier;
  /* Which torch's single-tensor Adam/AdamW the update matches bit for bit: OFFLOAD_FORM_TORCH_1_13
   * (exp_avg.mul_().add_()) or OFFLOAD_FORM_LERP (torch 2.x, exp_avg.lerp_()). */
  int32_t adam_form;
  /* The Adam moments' storage on the shards (CreateJobRequest.state_dtype): 0 or OFFLOAD_FP32
   * (12 bytes of state a parameter), or OFFLOAD_BF16 (8: fp32 master, bf16 moments), stored with
   * state_rounding, OFFLOAD_ROUND_STOCHASTIC or OFFLOAD_ROUND_NEAREST, in memory or on the disk
   * tier. */
  int32_t state_dtype;
  int32_t state_rounding;
  /* Inside a step, a shard that has not answered within 10x its median step, and at least this
   * many seconds, is hung: the step fails naming it (never beyond call_timeout_seconds); <= 0:
   * 60. */
  double step_timeout_floor_seconds;
} OffloadConfig;

/* One parameter of the flat space, by name (checkpoints): numel = the product of shape. */
typedef struct {
  const char* name;
  uint64_t offset;
  int32_t ndim;
  const int64_t* shape;
} OffloadNamedTensor;

/* What one step did. */
typedef struct {
  uint64_t step;         /* the step committed (1-based) */
  int32_t skipped;       /* some gradient was inf or NaN: the weights were kept */
  float loss_scale;      /* the scale this step's gradients were computed with */
  float next_loss_scale; /* the scale for the next step */
  double grad_norm;      /* global norm of the unscaled gradient */
  float clip_coef;       /* min(1, max_norm / (grad_norm + 1e-6)), 1 when off or skipped */
  float grad_multiplier; /* what the shards multiplied every gradient by */
  uint64_t adam_step;    /* updates applied so far (the t of bias correction) */
  uint64_t skipped_steps;
  /* The update during backward (offload_speculate): elements of this rank's partition the
   * shards updated before the commit and kept, and those they dropped and updated again (or
   * skipped) at the commit because it decided otherwise. */
  uint64_t early_updated;
  uint64_t early_rolled_back;
} OffloadStepReport;

const char* offload_last_error(void);
int32_t offload_abi_version(void);

/* Connects to the shards (or builds the in-process engine) and, with create_job, creates the
 * job. On success *out owns everything; on failure *out is null. */
int32_t offload_create(const OffloadConfig* config, OffloadOptimizer** out);
/* Ends any open step (nothing applied) and frees everything; the job stays on the shards. */
void offload_destroy(OffloadOptimizer* opt);
/* Drops the job on every shard (rank 0, at the end). */
int32_t offload_drop_job(OffloadOptimizer* opt);

/* The flat space: padded length, and this rank's partition [offset, offset + length). */
uint64_t offload_padded_length(const OffloadOptimizer* opt);
uint64_t offload_partition_offset(const OffloadOptimizer* opt);
uint64_t offload_partition_length(const OffloadOptimizer* opt);
/* "shm", "grpc, shm", "inprocess": the data plane of each shard, duplicates folded. */
const char* offload_transport_names(const OffloadOptimizer* opt);

/* State (rank 0 loads for everyone), streamed in chunks so the caller never holds it:
 * offload_load_begin, then offload_load_chunk for ranges of the tensors (OFFLOAD_MASTER, ...)
 * inside [0, num_params) in any order and sizes, then offload_load_finish; the shards apply
 * nothing before it. with_counters: completed_step and adam_step set the shards' counters (else
 * they keep theirs). Elements of a tensor no chunk covers keep their values (a fresh start sends
 * master weights only: the moments stay zero); the padding after num_params loads as zeros by
 * itself. A chunk that is refused (a value not finite, a negative exp_avg_sq, a range outside the
 * parameters) ends the load with nothing applied, as offload_load_abort does. */
int32_t offload_load_begin(OffloadOptimizer* opt, int32_t with_counters, uint64_t completed_step,
                           uint64_t adam_step);
int32_t offload_load_chunk(OffloadOptimizer* opt, int32_t tensor, uint64_t offset, uint64_t n,
                           const float* values);
int32_t offload_load_finish(OffloadOptimizer* opt);
void offload_load_abort(OffloadOptimizer* opt);
/* (n,) fp32 of one state tensor (OFFLOAD_MASTER, ...) for flat [offset, offset + n) into out. */
int32_t offload_read_state(OffloadOptimizer* opt, int32_t tensor, uint64_t offset, uint64_t n,
                           float* out);
/* (n,) master weights of flat [offset, offset + n) rounded to the job's 16-bit type, as the
 * shards round the weights a step returns. */
int32_t offload_read_weights16(OffloadOptimizer* opt, uint64_t offset, uint64_t n, uint16_t* out);

/* Checkpoints of the shards' state by parameter name (optimizer_client/param_state/): rank 0 writes
 * <root>/step-<completed_step>/ {manifest.json, master.safetensors, exp_avg.safetensors,
 * exp_avg_sq.safetensors}, streamed from the shards, committed atomically, keeping the `keep`
 * newest; `front_end` (JSON, may be null) is kept in the manifest as it is. Saved while a step is
 * open (between two micro-batches; one rank only), it also holds grad_sum.safetensors, the
 * step's gradient sum so far (offload_read_gradient_sum's; 4 bytes a parameter of host memory
 * while it is written). The committed
 * directory is written to dir_out (dir_out_size bytes). The counters and the loss scale are the
 * caller's and the step policy's now. */
int32_t offload_save_checkpoint(OffloadOptimizer* opt, const char* root,
                                const OffloadNamedTensor* tensors, int32_t num_tensors,
                                uint64_t completed_step, uint64_t adam_step, const char* front_end,
                                int32_t keep, char* dir_out, uint64_t dir_out_size);
/* The gradient sum a checkpoint saved between two micro-batches holds, into out (num_params,):
 * each parameter's at its offset, zeros elsewhere (for offload_restore_gradient_sum). NOT_FOUND
 * when it has none (saved between steps); another model's checkpoint, or a file cut short or
 * altered, refused as offload_load_checkpoint refuses them. Needs no optimizer. */
int32_t offload_read_checkpoint_gradient_sum(const char* dir, const OffloadNamedTensor* tensors,
                                             int32_t num_tensors, uint64_t num_params, float* out);
/* The checkpoint directory `path` names (itself, or the one its `latest` file names) into dir_out;
 * NOT_FOUND when there is none. Needs no optimizer. */
int32_t offload_find_checkpoint(const char* path, char* dir_out, uint64_t dir_out_size);
/* INVALID_ARGUMENT naming the first parameter that differs when the checkpoint in `dir` is not of
 * these parameters (one missing, extra, or of another shape); reads only its manifest. Needs no
 * optimizer. */
int32_t offload_check_checkpoint(const char* dir, const OffloadNamedTensor* tensors,
                                 int32_t num_tensors);
/* Loads the checkpoint in `dir` onto the shards (rank 0), their counters too, streamed file by
 * file; every file's size and CRC-32 are checked on the way and the shards apply the load only
 * when all match. A checkpoint of another model (a parameter missing, extra, or of another shape)
 * is refused before anything streams, naming the first; a file cut short or altered is refused
 * naming it; in every refusal no shard changes. The loss scale and the front end's own record are
 * in <dir>/manifest.json for the caller to restore. */
int32_t offload_load_checkpoint(OffloadOptimizer* opt, const char* dir,
                                const OffloadNamedTensor* tensors, int32_t num_tensors);

/* The step policy's loss scale for the next step, and its state for checkpoints. */
float offload_loss_scale(const OffloadOptimizer* opt);
void offload_get_scaler(const OffloadOptimizer* opt, float* scale, uint32_t* clean_steps,
                        uint64_t* skipped_steps);
int32_t offload_set_scaler(OffloadOptimizer* opt, float scale, uint32_t clean_steps,
                           uint64_t skipped_steps); /* refused while a step is open */

/* One step: offload_begin_step, then for every element of this rank's partition exactly once
 * (from any thread) offload_gradient_buffer + writing the 16-bit gradients there +
 * offload_gradients_ready, or offload_send_gradients_f32; then offload_commit (or
 * offload_abort_step). */
int32_t offload_begin_step(OffloadOptimizer* opt, uint64_t step); /* step: 1-based */
int32_t offload_in_step(const OffloadOptimizer* opt);
/* Where to write the 16-bit gradients of flat [offset, offset + n) (inside this rank's
 * partition): the shard's shared-memory gradient area when the range lies in one slice on that
 * plane (no copy on the way to the shard), else the library's own buffer. Null (with an error)
 * outside a step or the partition. */
uint16_t* offload_gradient_buffer(OffloadOptimizer* opt, uint64_t offset, uint64_t n);
/* The gradients of [offset, offset + n), written at `where`, are final: queued for the sender
 * thread, which measures them (sum of squares, inf/NaN) and sends them. `where` is what
 * offload_gradient_buffer returned for this range, or for pieces of it that follow each other in
 * memory as in the flat space (null: offload_gradient_buffer(offset, n)); anything else is
 * refused, since the shard would read its place and not the caller's bytes. Returns at once;
 * send errors surface at offload_local_stats or offload_commit. */
int32_t offload_gradients_ready(OffloadOptimizer* opt, uint64_t offset, uint64_t n,
                                const uint16_t* where);
/* fp32 gradients (n,) of flat [offset, offset + n), multiplied by `scale` (1/W for a mean over
 * ranks) and rounded to the job's 16-bit type in one pass, then queued as above. */
int32_t offload_send_gradients_f32(OffloadOptimizer* opt, uint64_t offset, const float* grads,
                                   uint64_t n, float scale);
/* A run of the flat space and how the open step's commit updates it: t == 0 not at all (torch
 * skips a parameter without a gradient: weights, moments and its step count stay), t > 0 with the
 * bias correction of step t (a parameter's own step count, torch's state["step"] after this
 * update, where it missed updates before). */
typedef struct {
  uint64_t offset;
  uint64_t length;
  uint64_t t;
} OffloadRangeStep;

/* The open step's range steps (replacing an earlier call's in this step; ended with the step):
 * sorted by offset, not overlapping, non-empty, inside the padded flat space, t at most the open
 * step, else INVALID_ARGUMENT and nothing kept. Elements no range covers update as the job's
 * step count says. Every rank may pass the whole model's list: each commits its partition's
 * part. Ignored by a step that is skipped (overflow). */
int32_t offload_set_range_steps(OffloadOptimizer* opt, const OffloadRangeStep* ranges, int32_t n);
/* Gradient accumulation: ends the open step's current micro-batch (waits until its gradients are
 * sent) and starts the next, whose gradients are added to the earlier ones: the shards sum them in
 * fp32, in micro-batch order, and the step is decided (overflow, norm, clipping) on that sum, of
 * which the library keeps this rank's copy (4 bytes a parameter of the partition, host memory,
 * from the first step with a second micro-batch on). In every micro-batch each element is sent at
 * most once, and the ranges of one micro-batch are written only after the previous micro-batch
 * ended (offload_gradient_buffer then gives the library's buffer, never a shard's place). An
 * element no micro-batch sends must still be sent once (zeros) before the commit. The gradients
 * are summed as they are: a mean over micro-batches is the caller's (its loss divided by their
 * number, as in torch). */
int32_t offload_next_micro_batch(OffloadOptimizer* opt);
/* Gradient accumulation across a checkpoint. offload_read_gradient_sum: the fp32 sum of the open
 * step's micro-batches so far for flat [offset, offset + n) of this rank's partition into out
 * (n,), as the shards hold it (zeros where nothing was sent); waits until every gradient handed
 * over is sent. offload_restore_gradient_sum: into a step just opened (nothing handed over in
 * it yet), the whole partition's such sum, sums (partition_length,), which goes to the shards
 * as fp32 and becomes the earlier micro-batches: the step continues in accumulation (what is
 * handed over next is added), with every bit of the run that saved it. */
int32_t offload_read_gradient_sum(OffloadOptimizer* opt, uint64_t offset, uint64_t n, float* out);
int32_t offload_restore_gradient_sum(OffloadOptimizer* opt, const float* sums);
/* The update during backward (ARCHITECTURE.md section 16): the open step speculates that its
 * commit will carry these group lrs (num_groups of them, one per group), these range steps
 * (ranges, n: as offload_set_range_steps's, for every parameter that gets a gradient) and the
 * gradient multiplier of a step with nothing clipped and nothing skipped (1 / the loss scale).
 * From then on offload_update_ready lets the shards run Adam on a range as soon as its gradients
 * are all out. A shard keeps what it overwrote (12 bytes an element of its range, its host memory,
 * allocated at its first update during backward and kept) and at the commit keeps each early update
 * the commit agrees with and restores the others exactly: skipped on overflow, clipped, another lr
 * or range step, or a second micro-batch. So the weights are the same bits as without speculation
 * in every case; only the time differs. A shard that cannot (no memory for the copy, state on disk,
 * a data plane without it: gRPC and UCX today) declines and updates those elements at the commit.
 * Only in the first micro-batch; ends with the step or offload_next_micro_batch. */
int32_t offload_speculate(OffloadOptimizer* opt, const double* group_lr, int32_t num_groups,
                          const OffloadRangeStep* ranges, int32_t n);
/* Flat [offset, offset + n) inside [0, padded_length): the gradients of every element of it in
 * this rank's partition were handed over in this micro-batch (offload_gradients_ready,
 * offload_send_gradients_f32), and none will follow before the commit. Queued behind them for an
 * update with offload_speculate's arguments; the part outside the partition is ignored, as are
 * elements a range step skips (t == 0). Ignored (0) when the step does not speculate. */
int32_t offload_update_ready(OffloadOptimizer* opt, uint64_t offset, uint64_t n);
/* Waits until every queued gradient is sent; out[0] = sum of squares, out[1] = 1 if any was inf
 * or NaN, over this rank's gradients (still multiplied by the loss scale). W > 1: sum them over
 * ranks and pass the sums to offload_commit. A send that failed ends the step (nothing applied)
 * and its error is returned, here or from offload_preview / offload_commit. */
int32_t offload_local_stats(OffloadOptimizer* opt, double out[2]);
/* Decides the step by the policy from `global_stats` (null: this rank's own), with max_grad_norm
 * (< 0: the config's grad_clip) and one lr per group (group_lr, num_groups of them), commits it
 * on this rank's slices and writes the updated 16-bit weights of this rank's partition into
 * params16 + partition_offset (params16 is (padded_length,), only the partition is written;
 * nothing on a skipped step). */
int32_t offload_commit(OffloadOptimizer* opt, const double* global_stats, const double* group_lr,
                       int32_t num_groups, float max_grad_norm, uint16_t* params16,
                       OffloadStepReport* report);
void offload_abort_step(OffloadOptimizer* opt);
/* The delayed parameter update: as offload_commit, but only the decision happens now (every
 * gradient sent, the skip, the clip and the loss scale of the next step, in *report with the
 * step's number; adam_step and skipped_steps are 0 there); a thread of the library then commits
 * on the shards and writes the updated 16-bit weights of the partition into params16 +
 * partition_offset, which must stay valid and unread until offload_wait_commit. Until then no
 * other call may reach the shards: offload_begin_step, loads, reads, checkpoints and
 * offload_set_scaler are refused (FAILED_PRECONDITION); offload_destroy and offload_drop_job wait
 * for it. */
int32_t offload_commit_async(OffloadOptimizer* opt, const double* global_stats,
                             const double* group_lr, int32_t num_groups, float max_grad_norm,
                             uint16_t* params16, OffloadStepReport* report);
/* Waits for the commit offload_commit_async started; report (may be null) as offload_commit's.
 * The commit's error, if it failed (then the shards applied nothing). */
int32_t offload_wait_commit(OffloadOptimizer* opt, OffloadStepReport* report);
/* Adds a span [begin, end) of the caller's (seconds of CLOCK_MONOTONIC: Python's
 * time.monotonic()) to the trace, e.g. "backward"; nothing without a trace_file. */
void offload_trace_phase(OffloadOptimizer* opt, const char* name, uint64_t step, double begin,
                         double end);
int32_t offload_write_trace(OffloadOptimizer* opt);
/* What offload_commit would decide from the same arguments (the global norm, the clip
 * coefficient, the skip), without committing or changing anything: clip_grad_norm_'s answer. */
int32_t offload_preview(OffloadOptimizer* opt, const double* global_stats, float max_grad_norm,
                        OffloadStepReport* report);

/* The structs above as this library was compiled, for front ends that mirror them (ctypes, cffi)
 * to check their copy at load: for each struct in declaration order (OffloadGroup, OffloadConfig,
 * OffloadNamedTensor, OffloadStepReport, OffloadRangeStep, OffloadFieldLayout), a row for the
 * struct as a whole (field null, offset 0, size its sizeof), then one per field in declaration
 * order; a row whose struct_name is null ends the table. Static: never freed. */
typedef struct {
  const char* struct_name;
  const char* field; /* null: the struct as a whole */
  uint64_t offset;
  uint64_t size;
} OffloadFieldLayout;
const OffloadFieldLayout* offload_abi_layout(void);

/* Gradient buckets as the C++ trainer plans them (model_spec/gradient_buckets.h): n members of
 * sizes[i] elements, in the order they are grouped, go into buckets of consecutive members,
 * greedily; a bucket closes once it holds at least bucket_elements, the last may hold fewer, and
 * a member is never split (bucket_elements 1: each member of at least one element alone).
 * bucket_of (n,) gets each member's bucket: 0, 1, ... in order. INVALID_ARGUMENT for a null
 * array, n < 0, bucket_elements 0 or sizes that add up past 2^63 - 1. Needs no optimizer. */
int32_t offload_plan_buckets(const uint64_t* sizes, int32_t n, uint64_t bucket_elements,
                             int32_t* bucket_of);

#ifdef __cplusplus
}
#endif

#endif /* OFFLOAD_OPTIMIZER_CLIENT_CAPI_OFFLOAD_C_H_ */
