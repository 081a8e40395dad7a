"""``offload.torch.AdamW``: a torch optimizer whose state lives on Offload's optimizer servers.

A model needs no change. The optimizer takes the parameters' values (fp32, as most models are
built) as the fp32 master weights on the servers, and casts the parameters in place to a 16-bit
type (``dtype=``, bf16 by default): each becomes a view of one flat 16-bit buffer, laid out group
by group in parameter order. While backward runs, a hook on every parameter, run once autograd
has accumulated its gradient, puts it on its way to the servers and frees ``p.grad``.
``step()`` commits: the servers run Adam or AdamW in fp32 and return the 16-bit weights, which
land in the parameters in place.

``AdamW`` is the torch-facing face; the work is done by its parts, one module each:

- ``options``: ``OffloadOptions``, where the job runs (servers, TLS, transport, state tier).
- ``layout``: the flat layout of the parameters, the gradient buckets.
- ``native``: the C library (``optimizer_client/capi/offload_c.h``) and its errors.
- ``weights``: the 16-bit weights, their set-up from the fp32 values, ZeRO-3's host copies.
- ``gradients``: the gradient path from the hooks to the library, micro-batches, the update
  during backward (``grad_hooks``: the hooks, the staging ring, the reducer).
- ``commits``: the committed steps' counters and the delayed update.
- ``state``: ``state_dict``, checkpoints, the mid-accumulation resume.
- ``param_window``: ZeRO-3's device window.

Numerics live in the C++ library: the statistics of the gradients, the loss scale, the overflow
skip and the clipping multiplier are the C++ trainer's own step policy. This package only moves
tensors and calls the library.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch

from offload import clipping
from offload import job as _job
from offload import native
from offload import rendezvous as _rendezvous
from offload.commits import Commits
from offload.gradients import GradientPath
from offload.layout import FlatLayout, split_names
from offload.native import NativeOptimizer, OffloadError
from offload.options import OffloadOptions
from offload.param_window import ParamWindow
from offload.ranks import Ranks
from offload.server import LocalServer
from offload.state import OptimizerState
from offload.weights import Values, Weights

# On the pool, the script's torch.distributed.init_process_group("gloo") meets only its own
# attempt's ranks (offload/rendezvous.py).
_rendezvous.install()

__all__ = ["AdamW", "Adam", "OffloadError", "OffloadOptions", "materialize", "save_safetensors"]

_DTYPES = {torch.float16: native.FP16, torch.bfloat16: native.BF16}
# The installed torch's single-tensor Adam/AdamW, which the shards reproduce bit for bit: 2.0
# moved exp_avg with lerp_ (and bias_correction2 ** 0.5) where 1.x has mul_().add_().
_ADAM_FORM = (native.FORM_LERP if int(torch.__version__.split(".")[0]) >= 2
              else native.FORM_TORCH_1_13)


def _check_arguments(lr: float, betas: Tuple[float, float], eps: float, weight_decay: float,
                     amsgrad: bool, dtype: torch.dtype) -> None:
    if amsgrad:
        raise ValueError("amsgrad is not supported: the optimizer servers keep exp_avg and "
                         "exp_avg_sq only")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, not {dtype}")
    if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
        raise ValueError(f"invalid lr {lr}, eps {eps} or weight_decay {weight_decay}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"invalid betas {betas}")


def _check_stage(zero_stage: int, model: Any, blocks: Any, max_resident_bytes: int,
                 persist_elements: Optional[int]) -> None:
    if zero_stage not in (2, 3):
        raise ValueError(f"zero_stage must be 2 or 3, not {zero_stage}")
    if zero_stage == 3 and model is None:
        raise ValueError("zero_stage=3 needs model=: the parameters visit the device module "
                         "by module, through hooks on the model")
    if zero_stage == 2 and (model is not None or blocks is not None or max_resident_bytes):
        raise ValueError("model=, blocks= and max_resident_bytes= are zero_stage=3's")
    if persist_elements is not None and persist_elements < 0:
        raise ValueError(f"persist_elements is {persist_elements}")


def _check_overlap(delay_update: bool, delay_warmup_steps: int, update_in_backward: bool) -> None:
    if delay_warmup_steps < 0:
        raise ValueError(f"delay_warmup_steps is {delay_warmup_steps}; it must be >= 0")
    if update_in_backward and delay_update:
        raise ValueError("update_in_backward and delay_update both overlap the servers' "
                         "update with the model's compute (in this step's backward, or in "
                         "the next step): choose one")


def _release(opt: NativeOptimizer, owner: bool, server: Optional[LocalServer]) -> None:
    opt.close(drop_job=owner)
    if server is not None:
        server.close()


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with fp32 state on optimizer servers and 16-bit parameters.

    ``params`` as torch's, or with names (``model.named_parameters()``, alone or as groups'
    "params"): the names are the tensors' names in ``save_checkpoint``'s files.

    Args beyond torch's:
      dtype: torch.bfloat16 (default) or torch.float16; fp16 uses dynamic loss scaling: call
        ``optimizer.backward(loss)`` (or multiply the loss by ``optimizer.loss_scale``).
      options: where the job runs, an ``OffloadOptions`` (``offload.options``): servers (None
        starts a local ``cpu_optimizer_server`` child process, a list of "host:port" uses
        running servers, "inprocess" the same shard engine in this process), token, transport,
        threads, job_id, tls_ca, tls_cert, tls_key, tls_server_name, call_timeout,
        step_timeout_floor (a server silent inside a step for 10x its median step, and at least
        this many seconds, is hung), state_dir, optimizer_state ("auto", "memory" or "disk"),
        server_memory_mib, trace_file,
        optimizer_cores (cores for the local server alone; this process keeps to the others),
        state_dtype (torch.bfloat16: the servers keep the Adam moments in bf16, 8 bytes of
        state a parameter instead of 12), state_rounding ("stochastic" or "nearest") and
        server_priority (the local server's scheduling: "normal", or "idle": SCHED_IDLE, so an
        update overlapped with the model takes only the cycles torch leaves).
        Each is also a keyword here; one given both ways is refused.
      max_grad_norm: clip the global gradient norm every step (0: off);
        ``clip_grad_norm_`` sets it for one step.
      loss_scale, loss_scale_window: fp16's initial scale and growth window (GradScaler's).
      bucket_elements: gradients are handed to the sender in buckets of about this many elements.
      keep_grads: leave each 16-bit gradient in ``p.grad`` after backward, as plain torch does,
        for code that reads them: 2 bytes a parameter more on the parameters' device, held until
        ``zero_grad()``. By default ``p.grad`` is freed as soon as the gradient is on its way, so
        after backward every ``p.grad`` is None. The step uses the gradients sent either way:
        clip with ``max_grad_norm`` or ``clip_grad_norm_`` of this optimizer. With
        accumulation over several ``backward()`` calls, keep_grads must be False.
      process_group: torch.distributed group for several ranks (ZeRO-2); None: one rank.
      device: where the 16-bit weights live (default: the parameters' device). Each parameter
        is cast on the host, a chunk at a time, and copied there, so a model built in fp32 on
        the CPU trains on a GPU that could not hold it in fp32.
      delay_update: the delayed parameter update (the ZeRO-Offload paper's DPU): after
        ``delay_warmup_steps`` ordinary steps, ``step()`` returns as soon as the step is decided
        and its commit has left; the servers run Adam while the next forward (and backward, up
        to its first complete gradient) computes on the weights one update old, and the update
        lands in the parameters at the next ``step()``. Exactly one update behind, never
        anything between. fp16 overflow in a delayed step skips it, as in an ordinary one; the
        loss scale moves at once. ``state_dict()``, ``save_checkpoint()`` and ``flush()`` put
        the update in flight into the parameters, so a run resumed from them computes with the
        same weights as the run that saved. On the CPU the update waits in a second 16-bit
        copy (2 bytes a parameter of host memory); on a GPU in the pinned copy there is anyway.
      update_in_backward: the servers run Adam on each bucket as soon as backward has produced
        all of its gradients, so by the end of backward most of the update is done and
        ``step()`` waits for the tail. The step's decision is speculated (nothing skipped or
        clipped, the lrs the groups have when backward begins): each server writes the update
        into a staging copy (12 bytes a parameter of server memory) that the commit swaps in,
        and drops and redoes exactly what the decision changed (an fp16 overflow, clipping that
        bites, a changed lr, a second ``backward()``), so the weights are the same bits as
        without it, always. After
        a step it had to undo, it pauses for a few steps (1, 3, 7, ... up to 63 while undos
        repeat); with several micro-batches per step it stays off. Where a server cannot (no
        memory for the copy, state on disk) it updates at the commit as usual. ``last_report``'s
        ``early_updated`` and ``early_rolled_back`` count the elements. Not with
        ``delay_update``, which overlaps the same update with the next step instead.
      zero_stage: 2 (default): the 16-bit weights stay on ``device``; 3 (ZeRO-3, needs
        ``model``): they live in host memory (page-locked for a GPU; with several ranks each
        rank holds its partition) and visit the device a block at a time through hooks on
        ``model`` (``offload.param_window``): a block's parameters are copied there before its
        forward and again when backward needs them, then released; the blocks after it (in the
        last forward's order) are prefetched while they fit. The same bits as stage 2. Between
        uses the parameters are empty: outside the model's forward use ``gathered()``. The
        model may stay where it was built (the host) with ``device=`` the GPU: its buffers are
        moved there.
      model: the module whose forward uses the parameters (ZeRO-3).
      window: ZeRO-3: the most blocks on the device at once (2: one computing, one prefetched).
      max_resident_bytes: ZeRO-3: the most bytes of blocks and root set on the device (0: no
        limit but the window); below the root set plus the largest block it is refused.
      blocks: ZeRO-3: the modules fetched as units, as classes or a predicate (name, module);
        default: the children of the model's nn.ModuleList and nn.Sequential containers.
        Parameters outside every block stay on the device for the whole forward.
      persist_elements: ZeRO-3: parameters of at most this many elements stay on the device
        (default: 1-D ones of at most 65536, norms and biases).

    Gradient accumulation: any number of ``backward()`` calls per ``step()``. Each
    micro-batch's gradients leave during its backward (device memory stays a bucket); the servers
    add them in fp32, and the step (overflow skip, global norm, clipping) is decided on the sum,
    which is what the parameters' ``.grad`` would hold in fp32. As with torch, the sum is the
    gradient: divide the loss by the number of micro-batches for a mean. ``step()`` with no
    gradient since the last one does nothing, as torch's.

    Parameters with ``requires_grad=False`` when the optimizer is built are frozen: cast to
    ``dtype`` with the others, but never sent, stepped or changed, and the servers hold nothing
    for them; unfreezing one later is refused at ``step()`` (build a new optimizer). A trained
    parameter that gets no gradient in a step is skipped as torch skips it: its weights, moments
    and own step count (``state_dict()``'s per-parameter ``step``) stay.

    The fp32 values the parameters hold when the optimizer is built go to the servers in
    chunks as each parameter is cast; no fp32 copy of the model is made. For a model built on
    the meta device, see ``materialize``.
    """

    _kind = native.ADAMW
    # Staging slots of the CUDA ring: enough to keep copies in flight while older slots are
    # handed over, few enough that the page-locked memory stays small.
    _STAGING_SLOTS = 4
    # Whether a CPU model's gradients go through the staging ring too (the CUDA path's
    # bookkeeping with stand-in streams): for tests; a CPU gradient is copied straight into place.
    _stage_on_cpu = False
    # The way of hooking after accumulation (grad_hooks' names); None: this torch's newest.
    _hook_path: Optional[str] = None

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 dtype: torch.dtype = torch.bfloat16, options: Optional[OffloadOptions] = None,
                 servers: Any = None, token: Optional[str] = None, transport: str = "auto",
                 max_grad_norm: float = 0.0, loss_scale: float = 65536.0,
                 loss_scale_window: int = 2000, bucket_elements: int = 1 << 22, threads: int = 0,
                 keep_grads: bool = False, job_id: Optional[str] = None,
                 tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, tls_server_name: Optional[str] = None,
                 call_timeout: float = 600.0, step_timeout_floor: float = 60.0,
                 process_group: Any = None,
                 trace_file: Optional[str] = None, device: Any = None,
                 state_dir: Optional[str] = None, optimizer_state: str = "auto",
                 server_memory_mib: int = 0, delay_update: bool = False,
                 delay_warmup_steps: int = 20, update_in_backward: bool = False,
                 zero_stage: int = 2, model: Optional[torch.nn.Module] = None, window: int = 2,
                 max_resident_bytes: int = 0, persist_elements: Optional[int] = None,
                 blocks: Any = None, optimizer_cores: Optional[Sequence[int]] = None,
                 state_dtype: Optional[torch.dtype] = None, state_rounding: str = "stochastic",
                 server_priority: str = "normal", _values: Optional[Values] = None):
        _check_arguments(lr, betas, eps, weight_decay, amsgrad, dtype)
        options = (options or OffloadOptions()).with_keywords(dict(
            servers=servers, token=token, transport=transport, threads=threads, job_id=job_id,
            tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, tls_server_name=tls_server_name,
            call_timeout=call_timeout, step_timeout_floor=step_timeout_floor,
            state_dir=state_dir, optimizer_state=optimizer_state,
            server_memory_mib=server_memory_mib, trace_file=trace_file,
            optimizer_cores=optimizer_cores, state_dtype=state_dtype,
            state_rounding=state_rounding, server_priority=server_priority))
        _check_stage(zero_stage, model, blocks, max_resident_bytes, persist_elements)
        params, names = split_names(params)
        self._building = True
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, amsgrad=False))
        self._building = False
        _check_overlap(delay_update, delay_warmup_steps, update_in_backward)
        self.dtype, self.bucket_elements, self.zero_stage = dtype, int(bucket_elements), zero_stage
        self._max_grad_norm = float(max_grad_norm)
        self._step_max_norm: Optional[float] = None  # clip_grad_norm_'s, for the coming step
        self._lock = threading.RLock()
        self.options, process_group = options.in_this_job(process_group)
        self._ranks = Ranks(process_group)
        self._layout = FlatLayout(self.param_groups, names, device, _values is not None)
        self.num_params, self.device = self._layout.num_params, self._layout.device
        self._native, self.job_id, self._server = self.options.create_job(
            self._ranks, num_params=self.num_params, dtype=_DTYPES[dtype],
            groups=self._layout.groups(self.param_groups, self._kind), loss_scale=loss_scale,
            loss_scale_window=loss_scale_window, grad_clip=self._max_grad_norm,
            adam_form=_ADAM_FORM)
        self._finalizer = weakref.finalize(self, _release, self._native, self._ranks.rank == 0,
                                           self._server)
        self.padded_length = self._native.padded_length()
        self.transport = self._native.transport_names()
        self._weights = Weights(self._layout, self._native, self._ranks, dtype, zero_stage,
                                delay_update, persist_elements)
        self._commits = Commits(self._layout, self._native, self._weights, bool(delay_update),
                                int(delay_warmup_steps))
        try:
            self._weights.set_up(self.param_groups, _values)
            self._weights.same_on_every_rank(self.param_groups)
            self._grads = GradientPath(
                self._native, self._layout, self._ranks, self._weights, self._commits,
                self.param_groups, self._lock, self.bucket_elements, keep_grads,
                update_in_backward, self._hook_path, self._stage_on_cpu, self._STAGING_SLOTS)
            self._state = OptimizerState(type(self).__name__, dtype, self.param_groups,
                                         self._layout, self._native, self._ranks, self._weights,
                                         self._commits, self._grads, self._lock)
            if zero_stage == 3:
                self._weights.build_window(model, window, max_resident_bytes, blocks)
        except BaseException:
            self.close()  # no job left on the servers, no server left running
            raise
        self.keep_grads = self._grads.keep_grads
        # torch's (and accelerate's) clip_grad_norm_ answer for these parameters (clipping).
        self._trained_ids = frozenset(id(p) for p in self._layout.params)
        clipping.register(self)

    # ------------------------------------------------------------------------------ properties

    @property
    def completed_steps(self) -> int:
        """Steps committed on the servers since the job began (skipped ones included), restored
        by load_checkpoint: where a resumed training loop goes on from."""
        return self._commits.step

    @property
    def last_report(self) -> Optional[Dict[str, Any]]:
        """What the last step did (``OffloadStepReport``'s fields), None before the first."""
        return self._commits.last_report

    @property
    def alive(self) -> bool:
        """Whether the optimizer can still step (not closed)."""
        return self._finalizer.alive

    @property
    def world_size(self) -> int:
        """The ranks that train with this optimizer (its process group's size; 1 without)."""
        return self._ranks.world

    @property
    def skipped_steps(self) -> int:
        """Steps the servers skipped (fp16 overflow, a non-finite gradient) since the job
        began, restored by load_checkpoint."""
        return self._native.get_scaler()[2]

    @property
    def loss_scale(self) -> float:
        """The scale to multiply the next loss by (1 for bf16)."""
        return self._native.loss_scale()

    @property
    def param_window(self) -> Optional[ParamWindow]:
        """ZeRO-3's device window (its blocks, resident_bytes(), peak_resident_bytes), or None."""
        return self._weights.window

    def gathered(self) -> Any:
        """ZeRO-3: a context in which every parameter is on the device with its current values
        (evaluation or export outside the model's forward, ``model.state_dict()``). Stage 2: a
        context that does nothing."""
        return self._weights.gathered()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError("offload.torch optimizers cannot take parameter groups after "
                               "they are built: the job's groups are fixed on the servers")
        super().add_param_group(param_group)

    def close(self) -> None:
        """Drops the job on the servers (rank 0) and stops the local server, if any. The
        optimizer cannot be used afterwards."""
        if getattr(self, "_grads", None) is not None:
            self._grads.remove()
        if getattr(self, "_weights", None) is not None and self._weights.window is not None:
            self._weights.window.remove()
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()

    # ------------------------------------------------------------------------------ the step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; gradients already on their way in an unfinished step are dropped too
        (nothing is applied), so a failed backward can be retried."""
        with self._lock:
            if self._native.in_step():
                self._grads.abort()
        super().zero_grad(set_to_none=set_to_none)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """loss.backward() at the current loss scale (what fp16 needs; bf16's scale is 1)."""
        scale = self.loss_scale
        begin = time.monotonic()
        (loss * scale if scale != 1.0 else loss).backward(**kwargs)
        self._commits.trace("backward", begin)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for this optimizer's parameters: returns the global norm
        of this step's (unscaled) gradients and clips them by max_norm in the coming step()."""
        with self._lock:
            stats = self._grads.out()
            try:
                report = self._native.preview(stats, float(max_norm))
            except BaseException:
                self._grads.abort()
                raise
        self._step_max_norm = float(max_norm)
        return torch.tensor(report.grad_norm if not report.skipped else math.inf)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads, commits = self._grads, self._commits
        self._native.live()
        begin = time.monotonic()
        with self._lock:
            if not self._native.in_step() and grads.frozen_with_grad() is None:
                # No gradient since the last step: nothing to do, as torch.optim does nothing
                # for parameters without gradients (every rank must agree, as with DDP).
                return loss
            stats = grads.out()
            unused = grads.unused
            commits.set_range_steps(unused, grads.abort)
            lrs = self._layout.lrs(self.param_groups)
            max_norm = self._step_max_norm if self._step_max_norm is not None else -1.0
            delayed = commits.delayed_now()
            if delayed:
                # The update of the step before lands now, before this one leaves: the next
                # forward computes with it, one update behind the servers (the paper's DPU).
                commits.apply_pending()
            report, error = native.attempt(lambda: commits.commit(stats, lrs, max_norm, delayed))
            # Whatever happened, this step is over on both sides (a commit refused before it
            # reached the shards leaves the library's step open: it ends here, nothing applied).
            grads.abort()
            if error is None:
                self._step_max_norm = None
            self._ranks.agree(error, "committing the step")
            commits.in_flight = delayed
        commits.trace("step", begin)
        grads.after_step(report)
        commits.committed(report, unused, delayed)
        if _job.active():
            self._job_step()
        return loss

    def _job_step(self) -> None:
        """A torch job's step boundary (offload.job): the step count reported, and the
        controller's requests carried out by every rank at the same step, as gpu_trainer does:
        a checkpoint asked for is written to the job's directory; a pause or cancel writes one
        too, then ends the script with exit code 130 (stopped as asked)."""
        _job._optimizer_stepped(self._commits.step, float(self.last_report["loss_scale"]))
        what, wanted = self._ranks.from_rank0(list(_job.request()))
        wanted = int(wanted)
        stop = what in ("pause", "cancel")
        if (stop or wanted > _job.checkpoint_request_done()) and _job.checkpoint_dir():
            directory = self.save_checkpoint()
            _job._checkpointed(directory, self._commits.step, wanted)
        if stop:
            _job._flush()
            raise SystemExit(130)

    def flush(self) -> None:
        """With ``delay_update``: waits for the update in flight and puts it into the
        parameters now, so they hold every committed step (evaluation, export). Checkpoints and
        ``state_dict()`` do it themselves. Nothing to do otherwise."""
        with self._lock:
            self._native.live()
            self._commits.apply_pending()

    def write_trace(self) -> None:
        """Writes the trace_file now (it is written at close() too)."""
        self._native.write_trace()

    # ------------------------------------------------------------------------------ state

    def master_weights(self) -> torch.Tensor:
        """(num_params,) fp32 master weights, read from the servers (4 bytes a parameter), with
        every committed step (a delayed one included, whether or not the parameters have it)."""
        with self._lock:
            self._native.live()
            self._commits.wait()
        return self._state.read(native.MASTER, 0, self.num_params)

    def state_dict(self) -> Dict[str, Any]:
        """torch's layout (per-parameter ``exp_avg``, ``exp_avg_sq``, ``step``) plus each
        parameter's fp32 ``master`` and an ``offload`` entry (counters, loss scale).

        It costs what torch's own costs: the whole fp32 state, 12 bytes a parameter, read from
        the servers into this process (parameter by parameter, with no second copy). For a model
        whose state should not pass through the training process, use ``save_checkpoint``,
        which streams it to files 16 MiB at a time."""
        return self._state.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores what state_dict() returned: the servers' state, counters and loss scale, the
        groups' lrs, and the 16-bit weights (the master weights rounded). Everything is checked
        against this optimizer's parameters first, and the values as they stream to the servers,
        which apply them only when all were accepted: a refused state changes nothing."""
        self._state.load_state_dict(state_dict)

    def save_checkpoint(self, path: Optional[str] = None, model: Optional[torch.nn.Module] = None,
                        keep: int = 2) -> str:
        """Writes the servers' fp32 state (master weights, exp_avg, exp_avg_sq), the step
        counters, the loss scale and the parameter groups as a new checkpoint under ``path``
        (``path/step-<step>/``, and ``path/latest`` names it), keeping the ``keep`` newest.

        The state streams from the servers to safetensors files 16 MiB at a time, never whole
        in this process; files are written to a staging directory, fsynced, and published with
        one rename, so a crash (kill -9 included) or a full disk mid-save leaves the previous
        checkpoint whole. Tensors are named by parameter name (``model``'s, or the names the
        optimizer was built with, else ``param.<index>``), so the checkpoint loads onto any
        number of servers and ranks. ``master.safetensors`` is the fp32 model: see
        ``offload.checkpoint.load_into_torch`` to continue with plain torch. Every rank calls
        it (rank 0 writes). Returns the checkpoint's directory. In a torch job on the pool
        ``path`` defaults to the job's checkpoint directory (``$OFFLOAD_CHECKPOINT_DIR``)."""
        return self._state.save_checkpoint(path, model, keep)

    def load_checkpoint(self, path: Optional[str] = None,
                        model: Optional[torch.nn.Module] = None) -> Optional[str]:
        """Restores a checkpoint written by save_checkpoint: ``path`` is its directory or the
        root that holds ``latest``. The servers' state and counters, the loss scale, the groups'
        lrs and the 16-bit weights (the master weights rounded) come back as they were saved,
        onto however many servers and ranks this run has.

        It streams 4 MiB at a time, checking each file's size and CRC-32 on the way; the servers
        apply the load only when everything matched. A checkpoint of another model (a parameter
        missing, extra, or of another shape: the first is named), a file cut short or altered
        (named), or other fixed hyper-parameters are refused, and then nothing changes. Every
        rank calls it. Returns the checkpoint's directory.

        Without ``path``, the job's checkpoint directory in a torch job on the pool, and a
        directory that holds no checkpoint yet (the first attempt), or no job, returns None with
        nothing changed, so ``opt.load_checkpoint()`` at the start of a script resumes a restarted
        attempt where the last checkpoint left it (``opt.completed_steps``)."""
        return self._state.load_checkpoint(path, model)


class Adam(AdamW):
    """torch.optim.Adam (weight decay added to the gradient) on the optimizer servers."""

    _kind = native.ADAM

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 **kwargs: Any):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


def materialize(model: torch.nn.Module, params: Any = None, *,
                init: Optional[Callable[[torch.nn.Module], None]] = None,
                optimizer: Optional[type] = None, **kwargs: Any) -> AdamW:
    """An offload.torch optimizer for a model built on the meta device (``with
    torch.device("meta"):`` on torch 2.x, ``device="meta"`` to each module on torch 1.13),
    whose fp32 weights need not fit anywhere.

    Module by module, the parameters are allocated in fp32 on the CPU, initialized by the
    module's own ``reset_parameters()`` or ``init(module)`` (e.g. a Hugging Face model's
    ``model._init_weights``), streamed to the servers as master weights and cast into the
    optimizer's 16-bit buffer (on ``device=``, else the CPU); each module's fp32 copy is freed
    before the next. The model's meta parameters are replaced by the trained ones (tied weights
    stay tied). ``params`` is what the optimizer would take (default
    ``model.named_parameters()``: groups of the meta model's parameters work too), ``optimizer``
    the class (default AdamW), and ``kwargs`` its arguments. If an init fails, the error is
    raised and nothing is left on the servers. With ``zero_stage=3`` the model is the one whose
    modules the window hooks (``model=`` need not be given)."""
    from offload.materialize import MetaValues
    cls = optimizer or AdamW
    if kwargs.get("zero_stage") == 3:
        kwargs.setdefault("model", model)
    if params is None:
        params = list(model.named_parameters())
    device = kwargs.get("device")
    values = MetaValues(model, init, torch.device(device) if device is not None else None)
    return cls(params, _values=values, **kwargs)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}


def save_safetensors(model: torch.nn.Module, path: str) -> None:
    """Writes the model's state_dict (its 16-bit weights as trained) as a safetensors file, the
    format Hugging Face and gpu_trainer --init_from read. Written atomically: a temporary file,
    fsync, then a rename, so a crash leaves the old file or the new one. Tied tensors (one
    Parameter under two names) are written under each name."""
    tensors = {}
    for name, t in model.state_dict().items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name here")
        tensors[name] = t.detach().to("cpu").contiguous()
    header: Dict[str, Any] = {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name in sorted(tensors):
                t = tensors[name]
                # Through a same-size integer view: numpy has no bfloat16.
                view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
                f.write(t.view(view[t.element_size()]).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dirfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)
